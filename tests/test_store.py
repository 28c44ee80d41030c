"""Store API semantics on every tier and pipelines; memory LRU; posix format, corruption,
budget, disk full, permissions; bad configuration. Real files, real processes."""
import os
import subprocess
import sys
import threading

import numpy as np
import pytest

import ucm
from ucm.errors import TaskTimeoutError
from ucm.store import BlockGeometry, open_store
from ucm.store.memory import MemoryStore
from ucm.store.pipeline import PipelineStore
from ucm.store.posix import PosixStore

NS = ucm.Namespace("test-model", "bfloat16", 16)
BLOCK, SHARD = 64 << 10, 16 << 10  # 4 shards ("layers") per block


def make_ids(n, seed=0):
    rng = np.random.default_rng(seed)
    return ucm.hash_blocks(rng.integers(0, 49152, 16 * n), NS)


def payload(ids, nbytes=BLOCK):
    """Deterministic bytes per block id (so any process can check what it reads)."""
    out = np.empty((len(ids), nbytes), dtype=np.uint8)
    for i, row in enumerate(ids):
        out[i] = np.random.default_rng(row.tolist()).integers(0, 256, nbytes, dtype=np.uint8)
    return out


def posix(path, **kw):
    kw.setdefault("capacity_bytes", 1 << 30)
    return PosixStore(BlockGeometry(BLOCK, SHARD), [str(path)], NS.digest(), **kw)


def memory(**kw):
    kw.setdefault("buffer_number", 64)
    kw.setdefault("namespace", NS.digest())
    return MemoryStore(BlockGeometry(BLOCK, SHARD), **kw)


@pytest.fixture(params=["memory", "posix", "posix-odirect", "memory|posix", "posix|memory",
                        "memory|posix-writeback"])
def store(request, tmp_path):
    kind = request.param
    if kind == "memory":
        s = memory()
    elif kind == "posix":
        s = posix(tmp_path)
    elif kind == "posix-odirect":
        s = posix(tmp_path, o_direct=True, fsync=True)
    elif kind == "memory|posix":
        s = PipelineStore([memory(), posix(tmp_path)])
    elif kind == "posix|memory":
        s = PipelineStore([posix(tmp_path), memory()])
    else:
        s = PipelineStore([memory(), posix(tmp_path)], write_back=True)
    yield s
    s.close()


def test_dump_invisible_until_commit_then_loads_exactly(store):
    ids = make_ids(10)
    src = payload(ids)
    task = store.dump(ids, 0, src)
    assert not any(store.lookup(ids))
    res = store.wait(task)
    assert res.all_ok and res.errors == {}
    assert not any(store.lookup(ids)) and store.lookup_prefix(ids) == 0
    store.commit(ids[:7], True)
    store.commit(ids[7:], [False, False, False])
    assert store.lookup(ids) == [True] * 7 + [False] * 3
    assert store.lookup_prefix(ids) == 7
    dst = np.full_like(src, 0xA5)
    res = store.wait(store.load(ids, 0, dst))
    assert res.ok.tolist() == [True] * 7 + [False] * 3
    assert np.array_equal(dst[:7], src[:7])
    assert set(res.errors) == {7, 8, 9}
    assert store.check(task)


def test_layerwise_shards(store):
    ids = make_ids(5, seed=1)
    src = payload(ids)
    for layer in range(4):  # save layer by layer, as the engine's layer-wise mode does
        off = layer * SHARD
        assert store.wait(store.dump(ids, off, src[:, off:off + SHARD])).all_ok
    store.commit(ids, True)
    assert all(store.lookup(ids))
    for layer in (3, 0, 2):  # load layers in any order
        off = layer * SHARD
        dst = np.zeros((5, SHARD), np.uint8)
        assert store.wait(store.load(ids, off, dst)).all_ok
        assert np.array_equal(dst, src[:, off:off + SHARD])
    two = np.zeros((5, 2 * SHARD), np.uint8)
    assert store.wait(store.load(ids, SHARD, two)).all_ok
    assert np.array_equal(two, src[:, SHARD:3 * SHARD])


def test_block_missing_a_shard_is_never_published(store):
    ids = make_ids(3, seed=2)
    src = payload(ids)
    assert store.wait(store.dump(ids, 0, src[:, :2 * SHARD])).all_ok  # 2 of 4 shards
    store.commit(ids, True)
    assert not any(store.lookup(ids))


