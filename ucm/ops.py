"""The op surface every caller uses. Each op validates its inputs here, once, then dispatches to
the reference or a fast implementation (see :mod:`ucm.dispatch`), which all share one signature.

Ops registered here:

===================  =========================================  ==============================
op                   reference                                  fast
===================  =========================================  ==============================
hash_blocks          ucm.reference.hashing (pure Python)        ucm.fast.numba.hashing
block_index          ucm.reference.index (OrderedDict)          ucm.fast.numba.index
copy_segments        ucm.reference.copy (ctypes.memmove)        ucm.fast.native (C threads)
alloc_aligned        ucm.reference.copy (numpy)                 ucm.fast.native (posix_memalign/mmap)
checksum             ucm.reference.fileio (numpy)               ucm.fast.native
checksum_units       ucm.reference.fileio (numpy)               ucm.fast.native
copy_checksum_units  ucm.reference.fileio (numpy)               ucm.fast.native (one pass)
io_batch             ucm.reference.fileio (os.pread/pwrite)     ucm.fast.native (C threads)
open_beneath         ucm.reference.fileio (O_NOFOLLOW walk)     ucm.fast.native (openat2)
===================  =========================================  ==============================

The KV transfer ops (``gather_blocks``, ``scatter_blocks``) live in :mod:`ucm.transfer`, the
sparse-attention ops in :mod:`ucm.sparse.ops`; each family module validates its inputs and holds
its own table of implementations.
"""
from __future__ import annotations

import os
from typing import Optional, Sequence, Union

import numpy as np

from ucm import dispatch, fast
from ucm.dispatch import ImplSpec
from ucm.threads import default_threads
from ucm.ids import ID_BYTES, ZERO_ID, Namespace, _check_block_size, as_ids

# ---------------------------------------------------------------------------------------------
# implementations: the reference first, then the fast path (see ucm.fast for the probes)

def _pair(reference: str, name: str, target: str, probe) -> tuple:
    return ImplSpec("reference", reference), ImplSpec(name, target, priority=10, probe=probe)


IMPLEMENTATIONS = {
    "hash_blocks": _pair("ucm.reference.hashing:hash_blocks", "numba",
                         "ucm.fast.numba.hashing:hash_blocks", fast.numba_status),
    "block_index": _pair("ucm.reference.index:BlockIndex", "numba",
                         "ucm.fast.numba.index:BlockIndex", fast.numba_status),
    **{op: _pair(f"ucm.reference.{module}:{op}", "native", f"ucm.fast.native:{op}",
                 fast.native_status)
       for op, module in (("copy_segments", "copy"), ("alloc_aligned", "copy"),
                          ("checksum", "fileio"), ("checksum_units", "fileio"),
                          ("copy_checksum_units", "fileio"),
                          ("io_batch", "fileio"),
                          ("open_beneath", "fileio"))},
}
for _op, _table in IMPLEMENTATIONS.items():
    dispatch.register_table((_op,), _table)

# ---------------------------------------------------------------------------------------------
# hashing

_U32_MAX = 0xFFFFFFFF


def _as_tokens(tokens) -> np.ndarray:
    if type(tokens).__module__.startswith("torch"):
        tokens = tokens.detach().cpu().numpy()
    arr = np.asarray(tokens)
    if arr.size == 0:
        raise ValueError("tokens: empty sequence (nothing to hash)")
    if arr.dtype == object or arr.dtype.kind not in "iu":
        raise ValueError(f"tokens: expected integer token ids, got dtype {arr.dtype}")
    if arr.ndim != 1:
        raise ValueError(f"tokens: expected a 1-D sequence, got shape {list(arr.shape)}")
    if arr.dtype != np.uint32:
        lo, hi = int(arr.min()), int(arr.max())
        if lo < 0 or hi > _U32_MAX:
            raise ValueError(f"tokens: ids must lie in [0, 2**32), got min {lo}, max {hi}")
    return np.ascontiguousarray(arr, dtype=np.uint32)


