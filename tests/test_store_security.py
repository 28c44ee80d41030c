"""The store as a hostile local user and a careless operator would treat it: symbolic links
planted by another user, file modes, roots that are not ucm's, tenants sharing a root, the byte
budget under never-committed dumps and oversized batches, read-only consumers, bad input.
Real files, real users (uid 65534 through setuid in a child process), real processes."""
import grp
import os
import shutil
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest

import ucm
from ucm.store import BlockGeometry, open_store
from ucm.store.memory import MemoryStore
from ucm.store.pipeline import PipelineStore
from ucm.store.posix import PosixStore, space_name

TESTS = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, TESTS)
from store_model import GEOMETRY, block_ids, content  # noqa: E402

NS = ucm.Namespace("security-test", "bfloat16", 16).digest()
FILE = 4096 + GEOMETRY.block_bytes
NOBODY = 65534
GID = 4242  # the shared group of the group-mode tests (a bare gid: no /etc/group entry needed)

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as two users")


def posix(root, **kw):
    kw.setdefault("capacity_bytes", 256 * FILE)
    return PosixStore(GEOMETRY, [str(root)], kw.pop("namespace", NS), io_threads=2, **kw)


def put(store, keys, commit=True):
    ids = block_ids(keys)
    r = store.wait(store.dump(ids, 0, np.stack([content(k) for k in keys])))
    if commit:
        store.commit(ids, r.ok)
    return r


def get(store, keys):
    dst = np.zeros((len(keys), GEOMETRY.block_bytes), np.uint8)
    r = store.wait(store.load(block_ids(keys), 0, dst))
    for i, k in enumerate(keys):
        assert not r.ok[i] or np.array_equal(dst[i], content(k)), f"key {k}: wrong bytes"
    return r


@pytest.fixture
def public_tmp():
    """A directory other users can reach (pytest's own tmp dirs are private to root)."""
    base = Path(tempfile.mkdtemp(prefix="ucm-sec-"))
    os.chmod(base, 0o755)
    yield base
    shutil.rmtree(base, ignore_errors=True)


def as_user(code: str, groups=(), **fmt) -> subprocess.CompletedProcess:
    """Run ``code`` in a child process as uid/gid 65534 with these supplementary groups."""
    prelude = ("import os, sys\nsys.path.insert(0, %r)\n" % TESTS
               + "import glob, shutil, numpy as np, ucm, store_model\n"  # imports while still root
               + "ucm.backend_info()\n"
               + f"os.setgroups({list(groups)!r}); os.setgid({NOBODY}); os.setuid({NOBODY})\n")
    r = subprocess.run([sys.executable, "-c", prelude + code.format(**fmt)], capture_output=True,
                       text=True, timeout=120)
    return r


def snapshot(path: Path) -> dict:
    """Every entry under ``path`` (not following links): kind, size, mode, mtime and bytes."""
    out = {}
    for d, dirs, files in os.walk(path):
        for name in dirs + files:
            p = os.path.join(d, name)
            st = os.lstat(p)
            data = open(p, "rb").read() if stat.S_ISREG(st.st_mode) else os.readlink(p) \
                if stat.S_ISLNK(st.st_mode) else None
            out[os.path.relpath(p, path)] = (stat.S_IFMT(st.st_mode), st.st_mode & 0o7777, st.st_mtime_ns, data)
    return out


# ---------------------------------------------------------------------------------------------
# file modes

def test_files_and_directories_are_private_by_default(tmp_path):
    old = os.umask(0)  # the modes must not depend on the caller's umask
    try:
        s = posix(tmp_path)
        put(s, range(6))
        dirs, files = [], []
        for d, ds, fs in os.walk(tmp_path):
            dirs += [os.path.join(d, x) for x in ds]
            files += [os.path.join(d, x) for x in fs]
        assert files and dirs
        bad = [(p, oct(os.stat(p).st_mode & 0o7777)) for p in dirs if os.stat(p).st_mode & 0o7777 != 0o700]
        bad += [(p, oct(os.stat(p).st_mode & 0o7777)) for p in files if os.stat(p).st_mode & 0o7777 != 0o600]
        assert not bad
        s.close()
    finally:
        os.umask(old)


