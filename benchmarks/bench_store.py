#!/usr/bin/env python3
"""Store throughput vs the physical baselines, ratios measured in one run (CPU machine).

    python benchmarks/bench_store.py [--dir DIR] [--gib 1] [--json out.json]

* posix tier: dump (dump + wait + commit) and load of 1 GiB in 2 MiB blocks vs ``dd`` writing
  and reading the same number of bytes on the same filesystem with ``bs=2M``, in two caching
  modes: buffered (page cache: dd plain, ucm default) and direct (dd ``oflag/iflag=direct``, ucm
  ``o_direct=True``). Buffered reads are from a warm page cache for both.
* memory tier: dump and load of the same bytes vs a multi-threaded memcpy of the same segments
  (the native engine's ``copy_segments`` with the same thread count, one call).

Every timing is the best of ``--repeats``; each figure is printed after a byte-exact check.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np

import ucm

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from foundation import best_of as best  # noqa: E402
from ucm.store import BlockGeometry
from ucm.store.memory import MemoryStore
from ucm.store.posix import PosixStore

BLOCK = 2 << 20
SHARD = BLOCK // 32  # 32 "layers"


def dd(args) -> float:
    """Seconds dd reports for its own transfer."""
    r = subprocess.run(["dd", *args], capture_output=True, text=True, check=True)
    m = re.search(r"copied, ([0-9.]+) s", r.stderr)
    return float(m.group(1))


def bench_posix(workdir, n_blocks, repeats, direct):
    nbytes = n_blocks * BLOCK
    data = ucm.alloc_aligned(nbytes).reshape(n_blocks, BLOCK)
    data[:] = np.random.default_rng(0).integers(0, 256, data.shape, dtype=np.uint8)
    dst = ucm.alloc_aligned(nbytes).reshape(n_blocks, BLOCK)
    ddfile = os.path.join(workdir, "dd.bin")
    flag_w = ["oflag=direct"] if direct else []
    flag_r = ["iflag=direct"] if direct else []
    res = {"mode": "direct" if direct else "buffered", "bytes": nbytes}

    res["dd_write_s"] = min(dd(["if=/dev/zero", f"of={ddfile}", "bs=2M", f"count={n_blocks}", *flag_w])
                            for _ in range(repeats))
    res["dd_read_s"] = min(dd([f"if={ddfile}", "of=/dev/null", "bs=2M", *flag_r]) for _ in range(repeats))
    os.unlink(ddfile)

    root = os.path.join(workdir, "posix")
    times_w, times_r = [], []
    for rep in range(repeats):
        shutil.rmtree(root, ignore_errors=True)
        os.makedirs(root)
        s = PosixStore(BlockGeometry(BLOCK, SHARD), [root], bytes(16), capacity_bytes=4 * nbytes,
                       o_direct=direct, io_threads=2)
        ids = np.stack([np.arange(n_blocks, dtype=np.uint64) + np.uint64(rep * n_blocks),
                        np.full(n_blocks, 7, dtype=np.uint64)], axis=1)
        t0 = time.perf_counter()
        r = s.wait(s.dump(ids, 0, data), timeout=600)
        s.commit(ids, r.ok)
        times_w.append(time.perf_counter() - t0)
        assert r.all_ok
        s.wait(s.load(ids[:4], 0, dst[:4]))  # warm-up
        t0 = time.perf_counter()
        r = s.wait(s.load(ids, 0, dst), timeout=600)
        times_r.append(time.perf_counter() - t0)
        assert r.all_ok and np.array_equal(dst, data)
        dst[:] = 0
        s.close()
    shutil.rmtree(root, ignore_errors=True)
    res["ucm_dump_s"], res["ucm_load_s"] = min(times_w), min(times_r)
    res["dump_vs_dd"] = res["dd_write_s"] / res["ucm_dump_s"]
    res["load_vs_dd"] = res["dd_read_s"] / res["ucm_load_s"]
    for k in ("dd_write", "dd_read", "ucm_dump", "ucm_load"):
        res[k + "_GBps"] = nbytes / res[k + "_s"] / 1e9
    return res


def bench_memory(n_blocks, repeats, threads=2):
    nbytes = n_blocks * BLOCK
    data = ucm.alloc_aligned(nbytes).reshape(n_blocks, BLOCK)
    data[:] = np.random.default_rng(1).integers(0, 256, data.shape, dtype=np.uint8)
    dst = ucm.alloc_aligned(nbytes).reshape(n_blocks, BLOCK)
    s = MemoryStore(BlockGeometry(BLOCK, SHARD), buffer_number=n_blocks, io_threads=2,
                    copy_threads=threads)
    ids = np.stack([np.arange(n_blocks, dtype=np.uint64), np.full(n_blocks, 3, np.uint64)], axis=1)
    r = s.wait(s.dump(ids, 0, data))
    s.commit(ids, r.ok)
    assert r.all_ok
    r = s.wait(s.load(ids, 0, dst))
    assert r.all_ok and np.array_equal(dst, data)

    ids2 = ids.copy()
    ids2[:, 1] = 99  # never committed: every repeat writes every slot
    # a second pool, so every timed dump writes every slot (then discards: slots come back)
    s2 = MemoryStore(BlockGeometry(BLOCK, SHARD), buffer_number=n_blocks, io_threads=2,
                     copy_threads=threads)

    def dump_once():
        rr = s2.wait(s2.dump(ids2, 0, data))
        s2.commit(ids2, False)  # discard: slots return to the pool
        assert rr.all_ok

    res = {"bytes": nbytes, "threads": threads}
    res["ucm_dump_s"] = best(dump_once, repeats)
    res["ucm_load_s"] = best(lambda: s.wait(s.load(ids, 0, dst)), repeats)
    src_addrs = np.uint64(data.ctypes.data) + np.arange(n_blocks, dtype=np.uint64) * np.uint64(BLOCK)
    pool_addrs = np.uint64(s.pool.ctypes.data) + np.arange(n_blocks, dtype=np.uint64) * np.uint64(BLOCK)
    lens = np.full(n_blocks, BLOCK, np.uint64)
    res["memcpy_s"] = best(lambda: ucm.copy_segments(src_addrs, pool_addrs, lens, threads), repeats)
    res["dump_vs_memcpy"] = res["memcpy_s"] / res["ucm_dump_s"]
    res["load_vs_memcpy"] = res["memcpy_s"] / res["ucm_load_s"]
    for k in ("ucm_dump", "ucm_load", "memcpy"):
        res[k + "_GBps"] = nbytes / res[k + "_s"] / 1e9
    s.close()
    s2.close()
    return res


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", default=None, help="directory on the filesystem to test (default: a temp dir)")
    p.add_argument("--gib", type=float, default=1.0)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json")
    args = p.parse_args()
    n_blocks = int(args.gib * 1024 * 1024 * 1024) // BLOCK
    workdir = tempfile.mkdtemp(prefix="ucm-bench-", dir=args.dir)
    machine = f"{platform.node()} {platform.machine()} {os.cpu_count()} cores"
    fs = subprocess.run(["df", "-T", workdir], capture_output=True, text=True).stdout.splitlines()[-1].split()[1]
    print(f"# store benchmarks on {machine}, filesystem {fs} ({workdir}), {time.strftime('%Y-%m-%d')}")
    out = {"machine": machine, "filesystem": fs, "date": time.strftime("%Y-%m-%d")}
    try:
        for direct in (False, True):
            r = bench_posix(workdir, n_blocks, args.repeats, direct)
            out["posix_" + r["mode"]] = r
            print(f"posix {r['mode']:>8}: dump {r['ucm_dump_GBps']:.2f} GB/s vs dd write {r['dd_write_GBps']:.2f}"
                  f" -> {r['dump_vs_dd']:.2f}x; load {r['ucm_load_GBps']:.2f} GB/s vs dd read "
                  f"{r['dd_read_GBps']:.2f} -> {r['load_vs_dd']:.2f}x", flush=True)
        m = bench_memory(n_blocks, args.repeats)
        out["memory"] = m
        print(f"memory tier: dump {m['ucm_dump_GBps']:.2f} GB/s, load {m['ucm_load_GBps']:.2f} GB/s vs "
              f"{m['threads']}-thread memcpy {m['memcpy_GBps']:.2f} -> {m['dump_vs_memcpy']:.2f}x / "
              f"{m['load_vs_memcpy']:.2f}x", flush=True)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