def test_per_block_buffers_and_torch_like_inputs(store):
    ids = make_ids(4, seed=3)
    src = payload(ids)
    assert store.wait(store.dump(ids, 0, [bytes(r) for r in src])).all_ok
    store.commit(ids, True)
    rows = [np.zeros(BLOCK, np.uint8) for _ in range(4)]
    assert store.wait(store.load(ids, 0, rows)).all_ok
    assert all(np.array_equal(r, s) for r, s in zip(rows, src))
    wide = np.zeros((4, BLOCK + 64), np.uint8)[:, 32:32 + BLOCK]  # strided rows
    assert store.wait(store.load(ids, 0, wide)).all_ok and np.array_equal(wide, src)


def test_duplicate_dump_is_idempotent(store):
    ids = make_ids(3, seed=4)
    src = payload(ids)
    assert store.wait(store.dump(ids, 0, src)).all_ok
    store.commit(ids, True)
    assert store.wait(store.dump(ids, 0, src)).all_ok  # already present: skipped
    store.commit(ids, True)
    dst = np.zeros_like(src)
    assert store.wait(store.load(ids, 0, dst)).all_ok and np.array_equal(dst, src)


def test_concurrent_threads(store):
    errors = []

    def worker(seed):
        try:
            ids = make_ids(6, seed=100 + seed % 3)  # overlapping ids between threads
            src = payload(ids)
            for _ in range(3):
                r = store.wait(store.dump(ids, 0, src))
                store.commit(ids, r.ok)
                dst = np.zeros_like(src)
                r = store.wait(store.load(ids, 0, dst))
                assert np.array_equal(dst[r.ok], src[r.ok])
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors


@pytest.mark.parametrize("bad,match", [
    (lambda s, ids, src: s.dump(ids, 1, src[:, :SHARD]), "whole shards"),
    (lambda s, ids, src: s.dump(ids, 0, src[:, :SHARD + 8]), "whole shards"),
    (lambda s, ids, src: s.dump(ids, 3 * SHARD, src[:, :2 * SHARD]), "whole shards"),
    (lambda s, ids, src: s.dump(ids, -SHARD, src[:, :SHARD]), "offset"),
    (lambda s, ids, src: s.dump(ids, 0, src[:2]), r"\[3, nbytes\]"),
    (lambda s, ids, src: s.dump(ids, 0, src[:, ::2]), "contiguous"),
    (lambda s, ids, src: s.dump(ids, 0, "bytes"), "expected a 2-D"),
    (lambda s, ids, src: s.dump(ids, 0, [src[0]]), "3 per-block"),
    (lambda s, ids, src: s.load(ids, 0, np.frombuffer(src.tobytes(), np.uint8).reshape(3, -1)), "read-only"),
    (lambda s, ids, src: s.load(np.zeros((3, 3), np.uint64), 0, src), r"\[n, 2\]"),
    (lambda s, ids, src: s.commit(ids, [True]), "success_flags"),
    (lambda s, ids, src: s.wait("task"), "Task"),
])
def test_bad_arguments(store, bad, match):
    ids = make_ids(3, seed=5)
    src = payload(ids)
    with pytest.raises(ValueError, match=match):
        bad(store, ids, src)


def test_wait_times_out_and_task_continues(tmp_path):
    s = posix(tmp_path, io_threads=1)
    gate = threading.Event()
    s._exec.submit(gate.wait)  # occupy the only worker (test harness: a slow device)
    ids = make_ids(2, seed=6)
    task = s.dump(ids, 0, payload(ids))
    with pytest.raises(TaskTimeoutError, match="not done"):
        s.wait(task, timeout=0.2)
    assert not s.check(task)
    gate.set()
    assert s.wait(task, timeout=10).all_ok
    s.close()


def test_a_pipeline_dump_that_times_out_names_the_late_tier(tmp_path):
    """Write-through: the memory tier is done at once, the posix tier's only worker is busy (test
    harness: a slow device); the timed-out wait says which tier it waits for, and the dump
    still completes once the device is free."""
    from ucm.store.pipeline import PipelineStore

    low = posix(tmp_path, io_threads=1)
    s = PipelineStore([memory(), low])
    gate = threading.Event()
    low._exec.submit(gate.wait)
    ids = make_ids(2, seed=16)
    task = s.dump(ids, 0, payload(ids))
    with pytest.raises(TaskTimeoutError, match=r"not done after 0.2 s \(waiting for posix\)$"):
        s.wait(task, timeout=0.2)
    gate.set()
    assert s.wait(task, timeout=10).all_ok
    s.close()


