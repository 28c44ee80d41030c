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

Bad input: ``keys`` that are not a sequence of keys, and ``target_locations`` / ``values`` that
are not one page per key, raise ValueError naming the argument (SGLang's cache controller logs
it and counts the batch failed); a key that is not a page hash is a miss; a host index, target
or value that is not a page of the host pool is an error in the log naming it, and a miss (or
False). A page of the generic interface is the host pool's flat page: a contiguous CPU tensor of
its dtype and byte size. After :meth:`UCMStorage.close` every call but ``close`` and
``get_stats`` raises RuntimeError saying the backend is closed.
"""
from __future__ import annotations

import bisect
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
        self._closed = False
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

        if self._closed:
            raise RuntimeError("ucm HiCache backend: closed (close() was called); a closed "
                               "backend does not reopen, create a new one")
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
        self.page_dtype = mem_pool_host.kv_buffer.dtype
        self.core = WorkerCore(layout, store, "cpu", shard_bytes=layout.block_bytes)

    def _ready(self) -> WorkerCore:
        core = self.core
        if core is None:
            if self._closed:
                raise RuntimeError("ucm HiCache backend: closed (close() was called)")
            raise RuntimeError("ucm HiCache backend: no host pool registered yet "
                               "(register_mem_pool_host)")
        return core

    @staticmethod
    def _keys(keys) -> list:
        """``keys`` as a list; ValueError when it is not a sequence of keys (a str would be
        read as one key per character)."""
        if isinstance(keys, (str, bytes, bytearray)) or not hasattr(keys, "__len__"):
            raise ValueError(f"ucm HiCache backend: keys must be a list of page keys, got "
                             f"{type(keys).__name__}")
        return list(keys)

    def _ids(self, keys: list, core: Optional[WorkerCore] = None) -> tuple:
        """``(ids, valid)`` of ``keys`` (:func:`pages.key_ids`)."""
        core = core if core is not None else self._ready()
        return pages.key_ids(list(keys), self.ns, core.store.generation())

    @staticmethod
    def _per_key(arg, name: str, n: int) -> list:
        """``target_locations`` / ``values`` as one entry per key: a sequence, or a tensor
        of pages along its first dimension (as iterating it gives them); None is no page for
        any key. ValueError naming ``name`` when its length is not ``n``: a page paired with
        another page's key would be stored, or returned, under that key."""
        if arg is None:
            return [None] * n
        if isinstance(arg, torch.Tensor):
            if arg.dim() == 0:
                raise ValueError(f"ucm HiCache backend: {name} is a 0-d tensor, not pages")
            arg = list(arg.unbind(0))
        elif isinstance(arg, (str, bytes, bytearray)) or not hasattr(arg, "__iter__"):
            raise ValueError(f"ucm HiCache backend: {name} must be a list of page tensors, got "
                             f"{type(arg).__name__}")
        else:
            arg = list(arg)
        if len(arg) != n:
            raise ValueError(f"ucm HiCache backend: {name} has {len(arg)} entries for {n} keys "
                             f"(one page per key)")
        return arg

    def _record(self, core: WorkerCore, op: str, n: int, t0: float) -> None:
        if self.metrics_on and n:
            dt = max(time.perf_counter() - t0, 1e-9)
            self._pgs[op].append(n)
            self._bw[op].append(n * core.block_bytes / dt / 1e9)

    # -- zero-copy interface (interface_v1) ----------------------------------------------------
    def batch_exists(self, keys: List[str], extra_info=None) -> int:
        """How many pages, from the first, the store holds."""
        core = self._ready()
        keys = self._keys(keys)
        ids, valid = self._ids(keys, core)
        n = len(keys) if valid.all() else int(np.argmin(valid))
        return core.leading_hits(ids[:n])

    def batch_get_v1(self, keys: List[str], host_indices: torch.Tensor,
                     extra_info=None) -> List[bool]:
        """Read pages straight into the host pool at ``host_indices`` (token indices, one
        page per ``page_size``)."""
        core = self._ready()
        return self._v1(core, "get", keys, host_indices, core.load_blocks)

    def batch_set_v1(self, keys: List[str], host_indices: torch.Tensor,
                     extra_info=None) -> List[bool]:
        """Write pages straight from the host pool at ``host_indices``."""
        core = self._ready()
        keys = self._keys(keys)
        if not self.writer:                 # MLA: another rank writes the same pages
            return [True] * len(keys)
        return self._v1(core, "set", keys, host_indices, core.save_blocks)

    def _v1(self, core: WorkerCore, op: str, keys, host_indices, transfer) -> List[bool]:
        """One zero-copy call: host token indices -> pages, keys -> ids, ``transfer`` (the
        core's load or save) on the valid keys; the rest are False."""
        t0 = time.perf_counter()
        keys = self._keys(keys)
        ids, valid = self._ids(keys, core)
        idx, why = pages.page_indices_why(host_indices, self.page_size, len(keys),
                                          core.layout.num_blocks)
        if idx is None:
            log.error("ucm HiCache backend: host_indices: %s", why)
            return [False] * len(keys)
        ok = np.zeros(len(keys), dtype=bool)
        if valid.any():
            try:
                ok[valid] = transfer(ids[valid], idx[valid])
            except ValueError as exc:      # e.g. one host page named twice in a get
                log.error("ucm HiCache backend: %s", exc)
                return [False] * len(keys)
        self._record(core, op, int(ok.sum()), t0)
        return ok.tolist()

    # -- generic interface (flat page tensors) ---------------------------------------------------
    def _flat(self, core: WorkerCore, t, name: str) -> Optional[torch.Tensor]:
        """``t`` as one row of a page's bytes; None, logged, when it is not the host pool's
        page: another dtype of the same size would be read back as the pool's dtype."""
        if not isinstance(t, torch.Tensor) or t.device.type != "cpu":
            log.error("ucm HiCache backend: %s must be a CPU tensor, got %s", name,
                      f"a tensor on {t.device}" if isinstance(t, torch.Tensor)
                      else type(t).__name__)
            return None
        if t.dtype != self.page_dtype:
            log.error("ucm HiCache backend: %s has dtype %s, the host pool's pages %s", name,
                      t.dtype, self.page_dtype)
            return None
        if t.numel() * t.element_size() != core.block_bytes:
            log.error("ucm HiCache backend: %s holds %d bytes, a page %d", name,
                      t.numel() * t.element_size(), core.block_bytes)
            return None
        if not t.is_contiguous():
            log.error("ucm HiCache backend: %s is not contiguous (a page is read into it "
                      "in place)", name)
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
        keys = self._keys(keys)
        ids, valid = self._ids(keys, core)
        targets = self._per_key(target_locations, "target_locations", len(keys))
        out = [None] * len(keys)
        filled = []                 # sorted start addresses of the targets read into so far
        for i, t in enumerate(targets):
            row = self._flat(core, t, f"target_locations[{i}]") if valid[i] else None
            if row is None:
                continue
            # a target sharing memory with an earlier one would overwrite that page with this
            # one's bytes: it is a miss
            start = row.data_ptr()
            j = bisect.bisect_left(filled, start)
            if ((j < len(filled) and filled[j] - start < core.block_bytes)
                    or (j and start - filled[j - 1] < core.block_bytes)):
                log.error("ucm HiCache backend: target_locations[%d] shares memory with an "
                          "earlier target", i)
                continue
            filled.insert(j, start)
            try:
                res = core.store.wait(core.store.load(core.rank_ids(ids[i:i + 1]), 0, row))
                if bool(res.ok[0]):
                    out[i] = t
            except Exception as exc:
                log.warning("ucm HiCache backend: get failed (%r); a miss", exc)
        self._record(core, "get", sum(x is not None for x in out), t0)
        return out

    def set(self, key: str, value: Any = None, target_location: Any = None,
            target_sizes: Any = None) -> bool:
        return self.batch_set([key], [value])

    def batch_set(self, keys: List[str], values: Any = None, target_locations: Any = None,
                  target_sizes: Any = None) -> bool:
        """Store flat pages ``values[i]`` under ``keys[i]``; True when all are stored."""
        core = self._ready()
        keys = self._keys(keys)
        ids, valid = self._ids(keys, core)
        values = self._per_key(values, "values", len(keys))
        if not self.writer:
            return True
        t0 = time.perf_counter()
        if not valid.all():
            return False
        rows = [self._flat(core, v.contiguous() if isinstance(v, torch.Tensor) else v,
                           f"values[{i}]") for i, v in enumerate(values)]
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
        self._record(core, "set", int(have.sum()), t0)
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
        """Release the store; a second call does nothing."""
        from ucm.integration.vllm import stores

        self._closed = True
        core, self.core = self.core, None
        if core is not None:
            core.close()
            stores.release(core.store)
