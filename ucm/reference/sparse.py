"""Sparse-attention ops, reference implementation: readable PyTorch, float32 math.

Contracts in ``docs/sparse.md``; inputs are validated (and normalized) by :mod:`ucm.sparse.ops`
before they reach these functions, so nothing here re-checks shapes or dtypes. Normalized means:
``budget`` is an int32 tensor ``[B]`` on the scores' device, ``scale`` is a float, ``kind`` and
``reduce`` are valid names, and the output width ``width`` of :func:`select_blocks` is given.

Cache layout: ``k_cache, v_cache: [num_blocks, block_size, Hkv, D]`` (any strides); query head
``h`` reads KV head ``h // (Hq // Hkv)``. Representation tables: ``[num_blocks, Hkv, X]`` or, with
``G`` sub-block summaries per block, ``[num_blocks, G, Hkv, X]`` (a 3-D table is the ``G = 1``
case, :func:`grouped`).
"""
from __future__ import annotations

from typing import Optional

import torch

NEG_INF = float("-inf")


def _logical_ids(block_table: torch.Tensor, num_blocks: torch.Tensor):
    """(physical ids as int64 with unused entries replaced by 0, valid mask [B, M])."""
    M = block_table.shape[1]
    valid = torch.arange(M, device=block_table.device)[None, :] < num_blocks[:, None].long()
    ids = torch.where(valid, block_table.long(), torch.zeros_like(block_table, dtype=torch.long))
    return ids, valid


# ---------------------------------------------------------------------------------------------
# hashing and block representations

