"""The Blend forward: fill a request's KV for a region of its prompt from stored chunk KV plus a
selective recompute (CacheBlend's algorithm), over any model and any paged cache.

A region is the tokens ``[start, start + n)`` of one request, after a context ``[0, start)``
whose KV is already in the cache (a prefix hit, or tokens computed before). Some region tokens
have stored KV (``loaded``: the keys already rotated to their positions in this request, see
:func:`ucm.blend.ops.rope_rotate`); the others (chunks not stored, text between chunks) do not.

Layer by layer:

* the layers up to ``check_layer`` are computed for every region token, exactly as a full
  prefill would (their inputs are exact: layer 0 sees only embeddings). Their K/V are written;
* at ``check_layer`` the fresh K/V of the loaded tokens are compared with the stored ones
  (:func:`ucm.blend.ops.kv_deviation`): the tokens whose stored KV deviates most from what the
  full prefill computes are the ones whose cross-chunk attention matters. Those (a fraction
  ``ratio`` of the loaded tokens) and every token without stored KV go on; the others keep
  their stored KV from the next layer on (:func:`ucm.blend.ops.select_recompute`);
* every later layer computes only the tokens that went on: their queries attend to the whole
  cache up to their position (stored KV of the others, fresh KV of their own), and their fresh
  K/V overwrite the stored ones.

``ratio=1`` recomputes everything (the result is the full prefill's); ``ratio=0`` keeps the
stored KV of every loaded token after ``check_layer`` (close to naive concatenation).

The model is reached through :class:`BlendModel` (embedding, per-layer q/k/v with RoPE, the
rest of a layer), the cache through :class:`RequestKV` (read positions ``[0, end)`` of a layer,
write given positions): the vLLM integration and the reference harness
(:class:`ucm.reference.llama.Llama`) implement both.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Protocol

import torch
import torch.nn.functional as F

#: queries per attention call: bounds the score matrix ([heads, QUERY_TILE, context]) and, with
#: queries in position order, skips the keys after a tile's last query (causal)
QUERY_TILE = 128

#: at most this many prompt tokens after a region (its last ones: a question closes a prompt)
#: make the lookahead
LOOKAHEAD_TOKENS = 256


class BlendModel(Protocol):
    """What the Blend forward needs from a decoder-only transformer with RoPE."""

    num_layers: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float          # attention softmax scale

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """Hidden states ``[n, hidden]`` of token ids ``[n]``."""

    def qkv(self, layer: int, h: torch.Tensor, pos: torch.Tensor) -> tuple:
        """``(q [n, Hq, D], k [n, Hkv, D], v [n, Hkv, D])`` of hidden states ``h`` (the layer's
        input) at positions ``pos [n]``; ``q`` and ``k`` carry RoPE."""

    def finish(self, layer: int, h: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """The layer's output hidden states from its input ``h`` and attention ``[n, Hq, D]``."""


