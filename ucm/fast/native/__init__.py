"""cffi wrapper of the C engine in ``native/`` (module ``ucm._native``).

The extension is checked at import: its ABI constant must equal :data:`EXPECTED_ABI`, and when the
C sources are next to this package (a development checkout) the source digest compiled into the
library must match them, so a stale ``.so`` is never used silently. :func:`status` says why the
engine is or is not usable; ``ucm`` falls back to the reference with one warning, or refuses to
import when ``UCM_REQUIRE_NATIVE=1``.
"""
from __future__ import annotations

import os
import sys

import numpy as np

EXPECTED_ABI = 5
# the checkout's C sources: repo/native, three levels above this package (ucm/fast/native)
_SRC_DIR = os.path.join(os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                     "..", "..", "..")), "native")

_lib = _ffi = None
_reason = ""


def _load() -> None:
    global _lib, _ffi, _reason
    try:
        from ucm import _native
    except ImportError as exc:
        _reason = f"extension ucm._native not built ({exc}); reinstall with `pip install -e .`"
        return
    abi = _native.lib.ucm_native_abi()
    if abi != EXPECTED_ABI:
        _reason = f"stale extension: ABI {abi}, this ucm expects {EXPECTED_ABI}; rebuild it"
        return
    built = _native.ffi.string(_native.lib.ucm_native_source_digest()).decode()
    if os.path.exists(os.path.join(_SRC_DIR, "build_native.py")):
        sys.path.insert(0, _SRC_DIR)
        try:
            from build_native import source_digest
        finally:
            sys.path.remove(_SRC_DIR)
        current = source_digest(_SRC_DIR)
        if built != current:
            _reason = (f"stale extension: built from sources {built or '?'}, the sources in "
                       f"{_SRC_DIR} are {current}; rebuild with `pip install -e .`")
            return
    _lib, _ffi = _native.lib, _native.ffi
    _reason = f"ucm._native ABI {abi}, sources {built}"


_load()


def status() -> tuple[bool, str]:
    return _lib is not None, _reason


def max_threads() -> int:
    return int(_lib.ucm_max_threads())


def _u64(a: np.ndarray):
    return _ffi.cast("const uint64_t *", a.ctypes.data)


def copy_segments(src_ptrs: np.ndarray, dst_ptrs: np.ndarray, lengths: np.ndarray,
                  n_threads: int) -> None:
    """Same contract as :func:`ucm.reference.copy.copy_segments`; runs on C threads."""
    rc = _lib.ucm_copy_segments(_u64(src_ptrs), _u64(dst_ptrs), _u64(lengths), len(lengths),
                                int(n_threads))
    if rc != 0:
        raise ValueError(f"ucm_copy_segments rejected its arguments (errno {-rc})")


def alloc_aligned(nbytes: int, alignment: int) -> np.ndarray:
    """Same contract as :func:`ucm.reference.copy.alloc_aligned`; small buffers from
    posix_memalign, large ones mmap'ed on transparent huge pages; freed when the last numpy view
    of it is gone."""
    ptr = _lib.ucm_alloc_aligned(nbytes, alignment)
    if ptr == _ffi.NULL:
        raise MemoryError(f"ucm_alloc_aligned({nbytes}, {alignment}) failed")
    owner = _ffi.gc(ptr, lambda p: _lib.ucm_free_aligned(p, nbytes), size=nbytes)
    arr = np.frombuffer(_ffi.buffer(owner, nbytes), dtype=np.uint8)
    return arr


# numpy mirror of ucm_io_op (native/ucm_native.h); its layout is checked against the C struct.
IO_OP_DTYPE = np.dtype([("fd", "<i4"), ("write", "<i4"), ("addr", "<u8"), ("len", "<u8"),
                        ("file_off", "<u8"), ("word0", "<u8"), ("csum_unit", "<u8"),
                        ("csum_out", "<u8"), ("result", "<i8"),
                        ("checksum", "<u8")], align=True)
if _lib is not None and _ffi.sizeof("ucm_io_op") != IO_OP_DTYPE.itemsize:
    _lib = None
    _reason = "ucm_io_op layout differs from IO_OP_DTYPE; rebuild the extension"


def checksum(data: np.ndarray, word0: int) -> int:
    """Same contract as :func:`ucm.reference.fileio.checksum`."""
    return int(_lib.ucm_checksum(_ffi.cast("const void *", data.ctypes.data), data.nbytes, word0))


def checksum_units(data: np.ndarray, unit: int, word0: int) -> np.ndarray:
    """Same contract as :func:`ucm.reference.fileio.checksum_units`."""
    out = np.empty(data.nbytes // unit, dtype=np.uint64)
    rc = _lib.ucm_checksum_units(_ffi.cast("const void *", data.ctypes.data), data.nbytes, unit,
                                 word0, _ffi.cast("uint64_t *", out.ctypes.data))
    if rc < 0:
        raise ValueError(f"ucm_checksum_units rejected unit {unit} for {data.nbytes} bytes")
    return out


def copy_checksum_units(dst: np.ndarray, src: np.ndarray, unit: int, word0: int) -> np.ndarray:
    """Same contract as :func:`ucm.reference.fileio.copy_checksum_units`."""
    out = np.empty(src.nbytes // unit, dtype=np.uint64)
    rc = _lib.ucm_copy_checksum_units(_ffi.cast("void *", dst.ctypes.data),
                                      _ffi.cast("const void *", src.ctypes.data), src.nbytes, unit,
                                      word0, _ffi.cast("uint64_t *", out.ctypes.data))
    if rc < 0:
        raise ValueError(f"ucm_copy_checksum_units rejected unit {unit} for {src.nbytes} bytes")
    return out


def io_batch(ops: np.ndarray, n_threads: int, want_checksum: bool) -> int:
    """Same contract as :func:`ucm.reference.fileio.io_batch`; runs on C threads."""
    rc = _lib.ucm_io_batch(_ffi.cast("ucm_io_op *", ops.ctypes.data), len(ops), int(n_threads),
                           int(bool(want_checksum)))
    if rc < 0:
        raise ValueError(f"ucm_io_batch rejected its arguments (errno {-rc})")
    return int(rc)


def open_beneath(dirfd: int, paths: np.ndarray, flags: int, mode: int, keep_open: bool,
                 want_sizes: bool):
    """Same contract as :func:`ucm.reference.fileio.open_beneath`; one C call for the batch
    (openat2 with RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS)."""
    n = len(paths)
    fds = np.zeros(n, dtype=np.int64)
    sizes = np.full(n, -1, dtype=np.int64) if want_sizes else None
    if n:
        rc = _lib.ucm_open_beneath(int(dirfd), _ffi.cast("const char *", paths.ctypes.data),
                                   paths.dtype.itemsize, n, int(flags), int(mode), int(bool(keep_open)),
                                   _ffi.cast("int64_t *", fds.ctypes.data),
                                   _ffi.NULL if sizes is None else _ffi.cast("int64_t *", sizes.ctypes.data))
        if rc < 0:
            raise ValueError(f"ucm_open_beneath rejected its arguments (errno {-rc})")
    return fds, sizes
