"""Reference KV codecs in PyTorch (the rules are in :mod:`ucm.compress`, the byte layout in
:mod:`ucm.codecs`). Readable over fast: whole-tensor operations on float32 copies, any device."""
from __future__ import annotations

import numpy as np
import torch

from ucm.codecs import (CodecSpec, KVShape, encoded_bytes, magnitude_limit, n_salient, offsets,
                         rank)

_TORCH = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32,
          "uint8": torch.uint8, "int8": torch.int8}


# ---------------------------------------------------------------------------------------------
# layout helpers

def _elements(b: torch.Tensor, dtype) -> torch.Tensor:
    """uint8 bytes (any strides, any start) as elements of ``dtype``: a contiguous copy at
    offset 0 (``contiguous()`` keeps rows that are already contiguous where they are, whose start
    need not be a multiple of the element size: ``view`` refuses those)."""
    return b.clone(memory_format=torch.contiguous_format).view(dtype)


_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32}


def swap_key_planes(rows: torch.Tensor, shape: KVShape, to_token_major: bool) -> torch.Tensor:
    """A copy of raw rows (uint8 ``[n, raw_bytes]``) whose key planes (``T x D`` per head,
    contiguous: ``shape.order`` ends in ``"td"``) are transposed, channel-major -> token-major
    (``to_token_major``) or back; the values copied as they are."""
    n, t, d = rows.shape[0], shape.tokens, shape.head_dim
    sizes = shape.sizes()
    x = _elements(rows, _BITS[shape.esize]).reshape([n] + [sizes[c] for c in shape.order[:-2]] + [t * d])
    out = torch.empty_like(x)
    kdim = 1 + shape.order.index("k")
    a, b = (d, t) if to_token_major else (t, d)
    out.select(kdim, 1).copy_(x.select(kdim, 1))
    out.select(kdim, 0).copy_(x.select(kdim, 0).unflatten(-1, (a, b)).transpose(-1, -2).flatten(-2))
    return out.view(torch.uint8).reshape(n, shape.raw_bytes)


def to_canonical(rows: torch.Tensor, shape: KVShape) -> torch.Tensor:
    """uint8 ``[n, raw_bytes]`` -> float32 ``[n, 2, T, H, D]``."""
    if shape.key_order == "dt":
        rows, shape = swap_key_planes(rows, shape, True), shape.with_token_major_keys()
    sizes = shape.sizes()
    x = _elements(rows, _TORCH[shape.dtype]).reshape([rows.shape[0]] + [sizes[c] for c in shape.order])
    perm = [0] + [1 + shape.order.index(c) for c in "kthd"]
    return x.permute(perm).float()


def from_canonical(x: torch.Tensor, shape: KVShape) -> torch.Tensor:
    """float32 ``[n, 2, T, H, D]`` -> uint8 ``[n, raw_bytes]`` in the shard's memory order."""
    perm = [0] + [1 + "kthd".index(c) for c in shape.order]
    y = x.to(_TORCH[shape.dtype]).permute(perm).contiguous()
    rows = y.view(torch.uint8).reshape(x.shape[0], shape.raw_bytes)
    return swap_key_planes(rows, shape, False) if shape.key_order == "dt" else rows


def bf16_up(x: torch.Tensor) -> torch.Tensor:
    """float32 >= 0 rounded up to the next bfloat16 (returned as float32)."""
    bits = x.contiguous().view(torch.int32)
    hi = bits & -65536
    return torch.where((bits & 0xFFFF) != 0, hi + 0x10000, hi).view(torch.float32)


def bf16_down(x: torch.Tensor) -> torch.Tensor:
    """float32 rounded toward minus infinity to a bfloat16 (returned as float32)."""
    bits = x.contiguous().view(torch.int32)
    hi = bits & -65536
    return torch.where(((bits & 0xFFFF) != 0) & (bits < 0), hi + 0x10000, hi).view(torch.float32)


def bf16_bits(x: torch.Tensor) -> torch.Tensor:
    """float32 holding a bfloat16 value exactly -> its 16 bits as int16."""
    return (x.contiguous().view(torch.int32) >> 16).to(torch.int16)


