"""``posix`` tier: one file per block under one or more root directories (local disk, NFS, any
shared mount), safe for several processes and nodes sharing the directories.

Layout of a root::

    <root>/ab/cd/<32 hex>.blk          published blocks (ab, cd: the first hex digits)
    <root>/ab/cd/<32 hex>.blk.tmp.*    blocks being written (never read)
    <root>/.ucm/lock                   flock serialising publish and garbage collection
    <root>/.ucm/usage                  bytes of published blocks (rebuilt by every GC scan)
    <root>/.ucm/quarantine/            blocks that failed a check, moved aside

Write path: a dump writes the payload into a temporary file (preallocated, so a full disk fails
the dump up front) with the native engine's threads (``pwrite``, optional ``O_DIRECT``),
computing one checksum per shard. ``commit(True)`` writes the header (docs/block-format.md),
optionally ``fsync``s, and publishes with an atomic ``rename`` under the root's lock, after
garbage collection made room: the byte budget of published blocks is never exceeded. A process
killed at any moment leaves at most a temporary file, which no reader opens and GC removes.

Read path: ``open`` + header check (magic, version, namespace, id, geometry, header checksum) +
size check + ``pread`` of the requested shards on native threads + per-shard checksum. Any
failure is a failed block (a miss for the engine); a block that fails a check is quarantined so
later lookups miss. A successful load refreshes the file's mtime: GC evicts by least recent use.
"""
from __future__ import annotations

import errno
import fcntl
import logging
import os
import threading
import time
import uuid
from ucm import threads
from typing import Optional, Sequence

import numpy as np

from ucm.ops import alloc_aligned, io_batch, new_io_ops
from ucm.store import format as fmt
from ucm.store.base import BlockBuffers, BlockGeometry, KVStore, Task, subset_buffers as _subset

log = logging.getLogger("ucm.store.posix")

SUFFIX = ".blk"
TMP = ".tmp."
META = ".ucm"


class _Pending:
    __slots__ = ("path", "tmp", "fd", "fd_direct", "checksums", "shards", "inflight", "failed",
                 "discard", "root")

    def __init__(self, root, path, tmp, fd, fd_direct, n_shards):
        self.root, self.path, self.tmp, self.fd, self.fd_direct = root, path, tmp, fd, fd_direct
        self.checksums = np.zeros(n_shards, dtype=np.uint64)
        self.shards = np.zeros(n_shards, dtype=bool)
        self.inflight = 0
        self.failed: Optional[str] = None
        self.discard = False

    def close(self) -> None:
        for fd in {self.fd, self.fd_direct} - {None}:
            try:
                os.close(fd)
            except OSError:
                pass
        self.fd = self.fd_direct = None