@needs_root
def test_other_users_cannot_read_private_blocks(public_tmp):
    root = public_tmp / "kv"
    root.mkdir()
    os.chmod(root, 0o755)  # even with a readable root directory
    s = posix(root)
    put(s, [1])
    path = s.path_of(block_ids([1])[0])
    s.close()
    r = as_user("try:\n    open({path!r}, 'rb').read()\n    print('READ')\nexcept PermissionError:\n    print('DENIED')",
                path=path)
    assert r.stdout.strip() == "DENIED", r.stderr


@needs_root
def test_shared_group_modes_and_a_group_member_reads(public_tmp):
    root = public_tmp / "shared"
    root.mkdir()
    old = os.umask(0o077)  # a strict umask must not cut the group's bits
    try:
        s = posix(root, group=str(GID))
        put(s, range(4))
    finally:
        os.umask(old)
    for d, ds, fs in os.walk(root):
        for x in ds:
            st = os.stat(os.path.join(d, x))
            assert st.st_gid == GID and st.st_mode & 0o7777 == 0o2770, (x, oct(st.st_mode))
        for x in fs:
            st = os.stat(os.path.join(d, x))
            assert st.st_gid == GID and st.st_mode & 0o7777 in (0o640, 0o660), (x, oct(st.st_mode))
    s.close()
    code = """
from ucm.store.posix import PosixStore
from store_model import GEOMETRY, block_ids, content
s = PosixStore(GEOMETRY, [{root!r}], {ns!r}, group="{gid}")
dst = np.zeros((4, GEOMETRY.block_bytes), np.uint8)
r = s.wait(s.load(block_ids(range(4)), 0, dst))
print("LOADED", int(r.ok.sum()), all(np.array_equal(dst[i], content(i)) for i in range(4)))
ids = block_ids([9])
s.commit(ids, s.wait(s.dump(ids, 0, content(9)[None])).ok)
s.close()
"""
    r = as_user(code, groups=[GID], root=str(root), ns=NS, gid=GID)
    assert "LOADED 4 True" in r.stdout, r.stderr
    s = posix(root, group=str(GID))
    assert get(s, [9]).all_ok  # and the member's block is everyone's in the group
    s.close()


# ---------------------------------------------------------------------------------------------
# symbolic links planted by another user

PLANT = """
import os
root, victim, space, what, ab = {root!r}, {victim!r}, {space!r}, {what!r}, {ab!r}
meta = os.path.join(root, ".ucm")
def swap(path, target):
    if os.path.isdir(path) and not os.path.islink(path):
        import shutil
        shutil.rmtree(path)
    elif os.path.lexists(path):
        os.unlink(path)
    os.symlink(target, path)
if what == "usage":
    swap(os.path.join(meta, "usage"), os.path.join(victim, "secret.txt"))
elif what == "lock":
    swap(os.path.join(meta, "lock"), os.path.join(victim, "created-by-lock"))
elif what == "marker":
    swap(os.path.join(meta, "ROOT"), os.path.join(victim, "secret.txt"))
elif what == "quarantine":
    swap(os.path.join(meta, "quarantine"), os.path.join(victim, "q"))
elif what == "tmp":
    swap(os.path.join(meta, "tmp"), os.path.join(victim, "elsewhere"))
elif what == "space":
    swap(os.path.join(root, space), os.path.join(victim, "elsewhere"))
elif what == "prefix":
    swap(os.path.join(root, space, ab), os.path.join(victim, "elsewhere"))
elif what == "block":
    blk = [os.path.join(d, f) for d, _, fs in os.walk(os.path.join(root, space)) for f in fs][0]
    swap(blk, os.path.join(victim, "elsewhere", "f" * 32 + ".blk"))
print("PLANTED", what)
"""

