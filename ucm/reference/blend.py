"""Blend ops, reference implementation: readable PyTorch, float64 angles and rotations.

Inputs are validated (and normalized) by :mod:`ucm.blend.ops` before they reach these functions,
so nothing here re-checks shapes, dtypes or devices: ``rotary_dim`` arrives as an int (even,
``<= D``), ``neox`` as a bool, ``ratio`` as a float in ``[0, 1]``.

* :func:`rope_rotate`: RoPE composes, ``R(p + d) = R(d) R(p)``, so a key stored at position ``p``
  becomes the key at ``p + d`` by one more rotation by ``d``. Angles ``delta * inv_freq`` reach
  ~1e5 radians: they, their cosines and sines and the rotation are float64 here, rounded once to
  ``x``'s dtype at the end.
* :func:`kv_deviation`: per-token squared L2 distance between fresh and stored K/V, float32.
* :func:`select_recompute`: the tokens a selective recompute goes on with (CacheBlend's
  high-deviation tokens plus the ones without stored KV).
"""
from __future__ import annotations

import math
from typing import Optional

import torch


def rotary_pairs(D: int, R: int, neox: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Channel indices ``(first, second)``, int64 ``[R / 2]`` each, of the rotated pairs of a
    head of ``D`` channels whose first ``R`` rotate: ``(i, i + R / 2)`` with ``neox``
    (rotate-half, Llama / Hugging Face), ``(2 i, 2 i + 1)`` without (GPT-J, interleaved).
    Pair ``i`` turns by ``delta * inv_freq[i]``."""
    assert R % 2 == 0 and 0 < R <= D, (D, R)
    i = torch.arange(R // 2)
    return (i, i + R // 2) if neox else (2 * i, 2 * i + 1)


def rope_rotate(x: torch.Tensor, delta: torch.Tensor, inv_freq: torch.Tensor, *,
                neox: bool = True, rotary_dim: Optional[int] = None,
                out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Keys ``x [N, H, D]`` (float32 / float16 / bfloat16, any strides) rotated by ``delta [N]``
    (int32 / int64) positions: for each pair ``(a, b)`` of :func:`rotary_pairs` and angle
    ``t = delta[n] * inv_freq[i]`` (float64),
    ``a' = a cos t - b sin t``, ``b' = b cos t + a sin t``; channels ``R..D-1`` unchanged.
    Returns ``out`` (written; it may be ``x`` itself) or a new contiguous tensor of ``x``'s
    dtype."""
    N, H, D = x.shape
    R = D if rotary_dim is None else rotary_dim
    first, second = rotary_pairs(D, R, neox)
    first, second = first.to(x.device), second.to(x.device)

    angle = delta.to(torch.float64)[:, None] * inv_freq.to(torch.float64)[None, :]   # [N, R/2]
    cos = angle.cos()[:, None, :]                                                    # [N, 1, R/2]
    sin = angle.sin()[:, None, :]

    y = x.to(torch.float64)                   # a copy: channels R..D-1 pass through exactly
    a = y[:, :, first].clone()                # [N, H, R/2]
    b = y[:, :, second].clone()
    # delta 0 is an exact copy: a * 1 - b * 0 is not (-0 pairs, infinities, NaN)
    zero = (delta == 0)[:, None, None]
    y[:, :, first] = torch.where(zero, a, a * cos - b * sin)
    y[:, :, second] = torch.where(zero, b, b * cos + a * sin)
    result = y.to(x.dtype)
    if out is None:
        return result.contiguous()
    out.copy_(result)                         # result is a new tensor: out may alias x
    return out


def kv_deviation(k_new: torch.Tensor, v_new: torch.Tensor, k_old: torch.Tensor,
                 v_old: torch.Tensor) -> torch.Tensor:
    """float32 ``[N]``: ``sum_{h, d} (k_new - k_old)^2 + (v_new - v_old)^2`` of each token, the
    four inputs ``[N, H, D]`` of one dtype (any strides), differences and sums in float32."""
    dk = k_new.float() - k_old.float()
    dv = v_new.float() - v_old.float()
    return (dk * dk).sum(dim=(1, 2)) + (dv * dv).sum(dim=(1, 2))


#: ``ratio * n`` within this of an integer counts as that integer (0.3 * 10 is
#: 3.0000000000000004 in float64: three tokens, not four)
COUNT_SLACK = 1e-9


def recompute_count(ratio: float, n: int) -> int:
    """``ceil(ratio * n)``, ``ratio * n`` taken as the nearest integer when within
    :data:`COUNT_SLACK` of it."""
    want = ratio * n
    near = round(want)
    k = near if abs(want - near) <= COUNT_SLACK else math.ceil(want)
    return max(0, min(n, int(k)))


def select_recompute(deviation: torch.Tensor, ratio: float, forced: torch.Tensor) -> torch.Tensor:
    """int64 token indices, increasing, on ``deviation``'s device: every ``n`` with
    ``forced[n]`` (bool ``[N]``: tokens without stored KV), plus the
    :func:`recompute_count` ``(ratio, number of unforced tokens)`` unforced tokens of largest
    ``deviation`` (float ``[N]``; NaN counts as +inf; ties to the lower index)."""
    dev = deviation.to(torch.float64)
    dev = torch.where(torch.isnan(dev), torch.full_like(dev, math.inf), dev)
    free = torch.nonzero(~forced, as_tuple=True)[0]                    # increasing
    k = recompute_count(ratio, int(free.numel()))
    # descending by deviation; stable: equal deviations keep increasing index order
    order = torch.sort(dev[free], descending=True, stable=True).indices
    chosen = free[order[:k]]
    keep = forced.clone()
    keep[chosen] = True
    return torch.nonzero(keep, as_tuple=True)[0]