def from_bf16_bits(b: torch.Tensor) -> torch.Tensor:
    """bfloat16 values (or their bits as int16) -> float32."""
    if b.dtype == torch.bfloat16:
        return b.float()
    return (b.to(torch.int32) << 16).view(torch.float32)


def _segment(rows: torch.Tensor, spec: CodecSpec, shape: KVShape, name: str) -> torch.Tensor:
    """A view of segment ``name`` of every encoded row: ``[n, *segment shape]``."""
    at, dt, shp = offsets(spec, shape)[name]
    size = int(np.prod(shp)) * torch.tensor([], dtype=_TORCH[dt]).element_size()
    seg = rows[:, at:at + size]
    return _elements(seg, _TORCH[dt]).reshape((rows.shape[0],) + tuple(shp))


def _put(dst: torch.Tensor, spec: CodecSpec, shape: KVShape, name: str, value: torch.Tensor) -> None:
    at, dt, shp = offsets(spec, shape)[name]
    b = value.contiguous().view(torch.uint8).reshape(dst.shape[0], -1)
    dst[:, at:at + b.shape[1]] = b


# ---------------------------------------------------------------------------------------------
# the quantizers

def _div(x: torch.Tensor, c: float) -> torch.Tensor:
    """``x / c`` correctly rounded on every device: PyTorch's CUDA division by a Python scalar
    multiplies by its float32 reciprocal instead (one bit off now and then, which moves
    ``bf16_up`` to the next bfloat16), so divide by a tensor."""
    return x / torch.full_like(x, c)


def quant8(x: torch.Tensor, dim: int = -1):
    """Symmetric INT8 over ``dim``: (int8 q, float32 scale holding a bfloat16, ``dim``
    removed)."""
    s = bf16_up(_div(x.abs().amax(dim=dim), 127.0))
    se = s.unsqueeze(dim)
    q = torch.where(se > 0, torch.round(x / se).clamp(-127, 127), torch.zeros_like(x))
    return q.to(torch.int8), s


def dequant8(q: torch.Tensor, s: torch.Tensor, dim: int = -1) -> torch.Tensor:
    return q.float() * s.unsqueeze(dim)


def _int8_channel_encode(k: torch.Tensor, v: torch.Tensor, rounding=None, layer: int = 0):
    """INT8 with keys per channel: k, v float32 ``[n, T, H, D]`` -> (q int8 ``[n, 2, T - 1, H,
    D]`` of tokens 1.., the keys' uint8 codes then the values' int8 codes, kp bf16 bits
    ``[n, H, D, 2]``, vscale ``[n, T - 1, H]``). Token 0 is kept exact (segment ``x0``) and out
    of the keys' ranges: in the block that starts a sequence it is the attention sink, which
    most heads attend to, whose key sits apart from the others (with it in the ranges
    asymmetric keys' KL is 2x on SmolLM2) and whose value's rounding error reaches every
    output (an exact one cuts the values' KL 3.7x). ``rounding``: a :class:`KeyRounding`
    choosing the keys' codes (:func:`round_keys`) instead of rounding each to nearest."""
    kq, km, ks = quant_asym(k[:, 1:], 1, 255)                     # [n, T-1, H, D], [n, 1, H, D]
    if rounding is not None:                                        # (keys per channel here)
        kq = round_keys(k[:, 1:], km, ks, rounding, layer)
    vq, vs = quant8(v[:, 1:])                                       # [n, T-1, H, D], [n, T-1, H]
    kp = torch.stack([km[:, 0], ks[:, 0]], dim=-1)                  # [n, H, D, 2]
    return torch.stack([kq.view(torch.int8), vq], dim=1), bf16_bits(kp), bf16_bits(vs)


