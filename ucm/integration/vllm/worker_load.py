"""The worker's load path: store -> paged KV cache. Imports nothing from vLLM.

* :meth:`WorkerLoad.start` (vLLM's ``start_load_kv``): one batched load into a staging buffer,
  one scatter into the cache; with every block in the memory tier (CPU caches), one copy from
  the tier's pool straight into the cache (a "borrowed" load, no staging). With a compressing
  store the rows hold encoded blocks and the "scatter" decodes them straight into the cache
  (:func:`ucm.compress.decode_scatter`: the decoded KV is written once, and on CUDA only the
  encoded bytes cross to the device). Blocks that fail to
  load are reported by :meth:`WorkerLoad.take_errors` (``get_block_ids_with_load_errors``) and
  vLLM recomputes them (``ucm.integration.patch()`` makes vLLM also drop them, and the blocks
  computed after them, from its prefix cache, so no other request attends to them);
* overlapped loads (``connector.overlap_load``): the step's copy into the paged cache runs layer
  by layer on a background thread while the forward computes; :meth:`WorkerLoad.wait_layer`
  (``wait_for_layer_load``) waits per layer. Used only once vLLM was seen calling that hook for
  every layer within one step;
* layer-wise mode (``connector.layerwise``): per-layer loads, each waited for in
  :meth:`WorkerLoad.wait_layer`.

Inputs are plain: :class:`~ucm.integration.vllm.records.Transfer` records (store ids, vLLM block
numbers as ints), layer indices (``None``: a layer the caches do not know), tensors.
"""
from __future__ import annotations

import logging
import time
from typing import Callable, Optional

import numpy as np
import torch

import ucm
import ucm.transfer
from ucm import threads as ucm_threads
from ucm.integration.vllm.records import LayerLoad, Overlap, concat
from ucm.integration.core import WorkerCore

log = logging.getLogger("ucm.integration.vllm")


