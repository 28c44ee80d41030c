#!/usr/bin/env python3
"""Threads hammering one store: dumps (with duplicates and present ids), commits, loads and
lookups of a shared pool of blocks, every loaded byte checked against what its id must hold.

    python benchmarks/store_threads.py [--pipeline memory|posix] [--threads 8] [--seconds 10]
                                       [--slots 64] [--budget-blocks 96] [--tree DIR] [--json F]

Reports operations per second and wrong-but-ok loads (a load reported ok whose bytes are not
its block's). ``--tree`` imports ucm from another checkout (for example a base revision, to
show a bug that the current tree fixes). Small pools keep eviction busy: 256 keys, 64 memory
slots and a 96-block disk budget by default.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import threading
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pipeline", default="memory|posix")
    ap.add_argument("--threads", type=int, default=8)
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--keys", type=int, default=256)
    ap.add_argument("--slots", type=int, default=64)
    ap.add_argument("--budget-blocks", type=int, default=96)
    ap.add_argument("--write-back", action="store_true")
    ap.add_argument("--tree", help="import ucm from this checkout")
    ap.add_argument("--json")
    args = ap.parse_args()
    if args.tree:
        sys.path.insert(0, os.path.abspath(args.tree))
    else:
        sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import numpy as np

    import ucm
    from ucm.store import open_store

    block, shard = 8192, 4096
    rng0 = np.random.default_rng(5)
    table = rng0.integers(0, 256, (args.keys, block), dtype=np.uint8)  # key k's bytes: row k
    ids = np.stack([np.arange(1, args.keys + 1, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15),
                    np.arange(args.keys, dtype=np.uint64)], axis=1)
    root = tempfile.mkdtemp(prefix="ucm-threads-")
    cfg = {"store": {"pipeline": args.pipeline, "write_back": args.write_back, "io_threads": 2,
                     "posix": {"roots": [root]}},
           "buffer_number": args.slots, "cache_capacity": args.budget_blocks * (block + 4096)}
    store = open_store(cfg, block_bytes=block, shard_bytes=shard, namespace=bytes(range(16)))
    counts = {"ops": 0, "dump": 0, "load": 0, "lookup": 0, "load_ok": 0, "wrong": 0}
    lock = threading.Lock()
    stop = time.monotonic() + args.seconds

    def work(seed):
        rng = np.random.default_rng(seed)
        local = dict.fromkeys(counts, 0)
        while time.monotonic() < stop:
            keys = rng.integers(0, args.keys, int(rng.integers(1, 9)))
            op = rng.random()
            if op < 0.4:
                r = store.wait(store.dump(ids[keys], 0, table[keys]))
                store.commit(ids[keys], r.ok)
                local["dump"] += 1
            elif op < 0.85:
                dst = np.zeros((len(keys), block), np.uint8)
                r = store.wait(store.load(ids[keys], 0, dst))
                ok = np.flatnonzero(r.ok)
                local["load"] += 1
                local["load_ok"] += len(ok)
                local["wrong"] += int(sum(not np.array_equal(dst[i], table[keys[i]]) for i in ok))
            else:
                store.lookup(ids[keys])
                local["lookup"] += 1
            local["ops"] += 1
        with lock:
            for k, v in local.items():
                counts[k] += v

    t0 = time.perf_counter()
    threads = [threading.Thread(target=work, args=(s,)) for s in range(args.threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - t0
    store.close()
    out = {**counts, "seconds": elapsed, "ops_per_s": counts["ops"] / elapsed, "pipeline": args.pipeline,
           "write_back": args.write_back, "threads": args.threads, "tree": args.tree or "this",
           "ucm": os.path.dirname(ucm.__file__), "machine": platform.platform(), "cpus": os.cpu_count(),
           "date": time.strftime("%Y-%m-%d")}
    print(f"{args.pipeline}{' write-back' if args.write_back else ''}, {args.threads} threads, "
          f"{elapsed:.1f} s: {counts['ops']} ops ({out['ops_per_s']:.0f}/s), {counts['load_ok']} blocks "
          f"loaded ok, {counts['wrong']} of them wrong")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    import shutil

    shutil.rmtree(root, ignore_errors=True)
    sys.exit(1 if counts["wrong"] else 0)


if __name__ == "__main__":
    main()
