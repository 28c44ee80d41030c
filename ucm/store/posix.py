"""``posix`` tier: one file per block under one or more root directories (local disk, NFS, any
shared mount), safe for several processes and nodes sharing the directories, and for roots that
other local users can reach.

Layout of a root (``docs/posix-tier.md`` has the full rules)::

    <root>/.ucm/ROOT                      marker: this directory belongs to ucm
    <root>/.ucm/lock                      flock serialising budget accounting, publish and GC
    <root>/.ucm/usage                     bytes of every ucm file in the root (blocks, temporaries)
    <root>/.ucm/quarantine/               blocks that failed their own checksums, moved aside
    <root>/.ucm/tmp/<host>-<pid>-<r>/lock one per open store that writes, flock-held while open
    <root>/<space>/ab/<32 hex>.blk        published blocks of one space (ab: the id's first two
                                          hex digits; 256 directories, made once): <space> is the
                                          digest of namespace, geometry, codec and format version
    <root>/<space>/ab/<32 hex>.blk.tmp.<writer>.<n>   a block being written by that writer

Ownership: a root is ucm's only once it carries the marker. A store initialises only an empty
directory and refuses a non-empty unmarked one (a home directory, say), so garbage collection
only ever deletes names ucm writes (32-hex ``.blk`` files under a space, its own temporaries and
quarantine). Files are private (0600 / directories 0700) unless ``group`` names the group that
shares the root (then 0640 / 0660 and setgid 2770 directories owned by that group).

Links: nothing under a root is reached through a symbolic link. The root's metadata is opened
with ``O_NOFOLLOW`` relative to the root's descriptor and must belong to this user (or, shared,
to the group); block files are opened with :func:`ucm.ops.open_beneath` (openat2,
``RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS``) relative to the space's descriptor; renames, unlinks
and directory creation go through directory descriptors obtained the same way.

Budget: ``usage`` counts published blocks, temporary files and quarantined files. A dump creates
its temporary files first, then reserves their bytes under the lock (collecting garbage when the
budget is full); what does not fit fails the dump. A batch larger than the budget keeps its
leading blocks (a prefix is only useful from its start). Every writer holds an flock on its own
``.ucm/tmp/<writer>/lock`` while it is open and names its temporaries after itself, so any store
that takes the root's lock can tell a dead writer (lock free, or no directory) and removes its
temporaries and directory: at open (when a dead writer's directory is there) and at every
collection. Disk use never exceeds the budget by more than the batches being reserved.

Write path: payload into a temporary file beside the block's final name (preallocated) with the native engine's
threads, one checksum per shard; ``commit(True)`` writes the header (docs/block-format.md),
optionally ``fsync``s and publishes with an atomic rename. Read path: open beneath the space,
size and header checks, ``pread`` of the requested shards on native threads, per-shard checksums.
A header of another namespace, id, codec or geometry (valid in itself) is a miss, never touched;
a block failing its own checksums or size is quarantined. A successful load refreshes the
file's mtime: collection evicts by least recent use. ``read_only`` stores write nothing at all:
no lock, no quarantine, no mtime refresh.

Ages: a call's blocks arrive in chain order (a request's prefix, head first), and a chain must
age from its tip, or collection removes its head and leaves the rest unreachable. So the
mtimes a publish or a load sets step back by :data:`AGE_STEP_NS` along the call's order (the
head the most recent). And the blocks a publish makes go just below the blocks loaded since the
previous publish (within :data:`READ_FLOOR_WINDOW_NS`): a request loads its prefix, then stores
the blocks after it, which must not outlive that prefix (the memory tier keeps the same rule).
"""
from __future__ import annotations

import errno
import logging
import os
import threading
import time
from typing import Optional, Sequence

import numpy as np

from ucm import threads
from ucm.config import check_count, check_flag, check_seconds
from ucm.ops import alloc_aligned, io_batch, new_io_ops, open_beneath
from ucm.store import format as fmt
from ucm.store.base import BlockBuffers, BlockGeometry, KVStore, Task, subset_buffers as _subset
from ucm.store.posix_root import (SUFFIX, Perms, RootDir, _close, _err, _unlink_in,  # noqa: F401
                                  space_name)

