"""The kernels of :mod:`ucm.fast.triton.compress` (see there for the addressing and the
formats). No jitted helpers: :func:`jit` makes each kernel with ``triton.jit`` on first use,
per mode (``TRITON_INTERPRET`` is read by ``triton.jit`` when it decorates).

Two operations are written by hand rather than with Triton's casts, identically natively and
under the interpreter (whose bfloat16 casts lose subnormals and do not round to nearest even):
bfloat16 -> float32 by the bits (``b << 16``), float32 -> bfloat16 rounding to nearest even
(``(b + 0x7FFF + lsb) >> 16``). ``rint`` is ``(y + 1.5 * 2**23) - 1.5 * 2**23``, exact for
``|y| < 2**22`` (every quotient here is within [-128, 16]).
"""
from __future__ import annotations

import triton
import triton.language as tl

from ucm.fast.triton import interpreting

_INF = tl.constexpr(float("inf"))
#: 1.5 * 2**23: for |y| < 2**22, (y + RINT) - RINT is y rounded to an integer, ties to even
#: (float32 additions round to nearest even; nothing reassociates them).
_RINT = tl.constexpr(12582912.0)
#: The quantizers without a division (_int8c_encode, _int4_encode_token, _int4_encode_channel):
#: groups whose scale is below _TINY are quantized with x, m and s scaled by _SCALE (exact, a
#: power of two; see _int4_encode_token).
_TINY = tl.constexpr(2.0 ** -100)
_SCALE = tl.constexpr(2.0 ** 64)


def _int8_encode(raw, voff, vstride, idx, enc, enc_pitch8, flags, pad, n_vectors, n_shards,
                 V: tl.constexpr, V0: tl.constexpr, VN: tl.constexpr, QV: tl.constexpr,
                 L: tl.constexpr, D: tl.constexpr, DP: tl.constexpr, E: tl.constexpr,
                 SCALE: tl.constexpr,
                 NPAD: tl.constexpr, NPADP: tl.constexpr, BV: tl.constexpr,
                 INDEXED: tl.constexpr, ALIGN: tl.constexpr, BF16: tl.constexpr,
                 LIMB: tl.constexpr):
    """Each vector ``v`` in ``[V0, V0 + VN)`` of every shard quantized by its own symmetric
    scale (the per-token INT8 rule), its codes at vector ``QV + v - V0`` of ``q``, its scale at
    ``SCALE + 2 (v - V0)``: every vector for INT8 with keys per token (``V0 = QV = 0``, ``VN =
    V``), the values of tokens 1.. for keys per channel (``V0 = (T + 1) H``, ``VN = QV = (T -
    1) H``). Program ``pid`` takes the call's vectors ``[pid * BV, pid * BV + BV)`` (vector ``g``
    = shard ``g // VN``, its vector ``V0 + g % VN``; shard ``s`` = row ``s // L``, selected layer
    ``s % L``)."""
    g = tl.program_id(0).to(tl.int64) * BV + tl.arange(0, BV)
    live = g < n_vectors
    s = g // VN
    v = V0 + (g - s * VN)
    i = s // L
    k = s - i * L
    if INDEXED:
        blk = tl.load(idx + i, mask=live, other=-1)
        live = live & (blk >= 0)
    else:
        blk = i
    tab = k * V + v
    off = tl.multiple_of(tl.load(voff + tab, mask=live, other=0), ALIGN)
    bst = tl.multiple_of(tl.load(vstride + tab, mask=live, other=0), ALIGN)
    d = tl.arange(0, DP)
    m2 = live[:, None] & (d < D)[None, :]
    if BF16:    # bfloat16 -> float32 by its bits (the interpreter's cast loses subnormals)
        xb = tl.load(raw.to(tl.pointer_type(tl.int16), bitcast=True) + (off + blk * bst)[:, None]
                     + d[None, :], mask=m2, other=0)
        x = (xb.to(tl.int32) << 16).to(tl.float32, bitcast=True)
    else:
        x = tl.load(raw + (off + blk * bst)[:, None] + d[None, :], mask=m2, other=0.0).to(tl.float32)
    a = tl.abs(x)
    # refused: |x| at or past the limit (LIMB: its float32 bits; NaN's bits are above them)
    bad = tl.max(tl.where(a.to(tl.int32, bitcast=True) < LIMB, 0, 1), axis=1)
    tl.store(flags + s, tl.zeros_like(bad), mask=live & (bad > 0))
    tl.store(flags + n_shards + s * 0, tl.zeros_like(bad), mask=live & (bad > 0))   # any bad
    amax = tl.max(a, axis=1)
    # s = bf16_up(amax / 127)
    bits = tl.math.div_rn(amax, 127.0).to(tl.int32, bitcast=True)
    hi = bits & -65536
    bits = tl.where((bits & 0xFFFF) != 0, hi + 0x10000, hi)
    sc = bits.to(tl.float32, bitcast=True)
    # s == 0 (a zero vector) divides by 1 instead (q is 0 there anyway): a zero divisor takes
    # the division's slow path. (Zero elements are left alone here: rare in KV, and the test
    # costs more than it saves; the INT4 kernels, where each group's minimum gives one, test.)
    den = tl.where(sc == 0, 1.0, sc)
    y = tl.math.div_rn(x, den[:, None])
    r = (y + _RINT) - _RINT
    q = tl.where(sc[:, None] > 0, tl.minimum(tl.maximum(r, -127.0), 127.0), 0.0).to(tl.int32)
    base = enc + i * (enc_pitch8 * 8) + k * E
    tl.store(base[:, None] + ((QV + v - V0) * D)[:, None] + d[None, :],
             q.to(tl.int8).to(tl.uint8, bitcast=True), mask=m2)
    b16 = bits >> 16
    tl.store(base + SCALE + 2 * (v - V0), (b16 & 255).to(tl.uint8), mask=live)
    tl.store(base + SCALE + 2 * (v - V0) + 1, ((b16 >> 8) & 255).to(tl.uint8), mask=live)
    if NPAD > 0:
        j = tl.arange(0, NPADP)
        po = tl.load(pad + j, mask=j < NPAD, other=0)
        tl.store(base[:, None] + po[None, :], tl.zeros([BV, NPADP], dtype=tl.uint8),
                 mask=(live & (v == V0))[:, None] & (j < NPAD)[None, :])