def hash_codes(x: torch.Tensor, proj: torch.Tensor) -> torch.Tensor:
    """int32 ``[..., hash_bits // 32]``: bit ``i`` of word ``w`` is set when channel ``32 w + i``
    of ``x @ proj`` (float32) is positive."""
    y = x.float() @ proj.float()
    bits = (y > 0).reshape(*y.shape[:-1], -1, 32).long()
    words = (bits << torch.arange(32, device=x.device)).sum(-1)  # in [0, 2**32)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def grouped(table: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """A representation table as ``[num_blocks, G, Hkv, X]``: a 3-D ``[num_blocks, Hkv, X]`` table
    is the ``G = 1`` view (same storage)."""
    if table is None or table.dim() == 4:
        return table
    return table.unsqueeze(1)


def quantize_rows(x: torch.Tensor):
    """``(int8 values, float32 scales)`` of a float table, one scale per last-axis row:
    ``scale = max |row| / 127`` and ``value = floor(row / scale + 1/2)`` (an all-zero row: scale
    0, values 0), so ``value * scale`` is within ``scale / 2`` of each entry. Shapes: ``x.shape``
    and ``x.shape[:-1]``."""
    xf = x.float()
    scale = xf.abs().amax(-1) / 127.0
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.floor(xf / safe[..., None] + 0.5).clamp(-127, 127)
    return torch.where(scale[..., None] > 0, q, 0.0).to(torch.int8), scale.contiguous()


def dequantized(table: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """An int8 summary table as float32: ``table * scale`` (``scale`` per row, see
    :func:`quantize_rows`)."""
    return table.float() * scale.float()[..., None]


def sub_block_keys(keys: torch.Tensor, num_tokens: torch.Tensor, G: int):
    """Split blocks of keys ``[N, bs, Hkv, D]`` into ``G`` sub-blocks of ``bs // G`` tokens:
    ``(keys [N, G, bs // G, Hkv, D], live bool [N, G, bs // G, 1, 1])``. Sub-block ``g`` holds
    tokens ``[g t, (g + 1) t)`` cut at the block's ``num_tokens``; a sub-block with no valid token
    (a partial block) stands for the last one that has some, so every summary is of real keys and
    a maximum over sub-blocks is unchanged by it."""
    N, bs = keys.shape[:2]
    t = bs // G
    n = num_tokens.long().to(keys.device)
    last = torch.div(n - 1, t, rounding_mode="floor")                       # [N]
    src = torch.minimum(torch.arange(G, device=keys.device)[None, :], last[:, None])   # [N, G]
    split = keys.reshape(N, G, t, *keys.shape[2:])
    sub = split[torch.arange(N, device=keys.device)[:, None], src]           # [N, G, t, Hkv, D]
    pos = src[:, :, None] * t + torch.arange(t, device=keys.device)[None, None, :]
    live = (pos < n[:, None, None])[..., None, None]
    return sub, live


def update_block_reprs(k_cache: torch.Tensor, block_ids: torch.Tensor, num_tokens: torch.Tensor,
                       *, mean: Optional[torch.Tensor] = None, kmin: Optional[torch.Tensor] = None,
                       kmax: Optional[torch.Tensor] = None, codes: Optional[torch.Tensor] = None,
                       proj: Optional[torch.Tensor] = None,
                       mean_scale: Optional[torch.Tensor] = None) -> None:
    """Write mean / kmin / kmax / codes rows of the listed physical blocks in place, over each
    block's first ``num_tokens[i]`` tokens, per sub-block when the tables are
    ``[num_blocks, G, Hkv, X]`` (:func:`sub_block_keys`; 3-D tables: ``G = 1``). An int8 ``mean``
    gets :func:`quantize_rows` of the float32 means, their scales going to ``mean_scale``."""
    if block_ids.numel() == 0:
        return
    given = [t for t in (mean, kmin, kmax, codes) if t is not None]
    G = 1 if given[0].dim() == 3 else given[0].shape[1]
    ids = block_ids.long()
    sub, live = sub_block_keys(k_cache[ids].float(), num_tokens, G)   # [N, G, t, Hkv, D]
    count = live.sum(2).float()                                        # [N, G, 1, 1]
    sub_mean = torch.where(live, sub, 0.0).sum(2) / count              # [N, G, Hkv, D]
    if mean is not None and mean_scale is not None:
        values, scales = quantize_rows(sub_mean)
        grouped(mean)[ids] = values
        (mean_scale if mean_scale.dim() == 3 else mean_scale.unsqueeze(1))[ids] = scales
    elif mean is not None:
        grouped(mean)[ids] = sub_mean.to(mean.dtype)
    if kmin is not None:
        grouped(kmin)[ids] = torch.where(live, sub, float("inf")).amin(2).to(kmin.dtype)
    if kmax is not None:
        grouped(kmax)[ids] = torch.where(live, sub, NEG_INF).amax(2).to(kmax.dtype)
    if codes is not None:
        grouped(codes)[ids] = hash_codes(sub_mean, proj)


def token_key_codes(keys: torch.Tensor):
    """int4 codes of whole blocks of keys ``[N, bs, Hkv, D]`` (D even), symmetric per (block,
    head, channel): ``(packed uint8 [N, Hkv, bs, D // 2], scale float16 [N, Hkv, D])``. The scale
    is ``max_t |k| / 7`` rounded to float16; a code is ``floor(k / scale + 1/2)`` clamped to
    ``[-7, 7]`` (0 where the scale is 0; the scale at most float16's largest finite value; a NaN
    key counts as 0), stored plus 8; byte ``c`` holds channel ``c`` in its low nibble and
    channel ``c + D / 2`` in its high one."""
    kf = keys.float().permute(0, 2, 1, 3)                              # [N, Hkv, bs, D]
    kf = torch.where(kf == kf, kf, 0.0)                                 # a NaN key counts as 0
    # float16's largest finite value bounds the scale: a key past 7 times it is clipped, never
    # a scale of inf (whose zero codes would dequantize to NaN)
    scale = (kf.abs().amax(2) / 7.0).clamp(max=65504.0).to(torch.float16)   # [N, Hkv, D]
    s = scale.float()[:, :, None, :]     # finite, so k / s is never NaN
    x = torch.where(s > 0, kf / torch.where(s > 0, s, torch.ones_like(s)), 0.0)
    codes = torch.floor(x.clamp(-7.0, 7.0) + 0.5).to(torch.int32) + 8
    half = kf.shape[-1] // 2
    packed = (codes[..., :half] | (codes[..., half:] << 4)).to(torch.uint8)
    return packed, scale


def token_keys(keys4: torch.Tensor, scale4: torch.Tensor) -> torch.Tensor:
    """float32 keys ``[N, Hkv, bs, D]`` of :func:`token_key_codes`' output."""
    lo = (keys4 & 15).to(torch.int32) - 8
    hi = (keys4 >> 4).to(torch.int32) - 8
    return torch.cat([lo, hi], -1).float() * scale4.float()[:, :, None, :]


def quantize_token_keys(k_cache: torch.Tensor, block_ids: torch.Tensor, *, keys4: torch.Tensor,
                        scale4: torch.Tensor) -> None:
    """Write :func:`token_key_codes` of the listed physical blocks into ``keys4`` / ``scale4``
    (rows indexed by physical block id); other rows are left as they are."""
    if block_ids.numel() == 0:
        return
    ids = block_ids.long()
    packed, scale = token_key_codes(k_cache[ids])
    keys4[ids] = packed
    scale4[ids] = scale


def score_token_mass(q: torch.Tensor, block_table: torch.Tensor, num_blocks: torch.Tensor, *,
                     keys4: torch.Tensor, scale4: torch.Tensor, scale: float) -> torch.Tensor:
    """float32 ``[B, Hq, M]``: per query head, ``logsumexp_t(scale * q . k_t) / scale`` over the
    tokens of each block's int4 keys (:func:`token_keys`), ``-inf`` past ``num_blocks``: a
    softmax over the blocks of ``scale *`` this is each block's attention mass under those
    keys."""
    B, Hq, D = q.shape
    ids, valid = _logical_ids(block_table, num_blocks)
    M = ids.shape[1]
    flat = ids.reshape(-1)               # only the rows the requests hold are dequantized
    per_kv = token_keys(keys4[flat], scale4[flat])                       # [B * M, Hkv, bs, D]
    Hkv = per_kv.shape[1]
    per_kv = per_kv.reshape(B, M, *per_kv.shape[1:])                     # [B, M, Hkv, bs, D]
    qg = q.float().reshape(B, Hkv, Hq // Hkv, D)
    logits = torch.einsum("bhgd,bmhtd->bhgmt", qg, per_kv) * scale
    per_head = (torch.logsumexp(logits, -1) / scale).reshape(B, Hq, -1)
    return torch.where(valid[:, None, :], per_head, NEG_INF).contiguous()


# ---------------------------------------------------------------------------------------------
# scoring and selection

def _popcount32(x: torch.Tensor) -> torch.Tensor:
    """Number of set bits of each int32 word (as int64)."""
    bits = (x.long().unsqueeze(-1) >> torch.arange(32, device=x.device)) & 1
    return bits.sum(-1)


def score_blocks(q: torch.Tensor, block_table: torch.Tensor, num_blocks: torch.Tensor, *, kind: str,
                 mean: Optional[torch.Tensor] = None, kmin: Optional[torch.Tensor] = None,
                 kmax: Optional[torch.Tensor] = None, codes: Optional[torch.Tensor] = None,
                 proj: Optional[torch.Tensor] = None, channel_mask: Optional[torch.Tensor] = None,
                 reduce: str = "sum", mean_scale: Optional[torch.Tensor] = None) -> torch.Tensor:
    """float32 block scores ``[B, M]`` (``reduce="sum"``) or per head (``reduce="none"``);
    positions ``j >= num_blocks[b]`` are ``-inf``. With sub-block tables
    ``[num_blocks, G, Hkv, X]`` a block's per-head score is the maximum of its ``G`` sub-block
    scores (taken before the sum over heads). An int8 ``mean`` comes with its per-row
    ``mean_scale`` (:func:`quantize_rows`) and scores as ``mean * mean_scale``."""
    if mean_scale is not None:
        mean = dequantized(mean, mean_scale)
    B, Hq, D = q.shape
    ids, valid = _logical_ids(block_table, num_blocks)
    qf = q.float()
    if kind == "hamming":
        table = grouped(codes)                                     # [n, G, Hkv, W]
        Hkv = table.shape[2]
        qsum = qf.reshape(B, Hkv, Hq // Hkv, D).sum(2)            # [B, Hkv, D]
        qcode = hash_codes(qsum, proj)                             # [B, Hkv, W]
        bcode = table[ids]                                         # [B, M, G, Hkv, W]
        diff = _popcount32(qcode[:, None, None] ^ bcode).sum(-1)   # [B, M, G, Hkv]
        per_head = (proj.shape[1] - diff).float().amax(2).permute(0, 2, 1)   # [B, Hkv, M]
    else:
        table = grouped(mean if kind == "mean" else kmin)          # [n, G, Hkv, D]
        Hkv = table.shape[2]
        group = Hq // Hkv
        if kind == "mean" and channel_mask is not None:
            qf = qf * channel_mask.to(qf.dtype)
        # sub-block representations of each query head's KV head: [B, M, G, Hq, D]
        per_q = table[ids].float().repeat_interleave(group, dim=3)
        if kind == "mean":
            per_sub = torch.einsum("bhd,bmghd->bhmg", qf, per_q)
        else:
            hi = grouped(kmax)[ids].float().repeat_interleave(group, dim=3)
            prod = torch.maximum(qf[:, None, None] * per_q, qf[:, None, None] * hi)
            per_sub = prod.sum(-1).permute(0, 3, 1, 2)             # [B, Hq, M, G]
        per_head = per_sub.amax(-1)                                # [B, Hq, M]
    per_head = torch.where(valid[:, None, :], per_head, NEG_INF)
    if reduce == "none":
        return per_head.contiguous()
    return torch.where(valid, per_head.sum(1), NEG_INF)


def forced_mask(num_blocks: torch.Tensor, M: int, init_window: int, local_window: int) -> torch.Tensor:
    """bool ``[B, M]``: the blocks every selection keeps (first ``init_window``, last
    ``local_window``, the last block), restricted to ``j < num_blocks[b]``."""
    j = torch.arange(M, device=num_blocks.device)[None, :]
    n = num_blocks.long()[:, None]
    keep = (j < init_window) | (j >= n - local_window) | (j == n - 1)
    return keep & (j < n)


def select_blocks(scores: torch.Tensor, num_blocks: torch.Tensor, budget: torch.Tensor, *,
                  init_window: int, local_window: int, width: int):
    """``(sel int32 [B, width], count int32 [B])``: the kept logical block indexes in increasing
    order, padded with ``-1``. Forced blocks first, then the highest scores (ties: lower index;
    NaN ranks like ``-inf``) until ``count = min(n, max(budget, forced))`` blocks."""
    B, M = scores.shape
    forced = forced_mask(num_blocks, M, init_window, local_window)
    j = torch.arange(M, device=scores.device)[None, :]
    valid = j < num_blocks.long()[:, None]
    count = torch.minimum(num_blocks.long(), torch.maximum(budget.long(), forced.sum(1)))
    s = torch.nan_to_num(scores.float(), nan=NEG_INF, posinf=float("inf"), neginf=NEG_INF)
    # rank: highest score first, ties by index (stable sort), then forced before the rest and
    # invalid positions last (a second stable sort on the class keeps the first order inside one)
    order = torch.sort(s, dim=1, descending=True, stable=True).indices
    klass = (forced.long() * 2 + valid.long()).gather(1, order)
    order = order.gather(1, torch.sort(klass, dim=1, descending=True, stable=True).indices)
    chosen = torch.zeros(B, M, dtype=torch.bool, device=scores.device)
    chosen.scatter_(1, order, j.expand(B, M) < count[:, None])
    # chosen positions in increasing order, then -1
    key = torch.where(chosen, j, M + j)
    sel = torch.sort(key, dim=1).values[:, :width]
    sel = torch.where(sel < M, sel, -1).to(torch.int32)
    return sel.contiguous(), count.to(torch.int32)


def pool_head_budgets(shares: torch.Tensor, num_blocks: torch.Tensor, budget: torch.Tensor, *,
                      cap: int, init_window: int, local_window: int) -> torch.Tensor:
    """int32 ``[B, H]``: each head's windows, plus its share of the ``H * (budget - windows)``
    other (head, block) pairs of highest share, at most ``cap * budget`` blocks a head."""
    B, H, M = shares.shape
    forced = forced_mask(num_blocks, M, init_window, local_window)            # [B, M]
    j = torch.arange(M, device=shares.device)[None, :]
    free = (j < num_blocks.long()[:, None]) & ~forced
    f = forced.sum(1)                                                        # [B]
    s = torch.nan_to_num(shares.float(), nan=NEG_INF, posinf=float("inf"), neginf=NEG_INF)
    s = torch.where(free[:, None, :], s, NEG_INF)
    ranked = torch.sort(s, dim=2, descending=True, stable=True).values       # [B, H, M]
    # a head's pairs beyond its cap, and the pairs that are not free blocks, are not eligible
    room = (cap * budget.long() - f).clamp(min=0)                            # [B]
    eligible = ((j[:, None, :] < room[:, None, None]) &
                (j[:, None, :] < free.sum(1)[:, None, None])).expand(B, H, M)
    # rank-major order: ties go to the lower rank within a head, then to the lower head
    v = torch.where(eligible, ranked, NEG_INF).transpose(1, 2).reshape(B, M * H)
    ok = eligible.transpose(1, 2).reshape(B, M * H)
    order = torch.sort(v, dim=1, descending=True, stable=True).indices
    # eligible pairs first (a second stable sort on the class keeps the order inside one)
    order = order.gather(1, torch.sort(ok.gather(1, order).long(), dim=1, descending=True,
                                       stable=True).indices)
    extra = (H * (budget.long() - f)).clamp(min=0)                           # [B]
    taken = (torch.arange(M * H, device=shares.device)[None, :] < extra[:, None]) & \
        ok.gather(1, order)
    head = order % H
    counts = torch.zeros(B, H, dtype=torch.long, device=shares.device)
    counts.scatter_add_(1, head, taken.long())
    return torch.minimum(counts + f[:, None], num_blocks.long()[:, None]).to(torch.int32)


def select_head_mass(per_head: torch.Tensor, num_blocks: torch.Tensor, budget: torch.Tensor, *,
                     scale: float, init_window: int, local_window: int, width: int):
    """:func:`select_blocks` on the head mass of per-head scores ``[B, H, M]``: a softmax over
    the blocks per head of ``scale * per_head`` (``-inf`` weighs 0), averaged over heads."""
    mass = torch.softmax(per_head.float() * scale, dim=-1).mean(1)
    return select_blocks(mass, num_blocks, budget, init_window=init_window,
                         local_window=local_window, width=width)


def score_select_head_mass(q: torch.Tensor, block_table: torch.Tensor, num_blocks: torch.Tensor,
                           budget: torch.Tensor, *, kind: str, mean: Optional[torch.Tensor] = None,
                           kmin: Optional[torch.Tensor] = None, kmax: Optional[torch.Tensor] = None,
                           channel_mask: Optional[torch.Tensor] = None, scale: float,
                           init_window: int, local_window: int, width: int,
                           mean_scale: Optional[torch.Tensor] = None,
                           seq_lens: Optional[torch.Tensor] = None,
                           block_size: Optional[int] = None):
    """:func:`select_head_mass` on the per-head :func:`score_blocks` (``kind`` "mean" or
    "quest"); with ``seq_lens`` and ``block_size`` also :func:`sparse_block_table` of the
    selection: ``(sel, count, table, lens)``."""
    per_head = score_blocks(q, block_table, num_blocks, kind=kind, mean=mean, kmin=kmin, kmax=kmax,
                            channel_mask=channel_mask, reduce="none", mean_scale=mean_scale)
    sel, count = select_head_mass(per_head, num_blocks, budget, scale=scale,
                                  init_window=init_window, local_window=local_window, width=width)
    if seq_lens is None:
        return sel, count
    return (sel, count) + sparse_block_table(block_table, seq_lens, sel, count, block_size)


def sparse_block_table(block_table: torch.Tensor, seq_lens: torch.Tensor, sel: torch.Tensor,
                       count: torch.Tensor, block_size: int):
    """``(table int32 [B, K], lens int32 [B])`` for the selected blocks; unused table entries are
    0 (a valid id that is never read). The last selected block is the sequence's last block."""
    K = sel.shape[1]
    used = torch.arange(K, device=sel.device)[None, :] < count.long()[:, None]
    table = block_table.long().gather(1, sel.long().clamp(min=0))
    table = torch.where(used, table, 0).to(torch.int32)
    n = seq_lens.long()
    last_len = n - (torch.div(n + block_size - 1, block_size, rounding_mode="floor") - 1) * block_size
    lens = (count.long() - 1) * block_size + last_len
    return table.contiguous(), lens.to(torch.int32)


# ---------------------------------------------------------------------------------------------
# attention

def _gather_tokens(cache: torch.Tensor, table_row: torch.Tensor, n: int) -> torch.Tensor:
    """float32 ``[n, Hkv, D]``: the first ``n`` tokens of one request, block by block."""
    bs = cache.shape[1]
    nb = -(-n // bs)
    blocks = cache[table_row[:nb].long()].float()               # [nb, bs, Hkv, D]
    return blocks.reshape(nb * bs, *cache.shape[2:])[:n]


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_table: torch.Tensor, seq_lens: torch.Tensor, *, scale: float,
                           out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``softmax(scale * q K^T) V`` over each request's ``seq_lens[b]`` cached tokens, float32
    accumulation; ``[B, Hq, D]`` in ``q``'s dtype (written into ``out`` when given). A 3-D
    ``block_table [B, Hkv, M]`` with ``seq_lens [B, Hkv]`` gives each KV head its own tokens."""
    B, Hq, D = q.shape
    Hkv = k_cache.shape[2]
    group = Hq // Hkv
    result = torch.empty(B, Hq, D, dtype=torch.float32, device=q.device)
    if block_table.dim() == 3:   # one table per KV head: each KV head's group on its own tokens
        for b in range(B):
            for g, n in enumerate(seq_lens[b].tolist()):
                heads = slice(g * group, (g + 1) * group)
                keys = _gather_tokens(k_cache[:, :, g:g + 1], block_table[b, g], n)[:, 0]
                vals = _gather_tokens(v_cache[:, :, g:g + 1], block_table[b, g], n)[:, 0]
                logits = q[b, heads].float() @ keys.T * scale                 # [group, n]
                result[b, heads] = torch.softmax(logits, dim=-1) @ vals
    for b, n in enumerate([] if block_table.dim() == 3 else seq_lens.tolist()):
        keys = _gather_tokens(k_cache, block_table[b], n).repeat_interleave(group, dim=1)
        vals = _gather_tokens(v_cache, block_table[b], n).repeat_interleave(group, dim=1)
        logits = torch.einsum("hd,nhd->hn", q[b].float(), keys) * scale
        result[b] = torch.einsum("hn,nhd->hd", torch.softmax(logits, dim=-1), vals)
    if out is None:
        return result.to(q.dtype)
    out.copy_(result)
    return out


def block_attention_mass(q: torch.Tensor, k_cache: torch.Tensor, block_table: torch.Tensor,
                         seq_lens: torch.Tensor, *, scale: float, per_query_head: bool = False) -> torch.Tensor:
    """float32 ``[B, M]``: softmax mass of each logical block, averaged over query heads (0 past a
    request's last block); ``per_query_head``: each query head's, ``[B, Hq, M]``."""
    B, Hq, D = q.shape
    M = block_table.shape[1]
    bs, Hkv = k_cache.shape[1], k_cache.shape[2]
    mass = torch.zeros(B, Hq, M, dtype=torch.float32, device=q.device)
    for b, n in enumerate(seq_lens.tolist()):
        keys = _gather_tokens(k_cache, block_table[b], n).repeat_interleave(Hq // Hkv, dim=1)
        p = torch.softmax(torch.einsum("hd,nhd->hn", q[b].float(), keys) * scale, dim=-1)
        nb = -(-n // bs)
        padded = torch.zeros(Hq, nb * bs, dtype=torch.float32, device=q.device)
        padded[:, :n] = p
        mass[b, :, :nb] = padded.reshape(Hq, nb, bs).sum(-1)
    return mass if per_query_head else mass.mean(1)