log = logging.getLogger("ucm.store.posix")

#: mtime step between consecutive blocks of one publish or load (1 us: a float st_mtime keeps it)
AGE_STEP_NS = 1000
#: a publish goes below the blocks loaded at most this long before it: a request loads its
#: prefix and stores the blocks after it within one prefill; older loads are other requests',
#: and new blocks placed below them would start out older than an hour of hits
READ_FLOOR_WINDOW_NS = 60 * 10**9


def _set_age(fd: int, ns: int) -> None:
    """Set the mtime (and atime) of ``fd`` to ``ns``; where explicit times are not allowed (a
    file of another owner on a shared file system), the current time, as before."""
    try:
        os.utime(fd, ns=(ns, ns))
    except PermissionError:
        try:
            os.utime(fd)
        except OSError:
            pass
    except OSError:
        pass

class _Pending:
    __slots__ = ("root", "hexid", "key", "tmp", "fd", "fd_direct", "checksums", "shards", "claimed",
                 "inflight", "failed", "discard", "publish")

    def __init__(self, root: RootDir, hexid: str, tmp: str, fd: int, fd_direct, n_shards: int):
        self.root, self.hexid, self.tmp, self.fd, self.fd_direct = root, hexid, tmp, fd, fd_direct
        self.checksums = np.zeros(n_shards, dtype=np.uint64)
        self.shards = np.zeros(n_shards, dtype=bool)   # written
        self.claimed = 0  # bit k: shard k is written or being written (one writer per shard)
        self.inflight = 0
        self.failed: Optional[str] = None
        self.discard = False
        self.publish = False  # committed while a dump of it was in flight: publish when it lands
        self.key = bytes.fromhex(hexid)

    def close(self) -> None:
        _close(self.fd, self.fd_direct)
        self.fd = self.fd_direct = None


