#!/usr/bin/env python3
"""Distributed tiers against their own client libraries, on services started on 127.0.0.1.

    python benchmarks/bench_remote.py [--tier redis] [--tier mooncake] [--blocks 128]
                                      [--rounds 5] [--json benchmarks/results/bench_remote_cpu.json]

For each tier (both by default) the service is started here with the test helpers
(``tests/services``): a redis-server (no persistence), or a mooncake_master with a separate
mooncake_client storage node (protocol tcp). Then, round by round, alternating:

* ucm: a store of that tier alone (``open_store``, ``store.pipeline=<tier>``, its defaults:
  4 I/O threads, 16 MiB batches; staging for all the blocks, at least 256 MiB); ``dump`` of
  ``--blocks`` blocks of ``--block-mib`` MiB in ``--shards`` shards (16: an engine's blocks have
  a shard per layer, each with its own checksum) + ``wait`` + ``commit``, then ``load`` +
  ``wait`` of the same blocks; every loaded byte checked (outside the timing);
* raw: the client library moving values of the same size (block header + payload) under fresh
  keys, in batches of the tier's size: redis-py (hiredis) pipelined ``SET`` / ``GET``, one
  connection per thread; Mooncake ``batch_put_from`` / ``batch_get_into`` from and into
  registered buffers. Once on one thread and once on as many threads as the tier has; the
  faster of the two is the baseline.

Best of ``--rounds`` for each; every round writes fresh keys (Mooncake keeps the first value
of a key, so a repeated put would cost nothing), and the stores are emptied between rounds.
Reported: seconds, GB/s, and tier/raw throughput ratios (1.0 = as fast as the client library)
of the best rounds, and the same ratios of the medians.
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import sys
import tempfile
import threading
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
TREE = os.path.dirname(HERE)
sys.path.insert(0, TREE)
sys.path.insert(0, os.path.join(TREE, "tests"))

import ucm  # noqa: E402
from ucm.store import open_store  # noqa: E402
from _argtypes import count as _count, write_json  # noqa: E402

NS = ucm.Namespace("bench-remote", "bfloat16", 16)


def best(fn, rounds: int) -> float:
    return min(fn(r) for r in range(rounds))


def split(n: int, parts: int) -> list[range]:
    step = -(-n // parts)
    return [range(lo, min(n, lo + step)) for lo in range(0, n, step)]


def in_threads(n_threads: int, n_items: int, work) -> float:
    """``work(items)`` on ``n_threads`` threads over an even split of ``range(n_items)``;
    seconds from the first start to the last end."""
    chunks = split(n_items, n_threads)
    barrier = threading.Barrier(len(chunks) + 1)
    errors = []

    def run(items):
        barrier.wait()
        try:
            work(items)
        except BaseException as exc:  # reported after the timing
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(c,)) for c in chunks]
    for t in threads:
        t.start()
    barrier.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    dt = time.perf_counter() - t0
    if errors:
        raise errors[0]
    return dt


# ---------------------------------------------------------------------------------------------
# the tier

class TierCase:
    def __init__(self, tier: str, cfg: dict, args):
        self.tier, self.args = tier, args
        self.block = args.block_mib << 20
        if args.io_threads:
            cfg = dict(cfg, store__io_threads=args.io_threads)
        # staging for every block at once (a dump that finds it full fails)
        cfg.setdefault("store__remote__staging", max(256 << 20, args.blocks * (self.block + 4096)))
        self.store = open_store(None, block_bytes=self.block, shard_bytes=self.block // args.shards,
                                namespace=NS.digest(), store__pipeline=tier, **cfg)
        self.store.prepare()  # the staging slab, outside the timing
        rng = np.random.default_rng(0)
        self.src = rng.integers(0, 256, (args.blocks, self.block), dtype=np.uint8)
        self.dst = np.zeros_like(self.src)
        self.value_bytes = self.store.value_bytes

    def ids(self, r: int) -> np.ndarray:
        return ucm.hash_blocks(np.arange(16 * self.args.blocks) + r * 1_000_003, NS)

    def dump(self, r: int) -> float:
        ids = self.ids(r)
        t0 = time.perf_counter()
        res = self.store.wait(self.store.dump(ids, 0, self.src))
        self.store.commit(ids, res.ok)
        dt = time.perf_counter() - t0
        if not res.all_ok:
            raise RuntimeError(f"{self.tier} dump failed: {list(res.errors.items())[:3]}")
        return dt

    def load(self, r: int) -> float:
        ids = self.ids(r)
        self.dst[:] = 0
        t0 = time.perf_counter()
        res = self.store.wait(self.store.load(ids, 0, self.dst))
        dt = time.perf_counter() - t0
        if not res.all_ok or not np.array_equal(self.dst, self.src):
            raise RuntimeError(f"{self.tier} load failed or wrong bytes: {list(res.errors.items())[:3]}")
        return dt

    def close(self) -> None:
        self.store.close()


# ---------------------------------------------------------------------------------------------
# raw clients

class RawRedis:
    def __init__(self, url: str, n: int, value_bytes: int, batch: int):
        self.url, self.n, self.batch = url, n, batch
        self.values = [np.random.default_rng(i).integers(0, 256, value_bytes, dtype=np.uint8).tobytes()
                       for i in range(n)]
        self.clients = threading.local()

    def _client(self):
        import redis

        c = getattr(self.clients, "c", None)
        if c is None:
            c = self.clients.c = redis.Redis.from_url(self.url)
        return c

    def put(self, r: int, threads: int) -> float:
        def work(items):
            c = self._client()
            for lo in range(items.start, items.stop, self.batch):
                p = c.pipeline(transaction=False)
                for i in range(lo, min(items.stop, lo + self.batch)):
                    p.set(f"raw:{r}:{i}", self.values[i])
                if not all(p.execute()):
                    raise RuntimeError("redis SET failed")
        return in_threads(threads, self.n, work)

    def get(self, r: int, threads: int) -> float:
        out = [None] * self.n

        def work(items):
            c = self._client()
            for lo in range(items.start, items.stop, self.batch):
                p = c.pipeline(transaction=False)
                idx = range(lo, min(items.stop, lo + self.batch))
                for i in idx:
                    p.get(f"raw:{r}:{i}")
                for i, v in zip(idx, p.execute()):
                    out[i] = v
        dt = in_threads(threads, self.n, work)
        if any(out[i] != self.values[i] for i in range(self.n)):
            raise RuntimeError("raw redis read wrong bytes")
        return dt

    def clear(self) -> None:
        self._client().flushall()


class RawMooncake:
    def __init__(self, svc, n: int, value_bytes: int, batch: int):
        self.client = svc.client()
        self.n, self.batch, self.vb = n, batch, value_bytes
        self.src = np.random.default_rng(1).integers(0, 256, (n, value_bytes), dtype=np.uint8)
        self.dst = np.zeros_like(self.src)
        for a in (self.src, self.dst):
            rc = self.client.register_buffer(a.ctypes.data, a.nbytes)
            if rc:
                raise RuntimeError(f"register_buffer: {rc}")

    def _addrs(self, a, idx):
        return [a.ctypes.data + i * self.vb for i in idx]

    def put(self, r: int, threads: int) -> float:
        def work(items):
            for lo in range(items.start, items.stop, self.batch):
                idx = range(lo, min(items.stop, lo + self.batch))
                rcs = self.client.batch_put_from([f"raw/{r}/{i}" for i in idx], self._addrs(self.src, idx),
                                                 [self.vb] * len(idx))
                if any(rcs):
                    raise RuntimeError(f"batch_put_from: {rcs[:4]}")
        return in_threads(threads, self.n, work)

    def get(self, r: int, threads: int) -> float:
        self.dst[:] = 0

        def work(items):
            for lo in range(items.start, items.stop, self.batch):
                idx = range(lo, min(items.stop, lo + self.batch))
                rcs = self.client.batch_get_into([f"raw/{r}/{i}" for i in idx], self._addrs(self.dst, idx),
                                                 [self.vb] * len(idx))
                if any(n != self.vb for n in rcs):
                    raise RuntimeError(f"batch_get_into: {rcs[:4]}")
        dt = in_threads(threads, self.n, work)
        if not np.array_equal(self.dst, self.src):
            raise RuntimeError("raw mooncake read wrong bytes")
        return dt

    def clear(self) -> None:
        self.client.remove_all(True)


# ---------------------------------------------------------------------------------------------

def run_tier(tier: str, args, tmp: str) -> dict:
    if tier == "redis":
        from services.redis import redis_server

        svc = redis_server(tmp)
        cfg = dict(store__redis__servers=[svc.url])
        stop = svc.stop
    else:
        from services.mooncake import MooncakeService

        # room for one round of the tier's values and one of the raw client's, with slack
        need = 3 * args.blocks * ((args.block_mib << 20) + 4096)
        svc = MooncakeService(tmp, segment=f"{-(-need // (1 << 20)) + 64}MB")
        cfg = dict(store__mooncake__masters=[svc.master],
                   store__mooncake__metadata_server=svc.metadata_server)
        stop = svc.stop
    case = raw = None
    try:
        case = TierCase(tier, cfg, args)
        io_threads = case.store._exec._max_workers
        batch = case.store.batch_blocks
        raw = (RawRedis(svc.url, args.blocks, case.value_bytes, batch) if tier == "redis"
               else RawMooncake(svc, args.blocks, case.value_bytes, batch))
        times = {k: [] for k in ("tier_dump", "tier_load", "raw_put_1", "raw_get_1",
                                 f"raw_put_{io_threads}", f"raw_get_{io_threads}")}
        for r in range(args.rounds):
            times["tier_dump"].append(case.dump(r))
            times["tier_load"].append(case.load(r))
            for th in sorted({1, io_threads}):
                times[f"raw_put_{th}"].append(raw.put(r * 10 + th, th))
                times[f"raw_get_{th}"].append(raw.get(r * 10 + th, th))
            raw.clear()  # the tier's keys too: the same server
            print(f"  {tier} round {r + 1}/{args.rounds}: " + ", ".join(
                f"{k} {v[-1]:.3f}s" for k, v in times.items()), flush=True)
        nbytes = args.blocks * case.value_bytes
        b = {k: min(v) for k, v in times.items()}
        med = {k: statistics.median(v) for k, v in times.items()}
        raw_put = min(b["raw_put_1"], b[f"raw_put_{io_threads}"])
        raw_get = min(b["raw_get_1"], b[f"raw_get_{io_threads}"])
        out = {
            "blocks": args.blocks, "block_bytes": case.block, "shards": args.shards,
            "value_bytes": case.value_bytes, "bytes": nbytes, "rounds": args.rounds,
            "io_threads": io_threads, "batch_blocks": batch,
            "seconds_best": b, "seconds_all": times,
            "tier_dump_GBps": nbytes / b["tier_dump"] / 1e9,
            "tier_load_GBps": nbytes / b["tier_load"] / 1e9,
            "raw_put_GBps": nbytes / raw_put / 1e9, "raw_get_GBps": nbytes / raw_get / 1e9,
            "raw_put_threads": 1 if b["raw_put_1"] <= b[f"raw_put_{io_threads}"] else io_threads,
            "raw_get_threads": 1 if b["raw_get_1"] <= b[f"raw_get_{io_threads}"] else io_threads,
            "dump_vs_raw": raw_put / b["tier_dump"], "load_vs_raw": raw_get / b["tier_load"],
            # medians: the same ratios, less sensitive to a lucky round on a shared machine
            "dump_vs_raw_median": min(med[f"raw_put_{t}"] for t in {1, io_threads}) / med["tier_dump"],
            "load_vs_raw_median": min(med[f"raw_get_{t}"] for t in {1, io_threads}) / med["tier_load"],
            "tier_stats": case.store.stats().get(tier, {}),
        }
        out["tier_stats"] = {k: v for k, v in out["tier_stats"].items() if not isinstance(v, list)}
        return out
    finally:
        if case is not None:
            case.close()
        if isinstance(raw, RawMooncake):
            raw.client.close()
        stop()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--tier", action="append", choices=("redis", "mooncake"),
                   help="tier to measure (repeatable; default both)")
    p.add_argument("--blocks", type=_count(1), default=128, help="default %(default)s")
    p.add_argument("--block-mib", type=_count(1), default=1, help="default %(default)s")
    p.add_argument("--shards", type=_count(1), default=16,
                   help="shards per block (layers), dividing its bytes (default %(default)s)")
    p.add_argument("--rounds", type=_count(1), default=5, help="default %(default)s")
    p.add_argument("--io-threads", type=_count(1), default=0,
                   help="store.io_threads (default: the tier's default)")
    p.add_argument("--json", help="write the figures here")
    args = p.parse_args(argv)
    if (args.block_mib << 20) % args.shards:
        p.error(f"--shards: {args.shards} does not divide a block's {args.block_mib << 20} bytes")
    tiers = args.tier or ["redis", "mooncake"]
    out = {"machine": f"{platform.machine()} {os.cpu_count()} cores",
           "date": datetime.date.today().isoformat(), "tiers": {}}
    with tempfile.TemporaryDirectory(prefix="ucm-bench-remote-") as tmp:
        for tier in tiers:
            print(f"{tier}: {args.blocks} blocks of {args.block_mib} MiB, best of {args.rounds}", flush=True)
            r = out["tiers"][tier] = run_tier(tier, args, tmp)
            print(f"{tier}: dump {r['tier_dump_GBps']:.2f} GB/s vs raw put {r['raw_put_GBps']:.2f} GB/s "
                  f"({r['dump_vs_raw']:.0%}); load {r['tier_load_GBps']:.2f} GB/s vs raw get "
                  f"{r['raw_get_GBps']:.2f} GB/s ({r['load_vs_raw']:.0%}); medians: dump "
                  f"{r['dump_vs_raw_median']:.0%}, load {r['load_vs_raw_median']:.0%} of raw", flush=True)
    if args.json:
        write_json(args.json, out, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