def _as_id_words(value, name: str) -> np.ndarray:
    if isinstance(value, Namespace):
        return value.digest_words()
    if isinstance(value, (bytes, bytearray)):
        if len(value) != ID_BYTES:
            raise ValueError(f"{name}: expected {ID_BYTES} bytes, got {len(value)}")
        return np.frombuffer(bytes(value), dtype="<u8").astype(np.uint64)
    arr = np.asarray(value)
    if arr.shape != (2,) or arr.dtype.kind not in "iu":
        raise ValueError(f"{name}: expected {ID_BYTES} bytes or uint64[2], got {value!r}")
    if arr.dtype.kind == "i" and (arr < 0).any():
        raise ValueError(f"{name}: id words are unsigned, got negative values {arr.tolist()}")
    return arr.astype(np.uint64)


def hash_blocks(tokens, namespace: Union[Namespace, bytes], block_size: Optional[int] = None,
                parent=None, *, backend: Optional[str] = None) -> np.ndarray:
    """Chained 128-bit ids of the full ``block_size``-token blocks of ``tokens``.

    tokens: 1-D integer ids in ``[0, 2**32)`` (list, numpy array or CPU/GPU tensor), non-empty.
    namespace: a :class:`~ucm.ids.Namespace` (its ``block_size`` is the default) or a 16-byte
    digest (then ``block_size`` is required). parent: the id of the block preceding
    ``tokens[0]`` (16 bytes or ``uint64[2]``) to continue a chain; ``None`` starts one.
    Returns ``uint64 [len(tokens) // block_size, 2]`` (see :mod:`ucm.reference.hashing`).
    """
    if isinstance(namespace, Namespace):
        if block_size is None:
            block_size = namespace.block_size
        elif block_size != namespace.block_size:
            raise ValueError(f"block_size={block_size!r} differs from namespace.block_size="
                             f"{namespace.block_size}")
    elif block_size is None:
        raise ValueError("block_size is required when namespace is a raw digest")
    block_size = _check_block_size(block_size)
    toks = _as_tokens(tokens)
    ns = _as_id_words(namespace, "namespace")
    par = ZERO_ID if parent is None else _as_id_words(parent, "parent")
    return dispatch.call("hash_blocks", toks, block_size, ns, par, backend=backend)


# ---------------------------------------------------------------------------------------------
# block index

def _check_count(value, name: str, minimum: int, maximum: Optional[int] = None) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    if maximum is not None and value > maximum:
        raise ValueError(f"{name} must be an int in [{minimum}, {maximum}], got {value!r}")
    return int(value)


_U64_MAX = (1 << 64) - 1
_INT_MAX = (1 << 31) - 1    # a C int (descriptors, flags, modes, thread counts)


def _check_threads(n_threads) -> int:
    """Thread count hint: >= 1; beyond a C int it is capped (the engine caps it far lower)."""
    if n_threads is None:
        return default_threads()
    return min(_check_count(n_threads, "n_threads", 1), _INT_MAX)


