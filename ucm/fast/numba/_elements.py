"""Element conversions of the numba KV codecs (:mod:`ucm.fast.numba.compress`): bit patterns <->
float32 for the cache's element types, as integer arithmetic that rounds as ``Tensor.to`` does.

* bfloat16 -> float32 is ``bits << 16``; float32 -> bfloat16 and float16 round to nearest even
  (subnormals, overflow to inf, NaN canonical); float16 -> float32 is exact (a subnormal
  through its integer mantissa).
* ``bf16_up`` / ``bf16_down``: the reference's roundings of a scale up and a minimum down.
* Per element type (an array of the element bits: ``uint16`` bfloat16, ``int16`` float16,
  ``uint32`` float32; the type picks the conversion at compile time): :func:`ld` (as
  float32), :func:`st` (a float32, rounded), :func:`mag` (magnitude bits: ordered as ``|x|`` is
  for finite values; NaN and the infinities above every finite value; a shard holding a value
  at or above the magnitude bits of its refusal limit is refused:
  :func:`ucm.fast.numba.compress._magnitude_bits`).

The hot conversions are LLVM IR on 32-bit integers: numba types arithmetic on narrower integers
as int64, which halves the vector lanes (measured: the INT8 decode 2x slower).
"""
from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba.core import cgutils, types
from numba.extending import intrinsic, overload

from ucm.fast.numba._jit import njit

@intrinsic
def i2f(typingctx, v):
    """The float32 whose bits are the low 32 bits of integer ``v``."""
    if not isinstance(v, types.Integer):
        return None

    def codegen(context, builder, signature, args):
        val = args[0]
        i32 = ir.IntType(32)
        if val.type.width > 32:
            val = builder.trunc(val, i32)
        elif val.type.width < 32:
            val = builder.zext(val, i32)
        return builder.bitcast(val, ir.FloatType())
    return types.float32(v), codegen


@intrinsic
def f2i(typingctx, f):
    """The bits of float32 ``f`` as a non-negative int64."""
    if f != types.float32:
        return None

    def codegen(context, builder, signature, args):
        return builder.zext(builder.bitcast(args[0], ir.IntType(32)), ir.IntType(64))
    return types.int64(f), codegen


@njit
def bf16_up(x):
    """float32 >= 0 rounded up to a bfloat16 (the reference's bf16_up)."""
    b = f2i(x)
    hi = b & 0xFFFF0000
    return i2f(hi + 0x10000 if (b & 0xFFFF) != 0 else hi)


@njit
def bf16_down(x):
    """float32 rounded toward minus infinity to a bfloat16 (the reference's bf16_down)."""
    b = f2i(x)
    hi = b & 0xFFFF0000
    return i2f(hi + 0x10000 if (b & 0xFFFF) != 0 and b >= 0x80000000 else hi)


_I16, _I32 = ir.IntType(16), ir.IntType(32)


def _c32(v):
    return ir.Constant(_I32, v)


def _u16_as_i32(builder, v):
    """The low 16 bits of an integer, zero-extended to i32."""
    if v.type.width > 16:
        v = builder.trunc(v, _I16)
    elif v.type.width < 16:
        v = builder.zext(v, _I16)
    return builder.zext(v, _I32)


def _as_i32(builder, v):
    if v.type.width > 32:
        return builder.trunc(v, _I32)
    return builder.zext(v, _I32) if v.type.width < 32 else v


@intrinsic
def bf16_to_f32(typingctx, v):
    """bfloat16 bits (the low 16 bits of an integer) -> float32."""
    if not isinstance(v, types.Integer):
        return None

    def codegen(context, builder, signature, args):
        return builder.bitcast(builder.shl(_u16_as_i32(builder, args[0]), _c32(16)),
                               ir.FloatType())
    return types.float32(v), codegen


@intrinsic
def f16_to_f32(typingctx, v):
    """float16 bits (the low 16 bits of an integer) -> float32, exact: a subnormal through
    its integer mantissa (no float subnormal involved), inf and NaN kept."""
    if not isinstance(v, types.Integer):
        return None

    def codegen(context, builder, signature, args):
        b = builder
        x = _u16_as_i32(b, args[0])
        e = b.and_(x, _c32(0x7C00))
        sub = b.fmul(b.uitofp(b.and_(x, _c32(0x3FF)), ir.FloatType()),
                     ir.Constant(ir.FloatType(), 2.0 ** -24))
        normal = b.add(b.shl(b.and_(x, _c32(0x7FFF)), _c32(13)), _c32(112 << 23))
        normal = b.select(b.icmp_unsigned("==", e, _c32(0x7C00)),
                          b.add(normal, _c32(112 << 23)), normal)
        bits = b.select(b.icmp_unsigned("==", e, _c32(0)), b.bitcast(sub, _I32), normal)
        bits = b.or_(bits, b.shl(b.and_(x, _c32(0x8000)), _c32(16)))
        return b.bitcast(bits, ir.FloatType())
    return types.float32(v), codegen


