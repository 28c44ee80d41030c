"""The s3 tier against a real S3-protocol server (moto's, on 127.0.0.1): round trips, multipart
values, the commit protocol, two writers, corrupt objects, a server that dies and comes back,
bad configuration, a memory|s3 pipeline."""
import os
import signal
import threading
import time

import numpy as np
import pytest

import ucm
from ucm.ids import id_hex
from ucm.store import open_store
from ucm.store.pipeline import PipelineStore
from ucm.store.s3 import S3Backend

from services import free_port
from services.s3 import ENV, UNSET, client, moto_server

from test_store import payload  # a block's bytes, a function of its id

NS = ucm.Namespace("test-s3", "bfloat16", 16)
BLOCK, SHARD = 64 << 10, 16 << 10  # 4 shards per block
BUCKET = "ucm-test"


def make_ids(n, seed):
    rng = np.random.default_rng(seed)
    return ucm.hash_blocks(rng.integers(0, 49152, 16 * n), NS)


@pytest.fixture(scope="module")
def aws_env():
    """Dummy credentials for every boto3 client of this module (the tier's and the tests')."""
    with pytest.MonkeyPatch.context() as mp:
        for k in UNSET:
            mp.delenv(k, raising=False)
        for k, v in ENV.items():
            mp.setenv(k, v)
        yield


@pytest.fixture(scope="module")
def server(aws_env, tmp_path_factory):
    proc = moto_server(tmp_path_factory.mktemp("s3"))
    client(proc.url).create_bucket(Bucket=BUCKET)
    yield proc
    proc.stop()


def config(url, prefix, pipeline="s3", s3=None, remote=None, **top):
    return {"store": {"pipeline": pipeline,
                      "s3": {"bucket": BUCKET, "endpoint_url": url, "prefix": prefix, **(s3 or {})},
                      # moto on a shared 2-core machine: a generous timeout, small staging
                      "remote": {"timeout_s": 2.0, "backoff_s": 0.2, "staging": "4MiB",
                                 **(remote or {})}},
            **top}


def open_s3(url, prefix, block=BLOCK, shard=SHARD, **kw):
    return open_store(config(url, prefix, **kw), block_bytes=block, shard_bytes=shard,
                      namespace=NS.digest())


def value_key(prefix, bid):
    return f"{prefix}/{NS.digest().hex()}/{id_hex(bid.reshape(1, 2))[0]}.v"


def listing(url, prefix):
    pages = client(url).get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix)
    return {o["Key"] for page in pages for o in page.get("Contents", ())}


def test_round_trip_whole_and_shard_by_shard_invisible_until_commit(server):
    s = open_s3(server.url, "rt")
    assert s.name == "s3"
    ids = make_ids(6, seed=1)
    src = payload(ids)
    assert s.wait(s.dump(ids[:3], 0, src[:3])).all_ok
    for k in range(4):  # layer by layer: the value is put once its last shard is staged
        sl = slice(k * SHARD, (k + 1) * SHARD)
        assert s.wait(s.dump(ids[3:], k * SHARD, np.ascontiguousarray(src[3:, sl]))).all_ok
    assert s.lookup(ids) == [False] * 6  # stored, not committed: invisible
    s.commit(ids[:5], True)
    s.commit(ids[5:], False)
    assert s.lookup(ids) == [True] * 5 + [False]
    dst = np.zeros_like(src[:5])
    assert s.wait(s.load(ids[:5], 0, dst)).all_ok and np.array_equal(dst, src[:5])
    part = np.zeros((5, 2 * SHARD), np.uint8)  # shards 1 and 2 only
    assert s.wait(s.load(ids[:5], SHARD, part)).all_ok
    assert np.array_equal(part, src[:5, SHARD:3 * SHARD])

    # layout: <prefix>/<namespace>/<id>.v|.m; the discarded block has no marker
    keys = listing(server.url, "rt/")
    hexes = id_hex(ids)
    ns = NS.digest().hex()
    assert {f"rt/{ns}/{h}.{kind}" for h in hexes[:5] for kind in "vm"} <= keys
    assert f"rt/{ns}/{hexes[5]}.m" not in keys
    backend = S3Backend(BUCKET, endpoint_url=server.url, timeout_s=2.0)
    assert set(backend.keys("rt/")) == keys
    backend.close()

    # another store object (another engine) sees the committed blocks and the generation
    assert s.set_generation(3) == 3
    other = open_s3(server.url, "rt")
    assert other.lookup(ids) == [True] * 5 + [False] and other.generation() == 3
    dst2 = np.zeros_like(src[:5])
    assert other.wait(other.load(ids[:5], 0, dst2)).all_ok and np.array_equal(dst2, src[:5])
    for st in (s.stats()["s3"], other.stats()["s3"]):
        assert st["quarantined"] == st["unavailable"] == st["io_errors"] == 0
    other.close()
    s.close()


