"""Paged decode attention, split-K ("flash decoding").

Program ``(b * num_kv_heads + g, s)`` takes KV head ``g`` of request ``b`` and the ``s``-th slice
of its tokens, reads each K/V tile once for the whole GQA group (the group's query heads, padded
to 16 rows, are the rows of one ``tl.dot``), follows the block table per token, runs an online
softmax in float32 (base 2) and writes a partial output and its log-sum-exp; a second launch
merges the slices per query head. Each tile's table entries are loaded one step ahead (the
first tile's alongside the length), so no K/V load waits for a table load of the same step.

float32 caches use exact float32 dots, and so do bfloat16 ones under the interpreter (its
bfloat16 ``tl.dot`` is wrong in Triton 3.9). The number of slices is chosen so that
``batch * num_kv_heads * slices`` fills one wave of programs (:func:`plan`). Any strides.
Per-KV-head tables (``[B, Hkv, M]`` tables and ``[B, Hkv]`` lengths, or a ``[B, Hkv, K]``
selection) are read per ``(b, g)`` row. With a selection (:func:`decode_selected`) the kernel
reads ``sel`` and the block table itself: :func:`sparse_block_table` folded in.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import triton
import triton.language as tl

from ucm.fast.triton import interpreting
from ucm.fast.triton.sparse.launch import LAUNCH, LOG2E, LaunchConfig, jit, pdl_launch, pow2, \
    sm_count


def _decode_split_kernel(q_ptr, k_ptr, v_ptr, table_ptr, lens_ptr, sel_ptr, count_ptr,
                         opart_ptr, lse_ptr,
                         q_stride_batch, q_stride_head, q_stride_dim,
                         k_stride_block, k_stride_token, k_stride_head, k_stride_dim,
                         v_stride_block, v_stride_token, v_stride_head, v_stride_dim,
                         table_stride_batch, table_stride_head, table_stride_block,
                         lens_stride_batch, lens_stride_head,
                         sel_stride_batch, sel_stride_head,
                         count_stride_batch, count_stride_head,
                         scale_log2, split_tokens, num_splits, table_tokens,
                         NUM_KV_HEADS: tl.constexpr, GROUP_SIZE: tl.constexpr,
                         GROUP_ROWS: tl.constexpr, HEAD_DIM: tl.constexpr,
                         HEAD_DIM_PADDED: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                         TOKEN_TILE: tl.constexpr, EXACT_F32: tl.constexpr,
                         SELECTED: tl.constexpr, PDL: tl.constexpr = False):
    """Partial attention of one GQA group over one slice of one request's tokens.

    Writes ``opart[b, h, s, :]`` (normalized partial output, float32) and ``lse[b, h, s]``
    (log2-sum-exp of the slice's scaled logits; ``-inf`` for an empty slice). SELECTED: the
    tokens are those of the selected logical blocks ``sel[b, :count[b]]`` (physical block
    ``table[b, sel[b, i]]``; only the last one, the sequence's last block, may be partial).
    ``table_tokens``: tokens the table (or selection) covers, the bound of the table loads.
    """
    if PDL:  # programmatic dependent launch: wait for the previous grid, let the next one launch
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    pid = tl.program_id(0)
    split = tl.program_id(1)
    b = pid // NUM_KV_HEADS
    g = pid % NUM_KV_HEADS
    # per-KV-head tables: the head strides pick KV head g's row (0 for one table per request)
    seq = tl.load(lens_ptr + b * lens_stride_batch + g * lens_stride_head)
    if SELECTED:
        last_len = seq - ((seq + BLOCK_SIZE - 1) // BLOCK_SIZE - 1) * BLOCK_SIZE
        count = tl.load(count_ptr + b * count_stride_batch + g * count_stride_head)
        seq = (count - 1) * BLOCK_SIZE + last_len
    start = split * split_tokens
    end = tl.minimum(start + split_tokens, seq)

    rows = tl.arange(0, GROUP_ROWS)
    heads = g * GROUP_SIZE + rows
    hmask = rows < GROUP_SIZE
    d = tl.arange(0, HEAD_DIM_PADDED)
    dmask = d < HEAD_DIM
    b64 = b.to(tl.int64)
    q = tl.load(q_ptr + b64 * q_stride_batch + heads[:, None] * q_stride_head
                + d[None, :] * q_stride_dim, mask=hmask[:, None] & dmask[None, :], other=0.0)
    m_i = tl.full([GROUP_ROWS], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_ROWS], tl.float32)
    acc = tl.zeros([GROUP_ROWS, HEAD_DIM_PADDED], tl.float32)
    k_head = k_ptr + g.to(tl.int64) * k_stride_head
    v_head = v_ptr + g.to(tl.int64) * v_stride_head
    k_col = d * k_stride_dim
    v_col = d * v_stride_dim
    cols = tl.arange(0, TOKEN_TILE)
    table_row = table_ptr + b64 * table_stride_batch + g * table_stride_head
    sel_row = sel_ptr + b64 * sel_stride_batch + g * sel_stride_head
    # the first tile's table entries, loaded alongside the length (not after it)
    t = start + cols
    imask = t < table_tokens
    if SELECTED:
        logical = tl.load(sel_row + t // BLOCK_SIZE, mask=imask, other=0)
        logical = tl.where(logical >= 0, logical, 0)
    else:
        logical = t // BLOCK_SIZE
    phys_next = tl.load(table_row + logical * table_stride_block, mask=imask, other=0)
    for t0 in range(start, end, TOKEN_TILE):
        t = t0 + cols
        tmask = t < end
        # this tile's entries came from the previous step; fetch the next tile's
        phys = phys_next.to(tl.int64)
        tn = t + TOKEN_TILE
        nmask = tn < table_tokens
        if SELECTED:
            nlogical = tl.load(sel_row + tn // BLOCK_SIZE, mask=nmask, other=0)
            nlogical = tl.where(nlogical >= 0, nlogical, 0)
        else:
            nlogical = tn // BLOCK_SIZE
        phys_next = tl.load(table_row + nlogical * table_stride_block, mask=nmask, other=0)
        off = t % BLOCK_SIZE
        kv_mask = tmask[:, None] & dmask[None, :]
        k = tl.load(k_head + phys[:, None] * k_stride_block + off[:, None] * k_stride_token
                    + k_col[None, :], mask=kv_mask, other=0.0)
        if EXACT_F32:
            s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        s = tl.where(tmask[None, :], s * scale_log2, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_head + phys[:, None] * v_stride_block + off[:, None] * v_stride_token
                    + v_col[None, :], mask=kv_mask, other=0.0)
        if EXACT_F32:
            acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new

    row = (b64 * (NUM_KV_HEADS * GROUP_SIZE) + heads) * num_splits + split    # [GROUP_ROWS]
    if start < end:
        lse = m_i + tl.log2(l_i)
        o = acc / l_i[:, None]
    else:
        lse = tl.full([GROUP_ROWS], float("-inf"), tl.float32)
        o = tl.zeros([GROUP_ROWS, HEAD_DIM_PADDED], tl.float32)
    tl.store(lse_ptr + row, lse, mask=hmask)
    tl.store(opart_ptr + row[:, None] * HEAD_DIM + d[None, :], o,
             mask=hmask[:, None] & dmask[None, :])


def _decode_merge_kernel(opart_ptr, lse_ptr, out_ptr,
                         out_stride_batch, out_stride_head, out_stride_dim, num_splits,
                         NUM_Q_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                         CHANNELS: tl.constexpr, SPLITS_PADDED: tl.constexpr,
                         PDL: tl.constexpr = False):
    """Merge the slices of one (request, query head) over one chunk of ``CHANNELS`` channels:
    weights ``2 ** (lse_s - max lse)``."""
    if PDL:  # programmatic dependent launch: wait for the previous grid, let the next one launch
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    pid = tl.program_id(0)
    b = pid // NUM_Q_HEADS
    h = pid % NUM_Q_HEADS
    s = tl.arange(0, SPLITS_PADDED)
    smask = s < num_splits
    d = tl.program_id(1) * CHANNELS + tl.arange(0, CHANNELS)
    dmask = d < HEAD_DIM
    base = pid.to(tl.int64) * num_splits
    lse = tl.load(lse_ptr + base + s, mask=smask, other=float("-inf"))
    m = tl.max(lse, 0)
    w = tl.where(smask & (lse > float("-inf")), tl.exp2(lse - m), 0.0)
    o = tl.load(opart_ptr + (base + s)[:, None] * HEAD_DIM + d[None, :],
                mask=smask[:, None] & dmask[None, :], other=0.0)
    res = tl.sum(o * w[:, None], 0) / tl.sum(w, 0)
    tl.store(out_ptr + b.to(tl.int64) * out_stride_batch + h * out_stride_head
             + d * out_stride_dim, res.to(out_ptr.dtype.element_ty), mask=dmask)


def split_length(max_tokens: int, splits: int, tile: int) -> tuple[int, int]:
    """``(num_splits, split_tokens)`` for about ``splits`` slices of whole token tiles."""
    split_tokens = math.ceil(math.ceil(max_tokens / splits) / tile) * tile
    return math.ceil(max_tokens / split_tokens), split_tokens


def plan(batch: int, num_kv_heads: int, max_tokens: int, device: torch.device,
         launch: LaunchConfig = LAUNCH) -> tuple[int, int]:
    """``(num_splits, split_tokens)`` for a decode launch: ``batch * num_kv_heads * num_splits``
    programs at most ``decode_programs_per_sm`` per multiprocessor (one wave when that many
    fit), each slice a multiple of the token tile and at least ``decode_min_split_tokens``
    long."""
    tile = launch.decode_block_n
    slots = launch.decode_programs_per_sm * sm_count(device) / (batch * num_kv_heads)
    want = max(1, math.floor(slots))
    most = max(1, max_tokens // max(launch.decode_min_split_tokens, tile))
    return split_length(max_tokens, min(want, most), tile)


def decode(q, k_cache, v_cache, block_table, seq_lens, scale: float, out=None, *,
           sel=None, count=None, num_splits: Optional[int] = None,
           launch: LaunchConfig = LAUNCH):
    """:func:`paged_decode_attention` with the launch's options: with ``sel, count`` from
    :func:`~ucm.fast.triton.sparse.select_blocks`, over the selected blocks only
    (:func:`decode_selected`); ``num_splits``: about that many slices instead of the planned
    count. Asynchronous."""
    B, Hq, D = q.shape
    _, bs, Hkv, _ = k_cache.shape
    group = Hq // Hkv
    tile = launch.decode_block_n
    selected = sel is not None
    if selected:
        sel = sel.contiguous()
    max_tokens = (sel if selected else block_table).shape[-1] * bs
    # per-KV-head tables ([B, Hkv, K] table or selection, [B, Hkv] lengths or counts)
    table_strides = (block_table.stride(0), block_table.stride(1) if block_table.dim() == 3 else 0,
                     block_table.stride(-1))
    lens_strides = (seq_lens.stride(0), seq_lens.stride(1)) if seq_lens.dim() == 2 else (1, 0)
    if selected:
        sel_strides = (sel.stride(0), sel.stride(1) if sel.dim() == 3 else 0)
        count_strides = (count.stride(0), count.stride(1)) if count.dim() == 2 else (1, 0)
    else:
        sel_strides = count_strides = (0, 0)
    if num_splits is None:
        num_splits, split_tokens = plan(B, Hkv, max_tokens, q.device, launch)
    else:
        num_splits, split_tokens = split_length(max_tokens, num_splits, tile)
    opart = torch.empty(B, Hq, num_splits, D, dtype=torch.float32, device=q.device)
    lse = torch.empty(B, Hq, num_splits, dtype=torch.float32, device=q.device)
    if out is None:
        out = torch.empty(B, Hq, D, dtype=q.dtype, device=q.device)
    dim_padded = pow2(D, 16)
    pdl = pdl_launch(q.device)
    jit(_decode_split_kernel)[(B * Hkv, num_splits)](
        q, k_cache, v_cache, block_table, seq_lens, sel if selected else seq_lens,
        count if selected else seq_lens, opart, lse,
        *q.stride(), *k_cache.stride(), *v_cache.stride(), *table_strides, *lens_strides,
        *sel_strides, *count_strides, scale * LOG2E, split_tokens, num_splits, max_tokens,
        NUM_KV_HEADS=Hkv, GROUP_SIZE=group, GROUP_ROWS=pow2(group, 16), HEAD_DIM=D,
        HEAD_DIM_PADDED=dim_padded, BLOCK_SIZE=bs, TOKEN_TILE=tile,
        EXACT_F32=q.dtype == torch.float32 or (interpreting() and q.dtype == torch.bfloat16),
        SELECTED=selected, num_warps=launch.decode_warps, num_stages=launch.decode_stages,
        **pdl)
    channels = min(dim_padded, max(16, pow2(launch.merge_channels)))
    jit(_decode_merge_kernel)[(B * Hq, triton.cdiv(D, channels))](
        opart, lse, out, *out.stride(), num_splits, NUM_Q_HEADS=Hq, HEAD_DIM=D,
        CHANNELS=channels, SPLITS_PADDED=pow2(num_splits), num_warps=4, **pdl)
    return out


def paged_decode_attention(q, k_cache, v_cache, block_table, seq_lens, *, scale: float,
                           out=None, launch: LaunchConfig = LAUNCH):
    """Same contract as :func:`ucm.reference.sparse.paged_decode_attention`; asynchronous."""
    return decode(q, k_cache, v_cache, block_table, seq_lens, scale, out, launch=launch)


def decode_selected(q, k_cache, v_cache, block_table, seq_lens, sel, count, *, scale: float,
                    out=None, launch: LaunchConfig = LAUNCH):
    """Sparse decode in one step: the result of ``paged_decode_attention(q, k_cache, v_cache,
    *sparse_block_table(block_table, seq_lens, sel, count, block_size))`` without building the
    sparse table (the kernel reads ``sel`` and ``block_table`` itself). Not a public op: inputs
    as validated by :func:`ucm.sparse.ops.sparse_block_table` (``sel, count`` from
    :func:`~ucm.fast.triton.sparse.select_blocks`); asynchronous."""
    return decode(q, k_cache, v_cache, block_table, seq_lens, scale, out, sel=sel, count=count,
                  launch=launch)
