"""Tiers on servers shared by many engines (Redis, Mooncake Store, S3): the store contract over
:class:`ucm.store.backends.Backend` servers.

Consistency protocol (every distributed tier)
---------------------------------------------
A block ``B`` of namespace ``N`` lives under two keys on one server:

* ``V(N, B)``: the value, one whole object: a block header (``ucm.store.format``, padded to
  64 bytes: magic, version, namespace, id, codec, geometry, a checksum per shard and of the
  header itself) followed by the payload. Written by ``dump`` once every shard of the block is
  staged, in one put, so it is never partial on the server;
* ``M(N, B)``: the commit marker, written by ``commit(True)`` only after the put of ``V`` was
  acknowledged (a commit that arrives while the put is in flight is applied when it lands).

``lookup`` reports a block only when both keys exist, and ``load`` reads only values whose
marker exists. A reader verifies the header (namespace,
id, codec, geometry, header checksum) and the checksum of every shard it reads; a value that
fails is a miss, counted as ``quarantined``, and both keys are deleted. Two nodes writing the
same content-addressed block race harmlessly: each put replaces a whole value with a whole value
of the same block, each marker says the same thing. A value whose marker was never written (a
writer that died, a ``commit(False)``) is never reported; the server's eviction or TTL reclaims
it.

Servers, load balancing, faults
-------------------------------
Blocks spread over the servers of a tier by rendezvous hashing of the block id: each server gets
an equal share, a server that joins takes ``1/(n+1)`` of the blocks from the others, a server
that leaves hands only its own blocks over. The list comes from the configuration or from a
file re-read when it changes, so the pool grows or shrinks without an engine restart (blocks
that move are misses until saved again). A server that fails a request (connection refused,
timeout, bad credentials) is left alone for a backoff that doubles up to 30 s: meanwhile its
blocks are misses at once, then the next request tries it again, so the tier recovers by
itself when the server comes back.

Bytes move through a staging slab of host rows (one value each) allocated once: dumps copy
their shards into a row until the block is complete, loads read into a row when the backend
reads in place (Mooncake's registered memory); the slab is handed to the backends to register.
"""
from __future__ import annotations

import logging
import os
from collections import OrderedDict
import threading
import time
from typing import Callable, Optional, Sequence

import numpy as np

from ucm import threads
from ucm.config import ConfigError
from ucm.ids import as_ids, id_bytes, id_hex
from ucm.ops import checksum, checksum_units, copy_checksum_units
from ucm.store.backends import Backend, Unavailable
from ucm.store.base import BlockBuffers, BlockGeometry, KVStore, Task
from ucm.store.format import BadBlock, Header, header_size, parse
from ucm.store.membership import Server, rendezvous
from ucm.store.remote_staging import Part as _Part, Pending as _Pending, Staging as _Staging

log = logging.getLogger("ucm.store.remote")

VALUE_ALIGN = 64           # header padding and staging row alignment
MARKER = b"\x01"
ROW_WAIT_S = 2.0           # longest wait of a dump or load for free staging rows


# ---------------------------------------------------------------------------------------------
# the tier

