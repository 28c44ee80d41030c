"""``memory`` tier: a host pool of ``buffer_number`` block slots, allocated once.

The pool is one aligned allocation (huge pages where the kernel grants them), page-locked with
``cudaHostRegister`` when a CUDA device is present so GPU copies run at the PCIe ceiling and
asynchronously. Committed blocks live in a :class:`ucm.BlockIndex` (id → slot); a dump takes a
free slot or evicts a committed block that no load is reading, chosen by the tier's ``policy``
(:mod:`ucm.store.policy`): ``lru`` is kept by the index itself, ``arc`` and ``prefix`` by a
policy object beside it. A load, and a dump that finds the block already stored, count as a
use. Dumped-but-uncommitted blocks hold their slot until ``commit``.

Copies: CPU buffers move with the native multi-threaded ``copy_segments``; CUDA buffers with
``copy_(non_blocking=True)`` on a side stream that first waits for the caller's stream, so a
``dump`` right after the kernel that produced ``src`` is safe. Runs of whole blocks that are
adjacent both in the caller's buffer and in the pool move as one copy.
"""
from __future__ import annotations

import logging
import threading
from ucm import threads
from typing import Optional

import numpy as np

from ucm.config import check_count, check_seconds
from ucm.ops import BlockIndex, alloc_aligned, copy_segments, physical_memory
from ucm.store.base import Borrowed, BlockBuffers, BlockGeometry, KVStore, Task
from ucm.store.policy import make_policy

log = logging.getLogger("ucm.store.memory")


class _Pending:
    __slots__ = ("key", "slot", "shards", "claimed", "inflight", "failed", "discard", "publish")

    def __init__(self, key: bytes, slot: int, n_shards: int):
        self.key = key
        self.slot = slot
        self.shards = np.zeros(n_shards, dtype=bool)   # written
        self.claimed = 0  # bit k: shard k is written or being written (one writer per shard)
        self.inflight = 0
        self.failed = False
        self.discard = False
        self.publish = False  # committed while a dump of it was in flight: publish when it lands


def _cuda_available() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False


