"""Eviction policies and write admission (ucm/store/policy.py) on their own, inside the memory
tier and inside a memory|posix pipeline: random operation sequences against a set model, the
memory tier's data under every policy, busy blocks, chain trimming, admission decisions."""
import random

import numpy as np
import pytest

from ucm.config import Config
from ucm.store.base import BlockGeometry
from ucm.store.memory import MemoryStore
from ucm.store.pipeline import PipelineStore
from ucm.store.policy import (ARCPolicy, LRUPolicy, POLICIES, PrefixPolicy, SecondHitAdmission,
                              make_policy)
from ucm.store.posix import PosixStore

CLASSES = [LRUPolicy, ARCPolicy, PrefixPolicy]


def key(i: int) -> bytes:
    return int(i * 0x9E3779B97F4A7C15 % (1 << 64)).to_bytes(8, "little") + i.to_bytes(8, "little")


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.name)
def test_random_operations_match_a_set_model(cls):
    rng = random.Random(7)
    cap = 24
    pol = cls(cap)
    model: set = set()
    for _ in range(4000):
        op = rng.random()
        if op < 0.45:  # a request's chain: the tier evicts first, then inserts the new ones
            chain = [key(rng.randrange(80)) for _ in range(rng.randrange(1, 6))]
            chain = list(dict.fromkeys(chain))
            new = [k for k in chain if k not in model]
            over = len(model) + len(new) - cap
            if over > 0:
                busy = set(rng.sample(sorted(model), min(3, len(model))))
                out = pol.evict(over, busy.__contains__)
                assert len(out) == len(set(out)) == min(over, len(model) - len(busy))
                assert not set(out) & busy, "a busy block was evicted"
                assert set(out) <= model
                model -= set(out)
                new = new[:cap - len(model)]
            pol.insert(new)
            model |= set(new)
        elif op < 0.8:
            ks = [key(rng.randrange(80)) for _ in range(3)]
            pol.hit(ks)
        else:
            ks = [key(rng.randrange(80)) for _ in range(2)]
            pol.remove(ks)
            model -= set(ks)
        assert len(pol) == len(model) <= cap
        for i in range(80):
            assert (key(i) in pol) == (key(i) in model)


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.name)
def test_evict_more_than_held_and_everything_busy(cls):
    pol = cls(4)
    pol.insert([key(1), key(2)])
    assert pol.evict(3, lambda k: True) == []
    assert len(pol) == 2
    assert sorted(pol.evict(5)) == sorted([key(1), key(2)])
    assert len(pol) == 0 and pol.evict(1) == []


def test_lru_policy_evicts_in_least_recent_order():
    """Least recent call first; within one call the deepest block first."""
    pol = LRUPolicy(8)
    pol.insert([key(i) for i in range(5)])
    pol.hit([key(0), key(2)])
    assert pol.evict(3) == [key(4), key(3), key(1)]
    pol.insert([key(7)])
    pol.hit([key(2)])
    assert pol.evict(3) == [key(0), key(7), key(2)]


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.name)
def test_every_policy_trims_a_chain_from_its_tip(cls):
    """A chain's deeper blocks go first: a cached block without its parent is never a hit."""
    pol = cls(16)
    chain = [key(i) for i in range(6)]
    pol.insert(chain)
    assert pol.evict(2) == [chain[5], chain[4]]
    pol.hit(chain[:4])  # read again, in chain order: the tip still goes first
    assert pol.evict(1) == [chain[3]]


def _system_prompt_sessions(store, geo) -> list:
    """Sessions under one system prompt (8 blocks) between one-off documents, one request at a
    time as vLLM's connector runs them (look up the prefix, load the hits, store the rest);
    after each request what is held of the prompt must be a prefix of it. Returns the hits of
    the sessions."""
    system = _ids(range(8))
    hits = []
    try:
        for s in range(24):
            doc = s % 2
            chain = _ids(range(1000 + 10 * s, 1007 + 10 * s)) if doc else \
                np.concatenate([system, _ids(range(100 + 10 * s, 104 + 10 * s))])
            k = store.lookup_prefix(chain)
            if k:
                out = np.zeros((k, geo.block_bytes), dtype=np.uint8)
                assert store.wait(store.load(chain[:k], 0, out)).all_ok
                assert np.array_equal(out, _payload(chain[:k], geo.block_bytes))
            if not doc:
                hits.append(k)
            rest = chain[k:]
            r = store.wait(store.dump(rest, 0, _payload(rest, geo.block_bytes)))
            store.commit(rest, r.ok)
            held = np.asarray(store.lookup(system), dtype=bool)
            assert not (~held[:-1] & held[1:]).any(), f"request {s}: the prompt held {held}"
    finally:
        store.close()
    return hits


