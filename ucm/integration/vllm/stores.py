"""The connector's per-process store registry: one open store per configuration and namespace,
shared by the scheduler side and a worker in the same process (so the scheduler's lookups see the
worker's memory tier), counted by its users and closed by the last one.
"""
from __future__ import annotations

import functools
import logging

import json
import os
import threading
from dataclasses import dataclass
from typing import Any, Optional

from ucm.config import Config
from ucm.ids import Namespace

log = logging.getLogger("ucm.integration.vllm")


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
    compression codecs need), or None when the spec does not say or the layout is not one the
    codecs know. vLLM-CPU keeps per block and head the block's keys, then its values
    (``hktd``), the keys channel-major on the attention paths probed so far
    (:func:`cpu_key_order`); vLLM's CUDA attention backends keep the keys, then the values,
    token-major (``kthd``)."""
    from ucm.compress import KVShape

    try:
        spec = kv_cache_config.kv_cache_groups[0].kv_cache_spec
        device = getattr(vllm_config.device_config, "device_type", None) or "cpu"
        dims = (int(spec.block_size), int(spec.num_kv_heads), int(spec.head_size))
        dtype = str(spec.dtype).replace("torch.", "")
    except Exception:  # (another spec or cache dtype: no codec can take it)
        return None
    if device != "cpu":
        return KVShape("kthd", *dims, dtype)
    order = cpu_key_order(dtype, *dims)
    return None if order is None else KVShape("hktd", *dims, dtype, key_order=order)


@functools.lru_cache(maxsize=None)
def cpu_key_order(dtype: str, tokens: int, heads: int, head_dim: int, isa: str = ""):
    """How vLLM-CPU's attention stores a block's key planes: ``"td"`` (token-major) or
    ``"dt"`` (channel-major), found by writing known keys and values into one block with the
    attention backend's own cache op (``cpu_attn_reshape_and_cache``, with ``isa`` or else the
    ISA the backend picks for this shape) and reading where they landed; None when the layout
    is neither (another ISA packing the cache differently: no codec or sparse view may then
    read it)."""
    import torch

    try:
        import vllm._custom_ops as ops
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

        tdtype = getattr(torch, dtype)
        isa = isa or _get_attn_isa(tdtype, tokens, head_dim)
        t = torch.arange(tokens).view(tokens, 1, 1)
        h = torch.arange(heads).view(1, heads, 1)
        d = torch.arange(head_dim).view(1, 1, head_dim)
        found = set()
        # three probes, one index each (small integers: exact in every cache dtype)
        for field in (t % 128, h, d):
            key = (field + 1).expand(tokens, heads, head_dim).to(tdtype).contiguous()
            value = -key
            cache = torch.zeros((1, heads, tokens, 2 * head_dim), dtype=tdtype)
            kc, vc = cache.view(1, heads, 2 * tokens, head_dim).chunk(2, dim=2)
            ops.cpu_attn_reshape_and_cache(key, value, kc, vc, torch.arange(tokens), isa)
            plane = cache.view(heads, 2, tokens * head_dim)
            if not torch.equal(plane[:, 1], value.permute(1, 0, 2).reshape(heads, -1)):
                return None
            layouts = {"td": key.permute(1, 0, 2), "dt": key.permute(1, 2, 0)}
            found.add(frozenset(name for name, k in layouts.items()
                                if torch.equal(plane[:, 0], k.reshape(heads, -1))))
        common = frozenset.intersection(*found)
        return "dt" if "dt" in common else ("td" if "td" in common else None)
    except Exception as exc:   # an older vLLM without this op, another platform
        log.warning("ucm: cannot probe vLLM-CPU's KV layout (%s); compression is off", exc)
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
