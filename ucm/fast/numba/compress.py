"""Numba KV codecs: the same contract and bytes as :mod:`ucm.reference.compress` (the rules are
in :mod:`ucm.compress`, the layout in :mod:`ucm.codecs`), one jitted call per batch (``nogil``).
The per-plane pieces are in :mod:`ucm.fast.numba._codec_planes`.

How it works:

* The rows are read and written in place through flat numpy views of the tensors (one 1-D array
  over all rows, a row stride in elements): raw rows as their element bits (``uint16``
  bfloat16, ``int16`` float16, ``uint32`` float32: the array's type picks the conversions at
  compile time), encoded rows as bytes. A raw tensor whose start or row stride is not a multiple
  of its element size goes through an aligned copy.
* Work goes one ``(kv, head)`` plane of ``T x D`` elements at a time, element offsets from the
  strides of ``shape.order`` (no permuted copy; a plane of ``"hktd"`` is contiguous): the plane is
  converted once to a float32 scratch buffer, then scales, quantization and packing read that.
* Every conversion is integer bit arithmetic (:mod:`ucm.fast.numba._elements`): bfloat16 ->
  float32 is ``bits << 16``; float16 -> float32 exact; float32 -> float16 / bfloat16 round to
  nearest even, as ``Tensor.to`` does. The arithmetic is float32 as in the reference (``/``
  correctly rounded, ``np.rint`` half to even; minima and maxima over integer keys of the
  floats, which vectorize), so integer payloads, scales and decoded bytes are bit-identical;
  the learned codec's products may round otherwise than the reference's BLAS products: the
  encode's (:func:`~ucm.fast.numba._elements.affine_rows`: register tiles of fused
  multiply-adds over the rank in order, the mean added last) and the decode's
  (:func:`~ucm.fast.numba._elements.affine_pairs`: bfloat16 coefficients times the basis
  rounded to bfloat16, two coefficients a step, by ``vdpbf16ps`` where the CPU has
  AVX512-BF16), and where the CPU has AVX512-BF16 subnormals flush (all within tolerance).
* A row with a NaN, an infinity or a value past :data:`ucm.codecs.MAGNITUDE_LIMIT` is encoded
  again as zeros (the reference zeroes it too), so even its bytes match; ``ok`` is False for it.
"""
from __future__ import annotations

import math
import threading

import numpy as np
import torch

from ucm.codecs import CodecSpec, KVShape, encoded_bytes, magnitude_limit, n_salient, offsets, rank
from ucm.fast.numba._codec_planes import (_dec4_planes, _enc4_plane, _enc8_chan_plane,
                                          _enc8_plane, _get_bf16, _keys_to_channel_major,
                                          _keys_to_token_major, _load_plane, _rows_from_plane,
                                          _zero_pads)
from ucm.fast.numba._amx import affine_tiles, tiles_fit, tiles_ready
from ucm.fast.numba._elements import affine_pairs, affine_rows, ld, mag, st
from ucm.fast.numba._jit import njit

# element bits of each cache dtype as the kernels see them (the type picks the conversions)
_BITS = {"bfloat16": np.uint16, "float16": np.int16, "float32": np.uint32}

_ESIZE = {"uint8": 1, "int8": 1, "bfloat16": 2, "float16": 2, "float32": 4}

# ---------------------------------------------------------------------------------------------
# kernels: one call per batch. ``geo`` = [T, H, D, stride of k, of t, of h] (elements);
# ``x`` / ``y`` the raw rows' elements (row stride ``rs``), ``out`` / ``src`` the encoded rows'
# bytes (row stride ``ro``). An encoder's row function returns whether the row held a NaN or an
# infinity (it may then stop early); the row is then encoded again as zeros.

@njit
def _row_q8(x, xb, xo, geo, chan, out, oo, offs, buf, tok, lo, hi, order, fb, lim, zero):
    """``offs`` = [q, per-token scales, (keys per channel:) key pairs, exact token 0].
    ``chan``: token 0's key and value copied exact from the raw bytes ``xb``, tokens 1..: keys
    with a (min, scale) per channel, values one scale per token. The keys' codes are chosen
    with ``order`` / ``fb`` ([H, D] / [H, D, D]) when ``order`` has channels, else ([1, 0])
    rounded to nearest (:func:`_enc8_chan_plane`). Without ``chan``: keys and values one scale
    per token."""
    t_n, h_n, d_n, s_k, s_t, s_h = geo[0], geo[1], geo[2], geo[3], geo[4], geo[5]
    es = x.itemsize
    q_off, s_off = offs[0], offs[1]
    tq = t_n - 1 if chan else t_n                          # tokens in each q plane
    for kv in range(2):
        for h in range(h_n):
            if _load_plane(x, xo + kv * s_k + h * s_h, tok, t_n, s_t, d_n, buf, zero, lim):
                return True
            if not chan:
                v = (kv * t_n) * h_n + h
                _enc8_plane(buf, t_n, d_n, out, oo + q_off + v * d_n, h_n * d_n,
                            oo + s_off + 2 * v, 2 * h_n)
                continue
            x0 = oo + offs[3] + (kv * h_n + h) * d_n * es
            if zero:
                out[x0:x0 + d_n * es] = 0
            else:
                at = (xo + kv * s_k + h * s_h) * es
                out[x0:x0 + d_n * es] = xb[at:at + d_n * es]
            # token t >= 1 of plane kv at q + ((kv * tq + t - 1) * H + h) * D
            q_at = oo + q_off + ((kv * tq - 1) * h_n + h) * d_n
            if kv == 0:
                _enc8_chan_plane(buf, t_n, d_n, out, q_at, h_n * d_n,
                                 oo + offs[2] + 4 * h * d_n, lo, hi, order[h % order.shape[0]],
                                 fb[h % fb.shape[0]])
            else:
                _enc8_plane(buf[d_n:], tq, d_n, out, q_at + h_n * d_n, h_n * d_n,
                            oo + s_off + 2 * h, 2 * h_n)
    return False


