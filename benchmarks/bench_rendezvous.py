"""Load balance and membership changes of the distributed tiers' rendezvous hashing
(``ucm.store.membership.rendezvous``), on random 128-bit block ids (ucm's ids are hashes).

    .venv/bin/python benchmarks/bench_rendezvous.py [--ids 100000] [--servers 4] [--trials 5] [--seed 0]

Reports, per trial (different ids and server names): max/mean blocks per server; the fraction
of blocks that move when one server joins (ideal 1/(n+1)) and whether all of them go to the
newcomer; the fraction that moves when one leaves (ideal 1/n) and whether any block of a
remaining server moves (must be none); routing throughput in ids/s.
"""
from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np

from ucm.store.membership import rendezvous
from _argtypes import count as _count  # noqa: E402


def trial(seed: int, n_ids: int, n_servers: int) -> dict:
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, 2**64, size=(n_ids, 2), dtype=np.uint64)
    names = [f"redis://10.{seed}.0.{i}:6379/0" for i in range(n_servers)]
    t0 = time.perf_counter()
    owner = rendezvous(ids, names)
    route_s = time.perf_counter() - t0
    counts = np.bincount(owner, minlength=n_servers)
    joined = names + [f"redis://10.{seed}.1.1:6379/0"]
    after_join = np.asarray(joined)[rendezvous(ids, joined)]
    before = np.asarray(names)[owner]
    moved_join = before != after_join
    leaver = names[int(rng.integers(n_servers))]
    left = [n for n in names if n != leaver]
    after_leave = np.asarray(left)[rendezvous(ids, left)]
    moved_leave = before != after_leave
    return {"max_over_mean": float(counts.max() / counts.mean()),
            "join_moved": float(moved_join.mean()), "join_ideal": 1 / (n_servers + 1),
            "join_all_to_newcomer": bool((after_join[moved_join] == joined[-1]).all()),
            "leave_moved": float(moved_leave.mean()), "leave_ideal": 1 / n_servers,
            "leave_only_its_blocks": bool((before[moved_leave] == leaver).all()),
            "route_ids_per_s": n_ids / route_s}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ids", type=_count(1), default=100_000, help="block ids (default %(default)s)")
    ap.add_argument("--servers", type=_count(2), default=4,
                    help="servers, >= 2 (one leaves; default %(default)s)")
    ap.add_argument("--trials", type=_count(1), default=5, help="default %(default)s")
    ap.add_argument("--seed", type=_count(0), default=0,
                    help="seed of the first trial; trial k uses SEED + k (default %(default)s)")
    ap.add_argument("--json", help="write the results here")
    a = ap.parse_args()
    rows = [trial(s, a.ids, a.servers) for s in range(a.seed, a.seed + a.trials)]
    for r in rows:
        print(f"max/mean {r['max_over_mean']:.4f}  join moved {r['join_moved']:.4f} "
              f"(ideal {r['join_ideal']:.4f}, all to newcomer: {r['join_all_to_newcomer']})  "
              f"leave moved {r['leave_moved']:.4f} (ideal {r['leave_ideal']:.4f}, only its "
              f"blocks: {r['leave_only_its_blocks']})  {r['route_ids_per_s'] / 1e6:.1f} M ids/s")
    worst = {"max_over_mean": max(r["max_over_mean"] for r in rows),
             "join_moved_max": max(r["join_moved"] for r in rows),
             "all_correct": all(r["join_all_to_newcomer"] and r["leave_only_its_blocks"] for r in rows)}
    print("worst:", json.dumps(worst))
    if a.json:
        os.makedirs(os.path.dirname(os.path.abspath(a.json)), exist_ok=True)
        with open(a.json, "w") as f:
            json.dump({"ids": a.ids, "servers": a.servers, "seed": a.seed, "trials": rows,
                       "worst": worst}, f, indent=1)


if __name__ == "__main__":
    main()
