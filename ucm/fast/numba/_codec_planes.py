"""Plane-level pieces of the numba KV codecs (:mod:`ucm.fast.numba.compress`, whose docstring
says how they work): the encoded rows' little-endian fields, one ``(kv, head)`` plane loaded,
quantized, dequantized, and the transpositions of channel-major key planes (vLLM-CPU)."""
from __future__ import annotations

import numpy as np

from ucm.fast.numba._elements import (bf16_down, bf16_up, f2i, hi4, i2f, key, ld, lo4,
                                      mag, mag32, st, unkey)
from ucm.fast.numba._jit import njit

_F0 = np.float32(0.0)
_F15 = np.float32(15.0)
_F255 = np.float32(255.0)
_F127 = np.float32(127.0)
_F128 = np.float32(128.0)
_FM127 = np.float32(-127.0)
_INF = np.float32(np.inf)
_NINF = np.float32(-np.inf)


# bytes of the encoded rows (little endian)

@njit
def _put16(out, at, v):
    out[at] = np.uint8(v & 0xFF)
    out[at + 1] = np.uint8((v >> 8) & 0xFF)


@njit
def _get16(buf, at):
    return np.int64(buf[at]) | (np.int64(buf[at + 1]) << 8)


@njit
def _put_bf16(out, at, f):
    """A float32 that holds a bfloat16 value exactly (a scale, a minimum): its top 16 bits."""
    _put16(out, at, f2i(f) >> 16)


@njit
def _get_bf16(buf, at):
    return i2f(_get16(buf, at) << 16)


# ---------------------------------------------------------------------------------------------
# planes: load (to float32), quantize, dequantize. Inner loops index slices with the loop
# variable (an index LLVM cannot prove non-negative keeps numba's wraparound select per element,
# which stops vectorization: 5x slower)

@njit
def _load_plane(x, base, tok, nt, s_t, d_n, buf, zero, lim):
    """Tokens ``tok[:nt]`` of one (kv, head) plane (token ``t`` at ``base + t * s_t``) into
    ``buf[nt, D]`` as float32; zeros when ``zero``. Returns whether a value's magnitude bits
    reach ``lim`` (the magnitude bits of :func:`ucm.codecs.magnitude_limit`; NaN and
    infinities included): the shard is refused."""
    if zero:
        buf[:nt * d_n] = _F0
        return False
    worst = np.int32(0)
    for j in range(nt):
        o = base + tok[j] * s_t
        xv = x[o:o + d_n]
        bv = buf[j * d_n:(j + 1) * d_n]
        for d in range(d_n):
            worst = max(worst, mag(xv, d))
            bv[d] = ld(xv, d)
    return worst >= lim


@njit
def _enc8_plane(buf, nt, d_n, out, q_at, q_ts, s_at, s_ts):
    """INT8 of each token's vector: q at ``q_at + t * q_ts``, its scale at ``s_at + t * s_ts``."""
    for t in range(nt):
        bv = buf[t * d_n:(t + 1) * d_n]
        amax = np.int32(0)                                 # max |x| as magnitude bits
        for d in range(d_n):
            amax = max(amax, mag32(bv[d]))
        s = bf16_up(i2f(amax) / _F127)
        _put_bf16(out, s_at + t * s_ts, s)
        ov = out[q_at + t * q_ts:q_at + t * q_ts + d_n]
        if s > _F0:
            for d in range(d_n):
                r = min(max(np.rint(bv[d] / s), _FM127), _F127)
                ov[d] = np.uint8(np.int32(r))
        else:
            ov[:] = 0


@njit
def _quant4(v, m, s):
    if s > _F0:
        return np.uint8(np.int32(min(max(np.rint((v - m) / s), _F0), _F15)))
    return np.uint8(0)


