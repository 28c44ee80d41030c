"""The learned codec's decode on AMX tiles (Intel Sapphire Rapids and later).

:func:`affine_tiles` computes what :func:`ucm.fast.numba._elements.affine_pairs` does (rows of
bfloat16 coefficients times a bfloat16 basis, plus the mean, rounded into the output) for the
rows in whole groups of 16, one ``tdpbf16ps`` per 16 rows by 16 columns: a tile product does
the multiply-adds of 16 rows' ``vdpbf16ps`` in about the time of one, so the decode becomes
bound by its stores (the rows past the last group of 16 stay with ``affine_pairs``).

An AMX instruction traps unless the process asked Linux for the tile state first
(``arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)``). :func:`tiles_ready` does, once, and
says whether the decode may take this path: the CPU has AMX-BF16, numba compiles for it, and
the kernel granted the state. Everything else keeps ``affine_pairs``.
"""
from __future__ import annotations

import ctypes
import functools
import platform

from llvmlite import ir
from numba.core import cgutils
from numba.extending import intrinsic

from ucm.fast.numba._elements import _target_has, pairs_operands, pairs_signature

_ARCH_REQ_XCOMP_PERM = 0x1023
_XFEATURE_XTILEDATA = 18
_SYS_ARCH_PRCTL = 158          # x86-64

_TILE_ROWS = 16                # rows of a tile (tokens); the columns of a tile are 16 floats
_K_CHUNK = 32                  # coefficients per A tile (64 bytes a row, the tile's limit)
_A, _B = 0, (6, 7)             # tile registers: A, the B tiles alternately, C tiles 1..4


@functools.lru_cache(maxsize=None)
def tiles_ready() -> bool:
    """Whether :func:`affine_tiles` may run in this process: numba compiles for AMX-BF16 and
    Linux granted the tile state (asked the first time; False on other systems, CPUs or a
    refusal)."""
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        return False
    from numba.core.registry import cpu_target

    # the features numba compiles for (the host's, or NUMBA_CPU_NAME / NUMBA_CPU_FEATURES): the
    # intrinsic is empty where they lack AMX, and must then never be called
    features = set(cpu_target.target_context.codegen().magic_tuple()[2].split(","))
    if not {"+amx-tile", "+amx-bf16"} <= features:
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.syscall(_SYS_ARCH_PRCTL, _ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA) == 0
    except (OSError, AttributeError):
        return False


def tiles_fit(k_n: int, m_n: int) -> bool:
    """Whether :func:`affine_tiles` takes a rank ``k_n`` and ``m_n`` columns."""
    return (k_n > 0 and k_n % 2 == 0 and (k_n <= _K_CHUNK or k_n % _K_CHUNK == 0)
            and m_n > 0 and m_n % 16 == 0)


