"""Element conversions of the numba KV codecs (:mod:`ucm.fast.numba.compress`): bit patterns <->
float32 for the cache's element types, as integer arithmetic that rounds as ``Tensor.to`` does.

* bfloat16 -> float32 is ``bits << 16``; float32 -> bfloat16 and float16 round to nearest even
  (subnormals, overflow to inf, NaN canonical); float16 -> float32 is exact (a subnormal
  through its integer mantissa).
* ``bf16_up`` / ``bf16_down``: the reference's roundings of a scale up and a minimum down.
* Per element type (an array of the element bits: ``uint16`` bfloat16, ``int16`` float16,
  ``uint32`` float32; the type picks the conversion at compile time): :func:`ld` (as
  float32), :func:`st` (a float32, rounded), :func:`mag` (magnitude bits: ordered as ``|x|`` is
  for finite values, ``>= inf_mag(a)`` for NaN and infinities).

The hot conversions are LLVM IR on 32-bit integers: numba types arithmetic on narrower integers
as int64, which halves the vector lanes (measured: the INT8 decode 2x slower).
"""
from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba.core import types
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


@intrinsic
def to_bf16(typingctx, f):
    """float32 -> bfloat16 bits, round to nearest even (NaN: 0x7FC0), as Tensor.to does."""
    if f != types.float32:
        return None

    def codegen(context, builder, signature, args):
        b = builder
        x = b.bitcast(args[0], _I32)
        lsb = b.and_(b.lshr(x, _c32(16)), _c32(1))
        r = b.lshr(b.add(b.add(x, _c32(0x7FFF)), lsb), _c32(16))
        nan = b.icmp_unsigned(">", b.and_(x, _c32(0x7FFFFFFF)), _c32(0x7F800000))
        return b.trunc(b.select(nan, _c32(0x7FC0), r), _I16)
    return types.uint16(f), codegen


@intrinsic
def to_f16(typingctx, f):
    """float32 -> float16 bits, round to nearest even (subnormals; overflow: inf; NaN:
    0x7E00), as Tensor.to does."""
    if f != types.float32:
        return None

    def codegen(context, builder, signature, args):
        b = builder
        x = b.bitcast(args[0], _I32)
        sign = b.and_(b.lshr(x, _c32(16)), _c32(0x8000))
        a = b.and_(x, _c32(0x7FFFFFFF))
        r = b.sub(a, _c32(0x38000000))                    # rebias the exponent: 127 -> 15
        normal = b.lshr(b.add(b.add(r, _c32(0xFFF)), b.and_(b.lshr(r, _c32(13)), _c32(1))),
                        _c32(13))
        m = b.or_(b.and_(a, _c32(0x7FFFFF)), _c32(0x800000))
        s = b.sub(_c32(126), b.lshr(a, _c32(23)))         # subnormal: m * 2^(e-150) / 2^-24
        s = b.select(b.icmp_signed("<", s, _c32(14)), _c32(14), s)
        s = b.select(b.icmp_signed(">", s, _c32(25)), _c32(25), s)
        half = b.sub(b.shl(_c32(1), b.sub(s, _c32(1))), _c32(1))
        sub = b.lshr(b.add(b.add(m, half), b.and_(b.lshr(m, s), _c32(1))), s)
        h = b.select(b.icmp_unsigned(">=", a, _c32(0x33000000)), sub, _c32(0))
        h = b.select(b.icmp_unsigned(">=", a, _c32(0x38800000)), normal, h)
        h = b.select(b.icmp_unsigned(">=", a, _c32(0x477FF000)), _c32(0x7C00), h)  # >= 65520
        h = b.select(b.icmp_unsigned(">", a, _c32(0x7F800000)), _c32(0x7E00), h)
        return b.trunc(b.or_(h, sign), _I16)
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


def inf_mag(a):
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


@overload(inf_mag)
def _inf_mag_impl(a):
    if a.dtype == types.uint16:
        return lambda a: np.int32(0x7F80)
    if a.dtype == types.int16:
        return lambda a: np.int32(0x7C00)
    if a.dtype == types.uint32:
        return lambda a: np.int32(0x7F800000)


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


def _vec_store_bits(bld, v, elem):
    """A vector of 16 float32 ``v`` as the element bits of ``elem`` (numba dtype of the output
    array): float32 / uint32 as they are; float16 (int16) and bfloat16 (uint16) through LLVM's
    ``fptrunc``: round to nearest even, overflow to inf, one instruction per vector where the
    CPU has one (F16C, AVX512-BF16; that bfloat16 conversion flushes subnormals to zero, below
    the learned codec's tolerance)."""
    if elem in (types.float32, types.uint32):
        return v if elem == types.float32 else bld.bitcast(v, ir.VectorType(_I32, 16))
    half = ir.HalfType() if elem == types.int16 else _BFloat()
    return bld.bitcast(bld.fptrunc(v, ir.VectorType(half, 16)), ir.VectorType(_I16, 16))


