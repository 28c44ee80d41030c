"""``mooncake`` tier: blocks in Mooncake Stores (``mooncake.store.MooncakeDistributedStore``).

Each entry of ``store.mooncake.masters`` is one ``mooncake_master``: one independent Mooncake
Store, one :class:`MooncakeBackend`; blocks spread over them by rendezvous hashing
(``ucm.store.remote``). The engine process is a client of each store and by default lends it no
memory (``store.mooncake.global_segment_size`` 0): the memory that holds the values belongs to
separate ``mooncake_client`` storage-node processes (``--global_segment_size``), which outlive
engine restarts. All masters share ``store.mooncake.metadata_server``: ``P2PHANDSHAKE`` (no
metadata server), etcd, or one HTTP metadata server. A master's built-in HTTP metadata server
answers only while that master runs, so it suits a single master.

Transfers are zero copy: the tier's staging slab is registered with every store
(``register_buffer``); values are put from their staging rows (``batch_put_from``) and read into
the rows the tier gives (``batch_get_into``). Values outside the slab (commit markers, the
generation: a few bytes) go through the client's local buffer (``put_batch``,
``batch_get_buffer``). It is sized to hold one batch of whole values, so that a read without
rows (the tier's first read from a master it has not connected to yet) still works.

Mooncake's rules and what this tier does with them
---------------------------------------------------
* A ``put`` of a key that exists succeeds and keeps the stored value; ``upsert`` overwrites the
  value in place, and reads concurrent with an upsert can return a mix of the old and the new
  value (seen with Mooncake 0.3.13). Puts
  never change a stored value, and two clients putting the same key at once left one whole value
  (200 races, no mix). So the tier puts and never upserts: every value under a key is a whole
  value of the same content-addressed block, and a reader must never see a value change under
  it. A value that is bad anyway (written by something else) fails verification on its first
  read and is deleted; the next save stores it again.
* A read takes a lease on the value (the master's ``--default_kv_lease_ttl``, 10 s by default)
  during which a plain ``remove`` fails (``OBJECT_HAS_LEASE``). The tier deletes only values it
  has just read and found bad, so deletes are forced. A reader that was copying the same value at
  that moment may get bytes of a later value, which its checksums reject.
* A missing key reads as empty bytes through ``get`` and as ``OBJECT_NOT_FOUND`` through
  ``batch_get_into``: both are misses here. A value longer than the row it is read into fails
  (``INVALID_PARAMS``) and is returned empty, so the tier rejects it as corrupt.
* A value put from memory that was not registered fails; so do plain ``put``/``get`` of a value
  larger than the client's local buffer. Values outside the slab are therefore small by design.
* An empty value cannot be stored.
* A ``batch_get_into`` that names a key twice reads it into the last of its buffers only, and
  reports every one of them as read: the others keep what they held (another block's value).
* A client fails the transfers past about 2048 keys in flight at once (``TRANSFER_FAIL``, at
  times only after a 60 s wait), whether they come in one request or in requests of several
  threads. So requests that move values go in slices of at most ``MAX_KEYS_IN_FLIGHT`` keys,
  each waiting until it fits in what the client has in flight.

Puts and reads of several threads run at once (the client is thread-safe): with the tier's
puts serialised per master, a 128-block dump took the time of one thread putting alone, about
0.7x the raw client on four threads (benchmarks/bench_remote.py, 2-core VM).

Failures
--------
A master that cannot be reached makes an operation fail with ``RPC_FAIL`` (:class:`Unavailable`
here; the tier then leaves the master alone for ``store.remote.backoff_s``). Only the first
request after the connection broke fails at once: the client's later requests reconnect, which
takes seconds before they fail, and so does ``setup`` with a master down. So after a failure,
and before connecting, the backend first opens a TCP connection to the master itself
(``store.remote.timeout_s``); while that fails, requests fail at once. When the master comes back
the client reconnects by itself (the first request takes about 1 s) and the storage nodes mount
their memory again; the values the old master knew are gone (misses). The client's requests
have no deadline of ours: a master that stops answering without closing its connections stalls
them for as long as Mooncake waits.

Environment: ``MC_STORE_CLIENT_SETUP_RETRIES=1`` (a master that is down fails ``setup`` in
seconds, not after 90 s of retries) and, when ``store.mooncake.local_hostname`` is a loopback
address, ``MC_TCP_BIND_ADDRESS=127.0.0.1`` (the address of Mooncake's TCP transport) are set
unless already set: a user's values win. Mooncake 0.3.13 opens the transfer engine's listening
sockets (its RPC and TCP-transport ports) on every interface whatever this says: where that
matters, a firewall must keep them private.
"""
from __future__ import annotations

