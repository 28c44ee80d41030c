"""The worker's save path: paged KV cache -> store. Imports nothing from vLLM.

* :meth:`WorkerSave.end_step` (vLLM's ``wait_for_save``): one gather of the step's new blocks
  into a staging buffer, one dump, commit. With ``connector.async_save`` (the default) the whole
  save (gather included) runs on a background thread and the step returns at once. That is safe
  because vLLM writes only blocks it allocated from its free pool, and a block being saved never
  gets there before its save finished: ``request_finished`` keeps a finished request's blocks
  (vLLM's delayed free) until ``get_finished`` (:meth:`WorkerSave.finished`) reports its saves
  done; a step that preempted requests (whose blocks vLLM frees at once) first waits for every
  save in flight (``barrier`` in :meth:`WorkerSave.begin_step`); a step that loads waits for
  them too (it may load a block still being saved: the load path calls :meth:`drain`);
* with ``connector.save_during_forward`` (the default) the background thread copies the new
  blocks out layer by layer as vLLM reports each layer done (``save_kv_layer``,
  :meth:`WorkerSave.layer_done`) and dumps each layer's part, while the forward computes the
  next layers; ``wait_for_save`` only queues the job that stores the rest (layers whose hook
  did not come) and commits. A prompt's save thus runs beside its own prefill (compute-bound)
  instead of through the first decode steps;
* layer-wise mode (``connector.layerwise``): per-layer saves from ``save_kv_layer``, committed
  at the step's end.

Inputs are plain: :class:`~ucm.integration.vllm.records.Transfer` records (store ids, vLLM block
numbers as ints), layer indices (``None``: a layer the caches do not know), request ids.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Optional

import numpy as np
import torch

import ucm
from ucm import threads as ucm_threads
from ucm.integration.vllm.records import LayerDump, LayerSave, LayerSaveState, SavePlan, concat
from ucm.integration.core import WorkerCore

log = logging.getLogger("ucm.integration.vllm")


class WorkerSave:
    """The save path of one worker over ``core``.

    ``background``: saves run on a background thread (``connector.async_save``; vLLM must then
    keep finished requests' blocks until :meth:`finished` reports them); ``during_forward``: with
    background saves, copy each layer out as vLLM reports it done (CPU caches whose layers are
    stored at their own offsets only); ``layerwise``: per-layer saves (no background thread)."""

    def __init__(self, core: WorkerCore, *, background: bool = True, during_forward: bool = True,
                 layerwise: bool = False):
        self.core = core
        self.layerwise = layerwise
        self.background = background and not layerwise
        # saves during the forward store each layer's part of a block at its own offset; CPU
        # engines only (on a GPU the save thread's copies would need the forward's stream)
        self.during = self.background and during_forward \
            and core.shard * core.n_layers == core.block_bytes and core.device.type == "cpu"
        # the step bound by begin_step: its saves (None: no ucm metadata this step) and idleness
        self._saves: Optional[list] = None
        self._step_idle = False
        self.idle = False  # the last step computed nothing (vLLM only polls us)
        # saves during the forward: per step, the layer jobs queued so far (None: not begun this
        # step; False: nothing to save); used once vLLM called save_kv_layer for every layer
        self._lsave: LayerSaveState = None
        self._lsave_seen: set = set()
        self.lsave_ok = False
        self._layer_dumps: list[LayerDump] = []  # layer-wise mode: the step's dumps
        # background saves: one thread runs them in order; per request, how many are in flight
        self._jobs_done = threading.Condition(core.lock)
        self._executor = None
        self._jobs_in_flight = 0
        self._req_jobs: dict[str, int] = {}  # requests we got saves for -> saves in flight
        self._finishing: set[str] = set()  # finished requests whose blocks vLLM keeps for us

    # the step ---------------------------------------------------------------------------------
    def begin_step(self, saves: Optional[list], *, idle: bool = False, barrier: bool = False) -> None:
        """A step's metadata arrived (``bind_connector_metadata``). ``saves``: its Transfer
        records (None: no ucm metadata); ``barrier``: wait for every save in flight first."""
        stale, self._lsave = self._lsave, None
        if stale:  # layer saves of a step that never reached wait_for_save: finish them
            self._finish_saves_during_forward(stale)
        self._saves, self._step_idle = saves, idle
        if barrier:
            self.drain()  # preempted blocks may be reused by this step's forward

    def clear_step(self) -> None:
        """The step's metadata is gone (``clear_connector_metadata``)."""
        self._saves = None

    def layer_done(self, k: Optional[int]) -> None:
        """vLLM's ``save_kv_layer``: the forward wrote layer ``k`` (None: a layer the caches do
        not know) of this step's tokens."""
        if self.during:
            if not self.lsave_ok:
                if k is not None:
                    self._lsave_seen.add(k)
            elif self._lsave is not False:
                self._save_layer(k)
            return
        core = self.core
        if not self.layerwise or not self._saves or core.store is None or k is None:
            return
        ids, blocks, _ = concat(self._saves)
        ids = core.rank_ids(ids)
        rows = torch.empty((len(ids), core.shard), dtype=torch.uint8, device=core.device)
        ucm.gather_blocks(core.layout, torch.tensor(blocks, dtype=torch.int64, device=core.device),
                          rows, layers=[k])
        self._layer_dumps.append(LayerDump(ids, core.store.dump(ids, k * core.shard, rows), rows))

    def end_step(self) -> bool:
        """vLLM's ``wait_for_save``: store what the step has to (in the background by default).
        False when the step had no ucm metadata (or no store)."""
        layer_saves, self._lsave = self._lsave, None
        if self.during and not self.lsave_ok:
            if self._lsave_seen.issuperset(range(self.core.n_layers)):
                self.lsave_ok = True  # vLLM reports every layer: later saves start during the forward
            self._lsave_seen = set()
        if layer_saves:  # queued by layer_done: store the rest, then commit
            self._finish_saves_during_forward(layer_saves)
        saves = self._saves
        if saves is None or self.core.store is None:
            return False
        self.idle = self._step_idle
        if self.layerwise:
            self._finish_layer_saves(saves)
        elif saves and not layer_saves:
            self._save(saves)
        return True

    def _plan(self, saves: list) -> SavePlan:
        """The step's saves, each block once, under this rank's ids."""
        ids, blocks, is_tail = concat(saves)
        # Two requests of one step may both hold a block no one had stored yet: save it once
        # (two writers of one block could interleave two numerically different versions).
        _, first = np.unique(ids, axis=0, return_index=True)
        if len(first) < len(ids):
            keep = np.sort(first)
            ids, blocks, is_tail = ids[keep], [blocks[k] for k in keep], is_tail[keep]
        return SavePlan(self.core.rank_ids(ids), blocks, is_tail, sorted({t.req_id for t in saves}))

    # saves at the step's end ------------------------------------------------------------------
    def _save(self, saves: list) -> None:
        """Store the step's new blocks: copy them out of the paged cache, dump, commit. In the
        background with ``background`` (vLLM keeps the blocks until then, see the module doc),
        else before the step returns."""
        plan = self._plan(saves)
        if not self.background:
            self._run_save(plan.ids, plan.blocks, plan.is_tail, ())
            return
        self._job_started(plan.reqs)
        if self._executor is None:
            self._executor = ucm_threads.pool(1, "ucm-save")
        self._executor.submit(self._run_save, plan.ids, plan.blocks, plan.is_tail, plan.reqs)

    def _run_save(self, ids, blocks, is_tail, reqs) -> None:
        core = self.core
        bb = core.block_bytes
        t0 = time.perf_counter()
        ok = np.zeros(len(ids), dtype=bool)
        staging = None
        try:
            staging = core.take_staging(len(ids) * bb)
            rows = staging[:len(ids) * bb].view(len(ids), bb)
            ucm.gather_blocks(core.layout, torch.tensor(blocks, dtype=torch.int64, device=core.device), rows)
            t1 = time.perf_counter()
            ok = core.store.wait(core.store.dump(ids, 0, rows)).ok
            core.store.commit(ids, ok)
        except Exception as exc:  # a failed save is a future miss, nothing more
            t1 = t0
            ok = self._save_failed(ids, exc)
        finally:
            self._save_ended(staging, ok, time.perf_counter() - t0, t1 - t0, is_tail, reqs)

    # saves during the forward -----------------------------------------------------------------
    def _save_layer(self, k: Optional[int]) -> None:
        """layer_done during the forward: queue the copy and dump of this layer's part of the
        step's new blocks on the background thread."""
        ls = self._lsave
        if ls is None:  # the step's first layer: plan its saves once
            if not self._saves or self.core.store is None:
                self._lsave = False
                return
            plan = self._plan(self._saves)
            staging = self.core.take_staging(len(plan.ids) * self.core.block_bytes)
            ls = self._lsave = LayerSave(plan.ids, torch.tensor(plan.blocks, dtype=torch.int64),
                                         plan.is_tail, plan.reqs, staging)
            if self._executor is None:
                self._executor = ucm_threads.pool(1, "ucm-save")
        if k is None or k in ls.queued:
            return
        ls.queued.add(k)
        self._executor.submit(self._run_layer_save, ls, [k])

    def _run_layer_save(self, ls: LayerSave, layers: list) -> None:
        """Background thread: copy ``layers`` of the step's blocks into their part of the staged
        rows (layer-major, each layer's part contiguous) and dump each part at its offset."""
        core = self.core
        t0 = time.perf_counter()
        n, shard = len(ls.ids), core.shard
        try:
            for k in layers:
                rows = ls.staging[k * n * shard:(k + 1) * n * shard].view(n, shard)
                t1 = time.perf_counter()
                ucm.gather_blocks(core.layout, ls.blocks, rows, layers=[k])
                ls.gather_s += time.perf_counter() - t1
                ls.tasks.append(core.store.dump(ls.ids, k * shard, rows))
        except Exception as exc:  # a failed save is a future miss, nothing more
            log.warning("ucm: save of layer(s) %s failed: %r", layers, exc)
            ls.failed = True
        ls.busy_s += time.perf_counter() - t0

    def _finish_saves_during_forward(self, ls: LayerSave) -> None:
        """The step's end after layer saves: queue the layers vLLM did not report and the commit
        (the request's blocks stay with us until it ran, as for any background save)."""
        rest = [k for k in range(self.core.n_layers) if k not in ls.queued]
        self.core.metrics.inc("ucm_saves_during_forward_total", 1)
        self._job_started(ls.reqs)
        if rest:
            self._executor.submit(self._run_layer_save, ls, rest)
        self._executor.submit(self._commit_layer_saves, ls)

    def _commit_layer_saves(self, ls: LayerSave) -> None:
        store = self.core.store
        t0 = time.perf_counter()
        ok = np.zeros(len(ls.ids), dtype=bool) if ls.failed else np.ones(len(ls.ids), dtype=bool)
        try:
            for task in ls.tasks:
                ok &= store.wait(task).ok
            store.commit(ls.ids, ok)
        except Exception as exc:
            ok = self._save_failed(ls.ids, exc)
        finally:
            self._save_ended(ls.staging, ok, ls.busy_s + time.perf_counter() - t0,
                             ls.gather_s, ls.is_tail, ls.reqs)

    # layer-wise mode --------------------------------------------------------------------------
    def _finish_layer_saves(self, saves: list) -> None:
        if not self._layer_dumps:
            return
        store = self.core.store
        t0 = time.perf_counter()
        ids = self._layer_dumps[0].ids
        ok = np.ones(len(ids), dtype=bool)
        failed = None
        for d in self._layer_dumps:
            try:
                ok &= store.wait(d.task).ok
            except Exception as exc:
                ok[:] = False
                failed = failed or exc
        if failed is not None:     # (the blocks are counted as failed saves: a future miss)
            log.warning("ucm: layer-wise save of %d blocks failed: %r", len(ids), failed)
        complete = len(self._layer_dumps) == self.core.n_layers
        store.commit(ids, ok & complete)
        self._layer_dumps = []
        self._count(ok & complete, time.perf_counter() - t0, concat(saves)[2])

    # bookkeeping ------------------------------------------------------------------------------
    def _job_started(self, reqs: list) -> None:
        """A background save job for ``reqs`` is queued (vLLM keeps their blocks until it ends)."""
        with self.core.lock:
            for r in reqs:
                self._req_jobs[r] = self._req_jobs.get(r, 0) + 1
            self._jobs_in_flight += 1

    def _save_failed(self, ids, exc) -> np.ndarray:
        """A save that raised: logged, its blocks committed as failed (a future miss)."""
        log.warning("ucm: save of %d blocks failed: %r", len(ids), exc)
        ok = np.zeros(len(ids), dtype=bool)
        try:
            self.core.store.commit(ids, ok)
        except Exception:
            pass
        return ok

    def _save_ended(self, staging, ok, seconds: float, gather_s: float, is_tail, reqs) -> None:
        """Bookkeeping at the end of a save: its staging back to the pool, counters, and (a
        background job) the requests' jobs in flight."""
        core = self.core
        with core.lock:
            if staging is not None:
                core.staging.give(staging)
            core.metrics.inc("ucm_save_gather_seconds_total", gather_s)
            self._count(ok, seconds, is_tail)
            if reqs:
                for r in reqs:
                    self._req_jobs[r] -= 1
                self._jobs_in_flight -= 1
                self._jobs_done.notify_all()

    def _count(self, ok, seconds, is_tail=None) -> None:
        n = int(np.sum(ok))
        tails = int(np.sum(ok & is_tail)) if is_tail is not None else 0
        m = self.core.metrics
        m.inc("ucm_save_blocks_total", n - tails)
        m.inc("ucm_save_tail_blocks_total", tails)
        m.inc("ucm_save_bytes_total", n * self.core.block_bytes)
        m.inc("ucm_save_failed_blocks_total", len(ok) - n)
        m.observe("ucm_save_seconds", seconds)

    def drain(self, timeout: Optional[float] = None) -> bool:
        """Wait for the background saves in flight (at most ``timeout`` seconds); True when none
        is left."""
        if not self.background:
            return True
        with self.core.lock:
            if not self._jobs_in_flight:
                return True
            t0 = time.perf_counter()
            done = self._jobs_done.wait_for(lambda: self._jobs_in_flight == 0, timeout)
            if timeout is None:
                self.core.metrics.inc("ucm_save_waits_total", 1)
                self.core.metrics.inc("ucm_save_wait_seconds_total", time.perf_counter() - t0)
            return done

    def finished(self, finished_req_ids: set[str]) -> Optional[set[str]]:
        """``get_finished``: finished requests whose background saves are all done: vLLM frees
        their blocks now (they are exactly the requests we got saves for; ``request_finished``
        delayed those). None when there is none."""
        if self.idle and self._finishing:
            self.drain(timeout=0.005)  # vLLM is only polling us: no busy loop meanwhile
        with self.core.lock:
            for r in finished_req_ids:
                if r in self._req_jobs:
                    self._finishing.add(r)
            done = {r for r in self._finishing if self._req_jobs.get(r, 0) == 0}
            for r in done:
                self._finishing.discard(r)
                self._req_jobs.pop(r, None)
        return done or None

    def shutdown(self) -> None:
        if self._executor is not None:
            self.drain()
            self._executor.shutdown(wait=True)
            self._executor = None