REFUSED = ["usage", "lock", "marker", "quarantine", "tmp", "space"]


@needs_root
@pytest.mark.parametrize("what", REFUSED + ["prefix", "block"])
def test_symlinks_planted_by_a_group_member_are_never_followed(public_tmp, what):
    """A member of the shared group (uid 65534) replaces a part of the root with a link into
    the victim's files; the victim's next store refuses to open (metadata) or treats the block
    as missing (prefix directory, block file); nothing outside the root is read, written,
    created or deleted, and no block lands outside the root."""
    root, victim = public_tmp / "shared", public_tmp / "victim"
    root.mkdir()
    os.chown(root, -1, GID)
    os.chmod(root, 0o2770)  # the group's directory, as an administrator sets one up
    for d in ("elsewhere/cd", "q"):
        (victim / d).mkdir(parents=True)
    (victim / "secret.txt").write_bytes(b"precious data, not ucm's")
    (victim / "elsewhere" / "cd" / ("f" * 32 + ".blk")).write_bytes(b"a user's file named like a block")
    (victim / "elsewhere" / ("f" * 32 + ".blk")).write_bytes(b"another one, where a block would be")
    (victim / "q" / ("e" * 32 + ".blk.1.1")).write_bytes(b"a user's file named like a quarantined block")
    os.utime(victim / "q" / ("e" * 32 + ".blk.1.1"), (1, 1))
    for p in [victim, *victim.rglob("*")]:
        os.chmod(p, 0o777 if p.is_dir() else 0o666)  # the attacker could not write here otherwise
    before = snapshot(victim)
    s = posix(root, group=str(GID), capacity_bytes=12 * FILE, stale_tmp_s=0)
    put(s, range(8))
    space = s.space
    later = [k for k in range(100, 400) if ucm.id_hex(block_ids([k]))[0][:2]
             == ucm.id_hex(block_ids([100]))[0][:2]][:4]
    s.close()
    r = as_user(PLANT, groups=[GID], root=str(root), victim=str(victim), space=space, what=what,
                ab=ucm.id_hex(block_ids([later[0]]))[0][:2])
    assert "PLANTED" in r.stdout, r.stderr
    if what in REFUSED:
        with pytest.raises(ValueError, match="symbolic link"):
            posix(root, group=str(GID), capacity_bytes=12 * FILE, stale_tmp_s=0)
    else:
        s = posix(root, group=str(GID), capacity_bytes=12 * FILE, stale_tmp_s=0)
        r = put(s, later)
        if what == "prefix":  # no temporary file is made through the link: the dumps fail
            assert not r.ok.any() and s.lookup(block_ids(later)) == [False] * len(later)
        else:
            assert r.all_ok
        got = get(s, list(range(8)))
        assert got.ok.sum() >= 7 - (what == "block")
        put(s, range(20, 60))  # eviction pressure: collection walks the tree
        s.gc(0)
        s.close()
    assert snapshot(victim) == before  # nothing outside the root changed
    assert not (victim / "created-by-lock").exists()


@needs_root
@pytest.mark.parametrize("plant", ["link", "dir"])
def test_metadata_made_by_another_user_in_a_world_writable_root_is_refused(public_tmp, plant):
    root = public_tmp / "world"
    root.mkdir()
    os.chmod(root, 0o1777)  # like /tmp: anyone may create entries
    code = ("os.symlink('/etc', {meta!r})" if plant == "link" else "os.mkdir({meta!r}, 0o777)")
    r = as_user(code, meta=str(root / ".ucm"))
    assert r.returncode == 0, r.stderr
    with pytest.raises(ValueError, match="symbolic link" if plant == "link" else "belongs to uid 65534"):
        posix(root)


# ---------------------------------------------------------------------------------------------
# roots that are not ucm's

