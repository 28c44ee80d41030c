"""Numba Blend ops on CPU tensors: same names and signatures as :mod:`ucm.reference.blend`
(inputs validated by :mod:`ucm.blend.ops`); one jitted call per op (``nogil``, one thread: an
engine may call from several).

How it works:

* Tensors are read and written where they are, through flat numpy views of their element bits
  (``uint16`` bfloat16, ``int16`` float16, ``uint32`` float32: the array's type picks the
  conversions at compile time, :mod:`ucm.fast.numba._elements`) with the tensor's own strides in
  elements, so transposed and sliced views of a cache need no copy. Loads convert to float32
  exactly; stores round to nearest even, as ``Tensor.to`` does.
* :func:`rope_rotate`: per token, the angles ``delta * inv_freq`` (float64 products) and their
  cosines and sines (float64 polynomials after a float64 reduction, :func:`_sincos`; then
  float32) once, then every head's pairs rotate in float32.
  Channels past ``rotary_dim`` move as bits (exact), and not at all in place.
* :func:`kv_deviation`: float32 differences and squares as the reference; the sum over a head's
  channels may be reordered (vectorized), so it matches within float32 rounding.
* With ``NUMBA_DISABLE_JIT=1`` the same code runs as Python (slowly): the element conversions
  then come from numpy instead of the LLVM intrinsics.
"""
from __future__ import annotations

from typing import Optional

import numba
import numpy as np
import torch

from ucm.fast.numba._jit import njit

# tensor dtype -> (torch dtype of its bits, numpy dtype of its bits as the kernels see them)
_BITS = {torch.bfloat16: (torch.int16, np.uint16), torch.float16: (torch.int16, np.int16),
         torch.float32: (torch.int32, np.uint32)}

if numba.config.DISABLE_JIT:
    def ld(a, i):
        """Element ``i`` of an array of element bits as float32 (plain Python)."""
        bits = np.asarray(a[i])
        if a.dtype == np.uint16:
            return (bits.astype(np.uint32) << np.uint32(16)).view(np.float32)[()]
        if a.dtype == np.int16:
            return bits.view(np.float16).astype(np.float32)[()]
        return bits.view(np.float32)[()]

    def st(a, i, f):
        """Store float32 ``f`` rounded to nearest even into element ``i`` (plain Python)."""
        f = np.asarray(np.float32(f))
        if a.dtype == np.uint16:
            u = int(f.view(np.uint32))
            a[i] = 0x7FC0 if (u & 0x7FFFFFFF) > 0x7F800000 else \
                (u + 0x7FFF + ((u >> 16) & 1)) >> 16
        elif a.dtype == np.int16:
            a[i] = f.astype(np.float16).view(np.int16)
        else:
            a[i] = f.view(np.uint32)
else:
    from ucm.fast.numba._elements import ld, st


def _elements(t: torch.Tensor):
    """``(bits, strides)``: a 1-D numpy array of ``t``'s element bits from its first element to
    its last (sharing ``t``'s memory), and ``t``'s strides in elements (int64). ``t`` non-empty."""
    as_torch, as_numpy = _BITS[t.dtype]
    span = 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))
    flat = torch.as_strided(t.view(as_torch), (span,), (1,), t.storage_offset())
    return flat.numpy().view(as_numpy), np.array(t.stride(), dtype=np.int64)


# ---------------------------------------------------------------------------------------------
# kernels

_HALF_PI = np.pi / 2
_INV_HALF_PI = 2 / np.pi


@njit(inline="always")
def _sincos(angle):
    """``(cos, sin)`` of a float64 angle, float64, within ~1e-11 of libm's for ``|angle|`` up to
    ~1e6 (the error of the float64 reduction): quarter turns ``q`` taken off in float64, then
    Taylor polynomials on ``[-pi / 4, pi / 4]`` (truncation error < 1e-16) and the quadrant's
    sign swap. Branch-free arithmetic: it vectorizes, where libm's ``cos`` / ``sin`` of large
    angles take most of a rotation's time."""
    t = np.floor(angle * _INV_HALF_PI + 0.5)
    y = angle - t * _HALF_PI
    q = t - 4.0 * np.floor(t * 0.25)                    # t mod 4, in {0, 1, 2, 3}
    y2 = y * y
    s = y * (1.0 + y2 * (-1.0 / 6 + y2 * (1.0 / 120 + y2 * (-1.0 / 5040 + y2 * (
        1.0 / 362880 + y2 * (-1.0 / 39916800 + y2 * (1.0 / 6227020800 + y2 * (
            -1.0 / 1307674368000))))))))
    c = 1.0 + y2 * (-0.5 + y2 * (1.0 / 24 + y2 * (-1.0 / 720 + y2 * (1.0 / 40320 + y2 * (
        -1.0 / 3628800 + y2 * (1.0 / 479001600 + y2 * (-1.0 / 87178291200 + y2 * (
            1.0 / 20922789888000))))))))
    # angle = y + q pi / 2: cos, sin = (c, s), (-s, c), (-c, -s), (s, -c)
    cq = c if q == 0.0 else (-s if q == 1.0 else (-c if q == 2.0 else s))
    sq = s if q == 0.0 else (c if q == 1.0 else (-s if q == 2.0 else -c))
    return cq, sq


