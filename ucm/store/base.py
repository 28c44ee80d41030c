"""The store API every tier and pipeline implements (the seed design's interface).

::

    lookup(block_ids) -> list[bool]          committed blocks only
    lookup_prefix(block_ids) -> int          length of the leading run of hits
    load(block_ids, offset, dst) -> Task     asynchronous
    dump(block_ids, offset, src) -> Task     asynchronous
    wait(task, timeout=None) -> TaskResult   per-block success; raises TaskTimeoutError on timeout
    check(task) -> bool                      non-blocking: finished?
    commit(block_ids, success_flags)         publish (True) or discard (False) dumped blocks
    prefetch(block_ids)                      hint: warm a faster tier
    supports_batch_ops() / batch_load(...)   several loads as one task
    stats() -> dict                          hits, misses, bytes and seconds per operation

Geometry: every block of a store has ``block_bytes`` bytes made of ``block_bytes //
shard_bytes`` equal shards (e.g. one shard per layer). ``offset`` and the per-block byte count
of a ``load``/``dump`` address whole shards, so layer-wise saving and loading work.

Consistency: a dumped block is invisible until ``wait`` reported it done and ``commit(True)``
published it (eventual consistency); ``commit(False)`` discards it. A block is published only if
every one of its shards was dumped successfully.

Buffers (``src``/``dst``): a 2-D array or tensor ``[n, nbytes]`` whose rows are contiguous (any
dtype, viewed as bytes; CPU or CUDA), or a sequence of ``n`` contiguous per-block buffers.
"""
from __future__ import annotations

import threading
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

from ucm.errors import TaskTimeoutError
from ucm.ids import as_ids