def test_a_non_empty_unmarked_directory_is_refused_and_left_untouched(tmp_path):
    home = tmp_path / "home"
    (home / "ab" / "cd").mkdir(parents=True)
    for name in ("image.blk", "cache.tmp.42", "report.tmp.docx", "ab/cd/" + "0" * 32 + ".blk"):
        (home / name).write_bytes(b"the user's")
    before = snapshot(home)
    with pytest.raises(ValueError, match="not empty and is not a ucm root"):
        posix(home)
    assert snapshot(home) == before


@pytest.mark.parametrize("roots,match", [
    ([""], "not a directory path"), (["   "], "not a directory path"),
    (["{a}", "{a}/"], "listed twice"), (["{a}/nope"], "does not exist"), ([7], "not a directory path"),
])
def test_bad_roots(tmp_path, roots, match):
    roots = [r.format(a=tmp_path) if isinstance(r, str) else r for r in roots]
    with pytest.raises(ValueError, match=match):
        PosixStore(GEOMETRY, roots, NS)


@pytest.mark.parametrize("cfg,match", [
    ({"store": {"pipeline": "memory|memory"}}, r"'store.pipeline'.*each tier once"),
    ({"store": {"pipeline": "posix", "posix": {"roots": [""]}}}, r"'store.posix.roots'.*non-empty"),
    ({"store": {"pipeline": "posix", "posix": {"roots": ["/a", "/a"]}}}, r"'store.posix.roots'.*each directory once"),
])
def test_bad_store_configuration(cfg, match):
    with pytest.raises(ValueError, match=match):
        open_store(cfg, block_bytes=GEOMETRY.block_bytes)


def test_a_pipeline_of_one_tier_twice_or_of_two_namespaces_is_refused():
    m = MemoryStore(GEOMETRY, buffer_number=4, namespace=NS)
    with pytest.raises(ValueError, match="listed twice"):
        PipelineStore([m, m])
    other = MemoryStore(GEOMETRY, buffer_number=4, namespace=bytes(16))
    with pytest.raises(ValueError, match="another namespace"):
        PipelineStore([m, other])
    m.close()
    other.close()


def test_marker_checks(tmp_path):
    posix(tmp_path).close()
    (tmp_path / ".ucm" / "ROOT").write_bytes(b"something else\n")
    with pytest.raises(ValueError, match="not a ucm marker"):
        posix(tmp_path)
    other = tmp_path / "other"
    other.mkdir()
    (other / ".ucm").write_bytes(b"a file")
    with pytest.raises(ValueError, match="symbolic link or not a directory"):
        posix(other)


def test_collection_deletes_only_files_ucm_wrote(tmp_path):
    s = posix(tmp_path, capacity_bytes=10 * FILE, stale_tmp_s=0)
    put(s, range(4))
    sp = tmp_path / s.space
    ab = sorted(p for p in sp.iterdir())[0]
    (ab / "cd").mkdir()
    foreign = [tmp_path / "image.blk", tmp_path / "cache.tmp.42", sp / "report.tmp.docx",
               ab / "notes.txt", ab / "readme.blk", ab / ("A" * 32 + ".blk"), ab / "cd" / ("0" * 32 + ".blk"),
               tmp_path / ".ucm" / "tmp" / "notes", tmp_path / ".ucm" / "quarantine" / "mine.txt"]
    for f in foreign:
        f.write_bytes(b"not ucm's")
        os.utime(f, (1, 1))
    for k in range(10, 60, 5):  # eviction pressure
        put(s, range(k, k + 5))
    assert s.gc(0) == 0
    assert all(f.read_bytes() == b"not ucm's" for f in foreign)
    assert not any(p.name.endswith(".blk") and len(p.name) == 36 and p.name[:32].islower()
                   for p in sp.rglob("*.blk"))
    s.close()


# ---------------------------------------------------------------------------------------------
# tenants: namespaces and geometries sharing a root

