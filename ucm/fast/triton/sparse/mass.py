"""Head mass: the methods' combination of per-head scores, ``softmax(scale * per_head,
-1).mean(1)`` (each block's estimated share of attention, averaged over heads), and the
selections on it.

:func:`select_head_mass` on one long row (``mass_hist_min_blocks``, ``mass_hist_max_rows``)
runs four launches: each head's log-sum-exp and bounds in parts, then the histogram selection
whose first launch computes (and writes) the head mass, selecting exactly on the mass it wrote.
Other shapes compute the head mass in two launches (:func:`head_mass`), then select it.
:func:`score_select_head_mass` is per-head scoring followed by :func:`select_head_mass`.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ucm.fast.triton.sparse.histogram import lse_bounds, select_hist
from ucm.fast.triton.sparse.launch import LAUNCH, LOG2E, LaunchConfig, jit, pow2, sm_count
from ucm.fast.triton.sparse.scoring import score_blocks
from ucm.fast.triton.sparse.selection import select_blocks, select_sparse_table


def _lse_kernel(x_ptr, lse_ptr, M, scale_log2, CHUNK: tl.constexpr):
    """Row ``program_id(0)`` of ``x [rows, M]``: ``log2 sum_j 2 ** (scale_log2 * x_j)``."""
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, CHUNK)
    m_i = tl.full([CHUNK], float("-inf"), tl.float32)
    l_i = tl.zeros([CHUNK], tl.float32)
    for j0 in range(0, M, CHUNK):
        x = tl.load(x_ptr + row * M + j0 + c, mask=j0 + c < M, other=float("-inf")) * scale_log2
        m_new = tl.maximum(m_i, x)
        safe = tl.where(m_new > float("-inf"), m_new, 0.0)
        l_i = l_i * tl.exp2(m_i - safe) + tl.exp2(x - safe)
        m_i = m_new
    m = tl.max(m_i, 0)
    safe = tl.where(m_i > float("-inf"), m_i, m)
    total = tl.sum(tl.where(m_i > float("-inf"), l_i * tl.exp2(safe - m), 0.0), 0)
    tl.store(lse_ptr + row, m + tl.log2(total))


def _mass_kernel(x_ptr, lse_ptr, out_ptr, M, scale_log2, NUM_HEADS: tl.constexpr,
                 TILE: tl.constexpr):
    """``out[b, j] = mean_h 2 ** (scale_log2 * x[b, h, j] - lse[b, h])`` for one tile of ``j``."""
    b = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1) * TILE + tl.arange(0, TILE)
    inside = j < M
    acc = tl.zeros([TILE], tl.float32)
    for h in range(NUM_HEADS):
        x = tl.load(x_ptr + (b * NUM_HEADS + h) * M + j, mask=inside, other=float("-inf"))
        acc += tl.exp2(x * scale_log2 - tl.load(lse_ptr + b * NUM_HEADS + h))
    tl.store(out_ptr + b * M + j, acc / NUM_HEADS, mask=inside)


def head_mass(per_head: torch.Tensor, scale: float, *,
              launch: LaunchConfig = LAUNCH) -> torch.Tensor:
    """``softmax(scale * per_head, -1).mean(1)`` for float32 ``[B, H, M]`` (``-inf`` entries
    weigh 0; every row needs one finite entry) in two launches, one program per row then one per
    (request, tile). Equal to the PyTorch expression up to float32 rounding; asynchronous."""
    B, H, M = per_head.shape
    x = per_head.contiguous()
    lse = torch.empty(B, H, dtype=torch.float32, device=x.device)
    out = torch.empty(B, M, dtype=torch.float32, device=x.device)
    jit(_lse_kernel)[(B * H,)](x, lse, M, scale * LOG2E,
                               CHUNK=min(launch.head_mass_chunk, pow2(M, 16)), num_warps=4)
    tile = min(launch.head_mass_tile, pow2(M, 16))
    enough = launch.head_mass_programs_per_sm * sm_count(x.device)
    while tile > 16 and B * triton.cdiv(M, tile) < enough:
        tile //= 2
    jit(_mass_kernel)[(B, triton.cdiv(M, tile))](x, lse, out, M, scale * LOG2E, NUM_HEADS=H,
                                                 TILE=tile, num_warps=4)
    return out


def mass_hist_path(B: int, M: int, launch: LaunchConfig = LAUNCH) -> bool:
    """:func:`select_head_mass` takes the fused histogram path for ``[B, H, M]``."""
    return (launch.mass_hist_min_blocks <= M <= launch.select_kernel_max_blocks
            and B <= launch.mass_hist_max_rows)


def select_head_mass(per_head: torch.Tensor, num_blocks, budget, *, scale: float,
                     init_window: int, local_window: int, width: int, block_table=None,
                     seq_lens=None, block_size: int = 1, return_mass: bool = False,
                     launch: LaunchConfig = LAUNCH):
    """Same contract as :func:`ucm.reference.sparse.select_head_mass`: the selection of
    :func:`head_mass` ``(per_head, scale)``, ``(sel, count)``; with ``block_table, seq_lens``
    the sparse table folded in, ``(sel, count, table, lens)`` (as :func:`select_sparse_table`);
    ``return_mass``: the head mass appended. Exact selection on the mass it computes. Inputs as
    validated by :func:`ucm.sparse.ops.select_head_mass`; asynchronous."""
    B, H, M = per_head.shape
    x = per_head.contiguous()
    if mass_hist_path(B, M, launch):
        stats = lse_bounds(x, scale * LOG2E, launch)
        out = select_hist(x, stats, scale, num_blocks, budget, init_window, local_window, width,
                          launch, block_table, seq_lens, block_size)
    else:
        mass = head_mass(x, scale, launch=launch)
        if block_table is not None:
            out = select_sparse_table(mass, num_blocks, budget, block_table, seq_lens,
                                      init_window=init_window, local_window=local_window,
                                      width=width, block_size=block_size,
                                      launch=launch) + (mass,)
        else:
            out = select_blocks(mass, num_blocks, budget, init_window=init_window,
                                local_window=local_window, width=width, launch=launch) + (mass,)
    return out if return_mass else out[:-1]


def score_select_head_mass(q, block_table, num_blocks, budget, *, kind: str, mean=None,
                           kmin=None, kmax=None, channel_mask=None, scale: float,
                           init_window: int, local_window: int, width: int,
                           return_mass: bool = False, mean_scale=None, seq_lens=None,
                           block_size=None, launch: LaunchConfig = LAUNCH):
    """Same contract as :func:`ucm.reference.sparse.score_select_head_mass`: per-head
    :func:`score_blocks` then :func:`select_head_mass`, ``(sel, count)``. ``return_mass``: the
    head mass appended (tests). With ``seq_lens`` and ``block_size`` the attention's table is
    written by the selection's last launch: ``(sel, count, table, lens)``. Inputs as validated
    by :func:`ucm.sparse.ops.score_select_head_mass`; asynchronous."""
    per_head = score_blocks(q, block_table, num_blocks, kind=kind, reduce="none", mean=mean,
                            kmin=kmin, kmax=kmax, channel_mask=channel_mask,
                            mean_scale=mean_scale, launch=launch)
    fold = {} if seq_lens is None else dict(block_table=block_table, seq_lens=seq_lens,
                                            block_size=block_size)
    return select_head_mass(per_head, num_blocks, budget, scale=scale, init_window=init_window,
                            local_window=local_window, width=width, return_mass=return_mass,
                            launch=launch, **fold)
