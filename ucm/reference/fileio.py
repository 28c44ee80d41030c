"""Reference block checksum ("ucm-sum64") and batched positioned file I/O, in numpy and os.*.

Same names and signatures as :mod:`ucm.fast.native`; inputs are validated by ``ucm.ops``.
The checksum is defined in docs/block-format.md (and native/ucm_native.h).
"""
from __future__ import annotations

import ctypes
import errno
import os
import stat

import numpy as np

PHI = np.uint64(0x9E3779B97F4A7C15)
MIX = np.uint64(0xD6E8FEB86659FD93)
S32 = np.uint64(32)


def checksum(data: np.ndarray, word0: int) -> int:
    """ucm-sum64 of the bytes of ``data`` (a contiguous uint8 array), first word numbered
    ``word0``: sum over words of mix(w ^ (j * PHI)) modulo 2**64."""
    raw = data.tobytes()
    pad = (-len(raw)) % 8
    words = np.frombuffer(raw + b"\0" * pad, dtype="<u8").astype(np.uint64)
    with np.errstate(over="ignore"):
        j = np.uint64(word0) + np.arange(len(words), dtype=np.uint64)   # word numbers wrap at 2**64
        x = words ^ (j * PHI)
        x ^= x >> S32
        x *= MIX
        x ^= x >> S32
        return int(x.sum(dtype=np.uint64))


def checksum_units(data: np.ndarray, unit: int, word0: int) -> np.ndarray:
    """One :func:`checksum` per ``unit`` bytes of ``data`` (unit ``k`` starts at word
    ``word0 + k * unit / 8``), as ``uint64 [len / unit]``."""
    return np.array([checksum(data[k * unit:(k + 1) * unit], (word0 + k * unit // 8) % 2**64)
                     for k in range(data.nbytes // unit)], dtype=np.uint64)


def copy_checksum_units(dst: np.ndarray, src: np.ndarray, unit: int, word0: int) -> np.ndarray:
    """Copy ``src`` into ``dst`` (same size) and return :func:`checksum_units` of the copied
    bytes."""
    dst[:] = src
    return checksum_units(dst, unit, word0)


def _view(addr: int, length: int):
    return memoryview((ctypes.c_char * length).from_address(addr)).cast("B")


def io_batch(ops: np.ndarray, n_threads: int, want_checksum: bool) -> int:
    """Run each op of ``ops`` (structured array of ``ucm.fast.native.IO_OP_DTYPE``): pwrite
    ``len`` bytes from ``addr`` (``write=1``) or pread them into ``addr`` at ``file_off`` of
    ``fd``; sets ``result`` (bytes or -errno) and, if asked, the checksum: one in ``checksum``,
    or with ``csum_unit`` one per unit into the uint64 array at address ``csum_out``. One
    thread. Returns the number of failed ops."""
    failed = 0
    for op in ops:
        length, addr, unit = int(op["len"]), int(op["addr"]), int(op["csum_unit"])
        if want_checksum and unit and (unit % 8 or length % unit or not op["csum_out"]):
            op["result"] = -errno.EINVAL
            failed += 1
            continue
        buf = _view(addr, length) if length else memoryview(b"")
        done, result = 0, 0
        while done < length:
            try:
                if op["write"]:
                    r = os.pwrite(int(op["fd"]), buf[done:], int(op["file_off"]) + done)
                else:
                    r = os.preadv(int(op["fd"]), [buf[done:]], int(op["file_off"]) + done)
            except InterruptedError:
                continue
            except OSError as exc:
                result = -(exc.errno or errno.EIO)
                break
            if r == 0:
                result = -(errno.EIO if op["write"] else errno.ENODATA)
                break
            done += r
        else:
            result = done
        op["result"] = result
        if result < 0:
            failed += 1
            continue
        if want_checksum:
            data = np.frombuffer(buf, dtype=np.uint8) if length else np.zeros(0, np.uint8)
            word0 = int(op["word0"])
            if unit:
                out = np.frombuffer(_view(int(op["csum_out"]), 8 * (length // unit)), dtype=np.uint64)
                for u in range(length // unit):
                    out[u] = checksum(data[u * unit:(u + 1) * unit], word0 + u * unit // 8)
            else:
                op["checksum"] = checksum(data, word0)
    return failed


def _is_link(name: str, dirfd: int) -> bool:
    try:
        return stat.S_ISLNK(os.stat(name, dir_fd=dirfd, follow_symlinks=False).st_mode)
    except OSError:
        return False


def _open_walk(dirfd: int, path: str, flags: int, mode: int) -> int:
    parts = path.split("/")
    if path.startswith("/") or any(part in ("", "..") for part in parts):
        return -errno.EINVAL
    cur = dirfd
    try:
        for k, part in enumerate(parts):
            last = k == len(parts) - 1
            try:
                fd = os.open(part, (flags if last else os.O_PATH | os.O_DIRECTORY) | os.O_NOFOLLOW
                             | os.O_CLOEXEC, mode if last else 0, dir_fd=cur)
            except OSError as exc:
                code = exc.errno or errno.EIO
                if code == errno.ENOTDIR and not last and _is_link(part, cur):
                    code = errno.ELOOP   # a symbolic link where a directory is walked through
                return -code
            if cur != dirfd:
                os.close(cur)
            cur = fd
        fd, cur = cur, dirfd
        return fd
    finally:
        if cur != dirfd:
            os.close(cur)


def open_beneath(dirfd: int, paths: np.ndarray, flags: int, mode: int, keep_open: bool,
                 want_sizes: bool):
    """Open each relative path of ``paths`` (a fixed-width bytes array, NUL-padded) beneath the
    directory ``dirfd``, following no symbolic link: each directory component is opened with
    ``O_DIRECTORY | O_NOFOLLOW``, the last with ``flags | O_NOFOLLOW``. Returns ``(fds, sizes)``:
    int64 arrays with the descriptor (``keep_open``), 0 (closed again) or -errno per path, and
    with ``want_sizes`` each regular file's size (-1 on failure; a target that is not a regular
    file fails with -EINVAL, a link with -ELOOP), else None."""
    n = len(paths)
    fds = np.zeros(n, dtype=np.int64)
    sizes = np.full(n, -1, dtype=np.int64) if want_sizes else None
    for i in range(n):
        fd = _open_walk(dirfd, paths[i].decode(), flags, mode)
        if fd >= 0 and want_sizes:
            st = os.fstat(fd)
            import stat as _stat

            if _stat.S_ISLNK(st.st_mode) or not _stat.S_ISREG(st.st_mode):
                os.close(fd)
                fd = -(errno.ELOOP if _stat.S_ISLNK(st.st_mode) else errno.EINVAL)
            else:
                sizes[i] = st.st_size
        if fd >= 0 and not keep_open:
            os.close(fd)
            fd = 0
        fds[i] = fd
    return fds, sizes