@njit(nogil=True)
def _encode_q8(x, xb, rs, geo, chan, out, ro, offs, pads, ok, buf, tok, lo, hi, order, fb, lim):
    """``lim``: the magnitude bits from which a shard is refused (:func:`_magnitude_bits`)."""
    for i in range(ok.shape[0]):
        bad = _row_q8(x, xb, i * rs, geo, chan, out, i * ro, offs, buf, tok, lo, hi, order, fb,
                      lim, False)
        if bad:
            _row_q8(x, xb, i * rs, geo, chan, out, i * ro, offs, buf, tok, lo, hi, order, fb,
                    lim, True)
        _zero_pads(out, i * ro, pads)
        ok[i] = not bad


@njit
def _planes4(x, xo, geo, g, chan, nt, out, oo, offs, buf, tok, lo, hi, qb, korder, kfb, lim,
             zero):
    """INT4 of tokens ``tok[:nt]`` of every plane (keys then values); keys per channel coded
    with ``korder`` / ``kfb`` as in :func:`_row_q8`; ``lim``: the refusal's magnitude bits."""
    h_n, d_n, s_k, s_t, s_h = geo[1], geo[2], geo[3], geo[4], geo[5]
    half = d_n // 2
    ng = d_n // g
    for kv in range(2):
        for h in range(h_n):
            if _load_plane(x, xo + kv * s_k + h * s_h, tok, nt, s_t, d_n, buf, zero, lim):
                return True
            c = chan and kv == 0
            p_at = oo + offs[2 + kv] + (4 * h * d_n if c else 4 * h * ng)
            _enc4_plane(buf, nt, d_n, g, c, out, oo + offs[kv] + h * half, h_n * half,
                        p_at, 4 * h_n * ng, lo, hi, qb, korder[h % korder.shape[0]],
                        kfb[h % kfb.shape[0]])
    return False


@njit(nogil=True)
def _encode_q4(x, rs, geo, g, chan, out, ro, offs, pads, ok, buf, tok, lo, hi, qb, korder, kfb,
               lim):
    """``offs`` = [kq, vq, kp, vp] byte offsets."""
    t_n = geo[0]
    for i in range(ok.shape[0]):
        bad = _planes4(x, i * rs, geo, g, chan, t_n, out, i * ro, offs, buf, tok, lo, hi, qb,
                       korder, kfb, lim, False)
        if bad:
            _planes4(x, i * rs, geo, g, chan, t_n, out, i * ro, offs, buf, tok, lo, hi, qb,
                     korder, kfb, lim, True)
        _zero_pads(out, i * ro, pads)
        ok[i] = not bad