@intrinsic
def affine_tiles(typingctx, y, yi, ys, a, ai, as_, bp, bias, n_rows, k_n, m_n):
    """``y[yi + n * ys + m] = (sum_k a_n[k] * b[k][m]) + bias[m]`` for the rows ``n`` below
    ``16 * (n_rows // 16)``, ``m < m_n``: ``a_n[k]`` the bfloat16 at byte ``ai + n * as_ + 2 *
    k`` of the byte array ``a``; ``b`` as bfloat16 pairs ``bp`` uint32 ``[k_n / 2, m_n]``,
    element ``j * m_n + m`` holding ``b[2j][m]`` in its low half and ``b[2j + 1][m]`` in its
    high half (the tile instruction's order, not :func:`affine_pairs`'). Needs
    :func:`tiles_fit` and :func:`tiles_ready` (callers check; on a CPU without AMX-BF16 the
    intrinsic compiles to nothing). Bias and rounding as ``affine_pairs``.

    Per group of 16 rows and up to 4 column vectors: the C tiles zeroed; per chunk of 32
    coefficients the A tile (16 rows of coefficients) and each column's B tile loaded and
    multiplied; the C tiles stored to a stack buffer, read back as vectors, the bias added and
    rounded into ``y`` (:class:`~ucm.fast.numba._elements._AffineOut`, which also prefetches
    the output rows two groups ahead). Indices are not checked."""
    sig = pairs_signature(y, yi, ys, a, ai, as_, bp, bias, n_rows, k_n, m_n)
    if sig is None:
        return None

    def codegen(context, builder, signature, args):
        if not _target_has(context, "amx-tile", "amx-bf16"):
            return context.get_dummy_value()
        bld = builder
        ft, i8, i16, i64 = ir.FloatType(), ir.IntType(8), ir.IntType(16), ir.IntType(64)
        vt = ir.VectorType(ft, 16)
        p8 = i8.as_pointer()
        out, ap, bpp, as__, k_n_ = pairs_operands(context, bld, signature, args)
        c, nr_, m_n_ = out.c, out.nr_, out.m_n_
        bp8 = bld.bitcast(bpp, p8)

        def fn(name, ret, *argt):
            return cgutils.get_or_insert_function(bld.module, ir.FunctionType(ret, list(argt)),
                                                  name)
        void = ir.VoidType()
        ldcfg = fn("llvm.x86.ldtilecfg", void, p8)
        release = fn("llvm.x86.tilerelease", void)
        zero = fn("llvm.x86.tilezero", void, i8)
        load = fn("llvm.x86.tileloadd64", void, i8, p8, i64)
        store = fn("llvm.x86.tilestored64", void, i8, p8, i64)
        dp = fn("llvm.x86.tdpbf16ps", void, i8, i8, i8)

        def t(n):
            return ir.Constant(i8, n)

        # the tile configuration (palette 1): A 16 rows of 2 * chunk bytes; C 16 rows of 64
        # bytes; B chunk / 2 rows of 64 bytes
        chunk = bld.select(bld.icmp_signed("<", k_n_, c(_K_CHUNK)), k_n_, c(_K_CHUNK))
        cfg = cgutils.alloca_once(bld, ir.ArrayType(i8, 64), zfill=True)
        cfg8 = bld.bitcast(cfg, p8)
        bld.store(ir.Constant(ir.ArrayType(i8, 64), [0] * 64), cfg)
        bld.store(t(1), cfg8)
        colsb = bld.bitcast(bld.gep(cfg8, [c(16)], source_etype=i8), i16.as_pointer())
        rows = bld.gep(cfg8, [c(48)], source_etype=i8)
        half_chunk = bld.trunc(bld.lshr(chunk, c(1)), i8)
        for reg, cb, nr in ([(_A, bld.trunc(bld.shl(chunk, c(1)), i16), t(_TILE_ROWS))]
                            + [(j, ir.Constant(i16, 64), t(_TILE_ROWS)) for j in range(1, 5)]
                            + [(b, ir.Constant(i16, 64), half_chunk) for b in _B]):
            bld.store(cb, bld.gep(colsb, [c(reg)], source_etype=i16))
            bld.store(nr, bld.gep(rows, [c(reg)], source_etype=i8))
        bld.call(ldcfg, [cfg8])

        cbuf = bld.bitcast(cgutils.alloca_once(bld, ir.ArrayType(ft, 4 * 256)), p8)
        accs = [cgutils.alloca_once(bld, vt) for _ in range(16)]
        n_chunks = bld.udiv(bld.add(k_n_, c(_K_CHUNK - 1)), c(_K_CHUNK))
        b_pitch = bld.mul(m_n_, c(4))                       # bytes of a row of pairs

        def group(n0, m0, width):
            """Rows n0 .. n0 + 15, columns m0 .. m0 + 16 * width - 1."""
            out.prefetch_rows(n0, _TILE_ROWS, m0, width)
            for j in range(width):
                bld.call(zero, [t(1 + j)])
            with cgutils.for_range(bld, n_chunks) as kc:
                a_at = bld.add(bld.mul(n0, as__), bld.mul(kc.index, c(2 * _K_CHUNK)))
                bld.call(load, [t(_A), bld.gep(ap, [a_at], source_etype=i8), as__])
                b_row = bld.mul(bld.mul(kc.index, c(_K_CHUNK // 2)), b_pitch)
                for j in range(width):
                    b_at = bld.add(b_row, bld.mul(bld.add(m0, c(16 * j)), c(4)))
                    bld.call(load, [t(_B[j % 2]), bld.gep(bp8, [b_at], source_etype=i8), b_pitch])
                    bld.call(dp, [t(1 + j), t(_A), t(_B[j % 2])])
            for j in range(width):
                bld.call(store, [t(1 + j), bld.gep(cbuf, [c(1024 * j)], source_etype=i8),
                                 ir.Constant(i64, 64)])
            for r0 in range(0, _TILE_ROWS, 4):
                for i in range(4):
                    for j in range(width):
                        src = bld.gep(cbuf, [c(1024 * j + 64 * (r0 + i))], source_etype=i8)
                        v = bld.load(bld.bitcast(src, vt.as_pointer()), typ=vt, align=4)
                        bld.store(v, accs[i * width + j])
                out.finish(accs, bld.add(n0, c(r0)), 4, m0, width)

        n_groups = bld.udiv(nr_, c(_TILE_ROWS))
        n_vec = bld.ashr(m_n_, c(4))
        n_4 = bld.ashr(n_vec, c(2))
        with cgutils.for_range(bld, n_groups) as g:
            n0 = bld.mul(g.index, c(_TILE_ROWS))
            with cgutils.for_range(bld, n_4) as v4:
                group(n0, bld.mul(v4.index, c(64)), 4)
            with cgutils.for_range_slice(bld, bld.shl(n_4, c(2)), n_vec, c(1)) as (v, _):
                group(n0, bld.shl(v, c(4)), 1)
        bld.call(release, [])
        return context.get_dummy_value()
    return sig, codegen
