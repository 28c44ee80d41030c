"""Head mass: the methods' combination of per-head scores, ``softmax(scale * per_head,
-1).mean(1)`` (each block's estimated share of attention, averaged over heads), the selections
on it, and :func:`pool_head_budgets` (one budget per request shared by its KV heads).

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


def _pool_kernel(x_ptr, nblk_ptr, bud_ptr, out_ptr, M, cap, INIT, TAIL, H: tl.constexpr,
                 HP: tl.constexpr, TILE: tl.constexpr):
    """Request ``program_id(0)`` of :func:`pool_head_budgets`. Its free blocks are the range
    ``[init, tail)`` between the windows. A 4-ary search over the float32 bits (ordered as
    int32) finds the largest threshold ``t`` at which the heads' pairs of share ``>= t``, each
    head capped at ``E = min(cap * budget - windows, free)``, reach ``extra = H * (budget -
    windows)``; the pairs equal to ``t`` then go in rank-major order (rank within a head, then
    head), as the reference's stable sort orders them."""
    b = tl.program_id(0).to(tl.int64)
    h = tl.arange(0, HP)
    c = tl.arange(0, TILE)
    n = tl.load(nblk_ptr + b)
    per = tl.load(bud_ptr + b)
    init = tl.minimum(INIT, n)
    tail = tl.maximum(n - TAIL, 0)                             # TAIL: max(local window, 1)
    free = tl.maximum(tail - init, 0)
    f = n - free                                               # the windows' blocks
    E = tl.minimum(tl.maximum(cap * per - f, 0), free).to(tl.int64)
    extra = tl.maximum(H * (per - f), 0).to(tl.int64)
    head_ok = h < H
    row = x_ptr + (b * H + h) * M                              # [HP] row starts
    lo = tl.full([], -2147483648, tl.int64)
    hi = tl.full([], 2147483647, tl.int64)
    field = (1 << 21) - 1
    for _ in range(17):                                        # (2**32 - 1) / 4**16 < 1
        span = hi - lo
        t1 = (lo + (span + 3) // 4).to(tl.int32)
        t2 = (lo + (2 * span + 3) // 4).to(tl.int32)
        t3 = (lo + (3 * span + 3) // 4).to(tl.int32)
        a1 = tl.zeros([HP], tl.int32)
        a2 = tl.zeros([HP], tl.int32)
        a3 = tl.zeros([HP], tl.int32)
        for j0 in range(0, M, TILE):
            j = j0 + c
            cand = head_ok[:, None] & ((j >= init) & (j < tail))[None, :]
            s = tl.load(row[:, None] + j[None, :], mask=cand, other=float("-inf"))
            s = tl.where(s != s, float("-inf"), s)             # NaN ranks like -inf
            s = tl.where(s == 0.0, 0.0, s)                     # -0.0 ties with +0.0
            bits = s.to(tl.int32, bitcast=True)
            u = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
            # a tile's counts per head (<= TILE < 1024) packed in 10-bit fields of one int32
            p = tl.sum(tl.where(cand, (u >= t1).to(tl.int32) + ((u >= t2).to(tl.int32) << 10)
                                + ((u >= t3).to(tl.int32) << 20), 0), 1)
            a1 += p & 1023
            a2 += (p >> 10) & 1023
            a3 += p >> 20
        n1 = tl.sum(tl.where(head_ok, tl.minimum(a1.to(tl.int64), E), 0), 0)
        n2 = tl.sum(tl.where(head_ok, tl.minimum(a2.to(tl.int64), E), 0), 0)
        n3 = tl.sum(tl.where(head_ok, tl.minimum(a3.to(tl.int64), E), 0), 0)
        ok1, ok2, ok3 = n1 >= extra, n2 >= extra, n3 >= extra
        new_lo = tl.where(ok3, t3.to(tl.int64), tl.where(ok2, t2.to(tl.int64),
                                                         tl.where(ok1, t1.to(tl.int64), lo)))
        hi = tl.where(ok3, hi, tl.where(ok2, t3.to(tl.int64) - 1,
                                        tl.where(ok1, t2.to(tl.int64) - 1, t1.to(tl.int64) - 1)))
        lo = new_lo
    t = lo.to(tl.int32)
    acc = tl.zeros([HP], tl.int64)                             # above t, and equal to t
    for j0 in range(0, M, TILE):
        j = j0 + c
        cand = head_ok[:, None] & ((j >= init) & (j < tail))[None, :]
        s = tl.load(row[:, None] + j[None, :], mask=cand, other=float("-inf"))
        s = tl.where(s != s, float("-inf"), s)
        s = tl.where(s == 0.0, 0.0, s)
        bits = s.to(tl.int32, bitcast=True)
        u = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
        acc += tl.sum(tl.where(cand, (u > t).to(tl.int64) + ((u == t).to(tl.int64) << 21), 0), 1)
    above = acc & field
    ties = acc >> 21
    g = tl.where(head_ok, tl.minimum(above, E), 0)
    rest = extra - tl.sum(g, 0)                                # pairs still to take, all ties
    t_lo = above                                               # ranks of a head's tied pairs,
    t_hi = tl.where(head_ok, tl.minimum(above + ties, E), 0)   # capped: [t_lo, t_hi)
    # the first level L (rank) at which the tied pairs of ranks <= L reach `rest`
    a = tl.full([], 1, tl.int64)
    z = tl.full([], 1, tl.int64) + M
    for _ in range(22):                                        # M < 2**21 (the packed counts)
        mid = (a + z) // 2
        got = tl.sum(tl.maximum(tl.minimum(mid, t_hi) - t_lo, 0), 0)
        a = tl.where(got >= rest, a, mid + 1)
        z = tl.where(got >= rest, mid, z)
    L = a - 1
    base = tl.maximum(tl.minimum(L, t_hi) - t_lo, 0)
    active = (t_lo <= L) & (L < t_hi)
    left = rest - tl.sum(base, 0)
    before = tl.cumsum(active.to(tl.int64), 0) - active.to(tl.int64)
    tie = base + (active & (before < left)).to(tl.int64)
    counts = g + tie
    counts = tl.where(extra == 0, 0, tl.where(H * E <= extra, E, counts))
    tl.store(out_ptr + b * H + h, tl.minimum(counts + f, n).to(tl.int32), mask=head_ok)


def pool_head_budgets(shares: torch.Tensor, num_blocks, budget, *, cap: int, init_window: int,
                      local_window: int, launch: LaunchConfig = LAUNCH) -> torch.Tensor:
    """Same contract as :func:`ucm.reference.sparse.pool_head_budgets` (bit-identical budgets):
    one program per request; inputs as validated by :func:`ucm.sparse.ops.pool_head_budgets`;
    asynchronous."""
    B, H, M = shares.shape
    if M >= 1 << 21:   # the kernel packs counts in 21-bit fields
        from ucm.reference.sparse import pool_head_budgets as reference

        return reference(shares, num_blocks, budget, cap=cap, init_window=init_window,
                         local_window=local_window)
    x = shares.contiguous()
    out = torch.empty(B, H, dtype=torch.int32, device=x.device)
    hp = pow2(H)
    # (at most 512 blocks a tile: the kernel packs a tile's counts in 10-bit fields)
    tile = min(pow2(M, 16), max(16, launch.pool_tile_elems // hp), 512)
    jit(_pool_kernel)[(B,)](x, num_blocks, budget, out, M, cap, init_window,
                            max(local_window, 1), H=H, HP=hp, TILE=tile,
                            num_warps=launch.pool_warps)
    return out
