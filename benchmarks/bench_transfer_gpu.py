"""GPU benchmark of the KV transfer path (run on a CUDA machine; H200 figures in
``benchmarks/results/transfer_gpu.json``).

Shape: Llama-3-8B paged KV cache, 32 layers, 8 KV heads, head dim 128, bf16, 16-token blocks,
FlashAttention layout per layer ``[2, num_blocks, 16, 8, 128]`` (views ``kv.unbind(0)``), 2,112
blocks; 2,000 blocks are moved (2 MiB each over all layers, 4,000 MiB in all), in a random order.

First checks Triton gather/scatter against the reference bit for bit on the GPU, then times, in
one run:

(a) dump: Triton gather into a device staging chunk + one D2H copy per chunk into a pinned host
    slab, double-buffered on two streams (the gather of chunk k+1 overlaps the copy of chunk k);
(b) load: H2D copy per chunk into device staging + Triton scatter, double-buffered likewise;
(c) naive baseline: one ``copy_`` per block per layer per K/V between the cache and the slab;
(d) the ceiling: one 4,000 MiB pinned D2H copy and one H2D copy of the same bytes;
(e) dump/load through ucm's memory tier (``open_store(..., store__pipeline="memory")``):
    chunked Triton gather + ``store.dump`` / ``store.load`` + Triton scatter.

Every timed path is checked afterwards (host slab or destination cache equal to the reference).
Prints one JSON line and a table; ``--json PATH`` also writes the JSON.

    python benchmarks/bench_transfer_gpu.py --json benchmarks/results/transfer_gpu.json

Without CUDA, pytest collects :func:`test_smoke` (skipped) and nothing else.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
import traceback

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import ucm  # noqa: E402
from ucm.layout import KVLayout  # noqa: E402

LAYERS, HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16
NUM_BLOCKS, MOVE = 2112, 2000
GB = 1e9


def build_cache(torch, num_blocks, layers, device, seed=None):
    """Per-layer FA tensors [2, B, 16, 8, 128] bf16 (random bytes, or zeros without a seed)."""
    kvs = []
    gen = torch.Generator(device=device)
    for layer in range(layers):
        kv = torch.empty(2, num_blocks, BLOCK_SIZE, HEADS, HEAD_DIM, dtype=torch.bfloat16, device=device)
        if seed is None:
            kv.zero_()
        else:
            gen.manual_seed(seed * 1000 + layer)
            kv.view(torch.uint8).random_(0, 256, generator=gen)
        kvs.append(kv)
    views = [v for kv in kvs for v in kv.unbind(0)]
    layer_of_view = [l for l in range(layers) for _ in range(2)]
    return kvs, KVLayout.from_views(views, layer_of_view)


def pinned_slab(torch, nbytes):
    """A page-locked host buffer of exactly nbytes (aligned allocation + cudaHostRegister, not
    pin_memory=True, which rounds up to a power of two). Returns (tensor, seconds, unregister)."""
    buf = ucm.alloc_aligned(nbytes, 1 << 21)
    t0 = time.perf_counter()
    rc = torch.cuda.cudart().cudaHostRegister(buf.ctypes.data, nbytes, 0)
    if int(rc) != 0:
        raise RuntimeError(f"cudaHostRegister failed: {rc}")
    secs = time.perf_counter() - t0
    tensor = torch.from_numpy(buf)

    def unregister():
        torch.cuda.cudart().cudaHostUnregister(buf.ctypes.data)
    return tensor, secs, unregister


def timed(torch, fn, repeats):
    out = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        out.append(time.perf_counter() - t0)
    return out


def gbps(nbytes, seconds):
    return round(nbytes / seconds / GB, 2)


def check_equal(torch, name, a, b, failures):
    ok = bool(torch.equal(a, b))
    if not ok:
        failures.append(name)
    return ok


def correctness(torch, layout, kvs, ids, dev, failures, notes):
    """Triton == reference, bit for bit, on the GPU (full 2,000-block gather and scatter)."""
    bb = layout.block_bytes
    ref = torch.empty(len(ids), bb, dtype=torch.uint8, device=dev)
    tri = torch.full_like(ref, 0xA5)
    ucm.gather_blocks(layout, ids, ref, backend="reference")
    ucm.gather_blocks(layout, ids, tri, backend="triton")
    check_equal(torch, "gather triton == reference", tri, ref, failures)
    # semantic spot check: row 0 = K then V of layer 0 of block ids[0], ...
    b = int(ids[0])
    page = BLOCK_SIZE * HEADS * HEAD_DIM * 2
    check_equal(torch, "staged format", ref[0, :page], kvs[0][0, b].reshape(-1).view(torch.uint8), failures)
    check_equal(torch, "staged format V", ref[0, page:2 * page], kvs[0][1, b].reshape(-1).view(torch.uint8), failures)
    # -1 rows untouched
    small = torch.full((3, bb), 0x5A, dtype=torch.uint8, device=dev)
    ucm.gather_blocks(layout, torch.tensor([b, -1, int(ids[1])]), small, backend="triton")
    check_equal(torch, "-1 row untouched", small[1], torch.full_like(small[1], 0x5A), failures)
    check_equal(torch, "rows around -1", small[[0, 2]], ref[[0, 1]], failures)
    # scatter: triton and reference into zeroed caches must be identical everywhere
    dst_t, lay_t = build_cache(torch, NUM_BLOCKS, LAYERS, dev)
    dst_r, lay_r = build_cache(torch, NUM_BLOCKS, LAYERS, dev)
    ucm.scatter_blocks(lay_t, ref, ids, backend="triton")
    ucm.scatter_blocks(lay_r, ref, ids, backend="reference")
    same = all(torch.equal(a.view(torch.uint8), b_.view(torch.uint8)) for a, b_ in zip(dst_t, dst_r))
    if not same:
        failures.append("scatter triton == reference (whole cache)")
    back = torch.empty_like(ref)
    ucm.gather_blocks(lay_t, ids, back, backend="reference")
    check_equal(torch, "scatter round trip", back, ref, failures)
    # other layouts on the GPU: vLLM 0.32 4D byte views, head-outer (a block = 8 runs)
    raw = torch.empty(4 * 64 * HEADS * BLOCK_SIZE * 512 + 256, dtype=torch.int8, device=dev)
    raw.random_(-128, 127)
    shape = (4, 64, HEADS, BLOCK_SIZE, 512)                    # [L, B, H, N, C bytes]
    strides = (HEADS * 64 * BLOCK_SIZE * 512, BLOCK_SIZE * 512, 64 * BLOCK_SIZE * 512, 512, 1)  # LHBNC
    v5 = torch.as_strided(raw, shape, strides, 256)
    lay5 = KVLayout.from_views([v5[l].view(torch.bfloat16) for l in range(4)])
    sel = torch.tensor([63, -1, 0, 17, 5])
    r5 = torch.zeros(5, lay5.block_bytes, dtype=torch.uint8, device=dev)
    t5 = torch.ones_like(r5)
    ucm.gather_blocks(lay5, sel, r5, backend="reference")
    ucm.gather_blocks(lay5, sel, t5, backend="triton")
    check_equal(torch, "LHBNC gather", t5[[0, 2, 3, 4]], r5[[0, 2, 3, 4]], failures)
    before = raw.clone()
    ucm.scatter_blocks(lay5, torch.flip(r5, [0]), sel, backend="triton")   # permute blocks
    ucm.scatter_blocks(lay5, r5, sel, backend="triton")                     # and restore
    check_equal(torch, "LHBNC scatter restores", raw, before, failures)
    notes["runs_per_block"] = {"fa": sum(len(layout.view_runs(i)[0]) for i in range(layout.num_views)),
                               "vllm_LHBNC": sum(len(lay5.view_runs(i)[0]) for i in range(4))}
    del dst_t, dst_r, back, raw, v5
    return ref, tri


def run(args):
    import torch
    import triton

    dev = torch.device("cuda")
    torch.cuda.set_device(0)
    failures, notes = [], {}
    result = {"bench": "transfer_gpu", "device": torch.cuda.get_device_name(),
              "torch": torch.__version__, "triton": triton.__version__,
              "cuda": torch.version.cuda, "python": platform.python_version(),
              "date": time.strftime("%Y-%m-%d"),
              "shape": {"layers": LAYERS, "kv_heads": HEADS, "head_dim": HEAD_DIM,
                        "block_size": BLOCK_SIZE, "dtype": "bfloat16", "layout": "FA [2,B,N,H,D]",
                        "num_blocks": NUM_BLOCKS, "moved_blocks": MOVE}}
    rng = np.random.default_rng(0)
    ids_np = rng.permutation(NUM_BLOCKS)[:MOVE].astype(np.int64)
    ids = torch.from_numpy(ids_np)

    kvs, layout = build_cache(torch, NUM_BLOCKS, LAYERS, dev, seed=1)
    bb = layout.block_bytes
    total = MOVE * bb
    result.update(block_bytes=bb, bytes_moved=total)

    ref, dev_staging = correctness(torch, layout, kvs, ids, dev, failures, notes)
    result["check_before_timing"] = "passed" if not failures else failures
    if failures:
        return result, failures

    slab, pin_s, unregister = pinned_slab(torch, total)
    host = slab.view(MOVE, bb)
    result["pin_seconds_host_slab"] = round(pin_s, 3)
    s_gather, s_copy = torch.cuda.Stream(), torch.cuda.Stream()
    reps = args.repeats

    # device-only kernel throughput (bytes read + written)
    t = timed(torch, lambda: ucm.gather_blocks(layout, ids, dev_staging, backend="triton"), reps)
    result["gather_d2d_GBps_rw"] = gbps(2 * total, statistics.median(t))
    dst_kvs, dst_layout = build_cache(torch, NUM_BLOCKS, LAYERS, dev)
    t = timed(torch, lambda: ucm.scatter_blocks(dst_layout, ref, ids, backend="triton"), reps)
    result["scatter_d2d_GBps_rw"] = gbps(2 * total, statistics.median(t))
    t = timed(torch, lambda: ucm.gather_blocks(layout, ids, dev_staging, backend="reference"), 2)
    result["reference_gather_d2d_GBps_rw"] = gbps(2 * total, statistics.median(t))

    # (d) ceiling
    t = timed(torch, lambda: host.copy_(ref, non_blocking=True), reps)
    ceil_d2h = gbps(total, statistics.median(t))
    t = timed(torch, lambda: dev_staging.copy_(host, non_blocking=True), reps)
    ceil_h2d = gbps(total, statistics.median(t))
    result.update(ceiling_d2h_GBps=ceil_d2h, ceiling_h2d_GBps=ceil_h2d)
    check_equal(torch, "ceiling copies", dev_staging, ref, failures)

    # (a) / (b) pipelined, per chunk size
    ev_a = [torch.cuda.Event() for _ in range(2)]
    ev_b = [torch.cuda.Event() for _ in range(2)]
    bufs = None

    def dump(chunk):
        for k, start in enumerate(range(0, MOVE, chunk)):
            j, n = k % 2, min(chunk, MOVE - start)
            with torch.cuda.stream(s_gather):
                s_gather.wait_event(ev_b[j])            # D2H of chunk k-2 finished reading buf j
                ucm.gather_blocks(layout, ids[start:start + n], bufs[j][:n], backend="triton")
                ev_a[j].record(s_gather)
            with torch.cuda.stream(s_copy):
                s_copy.wait_event(ev_a[j])
                host[start:start + n].copy_(bufs[j][:n], non_blocking=True)
                ev_b[j].record(s_copy)

    def load(chunk):
        for k, start in enumerate(range(0, MOVE, chunk)):
            j, n = k % 2, min(chunk, MOVE - start)
            with torch.cuda.stream(s_copy):
                s_copy.wait_event(ev_b[j])              # scatter of chunk k-2 finished reading buf j
                bufs[j][:n].copy_(host[start:start + n], non_blocking=True)
                ev_a[j].record(s_copy)
            with torch.cuda.stream(s_gather):
                s_gather.wait_event(ev_a[j])
                ucm.scatter_blocks(dst_layout, bufs[j][:n], ids[start:start + n], backend="triton")
                ev_b[j].record(s_gather)

    sweep = {}
    for chunk in args.chunks:
        bufs = [torch.empty(chunk, bb, dtype=torch.uint8, device=dev) for _ in range(2)]
        host.fill_(0)
        td = timed(torch, lambda: dump(chunk), reps)
        check_equal(torch, f"dump chunk {chunk}", host.to(dev), ref, failures)
        for kv in dst_kvs:
            kv.zero_()
        tl_ = timed(torch, lambda: load(chunk), reps)
        dst_kvs_check = torch.empty_like(ref)
        ucm.gather_blocks(dst_layout, ids, dst_kvs_check, backend="reference")
        check_equal(torch, f"load chunk {chunk}", dst_kvs_check, ref, failures)
        del dst_kvs_check
        sweep[chunk] = {"chunk_MiB": chunk * bb >> 20, "dump_GBps": gbps(total, statistics.median(td)),
                        "load_GBps": gbps(total, statistics.median(tl_)),
                        "dump_GBps_best": gbps(total, min(td)), "load_GBps_best": gbps(total, min(tl_))}
        print(f"chunk {chunk}: {sweep[chunk]}", flush=True)
    bufs = None
    best_dump = max(sweep, key=lambda c: sweep[c]["dump_GBps"])
    best_load = max(sweep, key=lambda c: sweep[c]["load_GBps"])
    result["chunk_sweep"] = sweep
    result.update(dump_GBps=sweep[best_dump]["dump_GBps"], dump_chunk_blocks=best_dump,
                  load_GBps=sweep[best_load]["load_GBps"], load_chunk_blocks=best_load)

    # (c) naive: one copy_ per block per layer per K/V (views prepared outside the timing)
    page = BLOCK_SIZE * HEADS * HEAD_DIM
    pairs = []
    for i, b in enumerate(ids_np.tolist()):
        row = host[i].view(torch.bfloat16)
        for layer in range(LAYERS):
            for kv_i in range(2):
                off = (2 * layer + kv_i) * page
                pairs.append((kvs[layer][kv_i, b], row[off:off + page].view(BLOCK_SIZE, HEADS, HEAD_DIM),
                              dst_kvs[layer][kv_i, b]))

    def naive_dump():
        for src, h, _ in pairs:
            h.copy_(src, non_blocking=True)

    def naive_load():
        for _, h, dst in pairs:
            dst.copy_(h, non_blocking=True)

    host.fill_(0)
    t = timed(torch, naive_dump, args.naive_repeats)
    result["naive_dump_GBps"] = gbps(total, statistics.median(t))
    check_equal(torch, "naive dump", host.to(dev), ref, failures)
    for kv in dst_kvs:
        kv.zero_()
    t = timed(torch, naive_load, args.naive_repeats)
    result["naive_load_GBps"] = gbps(total, statistics.median(t))
    chk = torch.empty_like(ref)
    ucm.gather_blocks(dst_layout, ids, chk, backend="reference")
    check_equal(torch, "naive load", chk, ref, failures)
    result["naive_copies_per_direction"] = len(pairs)
    pairs.clear()

    # (e) the memory tier
    try:
        result["memory_tier"] = memory_tier(torch, args, layout, dst_layout, dst_kvs, ids, ids_np, ref,
                                            dev_staging, chk, s_gather, failures)
    except Exception as exc:  # report, keep the other figures
        traceback.print_exc()
        result["memory_tier"] = {"error": repr(exc)}

    unregister()
    result["ratios"] = {
        "dump_vs_ceiling": round(result["dump_GBps"] / ceil_d2h, 3),
        "load_vs_ceiling": round(result["load_GBps"] / ceil_h2d, 3),
        "dump_vs_naive": round(result["dump_GBps"] / result["naive_dump_GBps"], 2),
        "load_vs_naive": round(result["load_GBps"] / result["naive_load_GBps"], 2),
    }
    mt = result["memory_tier"]
    if "dump_GBps" in mt:
        result["ratios"].update(memory_tier_dump_vs_ceiling=round(mt["dump_GBps"] / ceil_d2h, 3),
                                memory_tier_load_vs_ceiling=round(mt["load_GBps"] / ceil_h2d, 3))
    result["target_GBps"] = 45
    result["meets_target"] = result["dump_GBps"] >= 45 and result["load_GBps"] >= 45
    result["notes"] = notes
    result["check_after_timing"] = "passed" if not failures else failures
    return result, failures


def memory_tier(torch, args, layout, dst_layout, dst_kvs, ids, ids_np, ref, dev_staging, chk,
                s_gather, failures):
    from ucm.store import open_store

    bb = layout.block_bytes
    chunk = args.store_chunk
    t0 = time.perf_counter()
    store = open_store(block_bytes=bb, shard_bytes=bb, store__pipeline="memory",
                       buffer_number=MOVE + 48)
    store.prepare()  # allocate and pin the pool now
    out = {"open_seconds": round(time.perf_counter() - t0, 3), "chunk_blocks": chunk,
           "pinned": store.stats()["memory"]["pinned"]}
    rep = [0]

    def block_ids():
        base = np.arange(MOVE, dtype=np.uint64) + np.uint64(1)
        return np.stack([base, np.full(MOVE, rep[0], dtype=np.uint64)], axis=1)

    def dump():
        rep[0] += 1  # new ids each repeat: nothing is skipped as already present
        bid = block_ids()
        tasks = []
        with torch.cuda.stream(s_gather):
            for start in range(0, MOVE, chunk):
                n = min(chunk, MOVE - start)
                rows = dev_staging[start:start + n]
                ucm.gather_blocks(layout, ids[start:start + n], rows, backend="triton")
                tasks.append(store.dump(bid[start:start + n], 0, rows))
        for task in tasks:
            r = store.wait(task)
            if not r.ok.all():
                raise RuntimeError(f"memory tier dump failed: {r.errors}")
        store.commit(bid, [True] * MOVE)

    def load():
        bid = block_ids()
        tasks = [store.load(bid[s:s + chunk], 0, dev_staging[s:s + chunk]) for s in range(0, MOVE, chunk)]
        with torch.cuda.stream(s_gather):
            for k, start in enumerate(range(0, MOVE, chunk)):
                n = min(chunk, MOVE - start)
                r = store.wait(tasks[k])
                if not r.ok.all():
                    raise RuntimeError(f"memory tier load failed: {r.errors}")
                ucm.scatter_blocks(dst_layout, dev_staging[start:start + n], ids[start:start + n],
                                   backend="triton")

    try:
        dev_staging.zero_()
        td = timed(torch, dump, args.repeats)
        for kv in dst_kvs:
            kv.zero_()
        dev_staging.zero_()
        tl_ = timed(torch, load, args.repeats)
        ucm.gather_blocks(dst_layout, ids, chk, backend="reference")
        check_equal(torch, "memory tier round trip", chk, ref, failures)
        total = MOVE * bb
        out.update(dump_GBps=gbps(total, statistics.median(td)), load_GBps=gbps(total, statistics.median(tl_)),
                   dump_GBps_best=gbps(total, min(td)), load_GBps_best=gbps(total, min(tl_)),
                   stats={k: v for k, v in store.stats()["memory"].items()
                          if k in ("dump_GBps", "load_GBps", "evictions", "committed", "pinned")})
    finally:
        store.close()
    return out


def table(r):
    lines = [f"KV transfer on {r['device']} (torch {r['torch']}, triton {r['triton']}): "
             f"{r['shape']['moved_blocks']} blocks x {r['block_bytes'] >> 20} MiB = "
             f"{r['bytes_moved'] / GB:.2f} GB",
             f"{'path':44s} {'GPU->host':>10s} {'host->GPU':>10s}"]
    mt = r.get("memory_tier", {})
    rows = [("(d) ceiling: one pinned copy", r["ceiling_d2h_GBps"], r["ceiling_h2d_GBps"]),
            ("(a,b) triton gather/scatter + chunked copy", r["dump_GBps"], r["load_GBps"]),
            ("(c) naive copy_ per block/layer/K,V", r["naive_dump_GBps"], r["naive_load_GBps"]),
            ("(e) triton + memory tier", mt.get("dump_GBps", "n/a"), mt.get("load_GBps", "n/a"))]
    for name, a, b in rows:
        lines.append(f"{name:44s} {a!s:>10s} {b!s:>10s}")
    lines.append(f"ratios: {r['ratios']}  meets 45 GB/s target: {r['meets_target']}")
    lines.append(f"device-only gather {r['gather_d2d_GBps_rw']} GB/s (read+write), scatter "
                 f"{r['scatter_d2d_GBps_rw']}, reference gather {r['reference_gather_d2d_GBps_rw']}")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--json", help="also write the JSON result here")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--naive-repeats", type=int, default=2)
    p.add_argument("--chunks", type=int, nargs="+", default=[32, 64, 128, 256])
    p.add_argument("--store-chunk", type=int, default=128)
    args = p.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("bench_transfer_gpu: no CUDA device", file=sys.stderr)
        return 2
    result, failures = run(args)
    line = json.dumps(result, sort_keys=True)
    print(line)
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            f.write(line + "\n")
    if failures:
        print(f"CORRECTNESS FAILURES: {failures}", file=sys.stderr)
        return 1
    print(table(result))
    return 0


def test_smoke():
    """Correctness half of the benchmark at full shape (CUDA only)."""
    import pytest

    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    kvs, layout = build_cache(torch, NUM_BLOCKS, LAYERS, torch.device("cuda"), seed=1)
    failures = []
    ids = torch.from_numpy(np.random.default_rng(0).permutation(NUM_BLOCKS)[:MOVE].astype(np.int64))
    correctness(torch, layout, kvs, ids, torch.device("cuda"), failures, {})
    assert not failures, failures


if __name__ == "__main__":
    sys.exit(main())
