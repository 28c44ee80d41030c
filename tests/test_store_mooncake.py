"""The mooncake tier against a real Mooncake Store on 127.0.0.1 (``tests/services/mooncake.py``:
a mooncake_master and a separate mooncake_client storage node): round trips (whole blocks,
shard by shard, partial loads), the commit protocol, two writers, corrupted values, namespaces,
a master that dies and comes back, bad configuration, a memory|mooncake pipeline."""
import threading
import time

import numpy as np
import pytest

import ucm
from ucm.config import ConfigError
from ucm.store import open_store
from ucm.store.mooncake import MooncakeStore

from services import free_port, require_module
from services.mooncake import MooncakeService

NS = ucm.Namespace("mooncake-test-model", "bfloat16", 16)
BLOCK, SHARD = 64 << 10, 16 << 10  # 4 shards per block


@pytest.fixture(scope="module")
def svc(tmp_path_factory):
    require_module("mooncake.store")
    s = MooncakeService(tmp_path_factory.mktemp("mooncake"), segment="128MB")
    yield s
    s.stop()


def make_ids(n, seed):
    rng = np.random.default_rng(seed)
    return ucm.hash_blocks(rng.integers(0, 49152, 16 * n), NS)


def payload(n, seed, nbytes=BLOCK):
    return np.random.default_rng(seed).integers(0, 256, (n, nbytes), dtype=np.uint8)


def open_mooncake(svc, namespace=NS, pipeline="mooncake", **kw):
    opts = dict(store__pipeline=pipeline, store__mooncake__masters=[svc.master],
                store__mooncake__metadata_server=svc.metadata_server,
                store__remote__staging=4 << 20, store__remote__timeout_s=0.2,
                store__remote__backoff_s=0.2)
    opts.update(kw)
    return open_store(None, block_bytes=BLOCK, shard_bytes=SHARD, namespace=namespace.digest(), **opts)


