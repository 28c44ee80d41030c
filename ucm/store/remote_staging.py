"""The remote tiers' staging rows and dump bookkeeping (:mod:`ucm.store.remote`): the slab of
host rows values pass through, a block being dumped, and the outcome of one part of a dump."""
from __future__ import annotations

import threading
import time
from typing import Optional

import numpy as np

from ucm.ops import alloc_aligned
from ucm.store.base import Task


class Staging:
    """``n`` host rows of ``row_bytes`` (each one value: header + payload), one slab."""

    def __init__(self, n: int, row_bytes: int):
        self.n, self.row_bytes = n, row_bytes
        self.slab = alloc_aligned(n * row_bytes, 4096).reshape(n, row_bytes)
        self._free = list(range(n - 1, -1, -1))
        self._cv = threading.Condition()

    def take(self, k: int, timeout: float) -> Optional[list[int]]:
        """``k`` rows at once (all or none, so two takers never wait on each other), waiting at
        most ``timeout`` seconds; ``None`` when they did not come free."""
        if k > self.n:
            return None
        deadline = time.monotonic() + timeout
        with self._cv:
            while len(self._free) < k:
                left = deadline - time.monotonic()
                if left <= 0 or not self._cv.wait(left):
                    if len(self._free) < k:
                        return None
            return [self._free.pop() for _ in range(k)]

    def wait_change(self, timeout: float) -> None:
        """Sleep until rows are given back (or ``timeout`` seconds)."""
        with self._cv:
            self._cv.wait(timeout)

    def free(self) -> int:
        with self._cv:
            return len(self._free)

    def give(self, rows) -> None:
        with self._cv:
            self._free.extend(rows)
            self._cv.notify_all()


class Pending:
    """A block being dumped: its staging row, the shards written, and where its put stands."""
    __slots__ = ("row", "shards", "sums", "copying", "state", "publish", "discard", "waiters",
                 "server")

    def __init__(self, row: int, n_shards: int):
        self.row = row
        self.shards = np.zeros(n_shards, dtype=bool)
        self.sums = np.zeros(n_shards, dtype=np.uint64)  # each shard's checksum, taken as staged
        self.copying = 0          # copies into the row in flight
        self.state = "staging"    # staging -> putting -> stored | failed
        self.publish = False      # committed before the put landed: write the marker then
        self.discard = False      # commit(False) before the put landed
        self.waiters: list = []   # (task, index) of later dumps of a block already putting
        self.server = ""


class Part:
    """The outcome of one part of a dump task: blocks settle now (``ok``/``fail``) or when a
    put lands (``wait_for`` then ``landed``); the part finishes once all have settled and
    ``release`` was called."""

    def __init__(self, task: Task):
        self.task = task
        self._ok: list[int] = []
        self._errors: dict = {}
        self._open = 1
        self._lock = threading.Lock()

    def ok(self, i: int) -> None:
        self._ok.append(i)

    def fail(self, i: int, why: str) -> None:
        self._errors[i] = why

    def wait_for(self, p: "Pending", i: int) -> None:
        with self._lock:
            self._open += 1
        p.waiters.append((self, i))

    def landed(self, i: int, why: Optional[str]) -> None:
        with self._lock:
            if why is None:
                self._ok.append(i)
            else:
                self._errors[i] = f"put: {why}"
        self.release()

    def release(self) -> None:
        with self._lock:
            self._open -= 1
            done = self._open == 0
        if done:
            self.task.finish_part(self._ok, self._errors)
