#!/usr/bin/env python3
"""The store's tiers against the physical baselines (dd, memcpy), against a base revision, and
under threads; every loaded byte checked.

    pytest benchmarks/bench_store.py [--benchmark-disable]
    python benchmarks/bench_store.py [tiers] [--dir DIR] [--gib 1] [--repeats 3] [--json benchmarks/results/bench_store_cpu.json]
    python benchmarks/bench_store.py ab --base REV [--rounds 9] [--json benchmarks/results/bench_store_ab_cpu.json]
    python benchmarks/bench_store.py threads [--pipeline memory --pipeline 'memory|posix'] [--write-back]
                                             [--base REV] [--json benchmarks/results/bench_store_threads_cpu.json]

pytest-benchmark, one group per operation (128 MiB in 2 MiB blocks of 32 shards, ucm with 2 I/O
threads; a provider's output is checked before and after its timing):

* ``dump``: ``memory``, ``posix`` (buffered), ``posix_direct`` (``O_DIRECT``) against the
  ceiling ``memcpy`` (the same segments into a pool, native engine, 2 threads) and the peer
  ``dd`` (``dd bs=2M`` writing as many bytes on the same filesystem, process start included);
* ``load``: the same providers (``dd`` reads the file back to /dev/null, page cache warm);
* ``lookup``: 4,096 ids, half present, on ``memory`` and ``posix``.

``tiers`` (the script's default): the ratios RESULTS.md cites, in one run, 1 GiB in 2 MiB blocks:
posix dump (dump + wait + commit) and load against ``dd`` writing and reading the same bytes
with ``bs=2M`` (dd's own reported time), buffered (page cache) and direct (``oflag/iflag=direct``,
ucm ``o_direct=True``); the memory tier's dump and load against a 2-thread memcpy of the same
segments. Best of ``--repeats``; a byte-exact check after every load.

``ab``: this tree against ``--base REV`` in one run. The base is checked out into a scratch
worktree (``--scratch``, default the system temp directory) and its native engine built there
once; every case then runs in fresh worker processes, alternating base and this tree round by
round, so both see the same machine state. A worker times its case as the best of three (after
``sync``) and checks the bytes it loads. Reported: median seconds per side, ratio this / base
(< 1: faster). Cases, 2 I/O threads, each tier's defaults otherwise: ``posix_dump_64k`` /
``posix_load_64k`` (512 blocks of 64 KiB, 4 shards, batches of 64), ``posix_lookup`` (4,096 ids,
half present, 10 lookups), ``posix_dump_2m`` / ``posix_load_2m`` (128 blocks of 2 MiB, 32
shards, batches of 32), ``memory_dump_64k`` / ``memory_load_64k``.

``threads``: ``--threads`` threads hammer one store for ``--seconds``: dumps (with duplicates and
present ids), commits, loads and lookups of a shared pool of 256 keys (64 memory slots, a
96-block disk budget: eviction stays busy), every loaded byte checked against what its id must
hold. Reported per pipeline: operations per second and wrong-but-ok loads (a load reported ok
whose bytes are not its block's). With ``--base REV`` the base runs the same load right after
(to show a bug this tree fixes). Exits 1 if this tree loaded a wrong block.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
TREE = os.path.dirname(HERE)
WORKERS = ("_ab-worker", "_threads-worker")
if __name__ == "__main__" and sys.argv[1:2] and sys.argv[1] in WORKERS:
    pass  # a worker imports ucm from the tree its PYTHONPATH names (this one or a base revision)
elif __name__ == "__main__":
    sys.path.insert(0, TREE)

import numpy as np  # noqa: E402
import pytest  # noqa: E402

import ucm  # noqa: E402
from ucm.store import BlockGeometry, open_store  # noqa: E402
from ucm.store.memory import MemoryStore  # noqa: E402
from ucm.store.posix import PosixStore  # noqa: E402

BLOCK = 2 << 20
SHARD = BLOCK // 32  # 32 "layers"


from bench_foundation import best_of as best  # noqa: E402
from _argtypes import count as _count, number, write_json  # noqa: E402

_positive_number = number(0.0, exclusive_min=True)


def dd(args) -> float:
    """Seconds dd reports for its own transfer."""
    r = subprocess.run(["dd", *args], capture_output=True, text=True, check=True)
    return float(re.search(r"copied, ([0-9.]+) s", r.stderr).group(1))


def block_ids(n: int, tag: int) -> np.ndarray:
    return np.stack([np.arange(n, dtype=np.uint64) + np.uint64(1), np.full(n, tag, dtype=np.uint64)], axis=1)


def random_blocks(n: int, block: int, seed: int) -> np.ndarray:
    data = ucm.alloc_aligned(n * block).reshape(n, block)
    data[:] = np.random.default_rng(seed).integers(0, 256, data.shape, dtype=np.uint8)
    return data


def dump_commit(store, ids, data, timeout=600) -> None:
    r = store.wait(store.dump(ids, 0, data), timeout=timeout)
    store.commit(ids, r.ok)
    if not r.all_ok:
        raise AssertionError(f"dump failed: {r.errors}")


def load_exact(store, ids, dst, data, timeout=600) -> None:
    """Load ``ids`` into ``dst``; raises unless every block is ok and equal to ``data``."""
    dst[:] = 0
    r = store.wait(store.load(ids, 0, dst), timeout=timeout)
    if not (r.all_ok and np.array_equal(dst, data)):
        raise AssertionError("load: a block failed or its bytes differ from what was dumped")


# ---------------------------------------------------------------------------------------------
# pytest-benchmark

PYTEST_BLOCKS = 64  # 128 MiB


class Tiers:
    """Stores and buffers of the pytest cases (one set per module)."""

    def __init__(self, workdir: str, n: int):
        self.workdir, self.n = workdir, n
        self.geo = BlockGeometry(BLOCK, SHARD)
        self.data = random_blocks(n, BLOCK, 0)
        self.dst = ucm.alloc_aligned(n * BLOCK).reshape(n, BLOCK)
        self.tag = 0
        self.stores = []

    def posix(self, direct: bool):
        root = tempfile.mkdtemp(dir=self.workdir)
        s = PosixStore(self.geo, [root], bytes(16), capacity_bytes=64 * self.n * BLOCK, o_direct=direct,
                       io_threads=2)
        self.stores.append(s)
        return s

    def memory(self):
        s = MemoryStore(self.geo, buffer_number=self.n, io_threads=2, copy_threads=2)
        s.prepare()
        self.stores.append(s)
        return s

    def fresh_ids(self):
        self.tag += 1
        return block_ids(self.n, self.tag)

    def close(self):
        for s in self.stores:
            s.close()


@pytest.fixture(scope="module")
def tiers():
    work = tempfile.mkdtemp(prefix="ucm-bench-store-")
    t = Tiers(work, PYTEST_BLOCKS)
    yield t
    t.close()
    shutil.rmtree(work, ignore_errors=True)


def _memcpy(t: Tiers, dst, src):
    addrs = lambda a: np.uint64(a.ctypes.data) + np.arange(t.n, dtype=np.uint64) * np.uint64(BLOCK)  # noqa: E731
    so, do, lens = addrs(src), addrs(dst), np.full(t.n, BLOCK, np.uint64)
    return lambda: ucm.copy_segments(so, do, lens, 2)


def _bench_memcpy(benchmark, t: Tiers, src) -> None:
    """The ceiling: a 2-thread copy of the same segments into the destination, checked."""
    run = _memcpy(t, t.dst, src)
    t.dst[:] = 0
    benchmark.pedantic(run, rounds=5, warmup_rounds=1)
    assert np.array_equal(t.dst, src)


@pytest.mark.parametrize("provider", ["memory", "posix", "posix_direct", "memcpy", "dd"])
def test_dump(benchmark, tiers, provider):
    t = tiers
    benchmark.group = "dump"
    benchmark.extra_info.update(bytes=t.n * BLOCK, block_bytes=BLOCK)
    if provider == "memory":
        s = t.memory()
        ids = t.fresh_ids()
        dump_commit(s, ids, t.data)
        load_exact(s, ids, t.dst, t.data)
        scratch = t.fresh_ids()  # never committed: every dump writes every slot, then gives it back

        def run():
            r = s.wait(s.dump(scratch, 0, t.data))
            s.commit(scratch, False)
            assert r.all_ok, r.errors
        benchmark.pedantic(run, rounds=5, warmup_rounds=1)
    elif provider.startswith("posix"):
        state = {}

        def setup():  # a new store and new ids per round: nothing is skipped as present
            state["s"], state["ids"] = t.posix(provider == "posix_direct"), t.fresh_ids()
        benchmark.pedantic(lambda: dump_commit(state["s"], state["ids"], t.data), setup=setup, rounds=3)
        load_exact(state["s"], state["ids"], t.dst, t.data)
    elif provider == "memcpy":
        _bench_memcpy(benchmark, t, t.data)
    else:
        path = os.path.join(t.workdir, "dd.bin")
        benchmark.pedantic(lambda: dd(["if=/dev/zero", f"of={path}", "bs=2M", f"count={t.n}"]), rounds=3)
        assert os.path.getsize(path) == t.n * BLOCK


@pytest.mark.parametrize("provider", ["memory", "posix", "posix_direct", "memcpy", "dd"])
def test_load(benchmark, tiers, provider):
    t = tiers
    benchmark.group = "load"
    benchmark.extra_info.update(bytes=t.n * BLOCK, block_bytes=BLOCK)
    if provider == "memcpy":
        _bench_memcpy(benchmark, t, random_blocks(t.n, BLOCK, 1))
        return
    if provider == "dd":
        path = os.path.join(t.workdir, "dd-read.bin")
        t.data.tofile(path)
        benchmark.pedantic(lambda: dd([f"if={path}", "of=/dev/null", "bs=2M"]), rounds=3, warmup_rounds=1)
        return
    s = t.memory() if provider == "memory" else t.posix(provider == "posix_direct")
    ids = t.fresh_ids()
    dump_commit(s, ids, t.data)
    load_exact(s, ids, t.dst, t.data)
    benchmark.pedantic(lambda: s.wait(s.load(ids, 0, t.dst), timeout=600), rounds=5, warmup_rounds=1)
    load_exact(s, ids, t.dst, t.data)


@pytest.mark.parametrize("provider", ["memory", "posix"])
def test_lookup(benchmark, tiers, provider):
    t = tiers
    benchmark.group = "lookup"
    s = t.memory() if provider == "memory" else t.posix(False)
    ids = t.fresh_ids()
    dump_commit(s, ids, t.data)
    absent = ids.copy()
    absent[:, 1] += np.uint64(1 << 40)
    probe = np.concatenate([ids] * 32 + [absent] * 32)  # 4,096 ids, half present
    benchmark.extra_info.update(ids=len(probe), present=len(probe) // 2)
    found = benchmark.pedantic(lambda: s.lookup(probe), rounds=5, warmup_rounds=1)
    assert list(found) == [True] * (32 * t.n) + [False] * (32 * t.n)


# ---------------------------------------------------------------------------------------------
# tiers: the ratios against dd and memcpy, in one run

def bench_posix(workdir, n_blocks, repeats, direct, block=BLOCK, shard=SHARD):
    nbytes = n_blocks * block
    data = random_blocks(n_blocks, block, 0)
    dst = ucm.alloc_aligned(nbytes).reshape(n_blocks, block)
    ddfile = os.path.join(workdir, "dd.bin")
    flag_w = ["oflag=direct"] if direct else []
    flag_r = ["iflag=direct"] if direct else []
    bs = f"bs={block >> 20}M" if block % (1 << 20) == 0 else f"bs={block}"
    res = {"mode": "direct" if direct else "buffered", "bytes": nbytes}
    res["dd_write_s"] = min(dd(["if=/dev/zero", f"of={ddfile}", bs, f"count={n_blocks}", *flag_w])
                            for _ in range(repeats))
    res["dd_read_s"] = min(dd([f"if={ddfile}", "of=/dev/null", bs, *flag_r]) for _ in range(repeats))
    os.unlink(ddfile)

    root = os.path.join(workdir, "posix")
    times_w, times_r = [], []
    for rep in range(repeats):
        shutil.rmtree(root, ignore_errors=True)
        os.makedirs(root)
        s = PosixStore(BlockGeometry(block, shard), [root], bytes(16), capacity_bytes=4 * nbytes,
                       o_direct=direct, io_threads=2)
        ids = block_ids(n_blocks, 7 + rep)
        t0 = time.perf_counter()
        dump_commit(s, ids, data)
        times_w.append(time.perf_counter() - t0)
        s.wait(s.load(ids[:4], 0, dst[:4]))  # warm-up
        dst[:] = 0
        t0 = time.perf_counter()
        r = s.wait(s.load(ids, 0, dst), timeout=600)
        times_r.append(time.perf_counter() - t0)
        if not (r.all_ok and np.array_equal(dst, data)):
            raise AssertionError(f"posix {res['mode']} load: wrong bytes")
        s.close()
    shutil.rmtree(root, ignore_errors=True)
    res["ucm_dump_s"], res["ucm_load_s"] = min(times_w), min(times_r)
    res["dump_vs_dd"] = res["dd_write_s"] / res["ucm_dump_s"]
    res["load_vs_dd"] = res["dd_read_s"] / res["ucm_load_s"]
    for k in ("dd_write", "dd_read", "ucm_dump", "ucm_load"):
        res[k + "_GBps"] = nbytes / res[k + "_s"] / 1e9
    return res


def bench_memory(n_blocks, repeats, threads=2, block=BLOCK, shard=SHARD):
    nbytes = n_blocks * block
    data = random_blocks(n_blocks, block, 1)
    dst = ucm.alloc_aligned(nbytes).reshape(n_blocks, block)
    geo = BlockGeometry(block, shard)
    s = MemoryStore(geo, buffer_number=n_blocks, io_threads=2, copy_threads=threads)
    ids = block_ids(n_blocks, 3)
    dump_commit(s, ids, data)
    load_exact(s, ids, dst, data)
    scratch = block_ids(n_blocks, 99)  # never committed: every repeat writes every slot
    # a second pool, so every timed dump writes every slot (then discards: slots come back)
    s2 = MemoryStore(geo, buffer_number=n_blocks, io_threads=2, copy_threads=threads)

    def dump_once():
        rr = s2.wait(s2.dump(scratch, 0, data))
        s2.commit(scratch, False)
        if not rr.all_ok:
            raise AssertionError(f"memory dump failed: {rr.errors}")

    res = {"bytes": nbytes, "threads": threads}
    res["ucm_dump_s"] = best(dump_once, repeats)
    dst[:] = 0
    res["ucm_load_s"] = best(lambda: s.wait(s.load(ids, 0, dst)), repeats)
    if not np.array_equal(dst, data):
        raise AssertionError("memory load: wrong bytes")
    src_addrs = np.uint64(data.ctypes.data) + np.arange(n_blocks, dtype=np.uint64) * np.uint64(block)
    pool_addrs = np.uint64(s.pool.ctypes.data) + np.arange(n_blocks, dtype=np.uint64) * np.uint64(block)
    lens = np.full(n_blocks, block, np.uint64)
    res["memcpy_s"] = best(lambda: ucm.copy_segments(src_addrs, pool_addrs, lens, threads), repeats)
    res["dump_vs_memcpy"] = res["memcpy_s"] / res["ucm_dump_s"]
    res["load_vs_memcpy"] = res["memcpy_s"] / res["ucm_load_s"]
    for k in ("ucm_dump", "ucm_load", "memcpy"):
        res[k + "_GBps"] = nbytes / res[k + "_s"] / 1e9
    s.close()
    s2.close()
    return res


def run_tiers(args) -> dict:
    n_blocks = int(args.gib * (1 << 30)) // BLOCK
    workdir = tempfile.mkdtemp(prefix="ucm-bench-", dir=args.dir)
    machine = f"{platform.node()} {platform.machine()} {os.cpu_count()} cores"
    fs = subprocess.run(["df", "-T", workdir], capture_output=True, text=True).stdout.splitlines()[-1].split()[1]
    print(f"# store tiers on {machine}, filesystem {fs} ({workdir}), {time.strftime('%Y-%m-%d')}")
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
    return out


# ---------------------------------------------------------------------------------------------
# ab: this tree against a base revision, alternating fresh worker processes

AB_CASES = ["posix_dump_64k", "posix_load_64k", "posix_lookup", "posix_dump_2m", "posix_load_2m",
            "memory_dump_64k", "memory_load_64k"]


def _check_tree(tree: str) -> None:
    here = os.path.dirname(os.path.abspath(ucm.__file__))
    if here != os.path.join(os.path.abspath(tree), "ucm"):
        raise SystemExit(f"worker for {tree} imported ucm from {here}")


def ab_worker(tree: str, case: str, workdir: str) -> dict:
    _check_tree(tree)
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
            dump_commit(store, ids[s:s + batch], data[s:s + batch])

    dst = np.zeros_like(data)

    def load_all(store):
        for s in range(0, n, batch):
            r = store.wait(store.load(ids[s:s + batch], 0, dst[s:s + batch]))
            assert r.all_ok, r.errors

    if case.startswith("posix_dump") or case == "memory_dump_64k":
        state = {}

        def setup():
            if "s" in state:
                state["s"].close()
            if case.startswith("posix"):
                state["s"] = make_posix()
            else:
                state["s"] = MemoryStore(geo, buffer_number=n, io_threads=2)
                state["s"].prepare()
        secs = timed(lambda: dump_all(state["s"]), setup)
        state["s"].close()
    elif case.startswith("posix_load") or case == "memory_load_64k":
        s = make_posix() if case.startswith("posix") else MemoryStore(geo, buffer_number=n, io_threads=2)
        dump_all(s)
        secs = timed(lambda: load_all(s))
        assert np.array_equal(dst, data), f"{case}: wrong bytes"
        s.close()
    elif case == "posix_lookup":
        s = make_posix()
        dump_all(s)
        probe = np.concatenate([ids] * 4 + [ids[::-1] + np.uint64(1)] * 4)  # 4,096, half absent
        found = []
        secs = timed(lambda: [found.append(sum(s.lookup(probe))) for _ in range(10)])
        assert found[0] == 4 * n, found[0]
        s.close()
    else:
        raise SystemExit(f"unknown case {case}")
    return {"seconds": secs, "bytes": int(data.nbytes), "runs": runs}


def prepare_base(rev: str, scratch: str) -> str:
    """A worktree of ``rev`` under ``scratch`` with its native engine built (reused if there)."""
    path = os.path.join(scratch, f"ucm-base-{rev[:12]}")
    if not os.path.exists(os.path.join(path, "ucm")):
        subprocess.run(["git", "-C", TREE, "worktree", "add", "--detach", "--force", path, rev], check=True,
                       capture_output=True)
    if not any(f.startswith("_native") and f.endswith(".so") for f in os.listdir(os.path.join(path, "ucm"))):
        subprocess.run([sys.executable, "setup.py", "-q", "build_ext", "--inplace"], cwd=path, check=True,
                       capture_output=True)
    return path


def _worker(kind: str, tree: str, args: list, cwd: str | None = None) -> dict:
    env = dict(os.environ, PYTHONPATH=tree)
    r = subprocess.run([sys.executable, os.path.abspath(__file__), kind, tree, *args], capture_output=True,
                       text=True, env=env, cwd=cwd)
    if r.returncode not in (0, 3):  # 3: a threads worker that loaded wrong blocks (reported)
        raise SystemExit(f"{kind} {tree} {args} failed:\n{r.stderr}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def run_ab(args) -> dict:
    base = prepare_base(args.base, args.scratch)
    trees = {"base": base, "this": TREE}
    times = {c: {"base": [], "this": []} for c in args.cases.split(",")}
    from ucm import progress

    for rnd in progress.track(range(args.rounds), "A/B rounds", unit="round"):
        for case in times:
            for side in (("base", "this") if rnd % 2 == 0 else ("this", "base")):
                work = tempfile.mkdtemp(prefix="ucm-ab-", dir=args.scratch)
                try:
                    times[case][side].append(_worker("_ab-worker", trees[side], [case, work], cwd=work)["seconds"])
                finally:
                    shutil.rmtree(work, ignore_errors=True)
    rows = []
    print(f"{'case':<18} {'base ms':>9} {'this ms':>9} {'this/base':>9}")
    for case, t in times.items():
        b, s = statistics.median(t["base"]), statistics.median(t["this"])
        rows.append({"case": case, "base_s": b, "this_s": s, "ratio": s / b, "base_runs": t["base"],
                     "this_runs": t["this"]})
        print(f"{case:<18} {b * 1e3:9.2f} {s * 1e3:9.2f} {s / b:9.3f}")
    return {"base": args.base, "machine": platform.platform(), "cpus": os.cpu_count(),
            "date": time.strftime("%Y-%m-%d"), "rounds": args.rounds, "cases": rows}


# ---------------------------------------------------------------------------------------------
# threads: many threads on one store, every loaded byte checked

def threads_worker(tree: str, spec: dict) -> dict:
    _check_tree(tree)
    keys, block, shard = spec["keys"], 8192, 4096
    table = np.random.default_rng(5).integers(0, 256, (keys, block), dtype=np.uint8)  # key k's bytes: row k
    ids = np.stack([np.arange(1, keys + 1, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15),
                    np.arange(keys, dtype=np.uint64)], axis=1)
    root = tempfile.mkdtemp(prefix="ucm-threads-")
    cfg = {"store": {"pipeline": spec["pipeline"], "write_back": spec["write_back"], "io_threads": 2,
                     "posix": {"roots": [root]}},
           "buffer_number": spec["slots"], "cache_capacity": spec["budget_blocks"] * (block + 4096)}
    store = open_store(cfg, block_bytes=block, shard_bytes=shard, namespace=bytes(range(16)))
    counts = {"ops": 0, "dump": 0, "load": 0, "lookup": 0, "load_ok": 0, "wrong": 0}
    lock = threading.Lock()
    # warm-up, outside the timed window: the first calls compile and start the store's machinery
    # (over a second on 2 cores), which a short --seconds would otherwise spend entirely
    k = np.arange(1)
    store.commit(ids[k], store.wait(store.dump(ids[k], 0, table[k])).ok)
    store.wait(store.load(ids[k], 0, np.zeros((1, block), np.uint8)))
    store.lookup(ids[k])
    stop = time.monotonic() + spec["seconds"]

    def work(seed):
        rng = np.random.default_rng(seed)
        local = dict.fromkeys(counts, 0)
        while time.monotonic() < stop:
            k = rng.integers(0, keys, int(rng.integers(1, 9)))
            op = rng.random()
            if op < 0.4:
                r = store.wait(store.dump(ids[k], 0, table[k]))
                store.commit(ids[k], r.ok)
                local["dump"] += 1
            elif op < 0.85:
                dst = np.zeros((len(k), block), np.uint8)
                r = store.wait(store.load(ids[k], 0, dst))
                ok = np.flatnonzero(r.ok)
                local["load"] += 1
                local["load_ok"] += len(ok)
                local["wrong"] += int(sum(not np.array_equal(dst[i], table[k[i]]) for i in ok))
            else:
                store.lookup(ids[k])
                local["lookup"] += 1
            local["ops"] += 1
        with lock:
            for name, v in local.items():
                counts[name] += v

    t0 = time.perf_counter()
    workers = [threading.Thread(target=work, args=(s,)) for s in range(spec["threads"])]
    for t in workers:
        t.start()
    for t in workers:
        t.join()
    elapsed = time.perf_counter() - t0
    store.close()
    shutil.rmtree(root, ignore_errors=True)
    return {**counts, "seconds": elapsed, "ops_per_s": counts["ops"] / elapsed, **spec, "tree": tree,
            "machine": platform.platform(), "cpus": os.cpu_count(), "date": time.strftime("%Y-%m-%d")}


def run_threads(args) -> dict:
    trees = {"this": TREE}
    if args.base:
        trees["base"] = prepare_base(args.base, args.scratch)
    runs = []
    for pipeline in args.pipeline or ["memory", "memory|posix"]:
        spec = {"pipeline": pipeline, "write_back": args.write_back, "threads": args.threads,
                "seconds": args.seconds, "keys": args.keys, "slots": args.slots, "budget_blocks": args.budget_blocks}
        for side, tree in trees.items():
            r = dict(_worker("_threads-worker", tree, [json.dumps(spec)]), side=side)
            runs.append(r)
            print(f"{side:4s} {pipeline}{' write-back' if args.write_back else ''}, {args.threads} threads, "
                  f"{r['seconds']:.1f} s: {r['ops']} ops ({r['ops_per_s']:.0f}/s), {r['load_ok']} blocks "
                  f"loaded ok, {r['wrong']} of them wrong", flush=True)
    return {"base": args.base, "runs": runs}


# ---------------------------------------------------------------------------------------------

def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] and argv[0] == "_ab-worker":
        print(json.dumps(ab_worker(*argv[1:4])))
        return 0
    if argv[:1] and argv[0] == "_threads-worker":
        r = threads_worker(argv[1], json.loads(argv[2]))
        print(json.dumps(r))
        return 3 if r["wrong"] else 0
    if not argv or argv[0] not in ("tiers", "ab", "threads", "-h", "--help"):
        argv.insert(0, "tiers")
    p = argparse.ArgumentParser(description="Store tiers against dd and memcpy (tiers), a base revision (ab), threads (threads).",
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    sub = p.add_subparsers(dest="mode", required=True)
    t = sub.add_parser("tiers", help="posix and memory tiers vs dd and memcpy (default)")
    t.add_argument("--dir", default=None, help="directory on the filesystem to test (default: a temp dir)")
    t.add_argument("--gib", type=_positive_number, default=1.0,
                   help="GiB written and read (at least one 2 MiB block; default %(default)s)")
    t.add_argument("--repeats", type=_count(1), default=3, help="best of (default %(default)s)")
    a = sub.add_parser("ab", help="this tree against a base revision")
    a.add_argument("--base", required=True, help="git revision to compare against")
    a.add_argument("--rounds", type=_count(1), default=5, help="default %(default)s")
    a.add_argument("--cases", default=",".join(AB_CASES),
                   help="comma-separated, of %(default)s")
    h = sub.add_parser("threads", help="threads hammering one store, loaded bytes checked")
    h.add_argument("--pipeline", action="append",
                   help="store pipeline, repeatable (default: memory, then memory|posix)")
    h.add_argument("--write-back", action="store_true")
    h.add_argument("--threads", type=_count(1), default=8, help="default %(default)s")
    h.add_argument("--seconds", type=_positive_number, default=10.0,
                   help="timed seconds per run, after a warm-up (default %(default)s)")
    h.add_argument("--keys", type=_count(1), default=256, help="shared pool of keys (default %(default)s)")
    h.add_argument("--slots", type=_count(1), default=64,
                   help="memory tier slots (buffer_number; default %(default)s)")
    h.add_argument("--budget-blocks", type=_count(1), default=96,
                   help="disk budget in blocks (default %(default)s)")
    h.add_argument("--base", help="also run the base revision (after this tree, per pipeline)")
    for sp in (a, h):
        sp.add_argument("--scratch", default=tempfile.gettempdir(), help="where the base worktree goes")
    for sp in (t, a, h):
        sp.add_argument("--json", help="write the figures here")
    args = p.parse_args(argv)
    if args.mode == "tiers":
        if int(args.gib * (1 << 30)) < BLOCK:
            p.error(f"--gib: {args.gib} is less than one {BLOCK >> 20} MiB block")
        if args.dir is not None and not os.path.isdir(args.dir):
            p.error(f"--dir: no such directory {args.dir!r}")
    if args.mode == "ab":      # (checked before the base worktree is made)
        unknown = [c for c in args.cases.split(",") if c not in AB_CASES]
        if unknown:
            p.error(f"--cases: unknown {unknown}; known: {AB_CASES}")
    out = {"tiers": run_tiers, "ab": run_ab, "threads": run_threads}[args.mode](args)
    if args.json:
        write_json(args.json, out, indent=1)
    wrong = [r for r in out.get("runs", []) if r["side"] == "this" and r["wrong"]] if args.mode == "threads" else []
    if wrong:
        print(f"CORRECTNESS FAILURE: this tree loaded wrong blocks in {len(wrong)} run(s)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
