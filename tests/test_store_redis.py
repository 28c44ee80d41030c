"""The redis tier against real redis-server processes on 127.0.0.1 (standalone, ACL users,
maxmemory, a 3-master Redis Cluster): the store contract, the consistency protocol, faults
(a killed server, corrupt and foreign values, a full server, wrong credentials) and membership
(rendezvous hashing, a servers file that changes while the store is open)."""
import os
import time

import numpy as np
import pytest

import ucm
from ucm.config import ConfigError
from ucm.store import open_store
from ucm.store.membership import rendezvous

from services import require_module, rng_per_test as rng  # noqa: F401 (a fixture)
from services.redis import RedisCluster, redis_server

redis = require_module("redis")

NS = ucm.Namespace("redis-test", "bfloat16", 16).digest()
SHARD = 4096
N_SHARDS = 4
BLOCK = SHARD * N_SHARDS


def _ids(rng, n):
    return rng.integers(0, 2**63, size=(n, 2), dtype=np.uint64)


def _data(rng, n):
    return rng.integers(0, 256, size=(n, BLOCK), dtype=np.uint8)


def _open(servers, namespace=NS, **redis_opts):
    extra = {k: v for k, v in redis_opts.items() if k in ("timeout_s", "backoff_s", "staging")}
    red = {k: v for k, v in redis_opts.items() if k not in extra}
    return open_store({"store": {"pipeline": "redis", "redis": {"servers": list(servers), **red},
                                 "remote": {"backoff_s": 0.3, "staging": "8MiB", **extra}}},
                      block_bytes=BLOCK, shard_bytes=SHARD, namespace=namespace)


def _put(store, ids, data):
    r = store.wait(store.dump(ids, 0, data))
    store.commit(ids, r.ok)
    return r


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    p = redis_server(tmp_path_factory.mktemp("redis"))
    yield p
    p.stop()


@pytest.fixture
def store(server):
    s = _open([server.url])
    yield s
    s.close()


def test_round_trip_invisible_until_committed(store, rng):
    ids, data = _ids(rng, 12), _data(rng, 12)
    r = store.wait(store.dump(ids, 0, data))
    assert r.all_ok, r.errors
    assert store.lookup(ids) == [False] * 12  # stored, not committed
    store.commit(ids[:8], True)
    store.commit(ids[8:], False)
    assert store.lookup(ids) == [True] * 8 + [False] * 4
    assert store.lookup_prefix(ids) == 8
    out = np.zeros((8, BLOCK), np.uint8)
    r = store.wait(store.load(ids[:8], 0, out))
    assert r.all_ok and (out == data[:8]).all()
    st = store.stats()["redis"]
    assert st["commits"] == 8 and st["discards"] == 4 and st["quarantined"] == 0


def test_layer_by_layer_dumps_and_shard_loads(store, rng):
    ids, data = _ids(rng, 5), _data(rng, 5)
    for k in (2, 0, 3, 1):  # shards arrive in any order, one dump each
        r = store.wait(store.dump(ids, k * SHARD, data[:, k * SHARD:(k + 1) * SHARD]))
        assert r.all_ok, r.errors
        if k != 1:
            assert store.lookup(ids) == [False] * 5
    store.commit(ids, True)
    assert all(store.lookup(ids))
    out = np.zeros((5, 2 * SHARD), np.uint8)
    assert store.wait(store.load(ids, SHARD, out)).all_ok
    assert (out == data[:, SHARD:3 * SHARD]).all()


def test_a_dump_larger_than_the_staging_flows_through_it(server, rng):
    s = _open([server.url], staging=1)  # 4 staging rows
    try:
        ids, data = _ids(rng, 40), _data(rng, 40)
        r = _put(s, ids, data)
        assert r.all_ok, r.errors
        out = np.zeros_like(data)
        assert s.wait(s.load(ids, 0, out)).all_ok and (out == data).all()
    finally:
        s.close()