@njit(inline="always")
def _angles(dt, inv_freq, half, cs, sn):
    """``cs[i], sn[i]`` = float32 cos, sin of ``dt * inv_freq[i]`` (float64) for ``i < half``."""
    for i in range(half):
        c, s = _sincos(dt * inv_freq[i])
        cs[i] = np.float32(c)
        sn[i] = np.float32(s)


@njit(nogil=True)
def _rope(x, xs, y, ys, delta, inv_freq, h_n, d_n, r_n, neox, tail, cs, sn):
    """Rotate ``x`` into ``y`` (element bits; element ``[n, h, c]`` at ``n xs[0] + h xs[1] +
    c xs[2]``, likewise ``y``): pair ``i`` is channels ``(i, i + r_n / 2)`` with ``neox``,
    ``(2 i, 2 i + 1)`` without, turned by ``delta[n] * inv_freq[i]``; channels
    ``r_n..d_n-1`` copied when ``tail``. ``cs``, ``sn``: float32 ``[r_n / 2]`` scratch."""
    half = r_n // 2
    step = 1 if neox else 2                  # pair i: channels step * i and step * i + off
    off = half if neox else 1
    xs_n, xs_h, xs_d = xs[0], xs[1], xs[2]
    ys_n, ys_h, ys_d = ys[0], ys[1], ys[2]
    for t in range(delta.shape[0]):
        if delta[t] == 0:                    # an exact copy (a * 1 - b * 0 is not: -0, inf)
            for h in range(h_n):
                for c in range(d_n):
                    y[t * ys_n + h * ys_h + c * ys_d] = x[t * xs_n + h * xs_h + c * xs_d]
            continue
        _angles(np.float64(delta[t]), inv_freq, half, cs, sn)
        for h in range(h_n):
            xb = t * xs_n + h * xs_h
            yb = t * ys_n + h * ys_h
            for i in range(half):
                ca = step * i
                cb = ca + off
                a = ld(x, xb + ca * xs_d)
                b = ld(x, xb + cb * xs_d)
                st(y, yb + ca * ys_d, a * cs[i] - b * sn[i])
                st(y, yb + cb * ys_d, b * cs[i] + a * sn[i])
            if tail:
                for c in range(r_n, d_n):
                    y[yb + c * ys_d] = x[xb + c * xs_d]


@njit(nogil=True)
def _rope_dense(x, xs, y, ys, delta, inv_freq, h_n, d_n, r_n, neox, tail, cs, sn, buf):
    """:func:`_rope` for channels of stride 1 in ``x`` and ``y``. Each head's rotary channels go
    to the float32 scratch ``buf [r_n]`` first, so that no loop reads and writes the same array
    (``y`` may be ``x``): both loops, indexed by their loop variable, vectorize."""
    half = r_n // 2
    xs_n, xs_h = xs[0], xs[1]
    ys_n, ys_h = ys[0], ys[1]
    for t in range(delta.shape[0]):
        if delta[t] == 0:                    # an exact copy (a * 1 - b * 0 is not: -0, inf)
            for h in range(h_n):
                xv = x[t * xs_n + h * xs_h:t * xs_n + h * xs_h + d_n]
                yv = y[t * ys_n + h * ys_h:t * ys_n + h * ys_h + d_n]
                for c in range(d_n):
                    yv[c] = xv[c]
            continue
        _angles(np.float64(delta[t]), inv_freq, half, cs, sn)
        for h in range(h_n):
            xv = x[t * xs_n + h * xs_h:t * xs_n + h * xs_h + d_n]
            yv = y[t * ys_n + h * ys_h:t * ys_n + h * ys_h + d_n]
            for c in range(r_n):
                buf[c] = ld(xv, c)
            if neox:
                ya = yv[:half]
                yb = yv[half:r_n]
                ba = buf[:half]
                bb = buf[half:]
                for i in range(half):
                    st(ya, i, ba[i] * cs[i] - bb[i] * sn[i])
                    st(yb, i, bb[i] * cs[i] + ba[i] * sn[i])
            else:
                for i in range(half):
                    st(yv, 2 * i, buf[2 * i] * cs[i] - buf[2 * i + 1] * sn[i])
                    st(yv, 2 * i + 1, buf[2 * i + 1] * cs[i] + buf[2 * i] * sn[i])
            if tail:
                yv[r_n:] = xv[r_n:]


