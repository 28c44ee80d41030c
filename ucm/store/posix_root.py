"""Root directories of the ``posix`` tier: ownership marker, permissions, metadata opened
without following links, the byte budget (lock, usage, reservation, collection), writer liveness
and publication. :mod:`ucm.store.posix` builds the store on these; ``docs/posix-tier.md`` has
the rules."""
from __future__ import annotations

import errno
import fcntl
import grp
import hashlib
import logging
import os
import re
import socket
import stat
import threading
import time
import uuid
from typing import Optional

from ucm.ops import open_beneath
from ucm.store import format as fmt
from ucm.store.base import BlockGeometry

log = logging.getLogger("ucm.store.posix")

SUFFIX = ".blk"
META = ".ucm"
MARKER = b"ucm kv root 1\n"
_HEX32 = re.compile(r"[0-9a-f]{32}\Z")
_HEX2 = re.compile(r"[0-9a-f]{2}\Z")
_BLOCK = re.compile(r"[0-9a-f]{32}\.blk\Z")
_TEMP = re.compile(r"[0-9a-f]{32}\.blk\.tmp\.([0-9a-f]{8}-\d+-[0-9a-f]{8})\.\d+\Z")
_WRITER = re.compile(r"[0-9a-f]{8}-\d+-[0-9a-f]{8}\Z")
_QUARANTINED = re.compile(r"[0-9a-f]{32}\.blk\.\d+\.\d+\Z")
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_HOST = hashlib.sha256(socket.gethostname().encode()).hexdigest()[:8]
_ORPHAN_WRITER_S = 60.0  # a writer directory without its lock file is dead after this long


def space_name(namespace: bytes, geometry: BlockGeometry, codec: int = 0) -> str:
    """The directory of one space (namespace, geometry, codec, format version) under a root."""
    h = hashlib.sha256(b"ucm-space\0" + bytes(namespace) + b"%d/%d/%d/%d" % (
        geometry.block_bytes, geometry.shard_bytes, codec, fmt.VERSION))
    return h.hexdigest()[:32]


def _err(code: int) -> str:
    code = abs(int(code))
    return f"{errno.errorcode.get(code, code)}: {os.strerror(code)}"


def _close(*fds) -> None:
    for fd in fds:
        if fd is not None and fd >= 0:
            try:
                os.close(fd)
            except OSError:
                pass


class Perms:
    """File and directory modes, and the group of a shared root."""

    def __init__(self, group: Optional[str], read_only: bool = False):
        self.gid = None
        # a reader writes nothing through these directories: it needs no ownership of them
        # (links stay refused), it trusts the producer whose root it was pointed at
        self.read_only = read_only
        if group not in (None, ""):
            try:
                self.gid = int(group) if str(group).isdigit() else grp.getgrnam(str(group)).gr_gid
            except KeyError:
                raise ValueError(f"store.posix.group: no group named {group!r}") from None
        shared = self.gid is not None
        self.dir_mode = 0o2770 if shared else 0o700
        self.file_mode = 0o640 if shared else 0o600
        self.meta_mode = 0o660 if shared else 0o600

    def fix(self, fd: int, mode: int) -> None:
        """Give a file or directory we created its mode (umask may have cut it) and group."""
        if self.gid is not None:
            os.fchown(fd, -1, self.gid)
            os.fchmod(fd, mode)

    def check(self, fd: int, what: str, directory: bool) -> None:
        """Refuse metadata that another user controls (or that is not what it should be)."""
        st = os.fstat(fd)
        if directory and not stat.S_ISDIR(st.st_mode) or not directory and not stat.S_ISREG(st.st_mode):
            raise ValueError(f"store.posix.roots: {what} is not a {'directory' if directory else 'file'}")
        if st.st_uid == os.geteuid() or self.read_only:
            return
        if self.gid is not None and st.st_gid == self.gid and not st.st_mode & 0o002:
            return
        raise ValueError(f"store.posix.roots: {what} belongs to uid {st.st_uid}, not to this user "
                         f"(uid {os.geteuid()}){'' if self.gid is None else ' nor to the shared group'}: "
                         f"refusing a directory another user controls (a consumer that only reads "
                         f"it opens it with store.posix.read_only)")


