"""Sparse-attention ops, reference implementation: readable PyTorch, float32 math.

Contracts in ``docs/sparse.md``; inputs are validated (and normalized) by :mod:`ucm.sparse.ops`
before they reach these functions, so nothing here re-checks shapes or dtypes. Normalized means:
``budget`` is an int32 tensor ``[B]`` on the scores' device, ``scale`` is a float, ``kind`` and
``reduce`` are valid names, and the output width ``width`` of :func:`select_blocks` is given.

Cache layout: ``k_cache, v_cache: [num_blocks, block_size, Hkv, D]`` (any strides); query head
``h`` reads KV head ``h // (Hq // Hkv)``.
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


def update_block_reprs(k_cache: torch.Tensor, block_ids: torch.Tensor, num_tokens: torch.Tensor,
                       *, mean: Optional[torch.Tensor] = None, kmin: Optional[torch.Tensor] = None,
                       kmax: Optional[torch.Tensor] = None, codes: Optional[torch.Tensor] = None,
                       proj: Optional[torch.Tensor] = None) -> None:
    """Write mean / kmin / kmax / codes rows of the listed physical blocks in place, over each
    block's first ``num_tokens[i]`` tokens."""
    if block_ids.numel() == 0:
        return
    ids = block_ids.long()
    keys = k_cache[ids].float()                                  # [N, bs, Hkv, D]
    bs = keys.shape[1]
    n = num_tokens.long().to(keys.device)
    live = (torch.arange(bs, device=keys.device)[None, :] < n[:, None])[:, :, None, None]
    block_mean = torch.where(live, keys, 0.0).sum(1) / n[:, None, None].float()
    if mean is not None:
        mean[ids] = block_mean.to(mean.dtype)
    if kmin is not None:
        kmin[ids] = torch.where(live, keys, float("inf")).amin(1).to(kmin.dtype)
    if kmax is not None:
        kmax[ids] = torch.where(live, keys, NEG_INF).amax(1).to(kmax.dtype)
    if codes is not None:
        codes[ids] = hash_codes(block_mean, proj)


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
                 reduce: str = "sum") -> torch.Tensor:
    """float32 block scores ``[B, M]`` (``reduce="sum"``) or per head (``reduce="none"``);
    positions ``j >= num_blocks[b]`` are ``-inf``."""
    B, Hq, D = q.shape
    ids, valid = _logical_ids(block_table, num_blocks)
    qf = q.float()
    if kind == "hamming":
        Hkv = codes.shape[1]
        qsum = qf.reshape(B, Hkv, Hq // Hkv, D).sum(2)            # [B, Hkv, D]
        qcode = hash_codes(qsum, proj)                             # [B, Hkv, W]
        bcode = codes[ids].permute(0, 2, 1, 3)                     # [B, Hkv, M, W]
        diff = _popcount32(qcode[:, :, None, :] ^ bcode).sum(-1)   # [B, Hkv, M]
        per_head = (proj.shape[1] - diff).float()
    else:
        table = mean if kind == "mean" else kmin
        Hkv = table.shape[1]
        group = Hq // Hkv
        if kind == "mean" and channel_mask is not None:
            qf = qf * channel_mask.to(qf.dtype)
        # block representations of each query head's KV head: [B, M, Hq, D]
        per_q = table[ids].float().repeat_interleave(group, dim=2)
        if kind == "mean":
            per_head = torch.einsum("bhd,bmhd->bhm", qf, per_q)
        else:
            hi = kmax[ids].float().repeat_interleave(group, dim=2)
            prod = torch.maximum(qf[:, None] * per_q, qf[:, None] * hi)
            per_head = prod.sum(-1).permute(0, 2, 1)               # [B, Hq, M]
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
    accumulation; ``[B, Hq, D]`` in ``q``'s dtype (written into ``out`` when given)."""
    B, Hq, D = q.shape
    Hkv = k_cache.shape[2]
    group = Hq // Hkv
    result = torch.empty(B, Hq, D, dtype=torch.float32, device=q.device)
    for b, n in enumerate(seq_lens.tolist()):
        keys = _gather_tokens(k_cache, block_table[b], n).repeat_interleave(group, dim=1)
        vals = _gather_tokens(v_cache, block_table[b], n).repeat_interleave(group, dim=1)
        logits = torch.einsum("hd,nhd->hn", q[b].float(), keys) * scale
        result[b] = torch.einsum("hn,nhd->hd", torch.softmax(logits, dim=-1), vals)
    if out is None:
        return result.to(q.dtype)
    out.copy_(result)
    return out


def block_attention_mass(q: torch.Tensor, k_cache: torch.Tensor, block_table: torch.Tensor,
                         seq_lens: torch.Tensor, *, scale: float) -> torch.Tensor:
    """float32 ``[B, M]``: softmax mass of each logical block, averaged over query heads (0 past a
    request's last block)."""
    B, Hq, D = q.shape
    M = block_table.shape[1]
    bs, Hkv = k_cache.shape[1], k_cache.shape[2]
    mass = torch.zeros(B, M, dtype=torch.float32, device=q.device)
    for b, n in enumerate(seq_lens.tolist()):
        keys = _gather_tokens(k_cache, block_table[b], n).repeat_interleave(Hq // Hkv, dim=1)
        p = torch.softmax(torch.einsum("hd,nhd->hn", q[b].float(), keys) * scale, dim=-1)
        nb = -(-n // bs)
        padded = torch.zeros(Hq, nb * bs, dtype=torch.float32, device=q.device)
        padded[:, :n] = p
        mass[b, :nb] = padded.reshape(Hq, nb, bs).sum(-1).mean(0)
    return mass