def _k(like, v):
    """Integer constant ``v`` of ``like``'s type: i32, or a vector of i32 (every lane ``v``)."""
    if isinstance(like, ir.VectorType):
        return ir.Constant(like, [v] * like.count)
    return ir.Constant(like, v)


def _bf16_bits(b, x):
    """float32 bits ``x`` (i32, or a vector of i32) -> bfloat16 bits in the low 16 bits, round
    to nearest even (NaN: 0x7FC0), as Tensor.to does."""
    t = x.type
    lsb = b.and_(b.lshr(x, _k(t, 16)), _k(t, 1))
    r = b.lshr(b.add(b.add(x, _k(t, 0x7FFF)), lsb), _k(t, 16))
    nan = b.icmp_unsigned(">", b.and_(x, _k(t, 0x7FFFFFFF)), _k(t, 0x7F800000))
    return b.select(nan, _k(t, 0x7FC0), r)


def _f16_bits(b, x):
    """float32 bits ``x`` (i32, or a vector of i32) -> float16 bits in the low 16 bits, round
    to nearest even (subnormals; overflow: inf; NaN: 0x7E00), as Tensor.to does."""
    t = x.type

    def k(v):
        return _k(t, v)
    sign = b.and_(b.lshr(x, k(16)), k(0x8000))
    a = b.and_(x, k(0x7FFFFFFF))
    r = b.sub(a, k(0x38000000))                               # rebias the exponent: 127 -> 15
    normal = b.lshr(b.add(b.add(r, k(0xFFF)), b.and_(b.lshr(r, k(13)), k(1))), k(13))
    m = b.or_(b.and_(a, k(0x7FFFFF)), k(0x800000))
    s = b.sub(k(126), b.lshr(a, k(23)))                       # subnormal: m * 2^(e-150) / 2^-24
    s = b.select(b.icmp_signed("<", s, k(14)), k(14), s)
    s = b.select(b.icmp_signed(">", s, k(25)), k(25), s)
    half = b.sub(b.shl(k(1), b.sub(s, k(1))), k(1))
    sub = b.lshr(b.add(b.add(m, half), b.and_(b.lshr(m, s), k(1))), s)
    h = b.select(b.icmp_unsigned(">=", a, k(0x33000000)), sub, k(0))
    h = b.select(b.icmp_unsigned(">=", a, k(0x38800000)), normal, h)
    h = b.select(b.icmp_unsigned(">=", a, k(0x477FF000)), k(0x7C00), h)   # >= 65520
    h = b.select(b.icmp_unsigned(">", a, k(0x7F800000)), k(0x7E00), h)
    return b.or_(h, sign)


@intrinsic
def to_bf16(typingctx, f):
    """float32 -> bfloat16 bits, round to nearest even (NaN: 0x7FC0), as Tensor.to does."""
    if f != types.float32:
        return None

    def codegen(context, builder, signature, args):
        return builder.trunc(_bf16_bits(builder, builder.bitcast(args[0], _I32)), _I16)
    return types.uint16(f), codegen


@intrinsic
def to_f16(typingctx, f):
    """float32 -> float16 bits, round to nearest even (subnormals; overflow: inf; NaN:
    0x7E00), as Tensor.to does."""
    if f != types.float32:
        return None

    def codegen(context, builder, signature, args):
        return builder.trunc(_f16_bits(builder, builder.bitcast(args[0], _I32)), _I16)
    return types.uint16(f), codegen


@intrinsic
def mag16(typingctx, v):
    """Magnitude bits of a 16-bit float (the low 16 bits of an integer), as int32."""
    if not isinstance(v, types.Integer):
        return None

    def codegen(context, builder, signature, args):
        return builder.and_(_u16_as_i32(builder, args[0]), _c32(0x7FFF))
    return types.int32(v), codegen


@intrinsic
def mag32(typingctx, v):
    """Magnitude bits of a float32 (its bits as an integer, or the float itself), as int32."""
    if not isinstance(v, (types.Integer, types.Float)) or v == types.float64:
        return None

    def codegen(context, builder, signature, args):
        x = args[0]
        x = builder.bitcast(x, _I32) if isinstance(x.type, ir.FloatType) else _as_i32(builder, x)
        return builder.and_(x, _c32(0x7FFFFFFF))
    return types.int32(v), codegen