def test_layer_by_layer_loads_fetch_each_value_once(store, server, rng):
    """An engine loading layer by layer asks for one shard at a time: the whole value comes
    from the server once (every shard checked), the later layers from what was kept."""
    ids, data = _ids(rng, 6), _data(rng, 6)
    _put(store, ids, data)
    raw = _raw(server)
    gets = lambda: raw.info("commandstats").get("cmdstat_get", {}).get("calls", 0)  # noqa: E731
    before = gets()
    for k in range(N_SHARDS):
        out = np.zeros((6, SHARD), np.uint8)
        assert store.wait(store.load(ids, k * SHARD, out)).all_ok
        assert (out == data[:, k * SHARD:(k + 1) * SHARD]).all()
    assert gets() - before == 6
    assert not store._recent  # the last layer's load let them go
    raw.close()


def test_a_block_missing_shards_is_never_published(store, rng):
    ids, data = _ids(rng, 3), _data(rng, 3)
    assert store.wait(store.dump(ids, 0, data[:, :2 * SHARD])).all_ok
    store.commit(ids, True)
    assert store.lookup(ids) == [False] * 3
    assert store.stats()["redis"]["pending_blocks"] == 0  # the staging rows came back


def test_commit_while_the_put_is_in_flight_publishes_when_it_lands(server, rng):
    """A second writer of a block whose first dump is still on its way: its dump joins the put
    in flight, and a commit then publishes it once the bytes landed."""
    s = _open([server.url])
    try:
        ids, data = _ids(rng, 64), _data(rng, 64)
        first = s.dump(ids, 0, data)
        second = s.dump(ids, 0, data)       # same blocks, while the first is in flight
        r2 = s.wait(second)
        s.commit(ids, r2.ok)
        assert s.wait(first).all_ok and r2.all_ok
        assert all(s.lookup(ids))
        out = np.zeros_like(data)
        assert s.wait(s.load(ids, 0, out)).all_ok and (out == data).all()
    finally:
        s.close()


def test_two_nodes_writing_the_same_block_race_harmlessly(server, rng):
    """Two stores (two engines) dump and commit the same content-addressed blocks at once,
    then each reads the other's: whole values, exact bytes."""
    a, b = _open([server.url]), _open([server.url])
    try:
        ids, data = _ids(rng, 40), _data(rng, 40)
        ta, tb = a.dump(ids, 0, data), b.dump(ids, 0, data)
        ra, rb = a.wait(ta), b.wait(tb)
        a.commit(ids, ra.ok)
        b.commit(ids, rb.ok)
        for s in (a, b):
            out = np.zeros_like(data)
            assert s.wait(s.load(ids, 0, out)).all_ok and (out == data).all()
    finally:
        a.close()
        b.close()


def _raw(server):
    return redis.Redis(host="127.0.0.1", port=server.port)


def test_corrupt_truncated_and_foreign_values_are_misses_and_deleted(store, server, rng):
    ids, data = _ids(rng, 4), _data(rng, 4)
    _put(store, ids, data)
    raw = _raw(server)
    vkeys = store._keys(ids, "v")
    flipped = bytearray(raw.get(vkeys[0]))
    flipped[-100] ^= 0x40                                   # a payload bit
    raw.set(vkeys[0], bytes(flipped))
    raw.set(vkeys[1], raw.get(vkeys[1])[:-10])              # truncated
    other = _open([server.url], namespace=ucm.Namespace("other", "bfloat16", 16).digest())
    try:  # a whole, valid value of another namespace, copied under this namespace's key
        _put(other, ids[2:3], data[2:3])
        raw.set(vkeys[2], raw.get(other._keys(ids[2:3], "v")[0]))
    finally:
        other.close()
    out = np.zeros_like(data)
    r = store.wait(store.load(ids, 0, out))
    assert r.ok.tolist() == [False, False, False, True]
    assert "checksum" in r.errors[0] and "bytes" in r.errors[1] and "namespace" in r.errors[2]
    assert (out[3] == data[3]).all()
    assert store.stats()["redis"]["quarantined"] == 3
    assert store.lookup(ids) == [False, False, False, True]  # both keys deleted
    raw.close()


