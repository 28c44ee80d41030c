"""Block scoring: mean (dot product with the summary means), Quest (upper bound from the key
bounds) and Hamming (equal bits of hash codes).

Mean / Quest: one program per (request, tile of logical blocks; the tile shrinks until a batch of
one request fills the GPU), looping over the KV heads in a software-pipelined loop: the tile's
sub-block rows of one KV head (``[TILE_M * G, D]``, one coalesced load) meet the GQA group's
query heads in one ``tl.dot`` (Quest: two, ``max(q, 0) . kmax + min(q, 0) . kmin``), the maximum
over each block's ``G`` sub-blocks is taken on the product, then the sum over heads. Tables in
bfloat16 (or an int8 mean) meet a bfloat16 query with bfloat16 operands and float32
accumulation; anything else is scored in exact float32.

Hamming: one program per (request, tile), XOR + SWAR popcount against the code of each group's
summed query, the best sub-block per block.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ucm.fast.triton import interpreting
from ucm.fast.triton.sparse.launch import LAUNCH, LaunchConfig, jit, pow2, sm_count
from ucm.fast.triton.sparse.reprs import groups_of, hash_codes


def _score_dot_kernel(q_ptr, table_ptr, nblk_ptr, a_ptr, b_ptr, mask_ptr, out_ptr, scale_ptr,
                      q_stride_batch, q_stride_head, q_stride_dim,
                      table_stride_batch, table_stride_block, M,
                      NUM_KV_HEADS: tl.constexpr, GROUP_SIZE: tl.constexpr,
                      GROUP_ROWS: tl.constexpr, HEAD_DIM: tl.constexpr,
                      HEAD_DIM_PADDED: tl.constexpr, GROUPS: tl.constexpr,
                      GROUPS_PADDED: tl.constexpr, QUEST: tl.constexpr, HAS_MASK: tl.constexpr,
                      PER_HEAD: tl.constexpr, TILE_M: tl.constexpr, EXACT_F32: tl.constexpr,
                      QUANT: tl.constexpr, LOOP_STAGES: tl.constexpr):
    """Mean (QUEST False) or Quest scores of logical blocks ``[tile * TILE_M, +TILE_M)`` of
    request ``b``, as matrix products.

    The tile's sub-block rows of one KV head, ``[TILE_M * GROUPS_PADDED, HEAD_DIM]`` (row
    ``jj * GROUPS_PADDED + s``: block ``jj``, sub-block ``s``), meet the GQA group's query heads
    (padded to ``GROUP_ROWS`` rows) in one ``tl.dot``; the maximum over each block's ``GROUPS``
    sub-blocks is taken on the ``[GROUP_ROWS, TILE_M, GROUPS_PADDED]`` view of the product. The
    loop over KV heads is software-pipelined (``LOOP_STAGES`` stages). Quest's bound is two
    products: ``sum_d max(q_d kmin_d, q_d kmax_d) = max(q, 0) . kmax + min(q, 0) . kmin``
    (``kmin <= kmax``, as :func:`update_block_reprs` writes them); ``a`` is ``mean`` or
    ``kmax``, ``b`` ``kmin``. EXACT_F32: float32 operands and exact float32 products, else
    bfloat16 operands with float32 accumulation (their products are exact). QUANT (mean): an
    int8 ``mean`` (exact in bfloat16) whose products are scaled by each row's ``scale
    [num_blocks, GROUPS, NUM_KV_HEADS]`` after the product.
    """
    b = tl.program_id(0).to(tl.int64)
    j0 = tl.program_id(1) * TILE_M
    nb = tl.load(nblk_ptr + b)
    r = tl.arange(0, TILE_M * GROUPS_PADDED)
    jr = j0 + r // GROUPS_PADDED
    sr = r % GROUPS_PADDED
    rvalid = (jr < nb) & (sr < GROUPS)
    phys = tl.load(table_ptr + b * table_stride_batch + jr * table_stride_block, mask=rvalid,
                   other=0).to(tl.int64)
    j = j0 + tl.arange(0, TILE_M)
    valid = j < nb
    inside = j < M
    rows = tl.arange(0, GROUP_ROWS)
    hmask = rows < GROUP_SIZE
    d = tl.arange(0, HEAD_DIM_PADDED)
    dmask = d < HEAD_DIM
    qmask = hmask[:, None] & dmask[None, :]
    amask = rvalid[:, None] & dmask[None, :]
    total = tl.zeros([TILE_M], tl.float32)
    for g in tl.range(0, NUM_KV_HEADS, num_stages=LOOP_STAGES):
        heads = g * GROUP_SIZE + rows
        qg = tl.load(q_ptr + b * q_stride_batch + heads[:, None] * q_stride_head
                     + d[None, :] * q_stride_dim, mask=qmask, other=0.0)
        if EXACT_F32:
            qg = qg.to(tl.float32)
        if HAS_MASK:
            keep = tl.load(mask_ptr + (b * (NUM_KV_HEADS * GROUP_SIZE) + heads[:, None])
                           * HEAD_DIM + d[None, :], mask=qmask, other=0)
            qg = tl.where(keep != 0, qg, tl.zeros_like(qg))
        off = ((phys * GROUPS + sr) * NUM_KV_HEADS + g)[:, None] * HEAD_DIM + d[None, :]
        rep_a = tl.load(a_ptr + off, mask=amask, other=0)
        if EXACT_F32:
            rep_a = rep_a.to(tl.float32)
        elif QUANT:
            rep_a = rep_a.to(qg.dtype)                              # int8: exact in bfloat16
        if QUEST:
            rep_b = tl.load(b_ptr + off, mask=amask, other=0.0)
            if EXACT_F32:
                rep_b = rep_b.to(tl.float32)
            zero = tl.zeros_like(qg)
            q_pos = tl.where(qg > 0, qg, zero)                     # same dtype as qg
            q_neg = tl.where(qg < 0, qg, zero)
            if EXACT_F32:
                s = tl.dot(q_pos, tl.trans(rep_a), input_precision="ieee")
                s += tl.dot(q_neg, tl.trans(rep_b), input_precision="ieee")
            else:
                s = tl.dot(q_pos, tl.trans(rep_a))
                s += tl.dot(q_neg, tl.trans(rep_b))
        else:
            if EXACT_F32:
                s = tl.dot(qg, tl.trans(rep_a), input_precision="ieee")
            else:
                s = tl.dot(qg, tl.trans(rep_a))              # [GROUP_ROWS, TILE_M * GROUPS_PADDED]
            if QUANT:
                rs = tl.load(scale_ptr + (phys * GROUPS + sr) * NUM_KV_HEADS + g, mask=rvalid,
                             other=0.0)
                s = s * rs[None, :]
        s = tl.where(rvalid[None, :], s, float("-inf"))
        best = tl.max(tl.reshape(s, [GROUP_ROWS, TILE_M, GROUPS_PADDED]), 2)  # [GROUP_ROWS, TILE_M]
        if PER_HEAD:
            tl.store(out_ptr + (b * (NUM_KV_HEADS * GROUP_SIZE) + heads[:, None]) * M
                     + j[None, :], tl.where(valid[None, :], best, float("-inf")),
                     mask=hmask[:, None] & inside[None, :])
        total += tl.sum(tl.where(hmask[:, None], best, 0.0), 0)
    if not PER_HEAD:
        tl.store(out_ptr + b * M + j, tl.where(valid, total, float("-inf")), mask=inside)


def _hamming_kernel(table_ptr, nblk_ptr, codes_ptr, qcode_ptr, out_ptr,
                    table_stride_batch, table_stride_block, M,
                    NUM_KV_HEADS: tl.constexpr, KV_HEADS_PADDED: tl.constexpr,
                    GROUPS: tl.constexpr, WORDS: tl.constexpr, WORDS_PADDED: tl.constexpr,
                    PER_HEAD: tl.constexpr, TILE_M: tl.constexpr):
    """Hamming scores of logical blocks ``[tile * TILE_M, +TILE_M)`` of request ``b``: per KV
    head, equal bits between each sub-block's code and the code of the group's summed query
    (``qcode [B, NUM_KV_HEADS, WORDS]``), XOR + SWAR popcount, the best sub-block per block."""
    b = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1) * TILE_M + tl.arange(0, TILE_M)
    nb = tl.load(nblk_ptr + b)
    valid = j < nb
    inside = j < M
    phys = tl.load(table_ptr + b * table_stride_batch + j * table_stride_block, mask=valid,
                   other=0).to(tl.int64)
    g = tl.arange(0, KV_HEADS_PADDED)
    gmask = g < NUM_KV_HEADS
    w = tl.arange(0, WORDS_PADDED)
    wmask = w < WORDS
    m3 = valid[:, None, None] & gmask[None, :, None] & wmask[None, None, :]
    qw = tl.load(qcode_ptr + (b * NUM_KV_HEADS + g[:, None]) * WORDS + w[None, :],
                 mask=gmask[:, None] & wmask[None, :], other=0)
    best = tl.zeros([TILE_M, KV_HEADS_PADDED], tl.int32)
    for sub in tl.static_range(GROUPS):
        codes = tl.load(codes_ptr + ((phys[:, None, None] * GROUPS + sub) * NUM_KV_HEADS
                                     + g[None, :, None]) * WORDS + w[None, None, :],
                        mask=m3, other=0)
        x = (codes ^ qw[None, :, :]).to(tl.uint32, bitcast=True)
        x = x - ((x >> 1) & 0x55555555)                           # SWAR popcount
        x = (x & 0x33333333) + ((x >> 2) & 0x33333333)
        x = (x + (x >> 4)) & 0x0F0F0F0F
        x = x + (x >> 8)
        x = (x + (x >> 16)) & 0x3F
        diff = tl.sum(tl.where(m3, x, 0), 2)
        best = tl.maximum(best, WORDS * 32 - diff.to(tl.int32))
    score = best.to(tl.float32)                                    # [TILE_M, KV_HEADS_PADDED]
    if PER_HEAD:
        tl.store(out_ptr + (b * NUM_KV_HEADS + g[None, :]) * M + j[:, None],
                 tl.where(valid[:, None], score, float("-inf")),
                 mask=inside[:, None] & gmask[None, :])
    else:
        total = tl.sum(tl.where(gmask[None, :], score, 0.0), 1)
        tl.store(out_ptr + b * M + j, tl.where(valid, total, float("-inf")), mask=inside)


def score_tile(B: int, M: int, groups_padded: int, device: torch.device,
               launch: LaunchConfig = LAUNCH) -> int:
    """Blocks per mean / Quest scoring program (a power of two): ``score_rows`` sub-block rows,
    halved (down to the 16 columns ``tl.dot`` needs) until the grid has
    ``score_programs_per_sm`` programs per multiprocessor."""
    least = max(1, 16 // groups_padded)
    tile = max(least, min(pow2(M), launch.score_rows // groups_padded))
    enough = launch.score_programs_per_sm * sm_count(device)
    while tile > least and B * triton.cdiv(M, tile) < enough:
        tile //= 2
    return tile


def score_blocks(q, block_table, num_blocks, *, kind: str, mean=None, kmin=None, kmax=None,
                 codes=None, proj=None, channel_mask=None, reduce: str = "sum", mean_scale=None,
                 launch: LaunchConfig = LAUNCH):
    """Same contract as :func:`ucm.reference.sparse.score_blocks`; asynchronous."""
    B, Hq, D = q.shape
    M = block_table.shape[1]
    dev = q.device
    per_head = reduce == "none"
    dummy = torch.empty(1, dtype=torch.float32, device=dev)
    if kind == "hamming":
        G = groups_of(codes)
        Hkv, words = codes.shape[-2], codes.shape[-1]
        qsum = q.float().reshape(B, Hkv, Hq // Hkv, D).sum(2)
        qcode = hash_codes(qsum, proj).contiguous()
        out = torch.empty((B, Hkv, M) if per_head else (B, M), dtype=torch.float32, device=dev)
        heads_padded, words_padded = pow2(Hkv), pow2(words)
        fit = max(1, launch.hamming_tile_elems // (heads_padded * words_padded * G))
        tile = min(64, 1 << (fit.bit_length() - 1), pow2(M))         # a power of two
        jit(_hamming_kernel)[(B, triton.cdiv(M, tile))](
            block_table, num_blocks, codes.contiguous(), qcode, out, *block_table.stride(), M,
            NUM_KV_HEADS=Hkv, KV_HEADS_PADDED=heads_padded, GROUPS=G, WORDS=words,
            WORDS_PADDED=words_padded, PER_HEAD=per_head, TILE_M=tile, num_warps=4)
        return out
    if kind == "quest":
        rep_a, rep_b = kmax.contiguous(), kmin.contiguous()
    else:
        rep_a, rep_b = mean.contiguous(), dummy
    G = groups_of(rep_a)
    Hkv = rep_a.shape[-2]
    out = torch.empty((B, Hq, M) if per_head else (B, M), dtype=torch.float32, device=dev)
    cmask = dummy if channel_mask is None else channel_mask.contiguous().view(torch.uint8)
    groups_padded = pow2(G)
    tile = score_tile(B, M, groups_padded, dev, launch)
    exact = interpreting() or not (q.dtype == torch.bfloat16
                                   and rep_a.dtype in (torch.bfloat16, torch.int8))
    # an int8 mean comes with its scales (validated: only kind "mean" takes them)
    scales = dummy if mean_scale is None else mean_scale.contiguous()
    jit(_score_dot_kernel)[(B, triton.cdiv(M, tile))](
        q, block_table, num_blocks, rep_a, rep_b, cmask, out, scales, *q.stride(),
        *block_table.stride(), M,
        NUM_KV_HEADS=Hkv, GROUP_SIZE=Hq // Hkv, GROUP_ROWS=pow2(Hq // Hkv, 16), HEAD_DIM=D,
        HEAD_DIM_PADDED=pow2(D, 16), GROUPS=G, GROUPS_PADDED=groups_padded,
        QUEST=kind == "quest", HAS_MASK=channel_mask is not None, PER_HEAD=per_head,
        TILE_M=tile, EXACT_F32=exact, QUANT=mean_scale is not None,
        LOOP_STAGES=launch.score_loop_stages, num_warps=launch.score_warps,
        num_stages=launch.score_stages)
    return out