# ---------------------------------------------------------------------------------------------
# memory tier

def test_memory_lru_eviction_and_capacity():
    s = memory(buffer_number=4)
    ids = make_ids(6, seed=7)
    src = payload(ids)
    for i in range(4):
        assert s.wait(s.dump(ids[i:i + 1], 0, src[i:i + 1])).all_ok
        s.commit(ids[i:i + 1], True)
    s.wait(s.load(ids[:1], 0, np.zeros((1, BLOCK), np.uint8)))  # block 0 becomes most recent
    assert s.wait(s.dump(ids[4:6], 0, src[4:6])).all_ok
    s.commit(ids[4:6], True)
    assert s.lookup(ids) == [True, False, False, True, True, True]
    st = s.stats()["memory"]
    assert st["evictions"] == 2 and st["committed"] == 4 and st["free"] == 0
    s.close()


def test_memory_pending_blocks_hold_slots_and_full_pool_fails_cleanly():
    s = memory(buffer_number=2)
    ids = make_ids(3, seed=8)
    src = payload(ids)
    r = s.wait(s.dump(ids, 0, src))  # 3 pending blocks, 2 slots, nothing evictable
    assert r.ok.tolist() == [True, True, False] and "full" in r.errors[2]
    s.commit(ids, r.ok)
    assert s.lookup(ids) == [True, True, False]
    s.close()


def test_memory_slot_being_read_is_not_evicted():
    s = memory(buffer_number=2)
    ids = make_ids(3, seed=9)
    src = payload(ids)
    s.commit(ids[:2], s.wait(s.dump(ids[:2], 0, src[:2])).ok)
    with s._lock:  # a load in flight pins slot of block 0 (oldest)
        slot0 = int(s._index.lookup(ids[:1])[0])
        s._refs[slot0] += 1
    s.commit(ids[2:], s.wait(s.dump(ids[2:], 0, src[2:])).ok)
    assert s.lookup(ids) == [True, False, True]
    with s._lock:
        s._refs[slot0] -= 1
    s.close()


def test_memory_bad_config():
    with pytest.raises(ValueError, match="buffer_number"):
        memory(buffer_number=0)
    with pytest.raises(ValueError, match="shard_bytes"):
        MemoryStore(BlockGeometry(BLOCK, 3000), buffer_number=2)


# ---------------------------------------------------------------------------------------------
# posix tier: format and corruption

def _committed(tmp_path, n=4, seed=10, **kw):
    s = posix(tmp_path, **kw)
    ids = make_ids(n, seed=seed)
    src = payload(ids)
    s.commit(ids, s.wait(s.dump(ids, 0, src)).ok)
    return s, ids, src


def test_posix_file_layout(tmp_path):
    s, ids, src = _committed(tmp_path)
    path = s.path_of(ids[0])
    hexid = ucm.id_hex(ids[:1])[0]
    assert path == os.path.join(str(tmp_path), s.space, hexid[:2], hexid + ".blk")
    assert open(tmp_path / ".ucm" / "ROOT", "rb").read() == b"ucm kv root 1\n"
    raw = open(path, "rb").read()
    assert raw[:8] == b"UCMKVBLK" and len(raw) == 4096 + BLOCK
    assert raw[16:32] == NS.digest() and raw[32:48] == ucm.id_bytes(ids[:1])[0]
    assert raw[4096:] == src[0].tobytes()
    assert os.listdir(tmp_path / ".ucm" / "tmp" / s.roots[0].writer_name) == ["lock"]  # no temporaries
    s.close()
    assert os.listdir(tmp_path / ".ucm" / "tmp") == []  # the writer directory goes with its store


def _corrupt_flip(path, offset):
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x40]))


@pytest.mark.parametrize("how", ["payload-byte", "last-byte", "header-byte", "checksum-table",
                                 "truncate", "extend", "namespace-byte", "empty"])