@njit
def _row_sparse(x, xb, xo, geo, g, chan, n_exact, out, oo, offs, buf, tok, lo, hi, qb, keys,
                order, korder, kfb, lim, zero):
    t_n, h_n, d_n, s_k, s_t, s_h = geo[0], geo[1], geo[2], geo[3], geo[4], geo[5]
    es = x.itemsize
    limit_bits = lim
    # scores: max |K[t]| as magnitude bits (ordered as the values are); ties -> the lower
    # token: key = score << 32 | (2^32 - 1 - t), all distinct
    keys[:] = 0
    if not zero:
        for h in range(h_n):
            for t in range(t_n):
                o = xo + t * s_t + h * s_h
                xv = x[o:o + d_n]
                sc = np.int32(keys[t])
                for d in range(d_n):
                    sc = max(sc, mag(xv, d))
                keys[t] = sc
        worst = np.int64(0)
        for t in range(t_n):
            worst = max(worst, keys[t])
        if worst >= limit_bits:
            return True
    keys[0] = 0x7FFFFFFF                                    # token 0 first (the reference's rule)
    for t in range(t_n):
        keys[t] = (keys[t] << 32) | (0xFFFFFFFF - t)
        order[t] = keys[t]
    order.sort()
    cut = order[t_n - n_exact]                              # the n_exact largest keys
    bm = out[oo + offs[4]:oo + offs[4] + (t_n + 7) // 8]
    bm[:] = 0
    j = 0
    r = 0
    for t in range(t_n):
        if keys[t] < cut:
            tok[r] = t
            r += 1
            continue
        bm[t // 8] |= np.uint8(1 << (t % 8))
        for kv in range(2):
            for h in range(h_n):
                o = xo + kv * s_k + t * s_t + h * s_h
                at = oo + offs[5] + (((j * 2 + kv) * h_n + h) * d_n) * es
                ov = out[at:at + d_n * es]
                if zero:
                    ov[:] = 0
                    continue
                xv = x[o:o + d_n]
                worst = np.int32(0)
                for d in range(d_n):
                    worst = max(worst, mag(xv, d))
                if worst >= limit_bits:
                    return True
                ov[:] = xb[o * es:(o + d_n) * es]
        j += 1
    return _planes4(x, xo, geo, g, chan, t_n - n_exact, out, oo, offs, buf, tok, lo, hi, qb,
                    korder, kfb, lim, zero)


@njit(nogil=True)
def _encode_sparse(x, xb, rs, geo, g, chan, n_exact, out, ro, offs, pads, ok, buf, tok, lo, hi,
                   qb, keys, order, korder, kfb, lim):
    """``xb``: ``x``'s bytes; ``offs`` = [kq, vq, kp, vp, bitmap, exact] byte offsets; ``keys``,
    ``order``: int64 [T] scratch; ``korder``, ``kfb``, ``lim`` as :func:`_planes4`'s."""
    for i in range(ok.shape[0]):
        bad = _row_sparse(x, xb, i * rs, geo, g, chan, n_exact, out, i * ro, offs, buf, tok, lo,
                          hi, qb, keys, order, korder, kfb, lim, False)
        if bad:
            _row_sparse(x, xb, i * rs, geo, g, chan, n_exact, out, i * ro, offs, buf, tok, lo,
                        hi, qb, keys, order, korder, kfb, lim, True)
        _zero_pads(out, i * ro, pads)
        ok[i] = not bad


@njit
def _row_learned(x, xo, geo, mean, basis, out16, oo, c_off, buf, tok, zero_r, w, zero, lim):
    """One row's coefficients: per (kv, head), the tokens loaded as float32 rows less the mean,
    times the basis (:func:`affine_rows`), rounded to bfloat16 into ``out16`` (the encoded rows
    as 16-bit words; ``oo``, ``c_off`` in words). ``lim``: the refusal limit's magnitude bits
    (:func:`ucm.codecs.magnitude_limit`)."""
    t_n, h_n, d_n, s_k, s_t, s_h = geo[0], geo[1], geo[2], geo[3], geo[4], geo[5]
    r_n = basis.shape[3]
    for kv in range(2):
        for h in range(h_n):
            if _load_plane(x, xo + kv * s_k + h * s_h, tok, t_n, s_t, d_n, buf, zero, lim):
                return True
            mu = mean[kv, h]
            for t in range(t_n):
                bv = buf[t * d_n:(t + 1) * d_n]
                for d in range(d_n):
                    bv[d] -= mu[d]
            affine_rows(out16, oo + c_off + (kv * t_n * h_n + h) * r_n, h_n * r_n, buf, 0, d_n,
                        basis[kv, h], zero_r, t_n, d_n, r_n, w)
    return False


@njit(nogil=True)
def _encode_learned(x, rs, geo, mean, basis, out, out16, ro, c_off, pads, ok, buf, tok, zero_r,
                    w, lim):
    """``mean`` float32 [2, H, D], ``basis`` float32 [2, H, D, R]; coefficients bfloat16 at
    byte ``c_off`` of each row as [2, T, H, R]. ``out16``: ``out`` as 16-bit words (``ro`` and
    ``c_off`` even). Scratch: ``zero_r`` float32 zeros [R], ``w`` float32 [8 * D]."""
    for i in range(ok.shape[0]):
        bad = _row_learned(x, i * rs, geo, mean, basis, out16, i * ro // 2, c_off // 2, buf, tok,
                           zero_r, w, False, lim)
        if bad:
            _row_learned(x, i * rs, geo, mean, basis, out16, i * ro // 2, c_off // 2, buf, tok,
                         zero_r, w, True, lim)
        _zero_pads(out, i * ro, pads)
        ok[i] = not bad


@njit
def _q8_keys(src, qi, so, t_n, h_n, d_n, h0, h1, offs, chan, sc, ys, y, base, s_h, s_t):
    """Heads ``h0 .. h1 - 1``'s keys of one row decoded into ``y`` (head ``h``, token ``t`` at
    ``base + (h - h0) * s_h + t * s_t``, stored through :func:`st`: the cache's elements, or a
    float32 plane as uint32 bits), token by token across the heads: the int8 payload (token,
    then head) is then read in order, where a head at a time reads it at a stride of ``H * D``
    bytes, which from memory ran at less than half the rate (the hardware prefetchers do not
    follow it). With ``chan``, token 0's key is the exact one, read as ``ys``'s element type
    (``ys``: a D-element array of it, scratch), and the codes start at token 1; ``sc``:
    float32 scratch of 2 * H * D."""
    if chan:
        es = ys.itemsize
        for h in range(h0, h1):
            p_at = so + offs[2] + 4 * h * d_n
            for d in range(d_n):
                sc[2 * h * d_n + d] = _get_bf16(src, p_at + 4 * d + 2)          # scale
                sc[(2 * h + 1) * d_n + d] = _get_bf16(src, p_at + 4 * d)        # minimum
            _x0_row(src, so + offs[3] + h * d_n * es, ys, y, base + (h - h0) * s_h, d_n)
    first = 1 if chan else 0
    for t in range(first, t_n):
        for h in range(h0, h1):
            v = (t - first) * h_n + h
            q = so + offs[0] + v * d_n
            o = base + (h - h0) * s_h + t * s_t
            tv = y[o:o + d_n]
            if chan:
                qv = src[q:q + d_n]
                scv = sc[2 * h * d_n:(2 * h + 1) * d_n]
                mnv = sc[(2 * h + 1) * d_n:(2 * h + 2) * d_n]
                for d in range(d_n):
                    st(tv, d, np.float32(qv[d]) * scv[d] + mnv[d])
            else:
                qv = qi[q:q + d_n]
                s = _get_bf16(src, so + offs[1] + 2 * v)
                for d in range(d_n):
                    st(tv, d, np.float32(qv[d]) * s)


@njit
def _x0_row(src, at, ys, y, o, d_n):
    """An exact token-0 vector (the element type of ``ys``, a D-element scratch) at byte ``at``
    of ``src`` stored at ``y[o:]``."""
    es = ys.itemsize
    ys.view(np.uint8)[:] = src[at:at + d_n * es]
    tv = y[o:o + d_n]
    for d in range(d_n):
        st(tv, d, ld(ys, d))                                    # exact in either type


@njit(nogil=True)
def _decode_q8(src, so_, y, yo, geo, chan, offs, sc, kf, keys_dt):
    """Row ``i``: encoded at byte ``so_[i]`` of ``src``, decoded to element ``yo[i]`` of ``y``
    (the decode kernels all take such offsets, so they write into a staging row or straight into
    a block of the paged cache alike). Keys straight into the cache in the encoded order
    (token, then head: :func:`_q8_keys` over all heads), or with ``keys_dt`` a head at a time
    token-major into ``kf`` (float32 T x D scratch, in L1) and from there
    channel-major (element (t, d) at ``d * T + t`` of the plane) instead of transposing them
    afterwards; values in the encoded order too, so the int8 payload and the scales are read
    sequentially. ``sc``: float32 scratch of 2 * H * D."""
    t_n, h_n, d_n, s_k, s_t, s_h = geo[0], geo[1], geo[2], geo[3], geo[4], geo[5]
    qi = src.view(np.int8)
    ys = y[:d_n].copy()
    kb = kf.view(np.uint32)
    for i in range(so_.shape[0]):
        so = so_[i]
        if keys_dt:
            for h in range(h_n):
                _q8_keys(src, qi, so, t_n, h_n, d_n, h, h + 1, offs, chan, sc, ys, kb, 0, 0, d_n)
                _rows_from_plane(kb, y, yo[i] + h * s_h, t_n, d_n)
        else:
            _q8_keys(src, qi, so, t_n, h_n, d_n, 0, h_n, offs, chan, sc, ys, y, yo[i], s_h, s_t)
        first = 1 if chan else 0
        if chan:
            es = ys.itemsize
            for h in range(h_n):
                _x0_row(src, so + offs[3] + (h_n + h) * d_n * es, ys, y,
                        yo[i] + s_k + h * s_h, d_n)
        for t in range(first, t_n):
            for h in range(h_n):
                w = (t - first) * h_n + h                      # vector of the values' plane
                q = so + offs[0] + ((t_n - first) * h_n + w) * d_n
                qv = qi[q:q + d_n]
                o = yo[i] + s_k + h * s_h + t * s_t
                yv = y[o:o + d_n]
                s = _get_bf16(src, so + offs[1] + 2 * (w if chan else (t_n * h_n + w)))
                for d in range(d_n):
                    st(yv, d, np.float32(qv[d]) * s)


@njit(nogil=True)
def _decode_q4(src, so_, y, yo, geo, g, chan, offs, tok, lo, hi, qb, kf, keys_dt):
    """``keys_dt``: write key planes channel-major, each through ``kf`` (uint32 [T * D], a
    float32 plane's bits) decoded token-major."""
    t_n, h_n, d_n, s_k, s_t, s_h = geo[0], geo[1], geo[2], geo[3], geo[4], geo[5]
    half = d_n // 2
    ng = d_n // g
    for i in range(so_.shape[0]):
        so = so_[i]
        for kv in range(2):
            c = chan and kv == 0
            if keys_dt and kv == 0:
                for h in range(h_n):
                    p_at = so + offs[2 + kv] + (4 * h * d_n if c else 4 * h * ng)
                    _dec4_planes(src, t_n, d_n, g, c, kf, 0, 0, tok, d_n,
                                 so + offs[kv] + h * half, 0, h_n * half, p_at, 0,
                                 4 * h_n * ng, 1, lo, hi, qb)
                    _rows_from_plane(kf, y, yo[i] + h * s_h, t_n, d_n)
            else:
                _dec4_planes(src, t_n, d_n, g, c, y, yo[i] + kv * s_k, s_h, tok, s_t,
                             so + offs[kv], half, h_n * half, so + offs[2 + kv],
                             4 * d_n if c else 4 * ng, 4 * h_n * ng, h_n, lo, hi, qb)


@njit(nogil=True)
def _decode_sparse(src, so_, y, yb, yo, geo, g, chan, n_exact, offs, tok, exact, lo, hi, qb):
    """``yb``: ``y``'s bytes. Returns -1, or the first row whose bitmap does not mark
    ``n_exact`` tokens."""
    t_n, h_n, d_n, s_k, s_t, s_h = geo[0], geo[1], geo[2], geo[3], geo[4], geo[5]
    half = d_n // 2
    ng = d_n // g
    es = y.itemsize
    n_rest = t_n - n_exact
    for i in range(so_.shape[0]):
        so = so_[i]
        bm = src[so + offs[4]:so + offs[4] + (t_n + 7) // 8]
        j = 0
        r = 0
        for t in range(t_n):
            if (bm[t // 8] >> (t % 8)) & 1:
                if j < n_exact:
                    exact[j] = t
                j += 1
            else:
                if r < n_rest:
                    tok[r] = t
                r += 1
        if j != n_exact:
            return i
        for kv in range(2):
            for h in range(h_n):
                base = yo[i] + kv * s_k + h * s_h
                for j in range(n_exact):
                    at = so + offs[5] + (((j * 2 + kv) * h_n + h) * d_n) * es
                    o = (base + exact[j] * s_t) * es
                    yb[o:o + d_n * es] = src[at:at + d_n * es]
            c = chan and kv == 0
            _dec4_planes(src, n_rest, d_n, g, c, y, yo[i] + kv * s_k, s_h, tok, s_t,
                         so + offs[kv], half, h_n * half, so + offs[2 + kv],
                         4 * d_n if c else 4 * ng, 4 * h_n * ng, h_n, lo, hi, qb)
    return -1


@njit(nogil=True)
def _affine_head(y, yi, ys, src, at, pitch, tiles, pairs, basis_t, mean, t_n, d_n, w):
    """One head's ``t_n`` tokens of the learned decode into rows ``yi + n * ys`` of ``y``: the
    coefficients at byte ``at`` of ``src`` (``pitch`` bytes apart) times the basis, plus the
    mean. Through :func:`affine_tiles` for the tokens in whole groups of 16 where ``tiles`` is
    given, :func:`affine_pairs` for the rest where ``pairs`` is, else :func:`affine_rows`."""
    r_n = basis_t.shape[0]
    if pairs.shape[0] == 0:
        affine_rows(y, yi, ys, src, at, pitch, basis_t, mean, t_n, r_n, d_n, w)
        return
    done = 0
    if tiles.shape[0] > 0:
        affine_tiles(y, yi, ys, src, at, pitch, tiles, mean, t_n, r_n, d_n)
        done = t_n - t_n % 16
    affine_pairs(y, yi + done * ys, ys, src, at + done * pitch, pitch, pairs, mean, t_n - done,
                 r_n, d_n)


@njit(nogil=True)
def _decode_learned(src, so_, y, yo, geo, mean, basis_t, pairs, tiles, c_off, plane, w, keys_dt):
    """``basis_t`` float32 [2, H, R, D] (the basis transposed, rounded to bfloat16 as the
    reference decodes with it); ``pairs`` the same as bfloat16 pairs [2, H, R / 2, D]
    (:func:`affine_pairs`), or [2, H, 0, D] where the rank is odd or D not a multiple of 16;
    ``tiles`` the pairs in the tile order (:func:`affine_tiles`), or [2, H, 0, D] where the
    tiles do not run. Each head's tokens are one :func:`_affine_head` call (``w``: float32
    scratch of 8 * R): coefficients times the basis, plus the mean, rounded into ``y``; with
    ``keys_dt`` the key planes go through ``plane`` (float32 scratch [T * D]) and are written
    channel-major."""
    t_n, h_n, d_n, s_k, s_t, s_h = geo[0], geo[1], geo[2], geo[3], geo[4], geo[5]
    r_n = basis_t.shape[2]
    pitch = 2 * h_n * r_n                                  # bytes from a token's coefficients
    for i in range(so_.shape[0]):                          # to the next token's
        so = so_[i]
        for kv in range(2):
            for h in range(h_n):
                base = yo[i] + kv * s_k + h * s_h
                at = so + c_off + 2 * ((kv * t_n * h_n + h) * r_n)
                if keys_dt and kv == 0:
                    _affine_head(plane, 0, d_n, src, at, pitch, tiles[kv, h], pairs[kv, h],
                                 basis_t[kv, h], mean[kv, h], t_n, d_n, w)
                    _rows_from_plane(plane.view(np.uint32), y, base, t_n, d_n)
                else:
                    _affine_head(y, base, s_t, src, at, pitch, tiles[kv, h], pairs[kv, h],
                                 basis_t[kv, h], mean[kv, h], t_n, d_n, w)


_LEARNED_DECODE = {}      # (spec, shape, layer, projection digest) -> _learned_decode_constants


def _learned_decode_constants(spec: CodecSpec, shape: KVShape, layer: int):
    """(mean [2, H, D], basis transposed [2, H, R, D] and rounded to bfloat16, the same as
    bfloat16 pairs for :func:`affine_pairs` (or empty), and in the tile order for
    :func:`affine_tiles` (or empty), byte offset of the coefficients) of a
    layer's learned decode, made once per projection version and kept (a few hundred entries
    at most, then started again): the transposed copy and the offsets are Python steps, which
    after other work has evicted their data from the caches cost as much as decoding a few
    shards. Keyed by the projection's digest too: ``CodecSpec`` compares without its
    projection. Read-only: the decode's scratch is made per call."""
    key = (spec, shape, layer, spec.projection.digest)
    got = _LEARNED_DECODE.get(key)
    if got is None:
        if len(_LEARNED_DECODE) >= 512:
            _LEARNED_DECODE.clear()
        mean, basis_t, _ = _projection(spec, shape, layer, transposed=True)
        bits = torch.from_numpy(basis_t).to(torch.bfloat16).view(torch.int16).numpy()
        bits = bits.astype(np.uint16).astype(np.uint32)           # [2, H, R, D]
        basis_t = (bits << 16).view(np.float32)                   # the basis the decode uses
        r_n, d_n = basis_t.shape[2], basis_t.shape[3]
        if r_n % 2 == 0 and d_n % 16 == 0:
            pairs = np.ascontiguousarray((bits[:, :, 0::2] << 16) | bits[:, :, 1::2])
        else:
            pairs = np.zeros(basis_t.shape[:2] + (0, d_n), np.uint32)
        # tiles for 16-bit caches only: their sums round differently from the pairs' (within
        # a float32 rounding step per term), which rounding to bfloat16 / float16 hides and a
        # float32 cache would show; a float32 decode is bound by its writes anyway
        if shape.dtype != "float32" and tiles_fit(r_n, d_n) and tiles_ready():
            tiles = np.ascontiguousarray((bits[:, :, 1::2] << 16) | bits[:, :, 0::2])
        else:
            tiles = np.zeros(basis_t.shape[:2] + (0, d_n), np.uint32)
        got = _LEARNED_DECODE[key] = (mean, np.ascontiguousarray(basis_t), pairs, tiles,
                                      int(_at(spec, shape, "coef")[0]))
    return got


# ---------------------------------------------------------------------------------------------
# the ops

_local = threading.local()


def _scratch(nbytes: int) -> np.ndarray:
    """This thread's reusable uint8 buffer of at least ``nbytes`` (fresh pages cost more than
    the transposition they would hold: reuse them)."""
    buf = getattr(_local, "buf", None)
    if buf is None or buf.nbytes < nbytes:
        buf = _local.buf = np.empty(max(nbytes, 1 << 20), dtype=np.uint8)
    return buf[:nbytes]


def _geometry(shape: KVShape) -> np.ndarray:
    sizes = shape.sizes()
    stride, strides = 1, {}
    for c in reversed(shape.order):
        strides[c] = stride
        stride *= sizes[c]
    return np.array([shape.tokens, shape.heads, shape.head_dim, strides["k"], strides["t"],
                     strides["h"]], dtype=np.int64)


def _flat(t: torch.Tensor, width: int, dtype):
    """``(1-D array of dtype over every row, row stride in elements)`` sharing ``t``'s memory
    (uint8 ``[n, width]``, rows of contiguous bytes), or None when ``t``'s start or row stride
    is not a multiple of the element size."""
    n = t.shape[0]
    rs = t.stride(0) if n > 1 else width
    es = np.dtype(dtype).itemsize
    if rs % es or t.data_ptr() % es:
        return None
    span = (n - 1) * rs + width
    flat = torch.as_strided(t, (span,), (1,), t.storage_offset()).numpy()
    return flat.view(dtype), rs // es


def _pads(spec: CodecSpec, shape: KVShape) -> np.ndarray:
    """Byte ranges ``[start, end)`` of an encoded row that no segment covers (zero padding)."""
    out = []
    for at, dt, shp in offsets(spec, shape).values():
        size = math.prod(shp) * _ESIZE[dt]
        end = -(-size // 8) * 8
        if end > size:
            out.append((at + size, at + end))
    return np.array(out, dtype=np.int64).reshape(-1, 2)


def _at(spec, shape, *names) -> np.ndarray:
    offs = offsets(spec, shape)
    return np.array([offs[name][0] for name in names], dtype=np.int64)


def _q8_at(spec, shape) -> np.ndarray:
    """INT8 offsets [q, per-token scales, per-channel key pairs, exact keys] (0 without)."""
    if spec.key_mode == "channel":
        return _at(spec, shape, "q", "vscale", "kp", "x0")
    return np.append(_at(spec, shape, "q", "scale"), [0, 0])


def _magnitude_bits(lim: float, dtype: str) -> np.int32:
    """A power-of-two limit's magnitude bits in the element type (as :func:`mag` reads them)."""
    e = int(math.log2(lim))
    if dtype == "float16":
        return np.int32((e + 15) << 10) if e >= -14 else np.int32(1 << (e + 24))
    if dtype == "bfloat16":
        return np.int32((e + 127) << 7)
    return np.int32((e + 127) << 23)


def _rounding(spec: CodecSpec, shape: KVShape, layer: int):
    """(order int64 [H, D], feedback float32 [H, D, D]) of the key rounding of this layer, or
    ([1, 0], [1, 1, 1]): keys rounded to nearest."""
    if not spec.rounds_keys:        # (shape and layer checked by ucm.compress before dispatch)
        return np.zeros((1, 0), np.int64), np.zeros((1, 1, 1), np.float32)
    return spec.rounding.order[layer], spec.rounding.feedback[layer]


def _projection(spec: CodecSpec, shape: KVShape, layer: int, transposed: bool):
    """(mean [2, H, D], the basis [2, H, D, R] or transposed [2, H, R, D], rank), float32."""
    p = spec.projection
    r = rank(spec, shape)
    mean = np.ascontiguousarray(p.means[layer], dtype=np.float32)
    basis = p.bases[layer][..., :r]
    basis = np.ascontiguousarray(basis.transpose(0, 1, 3, 2) if transposed else basis,
                                 dtype=np.float32)
    return mean, basis, r


def encode(spec: CodecSpec, shape: KVShape, src: torch.Tensor, dst: torch.Tensor,
           layer: int) -> np.ndarray:
    """Same contract as :func:`ucm.reference.compress.encode` (CPU tensors)."""
    spec = spec.for_shape(shape)
    n = src.shape[0]
    t_n, d_n = shape.tokens, shape.head_dim
    bits = _BITS[shape.dtype]
    raw = _flat(src, shape.raw_bytes, bits)
    if raw is None:                                    # unaligned elements: an aligned copy
        aligned = torch.empty((n, shape.raw_bytes), dtype=torch.uint8)
        aligned.copy_(src)
        raw = _flat(aligned, shape.raw_bytes, bits)
    x, rs = raw
    geo = _geometry(shape)
    if shape.key_order == "dt":                        # token-major keys in a copy
        width = shape.raw_bytes // shape.esize
        tm = _scratch(n * width * shape.esize).view(bits)
        _keys_to_token_major(x, rs, n, geo, tm, width)
        x, rs = tm, width
    out, ro = _flat(dst, dst.shape[1], np.uint8)
    pads = _pads(spec, shape)
    ok = np.empty(n, dtype=bool)
    buf = np.empty(t_n * d_n, dtype=np.float32)
    tok = np.arange(t_n, dtype=np.int64)
    order, fb = _rounding(spec, shape, layer)
    lim = _magnitude_bits(magnitude_limit(spec, shape, layer), shape.dtype)
    if spec.int8:
        _encode_q8(x, x.view(np.uint8), rs, geo, spec.key_mode == "channel", out, ro,
                   _q8_at(spec, shape), pads, ok, buf, tok, np.empty(d_n, np.float32),
                   np.empty(d_n, np.float32), order, fb, lim)
    elif spec.method == "quantize":
        lo, hi = np.empty(d_n, np.float32), np.empty(d_n, np.float32)
        _encode_q4(x, rs, geo, spec.group, spec.key_mode == "channel", out, ro,
                   _at(spec, shape, "kq", "vq", "kp", "vp"), pads, ok, buf, tok, lo, hi,
                   np.empty(d_n, np.uint8), order, fb, lim)
    elif spec.method == "sparse":
        lo, hi = np.empty(d_n, np.float32), np.empty(d_n, np.float32)
        _encode_sparse(x, x.view(np.uint8), rs, geo, spec.group, spec.key_mode == "channel",
                       n_salient(spec, shape), out, ro,
                       _at(spec, shape, "kq", "vq", "kp", "vp", "bitmap", "exact"), pads, ok,
                       buf, np.empty(t_n, np.int64), lo, hi, np.empty(d_n, np.uint8),
                       np.empty(t_n, np.int64), np.empty(t_n, np.int64), order, fb, lim)
    else:
        mean, basis, r = _projection(spec, shape, layer, transposed=False)
        c_off = int(_at(spec, shape, "coef")[0])
        if ro % 2 or out.ctypes.data % 2:              # 16-bit words need even rows: a copy
            aligned = torch.empty((n, dst.shape[1]), dtype=torch.uint8)
            ok = encode(spec, shape, src, aligned, layer)
            dst.copy_(aligned)
            return ok
        _encode_learned(x, rs, geo, mean, basis, out, out.view(np.uint16), ro, c_off, pads, ok,
                        buf, tok, np.zeros(r, np.float32), np.empty(8 * d_n, np.float32),
                        _magnitude_bits(magnitude_limit(spec, shape, layer), shape.dtype))
    return ok


def _decode_rows(spec: CodecSpec, shape: KVShape, enc: np.ndarray, so: np.ndarray,
                 y: np.ndarray, yo: np.ndarray, layer: int) -> None:
    """Decode the encoded rows at bytes ``so`` of ``enc`` into the raw rows at elements ``yo``
    of ``y`` (``y`` of the element bits of ``shape.dtype``)."""
    _row_decoder(spec, shape, layer)(enc, so, y, yo)


def _row_decoder(spec: CodecSpec, shape: KVShape, layer: int):
    """:func:`_decode_rows` of one layer as ``f(enc, so, y, yo)``, its constants and scratch
    bound once (one numba call, plus the key-plane turn of token-major decodes, per call)."""
    t_n, d_n = shape.tokens, shape.head_dim
    geo = _geometry(shape)
    dt = shape.key_order == "dt"
    if spec.int8:
        args = (geo, spec.key_mode == "channel", _q8_at(spec, shape),
                np.empty(2 * d_n * shape.heads, np.float32), np.empty(t_n * d_n, np.float32), dt)
        return lambda enc, so, y, yo: _decode_q8(enc, so, y, yo, *args)
    if spec.method == "quantize":                      # (writes channel-major keys itself)
        args = (geo, spec.group, spec.key_mode == "channel",
                _at(spec, shape, "kq", "vq", "kp", "vp"), np.arange(t_n, dtype=np.int64),
                np.empty(d_n * shape.heads, np.float32), np.empty(d_n * shape.heads, np.float32),
                np.empty(d_n, np.float32), np.empty(t_n * d_n, np.uint32), dt)
        return lambda enc, so, y, yo: _decode_q4(enc, so, y, yo, *args)
    turn = np.empty(t_n * d_n, dtype=_BITS[shape.dtype])
    if spec.method == "sparse":
        c = n_salient(spec, shape)
        args = (geo, spec.group, spec.key_mode == "channel", c,
                _at(spec, shape, "kq", "vq", "kp", "vp", "bitmap", "exact"),
                np.empty(t_n, np.int64), np.empty(c, np.int64),
                np.empty(d_n * shape.heads, np.float32), np.empty(d_n * shape.heads, np.float32),
                np.empty(d_n, np.float32))

        def run(enc, so, y, yo):
            bad = _decode_sparse(enc, so, y, y.view(np.uint8), yo, *args)
            if bad >= 0:
                raise ValueError(f"decode: row {bad}: its bitmap does not mark {c} exact tokens "
                                 f"(not a sparse shard of this codec)")
            if dt:                                     # decoded token-major: turn key planes
                _keys_to_channel_major(y, yo, geo, turn)
        return run
    mean, basis_t, pairs, tiles, c_off = _learned_decode_constants(spec, shape, layer)
    args = (geo, mean, basis_t, pairs, tiles, c_off, np.empty(t_n * d_n, np.float32),
            np.empty(8 * basis_t.shape[2], np.float32), dt)
    return lambda enc, so, y, yo: _decode_learned(enc, so, y, yo, *args)


def decode(spec: CodecSpec, shape: KVShape, src: torch.Tensor, dst: torch.Tensor,
           layer: int) -> None:
    """Same contract as :func:`ucm.reference.compress.decode` (CPU tensors)."""
    spec = spec.for_shape(shape)
    n = src.shape[0]
    bits = _BITS[shape.dtype]
    target = dst
    raw = _flat(dst, shape.raw_bytes, bits)
    if raw is None:                                    # unaligned elements: through a copy
        target = torch.empty((n, shape.raw_bytes), dtype=torch.uint8)
        raw = _flat(target, shape.raw_bytes, bits)
    y, rs = raw
    enc, ro = _flat(src, src.shape[1], np.uint8)
    rows = np.arange(n, dtype=np.int64)
    _decode_rows(spec, shape, enc, rows * ro, y, rows * rs, layer)
    if target is not dst:
        dst.copy_(target)


def decode_scatter(layout, src: torch.Tensor, block_indices: torch.Tensor, spec: CodecSpec,
                   shape: KVShape, layers: tuple) -> None:
    """Same contract as :func:`ucm.reference.compress_transfer.decode_scatter` (CPU tensors):
    where a selected layer's block is one contiguous run of its view (vLLM-CPU's cache), each
    row decodes straight into the block, so the decoded KV is written once, into the cache;
    other layouts decode into a staging row and scatter it."""
    run = layer_decoder(layout, src, block_indices, spec, shape, layers)
    for k in range(len(layers)):
        run(k)


def layer_decoder(layout, src: torch.Tensor, block_indices: torch.Tensor, spec: CodecSpec,
                  shape: KVShape, layers: tuple):
    """:func:`decode_scatter` prepared for a decode a layer at a time: ``f(k)`` decodes shard
    ``k`` of ``src`` into layer ``layers[k]``. Every array, offset and scratch buffer is made
    here, so a call is one numba decode with the GIL released (or the staging path) and no
    other Python work on tensors: a load thread that decodes beside the forward takes the GIL
    once per layer, where each take can wait up to the interpreter's switch interval."""
    spec = spec.for_shape(shape)
    from ucm.layout import COL_BASE, COL_BLOCK_STRIDE, COL_LENGTH, COL_OFFSET, COL_VIEW
    from ucm.reference import transfer as ref_transfer

    good = np.flatnonzero(block_indices.numpy() >= 0)
    if not len(good):
        return lambda k: None
    blocks = block_indices.numpy()[good]
    enc, ro = _flat(src, src.shape[1], np.uint8)
    E, es = encoded_bytes(spec, shape), shape.esize
    steps = []
    for k, layer in enumerate(layers):
        so = good * ro + k * E
        dec = _row_decoder(spec, shape, layer)
        tab = layout.table(layer)
        view = layout.views[int(tab[0, COL_VIEW])] if len(tab) == 1 else None
        if view is None or (int(tab[0, COL_BASE]) + int(tab[0, COL_OFFSET])) % es \
                or int(tab[0, COL_BLOCK_STRIDE]) % es or int(tab[0, COL_LENGTH]) != shape.raw_bytes:
            def staged(so=so, dec=dec, layer=layer):
                staging = torch.empty((len(good), shape.raw_bytes), dtype=torch.uint8)
                y, rs = _flat(staging, shape.raw_bytes, _BITS[shape.dtype])
                dec(enc, so, y, np.arange(len(good), dtype=np.int64) * rs)
                ref_transfer.scatter_blocks(layout, staging, torch.from_numpy(blocks), (layer,))
            steps.append(staged)
            continue
        # the view's memory as one flat array; row i's block at block * stride + the run's offset
        stride, off = int(tab[0, COL_BLOCK_STRIDE]), int(tab[0, COL_OFFSET])
        y = _view_bytes(view, (layout.num_blocks - 1) * stride + off + shape.raw_bytes)
        steps.append(lambda so=so, dec=dec, y=y.view(_BITS[shape.dtype]),
                     yo=(blocks * stride + off) // es: dec(enc, so, y, yo))
    return lambda k: steps[k]()


def _view_bytes(view: torch.Tensor, span: int) -> np.ndarray:
    """The ``span`` bytes of memory from ``view``'s first element on, as a flat uint8 array
    (whatever the view's strides)."""
    storage = view.untyped_storage()
    at = view.data_ptr() - storage.data_ptr()
    if at < 0 or at + span > storage.nbytes():
        raise ValueError(f"decode_scatter: {span} bytes from the view's start leave its storage")
    flat = torch.empty(0, dtype=torch.uint8).set_(storage, at, (span,), (1,))
    return flat.numpy()
