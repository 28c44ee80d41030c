"""Hostile conditions for the s3 tier (``ucm.store.s3`` over moto's real S3-protocol server on
127.0.0.1): objects tampered with on the server, a bucket deleted mid-run, servers that accept
connections and never answer, close them at once or answer garbage, an AWS credential chain that
cannot be read, configuration values S3 cannot take, duplicate and concurrent dumps, batches
larger than the staging, use during and after close. Every storage fault must read as a miss of
the blocks it touches (never an exception out of lookup or load, never another block's bytes);
bad configuration is a ValueError naming the key."""
import os
import signal
import threading
import time
import tracemalloc

import numpy as np
import pytest

import ucm
from ucm.store import open_store

from services import FakeServer, rng_per_test as rng  # noqa: F401 (a fixture)
from services.s3 import client, moto_server
from test_store_s3 import aws_env  # noqa: F401 (a fixture: dummy AWS credentials)

NS = ucm.Namespace("bad-input-s3", "bfloat16", 16).digest()
SHARD = 16 << 10
BLOCK = 4 * SHARD
BUCKET = "ucm-bad"


@pytest.fixture(scope="module")
def server(aws_env, tmp_path_factory):
    proc = moto_server(tmp_path_factory.mktemp("s3"), name="moto-bad")
    client(proc.url).create_bucket(Bucket=BUCKET)
    yield proc
    proc.stop()


def _open(url, prefix="bad", bucket=BUCKET, namespace=NS, remote=None, **s3):
    return open_store({"store": {"pipeline": "s3",
                                 "s3": {"bucket": bucket, "endpoint_url": url, "prefix": prefix,
                                        **s3},
                                 # moto on a shared 2-core machine: a generous timeout
                                 "remote": {"timeout_s": 10.0, "backoff_s": 0.2, "staging": "4MiB",
                                            **(remote or {})}}},
                      block_bytes=BLOCK, shard_bytes=SHARD, namespace=namespace)


def _ids(rng, n):
    return rng.integers(0, 2**63, size=(n, 2), dtype=np.uint64)


def _data(rng, n):
    return rng.integers(0, 256, size=(n, BLOCK), dtype=np.uint8)


def _put(store, ids, data):
    r = store.wait(store.dump(ids, 0, data), timeout=20)
    assert r.all_ok, r.errors
    store.commit(ids, r.ok)


def _config_error(url, key, **s3):
    with pytest.raises(ValueError) as err:
        _open(url, **s3).close()
    text = str(err.value)
    assert f"'{key}'" in text, text
    return text


# -- configuration ------------------------------------------------------------------------------

@pytest.mark.parametrize("bucket", ["ucm?bad", "ucm#bad", "ucm%bad", "ucm\u00e9bad", "ucm\x00bad"])
def test_a_bucket_name_no_s3_request_can_address_is_a_config_error(server, bucket):
    """Characters outside S3's bucket alphabet used to pass ucm's check and raise botocore's
    ParamValidationError (not a ValueError, no config key) out of open_store."""
    text = _config_error(server.url, "store.s3.bucket", bucket=bucket)
    assert "letters, digits" in text


def test_a_region_with_a_trailing_newline_names_the_region(server):
    """botocore's region check matches with ``$``, which takes a trailing newline (a value read
    from a file): the tier opened a client, the HTTP layer refused the header and the error
    blamed the endpoint ('not reachable'). It must name store.s3.region."""
    text = _config_error(server.url, "store.s3.region", region="us-east-1\n")
    assert "us-east-1" in text and "not reachable" not in text


def test_multipart_bytes_above_what_s3_takes_is_refused(server):
    """S3 takes parts of at most 5 GiB and at most 5 GiB in one PutObject: a larger
    store.s3.multipart_bytes used to be accepted (values up to it would be sent in one request
    S3 refuses). 5 GiB itself is accepted."""
    text = _config_error(server.url, "store.s3.multipart_bytes", multipart_bytes="6GiB")
    assert "5 GiB" in text
    _open(server.url, multipart_bytes="5GiB").close()


