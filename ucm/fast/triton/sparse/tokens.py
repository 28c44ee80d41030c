"""Every token's key in int4, and each block's attention mass under those keys (the ``mass``
method's ranking).

:func:`quantize_token_keys`: one program per (listed block, KV head) reads the block's keys,
takes each channel's largest magnitude over the tokens and writes the packed codes and float16
scales, bit-identical to :func:`ucm.reference.sparse.token_key_codes` (IEEE division, float16
rounding to nearest even).

:func:`score_token_mass`: one program per (request, KV head, run of blocks) takes a few blocks
at a time (``score_mass_rows`` token rows, whole blocks). Instead of dequantizing every key entry
it folds each block's channel scales into the query: the columns of one ``tl.dot`` are the pairs
(block of the tile, query head), ``q * scale[block]`` each, so the query heads' padding to 16
columns holds the tile's other blocks, and each token row keeps its own block's columns. The
nibbles become bfloat16 ``128 + n`` by integer ops (``n | 0x4300`` bit-cast) and
``136 * sum(q * scale)`` is taken off each column afterwards. Then each block's ``log-sum-exp``
of the scaled logits per query head. On a GPU the product runs in bfloat16 on the tensor cores
(``q * scale`` rounded; float32 sums; the ranking tolerates the rounding, the tests bound it);
float32 caches and the interpreter take exact float32 products. What it reads per block and KV
head is ``block_size * head_dim / 2`` code bytes and ``2 * head_dim`` scale bytes: a sixteenth
of the block's keys and values in bfloat16, plus a quarter of that.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ucm.fast.triton import interpreting
from ucm.fast.triton.sparse.launch import LAUNCH, LOG2E, LaunchConfig, jit, pow2


def _quantize_kernel(k_ptr, ids_ptr, codes_ptr, scale_ptr,
                     k_stride_block, k_stride_token, k_stride_head, k_stride_dim,
                     NUM_KV_HEADS: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                     TOKENS_PADDED: tl.constexpr, HALF: tl.constexpr,
                     HALF_PADDED: tl.constexpr):
    i = tl.program_id(0)
    h = tl.program_id(1)
    blk = tl.load(ids_ptr + i).to(tl.int64)
    t = tl.arange(0, TOKENS_PADDED)
    c = tl.arange(0, HALF_PADDED)
    m = (t < BLOCK_SIZE)[:, None] & (c < HALF)[None, :]
    base = k_ptr + blk * k_stride_block + h * k_stride_head + t[:, None] * k_stride_token
    out_row = (blk * NUM_KV_HEADS + h)
    cm = c < HALF
    x_lo = tl.load(base + c[None, :] * k_stride_dim, mask=m, other=0.0).to(tl.float32)
    x_hi = tl.load(base + (c + HALF)[None, :] * k_stride_dim, mask=m, other=0.0).to(tl.float32)
    x_lo = tl.where(x_lo == x_lo, x_lo, 0.0)                           # a NaN key counts as 0
    x_hi = tl.where(x_hi == x_hi, x_hi, 0.0)
    seven = tl.full([HALF_PADDED], 7.0, tl.float32)
    s_lo = tl.minimum(tl.math.div_rn(tl.max(tl.abs(x_lo), 0), seven), 65504.0).to(tl.float16)
    s_hi = tl.minimum(tl.math.div_rn(tl.max(tl.abs(x_hi), 0), seven), 65504.0).to(tl.float16)
    tl.store(scale_ptr + out_row * (2 * HALF) + c, s_lo, mask=cm)
    tl.store(scale_ptr + out_row * (2 * HALF) + HALF + c, s_hi, mask=cm)
    f_lo = s_lo.to(tl.float32)
    f_hi = s_hi.to(tl.float32)
    # finite scales and NaN-free keys: the quotient is never NaN
    r_lo = tl.math.div_rn(x_lo, tl.where(f_lo > 0, f_lo, 1.0)[None, :])
    r_hi = tl.math.div_rn(x_hi, tl.where(f_hi > 0, f_hi, 1.0)[None, :])
    r_lo = tl.where((f_lo > 0)[None, :], r_lo, 0.0)
    r_hi = tl.where((f_hi > 0)[None, :], r_hi, 0.0)
    lo = tl.floor(tl.minimum(tl.maximum(r_lo, -7.0), 7.0) + 0.5).to(tl.int32) + 8
    hi = tl.floor(tl.minimum(tl.maximum(r_hi, -7.0), 7.0) + 0.5).to(tl.int32) + 8
    packed = (lo | (hi << 4)).to(tl.uint8)
    tl.store(codes_ptr + (out_row * BLOCK_SIZE + t[:, None]) * HALF + c[None, :], packed, mask=m)


def quantize_token_keys(k_cache, block_ids, *, keys4, scale4) -> None:
    """Same contract as :func:`ucm.reference.sparse.quantize_token_keys`; asynchronous."""
    n = block_ids.numel()
    if n == 0:
        return
    _, bs, Hkv, D = k_cache.shape
    half = D // 2
    jit(_quantize_kernel)[(n, Hkv)](
        k_cache, block_ids, keys4, scale4, *k_cache.stride(), NUM_KV_HEADS=Hkv, BLOCK_SIZE=bs,
        TOKENS_PADDED=pow2(bs), HALF=half, HALF_PADDED=pow2(half), num_warps=4)


def _mass_kernel(q_ptr, codes_ptr, scale_ptr, table_ptr, nblk_ptr, out_ptr,
                 q_stride_batch, q_stride_head, q_stride_dim, table_stride_batch, M, per_prog,
                 scale_log2, inv_scale_log2,
                 NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr, HALF: tl.constexpr,
                 HALF_PADDED: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                 TOKENS_PADDED: tl.constexpr, BLOCKS: tl.constexpr, COLS: tl.constexpr,
                 EXACT_F32: tl.constexpr):
    pid = tl.program_id(0)
    b = pid // NUM_KV_HEADS
    h = pid % NUM_KV_HEADS
    start = tl.program_id(1) * per_prog
    n = tl.load(nblk_ptr + b)
    end = tl.minimum(start + per_prog, M)
    # column (block of the tile, query head): the heads of every block side by side
    col = tl.arange(0, COLS)
    cb = col // GROUP
    cg = col % GROUP
    colok = col < BLOCKS * GROUP
    c = tl.arange(0, HALF_PADDED)
    cmask = c < HALF
    qrow = q_ptr + b.to(tl.int64) * q_stride_batch + (h * GROUP + cg)[:, None] * q_stride_head
    qm = colok[:, None] & cmask[None, :]
    qlo = tl.load(qrow + c[None, :] * q_stride_dim, mask=qm, other=0.0).to(tl.float32)
    qhi = tl.load(qrow + (c + HALF)[None, :] * q_stride_dim, mask=qm, other=0.0).to(tl.float32)
    ROWS: tl.constexpr = BLOCKS * TOKENS_PADDED
    r = tl.arange(0, ROWS)
    rb = r // TOKENS_PADDED
    rt = r % TOKENS_PADDED
    tb = table_ptr + b.to(tl.int64) * table_stride_batch
    out_cols = out_ptr + (b * (NUM_KV_HEADS * GROUP) + h * GROUP + cg).to(tl.int64) * M
    mine = (rb[:, None] == cb[None, :]) & (rt < BLOCK_SIZE)[:, None]   # a row's own columns
    for j0 in range(start, end, BLOCKS):
        j = j0 + rb
        live = (j < n) & (j < end)
        phys = tl.load(tb + j, mask=live, other=0).to(tl.int64)
        lm = (live & (rt < BLOCK_SIZE))[:, None] & cmask[None, :]
        codes = tl.load(codes_ptr + ((phys * NUM_KV_HEADS + h) * BLOCK_SIZE + rt)[:, None] * HALF
                        + c[None, :], mask=lm, other=0x88)
        jc = j0 + cb
        livec = colok & (jc < n) & (jc < end)
        physc = tl.load(tb + jc, mask=livec, other=0).to(tl.int64)
        srow = scale_ptr + (physc * NUM_KV_HEADS + h)[:, None] * (2 * HALF)
        sm = livec[:, None] & cmask[None, :]
        slo = tl.load(srow + c[None, :], mask=sm, other=0.0).to(tl.float32)
        shi = tl.load(srow + HALF + c[None, :], mask=sm, other=0.0).to(tl.float32)
        if EXACT_F32:
            klo = ((codes & 15).to(tl.int32) - 8).to(tl.float32)
            khi = ((codes >> 4).to(tl.int32) - 8).to(tl.float32)
            logit = tl.dot(klo, tl.trans(qlo * slo), input_precision="ieee") \
                + tl.dot(khi, tl.trans(qhi * shi), input_precision="ieee")
        else:
            alo = (qlo * slo).to(tl.bfloat16)
            ahi = (qhi * shi).to(tl.bfloat16)
            # the nibbles as bfloat16(128 + n) by integer ops, 136 * sum(a) taken off after
            klo = ((codes & 15).to(tl.int16) | 0x4300).to(tl.bfloat16, bitcast=True)
            khi = ((codes >> 4).to(tl.int16) | 0x4300).to(tl.bfloat16, bitcast=True)
            off = 136.0 * (tl.sum(alo.to(tl.float32), 1) + tl.sum(ahi.to(tl.float32), 1))
            logit = tl.dot(klo, tl.trans(alo)) + tl.dot(khi, tl.trans(ahi)) - off[None, :]
        x = tl.where(mine, logit * scale_log2, float("-inf"))
        mx = tl.max(x, 0)
        safe = tl.where(mx > float("-inf"), mx, 0.0)
        lse = safe + tl.log2(tl.sum(tl.exp2(x - safe[None, :]), 0))
        res = tl.where(jc < n, lse * inv_scale_log2, float("-inf"))
        tl.store(out_cols + jc, res, mask=colok & (jc < end))


def score_token_mass(q, block_table, num_blocks, *, keys4, scale4, scale: float,
                     launch: LaunchConfig = LAUNCH):
    """Same contract as :func:`ucm.reference.sparse.score_token_mass`; asynchronous."""
    B, Hq, D = q.shape
    M = block_table.shape[1]
    _, Hkv, bs, half = keys4.shape
    out = torch.empty(B, Hq, M, dtype=torch.float32, device=q.device)
    tokens = pow2(bs, 16)
    blocks = max(1, launch.score_mass_rows // tokens)
    per_prog = max(blocks, launch.score_mass_blocks_per_program // blocks * blocks)
    group = Hq // Hkv
    jit(_mass_kernel)[(B * Hkv, triton.cdiv(M, per_prog))](
        q, keys4, scale4, block_table, num_blocks, out, *q.stride(), block_table.stride(0), M,
        per_prog, scale * LOG2E, 1.0 / (scale * LOG2E), NUM_KV_HEADS=Hkv, GROUP=group,
        HALF=half, HALF_PADDED=pow2(half, 16), BLOCK_SIZE=bs, TOKENS_PADDED=tokens,
        BLOCKS=blocks, COLS=pow2(blocks * group, 16),
        EXACT_F32=q.dtype == torch.float32 or interpreting(),
        num_warps=launch.score_mass_warps, num_stages=launch.score_mass_stages)
    return out
