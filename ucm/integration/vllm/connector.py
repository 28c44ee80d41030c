"""``UCMConnector``: vLLM's KV-connector API (``KVConnectorBase_V1``, vLLM 0.32) backed by a ucm
store.

Use it with::

    --kv-transfer-config '{"kv_connector": "UCMConnector",
                           "kv_connector_module_path": "ucm.integration.vllm",
                           "kv_role": "kv_both",
                           "kv_connector_extra_config": {"store": {"pipeline": "memory|posix",
                                                         "posix": {"roots": ["/mnt/ucm"]}}}}'

(``kv_connector_module_path`` may be left out once ucm's vLLM plugin, installed with the package,
registered the name). ``kv_connector_extra_config`` holds ucm config keys; ``UCM_CONFIG_FILE``
and ``UCM_*`` variables apply too (``ucm.Config.load``).

Scheduler side (pure bookkeeping, no data movement):

* ``get_num_new_matched_tokens``: hash the request's full blocks (chained, cached per request),
  ask the store how many blocks after vLLM's own prefix hit it holds; the last prompt token is
  always left to compute. When every full block hits, the prompt's partial last block (its
  "tail", stored under an id of its exact tokens) is looked up too: a repeated prompt then
  computes only its last token instead of up to ``block_size`` tokens
  (``connector.partial_tail``). A block counts as present only once every rank committed it
  (a save in flight is not a hit: a failed save would become a failed load). Block ids follow
  :mod:`ucm.integration.vllm.keys`: LoRA adapter, ``cache_salt``, multimodal items and prompt
  embeds separate requests exactly as in vLLM's prefix cache, each rank stores its own shard,
  and ``reset_prefix_cache(reset_connector=True)`` raises the namespace's generation (stored
  with a posix tier, so it outlives the engine), which retires every block stored before;
* ``update_state_after_alloc``: remember which vLLM blocks to fill;
* ``build_connector_meta``: per step, the loads to run and the newly completed blocks to save
  (prompt and, by default, generated tokens), with chunked prefill and preemption handled
  through vLLM's per-step block tables.

Worker side (data movement):

* ``register_kv_caches``: plan the byte layout of the paged caches (any vLLM layout, strided
  views of one allocation included) and open the store;
* ``start_load_kv``: one batched load into a staging buffer, one scatter into the cache; blocks
  that fail to load are reported by ``get_block_ids_with_load_errors`` and vLLM recomputes
  them (``ucm.integration.patch()`` makes vLLM also drop them, and the blocks computed after
  them, from its prefix cache, so no other request attends to them);
* ``wait_for_save``: one gather of the step's new blocks into a staging buffer, one dump,
  commit. With ``connector.async_save`` (the default) the whole save (gather included) runs on
  a background thread and the step returns at once. That is safe because vLLM writes only
  blocks it allocated from its free pool, and a block being saved never gets there before its
  save finished: ``request_finished`` keeps a finished request's blocks (vLLM's delayed free)
  until ``get_finished`` reports its saves done; a step that preempted requests (whose blocks
  vLLM frees at once) first waits for every save in flight (``bind_connector_metadata``); a
  step that loads waits for them too (it may load a block still being saved);
  With ``connector.save_during_forward`` (the default) the background thread copies the new
  blocks out layer by layer as vLLM reports each layer done (``save_kv_layer``) and dumps each
  layer's part, while the forward computes the next layers; ``wait_for_save`` only queues the
  job that stores the rest (layers whose hook did not come) and commits. A prompt's save thus
  runs beside its own prefill (compute-bound) instead of through the first decode steps;
* layer-wise mode (``connector.layerwise``): per-layer loads waited for in
  ``wait_for_layer_load`` and per-layer saves from ``save_kv_layer``.
"""
from __future__ import annotations

import json
import logging
import os
import re
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional

import numpy as np
import torch

from vllm.distributed.kv_transfer.kv_connector.v1.base import (KVConnectorBase_V1,
                                                               KVConnectorMetadata,
                                                               KVConnectorRole)

import ucm
from ucm import threads as ucm_threads
from ucm.config import Config
from ucm.ids import Namespace
from ucm.integration.vllm import failed_loads as _failed_loads  # noqa: F401 (registers its patch)
from ucm.integration.vllm import keys
from ucm.reference.hashing import murmur3_x64_128

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

log = logging.getLogger("ucm.integration.vllm")


# ---------------------------------------------------------------------------------------------
# metadata: scheduler -> worker, once per step

@dataclass
class Transfer:
    """Blocks of one request: store ids ``uint64 [n, 2]`` and vLLM block numbers ``[n]``.
    ``tail``: the last entry is the prompt's partial last block (a "tail")."""
    req_id: str
    ids: np.ndarray
    blocks: list
    tail: bool = False


@dataclass
class UCMConnectorMetadata(KVConnectorMetadata):
    loads: list = field(default_factory=list)
    saves: list = field(default_factory=list)
    resumed: list = field(default_factory=list)  # requests resumed after a preemption this step
    barrier: bool = False  # wait for every save in flight before this step writes the cache
    idle: bool = False  # the step computes nothing (vLLM polls the connector)


# ---------------------------------------------------------------------------------------------
# shared pieces

_STORES: dict = {}
_STORES_LOCK = threading.Lock()


def _store_key(cfg: Config, ns: Namespace) -> str:
    return json.dumps([cfg.to_dict(), ns.canonical().decode()], sort_keys=True, default=str)


def _layer_order(name: str):
    nums = [int(x) for x in re.findall(r"\d+", name)]
    return nums, name


def _load_config(vllm_config) -> Config:
    from ucm.integration.patch import log_through_vllm

    log_through_vllm()  # (the plugin does it too; a connector given by module path needs it)
    extra = dict(vllm_config.kv_transfer_config.kv_connector_extra_config or {})
    cfg = Config.load(extra or None)
    if cfg.source("backend") != "default":  # the engine's ops use the configured backend
        ucm.set_backend(cfg["backend"])
    return cfg


def _namespace(vllm_config, cfg: Config) -> Namespace:
    mc = vllm_config.model_config
    pc = vllm_config.parallel_config
    cc = vllm_config.cache_config
    device = getattr(vllm_config.device_config, "device_type", None) or "cpu"
    cache_dtype = str(getattr(cc, "cache_dtype", "auto"))
    return Namespace(
        model=cfg["connector.model_id"] or str(mc.model),
        dtype=str(mc.dtype).replace("torch.", ""),
        block_size=int(cc.block_size),
        kv_layout=f"vllm-{device}-kv:{cache_dtype}",
        tp_rank=0,  # each rank stores under its own keys (keys.rank_ids)
        tp_size=int(getattr(pc, "tensor_parallel_size", 1)),
        codec="none",
        tenant_salt=cfg["tenant_salt"],
    )


class UCMConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole,
                 kv_cache_config: "KVCacheConfig"):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self.cfg = _load_config(vllm_config)
        self.ns = _namespace(vllm_config, self.cfg)
        self.block_size = self.ns.block_size
        self.shape = keys.ParallelShape.of(vllm_config)
        ktc = self._kv_transfer_config
        self.is_producer = bool(ktc.is_kv_producer)
        self.is_consumer = bool(ktc.is_kv_consumer)
        self.store = None
        if role == KVConnectorRole.SCHEDULER:
            self._init_scheduler(kv_cache_config)
        else:
            self._init_worker()

    # =========================================================================================
    # scheduler side
    # =========================================================================================
    def _init_scheduler(self, kv_cache_config) -> None:
        self._refuse_unreachable_store()
        if self.cfg["connector.load_failure"] == "recompute":
            # Storage faults are cache misses: vLLM must recompute failed blocks, not fail the
            # request (its default). The scheduler reads this right after creating us. vLLM
            # keeps a failed block in its prefix cache under that policy; the patch drops it.
            from ucm.integration.patch import apply_patch

            if apply_patch("evict_failed_loads"):
                self._kv_transfer_config.kv_load_failure_policy = "recompute"
            else:
                log.warning("ucm: vLLM could not be patched to drop blocks whose load failed "
                            "(UCM_DISABLE_PATCHES or an untested vLLM); a failed load fails its "
                            "request instead of being recomputed")
        self._quiet_engine_wait()
        self._reqs: dict[str, _ReqState] = {}
        self._matched: dict[str, tuple] = {}  # req -> (local tokens, hit blocks, tail id or None)
        self._lookup_store = None
        self._block_bytes = _block_bytes_from_spec(kv_cache_config)
        self._async = bool(self.cfg["connector.async_save"]) and not self.cfg["connector.layerwise"]
        self._tail = bool(self.cfg["connector.partial_tail"])
        # ids of partial tails live in their own namespace: a tail of t tokens is never
        # mistaken for a full block (and vice versa)
        self._tail_ns = murmur3_x64_128(self.ns.digest() + b"ucm-partial-tail-v1", 0)
        self._generation = 0
        ucm.hash_blocks(np.zeros(self.block_size, np.int64), self.ns)  # compile now, not per request
        try:  # open the store and compile its lookups now: the first request would pay ~0.2 s
            probe = np.zeros((1, 2), dtype=np.uint64)
            self._lookup().lookup(probe)
            self._lookup().lookup_prefix(probe)
            self._generation = self._lookup().generation()
        except Exception as exc:  # (every lookup then fails the same way: misses, logged)
            log.warning("ucm: the store is not ready for lookups (%r)", exc)

    def _refuse_unreachable_store(self) -> None:
        """A store whose every tier lives in one process (``memory``) is empty for a scheduler
        whose workers run elsewhere (vLLM's multiprocess executor, the CPU default): refuse it
        rather than silently never hit."""
        from ucm.store.factory import tier_class

        specs = [s for s in self.cfg["store.pipeline"].split("|") if s.strip()]
        try:
            local = all(getattr(tier_class(s), "process_local", False) for s in specs)
        except ValueError:
            return  # (an unknown tier is reported when the store opens)
        backend = getattr(self._vllm_config.parallel_config, "distributed_executor_backend", None)
        beside = backend == "uni" or (backend == "external_launcher" and self.shape.world == 1)
        if local and not beside:
            raise ValueError(
                f"config key 'store.pipeline' = {self.cfg['store.pipeline']!r}: every tier keeps "
                f"its blocks inside the worker process, and this engine's workers run in other "
                f"processes (distributed_executor_backend={backend!r}, {self.shape.world} rank(s)), "
                f"so the scheduler could never see a stored block. Add a shared tier (e.g. "
                f"'memory|posix' with store.posix.roots) or run one worker in the engine's "
                f"process (--distributed-executor-backend uni)")

    def _quiet_engine_wait(self) -> None:
        """CPU engines: vLLM's engine core (this process) sleeps between checks for the
        worker's step result instead of spinning on the CPU ucm's background threads use."""
        poll_us = float(self.cfg["connector.engine_poll_us"])
        device = str(getattr(getattr(self._vllm_config, "device_config", None), "device_type", "") or "")
        if device != "cpu":
            return
        try:
            from ucm.integration.vllm import engine_wait

            if engine_wait.enable(poll_us):
                log.info("ucm: engine core polls its worker every %g us (pid %d)", poll_us, os.getpid())
        except Exception as exc:  # an optimisation only: never fail the engine for it
            log.warning("ucm: engine wait patch not applied (%r)", exc)

    def _lookup(self):
        """The store as seen from the scheduler: the one an in-process worker uses (so lookups
        see its memory tier), else this process's own view of the shared tiers."""
        with _STORES_LOCK:
            entry = _STORES.get(_store_key(self.cfg, self.ns))
        if entry is not None:
            return entry[0]
        if self._lookup_store is None:
            bb, shard = self._block_bytes
            self._lookup_store = _open_store(self.cfg, self.ns, bb, shard)
        return self._lookup_store

    def _present(self, ids: np.ndarray) -> np.ndarray:
        """Which blocks every rank has committed (bool ``[n]``)."""
        found = np.asarray(self._lookup().lookup(keys.all_rank_ids(ids, self.shape)), dtype=bool)
        return found.reshape(self.shape.world, len(ids)).all(axis=0)

    def _prefix_hits(self, ids: np.ndarray) -> int:
        """Length of the leading run of blocks every rank has committed."""
        store = self._lookup()
        n = len(ids)
        for r in range(self.shape.world):
            if n == 0:
                break
            n = min(n, int(store.lookup_prefix(keys.rank_ids(ids[:n], r, self.shape))))
        return n

    @staticmethod
    def _cacheable(request: "Request") -> bool:
        return keys.keyable(request)

    def _state(self, request: "Request") -> Optional["_ReqState"]:
        """The request's state (None: a request ucm cannot key, neither looked up nor saved)."""
        st = self._reqs.get(request.request_id)
        if st is None:
            if not self._cacheable(request):
                return None
            st = self._reqs[request.request_id] = _ReqState(request)
        st.request = request
        return st

    def _hashes(self, st: "_ReqState", n_blocks: int) -> np.ndarray:
        """Ids of the request's first ``n_blocks`` full blocks (computed once)."""
        if st.chain is None or st.chain.generation != self._generation:
            st.chain = keys.RequestKeys(st.request, self.ns, self._generation, self._tail_ns)
        return st.chain.full(st.request, n_blocks)

    def _tail_id(self, st: "_ReqState", n_full: int, t: int) -> Optional[np.ndarray]:
        """Id of the ``t`` tokens after the request's first ``n_full`` full blocks (the full
        block ``n_full`` when ``t`` is the block size), or None when the request's partial
        blocks are not stored."""
        if t == self.block_size:
            return self._hashes(st, n_full + 1)[n_full]
        self._hashes(st, 0)
        return st.chain.tail(st.request, n_full, t)

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int
                                   ) -> tuple[Optional[int], bool]:
        if not self.is_consumer:
            return 0, False
        st = self._state(request)
        if st is None:
            return 0, False
        bs = self.block_size
        n_full = (request.num_tokens - 1) // bs  # the last token is always computed
        start = num_computed_tokens // bs
        if n_full < start:
            return 0, False
        hit, tail = start, None
        try:
            if n_full > start:
                hit = start + self._prefix_hits(self._hashes(st, n_full)[start:])
            t = request.num_tokens - n_full * bs  # tokens in the last block, 1..block_size
            if self._tail and hit == n_full and t >= 2:
                tid = self._tail_id(st, n_full, t)
                if tid is not None and self._present(tid[None])[0]:
                    tail = (tid, t)
        except Exception as exc:  # a store fault is a miss, never an engine failure
            log.warning("ucm: lookup failed (%r); treating as a miss", exc)
            hit, tail = start, None
        self._matched[request.request_id] = (num_computed_tokens, hit, tail)
        ext = (hit - start) * bs + (tail[1] - 1 if tail else 0)
        log.debug("ucm: %s: %d tokens, %d local, store hit %d of %d blocks, tail %s",
                  request.request_id, request.num_tokens, num_computed_tokens, hit, n_full,
                  tail is not None)
        return ext, False

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks",
                                 num_external_tokens: int) -> None:
        st = self._state(request)
        local, hit, tail = self._matched.pop(request.request_id,
                                             (request.num_computed_tokens, 0, None))
        if st is not None and num_external_tokens > 0:
            start = local // self.block_size
            end = start + num_external_tokens // self.block_size
            st.load = (start, end, tail[0] if tail and num_external_tokens % self.block_size else None)

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        meta = UCMConnectorMetadata()
        meta.idle = not getattr(scheduler_output, "total_num_scheduled_tokens", 1)
        # vLLM frees a preempted request's blocks at once and may hand them out in this very
        # step: saves still reading them must finish before the step writes the cache.
        meta.barrier = self._async and bool(getattr(scheduler_output, "preempted_req_ids", None))
        scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            st = self._reqs.get(new.req_id)
            if st is None:
                continue  # not cacheable or not seen by get_num_new_matched_tokens
            st.blocks = list(new.block_ids[0])
            st.known = max(st.known, new.num_computed_tokens // self.block_size)
            self._plan(st, meta, new.num_computed_tokens + scheduled.get(new.req_id, 0))
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            st = self._reqs.get(req_id)
            if st is None:
                continue
            new_blocks = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:  # after preemption: a whole new block table
                st.blocks = list(new_blocks[0]) if new_blocks else []
                meta.resumed.append(req_id)
            elif new_blocks:
                st.blocks.extend(new_blocks[0])
            self._plan(st, meta, cached.num_computed_tokens[i] + scheduled.get(req_id, 0))
        for t in meta.saves:
            st = self._reqs.get(t.req_id)
            if st is not None:
                st.saved = True
        if meta.loads or meta.saves:
            log.debug("ucm: step plan: load %d blocks, save %d blocks",
                      sum(len(t.blocks) for t in meta.loads), sum(len(t.blocks) for t in meta.saves))
        return meta

    def _plan(self, st: "_ReqState", meta: UCMConnectorMetadata, computed_after: int) -> None:
        bs = self.block_size
        if st.load is not None:
            a, b, tail = st.load
            st.load = None
            ids = self._hashes(st, b)[a:b].copy() if b > a and len(st.blocks) >= b \
                else np.zeros((0, 2), np.uint64)
            blocks = st.blocks[a:b] if len(ids) else []
            if len(ids):
                st.known = max(st.known, b)
            is_tail = False
            if tail is not None and len(ids) == b - a and len(st.blocks) > b:
                is_tail = st.request.num_tokens - b * bs < bs  # else the full block b (see _tail_id)
                ids = np.concatenate([ids, tail[None]])
                blocks = blocks + [st.blocks[b]]
                if is_tail:
                    st.tail_done = True
                else:
                    st.known = max(st.known, b + 1)
            if len(ids):
                meta.loads.append(Transfer(st.request.request_id, ids, blocks, tail=is_tail))
        if not self.is_producer:
            return
        limit = st.request.num_tokens if self.cfg["connector.save_generated"] \
            else st.request.num_prompt_tokens
        n_full = min(computed_after, limit) // bs
        n_full = min(n_full, len(st.blocks))
        if n_full > st.known:
            ids = self._hashes(st, n_full)
            todo = np.arange(st.known, n_full)
            try:
                present = self._present(ids[todo])
            except Exception:
                present = np.zeros(len(todo), dtype=bool)
            todo = todo[~present]
            if len(todo):
                meta.saves.append(Transfer(st.request.request_id, ids[todo].copy(),
                                           [st.blocks[k] for k in todo]))
            st.known = n_full
        prompt = st.request.num_prompt_tokens
        if self._tail and not st.tail_done and computed_after >= prompt:
            st.tail_done = True  # the prompt's partial last block, once its tokens are computed
            nf = (prompt - 1) // bs
            t = prompt - nf * bs
            if 2 <= t < bs and len(st.blocks) > nf:
                try:
                    tid = self._tail_id(st, nf, t)
                    if tid is not None and not self._present(tid[None])[0]:
                        meta.saves.append(Transfer(st.request.request_id, tid[None].copy(),
                                                   [st.blocks[nf]], tail=True))
                except Exception as exc:
                    log.warning("ucm: tail lookup failed (%r); not saving it", exc)

    def update_connector_output(self, connector_output) -> None:
        """Blocks whose load failed are recomputed by vLLM: they (and the blocks after them)
        are no longer known to be stored, so they are saved again once recomputed."""
        bad = getattr(connector_output, "invalid_block_ids", None)
        if not bad:
            return
        for st in self._reqs.values():
            first = next((k for k, b in enumerate(st.blocks) if b in bad), None)
            if first is not None:
                st.known = min(st.known, first)
                st.tail_done = False  # (the prompt's partial block comes after any full one)

    def reset_cache(self) -> bool:
        """``reset_prefix_cache(reset_connector=True)``: raise the namespace's generation, so
        that no block stored before is found again (by this engine or, with a tier that
        persists the generation, any engine opening the store later). False when the new
        generation could not be stored (this engine uses it anyway)."""
        self._generation += 1
        ok = True
        try:
            self._generation = self._lookup().set_generation(self._generation)
        except Exception as exc:
            log.error("ucm: reset_cache: the store could not record generation %d (%r); this "
                      "engine uses it, engines started later would not", self._generation, exc)
            ok = False
        for st in self._reqs.values():  # their ids are recomputed under the new generation
            st.chain, st.known, st.tail_done = None, 0, False
        self._matched.clear()
        log.info("ucm: connector cache reset: generation %d", self._generation)
        return ok

    def request_finished(self, request: "Request", block_ids: list[int]
                         ) -> tuple[bool, Optional[dict[str, Any]]]:
        st = self._reqs.pop(request.request_id, None)
        self._matched.pop(request.request_id, None)
        # With background saves vLLM keeps the blocks until the worker reports the request's
        # saves done (get_finished); the worker tracks exactly the requests it got saves for.
        return bool(self._async and st is not None and st.saved), None

    # =========================================================================================
    # worker side
    # =========================================================================================
    def _init_worker(self) -> None:
        from ucm.integration.vllm import sparse_hook

        sparse_hook.configure(self.cfg)  # sparse settings may come from kv_connector_extra_config
        self.layout = None
        self._staging = None
        self._load_errors: set[int] = set()
        self._layer_names: list[str] = []
        self._layer_tasks: dict = {}
        # vLLM calls wait_for_layer_load and save_kv_layer for every layer of every step (30 x 2
        # calls per decode step for SmolLM2): their common path must cost next to nothing
        # (reading the config there took 5 us a call, 0.3% of a 50 ms decode step on 2 cores)
        self._layerwise = bool(self.cfg["connector.layerwise"])
        self._pending_saves: list = []
        self._free_staging: list = []
        self._load_tails = np.zeros(0, dtype=bool)
        self._idle = False
        self._async = bool(self.cfg["connector.async_save"]) and not self.cfg["connector.layerwise"]
        # saves during the forward: per step, the layer jobs queued so far (None: not begun this
        # step; False: nothing to save); used once vLLM called save_kv_layer for every layer
        self._during = self._async and bool(self.cfg["connector.save_during_forward"])
        self._lsave = None
        self._lsave_seen: set = set()
        self._lsave_ok = False
        # background saves: one thread runs them in order; per request, how many are in flight
        self._lock = threading.Lock()
        self._jobs_done = threading.Condition(self._lock)
        self._executor = None
        self._jobs_in_flight = 0
        self._req_jobs: dict[str, int] = {}  # requests we got saves for -> saves in flight
        self._finishing: set[str] = set()  # finished requests whose blocks vLLM keeps for us
        self._stats_file = self.cfg["connector.stats_file"]
        # load_s = load_store_s + scatter_s; save_s (gather to commit) includes gather_s;
        # forward_s: from start_load_kv's return to wait_for_save (vLLM 0.32 calls
        # start_load_kv after the forward in steps without loads, so ~0 there).
        # *_tail_blocks: partial last blocks of prompts (not counted in *_blocks).
        self._counters = {"load_blocks": 0, "load_failed": 0, "load_bytes": 0, "load_s": 0.0,
                          "load_store_s": 0.0, "scatter_s": 0.0, "load_tail_blocks": 0,
                          "save_blocks": 0, "save_failed": 0, "save_bytes": 0, "save_s": 0.0,
                          "gather_s": 0.0, "save_tail_blocks": 0, "save_waits": 0,
                          "save_wait_s": 0.0, "steps": 0, "forward_s": 0.0,
                          "resumed_requests": 0, "resumed_load_blocks": 0,
                          "borrowed_load_blocks": 0, "background_cpus": 0,
                          "overlapped_load_blocks": 0, "scatter_wait_s": 0.0,
                          "saves_during_forward": 0}
        self._forward_t0: Optional[float] = None
        # overlapped loads: the step's copy into the paged cache runs layer by layer on a
        # background thread while the forward computes; wait_for_layer_load waits per layer.
        # Used only once vLLM was seen calling that hook for every layer within one step.
        self._overlap = bool(self.cfg["connector.overlap_load"]) and not self.cfg["connector.layerwise"]
        self._hooked: set = set()  # layers whose wait_for_layer_load ran in this step
        self._hook_ok = False
        self._ov: Optional[_Overlap] = None
        self._load_executor = None
        self._spare_cpu = False  # (register_kv_caches decides)
        self._rank = keys.worker_rank(self._vllm_config)

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        names = sorted(kv_caches, key=_layer_order)
        unique, seen = [], set()
        for n in names:  # layers that share one cache tensor (cross-layer sharing) count once
            key = (kv_caches[n].data_ptr(), tuple(kv_caches[n].shape))
            if key not in seen:
                seen.add(key)
                unique.append(n)
        self._layer_names = unique
        first = kv_caches[unique[0]]
        log.debug("ucm: register_kv_caches: %d tensors, first %s %s strides %s", len(kv_caches),
                  unique[0], tuple(first.shape), first.stride())
        self.layout = ucm.KVLayout.from_views([kv_caches[n] for n in unique])
        bb = self.layout.block_bytes
        shard = self.layout.shard_bytes(0)
        uniform = all(self.layout.shard_bytes(k) == shard for k in range(len(unique)))
        self._shard = shard if uniform and shard % 8 == 0 else bb
        self._layer_index = {n: k for k, n in enumerate(unique)}
        # saves during the forward store each layer's part of a block at its own offset; CPU
        # engines only (on a GPU the save thread's copies would need the forward's stream)
        self._during = self._during and self._shard * len(unique) == bb \
            and next(iter(kv_caches.values())).device.type == "cpu"
        # this is the engine's compute thread: ucm's threads (started lazily, from here on) go to
        # the CPUs no compute thread is bound to
        cpus = ucm_threads.place_beside_current_thread()
        self._counters["background_cpus"] = len(cpus or ())
        # overlapped loads need a CPU the compute does not use: with none, the copy takes the
        # forward's own cores (measured: 104 vs 78 ms warm TTFT with two OpenMP threads on 2 cores)
        self._spare_cpu = ucm_threads.beside_compute(cpus)
        log.info("ucm connector: background threads on CPUs %s", sorted(cpus) if cpus else "unchanged")
        self.store = _open_store(self.cfg, self.ns, bb, self._shard)
        self.store.prepare()  # allocate (and pin) host buffers now, not in the first request
        self._device = next(iter(kv_caches.values())).device
        first_batch = min(64, self.layout.num_blocks) * bb  # staging for a long prompt, up front
        self._staging = self._alloc(min(first_batch, 512 << 20))
        self._free_staging.append(self._alloc(min(first_batch, 512 << 20)))
        log.info("ucm connector: %d layers, %d bytes per block, store %s", len(unique), bb,
                 self.cfg["store.pipeline"])

    def _rank_ids(self, ids: np.ndarray) -> np.ndarray:
        return keys.rank_ids(ids, self._rank, self.shape)

    def _alloc(self, nbytes: int) -> torch.Tensor:
        """A staging buffer: on the CPU from ucm's allocator (huge pages, faulted in once, so
        a request never pays page faults); on a GPU, device memory."""
        if self._device.type == "cpu":
            return torch.from_numpy(ucm.alloc_aligned(max(nbytes, 1)))
        return torch.empty(max(nbytes, 1), dtype=torch.uint8, device=self._device)

    def _staging_rows(self, n: int, nbytes: int) -> torch.Tensor:
        need = n * nbytes
        if self._staging is None or self._staging.numel() < need:
            self._staging = self._alloc(max(need, 2 * (self._staging.numel() if self._staging is not None else 0)))
        return self._staging[:need].view(n, nbytes)

    @staticmethod
    def _concat(transfers: list) -> tuple[np.ndarray, list, np.ndarray]:
        """(ids, vLLM blocks, which entries are partial tails) of several transfers."""
        ids = np.concatenate([t.ids for t in transfers]) if transfers else np.zeros((0, 2), np.uint64)
        blocks = [b for t in transfers for b in t.blocks]
        ends = np.cumsum([len(t.blocks) for t in transfers], dtype=np.int64)
        is_tail = np.zeros(len(blocks), dtype=bool)
        is_tail[[e - 1 for e, t in zip(ends, transfers) if t.tail]] = True
        return ids, blocks, is_tail

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        stale, self._lsave = getattr(self, "_lsave", None), None
        if stale:  # layer saves of a step that never reached wait_for_save: finish them
            self._finish_saves_during_forward(stale)
        super().bind_connector_metadata(connector_metadata)
        if getattr(connector_metadata, "barrier", False):
            self._drain()  # preempted blocks may be reused by this step's forward

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        try:
            self._start_load(self._get_connector_metadata())
        finally:
            self._forward_t0 = time.perf_counter()

    def _start_load(self, meta) -> None:
        if not isinstance(meta, UCMConnectorMetadata):
            return
        if meta.resumed:  # preempted requests back: their blocks load like any other hit
            self._counters["resumed_requests"] += len(meta.resumed)
            self._counters["resumed_load_blocks"] += sum(len(t.blocks) for t in meta.loads
                                                         if t.req_id in meta.resumed)
        self._finish_overlap()  # (normally done by the previous step's wait_for_save)
        if not meta.loads or self.store is None:
            return
        self._drain()  # a block to load may still be on its way into the store
        ids, blocks, self._load_tails = self._concat(meta.loads)
        ids = self._rank_ids(ids)
        if self._layerwise:
            self._start_layer_loads(ids, blocks)
            return
        t0 = time.perf_counter()
        if self._device.type == "cpu" and self._load_borrowed(ids, blocks, t0):
            return
        staging = self._staging_rows(len(ids), self.layout.block_bytes)
        try:
            res = self.store.wait(self.store.load(ids, 0, staging))
            ok = res.ok
        except Exception as exc:
            log.warning("ucm: load failed (%r); %d blocks will be recomputed", exc, len(ids))
            ok = np.zeros(len(ids), dtype=bool)
        t1 = time.perf_counter()
        idx = torch.tensor([b if good else -1 for b, good in zip(blocks, ok)], dtype=torch.int64)
        if ok.any() and not self._scatter_overlapped(staging, idx, self._load_tails, None):
            ucm.scatter_blocks(self.layout, staging, idx.to(self._device))
        t2 = time.perf_counter()
        self._counters["load_store_s"] += t1 - t0
        self._counters["scatter_s"] += t2 - t1
        self._record_load(blocks, ok, t2 - t0)

    def _load_borrowed(self, ids, blocks, t0) -> bool:
        """All blocks in the memory tier: one copy from its pool straight into the paged cache
        (no staging buffer). False (nothing done) when some block is elsewhere."""
        try:
            lent = self.store.borrow(ids)
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
        tails[lent.rows] = self._load_tails
        t1 = time.perf_counter()
        try:
            if not self._scatter_overlapped(lent.pool, idx, tails, lent.release):
                with lent:
                    ucm.scatter_blocks(self.layout, lent.pool, idx)
        except BaseException:
            lent.release()
            raise
        t2 = time.perf_counter()
        self._counters["load_store_s"] += t1 - t0
        self._counters["scatter_s"] += t2 - t1
        self._counters["borrowed_load_blocks"] += len(blocks)
        self._record_load(blocks, np.ones(len(blocks), dtype=bool), t2 - t0)
        return True

    def _scatter_overlapped(self, src: torch.Tensor, idx: torch.Tensor, tails: np.ndarray,
                            release) -> bool:
        """Start copying ``src`` (full staged rows) into the cache blocks ``idx`` layer by layer
        on the load thread; False (nothing done) when overlapping is off or not safe yet.
        Partial tails are copied now: vLLM writes this step's new tokens into their blocks
        before the attention's wait_for_layer_load, and a late copy would overwrite them.
        ``release`` (or None) runs once the copy is done."""
        if not (self._overlap and self._hook_ok and self._device.type == "cpu"
                and self._spare_cpu and len(self._layer_names) > 1):
            return False
        if tails.any():
            now = torch.where(torch.from_numpy(tails), idx, -1)
            ucm.scatter_blocks(self.layout, src, now)
            idx = torch.where(torch.from_numpy(tails), -1, idx)
        ov = _Overlap(src, idx, len(self._layer_names), release)
        self._counters["overlapped_load_blocks"] += int((idx >= 0).sum())
        if self._load_executor is None:
            self._load_executor = ucm_threads.pool(1, "ucm-load")
        self._ov = ov
        ov.future = self._load_executor.submit(self._overlap_job, ov)
        return True

    def _scatter_layer(self, ov: "_Overlap", k: int) -> None:
        a, n = self.layout.shard_offset(k), self.layout.shard_bytes(k)
        ucm.scatter_blocks(self.layout, ov.src[:, a:a + n], ov.idx, layers=[k])

    def _overlap_job(self, ov: "_Overlap") -> None:
        t0 = time.perf_counter()
        for k in range(len(ov.done)):
            try:
                self._scatter_layer(ov, k)
            except Exception as exc:  # retried on the engine's thread (wait_for_layer_load)
                ov.failed[k] = exc
            ov.done[k].set()
        ov.seconds = time.perf_counter() - t0

    def _wait_layer(self, ov: "_Overlap", k: int) -> None:
        """Layer ``k`` of an overlapped load is in the cache (copied here if the thread failed)."""
        if k in ov.waited:
            return
        ov.done[k].wait()
        if k in ov.failed:
            log.warning("ucm: background copy of layer %d failed (%r); copying it again", k, ov.failed[k])
            self._scatter_layer(ov, k)  # a second failure propagates: never compute on bad KV
        ov.waited.add(k)

    def _finish_overlap(self) -> None:
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
                self._overlap = False
            for k in range(len(ov.done)):
                self._wait_layer(ov, k)
        finally:
            if ov.release is not None:
                ov.release()
        self._counters["scatter_s"] += ov.seconds
        self._counters["scatter_wait_s"] += time.perf_counter() - t0

    def _record_load(self, blocks, ok, seconds) -> None:
        failed = [b for b, good in zip(blocks, ok) if not good]
        self._load_errors.update(failed)
        n = int(np.sum(ok))
        tails = int(np.sum(ok & self._load_tails))
        self._counters["load_blocks"] += n - tails
        self._counters["load_tail_blocks"] += tails
        self._counters["load_failed"] += len(failed)
        self._counters["load_bytes"] += n * self.layout.block_bytes
        self._counters["load_s"] += seconds
        if failed:
            log.warning("ucm: %d of %d blocks failed to load; vLLM recomputes them", len(failed),
                        len(blocks))

    # layer-wise -------------------------------------------------------------------------------
    def _start_layer_loads(self, ids, blocks) -> None:
        self._layer_tasks = {}
        self._layer_ok = np.ones(len(ids), dtype=bool)
        self._layer_blocks = blocks
        self._layer_t0 = time.perf_counter()
        nb = self._shard
        staging = self._staging_rows(len(ids) * len(self._layer_names), nb)
        for k, name in enumerate(self._layer_names):
            rows = staging[k * len(ids):(k + 1) * len(ids)]
            self._layer_tasks[name] = (k, rows, self.store.load(ids, k * nb, rows))

    def wait_for_layer_load(self, layer_name: str) -> None:
        if not self._hook_ok:
            self._hooked.add(layer_name)
        ov = self._ov
        if ov is None and not self._layer_tasks:
            return
        if ov is not None:
            k = self._layer_index.get(layer_name)
            t0 = time.perf_counter()
            if k is None:  # a layer we do not know: wait for all of them
                for j in range(len(ov.done)):
                    self._wait_layer(ov, j)
            else:
                self._wait_layer(ov, k)
            self._counters["scatter_wait_s"] += time.perf_counter() - t0
            return
        entry = self._layer_tasks.pop(layer_name, None)
        if entry is None:
            return
        k, rows, task = entry
        try:
            ok = self.store.wait(task).ok
        except Exception:
            ok = np.zeros(len(rows), dtype=bool)
        self._layer_ok &= ok
        idx = torch.tensor([b if good else -1 for b, good in zip(self._layer_blocks, ok)], dtype=torch.int64)
        if ok.any():
            ucm.scatter_blocks(self.layout, rows, idx.to(self._device), layers=[k])
        if not self._layer_tasks:  # last layer: account for the whole load
            self._record_load(self._layer_blocks, self._layer_ok, time.perf_counter() - self._layer_t0)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata, **kwargs) -> None:
        if self._during:
            if not self._lsave_ok:
                self._lsave_seen.add(layer_name)
            elif self._lsave is not False:
                self._save_layer(layer_name)
            return
        if not self._layerwise or not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        if not isinstance(meta, UCMConnectorMetadata) or not meta.saves or self.store is None:
            return
        k = self._layer_index.get(layer_name)
        if k is None:
            return
        ids, blocks, _ = self._concat(meta.saves)
        ids = self._rank_ids(ids)
        rows = torch.empty((len(ids), self._shard), dtype=torch.uint8, device=self._device)
        ucm.gather_blocks(self.layout, torch.tensor(blocks, dtype=torch.int64, device=self._device),
                          rows, layers=[k])
        self._pending_saves.append((ids, self.store.dump(ids, k * self._shard, rows), rows))

    def wait_for_save(self) -> None:
        if self._forward_t0 is not None:
            self._counters["steps"] += 1
            self._counters["forward_s"] += time.perf_counter() - self._forward_t0
            self._forward_t0 = None
        self._finish_overlap()
        if self._hooked:
            if not self._hook_ok and self._layer_names and self._hooked.issuperset(self._layer_names):
                self._hook_ok = True  # vLLM waits per layer: later loads may overlap the forward
            self._hooked = set()
        layer_saves, self._lsave = self._lsave, None
        if self._during and not self._lsave_ok:
            if self._layer_names and self._lsave_seen.issuperset(self._layer_names):
                self._lsave_ok = True  # vLLM reports every layer: later saves start during the forward
            self._lsave_seen = set()
        if layer_saves:  # queued by save_kv_layer: store the rest, then commit
            self._finish_saves_during_forward(layer_saves)
        if not self.has_connector_metadata() or self.store is None:
            return
        meta = self._get_connector_metadata()
        if not isinstance(meta, UCMConnectorMetadata):
            return
        self._idle = meta.idle
        if self._layerwise:
            self._finish_layer_saves(meta)
        elif meta.saves and not layer_saves:
            self._save(meta.saves)
        self._write_stats()

    def _save_plan(self, saves: list) -> tuple:
        """(ids, vLLM blocks, tail flags, request ids) of a step's saves, each block once."""
        ids, blocks, is_tail = self._concat(saves)
        # Two requests of one step may both hold a block no one had stored yet: save it once
        # (two writers of one block could interleave two numerically different versions).
        _, first = np.unique(ids, axis=0, return_index=True)
        if len(first) < len(ids):
            keep = np.sort(first)
            ids, blocks, is_tail = ids[keep], [blocks[k] for k in keep], is_tail[keep]
        return self._rank_ids(ids), blocks, is_tail, sorted({t.req_id for t in saves})

    def _save_layer(self, layer_name: str) -> None:
        """save_kv_layer during the forward: queue the copy and dump of this layer's part of the
        step's new blocks on the background thread."""
        ctx = self._lsave
        if ctx is None:  # the step's first layer: plan its saves once
            meta = self._get_connector_metadata() if self.has_connector_metadata() else None
            if not isinstance(meta, UCMConnectorMetadata) or not meta.saves or self.store is None:
                self._lsave = False
                return
            ids, blocks, is_tail, reqs = self._save_plan(meta.saves)
            n = len(ids)
            staging = self._take_staging(n * self.layout.block_bytes)
            ctx = self._lsave = {"ids": ids, "blocks": torch.tensor(blocks, dtype=torch.int64),
                                 "is_tail": is_tail, "reqs": reqs, "staging": staging,
                                 "queued": set(), "tasks": [], "failed": False, "busy_s": 0.0,
                                 "gather_s": 0.0}
            if self._executor is None:
                self._executor = ucm_threads.pool(1, "ucm-save")
        k = self._layer_index.get(layer_name)
        if k is None or k in ctx["queued"]:
            return
        ctx["queued"].add(k)
        self._executor.submit(self._run_layer_save, ctx, [k])

    def _run_layer_save(self, ctx: dict, layers: list) -> None:
        """Background thread: copy ``layers`` of the step's blocks into their part of the staged
        rows (layer-major, each layer's part contiguous) and dump each part at its offset."""
        t0 = time.perf_counter()
        n, shard = len(ctx["ids"]), self._shard
        try:
            for k in layers:
                rows = ctx["staging"][k * n * shard:(k + 1) * n * shard].view(n, shard)
                t1 = time.perf_counter()
                ucm.gather_blocks(self.layout, ctx["blocks"], rows, layers=[k])
                ctx["gather_s"] += time.perf_counter() - t1
                ctx["tasks"].append(self.store.dump(ctx["ids"], k * shard, rows))
        except Exception as exc:  # a failed save is a future miss, nothing more
            log.warning("ucm: save of layer(s) %s failed: %r", layers, exc)
            ctx["failed"] = True
        ctx["busy_s"] += time.perf_counter() - t0

    def _finish_saves_during_forward(self, ctx: dict) -> None:
        """wait_for_save after layer saves: queue the layers vLLM did not report and the commit
        (the request's blocks stay with us until it ran, as for any background save)."""
        rest = [k for k in range(len(self._layer_names)) if k not in ctx["queued"]]
        self._counters["saves_during_forward"] += 1
        self._job_started(ctx["reqs"])
        if rest:
            self._executor.submit(self._run_layer_save, ctx, rest)
        self._executor.submit(self._commit_layer_saves, ctx)

    def _commit_layer_saves(self, ctx: dict) -> None:
        t0 = time.perf_counter()
        ids = ctx["ids"]
        ok = np.zeros(len(ids), dtype=bool) if ctx["failed"] else np.ones(len(ids), dtype=bool)
        try:
            for task in ctx["tasks"]:
                ok &= self.store.wait(task).ok
            self.store.commit(ids, ok)
        except Exception as exc:
            ok = self._save_failed(ids, exc)
        finally:
            self._save_ended(ctx["staging"], ok, ctx["busy_s"] + time.perf_counter() - t0,
                             ctx["gather_s"], ctx["is_tail"], ctx["reqs"])

    def _save(self, saves: list) -> None:
        """Store the step's new blocks: copy them out of the paged cache, dump, commit. In the
        background with ``async_save`` (vLLM keeps the blocks until then, see the module doc),
        else before the step returns."""
        ids, blocks, is_tail, reqs = self._save_plan(saves)
        if not self._async:
            self._run_save(ids, blocks, is_tail, ())
            return
        self._job_started(reqs)
        if self._executor is None:
            self._executor = ucm_threads.pool(1, "ucm-save")
        self._executor.submit(self._run_save, ids, blocks, is_tail, reqs)

    def _job_started(self, reqs: list) -> None:
        """A background save job for ``reqs`` is queued (vLLM keeps their blocks until it ends)."""
        with self._lock:
            for r in reqs:
                self._req_jobs[r] = self._req_jobs.get(r, 0) + 1
            self._jobs_in_flight += 1

    def _save_failed(self, ids, exc) -> np.ndarray:
        """A save that raised: logged, its blocks committed as failed (a future miss)."""
        log.warning("ucm: save of %d blocks failed: %r", len(ids), exc)
        ok = np.zeros(len(ids), dtype=bool)
        try:
            self.store.commit(ids, ok)
        except Exception:
            pass
        return ok

    def _save_ended(self, staging, ok, seconds: float, gather_s: float, is_tail, reqs) -> None:
        """Bookkeeping at the end of a save: its staging back to the pool, counters, and (a
        background job) the requests' jobs in flight."""
        with self._lock:
            if staging is not None:
                self._free_staging.append(staging)
            self._counters["gather_s"] += gather_s
            self._count_save(ok, seconds, is_tail)
            if reqs:
                for r in reqs:
                    self._req_jobs[r] -= 1
                self._jobs_in_flight -= 1
                self._jobs_done.notify_all()

    def _run_save(self, ids, blocks, is_tail, reqs) -> None:
        t0 = time.perf_counter()
        ok = np.zeros(len(ids), dtype=bool)
        staging = None
        try:
            staging = self._take_staging(len(ids) * self.layout.block_bytes)
            rows = staging[:len(ids) * self.layout.block_bytes].view(len(ids), self.layout.block_bytes)
            ucm.gather_blocks(self.layout, torch.tensor(blocks, dtype=torch.int64, device=self._device), rows)
            t1 = time.perf_counter()
            ok = self.store.wait(self.store.dump(ids, 0, rows)).ok
            self.store.commit(ids, ok)
        except Exception as exc:  # a failed save is a future miss, nothing more
            t1 = t0
            ok = self._save_failed(ids, exc)
        finally:
            self._save_ended(staging, ok, time.perf_counter() - t0, t1 - t0, is_tail, reqs)

    def _take_staging(self, nbytes: int) -> torch.Tensor:
        """A host/device staging buffer of at least nbytes, reused once its save completed."""
        with self._lock:
            for i, buf in enumerate(self._free_staging):
                if buf.numel() >= nbytes:
                    return self._free_staging.pop(i)
        return self._alloc(max(nbytes, 1 << 20))

    def _drain(self, timeout: Optional[float] = None) -> bool:
        """Wait for the background saves in flight (at most ``timeout`` seconds); True when none
        is left."""
        if not self._async:
            return True
        with self._lock:
            if not self._jobs_in_flight:
                return True
            t0 = time.perf_counter()
            done = self._jobs_done.wait_for(lambda: self._jobs_in_flight == 0, timeout)
            if timeout is None:
                self._counters["save_waits"] += 1
                self._counters["save_wait_s"] += time.perf_counter() - t0
            return done

    def get_finished(self, finished_req_ids: set[str]) -> tuple[Optional[set[str]], Optional[set[str]]]:
        """Finished requests whose background saves are all done: vLLM frees their blocks now
        (they are exactly the requests we got saves for; ``request_finished`` delayed those)."""
        if not self._async:
            return None, None
        if getattr(self, "_idle", False) and self._finishing:
            self._drain(timeout=0.005)  # vLLM is only polling us: no busy loop meanwhile
        with self._lock:
            for r in finished_req_ids:
                if r in self._req_jobs:
                    self._finishing.add(r)
            done = {r for r in self._finishing if self._req_jobs.get(r, 0) == 0}
            for r in done:
                self._finishing.discard(r)
                self._req_jobs.pop(r, None)
        return (done or None), None

    def _finish_layer_saves(self, meta) -> None:
        if not self._pending_saves:
            return
        t0 = time.perf_counter()
        ids = self._pending_saves[0][0]
        ok = np.ones(len(ids), dtype=bool)
        for _, task, _rows in self._pending_saves:
            try:
                ok &= self.store.wait(task).ok
            except Exception:
                ok[:] = False
        complete = len(self._pending_saves) == len(self._layer_names)
        self.store.commit(ids, ok & complete)
        self._pending_saves = []
        self._count_save(ok & complete, time.perf_counter() - t0, self._concat(meta.saves)[2])

    def _count_save(self, ok, seconds, is_tail=None) -> None:
        n = int(np.sum(ok))
        tails = int(np.sum(ok & is_tail)) if is_tail is not None else 0
        self._counters["save_blocks"] += n - tails
        self._counters["save_tail_blocks"] += tails
        self._counters["save_failed"] += len(ok) - n
        self._counters["save_bytes"] += n * self.layout.block_bytes
        self._counters["save_s"] += seconds

    def get_block_ids_with_load_errors(self) -> set[int]:
        out, self._load_errors = self._load_errors, set()
        return out

    def _write_stats(self) -> None:
        if not getattr(self, "_stats_file", None):
            return
        try:  # one line per step: the file stays open (opening it per step cost 0.3 ms)
            f = getattr(self, "_stats_fh", None)
            if f is None:
                f = self._stats_fh = open(self._stats_file, "a", buffering=1)
            f.write(json.dumps({"t": time.time(), "pid": os.getpid(), **self._counters}) + "\n")
        except (OSError, ValueError):
            pass

    def stats(self) -> dict:
        """Connector counters plus the store's statistics (worker side)."""
        out = dict(self._counters)
        if self.store is not None:
            out["store"] = self.store.stats()
        return out

    def shutdown(self) -> None:
        if getattr(self, "_ov", None) is not None:
            self._finish_overlap()
        if getattr(self, "_load_executor", None) is not None:
            self._load_executor.shutdown(wait=True)
            self._load_executor = None
        if getattr(self, "_executor", None) is not None:
            self._drain()
            self._executor.shutdown(wait=True)
            self._executor = None
        if getattr(self, "_counters", None) is not None:
            self._write_stats()
        if getattr(self, "_stats_fh", None) is not None:
            self._stats_fh.close()
            self._stats_fh = None
        if self.store is not None and getattr(self, "_role", None) == KVConnectorRole.WORKER:
            _release_store(self.store)
            self.store = None


