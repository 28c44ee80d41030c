#!/usr/bin/env python3
"""Foundation figures, all ratios measured in one run (issue: foundation).

    python benchmarks/foundation.py [--vllm-python /path/to/venv/bin/python] [--json out.json]

1. hash_blocks over 131,072 tokens in 16-token blocks: Numba vs the pure-Python reference, and
   vs vLLM's default block hashing (sha256, via benchmarks/vllm_block_hash.py in an interpreter
   that has vLLM; skipped with a note when none is found).
2. BlockIndex.lookup_prefix over 1,000,000 resident ids: Numba vs reference.
3. copy_segments of 256 MiB in 64 KiB segments scattered to a random permutation of slots:
   native with 2 threads vs a single-threaded numpy copy of the same segments between the same
   buffers; the contiguous single-call copy is shown as the machine's ceiling.

Each figure is printed only after a correctness check on the same data passed. Timings are the
best of several repeats (time.perf_counter).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time

import numpy as np

import ucm

HERE = os.path.dirname(os.path.abspath(__file__))


def best_of(fn, repeats):
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def bench_hashing(vllm_python, n_tokens=131072, block_size=16):
    tokens = np.random.default_rng(0).integers(0, 49152, size=n_tokens)
    ns = ucm.Namespace(model="bench", dtype="bfloat16", block_size=block_size)
    ref = ucm.hash_blocks(tokens, ns, backend="reference")
    fast = ucm.hash_blocks(tokens, ns, backend="numba")
    assert np.array_equal(ref, fast) and len(ref) == n_tokens // block_size
    t_ref = best_of(lambda: ucm.hash_blocks(tokens, ns, backend="reference"), 3)
    t_fast = best_of(lambda: ucm.hash_blocks(tokens, ns, backend="numba"), 30)
    out = {"n_tokens": n_tokens, "block_size": block_size, "reference_s": t_ref, "numba_s": t_fast,
           "numba_vs_reference": t_ref / t_fast}
    if vllm_python:
        r = subprocess.run([vllm_python, os.path.join(HERE, "vllm_block_hash.py"), str(n_tokens),
                            "--block-size", str(block_size), "--repeats", "7"],
                           capture_output=True, text=True)
        if r.returncode == 0:
            v = json.loads(r.stdout.strip().splitlines()[-1])
            out.update(vllm_version=v["vllm_version"], vllm_algo=v["algo"], vllm_s=v["seconds_best"],
                       numba_vs_vllm=v["seconds_best"] / t_fast,
                       reference_vs_vllm=v["seconds_best"] / t_ref)
        else:
            out["vllm_error"] = r.stderr.strip()[-300:]
    return out


def bench_index(n=1_000_000):
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 2**64 - 1, size=(n, 2), dtype=np.uint64, endpoint=True)
    ref = ucm.BlockIndex(n, backend="reference")
    fast = ucm.BlockIndex(n, backend="numba")
    for idx in (ref, fast):
        idx.insert(ids, np.arange(n))
    probe = ids.copy()
    assert ref.lookup_prefix(probe) == fast.lookup_prefix(probe) == n
    probe_miss = probe.copy()
    probe_miss[n // 2, 0] ^= np.uint64(1)
    assert ref.lookup_prefix(probe_miss) == fast.lookup_prefix(probe_miss) == n // 2
    t_ref = best_of(lambda: ref.lookup_prefix(probe), 3)
    t_fast = best_of(lambda: fast.lookup_prefix(probe), 10)
    return {"n_ids": n, "reference_s": t_ref, "numba_s": t_fast, "numba_vs_reference": t_ref / t_fast}


def bench_copy(total=256 << 20, seg=64 << 10, threads=2):
    n = total // seg
    rng = np.random.default_rng(0)
    src = ucm.alloc_aligned(total)
    src[:] = rng.integers(0, 256, total, dtype=np.uint8)
    dst = ucm.alloc_aligned(total)
    perm = rng.permutation(n)
    so = np.arange(n, dtype=np.uint64) * seg
    do = perm.astype(np.uint64) * seg
    lengths = np.full(n, seg, dtype=np.uint64)
    pairs = list(zip(so.tolist(), do.tolist()))

    def numpy_copy(d=dst, s=src):
        for a, b in pairs:
            d[b:b + seg] = s[a:a + seg]

    numpy_copy()
    expected = dst.copy()
    dst[:] = 0
    ucm.copy_ranges(src, so, dst, do, lengths, n_threads=threads, backend="native")
    assert np.array_equal(dst, expected)

    res = {"total_bytes": total, "segment_bytes": seg, "threads": threads}
    res["numpy_1thread_s"] = best_of(numpy_copy, 7)
    res["native_1thread_s"] = best_of(lambda: ucm.copy_ranges(src, so, dst, do, lengths, 1, backend="native"), 7)
    res[f"native_{threads}threads_s"] = best_of(
        lambda: ucm.copy_ranges(src, so, dst, do, lengths, threads, backend="native"), 7)
    res["reference_memmove_s"] = best_of(
        lambda: ucm.copy_ranges(src, so, dst, do, lengths, 1, backend="reference"), 3)
    res["ceiling_contiguous_numpy_s"] = best_of(lambda: np.copyto(dst, src), 7)
    res["ceiling_contiguous_native_s"] = best_of(
        lambda: ucm.copy_ranges(src, [0], dst, [0], [total], threads, backend="native"), 7)
    # the same numpy copy between ordinary (4 KiB page) numpy buffers, for context
    s4, d4 = np.array(src), np.zeros_like(src)
    res["numpy_1thread_plain_buffers_s"] = best_of(lambda: numpy_copy(d4, s4), 7)
    res["native_vs_numpy"] = res["numpy_1thread_s"] / res[f"native_{threads}threads_s"]
    for k in [k for k in res if k.endswith("_s")]:
        res[k.replace("_s", "_GBps")] = total / res[k] / 1e9
    return res


def find_vllm_python(explicit):
    if explicit:
        return explicit
    candidates = [os.environ.get("UCM_VLLM_PYTHON"), sys.executable,
                  os.path.join(os.path.dirname(os.path.dirname(HERE)), "vllm-venv", "bin", "python")]
    for c in candidates:
        if c and os.path.exists(c) and subprocess.run([c, "-c", "import vllm"], capture_output=True).returncode == 0:
            return c
    return None


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--vllm-python", help="interpreter with vLLM installed (default: search)")
    p.add_argument("--json", help="write the raw figures here")
    args = p.parse_args()
    machine = f"{platform.node()} {platform.machine()} {os.cpu_count()} cores"
    print(f"# foundation benchmarks on {machine}, {time.strftime('%Y-%m-%d')}", flush=True)
    print("backends:", {op: e["selected"] for op, e in ucm.backend_info()["ops"].items()}, flush=True)
    vllm_python = find_vllm_python(args.vllm_python)
    h = bench_hashing(vllm_python)
    print(f"hash_blocks 128K tokens/16: numba {h['numba_s'] * 1e3:.3f} ms, reference "
          f"{h['reference_s'] * 1e3:.1f} ms -> {h['numba_vs_reference']:.0f}x", flush=True)
    if "vllm_s" in h:
        print(f"  vLLM {h['vllm_version']} {h['vllm_algo']}: {h['vllm_s'] * 1e3:.2f} ms -> numba is "
              f"{h['numba_vs_vllm']:.1f}x faster", flush=True)
    else:
        print(f"  vLLM comparison skipped: {h.get('vllm_error', 'no interpreter with vllm found')}")
    i = bench_index()
    print(f"lookup_prefix 1M ids: numba {i['numba_s'] * 1e3:.2f} ms, reference {i['reference_s'] * 1e3:.0f} ms"
          f" -> {i['numba_vs_reference']:.0f}x", flush=True)
    c = bench_copy()
    print(f"copy_segments 256 MiB / 64 KiB scattered: native 2 threads {c['native_2threads_GBps']:.2f} GB/s, "
          f"numpy 1 thread {c['numpy_1thread_GBps']:.2f} GB/s -> {c['native_vs_numpy']:.2f}x; "
          f"native 1 thread {c['native_1thread_GBps']:.2f} GB/s; reference memmove "
          f"{c['reference_memmove_GBps']:.2f} GB/s; contiguous ceiling numpy "
          f"{c['ceiling_contiguous_numpy_GBps']:.2f} / native {c['ceiling_contiguous_native_GBps']:.2f} GB/s; "
          f"numpy on plain 4K-page buffers {c['numpy_1thread_plain_buffers_GBps']:.2f} GB/s", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": machine, "date": time.strftime("%Y-%m-%d"), "hashing": h, "index": i,
                       "copy": c}, f, indent=1)


if __name__ == "__main__":
    main()