def round_keys(x: torch.Tensor, m: torch.Tensor, s: torch.Tensor, rounding, layer: int,
               levels: int = 255):
    """Codes of keys ``x`` float32 ``[n, T, H, D]`` on the grids ``m + q s`` (``[n, 1, H, D]``,
    codes 0..``levels``) chosen channel by channel, each rounding error fed into the channels
    not yet coded so that the error of ``q . k`` stays small for queries of the calibrated
    second moments (GPTQ's rule with the queries' moments in place of a layer's inputs). For
    each head, in the order ``rounding.order[layer, h]``: ``c = clamp(rint((w_j - m_j) / s_j),
    0, levels)``, ``e = w_j - (c s_j + m_j)`` clamped to ``[-128 s_j, 128 s_j]`` (so the values stay
    finite: :data:`ucm.codecs.ROUNDING_LIMIT`), then ``w_i = w_i - e * F[j, i]`` for every channel
    ``i`` (``F = rounding.feedback[layer, h]``: zero for channels already coded), each product
    and difference rounded to float32 on its own, so every implementation picks the same
    codes."""
    order = torch.from_numpy(rounding.order[layer]).to(x.device)          # [H, D]
    fb = torch.from_numpy(rounding.feedback[layer]).to(x.device)         # [H, D, D]
    w = x.clone()
    q = torch.zeros(x.shape, dtype=torch.uint8, device=x.device)
    heads = torch.arange(x.shape[2], device=x.device)
    for step in range(x.shape[3]):
        j = order[:, step]                                                # [H]
        wj = w[:, :, heads, j]                                            # [n, T, H]
        mj, sj = m[:, :, heads, j], s[:, :, heads, j]                     # [n, 1, H]
        c = torch.where(sj > 0, torch.round((wj - mj) / sj).clamp(0, levels), torch.zeros_like(wj))
        q[:, :, heads, j] = c.to(torch.uint8)
        e = wj - (c * sj + mj)
        e = torch.minimum(torch.maximum(e, -128 * sj), 128 * sj)
        w = w - e[..., None] * fb[heads, j][None, None]                   # [n, T, H, D]
    return q


def quant_asym(x: torch.Tensor, dim: int, levels: int):
    """Asymmetric quantization over ``dim`` to codes ``0 .. levels``: (uint8 q, min, scale),
    min/scale float32 holding bfloat16 values, reduced over ``dim`` (kept as size 1). A zero
    extreme counts as +0 (``+ 0.0``): the min / max of -0 and +0 is either, and which one a
    reduction returns depends on its order (torch's on the positions of the zeros), which the
    stored bits must not."""
    m = bf16_down(x.amin(dim=dim, keepdim=True) + 0.0)
    s = bf16_up(_div(x.amax(dim=dim, keepdim=True) + 0.0 - m, float(levels)))
    q = torch.where(s > 0, torch.round((x - m) / s).clamp(0, levels), torch.zeros_like(x))
    return q.to(torch.uint8), m, s


def quant4(x: torch.Tensor, dim: int):
    """Asymmetric INT4 over ``dim`` (:func:`quant_asym`, codes 0 .. 15)."""
    return quant_asym(x, dim, 15)


