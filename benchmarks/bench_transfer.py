#!/usr/bin/env python3
"""KV transfer: paged KV cache <-> staging rows (``gather_blocks`` / ``scatter_blocks``), the fast
implementation against the reference and the machine's ceiling, every output checked first.

    pytest benchmarks/bench_transfer.py [--benchmark-disable]
    python benchmarks/bench_transfer.py cpu [--repeats 5] [--json benchmarks/results/bench_transfer_cpu.json]
    python3 benchmarks/bench_transfer.py cuda [--json $OUT/bench_transfer_h200.json] [--repeats 5]
                                              [--naive-repeats 2] [--chunks 32 64 128 256] [--store-chunk 128]

Shape: Llama-3-8B paged KV cache, 32 layers, 8 KV heads, head dim 128, bf16, 16-token blocks,
FlashAttention layout per layer ``[2, num_blocks, 16, 8, 128]`` (views ``kv.unbind(0)``), 2 MiB
per block over all layers, moved in a random order: 32 of 48 blocks on CPU (64 MiB), 2,000 of
2,112 on CUDA (4,000 MiB).

CPU (pytest groups ``gather`` and ``scatter``, and the ``cpu`` script, which prints the ratios of
one run): ``reference`` (PyTorch indexing), ``native`` (the C engine's threaded copies), and the
ceiling: one contiguous copy of the same bytes on as many native threads. Before timing, the
checks of the CUDA run below with ``native`` in place of Triton; the script refuses to report
(exit 1) if any fails.

CUDA (pytest groups ``cuda gather`` / ``cuda scatter``: ``reference``, ``triton`` and a
device-to-device copy of the same bytes; ``cuda dump`` / ``cuda load``: Triton gather + one
copy into pinned host memory, and back, against the ceiling, the pinned copy alone; skipped
without CUDA). The ``cuda`` script (formerly ``bench_transfer_gpu.py``, same options) first
checks Triton gather/scatter against the reference bit for bit on the GPU, then times, in one
run:

(a) dump: Triton gather into a device staging chunk + one D2H copy per chunk into a pinned host
    slab, double-buffered on two streams (the gather of chunk k+1 overlaps the copy of chunk k);
(b) load: H2D copy per chunk into device staging + Triton scatter, double-buffered likewise;
(c) naive baseline: one ``copy_`` per block per layer per K/V between the cache and the slab;
(d) the ceiling: one 4,000 MiB pinned D2H copy and one H2D copy of the same bytes;
(e) dump/load through ucm's memory tier (``open_store(..., store__pipeline="memory")``):
    chunked Triton gather + ``store.dump`` / ``store.load`` + Triton scatter.

Every timed path is checked afterwards (host slab or destination cache equal to the reference);
on any failure it prints the failures and exits 1 without reporting figures. Otherwise it
prints one JSON line and a table; ``--json PATH`` also writes the JSON.
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
from dataclasses import dataclass

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import ucm  # noqa: E402
from ucm.layout import KVLayout  # noqa: E402
from _argtypes import count as _count, write_json  # noqa: E402


@dataclass(frozen=True)
class Shape:
    """A paged KV cache: per layer one FlashAttention tensor ``[2, num_blocks, block_size,
    kv_heads, head_dim]`` bf16; ``moved`` of its blocks (in a random order) are gathered or
    scattered."""
    layers: int
    kv_heads: int
    head_dim: int
    block_size: int
    num_blocks: int
    moved: int


#: the CUDA figure's shape: Llama-3-8B, 2 MiB per block over all layers, 4,000 MiB moved
LLAMA3_8B = Shape(layers=32, kv_heads=8, head_dim=128, block_size=16, num_blocks=2112, moved=2000)
#: the CPU cases: the same blocks, 32 of them moved (64 MiB)
CPU_SHAPE = Shape(layers=32, kv_heads=8, head_dim=128, block_size=16, num_blocks=48, moved=32)
LAYERS, HEADS, HEAD_DIM, BLOCK_SIZE = LLAMA3_8B.layers, LLAMA3_8B.kv_heads, LLAMA3_8B.head_dim, LLAMA3_8B.block_size
NUM_BLOCKS, MOVE = LLAMA3_8B.num_blocks, LLAMA3_8B.moved
GB = 1e9


def build_cache(torch, shape, device, seed=None):
    """Per-layer FA tensors [2, B, N, H, D] bf16 (random bytes, or zeros without a seed)."""
    kvs = []
    layers = shape.layers
    gen = torch.Generator(device=device)
    for layer in range(layers):
        kv = torch.empty(2, shape.num_blocks, shape.block_size, shape.kv_heads, shape.head_dim,
                         dtype=torch.bfloat16, device=device)
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


def correctness(torch, shape, layout, kvs, ids, dev, failures, notes, fast="triton"):
    """``fast`` (Triton on a GPU, native on CPU) == reference, bit for bit, on ``dev``: every moved
    block gathered and scattered, rows of -1 untouched, and vLLM 0.32's head-outer layout."""
    bb = layout.block_bytes
    ref = torch.empty(len(ids), bb, dtype=torch.uint8, device=dev)
    tri = torch.full_like(ref, 0xA5)
    ucm.gather_blocks(layout, ids, ref, backend="reference")
    ucm.gather_blocks(layout, ids, tri, backend=fast)
    check_equal(torch, f"gather {fast} == reference", tri, ref, failures)
    # semantic spot check: row 0 = K then V of layer 0 of block ids[0], ...
    b = int(ids[0])
    page = shape.block_size * shape.kv_heads * shape.head_dim * 2
    check_equal(torch, "staged format", ref[0, :page], kvs[0][0, b].reshape(-1).view(torch.uint8), failures)
    check_equal(torch, "staged format V", ref[0, page:2 * page], kvs[0][1, b].reshape(-1).view(torch.uint8), failures)
    # -1 rows untouched
    small = torch.full((3, bb), 0x5A, dtype=torch.uint8, device=dev)
    ucm.gather_blocks(layout, torch.tensor([b, -1, int(ids[1])]), small, backend=fast)
    check_equal(torch, "-1 row untouched", small[1], torch.full_like(small[1], 0x5A), failures)
    check_equal(torch, "rows around -1", small[[0, 2]], ref[[0, 1]], failures)
    # scatter: triton and reference into zeroed caches must be identical everywhere
    dst_t, lay_t = build_cache(torch, shape, dev)
    dst_r, lay_r = build_cache(torch, shape, dev)
    ucm.scatter_blocks(lay_t, ref, ids, backend=fast)
    ucm.scatter_blocks(lay_r, ref, ids, backend="reference")
    same = all(torch.equal(a.view(torch.uint8), b_.view(torch.uint8)) for a, b_ in zip(dst_t, dst_r))
    if not same:
        failures.append(f"scatter {fast} == reference (whole cache)")
    back = torch.empty_like(ref)
    ucm.gather_blocks(lay_t, ids, back, backend="reference")
    check_equal(torch, "scatter round trip", back, ref, failures)
    # other layouts on the GPU: vLLM 0.32 4D byte views, head-outer (a block = 8 runs)
    heads, bs = shape.kv_heads, shape.block_size
    raw = torch.empty(4 * 64 * heads * bs * 512 + 256, dtype=torch.int8, device=dev)
    raw.random_(-128, 127)
    dims = (4, 64, heads, bs, 512)                             # [L, B, H, N, C bytes]
    strides = (heads * 64 * bs * 512, bs * 512, 64 * bs * 512, 512, 1)  # LHBNC
    v5 = torch.as_strided(raw, dims, strides, 256)
    lay5 = KVLayout.from_views([v5[l].view(torch.bfloat16) for l in range(4)])
    sel = torch.tensor([63, -1, 0, 17, 5])
    r5 = torch.zeros(5, lay5.block_bytes, dtype=torch.uint8, device=dev)
    t5 = torch.ones_like(r5)
    ucm.gather_blocks(lay5, sel, r5, backend="reference")
    ucm.gather_blocks(lay5, sel, t5, backend=fast)
    check_equal(torch, "LHBNC gather", t5[[0, 2, 3, 4]], r5[[0, 2, 3, 4]], failures)
    before = raw.clone()
    ucm.scatter_blocks(lay5, torch.flip(r5, [0]), sel, backend=fast)   # permute blocks
    ucm.scatter_blocks(lay5, r5, sel, backend=fast)                     # and restore
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

    kvs, layout = build_cache(torch, LLAMA3_8B, dev, seed=1)
    bb = layout.block_bytes
    total = MOVE * bb
    result.update(block_bytes=bb, bytes_moved=total)

    ref, dev_staging = correctness(torch, LLAMA3_8B, layout, kvs, ids, dev, failures, notes)
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
    dst_kvs, dst_layout = build_cache(torch, LLAMA3_8B, dev)
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


