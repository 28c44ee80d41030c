"""Opening the files a user names (config files, traces, sample requests, fitted codec files).

Only regular files are read. A FIFO would block the open until some writer came, and a device
such as ``/dev/zero`` never ends; a symlink is followed and judged by its target. The file is
opened without blocking and checked on its descriptor, so nothing can be swapped in between.
"""
from __future__ import annotations

import io
import os
import stat


class NotRegularFile(OSError):
    """The path names something other than a regular file (a FIFO, a device, a directory)."""


def open_regular(path, mode: str = "rb", **kwargs) -> io.IOBase:
    """``open(path, mode)`` for reading (``"rb"`` or ``"r"`` with ``encoding`` etc.), refusing
    anything but a regular file with :class:`NotRegularFile` (an ``OSError``, as ``open``'s own
    failures are: callers that report one report both)."""
    if mode not in ("rb", "r"):
        raise ValueError(f"open_regular reads only: mode 'rb' or 'r', got {mode!r}")
    fd = os.open(os.fspath(path), os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        kind = stat.S_IFMT(os.fstat(fd).st_mode)
        if kind != stat.S_IFREG:
            what = {stat.S_IFIFO: "a FIFO", stat.S_IFCHR: "a character device",
                    stat.S_IFBLK: "a block device", stat.S_IFDIR: "a directory",
                    stat.S_IFSOCK: "a socket"}.get(kind, "not a file")
            raise NotRegularFile(f"not a regular file ({what})")
        os.set_blocking(fd, True)
        return os.fdopen(fd, mode, **kwargs)
    except BaseException:
        os.close(fd)
        raise
