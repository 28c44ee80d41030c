"""Triton sparse-attention ops: same names and signatures as :mod:`ucm.reference.sparse`; inputs
validated by :mod:`ucm.sparse.ops`. CUDA tensors, or CPU tensors under ``TRITON_INTERPRET=1``
(set before triton is imported: its standard library, ``tl.sum`` and friends, is jitted at
import). Kernels call no ``@triton.jit`` helpers, so one process can run them both ways.

- :func:`paged_decode_attention`: split-K ("flash decoding"). Program ``(b * Hkv + g, s)`` takes
  KV head ``g`` of request ``b`` and the ``s``-th slice of its tokens, reads each K/V tile once
  for the whole GQA group (the group's query heads, padded to 16 rows, are the rows of one
  ``tl.dot``; float32 caches use exact float32 dots, and so do bfloat16 ones under the
  interpreter, whose bfloat16 ``tl.dot`` is wrong in Triton 3.9), follows the block table per
  token, runs an online softmax in float32 (base 2) and writes a partial output and its
  log-sum-exp. A second kernel merges the slices per query head. The number of slices is chosen
  so that ``B * Hkv * splits`` covers the multiprocessors a few times over (:func:`plan`).
  Any strides. Per-KV-head tables (``[B, Hkv, M]`` tables / ``[B, Hkv]`` lengths, or a
  ``[B, Hkv, K]`` selection): program ``(b * Hkv + g, s)`` reads row ``(b, g)``.
  Launch defaults tuned on the H200 (``benchmarks/bench_sparse.py --sweep``).
- :func:`update_block_reprs`: one program per (listed block, KV head, sub-block): masked mean /
  min / max over the sub-block's valid tokens; codes hashed from the means by the
  :func:`hash_codes` kernel.
- :func:`score_blocks` (mean, Quest): one program per (request, tile of logical blocks; the tile
  shrinks until a batch of one request fills the GPU), looping over the KV heads: the tile's
  sub-block rows of one KV head (``[TILE_M * G, D]``, one coalesced load) meet the GQA group's
  query heads in one ``tl.dot`` (Quest: two, ``max(q, 0) . kmax + min(q, 0) . kmin``), the
  maximum over each block's ``G`` sub-blocks is taken on the product, then the sum over heads.
  Hamming: one program per (request, tile), XOR + SWAR popcount against the code of each group's
  summed query, the best sub-block per block.
- :func:`hash_codes`: one program per row.
- :func:`select_blocks`: one program per request holding its row of scores: a 17-step 4-ary
  search (or, with ``SELECT_RADIX``, a radix select) for the threshold score over an
  order-preserving integer image of the floats (three probes counted in one packed reduction
  per step), ties to the lower index through a prefix count, compaction through a second one.
  One long row (batch 1, ``SELECT_HIST_*``) takes the histogram selection instead (three
  launches of chunk-local programs, below); with it off (``SELECT_PAIRS_*``), two launches over
  the whole GPU: a pairwise rank of each candidate against the row, then a compaction.
  Rows longer than ``SELECT_KERNEL_MAX_BLOCKS`` use PyTorch glue instead: one ``torch.topk``
  over unique int64 keys (score image, then ``M-1-j``). All give exactly the reference's
  selection.
- Histogram selection (one long row): a global histogram of the score image (bins between the
  row's bounds; atomics); every program finds the threshold's bin from it and lists its chunk's
  candidates in that bin (atomic slots) with a count of its sure blocks; every program then
  ranks the list into the key ``(u*, j*)`` of the last block taken (pairwise, or searches when
  the list is long) and writes its chunk. Programs only touch their chunk, the histogram and
  the list: a single program's pass over the whole row is latency-bound on the H200.
- :func:`select_head_mass`: the selection on the head mass of per-head scores. One long row
  (``MASS_HIST_*``): log-sum-exp and bounds per head, then the histogram selection with the
  head mass computed (and written) by the histogram launch. Other shapes use
  :func:`head_mass` then :func:`select_blocks`. Exact selection on the mass it computes.
- :func:`score_select_head_mass`: per-head scores then :func:`select_head_mass` (the methods'
  call); with :data:`SCORE_HEAD_STATS` (off: slower on the H200) the scoring launch also writes
  the per-head log-sum-exp statistics and the selection skips its log-sum-exp launch.
- :func:`sparse_block_table`: one gather kernel (table entries and lengths);
  :func:`decode_selected` folds it into the decode kernel (reads ``sel`` and the block table).
- mean / kmin / kmax tables may be bfloat16: written rounded from float32; scored with bfloat16
  operands and float32 accumulation when the query is bfloat16 too, else in float32.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import triton
import triton.language as tl

from ucm.fast.triton import interpreting

LOG2E = 1.4426950408889634

#: Tile of tokens per inner step of the decode kernel; launch shape knobs (see :func:`plan`).
BLOCK_N = 128
NUM_WARPS = 4
NUM_STAGES = 2
#: Programs aimed at per multiprocessor by the split heuristic, and the fewest tokens per split.
#: 3 (rounded down, :data:`PLAN_FLOOR`): as many as fit in one wave (3 per multiprocessor at 168
#: registers and 72 KB of shared memory per program, read before the table prefetch; H200:
#: 8 x 32K 6 splits, 1 x 128K dense 49; 2 rounded up gave 5 / 33; 3 rounded up gives 7 at
#: 8 x 32K, two waves, +25% there).
PROGRAMS_PER_SM = 3
MIN_SPLIT_TOKENS = 256
#: Round the split count down (at most PROGRAMS_PER_SM programs per multiprocessor: one wave
#: when that many fit) instead of up.
PLAN_FLOOR = True
#: Slices are whole token tiles ("tile") or whole KV blocks ("block": the slices' lengths differ
#: by less than a block, the last tile of a slice may be partial). H200, 1 x 128K at 20%
#: (``benchmarks/sparse_attn_launch.py``): "block" 33.1-35.3 us against 32.5 ("tile"), the
#: attention already at the speed of a plain read of its 107 MB (32.0 us).
SPLIT_GRAIN = "tile"
#: Issue each tile's V load together with its K load (before the logits) instead of after them
#: (H200: within 0.1 us either way; off).
V_EARLY = False


def _p2(n: int, least: int = 1) -> int:
    return max(least, triton.next_power_of_2(int(n)))


# ---------------------------------------------------------------------------------------------
# decode attention


def _decode_split_kernel(q_ptr, k_ptr, v_ptr, table_ptr, lens_ptr, sel_ptr, count_ptr,
                         opart_ptr, lse_ptr, out_ptr, counter_ptr,
                         sq_b, sq_h, sq_d, sk_n, sk_t, sk_h, sk_d, sv_n, sv_t, sv_h, sv_d,
                         st_b, st_m, ss_b, so_b, so_h, so_d, scale_log2, split_tokens,
                         num_splits, st_h, sl_b, sl_h, ss_h, sc_b, sc_h,
                         HKV: tl.constexpr, GROUP: tl.constexpr, GPAD: tl.constexpr,
                         D: tl.constexpr, DPAD: tl.constexpr, BS: tl.constexpr,
                         TILE: tl.constexpr, IEEE: tl.constexpr, SELECTED: tl.constexpr,
                         MERGE: tl.constexpr, SPAD: tl.constexpr, GP2: tl.constexpr = 1,
                         PDL: tl.constexpr = False, STATIC: tl.constexpr = False,
                         PREFETCH: tl.constexpr = False, V_EARLY: tl.constexpr = False,
                         tab_tokens=0):
    """Partial attention of one GQA group over one slice of one request's tokens.

    Writes ``opart[b, h, s, :]`` (normalized partial output, float32) and ``lse[b, h, s]``
    (log2-sum-exp of the slice's scaled logits; ``-inf`` for an empty slice). SELECTED: the
    tokens are those of the selected logical blocks ``sel[b, :count[b]]`` (physical block
    ``table[b, sel[b, i]]``; only the last one, the sequence's last block, may be partial), i.e.
    :func:`sparse_block_table` folded into the kernel.
    """
    if PDL:  # programmatic dependent launch: wait for the previous grid, let the next one launch
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    pid = tl.program_id(0)
    split = tl.program_id(1)
    b = pid // HKV
    g = pid % HKV
    # per-KV-head tables: the ``*_h`` strides pick KV head g's row (0 for one table per request)
    seq = tl.load(lens_ptr + b * sl_b + g * sl_h)
    if SELECTED:
        last_len = seq - ((seq + BS - 1) // BS - 1) * BS
        seq = (tl.load(count_ptr + b * sc_b + g * sc_h) - 1) * BS + last_len
    start = split * split_tokens
    end = tl.minimum(start + split_tokens, seq)

    rows = tl.arange(0, GPAD)
    heads = g * GROUP + rows
    hmask = rows < GROUP
    d = tl.arange(0, DPAD)
    dmask = d < D
    b64 = b.to(tl.int64)
    q = tl.load(q_ptr + b64 * sq_b + heads[:, None] * sq_h + d[None, :] * sq_d,
                mask=hmask[:, None] & dmask[None, :], other=0.0)
    m_i = tl.full([GPAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GPAD], tl.float32)
    acc = tl.zeros([GPAD, DPAD], tl.float32)
    k_head = k_ptr + g.to(tl.int64) * sk_h
    v_head = v_ptr + g.to(tl.int64) * sv_h
    k_col = d * sk_d
    v_col = d * sv_d
    cols = tl.arange(0, TILE)
    if STATIC:  # trip count known at launch: the first table loads need not wait for the length
        t_hi = start + split_tokens
    else:
        t_hi = end
    if PREFETCH:  # the first tile's table entries, loaded alongside the length (not after it)
        t = start + cols
        imask = t < tab_tokens
        if SELECTED:
            logical = tl.load(sel_ptr + b64 * ss_b + g * ss_h + t // BS, mask=imask, other=0)
            logical = tl.where(logical >= 0, logical, 0)
        else:
            logical = t // BS
        phys_next = tl.load(table_ptr + b64 * st_b + g * st_h + logical * st_m, mask=imask,
                            other=0)
    else:
        phys_next = tl.zeros([TILE], tl.int32)
    for t0 in range(start, t_hi, TILE):
        t = t0 + cols
        tmask = t < end
        if PREFETCH:  # this tile's entries came from the previous step; fetch the next tile's
            phys = phys_next.to(tl.int64)
            tn = t + TILE
            nmask = tn < tab_tokens
            if SELECTED:
                nlogical = tl.load(sel_ptr + b64 * ss_b + g * ss_h + tn // BS, mask=nmask,
                                   other=0)
                nlogical = tl.where(nlogical >= 0, nlogical, 0)
            else:
                nlogical = tn // BS
            phys_next = tl.load(table_ptr + b64 * st_b + g * st_h + nlogical * st_m,
                                mask=nmask, other=0)
        else:
            if STATIC:
                imask = t < tab_tokens                      # in the table, whatever the length
            else:
                imask = tmask
            if SELECTED:
                logical = tl.load(sel_ptr + b64 * ss_b + g * ss_h + t // BS, mask=imask, other=0)
                logical = tl.where(tmask, logical, 0)
            else:
                logical = t // BS
            phys = tl.load(table_ptr + b64 * st_b + g * st_h + logical * st_m, mask=imask,
                           other=0).to(tl.int64)
        off = t % BS
        kv_mask = tmask[:, None] & dmask[None, :]
        k = tl.load(k_head + phys[:, None] * sk_n + off[:, None] * sk_t + k_col[None, :],
                    mask=kv_mask, other=0.0)
        if V_EARLY:  # V's load issued with K's, before the logits need K
            v = tl.load(v_head + phys[:, None] * sv_n + off[:, None] * sv_t + v_col[None, :],
                        mask=kv_mask, other=0.0)
        if IEEE:
            s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        s = tl.where(tmask[None, :], s * scale_log2, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if not V_EARLY:
            v = tl.load(v_head + phys[:, None] * sv_n + off[:, None] * sv_t + v_col[None, :],
                        mask=kv_mask, other=0.0)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new

    row = (b64 * (HKV * GROUP) + heads) * num_splits + split            # [GPAD]
    if start < end:
        lse = m_i + tl.log2(l_i)
        o = acc / l_i[:, None]
    else:
        lse = tl.full([GPAD], float("-inf"), tl.float32)
        o = tl.zeros([GPAD, DPAD], tl.float32)
    tl.store(lse_ptr + row, lse, mask=hmask)
    tl.store(opart_ptr + row[:, None] * D + d[None, :], o, mask=hmask[:, None] & dmask[None, :])
    if MERGE:
        # the group's last slice to finish merges all of them (no second launch): the atomic
        # orders this program's partial stores before it and the others' before the merge reads
        tl.debug_barrier()                                   # every thread's partial stores issued
        done = tl.atomic_add(counter_ptr + pid, 1, sem="acq_rel")
        if done == num_splits - 1:
            # one query head at a time: [SPAD, DPAD] partials in registers (all GROUP heads at
            # once would hold [GP2 * SPAD, DPAD]: 256 floats a thread at 64 slices)
            sr = tl.arange(0, SPAD)
            smask = sr < num_splits
            for hh in tl.static_range(GROUP):
                mrow = (b64 * (HKV * GROUP) + g * GROUP + hh) * num_splits + sr
                lse_s = tl.load(lse_ptr + mrow, mask=smask, other=float("-inf"),
                                cache_modifier=".cg")
                mx = tl.max(lse_s, 0)
                mx = tl.where(mx > float("-inf"), mx, 0.0)
                w = tl.where(lse_s > float("-inf"), tl.exp2(lse_s - mx), 0.0)
                parts = tl.load(opart_ptr + mrow[:, None] * D + d[None, :],
                                mask=smask[:, None] & dmask[None, :], other=0.0,
                                cache_modifier=".cg")
                res = tl.sum(parts * w[:, None], 0) / tl.sum(w, 0)
                tl.store(out_ptr + b64 * so_b + (g * GROUP + hh) * so_h + d * so_d,
                         res.to(out_ptr.dtype.element_ty), mask=dmask)
            tl.atomic_xchg(counter_ptr + pid, 0)                  # ready for the next launch


def _decode_reduce_kernel(opart_ptr, lse_ptr, out_ptr, so_b, so_h, so_d, num_splits,
                          HQ: tl.constexpr, D: tl.constexpr, DPAD: tl.constexpr,
                          SPAD: tl.constexpr, PDL: tl.constexpr = False):
    """Merge the slices of one (request, query head): weights ``2 ** (lse_s - max lse)``."""
    if PDL:  # programmatic dependent launch: wait for the previous grid, let the next one launch
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    pid = tl.program_id(0)
    b = pid // HQ
    h = pid % HQ
    s = tl.arange(0, SPAD)
    smask = s < num_splits
    d = tl.program_id(1) * DPAD + tl.arange(0, DPAD)               # a chunk of the channels
    dmask = d < D
    base = pid.to(tl.int64) * num_splits
    lse = tl.load(lse_ptr + base + s, mask=smask, other=float("-inf"))
    m = tl.max(lse, 0)
    w = tl.where(smask & (lse > float("-inf")), tl.exp2(lse - m), 0.0)
    o = tl.load(opart_ptr + (base + s)[:, None] * D + d[None, :],
                mask=smask[:, None] & dmask[None, :], other=0.0)
    res = tl.sum(o * w[:, None], 0) / tl.sum(w, 0)
    tl.store(out_ptr + b.to(tl.int64) * so_b + h * so_h + d * so_d,
             res.to(out_ptr.dtype.element_ty), mask=dmask)


#: Channels per program of the merge launch (None: all; fewer -> more programs for small batches;
#: 32: -0.7 to -0.9 us at 1 x 128K in three H200 runs, neutral at 8 x 32K).
REDUCE_CHUNK = 32

#: Programmatic dependent launch (Hopper and later, CUDA tensors): every kernel of this module
#: is launched with ``launch_pdl`` and starts with ``gdc_wait`` (the previous grid has finished
#: and its writes are visible, so stream order is kept) then ``gdc_launch_dependents``: the next
#: kernel's launch overlaps this one's run instead of following its end. Off by default.
PDL = False


#: Programmatic dependent launch for the decode kernels only (the split and merge launches; see
#: :data:`PDL`): each launch overlaps the end of the one before it. None: on for CUDA devices of
#: compute capability 9.0 and later (H200: 1 x 128K attention on the sparse table
#: 33.5 -> 32.4 us, ESA stride-8 steps -1.1 us at 1 x 128K and -0.6 us at 8 x 32K; the dense
#: kernel 127.3 -> 126.0 us, as with PDL on every kernel).
DECODE_PDL = None
_pdl_ok: dict = {}


def _hopper(device: torch.device) -> bool:
    """A CUDA device of compute capability 9.0 or later (programmatic dependent launch)."""
    if device.type != "cuda":
        return False
    ok = _pdl_ok.get(device.index)
    if ok is None:
        ok = _pdl_ok[device.index] = torch.cuda.get_device_capability(device)[0] >= 9
    return ok


def _decode_pdl(device: torch.device) -> bool:
    if DECODE_PDL is not None:
        return bool(DECODE_PDL)
    return _hopper(device)


def _pdl_launch(on: bool = False) -> dict:
    """Launch keywords for :data:`PDL` (or ``on``; none under the interpreter)."""
    return {"PDL": True, "launch_pdl": True} if (PDL or on) and not interpreting() else {}


_jitted: dict = {}


def _jit(fn):
    """``triton.jit(fn)``, made on first use so that ``TRITON_INTERPRET`` set before the first
    call is honoured (``triton.jit`` reads it when it decorates)."""
    key = (fn.__name__, interpreting())
    k = _jitted.get(key)
    if k is None:
        k = _jitted[key] = triton.jit(fn)
    return k


_sm_counts: dict = {}


def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 4  # the interpreter: any small number
    n = _sm_counts.get(device.index)
    if n is None:
        n = _sm_counts[device.index] = torch.cuda.get_device_properties(device).multi_processor_count
    return n


def _split_len(max_tokens: int, splits: int, tile: int, block_size: int) -> tuple[int, int]:
    """``(num_splits, split_tokens)`` for about ``splits`` slices, each a multiple of the grain
    (:data:`SPLIT_GRAIN`)."""
    grain = block_size if SPLIT_GRAIN == "block" else tile
    split_tokens = math.ceil(math.ceil(max_tokens / splits) / grain) * grain
    return math.ceil(max_tokens / split_tokens), split_tokens


def plan(batch: int, num_kv_heads: int, max_tokens: int, device: torch.device,
         block_n: Optional[int] = None, block_size: int = 16) -> tuple[int, int]:
    """``(num_splits, split_tokens)`` for a decode launch: enough programs
    (``batch * num_kv_heads * num_splits``) for ``PROGRAMS_PER_SM`` per multiprocessor, each
    slice a multiple of the token tile and at least ``MIN_SPLIT_TOKENS`` long."""
    tile = block_n or BLOCK_N
    units = batch * num_kv_heads
    slots = PROGRAMS_PER_SM * _sm_count(device) / units
    want = max(1, math.floor(slots) if PLAN_FLOOR else math.ceil(slots))
    most = max(1, max_tokens // max(MIN_SPLIT_TOKENS, tile))
    return _split_len(max_tokens, min(want, most), tile, block_size)


#: Slices of a decode launch that runs beside other work (``decode(..., beside=True)``), as a share
#: of the planned ones: ESA's asynchronous retrieval runs beside the attention of the step that
#: computes it, and leaving it part of the GPU shortens the pair. H200, ESA stride 8 at
#: 1 x 128K (41 planned slices): 48 / 40 / 32 / 24 / 16 / 8 slices 35.68 / 35.47 / 34.90 / 34.35
#: / 35.49 / 38.13 us per step (default 35.68); 8 x 32K (6 planned): within 0.7%.
BESIDE_SHARE = 0.6


#: Loop over the slice's full tile count (masked past the length) instead of up to the length,
#: so the first table and K/V loads need not wait for the length's load. Off: as fast as
#: PREFETCH_TABLE on full tables, but a short sequence in a wide table runs every masked tile
#: (H200, 1K tokens in a 128K table: 78 us against 21).
STATIC_LOOP = False
#: Load each tile's table entries one step ahead (the first tile's before the loop, alongside the
#: length), so no K/V load waits for a table load issued in the same step. H200: 1 x 128K at 20%
#: 35.3 -> 33.9 us, dense 133.7 -> 130.6 us.
PREFETCH_TABLE = True

#: Merge the slices inside the split kernel (the last slice of each (request, KV head) to finish
#: merges, counted by an atomic per group in a cached per-device buffer that the merging program
#: resets) instead of a second launch. The buffer is shared: one decode launch at a time per
#: device (streams launching decodes concurrently need FUSED_MERGE = False).
FUSED_MERGE = False
_counter_bufs: dict = {}


def _counters(device: torch.device, n: int) -> torch.Tensor:
    """A zeroed int32 buffer of at least ``n`` counters for ``device``, reused across calls (every
    launch leaves it zeroed); grown outside any CUDA graph capture by a first eager call."""
    key = (device.type, device.index)
    buf = _counter_bufs.get(key)
    if buf is None or buf.numel() < n:
        buf = _counter_bufs[key] = torch.zeros(max(n, 1024), dtype=torch.int32, device=device)
    return buf


def decode(q, k_cache, v_cache, block_table, seq_lens, scale: float, out=None, *,
           sel=None, count=None, block_n: Optional[int] = None,
           num_splits: Optional[int] = None, num_warps: Optional[int] = None,
           num_stages: Optional[int] = None, fused_merge: Optional[bool] = None,
           static_loop: Optional[bool] = None, prefetch: Optional[bool] = None,
           v_early: Optional[bool] = None, beside: bool = False):
    """:func:`paged_decode_attention` with explicit launch knobs (benchmarks, tuning); with
    ``sel, count`` from :func:`select_blocks`, over the selected blocks only
    (:func:`decode_selected`). ``beside``: the launch shares the GPU with work on another
    stream (ESA's asynchronous retrieval): :data:`BESIDE_SHARE` of the planned slices."""
    B, Hq, D = q.shape
    _, bs, Hkv, _ = k_cache.shape
    group = Hq // Hkv
    tile = block_n or BLOCK_N
    selected = sel is not None
    if selected:
        sel = sel.contiguous()
    max_tokens = (sel if selected else block_table).shape[-1] * bs
    # per-KV-head tables ([B, Hkv, K] table or selection, [B, Hkv] lengths or counts)
    st_h = block_table.stride(1) if block_table.dim() == 3 else 0
    st_b, st_m = block_table.stride(0), block_table.stride(-1)
    sl_b, sl_h = (seq_lens.stride(0), seq_lens.stride(1)) if seq_lens.dim() == 2 else (1, 0)
    ss_b, ss_h = ((sel.stride(0), sel.stride(1) if sel.dim() == 3 else 0) if selected else (0, 0))
    if selected and count.dim() == 2:
        sc_b, sc_h = count.stride(0), count.stride(1)
    else:
        sc_b, sc_h = 1, 0
    merge = FUSED_MERGE if fused_merge is None else fused_merge
    static = STATIC_LOOP if static_loop is None else static_loop
    prefetch = PREFETCH_TABLE if prefetch is None else prefetch
    if num_splits is None:
        num_splits, split_tokens = plan(B, Hkv, max_tokens, q.device, tile, bs)
        if beside:
            num_splits, split_tokens = _split_len(
                max_tokens, max(1, round(num_splits * BESIDE_SHARE)), tile, bs)
    else:
        num_splits, split_tokens = _split_len(max_tokens, num_splits, tile, bs)
    opart = torch.empty(B, Hq, num_splits, D, dtype=torch.float32, device=q.device)
    lse = torch.empty(B, Hq, num_splits, dtype=torch.float32, device=q.device)
    if out is None:
        out = torch.empty(B, Hq, D, dtype=q.dtype, device=q.device)
    dpad = _p2(D, 16)
    warps = num_warps or NUM_WARPS
    counters = _counters(q.device, B * Hkv) if merge else seq_lens
    pdl = _decode_pdl(q.device)
    _jit(_decode_split_kernel)[(B * Hkv, num_splits)](
        q, k_cache, v_cache, block_table, seq_lens, sel if selected else seq_lens,
        count if selected else seq_lens, opart, lse, out, counters,
        *q.stride(), *k_cache.stride(), *v_cache.stride(), st_b, st_m,
        ss_b, *out.stride(), scale * LOG2E, split_tokens,
        num_splits, st_h, sl_b, sl_h, ss_h, sc_b, sc_h,
        HKV=Hkv, GROUP=group, GPAD=_p2(group, 16), D=D, DPAD=dpad, BS=bs, TILE=tile,
        IEEE=q.dtype == torch.float32 or (interpreting() and q.dtype == torch.bfloat16),
        SELECTED=selected, MERGE=merge, SPAD=_p2(num_splits), GP2=_p2(group),
        STATIC=static, PREFETCH=prefetch,
        V_EARLY=V_EARLY if v_early is None else v_early, tab_tokens=max_tokens,
        num_warps=warps, num_stages=num_stages or NUM_STAGES, **_pdl_launch(pdl))
    if not merge:
        chunk = min(dpad, max(16, _p2(REDUCE_CHUNK))) if REDUCE_CHUNK else dpad
        _jit(_decode_reduce_kernel)[(B * Hq, triton.cdiv(D, chunk))](
            opart, lse, out, *out.stride(), num_splits, HQ=Hq, D=D, DPAD=chunk,
            SPAD=_p2(num_splits), num_warps=4, **_pdl_launch(pdl))
    return out


def paged_decode_attention(q, k_cache, v_cache, block_table, seq_lens, *, scale: float,
                           out=None):
    """Same contract as :func:`ucm.reference.sparse.paged_decode_attention`; asynchronous."""
    return decode(q, k_cache, v_cache, block_table, seq_lens, scale, out)


def decode_selected(q, k_cache, v_cache, block_table, seq_lens, sel, count, *, scale: float,
                    out=None):
    """Sparse decode in one step: the result of ``paged_decode_attention(q, k_cache, v_cache,
    *sparse_block_table(block_table, seq_lens, sel, count, block_size))`` without building the
    sparse table (the kernel reads ``sel`` and ``block_table`` itself). Not a public op: inputs
    as validated by :func:`ucm.sparse.ops.sparse_block_table` (``sel, count`` from
    :func:`select_blocks`); asynchronous."""
    return decode(q, k_cache, v_cache, block_table, seq_lens, scale, out, sel=sel, count=count)


# ---------------------------------------------------------------------------------------------
# hashing and block representations


def _hash_kernel(x_ptr, proj_ptr, out_ptr, D: tl.constexpr, DPAD: tl.constexpr,
                 WORDS: tl.constexpr):
    """Row ``program_id(0)`` of ``x [rows, D]``: word ``w`` = sign bits of
    ``x @ proj[:, 32 w : 32 w + 32]`` (float32 products summed over D)."""
    row = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, DPAD)
    dmask = d < D
    x = tl.load(x_ptr + row * D + d, mask=dmask, other=0.0).to(tl.float32)
    lanes = tl.arange(0, 32)
    for w in range(WORDS):
        cols = w * 32 + lanes
        p = tl.load(proj_ptr + d[:, None] * (WORDS * 32) + cols[None, :], mask=dmask[:, None],
                    other=0.0)
        y = tl.sum(x[:, None] * p, 0)                                        # [32]
        bits = tl.where(y > 0, tl.full([32], 1, tl.uint32) << lanes.to(tl.uint32), 0)
        tl.store(out_ptr + row * WORDS + w, tl.sum(bits, 0).to(tl.int32, bitcast=True))


def hash_codes(x, proj):
    """Same contract as :func:`ucm.reference.sparse.hash_codes`."""
    D, bits = proj.shape
    rows = x.reshape(-1, D).contiguous()
    proj = proj.contiguous()
    out = torch.empty(rows.shape[0], bits // 32, dtype=torch.int32, device=x.device)
    if rows.shape[0]:
        _jit(_hash_kernel)[(rows.shape[0],)](rows, proj, out, D=D, DPAD=_p2(D, 16),
                                              WORDS=bits // 32)
    return out.reshape(*x.shape[:-1], bits // 32)


def _reprs_kernel(k_ptr, ids_ptr, ntok_ptr, mean_ptr, kmin_ptr, kmax_ptr, listed_ptr,
                  sk_n, sk_t, sk_h, sk_d, HKV: tl.constexpr, D: tl.constexpr, DPAD: tl.constexpr,
                  T: tl.constexpr, TPAD: tl.constexpr, G: tl.constexpr, DO_MEAN: tl.constexpr,
                  DO_MIN: tl.constexpr, DO_MAX: tl.constexpr, DO_LISTED: tl.constexpr,
                  scale_ptr=None, QUANT: tl.constexpr = False):
    """Block ``ids[i]``, KV head ``g``, sub-block ``s`` (tokens ``[s T, (s + 1) T)``, or the last
    sub-block holding valid tokens when ``s T >= ntok[i]``): mean / min / max over its valid
    tokens into row ``(ids[i], s, g)`` of the ``[num_blocks, G, HKV, D]`` tables; DO_LISTED also
    writes the mean to row ``(i, s, g)`` of ``listed [N, G, HKV, D]``. QUANT: the mean row is
    stored as int8 with its float32 scale in ``scale [num_blocks, G, HKV]``, as
    :func:`ucm.reference.sparse.quantize_rows` rounds it."""
    i = tl.program_id(0)
    g = tl.program_id(1)
    sub = tl.program_id(2)
    blk = tl.load(ids_ptr + i).to(tl.int64)
    n = tl.load(ntok_ptr + i).to(tl.int32)
    src = tl.minimum(sub, (n - 1) // T)
    t = tl.arange(0, TPAD)
    pos = src * T + t
    d = tl.arange(0, DPAD)
    dmask = d < D
    tok = (t < T) & (pos < n)
    live = tok[:, None] & dmask[None, :]
    keys = tl.load(k_ptr + blk * sk_n + pos[:, None] * sk_t + g * sk_h + d[None, :] * sk_d,
                   mask=live, other=0.0).to(tl.float32)
    row = ((blk * G + sub) * HKV + g) * D + d
    mean = tl.sum(keys, 0) / tl.minimum(n - src * T, T).to(tl.float32)
    if DO_MEAN and QUANT:
        amax = tl.max(tl.where(dmask, tl.abs(mean), 0.0), 0)
        scale = amax / 127.0
        safe = tl.where(scale > 0, scale, 1.0)
        qv = tl.minimum(tl.maximum(tl.floor(mean / safe + 0.5), -127.0), 127.0)
        qv = tl.where(scale > 0, qv, 0.0)
        tl.store(mean_ptr + row, qv.to(tl.int8), mask=dmask)
        tl.store(scale_ptr + (blk * G + sub) * HKV + g, scale)
    elif DO_MEAN:
        tl.store(mean_ptr + row, mean, mask=dmask)
    if DO_MIN:
        tl.store(kmin_ptr + row, tl.min(tl.where(live, keys, float("inf")), 0), mask=dmask)
    if DO_MAX:
        tl.store(kmax_ptr + row, tl.max(tl.where(live, keys, float("-inf")), 0), mask=dmask)
    if DO_LISTED:
        tl.store(listed_ptr + ((i.to(tl.int64) * G + sub) * HKV + g) * D + d, mean, mask=dmask)


def _groups_of(*tables) -> int:
    """Sub-block summaries per block of the given tables (3-D tables: 1)."""
    t = next(x for x in tables if x is not None)
    return 1 if t.dim() == 3 else t.shape[1]


def update_block_reprs(k_cache, block_ids, num_tokens, *, mean=None, kmin=None, kmax=None,
                       codes=None, proj=None, mean_scale=None) -> None:
    """Same contract as :func:`ucm.reference.sparse.update_block_reprs`; asynchronous."""
    n = block_ids.shape[0]
    if n == 0:
        return
    _, bs, Hkv, D = k_cache.shape
    G = _groups_of(mean, kmin, kmax, codes)
    T = bs // G
    dummy = torch.empty(1, dtype=torch.float32, device=k_cache.device)
    tables = []
    for t in (mean, kmin, kmax, mean_scale):  # written through flat row indexes: need contiguity
        tables.append(None if t is None else (t if t.is_contiguous() else t.contiguous()))
    listed = None if codes is None else torch.empty(n, G, Hkv, D, dtype=torch.float32,
                                                    device=k_cache.device)
    _jit(_reprs_kernel)[(n, Hkv, G)](
        k_cache, block_ids, num_tokens, *(dummy if t is None else t for t in tables[:3]),
        dummy if listed is None else listed, *k_cache.stride(),
        HKV=Hkv, D=D, DPAD=_p2(D, 16), T=T, TPAD=_p2(T), G=G, DO_MEAN=mean is not None,
        DO_MIN=kmin is not None, DO_MAX=kmax is not None, DO_LISTED=listed is not None,
        scale_ptr=dummy if mean_scale is None else tables[3], QUANT=mean_scale is not None)
    for given, used in zip((mean, kmin, kmax, mean_scale), tables):
        if given is not None and used is not given:
            given.copy_(used)
    if codes is not None:
        view = codes if codes.dim() == 4 else codes.unsqueeze(1)
        view[block_ids.long()] = hash_codes(listed, proj)


# ---------------------------------------------------------------------------------------------
# scoring


def _score_dot_kernel(q_ptr, table_ptr, nblk_ptr, a_ptr, b_ptr, mask_ptr, out_ptr,
                      sq_b, sq_h, sq_d, st_b, st_m, M,
                      HKV: tl.constexpr, GROUP: tl.constexpr, GPAD: tl.constexpr,
                      D: tl.constexpr, DPAD: tl.constexpr, G: tl.constexpr, SPAD: tl.constexpr,
                      KIND: tl.constexpr, HAS_MASK: tl.constexpr, PER_HEAD: tl.constexpr,
                      TILE_M: tl.constexpr, IEEE: tl.constexpr, PDL: tl.constexpr = False,
                      scale_ptr=None, QUANT: tl.constexpr = False):
    """Mean (KIND 0) or Quest (KIND 1) scores of logical blocks ``[tile * TILE_M, +TILE_M)`` of
    request ``b``, as matrix products.

    The tile's sub-block rows of one KV head, ``[TILE_M * SPAD, D]`` (row ``jj * SPAD + s``:
    block ``jj``, sub-block ``s``), meet the GQA group's query heads (padded to ``GPAD`` rows) in
    one ``tl.dot``; the maximum over each block's ``G`` sub-blocks is taken on the
    ``[GPAD, TILE_M, SPAD]`` view of the product. Quest's bound is two products:
    ``sum_d max(q_d kmin_d, q_d kmax_d) = max(q, 0) . kmax + min(q, 0) . kmin`` (``kmin <= kmax``,
    as :func:`update_block_reprs` writes them); ``a`` is ``mean`` or ``kmax``, ``b`` ``kmin``.
    IEEE: float32 operands and exact float32 products (float32 tables or queries, and the
    interpreter), else bfloat16 operands with float32 accumulation (their products are exact).
    QUANT (KIND 0): an int8 ``mean`` (exact in bfloat16) whose products are scaled by each row's
    ``scale [num_blocks, G, HKV]`` after the product.
    """
    if PDL:  # programmatic dependent launch: wait for the previous grid, let the next one launch
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    b = tl.program_id(0).to(tl.int64)
    j0 = tl.program_id(1) * TILE_M
    nb = tl.load(nblk_ptr + b)
    r = tl.arange(0, TILE_M * SPAD)
    jr = j0 + r // SPAD
    sr = r % SPAD
    rvalid = (jr < nb) & (sr < G)
    phys = tl.load(table_ptr + b * st_b + jr * st_m, mask=rvalid, other=0).to(tl.int64)
    j = j0 + tl.arange(0, TILE_M)
    valid = j < nb
    inside = j < M
    rows = tl.arange(0, GPAD)
    hmask = rows < GROUP
    d = tl.arange(0, DPAD)
    dmask = d < D
    qmask = hmask[:, None] & dmask[None, :]
    amask = rvalid[:, None] & dmask[None, :]
    total = tl.zeros([TILE_M], tl.float32)
    for g in tl.static_range(HKV):
        heads = g * GROUP + rows
        qg = tl.load(q_ptr + b * sq_b + heads[:, None] * sq_h + d[None, :] * sq_d, mask=qmask,
                     other=0.0)
        if IEEE:
            qg = qg.to(tl.float32)
        if HAS_MASK:
            keep = tl.load(mask_ptr + (b * (HKV * GROUP) + heads[:, None]) * D + d[None, :],
                           mask=qmask, other=0)
            qg = tl.where(keep != 0, qg, tl.zeros_like(qg))
        off = ((phys * G + sr) * HKV + g)[:, None] * D + d[None, :]
        rep_a = tl.load(a_ptr + off, mask=amask, other=0)
        if IEEE:
            rep_a = rep_a.to(tl.float32)
        elif QUANT:
            rep_a = rep_a.to(qg.dtype)                              # int8: exact in bfloat16
        if KIND == 1:
            rep_b = tl.load(b_ptr + off, mask=amask, other=0.0)
            if IEEE:
                rep_b = rep_b.to(tl.float32)
            zero = tl.zeros_like(qg)
            q_pos = tl.where(qg > 0, qg, zero)                     # same dtype as qg
            q_neg = tl.where(qg < 0, qg, zero)
            if IEEE:
                s = tl.dot(q_pos, tl.trans(rep_a), input_precision="ieee")
                s += tl.dot(q_neg, tl.trans(rep_b), input_precision="ieee")
            else:
                s = tl.dot(q_pos, tl.trans(rep_a))
                s += tl.dot(q_neg, tl.trans(rep_b))
        else:
            if IEEE:
                s = tl.dot(qg, tl.trans(rep_a), input_precision="ieee")
            else:
                s = tl.dot(qg, tl.trans(rep_a))                    # [GPAD, TILE_M * SPAD]
            if QUANT:
                rs = tl.load(scale_ptr + (phys * G + sr) * HKV + g, mask=rvalid, other=0.0)
                s = s * rs[None, :]
        s = tl.where(rvalid[None, :], s, float("-inf"))
        best = tl.max(tl.reshape(s, [GPAD, TILE_M, SPAD]), 2)      # [GPAD, TILE_M]
        if PER_HEAD:
            tl.store(out_ptr + (b * (HKV * GROUP) + heads[:, None]) * M + j[None, :],
                     tl.where(valid[None, :], best, float("-inf")),
                     mask=hmask[:, None] & inside[None, :])
        total += tl.sum(tl.where(hmask[:, None], best, 0.0), 0)
    if not PER_HEAD:
        tl.store(out_ptr + b * M + j, tl.where(valid, total, float("-inf")), mask=inside)


def _score_dot_pipe_kernel(q_ptr, table_ptr, nblk_ptr, a_ptr, b_ptr, mask_ptr, out_ptr,
                      sq_b, sq_h, sq_d, st_b, st_m, M,
                      HKV: tl.constexpr, GROUP: tl.constexpr, GPAD: tl.constexpr,
                      D: tl.constexpr, DPAD: tl.constexpr, G: tl.constexpr, SPAD: tl.constexpr,
                      KIND: tl.constexpr, HAS_MASK: tl.constexpr, PER_HEAD: tl.constexpr,
                      TILE_M: tl.constexpr, IEEE: tl.constexpr, PDL: tl.constexpr = False,
                           LOOP_STAGES: tl.constexpr = 3, part_ptr=None, grp_ptr=None,
                           stat_ptr=None, cnt_ptr=None, stat_scale=1.0,
                           STATS: tl.constexpr = False, HQ: tl.constexpr = 1,
                           HPAD: tl.constexpr = 1, GSZ: tl.constexpr = 1,
                           NGPAD: tl.constexpr = 1, scale_ptr=None,
                           QUANT: tl.constexpr = False):
    """:func:`_score_dot_kernel` with the KV heads in a software-pipelined loop
    (``LOOP_STAGES`` stages: the next heads' summary rows are loaded while this head's product
    runs) instead of an unrolled one. Per-head stores and the sum as there.

    STATS (per-head scores): also each head's log-sum-exp and bounds over the row, as
    :func:`_lse_bounds_kernel` writes them (``stat [B, HQ, 3]``: ``log2 sum_j 2 ** (c x_j)``,
    ``max c x``, ``min c x`` over the finite entries; ``c = stat_scale``), without a launch of
    its own: every program writes its tile's partial (max, sum of ``2 ** (c x - max)``, min) per
    head to ``part [B, HQ, tiles, 3]``; the last program of each group of ``GSZ`` tiles to
    finish (atomic ticket ``cnt[b * groups + group]``) combines the group's partials into
    ``grp [B, HQ, groups, 3]``, and the last group to finish (ticket ``cnt[B * groups + b]``)
    combines those into ``stat``. Each ticket is reset by the program that drew the last one."""
    if PDL:  # programmatic dependent launch: wait for the previous grid, let the next one launch
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    b = tl.program_id(0).to(tl.int64)
    j0 = tl.program_id(1) * TILE_M
    nb = tl.load(nblk_ptr + b)
    r = tl.arange(0, TILE_M * SPAD)
    jr = j0 + r // SPAD
    sr = r % SPAD
    rvalid = (jr < nb) & (sr < G)
    phys = tl.load(table_ptr + b * st_b + jr * st_m, mask=rvalid, other=0).to(tl.int64)
    j = j0 + tl.arange(0, TILE_M)
    valid = j < nb
    inside = j < M
    rows = tl.arange(0, GPAD)
    hmask = rows < GROUP
    d = tl.arange(0, DPAD)
    dmask = d < D
    qmask = hmask[:, None] & dmask[None, :]
    amask = rvalid[:, None] & dmask[None, :]
    total = tl.zeros([TILE_M], tl.float32)
    for g in tl.range(0, HKV, num_stages=LOOP_STAGES):
        heads = g * GROUP + rows
        qg = tl.load(q_ptr + b * sq_b + heads[:, None] * sq_h + d[None, :] * sq_d, mask=qmask,
                     other=0.0)
        if IEEE:
            qg = qg.to(tl.float32)
        if HAS_MASK:
            keep = tl.load(mask_ptr + (b * (HKV * GROUP) + heads[:, None]) * D + d[None, :],
                           mask=qmask, other=0)
            qg = tl.where(keep != 0, qg, tl.zeros_like(qg))
        off = ((phys * G + sr) * HKV + g)[:, None] * D + d[None, :]
        rep_a = tl.load(a_ptr + off, mask=amask, other=0)
        if IEEE:
            rep_a = rep_a.to(tl.float32)
        elif QUANT:
            rep_a = rep_a.to(qg.dtype)                              # int8: exact in bfloat16
        if KIND == 1:
            rep_b = tl.load(b_ptr + off, mask=amask, other=0.0)
            if IEEE:
                rep_b = rep_b.to(tl.float32)
            zero = tl.zeros_like(qg)
            q_pos = tl.where(qg > 0, qg, zero)                     # same dtype as qg
            q_neg = tl.where(qg < 0, qg, zero)
            if IEEE:
                s = tl.dot(q_pos, tl.trans(rep_a), input_precision="ieee")
                s += tl.dot(q_neg, tl.trans(rep_b), input_precision="ieee")
            else:
                s = tl.dot(q_pos, tl.trans(rep_a))
                s += tl.dot(q_neg, tl.trans(rep_b))
        else:
            if IEEE:
                s = tl.dot(qg, tl.trans(rep_a), input_precision="ieee")
            else:
                s = tl.dot(qg, tl.trans(rep_a))                    # [GPAD, TILE_M * SPAD]
            if QUANT:
                rs = tl.load(scale_ptr + (phys * G + sr) * HKV + g, mask=rvalid, other=0.0)
                s = s * rs[None, :]
        s = tl.where(rvalid[None, :], s, float("-inf"))
        best = tl.max(tl.reshape(s, [GPAD, TILE_M, SPAD]), 2)      # [GPAD, TILE_M]
        if PER_HEAD:
            tl.store(out_ptr + (b * (HKV * GROUP) + heads[:, None]) * M + j[None, :],
                     tl.where(valid[None, :], best, float("-inf")),
                     mask=hmask[:, None] & inside[None, :])
            if STATS:  # this tile's partial log-sum-exp and bounds of each of the group's heads
                cx = tl.where(valid[None, :], best * stat_scale, float("-inf"))
                pm = tl.max(cx, 1)
                psafe = tl.where(pm > float("-inf"), pm, 0.0)
                pl = tl.sum(tl.exp2(cx - psafe[:, None]), 1)
                pn = tl.min(tl.where(cx > float("-inf"), cx, float("inf")), 1)
                prow = ((b * HQ + heads) * tl.num_programs(1) + tl.program_id(1)) * 3
                tl.store(part_ptr + prow, pm, mask=hmask)
                tl.store(part_ptr + prow + 1, pl, mask=hmask)
                tl.store(part_ptr + prow + 2, pn, mask=hmask)
        total += tl.sum(tl.where(hmask[:, None], best, 0.0), 0)
    if not PER_HEAD:
        tl.store(out_ptr + b * M + j, tl.where(valid, total, float("-inf")), mask=inside)
    if STATS:
        # the group's last tile to finish combines the group's partials, the row's last group
        # combines the groups' (the atomics order the partial stores before the combining reads)
        nt = tl.num_programs(1)
        tile = tl.program_id(1)
        ng = (nt + GSZ - 1) // GSZ
        gi = tile // GSZ
        in_group = tl.minimum(nt - gi * GSZ, GSZ)
        tl.debug_barrier()                                     # every thread's partials stored
        done = tl.atomic_add(cnt_ptr + b * ng + gi, 1, sem="acq_rel")
        if done == in_group - 1:
            hh = tl.arange(0, HPAD)
            hm = hh < HQ
            tt = gi * GSZ + tl.arange(0, GSZ)
            cm = hm[:, None] & (tt < nt)[None, :]
            src = ((b * HQ + hh[:, None]) * nt + tt[None, :]) * 3
            am = tl.load(part_ptr + src, mask=cm, other=float("-inf"), cache_modifier=".cg")
            al = tl.load(part_ptr + src + 1, mask=cm, other=0.0, cache_modifier=".cg")
            an = tl.load(part_ptr + src + 2, mask=cm, other=float("inf"), cache_modifier=".cg")
            gm = tl.max(am, 1)
            gsafe = tl.where(gm > float("-inf"), gm, 0.0)
            gl = tl.sum(tl.where(am > float("-inf"), al * tl.exp2(am - gsafe[:, None]), 0.0), 1)
            gn = tl.min(an, 1)
            dst = ((b * HQ + hh) * ng + gi) * 3
            tl.store(grp_ptr + dst, gm, mask=hm)
            tl.store(grp_ptr + dst + 1, gl, mask=hm)
            tl.store(grp_ptr + dst + 2, gn, mask=hm)
            tl.atomic_xchg(cnt_ptr + b * ng + gi, 0)           # ready for the next launch
            tl.debug_barrier()                                 # every thread's group stats stored
            last = tl.atomic_add(cnt_ptr + tl.num_programs(0) * ng + b, 1, sem="acq_rel")
            if last == ng - 1:
                gg = tl.arange(0, NGPAD)
                rm = hm[:, None] & (gg < ng)[None, :]
                src2 = ((b * HQ + hh[:, None]) * ng + gg[None, :]) * 3
                bm = tl.load(grp_ptr + src2, mask=rm, other=float("-inf"), cache_modifier=".cg")
                bl = tl.load(grp_ptr + src2 + 1, mask=rm, other=0.0, cache_modifier=".cg")
                bn = tl.load(grp_ptr + src2 + 2, mask=rm, other=float("inf"),
                             cache_modifier=".cg")
                rmax = tl.max(bm, 1)
                rsafe = tl.where(rmax > float("-inf"), rmax, 0.0)
                rsum = tl.sum(tl.where(bm > float("-inf"), bl * tl.exp2(bm - rsafe[:, None]),
                                       0.0), 1)
                srow = (b * HQ + hh) * 3
                tl.store(stat_ptr + srow, rsafe + tl.log2(rsum), mask=hm)
                tl.store(stat_ptr + srow + 1, rmax, mask=hm)
                tl.store(stat_ptr + srow + 2, tl.min(bn, 1), mask=hm)
                tl.atomic_xchg(cnt_ptr + tl.num_programs(0) * ng + b, 0)


def _hamming_kernel(table_ptr, nblk_ptr, codes_ptr, qcode_ptr, out_ptr, st_b, st_m, M,
                    HKV: tl.constexpr, HPAD: tl.constexpr, G: tl.constexpr, WORDS: tl.constexpr,
                    WPAD: tl.constexpr, PER_HEAD: tl.constexpr, TILE_M: tl.constexpr):
    """Hamming scores of logical blocks ``[tile * TILE_M, +TILE_M)`` of request ``b``: per KV
    head, equal bits between each sub-block's code and the code of the group's summed query
    (``qcode [B, HKV, WORDS]``), XOR + SWAR popcount, the best sub-block per block."""
    b = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1) * TILE_M + tl.arange(0, TILE_M)
    nb = tl.load(nblk_ptr + b)
    valid = j < nb
    inside = j < M
    phys = tl.load(table_ptr + b * st_b + j * st_m, mask=valid, other=0).to(tl.int64)
    g = tl.arange(0, HPAD)
    gmask = g < HKV
    w = tl.arange(0, WPAD)
    wmask = w < WORDS
    m3 = valid[:, None, None] & gmask[None, :, None] & wmask[None, None, :]
    qw = tl.load(qcode_ptr + (b * HKV + g[:, None]) * WORDS + w[None, :],
                 mask=gmask[:, None] & wmask[None, :], other=0)
    best = tl.zeros([TILE_M, HPAD], tl.int32)
    for sub in tl.static_range(G):
        codes = tl.load(codes_ptr + ((phys[:, None, None] * G + sub) * HKV + g[None, :, None])
                        * WORDS + w[None, None, :], mask=m3, other=0)
        x = (codes ^ qw[None, :, :]).to(tl.uint32, bitcast=True)
        x = x - ((x >> 1) & 0x55555555)                           # SWAR popcount
        x = (x & 0x33333333) + ((x >> 2) & 0x33333333)
        x = (x + (x >> 4)) & 0x0F0F0F0F
        x = x + (x >> 8)
        x = (x + (x >> 16)) & 0x3F
        diff = tl.sum(tl.where(m3, x, 0), 2)
        best = tl.maximum(best, WORDS * 32 - diff.to(tl.int32))
    score = best.to(tl.float32)                                    # [TILE_M, HPAD]
    if PER_HEAD:
        tl.store(out_ptr + (b * HKV + g[None, :]) * M + j[:, None],
                 tl.where(valid[:, None], score, float("-inf")),
                 mask=inside[:, None] & gmask[None, :])
    else:
        total = tl.sum(tl.where(gmask[None, :], score, 0.0), 1)
        tl.store(out_ptr + b * M + j, tl.where(valid, total, float("-inf")), mask=inside)


#: Mean / Quest scoring: sub-block rows one program holds per KV head (``TILE_M * SPAD``; sets
#: the block tile), the fewest programs aimed at per multiprocessor (the tile shrinks, down to
#: 16 rows, until ``batch * tiles`` reaches it: batch 1 fills the GPU), warps, pipeline stages.
SCORE_ROWS = 64
SCORE_PROGRAMS_PER_SM = 2
SCORE_WARPS = 4
SCORE_STAGES = 2
#: Stages of a software-pipelined loop over the KV heads in the mean / Quest scoring kernel
#: (:func:`_score_dot_pipe_kernel`); 0: the unrolled loop (:func:`_score_dot_kernel`). H200,
#: ESA per-head scores, G = 4 bf16 tables: 8 x 32K 41.7 -> 36.5 us (3 stages),
#: 1 x 128K 20.8 -> 20.1 (3 stages, 2 programs per multiprocessor: 16-block tiles); 4 stages or
#: 8 warps lose.
SCORE_LOOP_STAGES = 3
#: Hamming scoring: code words one program holds (sets its block tile).
SCORE_TILE_ELEMS = 8192


def score_tile(B: int, M: int, spad: int, device: torch.device, rows: Optional[int] = None) -> int:
    """Blocks per mean / Quest scoring program (a power of two)."""
    least = max(1, 16 // spad)                                     # tl.dot: >= 16 columns
    tile = max(least, min(_p2(M), (rows or SCORE_ROWS) // spad))
    while tile > least and B * triton.cdiv(M, tile) < SCORE_PROGRAMS_PER_SM * _sm_count(device):
        tile //= 2
    return tile


#: Score kernel tiles per first-level group of :func:`score_blocks`' log-sum-exp statistics
#: (``head_stats_scale``): the last tile of each group combines the group's partials, the last
#: group the row's.
SCORE_STATS_GROUP = 32
#: :func:`score_select_head_mass`: the scoring launch also writes each head's log-sum-exp and
#: bounds (``head_stats_scale``), and the histogram selection then skips its own log-sum-exp
#: launch (:func:`_lse_bounds_kernel`). Only with the pipelined scoring loop
#: (``SCORE_LOOP_STAGES > 0``), mean or Quest scores, on the fused head-mass path. Off: correct
#: (H200: the same selection, mass within 8.4e-8), but the scoring launch with the
#: statistics took 38.8 us against 20.5 at 1 x 128K (61.7 against 37.1 at 8 x 32K), so the
#: ESA stride-8 step went 38.3 -> 39.9 us instead of the ~0.4 us gain the saved 3.4-us launch
#: promised (not measured further: probably each short program's ticket, an acq_rel atomic
#: after its stores, and the per-tile reductions in the pipelined loop).
SCORE_HEAD_STATS = False
_stat_bufs: dict = {}


def _stat_counters(device: torch.device, n: int) -> torch.Tensor:
    """A zeroed int32 buffer of at least ``n`` tickets for the scoring statistics (kept zeroed by
    the programs that draw the last tickets); made or grown by a first eager call, outside any
    CUDA graph capture. Shared: one scoring launch with statistics at a time per device."""
    key = (device.type, device.index)
    buf = _stat_bufs.get(key)
    if buf is None or buf.numel() < n:
        buf = _stat_bufs[key] = torch.zeros(max(n, 1024), dtype=torch.int32, device=device)
    return buf


def score_blocks(q, block_table, num_blocks, *, kind: str, mean=None, kmin=None, kmax=None,
                 codes=None, proj=None, channel_mask=None, reduce: str = "sum",
                 head_stats_scale: Optional[float] = None, mean_scale=None):
    """Same contract as :func:`ucm.reference.sparse.score_blocks`; asynchronous.

    ``head_stats_scale`` (``reduce="none"``, mean or Quest, the pipelined loop): also returns the
    per-head statistics ``[B, Hq, 3]`` that :func:`select_head_mass` takes as ``head_stats``
    (each head's log2-sum-exp, max and min of ``head_stats_scale * log2(e) * scores``), computed
    by the scoring launch: ``(scores, stats)``."""
    B, Hq, D = q.shape
    M = block_table.shape[1]
    dev = q.device
    per_head = reduce == "none"
    dummy = torch.empty(1, dtype=torch.float32, device=dev)
    if kind == "hamming":
        G = _groups_of(codes)
        Hkv, words = codes.shape[-2], codes.shape[-1]
        qsum = q.float().reshape(B, Hkv, Hq // Hkv, D).sum(2)
        qcode = hash_codes(qsum, proj).contiguous()
        out = torch.empty((B, Hkv, M) if per_head else (B, M), dtype=torch.float32, device=dev)
        hpad, wpad = _p2(Hkv), _p2(words)
        fit = max(1, SCORE_TILE_ELEMS // (hpad * wpad * G))
        tile = min(64, 1 << (fit.bit_length() - 1), _p2(M))         # a power of two
        _jit(_hamming_kernel)[(B, triton.cdiv(M, tile))](
            block_table, num_blocks, codes.contiguous(), qcode, out, *block_table.stride(), M,
            HKV=Hkv, HPAD=hpad, G=G, WORDS=words, WPAD=wpad, PER_HEAD=per_head, TILE_M=tile,
            num_warps=4)
        return out
    if kind == "quest":
        rep_a, rep_b = kmax.contiguous(), kmin.contiguous()
    else:
        rep_a, rep_b = mean.contiguous(), dummy
    G = _groups_of(rep_a)
    Hkv = rep_a.shape[-2]
    out = torch.empty((B, Hq, M) if per_head else (B, M), dtype=torch.float32, device=dev)
    cmask = dummy if channel_mask is None else channel_mask.contiguous().view(torch.uint8)
    spad = _p2(G)
    tile = score_tile(B, M, spad, dev)
    ieee = interpreting() or not (q.dtype == torch.bfloat16
                                  and rep_a.dtype in (torch.bfloat16, torch.int8))
    # an int8 mean (validated: only kind "mean" takes a scale)
    pipe_q = {} if mean_scale is None else dict(scale_ptr=mean_scale.contiguous(), QUANT=True)
    kern = _score_dot_pipe_kernel if SCORE_LOOP_STAGES else _score_dot_kernel
    pipe = dict(LOOP_STAGES=SCORE_LOOP_STAGES) if SCORE_LOOP_STAGES else {}
    nt = triton.cdiv(M, tile)
    stats = None
    if head_stats_scale is not None:
        if not (per_head and SCORE_LOOP_STAGES):
            raise ValueError("head_stats_scale: needs reduce='none' and the pipelined loop "
                             "(SCORE_LOOP_STAGES > 0)")
        gsz = _p2(min(SCORE_STATS_GROUP, nt))
        ng = triton.cdiv(nt, gsz)
        part = torch.empty(B, Hq, nt, 3, dtype=torch.float32, device=dev)
        grp = torch.empty(B, Hq, ng, 3, dtype=torch.float32, device=dev)
        stats = torch.empty(B, Hq, 3, dtype=torch.float32, device=dev)
        pipe.update(part_ptr=part, grp_ptr=grp, stat_ptr=stats,
                    cnt_ptr=_stat_counters(dev, B * ng + B), stat_scale=head_stats_scale * LOG2E,
                    STATS=True, HQ=Hq, HPAD=_p2(Hq), GSZ=gsz, NGPAD=_p2(ng))
    _jit(kern)[(B, nt)](
        q, block_table, num_blocks, rep_a, rep_b, cmask, out, *q.stride(),
        *block_table.stride(), M,
        HKV=Hkv, GROUP=Hq // Hkv, GPAD=_p2(Hq // Hkv, 16), D=D, DPAD=_p2(D, 16), G=G, SPAD=spad,
        KIND=1 if kind == "quest" else 0, HAS_MASK=channel_mask is not None, PER_HEAD=per_head,
        TILE_M=tile, IEEE=ieee, num_warps=SCORE_WARPS, num_stages=SCORE_STAGES,
        **pipe, **pipe_q, **_pdl_launch(SCORE_PDL))
    return out if stats is None else (out, stats)


# ---------------------------------------------------------------------------------------------
# selection and the sparse block table


def _select_kernel(scores_ptr, nblk_ptr, budget_ptr, sel_ptr, count_ptr, M, width,
                   ss_b, ss_m, table_ptr, lens_ptr, otable_ptr, olens_ptr, st_b, st_m,
                   INIT: tl.constexpr, LOCAL: tl.constexpr, MPAD: tl.constexpr,
                   RADIX: tl.constexpr, TABLE: tl.constexpr, BS: tl.constexpr,
                   PDL: tl.constexpr = False):
    """One request: forced blocks, then the ``r`` best other blocks by (score desc, index asc).

    The ``r``-th best score ``t`` is found over the order-preserving int32 image ``u`` of the
    scores (the row held in registers), either by RADIX select (four 8-bit digit histograms,
    most significant first) or by a 4-ary search (17 counting passes, int32 compares); both give
    the largest ``t`` with ``#(u >= t) >= r``. Blocks above ``t`` are taken, and of those equal
    to it the lowest indexes (an inclusive prefix count).
    """
    if PDL:  # programmatic dependent launch: wait for the previous grid, let the next one launch
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    b = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, MPAD)
    n = tl.load(nblk_ptr + b)
    valid = j < n
    forced = valid & ((j < INIT) | (j >= n - LOCAL) | (j == n - 1))
    s = tl.load(scores_ptr + b * ss_b + j * ss_m, mask=valid, other=float("-inf"))
    s = tl.where(s != s, float("-inf"), s)                     # NaN ranks like -inf
    s = tl.where(s == 0.0, 0.0, s)                             # -0.0 ties with +0.0
    bits = s.to(tl.int32, bitcast=True)
    u = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)           # int32, ordered like the scores
    cand = valid & ~forced
    n_forced = tl.sum(forced.to(tl.int32), 0)
    keep = tl.minimum(n, tl.maximum(tl.load(budget_ptr + b), n_forced))
    r = keep - n_forced                                        # blocks still to take
    if RADIX:
        uu = u.to(tl.int64) + 2147483648                     # [0, 2**32)
        bins = tl.arange(0, 512)
        real = bins < 256
        match = cand                                           # equal to lo's digits so far
        need = r
        lo = tl.zeros([], tl.int64)
        for shift in tl.static_range(24, -1, -8):
            digit = ((uu >> shift) & 255).to(tl.int32)
            hist = tl.histogram(tl.where(match, digit, 256), 512)   # bin 256: not matching
            hist = tl.where(real, hist, 0)
            at_least = tl.sum(hist, 0) - tl.cumsum(hist, 0) + hist  # #(digit >= bin)
            top = tl.max(tl.where(real & (at_least >= need), bins, 0), 0)
            need -= tl.sum(tl.where(real & (bins > top), hist, 0), 0)
            match = match & (digit == top)
            lo = lo | (top.to(tl.int64) << shift)
        lo = lo - 2147483648
    else:
        # 4-ary search for the largest t with #(u >= t) >= r, invariant lo <= t <= hi: three
        # probes per step, their counts packed in 21-bit fields of one int64 sum (one reduction)
        lo = tl.full([], -2147483648, tl.int64)
        hi = tl.full([], 2147483647, tl.int64)
        field = (1 << 21) - 1
        for _ in range(17):                                    # (2**32 - 1) / 4**16 < 1
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
    tl.store(out + j, tl.full([MPAD], -1, tl.int32), mask=(j >= keep) & (j < width))
    tl.store(count_ptr + b, keep)
    if TABLE:  # sparse_block_table folded in: physical ids of the chosen blocks, and the length
        phys = tl.load(table_ptr + b * st_b + j * st_m, mask=chosen, other=0)
        tl.store(otable_ptr + b * width + pos, phys, mask=chosen)
        tl.store(otable_ptr + b * width + j, tl.zeros([MPAD], tl.int32),
                 mask=(j >= keep) & (j < width))
        n_tok = tl.load(lens_ptr + b)
        tl.store(olens_ptr + b, (keep - 1) * BS + n_tok - ((n_tok + BS - 1) // BS - 1) * BS)


def _rank_kernel(scores_ptr, nblk_ptr, budget_ptr, flag_ptr, M, ss_b, ss_m,
                 INIT: tl.constexpr, LW: tl.constexpr, T: tl.constexpr, TJ: tl.constexpr,
                 PDL: tl.constexpr = False):
    """Chosen flags of blocks ``[c T, (c + 1) T)`` of request ``b`` (the batch-1 selection: every
    program of the grid compares its blocks with all of the row's, so the whole GPU works on one
    row). Forced blocks are chosen; a candidate is chosen when fewer than ``r`` candidates beat it
    (higher int32 score image, or equal and a lower index), i.e. exactly the blocks the threshold
    search of :func:`_select_kernel` takes. The row is read in ``[1, TJ]`` chunks (``TJ`` a
    multiple of ``T``) compared with the program's ``[T, 1]`` blocks. ``LW = max(local_window,
    1)`` (the last block is always forced). Per-pair counts accumulate in a ``[T, TJ]`` register
    tile, summed once at the end (a sum per chunk cost a warp reduction per row and chunk)."""
    if PDL:  # programmatic dependent launch: wait for the previous grid, let the next one launch
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    b = tl.program_id(0).to(tl.int64)
    i0 = tl.program_id(1) * T
    n = tl.load(nblk_ptr + b)
    head = tl.minimum(n, INIT)                                  # forced: [0, head) and [tail, n)
    tail = tl.maximum(n - LW, 0)
    n_forced = head + (n - tail) - tl.maximum(head - tail, 0)
    keep = tl.minimum(n, tl.maximum(tl.load(budget_ptr + b), n_forced))
    r = keep - n_forced
    i = i0 + tl.arange(0, T)[:, None]                           # [T, 1]
    vi = i < n
    si = tl.load(scores_ptr + b * ss_b + i * ss_m, mask=vi, other=float("-inf"))
    si = tl.where(si != si, float("-inf"), si)                 # NaN ranks like -inf
    si = tl.where(si == 0.0, 0.0, si)                          # -0.0 ties with +0.0
    bi = si.to(tl.int32, bitcast=True)
    ui = tl.where(bi < 0, bi ^ 0x7FFFFFFF, bi)                 # >= image(-inf) > INT32_MIN
    # j beats i  <=>  u_j > u_i, or u_j == u_i and j < i  <=>  u_j > u_i - (j < i); non-candidate
    # j get INT32_MIN (beat nothing). Chunks wholly before / after this program's blocks need one
    # compare per pair; the chunk holding them picks the threshold per pair.
    lo_thr = ui - 1
    cols = tl.arange(0, TJ)[None, :]                            # [1, TJ]
    own = i0 // TJ * TJ                                         # the chunk holding [i0, i0 + T)
    beats = tl.zeros([T, TJ], tl.int32)                         # summed once, at the end
    for j0 in range(0, own, TJ):
        j = j0 + cols
        sj = tl.load(scores_ptr + b * ss_b + j * ss_m)          # j < own <= i0 < n: valid
        sj = tl.where(sj != sj, float("-inf"), sj)
        sj = tl.where(sj == 0.0, 0.0, sj)
        bj = sj.to(tl.int32, bitcast=True)
        cj = (j >= INIT) & (j < tail)
        uj = tl.where(cj, tl.where(bj < 0, bj ^ 0x7FFFFFFF, bj), -2147483648)
        beats += (uj > lo_thr).to(tl.int32)
    for j0 in range(own, n, TJ):
        j = j0 + cols
        vj = j < n
        sj = tl.load(scores_ptr + b * ss_b + j * ss_m, mask=vj, other=0.0)
        sj = tl.where(sj != sj, float("-inf"), sj)
        sj = tl.where(sj == 0.0, 0.0, sj)
        bj = sj.to(tl.int32, bitcast=True)
        cj = vj & (j >= INIT) & (j < tail)
        uj = tl.where(cj, tl.where(bj < 0, bj ^ 0x7FFFFFFF, bj), -2147483648)
        if j0 == own:
            beats += (uj > tl.where(j < i, lo_thr, ui)).to(tl.int32)
        else:
            beats += (uj > ui).to(tl.int32)
    rank = tl.sum(beats, 1)
    ii = i0 + tl.arange(0, T)
    vii = ii < n
    chosen = (vii & ((ii < INIT) | (ii >= tail))) | (vii & (rank < r))
    tl.store(flag_ptr + b * M + ii, chosen.to(tl.int8), mask=ii < M)


def _compact_kernel(flag_ptr, nblk_ptr, budget_ptr, sel_ptr, count_ptr, M, width,
                    table_ptr, lens_ptr, otable_ptr, olens_ptr, st_b, st_m,
                    INIT: tl.constexpr, LW: tl.constexpr, T: tl.constexpr, MPAD: tl.constexpr,
                    TABLE: tl.constexpr, BS: tl.constexpr, PDL: tl.constexpr = False):
    """Blocks ``[c T, (c + 1) T)`` of request ``b``: their chosen flags (:func:`_rank_kernel`)
    written as increasing positions of ``sel`` (the chosen blocks before the chunk counted from
    the flags), pads ``-1`` at positions ``[keep, width)`` of the chunk's range; TABLE: the
    chosen blocks' physical ids likewise (pads 0) and the sparse length."""
    if PDL:  # programmatic dependent launch: wait for the previous grid, let the next one launch
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    b = tl.program_id(0).to(tl.int64)
    c0 = tl.program_id(1) * T
    n = tl.load(nblk_ptr + b)
    head = tl.minimum(n, INIT)
    tail = tl.maximum(n - LW, 0)
    n_forced = head + (n - tail) - tl.maximum(head - tail, 0)
    keep = tl.minimum(n, tl.maximum(tl.load(budget_ptr + b), n_forced))
    every = tl.arange(0, MPAD)
    before = tl.sum(tl.load(flag_ptr + b * M + every, mask=every < c0, other=0).to(tl.int32), 0)
    lanes = tl.arange(0, T)
    j = c0 + lanes
    f = tl.load(flag_ptr + b * M + j, mask=j < M, other=0).to(tl.int32)
    chosen = f != 0
    pos = before + tl.cumsum(f, 0) - 1
    tl.store(sel_ptr + b * width + pos, j, mask=chosen)
    pad = (j >= keep) & (j < width)
    tl.store(sel_ptr + b * width + j, tl.full([T], -1, tl.int32), mask=pad)
    if TABLE:
        phys = tl.load(table_ptr + b * st_b + j * st_m, mask=chosen, other=0)
        tl.store(otable_ptr + b * width + pos, phys, mask=chosen)
        tl.store(otable_ptr + b * width + j, tl.zeros([T], tl.int32), mask=pad)
    if tl.program_id(1) == 0:
        tl.store(count_ptr + b, keep)
        if TABLE:
            n_tok = tl.load(lens_ptr + b)
            tl.store(olens_ptr + b, (keep - 1) * BS + n_tok - ((n_tok + BS - 1) // BS - 1) * BS)


#: Rows up to this many blocks are selected by the kernel (held in registers); longer rows use
#: the top-k glue below (the kernel's packed counts hold up to 2**21 - 1). SELECT_RADIX: the
#: kernel's threshold search (radix select, else the 4-ary search; on the H200 the 4-ary search
#: took 10.4 us for 8 x 2,048 blocks and 25.1 us for 1 x 8,192, radix select 14 and 45 us, the
#: 4-ary search comparing int64 images 12.3 and 28.1 us, a binary search 11 and 27 us).
SELECT_KERNEL_MAX_BLOCKS = 16384
SELECT_RADIX = False
#: Warps of the selection program (None: 4 up to 2,048 blocks, else 8; tuned on the H200).
SELECT_WARPS = None
#: A batch of at most SELECT_PAIRS_MAX_ROWS rows of at least SELECT_PAIRS_MIN_BLOCKS blocks (None:
#: never) is selected by the pairwise-rank kernels instead (:func:`_rank_kernel`: one program
#: per ``SELECT_PAIRS_TILE`` blocks, each compared with the whole row in ``SELECT_PAIRS_COLS``
#: chunks; then :func:`_compact_kernel`): two launches that spread one row over the GPU, against
#: one program per row. Identical output. H200, 1 x 8,192 blocks: 22.8 us against 27.3 (with the
#: table); its ``M**2`` comparisons per row make it slower from 2 rows on (8 rows x 8,192 blocks:
#: 143 us against 27) and at 8 x 2,048 (15.8 against 11.2).
SELECT_PAIRS_MIN_BLOCKS = 4096
SELECT_PAIRS_MAX_ROWS = 1
SELECT_PAIRS_TILE = 32
SELECT_PAIRS_COLS = 256
SELECT_PAIRS_WARPS = 4
SELECT_COMPACT_TILE = 1024


# histogram selection (one long row, or a few): the threshold's bin from a global histogram,
# then the row resolved inside that bin only


def _lse_bounds_kernel(x_ptr, stat_ptr, M, scale_log2, CHUNK: tl.constexpr,
                       PDL: tl.constexpr = False, SPAN: tl.constexpr = 0):
    """Row ``program_id(0)`` of ``x [rows, M]`` (``c = scale_log2``), entries ``[s SPAN, (s + 1)
    SPAN)`` for ``s = program_id(1)`` (``SPAN`` 0: the whole row, one program per row):
    ``stat[row, s] = (log2 sum_j 2 ** (c x_j), max_j c x_j, min_j c x_j over the entries above
    -inf)`` (``-inf, -inf, inf`` for a part with none); :func:`_mass_hist_kernel` combines the
    parts of a row."""
    if PDL:  # programmatic dependent launch: wait for the previous grid, let the next one launch
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
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


def _mass_hist_kernel(x_ptr, stat_ptr, mass_ptr, nblk_ptr, hist_ptr, prm_ptr, lcnt_ptr, M,
                      sx_b, sx_m,
                      scale_log2, HQ: tl.constexpr, HPAD: tl.constexpr, T: tl.constexpr,
                      MASS: tl.constexpr, INIT: tl.constexpr, LW: tl.constexpr,
                      NB: tl.constexpr, LOG_NB: tl.constexpr, PDL: tl.constexpr = False,
                      BOUNDED: tl.constexpr = False, PARTS: tl.constexpr = 1,
                      PPAD: tl.constexpr = 1):
    """Blocks ``[c T, (c + 1) T)`` of request ``b``: add each candidate (not forced, below
    ``nblk[b]``) to its bin of the row's ``NB``-bin histogram (global atomics).

    MASS: the row is the head mass of per-head scores ``x [B, HQ, M]``, ``mean_h 2 ** (c x_hj -
    lse_h)`` (``stat [B, HQ, PARTS, 3]`` from :func:`_lse_bounds_kernel`, each head's ``PARTS``
    parts combined here), written to ``mass [B, M]``; its bins
    split ``[lo, hi]`` evenly on the order-preserving int32 image ``u``, where ``lo`` / ``hi``
    are the head mass of each head's lowest / highest score (bounds of the row, up to rounding;
    values outside land in the end bins). Else the row is ``x [B, M]`` (strides ``sx``) and the
    bins are the top ``LOG_NB`` bits of ``u``, or with BOUNDED split the row's ``[min, max]``
    (``stat[b]`` from :func:`_lse_bounds_kernel` at scale 1) likewise. Bin of ``u``: ``clamp((u >> shift) - base, 0, NB
    - 1)``, monotone in ``u``; ``(shift, base)`` go to ``prm [B, 3]`` for the selection, and
    ``lcnt[b]`` (the threshold bin's list length) is reset."""
    if PDL:  # programmatic dependent launch: wait for the previous grid, let the next one launch
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    b = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1) * T + tl.arange(0, T)
    inside = j < M
    n = tl.load(nblk_ptr + b)
    tail = tl.maximum(n - LW, 0)
    if MASS:
        h = tl.arange(0, HPAD)
        hm = h < HQ
        if PARTS == 1:
            lse = tl.load(stat_ptr + (b * HQ + h) * 3, mask=hm, other=0.0)
            mx = tl.load(stat_ptr + (b * HQ + h) * 3 + 1, mask=hm, other=0.0)
            mn = tl.load(stat_ptr + (b * HQ + h) * 3 + 2, mask=hm, other=0.0)
        else:  # combine each head's parts (log2-sum-exp of log2-sum-exps, max, min)
            pp = tl.arange(0, PPAD)
            pm = hm[:, None] & (pp < PARTS)[None, :]
            src = ((b * HQ + h[:, None]) * PARTS + pp[None, :]) * 3
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
        x = tl.load(x_ptr + (b * HQ + h[:, None]) * M + j[None, :],
                    mask=hm[:, None] & inside[None, :], other=float("-inf"))
        p = tl.where(hm[:, None], tl.exp2(x * scale_log2 - lse[:, None]), 0.0)
        s = tl.sum(p, 0) / HQ
        tl.store(mass_ptr + b * M + j, s, mask=inside)
        hi = tl.sum(tl.where(hm, tl.exp2(mx - lse), 0.0), 0) / HQ
        lo = tl.sum(tl.where(hm, tl.exp2(mn - lse), 0.0), 0) / HQ
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
        for _ in tl.static_range(33):                      # smallest shift with span >> shift <= NB - 2
            shift += ((span >> shift) > NB - 2).to(tl.int64)
        base = ul >> shift
    else:
        s = tl.load(x_ptr + b * sx_b + j * sx_m, mask=inside, other=float("-inf"))
        if BOUNDED:  # bins between the row's extremes (stat[b] = (-, max, min above -inf))
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
            for _ in tl.static_range(33):                  # smallest shift with span >> shift <= NB - 2
                shift += ((span >> shift) > NB - 2).to(tl.int64)
            base = ul >> shift
        else:
            shift = tl.full([], 32 - LOG_NB, tl.int64)
            base = tl.full([], -(NB // 2), tl.int64)
    s = tl.where(s != s, float("-inf"), s)                 # NaN ranks like -inf
    s = tl.where(s == 0.0, 0.0, s)                         # -0.0 ties with +0.0
    bits = s.to(tl.int32, bitcast=True)
    u = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits).to(tl.int64)
    ub = tl.minimum(tl.maximum((u >> shift) - base, 0), NB - 1).to(tl.int32)
    cand = inside & (j < n) & (j >= INIT) & (j < tail)
    tl.atomic_add(hist_ptr + b * NB + ub, tl.full([T], 1, tl.int32), mask=cand, sem="relaxed")
    if tl.program_id(1) == 0:
        tl.store(prm_ptr + b * 3, shift)
        tl.store(prm_ptr + b * 3 + 1, base)
        tl.store(lcnt_ptr + b, 0)                          # the list kernel's slot counter


def _hist_list_kernel(s_ptr, ss_b, ss_m, nblk_ptr, budget_ptr, hist_ptr, prm_ptr, lcnt_ptr,
                      lu_ptr, lj_ptr, ccnt_ptr, M,
                      INIT: tl.constexpr, LW: tl.constexpr, NB: tl.constexpr,
                      TC: tl.constexpr, PDL: tl.constexpr = False):
    """Blocks ``[c TC, (c + 1) TC)`` of row ``b``, given the row's histogram
    (:func:`_mass_hist_kernel`): the threshold bin ``b1`` is the highest bin whose suffix count
    reaches ``r`` (the candidates still to take; every program finds it from the histogram).
    Candidates in higher bins are taken, in lower bins not; ``need`` of the ``L`` candidates in
    ``b1`` are. The chunk's candidates in ``b1`` are appended to the row's list (``lu, lj``: score
    image and index, a slot per atomic on ``lcnt[b]``); ``ccnt[b, c]`` gets the chunk's blocks
    taken for sure (forced, or a candidate above ``b1``); ``prm[b, 2]`` gets ``need``."""
    if PDL:  # programmatic dependent launch: wait for the previous grid, let the next one launch
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    b = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    n = tl.load(nblk_ptr + b)
    head = tl.minimum(n, INIT)
    tail = tl.maximum(n - LW, 0)
    n_forced = head + (n - tail) - tl.maximum(head - tail, 0)
    keep = tl.minimum(n, tl.maximum(tl.load(budget_ptr + b), n_forced))
    r = keep - n_forced
    shift = tl.load(prm_ptr + b * 3)
    base = tl.load(prm_ptr + b * 3 + 1)
    bins = tl.arange(0, NB)
    hc = tl.load(hist_ptr + b * NB + bins)
    suffix = tl.sum(hc, 0) - tl.cumsum(hc, 0) + hc             # candidates in bins >= k
    b1 = tl.max(tl.where(suffix >= r, bins, 0), 0)             # r <= 0: NB - 1, need <= 0
    above = tl.sum(tl.where(bins > b1, hc, 0), 0)
    need = r - above                                           # in [1, L] when r >= 1
    i = c * TC + tl.arange(0, TC)
    vi = i < n
    si = tl.load(s_ptr + b * ss_b + i * ss_m, mask=vi, other=float("-inf"))
    si = tl.where(si != si, float("-inf"), si)                 # NaN ranks like -inf
    si = tl.where(si == 0.0, 0.0, si)                          # -0.0 ties with +0.0
    bi = si.to(tl.int32, bitcast=True)
    ui = tl.where(bi < 0, bi ^ 0x7FFFFFFF, bi)
    cand = vi & (i >= INIT) & (i < tail)
    ub = tl.minimum(tl.maximum((ui.to(tl.int64) >> shift) - base, 0), NB - 1).to(tl.int32)
    inb = cand & (ub == b1) & (tl.zeros([TC], tl.int32) + need > 0)
    slot = tl.atomic_add(lcnt_ptr + b + tl.zeros([TC], tl.int64), tl.full([TC], 1, tl.int32),
                         mask=inb, sem="relaxed")
    tl.store(lu_ptr + b * M + slot, ui, mask=inb)
    tl.store(lj_ptr + b * M + slot, i, mask=inb)
    sure = (vi & ~cand) | (cand & (ub > b1))
    tl.store(ccnt_ptr + b * tl.num_programs(1) + c, tl.sum(sure.to(tl.int32), 0))
    if c == 0:
        tl.store(prm_ptr + b * 3 + 2, need.to(tl.int64))


def _hist_emit_kernel(s_ptr, ss_b, ss_m, nblk_ptr, budget_ptr, hist_ptr, prm_ptr, lcnt_ptr,
                      lu_ptr, lj_ptr, ccnt_ptr, sel_ptr, count_ptr, M, width, lcap,
                      table_ptr, lens_ptr, otable_ptr, olens_ptr, st_b, st_m,
                      INIT: tl.constexpr, LW: tl.constexpr, NB: tl.constexpr,
                      TC: tl.constexpr, PPAD: tl.constexpr, LCAP: tl.constexpr,
                      CH: tl.constexpr, TABLE: tl.constexpr, BS: tl.constexpr,
                      PDL: tl.constexpr = False):
    """Blocks ``[c TC, (c + 1) TC)`` of row ``b``, given :func:`_hist_list_kernel`'s list of the
    threshold bin's candidates: the ``need``-th best of them by (score desc, index asc) is the
    key ``(u*, j*)`` (pairwise ranks when ``L <= lcap``; else a 4-ary search for ``u*`` over the
    list, then one for the ``(need - #(u > u*))``-th smallest index among the ties). The chosen
    blocks are exactly the forced ones and the candidates with ``u > u*`` or ``u == u*, j <=
    j*``: written like :func:`_compact_kernel` writes them, at positions after the chosen blocks
    of the earlier chunks (their sure counts plus the list's chosen entries before the chunk).
    Program 0 zeroes the row's histogram for the next call (the list kernel has read it)."""
    if PDL:  # programmatic dependent launch: wait for the previous grid, let the next one launch
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    b = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    c0 = c * TC
    n = tl.load(nblk_ptr + b)
    head = tl.minimum(n, INIT)
    tail = tl.maximum(n - LW, 0)
    n_forced = head + (n - tail) - tl.maximum(head - tail, 0)
    keep = tl.minimum(n, tl.maximum(tl.load(budget_ptr + b), n_forced))
    need = tl.load(prm_ptr + b * 3 + 2).to(tl.int32)
    L = tl.load(lcnt_ptr + b)
    pc = tl.arange(0, PPAD)
    before = tl.sum(tl.load(ccnt_ptr + b * tl.num_programs(1) + pc, mask=pc < c, other=0), 0)
    i = c0 + tl.arange(0, TC)
    vi = i < n
    si = tl.load(s_ptr + b * ss_b + i * ss_m, mask=vi, other=float("-inf"))
    si = tl.where(si != si, float("-inf"), si)
    si = tl.where(si == 0.0, 0.0, si)
    bi = si.to(tl.int32, bitcast=True)
    ui = tl.where(bi < 0, bi ^ 0x7FFFFFFF, bi)
    cand = vi & (i >= INIT) & (i < tail)
    if c == 0:
        tl.store(hist_ptr + b * NB + tl.arange(0, NB), tl.zeros([NB], tl.int32))
    ustar = tl.full([], 2147483647, tl.int32)                  # need <= 0: no candidate taken
    jstar = tl.full([], -1, tl.int32)
    if need > 0:
        if L <= lcap:
            k = tl.arange(0, LCAP)
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
            cc = tl.arange(0, CH)
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
                for k0 in range(0, L, CH):
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
            for k0 in range(0, L, CH):
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
                for k0 in range(0, L, CH):
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
            for k0 in range(0, L, CH):
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
    tl.store(sel_ptr + b * width + i, tl.full([TC], -1, tl.int32), mask=pad)
    if TABLE:
        phys = tl.load(table_ptr + b * st_b + i * st_m, mask=chosen, other=0)
        tl.store(otable_ptr + b * width + pos, phys, mask=chosen)
        tl.store(otable_ptr + b * width + i, tl.zeros([TC], tl.int32), mask=pad)
    if c == 0:
        tl.store(count_ptr + b, keep)
        if TABLE:
            n_tok = tl.load(lens_ptr + b)
            tl.store(olens_ptr + b, (keep - 1) * BS + n_tok - ((n_tok + BS - 1) // BS - 1) * BS)


#: Histogram selection (:func:`_mass_hist_kernel`, :func:`_hist_list_kernel`,
#: :func:`_hist_emit_kernel`: three launches of chunk-local programs) for batches of at most
#: SELECT_HIST_MAX_ROWS rows of at least SELECT_HIST_MIN_BLOCKS blocks (None: never), and for the
#: fused head mass (:func:`select_head_mass`). Bins (2 ** SELECT_HIST_BITS), blocks per histogram
#: program, blocks per list / emit program, the most candidates in the threshold's bin that are
#: ranked pairwise (more: searches over the list, SELECT_HIST_CHUNK entries a step), warps.
#: H200 (1 x 8,192 blocks, with the table): summed scores 16.4 us against
#: 22.7 for the pairwise selection (top-12-bit bins instead of bounded ones: 28.6, the threshold's
#: bin crowded); head mass 18.1 (bits 12: 16.1; without the histogram: 24.3). Run 2: 4,096 bins with lists of
#: 64 overflowed into the searches (27.7 us; lists of 128: 13.8; 16,384 bins: 14.0). A first
#: version in one launch, whose last program (atomic ticket) resolved and wrote the whole row,
#: took 37.4: a single program's passes over the row are latency-bound (~2 us per 1,024 blocks).
SELECT_HIST_MIN_BLOCKS = 4096
SELECT_HIST_MAX_ROWS = 1
#: 4,096 bins: measured faster per step than 16,384 on the H200 (benchmarks/RESULTS-archive.md).
#: The bins split the row's [lo, hi] (its extremes), so only a row whose blocks crowd a sliver of a
#: wide range overflows the list into the searches (slower, still exact).
SELECT_HIST_BITS = 12
SELECT_HIST_TILE = 64
SELECT_HIST_SPAN = 256
SELECT_HIST_CHUNK = 1024
SELECT_HIST_LIST = 128
SELECT_HIST_WARPS = 4
#: Plain score rows: bins between the row's extremes (one more launch, :func:`_lse_bounds_kernel`
#: at scale 1) instead of the top SELECT_HIST_BITS bits of the score image.
SELECT_HIST_BOUNDED = True
#: Head mass + selection in one pass (:func:`_lse_bounds_kernel`, then the histogram selection)
#: for batches of at most MASS_HIST_MAX_ROWS rows of at least MASS_HIST_MIN_BLOCKS blocks (None:
#: never; else :func:`head_mass` then the selection).
MASS_HIST_MIN_BLOCKS = 4096
MASS_HIST_MAX_ROWS = 1
#: Programmatic dependent launch for the selection launches (:func:`select_head_mass`'s two,
#: the histogram selection, :func:`sparse_block_table`) and, with SCORE_PDL, the scoring launch
#: (see :data:`PDL`). None: as :data:`DECODE_PDL` (on for compute capability >= 9.0).
SELECT_PDL = False
SCORE_PDL = False

_hist_bufs: dict = {}


def _select_pdl(device: torch.device) -> bool:
    if SELECT_PDL is not None:
        return bool(SELECT_PDL)
    return _hopper(device)


def _hist_scratch(device: torch.device, n: int) -> torch.Tensor:
    """A zeroed int32 buffer of at least ``n`` entries for ``device``, reused across calls and kept
    zeroed by the selection kernel that uses it (histograms, tickets); made or grown by a first
    eager call, outside any CUDA graph capture. Shared like the fused merge's counters: one
    histogram selection at a time per device (streams selecting concurrently need
    ``SELECT_HIST_MIN_BLOCKS = MASS_HIST_MIN_BLOCKS = None``)."""
    key = (device.type, device.index)
    buf = _hist_bufs.get(key)
    if buf is None or buf.numel() < n:
        buf = _hist_bufs[key] = torch.zeros(max(n, 1 << 18), dtype=torch.int32, device=device)
    return buf


def _select_hist(x, stats, scale, num_blocks, budget, init_window, local_window, width,
                 block_table=None, seq_lens=None, block_size=1):
    """The histogram selection: ``x`` the scores ``[B, M]`` (``stats`` None) or per-head scores
    ``[B, H, M]`` with their :func:`_lse_bounds_kernel` stats ``[B, H, 3]`` or, in parts,
    ``[B, H, parts, 3]`` (the row is then their head mass).
    Returns ``(sel, count[, table, lens], mass)`` (``mass`` None for plain scores)."""
    mass_mode = stats is not None
    if mass_mode:
        B, H, M = x.shape
    else:
        (B, M), H = x.shape, 1
    dev = x.device
    nb = 1 << SELECT_HIST_BITS
    mpad = _p2(M, 16)
    hist = _hist_scratch(dev, B * nb)[:B * nb]
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
    dummy = count
    lw = max(local_window, 1)
    pdl = _pdl_launch(_select_pdl(dev))
    t = min(_p2(SELECT_HIST_TILE, 16), mpad)
    sx = (0, 0) if mass_mode else x.stride()
    bounded = not mass_mode and SELECT_HIST_BOUNDED
    if bounded:  # the row's max and min (scale 1)
        stats = torch.empty(B, 1, 3, dtype=torch.float32, device=dev)
        _jit(_lse_bounds_kernel)[(B,)](x.contiguous(), stats, M, 1.0,
                                       CHUNK=min(_p2(LSE_CHUNK), mpad), num_warps=LSE_WARPS, **pdl)
    parts = stats.shape[2] if mass_mode and stats.dim() == 4 else 1
    _jit(_mass_hist_kernel)[(B, triton.cdiv(M, t))](
        x, stats if stats is not None else dummy, mass if mass_mode else dummy, num_blocks, hist,
        prm, lcnt, M, *sx, scale * LOG2E, HQ=H, HPAD=_p2(H), T=t, MASS=mass_mode,
        INIT=init_window, LW=lw, NB=nb, LOG_NB=SELECT_HIST_BITS, BOUNDED=bounded, num_warps=4,
        PARTS=parts, PPAD=_p2(parts), **pdl)
    src = mass if mass_mode else x
    tc = min(_p2(SELECT_HIST_SPAN, 16), mpad)
    nprog = triton.cdiv(M, tc)
    ccnt = torch.empty(B, nprog, dtype=torch.int32, device=dev)
    _jit(_hist_list_kernel)[(B, nprog)](
        src, *src.stride(), num_blocks, budget, hist, prm, lcnt, lu, lj, ccnt, M,
        INIT=init_window, LW=lw, NB=nb, TC=tc, num_warps=SELECT_HIST_WARPS, **pdl)
    _jit(_hist_emit_kernel)[(B, nprog)](
        src, *src.stride(), num_blocks, budget, hist, prm, lcnt, lu, lj, ccnt, sel, count, M,
        width, SELECT_HIST_LIST, block_table if table else count, seq_lens if table else count,
        otable, olens, *(block_table.stride() if table else (0, 0)),
        INIT=init_window, LW=lw, NB=nb, TC=tc, PPAD=_p2(nprog), LCAP=_p2(max(SELECT_HIST_LIST, 1), 16),
        CH=min(_p2(SELECT_HIST_CHUNK, 16), mpad), TABLE=table, BS=block_size,
        num_warps=SELECT_HIST_WARPS, **pdl)
    out = (sel, count, otable, olens) if table else (sel, count)
    return out + (mass,)


def _use_hist(B: int, M: int) -> bool:
    return (SELECT_HIST_MIN_BLOCKS is not None and M >= SELECT_HIST_MIN_BLOCKS
            and B <= SELECT_HIST_MAX_ROWS and M <= SELECT_KERNEL_MAX_BLOCKS)


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


def select_blocks(scores, num_blocks, budget, *, init_window: int, local_window: int, width: int):
    """Same contract as :func:`ucm.reference.sparse.select_blocks` (identical output)."""
    B, M = scores.shape
    if M > SELECT_KERNEL_MAX_BLOCKS:
        return _select_topk(scores, num_blocks, budget, init_window, local_window, width)
    return _select(scores, num_blocks, budget, init_window, local_window, width)


def _select(scores, num_blocks, budget, init_window, local_window, width, block_table=None,
            seq_lens=None, block_size=1):
    B, M = scores.shape
    if _use_hist(B, M):
        return _select_hist(scores, None, 1.0, num_blocks, budget, init_window, local_window,
                            width, block_table, seq_lens, block_size)[:-1]
    dev = scores.device
    sel = torch.empty(B, width, dtype=torch.int32, device=dev)
    count = torch.empty(B, dtype=torch.int32, device=dev)
    table = block_table is not None
    otable = torch.empty(B, width, dtype=torch.int32, device=dev) if table else count
    olens = torch.empty(B, dtype=torch.int32, device=dev) if table else count
    mpad = _p2(M, 16)
    tb_args = (block_table if table else count, seq_lens if table else count, otable, olens,
               *(block_table.stride() if table else (0, 0)))
    if SELECT_PAIRS_MIN_BLOCKS is not None and M >= SELECT_PAIRS_MIN_BLOCKS \
            and B <= SELECT_PAIRS_MAX_ROWS:
        flags = torch.empty(B, M, dtype=torch.int8, device=dev)
        t = SELECT_PAIRS_TILE
        grid = (B, triton.cdiv(M, t))
        _jit(_rank_kernel)[grid](scores, num_blocks, budget, flags, M, *scores.stride(),
                                 INIT=init_window, LW=max(local_window, 1), T=t,
                                 TJ=max(t, min(SELECT_PAIRS_COLS, mpad)),
                                 num_warps=SELECT_PAIRS_WARPS, **_pdl_launch())
        tc = min(SELECT_COMPACT_TILE, mpad)
        _jit(_compact_kernel)[(B, triton.cdiv(M, tc))](
            flags, num_blocks, budget, sel, count, M, width, *tb_args,
            INIT=init_window, LW=max(local_window, 1), T=tc, MPAD=mpad, TABLE=table,
            BS=block_size, num_warps=4, **_pdl_launch())
        return (sel, count, otable, olens) if table else (sel, count)
    _jit(_select_kernel)[(B,)](scores, num_blocks, budget, sel, count, M, width, *scores.stride(),
                               *tb_args,
                               INIT=init_window, LOCAL=local_window, MPAD=mpad,
                               RADIX=SELECT_RADIX, TABLE=table, BS=block_size,
                               num_warps=SELECT_WARPS or (4 if mpad <= 2048 else 8),
                               **_pdl_launch())
    return (sel, count, otable, olens) if table else (sel, count)


def select_sparse_table(scores, num_blocks, budget, block_table, seq_lens, *, init_window: int,
                        local_window: int, width: int, block_size: int):
    """:func:`select_blocks` and :func:`sparse_block_table` in one launch: ``(sel, count, table,
    lens)``, each as those ops return them (the selection kernel gathers the chosen blocks'
    physical ids itself). Not a public op: validated inputs, ``num_blocks`` =
    ``ceil(seq_lens / block_size)``; asynchronous."""
    if scores.shape[1] > SELECT_KERNEL_MAX_BLOCKS:
        sel, count = _select_topk(scores, num_blocks, budget, init_window, local_window, width)
        return (sel, count) + sparse_block_table(block_table, seq_lens, sel, count, block_size)
    return _select(scores, num_blocks, budget, init_window, local_window, width, block_table,
                   seq_lens, block_size)


def _table_kernel(table_ptr, lens_ptr, sel_ptr, count_ptr, out_ptr, out_lens_ptr, K,
                  st_b, st_m, BS: tl.constexpr, TILE: tl.constexpr, PDL: tl.constexpr = False):
    if PDL:  # programmatic dependent launch: wait for the previous grid, let the next one launch
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    b = tl.program_id(0).to(tl.int64)
    k = tl.program_id(1) * TILE + tl.arange(0, TILE)
    cnt = tl.load(count_ptr + b)
    used = k < cnt
    logical = tl.load(sel_ptr + b * K + k, mask=used, other=0)
    phys = tl.load(table_ptr + b * st_b + logical * st_m, mask=used, other=0)
    tl.store(out_ptr + b * K + k, tl.where(used, phys, 0), mask=k < K)
    if tl.program_id(1) == 0:
        n = tl.load(lens_ptr + b)
        last_len = n - ((n + BS - 1) // BS - 1) * BS
        tl.store(out_lens_ptr + b, (cnt - 1) * BS + last_len)


def sparse_block_table(block_table, seq_lens, sel, count, block_size: int):
    """Same contract as :func:`ucm.reference.sparse.sparse_block_table`; asynchronous."""
    B, K = sel.shape
    sel = sel.contiguous()
    table = torch.empty(B, K, dtype=torch.int32, device=sel.device)
    lens = torch.empty(B, dtype=torch.int32, device=sel.device)
    tile = min(1024, _p2(K, 16))
    _jit(_table_kernel)[(B, triton.cdiv(K, tile))](block_table, seq_lens, sel, count, table, lens,
                                                   K, *block_table.stride(), BS=block_size,
                                                   TILE=tile,
                                                   **_pdl_launch(_select_pdl(sel.device)))
    return table, lens


# ---------------------------------------------------------------------------------------------
# head mass (the methods' combination of per-head scores)


def _lse_kernel(x_ptr, lse_ptr, M, scale_log2, CHUNK: tl.constexpr, PDL: tl.constexpr = False):
    """Row ``program_id(0)`` of ``x [rows, M]``: ``log2 sum_j 2 ** (scale_log2 * x_j)``."""
    if PDL:  # programmatic dependent launch: wait for the previous grid, let the next one launch
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
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


def _mass_kernel(x_ptr, lse_ptr, out_ptr, M, scale_log2, HQ: tl.constexpr, TILE: tl.constexpr,
                 PDL: tl.constexpr = False):
    """``out[b, j] = mean_h 2 ** (scale_log2 * x[b, h, j] - lse[b, h])`` for one tile of ``j``."""
    if PDL:  # programmatic dependent launch: wait for the previous grid, let the next one launch
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    b = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1) * TILE + tl.arange(0, TILE)
    inside = j < M
    acc = tl.zeros([TILE], tl.float32)
    for h in range(HQ):
        x = tl.load(x_ptr + (b * HQ + h) * M + j, mask=inside, other=float("-inf"))
        acc += tl.exp2(x * scale_log2 - tl.load(lse_ptr + b * HQ + h))
    tl.store(out_ptr + b * M + j, acc / HQ, mask=inside)


def head_mass(per_head: torch.Tensor, scale: float) -> torch.Tensor:
    """``softmax(scale * per_head, -1).mean(1)`` for float32 ``[B, H, M]`` (``-inf`` entries
    weigh 0; every row needs one finite entry): each block's estimated share of attention,
    averaged over heads (:meth:`ucm.sparse.base.SparseMethod.head_mass`) in two launches, one
    program per row then one per (request, tile). Equal to the PyTorch expression up to float32
    rounding; asynchronous."""
    B, H, M = per_head.shape
    x = per_head.contiguous()
    lse = torch.empty(B, H, dtype=torch.float32, device=x.device)
    out = torch.empty(B, M, dtype=torch.float32, device=x.device)
    _jit(_lse_kernel)[(B * H,)](x, lse, M, scale * LOG2E, CHUNK=min(1024, _p2(M, 16)),
                                num_warps=4, **_pdl_launch())
    tile = min(256, _p2(M, 16))
    while tile > 16 and B * triton.cdiv(M, tile) < 2 * _sm_count(x.device):
        tile //= 2
    _jit(_mass_kernel)[(B, triton.cdiv(M, tile))](x, lse, out, M, scale * LOG2E, HQ=H, TILE=tile,
                                                  num_warps=4, **_pdl_launch())
    return out


#: :func:`_lse_bounds_kernel` launch: elements per step, warps; LSE_SPAN: in the head-mass
#: selection each head's row is cut into parts of this many entries, one program each (warps
#: LSE_SPAN_WARPS), combined by the head-mass launch (0: one program per head over its whole row,
#: as the previous layout). H200 (1 x 128K, int8 tables, ESA stride 8, µs per step):
#: span 0 / 2048 / 1024 / 512 / 256: 37.21 / 37.04 / 36.99 (4 warps) / 37.18 / 37.09.
LSE_CHUNK = 4096
LSE_WARPS = 8
LSE_SPAN = 1024
LSE_SPAN_WARPS = 4


def select_head_mass(per_head: torch.Tensor, num_blocks, budget, *, scale: float,
                     init_window: int, local_window: int, width: int, block_table=None,
                     seq_lens=None, block_size: int = 1, return_mass: bool = False,
                     head_stats: Optional[torch.Tensor] = None):
    """Same contract as :func:`ucm.reference.sparse.select_head_mass`: :func:`select_blocks` on
    :func:`head_mass` ``(per_head, scale)``, ``(sel, count)``; with
    ``block_table, seq_lens`` the sparse table folded in, ``(sel, count, table, lens)`` (as
    :func:`select_sparse_table`); ``return_mass``: the head mass appended. Rows of at least
    ``MASS_HIST_MIN_BLOCKS`` blocks: four launches (log-sum-exp and bounds per head; head mass
    and histogram; the threshold bin's list; the selection written), the head mass written once
    and selected exactly as
    :func:`select_blocks` selects it. Inputs as validated by
    :func:`ucm.sparse.ops.select_head_mass`; asynchronous."""
    B, H, M = per_head.shape
    x = per_head.contiguous()
    if _mass_hist_path(B, M):
        stats = head_stats
        if stats is None:  # else the scoring launch wrote them (score_blocks' head_stats_scale)
            span = LSE_SPAN if 0 < LSE_SPAN < M else 0
            parts = triton.cdiv(M, span) if span else 1
            stats = torch.empty(B, H, parts, 3, dtype=torch.float32, device=x.device)
            chunk = min(_p2(LSE_CHUNK), _p2(span or M, 16))
            _jit(_lse_bounds_kernel)[(B * H, parts)](x, stats, M, scale * LOG2E, CHUNK=chunk,
                                                     num_warps=LSE_SPAN_WARPS if span
                                                     else LSE_WARPS,
                                                     SPAN=span,
                                                     **_pdl_launch(_select_pdl(x.device)))
        out = _select_hist(x, stats, scale, num_blocks, budget, init_window, local_window, width,
                           block_table, seq_lens, block_size)
    else:
        mass = head_mass(x, scale)
        if block_table is not None:
            out = select_sparse_table(mass, num_blocks, budget, block_table, seq_lens,
                                      init_window=init_window, local_window=local_window,
                                      width=width, block_size=block_size) + (mass,)
        else:
            out = select_blocks(mass, num_blocks, budget, init_window=init_window,
                                local_window=local_window, width=width) + (mass,)
    return out if return_mass else out[:-1]


def _mass_hist_path(B: int, M: int) -> bool:
    """:func:`select_head_mass` takes the fused histogram path (log-sum-exp stats, then the
    histogram selection) for ``[B, H, M]``."""
    return (MASS_HIST_MIN_BLOCKS is not None and MASS_HIST_MIN_BLOCKS <= M <= SELECT_KERNEL_MAX_BLOCKS
            and B <= MASS_HIST_MAX_ROWS)


def score_select_head_mass(q, block_table, num_blocks, budget, *, kind: str, mean=None,
                           kmin=None, kmax=None, channel_mask=None, scale: float,
                           init_window: int, local_window: int, width: int,
                           return_mass: bool = False, mean_scale=None, seq_lens=None,
                           block_size=None):
    """Same contract as :func:`ucm.reference.sparse.score_select_head_mass`: per-head
    :func:`score_blocks` then :func:`select_head_mass`, ``(sel, count)``. On the fused head-mass
    path (:data:`SCORE_HEAD_STATS`) the scoring launch also writes the log-sum-exp statistics
    the selection needs, so the selection's own log-sum-exp launch is skipped. ``return_mass``:
    the head mass appended (tests). With ``seq_lens`` and ``block_size`` the attention's table
    is written by the selection's last launch (:func:`select_head_mass` with ``block_table``):
    ``(sel, count, table, lens)``. Inputs as validated by
    :func:`ucm.sparse.ops.score_select_head_mass`; asynchronous."""
    B, M = block_table.shape
    fold = (SCORE_HEAD_STATS and bool(SCORE_LOOP_STAGES) and kind in ("mean", "quest")
            and _mass_hist_path(B, M))
    reprs = dict(mean=mean, kmin=kmin, kmax=kmax, channel_mask=channel_mask,
                 mean_scale=mean_scale)
    if fold:
        per_head, stats = score_blocks(q, block_table, num_blocks, kind=kind, reduce="none",
                                       head_stats_scale=scale, **reprs)
    else:
        per_head, stats = score_blocks(q, block_table, num_blocks, kind=kind, reduce="none",
                                       **reprs), None
    fold = {} if seq_lens is None else dict(block_table=block_table, seq_lens=seq_lens,
                                            block_size=block_size)
    return select_head_mass(per_head, num_blocks, budget, scale=scale, init_window=init_window,
                            local_window=local_window, width=width, return_mass=return_mass,
                            head_stats=stats, **fold)