def test_posix_corruption_detected_quarantined_then_miss(tmp_path, how):
    s, ids, src = _committed(tmp_path)
    victim = s.path_of(ids[1])
    if how == "payload-byte":
        _corrupt_flip(victim, 4096 + 12345)
    elif how == "last-byte":
        _corrupt_flip(victim, 4096 + BLOCK - 1)
    elif how == "header-byte":
        _corrupt_flip(victim, 60)
    elif how == "checksum-table":
        _corrupt_flip(victim, 90)
    elif how == "truncate":
        os.truncate(victim, 4096 + BLOCK - 100)
    elif how == "extend":
        with open(victim, "ab") as f:
            f.write(b"\0" * 10)
    elif how == "namespace-byte":  # a flipped bit is damage (the header checksum), not a tenant
        _corrupt_flip(victim, 20)
    elif how == "empty":
        open(victim, "wb").close()
    dst = np.full_like(src, 0x5A)
    res = s.wait(s.load(ids, 0, dst))
    assert not res.ok[1] and "corrupt" in res.errors[1]
    assert not dst[1].any()  # never plausible bytes for a failed block
    good = [0, 2, 3]
    assert res.ok[good].all() and np.array_equal(dst[good], src[good])
    assert not os.path.exists(victim)
    assert os.listdir(tmp_path / ".ucm" / "quarantine")
    assert s.lookup(ids[1:2]) == [False]
    assert s.stats()["posix"]["quarantined"] == 1
    s.close()


def test_posix_intact_block_of_another_id_is_a_miss_and_left_alone(tmp_path):
    """A valid block file under another block's name (copied there by hand) is not damage: a
    miss for the reader, never quarantined, never read as this block."""
    s, ids, src = _committed(tmp_path)
    victim = s.path_of(ids[1])
    os.replace(s.path_of(ids[2]), victim)
    dst = np.full_like(src, 0x5A)
    res = s.wait(s.load(ids, 0, dst))
    assert not res.ok[1] and "foreign" in res.errors[1] and not dst[1].any()
    assert os.path.exists(victim) and not os.listdir(tmp_path / ".ucm" / "quarantine")
    assert s.stats()["posix"]["quarantined"] == 0
    s.close()


def test_posix_shard_load_checks_only_what_it_reads_but_catches_it(tmp_path):
    s, ids, src = _committed(tmp_path)
    _corrupt_flip(s.path_of(ids[0]), 4096 + 3 * SHARD + 7)  # shard 3
    dst = np.zeros((4, SHARD), np.uint8)
    assert s.wait(s.load(ids, 0, dst)).all_ok  # shard 0 is intact
    res = s.wait(s.load(ids, 3 * SHARD, dst))
    assert not res.ok[0] and res.ok[1:].all()
    s.close()


def test_posix_other_namespace_never_reads_foreign_blocks(tmp_path):
    s, ids, src = _committed(tmp_path)
    other = PosixStore(BlockGeometry(BLOCK, SHARD), [str(tmp_path)],
                       ucm.Namespace("other-model", "bfloat16", 16).digest(), capacity_bytes=1 << 30)
    res = other.wait(other.load(ids, 0, np.zeros_like(src)))
    assert not res.ok.any()  # same file names, wrong namespace in the header
    s.close()
    other.close()


def test_posix_restart_sees_committed_blocks(tmp_path):
    s, ids, src = _committed(tmp_path)
    s.close()
    s2 = posix(tmp_path)
    dst = np.zeros_like(src)
    assert s2.lookup_prefix(ids) == 4 and s2.wait(s2.load(ids, 0, dst)).all_ok
    assert np.array_equal(dst, src)
    s2.close()


def test_posix_budget_lru_by_last_access(tmp_path):
    file_bytes = 4096 + BLOCK
    s = posix(tmp_path, capacity_bytes=10 * file_bytes)
    ids = make_ids(30, seed=11)
    src = payload(ids)
    hot = ids[:2]
    for k in range(0, 30, 2):
        s.commit(ids[k:k + 2], s.wait(s.dump(ids[k:k + 2], 0, src[k:k + 2])).ok)
        s.wait(s.load(hot, 0, np.zeros((2, BLOCK), np.uint8)))  # keep touching the hot blocks
        os.utime(s.path_of(hot[0]))
        published = [f for _, _, fs in os.walk(tmp_path) for f in fs if f.endswith(".blk")]
        assert len(published) * file_bytes <= 10 * file_bytes
        assert s.usage() == len(published) * file_bytes
    assert all(s.lookup(hot))  # recently used blocks survived
    assert s.lookup_prefix(ids[28:]) == 2  # the newest too
    assert s.stats()["posix"]["evictions"] >= 18
    s.close()