import ctypes
import ipaddress
import logging
import os
import socket
import threading
from typing import Optional, Sequence

import numpy as np

from ucm.config import ConfigError
from ucm.store.backends import Backend, Unavailable
from ucm.store.base import BlockGeometry
from ucm.store.format import header_size
from ucm.store.remote import VALUE_ALIGN, RemoteStore, remote_options

log = logging.getLogger("ucm.store.mooncake")

# Mooncake Store error codes (mooncake-store/include/types.h)
OK = 0
BUFFER_OVERFLOW = -10
NO_AVAILABLE_HANDLE = -200
INVALID_PARAMS = -600
OBJECT_NOT_FOUND = -704
OBJECT_ALREADY_EXISTS = -705
OBJECT_HAS_LEASE = -706
TRANSFER_FAIL = -800
RPC_FAIL = -900
UNAVAILABLE_IN_CURRENT_STATUS = -1010
UNAVAILABLE_IN_CURRENT_MODE = -1011
#: codes that mean the master cannot serve (not a fault of one key)
MASTER_DOWN = frozenset({RPC_FAIL, UNAVAILABLE_IN_CURRENT_STATUS, UNAVAILABLE_IN_CURRENT_MODE})
_NAMES = {BUFFER_OVERFLOW: "BUFFER_OVERFLOW", NO_AVAILABLE_HANDLE: "NO_AVAILABLE_HANDLE (store full)",
          INVALID_PARAMS: "INVALID_PARAMS", -703: "REPLICA_IS_NOT_READY",
          OBJECT_NOT_FOUND: "OBJECT_NOT_FOUND", OBJECT_ALREADY_EXISTS: "OBJECT_ALREADY_EXISTS",
          OBJECT_HAS_LEASE: "OBJECT_HAS_LEASE", -707: "LEASE_EXPIRED",
          TRANSFER_FAIL: "TRANSFER_FAIL", RPC_FAIL: "RPC_FAIL", -1: "INTERNAL_ERROR",
          UNAVAILABLE_IN_CURRENT_STATUS: "UNAVAILABLE_IN_CURRENT_STATUS",
          UNAVAILABLE_IN_CURRENT_MODE: "UNAVAILABLE_IN_CURRENT_MODE"}
#: the smallest local buffer a client gets (values outside the staging slab pass through it)
MIN_LOCAL_BUFFER = 16 << 20
#: keys one client has in transfer at once, at most (module doc: half of Mooncake's limit)
MAX_KEYS_IN_FLIGHT = 1024
PING_KEY = "ucm/ping"


def code_name(rc: int) -> str:
    return f"{rc} ({_NAMES.get(rc, 'error')})"


def _mooncake():
    try:
        from mooncake import store
    except ImportError as exc:
        raise ConfigError("config key 'store.pipeline': the mooncake tier needs the Mooncake "
                          "transfer engine (pip install mooncake-transfer-engine-non-cuda, or "
                          f"mooncake-transfer-engine on CUDA machines): {exc}") from exc
    return store


