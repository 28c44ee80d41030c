"""Bad input to the configuration, the store factory, the tiers' constructors and `ucm store`:
each is a clear error naming the key (or argument) and what is accepted, and loses nothing.
Never a bare TypeError/OverflowError, never a value silently taken with another meaning."""
import os

import numpy as np
import pytest

from ucm import cli
from ucm.config import Config, ConfigError
from ucm.store import open_store
from ucm.store.base import BlockGeometry
from ucm.store.memory import MemoryStore
from ucm.store.posix import PosixStore

G = BlockGeometry(4096, 4096)


# ---------------------------------------------------------------------------------------------
# Config values

@pytest.mark.parametrize("key", ["sparse_ratio", "store.wait_timeout_s", "blend.recompute_ratio"])
def test_a_float_option_given_an_int_beyond_a_float_names_the_key(key):
    # float(10**400) raises OverflowError: it must be the option's own error
    with pytest.raises(ConfigError, match=rf"'{key}' \(dict\): expected a finite number"):
        Config({key: 10**400})


@pytest.mark.parametrize("raw", ["1" + "0" * 400, "9" * 30 + "TiB", "99999999999TiB"])
def test_a_size_beyond_any_disk_names_the_key(raw):
    # int(float('1e400')) raised OverflowError (cannot convert float infinity to integer)
    with pytest.raises(ConfigError, match=r"'cache_capacity' \(dict\): expected a size"):
        Config({"cache_capacity": raw})
    with pytest.raises(ConfigError, match=r"'store.memory.capacity' \(env UCM_STORE_MEMORY_CAPACITY\)"):
        Config(env={"UCM_STORE_MEMORY_CAPACITY": raw})


def test_a_size_string_means_exactly_its_bytes():
    # through a float, '2.01kB' was 2009 bytes and '8.03kB' 8029
    assert Config({"cache_capacity": "2.01kB"}).cache_capacity == 2010
    assert Config({"cache_capacity": "8.03kB"}).cache_capacity == 8030
    assert Config({"cache_capacity": "1.5KiB"}).cache_capacity == 1536
    assert Config({"cache_capacity": " 2 GiB "}).cache_capacity == 2 * 1024**3
    # a fraction of a byte is not a size: '1.9' was silently 1 byte
    for raw in ("1.9", "1.9b", "0.5"):
        with pytest.raises(ConfigError, match=r"'cache_capacity'.*whole number of bytes"):
            Config({"cache_capacity": raw})


@pytest.mark.parametrize("preset", [["batch"], {"batch"}])
def test_a_preset_that_is_not_a_name_names_the_key(preset):
    # `name not in PRESETS` raised TypeError: unhashable type
    with pytest.raises(ConfigError, match=r"'preset'.*'batch'"):
        Config({"preset": preset})


def test_a_lookup_with_a_key_that_is_not_a_string():
    c = Config()
    for key in (5, None, ("store", "pipeline")):
        with pytest.raises(ConfigError, match="strings"):
            c[key]
        with pytest.raises(ConfigError, match="strings"):
            c.source(key)


def test_a_key_given_twice_in_one_source_is_refused_not_silently_resolved(tmp_path):
    # a dotted key and the same key nested: one of the two values used to win unnoticed
    with pytest.raises(ConfigError, match=r"'store.pipeline' \(dict\): given twice"):
        Config({"store.pipeline": "memory", "store": {"pipeline": "posix"}})
    with pytest.raises(ConfigError, match=r"'store.posix.fsync' \(dict\): given twice"):
        Config({"store": {"posix.fsync": True, "posix": {"fsync": False}}})
    f = tmp_path / "ucm.yaml"
    f.write_text("store.posix.roots: [/a]\nstore:\n  posix:\n    roots: [/b]\n")
    with pytest.raises(ConfigError, match=r"'store.posix.roots' \(file .*ucm.yaml\): given twice"):
        Config.load(str(f), env={})
    # precedence between sources stays as documented (a dict overrides the file)
    g = tmp_path / "ok.yaml"
    g.write_text("store:\n  pipeline: posix\n")
    assert Config.load(str(g), env={}, overrides={"store.pipeline": "memory"})["store.pipeline"] == "memory"