@intrinsic
def key(typingctx, f):
    """An int32 ordered as the float32 ``f`` (finite) is, -0 and +0 both 0: min / max over it
    vectorize (float reductions do not without fast math) and a zero extreme comes back as
    +0, as in the reference."""
    if f != types.float32:
        return None

    def codegen(context, builder, signature, args):
        b = builder
        x = b.bitcast(args[0], _I32)
        m = b.and_(x, _c32(0x7FFFFFFF))
        return b.select(b.icmp_signed("<", x, _c32(0)), b.sub(_c32(0), m), m)
    return types.int32(f), codegen


@intrinsic
def unkey(typingctx, k):
    """The float32 of a :func:`key`."""
    if k != types.int32:
        return None

    def codegen(context, builder, signature, args):
        b = builder
        x = args[0]
        bits = b.select(b.icmp_signed("<", x, _c32(0)),
                        b.or_(b.sub(_c32(0), x), _c32(-0x80000000)), x)
        return b.bitcast(bits, ir.FloatType())
    return types.float32(k), codegen


def _nibble(shift):
    def typer(typingctx, v):
        if not isinstance(v, types.Integer):
            return None

        def codegen(context, builder, signature, args):
            x = args[0]
            x = builder.trunc(x, ir.IntType(8)) if x.type.width > 8 else x
            x = builder.and_(builder.lshr(builder.zext(x, _I32), _c32(shift)), _c32(15))
            return builder.uitofp(x, ir.FloatType())
        return types.float32(v), codegen
    return typer


lo4 = intrinsic(_nibble(0))        # the low 4 bits of a byte as float32
hi4 = intrinsic(_nibble(4))        # the high 4 bits


# per element type (the array's dtype: uint16 bfloat16, int16 float16, uint32 float32): load
# as float32, magnitude bits, the magnitude of infinity, store a float32 (rounded)

def ld(a, i):
    raise NotImplementedError


def mag(a, i):
    raise NotImplementedError


def st(a, i, f):
    raise NotImplementedError


@overload(ld)
def _ld_impl(a, i):
    if a.dtype == types.uint16:
        return lambda a, i: bf16_to_f32(a[i])
    if a.dtype == types.int16:
        return lambda a, i: f16_to_f32(a[i])
    if a.dtype == types.uint32:
        return lambda a, i: i2f(a[i])


@overload(mag)
def _mag_impl(a, i):
    if a.dtype in (types.uint16, types.int16):
        return lambda a, i: mag16(a[i])
    if a.dtype == types.uint32:
        return lambda a, i: mag32(a[i])


@overload(st)
def _st_impl(a, i, f):
    if a.dtype == types.uint16:
        def st_bf16(a, i, f):
            a[i] = to_bf16(f)
        return st_bf16
    if a.dtype == types.int16:
        def st_f16(a, i, f):
            a[i] = np.int16(to_f16(f))
        return st_f16
    if a.dtype == types.uint32:
        def st_f32(a, i, f):
            a[i] = np.uint32(f2i(f))
        return st_f32


class _BFloat(ir.Type):
    """LLVM's ``bfloat`` (llvmlite's IR builder has no such type)."""

    def _to_string(self):
        return "bfloat"

    def __eq__(self, other):
        return isinstance(other, _BFloat)

    def __hash__(self):
        return hash("bfloat")


def _target_has(context, *features):
    """Whether the code being compiled may use all these LLVM target features: those of
    numba's target machine (the host's, or ``NUMBA_CPU_FEATURES``), which also key numba's
    on-disk cache, so code built for one CPU is not loaded on another."""
    have = set(context.codegen().magic_tuple()[2].split(","))
    return all("+" + f in have for f in features)


def _rounded_bits(context, bld, vs, elem):
    """Vectors of 16 float32 ``vs`` (consecutive columns) as the element bits of ``elem``
    (numba dtype of the output array), as a list of vectors to store one after the other.

    float32 / uint32 as they are. bfloat16 (uint16) and float16 (int16) round to nearest even,
    overflow to inf: with AVX512-BF16 two vectors per ``vcvtne2ps2bf16`` (one instruction for 32
    values, where ``fptrunc`` would take one per 16 and an insert), with F16C ``fptrunc`` to
    ``half`` (``vcvtps2ph``); on CPUs without those, integer arithmetic on the bits
    (:func:`_bf16_bits`, :func:`_f16_bits`): there ``fptrunc`` becomes calls to compiler-rt's
    ``__truncsfbf2`` / ``__truncsfhf2``, which numba's JIT does not resolve (the kernel
    crashes). The AVX512-BF16 conversion flushes subnormals to zero and keeps a NaN's payload,
    both below the learned codec's tolerance; the integer path does neither."""
    vt = ir.VectorType(ir.FloatType(), 16)
    if elem in (types.float32, types.uint32):
        return vs if elem == types.float32 else [bld.bitcast(v, ir.VectorType(_I32, 16))
                                                 for v in vs]
    i16v = ir.VectorType(_I16, 16)
    if elem == types.uint16 and _target_has(context, "avx512bf16", "avx512f"):
        i16x32 = ir.VectorType(_I16, 32)
        both = cgutils.get_or_insert_function(
            bld.module, ir.FunctionType(ir.VectorType(_BFloat(), 32), [vt, vt]),
            "llvm.x86.avx512bf16.cvtne2ps2bf16.512")          # (high half, low half)
        out = [bld.bitcast(bld.call(both, [vs[j + 1], vs[j]]), i16x32)
               for j in range(0, len(vs) - 1, 2)]
        if len(vs) % 2:
            out.append(bld.bitcast(bld.fptrunc(vs[-1], ir.VectorType(_BFloat(), 16)), i16v))
        return out
    if elem == types.int16 and _target_has(context, "f16c"):
        return [bld.bitcast(bld.fptrunc(v, ir.VectorType(ir.HalfType(), 16)), i16v) for v in vs]
    bits = _bf16_bits if elem == types.uint16 else _f16_bits
    return [bld.trunc(bits(bld, bld.bitcast(v, ir.VectorType(_I32, 16))), i16v) for v in vs]


