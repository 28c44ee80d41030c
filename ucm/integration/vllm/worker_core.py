"""State the worker's load path (:mod:`.worker_load`) and save path (:mod:`.worker_save`) share:
the paged caches' byte layout, the store, the device, the pool of staging buffers, the counters
and the rule that turns a block id into this rank's id. Imports nothing from vLLM: the caches are
described by a :class:`ucm.KVLayout` over plain tensors.
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
        from ucm.integration.vllm import sparse_hook

        self.metrics.add(sparse_hook.drain_metrics())
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
        """Write the last statistics line and close the file (the store stays open)."""
        self.write_stats(final=True)
        if self.stats_sink is not None:
            self.stats_sink.close()