class _Root:
    """One root directory: its budget, lock and usage counter."""

    def __init__(self, path: str, budget: int, file_bytes: int, stale_s: float, stats):
        self.path, self.budget, self.file_bytes, self.stale_s = path, budget, file_bytes, stale_s
        self.meta = os.path.join(path, META)
        self.quarantine = os.path.join(self.meta, "quarantine")
        os.makedirs(self.quarantine, exist_ok=True)
        self._lockfd = os.open(os.path.join(self.meta, "lock"), os.O_RDWR | os.O_CREAT, 0o644)
        self._usagefd = os.open(os.path.join(self.meta, "usage"), os.O_RDWR | os.O_CREAT, 0o644)
        self._tlock = threading.Lock()  # flock does not exclude threads sharing one descriptor
        self._stats = stats

    def close(self):
        for fd in (self._lockfd, self._usagefd):
            os.close(fd)

    class _Locked:
        def __init__(self, root):
            self.root = root

        def __enter__(self):
            self.root._tlock.acquire()
            fcntl.flock(self.root._lockfd, fcntl.LOCK_EX)
            return self.root

        def __exit__(self, *exc):
            fcntl.flock(self.root._lockfd, fcntl.LOCK_UN)
            self.root._tlock.release()

    def locked(self):
        return _Root._Locked(self)

    def _read_usage(self) -> Optional[int]:
        raw = os.pread(self._usagefd, 32, 0).split(b"\n")[0].strip()
        return int(raw) if raw.isdigit() else None

    def _write_usage(self, value: int) -> None:
        os.pwrite(self._usagefd, b"%-30d\n" % value, 0)

    def usage_locked(self) -> int:
        usage = self._read_usage()
        return self.gc_locked(None) if usage is None else usage

    def scan(self):
        """(mtime, size, path) of every published block, plus stale temporary files."""
        blocks, stale = [], []
        now = time.time()
        for top in os.scandir(self.path):
            if not top.is_dir(follow_symlinks=False) or top.name == META:
                continue
            for mid in os.scandir(top.path):
                if not mid.is_dir(follow_symlinks=False):
                    continue
                for f in os.scandir(mid.path):
                    try:
                        st = f.stat(follow_symlinks=False)
                    except FileNotFoundError:
                        continue
                    if f.name.endswith(SUFFIX):
                        blocks.append((st.st_mtime, st.st_size, f.path))
                    elif TMP in f.name and now - st.st_mtime > self.stale_s:
                        stale.append(f.path)
        for f in os.scandir(self.quarantine):
            try:
                if now - f.stat().st_mtime > self.stale_s:
                    stale.append(f.path)
            except FileNotFoundError:
                pass
        return blocks, stale

    def gc_locked(self, target: Optional[int]) -> int:
        """Rescan (exact usage), drop stale temporaries, evict least recently used blocks until
        usage <= target (None: no eviction). Returns the usage; caller holds the lock."""
        blocks, stale = self.scan()
        for path in stale:
            _unlink(path)
        usage = sum(size for _, size, _ in blocks)
        if target is not None and usage > target:
            blocks.sort()
            evicted = 0
            for _, size, path in blocks:
                if usage <= target:
                    break
                if _unlink(path):
                    usage -= size
                    evicted += 1
            self._stats.add(evictions=evicted)
        self._write_usage(usage)
        return usage

    def publish(self, items: list) -> list[Optional[str]]:
        """Atomically rename each ``(tmp, final)`` into place within the budget; returns an
        error text (or None) per item."""
        out: list[Optional[str]] = []
        with self.locked():
            usage = self.usage_locked()
            need = len(items) * self.file_bytes
            if usage + need > self.budget:
                target = max(0, min(self.budget - need, int(self.budget * 0.9)))
                usage = self.gc_locked(target)
            for tmp, final in items:
                if os.path.exists(final):  # published meanwhile by another process
                    _unlink(tmp)
                    out.append(None)
                    continue
                if usage + self.file_bytes > self.budget:
                    _unlink(tmp)
                    out.append("byte budget too small for this block")
                    continue
                try:
                    os.rename(tmp, final)
                except OSError as exc:
                    _unlink(tmp)
                    out.append(f"publish failed: {exc}")
                    continue
                usage += self.file_bytes
                out.append(None)
            self._write_usage(usage)
        return out

    def quarantine_block(self, path: str) -> None:
        dest = os.path.join(self.quarantine, f"{os.path.basename(path)}.{os.getpid()}.{time.time():.0f}")
        with self.locked():
            try:
                os.rename(path, dest)
            except OSError:
                return  # already gone (evicted or quarantined by someone else)
            usage = self._read_usage()
            if usage is not None:
                self._write_usage(max(0, usage - self.file_bytes))
        self._stats.add(quarantined=1)


def _unlink(path: str) -> bool:
    try:
        os.unlink(path)
        return True
    except FileNotFoundError:
        return False


def _err(code: int) -> str:
    code = abs(int(code))
    return f"{errno.errorcode.get(code, code)}: {os.strerror(code)}"


