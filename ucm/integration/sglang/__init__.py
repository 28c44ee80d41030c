"""ucm as SGLang's HiCache L3 storage backend (SGLang 0.5.23's ``HiCacheStorage``).

Load it with SGLang's dynamic backend::

    --enable-hierarchical-cache --hicache-storage-backend dynamic
    --hicache-storage-backend-extra-config '{"backend_name": "ucm",
        "module_path": "ucm.integration.sglang", "class_name": "UCMStorage",
        "interface_v1": 1,
        "ucm": {"store": {"pipeline": "memory|posix", "posix": {"roots": ["/cache"]}}}}'

``"ucm"`` holds a ucm configuration (the keys of ``docs/configuration.md``, as vLLM's
``kv_connector_extra_config`` takes them); ``"model"`` may name the model when SGLang's storage
config does not. ``"interface_v1": 1`` makes HiCache call the zero-copy ``batch_get_v1`` /
``batch_set_v1`` (pages straight between the host pool and the store); without it HiCache uses
the generic ``batch_get`` / ``batch_set`` over flat page tensors. Both write one format.

The backend is an adapter over :class:`ucm.integration.core.WorkerCore` (the engine-free core
the vLLM connector uses): the host pool becomes a :class:`ucm.KVLayout` when HiCache registers
it, SGLang's page keys become ucm block ids (:mod:`ucm.integration.sglang.pages`). Storage
faults are misses; a page never reads another page's bytes (the store checks each block's id).
MLA models: every rank reads, only SGLang's storage-writer rank writes.
"""
from __future__ import annotations

import logging
import time
from typing import Any, List, Optional

import numpy as np
import torch

try:
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorage
except ImportError as exc:  # pragma: no cover - import only inside SGLang
    raise ImportError("ucm.integration.sglang is SGLang's storage backend and needs SGLang "
                      f"(0.5.23): {exc}") from None

from ucm.config import Config, ConfigError
from ucm.integration.core import WorkerCore
from ucm.integration.sglang import pages

log = logging.getLogger("ucm.integration.sglang")

__all__ = ["UCMStorage"]

_OWN_KEYS = ("backend_name", "module_path", "class_name", "interface_v1", "ucm", "model")