class MemoryStore(KVStore):
    process_local = True
    name = "memory"

    def __init__(self, geometry: BlockGeometry, buffer_number: int, io_threads: int = 4,
                 wait_timeout_s: float = 30.0, pin: Optional[bool] = None, copy_threads: int = 2,
                 namespace: bytes = bytes(16), policy: str = "lru"):
        super().__init__(geometry, check_seconds(wait_timeout_s, "store.wait_timeout_s"), namespace)
        if isinstance(buffer_number, bool) or not isinstance(buffer_number, (int, np.integer)) \
                or buffer_number < 1:
            raise ValueError(f"buffer_number must be an int >= 1, got {buffer_number!r}")
        io_threads = check_count(io_threads, "store.io_threads")
        copy_threads = check_count(copy_threads, "copy_threads")
        pool_bytes = int(buffer_number) * geometry.block_bytes
        if pool_bytes > physical_memory():
            raise ValueError(f"buffer_number: {int(buffer_number)} blocks of {geometry.block_bytes} "
                             f"bytes ({pool_bytes} bytes) is more than this machine's memory "
                             f"({physical_memory()} bytes); the memory tier's pool must fit in it")
        self.n_slots = int(buffer_number)
        self.policy = policy
        self._policy = None if policy == "lru" else make_policy(policy, self.n_slots)
        # blocks read since the last insert, made recent again after it (see _inserted)
        self._reads: list = []
        self._read_count = 0
        self.pool = None  # allocated on first use or by prepare(): a lookup-only view costs nothing
        self.pinned = False
        self._want_pin = pin
        self._pool_t = None
        self._base = None
        self._index = BlockIndex(self.n_slots)
        self._free = list(range(self.n_slots - 1, -1, -1))
        self._pending: dict[bytes, _Pending] = {}
        self._refs = np.zeros(self.n_slots, dtype=np.int64)
        self._lock = threading.Lock()
        self._exec = threads.pool(io_threads, "ucm-memory")
        self._copy_threads = copy_threads
        self._streams: dict = {}

    # -- setup --------------------------------------------------------------------------------
    def prepare(self) -> None:
        with self._lock:
            self._ensure_pool()
            _warm_up_index()

    def _ensure_pool(self) -> None:
        """Allocate the pool once (caller holds the lock)."""
        if self.pool is not None:
            return
        self.pool = alloc_aligned(self.n_slots * self.geometry.block_bytes)
        self._base = np.uint64(self.pool.ctypes.data)
        pin = _cuda_available() if self._want_pin is None else self._want_pin
        if pin:
            self._pin()

    def _pin(self) -> None:
        import torch

        rc = torch.cuda.cudart().cudaHostRegister(self.pool.ctypes.data, self.pool.nbytes, 0)
        if int(rc) != 0:
            log.warning("ucm memory tier: cudaHostRegister failed (%s); pool stays pageable", rc)
            return
        self.pinned = True

    def _torch_pool(self):
        if self._pool_t is None:
            import torch

            self._pool_t = torch.from_numpy(self.pool)
        return self._pool_t

    def close(self) -> None:
        if self._closed:
            return
        super().close()
        self._exec.shutdown(wait=True)
        if self.pinned and self.pool is not None:
            import torch

            torch.cuda.cudart().cudaHostUnregister(self.pool.ctypes.data)
            self.pinned = False

    # -- slots (callers hold self._lock, except _hold and _unhold, which take it) ---------------
    def _alloc_slots(self, k: int) -> list:
        """Up to ``k`` slots: free ones first, then by evicting least recently used blocks that
        no load is reading (one batched index call, not one per block)."""
        out = [self._free.pop() for _ in range(min(k, len(self._free)))]
        if self._policy is not None and len(out) < k:
            refs = self._refs
            busy = None
            if refs.any():
                busy = lambda key: refs[int(self._index.lookup(_id(key))[0])] > 0  # noqa: E731
            keys = self._policy.evict(k - len(out), busy)
            if keys:
                slots = self._index.remove(np.frombuffer(b"".join(keys), dtype=np.uint64).reshape(-1, 2))
                freed = slots[slots >= 0].tolist()
                self._stats.add(evictions=len(freed))
                out.extend(freed)
            return out
        tries = 0
        while len(out) < k and len(self._index) and tries < 4:
            tries += 1
            need = k - len(out)
            ev_ids, ev_slots = self._index.evict(max(0, len(self._index) - need))
            busy = self._refs[ev_slots] > 0
            if busy.any():  # being read: keep them, as most recent
                self._index.insert(ev_ids[busy], ev_slots[busy])
            freed = ev_slots[~busy].tolist()
            self._stats.add(evictions=len(freed))
            out.extend(freed)
        return out

    def _release(self, p: _Pending) -> None:
        self._free.append(p.slot)

    def _hold(self, ids) -> np.ndarray:
        """Slots of ``ids`` (-1: not held), each held against eviction until ``_unhold`` (a
        load or a borrow reading it); touched as most recently used."""
        with self._lock:
            slots = self._index.lookup(ids)
            found = slots >= 0
            np.add.at(self._refs, slots[found], 1)
            self._use(ids[found])
        return slots

    def _use(self, ids) -> None:
        """Blocks read again, in chain order (caller holds the lock). The index-kept LRU is
        touched deepest first, so that a chain ages from its tip: evicting its first block
        would strand every block after it (see :mod:`ucm.store.policy`)."""
        if self._policy is None:
            self._index.touch(ids[::-1])
        else:
            self._policy.hit([ids[i].tobytes() for i in range(len(ids))])
        if self._read_count < self.n_slots:
            self._reads.append(ids.copy())       # (the caller may reuse its array)
            self._read_count += len(ids)

    def _inserted(self, ids, slots) -> None:
        """Publish blocks, in chain order (caller holds the lock): into the index (the LRU
        order deepest first, as in _use) and the policy. A request loads its prefix, then
        stores the blocks after it: the blocks read since the last insert are made recent
        again, so that they stay more recent than the deeper blocks just stored and the chain
        still ages from its tip (a read block would otherwise go before the blocks stored
        after it and leave a gap in the chain)."""
        self._index.insert(ids[::-1], np.asarray(slots[::-1], dtype=np.int64))
        if self._policy is not None:
            self._policy.insert([ids[i].tobytes() for i in range(len(ids))])
        for read in self._reads:
            if self._policy is None:
                self._index.touch(read[::-1])
            else:
                self._policy.refresh([read[i].tobytes() for i in range(len(read))])
        self._reads.clear()
        self._read_count = 0

    def _unhold(self, slots) -> None:
        with self._lock:
            np.add.at(self._refs, slots, -1)

    # -- API ----------------------------------------------------------------------------------
    def lookup(self, block_ids) -> list[bool]:
        from ucm.ids import as_ids

        ids = as_ids(block_ids, "block_ids")
        with self._lock:
            found = self._index.lookup(ids) >= 0
        hits = int(found.sum())
        self._stats.add(lookups=len(ids), hits=hits, misses=len(ids) - hits)
        return found.tolist()

    def _dump(self, ids, offset, bufs: BlockBuffers, shards: range) -> Task:
        task = Task("dump", ids)
        nbytes = len(shards) * self.geometry.shard_bytes
        mask = ((1 << len(shards)) - 1) << shards.start
        plan, skipped, errors = [], [], {}
        with self._lock:
            self._ensure_pool()
            present = self._index.lookup(ids) >= 0
            if present.any():  # asked to store it again: the block was needed again
                self._use(ids[present])
            keys = [ids[i].tobytes() for i in range(len(ids))]
            fresh = [i for i in range(len(ids)) if not present[i] and keys[i] not in self._pending]
            fresh_set = set(fresh)
            slots = iter(self._alloc_slots(len(set(keys[i] for i in fresh))))
            for i in range(len(ids)):
                if present[i]:
                    skipped.append(i)
                    continue
                p = self._pending.get(keys[i])
                if p is None and i in fresh_set:
                    slot = next(slots, None)
                    if slot is None:
                        errors[i] = "memory tier full: every slot is pending or being read"
                        continue
                    p = self._pending[keys[i]] = _Pending(keys[i], slot, self.geometry.n_shards)
                if p.claimed & mask == mask:
                    # these shards are written (or being written) by an earlier row or task:
                    # one writer per byte, so a block never mixes two sources
                    skipped.append(i)
                    continue
                p.claimed |= mask
                p.inflight += 1
                plan.append((i, p))
        self._stats.add(dump_skipped=len(skipped), dump_failures=len(errors))
        task.add_part()
        task.finish_part(skipped, errors)
        if plan:
            ready = self._cuda_ready_event(bufs)
            task.add_part()
            self._exec.submit(self._run_dump, task, plan, offset, nbytes, bufs, shards, ready)
        return task.seal()

    def _run_dump(self, task, plan, offset, nbytes, bufs, shards, ready):
        import time

        t0 = time.perf_counter()
        try:
            # each item carries its row: skipped or refused rows leave gaps in the plan
            self._copy(bufs, [p.slot for _, p in plan], offset, nbytes, to_pool=True, ready=ready,
                       rows=[i for i, _ in plan])
            ok, err = True, None
        except Exception as exc:  # a copy fault fails these blocks, never the process
            ok, err = False, f"copy into memory tier failed: {exc!r}"
        with self._lock:
            for _, p in plan:
                p.inflight -= 1
                if ok:
                    p.shards[shards.start:shards.stop] = True
                else:
                    p.failed = True
                if p.inflight == 0 and p.publish:
                    self._publish_late(p)
                elif p.discard and p.inflight == 0:
                    self._release(p)
        idx = [i for i, _ in plan]
        self._stats.add(dump_blocks=len(idx) if ok else 0, dump_bytes=len(idx) * nbytes if ok else 0,
                        dump_seconds=time.perf_counter() - t0, dump_failures=0 if ok else len(idx))
        task.finish_part(idx if ok else [], None if ok else {i: err for i in idx},
                         len(idx) * nbytes if ok else 0)

    def _publish_late(self, p: _Pending) -> None:
        """A block committed while another writer's dump of it was in flight, now landed
        (caller holds the lock)."""
        mine = self._pending.get(p.key) is p
        if mine:
            del self._pending[p.key]
        if mine and not p.failed and p.shards.all():
            self._inserted(_id(p.key), [p.slot])
            self._stats.add(commits=1)
        else:
            self._release(p)
            self._stats.add(discards=1)

    def commit(self, block_ids, success_flags) -> None:
        ids, flags = self._flags(block_ids, success_flags)
        rows, slots = [], []
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
                    continue  # already present (dump skipped), failed at submission, or unknown
                publish = flags[i] and p.inflight == 0 and not p.failed and p.shards.all()
                if publish:
                    rows.append(i)
                    slots.append(p.slot)
                    continue
                if flags[i]:
                    log.warning("ucm memory tier: block %s not published (%s)", ids[i].tobytes().hex(),
                                "dump still in flight" if p.inflight else "dump failed" if p.failed
                                else "not every shard was dumped")
                self._stats.add(discards=1)
                if p.inflight:
                    p.discard = True
                else:
                    self._release(p)
            if rows:  # one index call for the batch
                self._inserted(ids[rows], slots)
        self._stats.add(commits=len(rows))

    def _load(self, ids, offset, bufs: BlockBuffers, shards: range) -> Task:
        task = Task("load", ids)
        nbytes = len(shards) * self.geometry.shard_bytes
        slots = self._hold(ids)
        found = np.flatnonzero(slots >= 0)
        missing = {int(i): "not in memory tier" for i in np.flatnonzero(slots < 0)}
        self._stats.add(lookups=len(ids), hits=len(found), misses=len(missing),
                        load_failures=len(missing))
        task.add_part()
        task.finish_part([], missing)
        if len(found):
            task.add_part()
            ready = self._cuda_ready_event(bufs)
            self._exec.submit(self._run_load, task, found, slots[found], offset, nbytes, bufs, ready)
        return task.seal()

    def borrow(self, block_ids) -> Borrowed:
        """The pool as ``[n_slots, block_bytes]`` and each block's slot (-1: not held); the
        slots are held like a load's until ``release()``."""
        from ucm.ids import as_ids

        if self._closed:   # (as load and dump: nothing is lent out of a closed store)
            raise ValueError(f"{self.name}: store is closed")
        ids = as_ids(block_ids, "block_ids")
        with self._lock:
            self._ensure_pool()
        slots = self._hold(ids).astype(np.int64)
        found = slots[slots >= 0]
        self._stats.add(lookups=len(ids), hits=len(found), misses=len(ids) - len(found))
        pool = self._torch_pool().view(self.n_slots, self.geometry.block_bytes)
        return Borrowed(pool, slots, lambda: self._unhold(found))

    def _run_load(self, task, found, slots, offset, nbytes, bufs, ready):
        import time

        t0 = time.perf_counter()
        try:
            self._copy(bufs, slots.tolist(), offset, nbytes, to_pool=False, ready=ready, rows=found)
            ok, err = True, None
        except Exception as exc:
            ok, err = False, f"copy from memory tier failed: {exc!r}"
        self._unhold(slots)
        self._stats.add(load_blocks=len(found) if ok else 0, load_bytes=len(found) * nbytes if ok else 0,
                        load_seconds=time.perf_counter() - t0, load_failures=0 if ok else len(found))
        task.finish_part(found if ok else [], None if ok else {int(i): err for i in found},
                         len(found) * nbytes if ok else 0)

    # -- data movement ------------------------------------------------------------------------
    def _stream(self, device, to_pool: bool):
        """One copy stream per device and direction, shared by the workers: copies in one
        direction queue on one copy engine instead of splitting the link between streams."""
        import torch

        key = (str(device), to_pool)
        with self._lock:
            stream = self._streams.get(key)
            if stream is None:
                stream = self._streams[key] = torch.cuda.Stream(device=device)
        return stream

    def _cuda_ready_event(self, bufs: BlockBuffers):
        if not bufs.is_cuda:
            return None
        import torch

        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(bufs.rows[0].device))
        return ev

    def _copy(self, bufs: BlockBuffers, slots: list, offset: int, nbytes: int, to_pool: bool,
              ready=None, rows=None) -> None:
        """Move ``nbytes`` between buffer rows (``rows``, default all in order) and
        ``[slot * block_bytes + offset, ...)`` of the pool."""
        rows = np.arange(len(slots)) if rows is None else np.asarray(rows)
        bb = self.geometry.block_bytes
        if not bufs.is_cuda:
            pool_addrs = self._base + np.asarray(slots, dtype=np.uint64) * np.uint64(bb) + np.uint64(offset)
            buf_addrs = bufs.addrs[rows]
            src, dst = (buf_addrs, pool_addrs) if to_pool else (pool_addrs, buf_addrs)
            copy_segments(src, dst, np.full(len(slots), nbytes, dtype=np.uint64), self._copy_threads)
            return
        import torch

        stream = self._stream(bufs.rows[0].device, to_pool)
        pool = self._torch_pool()
        with torch.cuda.stream(stream):
            if ready is not None:
                stream.wait_event(ready)
            for r, slot, count in _runs(bufs, rows.tolist(), slots, nbytes, nbytes == bb):
                host = pool[slot * bb + offset: slot * bb + offset + count * nbytes]
                dev = bufs.rows[r] if count == 1 else bufs.rows[r].as_strided((count * nbytes,), (1,))
                if to_pool:
                    host.copy_(dev, non_blocking=True)
                else:
                    dev.copy_(host, non_blocking=True)
            done = torch.cuda.Event()
            done.record(stream)
        done.synchronize()

    def stats(self) -> dict:
        d = self._stats.snapshot()
        with self._lock:
            d.update(slots=self.n_slots, committed=len(self._index), pending=len(self._pending),
                     free=len(self._free), pinned=self.pinned, policy=self.policy, allocated=self.pool is not None,
                     used_bytes=len(self._index) * self.geometry.block_bytes,
                     capacity_bytes=self.n_slots * self.geometry.block_bytes)
        return {self.name: d}