def parse_address(text: str, key: str) -> tuple[str, int]:
    """``host:port`` (``[v6]:port`` for IPv6) of a master; ConfigError naming ``key``."""
    host, sep, port = text.strip().rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    # ASCII digits only: str.isdigit also takes digits that int() refuses ('²') or that
    # Mooncake does not read ('５')
    ok = bool(sep and host and port.isascii() and port.isdigit() and 0 < int(port) < 65536)
    if not ok or any(c in host for c in "/@ "):
        raise ConfigError(f"config key {key!r}: {text!r} is not a mooncake_master address "
                          "(expected host:port, e.g. 127.0.0.1:50051)")
    return host, int(port)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def set_default_environment(local_hostname: str) -> None:
    """Mooncake's environment defaults for this tier, unless the user set them (module doc)."""
    os.environ.setdefault("MC_STORE_CLIENT_SETUP_RETRIES", "1")
    if is_loopback(local_hostname):
        os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")


def _address(view) -> int:
    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data)


class MooncakeBackend(Backend):
    """One client of one Mooncake Store (one ``mooncake_master``)."""

    reads_into_rows = True

    def __init__(self, master: str, *, metadata_server: str = "P2PHANDSHAKE",
                 protocol: str = "tcp", device_name: str = "", local_hostname: str = "127.0.0.1",
                 global_segment_size: int = 0, local_buffer_size: int = MIN_LOCAL_BUFFER,
                 replicas: int = 1, timeout_s: float = 0.2, key: str = "store.mooncake.masters"):
        self.name = f"mooncake://{master}"
        self._addr = parse_address(master, key)
        self._timeout_s = float(timeout_s)
        self._suspect = True      # probe the master before the next request (module doc)
        self._slab: Optional[tuple[int, int]] = None
        self._lock = threading.Lock()
        self._flight = threading.Condition()
        self._flying = 0  # keys of this client's requests in transfer now
        self._probe()
        set_default_environment(local_hostname)
        mc = _mooncake()
        self.client = mc.MooncakeDistributedStore()
        rc = self.client.setup(local_hostname, metadata_server, int(global_segment_size),
                               int(local_buffer_size), protocol, device_name, master)
        if rc != 0:
            self._close_client()
            raise Unavailable(f"{self.name}: client setup failed ({code_name(rc)}; metadata "
                              f"server {metadata_server})")
        self._config = mc.ReplicateConfig()
        self._config.replica_num = int(replicas)
        self._suspect = False

    # -- health ---------------------------------------------------------------------------------
    def _probe(self) -> None:
        """Unavailable unless the master accepts a TCP connection within the timeout."""
        try:
            with socket.create_connection(self._addr, timeout=self._timeout_s):
                pass
        except OSError as exc:
            self._suspect = True
            raise Unavailable(f"{self.name}: {exc}") from None

    def _before(self) -> None:
        if self._suspect:
            self._probe()

    def _after(self, codes) -> None:
        """Unavailable when the master failed the request; else the master is known good."""
        down = [c for c in codes if c in MASTER_DOWN]
        if down:
            self._suspect = True
            raise Unavailable(f"{self.name}: {code_name(down[0])}")
        self._suspect = False

    def _transfer(self, n: int, fn) -> list:
        """``fn(lo, hi)`` for the slices ``[lo, hi)`` of ``n`` keys, at most
        ``MAX_KEYS_IN_FLIGHT`` each, each once it fits in what this client has in flight
        (module doc); their results in order."""
        out = []
        for lo in range(0, n, MAX_KEYS_IN_FLIGHT):
            k = min(n - lo, MAX_KEYS_IN_FLIGHT)
            with self._flight:
                while self._flying + k > MAX_KEYS_IN_FLIGHT:
                    self._flight.wait()
                self._flying += k
            try:
                out.append(fn(lo, lo + k))
            finally:
                with self._flight:
                    self._flying -= k
                    self._flight.notify_all()
        return out

    # -- Backend --------------------------------------------------------------------------------
    def register(self, base: int, nbytes: int) -> None:
        with self._lock:
            if self._slab is not None and self._slab[0] == base:
                return
            rc = self.client.register_buffer(int(base), int(nbytes))
            if rc != 0:
                raise RuntimeError(f"{self.name}: register_buffer of {nbytes} bytes failed "
                                   f"({code_name(rc)})")
            self._slab = (int(base), int(base) + int(nbytes))

    def _in_slab(self, view) -> Optional[int]:
        """Address of ``view`` when it lies in the registered slab, else None."""
        if self._slab is None or not len(view):
            return None
        addr = _address(view)
        return addr if self._slab[0] <= addr and addr + len(view) <= self._slab[1] else None

    def put(self, keys: Sequence[str], values: Sequence[memoryview]) -> list[Optional[str]]:
        out: list[Optional[str]] = [None] * len(keys)
        if not keys:
            return out
        self._before()
        direct, small = [], []
        for i, v in enumerate(values):
            addr = self._in_slab(v)
            (direct if addr is not None else small).append((i, addr))
        codes = []
        if direct:
            ks, addrs = [keys[i] for i, _ in direct], [a for _, a in direct]
            sizes = [len(values[i]) for i, _ in direct]
            rcs = [rc for part in self._transfer(len(ks), lambda lo, hi: self.client.batch_put_from(
                ks[lo:hi], addrs[lo:hi], sizes[lo:hi], self._config)) for rc in part]
            codes += rcs
            for (i, _), rc in zip(direct, rcs):
                out[i] = _put_reason(rc)
        if small:
            ks, vs = [keys[i] for i, _ in small], [bytes(values[i]) for i, _ in small]
            # one code per request
            rcs = self._transfer(len(ks), lambda lo, hi: self.client.put_batch(
                ks[lo:hi], vs[lo:hi], self._config))
            codes += rcs
            for j, (i, _) in enumerate(small):
                out[i] = _put_reason(rcs[j // MAX_KEYS_IN_FLIGHT])
        self._after(codes)
        return out

    def get(self, keys: Sequence[str], rows: Sequence[Optional[memoryview]]) -> list:
        out: list = [None] * len(keys)
        if not keys:
            return out
        self._before()
        rows = rows if rows is not None else [None] * len(keys)
        direct = [(i, self._in_slab(rows[i])) for i in range(len(keys)) if rows[i] is not None]
        direct = [(i, a) for i, a in direct if a is not None]
        rest = sorted(set(range(len(keys))) - {i for i, _ in direct})
        # each key is read once: a request that names a key twice fills only the last of its
        # rows and reports every one as read (module doc); the others share that value
        first: dict[str, int] = {}
        twice = [i for i, _ in direct if first.setdefault(keys[i], i) != i]
        direct = [(i, a) for i, a in direct if first[keys[i]] == i]
        codes = []
        if direct:
            ks, addrs = [keys[i] for i, _ in direct], [a for _, a in direct]
            sizes = [len(rows[i]) for i, _ in direct]
            rcs = [n for part in self._transfer(len(ks), lambda lo, hi: self.client.batch_get_into(
                ks[lo:hi], addrs[lo:hi], sizes[lo:hi])) for n in part]
            codes += rcs
            for (i, _), n in zip(direct, rcs):
                if n > 0:
                    out[i] = memoryview(rows[i])[:n]
                elif n == INVALID_PARAMS:  # longer than the row: not a value of this tier
                    out[i] = memoryview(b"")
                elif n not in (0, OBJECT_NOT_FOUND) and n not in MASTER_DOWN:
                    log.debug("ucm mooncake: %s: read of %s failed: %s", self.name, keys[i],
                              code_name(n))
            for i in twice:
                out[i] = out[first[keys[i]]]
        unreadable = []
        if rest:
            values, rest_codes, unreadable = self._get_copies([keys[i] for i in rest])
            codes += rest_codes
            for i, v in zip(rest, values):
                out[i] = v
        self._after(codes)
        if unreadable:
            raise RuntimeError(f"{self.name}: stored but not readable through the local buffer: "
                               f"{unreadable[:3]}")
        return out

    def _get_copies(self, keys: list[str]) -> tuple[list, list, list]:
        """Values read through the client's local buffer (copies), the codes of the check of
        those that read as nothing, and the keys among them that exist all the same."""
        def copies(lo: int, hi: int) -> list:
            handles = self.client.batch_get_buffer(keys[lo:hi])
            # the handles go when this returns, giving their space in the local buffer back
            return [None if h is None else ctypes.string_at(h.ptr(), h.size()) for h in handles]

        values = [v for part in self._transfer(len(keys), copies) for v in part]
        missing = [k for k, v in zip(keys, values) if v is None]
        if not missing:
            return values, [], []
        found = list(self.client.batch_is_exist(missing))
        return values, found, [k for k, f in zip(missing, found) if f == 1]

    def exists(self, keys: Sequence[str]) -> list[bool]:
        if not keys:
            return []
        self._before()
        found = self.client.batch_is_exist(list(keys))
        self._after(found)
        bad = [f for f in found if f < 0]
        if bad:
            raise RuntimeError(f"{self.name}: exists failed: {code_name(bad[0])}")
        return [f == 1 for f in found]

    def delete(self, keys: Sequence[str]) -> None:
        if not keys:
            return
        self._before()
        # forced: a read holds a lease on the value that a plain remove waits out (module doc)
        rcs = self.client.batch_remove(list(keys), True)
        self._after(rcs)
        bad = [(k, rc) for k, rc in zip(keys, rcs) if rc not in (OK, OBJECT_NOT_FOUND)]
        if bad:
            raise RuntimeError(f"{self.name}: remove of {bad[0][0]} failed: {code_name(bad[0][1])}")

    def ping(self) -> None:
        self._probe()
        self.exists([PING_KEY])

    def close(self) -> None:
        with self._lock:
            slab, self._slab = self._slab, None
        if slab is not None:
            try:
                self.client.unregister_buffer(slab[0])
            except Exception:  # closing must not fail a shutdown
                pass
        self._close_client()

    def _close_client(self) -> None:
        client, self.client = getattr(self, "client", None), None
        if client is not None:
            try:
                client.close()
            except Exception:
                pass


def _put_reason(rc: int) -> Optional[str]:
    # an existing key keeps its value: a whole value of the same block (module doc)
    return None if rc in (OK, OBJECT_ALREADY_EXISTS) else f"mooncake put: {code_name(rc)}"


class MooncakeStore(RemoteStore):
    name = "mooncake"

    @classmethod
    def from_config(cls, geometry: BlockGeometry, config, namespace: bytes,
                    codec: int = 0) -> "MooncakeStore":
        servers_file = config["store.mooncake.servers_file"]
        key = "store.mooncake.servers_file" if servers_file else "store.mooncake.masters"
        if servers_file:
            try:
                with open(servers_file) as f:
                    masters = [ln.strip() for ln in f if ln.strip() and not ln.lstrip().startswith("#")]
            except OSError as exc:
                raise ConfigError(f"config key {key!r}: cannot read {servers_file!r}: {exc}") from None
            if not masters:
                raise ConfigError(f"config key {key!r}: {servers_file!r} lists no master")
        else:
            masters = config["store.mooncake.masters"]
        for m in masters:
            parse_address(m, key)
        metadata = config["store.mooncake.metadata_server"].strip()
        if not metadata:
            raise ConfigError("config key 'store.mooncake.metadata_server': empty (use "
                              "P2PHANDSHAKE when there is no metadata server)")
        _mooncake()
        value_bytes = header_size(geometry.n_shards, VALUE_ALIGN) + geometry.block_bytes
        batch = max(1, config["store.remote.batch_bytes"] // value_bytes) * value_bytes
        opts = dict(metadata_server=metadata, protocol=config["store.mooncake.protocol"],
                    device_name=config["store.mooncake.device_name"],
                    local_hostname=config["store.mooncake.local_hostname"],
                    global_segment_size=config["store.mooncake.global_segment_size"],
                    local_buffer_size=max(MIN_LOCAL_BUFFER, -(-batch // (1 << 20)) << 20),
                    replicas=config["store.mooncake.replicas"],
                    timeout_s=config["store.remote.timeout_s"], key=key)

        def connect(master: str) -> MooncakeBackend:
            try:
                return MooncakeBackend(master, **opts)
            except ConfigError as exc:  # a bad line in a servers file read later
                raise Unavailable(str(exc)) from None

        store = cls(geometry, masters, connect, namespace=namespace, codec=codec, servers_file=servers_file,
                    **remote_options(config))
        store.check_reachable(key)
        return store