class PosixStore(KVStore):
    name = "posix"

    def __init__(self, geometry: BlockGeometry, roots: Sequence[str], namespace: bytes = bytes(16),
                 capacity_bytes: int = 64 << 30, o_direct: bool = False, fsync: bool = False,
                 io_threads: int = 4, wait_timeout_s: float = 30.0, stale_tmp_s: float = 600.0,
                 codec: int = 0, read_only: bool = False, group: Optional[str] = None):
        super().__init__(geometry, check_seconds(wait_timeout_s, "store.wait_timeout_s"), namespace)
        if isinstance(roots, (str, os.PathLike)):
            roots = [roots]
        if isinstance(roots, (bytes, bytearray)) or not hasattr(roots, "__iter__"):
            raise ValueError(f"store.posix.roots: expected a list of directory paths, got {roots!r}")
        roots = list(roots)
        for r in roots:
            if not isinstance(r, (str, os.PathLike)) or not isinstance(os.fspath(r), str) \
                    or not os.fspath(r).strip():
                raise ValueError(f"store.posix.roots: {r!r} is not a directory path (an empty path "
                                 f"would silently mean the working directory)")
            if "\0" in os.fspath(r):
                raise ValueError(f"store.posix.roots: {r!r} is not a directory path (it holds a NUL "
                                 f"character)")
        o_direct = check_flag(o_direct, "store.posix.o_direct")
        fsync = check_flag(fsync, "store.posix.fsync")
        read_only = check_flag(read_only, "store.posix.read_only")
        io_threads = check_count(io_threads, "store.io_threads")
        roots = [os.path.realpath(os.path.expanduser(os.fspath(r))) for r in roots]
        if not roots:
            raise ValueError("store.posix.roots: at least one directory is required")
        if len(set(roots)) != len(roots):
            dup = sorted(r for r in set(roots) if roots.count(r) > 1)
            raise ValueError(f"store.posix.roots: {dup[0]!r} is listed twice")
        if isinstance(capacity_bytes, bool) or not isinstance(capacity_bytes, (int, np.integer)) \
                or capacity_bytes < 0:
            raise ValueError(f"cache_capacity must be a size in bytes >= 0, got {capacity_bytes!r}")
        self.codec = int(codec)
        self.read_only = bool(read_only)
        self.o_direct, self.fsync = bool(o_direct), bool(fsync)
        self.io_threads = max(1, int(io_threads))
        self.header_bytes = fmt.header_size(geometry.n_shards)
        self.file_bytes = self.header_bytes + geometry.block_bytes
        per_root = int(capacity_bytes) // len(roots)
        if per_root < self.file_bytes and not self.read_only:
            raise ValueError(f"cache_capacity ({capacity_bytes} bytes over {len(roots)} roots) is "
                             f"smaller than one block file ({self.file_bytes} bytes)")
        self.perms = Perms(group, self.read_only)
        self.space = space_name(self.namespace, geometry, self.codec)
        self.roots: list[RootDir] = []
        try:
            for r in roots:
                self.roots.append(RootDir(r, per_root, self.file_bytes, self.space, self.perms,
                                        self.read_only, stale_tmp_s, self._stats))
        except BaseException:
            for r in self.roots:
                r.close()
            raise
        self._pending: dict[bytes, _Pending] = {}
        self._lock = threading.Lock()
        #: oldest mtime a load gave since the last publish (None: no load since)
        self._read_floor_ns: Optional[int] = None
        self._seq = 0
        self._exec = threads.pool(self.io_threads, "ucm-posix")
        self._bounce_free: list = []  # pinned host buffers for CUDA rows, reused

    # -- paths ----------------------------------------------------------------------------------
    @staticmethod
    def _hex(block_id: np.ndarray) -> str:
        return block_id.astype("<u8").tobytes().hex()

    def _root_of(self, block_id: np.ndarray) -> RootDir:
        return self.roots[int(block_id[1]) % len(self.roots)]

    @staticmethod
    def _rel(hexid: str) -> str:
        return f"{hexid[:2]}/{hexid}{SUFFIX}"

    @staticmethod
    def _rel_rows(ids: np.ndarray) -> np.ndarray:
        """``ab/<32 hex>.blk`` of every id as NUL-terminated ``uint8 [n, 40]`` rows (built with
        array operations: lookups of thousands of ids are the scheduler's hot path)."""
        hexes = np.frombuffer(ids.astype("<u8").tobytes().hex().encode(), dtype=np.uint8).reshape(-1, 32)
        rows = np.zeros((len(ids), 40), dtype=np.uint8)
        rows[:, 0:2] = hexes[:, 0:2]
        rows[:, 2] = ord("/")
        rows[:, 3:35] = hexes
        rows[:, 35:39] = np.frombuffer(SUFFIX.encode(), dtype=np.uint8)
        return rows

    def path_of(self, block_id) -> str:
        """File of one block id (16 bytes or ``uint64[2]``)."""
        from ucm.ids import as_ids

        one = [bytes(block_id)] if isinstance(block_id, (bytes, bytearray)) else \
            np.asarray(block_id).reshape(1, 2)
        bid = as_ids(one)[0]
        return os.path.join(self._root_of(bid).path, self.space, self._rel(self._hex(bid)))

    def _probe(self, ids: np.ndarray) -> np.ndarray:
        """Is each block published here (a regular file of the right size, reached without a
        link)? One native call per root."""
        fds, sizes = self._open_blocks(ids, os.O_PATH, keep_open=False)
        return (fds == 0) & (sizes == self.file_bytes)

    # -- API ------------------------------------------------------------------------------------
    def lookup(self, block_ids) -> list[bool]:
        from ucm.ids import as_ids

        ids = as_ids(block_ids, "block_ids")
        found = self._probe(ids)
        hits = int(found.sum())
        self._stats.add(lookups=len(ids), hits=hits, misses=len(ids) - hits)
        return found.tolist()

    PREFIX_STEP = 64  # ids probed per call while extending a leading run

    def lookup_prefix(self, block_ids) -> int:
        from ucm.ids import as_ids

        ids = as_ids(block_ids, "block_ids")
        n = 0
        while n < len(ids):
            found = self._probe(ids[n:n + self.PREFIX_STEP])
            run = len(found) if found.all() else int(np.argmin(found))
            n += run
            if run < len(found):
                break
        self._stats.add(lookups=min(n + 1, len(ids)), hits=n, misses=int(n < len(ids)))
        return n

    def close(self) -> None:
        if self._closed:
            return
        super().close()
        self._exec.shutdown(wait=True)
        with self._lock:
            pending, self._pending = list(self._pending.values()), {}
        self._drop_counted(pending)  # never published: remove
        if self._bounce_free:
            import torch

            for arr, _ in self._bounce_free:
                torch.cuda.cudart().cudaHostUnregister(arr.ctypes.data)
            self._bounce_free = []
        for r in self.roots:
            r.close()

    def generation(self) -> int:
        """Persisted in each root's metadata (``.ucm/generation.<namespace hex>``), so every
        engine that opens the root later sees it; the highest of the roots counts."""
        stored = max(r.read_generation(self.namespace.hex()) for r in self.roots)
        self._generation = max(self._generation, stored)
        return self._generation

    def set_generation(self, value: int) -> int:
        target = max(super().set_generation(value), self.generation())
        for r in self.roots:
            r.write_generation(self.namespace.hex(), target)
        self._generation = target
        return target

    def gc(self, target_bytes: Optional[int] = None) -> int:
        """Collect dead writers' temporaries and old quarantined files and, with a target, evict
        down to it (split over the roots). Returns the bytes in use after collection."""
        self._writable("gc")
        total = 0
        for r in self.roots:
            with r.locked():
                total += r.gc_locked(target_bytes if target_bytes is None else target_bytes // len(self.roots))
        return total

    def usage(self) -> int:
        """Bytes of ucm files in the roots (published, being written, quarantined)."""
        self._writable("usage")
        total = 0
        for r in self.roots:
            with r.locked():
                total += r.usage_locked()
        return total

    def _writable(self, what: str) -> None:
        if self.read_only:
            raise ValueError(f"posix tier: {what}() needs a writable store (store.posix.read_only is set)")

    # -- dump -----------------------------------------------------------------------------------
    CHUNK = 32  # blocks per worker job: Python preparation of one overlaps I/O of another

    def _submit(self, kind: str, fn, ids, bufs: BlockBuffers, shards: range) -> Task:
        task = Task(kind, ids)
        task.t_ns = time.time_ns()   # one clock for the ages of all parts (a load's, see Ages)
        for start in range(0, len(ids), self.CHUNK):
            rows = np.arange(start, min(start + self.CHUNK, len(ids)))
            task.add_part()
            self._exec.submit(self._guard, task, fn, task, ids[rows], _subset(bufs, rows), shards, start)
        return task.seal()

    def _dump(self, ids, offset, bufs: BlockBuffers, shards: range) -> Task:
        if self.read_only:
            task = Task("dump", ids)
            task.add_part()
            task.finish_part([], {i: "read-only store" for i in range(len(ids))})
            return task.seal()
        return self._submit("dump", self._run_dump, ids, bufs, shards)

    def _guard(self, task: Task, fn, task_, ids, bufs, shards, base) -> None:
        """Run a worker; an unexpected exception fails its part instead of hanging the task."""
        try:
            fn(task_, ids, bufs, shards, base)
        except Exception as exc:  # pragma: no cover - defensive
            log.exception("ucm posix tier: %s task failed", task.kind)
            task.finish_part([], {base + i: f"internal error: {exc!r}" for i in range(len(ids))})

    def _new_temp(self, root: RootDir, hexid: str, lfd: int) -> _Pending:
        """A preallocated temporary file beside the block's final name (``lfd``: its fan-out
        directory), named after this store's writer so that collection can tell whose it is."""
        if lfd < 0:
            raise OSError(-lfd, os.strerror(-lfd))
        with self._lock:
            self._seq += 1
            tmp = f"{hexid}{SUFFIX}.tmp.{root.writer_name}.{self._seq}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                     self.perms.file_mode, dir_fd=lfd)
        try:
            self.perms.fix(fd, self.perms.file_mode)
            os.posix_fallocate(fd, 0, self.file_bytes)  # a full disk fails here, up front
            fd_direct = os.open(tmp, os.O_WRONLY | os.O_DIRECT | os.O_NOFOLLOW | os.O_CLOEXEC,
                                dir_fd=lfd) if self.o_direct else None
        except BaseException:
            os.close(fd)
            _unlink_in(lfd, tmp)
            raise
        return _Pending(root, hexid, tmp, fd, fd_direct, self.geometry.n_shards)

    def _host_rows(self, bufs: BlockBuffers, nbytes: int, to_device: bool = False):
        """Host addresses for the rows; CUDA buffers go through a pinned bounce buffer taken
        from a pool allocated once (returned by :meth:`_give_back`)."""
        if not bufs.is_cuda:
            return bufs.addrs, None
        bounce = self._take_bounce()
        n = len(bufs.rows)
        host = bounce[1][:n * nbytes].view(n, nbytes)
        if not to_device:
            for i, row in enumerate(bufs.rows):
                host[i].copy_(row, non_blocking=True)
            import torch

            torch.cuda.current_stream(bufs.rows[0].device).synchronize()
        addrs = np.uint64(bounce[0].ctypes.data) + np.arange(n, dtype=np.uint64) * np.uint64(nbytes)
        return addrs, (bounce, host)

    def _take_bounce(self):
        with self._lock:
            if self._bounce_free:
                return self._bounce_free.pop()
        import torch

        arr = alloc_aligned(self.CHUNK * self.geometry.block_bytes)
        if torch.cuda.cudart().cudaHostRegister(arr.ctypes.data, arr.nbytes, 0) != 0:
            log.warning("ucm posix tier: could not pin a bounce buffer; GPU copies will be slower")
        return arr, torch.from_numpy(arr)

    def _give_back(self, bounce) -> None:
        if bounce is not None:
            with self._lock:
                self._bounce_free.append(bounce)

    def _block_ops(self, targets: list, shards: range, write: bool):
        """One I/O op per block covering ``shards`` (one checksum per shard into ``sums``).
        ``targets``: (fd, fd_direct or None, buffer address) per block."""
        sb = self.geometry.shard_bytes
        nbytes = len(shards) * sb
        off = self.header_bytes + shards.start * sb
        ops = new_io_ops(len(targets))
        sums = np.zeros((len(targets), len(shards)), dtype=np.uint64)
        base = np.uint64(sums.ctypes.data)
        for n, (fd, fd_direct, addr) in enumerate(targets):
            use = fd_direct if fd_direct is not None and self._direct_ok(addr, nbytes, off) else fd
            ops[n] = (use, int(write), addr, nbytes, off, shards.start * sb // 8, sb,
                      int(base) + n * 8 * len(shards), 0, 0)
        return ops, sums

    def _direct_ok(self, addr, length, file_off) -> bool:
        return self.o_direct and addr % 4096 == 0 and length % 4096 == 0 and file_off % 4096 == 0

    def _run_dump(self, task: Task, ids, bufs: BlockBuffers, shards: range, base: int) -> None:
        t0 = time.perf_counter()
        sb = self.geometry.shard_bytes
        nbytes = len(shards) * sb
        mask = ((1 << len(shards)) - 1) << shards.start
        present = self._probe(ids)
        skipped, errors, plan = [], {}, []  # plan: (row, pending)
        fresh: dict[bytes, list] = {}       # key -> rows needing a new temporary file
        with self._lock:
            for i in range(len(ids)):
                if present[i]:
                    skipped.append(i)
                    continue
                key = ids[i].tobytes()
                p = self._pending.get(key)
                if p is None:
                    fresh.setdefault(key, []).append(i)
                elif p.claimed & mask == mask:
                    skipped.append(i)  # these shards are written by an earlier row or task
                else:
                    p.claimed |= mask
                    p.inflight += 1
                    plan.append((i, p))
        made: dict[int, list] = {}  # root -> [(key, rows, pending)]
        by_root: dict[int, list] = {}
        for key, rows in fresh.items():
            bid = ids[rows[0]]
            by_root.setdefault(id(self._root_of(bid)), []).append((key, rows, self._hex(bid)))
        for items in by_root.values():
            root = self._root_of(ids[items[0][1][0]])
            leaves = root.leaves([h[:2] for _, _, h in items], create=True)
            try:
                for key, rows, hexid in items:
                    try:
                        p = self._new_temp(root, hexid, leaves[hexid[:2]])
                    except OSError as exc:
                        for i in rows:
                            errors[i] = f"cannot create block file: {_err(exc.errno or errno.EIO)}"
                        continue
                    made.setdefault(id(root), []).append((key, rows, p))
            finally:
                for fd in leaves.values():
                    _close(fd)
        for group in made.values():
            root = group[0][2].root
            fit = root.reserve(len(group))
            for key, rows, p in group[fit:]:
                for i in rows:
                    errors[i] = "byte budget full: blocks being written fill it"
            self._remove_temps([p for _, _, p in group[fit:]])
            raced = []
            with self._lock:
                for key, rows, p in group[:fit]:
                    other = self._pending.setdefault(key, p)
                    if other is not p:  # another task of this process got there first
                        raced.append(p)
                    for n, i in enumerate(rows):
                        if n == 0 and not other.claimed & mask == mask:
                            other.claimed |= mask
                            other.inflight += 1
                            plan.append((i, other))
                        else:
                            skipped.append(i)
            self._drop_counted(raced)
        addrs, bounce = self._host_rows(bufs, nbytes)
        ops, sums = self._block_ops(
            [(p.fd, p.fd_direct, int(addrs[i])) for i, p in plan], shards, write=True)
        if len(ops):
            io_batch(ops, self.io_threads, want_checksum=True)
        ok = list(skipped)
        dropped, late = [], []
        with self._lock:
            for n, (i, p) in enumerate(plan):
                if ops["result"][n] < 0:
                    p.failed = f"write failed: {_err(ops['result'][n])}"
                    errors[i] = p.failed
                else:
                    p.checksums[shards.start:shards.stop] = sums[n]
                    p.shards[shards.start:shards.stop] = True
                    ok.append(i)
                p.inflight -= 1
                if p.inflight == 0 and p.publish:
                    if self._pending.get(p.key) is p:
                        del self._pending[p.key]
                        (late if not p.failed and p.shards.all() else dropped).append(p)
                elif p.discard and p.inflight == 0:
                    dropped.append(p)
        self._publish(late, dropped)
        self._give_back(None if bounce is None else bounce[0])
        written = (len(ok) - len(skipped)) * nbytes
        self._stats.add(dump_blocks=len(ok) - len(skipped), dump_bytes=written,
                        dump_seconds=time.perf_counter() - t0, dump_failures=len(errors),
                        dump_skipped=len(skipped))
        task.finish_part(np.asarray(ok, dtype=np.int64) + base, {base + i: e for i, e in errors.items()},
                         written)

    @staticmethod
    def _remove_temps(plist: list) -> dict:
        """Close and unlink temporaries; ``{root id: [root, how many went]}``."""
        per_root: dict[int, list] = {}
        for p in plist:
            p.close()
            per_root.setdefault(id(p.root), [p.root, []])[1].append((p.hexid, p.tmp))
        return {k: [root, root.remove_temps(names)] for k, (root, names) in per_root.items()}

    def _drop_counted(self, plist: list) -> None:
        """Remove temporaries that were counted in their root's usage, and uncount them."""
        for root, n in self._remove_temps(plist).values():
            if n:
                root.add_usage(-n * self.file_bytes)

    def commit(self, block_ids, success_flags) -> None:
        ids, flags = self._flags(block_ids, success_flags)
        ready: list[_Pending] = []
        discard: list[_Pending] = []
        with self._lock:
            for i in range(len(ids)):
                p = self._pending.get(ids[i].tobytes())
                if p is not None and flags[i] and p.inflight and not p.failed:
                    # another writer's dump of these bytes (this caller's own dump found them
                    # claimed) is still landing: publish when it does, not discard
                    p.publish = True
                    continue
                p = self._pending.pop(ids[i].tobytes(), None)
                if p is None:
                    continue
                if flags[i] and p.inflight == 0 and not p.failed and p.shards.all():
                    ready.append(p)
                    continue
                if flags[i]:
                    log.warning("ucm posix tier: block %s not published (%s)", p.hexid,
                                "dump in flight" if p.inflight else p.failed or "shards missing")
                self._stats.add(discards=1)
                if p.inflight:
                    p.discard = True
                else:
                    discard.append(p)
        self._publish(ready, discard)

    def _publish(self, ready: list, discard: list) -> None:
        """Write the headers of complete blocks and rename them into place; remove the
        temporaries of ``discard``."""
        by_root: dict[int, list] = {}
        floor = None
        if ready:
            with self._lock:
                floor, self._read_floor_ns = self._read_floor_ns, None
        now = time.time_ns()
        recent = floor is not None and now - floor < READ_FLOOR_WINDOW_NS
        base = min(now, floor - AGE_STEP_NS) if recent else now
        for rank, p in enumerate(ready):
            try:
                header = fmt.Header(self.namespace, bytes.fromhex(p.hexid), self.codec,
                                    self.geometry.block_bytes, self.geometry.shard_bytes,
                                    p.checksums).pack()
                os.pwrite(p.fd, header.tobytes(), 0)
                _set_age(p.fd, base - rank * AGE_STEP_NS)     # the call's first block newest
                if self.fsync:
                    os.fsync(p.fd)
            except OSError as exc:
                log.warning("ucm posix tier: header write failed for %s: %s", p.hexid, exc)
                discard.append(p)
                self._stats.add(discards=1)
                continue
            p.close()
            by_root.setdefault(id(p.root), []).append(p)
        self._drop_counted(discard)
        for plist in by_root.values():
            root = plist[0].root
            results = root.publish([(p.tmp, p.hexid) for p in plist])
            for p, err in zip(plist, results):
                if err:
                    log.warning("ucm posix tier: %s not published: %s", p.hexid, err)
                    self._stats.add(discards=1)
                else:
                    self._stats.add(commits=1)
            if self.fsync:
                for lfd in root.leaves([p.hexid[:2] for p in plist], create=False).values():
                    if lfd >= 0:
                        try:
                            os.fsync(lfd)
                        except OSError:
                            pass
                        finally:
                            os.close(lfd)

    # -- load -----------------------------------------------------------------------------------
    def _load(self, ids, offset, bufs: BlockBuffers, shards: range) -> Task:
        return self._submit("load", self._run_load, ids, bufs, shards)

    def _open_blocks(self, ids, flags, keep_open: bool = True):
        """Open each block beneath its root's space: (fds, sizes) int64 arrays (-errno; 0 for
        a probe that was closed again)."""
        fds = np.full(len(ids), -errno.ENOENT, dtype=np.int64)
        sizes = np.full(len(ids), -1, dtype=np.int64)
        owner = ids[:, 1] % np.uint64(len(self.roots))
        for k, root in enumerate(self.roots):
            rows = np.flatnonzero(owner == k)
            if not len(rows):
                continue
            sfd = root.open_space(create=False)
            if sfd is None:
                continue
            f, s = open_beneath(sfd, self._rel_rows(ids[rows]), flags, keep_open=keep_open, want_sizes=True)
            fds[rows], sizes[rows] = f, s
        return fds, sizes

    def _run_load(self, task: Task, ids, bufs: BlockBuffers, shards: range, base: int) -> None:
        t0 = time.perf_counter()
        sb = self.geometry.shard_bytes
        nbytes = len(shards) * sb
        addrs, bounce = self._host_rows(bufs, nbytes, to_device=True)
        errors: dict = {}
        fds, sizes = self._open_blocks(ids, os.O_RDONLY)
        candidates = []  # (row, fd)
        for i in range(len(ids)):
            fd = int(fds[i])
            if fd == -errno.ENOENT:
                errors[i] = "miss"
            elif fd < 0:
                errors[i] = f"cannot open: {_err(fd)}"
            elif sizes[i] < self.header_bytes:
                os.close(fd)
                errors[i] = f"corrupt block: file is {sizes[i]} bytes, expected {self.file_bytes}"
                self._root_of(ids[i]).quarantine_block(self._hex(ids[i]))
            else:
                candidates.append((i, fd))
        direct = {}
        if self.o_direct and candidates:
            dfds, _ = self._open_blocks(ids[[i for i, _ in candidates]], os.O_RDONLY | os.O_DIRECT)
            direct = {i: int(d) for (i, _), d in zip(candidates, dfds) if d > 0}
        # every header in one parallel batch (a cold header read is a disk round trip each)
        hsz = self.header_bytes
        headers = alloc_aligned(max(1, len(candidates)) * hsz)
        hops = new_io_ops(len(candidates))
        for n, (i, fd) in enumerate(candidates):
            hops[n] = (direct.get(i, fd), 0, headers.ctypes.data + n * hsz, hsz, 0, 0, 0, 0, 0, 0)
        if len(hops):
            io_batch(hops, self.io_threads, want_checksum=False)
        opened = []  # (row, fd, fd_direct, header)
        for n, (i, fd) in enumerate(candidates):
            fdd = direct.get(i)
            problem = None
            if hops["result"][n] < 0:  # an I/O error is not corruption: no quarantine
                problem = (f"read failed: {_err(hops['result'][n])}", False)
            else:
                try:
                    header = fmt.parse(headers[n * hsz:(n + 1) * hsz], self.namespace, ids[i].tobytes(),
                                       self.geometry.block_bytes, sb, self.codec)
                    if sizes[i] != self.file_bytes:
                        raise fmt.BadBlock(f"file is {sizes[i]} bytes, expected {self.file_bytes}")
                except fmt.BadBlock as exc:
                    problem = (f"foreign block: {exc}" if exc.foreign else f"corrupt block: {exc}",
                               not exc.foreign)
            if problem is not None:
                _close(fd, fdd)
                errors[i] = problem[0]
                if problem[1]:
                    self._root_of(ids[i]).quarantine_block(self._hex(ids[i]))
                continue
            opened.append((i, fd, fdd, header))
        ops, sums = self._block_ops([(fd, fdd, int(addrs[i])) for i, fd, fdd, _ in opened],
                                    shards, write=False)
        if len(ops):
            io_batch(ops, self.io_threads, want_checksum=True)
        ok = []
        now = task.t_ns
        for n, (i, fd, fdd, header) in enumerate(opened):
            if ops["result"][n] < 0:
                errors[i] = f"read failed: {_err(ops['result'][n])}"
            else:
                expected = header.shard_checksums[shards.start:shards.stop]
                if not np.array_equal(sums[n], expected):
                    errors[i] = "corrupt block: payload checksum mismatch"
                    self._root_of(ids[i]).quarantine_block(self._hex(ids[i]))
                else:
                    ok.append(i)
                    if not self.read_only:    # least recent use, the call's first block newest
                        _set_age(fd, now - (base + i) * AGE_STEP_NS)
            _close(fd, fdd)
        if ok and not self.read_only:
            oldest = now - (base + max(ok)) * AGE_STEP_NS
            with self._lock:
                if self._read_floor_ns is None or oldest < self._read_floor_ns:
                    self._read_floor_ns = oldest
        if bounce is not None:
            _, host = bounce
            for i in ok:
                bufs.rows[i].copy_(host[i], non_blocking=False)
            self._give_back(bounce[0])
        self._scrub(bufs, [i for i in errors if errors[i] != "miss"], nbytes)
        misses = sum(1 for e in errors.values() if e == "miss")
        self._stats.add(load_blocks=len(ok), load_bytes=len(ok) * nbytes,
                        load_seconds=time.perf_counter() - t0, load_failures=len(errors) - misses)
        task.finish_part(np.asarray(ok, dtype=np.int64) + base, {base + i: e for i, e in errors.items()},
                         len(ok) * nbytes)

    @staticmethod
    def _scrub(bufs: BlockBuffers, rows: list, nbytes: int) -> None:
        """Zero the rows of blocks that failed after bytes may have landed: a failed block never
        leaves plausible-looking data behind."""
        for i in rows:
            if bufs.is_cuda:
                bufs.rows[i].zero_()
            else:
                bufs.rows[i][:nbytes] = 0

    def stats(self) -> dict:
        d = self._stats.snapshot()
        with self._lock:
            d["pending"] = len(self._pending)
        d["roots"] = [r.path for r in self.roots]
        d["space"] = self.space
        d["read_only"] = self.read_only
        return {self.name: d}
