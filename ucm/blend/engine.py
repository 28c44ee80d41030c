"""The Blend forward: fill a request's KV for a region of its prompt from stored chunk KV plus a
selective recompute (CacheBlend's algorithm), over any model and any paged cache.

A region is the tokens ``[start, start + n)`` of one request, after a context ``[0, start)``
whose KV is already in the cache (a prefix hit, or tokens computed before). Some region tokens
have stored KV (``loaded``: the keys already rotated to their positions in this request, see
:func:`ucm.blend.ops.rope_rotate`); the others (chunks not stored, text between chunks) do not.

Which tokens are recomputed (a fraction ``ratio`` of the loaded ones, plus every token without
stored KV) is chosen one of two ways:

* **by lookahead** (the prompt continues after the region, the usual case: a question closes
  it): every layer's stored KV is written into the cache, the tokens after the region run over
  it (:func:`lookahead_mass`), and the stored tokens they attend to most are recomputed, since a
  stored token's error reaches the answer in proportion to that attention. No layer is
  computed in full;
* **by deviation** (nothing follows the region; CacheBlend's rule): the layers up to
  ``check_layer`` are computed for every region token, exactly as a full prefill would (layer 0
  sees only embeddings). At ``check_layer`` the fresh K/V of the loaded tokens are compared with
  the stored ones (:func:`ucm.blend.ops.kv_deviation`) and those that deviate most go on; the
  others keep their stored KV from the next layer on.

Then every remaining layer computes only the selected tokens: their queries attend to the whole
cache up to their position (stored KV of the others, fresh KV of their own), and their fresh
K/V overwrite the stored ones. ``ratio=1`` recomputes everything (the result is the full
prefill's); ``ratio=0`` keeps the stored KV of every loaded token (naive concatenation).

The model is reached through :class:`BlendModel` (embedding, per-layer q/k/v with RoPE, the
rest of a layer), the cache through :class:`RequestKV` (read positions ``[0, end)`` of a layer,
write given positions): the vLLM integration and the reference harness
(:class:`ucm.reference.llama.Llama`) implement both.
"""
from __future__ import annotations

import math
import numbers
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


_FLASH: list = []


def _flash_cpu():
    """torch's CPU flash-attention op, which returns the log-sum-exp beside the output; None
    where this torch lacks it or calls it otherwise (a private op: probed once)."""
    if not _FLASH:
        _FLASH.append(_probe(getattr(torch.ops.aten,
                                     "_scaled_dot_product_flash_attention_for_cpu", None)))
    return _FLASH[0]


def _probe(op):
    """``op`` if it takes ``(q, k, v, attn_mask=, scale=)`` and returns ``(out, lse)`` of the
    expected shapes and values, else None."""
    if op is None:
        return None
    try:
        q = torch.tensor([[[[1.0, 0.0], [0.0, 1.0]]]])
        o, lse = op(q, q, q, attn_mask=torch.tensor([[0.0, float("-inf")], [0.0, 0.0]]),
                    scale=1.0)
        want = torch.logsumexp(torch.tensor([[1.0, float("-inf")], [0.0, 1.0]]), -1)
        if o.shape != q.shape or not torch.allclose(lse.reshape(-1), want, atol=1e-5) or \
                not torch.allclose(o[0, 0, 0], q[0, 0, 0], atol=1e-5):
            return None
    except Exception:
        return None
    return op


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor,
           scale: float) -> torch.Tensor:
    """Causal attention of queries at positions ``q_pos [m]`` over keys/values of positions
    ``[0, E)`` (``k, v [E, Hkv, D]``): query ``i`` sees keys ``j <= q_pos[i]``. Returns
    ``[m, Hq, D]`` in ``q``'s dtype (softmax in float32 for half inputs). Grouped-query heads
    attend per KV head (:func:`_grouped`), so the keys and values are never repeated.

    Queries go in tiles of ``QUERY_TILE``; a tile (queries in position order, as Blend's are)
    needs the keys up to its last query. On CPU the keys before its first query, which every
    query of the tile sees, are attended without a mask, and only the rest with one; the two
    parts are merged by their log-sum-exp (a masked call costs about 1.2x an unmasked one)."""
    m, hq, _ = q.shape
    E, hkv, _ = k.shape
    rep = hq // hkv
    kk = k.transpose(0, 1)[None]                                       # [1, Hkv, E, D]
    vv = v.transpose(0, 1)[None]
    out = torch.empty_like(q)
    keys = torch.arange(E, device=q.device)
    pos = q_pos.tolist()
    ascending = all(x <= y for x, y in zip(pos, pos[1:]))
    flash = _flash_cpu() if q.device.type == "cpu" and ascending else None
    for a in range(0, m, QUERY_TILE):
        b = min(m, a + QUERY_TILE)
        end = min(E, (pos[b - 1] if ascending else max(pos[a:b])) + 1)
        lo = min(pos[a], end) if flash is not None else 0   # keys [0, lo): seen by all
        mask = (keys[None, lo:end] <= q_pos[a:b, None]).repeat(rep, 1)  # [rep * t, end - lo]
        qq = _grouped(q[a:b], hkv)[None]                               # [1, Hkv, rep * t, D]
        if flash is None:
            o = F.scaled_dot_product_attention(qq, kk[:, :, :end], vv[:, :, :end],
                                               attn_mask=mask, scale=scale)
        else:
            add = torch.zeros(mask.shape, dtype=q.dtype).masked_fill_(~mask, float("-inf"))
            o, lse = flash(qq, kk[:, :, lo:end], vv[:, :, lo:end], attn_mask=add, scale=scale)
            if lo > 0:   # (every query sees key lo, its tile's first position: lse is finite)
                o0, lse0 = flash(qq, kk[:, :, :lo], vv[:, :, :lo], scale=scale)
                total = torch.logaddexp(lse0, lse)
                o = o0 * torch.exp(lse0 - total)[..., None] + o * torch.exp(lse - total)[..., None]
        out[a:b] = _ungrouped(o[0], b - a)
    return out