def _id(key: bytes) -> np.ndarray:
    return np.frombuffer(key, dtype=np.uint64).reshape(1, 2)


def _runs(bufs: BlockBuffers, rows: list, slots: list, nbytes: int, whole_blocks: bool):
    """Group (row, slot) pairs into runs that are contiguous on both sides (consecutive slots,
    adjacent device rows), so a chunk of blocks moves in one large copy: PCIe reaches its
    ceiling only with transfers of a few MiB. Yields (first row, first slot, count)."""
    if not whole_blocks:  # slot ranges are strided: one copy per block
        for r, slot in zip(rows, slots):
            yield r, slot, 1
        return
    start = None
    for r, slot in zip(rows, slots):
        ptr = bufs.rows[r].data_ptr()
        if start is not None and slot == last_slot + 1 and ptr == last_ptr + nbytes:
            count += 1
        else:
            if start is not None:
                yield start, first_slot, count
            start, first_slot, count = r, slot, 1
        last_slot, last_ptr = slot, ptr
    if start is not None:
        yield start, first_slot, count


def _warm_up_index() -> None:
    """Compile the index's jitted functions now (about a second), not in the first request."""
    probe = BlockIndex(2)
    ids = np.arange(6, dtype=np.uint64).reshape(3, 2)
    probe.insert(ids, [0, 1, 2])
    probe.lookup(ids)
    probe.lookup_prefix(ids)
    probe.touch(ids)
    probe.remove(ids[:1])
    probe.evict(0)