def test_namespaces_and_geometries_live_apart(tmp_path):
    a = posix(tmp_path)
    b = posix(tmp_path, namespace=ucm.Namespace("another-model", "bfloat16", 16).digest())
    keys = list(range(6))
    put(a, keys)
    assert b.lookup(block_ids(keys)) == [False] * 6  # A's blocks are not B's hits
    r = put(b, keys)
    assert r.all_ok and b.stats()["posix"]["dump_skipped"] == 0  # B really wrote its own
    assert get(a, keys).all_ok and get(b, keys).all_ok
    geo2 = BlockGeometry(GEOMETRY.block_bytes, GEOMETRY.block_bytes)  # one shard per block
    c = PosixStore(geo2, [str(tmp_path)], NS, capacity_bytes=256 * FILE)
    assert c.space != a.space and c.lookup(block_ids(keys)) == [False] * 6
    dst = np.zeros((6, GEOMETRY.block_bytes), np.uint8)
    assert not c.wait(c.load(block_ids(keys), 0, dst)).ok.any()
    for s in (a, b, c):
        assert s.stats()["posix"]["quarantined"] == 0
    assert get(a, keys).all_ok  # nothing of A's was touched
    for s in (a, b, c):
        s.close()
    assert space_name(NS, GEOMETRY) == a.space


def test_memory_tier_carries_its_namespace():
    m = open_store({"store": {"pipeline": "memory"}, "buffer_number": 4}, block_bytes=GEOMETRY.block_bytes,
                   shard_bytes=GEOMETRY.shard_bytes, namespace=NS)
    assert m.namespace == NS
    m.close()


# ---------------------------------------------------------------------------------------------
# the byte budget

def _disk(root):
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(root) for f in fs
               if f not in ("lock", "usage", "ROOT"))


def test_never_committed_dumps_stay_within_the_budget(tmp_path):
    budget = 3 * FILE + 100
    s = posix(tmp_path, capacity_bytes=budget)
    failed = 0
    for k in range(200):
        r = put(s, [k], commit=False)
        failed += int(not r.ok[0])
        assert _disk(tmp_path) <= budget
    assert failed >= 197 and "budget" in r.errors[0]
    s.commit(block_ids(range(200)), False)
    assert _disk(tmp_path) == 0 and s.usage() == 0
    s.close()


def test_a_batch_larger_than_the_budget_keeps_its_leading_blocks(tmp_path):
    s = posix(tmp_path, capacity_bytes=10 * FILE)
    put(s, range(4))
    put(s, range(10, 13))
    assert all(s.lookup(block_ids(list(range(4)) + [10, 11, 12])))  # no eviction below the budget
    big = list(range(100, 115))
    r = put(s, big)
    assert r.ok.tolist() == [True] * 10 + [False] * 5
    assert s.lookup_prefix(block_ids(big)) == 10
    assert get(s, big[:10]).all_ok
    assert _disk(tmp_path) <= 10 * FILE and s.usage() == _disk(tmp_path)
    s.close()


# ---------------------------------------------------------------------------------------------
# read-only consumers

@needs_root
def test_a_read_only_consumer_of_a_root_it_may_not_write(public_tmp):
    root = public_tmp / "published"
    root.mkdir()
    s = posix(root)
    put(s, range(10))
    s.close()
    for p in [root, *root.rglob("*")]:  # the operator publishes it read-only to everyone
        os.chmod(p, 0o555 if p.is_dir() else 0o444)
    before = snapshot(root)
    code = """
from ucm.store.posix import PosixStore
from store_model import GEOMETRY, block_ids, content
import numpy as np
try:
    PosixStore(GEOMETRY, [{root!r}], {ns!r})
except ValueError as e:
    print("WRITABLE-REFUSED", e)
s = PosixStore(GEOMETRY, [{root!r}], {ns!r}, read_only=True)
ids = block_ids(range(12))
print("LOOKUP", sum(s.lookup(ids)), s.lookup_prefix(ids))
dst = np.zeros((12, GEOMETRY.block_bytes), np.uint8)
r = s.wait(s.load(ids, 0, dst))
print("LOAD", int(r.ok.sum()), all(np.array_equal(dst[i], content(i)) for i in range(10)))
r = s.wait(s.dump(ids[10:], 0, dst[10:]))
print("DUMP", r.ok.tolist(), sorted(set(r.errors.values())))
s.commit(ids[10:], True)
s.close()
"""
    r = as_user(code, root=str(root), ns=NS)
    assert r.returncode == 0, r.stderr
    assert "WRITABLE-REFUSED" in r.stdout and "read_only" in r.stdout
    assert "LOOKUP 10 10" in r.stdout and "LOAD 10 True" in r.stdout
    assert "DUMP [False, False] ['read-only store']" in r.stdout
    assert snapshot(root) == before  # not one byte, mode or mtime changed


