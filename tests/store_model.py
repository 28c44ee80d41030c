"""Model-based checking of any store (tier or pipeline) against a plain dictionary model.

``run_model(open_store, seed, n_ops, roomy=...)`` drives a store with a seeded random sequence
of operations (dumps with duplicate, present and pending ids, whole / layer-by-layer / partial
shards; commits with true, false and mixed flags, of dumped, pending and never-dumped ids;
loads of whole blocks and shard ranges; lookups and prefix lookups; prefetch; close and reopen)
and checks every answer against the model:

* safety, always: a load reported ok returns exactly the bytes dumped under that id (for the
  shards asked); no id that was never published (committed with every shard dumped) is ever
  reported present or loaded;
* liveness, when the store has room for every id (``roomy``): an id whose every shard was
  dumped cleanly and then committed is present and loads, until a reopen of a store that keeps
  nothing (``persistent=False``); ``persistent="admitted"`` (a pipeline with a write-admission
  filter, whose persistent tier holds only the blocks it admitted): after a reopen a published
  id may be present or not, and everything else holds.

``open_store()`` returns a fresh store (called again for each reopen); the store's geometry must
be :data:`GEOMETRY`. Each id's bytes are a function of the id, as a real KV block's are. The
seed and the last operations are in every failure message, so a failure replays exactly.
"""
from __future__ import annotations

import collections

import numpy as np

from ucm.store import BlockGeometry

SHARD = 1024
N_SHARDS = 2
BLOCK = SHARD * N_SHARDS
GEOMETRY = BlockGeometry(BLOCK, SHARD)


def block_ids(keys) -> np.ndarray:
    """128-bit ids of integer keys (both words vary, so multi-root placement spreads)."""
    keys = np.asarray(keys, dtype=np.uint64)
    with np.errstate(over="ignore"):
        lo = (keys + np.uint64(1)) * np.uint64(0x9E3779B97F4A7C15)
        hi = (keys ^ np.uint64(0x5A5A5A5A)) * np.uint64(0xD6E8FEB86659FD93) + keys
    return np.stack([lo, hi], axis=1)


_CONTENT: dict = {}


def content(key: int) -> np.ndarray:
    """The bytes of block ``key`` (distinct for every key)."""
    row = _CONTENT.get(key)
    if row is None:
        row = np.random.default_rng([key, 77]).integers(0, 256, BLOCK, dtype=np.uint8)
        _CONTENT[key] = row
    return row


class ModelError(AssertionError):
    pass


class _Model:
    def __init__(self):
        self.must: set = set()       # published cleanly: present while the store has room
        self.may: set = set()        # may be present (published at some point)
        self.cover: dict = {}        # key -> shards dumped ok since its last commit
        self.dirty: set = set()      # keys with a failed dump row since their last commit
        self.pending: set = set()    # keys dumped and not yet committed

    def dumped(self, key: int, shards: range, ok: bool) -> None:
        self.pending.add(key)
        if ok:
            self.cover.setdefault(key, np.zeros(N_SHARDS, bool))[shards.start:shards.stop] = True
        else:
            self.dirty.add(key)

    def committed(self, key: int, flag: bool) -> None:
        cover = self.cover.pop(key, None)
        dirty = key in self.dirty
        self.dirty.discard(key)
        self.pending.discard(key)
        if flag and cover is not None and cover.all():
            self.may.add(key)
            if not dirty:
                self.must.add(key)

    def forget_pending(self) -> None:
        self.cover.clear()
        self.dirty.clear()
        self.pending.clear()

    def forget_all(self) -> None:
        self.forget_pending()
        self.must.clear()
        self.may.clear()


