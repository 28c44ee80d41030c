"""Hostile conditions for the mooncake tier (``ucm.store.mooncake`` over a real mooncake_master
and mooncake_client storage node on 127.0.0.1, ``tests/services/mooncake.py``): thousands of
blocks in one request, values tampered with through a second client, a storage node killed,
option values Mooncake refuses, lifecycle misuse, concurrent dumps of one block. Every fault
must read as a miss of the blocks it touches (never an exception out of lookup or load, never
another block's bytes), and bad configuration as a ConfigError naming the key."""
import threading

import numpy as np
import pytest

import ucm
from ucm.config import Config, ConfigError
from ucm.store import open_store
from ucm.store.base import BlockGeometry
from ucm.store.mooncake import MooncakeStore

from services import require_module, rng_per_test as rng  # noqa: F401 (a fixture)
from services.mooncake import MooncakeService
from test_store_mooncake import svc  # noqa: F401 (a fixture: a master and a storage node)

NS = ucm.Namespace("bad-input-mooncake", "bfloat16", 16)
SHARD = 1024
BLOCK = 4 * SHARD          # small blocks: thousands fit in one batched request
MANY = 2600                # blocks in one request: more than Mooncake moves at once (~2048)


def _opts(svc, **kw):
    opts = dict(store__pipeline="mooncake", store__mooncake__masters=[svc.master],
                store__mooncake__metadata_server=svc.metadata_server,
                store__remote__staging=4 << 20, store__remote__timeout_s=0.2,
                store__remote__backoff_s=0.2)
    opts.update(kw)
    return opts


def _open(svc, block=BLOCK, shard=SHARD, **kw):
    return open_store(None, block_bytes=block, shard_bytes=shard, namespace=NS.digest(),
                      **_opts(svc, **kw))


def _ids(rng, n):
    return rng.integers(0, 2**63, size=(n, 2), dtype=np.uint64)


def _data(rng, n, nbytes=BLOCK):
    return rng.integers(0, 256, size=(n, nbytes), dtype=np.uint8)


def _save(store, ids, data, step=500):
    """Dump and commit in requests of at most ``step`` blocks."""
    for lo in range(0, len(ids), step):
        r = store.wait(store.dump(ids[lo:lo + step], 0, data[lo:lo + step]), timeout=30)
        assert r.all_ok, list(r.errors.values())[:3]
        store.commit(ids[lo:lo + step], r.ok)


# ---------------------------------------------------------------------------------------------
# thousands of blocks in one request

def test_a_dump_of_thousands_of_blocks_in_one_batch_stores_them_all(svc, rng):
    """With small blocks a batch holds more than 2048 values (16 MiB of 4 KiB blocks); Mooncake's
    client fails the transfers past about 2048 keys in flight (TRANSFER_FAIL, at times only after
    a 60 s wait): the dump outlived its wait, and the blocks past the limit were not stored."""
    s = _open(svc, store__remote__staging=64 << 20)
    try:
        assert s.batch_blocks >= MANY  # one request carries them all
        ids, data = _ids(rng, MANY), _data(rng, MANY)
        r = s.wait(s.dump(ids, 0, data), timeout=30)
        assert r.ok.sum() == MANY, list(r.errors.values())[:3]
        assert s.stats()["mooncake"]["dump_failures"] == 0
    finally:
        s.close()


def test_dumps_in_parallel_batches_store_them_all(svc, rng):
    """Batches of 800 blocks each put by their own thread: 3200 keys in flight on one client,
    the same failure as one batch of 3200."""
    s = _open(svc, store__remote__staging=64 << 20, store__io_threads=4,
              store__remote__batch_bytes=800 * (BLOCK + 128))
    try:
        assert s.batch_blocks == 800
        ids, data = _ids(rng, 3200), _data(rng, 3200)
        r = s.wait(s.dump(ids, 0, data), timeout=30)
        assert r.ok.sum() == 3200, list(r.errors.values())[:3]
    finally:
        s.close()