def physical_memory() -> int:
    """Bytes of RAM of this machine (a pool or table larger than it can neither be pinned nor
    held)."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 1 << 62


class BlockIndex:
    """A capacity-bounded map from block id to a non-negative int64 value, in LRU order.

    Thin validating wrapper over the dispatched implementation (reference dict or Numba open
    addressing); method contract in :mod:`ucm.reference.index`. Not thread-safe: callers that
    share one index across threads hold a lock around each call.
    """

    def __init__(self, capacity: int, *, backend: Optional[str] = None):
        capacity = _check_count(capacity, "capacity", 1)
        impl, self.reason = dispatch.select("block_index", backend)
        self.backend = impl.name
        cls = impl.load()
        # an implementation that allocates its tables up front says how many bytes they take
        need = getattr(cls, "table_bytes", lambda n: 0)(capacity)
        if need > physical_memory():
            raise ValueError(f"capacity: {capacity} entries need {need} bytes of index tables "
                             f"({self.backend}), more than this machine's memory "
                             f"({physical_memory()} bytes)")
        self._impl = cls(capacity)
        self.capacity = capacity

    def __len__(self) -> int:
        return len(self._impl)

    def __repr__(self) -> str:
        return f"BlockIndex(capacity={self.capacity}, size={len(self)}, backend={self.backend!r})"

    def insert(self, ids, values):
        ids = as_ids(ids)
        vals = np.asarray(values)
        if vals.ndim == 0:
            vals = np.full(len(ids), vals)
        if vals.dtype.kind not in "iu" or vals.shape != (len(ids),):
            raise ValueError(f"values: expected {len(ids)} integers, got shape {list(vals.shape)} "
                             f"dtype {vals.dtype}")
        if vals.size and (vals.min() < 0 or vals.max() > np.iinfo(np.int64).max):
            raise ValueError("values must lie in [0, 2**63)")
        return self._impl.insert(ids, np.ascontiguousarray(vals, dtype=np.int64))

    def lookup(self, ids) -> np.ndarray:
        return self._impl.lookup(as_ids(ids))

    def lookup_prefix(self, ids) -> int:
        return self._impl.lookup_prefix(as_ids(ids))

    def touch(self, ids) -> np.ndarray:
        return self._impl.touch(as_ids(ids))

    def remove(self, ids) -> np.ndarray:
        return self._impl.remove(as_ids(ids))

    def evict(self, target: int):
        # at most capacity entries exist: a larger target evicts nothing (and fits an int64)
        return self._impl.evict(min(_check_count(target, "target", 0), self.capacity))

    def entries(self):
        return self._impl.entries()


# ---------------------------------------------------------------------------------------------
# byte movers

def _as_u64_vector(value, name: str, n: Optional[int] = None) -> np.ndarray:
    arr = np.asarray(value)
    if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
        raise ValueError(f"{name}: expected a 1-D sequence of non-negative ints, got "
                         f"shape {list(arr.shape)} dtype {arr.dtype}")
    if arr.size and arr.dtype.kind == "i" and arr.min() < 0:
        raise ValueError(f"{name}: negative value {int(arr.min())}")
    if n is not None and arr.shape[0] != n:
        raise ValueError(f"{name}: expected {n} entries, got {arr.shape[0]}")
    return np.ascontiguousarray(arr, dtype=np.uint64)


def copy_segments(src_ptrs: Sequence[int], dst_ptrs: Sequence[int], lengths: Sequence[int],
                  n_threads: Optional[int] = None, *, backend: Optional[str] = None) -> None:
    """Copy ``lengths[i]`` bytes from raw address ``src_ptrs[i]`` to ``dst_ptrs[i]``.

    Raw addresses cannot be checked: prefer :func:`copy_ranges`, which bounds-checks against
    buffers. Segments must not overlap. ``n_threads`` defaults to the core count (max 16).
    """
    lengths = _as_u64_vector(lengths, "lengths")
    src = _as_u64_vector(src_ptrs, "src_ptrs", len(lengths))
    dst = _as_u64_vector(dst_ptrs, "dst_ptrs", len(lengths))
    n_threads = _check_threads(n_threads)
    if len(lengths) and (((src == 0) | (dst == 0)) & (lengths > 0)).any():
        raise ValueError("src_ptrs/dst_ptrs: null address for a non-empty segment")
    dispatch.call("copy_segments", src, dst, lengths, n_threads, backend=backend)


def _buffer_view(buf, name: str, writable: bool) -> np.ndarray:
    if isinstance(buf, (list, tuple, str)):
        raise ValueError(f"{name}: expected a contiguous host buffer (numpy array, CPU tensor or "
                         f"buffer object), got {type(buf).__name__}")
    if type(buf).__module__.startswith("torch"):
        if buf.device.type != "cpu" or not buf.is_contiguous():
            raise ValueError(f"{name}: expected a contiguous CPU tensor")
        buf = buf.view(-1).view(__import__("torch").uint8).numpy()
    if isinstance(buf, np.ndarray):
        arr = buf
    else:
        try:
            arr = np.frombuffer(buf, dtype=np.uint8)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{name}: expected a contiguous host buffer (numpy array, CPU tensor "
                             f"or buffer object), got {type(buf).__name__} ({exc})") from None
    if arr.dtype.hasobject:
        raise ValueError(f"{name}: an array of Python objects has no bytes to copy")
    if not arr.flags.c_contiguous:
        raise ValueError(f"{name}: expected a C-contiguous buffer")
    if writable and not arr.flags.writeable:
        raise ValueError(f"{name}: buffer is read-only")
    return arr.reshape(-1).view(np.uint8)


def copy_ranges(src, src_offsets, dst, dst_offsets, lengths, n_threads: Optional[int] = None,
                *, backend: Optional[str] = None) -> None:
    """Bounds-checked :func:`copy_segments` between two contiguous host buffers (numpy arrays,
    CPU tensors or writable buffer objects): ``dst[dst_off:dst_off+len] = src[src_off:...]``."""
    s = _buffer_view(src, "src", writable=False)
    d = _buffer_view(dst, "dst", writable=True)
    lengths = _as_u64_vector(lengths, "lengths")
    so = _as_u64_vector(src_offsets, "src_offsets", len(lengths))
    do = _as_u64_vector(dst_offsets, "dst_offsets", len(lengths))
    if len(lengths):
        # each term alone first: their uint64 sum could wrap around to a small number
        if max(int(so.max()), int(lengths.max())) > s.nbytes or int((so + lengths).max()) > s.nbytes:
            raise ValueError(f"src_offsets + lengths exceed the source buffer ({s.nbytes} bytes)")
        if max(int(do.max()), int(lengths.max())) > d.nbytes or int((do + lengths).max()) > d.nbytes:
            raise ValueError(f"dst_offsets + lengths exceed the destination buffer ({d.nbytes} bytes)")
    base_s = np.uint64(s.ctypes.data)
    base_d = np.uint64(d.ctypes.data)
    copy_segments(so + base_s, do + base_d, lengths, n_threads, backend=backend)


def alloc_aligned(nbytes: int, alignment: int = 4096, *, backend: Optional[str] = None) -> np.ndarray:
    """A zero-filled, page-touched ``uint8 [nbytes]`` host buffer aligned to ``alignment`` bytes
    (a power of two, default 4096: suits ``O_DIRECT`` and pinning)."""
    nbytes = _check_count(nbytes, "nbytes", 1, 1 << 62)
    alignment = _check_count(alignment, "alignment", 8, 1 << 30)
    if alignment & (alignment - 1):
        raise ValueError(f"alignment must be a power of two, got {alignment}")
    return dispatch.call("alloc_aligned", nbytes, alignment, backend=backend)


# ---------------------------------------------------------------------------------------------
# block checksum and batched file I/O (used by the posix tier)

def checksum(data, word0: int = 0, *, backend: Optional[str] = None) -> int:
    """ucm-sum64 checksum of a contiguous host buffer whose first byte is word ``word0`` of its
    block (docs/block-format.md). Checksums of adjacent ranges add up modulo 2**64."""
    view = _buffer_view(data, "data", writable=False)
    word0 = _check_count(word0, "word0", 0, _U64_MAX)
    return dispatch.call("checksum", view, word0, backend=backend)


def checksum_units(data, unit_bytes: int, word0: int = 0, *,
                   backend: Optional[str] = None) -> np.ndarray:
    """One :func:`checksum` per ``unit_bytes`` of a contiguous host buffer (e.g. the shards of
    a block) in one call: ``uint64 [nbytes / unit_bytes]``; unit ``k`` starts at word
    ``word0 + k * unit_bytes / 8``. ``unit_bytes`` is a multiple of 8 that divides the size."""
    view = _buffer_view(data, "data", writable=False)
    unit = _check_count(unit_bytes, "unit_bytes", 8)
    if unit % 8 or view.nbytes % unit:
        raise ValueError(f"unit_bytes must be a multiple of 8 dividing the buffer's {view.nbytes} "
                         f"bytes, got {unit_bytes}")
    word0 = _check_count(word0, "word0", 0, _U64_MAX)
    return dispatch.call("checksum_units", view, unit, word0, backend=backend)


def copy_checksum_units(dst, src, unit_bytes: int, word0: int = 0, *,
                        backend: Optional[str] = None) -> np.ndarray:
    """Copy the contiguous host buffer ``src`` into ``dst`` (as many bytes) and return
    :func:`checksum_units` of the copied bytes, reading the source once."""
    s = _buffer_view(src, "src", writable=False)
    d = _buffer_view(dst, "dst", writable=True)
    if d.nbytes != s.nbytes:
        raise ValueError(f"dst has {d.nbytes} bytes, src {s.nbytes}: they must be equal")
    unit = _check_count(unit_bytes, "unit_bytes", 8)
    if unit % 8 or s.nbytes % unit:
        raise ValueError(f"unit_bytes must be a multiple of 8 dividing the buffer's {s.nbytes} "
                         f"bytes, got {unit_bytes}")
    word0 = _check_count(word0, "word0", 0, _U64_MAX)
    return dispatch.call("copy_checksum_units", d, s, unit, word0, backend=backend)


def new_io_ops(n: int) -> np.ndarray:
    """A zeroed structured array of ``n`` I/O ops for :func:`io_batch` (fields: fd, write, addr,
    len, file_off, word0; outputs result, checksum)."""
    from ucm.fast.native import IO_OP_DTYPE

    return np.zeros(_check_count(n, "n", 0), dtype=IO_OP_DTYPE)


def io_batch(ops: np.ndarray, n_threads: Optional[int] = None, want_checksum: bool = True, *,
             backend: Optional[str] = None) -> int:
    """Run positioned reads/writes (``ops`` from :func:`new_io_ops`) on several threads; fills
    ``ops["result"]`` (bytes moved or -errno) and ``ops["checksum"]``. Returns the number of
    failed ops. Addresses are raw: callers keep the buffers alive and sized."""
    from ucm.fast.native import IO_OP_DTYPE

    if not isinstance(ops, np.ndarray) or ops.dtype != IO_OP_DTYPE or ops.ndim != 1 \
            or not ops.flags.c_contiguous:
        raise ValueError("ops: expected a contiguous 1-D array from ucm.ops.new_io_ops()")
    if len(ops) and ((ops["addr"] == 0) & (ops["len"] > 0)).any():
        raise ValueError("ops: null address for a non-empty transfer")
    if len(ops) and (ops["fd"] < 0).any():
        raise ValueError("ops: negative file descriptor")
    n_threads = _check_threads(n_threads)
    return dispatch.call("io_batch", ops, n_threads, bool(want_checksum), backend=backend)


def open_beneath(dirfd: int, paths, flags: int, mode: int = 0o600, *,
                 keep_open: bool = True, want_sizes: bool = False,
                 backend: Optional[str] = None):
    """Open relative ``paths`` beneath the directory descriptor ``dirfd`` without following any
    symbolic link or leaving the directory (``O_NOFOLLOW`` and ``O_CLOEXEC`` are always added).
    ``paths``: a sequence of str, or (for hot loops) a ``uint8 [n, width]`` array whose rows hold
    NUL-terminated paths. Returns ``(fds, sizes)``: int64 arrays, per path the descriptor
    (``keep_open``; the caller closes it), 0 (opened and closed again: a probe) or -errno; with
    ``want_sizes`` the size of each regular file (a target that is not one fails with -EINVAL),
    else None."""
    if isinstance(dirfd, bool) or not isinstance(dirfd, (int, np.integer)) or not 0 <= dirfd <= _INT_MAX:
        raise ValueError(f"dirfd: expected a directory descriptor, got {dirfd!r}")
    for value, what in ((flags, "flags"), (mode, "mode")):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or \
                not -_INT_MAX - 1 <= value <= _INT_MAX:
            raise ValueError(f"{what}: expected an int that fits a C int, got {value!r}")
    if isinstance(paths, np.ndarray):
        if paths.dtype != np.uint8 or paths.ndim != 2 or not paths.flags.c_contiguous \
                or (len(paths) and not (paths == 0).any(axis=1).all()):
            raise ValueError("paths: expected a C-contiguous uint8 [n, width] array of "
                             "NUL-terminated rows")
        packed = paths.view(f"S{paths.shape[1]}").reshape(-1) if paths.shape[1] else \
            np.zeros(0, dtype="S1")
    else:
        if isinstance(paths, (str, bytes)):
            raise ValueError("paths: expected a sequence of relative paths, got one string")
        raw = [p.encode() if isinstance(p, str) else p for p in paths]
        for p in raw:
            if not isinstance(p, bytes) or b"\0" in p or p.startswith(b"/") \
                    or any(part in (b"", b".", b"..") for part in p.split(b"/")):
                raise ValueError(f"paths: {p!r} is not a relative path of plain components")
        width = max((len(p) for p in raw), default=0) + 1
        packed = np.array(raw, dtype=f"S{width}") if raw else np.zeros(0, dtype="S1")
    return dispatch.call("open_beneath", int(dirfd), packed, int(flags), int(mode), bool(keep_open),
                         bool(want_sizes), backend=backend)