@pytest.mark.parametrize("prefix", ["x/../y", "x/./y", "x//y", "x/", "..", "."])
def test_a_prefix_with_path_segments_servers_rewrite_is_a_config_error(prefix):
    """Keys are literal on AWS, but servers that map keys to paths (MinIO among them) refuse or
    fold '.', '..' and empty segments, so two prefixes could name one place, or every put
    fail. Such a store.s3.prefix used to be accepted."""
    with pytest.raises(ValueError, match="store.s3.prefix"):
        ucm.Config({"store": {"s3": {"prefix": prefix}}})
    ucm.Config({"store": {"s3": {"prefix": "team-a/ucm.v2"}}})


@pytest.mark.parametrize("case", ["key-without-secret", "missing-profile", "unparsable-config"])
def test_an_aws_chain_that_cannot_be_read_is_a_config_error(server, tmp_path, monkeypatch, case):
    """The AWS chain is read when the tier makes its clients: an access key id without its
    secret, a profile that does not exist, or a config file that does not parse used to raise
    botocore's own errors (PartialCredentialsError, ProfileNotFound, ConfigParseError: not
    ValueErrors) out of open_store."""
    if case == "key-without-secret":
        monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    elif case == "missing-profile":
        monkeypatch.setenv("AWS_PROFILE", "no-such-profile")
    else:
        bad = tmp_path / "aws-config"
        bad.write_text("[default\nregion = \n")
        monkeypatch.setenv("AWS_CONFIG_FILE", str(bad))
    text = _config_error(server.url, "store.s3.endpoint_url")
    assert "AWS chain" in text


def test_credentials_the_server_refuses_fail_open_with_the_key(aws_env, tmp_path, monkeypatch):
    """A server that checks signatures (moto with authentication on after the first request,
    which creates the bucket) and keys it does not know: refused at open, with the reason."""
    monkeypatch.setenv("INITIAL_NO_AUTH_ACTION_COUNT", "1")
    proc = moto_server(tmp_path, name="moto-auth")
    try:
        client(proc.url).create_bucket(Bucket=BUCKET)
        text = _config_error(proc.url, "store.s3.endpoint_url")
        assert "403" in text and "credentials are refused" in text
    finally:
        proc.stop()


@pytest.mark.parametrize("mode", ["silent", "close", "garbage"])
def test_an_endpoint_that_is_no_s3_server_fails_open_with_the_key(aws_env, mode):
    bad = FakeServer(mode, b"-ERR this is not an S3 server\r\n")
    bad.url = f"http://127.0.0.1:{bad.port}"
    try:
        text = _config_error(bad.url, "store.s3.endpoint_url", remote={"timeout_s": 0.2})
        assert "not reachable" in text
        assert 1 <= bad.accepted <= 2  # one request, retried at most once (a closed connection)
    finally:
        bad.shutdown()


def test_an_endpoint_that_answers_200_to_everything_fails_open_with_the_key(aws_env):
    """A web server or proxy that answers every request with 200 (an endpoint URL pointing at
    the wrong service) passed the bucket check: every lookup then said hit and every load
    missed, so the engine planned loads that all failed, with no error anywhere. The tier now
    asks at open for an object that cannot exist and refuses an endpoint that says it does."""
    ok = b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
    bad = FakeServer("garbage", ok)
    bad.url = f"http://127.0.0.1:{bad.port}"
    try:
        text = _config_error(bad.url, "store.s3.endpoint_url", remote={"timeout_s": 2.0})
        assert "cannot exist" in text
    finally:
        bad.shutdown()


# -- objects tampered with on the server ---------------------------------------------------------

