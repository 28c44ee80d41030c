"""A pool of reusable byte buffers (staging for transfers and codecs).

Fresh host buffers cost page faults on first touch, often more than the copy they stage, so a
buffer whose work ended goes back to a pool and the next transfer of at most its size takes it.
"""
from __future__ import annotations

import threading
from typing import Callable, Optional


class BufferPool:
    """``take(nbytes)``: a free buffer of at least ``nbytes`` (1-D uint8 tensor), else a new one
    of ``max(nbytes, min_bytes)`` from ``alloc``; ``give(buf)``: back to the pool (at most
    ``keep`` are kept; None: all). Thread-safe."""

    def __init__(self, alloc: Callable[[int], "object"], keep: Optional[int] = None,
                 min_bytes: int = 1 << 20):
        self._alloc = alloc
        self._keep = keep
        self._min = min_bytes
        self._free: list = []
        self._lock = threading.Lock()

    def take(self, nbytes: int):
        with self._lock:
            for i, buf in enumerate(self._free):
                if buf.numel() >= nbytes:
                    return self._free.pop(i)
        return self._alloc(max(nbytes, self._min, 1))

    def give(self, buf) -> None:
        with self._lock:
            if any(b is buf for b in self._free):
                return  # given back twice: one pooled copy, or two takers would share it
            if self._keep is None or len(self._free) < self._keep:
                self._free.append(buf)

    def __len__(self) -> int:
        with self._lock:
            return len(self._free)