def _int8_decode(raw, voff, vstride, idx, enc, enc_pitch8, n_vectors,
                 V: tl.constexpr, L: tl.constexpr, D: tl.constexpr, DP: tl.constexpr,
                 E: tl.constexpr, SCALE: tl.constexpr, BV: tl.constexpr, INDEXED: tl.constexpr,
                 ALIGN: tl.constexpr, BF16: tl.constexpr):
    g = tl.program_id(0).to(tl.int64) * BV + tl.arange(0, BV)
    live = g < n_vectors
    s = g // V
    v = g - s * V
    i = s // L
    k = s - i * L
    if INDEXED:
        blk = tl.load(idx + i, mask=live, other=-1)
        live = live & (blk >= 0)
    else:
        blk = i
    tab = k * V + v
    off = tl.multiple_of(tl.load(voff + tab, mask=live, other=0), ALIGN)
    bst = tl.multiple_of(tl.load(vstride + tab, mask=live, other=0), ALIGN)
    d = tl.arange(0, DP)
    m2 = live[:, None] & (d < D)[None, :]
    base = enc + i * (enc_pitch8 * 8) + k * E
    q = tl.load(base[:, None] + (v * D)[:, None] + d[None, :], mask=m2, other=0)
    q = q.to(tl.int8, bitcast=True).to(tl.float32)
    lo = tl.load(base + SCALE + 2 * v, mask=live, other=0).to(tl.int32)
    hi = tl.load(base + SCALE + 2 * v + 1, mask=live, other=0).to(tl.int32)
    sc = ((lo | (hi << 8)) << 16).to(tl.float32, bitcast=True)
    x = q * sc[:, None]
    if BF16:
        _b = x.to(tl.int32, bitcast=True)
        out = ((_b + 0x7FFF + ((_b >> 16) & 1)) >> 16).to(tl.int16).to(tl.bfloat16, bitcast=True)   # RNE (the interpreter's own cast is not)
    else:
        out = x.to(raw.dtype.element_ty)
    tl.store(raw + (off + blk * bst)[:, None] + d[None, :], out, mask=m2)


