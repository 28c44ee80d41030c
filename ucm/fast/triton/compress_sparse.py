"""The sparse codec's first encode kernel (:func:`_sparse_select`), apart from the other codec
kernels of :mod:`ucm.fast.triton.compress_kernels` (whose constants, conventions and ``jit`` it
shares; see there and :mod:`ucm.fast.triton.compress`)."""
from __future__ import annotations

import triton.language as tl

from ucm.fast.triton.compress_kernels import _INF, _RINT, _SCALE, _TINY


def _sparse_select(raw, voff, vstride, idx, enc, enc_pitch8, flags, n_shards,
                   T: tl.constexpr, TP: tl.constexpr, H: tl.constexpr, HC: tl.constexpr,
                   D: tl.constexpr, HWP: tl.constexpr, L: tl.constexpr, E: tl.constexpr,
                   KQ: tl.constexpr, KP: tl.constexpr, BITMAP: tl.constexpr,
                   EXACT: tl.constexpr, C: tl.constexpr, CHANNEL: tl.constexpr,
                   INDEXED: tl.constexpr, ALIGN: tl.constexpr, DT: tl.constexpr,
                   LIMB: tl.constexpr):
    """Sparse codec, first kernel: shard ``program_id(0)`` (row ``s // L``, selected layer
    ``s % L``). The ``C`` salient tokens (token 0, then the ``C - 1`` others of largest ``max
    |K|`` over heads and channels, ties to the lower token: the reference's rule) into the
    bitmap, and their keys and values, in token order, into the exact rows; with ``CHANNEL``
    the other tokens' keys quantized per channel too (as in :func:`_int4_encode_channel`). The
    values, and keys per token, are :func:`_int4_encode_token`'s, launched next: it reads the
    bitmap.

    Tiles ``[tokens, HC heads x D / 2]`` of pair words (column ``h * HWP + w``), their
    offsets built per (token, head) from the tables and widened over the words (``ALIGN``: at
    most 2, the contiguity declared): the threads lie along the columns, two words each, the
    warps along the heads, and each thread holds all the tokens of its channels, so that the
    scores and every per-token quantity (selection, exact row ``epos``, quantized row ``rpos =
    t - epos``) stay in the thread, as do a channel's extremes over the tokens. A shard of more
    than ``HC`` heads is read in chunks of ``HC``, twice with ``CHANNEL`` (scores, then keys).

    Scores are maxima over the bits of ``|K|`` (non-negative floats order as their bits, and
    NaN's bits are above infinity's): the same order as the values, and a maximum at or above
    infinity's bits flags the shard. With ``C == 1`` the selection is token 0 whatever the
    scores, and only the shard's maximum is taken. Otherwise ``C - 1`` rounds after token 0,
    each taking the largest score not yet taken (the lowest such token) and counting it for
    every later token (``epos``). A channel's extremes leave the salient tokens out by
    multiplying them by NaN (the minima and maxima ignore NaN; ``x * 1`` is ``x``)."""
    s = tl.program_id(0).to(tl.int64)
    i = s // L
    k = s - i * L
    if INDEXED:
        blk = tl.load(idx + i)
    else:
        blk = i
    HW: tl.constexpr = D // 2
    NCH: tl.constexpr = (H + HC - 1) // HC
    t = tl.arange(0, TP)
    col = tl.arange(0, HC * HWP)
    hc = col // HWP
    w = col % HWP
    hv = tl.arange(0, HC)                   # heads and words of the [.., HC] table loads
    wv = tl.arange(0, HWP)
    # (masks are built from blocks only: the interpreter mishandles scalar & block)
    live = (t * 0 + blk) >= 0
    tm = (t < T) & live
    wm = (w < HW) & ((col * 0 + blk) >= 0)
    base = enc + i * (enc_pitch8 * 8) + k * E
    tab = k * (2 * T * H)
    # ---- scores (one salient token is token 0: then only the shard's largest |K| is needed,
    # for the flags)
    score = tl.zeros([TP], dtype=tl.int32)
    worst = tl.zeros([HC * HWP], dtype=tl.int32)
    for c1 in tl.static_range(NCH):
        h = c1 * HC + hc
        m2 = tm[:, None] & (wm & (h < H))[None, :]
        th = tm[:, None] & (c1 * HC + hv < H)[None, :]
        vk = tab + t[:, None] * H + (c1 * HC + hv)[None, :]                # [TP, HC]
        kb = (tl.multiple_of(tl.load(voff + vk, mask=th, other=0), [1, ALIGN])
              + blk * tl.multiple_of(tl.load(vstride + vk, mask=th, other=0), [1, ALIGN]))
        kb = tl.reshape(kb[:, :, None] + wv[None, None, :], [TP, HC * HWP])
        wk = tl.load(raw + tl.max_contiguous(tl.multiple_of(kb, [1, ALIGN]), [1, 2]), mask=m2,
                     other=0)
        if DT == 0:      # bfloat16 pairs in an int32
            ke = (wk << 16).to(tl.float32, bitcast=True)
            ko = (wk & -65536).to(tl.float32, bitcast=True)
        elif DT == 1:    # float16 pairs in an int32
            ke = (wk & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
            ko = (wk >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        else:            # float32 pairs in an int64
            ke = (wk & 0xFFFFFFFF).to(tl.int32).to(tl.float32, bitcast=True)
            ko = (wk >> 32).to(tl.int32).to(tl.float32, bitcast=True)
        a = tl.maximum(ke.to(tl.int32, bitcast=True) & 0x7FFFFFFF,
                       ko.to(tl.int32, bitcast=True) & 0x7FFFFFFF)
        if C == 1:
            worst = tl.maximum(worst, tl.max(a, axis=0))
        else:
            score = tl.maximum(score, tl.max(a, axis=1))
    if C == 1:
        top = tl.max(worst, axis=0)
    else:
        top = tl.max(score, axis=0)
    bad = (t * 0 + top) >= LIMB           # at or past the magnitude limit (NaN, inf too)
    tl.store(flags + s + t * 0, t * 0, mask=(t == 0) & live & bad)
    tl.store(flags + n_shards + t * 0, t * 0, mask=(t == 0) & live & bad)     # any bad
    # ---- selection: token 0 (the reference's rule), then C - 1 rounds
    sel = t == 0
    epos = (t > 0).to(tl.int32)
    for c in range(C - 1):
        cand = tl.where(tm & (sel == 0), score, -1)
        top = tl.max(cand, axis=0)
        pick = tl.min(tl.where(cand == top, t, TP), axis=0)
        sel = sel | (t == pick)
        epos += (t > pick).to(tl.int32)
    # the bitmap, in 8-byte words (with the segment's padding: bits past T are 0)
    b64 = (base + BITMAP).to(tl.pointer_type(tl.int64), bitcast=True)
    for j in tl.static_range((T + 63) // 64):
        word = tl.sum(tl.where(sel & ((t >> 6) == j), tl.full([TP], 1, tl.int64) << (t & 63), 0),
                      axis=0)
        tl.store(b64 + j + t * 0, word + t * 0, mask=(t == 0) & live)
    # ---- the exact rows: salient token c of the shard (in token order) is exact row c
    ex = (base + EXACT).to(tl.pointer_type(raw.dtype.element_ty), bitcast=True)
    kv = tl.arange(0, 2)
    for c in range(C):
        if C == 1:
            tc = 0
        else:
            tc = tl.sum(tl.where(sel & (epos == c), t, 0), axis=0)
        for ci in range(NCH):
            h = ci * HC + hc
            em = (kv < 2)[:, None] & (wm & (h < H))[None, :]
            eh = ((kv * 0 + blk) >= 0)[:, None] & (ci * HC + hv < H)[None, :]
            ve = tab + (kv[:, None] * T + tc) * H + (ci * HC + hv)[None, :]   # [2, HC]
            eb = (tl.multiple_of(tl.load(voff + ve, mask=eh, other=0), [1, ALIGN])
                  + blk * tl.multiple_of(tl.load(vstride + ve, mask=eh, other=0), [1, ALIGN]))
            eb = tl.reshape(eb[:, :, None] + wv[None, None, :], [2, HC * HWP])
            row = tl.load(raw + tl.max_contiguous(tl.multiple_of(eb, [1, ALIGN]), [1, 2]),
                          mask=em, other=0)
            tl.store(tl.max_contiguous(ex + ((c * 2 + kv)[:, None] * H + h[None, :]) * HW
                                       + w[None, :], [1, 2]), row, mask=em)
    if CHANNEL:
        # ---- the other tokens' keys, per channel over the tokens
        keep = tm & (sel == 0)
        rpos = t - epos
        # (a skipped row, index -1, stores nothing: its zeros are kept, not an all-NaN column)
        nan = tl.where(keep | (live == 0), 1.0, float("nan"))[:, None]
        for ci in range(NCH):
            h = ci * HC + hc
            hm = wm & (h < H)
            if NCH > 1:      # (read again; the one chunk of a smaller shard is still held)
                m2 = tm[:, None] & hm[None, :]
                th = tm[:, None] & (ci * HC + hv < H)[None, :]
                vk = tab + t[:, None] * H + (ci * HC + hv)[None, :]
                kb = (tl.multiple_of(tl.load(voff + vk, mask=th, other=0), [1, ALIGN])
                      + blk * tl.multiple_of(tl.load(vstride + vk, mask=th, other=0), [1, ALIGN]))
                kb = tl.reshape(kb[:, :, None] + wv[None, None, :], [TP, HC * HWP])
                wk = tl.load(raw + tl.max_contiguous(tl.multiple_of(kb, [1, ALIGN]), [1, 2]),
                             mask=m2, other=0)
                if DT == 0:
                    ke = (wk << 16).to(tl.float32, bitcast=True)
                    ko = (wk & -65536).to(tl.float32, bitcast=True)
                elif DT == 1:
                    ke = (wk & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
                    ko = (wk >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
                else:
                    ke = (wk & 0xFFFFFFFF).to(tl.int32).to(tl.float32, bitcast=True)
                    ko = (wk >> 32).to(tl.int32).to(tl.float32, bitcast=True)
            p32 = (base + KP).to(tl.pointer_type(tl.int32), bitcast=True) + h * D + 2 * w
            for half in tl.static_range(2):     # channels 2w, then 2w + 1
                if half == 0:
                    x = ke
                else:
                    x = ko
                xn = x * nan
                mn = tl.min(xn, axis=0) + 0.0           # a zero extreme counts as +0
                mx = tl.max(xn, axis=0) + 0.0
                b = mn.to(tl.int32, bitcast=True)
                hi = b & -65536
                mb = tl.where(((b & 0xFFFF) != 0) & (b < 0), hi + 0x10000, hi)
                m = mb.to(tl.float32, bitcast=True)
                b = tl.math.div_rn(mx - m, 15.0).to(tl.int32, bitcast=True)
                hi = b & -65536
                sb = tl.where((b & 0xFFFF) != 0, hi + 0x10000, hi)
                sc = sb.to(tl.float32, bitcast=True)
                f = tl.where((sc > 0) & (sc < _TINY), _SCALE, 1.0)
                sp = sc * f
                mp = m * f
                rp = 1.0 / tl.where(sp == 0, 1.0, sp)
                hs = tl.where(sp == 0, _INF, sp * 0.5)
                nu = tl.fma(x, f[None, :], -mp[None, :])
                kf = tl.floor(nu * rp[None, :])
                hh = tl.fma(kf, sp[None, :], hs[None, :])
                qb = (kf + _RINT).to(tl.int32, bitcast=True)
                q = qb + ((nu > hh) | ((nu == hh) & ((qb & 1) != 0))).to(tl.int32)
                # kp [H, D, 2] bf16: one int32 (min | scale << 16) per channel
                tl.store(p32 + half, ((mb >> 16) & 0xFFFF) | (sb & -65536), mask=hm)
                if half == 0:
                    qe = q
                else:
                    tl.store(tl.max_contiguous(base + KQ + (rpos[:, None] * H + h[None, :]) * HW
                                               + w[None, :], [1, 2]),
                             (qe + (q << 4)).to(tl.uint8), mask=keep[:, None] & hm[None, :])
