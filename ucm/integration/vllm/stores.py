"""The connector's per-process store registry: one open store per configuration and namespace,
shared by the scheduler side and a worker in the same process (so the scheduler's lookups see the
worker's memory tier), counted by its users and closed by the last one.
"""
from __future__ import annotations

import json
import os
import threading
from dataclasses import dataclass
from typing import Any, Optional

from ucm.config import Config
from ucm.ids import Namespace


@dataclass
class _Entry:
    store: Any
    users: int


_STORES: dict = {}  # registry_key -> _Entry
_STORES_LOCK = threading.Lock()


def registry_key(cfg: Config, ns: Namespace) -> str:
    return json.dumps([cfg.to_dict(), ns.canonical().decode()], sort_keys=True, default=str)


def in_process(cfg: Config, ns: Namespace):
    """The store this process opened for ``cfg`` and ``ns`` (None: none)."""
    with _STORES_LOCK:
        entry = _STORES.get(registry_key(cfg, ns))
    return None if entry is None else entry.store


def acquire(cfg: Config, ns: Namespace, block_bytes: Optional[int], shard_bytes: Optional[int],
            kv_shape=None):
    """One store per process and configuration, shared by the scheduler and an in-process
    worker (so the scheduler's lookups see the worker's memory tier). ``kv_shape``: one
    layer's block as a :class:`ucm.compress.KVShape` (used when ``compression.enabled``)."""
    from ucm.store import open_store

    key = registry_key(cfg, ns)
    with _STORES_LOCK:
        entry = _STORES.get(key)
        if entry is not None and entry.store.geometry.block_bytes == block_bytes and \
                (shard_bytes is None or entry.store.geometry.shard_bytes == shard_bytes):
            entry.users += 1
            return entry.store
        bb = block_bytes or 4096
        ensure_roots(cfg)
        store = open_store(cfg, block_bytes=bb, shard_bytes=shard_bytes or bb, namespace=ns.digest(),
                           kv_shape=kv_shape)
        if entry is not None:  # the worker knows the real geometry: it replaces the guess
            entry.store.close()
        _STORES[key] = _Entry(store, 1)
        return store


def release(store) -> None:
    """One user less; the last one closes the store (a store not in the registry is closed)."""
    with _STORES_LOCK:
        for key, entry in list(_STORES.items()):
            if entry.store is store:
                entry.users -= 1
                if entry.users <= 0:
                    del _STORES[key]
                    store.close()
                return
    store.close()


def ensure_roots(cfg: Config) -> None:
    """The default cache directory is created; explicitly configured roots must exist."""
    if "posix" not in cfg["store.pipeline"]:
        return
    roots = cfg["store.posix.roots"]
    if cfg.source("store.posix.roots") == "default":
        for r in roots:
            os.makedirs(os.path.expanduser(r), exist_ok=True)


def block_bytes_from_spec(kv_cache_config) -> tuple[Optional[int], Optional[int]]:
    """(block bytes over all layers, bytes per layer) from vLLM's KV cache spec."""
    try:
        total, page = 0, None
        for group in kv_cache_config.kv_cache_groups:
            page = group.kv_cache_spec.page_size_bytes
            total += page * len(group.layer_names)
        return (total or None), page
    except Exception:
        return None, None


def kv_shape(vllm_config, kv_cache_config):
    """One layer's block of vLLM's KV cache as a :class:`ucm.compress.KVShape` (what the
    compression codecs need), or None when the spec does not say. vLLM-CPU keeps per block and
    head the block's keys, then its values (``hktd``); vLLM's CUDA attention backends keep the
    keys, then the values, token-major (``kthd``)."""
    from ucm.compress import KVShape

    try:
        spec = kv_cache_config.kv_cache_groups[0].kv_cache_spec
        device = getattr(vllm_config.device_config, "device_type", None) or "cpu"
        return KVShape("hktd" if device == "cpu" else "kthd", int(spec.block_size),
                       int(spec.num_kv_heads), int(spec.head_size),
                       str(spec.dtype).replace("torch.", ""))
    except Exception:  # (another spec or cache dtype: no codec can take it)
        return None


def check_kv_shape(shape, cache) -> None:
    """ValueError when the engine's cache tensor is not laid out as ``shape`` says."""
    import torch

    h, t, d = shape.heads, shape.tokens, shape.head_dim
    dims = tuple(cache.shape)
    fits = (dims[1:] == (h, t, 2 * d)) if shape.order == "hktd" else \
        (len(dims) == 5 and dims[-3:] == (t, h, d) and 2 in dims[:2])
    if not fits or cache.dtype != getattr(torch, shape.dtype):
        raise ValueError(f"compression: the KV cache tensor ({list(dims)}, {cache.dtype}) is not "
                         f"laid out as {shape}; compression supports vLLM's CPU and CUDA "
                         f"attention layouts")