def test_killed_server_fails_fast_and_the_tier_recovers_by_itself(tmp_path, rng):
    p = redis_server(tmp_path)
    s = _open([p.url])
    try:
        ids, data = _ids(rng, 8), _data(rng, 8)
        _put(s, ids, data)
        p.kill()
        t0 = time.monotonic()
        assert s.lookup(ids) == [False] * 8
        out = np.zeros_like(data)
        r = s.wait(s.load(ids, 0, out), timeout=5)
        d = s.wait(s.dump(ids, 0, data), timeout=5)
        assert not r.ok.any() and not d.ok.any()
        assert time.monotonic() - t0 < 1.0  # the first request times out (0.2 s), the rest fail at once
        assert s.stats()["redis"]["unavailable"] >= 1
        assert s.stats()["redis"]["down"] == [p.url]
        p.start()  # same port, empty (no persistence)
        deadline = time.monotonic() + 10
        while True:  # the backoff (0.3 s here) runs out, the next request finds the server
            r = s.wait(s.dump(ids, 0, data))
            if r.all_ok or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert r.all_ok, r.errors
        s.commit(ids, True)
        assert all(s.lookup(ids))
        assert s.stats()["redis"]["down"] == []
    finally:
        s.close()
        p.stop()


def test_full_server_refuses_saves_and_keeps_serving(tmp_path, rng):
    p = redis_server(tmp_path, maxmemory="3mb", policy="noeviction")
    s = _open([p.url])
    try:
        ids, data = _ids(rng, 8), _data(rng, 8)
        _put(s, ids, data)
        assert all(s.lookup(ids))
        big = _ids(rng, 400)
        rows = np.zeros((400, BLOCK), np.uint8)
        r = s.wait(s.dump(big, 0, rows))
        s.commit(big, r.ok)
        assert not r.all_ok and "maxmemory" in next(iter(r.errors.values()))
        assert s.stats()["redis"]["dump_failures"] >= 1
        out = np.zeros_like(data)
        assert s.wait(s.load(ids, 0, out)).all_ok and (out == data).all()
        # at most the saves that succeeded (a marker the full server refused hides its block)
        assert sum(s.lookup(big)) <= int(r.ok.sum())
    finally:
        s.close()
        p.stop()


def test_credentials_and_acl(tmp_path, rng):
    p = redis_server(tmp_path, password="s3cret")
    try:
        with pytest.raises(ConfigError, match="store.redis.servers"):
            _open([p.url])  # no password
        with pytest.raises(ConfigError, match="store.redis.servers"):
            _open([p.url], password="wrong")
        admin = redis.Redis(host="127.0.0.1", port=p.port, password="s3cret")
        # a user that may read but not write: saves fail (counted), reads work
        admin.acl_setuser("reader", enabled=True, passwords=["+rpw"], keys=["*"],
                          commands=["+get", "+exists", "+ping", "+del"])
        w = _open([f"redis://127.0.0.1:{p.port}/0"], password="s3cret")
        r = _open([f"redis://reader:rpw@127.0.0.1:{p.port}/0"])
        try:
            ids, data = _ids(rng, 4), _data(rng, 4)
            _put(w, ids, data)
            out = np.zeros_like(data)
            assert r.wait(r.load(ids, 0, out)).all_ok and (out == data).all()
            more = _ids(rng, 2)
            res = r.wait(r.dump(more, 0, data[:2]))
            assert not res.ok.any() and "no permissions" in res.errors[0]
            assert r.stats()["redis"]["dump_failures"] == 2
            assert "rpw" not in str(r.stats())  # no password in statistics
        finally:
            w.close()
            r.close()
        admin.close()
    finally:
        p.stop()


def test_tls_with_client_certificates(tmp_path, rng):
    from services.redis import make_certs

    certs = make_certs(tmp_path)
    p = redis_server(tmp_path, tls=certs)
    try:
        s = _open([p.url], tls_ca_file=certs["ca.crt"], tls_cert_file=certs["client.crt"],
                  tls_key_file=certs["client.key"])
        try:
            ids, data = _ids(rng, 3), _data(rng, 3)
            assert _put(s, ids, data).all_ok
            out = np.zeros_like(data)
            assert s.wait(s.load(ids, 0, out)).all_ok and (out == data).all()
        finally:
            s.close()
        with pytest.raises(ConfigError, match="store.redis.servers"):  # no client certificate
            _open([p.url], tls_ca_file=certs["ca.crt"])
        with pytest.raises(ConfigError, match="store.redis.servers"):  # server not trusted
            _open([p.url], tls_cert_file=certs["client.crt"], tls_key_file=certs["client.key"])
        with pytest.raises(ConfigError, match="store.redis.servers"):  # plain text to a TLS port
            _open([p.url.replace("rediss://", "redis://")])
    finally:
        p.stop()