def test_read_only_needs_an_existing_root(tmp_path):
    with pytest.raises(ValueError, match="not a ucm root"):
        posix(tmp_path, read_only=True)


# ---------------------------------------------------------------------------------------------
# bad input on every kind of store

@pytest.fixture(params=["memory", "posix", "memory|posix"])
def store(request, tmp_path):
    if request.param == "memory":
        s = MemoryStore(GEOMETRY, buffer_number=8, namespace=NS)
    elif request.param == "posix":
        s = posix(tmp_path)
    else:
        s = PipelineStore([MemoryStore(GEOMETRY, buffer_number=8, namespace=NS), posix(tmp_path)])
    yield s
    s.close()


def test_bad_input_is_a_clear_error_and_loses_nothing(store):
    put(store, [1, 2])
    ids = block_ids([1, 2])
    good = np.stack([content(1), content(2)])
    with pytest.raises(TypeError, match="dst: dtype object"):
        store.load(ids, 0, np.empty((2, 8), dtype=object))
    with pytest.raises(TypeError, match="src: dtype object"):
        store.dump(ids, 0, np.array([[object()] * 8] * 2, dtype=object))
    with pytest.raises(ValueError, match="src: rows in reverse order"):
        store.dump(ids, 0, good[::-1])
    with pytest.raises(ValueError, match="dst: rows overlap"):
        store.load(ids, 0, np.lib.stride_tricks.as_strided(np.zeros(GEOMETRY.block_bytes, np.uint8),
                                                           (2, GEOMETRY.block_bytes), (0, 1)))
    with pytest.raises(TypeError, match="success_flags"):
        store.commit(ids, None)
    with pytest.raises(TypeError, match="success_flags"):
        store.commit(ids, "yes")
    with pytest.raises(TypeError, match="success_flags"):
        store.commit(ids, [2, 0])
    with pytest.raises(ValueError, match="offset"):
        store.load(ids, 1.5, np.zeros_like(good))
    empty = store.wait(store.dump(np.zeros((0, 2), np.uint64), 0, np.zeros((0, GEOMETRY.block_bytes), np.uint8)))
    assert empty.ok.shape == (0,) and empty.all_ok
    assert store.wait(store.load([], 0, [])).ok.shape == (0,)
    assert get(store, [1, 2]).all_ok  # nothing lost


def test_a_root_of_an_older_ucm_is_adopted_and_recounted(tmp_path):
    """An older ucm's root (.ucm/ without a marker, blocks in ab/cd/ at the top): adopted, its
    old blocks neither read nor counted nor deleted, its stale usage figure recounted."""
    (tmp_path / ".ucm" / "quarantine").mkdir(parents=True)
    (tmp_path / ".ucm" / "usage").write_text("%-30d\n" % (999 * FILE))
    old = tmp_path / "ab" / "cd" / ("ab" + "c" * 30 + ".blk")
    old.parent.mkdir(parents=True)
    old.write_bytes(b"an old block")
    s = posix(tmp_path, capacity_bytes=8 * FILE)
    assert s.usage() == 0 and old.exists()
    put(s, range(4))
    assert s.usage() == 4 * FILE and get(s, range(4)).all_ok
    s.close()
