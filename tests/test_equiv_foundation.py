"""Foundation ops, every registered implementation against the reference (tests/equivalence.py):
hash_blocks, block_index, copy_segments (through copy_ranges), alloc_aligned, checksum,
io_batch and open_beneath, per input dtype and layout, on random and edge inputs (empty, one
element, extreme values, sizes at the ops' internal boundaries). The ops' own allocations are
poisoned; buffers the tests pass in start as a sentinel, so stray and missing writes show."""
import errno
import os
import pathlib
import tempfile

import numpy as np
import pytest

import ucm
import ucm.ops as ops
from equivalence import (assert_equivalent, compare, dirty_heap, implementation_params,
                         runnable)

SENTINEL = 0xA5


def impls(op):
    return pytest.mark.parametrize("impl", implementation_params(op))


# ---------------------------------------------------------------------------------------------
# hash_blocks

TOKEN_DTYPES = [np.int32, np.int64, np.uint32, np.uint64]
# (tokens, block_size): one token, fewer tokens than a block (no block: an empty result), one
# block, a tail, primes, block_size 256, a long chain
HASH_SHAPES = [(1, 1), (15, 16), (16, 16), (17, 16), (997, 7), (64, 3), (256, 256), (4099, 32)]


def _tokens(rng, n, dtype, layout):
    hi = 2**31 - 1 if np.dtype(dtype) == np.int32 else 2**32 - 1
    t = rng.integers(0, hi, size=n, endpoint=True).astype(dtype)
    t[: min(n, 2)] = [0, hi][: min(n, 2)]                    # the extreme ids
    if layout == "strided":
        wide = np.zeros(2 * n, dtype=dtype)
        wide[::2] = t
        return wide[::2]
    return t.tolist() if layout == "list" else t