_AFFINE_OUT = (types.float32, types.uint32, types.uint16, types.int16)


@intrinsic
def affine_rows(typingctx, y, yi, ys, a, ai, as_, b, bias, n_rows, k_n, m_n, w):
    """``y[yi + n * ys + m] = (sum_k a_n[k] * b[k * m_n + m]) + bias[m]`` for ``n < n_rows``,
    ``m < m_n``: rows of coefficients times a float32 ``k_n x m_n`` matrix plus a bias row,
    stored in ``y``'s element type (float32, or the bits of float32 / bfloat16 / float16:
    uint32 / uint16 / int16; rounded to nearest even). ``a_n[k]`` is element ``ai + n * as_ +
    k`` of a float32 array ``a``, or the bfloat16 at byte ``ai + n * as_ + 2 * k`` of a byte
    array ``a``. The learned codec's encode (float32 rows) and decode (bfloat16 rows). ``w``:
    float32 scratch of at least ``8 * k_n`` (bfloat16 rows only).

    Register tiles of four rows by four vectors of 16 columns, or of eight rows by one vector
    where fewer than four vectors remain. Each vector of ``b`` loaded for a ``k``
    feeds every row of the tile, and the tile's independent chains of fused multiply-adds hide
    their latency (a single row's four chains wait on it: about half the rate). Coefficients
    are taken as broadcasts from memory (a load, not a shuffle that would compete with the
    multiply-adds for their port), bfloat16 ones widened into ``w`` first, a vector per 16.
    Rows past the last full tile one at a time; columns past the last full vector one at a
    time. Sums run over ``k`` in order, the bias added last (as the reference adds the mean).
    Indices are not checked."""
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
        from numba.core import cgutils

        bld = builder
        ft = ir.FloatType()
        vt = ir.VectorType(ft, 16)
        et = context.get_value_type(elem)
        evt = ir.VectorType(et, 16)
        intp = context.get_value_type(types.intp)
        i8 = ir.IntType(8)

        def c(v):
            return ir.Constant(intp, v)
        yp, ap, bp, cp, wp = (context.make_array(signature.args[j])(context, bld, args[j]).data
                              for j in (0, 3, 6, 7, 11))
        yi_, ys_, ai_, as__, nr_, k_n_, m_n_ = (
            context.cast(bld, args[j], signature.args[j], types.intp) for j in (1, 2, 4, 5, 8, 9, 10))
        yp = bld.gep(yp, [yi_], source_etype=et)
        ap = bld.gep(ap, [ai_], source_etype=i8 if packed else ft)
        fma_v = cgutils.get_or_insert_function(bld.module, ir.FunctionType(vt, [vt, vt, vt]),
                                               "llvm.fma.v16f32")
        fma_s = cgutils.get_or_insert_function(bld.module, ir.FunctionType(ft, [ft, ft, ft]),
                                               "llvm.fma.f32")
        accs = [cgutils.alloca_once(bld, vt) for _ in range(16)]
        acc_s = cgutils.alloca_once(bld, ft)
        mask0 = ir.Constant(ir.VectorType(_I32, 16), [0] * 16)
        zero_v = ir.Constant(vt, [0.0] * 16)
        i16v, i32v = ir.VectorType(_I16, 16), ir.VectorType(_I32, 16)

        def splat(x):
            v = bld.insert_element(ir.Constant(vt, ir.Undefined), x, ir.Constant(_I32, 0))
            return bld.shuffle_vector(v, ir.Constant(vt, ir.Undefined), mask0)

        def at_f(p, i):
            return bld.gep(p, [i], source_etype=ft)

        def vload(p, i):
            return bld.load(bld.bitcast(at_f(p, i), vt.as_pointer()), typ=vt, align=4)

        def rows_at(n0, rows):
            """(pointer, row pitch) of the float32 coefficients of rows n0 .. n0 + rows - 1:
            ``a`` itself, or bfloat16 rows widened into ``w``."""
            if not packed:
                return bld.gep(ap, [bld.mul(n0, as__)], source_etype=ft), as__
            n_vec = bld.ashr(k_n_, c(4))
            for i in range(rows):
                src = bld.gep(ap, [bld.mul(bld.add(n0, c(i)), as__)], source_etype=i8)
                dst = bld.mul(c(i), k_n_)
                with cgutils.for_range(bld, n_vec) as v:
                    k0 = bld.shl(v.index, c(4))
                    p = bld.gep(src, [bld.shl(k0, c(1))], source_etype=i8)
                    h = bld.load(bld.bitcast(p, i16v.as_pointer()), typ=i16v, align=1)
                    f = bld.bitcast(bld.shl(bld.zext(h, i32v), ir.Constant(i32v, [16] * 16)), vt)
                    bld.store(f, bld.bitcast(at_f(wp, bld.add(dst, k0)), vt.as_pointer()),
                              align=4)
                with cgutils.for_range_slice(bld, bld.shl(n_vec, c(4)), k_n_, c(1)) as (k, _):
                    p = bld.gep(src, [bld.shl(k, c(1))], source_etype=i8)
                    h = bld.load(bld.bitcast(p, _I16.as_pointer()), typ=_I16, align=1)
                    bld.store(bld.bitcast(bld.shl(bld.zext(h, _I32), _c32(16)), ft),
                              at_f(wp, bld.add(dst, k)))
            return wp, k_n_

        def tile(n0, rows, m0, width):
            """Rows n0 .. n0 + rows - 1, columns m0 .. m0 + 16 * width - 1."""
            cf, pitch = rows_at(n0, rows)
            for j in range(width):
                for i in range(rows):
                    bld.store(zero_v, accs[i * width + j])
            with cgutils.for_range(bld, k_n_) as k:
                avs = [splat(bld.load(at_f(cf, bld.add(bld.mul(c(i), pitch), k.index)), typ=ft))
                       for i in range(rows)]
                row = bld.add(bld.mul(k.index, m_n_), m0)
                for j in range(width):
                    bv = vload(bp, bld.add(row, c(16 * j)))
                    for i in range(rows):
                        acc = accs[i * width + j]
                        bld.store(bld.call(fma_v, [avs[i], bv, bld.load(acc, typ=vt)]), acc)
            bias_v = [vload(cp, bld.add(m0, c(16 * j))) for j in range(width)]
            for i in range(rows):
                base = bld.add(bld.mul(bld.add(n0, c(i)), ys_), m0)
                for j in range(width):
                    v = bld.fadd(bld.load(accs[i * width + j], typ=vt), bias_v[j])
                    p = bld.gep(yp, [bld.add(base, c(16 * j))], source_etype=et)
                    bld.store(_vec_store_bits(bld, v, elem), bld.bitcast(p, evt.as_pointer()),
                              align=1)

        def all_rows(m0, width):
            rows = 4 if width == 4 else 8
            n_t = bld.udiv(nr_, c(rows))
            with cgutils.for_range(bld, n_t) as g:
                tile(bld.mul(g.index, c(rows)), rows, m0, width)
            with cgutils.for_range_slice(bld, bld.mul(n_t, c(rows)), nr_, c(1)) as (n, _):
                tile(n, 1, m0, width)
        n_vec = bld.ashr(m_n_, c(4))
        n_4 = bld.ashr(n_vec, c(2))
        with cgutils.for_range(bld, n_4) as g:
            all_rows(bld.mul(g.index, c(64)), 4)
        with cgutils.for_range_slice(bld, bld.shl(n_4, c(2)), n_vec, c(1)) as (v, _):
            all_rows(bld.shl(v, c(4)), 1)
        with cgutils.for_range_slice(bld, bld.shl(n_vec, c(4)), m_n_, c(1)) as (m, _):
            with cgutils.for_range(bld, nr_) as n:         # columns past the last vector
                cf, _ = rows_at(n.index, 1)
                bld.store(ir.Constant(ft, 0.0), acc_s)
                with cgutils.for_range(bld, k_n_) as k:
                    av = bld.load(at_f(cf, k.index), typ=ft)
                    bv = bld.load(at_f(bp, bld.add(bld.mul(k.index, m_n_), m)), typ=ft)
                    bld.store(bld.call(fma_s, [av, bv, bld.load(acc_s, typ=ft)]), acc_s)
                v = splat(bld.fadd(bld.load(acc_s, typ=ft), bld.load(at_f(cp, m), typ=ft)))
                e = bld.extract_element(_vec_store_bits(bld, v, elem), ir.Constant(_I32, 0))
                bld.store(e, bld.gep(yp, [bld.add(bld.mul(n.index, ys_), m)], source_etype=et))
        return context.get_dummy_value()
    return sig, codegen