@dataclass
class _ReqState:
    request: Any
    chain: Optional[keys.RequestKeys] = None  # the request's block ids
    blocks: list = field(default_factory=list)
    known: int = 0  # leading blocks known to be stored (saved, loaded or found)
    load: Optional[tuple] = None  # (first block, end of full blocks, tail id or None)
    tail_done: bool = False  # the prompt's partial last block was saved, found or loaded
    saved: bool = False  # some save of this request was planned (its blocks wait for it)


class _Overlap:
    """A load being copied into the paged cache layer by layer on the load thread."""

    def __init__(self, src, idx, n_layers: int, release):
        self.src, self.idx, self.release = src, idx, release
        self.done = [threading.Event() for _ in range(n_layers)]
        self.failed: dict = {}  # layer -> exception of the background copy
        self.waited: set = set()  # layers known to be in the cache
        self.future = None
        self.seconds = 0.0


def _block_bytes_from_spec(kv_cache_config) -> tuple[Optional[int], Optional[int]]:
    """(block bytes over all layers, bytes per layer) from vLLM's KV cache spec."""
    try:
        total, page = 0, None
        for group in kv_cache_config.kv_cache_groups:
            page = group.kv_cache_spec.page_size_bytes
            total += page * len(group.layer_names)
        return (total or None), page
    except Exception:
        return None, None


