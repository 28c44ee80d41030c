"""Block selection and the sparse block table.

Every path gives exactly the reference's selection: the forced blocks (the first
``init_window``, the last ``local_window`` and the last block), then the best other blocks by
(score desc, index asc). Scores are compared through an order-preserving int32 image ``u`` of
their float32 bits (``bits ^ 0x7FFFFFFF`` for negative floats), NaN mapped to ``-inf`` and
``-0.0`` to ``+0.0`` first, so that ties and special values rank as the reference ranks them.

- Rows up to ``select_kernel_max_blocks``: one program per request holding its row in
  registers; a 17-step 4-ary search finds the threshold image (three probes counted in one
  packed reduction per step), ties go to the lower indexes through a prefix count, and a
  second prefix count compacts the chosen blocks.
- A few long rows (at most ``hist_max_rows`` of at least ``hist_min_blocks``): the histogram
  selection of :mod:`ucm.fast.triton.sparse.histogram`, three launches over the whole GPU.
- Longer rows: PyTorch glue, one ``torch.topk`` over unique int64 keys.

:func:`select_sparse_table` writes the attention's table in the same launch;
:func:`sparse_block_table` is one gather kernel.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ucm.fast.triton.sparse.histogram import select_hist
from ucm.fast.triton.sparse.launch import LAUNCH, LaunchConfig, jit, pow2


def _select_kernel(scores_ptr, nblk_ptr, budget_ptr, sel_ptr, count_ptr, M, width,
                   scores_stride_batch, scores_stride_block, table_ptr, lens_ptr, otable_ptr,
                   olens_ptr, table_stride_batch, table_stride_block,
                   INIT: tl.constexpr, LOCAL: tl.constexpr, M_PADDED: tl.constexpr,
                   TABLE: tl.constexpr, BLOCK_SIZE: tl.constexpr):
    """One request: forced blocks, then the ``r`` best other blocks by (score desc, index asc).

    The ``r``-th best image ``t`` is found by a 4-ary search over the int32 images ``u`` of the
    row (held in registers): the largest ``t`` with ``#(u >= t) >= r``. Blocks above ``t`` are
    taken, and of those equal to it the lowest indexes (an inclusive prefix count). TABLE: the
    chosen blocks' physical ids and the sparse length are written too.
    """
    b = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, M_PADDED)
    n = tl.load(nblk_ptr + b)
    valid = j < n
    forced = valid & ((j < INIT) | (j >= n - LOCAL) | (j == n - 1))
    s = tl.load(scores_ptr + b * scores_stride_batch + j * scores_stride_block, mask=valid,
                other=float("-inf"))
    s = tl.where(s != s, float("-inf"), s)                     # NaN ranks like -inf
    s = tl.where(s == 0.0, 0.0, s)                             # -0.0 ties with +0.0
    bits = s.to(tl.int32, bitcast=True)
    u = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)           # int32, ordered like the scores
    cand = valid & ~forced
    n_forced = tl.sum(forced.to(tl.int32), 0)
    keep = tl.minimum(n, tl.maximum(tl.load(budget_ptr + b), n_forced))
    r = keep - n_forced                                        # blocks still to take
    # 4-ary search for the largest t with #(u >= t) >= r, invariant lo <= t <= hi: three probes
    # per step, their counts packed in 21-bit fields of one int64 sum (one reduction)
    lo = tl.full([], -2147483648, tl.int64)
    hi = tl.full([], 2147483647, tl.int64)
    field = (1 << 21) - 1
    for _ in range(17):                                        # (2**32 - 1) / 4**16 < 1
        span = hi - lo
        t1 = lo + (span + 3) // 4
        t2 = lo + (2 * span + 3) // 4
        t3 = lo + (3 * span + 3) // 4
        packed = tl.sum(tl.where(cand, (u >= t1.to(tl.int32)).to(tl.int64)
                                 + ((u >= t2.to(tl.int32)).to(tl.int64) << 21)
                                 + ((u >= t3.to(tl.int32)).to(tl.int64) << 42), 0), 0)
        ok1 = (packed & field) >= r
        ok2 = ((packed >> 21) & field) >= r
        ok3 = (packed >> 42) >= r
        new_lo = tl.where(ok3, t3, tl.where(ok2, t2, tl.where(ok1, t1, lo)))
        hi = tl.where(ok3, hi, tl.where(ok2, t3 - 1, tl.where(ok1, t2 - 1, t1 - 1)))
        lo = new_lo
    above = cand & (u > lo.to(tl.int32))
    ties = cand & (u == lo.to(tl.int32))
    rank = tl.cumsum(ties.to(tl.int32), 0)
    chosen = forced | above | (ties & (rank <= r - tl.sum(above.to(tl.int32), 0)))
    pos = tl.cumsum(chosen.to(tl.int32), 0) - 1
    out = sel_ptr + b * width
    tl.store(out + pos, j, mask=chosen)
    tl.store(out + j, tl.full([M_PADDED], -1, tl.int32), mask=(j >= keep) & (j < width))
    tl.store(count_ptr + b, keep)
    if TABLE:  # sparse_block_table folded in: physical ids of the chosen blocks, and the length
        phys = tl.load(table_ptr + b * table_stride_batch + j * table_stride_block, mask=chosen,
                       other=0)
        tl.store(otable_ptr + b * width + pos, phys, mask=chosen)
        tl.store(otable_ptr + b * width + j, tl.zeros([M_PADDED], tl.int32),
                 mask=(j >= keep) & (j < width))
        n_tok = tl.load(lens_ptr + b)
        tl.store(olens_ptr + b, (keep - 1) * BLOCK_SIZE + n_tok
                 - ((n_tok + BLOCK_SIZE - 1) // BLOCK_SIZE - 1) * BLOCK_SIZE)


def _ordered_int(scores: torch.Tensor) -> torch.Tensor:
    """int64 image of float32 scores with the same order (``-0.0`` maps with ``+0.0``, NaN with
    ``-inf``)."""
    s = torch.nan_to_num(scores, nan=float("-inf"), posinf=float("inf"), neginf=float("-inf"))
    s = torch.where(s == 0, 0.0, s)
    bits = s.view(torch.int32).long()
    return torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits)  # negative floats: reverse magnitude


def _select_topk(scores, num_blocks, budget, init_window: int, local_window: int, width: int):
    """Long rows: one ``torch.topk`` over unique int64 keys (score image in the high half,
    ``M-1-j`` in the low half, forced blocks above everything, invalid ones below)."""
    B, M = scores.shape
    dev = scores.device
    j = torch.arange(M, device=dev)[None, :]
    n = num_blocks.long()[:, None]
    valid = j < n
    forced = ((j < init_window) | (j >= n - local_window) | (j == n - 1)) & valid
    count = torch.minimum(n[:, 0], torch.maximum(budget.long(), forced.sum(1)))
    key = _ordered_int(scores.float()) * (1 << 32) + ((M - 1) - j)
    key = torch.where(forced, torch.iinfo(torch.int64).max - j, key)
    key = torch.where(valid, key, torch.iinfo(torch.int64).min)
    top = torch.topk(key, width, dim=1, sorted=True).indices     # best first
    rank = torch.arange(width, device=dev)[None, :]
    picked = torch.where(rank < count[:, None], top, M)
    sel = torch.sort(picked, dim=1).values
    sel = torch.where(sel < M, sel, -1).to(torch.int32)
    return sel, count.to(torch.int32)


def use_hist(B: int, M: int, launch: LaunchConfig) -> bool:
    """A ``[B, M]`` selection takes the histogram path."""
    return (M >= launch.hist_min_blocks and B <= launch.hist_max_rows
            and M <= launch.select_kernel_max_blocks)


def _select(scores, num_blocks, budget, init_window, local_window, width, launch,
            block_table=None, seq_lens=None, block_size=1):
    """Kernel selection of rows up to ``select_kernel_max_blocks``: ``(sel, count)``, or with
    ``block_table, seq_lens`` ``(sel, count, table, lens)``."""
    B, M = scores.shape
    if use_hist(B, M, launch):
        return select_hist(scores, None, 1.0, num_blocks, budget, init_window, local_window,
                           width, launch, block_table, seq_lens, block_size)[:-1]
    dev = scores.device
    sel = torch.empty(B, width, dtype=torch.int32, device=dev)
    count = torch.empty(B, dtype=torch.int32, device=dev)
    table = block_table is not None
    otable = torch.empty(B, width, dtype=torch.int32, device=dev) if table else count
    olens = torch.empty(B, dtype=torch.int32, device=dev) if table else count
    m_padded = pow2(M, 16)
    long_row = m_padded > launch.select_long_blocks
    jit(_select_kernel)[(B,)](
        scores, num_blocks, budget, sel, count, M, width, *scores.stride(),
        block_table if table else count, seq_lens if table else count, otable, olens,
        *(block_table.stride() if table else (0, 0)),
        INIT=init_window, LOCAL=local_window, M_PADDED=m_padded, TABLE=table,
        BLOCK_SIZE=block_size,
        num_warps=launch.select_warps_long if long_row else launch.select_warps)
    return (sel, count, otable, olens) if table else (sel, count)


def select_blocks(scores, num_blocks, budget, *, init_window: int, local_window: int, width: int,
                  launch: LaunchConfig = LAUNCH):
    """Same contract as :func:`ucm.reference.sparse.select_blocks` (identical output)."""
    if scores.shape[1] > launch.select_kernel_max_blocks:
        return _select_topk(scores, num_blocks, budget, init_window, local_window, width)
    return _select(scores, num_blocks, budget, init_window, local_window, width, launch)


def select_sparse_table(scores, num_blocks, budget, block_table, seq_lens, *, init_window: int,
                        local_window: int, width: int, block_size: int,
                        launch: LaunchConfig = LAUNCH):
    """:func:`select_blocks` and :func:`sparse_block_table` in one launch: ``(sel, count, table,
    lens)``, each as those ops return them (the selection kernel gathers the chosen blocks'
    physical ids itself). Not a public op: validated inputs, ``num_blocks`` =
    ``ceil(seq_lens / block_size)``; asynchronous."""
    if scores.shape[1] > launch.select_kernel_max_blocks:
        sel, count = _select_topk(scores, num_blocks, budget, init_window, local_window, width)
        return (sel, count) + sparse_block_table(block_table, seq_lens, sel, count, block_size,
                                                 launch=launch)
    return _select(scores, num_blocks, budget, init_window, local_window, width, launch,
                   block_table, seq_lens, block_size)


def _table_kernel(table_ptr, lens_ptr, sel_ptr, count_ptr, out_ptr, out_lens_ptr, K,
                  table_stride_batch, table_stride_block, BLOCK_SIZE: tl.constexpr,
                  TILE: tl.constexpr):
    """Entries ``[tile * TILE, +TILE)`` of request ``b``'s sparse table (0 past ``count[b]``);
    program 0 also writes its length."""
    b = tl.program_id(0).to(tl.int64)
    k = tl.program_id(1) * TILE + tl.arange(0, TILE)
    cnt = tl.load(count_ptr + b)
    used = k < cnt
    logical = tl.load(sel_ptr + b * K + k, mask=used, other=0)
    phys = tl.load(table_ptr + b * table_stride_batch + logical * table_stride_block, mask=used,
                   other=0)
    tl.store(out_ptr + b * K + k, tl.where(used, phys, 0), mask=k < K)
    if tl.program_id(1) == 0:
        n = tl.load(lens_ptr + b)
        last_len = n - ((n + BLOCK_SIZE - 1) // BLOCK_SIZE - 1) * BLOCK_SIZE
        tl.store(out_lens_ptr + b, (cnt - 1) * BLOCK_SIZE + last_len)


def sparse_block_table(block_table, seq_lens, sel, count, block_size: int, *,
                       launch: LaunchConfig = LAUNCH):
    """Same contract as :func:`ucm.reference.sparse.sparse_block_table`; asynchronous."""
    B, K = sel.shape
    sel = sel.contiguous()
    table = torch.empty(B, K, dtype=torch.int32, device=sel.device)
    lens = torch.empty(B, dtype=torch.int32, device=sel.device)
    tile = min(launch.table_tile, pow2(K, 16))
    jit(_table_kernel)[(B, triton.cdiv(K, tile))](block_table, seq_lens, sel, count, table, lens,
                                                  K, *block_table.stride(),
                                                  BLOCK_SIZE=block_size, TILE=tile)
    return table, lens