class UCMStorage(HiCacheStorage):
    """SGLang ``HiCacheStorage`` over a ucm store (module doc)."""

    def __init__(self, storage_config, kwargs: Optional[dict] = None):
        extra = dict(getattr(storage_config, "extra_config", None) or {})
        if "ucm" not in extra:
            raise ValueError("ucm HiCache backend: the extra config has no 'ucm' key; give the "
                             "ucm store there, e.g. {\"ucm\": {\"store\": {\"pipeline\": "
                             "\"memory|posix\"}}}")
        if not isinstance(extra["ucm"], dict):
            raise ValueError(f"ucm HiCache backend: 'ucm' must be a mapping (a ucm config), got "
                             f"{type(extra['ucm']).__name__}")
        try:
            self.cfg = Config(extra["ucm"])
        except ConfigError as exc:
            raise ValueError(f"ucm HiCache backend: 'ucm': {exc}") from None
        self.storage_config = storage_config
        self.model = extra.get("model")
        self.writer = bool(getattr(storage_config, "is_storage_writer",
                                   not storage_config.is_mla_model or storage_config.tp_rank == 0))
        self.metrics_on = bool(getattr(storage_config, "enable_storage_metrics", False))
        self.core: Optional[WorkerCore] = None
        self.ns = None
        self._pgs = {"get": [], "set": []}
        self._bw = {"get": [], "set": []}
        host = (kwargs or {}).get("mem_pool_host") if isinstance(kwargs, dict) else None
        if host is not None:
            self.register_mem_pool_host(host)

    # -- setup ---------------------------------------------------------------------------------
    def register_mem_pool_host(self, mem_pool_host) -> None:
        """HiCache hands over its host pool: its pages become the core's layout and the
        namespace is fixed by its shape (a second pool of another shape is refused)."""
        import ucm
        from ucm.integration.vllm import stores

        super().register_mem_pool_host(mem_pool_host)
        views = pages.page_views(mem_pool_host)
        layout = ucm.KVLayout.from_views(views, [0] * len(views))
        ns = pages.namespace(self.storage_config, mem_pool_host, self.model,
                             self.cfg["tenant_salt"])
        if self.core is not None:
            if ns != self.ns or layout.block_bytes != self.core.block_bytes:
                raise ValueError("ucm HiCache backend: a host pool of another shape was "
                                 "registered after the first")
            self.core.layout = layout
            return
        store = stores.acquire(self.cfg, ns, layout.block_bytes, layout.block_bytes)
        store.prepare()    # allocate (and fault in) the memory tier now, not in the first call
        self.ns = ns
        self.page_size = int(mem_pool_host.page_size)
        self.core = WorkerCore(layout, store, "cpu", shard_bytes=layout.block_bytes)

    def _ready(self) -> WorkerCore:
        if self.core is None:
            raise RuntimeError("ucm HiCache backend: no host pool registered yet "
                               "(register_mem_pool_host)")
        return self.core

    def _ids(self, keys) -> tuple:
        return pages.key_ids(list(keys), self.ns, self.core.store.generation())

    def _record(self, op: str, n: int, t0: float) -> None:
        if self.metrics_on and n:
            dt = max(time.perf_counter() - t0, 1e-9)
            self._pgs[op].append(n)
            self._bw[op].append(n * self.core.block_bytes / dt / 1e9)

    # -- zero-copy interface (interface_v1) ----------------------------------------------------
    def batch_exists(self, keys: List[str], extra_info=None) -> int:
        """How many pages, from the first, the store holds."""
        core = self._ready()
        ids, valid = self._ids(keys)
        n = len(keys) if valid.all() else int(np.argmin(valid))
        return core.leading_hits(ids[:n])

    def batch_get_v1(self, keys: List[str], host_indices: torch.Tensor,
                     extra_info=None) -> List[bool]:
        """Read pages straight into the host pool at ``host_indices`` (token indices, one
        page per ``page_size``)."""
        return self._v1("get", keys, host_indices, self._ready().load_blocks)

    def batch_set_v1(self, keys: List[str], host_indices: torch.Tensor,
                     extra_info=None) -> List[bool]:
        """Write pages straight from the host pool at ``host_indices``."""
        core = self._ready()
        if not self.writer:                 # MLA: another rank writes the same pages
            return [True] * len(keys)
        return self._v1("set", keys, host_indices, core.save_blocks)

    def _v1(self, op: str, keys, host_indices, transfer) -> List[bool]:
        """One zero-copy call: host token indices -> pages, keys -> ids, ``transfer`` (the
        core's load or save) on the valid keys; the rest are False."""
        t0 = time.perf_counter()
        idx = pages.page_indices(host_indices, self.page_size, len(keys),
                                 self.core.layout.num_blocks)
        if idx is None:
            log.error("ucm HiCache backend: %d host indices for %d pages of %d tokens (or not "
                      "whole pages of the host pool)", len(host_indices), len(keys),
                      self.page_size)
            return [False] * len(keys)
        ids, valid = self._ids(keys)
        ok = np.zeros(len(keys), dtype=bool)
        if valid.any():
            try:
                ok[valid] = transfer(ids[valid], idx[valid])
            except ValueError as exc:      # e.g. one host page named twice in a get
                log.error("ucm HiCache backend: %s", exc)
                return [False] * len(keys)
        self._record(op, int(ok.sum()), t0)
        return ok.tolist()

    # -- generic interface (flat page tensors) ---------------------------------------------------
    def _flat(self, t, name: str) -> Optional[torch.Tensor]:
        if not isinstance(t, torch.Tensor) or t.device.type != "cpu":
            log.error("ucm HiCache backend: %s must be a CPU tensor", name)
            return None
        if t.numel() * t.element_size() != self.core.block_bytes or not t.is_contiguous():
            log.error("ucm HiCache backend: %s holds %d bytes, a page %d", name,
                      t.numel() * t.element_size(), self.core.block_bytes)
            return None
        return t.view(torch.uint8).view(1, -1)

    def get(self, key: str, target_location: Any = None, target_sizes: Any = None):
        return self.batch_get([key], [target_location])[0]

    def batch_get(self, keys: List[str], target_locations: Any = None,
                  target_sizes: Any = None) -> list:
        """Fill each ``target_locations[i]`` (a flat page, as ``get_dummy_flat_data_page``)
        with page ``keys[i]``; the tensor, or None for a miss."""
        core = self._ready()
        t0 = time.perf_counter()
        targets = list(target_locations or [None] * len(keys))
        ids, valid = self._ids(keys)
        out = [None] * len(keys)
        for i, t in enumerate(targets):
            row = self._flat(t, f"target_locations[{i}]") if valid[i] else None
            if row is None:
                continue
            try:
                res = core.store.wait(core.store.load(core.rank_ids(ids[i:i + 1]), 0, row))
                if bool(res.ok[0]):
                    out[i] = t
            except Exception as exc:
                log.warning("ucm HiCache backend: get failed (%r); a miss", exc)
        self._record("get", sum(x is not None for x in out), t0)
        return out

    def set(self, key: str, value: Any = None, target_location: Any = None,
            target_sizes: Any = None) -> bool:
        return self.batch_set([key], [value])

    def batch_set(self, keys: List[str], values: Any = None, target_locations: Any = None,
                  target_sizes: Any = None) -> bool:
        """Store flat pages ``values[i]`` under ``keys[i]``; True when all are stored."""
        core = self._ready()
        if not self.writer:
            return True
        t0 = time.perf_counter()
        ids, valid = self._ids(keys)
        values = list(values or [])
        if len(values) != len(keys) or not valid.all():
            return False
        rows = [self._flat(v.contiguous() if isinstance(v, torch.Tensor) else v, f"values[{i}]")
                for i, v in enumerate(values)]
        if any(r is None for r in rows):
            return False
        try:
            rids = core.rank_ids(ids)
            have = np.asarray(core.store.lookup(rids), dtype=bool)
            todo = np.flatnonzero(~have)
            if len(todo):
                src = torch.cat([rows[i] for i in todo])
                res = core.store.wait(core.store.dump(rids[todo], 0, src))
                done = np.asarray(res.ok, dtype=bool)
                core.store.commit(rids[todo], done)
                have[todo] = done
        except Exception as exc:
            log.warning("ucm HiCache backend: set failed (%r)", exc)
            return False
        self._record("set", int(have.sum()), t0)
        return bool(have.all())

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    # -- the rest ----------------------------------------------------------------------------
    def clear(self) -> None:
        """Forget this backend's pages: the namespace's generation is raised, so every page
        stored before is a miss from now on (tiers reclaim the space by eviction)."""
        core = self._ready()
        core.store.set_generation(core.store.generation() + 1)

    def get_stats(self):
        """SGLang's ``StorageMetrics`` of the calls since the last one (pages per call and
        GB/s), when storage metrics are on."""
        from sglang.srt.observability.metrics_collector import StorageMetrics

        m = StorageMetrics()
        m.prefetch_pgs.extend(self._pgs["get"])
        m.backup_pgs.extend(self._pgs["set"])
        m.prefetch_bandwidth.extend(self._bw["get"])
        m.backup_bandwidth.extend(self._bw["set"])
        for d in (self._pgs, self._bw):
            for v in d.values():
                v.clear()
        return m

    def ucm_stats(self) -> dict:
        """ucm's counters of this backend (loads, saves, lookups) and the store's tiers."""
        return self._ready().stats()

    def close(self) -> None:
        from ucm.integration.vllm import stores

        if self.core is not None:
            self.core.close()
            stores.release(self.core.store)
            self.core = None