def test_value_above_multipart_threshold_and_failed_upload_aborted(server):
    block, shard = 6 << 20, 3 << 20  # value = header + 6 MiB > 5 MiB: two parts
    s = open_s3(server.url, "mp", block=block, shard=shard, s3={"multipart_bytes": "5MiB"},
                remote={"staging": "32MiB"})
    ids = make_ids(2, seed=2)
    src = payload(ids, block)
    assert s.wait(s.dump(ids, 0, src)).all_ok
    s.commit(ids, True)
    dst = np.zeros_like(src)
    assert s.wait(s.load(ids, 0, dst)).all_ok and np.array_equal(dst, src)
    raw = client(server.url)
    head = raw.head_object(Bucket=BUCKET, Key=value_key("mp", ids[0]))
    assert head["ETag"].strip('"').endswith("-2")  # S3's ETag of a two-part upload
    assert head["ContentLength"] == s.value_bytes
    s.close()

    # An upload the server refuses at completion (parts under S3's 5 MiB minimum) is aborted:
    # no object, no upload left behind, the put reports why.
    b = S3Backend(BUCKET, endpoint_url=server.url, timeout_s=2.0, part_bytes=1 << 20)
    why = b.put(["mp/refused.v"], [memoryview(src[0, :3 << 20])])
    assert why[0] and "EntityTooSmall" in why[0]
    assert b.exists(["mp/refused.v"]) == [False]
    assert not raw.list_multipart_uploads(Bucket=BUCKET, Prefix="mp/").get("Uploads")
    b.close()