@dataclass(frozen=True)
class BlockGeometry:
    block_bytes: int
    shard_bytes: int

    def __post_init__(self):
        for name in ("block_bytes", "shard_bytes"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v <= 0:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        if self.block_bytes % self.shard_bytes:
            raise ValueError(f"shard_bytes ({self.shard_bytes}) must divide block_bytes "
                             f"({self.block_bytes})")
        if self.shard_bytes % 8:
            raise ValueError(f"shard_bytes must be a multiple of 8, got {self.shard_bytes}")

    @property
    def n_shards(self) -> int:
        return self.block_bytes // self.shard_bytes

    def shards(self, offset: int, nbytes: int) -> range:
        """The shard numbers covered by ``[offset, offset + nbytes)``; ValueError unless the
        range is a non-empty run of whole shards inside the block."""
        if isinstance(offset, bool) or not isinstance(offset, (int, np.integer)) or offset < 0:
            raise ValueError(f"offset must be an int >= 0, got {offset!r}")
        if offset % self.shard_bytes or nbytes % self.shard_bytes or nbytes <= 0 \
                or offset + nbytes > self.block_bytes:
            raise ValueError(
                f"offset={offset}, {nbytes} bytes per block: must be whole shards of "
                f"{self.shard_bytes} bytes inside a block of {self.block_bytes} bytes")
        first = offset // self.shard_bytes
        return range(first, first + nbytes // self.shard_bytes)


# ---------------------------------------------------------------------------------------------
# buffers

def _is_torch(x) -> bool:
    return type(x).__module__.startswith("torch")


class BlockBuffers:
    """``n`` per-block byte buffers of ``nbytes`` each, on the CPU or one CUDA device.

    CPU buffers are exposed as raw addresses (``addrs``, for the native engine) and numpy rows;
    CUDA buffers as torch uint8 row views (``rows``). ``keep`` holds what must stay alive until
    the task that uses them has finished.
    """

    def __init__(self, rows: list, device: str, addrs: Optional[np.ndarray], keep):
        self.rows, self.device, self.addrs, self.keep = rows, device, addrs, keep

    @property
    def is_cuda(self) -> bool:
        return self.device.startswith("cuda")

    @classmethod
    def wrap(cls, buf, n: int, name: str, writable: bool) -> "BlockBuffers":
        if isinstance(buf, (list, tuple)):
            if len(buf) != n:
                raise ValueError(f"{name}: expected {n} per-block buffers, got {len(buf)}")
            parts = [cls.wrap(b if _is_torch(b) or isinstance(b, np.ndarray) and b.ndim == 2
                              else _row2d(b, f"{name}[{i}]"), 1, f"{name}[{i}]", writable)
                     for i, b in enumerate(buf)]
            devices = {p.device for p in parts}
            if len(devices) > 1:
                raise ValueError(f"{name}: buffers on several devices {sorted(devices)}")
            addrs = None if parts and parts[0].is_cuda else \
                np.concatenate([p.addrs for p in parts]) if parts else np.zeros(0, np.uint64)
            return cls([p.rows[0] for p in parts], devices.pop() if devices else "cpu", addrs,
                       [p.keep for p in parts])
        if _is_torch(buf):
            return _wrap_torch(buf, n, name, writable)
        if isinstance(buf, np.ndarray):
            return _wrap_numpy(buf, n, name, writable)
        raise ValueError(f"{name}: expected a 2-D array/tensor [n, nbytes] or a list of "
                         f"per-block buffers, got {type(buf).__name__}")

    def nbytes(self) -> int:
        sizes = {int(r.nbytes) if isinstance(r, np.ndarray) else r.numel() for r in self.rows}
        if len(sizes) != 1:
            raise ValueError(f"per-block buffers differ in size: {sorted(sizes)}")
        return sizes.pop()


def _row2d(b, name):
    if isinstance(b, (bytes, bytearray, memoryview)):
        arr = np.frombuffer(b, dtype=np.uint8)
        return arr.reshape(1, -1)
    if isinstance(b, np.ndarray):
        return b.reshape(1, -1) if b.flags.c_contiguous else b
    raise ValueError(f"{name}: unsupported buffer type {type(b).__name__}")


def _check_rows(name: str, n: int, row_stride: int, row_bytes: int, writable: bool) -> None:
    """Rows are addressed as base + i * row_stride: a negative stride is refused, and rows a
    load writes must not overlap (the bytes of one block would land in another's row)."""
    if n > 1 and row_stride < 0:
        raise ValueError(f"{name}: rows in reverse order (negative row stride {row_stride}); pass "
                         f"a copy with ascending rows")
    if n > 1 and writable and row_stride < row_bytes:
        raise ValueError(f"{name}: rows overlap (row stride {row_stride} < {row_bytes} bytes a "
                         f"row); a destination needs one distinct row per block")


def _wrap_numpy(arr: np.ndarray, n: int, name: str, writable: bool) -> BlockBuffers:
    if arr.dtype.hasobject:
        raise TypeError(f"{name}: dtype {arr.dtype} holds Python object references, not bytes")
    if arr.ndim != 2 or arr.shape[0] != n:
        raise ValueError(f"{name}: expected shape [{n}, nbytes], got {list(arr.shape)}")
    if writable and not arr.flags.writeable:
        raise ValueError(f"{name}: array is read-only")
    if n == 0:
        return BlockBuffers([], "cpu", np.zeros(0, np.uint64), arr)
    if arr.strides[1] != arr.itemsize:
        raise ValueError(f"{name}: rows must be contiguous (strides {arr.strides})")
    _check_rows(name, n, arr.strides[0], arr.shape[1] * arr.itemsize, writable)
    rows = [np.frombuffer(arr[i].data, dtype=np.uint8) if arr[i].flags.c_contiguous
            else arr[i].view(np.uint8) for i in range(n)]
    base = np.uint64(arr.ctypes.data)
    addrs = base + np.arange(n, dtype=np.uint64) * np.uint64(arr.strides[0])
    return BlockBuffers(rows, "cpu", addrs, arr)


def _wrap_torch(t, n: int, name: str, writable: bool) -> BlockBuffers:
    import torch

    if t.dim() != 2 or t.shape[0] != n:
        raise ValueError(f"{name}: expected shape [{n}, nbytes], got {list(t.shape)}")
    if n == 0:
        return BlockBuffers([], str(t.device), np.zeros(0, np.uint64) if t.device.type == "cpu" else None, t)
    if t.stride(1) != 1:
        raise ValueError(f"{name}: rows must be contiguous (strides {t.stride()})")
    _check_rows(name, n, t.stride(0) * t.element_size(), t.shape[1] * t.element_size(), writable)
    if t.dtype != torch.uint8:
        if t.stride(0) * t.element_size() % 1:
            raise ValueError(f"{name}: cannot view rows as bytes")
        t = t.view(torch.uint8)
    device = str(t.device)
    if t.device.type == "cpu":
        rows = [t[i].numpy() for i in range(n)]
        base = np.uint64(t.data_ptr())
        addrs = base + np.arange(n, dtype=np.uint64) * np.uint64(t.stride(0))
        return BlockBuffers(rows, "cpu", addrs, t)
    if t.device.type != "cuda":
        raise ValueError(f"{name}: unsupported device {device}")
    return BlockBuffers([t[i] for i in range(n)], device, None, t)


# ---------------------------------------------------------------------------------------------
# tasks

@dataclass
class TaskResult:
    """Outcome of a task: ``ok[i]`` for block ``i`` of the request, ``errors[i]`` why not."""
    ok: np.ndarray
    errors: dict
    nbytes: int
    seconds: float

    @property
    def all_ok(self) -> bool:
        return bool(self.ok.all())

    @property
    def failed(self) -> list[int]:
        return [int(i) for i in np.flatnonzero(~self.ok)]


class Task:
    """An asynchronous load or dump of ``n`` blocks, finished when all of its parts are."""

    _counter = 0
    _counter_lock = threading.Lock()

    def __init__(self, kind: str, block_ids: np.ndarray):
        with Task._counter_lock:
            Task._counter += 1
            self.id = Task._counter
        self.kind = kind
        self.block_ids = block_ids
        self.n = len(block_ids)
        self._ok = np.zeros(self.n, dtype=bool)
        self._errors: dict = {}
        self._parts = 0
        self._lock = threading.Lock()
        self._event = threading.Event()
        self._sealed = False
        self._nbytes = 0
        self._t0 = time.perf_counter()
        self._t1 = None
        self._callbacks: list = []
        #: what a composite task is still waiting for, for the timeout's message (a pipeline
        #: names its tiers whose parts are not done)
        self.pending = None

    def __repr__(self):
        return f"Task(#{self.id} {self.kind} n={self.n} done={self.done()})"

    def add_part(self) -> None:
        with self._lock:
            assert not self._sealed
            self._parts += 1

    def finish_part(self, ok_idx=(), errors: Optional[dict] = None, nbytes: int = 0) -> None:
        """Record one part's outcome: indices that succeeded, ``{index: reason}`` failures."""
        with self._lock:
            if len(ok_idx):
                self._ok[np.asarray(ok_idx, dtype=np.int64)] = True
            for i, why in (errors or {}).items():
                self._ok[i] = False
                self._errors.setdefault(int(i), why)
            self._nbytes += nbytes
            self._parts -= 1
            finished = self._sealed and self._parts == 0
        if finished:
            self._finish()

    def seal(self) -> "Task":
        """No more parts will be added; a task without parts finishes now."""
        with self._lock:
            self._sealed = True
            finished = self._parts == 0
        if finished:
            self._finish()
        return self

    def _finish(self) -> None:
        with self._lock:
            for i in np.flatnonzero(~self._ok):
                self._errors.setdefault(int(i), "not completed")
            self._t1 = time.perf_counter()
            self._event.set()
            callbacks, self._callbacks = self._callbacks, []
        for cb in callbacks:
            cb(self)

    def on_done(self, callback) -> None:
        """Call ``callback(task)`` once the task is done (now, if it already is)."""
        with self._lock:
            if not self._event.is_set():
                self._callbacks.append(callback)
                return
        callback(self)

    def done(self) -> bool:
        return self._event.is_set()

    def wait(self, timeout: Optional[float]) -> TaskResult:
        if not self._event.wait(timeout):
            late = self.pending() if self.pending is not None else ""
            raise TaskTimeoutError(f"task #{self.id} ({self.kind} of {self.n} blocks) not done "
                                   f"after {timeout} s" + (f" (waiting for {late})" if late else ""))
        with self._lock:
            return TaskResult(self._ok.copy(), dict(self._errors), self._nbytes,
                              (self._t1 or time.perf_counter()) - self._t0)


# ---------------------------------------------------------------------------------------------
# statistics

class Stats:
    """Thread-safe counters: ``stats.add(load_bytes=..., load_seconds=...)``."""

    FIELDS = ("lookups", "hits", "misses", "load_blocks", "load_bytes", "load_seconds",
              "load_failures", "dump_blocks", "dump_bytes", "dump_seconds", "dump_failures",
              "dump_skipped", "commits", "discards", "evictions", "quarantined", "promotions",
              # distributed tiers: requests skipped or failed because a server was down, and
              # other failed requests (both become misses or failed saves)
              "unavailable", "io_errors")

    def __init__(self, fields: Optional[Sequence[str]] = None):
        self._lock = threading.Lock()
        self._v = {f: 0 for f in (self.FIELDS if fields is None else fields)}

    def add(self, **kw) -> None:
        with self._lock:
            for k, v in kw.items():
                self._v[k] += v

    def snapshot(self) -> dict:
        with self._lock:
            d = dict(self._v)
        if "hits" not in d:  # (another set of fields: no derived rates)
            return d
        looked = d["hits"] + d["misses"]
        d["hit_rate"] = d["hits"] / looked if looked else 0.0
        d["load_GBps"] = d["load_bytes"] / d["load_seconds"] / 1e9 if d["load_seconds"] else 0.0
        d["dump_GBps"] = d["dump_bytes"] / d["dump_seconds"] / 1e9 if d["dump_seconds"] else 0.0
        return d


# ---------------------------------------------------------------------------------------------
# the interface

class KVStore(ABC):
    """Base of every tier and pipeline. Subclasses implement ``lookup``, ``_load``, ``_dump``
    and ``commit``; argument checking happens here, once."""

    name = "store"
    #: blocks live in this process only (another process opening the same config sees none)
    process_local = False

    def __init__(self, geometry: BlockGeometry, wait_timeout_s: float = 30.0,
                 namespace: bytes = bytes(16)):
        if not isinstance(namespace, (bytes, bytearray)) or len(namespace) != 16:
            raise ValueError("namespace: expected a 16-byte digest (ucm.Namespace(...).digest())")
        self.geometry = geometry
        #: whose blocks these are: a tier serves only blocks stored under this digest, and the
        #: tiers of one pipeline share it
        self.namespace = bytes(namespace)
        self.wait_timeout_s = float(wait_timeout_s)
        self._stats = Stats()
        self._closed = False
        self._generation = 0

    # -- public API ---------------------------------------------------------------------------
    @abstractmethod
    def lookup(self, block_ids) -> list[bool]:
        """For each id: is it committed here?"""

    def lookup_prefix(self, block_ids) -> int:
        """Number of leading ids that are committed here."""
        n = 0
        for hit in self.lookup(block_ids):
            if not hit:
                break
            n += 1
        return n

    def load(self, block_ids, offset: int, dst) -> Task:
        """Copy bytes ``[offset, offset + nbytes)`` of each block into row ``i`` of ``dst``."""
        ids, bufs, shards = self._prepare(block_ids, offset, dst, writable=True, name="dst")
        return self._load(ids, offset, bufs, shards) if len(ids) else Task("load", ids).seal()

    def dump(self, block_ids, offset: int, src) -> Task:
        """Store row ``i`` of ``src`` as bytes ``[offset, offset + nbytes)`` of block ``i``."""
        ids, bufs, shards = self._prepare(block_ids, offset, src, writable=False, name="src")
        return self._dump(ids, offset, bufs, shards) if len(ids) else Task("dump", ids).seal()

    def wait(self, task: Task, timeout: Optional[float] = None) -> TaskResult:
        """Block until ``task`` is done (at most ``timeout`` seconds, default the store's
        ``wait_timeout_s``) and return its per-block result."""
        if not isinstance(task, Task):
            raise ValueError(f"task: expected a Task, got {type(task).__name__}")
        return task.wait(self.wait_timeout_s if timeout is None else timeout)

    def check(self, task: Task) -> bool:
        return task.done()

    @abstractmethod
    def commit(self, block_ids, success_flags) -> None:
        """Publish (True) or discard (False) each dumped block."""

    def prefetch(self, block_ids) -> None:
        """Hint that these blocks will be loaded soon (a pipeline warms its faster tier)."""

    def borrow(self, block_ids) -> Optional["Borrowed"]:
        """Zero-copy read access to committed blocks this store holds in host memory: a
        :class:`Borrowed` (one 2-D ``uint8`` pool tensor, the row of each block in it or -1,
        and ``release()``), or ``None`` when the store keeps nothing in memory. Borrowed rows
        are never evicted or overwritten before ``release()``. Optional capability: a caller
        falls back to ``load`` when it gets ``None`` or rows of -1."""
        return None

    def supports_batch_ops(self) -> bool:
        return False

    def generation(self) -> int:
        """The namespace's generation: a counter that only grows. An engine derives its block
        ids from it, so raising it (after a weight update, say) makes every block stored
        before unreachable without deleting anything. This base keeps it in the process;
        tiers that outlive the process persist it."""
        return self._generation

    def set_generation(self, value: int) -> int:
        """Raise the generation to at least ``value``; returns the generation now in force
        (never lower than before). Raises ``OSError`` when it cannot be persisted."""
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
            raise TypeError(f"generation: expected an int >= 0, got {value!r}")
        self._generation = max(self._generation, int(value))
        return self._generation

    def prepare(self) -> None:
        """Allocate buffers now (tiers may allocate lazily, on first use)."""

    def batch_load(self, requests: Sequence[tuple]) -> Task:
        """Several ``(block_ids, offset, dst)`` loads as one task (block order concatenated)."""
        tasks = [self.load(*r) for r in requests]
        return combine("load", tasks)

    def stats(self) -> dict:
        return {self.name: self._stats.snapshot()}

    def close(self) -> None:
        self._closed = True

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # -- for subclasses -----------------------------------------------------------------------
    @abstractmethod
    def _load(self, ids: np.ndarray, offset: int, bufs: BlockBuffers, shards: range) -> Task:
        ...

    @abstractmethod
    def _dump(self, ids: np.ndarray, offset: int, bufs: BlockBuffers, shards: range) -> Task:
        ...

    def _prepare(self, block_ids, offset, buf, writable: bool, name: str):
        if self._closed:
            raise ValueError(f"{self.name}: store is closed")
        ids = as_ids(block_ids, "block_ids")
        bufs = BlockBuffers.wrap(buf, len(ids), name, writable)
        nbytes = bufs.nbytes() if len(ids) else self.geometry.shard_bytes
        shards = self.geometry.shards(offset, nbytes)
        return ids, bufs, shards

    @staticmethod
    def _flags(block_ids, success_flags) -> tuple[np.ndarray, np.ndarray]:
        ids = as_ids(block_ids, "block_ids")
        if success_flags is None or isinstance(success_flags, (str, bytes)):
            raise TypeError(f"success_flags: expected a bool or {len(ids)} booleans (e.g. the "
                            f"task result's ok), got {success_flags!r}")
        flags = np.asarray(success_flags)
        if flags.dtype.kind not in "biu" or flags.dtype.kind in "iu" and flags.size \
                and not np.isin(flags, (0, 1)).all():
            raise TypeError(f"success_flags: expected booleans, got {flags!r}")
        if flags.ndim == 0:
            flags = np.full(len(ids), bool(flags))
        if flags.shape != (len(ids),):
            raise ValueError(f"success_flags: expected {len(ids)} booleans, got {flags!r}")
        return ids, flags.astype(bool)


class Borrowed:
    """Blocks lent by :meth:`KVStore.borrow`: ``pool`` is ``uint8 [n_rows, block_bytes]``,
    ``rows[i]`` the pool row holding block ``i`` (-1: not held). Release exactly once (also as a
    context manager)."""

    def __init__(self, pool, rows: np.ndarray, release):
        self.pool = pool
        self.rows = rows
        self._release = release

    @property
    def all_found(self) -> bool:
        return bool(len(self.rows)) and bool((self.rows >= 0).all())

    def release(self) -> None:
        rel, self._release = self._release, None
        if rel is not None:
            rel()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.release()


def combine(kind: str, tasks: Sequence[Task]) -> Task:
    """One task over several (block order concatenated), done when all of them are."""
    ids = np.concatenate([t.block_ids for t in tasks]) if tasks else np.zeros((0, 2), np.uint64)
    out = Task(kind, ids)
    base = 0
    for t in tasks:
        out.add_part()

        def forward(child, base=base):
            r = child.wait(0)
            out.finish_part(np.flatnonzero(r.ok) + base,
                            {base + i: e for i, e in r.errors.items()}, r.nbytes)
        t.on_done(forward)
        base += t.n
    return out.seal()


def subset_buffers(bufs: BlockBuffers, rows) -> BlockBuffers:
    """The buffers of some rows, in the given order."""
    rows = np.asarray(rows)
    return BlockBuffers([bufs.rows[i] for i in rows], bufs.device,
                        None if bufs.addrs is None else bufs.addrs[rows], bufs.keep)