@impls("hash_blocks")
@pytest.mark.parametrize("layout", ["contiguous", "strided", "list"])
@pytest.mark.parametrize("dtype", TOKEN_DTYPES, ids=lambda d: np.dtype(d).name)
def test_hash_blocks(impl, dtype, layout, monkeypatch, rng):
    backend, _ = runnable("hash_blocks", impl, monkeypatch)
    for n, bs in HASH_SHAPES:
        tokens = _tokens(rng, n, dtype, layout)
        ns = ucm.Namespace(model="m", dtype="float32", block_size=bs)
        for parent in (None, rng.integers(0, 2**64 - 1, size=2, dtype=np.uint64, endpoint=True)):
            want = compare("hash_blocks", lambda b: ucm.hash_blocks(tokens, ns, parent=parent,
                                                                   backend=b),
                           backend, np.uint64)
            assert want.shape == (n // bs, 2)


# ---------------------------------------------------------------------------------------------
# block_index: a random log of mixed calls, malformed ones among them

def _ids(rng, n):
    return rng.integers(0, 2**64 - 1, size=(n, 2), dtype=np.uint64, endpoint=True)


GARBAGE = [np.zeros((3, 3), np.uint64), np.zeros(5, np.int64), np.full((2, 2), -5, np.int64),
           [b"abc"], np.zeros((1, 2), np.float32), "not ids", [None]]


def _log(seed, n_ops, pool_size, capacity, garbage):
    """(method, args, malformed) for a random workload over a pool of ids (small clustered keys
    among them); with ``garbage`` about 10% of the calls are malformed."""
    rng = np.random.default_rng(seed)
    pool = _ids(rng, pool_size)
    pool[: pool_size // 10, 0] = np.arange(pool_size // 10)
    kinds = ["insert", "lookup", "lookup_prefix", "touch", "remove", "evict", "entries"]
    probs = [0.34, 0.2, 0.14, 0.12, 0.12, 0.04, 0.04]
    for _ in range(n_ops):
        kind = kinds[rng.choice(len(kinds), p=probs)]
        batch = pool[rng.integers(0, len(pool), size=int(rng.integers(0, 9)))]
        if garbage and kind not in ("evict", "entries") and rng.random() < 0.1:
            bad = GARBAGE[int(rng.integers(len(GARBAGE)))]
            yield kind, ((bad, [1]) if kind == "insert" else (bad,)), True
        elif kind == "insert":
            yield kind, (batch, rng.integers(0, 2**40, size=len(batch))), False
        elif kind == "evict":
            yield kind, (int(rng.integers(0, capacity + 2)),), False
        elif kind == "entries":
            yield kind, (), False
        else:
            yield kind, (batch,), False


def _replay(backend, capacity, log):
    idx = ucm.BlockIndex(capacity, backend=backend)
    out = []
    for kind, args, malformed in log:
        if malformed:
            with pytest.raises(ValueError):
                getattr(idx, kind)(*args)
            out.append("ValueError")
        else:
            out.append(getattr(idx, kind)(*args))
        assert len(idx) <= capacity
    out.append(idx.entries())
    return out


# (capacity, id pool, operations): together 105,000 operations for a fast implementation; the
# reference against itself replays a tenth (it can only differ from itself by what it reads
# uninitialised, which a short log shows as well)
INDEX_LOGS = [pytest.param(1, 4, 10_000, id="cap1"),
              pytest.param(7, 40, 30_000, id="cap7-tiny-table"),
              pytest.param(300, 1_000, 40_000, id="cap300"),
              pytest.param(2_000, 2_500, 25_000, id="cap2000-mostly-resident")]


@impls("block_index")
@pytest.mark.parametrize("capacity,pool_size,n_ops", INDEX_LOGS)
def test_block_index_log(impl, capacity, pool_size, n_ops, monkeypatch):
    backend, _ = runnable("block_index", impl, monkeypatch)
    if backend == "reference":
        n_ops //= 10
    log = list(_log(capacity, n_ops, pool_size, capacity, garbage=capacity < 300))

    def same(g, w):   # a quick exact test; assert_equivalent explains the first difference
        if isinstance(w, tuple):
            return isinstance(g, tuple) and len(g) == len(w) and all(map(same, g, w))
        if isinstance(w, np.ndarray):
            return isinstance(g, np.ndarray) and g.dtype == w.dtype and np.array_equal(g, w)
        return type(g) is type(w) and g == w

    def check(got, want):
        assert len(got) == len(want)
        for step, (g, w) in enumerate(zip(got, want)):
            if same(g, w):
                continue
            kind = log[step][0] if step < len(log) else "entries (final)"
            dtype = w.dtype if isinstance(w, np.ndarray) else \
                w[0].dtype if isinstance(w, tuple) and isinstance(w[0], np.ndarray) else "int64"
            assert_equivalent("block_index", g, w, dtype, f" step {step} ({kind})")
    compare("block_index", lambda b: _replay(b, capacity, log), backend, None, check=check)


# ---------------------------------------------------------------------------------------------
# copy_segments (through the bounds-checked copy_ranges)

def _plan(rng, n, max_len, buf_size):
    lengths = rng.integers(0, max_len + 1, size=n)
    lengths[rng.random(n) < 0.1] = 0
    slot = max_len + 13
    src = rng.permutation(buf_size // slot)[:n] * slot + rng.integers(0, 13, n)
    dst = rng.permutation(buf_size // slot)[:n] * slot + rng.integers(0, 13, n)
    return src, dst, lengths


def _buffer(raw: np.ndarray, dtype, layout):
    """The bytes ``raw`` as a buffer of ``dtype`` elements in ``layout``."""
    arr = raw.view(dtype)
    if layout == "torch":
        import torch

        return torch.from_numpy(arr)
    return bytearray(arr.tobytes()) if layout == "bytearray" else arr


def _raw(buf) -> np.ndarray:
    if type(buf).__module__.startswith("torch"):
        buf = buf.numpy()
    return np.frombuffer(buf, dtype=np.uint8) if isinstance(buf, bytearray) else buf.view(np.uint8)


# (segments, longest segment): none, one byte, odd sizes, many, multi-megabyte
COPY_PLANS = [(0, 8), (1, 1), (7, 33), (64, 4096), (300, 65536), (3, 3 << 20)]


@impls("copy_segments")
@pytest.mark.parametrize("layout", ["numpy", "torch", "bytearray"])
@pytest.mark.parametrize("dtype", [np.uint8, np.float32], ids=["uint8", "float32"])
def test_copy_segments(impl, dtype, layout, monkeypatch, rng):
    backend, _ = runnable("copy_segments", impl, monkeypatch)
    if layout == "torch":
        pytest.importorskip("torch")
    for n, max_len in COPY_PLANS:
        size = (max_len + 13) * (n + 2)
        size += -size % 4
        src = _buffer(rng.integers(0, 256, size, dtype=np.uint8), dtype, layout)
        so, do, ln = _plan(rng, n, max_len, size)
        for threads in (1, 3):
            def run(b):
                dst = _buffer(np.full(size, SENTINEL, dtype=np.uint8), dtype, layout)
                ucm.copy_ranges(src, so, dst, do, ln, n_threads=threads, backend=b)
                return _raw(dst)
            compare("copy_segments", run, backend, np.uint8)


# ---------------------------------------------------------------------------------------------
# alloc_aligned: zero-filled even where the allocator reuses dirty memory

@impls("alloc_aligned")
@pytest.mark.parametrize("nbytes,alignment", [(1, 8), (4097, 4096), (1 << 20, 64),
                                              (3 << 20, 2 << 20)])
def test_alloc_aligned(impl, nbytes, alignment, monkeypatch):
    backend, _ = runnable("alloc_aligned", impl, monkeypatch)

    def run(b):
        dirty_heap(nbytes + alignment)
        buf = ucm.alloc_aligned(nbytes, alignment, backend=b)
        assert buf.ctypes.data % alignment == 0 and buf.flags.writeable, b
        return buf.copy()
    compare("alloc_aligned", run, backend, np.uint8)


# ---------------------------------------------------------------------------------------------
# checksum

CHECKSUM_SIZES = [0, 1, 7, 8, 9, 63, 64, 65, 127, 128, 129, 1000, 4096 * 3 + 5]


@impls("checksum")
@pytest.mark.parametrize("layout", ["numpy", "unaligned", "torch", "bytes"])
@pytest.mark.parametrize("dtype", [np.uint8, np.uint64], ids=["uint8", "uint64"])
def test_checksum(impl, dtype, layout, monkeypatch, rng):
    backend, _ = runnable("checksum", impl, monkeypatch)
    if layout == "torch":
        pytest.importorskip("torch")
    for n in CHECKSUM_SIZES:
        raw = rng.integers(0, 256, n + 16, dtype=np.uint8)
        if layout == "unaligned":                        # a start that is not word aligned
            data = raw[3:3 + n]
        else:
            whole = raw[: n - n % np.dtype(dtype).itemsize].view(dtype)
            data = _buffer(whole.view(np.uint8), dtype, "torch") if layout == "torch" else \
                whole.tobytes() if layout == "bytes" else whole
        for word0 in (0, 5, 2**40, 2**64 - 1):
            compare("checksum", lambda b: ops.checksum(data, word0, backend=b), backend,
                    np.uint64)



@impls("checksum_units")
@pytest.mark.parametrize("layout", ["numpy", "unaligned", "torch"])
def test_checksum_units(impl, layout, monkeypatch, rng):
    backend, _ = runnable("checksum_units", impl, monkeypatch)
    if layout == "torch":
        pytest.importorskip("torch")
    for n_units, unit in ((1, 8), (3, 64), (16, 4096), (5, 65536 + 8)):
        raw = rng.integers(0, 256, n_units * unit + 16, dtype=np.uint8)
        data = raw[3:3 + n_units * unit] if layout == "unaligned" else raw[:n_units * unit]
        if layout == "torch":
            data = _buffer(data, np.uint8, "torch")
        for word0 in (0, 7, 2**64 - 1):
            compare("checksum_units", lambda b: ops.checksum_units(data, unit, word0, backend=b),
                    backend, np.uint64)

@impls("copy_checksum_units")
@pytest.mark.parametrize("layout", ["numpy", "unaligned", "torch"])
def test_copy_checksum_units(impl, layout, monkeypatch, rng):
    """The sums of checksum_units over the copied bytes, and every byte copied (the outputs
    compared are the sums followed by the destination's bytes)."""
    backend, _ = runnable("copy_checksum_units", impl, monkeypatch)
    if layout == "torch":
        pytest.importorskip("torch")
    for n_units, unit in ((1, 8), (3, 64), (16, 4096), (2, 16384 + 8), (5, 65536 + 8)):
        raw = rng.integers(0, 256, n_units * unit + 16, dtype=np.uint8)
        src = raw[3:3 + n_units * unit] if layout == "unaligned" else raw[:n_units * unit]
        if layout == "torch":
            src = _buffer(src, np.uint8, "torch")
        for word0 in (0, 7, 2**64 - 1):
            def run(b):
                dst = np.full(n_units * unit + 5, 0xA5, dtype=np.uint8)
                view = dst[1:1 + n_units * unit] if layout == "unaligned" else dst[:n_units * unit]
                sums = ops.copy_checksum_units(view, src, unit, word0, backend=b)
                assert np.array_equal(sums, ops.checksum_units(src, unit, word0, backend="reference"))
                return np.concatenate([sums, dst.view(np.uint8).astype(np.uint64)])
            compare("copy_checksum_units", run, backend, np.uint64)
    with pytest.raises(ValueError, match="must be equal"):
        ops.copy_checksum_units(np.zeros(16, np.uint8), np.zeros(24, np.uint8), 8, backend=backend)
    with pytest.raises(ValueError, match="unit_bytes"):
        ops.copy_checksum_units(np.zeros(24, np.uint8), np.zeros(24, np.uint8), 16, backend=backend)
    with pytest.raises(ValueError, match="read-only"):
        ro = np.zeros(16, np.uint8)
        ro.flags.writeable = False
        ops.copy_checksum_units(ro, np.zeros(16, np.uint8), 8, backend=backend)


# ---------------------------------------------------------------------------------------------
# io_batch: writes, reads, per-unit checksums and per-op errors

def _io_run(backend, tmp_path, data, threads, want_checksum):
    """Write ``data`` in pieces, read it back in others, with errors mixed in; the outputs that
    may be compared across implementations (results, checksums, bytes read, file contents)."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    d = pathlib.Path(tempfile.mkdtemp(dir=tmp_path))
    fd = os.open(d / "f.bin", os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    n = len(data)
    unit = 64
    sums = np.full((4, max(1, (n // 4) // unit)), SENTINEL, dtype=np.uint64)
    piece = n // 4 - (n // 4) % unit
    w = ops.new_io_ops(5)
    for k in range(4):
        unit_k = unit if piece else 0
        w[k] = (fd, 1, data.ctypes.data + k * piece if piece else 0, piece, k * piece,
                k * piece // 8, unit_k, sums.ctypes.data + k * sums.shape[1] * 8 if unit_k else 0,
                0, 0)
    w[4] = (fd, 1, data.ctypes.data + 4 * piece, n - 4 * piece, 4 * piece, 4 * piece // 8, 0, 0,
            0, 0)
    w["result"] = -12345
    w["checksum"] = 0xA5A5A5A5A5A5A5A5
    wrote = ops.io_batch(w, threads, want_checksum, backend=backend)
    out = np.full(n + 64, SENTINEL, dtype=np.uint8)
    r = ops.new_io_ops(5)
    r[0] = (fd, 0, out.ctypes.data, n // 2, 0, 0, 0, 0, 0, 0)
    r[1] = (fd, 0, out.ctypes.data + n // 2, n - n // 2, n // 2, (n // 2) // 8, 0, 0, 0, 0)
    r[2] = (fd, 0, out.ctypes.data, 64, n, 0, 0, 0, 0, 0)               # past the end
    r[3] = (9999, 0, out.ctypes.data, 16, 0, 0, 0, 0, 0, 0)             # bad descriptor
    r[4] = (fd, 0, out.ctypes.data, 64, 0, 0, 12, out.ctypes.data, 0, 0)  # unit not 8-aligned
    r["result"] = -12345
    r["checksum"] = 0xA5A5A5A5A5A5A5A5
    read = ops.io_batch(r, threads, want_checksum, backend=backend)
    os.close(fd)
    # the checksum field is defined for ops that succeeded without per-unit checksums
    defined = [o["checksum"][(o["result"] >= 0) & (o["csum_unit"] == 0)] if want_checksum
               else np.zeros(0, np.uint64) for o in (w, r)]
    return dict(failed=(wrote, read), write=[w["result"].copy(), defined[0]],
                read=[r["result"].copy(), defined[1]], sums=sums if want_checksum else None,
                out=out, file=np.fromfile(d / "f.bin", np.uint8))


@impls("io_batch")
@pytest.mark.parametrize("size", [1, 8, 4096 + 7, 1 << 20], ids=lambda s: f"{s}B")
@pytest.mark.parametrize("threads", [1, 3])
def test_io_batch(impl, size, threads, tmp_path, monkeypatch, rng):
    backend, _ = runnable("io_batch", impl, monkeypatch)
    data = rng.integers(0, 256, size, dtype=np.uint8)
    for want_checksum in (True, False):
        def check(got, want):
            for key, dtype in (("failed", "int64"), ("write", None), ("read", None),
                               ("sums", "uint64"), ("out", "uint8"), ("file", "uint8")):
                if dtype is None:                   # [results int64, checksums uint64]
                    for i, (g, w) in enumerate(zip(got[key], want[key])):
                        assert_equivalent("io_batch", g, w, w.dtype, f"[{key!r}][{i}]")
                else:
                    assert_equivalent("io_batch", got[key], want[key], dtype, f"[{key!r}]")
        compare("io_batch", lambda b: _io_run(b, tmp_path / str(want_checksum), data, threads,
                                              want_checksum), backend, None, check=check)


# ---------------------------------------------------------------------------------------------
# open_beneath

def _tree(root):
    root.mkdir(parents=True)
    (root / "a").mkdir()
    (root / "a" / "f").write_bytes(b"x" * 4100)
    (root / "e").write_bytes(b"")
    os.symlink("a/f", root / "link")
    os.symlink("a", root / "dirlink")
    return os.open(root, os.O_RDONLY | os.O_DIRECTORY)


# regular files (nested, empty), missing ones, a symlink last or in the middle, a directory,
# names at the open_beneath width limits
OPEN_PATHS = ["a/f", "e", "missing", "a/missing", "link", "dirlink/f", "a", "a/f/x",
              "n" * 255, "a/" + "m" * 200]


def _paths(paths, layout):
    if layout == "array":
        width = max(len(p) for p in paths) + 1
        arr = np.zeros((len(paths), width), dtype=np.uint8)
        for i, p in enumerate(paths):
            arr[i, :len(p)] = np.frombuffer(p.encode(), np.uint8)
        return arr
    return [p.encode() for p in paths] if layout == "bytes" else list(paths)


@impls("open_beneath")
@pytest.mark.parametrize("layout", ["str", "bytes", "array"])
@pytest.mark.parametrize("mode", ["read", "probe_sizes", "create"])
def test_open_beneath(impl, layout, mode, tmp_path, monkeypatch):
    backend, _ = runnable("open_beneath", impl, monkeypatch)
    flags = os.O_RDWR | os.O_CREAT if mode == "create" else os.O_RDONLY
    keep_open, sizes = mode != "probe_sizes", mode == "probe_sizes"

    def run(b):
        root = pathlib.Path(tempfile.mkdtemp(dir=tmp_path)) / "root"
        dirfd = _tree(root)
        try:
            fds, sz = ops.open_beneath(dirfd, _paths(OPEN_PATHS, layout), flags, 0o600,
                                       keep_open=keep_open, want_sizes=sizes, backend=b)
            kept = fds[fds > 0]
            for fd in kept.tolist():
                os.close(fd)
            # descriptor numbers differ between runs: compare "a descriptor" (1) with -errno
            return dict(fds=np.where(fds > 0, 1, fds), sizes=sz, listing=sorted(os.listdir(root)))
        finally:
            os.close(dirfd)
    want = compare("open_beneath", run, backend, np.int64)
    assert want["fds"][4] == -errno.ELOOP and want["fds"][7] == -errno.ENOTDIR
    assert want["fds"][2] == (1 if mode == "create" else -errno.ENOENT)      # "missing"