def _int4_encode_token(raw, voff, vstride, idx, enc, enc_pitch8, flags, pad, n_shards,
                       T: tl.constexpr, TP: tl.constexpr, H: tl.constexpr, HP: tl.constexpr,
                       D: tl.constexpr, NG: tl.constexpr, NGP: tl.constexpr,
                       GH: tl.constexpr, L: tl.constexpr, E: tl.constexpr, KQ: tl.constexpr,
                       VQ: tl.constexpr, KP: tl.constexpr, VP: tl.constexpr,
                       BITMAP: tl.constexpr, KEYS: tl.constexpr, SPARSE: tl.constexpr,
                       C: tl.constexpr, NPAD: tl.constexpr, NPADP: tl.constexpr,
                       INDEXED: tl.constexpr, ALIGN: tl.constexpr, DT: tl.constexpr,
                       OVF: tl.constexpr):
    """INT4 and sparse: the values, and with ``KEYS`` the keys too (keys per token, like the
    values; keys per channel are :func:`_int4_encode_channel`'s, or the sparse codec's
    :func:`_sparse_select`'s). Shard ``program_id(0)`` (row
    ``s // L``, selected layer ``s % L``), heads ``[program_id(1) * HP, + HP)``. Tiles
    ``[tokens, heads, groups, G / 2]`` of *pair words* (channels ``2w`` and ``2w + 1`` of a
    vector in one int32, or int64 for float32; ``raw``, ``voff`` and ``vstride`` count pair
    words): a group's reduction is over the last axis, and the two nibbles of a byte are the
    two halves of a word. SPARSE: the tokens that the bitmap (:func:`_sparse_select`'s, which
    also stores the ``C`` salient ones exact) leaves out are quantized into rows ``rpos`` of the
    INT4 part. The programs of heads 0 write the padding."""
    s = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    i = s // L
    k = s - i * L
    if INDEXED:
        blk = tl.load(idx + i)
    else:
        blk = i
    HW: tl.constexpr = D // 2
    t = tl.arange(0, TP)
    hp = tl.arange(0, HP)
    gi = tl.arange(0, NGP)
    j = tl.arange(0, GH)
    # (masks are built from blocks only: the interpreter mishandles scalar & block)
    tm = (t < T) & ((t * 0 + blk) >= 0)
    base = enc + i * (enc_pitch8 * 8) + k * E
    tab = k * (2 * T * H)
    if NPAD > 0:
        jp = tl.arange(0, NPADP)
        po = tl.load(pad + jp, mask=jp < NPAD, other=0)
        tl.store(base + po, tl.zeros([NPADP], dtype=tl.uint8),
                 mask=(jp < NPAD) & ((jp * 0 + blk) >= 0) & ((jp * 0 + c) == 0))
    if SPARSE and C == 1:       # token 0 alone (the first salient token is always token 0)
        sel = t == 0
        rpos = t - 1
    elif SPARSE:
        # the salient tokens from the bitmap (32-bit words); rpos = t - the salient tokens
        # before t, a population count of the bitmap's bits below t
        b32 = (base + BITMAP).to(tl.pointer_type(tl.int32), bitcast=True)
        rpos = t
        sel = t < 0
        for jw in tl.static_range((T + 31) // 32):
            bw = tl.load(b32 + jw + t * 0, mask=tm & ((t >> 5) >= jw), other=0)
            here = (t >> 5) == jw
            sel = sel | (here & (((bw >> (t & 31)) & 1) != 0))
            bw = tl.where(here, bw & ((1 << (t & 31)) - 1), bw)
            bw = bw - ((bw >> 1) & 0x55555555)
            bw = (bw & 0x33333333) + ((bw >> 2) & 0x33333333)
            bw = (bw + (bw >> 4)) & 0x0F0F0F0F
            rpos -= (bw * 0x01010101) >> 24
    else:
        sel = t < 0
        rpos = t
    keep = tm & (sel.to(tl.int32) == 0)
    gcol = (gi * GH)[:, None] + j[None, :]                              # [NGP, GH]
    gm2 = (gi < NG)[:, None] & (j < GH)[None, :]
    v32 = (base + VP).to(tl.pointer_type(tl.int32), bitcast=True)
    p32 = (base + KP).to(tl.pointer_type(tl.int32), bitcast=True)
    h = c * HP + hp
    hm = (h < H) & ((hp * 0 + blk) >= 0)
    th = tm[:, None] & hm[None, :]
    m4 = th[:, :, None, None] & gm2[None, None, :, :]
    vk = tab + t[:, None] * H + h[None, :]                          # [TP, HP]
    vb = (tl.multiple_of(tl.load(voff + vk + T * H, mask=th, other=0), [ALIGN, ALIGN])
          + blk * tl.multiple_of(tl.load(vstride + vk + T * H, mask=th, other=0), [ALIGN, ALIGN]))
    wv = tl.load(raw + vb[:, :, None, None] + gcol[None, None, :, :], mask=m4, other=0)
    if KEYS:
        kb = (tl.multiple_of(tl.load(voff + vk, mask=th, other=0), [ALIGN, ALIGN])
              + blk * tl.multiple_of(tl.load(vstride + vk, mask=th, other=0), [ALIGN, ALIGN]))
        wk = tl.load(raw + kb[:, :, None, None] + gcol[None, None, :, :], mask=m4, other=0)
    qrow = rpos[:, None] * H + h[None, :]                              # [TP, HP]
    kq2 = keep[:, None] & hm[None, :]
    gq3 = kq2[:, :, None] & (gi < NG)[None, None, :]
    qm4 = kq2[:, :, None, None] & gm2[None, None, :, :]
    for kv in tl.static_range(2 if KEYS else 1):
        # values first, then the keys; per token, groups of G channels. Masked lanes (padding
        # groups, tokens past T, absent heads, salient tokens) hold zeros or their own values
        # and only reach outputs that are not stored.
        if kv == 0:
            w = wv
        else:
            w = wk
        if DT == 0:      # bfloat16 pairs in an int32
            xe = (w << 16).to(tl.float32, bitcast=True)
            xo = (w & -65536).to(tl.float32, bitcast=True)
        elif DT == 1:    # float16 pairs in an int32
            xe = (w & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
            xo = (w >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        else:            # float32 pairs in an int64
            xe = (w & 0xFFFFFFFF).to(tl.int32).to(tl.float32, bitcast=True)
            xo = (w >> 32).to(tl.int32).to(tl.float32, bitcast=True)
        # refused values: x * OVF (a power of two that overflows exactly from the magnitude
        # limit on) times 0 is NaN for them and for NaN and infinities, 0 otherwise (masked
        # lanes load as 0); the flags are stored by the lanes that see one (no reduction
        # across the program)
        z = tl.sum(tl.sum((xe * OVF) * 0.0 + (xo * OVF) * 0.0, axis=3), axis=2)   # [TP, HP]
        z0 = tl.zeros(z.shape, dtype=tl.int32)
        tl.store(flags + s + z0, z0, mask=z != z)
        tl.store(flags + n_shards + z0, z0, mask=z != z)            # any bad
        mn = tl.minimum(tl.min(xe, axis=3), tl.min(xo, axis=3)) + 0.0   # a zero extreme is +0
        mx = tl.maximum(tl.max(xe, axis=3), tl.max(xo, axis=3)) + 0.0
        b = mn.to(tl.int32, bitcast=True)
        hi = b & -65536
        mb = tl.where(((b & 0xFFFF) != 0) & (b < 0), hi + 0x10000, hi)
        m = mb.to(tl.float32, bitcast=True)
        b = tl.math.div_rn(mx - m, 15.0).to(tl.int32, bitcast=True)
        hi = b & -65536
        sb = tl.where((b & 0xFFFF) != 0, hi + 0x10000, hi)
        sc = sb.to(tl.float32, bitcast=True)
        # q = rint(RN((x - m) / s)) without dividing. nu = fma(x, f, -m f) = (x - m) f, one
        # rounding, with f = 2**64 where s is tiny (exact: it keeps (k + 1/2) s and 1 / s
        # normal), else 1. y = nu * (1 / s') is within a few ulps of the quotient, so k =
        # floor(y) is the integer below it or next to it, and the exact product h = (k + 1/2)
        # s' (few significant bits) decides: nu > h rounds up, nu == h is the tie (to even;
        # RN(nu / s') == k + 1/2 only if nu == h exactly, for a normal h), nu < h down. q <= 15
        # without a clamp, as s >= RN(range / 15); s == 0 gives h = inf, q = 0. k is read from
        # the low bits of k + 1.5 * 2**23 (no float to integer conversion).
        f = tl.where((sc > 0) & (sc < _TINY), _SCALE, 1.0)
        sp = sc * f
        mp = m * f
        rp = 1.0 / tl.where(sp == 0, 1.0, sp)
        hs = tl.where(sp == 0, _INF, sp * 0.5)   # s == 0: q = 0
        nu = tl.fma(xe, f[:, :, :, None], -mp[:, :, :, None])
        kf = tl.floor(nu * rp[:, :, :, None])
        hh = tl.fma(kf, sp[:, :, :, None], hs[:, :, :, None])
        qb = (kf + _RINT).to(tl.int32, bitcast=True)
        qe = qb + ((nu > hh) | ((nu == hh) & ((qb & 1) != 0))).to(tl.int32)
        nu = tl.fma(xo, f[:, :, :, None], -mp[:, :, :, None])
        kf = tl.floor(nu * rp[:, :, :, None])
        hh = tl.fma(kf, sp[:, :, :, None], hs[:, :, :, None])
        qb = (kf + _RINT).to(tl.int32, bitcast=True)
        qo = qb + ((nu > hh) | ((nu == hh) & ((qb & 1) != 0))).to(tl.int32)
        if kv == 0:
            pp = v32
            qq = base + VQ
        else:
            pp = p32
            qq = base + KQ
        tl.store(pp + (qrow * NG)[:, :, None] + gi[None, None, :],
                 ((mb >> 16) & 0xFFFF) | (sb & -65536), mask=gq3)
        tl.store(qq + (qrow * HW)[:, :, None, None] + gcol[None, None, :, :],
                 (qe + (qo << 4)).to(tl.uint8), mask=qm4)   # (the low bytes of k + RINT: q)


def _int4_encode_channel(raw, voff, vstride, idx, enc, enc_pitch8, flags, n_shards,
                         T: tl.constexpr, TP: tl.constexpr, H: tl.constexpr,
                         D: tl.constexpr, HWP: tl.constexpr, L: tl.constexpr,
                         E: tl.constexpr, KQ: tl.constexpr, KP: tl.constexpr,
                         INDEXED: tl.constexpr, ALIGN: tl.constexpr, DT: tl.constexpr,
                         OVF: tl.constexpr):
    """INT4 with keys per channel: the keys (the values are :func:`_int4_encode_token`'s; the
    sparse codec's keys are :func:`_sparse_select`'s). Shard ``program_id(0)``, head
    ``program_id(1)``: a tile ``[tokens, D / 2]`` of pair words whose accesses declare a
    contiguity of two words, so that the threads lie along the channels, two words each, and
    the tokens along the threads
    (and across warps only past ``32 * 32`` pair words a warp): a channel's minimum and maximum
    over the tokens are reduced within the thread, and its scale and constants computed by the
    one thread that holds it. (Laid out for vector loads, as the values are, every thread would
    hold a token of many channels and recompute their constants: most of the work.)
    Quantization as in :func:`_int4_encode_token`."""
    s = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    i = s // L
    k = s - i * L
    if INDEXED:
        blk = tl.load(idx + i)
    else:
        blk = i
    HW: tl.constexpr = D // 2
    t = tl.arange(0, TP)
    w = tl.arange(0, HWP)
    # (masks are built from blocks only: the interpreter mishandles scalar & block)
    tm = (t < T) & ((t * 0 + blk) >= 0)
    wm = (w < HW) & ((w * 0 + blk) >= 0)
    base = enc + i * (enc_pitch8 * 8) + k * E
    vk = k * (2 * T * H) + t * H + h
    kb = (tl.multiple_of(tl.load(voff + vk, mask=tm, other=0), ALIGN)
          + blk * tl.multiple_of(tl.load(vstride + vk, mask=tm, other=0), ALIGN))
    wk = tl.load(tl.max_contiguous(raw + kb[:, None] + w[None, :], [1, 2]),
                 mask=tm[:, None] & wm[None, :], other=0)
    if DT == 0:      # bfloat16 pairs in an int32
        ke = (wk << 16).to(tl.float32, bitcast=True)
        ko = (wk & -65536).to(tl.float32, bitcast=True)
    elif DT == 1:    # float16 pairs in an int32
        ke = (wk & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        ko = (wk >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    else:            # float32 pairs in an int64
        ke = (wk & 0xFFFFFFFF).to(tl.int32).to(tl.float32, bitcast=True)
        ko = (wk >> 32).to(tl.int32).to(tl.float32, bitcast=True)
    # refused values (past the magnitude limit, NaN, infinities): (x * OVF) * 0 is NaN for
    # them, 0 otherwise (masked lanes load as 0); summed over the tokens, the flags stored by
    # the lanes that see one
    z = tl.sum((ke * OVF) * 0.0 + (ko * OVF) * 0.0, axis=0)         # [HWP]
    z0 = tl.zeros(z.shape, dtype=tl.int32)
    tl.store(flags + s + z0, z0, mask=z != z)
    tl.store(flags + n_shards + z0, z0, mask=z != z)                # any bad
    if T < TP:   # rows left out of the extremes: tokens past T
        km = tm[:, None]
        mne = tl.min(tl.where(km, ke, _INF), axis=0)
        mxe = tl.max(tl.where(km, ke, -_INF), axis=0)
        mno = tl.min(tl.where(km, ko, _INF), axis=0)
        mxo = tl.max(tl.where(km, ko, -_INF), axis=0)
    else:
        mne = tl.min(ke, axis=0)
        mxe = tl.max(ke, axis=0)
        mno = tl.min(ko, axis=0)
        mxo = tl.max(ko, axis=0)
    p32 = (base + KP).to(tl.pointer_type(tl.int32), bitcast=True) + h * D
    for half in tl.static_range(2):     # channels 2w, then 2w + 1
        if half == 0:
            x = ke
            mn = mne + 0.0                  # a zero extreme counts as +0
            mx = mxe + 0.0
        else:
            x = ko
            mn = mno + 0.0
            mx = mxo + 0.0
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
        tl.store(p32 + 2 * w + half, ((mb >> 16) & 0xFFFF) | (sb & -65536), mask=wm)
        if half == 0:
            qe = q
        else:
            tl.store(tl.max_contiguous(base + KQ + ((t * H + h) * HW)[:, None] + w[None, :],
                                       [1, 2]),
                     (qe + (q << 4)).to(tl.uint8), mask=tm[:, None] & wm[None, :])


def _int4_decode(raw, voff, vstride, idx, enc, enc_pitch8,
                 T: tl.constexpr, TP: tl.constexpr, H: tl.constexpr, D: tl.constexpr,
                 DP: tl.constexpr, G: tl.constexpr, L: tl.constexpr, E: tl.constexpr,
                 KQ: tl.constexpr, VQ: tl.constexpr, KP: tl.constexpr, VP: tl.constexpr,
                 BITMAP: tl.constexpr, EXACT: tl.constexpr, CHANNEL: tl.constexpr,
                 SPARSE: tl.constexpr, C: tl.constexpr, HPP: tl.constexpr,
                 INDEXED: tl.constexpr, ALIGN: tl.constexpr, BF16: tl.constexpr):
    """INT4 and sparse: shard ``program_id(0)``, heads ``[program_id(1) * HPP, + HPP)``.
    SPARSE: the ``C`` salient tokens (the bitmap's; token 0 alone when ``C == 1``) from exact
    row ``epos`` (the salient tokens before them), the others from INT4 row ``rpos = t -
    epos``, both counted by a population count of the bitmap's bits below the token."""
    s = tl.program_id(0).to(tl.int64)
    hc = tl.program_id(1)
    i = s // L
    k = s - i * L
    if INDEXED:
        blk = tl.load(idx + i)
    else:
        blk = i
    V: tl.constexpr = 2 * T * H
    NG: tl.constexpr = DP // G
    NGR: tl.constexpr = D // G
    HD: tl.constexpr = D // 2
    t = tl.arange(0, TP)
    d = tl.arange(0, DP)
    dm = d < D
    tm = (t < T) & ((t * 0 + blk) >= 0)
    dlive = dm & ((d * 0 + blk) >= 0)
    base = enc + i * (enc_pitch8 * 8) + k * E
    tab = k * V
    if SPARSE and C == 1:
        sel = (t == 0) & tm
        epos = t * 0
        rpos = t - 1
    elif SPARSE:
        b32 = (base + BITMAP).to(tl.pointer_type(tl.int32), bitcast=True)
        epos = t * 0
        sel = t < 0
        for jw in tl.static_range((T + 31) // 32):
            bw = tl.load(b32 + jw + t * 0, mask=tm & ((t >> 5) >= jw), other=0)
            here = (t >> 5) == jw
            sel = sel | (here & (((bw >> (t & 31)) & 1) != 0))
            bw = tl.where(here, bw & ((1 << (t & 31)) - 1), bw)
            bw = bw - ((bw >> 1) & 0x55555555)
            bw = (bw & 0x33333333) + ((bw >> 2) & 0x33333333)
            bw = (bw + (bw >> 4)) & 0x0F0F0F0F
            epos += (bw * 0x01010101) >> 24
        sel = sel & tm
        rpos = t - epos
    else:
        sel = t < 0
        epos = t * 0
        rpos = t
    keep = tm & (sel.to(tl.int32) == 0)
    j2 = tl.arange(0, DP // 2)
    gi = tl.arange(0, NG)
    qm = keep[:, None] & (j2 < HD)[None, :]
    m2 = tm[:, None] & dm[None, :]
    for hh in range(HPP):
        h = hc * HPP + hh
        vk = t * H + h
        vv = (T + t) * H + h
        # ---- keys
        pk = tl.load(base + KQ + ((rpos * H + h) * HD)[:, None] + j2[None, :], mask=qm,
                     other=0).to(tl.int32)
        qk = tl.reshape(tl.join(pk & 15, pk >> 4), [TP, DP]).to(tl.float32)
        if CHANNEL:
            pb = base + KP + (h * D + d) * 4
            pm = dlive
            mb = tl.load(pb, mask=pm, other=0).to(tl.int32) | (tl.load(pb + 1, mask=pm, other=0).to(tl.int32) << 8)
            sb = tl.load(pb + 2, mask=pm, other=0).to(tl.int32) | (tl.load(pb + 3, mask=pm, other=0).to(tl.int32) << 8)
            m = (mb << 16).to(tl.float32, bitcast=True)
            sc = (sb << 16).to(tl.float32, bitcast=True)
            xk = qk * sc[None, :] + m[None, :]
        else:
            pb = base + KP + ((rpos * H + h) * NGR)[:, None] * 4 + gi[None, :] * 4
            pm = keep[:, None] & (gi < NGR)[None, :]
            mb = tl.load(pb, mask=pm, other=0).to(tl.int32) | (tl.load(pb + 1, mask=pm, other=0).to(tl.int32) << 8)
            sb = tl.load(pb + 2, mask=pm, other=0).to(tl.int32) | (tl.load(pb + 3, mask=pm, other=0).to(tl.int32) << 8)
            m = (mb << 16).to(tl.float32, bitcast=True)
            sc = (sb << 16).to(tl.float32, bitcast=True)
            xk = tl.reshape(tl.reshape(qk, [TP, NG, G]) * sc[:, :, None] + m[:, :, None], [TP, DP])
        # ---- values
        pv = tl.load(base + VQ + ((rpos * H + h) * HD)[:, None] + j2[None, :], mask=qm,
                     other=0).to(tl.int32)
        qv = tl.reshape(tl.join(pv & 15, pv >> 4), [TP, DP]).to(tl.float32)
        pb = base + VP + ((rpos * H + h) * NGR)[:, None] * 4 + gi[None, :] * 4
        pm = keep[:, None] & (gi < NGR)[None, :]
        mb = tl.load(pb, mask=pm, other=0).to(tl.int32) | (tl.load(pb + 1, mask=pm, other=0).to(tl.int32) << 8)
        sb = tl.load(pb + 2, mask=pm, other=0).to(tl.int32) | (tl.load(pb + 3, mask=pm, other=0).to(tl.int32) << 8)
        m = (mb << 16).to(tl.float32, bitcast=True)
        sc = (sb << 16).to(tl.float32, bitcast=True)
        xv = tl.reshape(tl.reshape(qv, [TP, NG, G]) * sc[:, :, None] + m[:, :, None], [TP, DP])
        if BF16:
            _b = xk.to(tl.int32, bitcast=True)
            outk = ((_b + 0x7FFF + ((_b >> 16) & 1)) >> 16).to(tl.int16).to(tl.bfloat16, bitcast=True)   # RNE
            _b = xv.to(tl.int32, bitcast=True)
            outv = ((_b + 0x7FFF + ((_b >> 16) & 1)) >> 16).to(tl.int16).to(tl.bfloat16, bitcast=True)
        else:
            outk = xk.to(raw.dtype.element_ty)
            outv = xv.to(raw.dtype.element_ty)
        if SPARSE:
            em = (sel & tm)[:, None] & dm[None, :]
            ex = (base + EXACT).to(tl.pointer_type(raw.dtype.element_ty), bitcast=True)
            ek = tl.load(ex + (((epos * 2) * H + h) * D)[:, None] + d[None, :], mask=em, other=0.0)
            ev = tl.load(ex + (((epos * 2 + 1) * H + h) * D)[:, None] + d[None, :], mask=em, other=0.0)
            outk = tl.where(em, ek, outk)
            outv = tl.where(em, ev, outv)
        ok = tl.multiple_of(tl.load(voff + tab + vk, mask=tm, other=0), ALIGN)
        sk = tl.multiple_of(tl.load(vstride + tab + vk, mask=tm, other=0), ALIGN)
        ov = tl.multiple_of(tl.load(voff + tab + vv, mask=tm, other=0), ALIGN)
        sv = tl.multiple_of(tl.load(vstride + tab + vv, mask=tm, other=0), ALIGN)
        tl.store(raw + (ok + blk * sk)[:, None] + d[None, :], outk, mask=m2)
        tl.store(raw + (ov + blk * sv)[:, None] + d[None, :], outv, mask=m2)


def _int8c_encode(raw, voff, vstride, idx, enc, enc_pitch8, flags, pad, n_shards,
                  T: tl.constexpr, H: tl.constexpr, D: tl.constexpr, DP: tl.constexpr,
                  TB: tl.constexpr, TQ: tl.constexpr, L: tl.constexpr, E: tl.constexpr,
                  KP: tl.constexpr, VS: tl.constexpr, X0: tl.constexpr, VALUES: tl.constexpr,
                  NPAD: tl.constexpr, NPADP: tl.constexpr, INDEXED: tl.constexpr,
                  ALIGN: tl.constexpr, BF16: tl.constexpr, LIMB: tl.constexpr):
    """INT8 with keys per channel (``key_mode="channel"``): a program per (shard, head). Each
    channel's minimum and maximum over the block's tokens after the first, keys quantized by
    their channel's (min, scale) to uint8 codes, token 0's key and value copied exact; with
    ``VALUES`` the values of tokens 1.. too, by their token's symmetric scale. Tokens 1..'s
    codes: keys at vector ``(t - 1) H + h`` of ``q``, values at ``(T - 1 + t - 1) H + h``.

    Two shapes. ``VALUES`` (small blocks: ``T <= TB``): the block's keys and values are
    loaded once, together, before any store (a store may alias a later load, so nothing is
    issued ahead of it). Otherwise keys only (the values are :func:`_int8_encode`'s, in a
    launch of their own): the channel ranges over chunks of ``TB`` tokens, then the codes over
    chunks of ``TQ``, the keys read a second time (from L2: a program's keys are a few tens of
    KiB). A program that holds keys and values of a long block together needs about twice the
    registers and ran at 0.56-0.61 of a device copy on an H200 at 128-token blocks, against
    0.72-0.75 for the two launches.

    Maxima of ``|x|`` are taken over its bits as integers (non-negative floats order as their
    bits, and NaN's bits are above infinity's): one reduction gives a value scale and says
    whether the shard holds a non-finite value; the keys' extremes likewise, over order keys
    (``b ^ ((b >> 31) & 0x7FFFFFFF)`` of the bits ``b``: integers that order as the floats,
    -0 below +0, NaNs beyond the infinities). ``q = rint(RN(x / s))`` is computed without a
    division, as in ``_int4_encode_token``: ``y = x f (1 / s')`` (``s' = s f``), ``k =
    floor(y)`` is within one of the quotient's integer part, and the exact ``h = (k + 1/2) s'``
    (at most 17 significant bits) decides: ``x f > h`` rounds up, ``==`` is the tie (to even),
    ``<`` down. ``f = 2**64`` where ``s`` is tiny (exact: it keeps ``h`` and ``1 / s'`` normal),
    else 1. An ``h`` that overflows is above every finite ``x``, as its exact value is. ``s ==
    0`` gives ``h = inf``: 0. ``q`` is read from ``k + 1.5 * 2**23``'s low bits (no float to
    integer conversion: ``k + 1.5 * 2**23`` is ``0x4B400000 + k`` as bits, whose low byte is
``k``'s). Key codes need no clamp: ``x - m >= 0``, and ``(max - m) / s <= 255 (1 + 2**-23)``,
which rounds to 255 at most."""
    s = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    i = s // L
    k = s - i * L
    if INDEXED:
        blk = tl.load(idx + i)
    else:
        blk = i
    live = blk >= 0
    t_lim = tl.where(live, T, 0)         # (the interpreter cannot mask with a vector & a scalar)
    d_lim = tl.where(live, D, 0)
    d = tl.arange(0, DP)
    dm = d < d_lim
    V = 2 * T * H
    base = enc + i * (enc_pitch8 * 8) + k * E
    tb = tl.arange(0, TB)
    i16 = raw.to(tl.pointer_type(tl.int16), bitcast=True)
    # per channel over tokens 1..: the extremes as order keys of the floats (integers that
    # order as the floats do, NaNs beyond the infinities): two integer reductions give the
    # range and say whether a key is not finite
    kmin = tl.full([DP], 0x7FFFFFFF, dtype=tl.int32)
    kmax = tl.full([DP], -0x7FFFFFFF - 1, dtype=tl.int32)
    bad = tl.zeros([TB], dtype=tl.int32)        # max |V| over the shard's values, as bits
    if VALUES:                           # one chunk: keys and values loaded together
        tm = tb < t_lim
        m2 = tm[:, None] & dm[None, :]
        vk = k * V + tb * H + h
        ok_ = tl.multiple_of(tl.load(voff + vk, mask=tm, other=0), ALIGN)
        sk = tl.multiple_of(tl.load(vstride + vk, mask=tm, other=0), ALIGN)
        ov = tl.multiple_of(tl.load(voff + vk + T * H, mask=tm, other=0), ALIGN)
        sv = tl.multiple_of(tl.load(vstride + vk + T * H, mask=tm, other=0), ALIGN)
        if BF16:     # bfloat16 -> float32 by its bits (the interpreter's cast loses subnormals)
            xk = (tl.load(i16 + (ok_ + blk * sk)[:, None] + d[None, :], mask=m2,
                          other=0).to(tl.int32) << 16).to(tl.float32, bitcast=True)
            xv = (tl.load(i16 + (ov + blk * sv)[:, None] + d[None, :], mask=m2,
                          other=0).to(tl.int32) << 16).to(tl.float32, bitcast=True)
        else:
            xk = tl.load(raw + (ok_ + blk * sk)[:, None] + d[None, :], mask=m2, other=0.0).to(tl.float32)
            xv = tl.load(raw + (ov + blk * sv)[:, None] + d[None, :], mask=m2, other=0.0).to(tl.float32)
        xb = xk.to(tl.int32, bitcast=True)
        ky = xb ^ ((xb >> 31) & 0x7FFFFFFF)
        r2 = (tm & (tb >= 1))[:, None]
        kmin = tl.min(tl.where(r2, ky, 0x7FFFFFFF), axis=0)
        kmax = tl.max(tl.where(r2, ky, -0x7FFFFFFF - 1), axis=0)
    else:
        for t0 in tl.static_range(0, T, TB):
            t = t0 + tb
            tm = t < t_lim
            vk = k * V + t * H + h
            ok_ = tl.multiple_of(tl.load(voff + vk, mask=tm, other=0), ALIGN)
            sk = tl.multiple_of(tl.load(vstride + vk, mask=tm, other=0), ALIGN)
            if BF16:
                xb = tl.load(i16 + (ok_ + blk * sk)[:, None] + d[None, :],
                             mask=tm[:, None] & dm[None, :], other=0).to(tl.int32) << 16
            else:
                xb = tl.load(raw + (ok_ + blk * sk)[:, None] + d[None, :],
                             mask=tm[:, None] & dm[None, :],
                             other=0.0).to(tl.float32).to(tl.int32, bitcast=True)
            ky = xb ^ ((xb >> 31) & 0x7FFFFFFF)
            r2 = (tm & (t >= 1))[:, None]
            kmin = tl.minimum(kmin, tl.min(tl.where(r2, ky, 0x7FFFFFFF), axis=0))
            kmax = tl.maximum(kmax, tl.max(tl.where(r2, ky, -0x7FFFFFFF - 1), axis=0))
    # refused: a key at or past the magnitude limit (LIMB: its bits; order key -1 - LIMB for
    # -limit), NaNs and infinities included
    kbad = (kmax >= LIMB) | (kmin <= -1 - LIMB)
    # key pairs, per channel: m = bf16_down(min + 0), s = bf16_up((max + 0 - m) / 255)
    fmin = (kmin ^ ((kmin >> 31) & 0x7FFFFFFF)).to(tl.float32, bitcast=True)
    fmax = (kmax ^ ((kmax >> 31) & 0x7FFFFFFF)).to(tl.float32, bitcast=True)
    b = (fmin + 0.0).to(tl.int32, bitcast=True)
    bh = b & -65536
    mb = tl.where(((b & 0xFFFF) != 0) & (b < 0), bh + 0x10000, bh)
    km = mb.to(tl.float32, bitcast=True)
    b = tl.math.div_rn(fmax + 0.0 - km, 255.0).to(tl.int32, bitcast=True)
    bh = b & -65536
    sb = tl.where((b & 0xFFFF) != 0, bh + 0x10000, bh)
    ksc = sb.to(tl.float32, bitcast=True)
    kf_ = tl.where((ksc > 0) & (ksc < _TINY), _SCALE, 1.0)
    ksp = ksc * kf_
    kmp = km * kf_
    krp = 1.0 / tl.where(ksp == 0, 1.0, ksp)
    khs = tl.where(ksp == 0, _INF, ksp * 0.5)    # s == 0: q = 0
    tq = tl.arange(0, TQ)               # (VALUES: TQ == TB, one chunk, the keys loaded above)
    for t0 in tl.static_range(0, T, TQ):
        t = t0 + tq
        tm = t < t_lim
        m2 = tm[:, None] & dm[None, :]
        if not VALUES:                   # the keys again
            vk = k * V + t * H + h
            ok_ = tl.multiple_of(tl.load(voff + vk, mask=tm, other=0), ALIGN)
            sk = tl.multiple_of(tl.load(vstride + vk, mask=tm, other=0), ALIGN)
            if BF16:
                xk = (tl.load(i16 + (ok_ + blk * sk)[:, None] + d[None, :], mask=m2,
                              other=0).to(tl.int32) << 16).to(tl.float32, bitcast=True)
            else:
                xk = tl.load(raw + (ok_ + blk * sk)[:, None] + d[None, :], mask=m2,
                             other=0.0).to(tl.float32)
        # ---- keys: uint8 codes of x - m (token 0's: 0)
        nu = tl.fma(xk, kf_[None, :], -kmp[None, :])
        fl = tl.floor(nu * krp[None, :])
        hh = tl.fma(fl, ksp[None, :], khs[None, :])
        b = (fl + _RINT).to(tl.int32, bitcast=True)      # 0x4B400000 + floor: low byte floor
        q = b + ((nu > hh) | ((nu == hh) & ((b & 1) != 0))).to(tl.int32)
        t1 = (t >= 1)[:, None]                       # (0 <= code <= 255 from token 1 on)
        tl.store(base + (((t - 1) * H + h) * D)[:, None] + d[None, :], q.to(tl.uint8),
                 mask=m2 & t1)
        if VALUES:
            # ---- values, per token
            vmax = tl.max(xv.to(tl.int32, bitcast=True) & 0x7FFFFFFF, axis=1)
            bad = tl.maximum(bad, vmax)
            vbits = tl.math.div_rn(vmax.to(tl.float32, bitcast=True), 127.0).to(tl.int32, bitcast=True)
            vhi = vbits & -65536
            vbits = tl.where((vbits & 0xFFFF) != 0, vhi + 0x10000, vhi)
            vsc = vbits.to(tl.float32, bitcast=True)
            vf = tl.where((vsc > 0) & (vsc < _TINY), _SCALE, 1.0)
            vsp = vsc * vf
            vrp = 1.0 / tl.where(vsp == 0, 1.0, vsp)
            vhs = tl.where(vsp == 0, _INF, vsp * 0.5)
            nu = xv * vf[:, None]
            fl = tl.floor(nu * vrp[:, None])
            hh = tl.fma(fl, vsp[:, None], vhs[:, None])
            b = (fl + _RINT).to(tl.int32, bitcast=True)
            q = b + ((nu > hh) | ((nu == hh) & ((b & 1) != 0))).to(tl.int32)
            tl.store(base + (((T - 2 + t) * H + h) * D)[:, None] + d[None, :],
                     q.to(tl.int8).to(tl.uint8, bitcast=True), mask=m2 & t1)
            tl.store((base + VS).to(tl.pointer_type(tl.int16), bitcast=True) + (t - 1) * H + h,
                     (vbits >> 16).to(tl.int16), mask=tm & (t >= 1))
    # kp [H, D, 2] bf16: one int32 (min | scale << 16) per channel
    tl.store((base + KP).to(tl.pointer_type(tl.int32), bitcast=True) + h * D + d,
             ((mb >> 16) & 0xFFFF) | (sb & -65536), mask=dm)
    # token 0's key and value, exact (their element bits), at x0 [2, H, D]
    for kv in tl.static_range(2):
        o0 = tl.multiple_of(tl.load(voff + k * V + kv * T * H + h + d * 0, mask=dm, other=0),
                            ALIGN)
        s0 = tl.multiple_of(tl.load(vstride + k * V + kv * T * H + h + d * 0, mask=dm, other=0),
                            ALIGN)
        if BF16:
            x0 = tl.load(i16 + o0 + blk * s0 + d, mask=dm, other=0)
            tl.store((base + X0).to(tl.pointer_type(tl.int16), bitcast=True)
                     + (kv * H + h) * D + d, x0, mask=dm)
            b0 = x0.to(tl.int32) << 16
        else:
            x0 = tl.load(raw + o0 + blk * s0 + d, mask=dm, other=0)
            tl.store((base + X0).to(tl.pointer_type(raw.dtype.element_ty), bitcast=True)
                     + (kv * H + h) * D + d, x0, mask=dm)
            b0 = x0.to(tl.float32).to(tl.int32, bitcast=True)
        kbad = kbad | ((b0 & 0x7FFFFFFF) >= LIMB)
    nb = tl.maximum(tl.max(kbad.to(tl.int32), axis=0) * LIMB, tl.max(bad, axis=0))
    tl.store(flags + s, 0, mask=live & (nb >= LIMB))
    tl.store(flags + n_shards, 0, mask=live & (nb >= LIMB))
    if NPAD > 0:
        j = tl.arange(0, NPADP)
        po = tl.load(pad + j, mask=j < NPAD, other=0)
        tl.store(base + po, tl.zeros([NPADP], dtype=tl.uint8), mask=j < tl.where(live & (h == 0), NPAD, 0))


def _int8c_decode(raw, voff, vstride, idx, enc, enc_pitch8,
                  T: tl.constexpr, H: tl.constexpr, D: tl.constexpr, DP: tl.constexpr,
                  TB: tl.constexpr, L: tl.constexpr, E: tl.constexpr, KP: tl.constexpr,
                  VS: tl.constexpr, X0: tl.constexpr, INDEXED: tl.constexpr,
                  ALIGN: tl.constexpr, BF16: tl.constexpr):
    s = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    i = s // L
    k = s - i * L
    if INDEXED:
        blk = tl.load(idx + i)
    else:
        blk = i
    live = blk >= 0
    t_lim = tl.where(live, T, 0)
    d_lim = tl.where(live, D, 0)
    d = tl.arange(0, DP)
    dm = d < d_lim
    V = 2 * T * H
    base = enc + i * (enc_pitch8 * 8) + k * E
    pw = tl.load((base + KP).to(tl.pointer_type(tl.int32), bitcast=True) + h * D + d,
                 mask=dm, other=0)
    km = (pw << 16).to(tl.float32, bitcast=True)
    ksc = (pw & -65536).to(tl.float32, bitcast=True)
    tb = tl.arange(0, TB)
    for t0 in tl.static_range(0, T, TB):
        t = t0 + tb
        tm = t < t_lim
        m2 = tm[:, None] & dm[None, :] & (t >= 1)[:, None]      # (token 0: from x0)
        vk = (t * H + h)
        q = tl.load(base + (((t - 1) * H + h) * D)[:, None] + d[None, :], mask=m2, other=0)
        xk = q.to(tl.float32) * ksc[None, :] + km[None, :]      # (q s is exact)
        off = tl.multiple_of(tl.load(voff + k * V + vk, mask=tm, other=0), ALIGN)
        bst = tl.multiple_of(tl.load(vstride + k * V + vk, mask=tm, other=0), ALIGN)
        if BF16:
            _b = xk.to(tl.int32, bitcast=True)
            _o = ((_b + 0x7FFF + ((_b >> 16) & 1)) >> 16).to(tl.int16).to(tl.bfloat16, bitcast=True)   # RNE
        else:
            _o = xk.to(raw.dtype.element_ty)
        tl.store(raw + (off + blk * bst)[:, None] + d[None, :], _o, mask=m2)
        vv = (T + t) * H + h
        q = tl.load(base + (((T - 2 + t) * H + h) * D)[:, None] + d[None, :], mask=m2, other=0)
        t1 = tm & (t >= 1)
        vlo = tl.load(base + VS + 2 * ((t - 1) * H + h), mask=t1, other=0).to(tl.int32)
        vhi = tl.load(base + VS + 2 * ((t - 1) * H + h) + 1, mask=t1, other=0).to(tl.int32)
        vsc = ((vlo | (vhi << 8)) << 16).to(tl.float32, bitcast=True)
        xv = q.to(tl.int8, bitcast=True).to(tl.float32) * vsc[:, None]
        off = tl.multiple_of(tl.load(voff + k * V + vv, mask=t1, other=0), ALIGN)
        bst = tl.multiple_of(tl.load(vstride + k * V + vv, mask=t1, other=0), ALIGN)
        if BF16:
            _b = xv.to(tl.int32, bitcast=True)
            _o = ((_b + 0x7FFF + ((_b >> 16) & 1)) >> 16).to(tl.int16).to(tl.bfloat16, bitcast=True)   # RNE
        else:
            _o = xv.to(raw.dtype.element_ty)
        tl.store(raw + (off + blk * bst)[:, None] + d[None, :], _o, mask=m2)
    # token 0's key and value, exact
    for kv in tl.static_range(2):
        o0 = tl.multiple_of(tl.load(voff + k * V + kv * T * H + h + d * 0, mask=dm, other=0),
                            ALIGN)
        s0 = tl.multiple_of(tl.load(vstride + k * V + kv * T * H + h + d * 0, mask=dm, other=0),
                            ALIGN)
        if BF16:
            tl.store(raw.to(tl.pointer_type(tl.int16), bitcast=True) + o0 + blk * s0 + d,
                     tl.load((base + X0).to(tl.pointer_type(tl.int16), bitcast=True)
                             + (kv * H + h) * D + d, mask=dm, other=0), mask=dm)
        else:
            tl.store(raw + o0 + blk * s0 + d,
                     tl.load((base + X0).to(tl.pointer_type(raw.dtype.element_ty), bitcast=True)
                             + (kv * H + h) * D + d, mask=dm, other=0), mask=dm)


_jitted: dict = {}


def jit(fn):
    """``triton.jit(fn)`` made on first use, per mode (``TRITON_INTERPRET`` is read by
    ``triton.jit`` when it decorates)."""
    key = (fn.__name__, interpreting())
    k = _jitted.get(key)
    if k is None:
        k = _jitted[key] = triton.jit(fn)
    return k


