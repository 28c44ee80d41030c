"""Block summaries: per-(sub-)block mean / min / max of the keys, int8 means, hash codes.

:func:`update_block_reprs` runs one program per (listed block, KV head, sub-block): masked mean /
min / max over the sub-block's valid tokens; codes are hashed from the means by the
:func:`hash_codes` kernel (one program per row). mean / kmin / kmax tables may be bfloat16
(written rounded from float32) or, for the mean, int8 with one float32 scale per row.
"""
from __future__ import annotations

import torch
import triton.language as tl

from ucm.fast.triton.sparse.launch import jit, pow2


def _hash_kernel(x_ptr, proj_ptr, out_ptr, HEAD_DIM: tl.constexpr,
                 HEAD_DIM_PADDED: tl.constexpr, WORDS: tl.constexpr):
    """Row ``program_id(0)`` of ``x [rows, HEAD_DIM]``: word ``w`` = sign bits of
    ``x @ proj[:, 32 w : 32 w + 32]`` (float32 products summed over the channels)."""
    row = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, HEAD_DIM_PADDED)
    dmask = d < HEAD_DIM
    x = tl.load(x_ptr + row * HEAD_DIM + d, mask=dmask, other=0.0).to(tl.float32)
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
        jit(_hash_kernel)[(rows.shape[0],)](rows, proj, out, HEAD_DIM=D,
                                             HEAD_DIM_PADDED=pow2(D, 16), WORDS=bits // 32)
    return out.reshape(*x.shape[:-1], bits // 32)


def _reprs_kernel(k_ptr, ids_ptr, ntok_ptr, mean_ptr, kmin_ptr, kmax_ptr, listed_ptr, scale_ptr,
                  k_stride_block, k_stride_token, k_stride_head, k_stride_dim,
                  NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                  HEAD_DIM_PADDED: tl.constexpr, SUB_TOKENS: tl.constexpr,
                  SUB_TOKENS_PADDED: tl.constexpr, GROUPS: tl.constexpr, DO_MEAN: tl.constexpr,
                  DO_MIN: tl.constexpr, DO_MAX: tl.constexpr, DO_LISTED: tl.constexpr,
                  QUANT: tl.constexpr):
    """Block ``ids[i]``, KV head ``g``, sub-block ``s`` (tokens ``[s T, (s + 1) T)`` with
    ``T = SUB_TOKENS``, or the last sub-block holding valid tokens when ``s T >= ntok[i]``): mean
    / min / max over its valid tokens into row ``(ids[i], s, g)`` of the ``[num_blocks, GROUPS,
    NUM_KV_HEADS, HEAD_DIM]`` tables; DO_LISTED also writes the mean to row ``(i, s, g)`` of
    ``listed [N, GROUPS, NUM_KV_HEADS, HEAD_DIM]``. QUANT: the mean row is stored as int8 with
    its float32 scale in ``scale [num_blocks, GROUPS, NUM_KV_HEADS]``, as
    :func:`ucm.reference.sparse.quantize_rows` rounds it."""
    i = tl.program_id(0)
    g = tl.program_id(1)
    sub = tl.program_id(2)
    blk = tl.load(ids_ptr + i).to(tl.int64)
    n = tl.load(ntok_ptr + i).to(tl.int32)
    src = tl.minimum(sub, (n - 1) // SUB_TOKENS)
    t = tl.arange(0, SUB_TOKENS_PADDED)
    pos = src * SUB_TOKENS + t
    d = tl.arange(0, HEAD_DIM_PADDED)
    dmask = d < HEAD_DIM
    tok = (t < SUB_TOKENS) & (pos < n)
    live = tok[:, None] & dmask[None, :]
    keys = tl.load(k_ptr + blk * k_stride_block + pos[:, None] * k_stride_token
                   + g * k_stride_head + d[None, :] * k_stride_dim,
                   mask=live, other=0.0).to(tl.float32)
    row = ((blk * GROUPS + sub) * NUM_KV_HEADS + g) * HEAD_DIM + d
    mean = tl.sum(keys, 0) / tl.minimum(n - src * SUB_TOKENS, SUB_TOKENS).to(tl.float32)
    if DO_MEAN and QUANT:
        amax = tl.max(tl.where(dmask, tl.abs(mean), 0.0), 0)
        scale = amax / 127.0
        safe = tl.where(scale > 0, scale, 1.0)
        qv = tl.minimum(tl.maximum(tl.floor(mean / safe + 0.5), -127.0), 127.0)
        qv = tl.where(scale > 0, qv, 0.0)
        tl.store(mean_ptr + row, qv.to(tl.int8), mask=dmask)
        tl.store(scale_ptr + (blk * GROUPS + sub) * NUM_KV_HEADS + g, scale)
    elif DO_MEAN:
        tl.store(mean_ptr + row, mean, mask=dmask)
    if DO_MIN:
        tl.store(kmin_ptr + row, tl.min(tl.where(live, keys, float("inf")), 0), mask=dmask)
    if DO_MAX:
        tl.store(kmax_ptr + row, tl.max(tl.where(live, keys, float("-inf")), 0), mask=dmask)
    if DO_LISTED:
        tl.store(listed_ptr + ((i.to(tl.int64) * GROUPS + sub) * NUM_KV_HEADS + g) * HEAD_DIM + d,
                 mean, mask=dmask)


def groups_of(*tables) -> int:
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
    G = groups_of(mean, kmin, kmax, codes)
    dummy = torch.empty(1, dtype=torch.float32, device=k_cache.device)
    tables = []
    for t in (mean, kmin, kmax, mean_scale):  # written through flat row indexes: need contiguity
        tables.append(None if t is None else (t if t.is_contiguous() else t.contiguous()))
    listed = None if codes is None else torch.empty(n, G, Hkv, D, dtype=torch.float32,
                                                    device=k_cache.device)
    jit(_reprs_kernel)[(n, Hkv, G)](
        k_cache, block_ids, num_tokens, *(dummy if t is None else t for t in tables[:3]),
        dummy if listed is None else listed, dummy if mean_scale is None else tables[3],
        *k_cache.stride(), NUM_KV_HEADS=Hkv, HEAD_DIM=D, HEAD_DIM_PADDED=pow2(D, 16),
        SUB_TOKENS=bs // G, SUB_TOKENS_PADDED=pow2(bs // G), GROUPS=G, DO_MEAN=mean is not None,
        DO_MIN=kmin is not None, DO_MAX=kmax is not None, DO_LISTED=listed is not None,
        QUANT=mean_scale is not None)
    for given, used in zip((mean, kmin, kmax, mean_scale), tables):
        if given is not None and used is not given:
            given.copy_(used)
    if codes is not None:
        view = codes if codes.dim() == 4 else codes.unsqueeze(1)
        view[block_ids.long()] = hash_codes(listed, proj)