def test_posix_gc_removes_old_quarantine_only(tmp_path):
    s, ids, src = _committed(tmp_path, stale_tmp_s=3600)
    q = tmp_path / ".ucm" / "quarantine"
    old = q / (ucm.id_hex(ids[:1])[0] + ".blk.99999.1")
    old.write_bytes(b"x" * 100)
    os.utime(old, (1, 1))
    fresh = q / (ucm.id_hex(ids[1:2])[0] + ".blk.99999.2")
    fresh.write_bytes(b"y" * 100)
    mine = tmp_path / "notes.txt.tmp.1"  # not a ucm name: never touched (written after the marker)
    mine.write_bytes(b"keep")
    s.gc()
    assert not old.exists() and fresh.exists() and mine.exists()
    s.close()


# ---------------------------------------------------------------------------------------------
# faults from the environment: disk full, permissions

@pytest.fixture
def small_tmpfs(tmp_path):
    mnt = tmp_path / "small"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)], capture_output=True, text=True)
    if r.returncode != 0:
        if os.environ.get("UCM_REQUIRE_SERVICES") == "1":
            pytest.fail(f"cannot mount a small tmpfs for the disk-full test: {r.stderr}")
        pytest.skip(f"cannot mount tmpfs: {r.stderr.strip()}")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_disk_full_fails_the_dump_and_store_keeps_serving(small_tmpfs):
    s = posix(small_tmpfs)  # room for about 15 blocks of 68 KiB, budget far larger
    ids = make_ids(40, seed=12)
    src = payload(ids)
    first = s.wait(s.dump(ids[:5], 0, src[:5]))
    assert first.all_ok
    s.commit(ids[:5], first.ok)
    res = s.wait(s.dump(ids[5:], 0, src[5:]))
    assert not res.all_ok
    failed = [e for e in res.errors.values()]
    assert failed and all("ENOSPC" in e for e in failed)
    s.commit(ids[5:], res.ok)
    dst = np.zeros((5, BLOCK), np.uint8)
    assert s.wait(s.load(ids[:5], 0, dst)).all_ok and np.array_equal(dst, src[:5])
    assert not [f for _, _, fs in os.walk(small_tmpfs) for f in fs if ".tmp." in f]
    s.close()


AS_NOBODY = """
import logging, os, sys, numpy as np
logging.basicConfig()
sys.path.insert(0, {tests!r})
from test_store import BLOCK, posix, make_ids, payload
import shutil, tempfile
# finish every lazy import while still root (the interpreter lives under /root, and the checkout
# may be private to root): one round trip through a scratch store, under whatever backend
# UCM_BACKEND selects
scratch = tempfile.mkdtemp()
w = posix(scratch)
warm = make_ids(2)
w.commit(warm, w.wait(w.dump(warm, 0, payload(warm))).ok)
w.wait(w.load(warm, 0, np.zeros((2, BLOCK), np.uint8)))
w.close()
shutil.rmtree(scratch)
# now become an unprivileged user for real
os.setgroups([]); os.setgid(65534); os.setuid(65534)
root = {root!r}
try:
    posix(root + "/readonly")
except ValueError as e:
    print("CTOR", e)
s = posix(root + "/ok")
print("SPACE", s.space)
if {dump}:
    ids = make_ids(40, seed=13)
    r = s.wait(s.dump(ids, 0, payload(ids)))
    print("DUMP", int(r.ok.sum()), sorted(set(r.errors.values())))
    s.commit(ids, r.ok)
    good = ids[np.array(s.lookup(ids))]
    print("PUBLISHED", len(good))
    dst = np.zeros((len(good), 64 << 10), np.uint8)
    print("LOAD", bool(s.wait(s.load(good, 0, dst)).all_ok), bool(np.array_equal(dst, payload(good))))
s.close()
"""