def test_a_load_of_thousands_of_blocks_in_one_batch_reads_them_all(svc, rng):
    """Saved in small requests, loaded in one: the reads past ~2048 keys in flight failed
    (TRANSFER_FAIL, at times after a 60 s wait), so blocks that lookup reported came back as
    misses, or the load outlived its wait."""
    s = _open(svc, store__remote__staging=64 << 20)
    try:
        ids, data = _ids(rng, MANY), _data(rng, MANY)
        _save(s, ids, data)
        assert all(s.lookup(ids))
        out = np.zeros_like(data)
        r = s.wait(s.load(ids, 0, out), timeout=30)
        assert r.ok.sum() == MANY, list(r.errors.values())[:3]
        assert (out == data).all()
    finally:
        s.close()


def test_a_commit_of_thousands_of_blocks_publishes_them_all(svc, rng):
    """A long prompt commits thousands of blocks at once. Their markers went to Mooncake in one
    put_batch, which failed past ~2048 keys (TRANSFER_FAIL, at times after a 60 s wait inside
    commit): the blocks were stored and never became visible."""
    s = _open(svc, store__remote__staging=64 << 20)
    try:
        ids, data = _ids(rng, MANY), _data(rng, MANY)
        for lo in range(0, MANY, 500):
            r = s.wait(s.dump(ids[lo:lo + 500], 0, data[lo:lo + 500]), timeout=30)
            assert r.all_ok
        s.commit(ids, True)
        hit = np.asarray(s.lookup(ids))
        assert hit.sum() == MANY
        assert s.stats()["mooncake"]["io_errors"] == 0
    finally:
        s.close()


# ---------------------------------------------------------------------------------------------
# configuration

def test_a_master_port_of_non_ascii_digits_is_a_config_error(svc):
    """``str.isdigit`` takes '²' (int() then raised a bare ValueError naming no key) and '５'
    (accepted, then Mooncake could not connect: 'no server reachable' after seconds)."""
    port = svc.master.rsplit(":", 1)[1]
    wide = "".join(chr(ord(c) + 0xFEE0) for c in port)  # fullwidth digits
    for bad in ("127.0.0.1:²", f"127.0.0.1:{wide}"):
        with pytest.raises(ConfigError, match=r"store\.mooncake\.masters.*not a mooncake_master "
                                              r"address"):
            _open(svc, store__mooncake__masters=[bad])


def test_option_values_mooncake_refuses_are_config_errors_naming_the_key(svc):
    """A segment under 16 MiB or an empty local host name failed the client's setup
    (INVALID_PARAMS), reported as 'store.mooncake.masters: no mooncake server reachable'."""
    for size in (1, 4096, (16 << 20) - 1):
        with pytest.raises(ConfigError, match=r"store\.mooncake\.global_segment_size.*16 MiB"):
            _open(svc, store__mooncake__global_segment_size=size)
    for host in ("", "  "):
        with pytest.raises(ConfigError, match=r"store\.mooncake\.local_hostname"):
            _open(svc, store__mooncake__local_hostname=host)
    for key, value in (("protocol", "udp"), ("replicas", 0), ("global_segment_size", -1)):
        with pytest.raises(ConfigError, match=rf"store\.mooncake\.{key}"):
            _open(svc, **{f"store__mooncake__{key}": value})
    # the boundary: an engine that lends exactly 16 MiB opens and stores
    s = _open(svc, store__mooncake__global_segment_size=16 << 20)
    try:
        ids, data = _ids(np.random.default_rng(1), 2), _data(np.random.default_rng(1), 2)
        _save(s, ids, data)
        assert s.lookup(ids) == [True, True]
    finally:
        s.close()


# ---------------------------------------------------------------------------------------------
# values tampered with through a second client

