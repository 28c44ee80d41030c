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

This module is only the adapter that speaks vLLM's connector API; the work is split by role:

* scheduler side (pure bookkeeping, no data movement): :mod:`ucm.integration.vllm.scheduler`
  (``get_num_new_matched_tokens``, ``update_state_after_alloc``, ``build_connector_meta``,
  ``update_connector_output``, ``reset_cache``, ``request_finished``);
* worker side (data movement): ``register_kv_caches`` plans the byte layout of the paged caches
  (any vLLM layout, strided views of one allocation included) and opens the store
  (:mod:`ucm.integration.vllm.stores`); then the load path (:mod:`ucm.integration.vllm.worker_load`:
  ``start_load_kv``, ``wait_for_layer_load``, ``get_block_ids_with_load_errors``) and the save
  path (:mod:`ucm.integration.vllm.worker_save`: ``save_kv_layer``, ``wait_for_save``,
  ``get_finished``) run over one :class:`~ucm.integration.core.WorkerCore`. Neither
  imports vLLM: they take plain tensors, block ids, vLLM block numbers and layer indices;
* scheduler -> worker, once per step: :class:`UCMConnectorMetadata`, made of
  :class:`~ucm.integration.vllm.records.Transfer` records.
"""
from __future__ import annotations

import functools
import logging
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional

import torch

from vllm.distributed.kv_transfer.kv_connector.v1.base import (KVConnectorBase_V1,
                                                               KVConnectorMetadata,
                                                               KVConnectorRole)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (KVConnectorPromMetrics,
                                                                 KVConnectorStats)

import ucm
from ucm import metrics as ucm_metrics
from ucm import threads as ucm_threads
from ucm.config import Config, ConfigError
from ucm.ids import Namespace
from ucm.integration.vllm import failed_loads as _failed_loads  # noqa: F401 (registers its patch)
from ucm.integration.vllm import keys, stores
from ucm.integration.vllm.records import Transfer
from ucm.integration.vllm.scheduler import ConnectorScheduler
from ucm.integration.core import WorkerCore, store_shard_bytes
from ucm.integration.vllm.worker_load import WorkerLoad
from ucm.integration.vllm.worker_save import WorkerSave

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

__all__ = ["UCMConnector", "UCMConnectorMetadata", "Transfer"]

log = logging.getLogger("ucm.integration.vllm")


@dataclass
class UCMConnectorMetadata(KVConnectorMetadata):
    """Scheduler -> worker, once per step."""
    loads: list = field(default_factory=list)  # Transfer records to load
    saves: list = field(default_factory=list)  # Transfer records to save
    resumed: list = field(default_factory=list)  # requests resumed after a preemption this step
    barrier: bool = False  # wait for every save in flight before this step writes the cache
    idle: bool = False  # the step computes nothing (vLLM polls the connector)
    prefetch: list = field(default_factory=list)  # ids [n, 2] of queued requests' stored blocks
    blends: list = field(default_factory=list)  # ucm.blend.chunks.BlendJob records to run


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


def _codec_name(cfg: Config) -> str:
    """The namespace's codec: 'none', or the digest of the ``compression.*`` codec (blocks of
    another codec, other parameters or another projection live under another namespace)."""
    from ucm.store.factory import codec_spec

    spec = codec_spec(cfg)
    return "none" if spec is None else f"{spec.method}-{spec.digest().hex()}"


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
        codec=_codec_name(cfg),
        tenant_salt=cfg["tenant_salt"],
    )


class UCMConnectorStats(KVConnectorStats):
    """vLLM's carrier of the connector's metrics: ``data`` is a :mod:`ucm.metrics` payload
    (JSON-safe: it crosses from the workers to the scheduler and on to the API server)."""

    def reset(self):
        self.data = {}

    def aggregate(self, other: "KVConnectorStats") -> "KVConnectorStats":
        if other is not None and other.data:
            ucm_metrics.merge(self.data, other.data)
        return self

    def reduce(self) -> dict:
        return ucm_metrics.flat(self.data)

    def is_empty(self) -> bool:
        return not self.data


class UCMPromMetrics(KVConnectorPromMetrics):
    """The :mod:`ucm.metrics` series as vLLM's Prometheus metrics (on ``vllm serve``'s
    ``/metrics``), labelled with vLLM's own labels (model name, engine) first."""

    def __init__(self, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self.sink = ucm_metrics.PrometheusSink(labelnames=labelnames, metric_types=metric_types)

    def observe(self, transfer_stats_data: dict, engine_idx: int = 0):
        self.sink.apply(transfer_stats_data or {}, self.per_engine_labelvalues[engine_idx])


class UCMConnector(KVConnectorBase_V1):
    """vLLM's connector for both roles: the scheduler's calls go to ``self.sched``
    (:class:`ConnectorScheduler`), the worker's to ``self.load_path`` and ``self.save_path``
    (created by ``register_kv_caches`` over ``self.core``)."""

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
        self.sched: Optional[ConnectorScheduler] = None
        self.core: Optional[WorkerCore] = None
        self.load_path: Optional[WorkerLoad] = None
        self.save_path: Optional[WorkerSave] = None
        self.blend_path = None  # worker_blend.WorkerBlend (blend.enabled)
        if role == KVConnectorRole.SCHEDULER:
            self.sched = ConnectorScheduler(self.cfg, self.ns, self.shape, vllm_config,
                                            kv_cache_config, ktc, is_producer=self.is_producer,
                                            is_consumer=self.is_consumer)
        else:
            from ucm.integration.vllm import sparse_hook

            sparse_hook.configure(self.cfg)  # sparse settings may come from kv_connector_extra_config
            self._layer_index: dict[str, int] = {}
            self._rank = keys.worker_rank(vllm_config)

    # =========================================================================================
    # scheduler side
    # =========================================================================================
    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int
                                   ) -> tuple[Optional[int], bool]:
        return self.sched.get_num_new_matched_tokens(request, num_computed_tokens)

    def on_new_request(self, request: "Request") -> None:
        self.sched.on_new_request(request)

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks",
                                 num_external_tokens: int) -> None:
        self.sched.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        return self.sched.build_connector_meta(scheduler_output, UCMConnectorMetadata())

    def update_connector_output(self, connector_output) -> None:
        self.sched.update_connector_output(connector_output)

    def reset_cache(self) -> bool:
        return self.sched.reset_cache()

    def request_finished(self, request: "Request", block_ids: list[int]
                         ) -> tuple[bool, Optional[dict[str, Any]]]:
        return self.sched.request_finished(request, block_ids)

    # =========================================================================================
    # worker side
    # =========================================================================================
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        cfg = self.cfg
        names = sorted(kv_caches, key=_layer_order)
        unique, seen = [], set()
        for n in names:  # layers that share one cache tensor (cross-layer sharing) count once
            key = (kv_caches[n].data_ptr(), tuple(kv_caches[n].shape))
            if key not in seen:
                seen.add(key)
                unique.append(n)
        self._layer_index = {n: k for k, n in enumerate(unique)}
        first = kv_caches[unique[0]]
        log.debug("ucm: register_kv_caches: %d tensors, first %s %s strides %s", len(kv_caches),
                  unique[0], tuple(first.shape), first.stride())
        layout = ucm.KVLayout.from_views([kv_caches[n] for n in unique])
        # this is the engine's compute thread: ucm's threads (started lazily, from here on) go to
        # the CPUs no compute thread is bound to
        cpus = ucm_threads.place_beside_current_thread()
        # overlapped loads need a CPU the compute does not use: with none, the copy takes the
        # forward's own cores (measured: 104 vs 78 ms warm TTFT with two OpenMP threads on 2 cores)
        spare_cpu = ucm_threads.beside_compute(cpus)
        log.info("ucm connector: background threads on CPUs %s", sorted(cpus) if cpus else "unchanged")
        shard = store_shard_bytes(layout)
        shape = None
        if cfg["compression.enabled"]:
            shape = stores.kv_shape(self._vllm_config, self._kv_cache_config)
            if shape is None:
                raise ConfigError("config key 'compression.enabled': vLLM's KV cache spec does "
                                  "not give the heads, head size and dtype a codec needs, or its "
                                  "attention stores the cache in a layout the codecs do not know "
                                  "(see the log)")
            try:
                stores.check_kv_shape(shape, kv_caches[unique[0]])
            except ValueError as exc:
                raise ConfigError(f"config key 'compression.enabled': {exc}") from None
        store = stores.acquire(cfg, self.ns, layout.block_bytes, shard, shape)
        store.prepare()  # allocate (and pin) host buffers now, not in the first request
        core = self.core = WorkerCore(
            layout, store, first.device, shard_bytes=shard,
            rank_ids=functools.partial(keys.rank_ids, rank=self._rank, shape=self.shape),
            stats_file=cfg["connector.stats_file"])
        from ucm.integration.vllm import sparse_hook

        core.metric_sources.append(sparse_hook.drain_metrics)
        core.metrics.set("ucm_background_cpus", len(cpus or ()))
        layerwise = bool(cfg["connector.layerwise"])
        self.save_path = WorkerSave(core, background=bool(cfg["connector.async_save"]),
                                    during_forward=bool(cfg["connector.save_during_forward"]),
                                    layerwise=layerwise)
        self.load_path = WorkerLoad(core, layerwise=layerwise,
                                    overlap=bool(cfg["connector.overlap_load"]),
                                    spare_cpu=spare_cpu, before_load=self.save_path.drain)
        if cfg["blend.enabled"]:
            self.blend_path = self._blend_path(kv_caches, unique, layout)
        first_batch = min(64, layout.num_blocks) * layout.block_bytes  # staging for a long prompt, up front
        self.load_path.reserve(min(first_batch, 512 << 20))
        core.staging.give(core.alloc(min(first_batch, 512 << 20)))
        log.info("ucm connector: %d layers, %d bytes per block, store %s", len(unique),
                 layout.block_bytes, cfg["store.pipeline"])

    def _blend_path(self, kv_caches, names, layout):
        """The worker's Blend path over the engine's caches (its model is taken at the first
        job: ``blend_hook.current_model``)."""
        from ucm.integration.vllm import blend_hook
        from ucm.integration.vllm.worker_blend import WorkerBlend

        mc, pc = self._vllm_config.model_config, self._vllm_config.parallel_config
        heads, dim = mc.get_num_kv_heads(pc), mc.get_head_size()
        caches = [kv_caches[n] for n in names]
        problem = None
        try:
            views = [blend_hook.cache_views(c, heads, dim) for c in caches]
        except blend_hook.BlendUnsupported as exc:
            views, problem = None, str(exc)

        def make_scratch(n: int):
            scratch = [c.new_zeros((2, n) + tuple(c.shape[2:])) if c.dim() == 5 and c.shape[0] == 2
                       else c.new_zeros((n,) + tuple(c.shape[1:])) for c in caches]
            lay = ucm.KVLayout.from_views(scratch)
            if lay.block_bytes != layout.block_bytes:
                raise blend_hook.BlendUnsupported("the scratch cache's block bytes differ from "
                                                  "the engine's")
            return lay, [blend_hook.cache_views(c, heads, dim) for c in scratch]

        def model():
            if problem is not None:
                raise blend_hook.BlendUnsupported(problem)
            m = blend_hook.current_model()
            if m is None:
                raise blend_hook.BlendUnsupported("the model is unknown to ucm (the blend_model "
                                                  "patch is off: UCM_DISABLE_PATCHES?)")
            return blend_hook.VllmBlendModel(m)

        if problem is not None:
            log.warning("ucm blend: unavailable (%s); Blend requests are computed in full", problem)
        return WorkerBlend(self.core, views or [], self.block_size, make_scratch, model,
                           ratio=float(self.cfg["blend.recompute_ratio"]),
                           check_layer=int(self.cfg["blend.check_layer"]),
                           on_failed=lambda blocks: self.load_path.add_errors(blocks),
                           failed_now=lambda: self.load_path.pending_errors())

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        hints = getattr(connector_metadata, "prefetch", None)
        if hints and self.core is not None:
            self.core.prefetch(hints)
        if self.save_path is not None:  # (saves None: the metadata is not ucm's)
            ours = isinstance(connector_metadata, UCMConnectorMetadata)
            self.save_path.begin_step(connector_metadata.saves if ours else None,
                                      idle=ours and connector_metadata.idle,
                                      barrier=bool(getattr(connector_metadata, "barrier", False)))

    def clear_connector_metadata(self) -> None:
        super().clear_connector_metadata()
        if self.save_path is not None:
            self.save_path.clear_step()

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        try:
            meta = self._get_connector_metadata()
            if self.load_path is not None and isinstance(meta, UCMConnectorMetadata):
                self.load_path.start(meta.loads, meta.resumed)
                if meta.blends:
                    if self.blend_path is None:  # (blend.enabled differs between the roles)
                        self.load_path.add_errors([b for j in meta.blends
                                                   for b in j.blocks[j.start // self.block_size:]])
                    else:
                        if any(j.end > j.start for j in meta.blends):
                            self.load_path.complete()   # Blend reads the prefix just loaded
                        self.blend_path.run(meta.blends)
        finally:
            if self.core is not None:
                self.core.forward_started()

    def wait_for_layer_load(self, layer_name: str) -> None:
        # vLLM calls wait_for_layer_load and save_kv_layer for every layer of every step (30 x 2
        # calls per decode step for SmolLM2): their common path must cost next to nothing
        # (reading the config there took 5 us a call, 0.3% of a 50 ms decode step on 2 cores)
        if self.load_path is not None:
            self.load_path.wait_layer(self._layer_index.get(layer_name))

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata, **kwargs) -> None:
        if self.save_path is not None:
            self.save_path.layer_done(self._layer_index.get(layer_name))

    def wait_for_save(self) -> None:
        if self.core is None:
            return
        self.core.forward_ended()
        self.load_path.end_step()
        blended = self.blend_path is not None and self.blend_path.store_chunks()
        if self.save_path.end_step() or blended:
            self.core.write_stats()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[Optional[set[str]], Optional[set[str]]]:
        """Finished requests whose background saves are all done: vLLM frees their blocks now
        (they are exactly the requests we got saves for; ``request_finished`` delayed those)."""
        if self.save_path is None or not self.save_path.background:
            return None, None
        return self.save_path.finished(finished_req_ids), None

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.load_path.take_errors() if self.load_path is not None else set()

    # =========================================================================================
    # metrics (both roles): vLLM collects them every step and shows them on /metrics
    # =========================================================================================
    def get_kv_connector_stats(self) -> Optional[KVConnectorStats]:
        if self.sched is not None:
            payload = self.sched.metrics.drain()
        elif self.core is not None:
            payload = self.core.drain_metrics()
        else:
            return None
        return UCMConnectorStats(data=payload) if payload else None

    @classmethod
    def build_kv_connector_stats(cls, data: Optional[dict] = None) -> Optional[KVConnectorStats]:
        return UCMConnectorStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        return UCMPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def stats(self) -> dict:
        """Connector counters plus the store's statistics (worker side)."""
        return self.core.stats() if self.core is not None else {}

    def shutdown(self) -> None:
        if getattr(self, "sched", None) is not None:
            self.sched.close()
        if self.load_path is not None:
            self.load_path.shutdown()
        if self.save_path is not None:
            self.save_path.shutdown()
        core = self.core
        if core is not None:
            core.close()
            if core.store is not None:
                stores.release(core.store)
                core.store = None