class RequestKV(Protocol):
    """One request's KV in a paged cache."""

    def read(self, layer: int, end: int) -> tuple:
        """``(k, v)`` of positions ``[0, end)``: ``[end, Hkv, D]`` each."""

    def write(self, layer: int, pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store ``k, v [n, Hkv, D]`` at positions ``pos [n]``."""


@dataclass
class BlendStats:
    tokens: int = 0            # region tokens
    loaded: int = 0            # with stored KV
    recomputed: int = 0        # computed past the check layer (selected + not stored)


def _grouped(x: torch.Tensor, hkv: int) -> torch.Tensor:
    """``[m, Hq, D]`` -> ``[Hkv, rep * m, D]``: each KV head's query heads side by side, so
    grouped-query attention is one batched product per KV head (no key or value is repeated)."""
    m, hq, d = x.shape
    rep = hq // hkv
    return x.reshape(m, hkv, rep, d).permute(1, 2, 0, 3).reshape(hkv, rep * m, d)


def _ungrouped(x: torch.Tensor, m: int) -> torch.Tensor:
    """Inverse of :func:`_grouped`: ``[Hkv, rep * m, D]`` -> ``[m, Hq, D]``."""
    hkv, rm, d = x.shape
    return x.reshape(hkv, rm // m, m, d).permute(2, 0, 1, 3).reshape(m, hkv * (rm // m), d)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor,
           scale: float) -> torch.Tensor:
    """Causal attention of queries at positions ``q_pos [m]`` over keys/values of positions
    ``[0, E)`` (``k, v [E, Hkv, D]``): query ``i`` sees keys ``j <= q_pos[i]``. Returns
    ``[m, Hq, D]`` in ``q``'s dtype (softmax in float32 for half inputs). Grouped-query heads
    attend per KV head (:func:`_grouped`), so the keys and values are never repeated."""
    m, hq, _ = q.shape
    E, hkv, _ = k.shape
    rep = hq // hkv
    kk = k.transpose(0, 1)[None]                                       # [1, Hkv, E, D]
    vv = v.transpose(0, 1)[None]
    out = torch.empty_like(q)
    keys = torch.arange(E, device=q.device)
    pos = q_pos.tolist()
    ascending = all(x <= y for x, y in zip(pos, pos[1:]))
    for a in range(0, m, QUERY_TILE):
        b = min(m, a + QUERY_TILE)
        # queries in position order (Blend's are): a tile needs the keys up to its last one
        end = min(E, (pos[b - 1] if ascending else max(pos[a:b])) + 1)
        mask = (keys[None, :end] <= q_pos[a:b, None]).repeat(rep, 1)  # [rep * t, end]
        qq = _grouped(q[a:b], hkv)[None]                               # [1, Hkv, rep * t, D]
        o = F.scaled_dot_product_attention(qq, kk[:, :, :end], vv[:, :, :end],
                                           attn_mask=mask, scale=scale)
        out[a:b] = _ungrouped(o[0], b - a)
    return out


def lookahead_mass(model: BlendModel, kv: RequestKV, start: int, end: int,
                   loaded_mask: torch.Tensor, ids: torch.Tensor, pos: torch.Tensor,
                   check_layer: int) -> torch.Tensor:
    """How much the tokens after a region look at each of its stored tokens, in a cheap
    approximate pass: the tokens ``ids [m]`` at positions ``pos [m]`` (increasing, all at or
    after ``end``) go through every layer, attending to the cache and to each other; up to
    ``check_layer`` the cache holds the region computed in full (exact), above it the prefix
    and, at the stored tokens, their stored KV: what a Blend at ratio 0 would give them. The
    cache must hold that stored KV above ``check_layer`` (:func:`blend_fill` writes it before
    it calls this); region tokens without stored KV are left out there. Returns float32
    ``[end - start]``: the softmax mass their queries give each region token, summed over the
    layers above ``check_layer``, heads and queries (0 for tokens without stored KV). Nothing
    is written to the cache."""
    n = end - start
    device = loaded_mask.device
    mass = torch.zeros(n, dtype=torch.float32, device=device)
    m = int(ids.shape[0])
    if m == 0 or check_layer + 1 >= model.num_layers:
        return mass
    hkv = model.num_kv_heads
    visible = torch.ones(end, dtype=torch.bool, device=device)
    own = pos[None, :] <= pos[:, None]                                # [m, m] causal among them
    h = model.embed(ids)
    for layer in range(model.num_layers):
        q, k, v = model.qkv(layer, h, pos)
        ck, cv = kv.read(layer, end)
        above = layer > check_layer
        if above:
            visible[start:] = loaded_mask
        kk = torch.cat([ck.to(q.dtype), k]).transpose(0, 1).float()     # [Hkv, end + m, D]
        vv = torch.cat([cv.to(q.dtype), v]).transpose(0, 1).float()
        allow = torch.cat([visible[None, :].expand(m, end), own], 1)  # [m, end + m]
        out = torch.empty_like(q)
        for a in range(0, m, QUERY_TILE):
            b = min(m, a + QUERY_TILE)
            qg = _grouped(q[a:b].float(), hkv)                        # [Hkv, rep * t, D]
            s = torch.bmm(qg, kk.transpose(1, 2)) * model.scale       # [Hkv, rep * t, end + m]
            s = s.view(hkv, -1, b - a, end + m).masked_fill(~allow[None, None, a:b], float("-inf"))
            p = s.softmax(-1)                                         # [Hkv, rep, t, end + m]
            o = torch.bmm(p.view(hkv, -1, end + m), vv)               # [Hkv, rep * t, D]
            out[a:b] = _ungrouped(o, b - a).to(q.dtype)
            if above:
                mass += p[..., start:end].sum((0, 1, 2))
        h = model.finish(layer, h, out)
    return mass


def choose_recompute(deviation: torch.Tensor, ratio: float, forced: torch.Tensor,
                     mass: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The tokens that go on past the check layer (increasing indices): the forced ones plus
    ``ceil(ratio * U)`` of the ``U`` unforced ones. With ``mass`` (:func:`lookahead_mass`):
    those the following text attends to most, since a stored token's error reaches the answer
    in proportion to the attention the answer gives it. Without it, or when the lookahead reads
    none of the stored tokens: those of largest deviation (CacheBlend's rule). On the reference
    forward, over prompts ending in a question, in a generic instruction ("Summarise the
    documents above") and in a code-word question, the mass alone beat the deviation alone and
    an even split of the budget between the two rankings, and tied with their product."""
    from ucm.blend import ops

    if mass is None or not bool((mass > 0).any()):
        return ops.select_recompute(deviation, ratio, forced)
    return ops.select_recompute(mass, ratio, forced)


def blend_fill(model: BlendModel, kv: RequestKV, ids: torch.Tensor, start: int,
               loaded: Optional[Callable[[int], tuple]], loaded_mask: torch.Tensor, *,
               ratio: float, check_layer: int = 1, backend: Optional[str] = None,
               stats: Optional[BlendStats] = None,
               lookahead: Optional[tuple] = None) -> torch.Tensor:
    """Fill the KV of region ``[start, start + n)`` of one request (module doc) and return the
    last layer's output hidden states of the tokens computed through every layer (those past
    the check layer, in position order; all of them when ``ratio`` is 1 or nothing is loaded).

    ``ids [n]``: the region's token ids; ``loaded(layer) -> (k, v)``, each ``[n, Hkv, D]``: the
    stored KV of the region's tokens at that layer, keys already at their positions here (rows
    of tokens without stored KV are ignored); ``loaded_mask [n]`` bool: which tokens have it.
    The stored KV of a layer is written first, so the cache holds it wherever no token is
    recomputed. ``lookahead``: ``(ids [m], pos [m])`` of prompt tokens after the region (the
    question of a retrieval prompt); when given, part of the recompute goes to the stored tokens
    they attend to (:func:`choose_recompute`)."""
    from ucm.blend import ops

    n = int(ids.shape[0])
    device = loaded_mask.device
    pos = torch.arange(start, start + n, device=device)
    forced = ~loaded_mask
    any_loaded = bool(loaded_mask.any()) and loaded is not None
    if not 0 <= check_layer < model.num_layers:
        raise ValueError(f"check_layer: {check_layer} is outside the model's "
                         f"{model.num_layers} layers")
    sel = torch.arange(n, device=device)                 # region tokens computed at this layer
    h = model.embed(ids)
    if n == 0:
        return h
    end = start + n
    blended = any_loaded and ratio < 1
    for layer in range(model.num_layers):
        q, k, v = model.qkv(layer, h, pos[sel])
        kv.write(layer, pos[sel], k, v)
        if blended and layer == check_layer:
            lk, lv = loaded(layer)
            dev = ops.kv_deviation(k, v, lk, lv, backend=backend)      # sel is every token here
            # the stored KV of every later layer goes in now: it stays wherever no token
            # recomputes (the recomputed ones overwrite theirs), and the lookahead reads it
            stored = pos[loaded_mask]
            for later in range(layer + 1, model.num_layers):
                lk, lv = loaded(later)
                kv.write(later, stored, lk[loaded_mask], lv[loaded_mask])
            mass = None
            if lookahead is not None and len(lookahead[0]) and ratio > 0:
                mass = lookahead_mass(model, kv, start, end, loaded_mask, lookahead[0],
                                      lookahead[1], check_layer)
            keep_idx = choose_recompute(dev, float(ratio), forced, mass)
            q, h, sel = q[keep_idx], h[keep_idx], sel[keep_idx]
            if len(sel) == 0:   # nothing recomputes: the later layers keep the stored KV
                break
        ck, cv = kv.read(layer, end)
        h = model.finish(layer, h, attend(q, ck, cv, pos[sel], model.scale))
    if stats is not None:
        stats.tokens += n
        stats.loaded += int(loaded_mask.sum())
        stats.recomputed += int(len(sel))
    return h
