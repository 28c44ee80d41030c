"""Histogram selection: a few long rows selected by chunk-local programs over the whole GPU.

A single program's passes over a row of thousands of blocks are latency-bound, so one long row is
selected in three launches whose programs each touch only their chunk, the row's histogram and a
short list:

1. :func:`_hist_kernel`: every candidate (not forced, below ``num_blocks``) is added to its bin
   of the row's histogram (global atomics). The bins split ``[lo, hi]`` evenly on the
   order-preserving int32 image of the scores (see :mod:`ucm.fast.triton.sparse.selection`),
   where ``lo`` / ``hi`` are the row's extremes from :func:`_lse_bounds_kernel`. For the head
   mass of per-head scores this launch also computes (and writes) the mass from each head's
   log-sum-exp, and bounds the row by the mass of each head's lowest / highest score.
2. :func:`_hist_list_kernel`: every program finds the threshold's bin from the histogram and
   appends its chunk's candidates in that bin to the row's list (atomic slots), with a count of
   its blocks taken for sure.
3. :func:`_hist_emit_kernel`: every program resolves the list into the key ``(u*, j*)`` of the
   last block taken (pairwise ranks, or 4-ary searches when the list is longer than
   ``hist_list``) and writes its chunk of the selection (and of the table).

The row's histogram and list counter live in a per-device scratch buffer that the kernels leave
zeroed: one histogram selection at a time per device.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ucm.fast.triton.sparse.launch import LOG2E, LaunchConfig, jit, pow2


def _lse_bounds_kernel(x_ptr, stat_ptr, M, scale_log2, CHUNK: tl.constexpr,
                       SPAN: tl.constexpr):
    """Row ``program_id(0)`` of ``x [rows, M]`` (``c = scale_log2``), entries ``[s SPAN, (s + 1)
    SPAN)`` for ``s = program_id(1)`` (``SPAN`` 0: the whole row, one program per row):
    ``stat[row, s] = (log2 sum_j 2 ** (c x_j), max_j c x_j, min_j c x_j over the entries above
    -inf)`` (``-inf, -inf, inf`` for a part with none); :func:`_hist_kernel` combines the
    parts of a row."""
    row = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1)
    lo = part * SPAN
    if SPAN > 0:
        hi = tl.minimum(lo + SPAN, M)
    else:
        hi = M
    c = tl.arange(0, CHUNK)
    m_i = tl.full([CHUNK], float("-inf"), tl.float32)
    l_i = tl.zeros([CHUNK], tl.float32)
    n_i = tl.full([CHUNK], float("inf"), tl.float32)
    for j0 in range(lo, hi, CHUNK):
        x = tl.load(x_ptr + row * M + j0 + c, mask=j0 + c < hi, other=float("-inf")) * scale_log2
        m_new = tl.maximum(m_i, x)
        safe = tl.where(m_new > float("-inf"), m_new, 0.0)
        l_i = l_i * tl.exp2(m_i - safe) + tl.exp2(x - safe)
        m_i = m_new
        n_i = tl.minimum(n_i, tl.where(x > float("-inf"), x, float("inf")))
    m = tl.max(m_i, 0)
    safe = tl.where(m_i > float("-inf"), m_i, m)
    total = tl.sum(tl.where(m_i > float("-inf"), l_i * tl.exp2(safe - m), 0.0), 0)
    out = (row * tl.num_programs(1) + part) * 3
    tl.store(stat_ptr + out, tl.where(total > 0, m + tl.log2(total), float("-inf")))
    tl.store(stat_ptr + out + 1, m)
    tl.store(stat_ptr + out + 2, tl.min(n_i, 0))


def _hist_kernel(x_ptr, stat_ptr, mass_ptr, nblk_ptr, hist_ptr, prm_ptr, lcnt_ptr, M,
                 x_stride_batch, x_stride_block, scale_log2,
                 NUM_HEADS: tl.constexpr, HEADS_PADDED: tl.constexpr, TILE: tl.constexpr,
                 MASS: tl.constexpr, INIT: tl.constexpr, LOCAL: tl.constexpr,
                 BINS: tl.constexpr, PARTS: tl.constexpr, PARTS_PADDED: tl.constexpr):
    """Blocks ``[c TILE, (c + 1) TILE)`` of request ``b``: add each candidate (not forced, below
    ``nblk[b]``) to its bin of the row's ``BINS``-bin histogram (global atomics).

    MASS: the row is the head mass of per-head scores ``x [B, NUM_HEADS, M]``, ``mean_h 2 ** (c
    x_hj - lse_h)`` (``stat [B, NUM_HEADS, PARTS, 3]`` from :func:`_lse_bounds_kernel`, each
    head's parts combined here), written to ``mass [B, M]``; its bounds are the head mass of each
    head's lowest / highest score (bounds of the row up to rounding; values outside land in the
    end bins). Else the row is ``x [B, M]`` (strides ``x_stride_*``) bounded by its ``[min, max]``
    (``stat[b]`` from :func:`_lse_bounds_kernel` at scale 1). Bin of the image ``u``:
    ``clamp((u >> shift) - base, 0, BINS - 1)``, monotone in ``u``; ``(shift, base)`` go to ``prm
    [B, 3]`` for the next launches, and ``lcnt[b]`` (the threshold bin's list length) is reset.
    ``LOCAL = max(local_window, 1)`` (the last block is always forced)."""
    b = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1) * TILE + tl.arange(0, TILE)
    inside = j < M
    n = tl.load(nblk_ptr + b)
    tail = tl.maximum(n - LOCAL, 0)
    if MASS:
        h = tl.arange(0, HEADS_PADDED)
        hm = h < NUM_HEADS
        if PARTS == 1:
            lse = tl.load(stat_ptr + (b * NUM_HEADS + h) * 3, mask=hm, other=0.0)
            mx = tl.load(stat_ptr + (b * NUM_HEADS + h) * 3 + 1, mask=hm, other=0.0)
            mn = tl.load(stat_ptr + (b * NUM_HEADS + h) * 3 + 2, mask=hm, other=0.0)
        else:  # combine each head's parts (log2-sum-exp of log2-sum-exps, max, min)
            pp = tl.arange(0, PARTS_PADDED)
            pm = hm[:, None] & (pp < PARTS)[None, :]
            src = ((b * NUM_HEADS + h[:, None]) * PARTS + pp[None, :]) * 3
            pl = tl.load(stat_ptr + src, mask=pm, other=float("-inf"))
            top = tl.max(pl, 1)
            tsafe = tl.where(top > float("-inf"), top, 0.0)
            lse = tsafe + tl.log2(tl.sum(tl.where(pl > float("-inf"),
                                                  tl.exp2(pl - tsafe[:, None]), 0.0), 1))
            lse = tl.where(hm, lse, 0.0)
            mx = tl.where(hm, tl.max(tl.load(stat_ptr + src + 1, mask=pm, other=float("-inf")),
                                     1), 0.0)
            mn = tl.where(hm, tl.min(tl.load(stat_ptr + src + 2, mask=pm, other=float("inf")),
                                     1), 0.0)
        x = tl.load(x_ptr + (b * NUM_HEADS + h[:, None]) * M + j[None, :],
                    mask=hm[:, None] & inside[None, :], other=float("-inf"))
        p = tl.where(hm[:, None], tl.exp2(x * scale_log2 - lse[:, None]), 0.0)
        s = tl.sum(p, 0) / NUM_HEADS
        tl.store(mass_ptr + b * M + j, s, mask=inside)
        hi = tl.sum(tl.where(hm, tl.exp2(mx - lse), 0.0), 0) / NUM_HEADS
        lo = tl.sum(tl.where(hm, tl.exp2(mn - lse), 0.0), 0) / NUM_HEADS
    else:  # bins between the row's extremes (stat[b] = (-, max, min above -inf))
        s = tl.load(x_ptr + b * x_stride_batch + j * x_stride_block, mask=inside,
                    other=float("-inf"))
        hi = tl.load(stat_ptr + b * 3 + 1)
        lo = tl.load(stat_ptr + b * 3 + 2)
    hi = tl.where(hi != hi, float("-inf"), hi)
    hi = tl.where(hi == 0.0, 0.0, hi)
    lo = tl.where(lo != lo, float("-inf"), lo)
    lo = tl.where(lo == 0.0, 0.0, lo)
    bh = hi.to(tl.int32, bitcast=True)
    bl = lo.to(tl.int32, bitcast=True)
    uh = tl.where(bh < 0, bh ^ 0x7FFFFFFF, bh).to(tl.int64)
    ul = tl.where(bl < 0, bl ^ 0x7FFFFFFF, bl).to(tl.int64)
    span = tl.maximum(uh - ul, 0)
    shift = tl.zeros([], tl.int64)
    for _ in tl.static_range(33):                  # smallest shift with span >> shift <= BINS - 2
        shift += ((span >> shift) > BINS - 2).to(tl.int64)
    base = ul >> shift
    s = tl.where(s != s, float("-inf"), s)                 # NaN ranks like -inf
    s = tl.where(s == 0.0, 0.0, s)                         # -0.0 ties with +0.0
    bits = s.to(tl.int32, bitcast=True)
    u = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits).to(tl.int64)
    ub = tl.minimum(tl.maximum((u >> shift) - base, 0), BINS - 1).to(tl.int32)
    cand = inside & (j < n) & (j >= INIT) & (j < tail)
    tl.atomic_add(hist_ptr + b * BINS + ub, tl.full([TILE], 1, tl.int32), mask=cand,
                  sem="relaxed")
    if tl.program_id(1) == 0:
        tl.store(prm_ptr + b * 3, shift)
        tl.store(prm_ptr + b * 3 + 1, base)
        tl.store(lcnt_ptr + b, 0)                          # the list kernel's slot counter


def _hist_list_kernel(s_ptr, s_stride_batch, s_stride_block, nblk_ptr, budget_ptr, hist_ptr,
                      prm_ptr, lcnt_ptr, lu_ptr, lj_ptr, ccnt_ptr, M,
                      INIT: tl.constexpr, LOCAL: tl.constexpr, BINS: tl.constexpr,
                      CHUNK: tl.constexpr):
    """Blocks ``[c CHUNK, (c + 1) CHUNK)`` of row ``b``, given the row's histogram
    (:func:`_hist_kernel`): the threshold bin ``b1`` is the highest bin whose suffix count
    reaches ``r`` (the candidates still to take; every program finds it from the histogram).
    Candidates in higher bins are taken, in lower bins not; ``need`` of the ``L`` candidates in
    ``b1`` are. The chunk's candidates in ``b1`` are appended to the row's list (``lu, lj``: score
    image and index, a slot per atomic on ``lcnt[b]``); ``ccnt[b, c]`` gets the chunk's blocks
    taken for sure (forced, or a candidate above ``b1``); ``prm[b, 2]`` gets ``need``."""
    b = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    n = tl.load(nblk_ptr + b)
    head = tl.minimum(n, INIT)
    tail = tl.maximum(n - LOCAL, 0)
    n_forced = head + (n - tail) - tl.maximum(head - tail, 0)
    keep = tl.minimum(n, tl.maximum(tl.load(budget_ptr + b), n_forced))
    r = keep - n_forced
    shift = tl.load(prm_ptr + b * 3)
    base = tl.load(prm_ptr + b * 3 + 1)
    bins = tl.arange(0, BINS)
    hc = tl.load(hist_ptr + b * BINS + bins)
    suffix = tl.sum(hc, 0) - tl.cumsum(hc, 0) + hc             # candidates in bins >= k
    b1 = tl.max(tl.where(suffix >= r, bins, 0), 0)             # r <= 0: BINS - 1, need <= 0
    above = tl.sum(tl.where(bins > b1, hc, 0), 0)
    need = r - above                                           # in [1, L] when r >= 1
    i = c * CHUNK + tl.arange(0, CHUNK)
    vi = i < n
    si = tl.load(s_ptr + b * s_stride_batch + i * s_stride_block, mask=vi, other=float("-inf"))
    si = tl.where(si != si, float("-inf"), si)                 # NaN ranks like -inf
    si = tl.where(si == 0.0, 0.0, si)                          # -0.0 ties with +0.0
    bi = si.to(tl.int32, bitcast=True)
    ui = tl.where(bi < 0, bi ^ 0x7FFFFFFF, bi)
    cand = vi & (i >= INIT) & (i < tail)
    ub = tl.minimum(tl.maximum((ui.to(tl.int64) >> shift) - base, 0), BINS - 1).to(tl.int32)
    inb = cand & (ub == b1) & (tl.zeros([CHUNK], tl.int32) + need > 0)
    slot = tl.atomic_add(lcnt_ptr + b + tl.zeros([CHUNK], tl.int64),
                         tl.full([CHUNK], 1, tl.int32), mask=inb, sem="relaxed")
    tl.store(lu_ptr + b * M + slot, ui, mask=inb)
    tl.store(lj_ptr + b * M + slot, i, mask=inb)
    sure = (vi & ~cand) | (cand & (ub > b1))
    tl.store(ccnt_ptr + b * tl.num_programs(1) + c, tl.sum(sure.to(tl.int32), 0))
    if c == 0:
        tl.store(prm_ptr + b * 3 + 2, need.to(tl.int64))


def _hist_emit_kernel(s_ptr, s_stride_batch, s_stride_block, nblk_ptr, budget_ptr, hist_ptr,
                      prm_ptr, lcnt_ptr, lu_ptr, lj_ptr, ccnt_ptr, sel_ptr, count_ptr, M, width,
                      list_cap, table_ptr, lens_ptr, otable_ptr, olens_ptr,
                      table_stride_batch, table_stride_block,
                      INIT: tl.constexpr, LOCAL: tl.constexpr, BINS: tl.constexpr,
                      CHUNK: tl.constexpr, PROGRAMS_PADDED: tl.constexpr,
                      LIST_PADDED: tl.constexpr, SEARCH_CHUNK: tl.constexpr,
                      TABLE: tl.constexpr, BLOCK_SIZE: tl.constexpr):
    """Blocks ``[c CHUNK, (c + 1) CHUNK)`` of row ``b``, given :func:`_hist_list_kernel`'s list
    of the threshold bin's candidates: the ``need``-th best of them by (score desc, index asc)
    is the key ``(u*, j*)`` (pairwise ranks when ``L <= list_cap``; else a 4-ary search for
    ``u*`` over the list, ``SEARCH_CHUNK`` entries a step, then one for the ``(need - #(u >
    u*))``-th smallest index among the ties). The chosen blocks are exactly the forced ones and
    the candidates with ``u > u*`` or ``u == u*, j <= j*``, written at positions after the chosen
    blocks of the earlier chunks (their sure counts plus the list's chosen entries before the
    chunk); ``-1`` pads positions ``[keep, width)``. TABLE: the chosen blocks' physical ids
    likewise (pads 0) and the sparse length. Program 0 zeroes the row's histogram for the next
    call (the list kernel has read it)."""
    b = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    c0 = c * CHUNK
    n = tl.load(nblk_ptr + b)
    head = tl.minimum(n, INIT)
    tail = tl.maximum(n - LOCAL, 0)
    n_forced = head + (n - tail) - tl.maximum(head - tail, 0)
    keep = tl.minimum(n, tl.maximum(tl.load(budget_ptr + b), n_forced))
    need = tl.load(prm_ptr + b * 3 + 2).to(tl.int32)
    L = tl.load(lcnt_ptr + b)
    pc = tl.arange(0, PROGRAMS_PADDED)
    before = tl.sum(tl.load(ccnt_ptr + b * tl.num_programs(1) + pc, mask=pc < c, other=0), 0)
    i = c0 + tl.arange(0, CHUNK)
    vi = i < n
    si = tl.load(s_ptr + b * s_stride_batch + i * s_stride_block, mask=vi, other=float("-inf"))
    si = tl.where(si != si, float("-inf"), si)
    si = tl.where(si == 0.0, 0.0, si)
    bi = si.to(tl.int32, bitcast=True)
    ui = tl.where(bi < 0, bi ^ 0x7FFFFFFF, bi)
    cand = vi & (i >= INIT) & (i < tail)
    if c == 0:
        tl.store(hist_ptr + b * BINS + tl.arange(0, BINS), tl.zeros([BINS], tl.int32))
    ustar = tl.full([], 2147483647, tl.int32)                  # need <= 0: no candidate taken
    jstar = tl.full([], -1, tl.int32)
    if need > 0:
        if L <= list_cap:
            k = tl.arange(0, LIST_PADDED)
            kv = k < L
            lu = tl.load(lu_ptr + b * M + k, mask=kv, other=-2147483648)
            lj = tl.load(lj_ptr + b * M + k, mask=kv, other=0)
            beats = kv[None, :] & ((lu[None, :] > lu[:, None])
                                   | ((lu[None, :] == lu[:, None]) & (lj[None, :] < lj[:, None])))
            rank = tl.sum(beats.to(tl.int32), 1)
            hit = kv & (rank == need - 1)
            ustar = tl.max(tl.where(hit, lu, -2147483648), 0)
            jstar = tl.max(tl.where(hit, lj, -1), 0)
            taken = kv & (rank < need)
            before += tl.sum((taken & (lj < c0)).to(tl.int32), 0)
        else:
            cc = tl.arange(0, SEARCH_CHUNK)
            field = (1 << 21) - 1
            # u*: the largest t with #(list u >= t) >= need (the list holds one bin: L >= need)
            t_lo = tl.full([], -2147483648, tl.int64)
            t_hi = tl.full([], 2147483647, tl.int64)
            for _step in range(17):                            # (2**32 - 1) / 4**16 < 1
                t_span = t_hi - t_lo
                t1 = t_lo + (t_span + 3) // 4
                t2 = t_lo + (2 * t_span + 3) // 4
                t3 = t_lo + (3 * t_span + 3) // 4
                packed = tl.zeros([], tl.int64)
                for k0 in range(0, L, SEARCH_CHUNK):
                    kk = k0 + cc
                    lu_c = tl.load(lu_ptr + b * M + kk, mask=kk < L, other=-2147483648)
                    packed += tl.sum((lu_c >= t1.to(tl.int32)).to(tl.int64)
                                     + ((lu_c >= t2.to(tl.int32)).to(tl.int64) << 21)
                                     + ((lu_c >= t3.to(tl.int32)).to(tl.int64) << 42), 0)
                ok1 = (packed & field) >= need
                ok2 = ((packed >> 21) & field) >= need
                ok3 = (packed >> 42) >= need
                new_lo = tl.where(ok3, t3, tl.where(ok2, t2, tl.where(ok1, t1, t_lo)))
                t_hi = tl.where(ok3, t_hi, tl.where(ok2, t3 - 1, tl.where(ok1, t2 - 1, t1 - 1)))
                t_lo = new_lo
            ustar = t_lo.to(tl.int32)
            n_above = tl.zeros([], tl.int32)
            for k0 in range(0, L, SEARCH_CHUNK):
                kk = k0 + cc
                lu_c = tl.load(lu_ptr + b * M + kk, mask=kk < L, other=-2147483648)
                n_above += tl.sum((lu_c > ustar).to(tl.int32), 0)
            need_t = need - n_above                            # >= 1 ties at u* to take
            # j*: the largest t with #(ties with j < t) < need_t (the need_t-th smallest index)
            j_lo = tl.zeros([], tl.int64)
            j_hi = tl.full([], 2147483647, tl.int64)
            for _step in range(17):
                t_span = j_hi - j_lo
                t1 = j_lo + (t_span + 3) // 4
                t2 = j_lo + (2 * t_span + 3) // 4
                t3 = j_lo + (3 * t_span + 3) // 4
                packed = tl.zeros([], tl.int64)
                for k0 in range(0, L, SEARCH_CHUNK):
                    kk = k0 + cc
                    km = kk < L
                    lu_c = tl.load(lu_ptr + b * M + kk, mask=km, other=-2147483648)
                    lj_c = tl.load(lj_ptr + b * M + kk, mask=km, other=0)
                    tie = km & (lu_c == ustar)
                    packed += tl.sum((tie & (lj_c < t1.to(tl.int32))).to(tl.int64)
                                     + ((tie & (lj_c < t2.to(tl.int32))).to(tl.int64) << 21)
                                     + ((tie & (lj_c < t3.to(tl.int32))).to(tl.int64) << 42), 0)
                ok1 = (packed & field) < need_t
                ok2 = ((packed >> 21) & field) < need_t
                ok3 = (packed >> 42) < need_t
                new_lo = tl.where(ok3, t3, tl.where(ok2, t2, tl.where(ok1, t1, j_lo)))
                j_hi = tl.where(ok3, j_hi, tl.where(ok2, t3 - 1, tl.where(ok1, t2 - 1, t1 - 1)))
                j_lo = new_lo
            jstar = j_lo.to(tl.int32)
            for k0 in range(0, L, SEARCH_CHUNK):
                kk = k0 + cc
                km = kk < L
                lu_c = tl.load(lu_ptr + b * M + kk, mask=km, other=-2147483648)
                lj_c = tl.load(lj_ptr + b * M + kk, mask=km, other=0)
                taken_c = km & ((lu_c > ustar) | ((lu_c == ustar) & (lj_c <= jstar)))
                before += tl.sum((taken_c & (lj_c < c0)).to(tl.int32), 0)
    chosen = (vi & ~cand) | (cand & ((ui > ustar) | ((ui == ustar) & (i <= jstar))))
    pos = before + tl.cumsum(chosen.to(tl.int32), 0) - 1
    tl.store(sel_ptr + b * width + pos, i, mask=chosen)
    pad = (i >= keep) & (i < width)
    tl.store(sel_ptr + b * width + i, tl.full([CHUNK], -1, tl.int32), mask=pad)
    if TABLE:
        phys = tl.load(table_ptr + b * table_stride_batch + i * table_stride_block, mask=chosen,
                       other=0)
        tl.store(otable_ptr + b * width + pos, phys, mask=chosen)
        tl.store(otable_ptr + b * width + i, tl.zeros([CHUNK], tl.int32), mask=pad)
    if c == 0:
        tl.store(count_ptr + b, keep)
        if TABLE:
            n_tok = tl.load(lens_ptr + b)
            tl.store(olens_ptr + b, (keep - 1) * BLOCK_SIZE + n_tok
                     - ((n_tok + BLOCK_SIZE - 1) // BLOCK_SIZE - 1) * BLOCK_SIZE)


_scratch_bufs: dict = {}


def _scratch(device: torch.device, n: int) -> torch.Tensor:
    """A zeroed int32 buffer of at least ``n`` entries for ``device`` (the rows' histograms),
    reused across calls and left zeroed by the emit kernel; made or grown by a first eager call,
    outside any CUDA graph capture. Shared: one histogram selection at a time per device."""
    key = (device.type, device.index)
    buf = _scratch_bufs.get(key)
    if buf is None or buf.numel() < n:
        buf = _scratch_bufs[key] = torch.zeros(max(n, 1 << 18), dtype=torch.int32, device=device)
    return buf


def scratch_zeroed() -> bool:
    """Every histogram scratch buffer is zeroed, as each selection must leave it (tests)."""
    return all(bool((buf == 0).all()) for buf in _scratch_bufs.values())


def lse_bounds(x: torch.Tensor, scale_log2: float, launch: LaunchConfig, parts: bool = True):
    """Per-row statistics of contiguous ``x [rows..., M]`` at scale ``scale_log2``:
    ``[*rows, P, 3]`` (log2-sum-exp, max, min above ``-inf``) in ``P`` parts of
    ``launch.lse_span`` entries (one part when ``parts`` is false or the row fits in one span),
    each part one program."""
    M = x.shape[-1]
    rows = x.numel() // M
    span = launch.lse_span if parts and 0 < launch.lse_span < M else 0
    n_parts = triton.cdiv(M, span) if span else 1
    stats = torch.empty(*x.shape[:-1], n_parts, 3, dtype=torch.float32, device=x.device)
    chunk = min(pow2(launch.lse_chunk), pow2(span or M, 16))
    jit(_lse_bounds_kernel)[(rows, n_parts)](
        x, stats, M, scale_log2, CHUNK=chunk, SPAN=span,
        num_warps=launch.lse_span_warps if span else launch.lse_warps)
    return stats


def select_hist(x, stats, scale, num_blocks, budget, init_window, local_window, width,
                launch: LaunchConfig, block_table=None, seq_lens=None, block_size=1):
    """The histogram selection: ``x`` the scores ``[B, M]`` (``stats`` None) or per-head scores
    ``[B, H, M]`` with their :func:`lse_bounds` stats ``[B, H, parts, 3]`` (the row is then their
    head mass). Returns ``(sel, count[, table, lens], mass)`` (``mass`` None for plain scores)."""
    mass_mode = stats is not None
    if mass_mode:
        B, H, M = x.shape
    else:
        (B, M), H = x.shape, 1
    dev = x.device
    bins = 1 << launch.hist_bits
    m_padded = pow2(M, 16)
    hist = _scratch(dev, B * bins)[:B * bins]
    prm = torch.empty(B, 3, dtype=torch.int64, device=dev)        # shift, base, need
    lcnt = torch.empty(B, dtype=torch.int32, device=dev)           # reset by the histogram kernel
    mass = torch.empty(B, M, dtype=torch.float32, device=dev) if mass_mode else None
    sel = torch.empty(B, width, dtype=torch.int32, device=dev)
    count = torch.empty(B, dtype=torch.int32, device=dev)
    table = block_table is not None
    otable = torch.empty(B, width, dtype=torch.int32, device=dev) if table else count
    olens = torch.empty(B, dtype=torch.int32, device=dev) if table else count
    lu = torch.empty(B * M, dtype=torch.int32, device=dev)          # the threshold bin's list
    lj = torch.empty(B * M, dtype=torch.int32, device=dev)
    local = max(local_window, 1)
    tile = min(pow2(launch.hist_tile, 16), m_padded)
    if not mass_mode:  # the row's max and min (scale 1), one program per row
        stats = lse_bounds(x.contiguous(), 1.0, launch, parts=False)
    parts = stats.shape[-2]
    jit(_hist_kernel)[(B, triton.cdiv(M, tile))](
        x, stats, mass if mass_mode else count, num_blocks, hist, prm, lcnt, M,
        *((0, 0) if mass_mode else x.stride()), scale * LOG2E, NUM_HEADS=H,
        HEADS_PADDED=pow2(H), TILE=tile, MASS=mass_mode, INIT=init_window, LOCAL=local,
        BINS=bins, PARTS=parts, PARTS_PADDED=pow2(parts), num_warps=4)
    src = mass if mass_mode else x
    chunk = min(pow2(launch.hist_span, 16), m_padded)
    programs = triton.cdiv(M, chunk)
    ccnt = torch.empty(B, programs, dtype=torch.int32, device=dev)
    jit(_hist_list_kernel)[(B, programs)](
        src, *src.stride(), num_blocks, budget, hist, prm, lcnt, lu, lj, ccnt, M,
        INIT=init_window, LOCAL=local, BINS=bins, CHUNK=chunk, num_warps=launch.hist_warps)
    jit(_hist_emit_kernel)[(B, programs)](
        src, *src.stride(), num_blocks, budget, hist, prm, lcnt, lu, lj, ccnt, sel, count, M,
        width, launch.hist_list, block_table if table else count, seq_lens if table else count,
        otable, olens, *(block_table.stride() if table else (0, 0)),
        INIT=init_window, LOCAL=local, BINS=bins, CHUNK=chunk, PROGRAMS_PADDED=pow2(programs),
        LIST_PADDED=pow2(max(launch.hist_list, 1), 16),
        SEARCH_CHUNK=min(pow2(launch.hist_chunk, 16), m_padded), TABLE=table,
        BLOCK_SIZE=block_size, num_warps=launch.hist_warps)
    out = (sel, count, otable, olens) if table else (sel, count)
    return out + (mass,)
