"""Head mass: the methods' combination of per-head scores, ``softmax(scale * per_head,
-1).mean(1)`` (each block's estimated share of attention, averaged over heads), the selections
on it, and :func:`pool_head_budgets` (one budget per request shared by its KV heads).

:func:`select_head_mass` on a few long rows (``mass_hist_min_blocks``, ``mass_hist_max_rows``)
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


def _pool_hist_kernel(x_ptr, nblk_ptr, state_ptr, hist_ptr, M, INIT, TAIL, span,
                      H: tl.constexpr, HP: tl.constexpr, TILE: tl.constexpr,
                      SHIFT: tl.constexpr, BITS: tl.constexpr):
    """Request ``program_id(0)``, blocks ``[s span, (s + 1) span)`` for ``s = program_id(1)``:
    each free pair whose key (the share's order-preserving 32-bit image) lies in the prefix found
    so far (``state[b, 0]``, the key's bits above ``SHIFT + BITS``) adds one to its head's bin
    ``(key >> SHIFT) mod 2**BITS`` (global atomics)."""
    b = tl.program_id(0).to(tl.int64)
    lo = tl.program_id(1) * span
    hi = tl.minimum(lo + span, M)
    n = tl.load(nblk_ptr + b)
    init = tl.minimum(INIT, n)
    tail = tl.maximum(n - TAIL, 0)
    prefix = tl.load(state_ptr + b * (HP + 1))
    h = tl.arange(0, HP)
    c = tl.arange(0, TILE)
    head_ok = h < H
    row = x_ptr + (b * H + h) * M
    NB: tl.constexpr = 1 << BITS
    bins = hist_ptr + (b * HP + h) * NB
    for j0 in range(lo, hi, TILE):
        j = j0 + c
        cand = head_ok[:, None] & ((j >= init) & (j < tail) & (j < hi))[None, :]
        s = tl.load(row[:, None] + j[None, :], mask=cand, other=float("-inf"))
        s = tl.where(s != s, float("-inf"), s)                 # NaN ranks like -inf
        s = tl.where(s == 0.0, 0.0, s)                         # -0.0 ties with +0.0
        bits = s.to(tl.int32, bitcast=True)
        key = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits).to(tl.int64) + 2147483648
        inside = cand & ((key >> (SHIFT + BITS)) == prefix)
        tl.atomic_add(bins[:, None] + ((key >> SHIFT) & (NB - 1)),
                      tl.full([HP, TILE], 1, tl.int32), mask=inside, sem="relaxed")


def _pool_scan_kernel(nblk_ptr, bud_ptr, state_ptr, hist_ptr, out_ptr, M, cap, INIT, TAIL,
                      H: tl.constexpr, HP: tl.constexpr, BITS: tl.constexpr,
                      CHUNK: tl.constexpr, LAST: tl.constexpr):
    """Request ``program_id(0)``: the highest bin ``k`` of this level's histogram at which the
    pairs at or above it (each head's count capped at ``E``, with the pairs above the prefix
    counted in ``state[b, 1:]``) reach ``extra`` (bin 0 if none does). The prefix grows by ``k``
    and the pairs above it are counted. At the last level the prefix is the threshold ``t``
    (the largest key at which the capped count reaches ``extra``), and the budgets follow: each
    head's pairs above ``t`` up to ``E``, then the pairs equal to ``t`` in rank-major order
    (rank within a head, then head), as the reference's stable sort orders them."""
    b = tl.program_id(0).to(tl.int64)
    n = tl.load(nblk_ptr + b)
    per = tl.load(bud_ptr + b)
    init = tl.minimum(INIT, n)
    tail = tl.maximum(n - TAIL, 0)                             # TAIL: max(local window, 1)
    free = tl.maximum(tail - init, 0)
    f = n - free                                               # the windows' blocks
    E = tl.minimum(tl.maximum(cap * per - f, 0), free).to(tl.int64)   # a head's extra pairs
    extra = tl.maximum(H * (per - f), 0).to(tl.int64)         # extra pairs in all
    h = tl.arange(0, HP)
    head_ok = h < H
    NB: tl.constexpr = 1 << BITS
    st = state_ptr + b * (HP + 1)
    prefix = tl.load(st)
    above = tl.load(st + 1 + h)                                # [HP] pairs above the prefix
    cb = tl.arange(0, CHUNK)
    carry = tl.zeros([HP], tl.int32)                           # pairs in the bins above a chunk
    k = tl.full([], 0, tl.int64)
    found = tl.full([], 0, tl.int32)
    k_above = above
    k_ties = tl.zeros([HP], tl.int64)
    z_above = above                                            # bin 0, if no bin reaches extra
    z_ties = tl.zeros([HP], tl.int64)
    for i in range(NB // CHUNK):                               # the bins from the top
        c0 = NB - (i + 1) * CHUNK
        bins = hist_ptr + ((b * HP + h) * NB)[:, None] + (c0 + cb)[None, :]
        cnt = tl.load(bins, mask=head_ok[:, None], other=0)
        tl.store(bins, tl.zeros([HP, CHUNK], tl.int32), mask=head_ok[:, None])  # next level's
        at_or_above = (tl.cumsum(cnt, 1, reverse=True) + carry[:, None]).to(tl.int64)
        total = tl.sum(tl.where(head_ok[:, None],
                                tl.minimum(above[:, None] + at_or_above, E), 0), 0)
        best = tl.max(tl.where(total >= extra, c0 + cb, -1), 0)
        pick = (cb + c0 == best)[None, :]
        b_cnt = tl.sum(tl.where(pick, cnt, 0), 1).to(tl.int64)
        b_up = tl.sum(tl.where(pick, at_or_above, 0), 1) - b_cnt
        take = (found == 0) & (best >= 0)
        k = tl.where(take, best, k)
        k_above = tl.where(take, above + b_up, k_above)
        k_ties = tl.where(take, b_cnt, k_ties)
        found = tl.where(take, 1, found)
        zero = (cb + c0 == 0)[None, :]
        z_cnt = tl.sum(tl.where(zero, cnt, 0), 1).to(tl.int64)
        z_above = tl.where(c0 == 0, above + tl.sum(tl.where(zero, at_or_above, 0), 1) - z_cnt,
                           z_above)
        z_ties = tl.where(c0 == 0, z_cnt, z_ties)
        carry += tl.sum(cnt, 1)
    k_above = tl.where(found == 1, k_above, z_above)
    k_ties = tl.where(found == 1, k_ties, z_ties)
    if LAST:
        g = tl.where(head_ok, tl.minimum(k_above, E), 0)
        rest = extra - tl.sum(g, 0)                            # pairs still to take, all ties
        t_lo = k_above                                         # ranks of a head's tied pairs,
        t_hi = tl.where(head_ok, tl.minimum(k_above + k_ties, E), 0)   # capped: [t_lo, t_hi)
        # the first level L (rank) at which the tied pairs of ranks <= L reach `rest`
        a = tl.full([], 1, tl.int64)
        z = tl.full([], 1, tl.int64) + M
        for _ in range(32):                                    # M < 2**31
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
    else:
        tl.store(st, (prefix << BITS) | k)
        tl.store(st + 1 + h, k_above)


#: Key bits each level of :func:`pool_head_budgets` resolves (32 in all), from the top.
_POOL_LEVELS = (11, 11, 10)


def pool_head_budgets(shares: torch.Tensor, num_blocks, budget, *, cap: int, init_window: int,
                      local_window: int, launch: LaunchConfig = LAUNCH) -> torch.Tensor:
    """Same contract as :func:`ucm.reference.sparse.pool_head_budgets` (bit-identical budgets);
    inputs as validated by :func:`ucm.sparse.ops.pool_head_budgets`; asynchronous.

    The threshold share is found by radix levels over the shares' order-preserving 32-bit
    images (11, 11 and 10 bits): each level histograms the pairs inside the prefix found so far
    with programs of ``pool_span`` blocks each (global atomics, a request spread over the GPU),
    then one program per request scans the histogram from the top for the bin at which the
    capped count reaches the budget: three passes over the shares, each spread over the GPU (one
    program per request would hold a long request on one multiprocessor)."""
    B, H, M = shares.shape
    x = shares.contiguous()
    hp = pow2(H)
    out = torch.empty(B, H, dtype=torch.int32, device=x.device)
    state = torch.zeros(B, hp + 1, dtype=torch.int64, device=x.device)   # prefix, above[h]
    # one histogram for every level: each scan leaves the bins it read zeroed
    hist = torch.zeros(B, hp, 1 << max(_POOL_LEVELS), dtype=torch.int32, device=x.device)
    tile = min(pow2(M, 16), max(16, launch.pool_tile_elems // hp))
    span = max(tile, launch.pool_span // tile * tile)
    chunk = max(16, launch.pool_scan_elems // hp)
    tail = max(local_window, 1)
    shift = 32
    for level, bits in enumerate(_POOL_LEVELS):
        shift -= bits
        jit(_pool_hist_kernel)[(B, triton.cdiv(M, span))](
            x, num_blocks, state, hist, M, init_window, tail, span, H=H, HP=hp,
            TILE=tile, SHIFT=shift, BITS=bits, num_warps=launch.pool_hist_warps)
        last = level == len(_POOL_LEVELS) - 1
        jit(_pool_scan_kernel)[(B,)](
            num_blocks, budget, state, hist, out, M, cap, init_window, tail, H=H, HP=hp,
            BITS=bits, CHUNK=min(chunk, 1 << bits), LAST=last,
            num_warps=launch.pool_scan_warps)
    return out