def test_permission_errors_as_unprivileged_user():
    """A root the user may not write is refused at open; directories inside the store that it
    may not write fail those blocks' publication (a miss later), the others are stored."""
    import shutil
    import tempfile
    from pathlib import Path

    base = Path(tempfile.mkdtemp(prefix="ucm-perm-"))  # pytest's tmp dirs are private to root
    tests = os.path.dirname(__file__)

    def as_nobody(dump):
        return subprocess.run([sys.executable, "-c", AS_NOBODY.format(tests=tests, root=str(root), dump=dump)],
                              capture_output=True, text=True, timeout=120)
    try:
        os.chmod(base, 0o755)
        root = base / "perm"
        (root / "readonly").mkdir(parents=True)
        ok = root / "ok"
        ok.mkdir()
        os.chmod(root, 0o755)
        os.chmod(ok, 0o777)
        first = as_nobody(False)  # makes the root and its space, as that user
        assert first.returncode == 0, first.stderr
        space = ok / first.stdout.split("SPACE ")[1].split()[0]
        ids = make_ids(40, seed=13)
        blocked = {ucm.id_hex(ids[i:i + 1])[0][:2] for i in range(0, 40, 3)}
        for d in blocked:  # fan-out directories the writer may not write into
            (space / d).mkdir()
            os.chmod(space / d, 0o555)
        r = as_nobody(True)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "CTOR store.posix.roots" in first.stdout and "not writable" in first.stdout
    n_dumped = int(out.split("DUMP ")[1].split()[0])
    n_ok = int(out.split("PUBLISHED ")[1].split()[0])
    assert 0 < n_ok == n_dumped < 40 and "EACCES" in out  # the blocked ones fail at dump time
    assert "LOAD True True" in out


# ---------------------------------------------------------------------------------------------
# configuration through the factory

def test_factory_builds_pipeline_from_config(tmp_path):
    s = open_store({"store": {"pipeline": "memory|posix", "posix": {"roots": [str(tmp_path)]}},
                    "buffer_number": 8, "cache_capacity": "16MiB"},
                   block_bytes=BLOCK, shard_bytes=SHARD, namespace=NS.digest())
    assert isinstance(s, PipelineStore) and [t.name for t in s.tiers] == ["memory", "posix"]
    ids = make_ids(12, seed=14)
    src = payload(ids)
    s.commit(ids, s.wait(s.dump(ids, 0, src)).ok)  # memory holds 8 of them, posix all 12
    in_memory = np.array(s.tiers[0].lookup(ids), dtype=bool)
    assert in_memory.sum() == 8 and all(s.tiers[1].lookup(ids))
    dst = np.zeros_like(src)
    assert s.wait(s.load(ids, 0, dst)).all_ok and np.array_equal(dst, src)
    st = s.stats()
    assert st["pipeline"]["hits_by_tier"]["memory"] == 8 and st["pipeline"]["hits_by_tier"]["posix"] == 4
    # Blocks read from posix are promoted into memory, evicting idle blocks. (In the load above
    # the memory tier's 8 blocks were being read at the same time and may not be evicted, so
    # whether it promoted depends on which part finished first.)
    s.flush()
    before = s.stats()["pipeline"]["promotions"]
    low = ids[~np.array(s.tiers[0].lookup(ids), dtype=bool)]
    dst = np.zeros((len(low),) + src.shape[1:], dtype=src.dtype)
    assert s.wait(s.load(low, 0, dst)).all_ok
    s.flush()
    assert s.stats()["pipeline"]["promotions"] - before == len(low)
    assert all(s.tiers[0].lookup(low))
    s.close()


class CountingTier(MemoryStore):
    """An out-of-tree tier, loaded by 'module:Class'."""
    name = "counting"

    @classmethod
    def from_config(cls, geometry, config, namespace):
        return cls(geometry, buffer_number=4)


def test_factory_out_of_tree_and_register(tmp_path):
    s = open_store({"store": {"pipeline": "test_store:CountingTier"}}, block_bytes=BLOCK)
    assert s.name == "counting"
    s.close()
    ucm.store.register("counting", CountingTier)
    s = open_store({"store": {"pipeline": "counting|memory"}}, block_bytes=BLOCK)
    assert [t.name for t in s.tiers] == ["counting", "memory"]
    s.close()