class WorkerLoad:
    """The load path of one worker over ``core``.

    ``layerwise``: per-layer loads; ``overlap``: allow overlapped loads (CPU caches only);
    ``spare_cpu``: a CPU beside the compute is free for the copy thread (without one, the copy
    takes the forward's own cores: measured 104 vs 78 ms warm TTFT with two OpenMP threads on
    2 cores); ``before_load``: called before a step's blocks are read from the store (the save
    path's drain: a block to load may still be on its way into the store)."""

    def __init__(self, core: WorkerCore, *, layerwise: bool = False, overlap: bool = False,
                 spare_cpu: bool = False, before_load: Optional[Callable[[], object]] = None):
        self.core = core
        self.layerwise = layerwise
        self.overlap = overlap and not layerwise
        self.spare_cpu = spare_cpu
        self._before_load = before_load
        self._staging: Optional[torch.Tensor] = None
        self._errors: set[int] = set()
        self._tails = np.zeros(0, dtype=bool)  # which entries of the step's load are tails
        # layer-wise loads of the step in flight
        self._layer_loads: dict[int, LayerLoad] = {}
        self._layer_ok = np.zeros(0, dtype=bool)
        self._layer_blocks: list = []
        self._layer_t0 = 0.0
        # overlapped loads
        self.hook_ok = False  # vLLM waits per layer: loads may overlap the forward
        self._hooked: set = set()  # layers whose wait_for_layer_load ran in this step
        self._ov: Optional[Overlap] = None
        self._executor = None

    def reserve(self, nbytes: int) -> None:
        """Allocate the staging buffer now (a long prompt's first load pays no allocation)."""
        self._staging = self.core.alloc(nbytes)

    def _staging_rows(self, n: int, nbytes: int) -> torch.Tensor:
        need = n * nbytes
        if self._staging is None or self._staging.numel() < need:
            self._staging = self.core.alloc(
                max(need, 2 * (self._staging.numel() if self._staging is not None else 0)))
        return self._staging[:need].view(n, nbytes)

    # a step's load ----------------------------------------------------------------------------
    def start(self, loads: list, resumed: list = ()) -> None:
        """Load the step's blocks (``loads``: Transfer records) into the cache, or start doing
        so (overlapped and layer-wise loads). ``resumed``: requests back after a preemption."""
        core = self.core
        if resumed:  # preempted requests back: their blocks load like any other hit
            core.metrics.inc("ucm_resumed_requests_total", len(resumed))
            core.metrics.inc("ucm_resumed_load_blocks_total",
                             sum(len(t.blocks) for t in loads if t.req_id in resumed))
        self.finish_overlap()  # (normally done by the previous step's end)
        if not loads or core.store is None:
            return
        if self._before_load is not None:
            self._before_load()  # a block to load may still be on its way into the store
        ids, blocks, self._tails = concat(loads)
        ids = core.rank_ids(ids)
        if self.layerwise:
            self._start_layer_loads(ids, blocks)
            return
        t0 = time.perf_counter()
        if core.device.type == "cpu" and self._load_borrowed(ids, blocks, t0):
            return
        codec = core.codec
        staging = self._staging_rows(len(ids), core.block_bytes if codec is None
                                     else codec.encoded_row_bytes)
        try:
            task = core.store.load(ids, 0, staging) if codec is None else \
                codec.load_encoded(ids, staging)
            ok = core.store.wait(task).ok
        except Exception as exc:
            log.warning("ucm: load failed (%r); %d blocks will be recomputed", exc, len(ids))
            ok = np.zeros(len(ids), dtype=bool)
        t1 = time.perf_counter()
        idx = torch.tensor([b if good else -1 for b, good in zip(blocks, ok)], dtype=torch.int64)
        if ok.any() and not self._scatter_overlapped(staging, idx, self._tails, None):
            self._copy(staging, idx.to(core.device))
        t2 = time.perf_counter()
        core.metrics.inc("ucm_load_store_seconds_total", t1 - t0)
        core.metrics.inc("ucm_load_scatter_seconds_total", t2 - t1)
        self._record(blocks, ok, t2 - t0)

    def _load_borrowed(self, ids, blocks, t0) -> bool:
        """All blocks in the memory tier: one copy from its pool straight into the paged cache
        (no staging buffer). False (nothing done) when some block is elsewhere."""
        core = self.core
        try:
            lent = core.store.borrow(ids) if core.codec is None else core.codec.borrow_encoded(ids)
        except Exception as exc:
            log.debug("ucm: borrow failed (%r); loading through staging", exc)
            return False
        if lent is None:
            return False
        if not lent.all_found or len(np.unique(lent.rows)) < len(lent.rows):
            lent.release()
            return False  # (one pool row cannot feed two cache blocks in one scatter)
        idx = torch.full((lent.pool.shape[0],), -1, dtype=torch.int64)
        idx[torch.from_numpy(lent.rows)] = torch.tensor(blocks, dtype=torch.int64)
        tails = np.zeros(lent.pool.shape[0], dtype=bool)
        tails[lent.rows] = self._tails
        t1 = time.perf_counter()
        try:
            if not self._scatter_overlapped(lent.pool, idx, tails, lent.release):
                with lent:
                    self._copy(lent.pool, idx)
        except BaseException:
            lent.release()
            raise
        t2 = time.perf_counter()
        core.metrics.inc("ucm_load_store_seconds_total", t1 - t0)
        core.metrics.inc("ucm_load_scatter_seconds_total", t2 - t1)
        core.metrics.inc("ucm_borrowed_load_blocks_total", len(blocks))
        self._record(blocks, np.ones(len(blocks), dtype=bool), t2 - t0)
        return True

    def _record(self, blocks, ok, seconds) -> None:
        failed = [b for b, good in zip(blocks, ok) if not good]
        self._errors.update(failed)
        n = int(np.sum(ok))
        tails = int(np.sum(ok & self._tails))
        m = self.core.metrics
        m.inc("ucm_load_blocks_total", n - tails)
        m.inc("ucm_load_tail_blocks_total", tails)
        m.inc("ucm_load_bytes_total", n * self.core.block_bytes)
        m.inc("ucm_load_failed_blocks_total", len(failed))
        m.observe("ucm_load_seconds", seconds)
        if failed:
            log.warning("ucm: %d of %d blocks failed to load; vLLM recomputes them", len(failed),
                        len(blocks))

    def add_errors(self, blocks) -> None:
        """Report ``blocks`` as failed loads (vLLM computes them): a Blend that could not run."""
        self._errors.update(int(b) for b in blocks)
        self.core.metrics.inc("ucm_load_failed_blocks_total", len(blocks))

    def complete(self) -> None:
        """Every block of the step's load is in the cache now (overlapped and layer-wise loads
        included): work that reads the prefix (Blend) runs after this."""
        if self._ov is not None:
            for k in range(self.core.n_layers):
                self.wait_layer(k)
        for k in sorted(self._layer_loads):
            self.wait_layer(k)

    def pending_errors(self) -> frozenset:
        """vLLM blocks whose load failed in this step so far (not yet reported to vLLM)."""
        return frozenset(self._errors)

    def take_errors(self) -> set[int]:
        """vLLM blocks whose load failed since the last call (vLLM recomputes them)."""
        out, self._errors = self._errors, set()
        return out

    # overlapped loads ---------------------------------------------------------------------------
    def _scatter_overlapped(self, src: torch.Tensor, idx: torch.Tensor, tails: np.ndarray,
                            release) -> bool:
        """Start copying ``src`` (full staged rows) into the cache blocks ``idx`` layer by layer
        on the load thread; False (nothing done) when overlapping is off or not safe yet.
        Partial tails are copied now: vLLM writes this step's new tokens into their blocks
        before the attention's wait_for_layer_load, and a late copy would overwrite them.
        ``release`` (or None) runs once the copy is done."""
        core = self.core
        if not (self.overlap and self.hook_ok and core.device.type == "cpu"
                and self.spare_cpu and core.n_layers > 1):
            return False
        if tails.any():
            now = torch.where(torch.from_numpy(tails), idx, -1)
            self._copy(src, now)
            idx = torch.where(torch.from_numpy(tails), -1, idx)
        ov = Overlap(src, idx, core.n_layers, release)
        core.metrics.inc("ucm_overlapped_load_blocks_total", int((idx >= 0).sum()))
        if self._executor is None:
            self._executor = ucm_threads.pool(1, "ucm-load")
        self._ov = ov
        ov.future = self._executor.submit(self._overlap_job, ov)
        return True

    def _copy(self, src: torch.Tensor, idx: torch.Tensor, layers=None) -> None:
        """Rows ``src`` (whole blocks, or the shards of ``layers``) into the cache blocks
        ``idx`` (-1: skip): a copy, or with a compressing store a decode straight into them."""
        core = self.core
        if core.codec is None:
            ucm.scatter_blocks(core.layout, src, idx, layers=layers)
        else:
            core.codec.decode_scatter(core.layout, src, idx, layers)

    def _scatter_layer(self, ov: Overlap, k: int) -> None:
        if ov.layer_copy is not None:
            ov.layer_copy(k)
            return
        layout, codec = self.core.layout, self.core.codec
        if codec is None:
            a, n = layout.shard_offset(k), layout.shard_bytes(k)
        else:  # encoded rows: shard k (layer k) at k * its encoded size
            a, n = k * codec.enc, codec.enc
        self._copy(ov.src[:, a:a + n], ov.idx, [k])

    def _overlap_job(self, ov: Overlap) -> None:
        t0 = time.perf_counter()
        core = self.core
        # prepared here, off the forward's path, so that each layer below is one copy or
        # decode with the GIL released: every Python step of this thread waits for the GIL,
        # which the forward's thread holds between its ops, up to the switch interval (5 ms)
        try:
            ov.layer_copy = ucm.transfer.layer_scatter(core.layout, ov.src, ov.idx) \
                if core.codec is None else core.codec.layer_decoder(core.layout, ov.src, ov.idx)
        except Exception as exc:
            log.warning("ucm: preparing the copy of a load failed (%r); copying layer by "
                        "layer", exc)
        for k in range(len(ov.done)):
            try:
                self._scatter_layer(ov, k)
            except Exception as exc:  # retried on the engine's thread (wait_layer)
                ov.failed[k] = exc
            ov.done[k].set()
        ov.seconds = time.perf_counter() - t0

    def _wait_overlapped(self, ov: Overlap, k: int) -> None:
        """Layer ``k`` of an overlapped load is in the cache (copied here if the thread failed)."""
        if k in ov.waited:
            return
        ov.done[k].wait()
        if k in ov.failed:
            log.warning("ucm: background copy of layer %d failed (%r); copying it again", k, ov.failed[k])
            self._scatter_layer(ov, k)  # a second failure propagates: never compute on bad KV
        ov.waited.add(k)

    def finish_overlap(self) -> None:
        """End the overlapped load in flight: every layer in the cache, its source released."""
        ov, self._ov = self._ov, None
        if ov is None:
            return
        t0 = time.perf_counter()
        try:
            ov.future.result()
            missed = [k for k in range(len(ov.done)) if k not in ov.waited]
            if missed:
                # the forward ran without waiting for these layers: vLLM stopped calling the
                # hook; never overlap again in this engine
                log.error("ucm: layers %s were not waited for by the forward; overlapped loads off",
                          missed[:8])
                self.overlap = False
            for k in range(len(ov.done)):
                self._wait_overlapped(ov, k)
        finally:
            if ov.release is not None:
                ov.release()
        self.core.metrics.inc("ucm_load_scatter_seconds_total", ov.seconds)
        self.core.metrics.inc("ucm_load_scatter_wait_seconds_total", time.perf_counter() - t0)

    # per layer --------------------------------------------------------------------------------
    def wait_layer(self, k: Optional[int]) -> None:
        """vLLM's ``wait_for_layer_load``: layer ``k`` (None: a layer the caches do not know;
        then every layer) of the step's load is in the cache when this returns."""
        if not self.hook_ok and k is not None:
            self._hooked.add(k)
        ov = self._ov
        if ov is None and not self._layer_loads:
            return
        if ov is not None:
            t0 = time.perf_counter()
            if k is None:  # a layer we do not know: wait for all of them
                for j in range(len(ov.done)):
                    self._wait_overlapped(ov, j)
            else:
                self._wait_overlapped(ov, k)
            self.core.metrics.inc("ucm_load_scatter_wait_seconds_total", time.perf_counter() - t0)
            return
        entry = self._layer_loads.pop(k, None) if k is not None else None
        if entry is None:
            return
        core = self.core
        try:
            ok = core.store.wait(entry.task).ok
        except Exception:
            ok = np.zeros(len(entry.rows), dtype=bool)
        self._layer_ok &= ok
        idx = torch.tensor([b if good else -1 for b, good in zip(self._layer_blocks, ok)], dtype=torch.int64)
        if ok.any():
            ucm.scatter_blocks(core.layout, entry.rows, idx.to(core.device), layers=[entry.layer])
        if not self._layer_loads:  # last layer: account for the whole load
            self._record(self._layer_blocks, self._layer_ok, time.perf_counter() - self._layer_t0)

    def _start_layer_loads(self, ids, blocks) -> None:
        core = self.core
        self._layer_loads = {}
        self._layer_ok = np.ones(len(ids), dtype=bool)
        self._layer_blocks = blocks
        self._layer_t0 = time.perf_counter()
        nb = core.shard
        staging = self._staging_rows(len(ids) * core.n_layers, nb)
        for k in range(core.n_layers):
            rows = staging[k * len(ids):(k + 1) * len(ids)]
            self._layer_loads[k] = LayerLoad(k, rows, core.store.load(ids, k * nb, rows))

    # step end ---------------------------------------------------------------------------------
    def end_step(self) -> None:
        """The step's forward ended (``wait_for_save``): the overlapped load is complete, and
        whether vLLM waited for every layer is known."""
        self.finish_overlap()
        if self._hooked:
            if not self.hook_ok and self._hooked.issuperset(range(self.core.n_layers)):
                self.hook_ok = True  # vLLM waits per layer: later loads may overlap the forward
            self._hooked = set()

    def shutdown(self) -> None:
        if self._ov is not None:
            self.finish_overlap()
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None