@pytest.mark.parametrize("policy", POLICIES)
def test_memory_tier_keeps_a_shared_system_prompt_found_under_pressure(policy):
    """The sessions of _system_prompt_sessions in a tier too small for them all. Each document
    evicts blocks of the session before it; evicting that chain from its first block (the
    system prompt's) stranded the rest, and the next session missed the whole prompt although
    most of it was held. A request's chain ages from its tip, its loaded prefix included: the
    session's own blocks go, the prompt stays whole, and what is held of it is always a
    prefix."""
    geo = BlockGeometry(64, 32)
    store = MemoryStore(geo, buffer_number=16, io_threads=1, pin=False, policy=policy)
    hits = _system_prompt_sessions(store, geo)
    assert hits == [0] + [8] * 11, hits


def test_posix_tier_keeps_a_shared_system_prompt_found_under_pressure(tmp_path):
    """The same sessions on the posix tier, whose collection evicts the least recently used
    files by mtime: a publish and a load give the call's blocks ages that step back along the
    chain (its head the newest), and the blocks a request stores go below the prefix it
    loaded. Evicting by the order the files happened to be written removed the prompt's head
    first and stranded the rest."""
    from ucm.store import format as fmt
    from ucm.store.posix import PosixStore

    geo = BlockGeometry(64, 32)
    file_bytes = fmt.header_size(geo.n_shards) + geo.block_bytes
    store = PosixStore(geo, [str(tmp_path)], capacity_bytes=16 * file_bytes, io_threads=1)
    hits = _system_prompt_sessions(store, geo)
    assert hits == [0] + [8] * 11, hits


def test_posix_tier_stores_below_a_fresh_load_and_not_below_an_old_one(tmp_path):
    """A request's new blocks go just below the prefix it loaded a moment before; a load long
    before the publish (READ_FLOOR_WINDOW_NS) is another request's, and the new blocks then
    start at the current time, not in the past."""
    import os
    import time

    from ucm.store import posix as posix_mod

    geo = BlockGeometry(64, 32)
    store = posix_mod.PosixStore(geo, [str(tmp_path)], capacity_bytes=1 << 20, io_threads=1)
    try:
        def put(ids):
            r = store.wait(store.dump(ids, 0, _payload(ids, geo.block_bytes)))
            store.commit(ids, r.ok)

        def mtime(ids):
            return [os.stat(store.path_of(i)).st_mtime_ns for i in ids]

        prefix, new, later = _ids(range(4)), _ids(range(10, 13)), _ids(range(20, 22))
        put(prefix)
        assert mtime(prefix) == sorted(mtime(prefix), reverse=True)      # head newest
        out = np.zeros((4, geo.block_bytes), dtype=np.uint8)
        assert store.wait(store.load(prefix, 0, out)).all_ok
        put(new)
        assert max(mtime(new)) < min(mtime(prefix))                       # below the prefix
        assert mtime(new) == sorted(mtime(new), reverse=True)
        assert store.wait(store.load(prefix, 0, out)).all_ok
        with store._lock:                      # as if that load had been 2 minutes ago
            store._read_floor_ns -= 2 * posix_mod.READ_FLOOR_WINDOW_NS
        before = time.time_ns()
        put(later)
        assert min(mtime(later)) >= before - 10**6
    finally:
        store.close()


def _ids(nums) -> np.ndarray:
    return np.array([[n * 7919 + 1, n] for n in nums], dtype=np.uint64)


def _payload(ids: np.ndarray, nbytes: int) -> np.ndarray:
    """Bytes that name their block: a wrong block's bytes can never pass."""
    out = np.empty((len(ids), nbytes), dtype=np.uint8)
    for i, (a, b) in enumerate(ids.tolist()):
        out[i] = np.random.default_rng([a, b]).integers(0, 256, nbytes, dtype=np.uint8)
    return out