def _open_dir(name: str, dir_fd: int, perms: Optional[Perms], what: str, create: bool) -> Optional[int]:
    """A directory below ``dir_fd`` (one component), created if asked, never through a link.
    None when it does not exist and ``create`` is False."""
    for attempt in (0, 1):
        try:
            fd = os.open(name, _DIR_FLAGS, dir_fd=dir_fd)
        except FileNotFoundError:
            if not create or attempt:
                return None
            try:
                os.mkdir(name, perms.dir_mode if perms else 0o700, dir_fd=dir_fd)
            except FileExistsError:
                pass
            continue
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                raise ValueError(f"store.posix.roots: {what} is a symbolic link or not a directory; "
                                 f"ucm follows no link under a root") from None
            raise
        if perms is not None:
            try:
                perms.check(fd, what, directory=True)
                if create and attempt:
                    perms.fix(fd, perms.dir_mode)
            except BaseException:
                os.close(fd)
                raise
        return fd
    return None


class RootDir:
    """One root directory: its descriptors, lock, usage counter, writer directory and space."""

    def __init__(self, path: str, budget: int, file_bytes: int, space: str, perms: Perms,
                 read_only: bool, stale_s: float, stats):
        self.path, self.budget, self.file_bytes, self.space = path, budget, file_bytes, space
        self.perms, self.read_only, self.stale_s, self._stats = perms, read_only, stale_s, stats
        self.fd = self.meta = self.lockfd = self.usagefd = self.quarantine = None
        self.tmp = self.writer = self.writer_lock = self.space_fd = None
        self.writer_name = None
        self._tlock = threading.Lock()  # flock does not exclude threads sharing one descriptor
        self._space_probe = 0.0
        try:
            self._open()
        except BaseException:
            self.close()
            raise

    # -- opening --------------------------------------------------------------------------------
    def _open(self) -> None:
        try:
            self.fd = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except FileNotFoundError:
            raise ValueError(f"store.posix.roots: {self.path!r} does not exist or is not a directory") from None
        except NotADirectoryError:
            raise ValueError(f"store.posix.roots: {self.path!r} does not exist or is not a directory") from None
        except PermissionError:
            raise ValueError(f"store.posix.roots: {self.path!r} cannot be opened (permission denied)") from None
        self.meta = _open_dir(META, self.fd, self.perms, f"{self.path}/{META}", create=False)
        if self.meta is None:
            self._initialise()
        made = self._check_marker()
        if not self.read_only:
            try:
                self.lockfd = self._meta_file("lock")
                self.usagefd = self._meta_file("usage")
                self.quarantine = _open_dir("quarantine", self.meta, self.perms,
                                            f"{self.path}/{META}/quarantine", create=True)
                self.tmp = _open_dir("tmp", self.meta, self.perms, f"{self.path}/{META}/tmp", create=True)
            except PermissionError as exc:
                raise ValueError(f"store.posix.roots: {self.path!r} is not writable ({exc.strerror}); "
                                 f"a consumer that may not write opens it with store.posix.read_only") from None
            self._open_writer()
            with self.locked():
                # a dead writer's temporaries may not all have been counted yet (they are
                # counted right after they are made): remove them and recount exactly
                # and a root just marked (new, or adopted from an older ucm) is counted afresh
                if made or self._dead_writers() or self.read_usage() is None:
                    self.gc_locked(None)
        if self.space is not None:      # (None: an administrator's handle on the whole root)
            self.open_space(create=not self.read_only)

    def _initialise(self) -> None:
        """Make an empty directory a ucm root (marker last: a half-made root is still empty of
        anything but .ucm, so the next store finishes the job)."""
        if self.read_only:
            raise ValueError(f"store.posix.roots: {self.path!r} is not a ucm root (no {META}/ROOT "
                             f"marker); a read-only store opens only a root a writer has made")
        others = [e for e in os.listdir(self.fd) if e != META]
        if others:  # another process may have made it meanwhile (engines open roots at once)
            self.meta = _open_dir(META, self.fd, self.perms, f"{self.path}/{META}", create=False)
            if self.meta is not None:
                return
            raise ValueError(f"store.posix.roots: {self.path!r} is not empty and is not a ucm root "
                             f"(no {META}/ROOT marker; it holds e.g. {sorted(others)[0]!r}); ucm "
                             f"takes only an empty directory or one it made, so that it never "
                             f"deletes files it did not write")
        try:
            self.meta = _open_dir(META, self.fd, self.perms, f"{self.path}/{META}", create=True)
        except PermissionError as exc:
            raise ValueError(f"store.posix.roots: {self.path!r} is not writable ({exc.strerror})") from None

    def _check_marker(self) -> bool:
        """Check the root's marker, writing it if it is missing; True when it was written."""
        content = self._read_meta("ROOT", 64)
        if content is None:
            if self.read_only:
                raise ValueError(f"store.posix.roots: {self.path!r} is not a ucm root (no {META}/ROOT "
                                 f"marker)")
            self._write_marker()
            return True
        if content != MARKER:
            raise ValueError(f"store.posix.roots: {self.path}/{META}/ROOT is not a ucm marker "
                             f"({content[:20]!r})")
        return False

    def _write_marker(self) -> None:
        if any(_HEX2.match(e) for e in os.listdir(self.fd)):
            log.warning("ucm posix tier: %s holds blocks of an older ucm layout (%s/ab/...); they "
                        "are no longer read or counted and may be deleted", self.path, self.path)
        try:
            self._replace_meta("ROOT", MARKER, self.perms.file_mode)
        except PermissionError as exc:
            raise ValueError(f"store.posix.roots: {self.path!r} is not writable ({exc.strerror})") from None

    # -- metadata files: opened relative to .ucm, never through a link -------------------------
    def _open_meta(self, name: str, flags: int, mode: int = 0) -> int:
        try:
            return os.open(name, flags | os.O_NOFOLLOW | os.O_CLOEXEC, mode, dir_fd=self.meta)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise ValueError(f"store.posix.roots: {self.path}/{META}/{name} is a symbolic link; "
                                 f"ucm follows no link under a root") from None
            raise

    def _read_meta(self, name: str, limit: int) -> Optional[bytes]:
        """The first ``limit`` bytes of a metadata file (its owner checked), None if missing."""
        try:
            fd = self._open_meta(name, os.O_RDONLY)
        except FileNotFoundError:
            return None
        try:
            self.perms.check(fd, f"{self.path}/{META}/{name}", directory=False)
            return os.read(fd, limit)
        finally:
            os.close(fd)

    def _replace_meta(self, name: str, data: bytes, mode: int) -> None:
        """Write a metadata file atomically: a synced new file renamed over the old one."""
        tmp = f"{name}.{os.getpid()}.{uuid.uuid4().hex[:8]}"
        fd = self._open_meta(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
        try:
            self.perms.fix(fd, mode)
            os.write(fd, data)
            os.fsync(fd)
        except BaseException:
            os.close(fd)
            _unlink_in(self.meta, tmp)
            raise
        os.close(fd)
        os.rename(tmp, name, src_dir_fd=self.meta, dst_dir_fd=self.meta)
        os.fsync(self.meta)

    def _meta_file(self, name: str) -> int:
        what = f"{self.path}/{META}/{name}"
        fd = self._open_meta(name, os.O_RDWR | os.O_CREAT, self.perms.meta_mode)
        try:
            self.perms.check(fd, what, directory=False)
            if os.fstat(fd).st_uid == os.geteuid():
                self.perms.fix(fd, self.perms.meta_mode)
        except BaseException:
            os.close(fd)
            raise
        return fd

    # -- the namespace's generation (see KVStore.generation) -----------------------------------
    def read_generation(self, ns_hex: str) -> int:
        raw = self._read_meta(f"generation.{ns_hex}", 32)
        if raw is None:
            return 0
        if not raw.strip().isdigit():
            raise ValueError(f"store.posix.roots: {self.path}/{META}/generation.{ns_hex} does not "
                             f"hold a generation ({raw[:20]!r})")
        return int(raw)

    def write_generation(self, ns_hex: str, value: int) -> int:
        """Raise the stored generation to ``value`` (atomically); returns the one now stored."""
        if self.read_only:
            raise OSError(errno.EROFS, f"{self.path} is opened read-only (store.posix.read_only)")
        with self.locked():
            value = max(value, self.read_generation(ns_hex))
            self._replace_meta(f"generation.{ns_hex}", b"%d\n" % value, self.perms.meta_mode)
        return value

    def _open_writer(self) -> None:
        """This store's writer directory, its lock held (flock) until close."""
        name = f"{_HOST}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.writer = _open_dir(name, self.tmp, self.perms, f"{self.path}/{META}/tmp/{name}", create=True)
        self.writer_name = name
        self.writer_lock = os.open("lock", os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                                   self.perms.meta_mode, dir_fd=self.writer)
        self.perms.fix(self.writer_lock, self.perms.meta_mode)
        fcntl.flock(self.writer_lock, fcntl.LOCK_EX)

    def open_space(self, create: bool) -> Optional[int]:
        """The space's directory descriptor (None while a read-only store finds none: looked for
        again at most once a second)."""
        if self.space_fd is None and (create or time.monotonic() - self._space_probe > 1.0):
            self._space_probe = time.monotonic()
            fd = _open_dir(self.space, self.fd, self.perms, f"{self.path}/{self.space}", create=create)
            with self._tlock:
                if self.space_fd is None:
                    self.space_fd = fd
                elif fd is not None:
                    os.close(fd)
        return self.space_fd

    def close(self) -> None:
        if self.writer is not None:
            self._remove_writer_dir(self.writer, self.writer_name)
        _close(self.writer_lock, self.writer, self.space_fd, self.tmp, self.quarantine, self.usagefd,
               self.lockfd, self.meta, self.fd)
        self.fd = self.meta = self.lockfd = self.usagefd = self.quarantine = None
        self.tmp = self.writer = self.writer_lock = self.space_fd = None

    # -- lock and usage -------------------------------------------------------------------------
    class _Locked:
        def __init__(self, root):
            self.root = root

        def __enter__(self):
            self.root._tlock.acquire()
            fcntl.flock(self.root.lockfd, fcntl.LOCK_EX)
            return self.root

        def __exit__(self, *exc):
            fcntl.flock(self.root.lockfd, fcntl.LOCK_UN)
            self.root._tlock.release()

    def locked(self):
        return RootDir._Locked(self)

    def read_usage(self) -> Optional[int]:
        raw = os.pread(self.usagefd, 32, 0).split(b"\n")[0].strip()
        return int(raw) if raw.isdigit() else None

    def write_usage(self, value: int) -> None:
        os.pwrite(self.usagefd, b"%-30d\n" % value, 0)

    def usage_locked(self) -> int:
        usage = self.read_usage()
        return self.gc_locked(None) if usage is None else usage

    def add_usage(self, delta: int) -> None:
        with self.locked():
            self.write_usage(max(0, self.usage_locked() + delta))

    def reserve(self, n: int) -> int:
        """Count ``n`` temporary files that exist now; returns how many fit the budget (the
        leading ones), collecting garbage first when needed. The caller removes the rest."""
        fb = self.file_bytes
        with self.locked():
            usage = self.usage_locked()
            if usage + n * fb > self.budget:
                # the scan counts the n files already: evict down to a tenth below what they need
                target = max(0, min(self.budget, int(self.budget * 0.9) + n * fb))
                usage = self.gc_locked(target)
                fit = n - max(0, -(-(usage - self.budget) // fb))
                fit = max(0, min(n, fit))
                self.write_usage(usage - (n - fit) * fb)
                return fit
            self.write_usage(usage + n * fb)
            return n

    # -- scanning and collection ----------------------------------------------------------------
    def _subdirs(self, fd: int, pattern) -> list:
        out = []
        for e in os.scandir(fd):
            if pattern.match(e.name) and e.is_dir(follow_symlinks=False):
                out.append(e.name)
        return out

    def scan(self):
        """Published blocks of every space and quarantined files, as (mtime, size, dir path
        relative to the root, name); and temporaries as (size, dir path, name, writer)."""
        files, temps = [], []
        for space in self._subdirs(self.fd, _HEX32):
            sfd = _try_open_dir(space, self.fd)
            if sfd is None:
                continue
            try:
                for ab in self._subdirs(sfd, _HEX2):
                    afd = _try_open_dir(ab, sfd)
                    if afd is None:
                        continue
                    try:
                        rel = f"{space}/{ab}"
                        for e in os.scandir(afd):
                            temp = None if _BLOCK.match(e.name) else _TEMP.match(e.name)
                            if temp is None and not _BLOCK.match(e.name):
                                continue
                            st = _lstat(e)
                            if st is None or not stat.S_ISREG(st.st_mode):
                                continue
                            if temp is None:
                                files.append((st.st_mtime, st.st_size, rel, e.name))
                            else:
                                temps.append((st.st_size, rel, e.name, temp.group(1)))
                    finally:
                        os.close(afd)
            finally:
                os.close(sfd)
        for e in (os.scandir(self.quarantine) if self.quarantine is not None else ()):
            if _QUARANTINED.match(e.name):
                st = _lstat(e)
                if st is not None and stat.S_ISREG(st.st_mode):
                    files.append((st.st_mtime, st.st_size, f"{META}/quarantine", e.name))
        return files, temps

    def _writer_alive(self, name: str) -> bool:
        """Does the writer of this name hold its lock? (A writer makes its directory and takes
        the lock before it writes anything, and removes them only after its temporaries.)"""
        if name == self.writer_name:
            return True
        wfd = _try_open_dir(name, self.tmp)
        if wfd is None:
            return False
        try:
            try:
                lfd = os.open("lock", os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=wfd)
            except FileNotFoundError:  # died before taking its lock, or still starting
                return time.time() - os.fstat(wfd).st_mtime < _ORPHAN_WRITER_S
            except OSError:
                return True  # cannot tell: keep its files
            try:
                fcntl.flock(lfd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return False
            except OSError:  # held
                return True
            finally:
                os.close(lfd)
        finally:
            os.close(wfd)

    def _dead_writers(self) -> list:
        return [n for n in self._subdirs(self.tmp, _WRITER) if not self._writer_alive(n)]

    def _remove_writer_dir(self, wfd: Optional[int], name: str) -> None:
        """Delete a writer directory (its lock) once its temporaries are gone."""
        own = wfd is None
        if own:
            wfd = _try_open_dir(name, self.tmp)
            if wfd is None:
                return
        try:
            try:
                os.unlink("lock", dir_fd=wfd)
            except OSError:
                pass
        finally:
            if own:
                os.close(wfd)
        try:
            os.rmdir(name, dir_fd=self.tmp)
        except OSError:
            pass

    def gc_locked(self, target: Optional[int]) -> int:
        """Reap dead writers, rescan (exact usage), drop quarantined files older than the stale
        age and evict least recently used blocks until usage <= target (None: no eviction).
        Returns the usage; caller holds the lock."""
        dead_dirs = self._dead_writers()
        files, temps = self.scan()
        alive = {}
        dead_temps = []
        for t in temps:
            if t[3] not in alive:
                alive[t[3]] = self._writer_alive(t[3])
            if not alive[t[3]]:
                dead_temps.append(t)
        now = time.time()
        usage = sum(t[0] for t in temps) + sum(size for _, size, _, _ in files)
        for size, rel, name, _ in dead_temps:  # a dead writer's: never published
            dfd = self.dir_beneath(rel)
            if dfd is not None:
                try:
                    os.unlink(name, dir_fd=dfd)
                    usage -= size
                except OSError:
                    pass
                finally:
                    os.close(dfd)
        for name in dead_dirs:
            self._remove_writer_dir(None, name)
        files.sort()
        victims = [f for f in files if f[2].startswith(META) and now - f[0] > self.stale_s]
        if target is not None and usage > target:
            chosen = {id(f) for f in victims}
            need = usage - target - sum(f[1] for f in victims)
            for f in files:
                if need <= 0:
                    break
                if id(f) not in chosen:
                    victims.append(f)
                    chosen.add(id(f))
                    need -= f[1]
        evicted = 0
        by_dir: dict[str, list] = {}
        for f in victims:
            by_dir.setdefault(f[2], []).append(f)
        for rel, group in by_dir.items():
            dfd = self.dir_beneath(rel)
            if dfd is None:
                continue
            try:
                for _, size, _, name in group:
                    try:
                        os.unlink(name, dir_fd=dfd)
                    except OSError:
                        continue
                    usage -= size
                    evicted += not rel.startswith(META)
            finally:
                os.close(dfd)
        if evicted:
            self._stats.add(evictions=evicted)
        self.write_usage(max(0, usage))
        return usage

    def dir_beneath(self, rel: str) -> Optional[int]:
        fds, _ = open_beneath(self.fd, [rel], os.O_PATH | os.O_DIRECTORY, keep_open=True)
        return int(fds[0]) if fds[0] > 0 else None

    # -- publish and quarantine -----------------------------------------------------------------
    def leaves(self, keys, create: bool) -> dict:
        """Descriptors of the fan-out directories ``<space>/ab`` of these keys (``ab``), created
        when asked: ``{key: fd or -errno}`` (the caller closes them). One batched open, and a
        second after making the missing ones."""
        keys = sorted(set(keys))
        sfd = self.open_space(create=create)
        if sfd is None:
            return {k: -errno.ENOENT for k in keys}
        flags = os.O_RDONLY | os.O_DIRECTORY
        fds, _ = open_beneath(sfd, keys, flags)
        out = dict(zip(keys, fds.tolist()))
        missing = [k for k in keys if out[k] == -errno.ENOENT]
        if not create or not missing:
            return out
        why = {k: self._mkdir(k, sfd) for k in missing}
        fds, _ = open_beneath(sfd, missing, flags)
        for key, fd in zip(missing, fds.tolist()):
            # a directory that could not be made: say why (EACCES, ENOSPC...), not ENOENT
            out[key] = fd if fd != -errno.ENOENT else -(why[key] or errno.ENOENT)
        return out

    def _mkdir(self, name: str, dir_fd: int) -> int:
        """Make a directory; 0, or the errno that stopped it (an existing one is fine)."""
        try:
            os.mkdir(name, self.perms.dir_mode, dir_fd=dir_fd)
        except FileExistsError:
            return 0
        except OSError as exc:
            return exc.errno or errno.EIO
        if self.perms.gid is not None:
            fd = _try_open_dir(name, dir_fd)
            if fd is not None:
                try:
                    self.perms.fix(fd, self.perms.dir_mode)
                finally:
                    os.close(fd)
        return 0

    def publish(self, items: list) -> list[Optional[str]]:
        """Rename each ``(temp name, hex id)`` into place (same directory); returns an error
        text (or None) per item. The bytes were counted when the temporaries were made."""
        out: list[Optional[str]] = []
        leaves: dict[tuple, int] = {}
        dropped = 0
        try:
            with self.locked():
                leaves = self.leaves([h[:2] for _, h in items], create=True)
                for tmp, hexid in items:
                    lfd = leaves[hexid[:2]]
                    final = hexid + SUFFIX
                    if lfd < 0:
                        err = f"cannot create the block's directory: {_err(lfd)}"
                    else:
                        try:
                            os.stat(final, dir_fd=lfd, follow_symlinks=False)
                            err = "present"  # published meanwhile by another writer
                        except FileNotFoundError:
                            try:
                                os.rename(tmp, final, src_dir_fd=lfd, dst_dir_fd=lfd)
                                err = None
                            except OSError as exc:
                                err = f"publish failed: {_err(exc.errno or errno.EIO)}"
                        except OSError as exc:
                            err = f"publish failed: {_err(exc.errno or errno.EIO)}"
                    if err is not None and lfd >= 0:
                        try:
                            os.unlink(tmp, dir_fd=lfd)
                            dropped += 1
                        except OSError:
                            pass
                    out.append(None if err == "present" else err)
                if dropped:
                    self.write_usage(max(0, self.usage_locked() - dropped * self.file_bytes))
        finally:
            for fd in leaves.values():
                _close(fd)
        return out

    def remove_temps(self, names: list) -> int:
        """Unlink temporaries ``(hex id, temp name)`` of this store; returns how many went."""
        gone = 0
        leaves = self.leaves([h[:2] for h, _ in names], create=False)
        try:
            for hexid, tmp in names:
                lfd = leaves[hexid[:2]]
                if lfd >= 0 and _unlink_in(lfd, tmp):
                    gone += 1
        finally:
            for fd in leaves.values():
                _close(fd)
        return gone

    def quarantine_block(self, hexid: str) -> None:
        if self.read_only:
            return
        lfd = self.leaves([hexid[:2]], create=False).popitem()[1]
        if lfd < 0:
            return
        dest = f"{hexid}{SUFFIX}.{os.getpid()}.{time.time():.0f}"
        try:
            with self.locked():
                os.rename(hexid + SUFFIX, dest, src_dir_fd=lfd, dst_dir_fd=self.quarantine)
        except OSError:
            return  # already gone (evicted or quarantined by someone else)
        finally:
            os.close(lfd)
        self._stats.add(quarantined=1)


def _try_open_dir(name: str, dir_fd: int) -> Optional[int]:
    try:
        return os.open(name, _DIR_FLAGS, dir_fd=dir_fd)
    except OSError:
        return None


def _lstat(entry):
    try:
        return entry.stat(follow_symlinks=False)
    except OSError:
        return None


def _unlink_in(dir_fd: Optional[int], name: str) -> bool:
    if dir_fd is None:
        return False
    try:
        os.unlink(name, dir_fd=dir_fd)
        return True
    except FileNotFoundError:
        return False