def test_round_trip_whole_blocks_shards_and_partial_loads(svc):
    s = open_mooncake(svc)
    try:
        assert isinstance(s, MooncakeStore)
        ids, src = make_ids(6, 1), payload(6, 1)
        assert s.wait(s.dump(ids, 0, src)).all_ok
        s.commit(ids, True)
        assert s.lookup(ids) == [True] * 6
        dst = np.zeros_like(src)
        assert s.wait(s.load(ids, 0, dst)).all_ok
        assert np.array_equal(dst, src)
        backend = s._servers[svc.master].backend
        assert backend.reads_into_rows and backend._slab is not None  # zero copy: slab registered

        # a dump shard by shard (one "layer" at a time): visible only once complete and committed
        ids2, src2 = make_ids(5, 2), payload(5, 2)
        for k in range(BLOCK // SHARD):
            piece = np.ascontiguousarray(src2[:, k * SHARD:(k + 1) * SHARD])
            assert s.wait(s.dump(ids2, k * SHARD, piece)).all_ok
            assert not any(s.lookup(ids2))
        s.commit(ids2, True)
        assert s.lookup(ids2) == [True] * 5
        # partial loads: shards 1-2, then the last shard alone
        part = np.zeros((5, 2 * SHARD), dtype=np.uint8)
        assert s.wait(s.load(ids2, SHARD, part)).all_ok
        assert np.array_equal(part, src2[:, SHARD:3 * SHARD])
        last = np.zeros((5, SHARD), dtype=np.uint8)
        assert s.wait(s.load(ids2, BLOCK - SHARD, last)).all_ok
        assert np.array_equal(last, src2[:, BLOCK - SHARD:])
        st = s.stats()["mooncake"]
        assert st["quarantined"] == 0 and st["unavailable"] == 0 and st["io_errors"] == 0
    finally:
        s.close()


def test_invisible_before_commit_discard_and_commit_while_put_in_flight(svc):
    s = open_mooncake(svc)
    try:
        ids, src = make_ids(8, 3), payload(8, 3)
        assert s.wait(s.dump(ids, 0, src)).all_ok
        assert not any(s.lookup(ids))  # stored, not committed
        s.commit(ids[:4], True)
        s.commit(ids[4:], False)
        assert s.lookup(ids) == [True] * 4 + [False] * 4
        dst = np.zeros_like(src[:4])
        assert s.wait(s.load(ids[:4], 0, dst)).all_ok and np.array_equal(dst, src[:4])

        # commit right after dump, before the put landed: the marker follows the bytes
        ids2, src2 = make_ids(16, 4), payload(16, 4)
        task = s.dump(ids2, 0, src2)
        s.commit(ids2, True)
        assert s.wait(task).all_ok
        deadline = time.monotonic() + 5
        while not all(s.lookup(ids2)) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert s.lookup(ids2) == [True] * 16
        dst2 = np.zeros_like(src2)
        assert s.wait(s.load(ids2, 0, dst2)).all_ok and np.array_equal(dst2, src2)
    finally:
        s.close()


def test_two_writers_of_the_same_blocks_race_harmlessly(svc):
    a, b = open_mooncake(svc), open_mooncake(svc)  # two engines ("nodes"), one store
    try:
        ids, src = make_ids(24, 5), payload(24, 5)
        results = {}

        def save(name, store):
            for lo in range(0, 24, 6):  # several batches, so the two writers interleave
                res = store.wait(store.dump(ids[lo:lo + 6], 0, src[lo:lo + 6]))
                results.setdefault(name, []).append(res.all_ok)
                store.commit(ids[lo:lo + 6], True)

        threads = [threading.Thread(target=save, args=(n, st)) for n, st in (("a", a), ("b", b))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert all(results["a"]) and all(results["b"])
        for st in (a, b):
            assert st.lookup(ids) == [True] * 24
            dst = np.zeros_like(src)
            assert st.wait(st.load(ids, 0, dst)).all_ok and np.array_equal(dst, src)
            assert st.stats()["mooncake"]["quarantined"] == 0
    finally:
        a.close()
        b.close()


def test_corrupted_and_truncated_values_are_quarantined(svc):
    s = open_mooncake(svc)
    raw = svc.client()
    try:
        ids, src = make_ids(3, 6), payload(3, 6)
        assert s.wait(s.dump(ids, 0, src)).all_ok
        s.commit(ids, True)
        keys = s._keys(ids, "v")
        good = raw.get(keys[0])
        assert len(good) == s.value_bytes
        flipped = bytearray(good)
        flipped[s.header_bytes + 100] ^= 0xFF          # one payload byte of shard 0
        assert raw.upsert(keys[0], bytes(flipped)) == 0
        assert raw.upsert(keys[1], good[:len(good) // 2]) == 0  # truncated
        dst = np.zeros_like(src)
        res = s.wait(s.load(ids, 0, dst))
        assert res.ok.tolist() == [False, False, True]
        assert np.array_equal(dst[2], src[2])
        st = s.stats()["mooncake"]
        assert st["quarantined"] == 2
        assert s.lookup(ids) == [False, False, True]  # both keys of the bad values deleted
        assert raw.batch_is_exist(keys) == [0, 0, 1]
        # saved again, they load
        assert s.wait(s.dump(ids[:2], 0, src[:2])).all_ok
        s.commit(ids[:2], True)
        dst[:] = 0
        assert s.wait(s.load(ids, 0, dst)).all_ok and np.array_equal(dst, src)
    finally:
        raw.close()
        s.close()


def test_foreign_namespace_is_a_miss(svc):
    other = ucm.Namespace("another-model", "bfloat16", 16)
    s, t = open_mooncake(svc), open_mooncake(svc, namespace=other)
    raw = svc.client()
    try:
        ids, src = make_ids(2, 7), payload(2, 7)
        assert s.wait(s.dump(ids, 0, src)).all_ok
        s.commit(ids, True)
        assert t.lookup(ids) == [False, False]
        dst = np.zeros_like(src)
        assert t.wait(t.load(ids, 0, dst)).ok.tolist() == [False, False]
        # the value copied under the other namespace's keys (with its marker): refused on read
        value = raw.get(s._keys(ids[:1], "v")[0])
        assert raw.put(t._keys(ids[:1], "v")[0], value) == 0
        assert raw.put(t._keys(ids[:1], "m")[0], b"\x01") == 0
        assert t.lookup(ids) == [True, False]
        assert t.wait(t.load(ids, 0, dst)).ok.tolist() == [False, False]
        assert t.stats()["mooncake"]["quarantined"] == 1
        assert not dst.any()
        assert s.lookup(ids) == [True, True]
    finally:
        raw.close()
        s.close()
        t.close()


def test_master_killed_fails_fast_then_recovers_by_itself(tmp_path):
    svc = MooncakeService(tmp_path, segment="64MB")
    s = None
    try:
        s = open_mooncake(svc)
        ids, src = make_ids(4, 8), payload(4, 8)
        assert s.wait(s.dump(ids, 0, src)).all_ok
        s.commit(ids, True)
        svc.kill_master()
        dst = np.zeros_like(src)
        for attempt in range(3):  # the first failure, during the backoff, and after it
            t0 = time.monotonic()
            assert s.lookup(ids) == [False] * 4
            res = s.wait(s.load(ids, 0, dst), timeout=5)
            assert res.ok.tolist() == [False] * 4
            res = s.wait(s.dump(make_ids(2, 9 + attempt), 0, payload(2, 9)), timeout=5)
            assert not res.ok.any()
            assert time.monotonic() - t0 < 1.5  # three operations, each < 0.5 s
            time.sleep(0.25 if attempt else 0)  # past the 0.2 s backoff
        st = s.stats()["mooncake"]
        assert st["unavailable"] >= 3 and st["io_errors"] == 0
        assert not dst.any()

        # one operation alone, past the backoff: the master is probed, fails at once
        time.sleep(0.45)
        t0 = time.monotonic()
        assert s.lookup(ids) == [False] * 4
        assert time.monotonic() - t0 < 0.5

        svc.start_master()  # same ports; the storage node mounts its memory again
        ids2, src2 = make_ids(4, 20), payload(4, 20)
        deadline = time.monotonic() + 20
        while True:
            ok = s.wait(s.dump(ids2, 0, src2), timeout=10).all_ok
            s.commit(ids2, ok)
            if ok and all(s.lookup(ids2)):
                break
            assert time.monotonic() < deadline, f"no recovery:\n{svc.log_tail()}"
            time.sleep(0.2)
        dst2 = np.zeros_like(src2)
        assert s.wait(s.load(ids2, 0, dst2)).all_ok and np.array_equal(dst2, src2)
        assert s.stats()["mooncake"]["down"] == []
        # the new master knows nothing of the blocks saved before: misses
        assert s.lookup(ids) == [False] * 4
    finally:
        if s is not None:
            s.close()
        svc.stop()


def test_bad_configuration_names_the_key(svc, tmp_path):
    t0 = time.monotonic()
    with pytest.raises(ConfigError, match=r"store\.mooncake\.masters.*no mooncake server reachable"):
        open_mooncake(svc, store__mooncake__masters=[f"127.0.0.1:{free_port()}"])
    assert time.monotonic() - t0 < 2
    with pytest.raises(ConfigError, match=r"store\.mooncake\.masters.*not a mooncake_master address"):
        open_mooncake(svc, store__mooncake__masters=["http://127.0.0.1:50051"])
    f = tmp_path / "masters"
    f.write_text(f"# masters\n{svc.master}\nnot-an-address\n")
    with pytest.raises(ConfigError, match=r"store\.mooncake\.servers_file.*'not-an-address'"):
        open_mooncake(svc, store__mooncake__servers_file=str(f))
    f.write_text(f"{svc.master}\n")
    s = open_mooncake(svc, store__mooncake__servers_file=str(f))
    try:
        assert s.servers() == [svc.master]
    finally:
        s.close()


def test_memory_mooncake_pipeline_and_generation(svc):
    ids, src = make_ids(6, 10), payload(6, 10)
    p = open_mooncake(svc, pipeline="memory|mooncake", store__memory__capacity=2 << 20)
    try:
        assert p.wait(p.dump(ids, 0, src)).all_ok
        p.commit(ids, True)
        assert p.lookup(ids) == [True] * 6
        assert p.set_generation(7) >= 7
    finally:
        p.close()
    # a fresh engine: its memory tier is empty, the blocks come from the Mooncake Store
    q = open_mooncake(svc, pipeline="memory|mooncake", store__memory__capacity=2 << 20)
    try:
        assert q.lookup(ids) == [True] * 6
        dst = np.zeros_like(src)
        assert q.wait(q.load(ids, 0, dst)).all_ok and np.array_equal(dst, src)
        assert q.generation() >= 7
    finally:
        q.close()