@njit(nogil=True, fastmath={"reassoc"})
def _deviation(kn, kns, vn, vns, ko, kos, vo, vos, h_n, d_n, out):
    """``out[n] = sum_{h, c} (kn - ko)^2 + (vn - vo)^2`` in float32 (element bits and strides
    as in :func:`_rope`); the sum over ``c`` may be reordered (``reassoc``: it vectorizes)."""
    for t in range(out.shape[0]):
        total = np.float32(0.0)
        for h in range(h_n):
            a = t * kns[0] + h * kns[1]
            b = t * vns[0] + h * vns[1]
            c = t * kos[0] + h * kos[1]
            e = t * vos[0] + h * vos[1]
            acc = np.float32(0.0)
            for d in range(d_n):
                dk = ld(kn, a + d * kns[2]) - ld(ko, c + d * kos[2])
                dv = ld(vn, b + d * vns[2]) - ld(vo, e + d * vos[2])
                acc += dk * dk + dv * dv
            total += acc
        out[t] = total


@njit(nogil=True, fastmath={"reassoc"})
def _deviation_dense(kn, kns, vn, vns, ko, kos, vo, vos, h_n, d_n, out):
    """:func:`_deviation` for channels of stride 1 in all four (slices: it vectorizes)."""
    for t in range(out.shape[0]):
        total = np.float32(0.0)
        for h in range(h_n):
            a = t * kns[0] + h * kns[1]
            b = t * vns[0] + h * vns[1]
            c = t * kos[0] + h * kos[1]
            e = t * vos[0] + h * vos[1]
            knv = kn[a:a + d_n]
            vnv = vn[b:b + d_n]
            kov = ko[c:c + d_n]
            vov = vo[e:e + d_n]
            acc = np.float32(0.0)
            for d in range(d_n):
                dk = ld(knv, d) - ld(kov, d)
                dv = ld(vnv, d) - ld(vov, d)
                acc += dk * dk + dv * dv
            total += acc
        out[t] = total


# ---------------------------------------------------------------------------------------------
# ops


def rope_rotate(x: torch.Tensor, delta: torch.Tensor, inv_freq: torch.Tensor, *,
                neox: bool = True, rotary_dim: Optional[int] = None,
                out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Same contract as :func:`ucm.reference.blend.rope_rotate` (CPU tensors)."""
    N, H, D = x.shape
    R = D if rotary_dim is None else rotary_dim
    y = torch.empty((N, H, D), dtype=x.dtype) if out is None else out
    if y.numel() == 0:
        return y
    in_place = y.data_ptr() == x.data_ptr() and y.stride() == x.stride()
    xb, xs = _elements(x)
    yb, ys = _elements(y)
    d64 = np.ascontiguousarray(delta.numpy(), dtype=np.int64)
    f64 = np.ascontiguousarray(inv_freq.numpy(), dtype=np.float64)
    args = (xb, xs, yb, ys, d64, f64, H, D, R, bool(neox), R < D and not in_place,
            np.empty(R // 2, np.float32), np.empty(R // 2, np.float32))
    if xs[2] == 1 and ys[2] == 1:
        _rope_dense(*args, np.empty(R, np.float32))
    else:
        _rope(*args)
    return y


def kv_deviation(k_new: torch.Tensor, v_new: torch.Tensor, k_old: torch.Tensor,
                 v_old: torch.Tensor) -> torch.Tensor:
    """Same contract as :func:`ucm.reference.blend.kv_deviation` (CPU tensors)."""
    N, H, D = k_new.shape
    out = torch.empty(N, dtype=torch.float32)
    if k_new.numel() == 0:
        return out.zero_()
    views = [_elements(t) for t in (k_new, v_new, k_old, v_old)]
    dense = all(s[2] == 1 for _, s in views)
    kernel = _deviation_dense if dense else _deviation
    kernel(*(a for view in views for a in view), H, D, out.numpy())
    return out