def lookahead_mass(model: BlendModel, kv: RequestKV, start: int, end: int,
                   loaded_mask: torch.Tensor, ids: torch.Tensor, pos: torch.Tensor,
                   check_layer: int) -> torch.Tensor:
    """How much the tokens after a region look at each of its stored tokens, in a cheap
    approximate pass: the tokens ``ids [m]`` at positions ``pos [m]`` (increasing, all at or
    after ``end``) go through every layer, attending to the cache and to each other. The cache
    holds the prefix and, at the stored tokens, their stored KV in every layer (:func:`blend_fill`
    writes it before it calls this): what a Blend at ratio 0 would give them. Region tokens
    without stored KV are left out. Returns float32 ``[end - start]``: the softmax mass their
    queries give each region token, summed over the layers above ``check_layer`` (the first
    layers attend mostly to nearby tokens and to the sequence's first), heads and queries (0 for
    tokens without stored KV). Nothing is written to the cache."""
    n = end - start
    device = loaded_mask.device
    mass = torch.zeros(n, dtype=torch.float32, device=device)
    m = int(ids.shape[0])
    if m == 0 or check_layer + 1 >= model.num_layers:
        return mass
    hkv = model.num_kv_heads
    hidden = start + (~loaded_mask).nonzero().flatten()             # region tokens left out
    later = pos[None, :] > pos[:, None]                               # [m, m] causal among them
    h = model.embed(ids)
    for layer in range(model.num_layers):
        q, k, v = model.qkv(layer, h, pos)
        ck, cv = kv.read(layer, end)
        above = layer > check_layer
        # keys and values [Hkv, D, E] / [Hkv, E, D] as strided views (no copy in float32):
        # the cache's and the lookahead's own are scored apart, one product each
        kc, vc = ck.to(q.dtype).float().permute(1, 2, 0), cv.to(q.dtype).float().transpose(0, 1)
        ko, vo = k.float().permute(1, 2, 0), v.float().transpose(0, 1)
        out = torch.empty_like(q)
        for a in range(0, m, QUERY_TILE):
            b = min(m, a + QUERY_TILE)
            qg = _grouped(q[a:b].float() * model.scale, hkv)          # [Hkv, rep * t, D]
            s = torch.cat([torch.bmm(qg, kc), torch.bmm(qg, ko)], 2)  # [Hkv, rep * t, end + m]
            s4 = s.view(hkv, -1, b - a, end + m)
            s4[..., hidden] = float("-inf")
            s4[..., end:].masked_fill_(later[a:b], float("-inf"))
            p = s.softmax(-1)                                         # [Hkv, rep * t, end + m]
            o = torch.bmm(p[..., :end], vc).add_(torch.bmm(p[..., end:], vo))
            out[a:b] = _ungrouped(o, b - a).to(q.dtype)
            if above:
                mass += p[..., start:end].sum((0, 1))
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
    last layer's output hidden states of the tokens computed through every layer (those
    recomputed, in position order; all of them when ``ratio`` is 1 or nothing is loaded).

    ``ids [n]``: the region's token ids; ``loaded_mask [n]`` bool: which tokens have stored KV;
    ``loaded(layer) -> (k, v)``, each ``[L, Hkv, D]`` for the ``L`` tokens of ``loaded_mask`` in
    position order: their stored KV at that layer, keys already at their positions here.
    The stored KV of a layer is written first, so the cache holds it wherever no token is
    recomputed. ``lookahead``: ``(ids [m], pos [m])`` of prompt tokens after the region (the
    question of a retrieval prompt); when given, the recompute goes to the stored tokens they
    attend to (:func:`choose_recompute`) and no layer is computed in full."""
    # ratio NaN or past 1 would silently run the full prefill ("ratio < 1" is False)
    if isinstance(ratio, bool) or not isinstance(ratio, numbers.Real) \
            or not math.isfinite(ratio) or not 0 <= ratio <= 1:
        raise ValueError(f"ratio: expected a real number in [0, 1], got {ratio!r}")
    n = int(ids.shape[0])
    device = loaded_mask.device
    pos = torch.arange(start, start + n, device=device)
    any_loaded = bool(loaded_mask.any()) and loaded is not None
    if not 0 <= check_layer < model.num_layers:
        raise ValueError(f"check_layer: {check_layer} is outside the model's "
                         f"{model.num_layers} layers")
    if n == 0:
        return model.embed(ids)
    sel, h, first = torch.arange(n, device=device), None, 0
    if any_loaded and ratio < 1:
        look = lookahead if lookahead is not None and len(lookahead[0]) > 0 else None
        chosen = None
        if ratio == 0 or look is not None:
            chosen = _select_over_stored(model, kv, ids, pos, loaded, loaded_mask, ratio,
                                         check_layer, look)
        if chosen is not None:
            sel = chosen
        else:
            sel, h, first = _select_at_check_layer(model, kv, ids, pos, loaded, loaded_mask,
                                                   ratio, check_layer, backend)
    h = _forward(model, kv, ids, pos, sel, h, first, start + n)
    if stats is not None:
        stats.tokens += n
        stats.loaded += int(loaded_mask.sum())
        stats.recomputed += int(len(sel))
    return h


class AfterSink:
    """A :class:`RequestKV` for computing a chunk after ``sink`` tokens: positions ``[0, s)``
    (the sink) live in buffers of this object, positions ``[s, ...)`` in ``inner`` at
    ``pos - s``, so the chunk's rows start at the inner cache's row 0 (block aligned) while
    its keys carry positions ``s...`` (a loader rotates them by ``chunk start - s``)."""

    def __init__(self, inner: RequestKV, s: int):
        self.inner, self.s = inner, s
        self._k: dict = {}
        self._v: dict = {}

    def write(self, layer, pos, k, v):
        low = pos < self.s
        if bool(low.any()):
            if layer not in self._k:
                self._k[layer] = k.new_zeros((self.s,) + tuple(k.shape[1:]))
                self._v[layer] = v.new_zeros((self.s,) + tuple(v.shape[1:]))
            self._k[layer][pos[low]] = k[low]
            self._v[layer][pos[low]] = v[low]
        high = ~low
        if bool(high.any()):
            self.inner.write(layer, pos[high] - self.s, k[high], v[high])

    def read(self, layer, end):
        sk, sv = self._k[layer][:min(end, self.s)], self._v[layer][:min(end, self.s)]
        if end <= self.s:
            return sk, sv
        k, v = self.inner.read(layer, end - self.s)
        return torch.cat([sk, k.to(sk.dtype)]), torch.cat([sv, v.to(sv.dtype)])


def chunk_fill(model: BlendModel, kv: RequestKV, ids: torch.Tensor,
               sink: Optional[torch.Tensor] = None) -> None:
    """Compute a chunk alone into ``kv`` (positions ``0..n-1`` of it): the KV a Blend stores
    for the chunk. With ``sink`` (token ids ``[s]``, e.g. the model's BOS) the chunk is computed
    after those tokens, whose KV is dropped: the keys then carry positions ``s..s+n-1``.

    Why a sink: computed as the start of a sequence, a chunk's first token becomes an attention
    sink (most of every later token's attention in most heads lands on position 0) and its
    stored KV is far from what the token has in a real prompt, where the prompt's own first
    token is the sink. After a shared sink token the chunk's tokens attend as they would
    inside a prompt, so less of the recompute budget goes to repairing the chunk's start."""
    s = 0 if sink is None else int(len(sink))
    full = ids if s == 0 else torch.cat([sink.to(ids.device, ids.dtype), ids])
    blend_fill(model, kv if s == 0 else AfterSink(kv, s), full, 0, None,
               torch.zeros(len(full), dtype=torch.bool, device=ids.device), ratio=1.0)


def _write_stored(kv: RequestKV, pos: torch.Tensor, loaded: Callable,
                  loaded_mask: torch.Tensor, layers) -> None:
    stored = pos[loaded_mask]
    for layer in layers:
        lk, lv = loaded(layer)
        kv.write(layer, stored, lk, lv)


def _forward(model: BlendModel, kv: RequestKV, ids: torch.Tensor, pos: torch.Tensor,
             sel: torch.Tensor, h: Optional[torch.Tensor], first: int, end: int,
             last: Optional[int] = None) -> torch.Tensor:
    """Layers ``first`` to ``last - 1`` (default: to the end) for the region tokens ``sel``
    (increasing indices; ``h``: their input to layer ``first``, or None for the embeddings at
    layer 0): each layer writes their fresh K/V, then their queries attend to the cache up to
    their positions."""
    if h is None:
        h = model.embed(ids[sel])
    if len(sel) == 0:
        return h
    p = pos[sel]
    for layer in range(first, model.num_layers if last is None else last):
        q, k, v = model.qkv(layer, h, p)
        kv.write(layer, p, k, v)
        ck, cv = kv.read(layer, end)
        h = model.finish(layer, h, attend(q, ck, cv, p, model.scale))
    return h


def _select_over_stored(model: BlendModel, kv: RequestKV, ids: torch.Tensor,
                        pos: torch.Tensor,
                        loaded: Callable, loaded_mask: torch.Tensor, ratio: float,
                        check_layer: int, lookahead: Optional[tuple]) -> Optional[torch.Tensor]:
    """The selection that needs no layer computed in full: every layer's stored KV goes into
    the cache, the lookahead (if any) reads it, and the recompute goes to the stored tokens it
    attends to most (at ratio 0: none, only the tokens without stored KV: naive
    concatenation). None when the lookahead reads none of the stored tokens (the caller then
    ranks by deviation)."""
    from ucm.blend import ops

    start, end = int(pos[0]), int(pos[-1]) + 1
    forced = ~loaded_mask
    _write_stored(kv, pos, loaded, loaded_mask, range(model.num_layers))
    if ratio == 0 or lookahead is None:
        return forced.nonzero().flatten()
    mass = lookahead_mass(model, kv, start, end, loaded_mask, lookahead[0], lookahead[1],
                          check_layer)
    if not bool((mass > 0).any()):
        return None
    return ops.select_recompute(mass, float(ratio), forced)


def _select_at_check_layer(model: BlendModel, kv: RequestKV, ids: torch.Tensor,
                           pos: torch.Tensor,
                           loaded: Callable, loaded_mask: torch.Tensor, ratio: float,
                           check_layer: int, backend: Optional[str]) -> tuple:
    """CacheBlend's selection: the layers up to ``check_layer`` computed for every region token,
    the tokens whose stored KV deviates most from the fresh one there go on. Returns ``(sel,
    h, first)`` for :func:`_forward`: the selected indices, their hidden states after the
    check layer's attention and the next layer."""
    from ucm.blend import ops

    n, end = int(ids.shape[0]), int(pos[-1]) + 1
    forced = ~loaded_mask
    h = _forward(model, kv, ids, pos, torch.arange(n, device=loaded_mask.device), None, 0, end,
                 last=check_layer)
    q, k, v = model.qkv(check_layer, h, pos)
    kv.write(check_layer, pos, k, v)
    lk, lv = loaded(check_layer)
    dev = torch.zeros(n, dtype=torch.float32, device=loaded_mask.device)
    dev[loaded_mask] = ops.kv_deviation(k[loaded_mask], v[loaded_mask], lk, lv, backend=backend)
    # the stored KV of every later layer goes in now: it stays wherever no token recomputes
    # (the recomputed ones overwrite theirs)
    _write_stored(kv, pos, loaded, loaded_mask, range(check_layer + 1, model.num_layers))
    keep = choose_recompute(dev, float(ratio), forced)
    q, h = q[keep], h[keep]
    if len(keep):
        ck, cv = kv.read(check_layer, end)
        h = model.finish(check_layer, h, attend(q, ck, cv, pos[keep], model.scale))
    return keep, h, check_layer + 1
