#!/usr/bin/env python3
"""What a change to the store costs: this tree against a base revision, in one run.

    python benchmarks/store_ab.py --base REV [--rounds 5] [--json out.json]

The base revision is checked out into a scratch worktree (``--scratch``, default under the
system temp directory) and its native engine built there once; then every case runs in fresh
worker processes, alternating base and this tree round by round (ABAB...), so both see the same
machine state. Each worker times its case as the best of three (after ``sync``, so that dirty
pages of earlier runs are not written back during a timing) and checks the bytes it loads.
Reported: the median seconds per side and ratio = this tree / base (< 1: faster).

Cases (posix tier on the scratch directory's filesystem, page cache warm for loads; memory tier
in RAM), each with the tier's own defaults except 2 I/O threads:
  posix_dump_64k / posix_load_64k   512 blocks of 64 KiB (4 shards), batches of 64
  posix_lookup                      4,096 ids, half present, 10 lookups
  posix_dump_2m / posix_load_2m     128 blocks of 2 MiB (32 shards), batches of 32
  memory_dump_64k / memory_load_64k 512 blocks of 64 KiB, batches of 64
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
TREE = os.path.dirname(HERE)
CASES = ["posix_dump_64k", "posix_load_64k", "posix_lookup", "posix_dump_2m", "posix_load_2m",
         "memory_dump_64k", "memory_load_64k"]


# ---------------------------------------------------------------------------------------------
# worker: one case on one tree

def worker(tree: str, case: str, workdir: str) -> dict:
    sys.path.insert(0, tree)
    import numpy as np

    import ucm
    from ucm.store import BlockGeometry
    from ucm.store.memory import MemoryStore
    from ucm.store.posix import PosixStore

    assert os.path.dirname(os.path.abspath(ucm.__file__)) == os.path.join(tree, "ucm"), ucm.__file__
    big = case.endswith("2m")
    block, shards, n, batch = ((2 << 20, 32, 128, 32) if big else (64 << 10, 4, 512, 64))
    geo = BlockGeometry(block, block // shards)
    rng = np.random.default_rng(0)
    data = rng.integers(0, 256, (n, block), dtype=np.uint8)
    ids = np.stack([rng.integers(1, 2**63, n, dtype=np.uint64), np.arange(n, dtype=np.uint64)], 1)
    runs = []

    def timed(fn, setup=None):
        for _ in range(3):
            if setup:
                setup()
            os.sync()  # dirty pages of earlier runs are written back before, not during, timing
            t0 = time.perf_counter()
            fn()
            runs.append(time.perf_counter() - t0)
        return min(runs)

    def make_posix(k=[0]):
        k[0] += 1
        root = os.path.join(workdir, f"root{k[0]}")
        os.mkdir(root)
        return PosixStore(geo, [root], bytes(16), capacity_bytes=4 * n * (block + 4096) + (1 << 20),
                          io_threads=2)

    def dump_all(store):
        for s in range(0, n, batch):
            r = store.wait(store.dump(ids[s:s + batch], 0, data[s:s + batch]))
            assert r.all_ok, r.errors
            store.commit(ids[s:s + batch], r.ok)

    dst = np.zeros_like(data)

    def load_all(store):
        for s in range(0, n, batch):
            r = store.wait(store.load(ids[s:s + batch], 0, dst[s:s + batch]))
            assert r.all_ok, r.errors

    if case.startswith("posix_dump"):
        state = {}

        def setup():
            if "s" in state:
                state["s"].close()
            state["s"] = make_posix()
        secs = timed(lambda: dump_all(state["s"]), setup)
        state["s"].close()
    elif case.startswith("posix_load"):
        s = make_posix()
        dump_all(s)
        secs = timed(lambda: load_all(s))
        assert np.array_equal(dst, data)
        s.close()
    elif case == "posix_lookup":
        s = make_posix()
        dump_all(s)
        probe = np.concatenate([ids] * 4 + [ids[::-1] + np.uint64(1)] * 4)  # 4,096, half absent
        found = []
        secs = timed(lambda: [found.append(sum(s.lookup(probe))) for _ in range(10)])
        assert found[0] == 4 * n, found[0]
        s.close()
    elif case == "memory_dump_64k":
        state = {}

        def setup():
            if "s" in state:
                state["s"].close()
            state["s"] = MemoryStore(geo, buffer_number=n, io_threads=2)
            state["s"].prepare()
        secs = timed(lambda: dump_all(state["s"]), setup)
        state["s"].close()
    elif case == "memory_load_64k":
        s = MemoryStore(geo, buffer_number=n, io_threads=2)
        dump_all(s)
        secs = timed(lambda: load_all(s))
        assert np.array_equal(dst, data)
        s.close()
    else:
        raise SystemExit(f"unknown case {case}")
    return {"seconds": secs, "bytes": int(data.nbytes), "runs": runs}


# ---------------------------------------------------------------------------------------------
# driver

def prepare_base(rev: str, scratch: str) -> str:
    path = os.path.join(scratch, f"ucm-base-{rev[:12]}")
    if not os.path.exists(os.path.join(path, "ucm")):
        subprocess.run(["git", "-C", TREE, "worktree", "add", "--detach", "--force", path, rev], check=True,
                       capture_output=True)
    if not any(f.startswith("_native") and f.endswith(".so") for f in os.listdir(os.path.join(path, "ucm"))):
        subprocess.run([sys.executable, "setup.py", "-q", "build_ext", "--inplace"], cwd=path, check=True,
                       capture_output=True)
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", help="git revision to compare against (required)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--scratch", default=tempfile.gettempdir())
    ap.add_argument("--json")
    ap.add_argument("--worker", nargs=3, metavar=("TREE", "CASE", "WORKDIR"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker(*args.worker)))
        return
    if not args.base:
        ap.error("--base REV is required")
    base = prepare_base(args.base, args.scratch)
    trees = {"base": base, "this": TREE}
    times = {c: {"base": [], "this": []} for c in args.cases.split(",")}
    for rnd in range(args.rounds):
        for case in times:
            for side in (("base", "this") if rnd % 2 == 0 else ("this", "base")):
                work = tempfile.mkdtemp(prefix="ucm-ab-", dir=args.scratch)
                try:
                    env = dict(os.environ, PYTHONPATH=trees[side])
                    r = subprocess.run([sys.executable, __file__, "--worker", trees[side], case, work],
                                       capture_output=True, text=True, env=env, cwd=work)
                    if r.returncode:
                        raise SystemExit(f"{side} {case} failed:\n{r.stderr}")
                    times[case][side].append(json.loads(r.stdout.strip().splitlines()[-1])["seconds"])
                finally:
                    shutil.rmtree(work, ignore_errors=True)
        print(f"round {rnd + 1}/{args.rounds} done", file=sys.stderr)
    rows = []
    print(f"{'case':<18} {'base ms':>9} {'this ms':>9} {'this/base':>9}")
    for case, t in times.items():
        b, s = statistics.median(t["base"]), statistics.median(t["this"])
        rows.append({"case": case, "base_s": b, "this_s": s, "ratio": s / b, "base_runs": t["base"],
                     "this_runs": t["this"]})
        print(f"{case:<18} {b * 1e3:9.2f} {s * 1e3:9.2f} {s / b:9.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"base": args.base, "machine": platform.platform(), "cpus": os.cpu_count(),
                       "date": time.strftime("%Y-%m-%d"), "rounds": args.rounds, "cases": rows}, f, indent=1)


if __name__ == "__main__":
    main()