@pytest.mark.parametrize("key", ["store.wait_timeout_s", "store.remote.timeout_s"])
def test_a_timeout_the_system_timers_cannot_take_is_refused(key):
    # threading.Event.wait(1e10) and socket.settimeout(1e10) raise OverflowError: a config that
    # says so must fail at load, not at every wait of the running store
    with pytest.raises(ConfigError, match=rf"'{key}' \(dict\): expected at most"):
        Config({key: 1e10})
    env = "UCM_" + key.upper().replace(".", "_")
    with pytest.raises(ConfigError, match=rf"'{key}' \(env {env}\): expected at most"):
        Config(env={env: "1e10"})
    assert Config({key: 3600.0})[key] == 3600.0


# ---------------------------------------------------------------------------------------------
# tiers' constructors

@pytest.mark.parametrize("flag", ["o_direct", "fsync", "read_only"])
@pytest.mark.parametrize("value", ["false", "no", 1, None])
def test_posix_flags_take_only_booleans(tmp_path, flag, value):
    # bool('false') is True: o_direct='false' opened the store with O_DIRECT
    with pytest.raises(ValueError, match=rf"store.posix.{flag} must be True or False"):
        PosixStore(G, [str(tmp_path)], **{flag: value})
    assert os.listdir(tmp_path) == []  # nothing made in the root


@pytest.mark.parametrize("value", [0, -3, 1.9, True, "4", None])
def test_tier_io_threads_must_be_a_positive_int(tmp_path, value):
    # were max(1, int(value)): 0 and -3 became 1, 1.9 became 1, True became 1
    with pytest.raises(ValueError, match=r"store.io_threads must be an int >= 1"):
        MemoryStore(G, 4, io_threads=value)
    with pytest.raises(ValueError, match=r"store.io_threads must be an int >= 1"):
        PosixStore(G, [str(tmp_path)], io_threads=value)


@pytest.mark.parametrize("value", [float("nan"), -1, 0, float("inf"), 1e10, None, "30"])
def test_tier_wait_timeouts_must_be_positive_finite_seconds(tmp_path, value):
    # nan and -1 were taken (every wait then timed out at once), None was a TypeError
    with pytest.raises(ValueError, match=r"store.wait_timeout_s must be"):
        MemoryStore(G, 4, wait_timeout_s=value)
    with pytest.raises(ValueError, match=r"store.wait_timeout_s must be"):
        PosixStore(G, [str(tmp_path)], wait_timeout_s=value)


def test_memory_copy_threads_must_be_a_positive_int():
    for value in (0, -1, 2.5):
        with pytest.raises(ValueError, match=r"copy_threads must be an int >= 1"):
            MemoryStore(G, 4, copy_threads=value)


@pytest.mark.parametrize("roots", [None, 5])
def test_posix_roots_that_are_not_a_list_of_paths(roots):
    # None and 5 were TypeError: 'NoneType' object is not iterable
    with pytest.raises(ValueError, match=r"store.posix.roots"):
        PosixStore(G, roots)


def test_a_posix_root_with_a_nul_character_names_the_key(tmp_path):
    # was a bare "embedded null byte"
    with pytest.raises(ValueError, match=r"store.posix.roots: .*NUL"):
        PosixStore(G, [str(tmp_path) + "/a\0b"])
    with pytest.raises(ValueError, match=r"store.posix.roots: .*NUL"):
        open_store({"store": {"pipeline": "posix", "posix": {"roots": [str(tmp_path) + "\0"]}}},
                   block_bytes=4096)


def test_a_memory_pool_larger_than_the_machine_is_refused_up_front():
    # the pool is allocated on first use: 100000 blocks of 1 GiB were accepted, failing (or
    # being killed for memory) only once the engine ran
    huge = BlockGeometry(1 << 30, 1 << 30)
    with pytest.raises(ValueError, match=r"buffer_number.*more than this machine's memory"):
        MemoryStore(huge, 100_000)
    with pytest.raises(ConfigError, match=r"'buffer_number'.*more than this machine's memory"):
        open_store({"store": {"pipeline": "memory"}, "buffer_number": 100_000}, block_bytes=1 << 30)
    with pytest.raises(ConfigError, match=r"'store.memory.capacity'.*more than this machine's memory"):
        open_store({"store": {"pipeline": "memory", "memory": {"capacity": "100000GiB"}}},
                   block_bytes=1 << 30)
    with open_store({"store": {"pipeline": "memory"}, "buffer_number": 4}, block_bytes=1 << 20) as s:
        assert s.n_slots == 4


