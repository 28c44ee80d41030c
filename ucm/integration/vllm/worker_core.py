"""State the worker's load path (:mod:`.worker_load`) and save path (:mod:`.worker_save`) share:
the paged caches' byte layout, the store, the device, the pool of staging buffers, the counters
and the rule that turns a block id into this rank's id. Imports nothing from vLLM: the caches are
described by a :class:`ucm.KVLayout` over plain tensors.
"""
from __future__ import annotations

import json
import os
import threading
import time
from typing import Callable, Optional

import numpy as np
import torch

import ucm
from ucm import metrics as ucm_metrics


def new_counters() -> dict:
    """The worker's counters (one line of ``connector.stats_file`` per step).

    load_s = load_store_s + scatter_s; save_s (gather to commit) includes gather_s;
    forward_s: from start_load_kv's return to wait_for_save (vLLM 0.32 calls
    start_load_kv after the forward in steps without loads, so ~0 there).
    *_tail_blocks: partial last blocks of prompts (not counted in *_blocks)."""
    return {"load_blocks": 0, "load_failed": 0, "load_bytes": 0, "load_s": 0.0,
            "load_store_s": 0.0, "scatter_s": 0.0, "load_tail_blocks": 0,
            "save_blocks": 0, "save_failed": 0, "save_bytes": 0, "save_s": 0.0,
            "gather_s": 0.0, "save_tail_blocks": 0, "save_waits": 0,
            "save_wait_s": 0.0, "steps": 0, "forward_s": 0.0,
            "resumed_requests": 0, "resumed_load_blocks": 0,
            "borrowed_load_blocks": 0, "background_cpus": 0,
            "overlapped_load_blocks": 0, "scatter_wait_s": 0.0,
            "saves_during_forward": 0}


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
    same ids); ``stats_file``: where :meth:`write_stats` appends a line (None: nowhere)."""

    def __init__(self, layout: "ucm.KVLayout", store, device, *, shard_bytes: Optional[int] = None,
                 rank_ids: Optional[Callable[[np.ndarray], np.ndarray]] = None,
                 stats_file: Optional[str] = None):
        self.layout = layout
        self.store = store
        self.device = torch.device(device)
        self.n_layers = layout.num_layers
        self.block_bytes = layout.block_bytes
        self.shard = shard_bytes if shard_bytes is not None else store_shard_bytes(layout)
        self.rank_ids = rank_ids if rank_ids is not None else (lambda ids: ids)
        self.stats_file = stats_file
        self.counters = new_counters()
        #: ucm.metrics series of this worker (drained by the connector into vLLM's stats)
        self.metrics = ucm_metrics.Recorder()
        self.store_metrics = ucm_metrics.StoreCollector(store) if store is not None else None
        # guards the staging pool, the counters a save thread updates and the save jobs in flight
        self.lock = threading.Lock()
        self.free_staging: list = []  # staging buffers of ended saves, reused
        self._forward_t0: Optional[float] = None
        self._stats_fh = None
        self._published: dict = {}   # the metrics payload drained since the last stats line

    # staging ----------------------------------------------------------------------------------
    def alloc(self, nbytes: int) -> torch.Tensor:
        """A staging buffer: on the CPU from ucm's allocator (huge pages, faulted in once, so
        a request never pays page faults); on a GPU, device memory."""
        if self.device.type == "cpu":
            return torch.from_numpy(ucm.alloc_aligned(max(nbytes, 1)))
        return torch.empty(max(nbytes, 1), dtype=torch.uint8, device=self.device)

    def take_staging(self, nbytes: int) -> torch.Tensor:
        """A host/device staging buffer of at least nbytes, reused once its save completed."""
        with self.lock:
            for i, buf in enumerate(self.free_staging):
                if buf.numel() >= nbytes:
                    return self.free_staging.pop(i)
        return self.alloc(max(nbytes, 1 << 20))

    # step timing and statistics -----------------------------------------------------------------
    def forward_started(self) -> None:
        self._forward_t0 = time.perf_counter()

    def forward_ended(self) -> None:
        if self._forward_t0 is not None:
            self.counters["steps"] += 1
            self.counters["forward_s"] += time.perf_counter() - self._forward_t0
            self._forward_t0 = None

    def write_stats(self, final: bool = False) -> None:
        """Append the counters (the last line, written at close, also the store's statistics
        per tier: failed saves and unavailable servers of a lower tier show there)."""
        if not self.stats_file:
            return
        try:  # one line per step: the file stays open (opening it per step cost 0.3 ms)
            f = self._stats_fh
            if f is None:
                f = self._stats_fh = open(self.stats_file, "a", buffering=1)
            line = {"t": time.time(), "pid": os.getpid(), **self.counters}
            if self._published:
                line["metrics"], self._published = self._published, {}
            if final and self.store is not None:
                line["store"] = self.store.stats()
            f.write(json.dumps(line, default=str) + "\n")
        except (OSError, ValueError):
            pass

    def drain_metrics(self) -> dict:
        """This worker's ucm.metrics payload since the last call: transfers, the store's tiers
        and sparse attention (also the next stats-file line's ``metrics``)."""
        from ucm.integration.vllm import sparse_hook

        if self.store_metrics is not None:
            try:
                self.store_metrics.collect(self.metrics)
            except Exception:   # a store fault: its tiers' series wait for the next call
                pass
        p = ucm_metrics.merge(self.metrics.drain(), sparse_hook.drain_metrics())
        if self.stats_file:
            ucm_metrics.merge(self._published, p)
        return p

    def stats(self) -> dict:
        """Counters plus the store's statistics."""
        out = dict(self.counters)
        if self.store is not None:
            out["store"] = self.store.stats()
        return out

    def close(self) -> None:
        """Write the last statistics line and close the file (the store stays open)."""
        self.write_stats(final=True)
        if self._stats_fh is not None:
            self._stats_fh.close()
            self._stats_fh = None