def test_tampered_objects_are_clean_misses_never_another_blocks_bytes(server, rng):
    s = _open(server.url, prefix="tamper")
    other_ns = _open(server.url, prefix="tamper", namespace=ucm.Namespace("x", "fp8", 16).digest())
    other_codec = _open(server.url, prefix="tamper")
    other_codec.codec = 1  # a writer whose values are encoded with another codec
    raw = client(server.url)
    try:
        ids, data = _ids(rng, 9), _data(rng, 9)
        _put(s, ids, data)
        _put(other_ns, ids[1:2], data[1:2])
        v = s._keys(ids, "v")

        def get(key):
            return raw.get_object(Bucket=BUCKET, Key=key)["Body"].read()

        def put(key, body):
            raw.put_object(Bucket=BUCKET, Key=key, Body=body)

        put(v[0], get(v[8]))                                   # another block's whole value
        put(v[1], get(other_ns._keys(ids[1:2], "v")[0]))       # same id, another namespace
        other_codec.wait(other_codec.dump(ids[2:3], 0, data[2:3]))  # same id, another codec
        put(v[3], b"")                                         # empty
        put(v[4], get(v[4])[:-1])                              # one byte short
        put(v[5], get(v[5]) + b"\0")                           # one byte long
        good = get(v[6])
        put(v[6], good[:s.header_bytes] + bytes(len(good) - s.header_bytes))  # payload zeroed
        assert s.lookup(ids) == [True] * 9
        raw.delete_object(Bucket=BUCKET, Key=v[7])             # gone between lookup and load
        out = np.full_like(data, 0xAB)
        r = s.wait(s.load(ids, 0, out), timeout=20)
        assert r.ok.tolist() == [False] * 8 + [True], r.errors
        assert (out[8] == data[8]).all()
        assert not (out[0] == data[8]).all() and not (out[1] == data[1]).all()
        assert all(r.errors[i].startswith("corrupt") for i in range(7)) and r.errors[7] == "miss"
        assert s.stats()["s3"]["quarantined"] == 7
        assert s.lookup(ids) == [False] * 8 + [True]  # both keys of each bad value deleted
    finally:
        for x in (s, other_ns, other_codec):
            x.close()


def test_an_object_replaced_by_a_huge_one_is_refused_without_reading_it_whole(server, rng):
    """A value key overwritten with a 32 MiB object used to be fetched whole into the engine's
    memory before the tier refused its length (an object of any size: any amount of memory).
    The load reads at most one byte more than a value: counted here as the memory the load
    allocates (tracemalloc), far below the object's size."""
    s = _open(server.url, prefix="huge")
    raw = client(server.url)
    try:
        ids, data = _ids(rng, 2), _data(rng, 2)
        _put(s, ids, data)
        huge = 32 << 20
        raw.put_object(Bucket=BUCKET, Key=s._keys(ids[:1], "v")[0], Body=bytes(huge))
        out = np.zeros_like(data)
        tracemalloc.start()
        try:
            r = s.wait(s.load(ids, 0, out), timeout=20)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert r.ok.tolist() == [False, True], r.errors
        assert "corrupt" in r.errors[0] and (out[1] == data[1]).all()
        assert peak < huge // 4, peak
        assert s.lookup(ids) == [False, True]  # quarantined
    finally:
        s.close()


# -- the bucket, the generation, lifecycle -------------------------------------------------------

def test_a_bucket_deleted_mid_run_reads_as_misses_and_the_generation_as_oserror(server, rng):
    """With the bucket gone, lookups and loads are misses and dumps fail per block; set_generation
    must raise OSError (its contract: the generation was not persisted), not the tier's internal
    Unavailable. Once the bucket is back the tier recovers by itself."""
    bucket = "ucm-gone"
    raw = client(server.url)
    raw.create_bucket(Bucket=bucket)
    s = _open(server.url, prefix="gone", bucket=bucket)
    try:
        ids, data = _ids(rng, 4), _data(rng, 4)
        _put(s, ids, data)
        keys = [o["Key"] for o in raw.list_objects_v2(Bucket=bucket)["Contents"]]
        raw.delete_objects(Bucket=bucket, Delete={"Objects": [{"Key": k} for k in keys]})
        raw.delete_bucket(Bucket=bucket)
        assert s.lookup(ids) == [False] * 4
        out = np.zeros_like(data)
        assert not s.wait(s.load(ids, 0, out), timeout=20).ok.any()
        r = s.wait(s.dump(ids, 0, data), timeout=20)
        s.commit(ids, r.ok)
        assert not r.ok.any() and "does not exist" in r.errors[0]
        assert s.generation() == 0
        with pytest.raises(OSError):
            s.set_generation(7)
        raw.create_bucket(Bucket=bucket)
        deadline = time.monotonic() + 20
        while True:
            r = s.wait(s.dump(ids, 0, data), timeout=20)
            s.commit(ids, r.ok)
            if r.all_ok or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert r.all_ok, r.errors
        assert s.set_generation(7) == 7 and s.lookup(ids) == [True] * 4
    finally:
        s.close()