@pytest.mark.parametrize("policy", POLICIES)
def test_memory_tier_random_requests_keep_every_block_its_own_bytes(policy):
    rng = random.Random(3)
    geo = BlockGeometry(64, 32)
    store = MemoryStore(geo, buffer_number=12, io_threads=2, pin=False, policy=policy)
    committed_ever = set()
    try:
        for _ in range(300):
            start = rng.randrange(40)
            chain = _ids(range(start, start + rng.randrange(1, 6)))
            k = store.lookup_prefix(chain)
            if k:
                dst = np.zeros((k, 64), dtype=np.uint8)
                r = store.wait(store.load(chain[:k], 0, dst))
                good = np.flatnonzero(r.ok)
                assert (dst[good] == _payload(chain[:k][good], 64)).all()
            rest = chain[k:]
            if len(rest):
                # layer by layer, as the connector saves
                t1 = store.dump(rest, 0, _payload(rest, 64)[:, :32])
                t2 = store.dump(rest, 32, np.ascontiguousarray(_payload(rest, 64)[:, 32:]))
                ok = store.wait(t1).ok & store.wait(t2).ok
                store.commit(rest, ok)
                committed_ever |= {tuple(x) for x in rest[ok].tolist()}
            st = store.stats()["memory"]
            assert st["committed"] <= 12 and st["policy"] == policy
        assert store.stats()["memory"]["evictions"] > 0
    finally:
        store.close()


@pytest.mark.parametrize("policy", ["arc", "prefix"])
def test_memory_tier_never_evicts_a_borrowed_block(policy):
    geo = BlockGeometry(8, 8)
    store = MemoryStore(geo, buffer_number=4, io_threads=1, pin=False, policy=policy)
    try:
        first = _ids(range(4))
        store.commit(first, store.wait(store.dump(first, 0, _payload(first, 8))).ok)
        held = store.borrow(first[:2])
        for n in range(10, 30):  # a stream of new blocks
            ids = _ids([n])
            store.commit(ids, store.wait(store.dump(ids, 0, _payload(ids, 8))).ok)
        assert store.lookup(first[:2]) == [True, True]
        pool = held.pool.numpy() if hasattr(held.pool, "numpy") else held.pool
        assert (pool[held.rows] == _payload(first[:2], 8)).all()
        held.release()
    finally:
        store.close()


def test_second_hit_admission_decides_once_per_block():
    adm = SecondHitAdmission(window=3)
    assert adm.admit([key(1), key(2)]) == [False, False]
    assert adm.admit([key(1)]) == [True]
    for i in range(10, 14):  # key(2) falls out of the window
        adm.admit([key(i)])
    assert adm.admit([key(2)]) == [False]


def test_pipeline_admits_to_the_slow_tier_on_the_second_offer_or_a_first_tier_hit(tmp_path):
    geo = BlockGeometry(64, 32)
    mem = MemoryStore(geo, buffer_number=2, io_threads=1, pin=False)
    posix = PosixStore(geo, roots=[str(tmp_path)], io_threads=1, capacity_bytes=1 << 20)
    store = PipelineStore([mem, posix], admission="second_hit")
    try:
        a, b, c = _ids([1]), _ids([2]), _ids([3])

        def save(ids):  # layer-wise: one decision for both halves
            t1 = store.dump(ids, 0, _payload(ids, 64)[:, :32])
            t2 = store.dump(ids, 32, np.ascontiguousarray(_payload(ids, 64)[:, 32:]))
            ok = store.wait(t1).ok & store.wait(t2).ok
            store.commit(ids, ok)
            store.flush()
            return ok

        assert save(a).all()
        assert posix.lookup(a) == [False] and mem.lookup(a) == [True]
        save(b), save(c)  # a is evicted from the 2-slot memory tier
        assert store.lookup(a) == [False]
        assert save(a).all()  # offered again: proved useful, now on disk
        assert posix.lookup(a) == [True]
        dst = np.zeros((1, 64), dtype=np.uint8)
        assert store.wait(store.load(c, 0, dst)).all_ok  # a first-tier hit on c
        store.flush()
        assert posix.lookup(c) == [True]
        assert posix.lookup(b) == [False]  # offered once, never read
        got = np.zeros((1, 64), dtype=np.uint8)
        assert posix.wait(posix.load(c, 0, got)).all_ok and (got == _payload(c, 64)).all()
    finally:
        store.close()


def test_pipeline_refuses_an_unknown_admission():
    geo = BlockGeometry(8, 8)
    with pytest.raises(ValueError, match="store.admission"):
        PipelineStore([MemoryStore(geo, 2, pin=False)], admission="lfu")
