"""What a distributed tier asks of one server of a key-value service (Redis, Mooncake Store, an
S3 bucket): whole values under string keys, in batches.

A :class:`Backend` is one independent server, or one cluster that routes keys itself (a Redis
Cluster). :class:`ucm.store.remote.RemoteStore` spreads blocks over several backends of one kind
(rendezvous hashing), writes the block header and checksums into every value, stages bytes in
host rows, and turns every failure here into a miss. So a backend only moves bytes:

* every method takes a batch and may be called from several I/O threads at once;
* a value is stored whole or not at all (a reader never gets a prefix of it);
* a server that cannot be reached, times out or refuses the credentials raises
  :class:`Unavailable` (the tier then leaves the server alone for a backoff and retries by
  itself); a per-key failure is reported per key instead.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Optional, Sequence


#: The slowest transfer rate a healthy server is expected to keep up (a busy server on the local
#: network, a WAN object store). A request that carries or returns ``n`` bytes may take
#: ``timeout_s + n / SLOW_SERVER_BYTES_PER_S`` before the server counts as down: the base
#: timeout alone would call a healthy server that takes a moment to move 16 MiB an outage.
SLOW_SERVER_BYTES_PER_S = 32 * 1024**2


def data_timeout(timeout_s: float, nbytes: int) -> float:
    """The timeout of a request that moves ``nbytes`` of values (module constant above)."""
    return timeout_s + nbytes / SLOW_SERVER_BYTES_PER_S


class Unavailable(Exception):
    """The server cannot serve now (connection refused or lost, timeout, authentication)."""


class Backend(ABC):
    #: label in logs and statistics, without credentials (``redis://127.0.0.1:6379/0``)
    name: str = "backend"
    #: the largest value the server accepts (``None``: no limit of ucm's concern)
    max_value_bytes: Optional[int] = None
    #: ``get`` reads into the host rows it is given (zero copy into registered memory); when
    #: False it returns buffers of its own and the rows are not allocated for loads
    reads_into_rows: bool = False

    def register(self, base: int, nbytes: int) -> None:
        """The tier's staging slab (host memory that every ``put`` value and every ``get`` row
        lies in), once, before any I/O: a backend with zero-copy transfers registers it."""

    @abstractmethod
    def put(self, keys: Sequence[str], values: Sequence[memoryview]) -> list[Optional[str]]:
        """Store ``values[i]`` under ``keys[i]`` (replacing an older value or keeping it: both
        are whole values of the same content-addressed block). Per key ``None`` (stored) or
        the reason it was not."""

    @abstractmethod
    def get(self, keys: Sequence[str], rows: Sequence[Optional[memoryview]]) -> list:
        """The value of each key: a bytes-like object (``rows[i]`` itself, or a prefix of it,
        when the backend reads into rows), ``None`` when the key is missing, or an
        :class:`Unavailable` for a key whose part of the service failed alone (a cluster node).
        A value whose length differs from what the tier expects is returned as it is (the tier
        rejects it)."""

    def get_committed(self, keys: Sequence[str], markers: Sequence[str],
                      rows: Sequence[Optional[memoryview]]) -> list:
        """``get`` of the keys whose marker exists (``None`` for the others). This default asks
        for the markers first and reads only the values they cover; a backend that can send
        both in one round trip overrides it."""
        found = self.exists(markers)
        out: list = [None] * len(keys)
        idx = [i for i, f in enumerate(found) if f]
        if idx:
            got = self.get([keys[i] for i in idx], None if rows is None else [rows[i] for i in idx])
            for i, v in zip(idx, got):
                out[i] = v
        return out

    @abstractmethod
    def exists(self, keys: Sequence[str]) -> list[bool]:
        """For each key: is a value stored under it? (False where the part of the service
        holding it failed alone.)"""

    @abstractmethod
    def delete(self, keys: Sequence[str]) -> None:
        """Remove the keys (missing keys are not an error)."""

    def ping(self) -> None:
        """Raise :class:`Unavailable` unless the server answers (checked when a tier opens)."""
        self.exists([])

    def keys(self, prefix: str):
        """Iterate over the stored keys that start with ``prefix`` (maintenance: ``ucm store``
        listings, tests). Optional."""
        raise NotImplementedError(f"{type(self).__name__} cannot list its keys")

    def close(self) -> None:
        """Release connections."""
