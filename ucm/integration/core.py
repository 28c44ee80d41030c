"""The engine-free core every engine adapter stands on: the engine's paged KV buffers as a
:class:`ucm.KVLayout` over plain tensors, the open store, the device, a pool of staging buffers,
the counters, and the rule that turns a block id into this rank's id. It imports no engine.

vLLM's connector drives it asynchronously, layer by layer (:mod:`ucm.integration.vllm.worker_load`,
:mod:`~ucm.integration.vllm.worker_save`); SGLang's HiCache backend
(:mod:`ucm.integration.sglang`) synchronously, page by page (:meth:`WorkerCore.save_blocks`,
:meth:`WorkerCore.load_blocks`, :meth:`WorkerCore.leading_hits`). A third engine needs only an
adapter: its buffers as ``KVLayout`` views (block dimension first) and its keys as block ids.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from typing import Callable, Optional

import numpy as np
import torch

import ucm
from ucm import metrics as ucm_metrics
from ucm.buffers import BufferPool
from ucm.store.codec import CodecStore

log = logging.getLogger("ucm.integration")


def store_shard_bytes(layout: "ucm.KVLayout") -> int:
    """Bytes per layer in the store's geometry: a layer's part of a block when every layer has
    the same (8-byte aligned) size, else the whole block (the store then cannot address layers)."""
    bb = layout.block_bytes
    shard = layout.shard_bytes(0)
    uniform = all(layout.shard_bytes(k) == shard for k in range(layout.num_layers))
    return shard if uniform and shard % 8 == 0 else bb


class WorkerCore:
    """What the load and save paths share (one per worker).

    ``layout``: the paged caches (``ucm.KVLayout``, one layer per cache tensor, in the order
    of the model's layers); ``store``: an open ucm store whose geometry is ``block_bytes =
    layout.block_bytes`` and ``shard_bytes`` (default :func:`store_shard_bytes`); ``rank_ids``:
    maps block ids ``uint64 [n, 2]`` to the ids this rank stores them under (default: the
    same ids); ``stats_file``: where :meth:`write_stats` appends the totals of :attr:`metrics`
    (None: nowhere).

    Every count and time of the load and save paths goes to :attr:`metrics` (series of
    :mod:`ucm.metrics`): vLLM's stats drain it each step, the stats file and :meth:`stats`
    show its totals. Of the times: ucm_load_seconds = load_store + load_scatter;
    ucm_save_seconds (gather to commit) includes save_gather; ucm_forward_seconds_total runs
    from start_load_kv's return to wait_for_save (vLLM 0.32 calls start_load_kv after the
    forward in steps without loads, so ~0 there)."""

    def __init__(self, layout: "ucm.KVLayout", store, device, *, shard_bytes: Optional[int] = None,
                 rank_ids: Optional[Callable[[np.ndarray], np.ndarray]] = None,
                 stats_file: Optional[str] = None):
        self.layout = layout
        self.store = store
        #: the store's compression stage, when it compresses: loads then read the encoded
        #: blocks and decode them straight into the paged cache (no decoded staging copy)
        self.codec = store if isinstance(store, CodecStore) else None
        self.device = torch.device(device)
        self.n_layers = layout.num_layers
        self.block_bytes = layout.block_bytes
        self.shard = shard_bytes if shard_bytes is not None else store_shard_bytes(layout)
        self.rank_ids = rank_ids if rank_ids is not None else (lambda ids: ids)
        #: ucm.metrics series of this worker (drained by the connector into vLLM's stats)
        self.metrics = ucm_metrics.Recorder()
        self.stats_sink = ucm_metrics.JsonLinesSink(stats_file) if stats_file else None
        self.store_metrics = ucm_metrics.StoreCollector(store) if store is not None else None
        # guards the staging pool, the counters a save thread updates and the save jobs in flight
        self.lock = threading.Lock()
        #: staging buffers of ended saves, reused
        self.staging = BufferPool(self.alloc)
        self._forward_t0: Optional[float] = None
        #: callables returning a ucm.metrics payload, merged at each collection (the vLLM
        #: connector adds sparse attention's)
        self.metric_sources: list = []

    def prefetch(self, hints: list) -> None:
        """Queued requests' stored blocks (base ids, one array per request): the store promotes
        those that only slower tiers hold into its first tier in the background. A hint is an
        optimisation: a fault is logged and costs nothing else."""
        if self.store is None:
            return
        try:
            ids = self.rank_ids(np.concatenate(hints))
            self.store.prefetch(ids)
            self.metrics.inc("ucm_prefetch_hint_blocks_total", len(ids))
        except Exception as exc:
            log.debug("ucm: prefetch failed (%r)", exc)

    # synchronous block transfers (engines whose storage calls block: SGLang's HiCache) -------
    def leading_hits(self, block_ids) -> int:
        """How many of ``block_ids`` (base ids, ``uint64 [n, 2]``), from the first, the store
        holds. A store fault counts as no hit."""
        ids = ucm.as_ids(block_ids, "block_ids")
        if self.store is None or not len(ids):
            return 0
        try:
            hit = int(self.store.lookup_prefix(self.rank_ids(ids)))
        except Exception as exc:
            log.warning("ucm: lookup failed (%r); counted as a miss", exc)
            hit = 0
        self.metrics.inc("ucm_lookup_hit_blocks_total", hit)
        self.metrics.inc("ucm_lookup_miss_blocks_total", len(ids) - hit)
        return hit

    def save_blocks(self, block_ids, indices) -> np.ndarray:
        """Store the engine's blocks ``indices`` (into the layout) under ``block_ids``; returns
        one bool per block (True: stored, or already there). Blocks the store holds are not
        written again; a store fault is a False, never an exception."""
        ids, idx, ok = self._block_args(block_ids, indices, unique=False)
        if self.store is None or not len(ids):
            return ok
        t0 = time.perf_counter()
        try:
            rids = self.rank_ids(ids)
            ok[:] = self.store.lookup(rids)
            todo = np.flatnonzero(~ok)
            if len(todo):
                buf = self.take_staging(len(todo) * self.block_bytes)
                try:
                    rows = buf[:len(todo) * self.block_bytes].view(len(todo), self.block_bytes)
                    ucm.gather_blocks(self.layout, torch.from_numpy(idx[todo]), rows)
                    res = self.store.wait(self.store.dump(rids[todo], 0, rows))
                    done = np.asarray(res.ok, dtype=bool)
                    self.store.commit(rids[todo], done)
                    ok[todo] = done
                finally:
                    self.staging.give(buf)
        except Exception as exc:
            log.warning("ucm: save of %d blocks failed (%r)", len(ids), exc)
            ok[:] = False
        self._count("save", ok, t0)
        return ok

    def _block_args(self, block_ids, indices, unique: bool) -> tuple:
        """``(ids, engine block indices, all-False result)``; ValueError naming the argument
        on unequal lengths, indices that are not integers in ``[0, num_blocks)`` (no ``-1``:
        a skipped block would be reported done) and, for loads (``unique``), an engine block
        named twice (it would hold one of two blocks' bytes)."""
        ids = ucm.as_ids(block_ids, "block_ids")
        if isinstance(indices, torch.Tensor):
            indices = indices.detach().cpu().numpy()
        arr = np.asarray(indices)
        if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
            raise ValueError(f"indices: expected a 1-D sequence of integer block indices, got "
                             f"shape {list(arr.shape)} dtype {arr.dtype}")
        if len(arr) != len(ids):
            raise ValueError(f"indices: {len(arr)} for {len(ids)} block ids")
        n = self.layout.num_blocks
        if arr.size and (int(arr.min()) < 0 or int(arr.max()) >= n):
            bad = next(int(x) for x in arr.tolist() if not 0 <= int(x) < n)
            raise ValueError(f"indices: block index {bad} out of range [0, {n})")
        idx = arr.astype(np.int64)
        if unique and len(np.unique(idx)) != len(idx):
            vals, counts = np.unique(idx, return_counts=True)
            raise ValueError(f"indices: block index {int(vals[counts > 1][0])} appears twice "
                             f"(one engine block cannot receive two blocks)")
        return ids, idx, np.zeros(len(ids), dtype=bool)

    def load_blocks(self, block_ids, indices) -> np.ndarray:
        """Load ``block_ids`` into the engine's blocks ``indices``; returns one bool per block.
        A block that fails (missing, corrupt, a store fault) is False and its engine block is
        left as it was: never another block's bytes."""
        ids, idx, ok = self._block_args(block_ids, indices, unique=True)
        if self.store is None or not len(ids):
            return ok
        t0 = time.perf_counter()
        if self.device.type == "cpu" and self.codec is None and self._load_borrowed(ids, idx):
            ok[:] = True
            self._count("load", ok, t0)
            return ok
        buf = self.take_staging(len(ids) * self.block_bytes)
        try:
            rows = buf[:len(ids) * self.block_bytes].view(len(ids), self.block_bytes)
            res = self.store.wait(self.store.load(self.rank_ids(ids), 0, rows))
            ok[:] = np.asarray(res.ok, dtype=bool)
            dst = np.where(ok, idx, -1)                  # -1: that row is not scattered
            ucm.scatter_blocks(self.layout, rows, torch.from_numpy(dst))
        except Exception as exc:
            log.warning("ucm: load of %d blocks failed (%r)", len(ids), exc)
            ok[:] = False
        finally:
            self.staging.give(buf)
        self._count("load", ok, t0)
        return ok

    def _load_borrowed(self, ids: np.ndarray, idx: np.ndarray) -> bool:
        """Every block in the memory tier: one copy from its pool straight into the engine's
        blocks (no staging). False, nothing done, otherwise."""
        try:
            lent = self.store.borrow(self.rank_ids(ids))
        except Exception:
            return False
        if lent is None:
            return False
        with lent:
            if not lent.all_found or len(np.unique(lent.rows)) < len(lent.rows):
                return False
            dst = torch.full((lent.pool.shape[0],), -1, dtype=torch.int64)
            dst[torch.from_numpy(lent.rows)] = torch.from_numpy(idx)
            ucm.scatter_blocks(self.layout, lent.pool, dst)
        return True

    def _count(self, kind: str, ok: np.ndarray, t0: float) -> None:
        """The ucm_{load,save}_* series of one synchronous call."""
        self.metrics.inc(f"ucm_{kind}_blocks_total", int(ok.sum()))
        self.metrics.inc(f"ucm_{kind}_bytes_total", int(ok.sum()) * self.block_bytes)
        self.metrics.inc(f"ucm_{kind}_failed_blocks_total", int((~ok).sum()))
        self.metrics.observe(f"ucm_{kind}_seconds", time.perf_counter() - t0)

    # staging ----------------------------------------------------------------------------------
    def alloc(self, nbytes: int) -> torch.Tensor:
        """A staging buffer: on the CPU from ucm's allocator (huge pages, faulted in once, so
        a request never pays page faults); on a GPU, device memory."""
        if self.device.type == "cpu":
            return torch.from_numpy(ucm.alloc_aligned(max(nbytes, 1)))
        return torch.empty(max(nbytes, 1), dtype=torch.uint8, device=self.device)

    def take_staging(self, nbytes: int) -> torch.Tensor:
        """A host/device staging buffer of at least nbytes, reused once its save completed."""
        return self.staging.take(nbytes)

    # step timing and statistics -----------------------------------------------------------------
    def forward_started(self) -> None:
        self._forward_t0 = time.perf_counter()

    def forward_ended(self) -> None:
        if self._forward_t0 is not None:
            self.metrics.inc("ucm_steps_total")
            self.metrics.inc("ucm_forward_seconds_total", time.perf_counter() - self._forward_t0)
            self._forward_t0 = None

    def write_stats(self, final: bool = False) -> None:
        """Append the totals to the stats file (the last line, written at close, also the
        store's statistics per tier: failed saves and unavailable servers of a lower tier show
        there)."""
        if self.stats_sink is None:
            return
        self._collect()
        extra = {"pid": os.getpid()}
        if final and self.store is not None:
            try:
                extra["store"] = self.store.stats()
            except Exception:
                pass
        self.stats_sink.write(self.metrics.totals(), **extra)

    def _collect(self) -> None:
        for source in self.metric_sources:
            self.metrics.add(source())
        if self.store_metrics is not None:
            try:
                self.store_metrics.collect(self.metrics)
            except Exception:   # a store fault: its tiers' series wait for the next call
                pass

    def drain_metrics(self) -> dict:
        """This worker's ucm.metrics payload since the last call: transfers, the store's tiers
        and sparse attention."""
        self._collect()
        return self.metrics.drain()

    def stats(self) -> dict:
        """The totals of :attr:`metrics` plus the store's statistics."""
        self._collect()
        out = self.metrics.totals()
        if self.store is not None:
            out["store"] = self.store.stats()
        return out

    def close(self) -> None:
        """Write the last statistics line and close the file (the store stays open). A second
        call does nothing."""
        if getattr(self, "_closed", False):
            return
        self._closed = True
        self.write_stats(final=True)
        if self.stats_sink is not None:
            self.stats_sink.close()
