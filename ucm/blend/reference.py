"""Blend on ucm's reference Llama forward (:mod:`ucm.reference.llama`): the adapters of
:mod:`ucm.blend.engine` over its weights and paged cache, and :func:`blended_logits`, one
request served with Blend from chunk KV computed alone, next to the same request's full
prefill. The accuracy harness (``evals/blend_quality.py``) and the tests use it; it is the
executable statement of what the vLLM integration computes.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from ucm.blend.engine import BlendStats, blend_fill, chunk_fill
from ucm.reference.llama import Llama, PagedKVCache


class LlamaBlendModel:
    """:class:`ucm.blend.engine.BlendModel` of a :class:`~ucm.reference.llama.Llama`."""

    def __init__(self, model: Llama):
        self.m = model
        self.num_layers = model.num_layers
        self.num_q_heads, self.num_kv_heads = model.num_q_heads, model.num_kv_heads
        self.head_dim = model.head_dim
        self.scale = model.head_dim ** -0.5
        self.inv_freq = model.inv_freq.to(torch.float32)
        self.neox, self.rotary_dim = True, model.head_dim       # (rotate-half over every channel)

    def embed(self, ids):
        return self.m.embed[ids]

    def qkv(self, layer, h, pos):
        return self.m._qkv(self.m.layers[layer], h, pos)

    def finish(self, layer, h, attn):
        return self.m._finish_layer(self.m.layers[layer], h, attn)

    def logits(self, h):
        return self.m._logits(h)


class PagedRequestKV:
    """:class:`ucm.blend.engine.RequestKV` of one request in a :class:`PagedKVCache`
    (``blocks``: its physical blocks in order)."""

    def __init__(self, cache: PagedKVCache, blocks: Sequence[int]):
        self.cache = cache
        self.bs = cache.block_size
        self.blocks = torch.as_tensor(list(blocks), dtype=torch.long, device=cache.k[0].device)

    def _slots(self, pos: torch.Tensor):
        pos = pos.to(self.blocks.device)
        return self.blocks[pos // self.bs], pos % self.bs

    def read(self, layer, end):
        b, o = self._slots(torch.arange(end, device=self.blocks.device))
        return self.cache.k[layer][b, o], self.cache.v[layer][b, o]

    def write(self, layer, pos, k, v):
        b, o = self._slots(pos.to(torch.long))
        self.cache.k[layer][b, o] = k.to(self.cache.k[layer].dtype)
        self.cache.v[layer][b, o] = v.to(self.cache.v[layer].dtype)


def chunk_kv(model: Llama, ids: Sequence[int], sink: Sequence[int] = ()) -> tuple:
    """The KV of ``ids`` computed alone, as the vLLM worker stores it
    (:func:`ucm.blend.engine.chunk_fill`): after the ``sink`` tokens (their KV dropped), keys at
    positions ``len(sink)..``; per layer ``k, v [n, Hkv, D]``."""
    n, bs = len(ids), 16
    cache = model.new_cache(math.ceil(n / bs), bs)
    kv = PagedRequestKV(cache, range(math.ceil(n / bs)))
    dev = model.device
    chunk_fill(LlamaBlendModel(model), kv, torch.tensor(list(ids), dtype=torch.long, device=dev),
               torch.tensor(list(sink), dtype=torch.long, device=dev))
    return [kv.read(layer, n) for layer in range(model.num_layers)]


@dataclass
class Blended:
    logits: torch.Tensor          # [len(suffix), vocab]: the suffix's positions, Blend
    full_logits: torch.Tensor     # the same positions from one full prefill
    stats: BlendStats


@torch.inference_mode()
def blended_logits(model: Llama, prefix: Sequence[int], chunks: Sequence[Sequence[int]],
                   suffix: Sequence[int], ratio: float, *, check_layer: int = 1,
                   stored: Optional[Sequence[bool]] = None, backend: Optional[str] = None,
                   chunk_cache: Optional[dict] = None,
                   lookahead: Optional[int] = None, sink: Sequence[int] = ()) -> Blended:
    """One request ``prefix + chunks... + suffix`` served with Blend: the prefix is computed
    (a prefix hit), each stored chunk's KV (computed alone, :func:`chunk_kv`) is rotated to its
    position, the chunk region is filled by :func:`ucm.blend.engine.blend_fill` at ``ratio``,
    and the suffix is computed over that cache; returns the suffix's logits beside a full
    prefill's. ``stored[i]`` False: chunk ``i`` has no stored KV (recomputed in place);
    ``chunk_cache``: memo of chunk KV by token tuple; ``lookahead``: how many leading suffix
    tokens the Blend's lookahead sees (default all, as the vLLM integration sees every prompt
    token after the chunks; 0: none, CacheBlend's deviation-only selection); ``sink``: the
    tokens each chunk is computed after (``blend.sink``; empty: as if it began the
    sequence)."""
    from ucm.blend import ops

    bm = LlamaBlendModel(model)
    dev = model.device
    stored = [True] * len(chunks) if stored is None else list(stored)
    ids = list(prefix) + [t for c in chunks for t in c] + list(suffix)
    n, P = len(ids), len(prefix)
    E = n - len(suffix)
    bs = 16
    nb = math.ceil(n / bs)
    cache = model.new_cache(nb, bs)
    kv = PagedRequestKV(cache, range(nb))
    if P:
        model.prefill(list(prefix), cache, list(range(math.ceil(P / bs))), logits_from=P - 1)
    region = E - P
    mask = torch.zeros(region, dtype=torch.bool, device=dev)
    pieces, off = [], 0
    memo = {} if chunk_cache is None else chunk_cache
    for c, ok in zip(chunks, stored):
        if ok:
            key = (tuple(sink), tuple(c))
            if key not in memo:
                memo[key] = chunk_kv(model, c, sink)
            pieces.append((off, memo[key]))
            mask[off:off + len(c)] = True
        off += len(c)
    def loaded(layer):   # the stored chunks' rows, in position order
        ks, vs = [], []
        for o, per_layer in pieces:
            ck, cv = per_layer[layer]
            delta = torch.full((len(ck),), P + o - len(sink), dtype=torch.int64, device=dev)
            ks.append(ops.rope_rotate(ck, delta, bm.inv_freq, backend=backend))
            vs.append(cv)
        return torch.cat(ks), torch.cat(vs)

    stats = BlendStats()
    if region:
        from ucm.blend.engine import LOOKAHEAD_TOKENS

        m = len(suffix) if lookahead is None else max(0, min(int(lookahead), len(suffix)))
        lo = max(E, E + m - LOOKAHEAD_TOKENS)
        after = (torch.tensor(ids[lo:E + m], dtype=torch.long, device=dev),
                 torch.arange(lo, E + m, device=dev))
        blend_fill(bm, kv, torch.tensor(ids[P:E], dtype=torch.long, device=dev), P, loaded, mask,
                   ratio=ratio, check_layer=check_layer, backend=backend, stats=stats,
                   lookahead=after)
    h = blend_fill(bm, kv, torch.tensor(ids[E:], dtype=torch.long, device=dev), E, None,
                   torch.zeros(n - E, dtype=torch.bool, device=dev), ratio=1.0)
    return Blended(bm.logits(h), model.forward(ids, logits_from=E), stats)