def dequant4(q: torch.Tensor, m: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    return q.float() * s + m


def pack4(q: torch.Tensor) -> torch.Tensor:
    return q[..., 0::2] | (q[..., 1::2] << 4)


def unpack4(b: torch.Tensor) -> torch.Tensor:
    return torch.stack([b & 15, b >> 4], dim=-1).reshape(b.shape[:-1] + (2 * b.shape[-1],))


def _int4_encode(k: torch.Tensor, v: torch.Tensor, spec: CodecSpec, layer: int = 0):
    """k, v: float32 ``[n, T', H, D]`` -> packed kq, vq and (min, scale) pairs as bf16 bits."""
    n, t, h, d = k.shape
    g = spec.group
    if spec.key_mode == "channel":
        kq, km, ks = quant4(k, dim=1)                       # over tokens: [n, 1, H, D]
        if spec.rounds_keys:
            kq = round_keys(k, km, ks, spec.rounding, layer, levels=15)
        kp = torch.stack([km[:, 0], ks[:, 0]], dim=-1)      # [n, H, D, 2]
    else:
        kq, km, ks = quant4(k.reshape(n, t, h, d // g, g), dim=-1)
        kq = kq.reshape(n, t, h, d)
        kp = torch.stack([km[..., 0], ks[..., 0]], dim=-1)  # [n, T', H, D/g, 2]
    vq, vm, vs = quant4(v.reshape(n, t, h, d // g, g), dim=-1)
    vq = vq.reshape(n, t, h, d)
    vp = torch.stack([vm[..., 0], vs[..., 0]], dim=-1)
    return pack4(kq), pack4(vq), bf16_bits(kp), bf16_bits(vp)


def _int4_decode(kq, vq, kp, vp, spec: CodecSpec, t: int, h: int, d: int):
    n = kq.shape[0]
    g = spec.group
    kp, vp = from_bf16_bits(kp), from_bf16_bits(vp)
    kq, vq = unpack4(kq), unpack4(vq)
    if spec.key_mode == "channel":
        k = dequant4(kq, kp[:, None, ..., 0], kp[:, None, ..., 1])
    else:
        k = dequant4(kq.reshape(n, t, h, d // g, g), kp[..., 0:1], kp[..., 1:2]).reshape(n, t, h, d)
    v = dequant4(vq.reshape(n, t, h, d // g, g), vp[..., 0:1], vp[..., 1:2]).reshape(n, t, h, d)
    return k, v


def salient_tokens(k: torch.Tensor, count: int) -> torch.Tensor:
    """bool ``[n, T]``: token 0 of each row, then the ``count - 1`` other tokens with the largest
    ``max |K|`` over heads and channels (ties: the lower token). Token 0 comes first because
    the block that starts a sequence holds its attention sink there: most heads put much of
    their attention on that one token, and its key is the error INT4 costs most (measured on
    SmolLM2: keeping it exact halves the KL of INT4's next-token distributions, where the
    largest-magnitude token alone gains nothing; in other blocks it costs one exact row)."""
    score = k.abs().amax(dim=(2, 3))                                    # [n, T]
    score[:, 0] = float("inf")
    order = torch.sort(-score, dim=1, stable=True).indices[:, :count]
    mask = torch.zeros(score.shape, dtype=torch.bool, device=k.device)
    mask.scatter_(1, order, True)
    return mask


# ---------------------------------------------------------------------------------------------
# ops

def encode(spec: CodecSpec, shape: KVShape, src: torch.Tensor, dst: torch.Tensor, layer: int) -> np.ndarray:
    spec = spec.for_shape(shape)
    x = to_canonical(src, shape)                                      # [n, 2, T, H, D]
    n, _, t, h, d = x.shape
    ok = (x.abs() < magnitude_limit(spec, shape, layer)).reshape(n, -1).all(dim=1)   # NaN: False
    x = torch.where(ok[:, None, None, None, None], x, torch.zeros_like(x))
    out = torch.zeros((n, encoded_bytes(spec, shape)), dtype=torch.uint8, device=x.device)
    if spec.int8 and spec.key_mode == "channel":
        q, kp, vs = _int8_channel_encode(x[:, 0], x[:, 1], spec.rounding, layer)
        _put(out, spec, shape, "q", q)
        _put(out, spec, shape, "kp", kp)
        _put(out, spec, shape, "vscale", vs)
        _put(out, spec, shape, "x0", x[:, :, 0].to(_TORCH[shape.dtype]))
    elif spec.int8:
        q, s = quant8(x)
        _put(out, spec, shape, "q", q)
        _put(out, spec, shape, "scale", bf16_bits(s))
    elif spec.method == "quantize":
        for name, val in zip(("kq", "vq", "kp", "vp"), _int4_encode(x[:, 0], x[:, 1], spec, layer)):
            _put(out, spec, shape, name, val)
    elif spec.method == "sparse":
        c = n_salient(spec, shape)
        mask = salient_tokens(x[:, 0], c)                             # [n, T]
        exact = x.permute(0, 2, 1, 3, 4)[mask].reshape(n, c, 2, h, d)  # ascending tokens
        rest = x.permute(0, 2, 1, 3, 4)[~mask].reshape(n, t - c, 2, h, d)
        bits = torch.zeros((n, -(-t // 8) * 8), dtype=torch.uint8, device=x.device)
        bits[:, :t] = mask.to(torch.uint8)
        bitmap = (bits.reshape(n, -1, 8) << torch.arange(8, device=x.device, dtype=torch.uint8)).sum(
            dim=-1, dtype=torch.uint8)
        _put(out, spec, shape, "bitmap", bitmap)
        _put(out, spec, shape, "exact", exact.to(_TORCH[shape.dtype]))
        for name, val in zip(("kq", "vq", "kp", "vp"),
                             _int4_encode(rest[:, :, 0], rest[:, :, 1], spec, layer)):
            _put(out, spec, shape, name, val)
    else:
        p = spec.projection
        r = rank(spec, shape)
        mean = torch.from_numpy(p.means[layer]).to(x.device)              # [2, H, D]
        basis = torch.from_numpy(p.bases[layer][..., :r]).to(x.device)    # [2, H, D, R]
        coef = torch.einsum("nkthd,khdr->nkthr", x - mean[None, :, None], basis)
        _put(out, spec, shape, "coef", coef.to(torch.bfloat16))
    dst.copy_(out)
    return ok.cpu().numpy()


def decode(spec: CodecSpec, shape: KVShape, src: torch.Tensor, dst: torch.Tensor, layer: int) -> None:
    spec = spec.for_shape(shape)
    n = src.shape[0]
    t, h, d = shape.tokens, shape.heads, shape.head_dim
    if spec.int8 and spec.key_mode == "channel":
        q = _segment(src, spec, shape, "q")
        kp = from_bf16_bits(_segment(src, spec, shape, "kp"))             # [n, H, D, 2]
        k = dequant4(q[:, 0].view(torch.uint8), kp[:, None, ..., 0], kp[:, None, ..., 1])
        v = dequant8(q[:, 1], from_bf16_bits(_segment(src, spec, shape, "vscale")))
        x0 = _segment(src, spec, shape, "x0").float()                     # [n, 2, H, D]
        x = torch.cat([x0[:, :, None], torch.stack([k, v], dim=1)], dim=2)
    elif spec.int8:
        x = dequant8(_segment(src, spec, shape, "q"), from_bf16_bits(_segment(src, spec, shape, "scale")))
    elif spec.method == "quantize":
        k, v = _int4_decode(*(_segment(src, spec, shape, s) for s in ("kq", "vq", "kp", "vp")),
                            spec, t, h, d)
        x = torch.stack([k, v], dim=1)
    elif spec.method == "sparse":
        c = n_salient(spec, shape)
        bitmap = _segment(src, spec, shape, "bitmap")
        mask = ((bitmap[..., None] >> torch.arange(8, device=src.device, dtype=torch.uint8)) & 1)
        mask = mask.reshape(n, -1)[:, :t].bool()
        wrong = (mask.sum(dim=1) != c).nonzero().flatten()
        if len(wrong):                          # (the numba implementation's error)
            raise ValueError(f"decode: row {int(wrong[0])}: its bitmap does not mark {c} exact "
                             f"tokens (not a sparse shard of this codec)")
        exact = _segment(src, spec, shape, "exact").float()                # [n, c, 2, H, D]
        k, v = _int4_decode(*(_segment(src, spec, shape, s) for s in ("kq", "vq", "kp", "vp")),
                            spec, t - c, h, d)
        tok = torch.empty((n, t, 2, h, d), dtype=torch.float32, device=src.device)
        tok[mask] = exact.reshape(-1, 2, h, d)
        tok[~mask] = torch.stack([k, v], dim=2).reshape(-1, 2, h, d)
        x = tok.permute(0, 2, 1, 3, 4)
    else:
        p = spec.projection
        r = rank(spec, shape)
        mean = torch.from_numpy(p.means[layer]).to(src.device)
        # the decode multiplies by the basis rounded to bfloat16, as the coefficients are: the
        # fast paths then multiply bfloat16 pairs exactly (ucm.fast.numba affine_pairs); the
        # rounding is far below the rank truncation's error
        basis = torch.from_numpy(p.bases[layer][..., :r]).to(src.device)
        basis = basis.to(torch.bfloat16).float()
        coef = _segment(src, spec, shape, "coef").float()
        x = torch.einsum("nkthr,khdr->nkthd", coef, basis) + mean[None, :, None]
    dst.copy_(from_canonical(x, shape))