def test_two_nodes_writing_the_same_blocks_race_harmlessly(server):
    a, b = open_s3(server.url, "race"), open_s3(server.url, "race")
    ids = make_ids(8, seed=3)
    src = payload(ids)
    start = threading.Barrier(2)
    errors = []

    def node(store):
        try:
            start.wait()
            for _ in range(2):
                res = store.wait(store.dump(ids, 0, src))
                store.commit(ids, res.ok)
                assert res.all_ok, res.errors
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=node, args=(x,)) for x in (a, b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors
    for store in (a, b):
        assert store.lookup(ids) == [True] * len(ids)
        dst = np.zeros_like(src)
        assert store.wait(store.load(ids, 0, dst)).all_ok and np.array_equal(dst, src)
        assert store.stats()["s3"]["quarantined"] == 0
    a.close()
    b.close()


def test_corrupt_or_truncated_object_is_a_miss_and_quarantined(server):
    s = open_s3(server.url, "bad")
    ids = make_ids(4, seed=4)
    src = payload(ids)
    s.commit(ids, s.wait(s.dump(ids, 0, src)).ok)
    raw = client(server.url)
    keys = [value_key("bad", bid) for bid in ids]
    good = raw.get_object(Bucket=BUCKET, Key=keys[0])["Body"].read()
    assert len(good) == s.value_bytes
    header = s.header_bytes

    def tamper(key, fn):
        data = bytearray(raw.get_object(Bucket=BUCKET, Key=key)["Body"].read())
        raw.put_object(Bucket=BUCKET, Key=key, Body=bytes(fn(data)))

    tamper(keys[0], lambda d: d.__setitem__(header + 5, d[header + 5] ^ 1) or d)  # payload bit
    tamper(keys[1], lambda d: d[:-100])                                          # truncated
    tamper(keys[2], lambda d: d.__setitem__(20, d[20] ^ 0xFF) or d)              # header byte
    assert s.lookup(ids) == [True] * 4  # markers are there; the values are checked on load
    dst = np.zeros_like(src)
    res = s.wait(s.load(ids, 0, dst))
    assert res.ok.tolist() == [False, False, False, True]
    assert all("corrupt" in res.errors[i] for i in range(3))
    assert np.array_equal(dst[3], src[3])
    assert s.stats()["s3"]["quarantined"] == 3
    assert s.lookup(ids) == [False, False, False, True]  # both keys of each deleted
    assert not listing(server.url, keys[0]) and not listing(server.url, keys[0][:-1] + "m")
    s.close()


def _recovers(s, ids, src, timeout=20.0):
    """Dump and commit ``ids`` until it works (the tier tries the server again by itself once
    its backoff ran out); the result of the last try."""
    deadline = time.monotonic() + timeout
    while True:
        res = s.wait(s.dump(ids, 0, src), timeout=10)
        s.commit(ids, res.ok)
        if res.all_ok or time.monotonic() > deadline:
            return res
        time.sleep(0.1)


def test_server_hung_or_killed_fails_fast_as_misses_then_recovers_by_itself(aws_env, tmp_path):
    proc = moto_server(tmp_path, name="moto-dies")
    s = None
    timeout_s = 1.0  # a hung server costs one of these; 5 would mean retries per attempt
    try:
        client(proc.url).create_bucket(Bucket=BUCKET)
        s = open_s3(proc.url, "down", remote={"timeout_s": timeout_s})
        ids = make_ids(4, seed=5)
        src = payload(ids)
        s.commit(ids, s.wait(s.dump(ids, 0, src)).ok)
        assert s.lookup(ids) == [True] * 4

        # Hung (SIGSTOP): connections are accepted by the kernel, replies never come. One
        # timeout, not one per attempt or per key, then the server is left alone.
        os.kill(proc.pid, signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            assert s.lookup(ids) == [False] * 4
            dst = np.zeros_like(src)
            assert not s.wait(s.load(ids, 0, dst), timeout=10).ok.any()
            assert time.monotonic() - t0 < 3 * timeout_s
            assert s.stats()["s3"]["down"] == s.servers()
        finally:
            os.kill(proc.pid, signal.SIGCONT)
        deadline = time.monotonic() + 20
        while s.lookup(ids) != [True] * 4 and time.monotonic() < deadline:
            time.sleep(0.1)
        dst = np.zeros_like(src)
        assert s.wait(s.load(ids, 0, dst)).all_ok and np.array_equal(dst, src)

        # Killed: refused at once.
        proc.kill()
        t0 = time.monotonic()
        assert s.lookup(ids) == [False] * 4
        assert not s.wait(s.load(ids, 0, dst), timeout=10).ok.any()
        more = make_ids(2, seed=6)
        res = s.wait(s.dump(more, 0, payload(more)), timeout=10)
        s.commit(more, res.ok)
        assert not res.ok.any()
        assert time.monotonic() - t0 < 2 * timeout_s
        st = s.stats()["s3"]
        assert st["unavailable"] >= 4 and st["down"] == s.servers()

        proc.start()  # same port; moto keeps nothing, so this is an empty service
        client(proc.url).create_bucket(Bucket=BUCKET)
        res = _recovers(s, more, payload(more))
        assert res.all_ok, res.errors
        assert s.lookup(more) == [True, True] and s.stats()["s3"]["down"] == []
        assert s.lookup(ids) == [False] * 4  # the old blocks went with the old server
        dst = np.zeros((2, BLOCK), np.uint8)
        assert s.wait(s.load(more, 0, dst)).all_ok and np.array_equal(dst, payload(more))
    finally:
        if s is not None:
            s.close()
        if proc.alive():
            os.kill(proc.pid, signal.SIGCONT)
        proc.stop()


def test_bad_configuration_names_the_key(server):
    dead = f"http://127.0.0.1:{free_port()}"
    cases = [
        ({"bucket": ""}, "store.s3.bucket", "empty"),
        ({"bucket": "s3://ucm-test"}, "store.s3.bucket", "no s3:// scheme"),
        ({"bucket": "no-such-bucket"}, "store.s3.bucket", "does not exist"),
        ({"endpoint_url": "127.0.0.1:9000"}, "store.s3.endpoint_url", "http://host"),
        ({"endpoint_url": "http://key:s3cret@127.0.0.1:9000"}, "store.s3.endpoint_url",
         "credentials do not belong in the URL"),
        ({"endpoint_url": dead}, "store.s3.endpoint_url", "not reachable"),
        ({"multipart_bytes": "1MiB"}, "store.s3.multipart_bytes", ""),
        ({"max_attempts": 0}, "store.s3.max_attempts", ""),
        ({"prefix": "/abs"}, "store.s3.prefix", ""),
    ]
    for s3, key, words in cases:
        t0 = time.monotonic()
        with pytest.raises(ValueError) as err:
            open_s3(server.url, "cfg", s3=s3)
        text = str(err.value)
        assert f"'{key}'" in text and words in text, (s3, text)
        assert "s3cret" not in text
        assert time.monotonic() - t0 < 2.0


def test_memory_s3_pipeline_round_trip(server):
    s = open_s3(server.url, "pipe", pipeline="memory|s3", buffer_number=16)
    assert isinstance(s, PipelineStore) and [t.name for t in s.tiers] == ["memory", "s3"]
    ids = make_ids(6, seed=7)
    src = payload(ids)
    s.commit(ids, s.wait(s.dump(ids, 0, src)).ok)
    dst = np.zeros_like(src)
    assert s.wait(s.load(ids, 0, dst)).all_ok and np.array_equal(dst, src)
    s.close()
    # another engine: an empty memory tier, the blocks come from the bucket
    s = open_s3(server.url, "pipe", pipeline="memory|s3", buffer_number=16)
    assert s.lookup(ids) == [True] * 6
    dst = np.zeros_like(src)
    assert s.wait(s.load(ids, 0, dst)).all_ok and np.array_equal(dst, src)
    s.flush()
    st = s.stats()["pipeline"]
    assert st["hits_by_tier"]["memory"] == 0 and st["promotions"] == 6  # now in memory too
    assert s.tiers[0].lookup(ids) == [True] * 6
    s.close()
