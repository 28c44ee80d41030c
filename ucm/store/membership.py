"""Which server of a distributed tier holds a block, and whether a server is usable now.

* :func:`rendezvous`: each block goes to the server with the highest ``mix(block id,
  seed(server name))``. Every engine computes the same owner from the same names, in any order;
  each server gets an equal share; a server that joins takes ``1/(n+1)`` of the blocks, all
  from the others; a server that leaves hands over only its own
  (``benchmarks/bench_rendezvous.py``).
* :class:`Server`: one backend and its health. A failure leaves the server alone for a backoff
  that doubles up to ``MAX_BACKOFF_S``; requests meanwhile fail at once; the first request
  after it tries again, and a success ends the backoff.
"""
from __future__ import annotations

import hashlib
import logging
import threading
import time
from typing import Callable, Optional, Sequence

import numpy as np

from ucm.store.backends import Backend, Unavailable

log = logging.getLogger("ucm.store.remote")

MAX_BACKOFF_S = 30.0
_K1, _K2, _K3 = np.uint64(0x9E3779B97F4A7C15), np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)


# ---------------------------------------------------------------------------------------------
# rendezvous hashing

def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer, vectorised (uint64 arithmetic wraps)."""
    x = x ^ (x >> np.uint64(30))
    x = x * _K2
    x = x ^ (x >> np.uint64(27))
    x = x * _K3
    return x ^ (x >> np.uint64(31))


def server_seed(name: str) -> np.uint64:
    return np.uint64(int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "little"))


def rendezvous(ids: np.ndarray, names: Sequence[str]) -> np.ndarray:
    """Index into ``names`` of the server owning each block id (``uint64 [n, 2]``): the server
    with the highest score ``mix(id, seed(server))``. Depends only on the id and the set of
    names, so every engine computes the same owner."""
    if not len(names):
        raise ValueError("rendezvous: no servers to own the blocks (an empty list of names)")
    ids = np.asarray(ids, dtype=np.uint64).reshape(-1, 2)
    if len(names) == 1 or not len(ids):
        return np.zeros(len(ids), dtype=np.int64)
    with np.errstate(over="ignore"):
        key = _mix(ids[:, 0] ^ (ids[:, 1] * _K1))
        seeds = np.array([server_seed(n) for n in names], dtype=np.uint64)
        scores = _mix(key[:, None] ^ seeds[None, :])
    return np.argmax(scores, axis=1)


# ---------------------------------------------------------------------------------------------
# servers

class Server:
    """One backend and its health: after a failure, requests fail at once until ``down_until``."""

    def __init__(self, name: str, connect: Callable[[str], Backend], label: str):
        self.name = name
        self.label = label  # the name as logs and statistics show it (no credentials)
        self._connect = connect
        self.backend: Optional[Backend] = None
        self.down_until = 0.0
        self.backoff = 0.0
        self.lock = threading.Lock()
        self.last_error = ""

    def get(self, base_backoff: float) -> Backend:
        """The backend, connecting on first use; raises Unavailable while the server is down."""
        now = time.monotonic()
        if now < self.down_until:
            raise Unavailable(f"{self.label} is down ({self.last_error}); next try in "
                              f"{self.down_until - now:.2f} s")
        with self.lock:
            if self.backend is None:
                try:
                    self.backend = self._connect(self.name)
                except Unavailable as exc:
                    self.failed(exc, base_backoff)
                    raise
            return self.backend

    def failed(self, exc, base_backoff: float) -> None:
        self.backoff = min(MAX_BACKOFF_S, self.backoff * 2 if self.backoff else base_backoff)
        self.down_until = time.monotonic() + self.backoff
        self.last_error = str(exc)[:200]
        log.warning("ucm %s: server failed (%s); left alone for %.1f s", self.label, self.last_error,
                    self.backoff)

    def succeeded(self) -> None:
        if self.backoff:
            log.info("ucm %s: server back", self.label)
        self.backoff = 0.0
        self.down_until = 0.0

    def close(self) -> None:
        with self.lock:
            if self.backend is not None:
                try:
                    self.backend.close()
                except Exception:  # closing a dead connection must not fail a shutdown
                    pass
                self.backend = None