@pytest.mark.parametrize("cfg,match", [
    ({"store": {"pipeline": "memory|s4"}}, r"'store.pipeline': unknown tier 's4'"),
    ({"store": {"pipeline": "nosuch.module:Tier"}}, r"'store.pipeline': cannot load tier"),
    ({"store": {"pipeline": "posix", "posix": {"roots": ["/nonexistent/ucm"]}}}, r"store.posix.roots.*does not exist"),
    ({"store": {"pipeline": "posix"}, "cache_capacity": -1}, r"'cache_capacity'"),
    ({"store": {"pipeline": "posix"}, "cache_capacity": 1000}, r"cache_capacity.*smaller than one block"),
    ({"buffer_number": -4}, r"'buffer_number'"),
    ({"store": {"pipeline": ""}}, r"'store.pipeline'"),
])
def test_bad_configuration(cfg, match, tmp_path):
    cfg = dict(cfg)
    cfg.setdefault("store", {}).setdefault("posix", {}).setdefault("roots", [str(tmp_path)])
    with pytest.raises(ValueError, match=match):
        open_store(cfg, block_bytes=BLOCK, shard_bytes=SHARD)


def test_bad_geometry():
    for kw, match in [({"block_bytes": 0}, "block_bytes"), ({"block_bytes": 100, "shard_bytes": 30}, "divide"),
                      ({"block_bytes": 100, "shard_bytes": 100}, "multiple of 8")]:
        with pytest.raises(ValueError, match=match):
            open_store({"store": {"pipeline": "memory"}}, **kw)


def test_borrow_lends_committed_rows_without_copy_and_pins_them(tmp_path):
    """KVStore.borrow: the memory tier lends its pool rows (the bytes it stored), a lent row is
    not evicted before release, a block it does not hold comes back as -1; tiers without host
    memory (posix) lend nothing; a pipeline lends its first tier's rows."""
    s = memory(buffer_number=2)
    ids = make_ids(3, seed=21)
    src = payload(ids)
    s.commit(ids[:2], s.wait(s.dump(ids[:2], 0, src[:2])).ok)
    lent = s.borrow(ids)
    assert lent.rows[2] == -1 and not lent.all_found
    for i in range(2):
        assert np.array_equal(lent.pool[int(lent.rows[i])].numpy(), src[i])
    # both slots lent: a third block cannot evict them
    r = s.wait(s.dump(ids[2:], 0, src[2:]))
    s.commit(ids[2:], r.ok)
    assert s.lookup(ids[:2]) == [True, True]
    lent.release()
    lent.release()  # idempotent
    s.commit(ids[2:], s.wait(s.dump(ids[2:], 0, src[2:])).ok)  # now evicts the oldest
    assert s.lookup(ids).count(True) == 2 and s.lookup(ids[2:]) == [True]
    with s.borrow(ids[2:]) as lent:
        assert lent.all_found and np.array_equal(lent.pool[int(lent.rows[0])].numpy(), src[2])
    s.close()
    with pytest.raises(ValueError, match="closed"):     # as load and dump
        s.borrow(ids)
    p = posix(tmp_path)
    assert p.borrow(ids) is None
    p.close()
    (tmp_path / "p").mkdir()
    pipe = PipelineStore([memory(), posix(tmp_path / "p")])
    pipe.commit(ids, pipe.wait(pipe.dump(ids, 0, src)).ok)
    with pipe.borrow(ids) as lent:
        assert lent.all_found
        got = np.stack([lent.pool[int(k)].numpy() for k in lent.rows])
    assert np.array_equal(got, src)
    pipe.close()


def test_commit_while_another_writer_of_the_block_is_in_flight_publishes_it():
    """Two dumps of one block: the second finds its shards claimed by the first, whose copy is
    still queued, and its caller commits first. The block is published once the bytes land
    (a discard here lost write-back blocks on a GPU machine)."""
    s = memory(buffer_number=8, io_threads=1)
    gate = threading.Event()
    s._exec.submit(gate.wait)  # the first writer's copy waits behind this (a slow device)
    ids = make_ids(1, seed=40)
    src = payload(ids)
    first = s.dump(ids, 0, src)
    second = s.dump(ids, 0, src)
    s.commit(ids, s.wait(second, timeout=5).ok)
    assert s.lookup(ids) == [False]  # not yet: the bytes are not there
    gate.set()
    s.commit(ids, s.wait(first, timeout=5).ok)
    assert s.lookup(ids) == [True]
    dst = np.zeros_like(src)
    assert s.wait(s.load(ids, 0, dst)).all_ok and np.array_equal(dst, src)
    s.close()