def main_cuda(args) -> int:
    import torch

    if not torch.cuda.is_available():
        print("bench_transfer.py cuda: no CUDA device", file=sys.stderr)
        return 2
    result, failures = run(args)
    if failures:  # no figure of a run whose outputs were wrong
        print(f"CORRECTNESS FAILURES, no figures reported: {failures}", file=sys.stderr)
        return 1
    line = json.dumps(result, sort_keys=True)
    print(line)
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            f.write(line + "\n")
    print(table(result))
    return 0


# ---------------------------------------------------------------------------------------------
# providers shared by the pytest cases and the cpu script

class WrongOutput(AssertionError):
    """A provider's output differs from the reference: no time of it may be reported."""


class Transfer:
    """A seeded cache of ``shape`` on ``device``, the moved ids, the reference's staged rows, and
    per operation the providers: ``{name: (run, check)}``; ``check()`` raises
    :class:`WrongOutput` unless the last ``run()`` left the right bytes."""

    def __init__(self, torch, shape: Shape, device, fast: str):
        self.torch, self.shape, self.dev, self.fast = torch, shape, device, fast
        self.kvs, self.layout = build_cache(torch, shape, device, seed=1)
        self.dst_kvs, self.dst_layout = build_cache(torch, shape, device)
        ids = np.random.default_rng(0).permutation(shape.num_blocks)[:shape.moved].astype(np.int64)
        self.ids = torch.from_numpy(ids)
        self.nbytes = shape.moved * self.layout.block_bytes
        self.ref = torch.empty(shape.moved, self.layout.block_bytes, dtype=torch.uint8, device=device)
        ucm.gather_blocks(self.layout, self.ids, self.ref, backend="reference")
        self.staging = torch.empty_like(self.ref)
        self.flat_src = self.ref.reshape(-1)
        self.flat_dst = torch.empty_like(self.flat_src)

    def _sync(self, fn):
        if self.dev.type != "cuda":
            return fn
        cuda = self.torch.cuda

        def run():
            fn()
            cuda.synchronize()
        return run

    def _ceiling(self, name):
        """One contiguous copy of the same bytes (native threads on CPU, ``copy_`` on a GPU)."""
        src, dst = self.flat_src, self.flat_dst
        if self.dev.type == "cuda":
            run = lambda: dst.copy_(src)  # noqa: E731
        else:
            from ucm.threads import default_threads

            run = lambda: ucm.copy_segments([src.data_ptr()], [dst.data_ptr()], [self.nbytes],  # noqa: E731
                                            default_threads())

        def check():
            ok = bool(self.torch.equal(dst, src))
            dst.zero_()
            if not ok:
                raise WrongOutput(f"{name}: wrong bytes")
        return self._sync(run), check

    def gather(self) -> dict:
        def provider(backend):
            run = self._sync(lambda: ucm.gather_blocks(self.layout, self.ids, self.staging, backend=backend))

            def check():
                ok = bool(self.torch.equal(self.staging, self.ref))
                self.staging.fill_(0xA5)  # the next provider's check sees only its own bytes
                if not ok:
                    raise WrongOutput(f"gather[{backend}] != reference")
            return run, check
        self.staging.fill_(0xA5)
        return {"reference": provider("reference"), self.fast: provider(self.fast),
                "ceiling_copy": self._ceiling("gather ceiling")}

    def scatter(self) -> dict:
        def provider(backend):
            run = self._sync(lambda: ucm.scatter_blocks(self.dst_layout, self.ref, self.ids, backend=backend))

            def check():
                back = self.torch.empty_like(self.ref)
                ucm.gather_blocks(self.dst_layout, self.ids, back, backend="reference")
                ok = bool(self.torch.equal(back, self.ref))
                for kv in self.dst_kvs:
                    kv.zero_()
                if not ok:
                    raise WrongOutput(f"scatter[{backend}] != reference")
            return run, check
        return {"reference": provider("reference"), self.fast: provider(self.fast),
                "ceiling_copy": self._ceiling("scatter ceiling")}

    def host(self, direction: str) -> dict:
        """CUDA: ``dump`` = Triton gather + one copy into pinned host memory; ``load`` = one copy
        from pinned host memory + Triton scatter; each against the pinned copy alone."""
        torch = self.torch
        host = torch.empty_like(self.ref, device="cpu").pin_memory()
        if direction == "dump":
            def through():
                ucm.gather_blocks(self.layout, self.ids, self.staging, backend=self.fast)
                host.copy_(self.staging, non_blocking=True)

            def check():
                ok = bool(torch.equal(host.to(self.dev), self.ref))
                host.zero_()
                if not ok:
                    raise WrongOutput("dump through pinned host memory: wrong bytes")
            return {self.fast: (self._sync(through), check),
                    "ceiling_pinned_copy": (self._sync(lambda: host.copy_(self.ref, non_blocking=True)), check)}
        host.copy_(self.ref)

        def back():
            self.staging.copy_(host, non_blocking=True)
            ucm.scatter_blocks(self.dst_layout, self.staging, self.ids, backend=self.fast)

        def check_back():
            out = torch.empty_like(self.ref)
            ucm.gather_blocks(self.dst_layout, self.ids, out, backend="reference")
            ok = bool(torch.equal(out, self.ref))
            for kv in self.dst_kvs:
                kv.zero_()
            if not ok:
                raise WrongOutput("load from pinned host memory: wrong bytes")

        def check_copy():
            ok = bool(torch.equal(self.staging, self.ref))
            self.staging.zero_()
            if not ok:
                raise WrongOutput("pinned copy: wrong bytes")
        return {self.fast: (self._sync(back), check_back),
                "ceiling_pinned_copy": (self._sync(lambda: self.staging.copy_(host, non_blocking=True)), check_copy)}