class RemoteStore(KVStore):
    """A tier on one kind of key-value server (module docstring). Subclasses give ``name`` and
    ``from_config``; ``connect(server_name) -> Backend`` opens one server."""

    name = "remote"
    #: key of a value or marker: ``kind`` is ``v`` or ``m``; Redis puts ``{ns:id}`` in braces
    #: (its cluster hash tag) so both keys of a block live on one node
    key_format = "{prefix}/{ns}/{id}.{kind}"

    def __init__(self, geometry: BlockGeometry, servers: Sequence[str],
                 connect: Callable[[str], Backend], *, namespace: bytes = bytes(16),
                 key_prefix: str = "ucm", servers_file: str = "", timeout_s: float = 0.2,
                 backoff_s: float = 1.0, staging_bytes: int = 256 << 20,
                 batch_bytes: int = 16 << 20, io_threads: int = 4, wait_timeout_s: float = 30.0,
                 codec: int = 0):
        super().__init__(geometry, wait_timeout_s, namespace)
        self.codec = int(codec)  # recorded in every value's header; another codec is a miss
        self._connect = connect
        self.key_prefix = key_prefix
        self.timeout_s = float(timeout_s)
        self.backoff_s = float(backoff_s)
        self.header_bytes = header_size(geometry.n_shards, VALUE_ALIGN)
        self.value_bytes = self.header_bytes + geometry.block_bytes
        self.row_bytes = -(-self.value_bytes // VALUE_ALIGN) * VALUE_ALIGN
        self.n_rows = max(4, int(staging_bytes) // self.row_bytes)
        # a batch is at most a quarter of the staging rows, so a dump larger than the staging
        # flows through it (later parts take the rows that earlier puts gave back)
        self.batch_blocks = max(1, min(int(batch_bytes) // self.value_bytes, self.n_rows // 4))
        self._ns_hex = self.namespace.hex()
        self._lock = threading.Lock()
        self._servers: dict[str, Server] = {}
        self._names: list[str] = []
        self._retired: list[Server] = []
        self._servers_file = servers_file
        self._file_state = None
        self._file_checked = 0.0
        self._staging: Optional[_Staging] = None
        self._pending: dict[bytes, _Pending] = {}
        self._putting = 0  # blocks whose put is in flight (their rows come back by themselves)
        self._recent: "OrderedDict[bytes, np.ndarray]" = OrderedDict()  # see _remember
        self._recent_cap = max(self.n_rows // 4, 1) * geometry.block_bytes
        self._exec = threads.pool(io_threads, f"ucm-{self.name}")
        # puts run apart from dumps and loads, so rows held by staged blocks come back while
        # dump parts wait for rows
        self._put_exec = threads.pool(io_threads, f"ucm-{self.name}-put")
        self.set_servers(self._read_servers_file() if servers_file else servers)

    # -- membership ---------------------------------------------------------------------------
    def set_servers(self, names: Sequence[str]) -> None:
        """Serve from these servers from now on (joins connect lazily; leavers are closed when
        the store closes, after requests in flight finished with them)."""
        names = [n.strip() for n in names if n.strip()]
        if not names:
            raise ValueError(f"{self.name}: at least one server")
        with self._lock:
            for n in names:
                if n not in self._servers:
                    self._servers[n] = Server(n, self._connect_registered, self.label(n))
            for n in list(self._servers):
                if n not in names:
                    self._retired.append(self._servers.pop(n))
            self._names = list(dict.fromkeys(names))
        log.info("ucm %s: servers %s", self.name, ", ".join(map(self.label, self._names)))

    @staticmethod
    def label(server: str) -> str:
        """A server's name as logs and statistics show it (a tier whose names can carry
        credentials strips them)."""
        return server

    def servers(self) -> list[str]:
        self._poll_servers_file()
        with self._lock:
            return list(self._names)

    def _read_servers_file(self) -> list[str]:
        with open(self._servers_file) as f:
            return [ln.strip() for ln in f if ln.strip() and not ln.lstrip().startswith("#")]

    def _poll_servers_file(self) -> None:
        if not self._servers_file or time.monotonic() - self._file_checked < 1.0:
            return
        self._file_checked = time.monotonic()
        try:
            st = os.stat(self._servers_file)
            state = (st.st_mtime_ns, st.st_size, st.st_ino)
            if state == self._file_state:
                return
            names = self._read_servers_file()
        except (OSError, ValueError) as exc:  # ValueError: bytes that are not UTF-8 (a file
            # caught mid-write): keep the pool as it is, read it again when it changes
            log.warning("ucm %s: cannot read servers file %s (%s); keeping %s", self.name,
                        self._servers_file, exc, [self.label(n) for n in self._names])
            return
        self._file_state = state
        if names and names != self._names:
            self.set_servers(names)

    def _connect_registered(self, name: str) -> Backend:
        backend = self._connect(name)
        st = self._staging
        if st is not None:
            backend.register(int(st.slab.ctypes.data), st.slab.nbytes)
        return backend

    def _route(self, ids: np.ndarray) -> dict[str, np.ndarray]:
        """Row indices of ``ids`` per owning server."""
        names = self.servers()
        owner = rendezvous(ids, names)
        return {names[k]: np.flatnonzero(owner == k) for k in np.unique(owner)}

    def _call(self, server: str, fn: Callable[[Backend], object]):
        """``fn(backend)`` on a server; Unavailable (now or raised by fn) marks it down."""
        with self._lock:
            srv = self._servers.get(server)
        if srv is None:
            raise Unavailable(f"{self.label(server)} left the pool")
        backend = srv.get(self.backoff_s)
        try:
            out = fn(backend)
        except Unavailable as exc:
            srv.failed(exc, self.backoff_s)
            raise
        srv.succeeded()
        return out

    def check_reachable(self, key: str) -> None:
        """At open: a ConfigError naming ``key`` when no server answers (the store is closed);
        a warning for each server that does not while others do."""
        answers = self.ping()
        down = {n: why for n, why in answers.items() if why}
        if len(down) == len(answers):
            self.close()
            raise ConfigError(f"config key {key!r}: no {self.name} server reachable: " + "; ".join(
                f"{n} ({why})" for n, why in down.items()))
        for n, why in down.items():
            log.warning("ucm %s: server %s (config key %r) not reachable at start: %s", self.name,
                        n, key, why)
        with self._lock:
            limits = [(s.label, s.backend.max_value_bytes) for s in self._servers.values()
                      if s.backend is not None and s.backend.max_value_bytes]
        for label, limit in limits:
            if self.value_bytes > limit:
                self.close()
                raise ConfigError(f"config key {key!r}: {label} takes values of at most {limit} "
                                  f"bytes; a block here is {self.value_bytes} bytes with its header "
                                  f"(use smaller blocks or another tier)")

    def ping(self) -> dict[str, str]:
        """``{server: ""}`` for each server that answers, else the reason it does not."""
        out = {}
        for name in self.servers():
            try:
                self._call(name, lambda b: b.ping())
                out[self.label(name)] = ""
            except Exception as exc:
                out[self.label(name)] = str(exc) or type(exc).__name__
                continue
        return out

    # -- keys -------------------------------------------------------------------------------------
    def _keys(self, ids: np.ndarray, kind: str) -> list[str]:
        return [self.key_format.format(prefix=self.key_prefix, ns=self._ns_hex, id=h, kind=kind)
                for h in id_hex(ids)]

    # -- staging ------------------------------------------------------------------------------
    def prepare(self) -> None:
        self._rows()

    def _rows(self) -> _Staging:
        with self._lock:
            if self._staging is None:
                self._staging = _Staging(self.n_rows, self.row_bytes)
                base, size = int(self._staging.slab.ctypes.data), self._staging.slab.nbytes
                for srv in self._servers.values():
                    if srv.backend is not None:
                        srv.backend.register(base, size)
            return self._staging

    def _row(self, r: int) -> np.ndarray:
        return self._staging.slab[r, :self.value_bytes]

    # -- lookup -------------------------------------------------------------------------------
    def lookup(self, block_ids) -> list[bool]:
        ids = as_ids(block_ids, "block_ids")
        hit = np.zeros(len(ids), dtype=bool)
        for server, rows in self._route(ids).items():
            sub = ids[rows]
            keys = self._keys(sub, "v") + self._keys(sub, "m")
            try:
                found = np.asarray(self._call(server, lambda b: b.exists(keys)), dtype=bool)
                hit[rows] = found[:len(rows)] & found[len(rows):]
            except Exception as exc:
                self._count_failure(exc)
        n_hit = int(hit.sum())
        self._stats.add(lookups=len(ids), hits=n_hit, misses=len(ids) - n_hit)
        return hit.tolist()

    def _count_failure(self, exc) -> None:
        if isinstance(exc, Unavailable):
            self._stats.add(unavailable=1)
        else:
            self._stats.add(io_errors=1)
            log.warning("ucm %s: request failed: %r", self.name, exc)

    # -- load -----------------------------------------------------------------------------------
    def _load(self, ids, offset, bufs: BlockBuffers, shards) -> Task:
        task = Task("load", ids)
        for server, rows in self._route(ids).items():
            for start in range(0, len(rows), self.batch_blocks):
                part = rows[start:start + self.batch_blocks]
                task.add_part()
                self._submit(self._load_part, task, server, ids, part, offset, bufs, shards)
        return task.seal()

    def _submit(self, fn, *args) -> None:
        """``fn(*args)`` on the load/dump executor. A call that passed the closed check just
        before another thread's close() finds the executor shut down: the closed store's
        error, not the executor's."""
        try:
            self._exec.submit(fn, *args)
        except RuntimeError:
            if self._closed:
                raise ValueError(f"{self.name}: store is closed") from None
            raise

    def _load_part(self, task: Task, server, ids, part, offset, bufs: BlockBuffers, shards) -> None:
        t0 = time.perf_counter()
        ok, errors, nbytes, rows = [], {}, 0, None
        span = len(shards) * self.geometry.shard_bytes
        partial = len(shards) < self.geometry.n_shards
        try:
            if partial:  # layer by layer: the blocks whose whole value an earlier layer fetched
                fetch = []
                for i in part:
                    if self._copy_recent(ids[i], i, offset, bufs, shards):
                        ok.append(i)
                        nbytes += span
                    else:
                        fetch.append(i)
                part = np.asarray(fetch, dtype=np.int64)
            backend_rows = None
            if len(part) and self._reads_into_rows(server):
                rows = self._rows().take(len(part), ROW_WAIT_S)
                if rows is None:
                    raise RuntimeError("staging rows busy")
                backend_rows = [memoryview(self._row(r)) for r in rows]
            keys, marks = self._keys(ids[part], "v"), self._keys(ids[part], "m")
            values = self._call(server, lambda b: b.get_committed(keys, marks, backend_rows)) \
                if len(part) else []
            bad = []
            for j, i in enumerate(part):
                why = self._verify_copy(values[j], ids[i], i, offset, bufs, shards, keep=partial)
                if why is None:
                    ok.append(i)
                    nbytes += span
                else:
                    errors[int(i)] = why
                    if why.startswith("corrupt"):
                        bad.append(i)
            if bad:
                self._quarantine(server, ids[np.asarray(bad)])
        except Exception as exc:
            self._count_failure(exc)
            errors.update({int(i): f"{self.name} {self.label(server)}: {exc}" for i in part})
        finally:
            if rows is not None:
                self._staging.give(rows)
        self._stats.add(load_blocks=len(ok), load_bytes=nbytes,
                        load_seconds=time.perf_counter() - t0, load_failures=len(errors))
        task.finish_part(ok, errors, nbytes)

    def _reads_into_rows(self, server: str) -> bool:
        with self._lock:
            srv = self._servers.get(server)
        b = srv.backend if srv is not None else None
        return bool(b is not None and b.reads_into_rows)

    def _verify_copy(self, value, bid, i, offset, bufs: BlockBuffers, shards,
                     keep: bool = False) -> Optional[str]:
        """Check one value and copy the asked shards to row ``i`` of ``bufs``: ``None`` when
        done, ``"miss"``, or why the value was refused. ``keep``: check every shard and keep the
        value for the next layers' loads (:meth:`_copy_recent`)."""
        if value is None:
            return "miss"
        if isinstance(value, Exception):
            self._stats.add(unavailable=1)
            return f"{self.name}: {value}"
        raw = np.frombuffer(value, dtype=np.uint8)
        if raw.nbytes != self.value_bytes:
            return f"corrupt: value of {raw.nbytes} bytes, expected {self.value_bytes}"
        g = self.geometry
        key = id_bytes(bid.reshape(1, 2))[0]
        try:
            head = parse(raw[:self.header_bytes], self.namespace, key, g.block_bytes,
                         g.shard_bytes, self.codec, VALUE_ALIGN)
        except BadBlock as exc:
            return f"corrupt: {exc}"
        # checksums of adjacent ranges add up: one pass over the shards read checks them all
        first, last = (0, g.n_shards - 1) if keep else (shards[0], shards[-1])
        checked = raw[self.header_bytes + first * g.shard_bytes:
                      self.header_bytes + (last + 1) * g.shard_bytes]
        want = int(head.shard_checksums[first:last + 1].sum(dtype=np.uint64))
        payload = raw[self.header_bytes:]
        if not keep and not bufs.is_cuda:
            # copy and checksum in one pass over the value; a mismatch leaves the row written,
            # which the failed load allows (its rows are the caller's to recompute)
            got = copy_checksum_units(bufs.rows[i], checked, checked.nbytes, first * g.shard_bytes // 8)
            if int(got[0]) != want:
                return f"corrupt: checksum mismatch in shards {first}-{last}"
            return None
        if checksum(checked, first * g.shard_bytes // 8) != want:
            return f"corrupt: checksum mismatch in shards {first}-{last}"
        self._copy_out(payload, i, offset, bufs, shards)
        if keep and shards[-1] < g.n_shards - 1:
            self._remember(key, payload.copy() if isinstance(value, memoryview) else payload)
        return None

    def _copy_out(self, payload: np.ndarray, i, offset, bufs: BlockBuffers, shards) -> None:
        data = payload[offset:offset + len(shards) * self.geometry.shard_bytes]
        if bufs.is_cuda:
            import torch

            bufs.rows[i].copy_(torch.from_numpy(data.copy()))
        else:
            bufs.rows[i][:] = data

    # Layer-by-layer loads (an engine waiting for each layer) ask for one shard of a block at a
    # time. The first such load fetches the whole value (a server sends whole values), checks
    # every shard and keeps the payload; the next layers copy from it; the load of the last
    # shard, or room for newer blocks (at most a quarter of the staging size), drops it.
    def _remember(self, key: bytes, payload: np.ndarray) -> None:
        with self._lock:
            self._recent[key] = payload
            self._recent.move_to_end(key)
            while len(self._recent) * self.geometry.block_bytes > self._recent_cap:
                self._recent.popitem(last=False)

    def _copy_recent(self, bid, i, offset, bufs: BlockBuffers, shards) -> bool:
        key = id_bytes(bid.reshape(1, 2))[0]
        with self._lock:
            payload = self._recent.get(key)
            if payload is not None and shards[-1] == self.geometry.n_shards - 1:
                del self._recent[key]
        if payload is None:
            return False
        self._copy_out(payload, i, offset, bufs, shards)
        return True

    def _quarantine(self, server: str, ids: np.ndarray) -> None:
        """Values that failed verification: counted, and both keys deleted (the block is
        recomputed and saved again by whoever needs it)."""
        self._stats.add(quarantined=len(ids))
        with self._lock:
            for key in id_bytes(ids):
                self._recent.pop(key, None)
        log.warning("ucm %s: %d value(s) on %s failed verification; deleted", self.name, len(ids),
                    self.label(server))
        keys = self._keys(ids, "m") + self._keys(ids, "v")
        try:
            self._call(server, lambda b: b.delete(keys))
        except Exception as exc:
            self._count_failure(exc)

    # -- dump -----------------------------------------------------------------------------------
    def _dump(self, ids, offset, bufs: BlockBuffers, shards) -> Task:
        task = Task("dump", ids)
        for start in range(0, len(ids), self.batch_blocks):
            part = np.arange(start, min(len(ids), start + self.batch_blocks))
            task.add_part()
            res = _Part(task)
            # claimed here, in the caller, so a commit that follows the dump at once finds its
            # blocks pending; their staging rows are taken later, by the I/O thread
            claimed = self._claim(res, ids, part, shards)
            self._submit(self._dump_part, res, ids, claimed, offset, bufs, shards)
        return task.seal()

    def _claim(self, res: "_Part", ids, part, shards) -> list:
        """Settle the blocks staged or stored already; returns the ``(i, key, pending)`` whose
        shards ``_dump_part`` copies (a new block's entry has no row yet)."""
        sl = slice(shards[0], shards[-1] + 1)
        claimed = []
        with self._lock:
            for i, key in zip(part.tolist(), id_bytes(ids[part])):
                p = self._pending.get(key)
                if p is None:
                    p = self._pending[key] = _Pending(-1, self.geometry.n_shards)
                if p.state == "putting":
                    res.wait_for(p, i)
                elif p.state == "stored" or p.state == "staging" and p.shards[sl].all():
                    res.ok(i)  # the same bytes are staged or stored already
                else:
                    if p.state == "failed":  # its last put failed: stage it again
                        p.state, p.shards[:] = "staging", False
                    p.copying += 1
                    claimed.append((i, key, p))
        return claimed

    def _take_rows(self, claimed: list) -> None:
        """A staging row for each claimed block without one. Only rows held by puts in flight
        come back by themselves (a staged block keeps its row until its commit), so this waits
        (at most ROW_WAIT_S) only when those would be enough; otherwise, or when they do not come
        in time, it uses what is free, and the other blocks fail (not stored)."""
        staging = self._rows()
        with self._lock:
            need = len({key for _, key, p in claimed if p.row < 0})
        spare = []
        deadline = time.monotonic() + ROW_WAIT_S
        while need:
            spare = staging.take(need, 0)
            if spare is not None:
                break
            spare = []
            with self._lock:
                putting = self._putting
            if staging.free() + putting < need or time.monotonic() > deadline:
                break  # the rows would not come back by themselves
            staging.wait_change(0.05)
        with self._lock:
            for _, _, p in claimed:
                if p.row < 0:
                    rows = [spare.pop()] if spare else staging.take(1, 0)
                    if rows is not None:
                        p.row = rows[0]
        if spare:
            staging.give(spare)

    def _dump_part(self, res: "_Part", ids, claimed, offset, bufs: BlockBuffers, shards) -> None:
        """Stage the shards of each claimed block; a block this completes is put to its server
        and succeeds when the put lands (so does a block whose put is already in flight); a
        block still missing shards succeeds once staged."""
        t0 = time.perf_counter()
        g = self.geometry
        sl = slice(shards[0], shards[-1] + 1)
        span = len(shards) * g.shard_bytes
        complete = []
        self._take_rows(claimed)
        for i, key, p in claimed:
            copied = p.row >= 0
            if not copied:
                res.fail(i, "staging full")
            else:
                try:
                    dst = self._row(p.row)[self.header_bytes + offset:
                                           self.header_bytes + offset + span]
                    if bufs.is_cuda:
                        import torch

                        torch.from_numpy(dst).copy_(bufs.rows[i])
                        sums = checksum_units(dst, g.shard_bytes, offset // 8)
                    else:  # the checksums taken while copying (the source is read once)
                        sums = copy_checksum_units(dst, bufs.rows[i], g.shard_bytes, offset // 8)
                    p.sums[sl] = sums
                except Exception as exc:  # a source that cannot be read: this block fails
                    copied = False
                    res.fail(i, f"copy: {exc!r}")
            with self._lock:
                p.copying -= 1
                if copied:
                    p.shards[sl] = True
                settled = p.copying == 0 and p.state == "staging"
                if settled and p.shards.all() and not p.discard:
                    p.state = "putting"
                    self._putting += 1
                    res.wait_for(p, i)
                    complete.append((key, p, ids[i]))
                    continue
                if settled and (p.discard or p.publish or p.row < 0):
                    # discarded, committed before its last shards came (never published), or
                    # without a row: nothing of it is kept
                    self._drop(key, p)
                    if copied:
                        res.fail(i, "discarded" if p.discard else "incomplete at commit")
                elif copied:
                    res.ok(i)
        self._stats.add(dump_bytes=len(claimed) * span, dump_seconds=time.perf_counter() - t0)
        if complete:
            self._put(complete)
        res.release()

    def _put(self, complete: list) -> None:
        """Headers for the completed blocks, then one batched put per server."""
        g = self.geometry
        for key, p, bid in complete:
            row = self._row(p.row)
            head = Header(self.namespace, key, self.codec, g.block_bytes, g.shard_bytes, p.sums,
                          VALUE_ALIGN)
            row[:self.header_bytes] = head.pack()
        bids = np.array([c[2] for c in complete], dtype=np.uint64).reshape(-1, 2)
        for server, idx in self._route(bids).items():
            self._put_exec.submit(self._put_group, server, [complete[j] for j in idx])

    def _put_group(self, server: str, group: list) -> None:
        t0 = time.perf_counter()
        bids = np.array([c[2] for c in group], dtype=np.uint64).reshape(-1, 2)
        keys = self._keys(bids, "v")
        values = [memoryview(self._row(c[1].row)) for c in group]
        try:
            res = self._call(server, lambda b: b.put(keys, values))
        except Exception as exc:
            self._count_failure(exc)
            res = [f"{self.label(server)}: {exc}"] * len(group)
        publish, finished = [], []
        with self._lock:
            for (key, p, bid), why in zip(group, res):
                good = why is None
                self._putting -= 1
                p.state = "stored" if good else "failed"
                self._staging.give([p.row])
                p.row = -1
                finished.append((p.waiters, why))
                p.waiters = []
                if p.discard or not good:
                    if self._pending.get(key) is p:
                        del self._pending[key]
                elif p.publish:
                    del self._pending[key]
                    publish.append(bid)
        n_ok = sum(r is None for r in res)
        self._stats.add(dump_blocks=n_ok, dump_failures=len(group) - n_ok,
                        dump_seconds=time.perf_counter() - t0)
        if publish:  # committed while the bytes were on their way: visible now
            self._mark(np.array(publish, dtype=np.uint64).reshape(-1, 2))
            self._stats.add(commits=len(publish))
        for waiters, why in finished:
            for part, i in waiters:
                part.landed(i, why)

    def _drop(self, key: bytes, p: _Pending) -> None:
        """Forget a pending block (lock held)."""
        self._pending.pop(key, None)
        if p.row >= 0:
            self._staging.give([p.row])
            p.row = -1

    # -- commit -----------------------------------------------------------------------------------
    def commit(self, block_ids, success_flags) -> None:
        ids, flags = self._flags(block_ids, success_flags)
        publish = []
        with self._lock:
            for bid, flag in zip(ids, flags):
                key = id_bytes(bid.reshape(1, 2))[0]
                p = self._pending.get(key)
                if p is None:
                    continue
                if not flag:
                    p.discard = True
                    if p.state != "putting" and p.copying == 0:
                        self._drop(key, p)
                elif p.state == "stored":
                    self._pending.pop(key)
                    publish.append(bid)
                elif p.state == "putting" or p.copying:
                    p.publish = True  # the marker follows when the bytes land
                else:  # never completed, or its put failed: not published
                    self._drop(key, p)
        if publish:
            self._mark(np.array(publish, dtype=np.uint64).reshape(-1, 2))
            self._stats.add(commits=len(publish))
        discarded = int((~flags).sum())
        if discarded:
            self._stats.add(discards=discarded)

    def _mark(self, ids: np.ndarray) -> None:
        """Write the commit markers of stored blocks (the step that makes them visible)."""
        for server, rows in self._route(ids).items():
            keys = self._keys(ids[rows], "m")
            try:
                res = self._call(server, lambda b: b.put(keys, [memoryview(MARKER)] * len(keys)))
                failed = sum(r is not None for r in res)
                if failed:
                    self._stats.add(io_errors=failed)
            except Exception as exc:
                self._count_failure(exc)

    # -- generation, stats, close -------------------------------------------------------------
    def _generation_key(self) -> tuple[str, str]:
        key = self.key_format.format(prefix=self.key_prefix, ns=self._ns_hex, id="generation",
                                     kind="g")
        names = self.servers()
        return names[int(rendezvous(np.frombuffer(self.namespace, np.uint64).reshape(1, 2),
                                    names)[0])], key

    def generation(self) -> int:
        """The generation stored on the namespace's server (the highest of it and this
        process's); this process's alone while that server is down."""
        server, key = self._generation_key()
        try:
            value = self._call(server, lambda b: b.get([key], None))[0]
            if value is not None:
                self._generation = max(self._generation, int(bytes(value).decode() or 0))
        except Exception as exc:
            self._count_failure(exc)
        return self._generation

    def set_generation(self, value: int) -> int:
        target = max(super().set_generation(value), self.generation())
        server, key = self._generation_key()
        try:
            res = self._call(server, lambda b: b.put([key], [memoryview(str(target).encode())]))
        except Unavailable as exc:  # the contract's error for a generation not persisted
            raise OSError(f"{self.name}: cannot store the generation: {exc}") from exc
        if res[0] is not None:
            raise OSError(f"{self.name}: cannot store the generation: {res[0]}")
        self._generation = target
        return target

    def stats(self) -> dict:
        snap = self._stats.snapshot()
        with self._lock:
            snap["servers"] = [self.label(n) for n in self._names]
            snap["down"] = [s.label for s in self._servers.values() if s.down_until > time.monotonic()]
            snap["pending_blocks"] = len(self._pending)
        return {self.name: snap}

    def close(self) -> None:
        if self._closed:
            return
        # closed first: a load or dump that arrives while the puts in flight drain is refused
        # as on a closed store, not handed to an executor that no longer takes work
        self._closed = True
        self._exec.shutdown(wait=True)
        self._put_exec.shutdown(wait=True)
        with self._lock:
            servers = list(self._servers.values()) + self._retired
            self._servers, self._retired = {}, []
        for srv in servers:
            srv.close()
        super().close()



def remote_options(config) -> dict:
    """The ``store.remote.*`` and shared store options every distributed tier takes."""
    return dict(timeout_s=config["store.remote.timeout_s"], backoff_s=config["store.remote.backoff_s"],
                staging_bytes=config["store.remote.staging"],
                batch_bytes=config["store.remote.batch_bytes"],
                io_threads=config["store.io_threads"], wait_timeout_s=config["store.wait_timeout_s"])