def run_model(open_store, seed: int, n_ops: int, roomy: bool, persistent=True,
              universe: int = 48, timeout: float = 30.0) -> dict:
    """Drive a store through ``n_ops`` random operations; raise :class:`ModelError` on the
    first answer the model forbids. Returns counts of what ran."""
    rng = np.random.default_rng(seed)
    model = _Model()
    store = open_store()
    log = collections.deque(maxlen=12)
    counts = collections.Counter()

    def fail(msg):
        raise ModelError(f"seed {seed}, op {counts['ops']}: {msg}\nlast operations:\n  "
                         + "\n  ".join(log))

    def pick_keys(n):
        keys = []
        for _ in range(n):
            r = rng.random()
            pool = sorted(model.may) if r < 0.3 else sorted(model.pending) if r < 0.5 else None
            if keys and rng.random() < 0.15:
                keys.append(keys[int(rng.integers(len(keys)))])  # a duplicate inside the batch
            elif pool:
                keys.append(pool[int(rng.integers(len(pool)))])
            else:
                keys.append(int(rng.integers(universe)))
        return keys

    def check_present(keys, found, what):
        for k, f in zip(keys, found):
            if f and k not in model.may:
                fail(f"{what} reports key {k} present; it was never published")
            if roomy and not f and k in model.must:
                fail(f"{what} misses key {k}; it was published and the store has room")

    try:
        for _ in range(n_ops):
            counts["ops"] += 1
            op = rng.random()
            if op < 0.32:  # dump
                keys = pick_keys(int(rng.integers(1, 9)))
                ids = block_ids(keys)
                src = np.stack([content(k) for k in keys])
                mode = rng.random()
                if mode < 0.6:
                    parts = [range(0, N_SHARDS)]
                elif mode < 0.85:
                    parts = [range(s, s + 1) for s in range(N_SHARDS)]
                else:
                    s = int(rng.integers(N_SHARDS))
                    parts = [range(s, s + 1)]
                for shards in parts:
                    off = shards.start * SHARD
                    part = np.ascontiguousarray(src[:, off:shards.stop * SHARD])
                    r = store.wait(store.dump(ids, off, part), timeout)
                    for k, ok in zip(keys, r.ok):
                        model.dumped(k, shards, bool(ok))
                log.append(f"dump {keys} shards {[(p.start, p.stop) for p in parts]} -> {r.ok.astype(int).tolist()}")
                counts["dump"] += 1
                if rng.random() < 0.7:  # usually commit what was dumped
                    flags = r.ok if rng.random() < 0.8 else rng.random(len(keys)) < 0.5
                    store.commit(ids, flags)
                    for k, f in zip(keys, flags):
                        model.committed(k, bool(f))
                    log.append(f"commit {keys} {np.asarray(flags).astype(int).tolist()}")
                    counts["commit"] += 1
                    check_present(keys, store.lookup(ids), "lookup right after commit")
            elif op < 0.42:  # commit pending or unknown ids
                keys = sorted(model.pending)[:int(rng.integers(1, 6))] or pick_keys(2)
                flags = rng.random(len(keys)) < 0.6
                store.commit(block_ids(keys), flags)
                for k, f in zip(keys, flags):
                    model.committed(k, bool(f))
                log.append(f"commit {keys} {flags.astype(int).tolist()}")
                counts["commit"] += 1
            elif op < 0.72:  # load
                keys = pick_keys(int(rng.integers(1, 9)))
                ids = block_ids(keys)
                if rng.random() < 0.6:
                    shards = range(0, N_SHARDS)
                else:
                    s = int(rng.integers(N_SHARDS))
                    shards = range(s, s + 1)
                off, nbytes = shards.start * SHARD, len(shards) * SHARD
                dst = np.full((len(keys), nbytes), 0xA5, dtype=np.uint8)
                r = store.wait(store.load(ids, off, dst), timeout)
                log.append(f"load {keys} shards {(shards.start, shards.stop)} -> {r.ok.astype(int).tolist()}")
                counts["load"] += 1
                for i, k in enumerate(keys):
                    if r.ok[i]:
                        counts["load_ok"] += 1
                        if k not in model.may:
                            fail(f"load of key {k} ok; it was never published")
                        if not np.array_equal(dst[i], content(k)[off:off + nbytes]):
                            counts["mismatch"] += 1
                            fail(f"load of key {k} returned other bytes than dumped")
                    elif roomy and k in model.must:
                        fail(f"load of published key {k} failed: {r.errors.get(i)}")
            elif op < 0.86:  # lookup / lookup_prefix
                keys = pick_keys(int(rng.integers(1, 9)))
                ids = block_ids(keys)
                found = store.lookup(ids)
                check_present(keys, found, "lookup")
                n = store.lookup_prefix(ids)
                if n > len(keys) or any(k not in model.may for k in keys[:n]):
                    fail(f"lookup_prefix {keys} = {n} counts an unpublished block")
                if roomy and n < len(keys) and keys[n] in model.must:
                    fail(f"lookup_prefix {keys} = {n} stops before published key {keys[n]}")
                log.append(f"lookup {keys} -> {[int(f) for f in found]} prefix {n}")
                counts["lookup"] += 1
            elif op < 0.93:  # prefetch (a hint; pipelines promote in the background)
                keys = pick_keys(int(rng.integers(1, 6)))
                store.prefetch(block_ids(keys))
                log.append(f"prefetch {keys}")
                counts["prefetch"] += 1
            elif op < 0.985:  # quiet moment: every pending block committed or discarded
                keys = sorted(model.pending)
                if keys:
                    flags = rng.random(len(keys)) < 0.5
                    store.commit(block_ids(keys), flags)
                    for k, f in zip(keys, flags):
                        model.committed(k, bool(f))
                    log.append(f"settle {keys} {flags.astype(int).tolist()}")
            else:  # close and reopen
                store.close()
                store = open_store()
                if persistent == "admitted":   # only what a lower tier admitted survives
                    model.forget_pending()
                    model.must.clear()
                else:
                    model.forget_pending() if persistent else model.forget_all()
                log.append("reopen")
                counts["reopen"] += 1
    finally:
        store.close()
    return dict(counts)


def run_threads(store, n_threads: int = 8, n_ops: int = 150, universe: int = 40) -> tuple:
    """``n_threads`` threads dump (duplicates, present ids), commit, load and look up one shared
    pool of blocks on ``store`` (closed at the end). Returns (blocks loaded ok, errors): an
    error is a block loaded ok with bytes other than its own, or an exception."""
    import threading

    errors, loaded = [], [0]

    def work(seed):
        rng = np.random.default_rng(seed)
        try:
            for _ in range(n_ops):
                keys = rng.integers(0, universe, int(rng.integers(1, 7))).tolist()
                ids = block_ids(keys)
                if rng.random() < 0.45:
                    r = store.wait(store.dump(ids, 0, np.stack([content(k) for k in keys])))
                    store.commit(ids, r.ok)
                elif rng.random() < 0.85:
                    dst = np.zeros((len(keys), GEOMETRY.block_bytes), np.uint8)
                    r = store.wait(store.load(ids, 0, dst))
                    for i in np.flatnonzero(r.ok):
                        loaded[0] += 1
                        if not np.array_equal(dst[i], content(keys[i])):
                            errors.append(f"key {keys[i]}: another block's bytes")
                else:
                    store.lookup(ids)
        except Exception as exc:  # reported to the caller
            errors.append(repr(exc))

    threads = [threading.Thread(target=work, args=(s,)) for s in range(n_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    store.close()
    return loaded[0], errors