def test_bad_configuration_names_the_key():
    with pytest.raises(ConfigError, match="store.redis.servers.*Redis URL"):
        _open(["http://127.0.0.1:1"])
    from services import free_port

    with pytest.raises(ConfigError, match="store.redis.servers.*no redis server reachable"):
        _open([f"redis://127.0.0.1:{free_port()}/0"])
    with pytest.raises(ConfigError, match="store.remote.timeout_s"):
        ucm.Config.load({"store": {"remote": {"timeout_s": 0}}})


def test_ttl_expires_blocks(server, rng):
    s = _open([server.url], ttl_s=1)
    try:
        ids, data = _ids(rng, 2), _data(rng, 2)
        _put(s, ids, data)
        assert all(s.lookup(ids))
        raw = _raw(server)
        assert 0 < raw.pttl(s._keys(ids[:1], "v")[0]) <= 1000
        assert 0 < raw.pttl(s._keys(ids[:1], "m")[0]) <= 1000
        raw.close()
    finally:
        s.close()


def test_generation_is_shared_by_the_engines_of_a_namespace(server):
    ns = ucm.Namespace("gen-test", "bfloat16", 16).digest()
    a, b = _open([server.url], namespace=ns), _open([server.url], namespace=ns)
    try:
        assert a.generation() == 0
        assert a.set_generation(3) == 3
        assert b.generation() == 3
        assert b.set_generation(1) == 3  # never lower
    finally:
        a.close()
        b.close()


# -- membership ----------------------------------------------------------------------------------

def test_rendezvous_balances_and_moves_only_what_it_must():
    ids = np.random.default_rng(5).integers(0, 2**64, size=(100_000, 2), dtype=np.uint64)
    four = [f"redis://10.0.0.{i}:6379/0" for i in range(4)]
    owner = rendezvous(ids, four)
    counts = np.bincount(owner, minlength=4)
    assert counts.max() / counts.mean() <= 1.1
    five = rendezvous(ids, four + ["redis://10.0.0.9:6379/0"])
    moved = np.asarray(four + ["new"])[owner] != np.asarray(four + ["new"])[five]
    assert 0.18 <= moved.mean() <= 0.22
    assert (five[moved] == 4).all()  # every moved block went to the new server
    three = rendezvous(ids, four[:2] + four[3:])  # server 2 leaves
    names3 = np.asarray(four[:2] + four[3:])
    stayed = owner != 2
    assert (np.asarray(four)[owner[stayed]] == names3[three[stayed]]).all()
    # the order of the list does not matter: every engine computes the same owner
    assert (np.asarray(four)[owner] == np.asarray(four[::-1])[rendezvous(ids, four[::-1])]).all()


def test_rendezvous_without_servers_says_so():
    """No server to own a block is the caller's error, named, not numpy's "argmax of an empty
    sequence"."""
    ids = np.zeros((3, 2), np.uint64)
    for got in (ids, ids[:0]):
        with pytest.raises(ValueError, match="no servers"):
            rendezvous(got, [])


def test_servers_file_grows_and_shrinks_the_pool_without_reopening(tmp_path, rng):
    a, b = redis_server(tmp_path, name="a"), redis_server(tmp_path, name="b")
    listing = tmp_path / "servers.txt"
    listing.write_text(a.url + "\n")
    s = _open(["redis://unused:1/0"], servers_file=str(listing))
    try:
        ids, data = _ids(rng, 200), _data(rng, 200)
        _put(s, ids, data)
        assert all(s.lookup(ids))
        listing.write_text(f"# two servers now\n{a.url}\n{b.url}\n")
        time.sleep(1.1)  # the file is checked at most once a second
        hits = np.asarray(s.lookup(ids))
        assert s.servers() == [a.url, b.url]
        moved = rendezvous(ids, [a.url, b.url]) == 1
        assert 0.35 < moved.mean() < 0.65
        assert (hits == ~moved).all()  # blocks that moved are misses until saved again
        _put(s, ids[moved], data[moved])
        assert all(s.lookup(ids))
        assert _raw(b).dbsize() == 2 * int(moved.sum())  # value + marker of each
        listing.write_text(b.url + "\n")  # a leaves: only its blocks are lost
        time.sleep(1.1)
        assert (np.asarray(s.lookup(ids)) == moved).all()
    finally:
        s.close()
        a.stop()
        b.stop()