def test_tampered_values_are_misses_of_their_blocks_alone(svc, rng):
    """Truncated, longer than a row, another block's value, another codec's header, zeros of the
    right length, a value removed after lookup: misses, quarantined where corrupt, never another
    block's bytes, never raised; the untouched blocks of the same batch load."""
    s = _open(svc)
    other = MooncakeStore.from_config(BlockGeometry(BLOCK, SHARD), Config().replace(**{
        k.replace("__", "."): v for k, v in _opts(svc).items()}), NS.digest(), codec=3)
    raw = svc.client()
    try:
        ids, data = _ids(rng, 8), _data(rng, 8)
        _save(s, ids, data)
        v = s._keys(ids, "v")
        good = [raw.get(k) for k in v]
        assert all(len(g) == s.value_bytes for g in good)
        assert raw.remove(v[4], True) == 0
        _save(other, ids[4:5], data[4:5])   # block 4 saved again, its header of codec 3
        assert raw.upsert(v[0], good[0][:len(good[0]) // 2]) == 0
        assert raw.upsert(v[1], good[1] + b"x" * 4096) == 0      # longer than a staging row
        assert raw.upsert(v[2], good[7]) == 0                     # block 7's valid value
        assert raw.upsert(v[3], bytes(len(good[3]))) == 0
        assert raw.remove(v[5], True) == 0                        # gone after the lookup
        out = np.full_like(data, 0xAB)
        r = s.wait(s.load(ids, 0, out), timeout=10)
        assert r.ok.tolist() == [False] * 6 + [True] * 2, r.errors
        assert (out[6:] == data[6:]).all()
        assert not (out[2] == data[7]).all()                      # never another block's bytes
        assert s.stats()["mooncake"]["quarantined"] == 5
        assert s.lookup(ids) == [False] * 6 + [True] * 2          # both keys of the bad deleted
        # a layer-by-layer load of a tampered value (the path that keeps whole values)
        _save(s, ids[:1], data[:1])
        assert raw.upsert(v[0], good[7]) == 0
        part = np.zeros((2, SHARD), np.uint8)
        r = s.wait(s.load(ids[[0, 6]], 0, part), timeout=10)
        assert r.ok.tolist() == [False, True] and (part[1] == data[6, :SHARD]).all()
    finally:
        raw.close()
        other.close()
        s.close()


# ---------------------------------------------------------------------------------------------
# lifecycle and concurrency

def test_use_after_close_and_close_twice(svc, rng):
    s = _open(svc)
    ids, data = _ids(rng, 4), _data(rng, 4)
    _save(s, ids, data)
    backend = s._servers[svc.master].backend
    s.close()
    s.close()
    backend.close()  # a backend closed twice
    assert s.lookup(ids) == [False] * 4
    s.commit(ids, True)
    with pytest.raises(ValueError, match="closed"):
        s.load(ids, 0, np.zeros_like(data))
    with pytest.raises(ValueError, match="closed"):
        s.dump(ids, 0, data)
    # another engine still sees the blocks
    t = _open(svc)
    try:
        out = np.zeros_like(data)
        assert t.wait(t.load(ids, 0, out)).all_ok and (out == data).all()
    finally:
        t.close()


def test_concurrent_dumps_of_one_block(svc, rng):
    """Four threads dump the same blocks at once: every dump succeeds, one whole value per
    block, nothing quarantined."""
    s = _open(svc)
    try:
        ids, data = _ids(rng, 16), _data(rng, 16)
        results, errors = [], []

        def dump():
            try:
                r = s.wait(s.dump(ids, 0, data), timeout=10)
                results.append(r.all_ok)
                s.commit(ids, r.ok)
            except Exception as exc:  # reported below
                errors.append(repr(exc))

        threads = [threading.Thread(target=dump) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors and results == [True] * 4
        assert s.lookup(ids) == [True] * 16
        out = np.zeros_like(data)
        assert s.wait(s.load(ids, 0, out), timeout=10).all_ok and (out == data).all()
        assert s.stats()["mooncake"]["quarantined"] == 0
    finally:
        s.close()


def test_a_load_that_names_a_block_twice_reads_it_and_deletes_nothing(svc, rng):
    """Mooncake's batch_get_into reads a key named twice into the last of its buffers only and
    reports both as read: the first staging row kept another block's value, so the block
    failed verification and its valid value and marker were deleted (quarantined)."""
    s = _open(svc)
    try:
        ids, data = _ids(rng, 8), _data(rng, 8)
        _save(s, ids, data)
        out = np.zeros_like(data)
        assert s.wait(s.load(ids, 0, out)).all_ok  # the staging rows now hold these values
        twice = ids[[0, 1, 2, 3, 0, 1, 2, 3]]
        # a dump naming blocks twice as well
        assert s.wait(s.dump(twice, 0, data[[0, 1, 2, 3, 0, 1, 2, 3]]), timeout=10).all_ok
        s.commit(twice, True)
        for sel in ([0, 1, 2, 3, 0, 1, 2, 3], [4, 4], [5, 6, 5, 7, 7]):
            out = np.zeros((len(sel), BLOCK), np.uint8)
            r = s.wait(s.load(ids[sel], 0, out), timeout=10)
            assert r.all_ok, r.errors
            assert (out == data[sel]).all()
        assert s.stats()["mooncake"]["quarantined"] == 0
        assert s.lookup(ids) == [True] * 8
    finally:
        s.close()


# ---------------------------------------------------------------------------------------------
# a small store: a block larger than the segment, a storage node killed

@pytest.fixture
def small_svc(tmp_path):
    require_module("mooncake.store")
    s = MooncakeService(tmp_path, segment="16MB")
    yield s
    s.stop()


def test_a_block_larger_than_the_segment_and_a_killed_storage_node(small_svc, rng):
    """A block that no segment can hold fails its dump (the store stays usable); a storage
    node killed makes its blocks misses (lookup may still report them) and dumps fail, never
    an exception or wrong bytes; once it is back, blocks are stored again."""
    big_block = 20 << 20
    s = _open(small_svc, block=big_block, shard=big_block // 4,
              store__remote__staging=4 * (big_block + 128))
    try:
        ids = _ids(rng, 1)
        src = _data(rng, 1, big_block)
        r = s.wait(s.dump(ids, 0, src), timeout=30)
        assert not r.ok.any() and "NO_AVAILABLE_HANDLE" in r.errors[0]
        s.commit(ids, r.ok)
        assert s.lookup(ids) == [False]
        assert not s.wait(s.load(ids, 0, np.zeros_like(src)), timeout=30).ok.any()
    finally:
        s.close()

    s = _open(small_svc)
    try:
        ids, data = _ids(rng, 16), _data(rng, 16)
        _save(s, ids, data)
        small_svc.node.kill()
        for _ in range(2):
            s.lookup(ids)  # no exception: hits or misses
            out = np.zeros_like(data)
            r = s.wait(s.load(ids, 0, out), timeout=30)
            assert not r.ok.any() and not out.any()
            more = _ids(rng, 4)
            assert not s.wait(s.dump(more, 0, data[:4]), timeout=30).ok.any()
        assert s.stats()["mooncake"]["quarantined"] == 0
        small_svc.node.start()
        fresh, fdata = _ids(rng, 4), _data(rng, 4)
        for _ in range(100):  # the node mounts its memory again by itself; until the master
            # drops the dead one, puts of values and markers placed there fail
            r = s.wait(s.dump(fresh, 0, fdata), timeout=30)
            s.commit(fresh, r.ok)
            if r.all_ok and all(s.lookup(fresh)):
                break
            threading.Event().wait(0.1)
        out = np.zeros_like(fdata)
        assert s.wait(s.load(fresh, 0, out), timeout=30).all_ok and (out == fdata).all()
    finally:
        s.close()