# ---------------------------------------------------------------------------------------------
# pytest-benchmark

CPU_CASES = [("gather", p) for p in ("reference", "native", "ceiling_copy")] + \
    [("scatter", p) for p in ("reference", "native", "ceiling_copy")]
CUDA_CASES = [("gather", p) for p in ("reference", "triton", "ceiling_copy")] + \
    [("scatter", p) for p in ("reference", "triton", "ceiling_copy")] + \
    [("dump", p) for p in ("triton", "ceiling_pinned_copy")] + [("load", p) for p in ("triton", "ceiling_pinned_copy")]


@pytest.fixture(scope="module")
def cpu_transfer():
    torch = pytest.importorskip("torch")
    return Transfer(torch, CPU_SHAPE, torch.device("cpu"), "native")


@pytest.fixture(scope="module")
def cuda_transfer():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    return Transfer(torch, LLAMA3_8B, torch.device("cuda"), "triton")


def _bench(benchmark, transfer, op, provider, group):
    providers = {"gather": transfer.gather, "scatter": transfer.scatter,
                 "dump": lambda: transfer.host("dump"), "load": lambda: transfer.host("load")}[op]()
    run, check = providers[provider]
    benchmark.group = group
    benchmark.extra_info.update(bytes=transfer.nbytes, shape=str(transfer.shape))
    run()
    check()  # no time counts for a wrong output
    benchmark.pedantic(run, rounds=5, warmup_rounds=1)
    check()