# -- cluster -------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = RedisCluster(tmp_path_factory.mktemp("cluster"))
    yield c
    c.stop()


def test_cluster_serves_and_survives_a_dead_node(cluster, rng):
    s = _open(cluster.urls, cluster=True)
    try:
        ids, data = _ids(rng, 60), _data(rng, 60)
        r = _put(s, ids, data)
        assert r.all_ok, r.errors
        assert all(s.lookup(ids))
        # keys spread over the three masters (hash tags keep value and marker together)
        per_node = [redis.Redis(port=p.port).dbsize() for p in cluster.nodes]
        assert all(n > 0 for n in per_node) and sum(per_node) == 120
        victim = cluster.nodes[1]
        on_victim = []
        rc = redis.cluster.RedisCluster(host="127.0.0.1", port=cluster.nodes[0].port)
        for k in s._keys(ids, "v"):
            on_victim.append(rc.get_node_from_key(k).port == victim.port)
        rc.close()
        on_victim = np.asarray(on_victim)
        victim.kill()
        t0 = time.monotonic()
        hits = np.asarray(s.lookup(ids))
        out = np.zeros_like(data)
        res = s.wait(s.load(ids, 0, out), timeout=10)
        assert time.monotonic() - t0 < 2.0
        assert (hits == ~on_victim).all()  # the other nodes keep serving their keys
        assert (res.ok == ~on_victim).all()
        assert (out[~on_victim] == data[~on_victim]).all()
    finally:
        s.close()


# -- the dictionary model (tests/store_model.py) ---------------------------------------------------

MODEL_OPS = int(os.environ.get("UCM_MODEL_OPS", "6000")) // 4


@pytest.mark.parametrize("roomy", [True, False], ids=["roomy", "tight"])
@pytest.mark.parametrize("kind", ["redis", "memory|redis"])
def test_redis_tiers_match_the_model(kind, roomy, server):
    """Random operation sequences against the dictionary model: exact bytes, nothing
    unpublished visible, and (roomy) every published block present. Tight: 4 staging rows (dumps
    find them full) and, in the pipeline, a memory tier of 10 slots."""
    from store_model import GEOMETRY, run_model, run_threads
    from ucm.store.memory import MemoryStore
    from ucm.store.pipeline import PipelineStore
    from ucm.store.redis import RedisStore, RedisBackend

    ns = ucm.Namespace(f"model-{kind}-{roomy}", "bfloat16", 16).digest()
    def flush():
        raw = _raw(server)
        raw.flushall()
        raw.close()

    def tier():
        return RedisStore(GEOMETRY, [server.url], lambda url: RedisBackend(url, timeout_s=1.0),
                          namespace=ns, staging_bytes=(1 << 20) if roomy else 1, io_threads=2)

    def open_store():
        if kind == "redis":
            return tier()
        return PipelineStore([MemoryStore(GEOMETRY, buffer_number=128 if roomy else 10,
                                          io_threads=2, namespace=ns), tier()])

    flush()
    if not roomy:  # and eight threads on one store, under the same pressure
        loaded, errors = run_threads(open_store())
        assert not errors, errors[:5]
        assert loaded > 50
        flush()
    counts = run_model(open_store, 500 + roomy + 10 * (kind == "redis"), MODEL_OPS, roomy=roomy,
                       persistent=True)
    print(f"model {kind} {'roomy' if roomy else 'tight'}: {counts}")
    assert counts.get("mismatch", 0) == 0
    assert counts["load_ok"] > MODEL_OPS // 20 and counts["reopen"] > 0