# ---------------------------------------------------------------------------------------------
# factory

def test_shard_bytes_zero_is_refused_not_taken_as_the_block():
    # `shard_bytes or block_bytes` made 0 mean "one shard"
    with pytest.raises(ValueError, match=r"shard_bytes must be a positive int, got 0"):
        open_store({"store": {"pipeline": "memory"}}, block_bytes=4096, shard_bytes=0)
    with open_store({"store": {"pipeline": "memory"}}, block_bytes=4096) as s:
        assert s.geometry.shard_bytes == 4096


@pytest.mark.parametrize("spec", ["ucm.store.base:BlockGeometry", "os:getcwd", "ucm.config:log",
                                  "memory|math:pi"])
def test_a_pipeline_entry_that_is_not_a_tier_names_the_key(spec):
    # these were bare TypeErrors from calling whatever the name pointed at
    with pytest.raises(ValueError, match=r"config key 'store.pipeline': .* is not a tier class"):
        open_store({"store": {"pipeline": spec}}, block_bytes=4096)


def test_a_tier_class_that_builds_something_else_names_the_key():
    with pytest.raises(ValueError, match=r"config key 'store.pipeline': tier .* built dict"):
        open_store({"store": {"pipeline": "test_bad_input_config_store:NotATier"}}, block_bytes=4096)


class NotATier:
    @classmethod
    def from_config(cls, geometry, config, namespace):
        return {}


@pytest.mark.parametrize("spec", ["memory|ucm.store.memory:MemoryStore",
                                  "ucm.store.posix:PosixStore|posix"])
def test_one_tier_under_two_names_is_refused(spec, tmp_path):
    # 'memory' twice is refused by the config; the same class under its module path was not,
    # and held every block twice
    with pytest.raises(ConfigError, match=r"'store.pipeline': .* are the same tier.*each tier once"):
        open_store({"store": {"pipeline": spec, "posix": {"roots": [str(tmp_path)]}}},
                   block_bytes=4096)
    assert os.listdir(tmp_path) == []


# ---------------------------------------------------------------------------------------------
# distributed tiers: refused before any server is contacted

def _redis_servers_file(path):
    pytest.importorskip("redis")
    return open_store({"store": {"pipeline": "redis", "redis": {"servers_file": str(path)}}},
                      block_bytes=4096)


def test_a_redis_servers_file_that_cannot_be_used_names_its_key(tmp_path):
    # a missing file was a bare FileNotFoundError, a directory IsADirectoryError, an empty
    # file "redis: at least one server" (no key), a line that is no Redis URL an unreachable
    # server
    with pytest.raises(ConfigError, match=r"'store.redis.servers_file': cannot read"):
        _redis_servers_file(tmp_path / "missing")
    with pytest.raises(ConfigError, match=r"'store.redis.servers_file': cannot read"):
        _redis_servers_file(tmp_path)
    empty = tmp_path / "empty"
    empty.write_text("# nothing yet\n\n")
    with pytest.raises(ConfigError, match=r"'store.redis.servers_file': .* lists no server"):
        _redis_servers_file(empty)
    bad = tmp_path / "bad"
    bad.write_text("127.0.0.1:6379\n")
    with pytest.raises(ConfigError, match=r"'store.redis.servers_file': '127.0.0.1:6379' is not a Redis URL"):
        _redis_servers_file(bad)


def test_an_s3_region_that_is_not_one_names_the_region_key():
    pytest.importorskip("boto3")
    # botocore's InvalidRegionError was reported as a bad store.s3.endpoint_url
    with pytest.raises(ConfigError, match=r"'store.s3.region': 'not a region!'"):
        open_store({"store": {"pipeline": "s3", "s3": {"bucket": "ucm-test", "region": "not a region!",
                                                        "endpoint_url": "http://127.0.0.1:1"}}},
                   block_bytes=4096)