@pytest.mark.parametrize("op,provider", CPU_CASES, ids=[f"{o}-{p}" for o, p in CPU_CASES])
def test_transfer_cpu(benchmark, cpu_transfer, op, provider):
    _bench(benchmark, cpu_transfer, op, provider, op)


@pytest.mark.parametrize("op,provider", CUDA_CASES, ids=[f"{o}-{p}" for o, p in CUDA_CASES])
def test_transfer_cuda(benchmark, cuda_transfer, op, provider):
    _bench(benchmark, cuda_transfer, op, provider, f"cuda {op}")


def test_correctness_cpu():
    """The CUDA run's correctness checks, with the native engine in place of Triton (CPU)."""
    torch = pytest.importorskip("torch")
    dev = torch.device("cpu")
    kvs, layout = build_cache(torch, CPU_SHAPE, dev, seed=1)
    ids = torch.from_numpy(np.random.default_rng(0).permutation(CPU_SHAPE.num_blocks)[:CPU_SHAPE.moved])
    failures = []
    correctness(torch, CPU_SHAPE, layout, kvs, ids, dev, failures, {}, fast="native")
    assert not failures, failures


def test_correctness_cuda():
    """The CUDA run's correctness checks at full shape (CUDA only)."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    dev = torch.device("cuda")
    kvs, layout = build_cache(torch, LLAMA3_8B, dev, seed=1)
    failures = []
    ids = torch.from_numpy(np.random.default_rng(0).permutation(NUM_BLOCKS)[:MOVE].astype(np.int64))
    correctness(torch, LLAMA3_8B, layout, kvs, ids, dev, failures, {})
    assert not failures, failures


# ---------------------------------------------------------------------------------------------
# cpu script: the ratios of one run

def main_cpu(args) -> int:
    import torch

    from ucm.threads import default_threads

    dev = torch.device("cpu")
    shape = CPU_SHAPE
    t = Transfer(torch, shape, dev, "native")
    failures = []
    correctness(torch, shape, t.layout, t.kvs, t.ids, dev, failures, {}, fast="native")
    if failures:
        print(f"CORRECTNESS FAILURES, no figures reported: {failures}", file=sys.stderr)
        return 1
    out = {"bench": "transfer_cpu", "machine": f"{platform.node()} {platform.machine()} {os.cpu_count()} cores",
           "date": time.strftime("%Y-%m-%d"), "torch": torch.__version__, "threads": default_threads(),
           "shape": vars(shape), "bytes_moved": t.nbytes, "ops": {}}
    print(f"# KV transfer on CPU ({out['machine']}, {out['threads']} native threads): {shape.moved} blocks x "
          f"{t.layout.block_bytes >> 20} MiB = {t.nbytes >> 20} MiB")
    for op in ("gather", "scatter"):
        rows = {}
        for name, (run_, check) in getattr(t, op)().items():
            try:
                run_()
                check()
                secs = []
                for _ in range(args.repeats):
                    t0 = time.perf_counter()
                    run_()
                    secs.append(time.perf_counter() - t0)
                check()
            except WrongOutput as exc:
                print(f"CORRECTNESS FAILURE, no figures reported: {exc}", file=sys.stderr)
                return 1
            rows[name] = {"seconds": min(secs), "GBps": t.nbytes / min(secs) / GB}
        for name, row in rows.items():
            row["vs_reference"] = rows["reference"]["seconds"] / row["seconds"]
            row["of_ceiling"] = rows["ceiling_copy"]["seconds"] / row["seconds"]
            print(f"{op:8s} {name:13s} {row['GBps']:7.2f} GB/s  {row['vs_reference']:7.2f}x reference  "
                  f"{row['of_ceiling']:6.1%} of the ceiling", flush=True)
        out["ops"][op] = rows
    if args.json:
        write_json(args.json, out, indent=1)
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="KV transfer: gather/scatter against the reference and the ceiling (cpu), the H200 figure (cuda).",
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    sub = p.add_subparsers(dest="mode", required=True)
    c = sub.add_parser("cpu", help="reference vs native vs a contiguous copy, CPU tensors")
    c.add_argument("--repeats", type=_count(1), default=5, help="timed runs per provider (best reported)")
    g = sub.add_parser("cuda", help="the H200 figure: Triton + pinned copies + memory tier vs the "
                       "pinned-copy ceiling (formerly bench_transfer_gpu.py)")
    g.add_argument("--repeats", type=_count(1), default=5, help="timed runs per path (median reported)")
    g.add_argument("--naive-repeats", type=_count(1), default=2, help="timed runs of the naive per-block copies")
    g.add_argument("--chunks", type=_count(1), nargs="+", default=[32, 64, 128, 256],
                   help="blocks per staging chunk of the pipelined copies (the best is reported)")
    g.add_argument("--store-chunk", type=_count(1), default=128, help="blocks per store.dump/load of the memory tier")
    for sp in (c, g):
        sp.add_argument("--json", help="also write the figures here")
    args = p.parse_args(argv)
    return main_cpu(args) if args.mode == "cpu" else main_cuda(args)


if __name__ == "__main__":
    sys.exit(main())