class PosixStore(KVStore):
    name = "posix"

    def __init__(self, geometry: BlockGeometry, roots: Sequence[str], namespace: bytes = bytes(16),
                 capacity_bytes: int = 64 << 30, o_direct: bool = False, fsync: bool = False,
                 io_threads: int = 4, wait_timeout_s: float = 30.0, stale_tmp_s: float = 600.0,
                 codec: int = 0):
        super().__init__(geometry, wait_timeout_s)
        if isinstance(roots, (str, os.PathLike)):
            roots = [roots]
        roots = [os.path.abspath(os.path.expanduser(os.fspath(r))) for r in roots]
        if not roots:
            raise ValueError("store.posix.roots: at least one directory is required")
        if not isinstance(namespace, (bytes, bytearray)) or len(namespace) != 16:
            raise ValueError("namespace: expected a 16-byte digest (ucm.Namespace(...).digest())")
        if isinstance(capacity_bytes, bool) or not isinstance(capacity_bytes, (int, np.integer)) \
                or capacity_bytes < 0:
            raise ValueError(f"cache_capacity must be a size in bytes >= 0, got {capacity_bytes!r}")
        self.namespace = bytes(namespace)
        self.codec = int(codec)
        self.o_direct, self.fsync = bool(o_direct), bool(fsync)
        self.io_threads = max(1, int(io_threads))
        self.header_bytes = fmt.header_size(geometry.n_shards)
        self.file_bytes = self.header_bytes + geometry.block_bytes
        per_root = int(capacity_bytes) // len(roots)
        if per_root < self.file_bytes:
            raise ValueError(f"cache_capacity ({capacity_bytes} bytes over {len(roots)} roots) is "
                             f"smaller than one block file ({self.file_bytes} bytes)")
        for r in roots:
            if not os.path.isdir(r):
                raise ValueError(f"store.posix.roots: {r!r} does not exist or is not a directory")
            probe = os.path.join(r, f".ucm-write-probe.{os.getpid()}.{uuid.uuid4().hex}")
            try:
                with open(probe, "wb") as f:
                    f.write(b"x")
                os.unlink(probe)
            except OSError as exc:
                raise ValueError(f"store.posix.roots: {r!r} is not writable ({exc.strerror})") from None
        self.roots = [_Root(r, per_root, self.file_bytes, stale_tmp_s, self._stats) for r in roots]
        self._pending: dict[bytes, _Pending] = {}
        self._lock = threading.Lock()
        self._exec = threads.pool(self.io_threads, "ucm-posix")
        self._bounce_free: list = []  # pinned host buffers for CUDA rows, reused

    # -- paths ----------------------------------------------------------------------------------
    def _place(self, block_id: np.ndarray) -> tuple[_Root, str]:
        hexid = block_id.astype("<u8").tobytes().hex()
        root = self.roots[int(block_id[1]) % len(self.roots)]
        return root, os.path.join(root.path, hexid[:2], hexid[2:4], hexid + SUFFIX)

    def path_of(self, block_id) -> str:
        """File of one block id (16 bytes or ``uint64[2]``)."""
        from ucm.ids import as_ids

        one = [bytes(block_id)] if isinstance(block_id, (bytes, bytearray)) else \
            np.asarray(block_id).reshape(1, 2)
        return self._place(as_ids(one)[0])[1]

    # -- API ------------------------------------------------------------------------------------
    def lookup(self, block_ids) -> list[bool]:
        from ucm.ids import as_ids

        ids = as_ids(block_ids, "block_ids")
        found = [os.path.exists(self._place(ids[i])[1]) for i in range(len(ids))]
        hits = sum(found)
        self._stats.add(lookups=len(ids), hits=hits, misses=len(ids) - hits)
        return found

    def lookup_prefix(self, block_ids) -> int:
        from ucm.ids import as_ids

        ids = as_ids(block_ids, "block_ids")
        n = 0
        while n < len(ids) and os.path.exists(self._place(ids[n])[1]):
            n += 1
        self._stats.add(lookups=min(n + 1, len(ids)), hits=n, misses=int(n < len(ids)))
        return n

    def close(self) -> None:
        if self._closed:
            return
        super().close()
        self._exec.shutdown(wait=True)
        with self._lock:
            pending, self._pending = list(self._pending.values()), {}
        for p in pending:  # never published: remove
            p.close()
            _unlink(p.tmp)
        if self._bounce_free:
            import torch

            for arr, _ in self._bounce_free:
                torch.cuda.cudart().cudaHostUnregister(arr.ctypes.data)
            self._bounce_free = []
        for r in self.roots:
            r.close()

    def gc(self, target_bytes: Optional[int] = None) -> int:
        """Collect stale temporaries and, with a target, evict down to it (per root). Returns
        the published bytes after collection."""
        total = 0
        for r in self.roots:
            with r.locked():
                total += r.gc_locked(target_bytes if target_bytes is None else target_bytes // len(self.roots))
        return total

    def usage(self) -> int:
        total = 0
        for r in self.roots:
            with r.locked():
                total += r.usage_locked()
        return total

    # -- dump -----------------------------------------------------------------------------------
    CHUNK = 32  # blocks per worker job: Python preparation of one overlaps I/O of another

    def _submit(self, kind: str, fn, ids, bufs: BlockBuffers, shards: range) -> Task:
        task = Task(kind, ids)
        for start in range(0, len(ids), self.CHUNK):
            rows = np.arange(start, min(start + self.CHUNK, len(ids)))
            task.add_part()
            self._exec.submit(self._guard, task, fn, task, ids[rows], _subset(bufs, rows), shards, start)
        return task.seal()

    def _dump(self, ids, offset, bufs: BlockBuffers, shards: range) -> Task:
        return self._submit("dump", self._run_dump, ids, bufs, shards)

    def _guard(self, task: Task, fn, *args) -> None:
        """Run a worker; an unexpected exception fails the whole part instead of hanging it."""
        try:
            fn(*args)
        except Exception as exc:  # pragma: no cover - defensive
            log.exception("ucm posix tier: %s task failed", task.kind)
            task.finish_part([], {i: f"internal error: {exc!r}" for i in range(task.n)})  # whole task

    def _open_tmp(self, root: _Root, path: str) -> _Pending:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}{TMP}{os.getpid()}.{uuid.uuid4().hex[:8]}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            os.posix_fallocate(fd, 0, self.file_bytes)  # a full disk fails here, up front
            fd_direct = os.open(tmp, os.O_WRONLY | os.O_DIRECT) if self.o_direct else None
        except BaseException:
            os.close(fd)
            _unlink(tmp)
            raise
        return _Pending(root, path, tmp, fd, fd_direct, self.geometry.n_shards)

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
        ops_keep = (ops, sums)
        return ops_keep

    def _direct_ok(self, addr, length, file_off) -> bool:
        return self.o_direct and addr % 4096 == 0 and length % 4096 == 0 and file_off % 4096 == 0

    def _run_dump(self, task: Task, ids, bufs: BlockBuffers, shards: range, base: int) -> None:
        t0 = time.perf_counter()
        sb = self.geometry.shard_bytes
        nbytes = len(shards) * sb
        addrs, bounce = self._host_rows(bufs, nbytes)
        skipped, errors, plan = [], {}, []  # plan: (row, pending)
        for i in range(len(ids)):
            root, path = self._place(ids[i])
            if os.path.exists(path):
                skipped.append(i)
                continue
            key = ids[i].tobytes()
            with self._lock:
                p = self._pending.get(key)
                if p is not None:
                    p.inflight += 1
            if p is None:
                try:
                    p = self._open_tmp(root, path)
                except OSError as exc:
                    errors[i] = f"cannot create block file: {_err(exc.errno or errno.EIO)}"
                    continue
                with self._lock:
                    other = self._pending.setdefault(key, p)
                    other.inflight += 1
                if other is not p:  # another task of this process got there first
                    p.close()
                    _unlink(p.tmp)
                    p = other
            plan.append((i, p))
        ops, sums = self._block_ops(
            [(p.fd, p.fd_direct, int(addrs[i])) for i, p in plan], shards, write=True)
        if len(ops):
            io_batch(ops, self.io_threads, want_checksum=True)
        ok = list(skipped)
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
                if p.discard and p.inflight == 0:
                    self._drop(p)
        self._give_back(None if bounce is None else bounce[0])
        written = (len(ok) - len(skipped)) * nbytes
        self._stats.add(dump_blocks=len(ok) - len(skipped), dump_bytes=written,
                        dump_seconds=time.perf_counter() - t0, dump_failures=len(errors),
                        dump_skipped=len(skipped))
        task.finish_part(np.asarray(ok, dtype=np.int64) + base, {base + i: e for i, e in errors.items()},
                         written)

    @staticmethod
    def _drop(p: _Pending) -> None:
        p.close()
        _unlink(p.tmp)

    def commit(self, block_ids, success_flags) -> None:
        ids, flags = self._flags(block_ids, success_flags)
        ready: list[_Pending] = []
        with self._lock:
            for i in range(len(ids)):
                p = self._pending.pop(ids[i].tobytes(), None)
                if p is None:
                    continue
                if flags[i] and p.inflight == 0 and not p.failed and p.shards.all():
                    ready.append(p)
                    continue
                if flags[i]:
                    log.warning("ucm posix tier: block %s not published (%s)", os.path.basename(p.path),
                                "dump in flight" if p.inflight else p.failed or "shards missing")
                self._stats.add(discards=1)
                if p.inflight:
                    p.discard = True
                else:
                    self._drop(p)
        by_root: dict[int, list] = {}
        for p in ready:
            try:
                header = fmt.Header(self.namespace, _id_bytes(p.path), self.codec,
                                    self.geometry.block_bytes, self.geometry.shard_bytes,
                                    p.checksums).pack()
                os.pwrite(p.fd, header.tobytes(), 0)
                if self.fsync:
                    os.fsync(p.fd)
            except OSError as exc:
                log.warning("ucm posix tier: header write failed for %s: %s", p.path, exc)
                self._drop(p)
                self._stats.add(discards=1)
                continue
            p.close()
            by_root.setdefault(id(p.root), []).append(p)
        for plist in by_root.values():
            root = plist[0].root
            results = root.publish([(p.tmp, p.path) for p in plist])
            for p, err in zip(plist, results):
                if err:
                    log.warning("ucm posix tier: %s not published: %s", p.path, err)
                    self._stats.add(discards=1)
                else:
                    self._stats.add(commits=1)
            if self.fsync:
                for d in {os.path.dirname(p.path) for p in plist}:
                    _fsync_dir(d)

    # -- load -----------------------------------------------------------------------------------
    def _load(self, ids, offset, bufs: BlockBuffers, shards: range) -> Task:
        return self._submit("load", self._run_load, ids, bufs, shards)

    def _run_load(self, task: Task, ids, bufs: BlockBuffers, shards: range, base: int) -> None:
        t0 = time.perf_counter()
        sb = self.geometry.shard_bytes
        nbytes = len(shards) * sb
        addrs, bounce = self._host_rows(bufs, nbytes, to_device=True)
        errors: dict = {}
        candidates = []  # (row, root, path, fd, fd_direct)
        for i in range(len(ids)):
            root, path = self._place(ids[i])
            try:
                fd = os.open(path, os.O_RDONLY)
            except FileNotFoundError:
                errors[i] = "miss"
                continue
            except OSError as exc:
                errors[i] = f"cannot open: {_err(exc.errno or errno.EIO)}"
                continue
            try:
                size = os.fstat(fd).st_size
                if size != self.file_bytes:
                    raise fmt.BadBlock(f"file is {size} bytes, expected {self.file_bytes}")
                fd_direct = os.open(path, os.O_RDONLY | os.O_DIRECT) if self.o_direct else None
            except fmt.BadBlock as exc:
                os.close(fd)
                errors[i] = f"corrupt block: {exc}"
                root.quarantine_block(path)
                continue
            except OSError as exc:
                os.close(fd)
                errors[i] = f"read failed: {_err(exc.errno or errno.EIO)}"
                continue
            candidates.append((i, root, path, fd, fd_direct))
        # every header in one parallel batch (a cold header read is a disk round trip each)
        hsz = self.header_bytes
        headers = alloc_aligned(max(1, len(candidates)) * hsz)
        hops = new_io_ops(len(candidates))
        for n, (_, _, _, fd, fd_direct) in enumerate(candidates):
            hops[n] = (fd if fd_direct is None else fd_direct, 0, headers.ctypes.data + n * hsz, hsz,
                       0, 0, 0, 0, 0, 0)
        if len(hops):
            io_batch(hops, self.io_threads, want_checksum=False)
        opened = []  # (row, root, path, fd, fd_direct, header)
        for n, (i, root, path, fd, fd_direct) in enumerate(candidates):
            if hops["result"][n] < 0:  # an I/O error is not corruption: no quarantine
                for f in {fd, fd_direct} - {None}:
                    os.close(f)
                errors[i] = f"read failed: {_err(hops['result'][n])}"
                continue
            try:
                if hops["result"][n] != hsz:
                    raise fmt.BadBlock("header truncated")
                header = fmt.parse(headers[n * hsz:(n + 1) * hsz], self.namespace, ids[i].tobytes(),
                                   self.geometry.block_bytes, sb, self.codec)
            except fmt.BadBlock as exc:
                for f in {fd, fd_direct} - {None}:
                    os.close(f)
                errors[i] = f"corrupt block: {exc}"
                root.quarantine_block(path)
                continue
            opened.append((i, root, path, fd, fd_direct, header))
        ops, sums = self._block_ops([(fd, fd_direct, int(addrs[i])) for i, _, _, fd, fd_direct, _ in opened],
                                    shards, write=False)
        if len(ops):
            io_batch(ops, self.io_threads, want_checksum=True)
        ok = []
        for n, (i, root, path, fd, fd_direct, header) in enumerate(opened):
            if ops["result"][n] < 0:
                errors[i] = f"read failed: {_err(ops['result'][n])}"
            else:
                expected = header.shard_checksums[shards.start:shards.stop]
                if not np.array_equal(sums[n], expected):
                    errors[i] = "corrupt block: payload checksum mismatch"
                    root.quarantine_block(path)
                else:
                    ok.append(i)
                    try:
                        os.utime(fd)  # least-recently-used order for GC
                    except OSError:
                        pass
            for f in {fd, fd_direct} - {None}:
                os.close(f)
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
        return {self.name: d}


def _id_bytes(path: str) -> bytes:
    return bytes.fromhex(os.path.basename(path)[:32])


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