@njit
def _pack(qb, out, o, d_n):
    ov = out[o:o + d_n // 2]
    for j in range(d_n // 2):
        ov[j] = qb[2 * j] | (qb[2 * j + 1] << np.uint8(4))


@njit
def _channel_params(buf, t0, nt, d_n, levels, out, p_at, lo, hi):
    """Asymmetric (min, scale) per channel over tokens ``t0 .. nt - 1`` of a plane, for codes
    ``0 .. levels``: ``m = bf16_down(min)``, ``s = bf16_up((max - m) / levels)`` (a zero
    extreme counts as +0), written as bfloat16 pairs at ``p_at + 4 d`` and left in ``lo``
    (minima) and ``hi`` (scales), float32 [D]."""
    lo[:] = _INF
    hi[:] = _NINF
    for t in range(t0, nt):
        bv = buf[t * d_n:(t + 1) * d_n]
        for d in range(d_n):
            lo[d] = min(lo[d], bv[d])
            hi[d] = max(hi[d], bv[d])
    for d in range(d_n):
        m = bf16_down(lo[d] + _F0)                        # + 0: a zero extreme is +0
        sc = bf16_up((hi[d] + _F0 - m) / levels)
        lo[d] = m
        hi[d] = sc
        _put_bf16(out, p_at + 4 * d, m)
        _put_bf16(out, p_at + 4 * d + 2, sc)


@njit
def _enc4_plane(buf, nt, d_n, g, chan, out, q_at, q_ts, p_at, p_ts, lo, hi, qb, order, fb):
    """INT4 of a plane's ``nt`` tokens: packed q at ``q_at + t * q_ts``; (min, scale) per channel
    at ``p_at + 4 d`` (``chan``: over the tokens) or per token and group at
    ``p_at + t * p_ts + 4 group``. ``lo``, ``hi``: float32 [D] scratch; ``qb``: uint8 [D].
    ``chan`` with ``order`` of D channels: codes chosen by :func:`_feedback_codes`."""
    if chan:
        _channel_params(buf, 0, nt, d_n, _F15, out, p_at, lo, hi)
        for t in range(nt):
            bv = buf[t * d_n:(t + 1) * d_n]
            if order.shape[0]:
                _feedback_codes(bv, d_n, lo, hi, _F15, order, fb, qb)
            else:
                for d in range(d_n):
                    qb[d] = _quant4(bv[d], lo[d], hi[d])
            _pack(qb, out, q_at + t * q_ts, d_n)
        return
    for t in range(nt):
        for k in range(d_n // g):
            bv = buf[t * d_n + k * g:t * d_n + (k + 1) * g]
            qv = qb[k * g:(k + 1) * g]
            mn = np.int32(0x7FFFFFFF)
            mx = np.int32(-0x7FFFFFFF)
            for d in range(g):
                kd = key(bv[d])
                mn = min(mn, kd)
                mx = max(mx, kd)
            m = bf16_down(unkey(mn))
            s = bf16_up((unkey(mx) - m) / _F15)
            at = p_at + t * p_ts + 4 * k
            _put_bf16(out, at, m)
            _put_bf16(out, at + 2, s)
            for d in range(g):
                qv[d] = _quant4(bv[d], m, s)
        _pack(qb, out, q_at + t * q_ts, d_n)


@njit
def _unpack(src, o, d_n, qf):
    """Packed nibbles -> float32 ``qf[D]``."""
    sv = src[o:o + d_n // 2]
    for j in range(d_n // 2):
        qf[2 * j] = lo4(sv[j])
        qf[2 * j + 1] = hi4(sv[j])


@njit
def _dec4_planes(src, nt, d_n, g, chan, y, base, s_h, tok, s_t, q_at, q_hs, q_ts, p_at, p_hs,
                 p_ts, h_n, lo, hi, qb):
    """Inverse of :func:`_enc4_plane` for ``h_n`` heads of one key or value plane group, token
    by token across the heads: head ``h``'s payload at ``q_at + h * q_hs`` (token stride
    ``q_ts``), its parameters at ``p_at + h * p_hs`` (per channel, or per token at stride
    ``p_ts``), token ``j`` written to ``y[base + h * s_h + tok[j] * s_t:]``. The encoded
    payload is token, then head, so all heads at once read it in order; a head at a time reads
    it at a stride, which from memory the hardware prefetchers do not follow (one head:
    ``h_n = 1``). ``lo``, ``hi``: float32 scratch of ``h_n * D``."""
    if chan:
        for h in range(h_n):
            for d in range(d_n):
                lo[h * d_n + d] = _get_bf16(src, p_at + h * p_hs + 4 * d)
                hi[h * d_n + d] = _get_bf16(src, p_at + h * p_hs + 4 * d + 2)
    for j in range(nt):
        for h in range(h_n):
            _unpack(src, q_at + h * q_hs + j * q_ts, d_n, qb)
            o = base + h * s_h + tok[j] * s_t
            if chan:
                yv = y[o:o + d_n]
                lv = lo[h * d_n:(h + 1) * d_n]
                hv = hi[h * d_n:(h + 1) * d_n]
                for d in range(d_n):
                    st(yv, d, qb[d] * hv[d] + lv[d])
            else:
                for k in range(d_n // g):
                    at = p_at + h * p_hs + j * p_ts + 4 * k
                    m = _get_bf16(src, at)
                    sc = _get_bf16(src, at + 2)
                    qv = qb[k * g:(k + 1) * g]
                    yv = y[o + k * g:o + (k + 1) * g]
                    for d in range(g):
                        st(yv, d, qv[d] * sc + m)


@njit
def _zero_pads(out, oo, pads):
    for k in range(pads.shape[0]):
        out[oo + pads[k, 0]:oo + pads[k, 1]] = 0


@njit
def _enc8_chan_plane(buf, nt, d_n, out, q_at, q_ts, p_at, lo, hi, order, fb):
    """INT8 keys with a (min, scale) per channel over tokens ``1 .. nt - 1`` (token 0 is stored
    exact by the caller): token ``t``'s uint8 codes at ``q_at + t * q_ts``, channel ``d``'s
    bfloat16 pair at ``p_at + 4 d``. ``lo``, ``hi``: float32 [D] scratch. ``order`` (int64 [D])
    and ``fb`` (float32 [D, D]) of one head: codes chosen with error feedback
    (:func:`_feedback_codes`; ``buf``'s keys are consumed); an empty ``order``: each rounded to
    nearest."""
    _channel_params(buf, 1, nt, d_n, _F255, out, p_at, lo, hi)
    for t in range(1, nt):
        bv = buf[t * d_n:(t + 1) * d_n]
        ov = out[q_at + t * q_ts:q_at + t * q_ts + d_n]
        if order.shape[0]:
            _feedback_codes(bv, d_n, lo, hi, _F255, order, fb, ov)
            continue
        for d in range(d_n):
            if hi[d] > _F0:
                ov[d] = np.uint8(np.int32(min(max(np.rint((bv[d] - lo[d]) / hi[d]), _F0),
                                              _F255)))
            else:
                ov[d] = 0


@njit
def _feedback_codes(bv, d_n, lo, hi, levels, order, fb, qv):
    """One key vector ``bv`` (float32 [D], consumed) coded on the per-channel grids ``lo + c hi``
    (codes ``0 .. levels``) in the channel order ``order``, each rounding error fed into the
    channels through ``fb`` (:func:`ucm.reference.compress.round_keys`: the same operations in
    the same order, no fused multiply-adds), codes into ``qv`` (uint8 [D])."""
    for step in range(d_n):
        j = order[step]
        s = hi[j]
        c = min(max(np.rint((bv[j] - lo[j]) / s), _F0), levels) if s > _F0 else _F0
        qv[j] = np.uint8(np.int32(c))
        e = bv[j] - (c * s + lo[j])
        e = min(max(e, -_F128 * s), _F128 * s)
        fv = fb[j]
        for i in range(d_n):
            bv[i] = bv[i] - e * fv[i]


@njit
def _rows_from_plane(kf, y, base, t_n, d_n):
    """A token-major plane ``kf`` (float32 bits, T x D) written channel-major at ``y[base:]``:
    each channel's row is gathered from ``kf`` (in L1) and stored contiguously (storing token
    by token would scatter every store across the plane)."""
    for d in range(d_n):
        row = y[base + d * t_n:base + (d + 1) * t_n]
        for t in range(t_n):
            st(row, t, i2f(kf[t * d_n + d]))


# ---------------------------------------------------------------------------------------------
# key planes stored channel-major (KVShape.key_order "dt", vLLM-CPU): transposed around the
# kernels, which see token-major keys. A plane (T x D of one head) is contiguous (the order ends
# in "td") and small (<= 64 KiB for 128 x 128 float32): each moves through cache once.

@njit(nogil=True)
def _keys_to_token_major(x, rs, n, geo, out, ro):
    """``out`` rows (pitch ``ro`` = the raw row's elements) = ``x`` rows with every key plane
    [D, T] written as [T, D]."""
    t_n, h_n, d_n, s_k, s_h = geo[0], geo[1], geo[2], geo[3], geo[5]
    plane = t_n * d_n
    for i in range(n):
        out[i * ro:(i + 1) * ro] = x[i * rs:i * rs + ro]
        for h in range(h_n):
            src = x[i * rs + h * s_h:i * rs + h * s_h + plane]
            dst = out[i * ro + h * s_h:i * ro + h * s_h + plane]
            for d in range(d_n):
                for t in range(t_n):
                    dst[t * d_n + d] = src[d * t_n + t]


@njit(nogil=True)
def _keys_to_channel_major(y, yo, geo, scratch):
    """In place: every key plane [T, D] of the rows at ``y[yo[i]:]`` becomes [D, T]."""
    t_n, h_n, d_n, s_h = geo[0], geo[1], geo[2], geo[5]
    plane = t_n * d_n
    for i in range(yo.shape[0]):
        for h in range(h_n):
            p = y[yo[i] + h * s_h:yo[i] + h * s_h + plane]
            scratch[:plane] = p
            for t in range(t_n):
                for d in range(d_n):
                    p[d * t_n + t] = scratch[t * d_n + d]