def test_use_after_close_and_close_twice(server, rng):
    s = _open(server.url, prefix="closed")
    ids, data = _ids(rng, 3), _data(rng, 3)
    _put(s, ids, data)
    s.close()
    s.close()
    assert s.lookup(ids) == [False] * 3
    with pytest.raises(ValueError, match="closed"):
        s.load(ids, 0, np.zeros_like(data))
    with pytest.raises(ValueError, match="closed"):
        s.dump(ids, 0, data)
    s.commit(ids, True)
    with pytest.raises(OSError):
        s.set_generation(3)


def test_a_load_arriving_while_close_drains_puts_is_refused_as_closed(server, rng):
    """close() stops the load/dump executor first and then waits for the puts in flight; a load
    or dump arriving in between used to raise the executor's RuntimeError ("cannot schedule new
    futures after shutdown") instead of the closed store's ValueError. The put is held in flight
    by stopping the server (SIGSTOP) until its timeout."""
    s = _open(server.url, prefix="closing", remote={"timeout_s": 1.0})
    ids, data = _ids(rng, 2), _data(rng, 2)
    _put(s, ids[:1], data[:1])
    closer = threading.Thread(target=s.close)
    os.kill(server.pid, signal.SIGSTOP)
    try:
        s.dump(ids[1:], 0, data[1:])  # its put waits on the stopped server
        closer.start()
        deadline = time.monotonic() + 5
        while not s._exec._shutdown and time.monotonic() < deadline:
            time.sleep(0.001)
        assert closer.is_alive()  # still draining the put
        with pytest.raises(ValueError, match="closed"):
            s.load(ids[:1], 0, np.zeros_like(data[:1]))
        with pytest.raises(ValueError, match="closed"):
            s.dump(ids[:1], 0, data[:1])
    finally:
        os.kill(server.pid, signal.SIGCONT)
        closer.join(20)
    assert not closer.is_alive()


# -- duplicates, concurrency, large batches -----------------------------------------------------

def test_the_same_id_twice_in_a_batch_again_and_from_many_threads(server, rng):
    s = _open(server.url, prefix="dup")
    raw = client(server.url)
    try:
        ids, data = _ids(rng, 4), _data(rng, 4)
        twice = np.concatenate([ids, ids[:2]])
        r = s.wait(s.dump(twice, 0, np.concatenate([data, data[:2]])), timeout=20)
        assert r.all_ok, r.errors
        s.commit(twice, r.ok)
        _put(s, ids, data)  # stored and committed already: again
        more, more_data = _ids(rng, 6), _data(rng, 6)
        start, errors = threading.Barrier(4), []

        def writer():
            try:
                start.wait()
                r = s.wait(s.dump(more, 0, more_data), timeout=20)
                s.commit(more, r.ok)
                assert r.all_ok, r.errors
            except BaseException as exc:  # reported below
                errors.append(exc)

        threads = [threading.Thread(target=writer) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert not errors, errors
        both, both_data = np.concatenate([ids, more]), np.concatenate([data, more_data])
        assert s.lookup(both) == [True] * 10
        out = np.zeros_like(both_data)
        assert s.wait(s.load(both, 0, out), timeout=20).all_ok and (out == both_data).all()
        listed = [o["Key"] for o in raw.list_objects_v2(Bucket=BUCKET, Prefix="dup/")["Contents"]]
        assert len(listed) == 20  # one value and one marker per block
        st = s.stats()["s3"]
        assert st["quarantined"] == st["io_errors"] == st["pending_blocks"] == 0
    finally:
        s.close()


def test_a_batch_larger_than_the_staging_in_one_call(server, rng):
    """160 blocks in one dump, lookup and load, with room for 62 values in the staging: the dump
    flows through it, every block round-trips."""
    s = _open(server.url, prefix="many")
    try:
        assert s.n_rows < 160
        ids, data = _ids(rng, 160), _data(rng, 160)
        _put(s, ids, data)
        assert s.lookup(ids) == [True] * 160
        out = np.zeros_like(data)
        r = s.wait(s.load(ids, 0, out), timeout=30)
        assert r.all_ok, r.errors
        assert (out == data).all()
        assert s.stats()["s3"]["pending_blocks"] == 0
    finally:
        s.close()