# ---------------------------------------------------------------------------------------------
# `ucm store`

@pytest.fixture
def root(tmp_path):
    r = tmp_path / "root"
    r.mkdir()
    s = open_store({"store": {"pipeline": "posix", "posix": {"roots": [str(r)]}}}, block_bytes=8192,
                   shard_bytes=4096, namespace=b"A" * 16)
    ids = (np.arange(8, dtype=np.uint64) + 1).reshape(4, 2)
    s.wait(s.dump(ids, 0, np.ones((4, 8192), np.uint8)))
    s.commit(ids, [True] * 4)
    s.close()
    return r


def _store(capsys, *args):
    rc = cli.main(["store", *args])
    out = capsys.readouterr()
    return rc, out.out, out.err


def _n_blocks(capsys, r):
    rc, out, _ = _store(capsys, "--root", str(r), "du")
    assert rc == 0
    return int(out.split(" in ")[1].split()[0])


def test_store_gc_refuses_a_negative_target_and_evicts_nothing(root, capsys):
    # --target -5 evicted every block
    rc, _, err = _store(capsys, "--root", str(root), "gc", "--target", "-5")
    assert rc == 2 and "gc target" in err and ">= 0" in err
    assert _n_blocks(capsys, root) == 4


def test_store_ls_refuses_a_negative_limit(root, capsys):
    # --limit -1 listed every block but the last
    rc, out, err = _store(capsys, "--root", str(root), "ls", "--limit", "-1")
    assert rc == 2 and "--limit" in err and not out
    rc, out, _ = _store(capsys, "--root", str(root), "ls", "--limit", "0")
    assert rc == 0 and len(out.strip().splitlines()) == 4


@pytest.mark.parametrize("ns", ["nothex", "", "41" * 15, "41" * 17])
def test_store_clear_refuses_what_is_not_a_namespace(root, capsys, ns):
    # a typo'd namespace 'removed 0 blocks' and exited 0
    rc, _, err = _store(capsys, "--root", str(root), "clear", "--namespace", ns)
    assert rc == 2 and "32 hex digits" in err
    assert _n_blocks(capsys, root) == 4
    rc, out, _ = _store(capsys, "--root", str(root), "clear", "--namespace", (b"A" * 16).hex().upper())
    assert rc == 0 and "removed 4 blocks" in out


def test_store_inspect_refuses_what_is_not_a_block_id(root, capsys):
    rc, _, err = _store(capsys, "--root", str(root), "inspect", "zz")
    assert rc == 2 and "block id 'zz': expected 32 hex digits" in err
    rc, _, err = _store(capsys, "--root", str(root), "inspect", "f" * 32)
    assert rc == 1 and "in no root" in err


def test_store_refuses_an_empty_root_instead_of_the_working_directory(root, capsys, monkeypatch):
    # realpath('') is the working directory: run from inside a root, `--root ''` acted on it
    monkeypatch.chdir(root)
    for args in (["du"], ["gc", "--target", "0"], ["clear", "--namespace", (b"A" * 16).hex()]):
        rc, out, err = _store(capsys, "--root", "", *args)
        assert rc == 2 and "not a directory path" in err and not out
        rc, out, err = _store(capsys, "--root", "  ", *args)
        assert rc == 2 and "not a directory path" in err
    assert _n_blocks(capsys, root) == 4


def test_config_file_that_is_a_fifo_or_a_device_is_refused_at_once(tmp_path):
    """A FIFO as the YAML config file blocked Config.load until a writer came."""
    from fifo import returns_within

    fifo = str(tmp_path / "ucm.yaml")
    os.mkfifo(fifo)
    ok, box = returns_within(lambda: Config.load(fifo), fifo)
    assert ok, "loading a FIFO as the config file blocked"
    assert isinstance(box.get("error"), ConfigError)
    assert "not a regular file" in str(box["error"])
    with pytest.raises(ConfigError, match="not a regular file"):
        Config.load("/dev/zero")