_AFFINE_OUT = (types.float32, types.uint32, types.uint16, types.int16)

_PREFETCH_TILES = 2     # the output rows of the tile this many tiles ahead are prefetched


class _AffineOut:
    """The output side the affine intrinsics share (:func:`affine_rows`, :func:`affine_pairs`),
    emitted into one codegen: rows ``n`` of ``y`` from element ``n * ys_`` (``yp`` already at
    the first), the bias row ``cp``, ``n_rows`` rows of ``m_n`` columns. A tile is ``rows``
    rows by ``width`` vectors of 16 columns from column ``m0``; its sums are in
    ``accs[i * width + j]``."""

    def __init__(self, context, bld, elem, yp, ys_, nr_, m_n_, cp):
        self.context, self.bld, self.elem = context, bld, elem
        self.et = context.get_value_type(elem)
        self.esize = context.get_abi_sizeof(self.et)
        self.intp = context.get_value_type(types.intp)
        self.yp, self.ys_, self.nr_, self.m_n_, self.cp = yp, ys_, nr_, m_n_, cp
        self.vt = ir.VectorType(ir.FloatType(), 16)
        i8 = ir.IntType(8)
        self.prefetch = cgutils.get_or_insert_function(
            bld.module, ir.FunctionType(ir.VoidType(), [i8.as_pointer(), _I32, _I32, _I32]),
            "llvm.prefetch.p0")

    def c(self, v):
        return ir.Constant(self.intp, v)

    def store_row(self, vs, at):
        """Vectors ``vs`` (consecutive columns) rounded into ``y`` from element ``at``."""
        bld = self.bld
        for v in _rounded_bits(self.context, bld, vs, self.elem):
            bld.store(v, bld.bitcast(bld.gep(self.yp, [at], source_etype=self.et),
                                     v.type.as_pointer()), align=1)
            at = bld.add(at, self.c(v.type.count))

    def prefetch_rows(self, n0, rows, m0, width):
        """Prefetch for writing the output lines of the tile ``_PREFETCH_TILES`` ahead (past
        the last row, the last row again: a prefetch does not fault, but it would fetch another
        buffer's line)."""
        bld, c = self.bld, self.c
        last = bld.sub(self.nr_, c(1))
        for i in range(rows):
            n = bld.add(n0, c(_PREFETCH_TILES * rows + i))
            n = bld.select(bld.icmp_signed("<", n, self.nr_), n, last)
            for q in range(0, 16 * width, 64 // self.esize):    # a cache line at a time
                p = bld.gep(self.yp, [bld.add(bld.mul(n, self.ys_), bld.add(m0, c(q)))],
                            source_etype=self.et)
                bld.call(self.prefetch, [bld.bitcast(p, ir.IntType(8).as_pointer()), _c32(1),
                                         _c32(3), _c32(1)])

    def finish(self, accs, n0, rows, m0, width):
        """The tile's sums plus the bias, rounded into its rows."""
        bld, c, vt = self.bld, self.c, self.vt
        bias_v = [bld.load(bld.bitcast(bld.gep(self.cp, [bld.add(m0, c(16 * j))],
                                               source_etype=ir.FloatType()), vt.as_pointer()),
                           typ=vt, align=4) for j in range(width)]
        for i in range(rows):
            self.store_row([bld.fadd(bld.load(accs[i * width + j], typ=vt), bias_v[j])
                            for j in range(width)],
                           bld.add(bld.mul(bld.add(n0, c(i)), self.ys_), m0))

    def over_tiles(self, tile):
        """``tile(n0, rows, m0, width, ahead)`` over the full vectors of every row: four vectors
        by four rows, then one vector by eight rows where fewer than four remain; rows past the
        last full tile one at a time (``ahead``: whether to prefetch). Returns the number of
        full vectors (columns past them are the caller's)."""
        bld, c = self.bld, self.c

        def all_rows(m0, width):
            rows = 4 if width == 4 else 8
            n_t = bld.udiv(self.nr_, c(rows))
            with cgutils.for_range(bld, n_t) as g:
                tile(bld.mul(g.index, c(rows)), rows, m0, width, True)
            with cgutils.for_range_slice(bld, bld.mul(n_t, c(rows)), self.nr_, c(1)) as (n, _):
                tile(n, 1, m0, width, False)
        n_vec = bld.ashr(self.m_n_, c(4))
        n_4 = bld.ashr(n_vec, c(2))
        with cgutils.for_range(bld, n_4) as g:
            all_rows(bld.mul(g.index, c(64)), 4)
        with cgutils.for_range_slice(bld, bld.shl(n_4, c(2)), n_vec, c(1)) as (v, _):
            all_rows(bld.shl(v, c(4)), 1)
        return n_vec


@intrinsic
def affine_rows(typingctx, y, yi, ys, a, ai, as_, b, bias, n_rows, k_n, m_n, w):
    """``y[yi + n * ys + m] = (sum_k a_n[k] * b[k * m_n + m]) + bias[m]`` for ``n < n_rows``,
    ``m < m_n``: rows of coefficients times a float32 ``k_n x m_n`` matrix plus a bias row,
    stored in ``y``'s element type (float32, or the bits of float32 / bfloat16 / float16:
    uint32 / uint16 / int16; rounded to nearest even, :func:`_rounded_bits`). ``a_n[k]`` is
    element ``ai + n * as_ + k`` of a float32 array ``a``, or the bfloat16 at byte ``ai + n *
    as_ + 2 * k`` of a byte array ``a``. The learned codec's encode (float32 rows) and decode
    (bfloat16 rows). ``w``: float32 scratch of at least ``8 * k_n`` (bfloat16 rows only).

    Register tiles of four rows by four vectors of 16 columns, or of eight rows by one vector
    where fewer than four vectors remain. Each vector of ``b`` loaded for a ``k``
    feeds every row of the tile, and the tile's independent chains of fused multiply-adds hide
    their latency (a single row's four chains wait on it: about half the rate). Coefficients
    are taken as broadcasts from memory (a load, not a shuffle that would compete with the
    multiply-adds for their port). bfloat16 ones are widened into ``w`` first, 16 at a time
    without a shuffle: their 32 bytes read as eight 32-bit words, each holding coefficients
    ``2j`` (low half) and ``2j + 1`` (high half), give the even ones shifted left by 16 and
    the odd ones masked, stored as ``[a0, a2, .., a14, a1, a3, .., a15]``; the ``k`` loop
    reads them from there (widening 16 lanes in order takes a cross-lane shuffle and a shift,
    which measured slower). Rows past the last full tile one at a time; columns past the last
    full vector one at a time.

    Sums run over ``k`` in order from zero, one rounding per multiply-add, the bias added last
    as the reference adds the mean after its product: the decoded bytes then match the
    reference's wherever its product sums in the same order (a store's tests compare them
    exactly). That last addition is not free: on an AMD Zen 4 core a tile's 16 additions cost
    about what 16 more multiply-adds do, a sixteenth of the work at rank 16; starting the sums
    at the bias would save it but round differently.

    The output rows of the tile ``_PREFETCH_TILES`` ahead are prefetched for writing: a
    batch's decoded rows are larger than the caches and a store that misses waits for its line
    (past the last row, the last row again: a prefetch does not fault, but it would fetch
    another buffer's line). Indices are not checked."""
    f32 = types.float32
    if not (isinstance(y, types.Array) and y.dtype in _AFFINE_OUT and y.layout == "C"
            and isinstance(a, types.Array) and a.dtype in (types.uint8, f32) and a.layout == "C"
            and all(isinstance(v, types.Array) and v.dtype == f32 and v.layout == "C"
                    for v in (b, bias, w))
            and all(isinstance(v, types.Integer) for v in (yi, ys, ai, as_, n_rows, k_n, m_n))):
        return None
    sig = types.void(y, yi, ys, a, ai, as_, b, bias, n_rows, k_n, m_n, w)
    elem, packed = y.dtype, a.dtype == types.uint8

    def codegen(context, builder, signature, args):
        bld = builder
        ft = ir.FloatType()
        vt = ir.VectorType(ft, 16)
        et = context.get_value_type(elem)
        i8 = ir.IntType(8)
        yp, ap, bp, cp, wp = (context.make_array(signature.args[j])(context, bld, args[j]).data
                              for j in (0, 3, 6, 7, 11))
        yi_, ys_, ai_, as__, nr_, k_n_, m_n_ = (
            context.cast(bld, args[j], signature.args[j], types.intp) for j in (1, 2, 4, 5, 8, 9, 10))
        yp = bld.gep(yp, [yi_], source_etype=et)
        out = _AffineOut(context, bld, elem, yp, ys_, nr_, m_n_, cp)
        c = out.c
        ap = bld.gep(ap, [ai_], source_etype=i8 if packed else ft)
        fma_v = cgutils.get_or_insert_function(bld.module, ir.FunctionType(vt, [vt, vt, vt]),
                                               "llvm.fma.v16f32")
        fma_s = cgutils.get_or_insert_function(bld.module, ir.FunctionType(ft, [ft, ft, ft]),
                                               "llvm.fma.f32")
        accs = [cgutils.alloca_once(bld, vt) for _ in range(16)]
        acc_s = cgutils.alloca_once(bld, ft)
        mask0 = ir.Constant(ir.VectorType(_I32, 16), [0] * 16)
        zero_v = ir.Constant(vt, [0.0] * 16)
        i32x8, f32x8 = ir.VectorType(_I32, 8), ir.VectorType(ft, 8)
        n_full = bld.shl(bld.ashr(k_n_, c(4)), c(4))      # coefficients in groups of 16

        def splat(x):
            v = bld.insert_element(ir.Constant(vt, ir.Undefined), x, ir.Constant(_I32, 0))
            return bld.shuffle_vector(v, ir.Constant(vt, ir.Undefined), mask0)

        def at_f(p, i):
            return bld.gep(p, [i], source_etype=ft)

        def vload(p, i):
            return bld.load(bld.bitcast(at_f(p, i), vt.as_pointer()), typ=vt, align=4)

        def rows_at(n0, rows):
            """(pointer, row pitch) of the float32 coefficients of rows n0 .. n0 + rows - 1:
            ``a`` itself, or bfloat16 rows widened into ``w`` (groups of 16 even then odd,
            :func:`w_index`)."""
            if not packed:
                return bld.gep(ap, [bld.mul(n0, as__)], source_etype=ft), as__
            for i in range(rows):
                src = bld.gep(ap, [bld.mul(bld.add(n0, c(i)), as__)], source_etype=i8)
                dst = bld.mul(c(i), k_n_)
                with cgutils.for_range_slice(bld, c(0), n_full, c(16)) as (k0, _):
                    p = bld.gep(src, [bld.shl(k0, c(1))], source_etype=i8)
                    pairs = bld.load(bld.bitcast(p, i32x8.as_pointer()), typ=i32x8, align=1)
                    even = bld.shl(pairs, ir.Constant(i32x8, [16] * 8))
                    odd = bld.and_(pairs, ir.Constant(i32x8, [-0x10000] * 8))
                    for half, v in ((0, even), (8, odd)):
                        q = at_f(wp, bld.add(dst, bld.add(k0, c(half))))
                        bld.store(bld.bitcast(v, f32x8), bld.bitcast(q, f32x8.as_pointer()),
                                  align=4)
                with cgutils.for_range_slice(bld, n_full, k_n_, c(1)) as (k, _):
                    p = bld.gep(src, [bld.shl(k, c(1))], source_etype=i8)
                    h = bld.load(bld.bitcast(p, _I16.as_pointer()), typ=_I16, align=1)
                    bld.store(bld.bitcast(bld.shl(bld.zext(h, _I32), _c32(16)), ft),
                              at_f(wp, bld.add(dst, k)))
            return wp, k_n_

        def w_index(k):
            """Where coefficient ``k`` of a row is in ``w``: in a group of 16, the even ones
            first; past the last full group, in order."""
            if not packed:
                return k
            o = bld.and_(k, c(15))
            at = bld.add(bld.sub(k, o), bld.add(bld.lshr(o, c(1)), bld.shl(bld.and_(o, c(1)),
                                                                           c(3))))
            return bld.select(bld.icmp_signed("<", k, n_full), at, k)

        def tile(n0, rows, m0, width, ahead):
            """Rows n0 .. n0 + rows - 1, columns m0 .. m0 + 16 * width - 1."""
            cf, pitch = rows_at(n0, rows)
            if ahead:
                out.prefetch_rows(n0, rows, m0, width)
            for j in range(width):
                for i in range(rows):
                    bld.store(zero_v, accs[i * width + j])
            with cgutils.for_range(bld, k_n_) as k:
                kw = w_index(k.index)
                avs = [splat(bld.load(at_f(cf, bld.add(bld.mul(c(i), pitch), kw)), typ=ft))
                       for i in range(rows)]
                row = bld.add(bld.mul(k.index, m_n_), m0)
                for j in range(width):
                    bv = vload(bp, bld.add(row, c(16 * j)))
                    for i in range(rows):
                        acc = accs[i * width + j]
                        bld.store(bld.call(fma_v, [avs[i], bv, bld.load(acc, typ=vt)]), acc)
            out.finish(accs, n0, rows, m0, width)

        n_vec = out.over_tiles(tile)
        with cgutils.for_range_slice(bld, bld.shl(n_vec, c(4)), m_n_, c(1)) as (m, _):
            with cgutils.for_range(bld, nr_) as n:         # columns past the last vector
                cf, _ = rows_at(n.index, 1)
                bld.store(ir.Constant(ft, 0.0), acc_s)
                with cgutils.for_range(bld, k_n_) as k:
                    av = bld.load(at_f(cf, w_index(k.index)), typ=ft)
                    bv = bld.load(at_f(bp, bld.add(bld.mul(k.index, m_n_), m)), typ=ft)
                    bld.store(bld.call(fma_s, [av, bv, bld.load(acc_s, typ=ft)]), acc_s)
                v = splat(bld.fadd(bld.load(acc_s, typ=ft), bld.load(at_f(cp, m), typ=ft)))
                e = bld.extract_element(_rounded_bits(context, bld, [v], elem)[0],
                                        ir.Constant(_I32, 0))
                bld.store(e, bld.gep(yp, [bld.add(bld.mul(n.index, ys_), m)], source_etype=et))
        return context.get_dummy_value()
    return sig, codegen


def pairs_signature(y, yi, ys, a, ai, as_, bp, bias, n_rows, k_n, m_n):
    """The signature of an intrinsic in the bfloat16 pair form (:func:`affine_pairs`,
    :func:`ucm.fast.numba._amx.affine_tiles`): ``y`` an output array of an affine element type,
    ``a`` bytes, ``bp`` uint32 pairs, ``bias`` float32, all C-contiguous, the rest integers; None
    (no match) otherwise."""
    if not (isinstance(y, types.Array) and y.dtype in _AFFINE_OUT and y.layout == "C"
            and isinstance(a, types.Array) and a.dtype == types.uint8 and a.layout == "C"
            and isinstance(bp, types.Array) and bp.dtype == types.uint32 and bp.layout == "C"
            and isinstance(bias, types.Array) and bias.dtype == types.float32
            and bias.layout == "C"
            and all(isinstance(v, types.Integer) for v in (yi, ys, ai, as_, n_rows, k_n, m_n))):
        return None
    return types.void(y, yi, ys, a, ai, as_, bp, bias, n_rows, k_n, m_n)


def pairs_operands(context, bld, signature, args) -> tuple:
    """The operands of a pair-form call in its codegen: ``(out, a, bp, as_, k_n)``: the
    :class:`_AffineOut` over ``y``'s rows from element ``yi``, a byte pointer at byte ``ai`` of
    ``a``, the pairs' data pointer, and the coefficients' pitch and count as ``intp``."""
    elem = signature.args[0].dtype
    yp, ap, bpp, cp = (context.make_array(signature.args[j])(context, bld, args[j]).data
                       for j in (0, 3, 6, 7))
    yi_, ys_, ai_, as__, nr_, k_n_, m_n_ = (
        context.cast(bld, args[j], signature.args[j], types.intp) for j in (1, 2, 4, 5, 8, 9, 10))
    yp = bld.gep(yp, [yi_], source_etype=context.get_value_type(elem))
    i8 = ir.IntType(8)
    ap = bld.gep(bld.bitcast(ap, i8.as_pointer()), [ai_], source_etype=i8)
    return _AffineOut(context, bld, elem, yp, ys_, nr_, m_n_, cp), ap, bpp, as__, k_n_


@intrinsic
def affine_pairs(typingctx, y, yi, ys, a, ai, as_, bp, bias, n_rows, k_n, m_n):
    """:func:`affine_rows` for bfloat16 coefficients and a bfloat16 matrix, two coefficients
    per step: ``y[yi + n * ys + m] = (sum_k a_n[k] * b[k][m]) + bias[m]``, ``a_n[k]`` the
    bfloat16 at byte ``ai + n * as_ + 2 * k`` of the byte array ``a``, ``b`` given as pairs:
    ``bp`` uint32 ``[k_n / 2, m_n]``, element ``j * m_n + m`` holding the bfloat16 bits of
    ``b[2j][m]`` (high half) and ``b[2j + 1][m]`` (low half). Needs an even ``k_n`` and ``m_n``
    a multiple of 16 (callers check). The learned codec's decode.

    With AVX512-BF16 each pair of coefficients is one ``vdpbf16ps`` per 16 columns and row: the
    coefficients' 32-bit pair broadcast from memory, no widening, half the instructions of the
    float32 multiply-adds :func:`affine_rows` issues. Elsewhere the same sums by two fused
    multiply-adds per pair on the halves widened to float32. The instruction adds the high
    halves' product first, so the coefficients' pair is rotated to put ``a[2j]`` there and the
    basis is paired the same way: both paths sum over ``k`` in order from zero, each product
    (exact in float32: two bfloat16 values) rounded once into the sum, as :func:`affine_rows`
    does, and agree with it but for subnormals, which the instruction flushes to zero. Tiles,
    bias and rounding as :func:`affine_rows`. Indices are not checked."""
    sig = pairs_signature(y, yi, ys, a, ai, as_, bp, bias, n_rows, k_n, m_n)
    if sig is None:
        return None

    def codegen(context, builder, signature, args):
        bld = builder
        ft = ir.FloatType()
        vt = ir.VectorType(ft, 16)
        iv = ir.VectorType(_I32, 16)
        i8 = ir.IntType(8)
        dp_ok = _target_has(context, "avx512bf16", "avx512f")
        out, ap, bpp, as__, k_n_ = pairs_operands(context, bld, signature, args)
        c, m_n_ = out.c, out.m_n_
        if dp_ok:
            bt = ir.VectorType(_BFloat(), 32)
            dp = cgutils.get_or_insert_function(bld.module, ir.FunctionType(vt, [vt, bt, bt]),
                                                "llvm.x86.avx512bf16.dpbf16ps.512")
        fma_v = cgutils.get_or_insert_function(bld.module, ir.FunctionType(vt, [vt, vt, vt]),
                                               "llvm.fma.v16f32")
        rot = cgutils.get_or_insert_function(bld.module, ir.FunctionType(_I32, [_I32] * 3),
                                             "llvm.fshl.i32")
        accs = [cgutils.alloca_once(bld, vt) for _ in range(16)]
        zero_v = ir.Constant(vt, [0.0] * 16)
        mask0 = ir.Constant(iv, [0] * 16)
        hi_mask = ir.Constant(iv, [-0x10000] * 16)
        sh16 = ir.Constant(iv, [16] * 16)
        n_pairs = bld.ashr(k_n_, c(1))

        def splat_i(x):
            v = bld.insert_element(ir.Constant(iv, ir.Undefined), x, ir.Constant(_I32, 0))
            return bld.shuffle_vector(v, ir.Constant(iv, ir.Undefined), mask0)

        def vload_i(p, i):
            q = bld.gep(p, [i], source_etype=_I32)
            return bld.load(bld.bitcast(q, iv.as_pointer()), typ=iv, align=4)

        def step(acc, av, bv):
            """acc + high * high, then + low * low, lane by lane (av, bv: pairs as i32)."""
            if dp_ok:
                return bld.call(dp, [acc, bld.bitcast(av, bt), bld.bitcast(bv, bt)])
            odd = bld.call(fma_v, [bld.bitcast(bld.and_(av, hi_mask), vt),
                                   bld.bitcast(bld.and_(bv, hi_mask), vt), acc])
            return bld.call(fma_v, [bld.bitcast(bld.shl(av, sh16), vt),
                                    bld.bitcast(bld.shl(bv, sh16), vt), odd])

        def tile(n0, rows, m0, width, ahead):
            if ahead:
                out.prefetch_rows(n0, rows, m0, width)
            for j in range(width):
                for i in range(rows):
                    bld.store(zero_v, accs[i * width + j])
            srcs = [bld.gep(ap, [bld.mul(bld.add(n0, c(i)), as__)], source_etype=i8)
                    for i in range(rows)]
            with cgutils.for_range(bld, n_pairs) as k:
                off = bld.shl(k.index, c(2))
                # the pair (a[2k] low, a[2k + 1] high) rotated by 16 bits: a[2k] in the high
                # half, which the instruction multiplies first
                avs = [splat_i(bld.call(rot, [x, x, _c32(16)])) for x in (
                    bld.load(bld.bitcast(bld.gep(s, [off], source_etype=i8), _I32.as_pointer()),
                             typ=_I32, align=1) for s in srcs)]
                row = bld.add(bld.mul(k.index, m_n_), m0)
                for j in range(width):
                    bv = vload_i(bpp, bld.add(row, c(16 * j)))
                    for i in range(rows):
                        acc = accs[i * width + j]
                        bld.store(step(bld.load(acc, typ=vt), avs[i], bv), acc)
            out.finish(accs, n0, rows, m0, width)

        out.over_tiles(tile)
        return context.get_dummy_value()
    return sig, codegen