def _open_store(cfg: Config, ns: Namespace, block_bytes: Optional[int], shard_bytes: Optional[int]):
    """One store per process and configuration, shared by the scheduler and an in-process
    worker (so the scheduler's lookups see the worker's memory tier)."""
    from ucm.store import open_store

    key = _store_key(cfg, ns)
    with _STORES_LOCK:
        entry = _STORES.get(key)
        if entry is not None and entry[0].geometry.block_bytes == block_bytes and \
                (shard_bytes is None or entry[0].geometry.shard_bytes == shard_bytes):
            entry[1] += 1
            return entry[0]
        bb = block_bytes or 4096
        _ensure_roots(cfg)
        store = open_store(cfg, block_bytes=bb, shard_bytes=shard_bytes or bb, namespace=ns.digest())
        if entry is not None:  # the worker knows the real geometry: it replaces the guess
            entry[0].close()
        _STORES[key] = [store, 1]
        return store


def _release_store(store) -> None:
    with _STORES_LOCK:
        for key, entry in list(_STORES.items()):
            if entry[0] is store:
                entry[1] -= 1
                if entry[1] <= 0:
                    del _STORES[key]
                    store.close()
                return
    store.close()


def _ensure_roots(cfg: Config) -> None:
    """The default cache directory is created; explicitly configured roots must exist."""
    if "posix" not in cfg["store.pipeline"]:
        return
    roots = cfg["store.posix.roots"]
    if cfg.source("store.posix.roots") == "default":
        for r in roots:
            os.makedirs(os.path.expanduser(r), exist_ok=True)
