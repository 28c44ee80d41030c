"""Exploration (issue 20): a SparQ-style scorer (the R channels of largest |q| per query head,
every token scored with that part of the dot product, per-block log-sum-exp) with one block
budget pooled over a request's KV heads, re-scored every ``S`` steps (in between the previous
per-KV-head selection plus the forced windows), keys quantized to B bits per (block, head,
channel) or exact. Registered as ``sqR_bB_sS`` rows of evals/sparse_quality.py.

    .venv/bin/python evals/explore/sparq_stride.py --contexts 2048,4096,8192 --docs 3 \\
        --tokens 32 --ratios 0.2 --methods sq16_b8_s1,sq16_b8_s2,...
"""
import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import ucm.sparse  # noqa: E402
from ucm.sparse.base import SparseMethod  # noqa: E402

POOL_CAP = 2.0        # a KV head takes at most twice the per-head budget from the pool


class SparQ(SparseMethod):
    name = "sparq"
    supports_per_kv_head = True
    R, BITS, STRIDE, MEANS, POOL = 16, 8, 1, 1, True

    def _pooled(self, shares, n, k):
        """shares [H, n] -> increasing block lists per KV head: Hkv * k blocks in all."""
        H = shares.shape[0]
        s = shares[:, :n].clone()
        s[:, self.forced(n)] = float("inf")
        if not self.POOL:   # each KV head its own k blocks
            rank = torch.argsort(torch.argsort(-s, dim=1, stable=True), dim=1)
            return [torch.nonzero(rank[h] < min(k, n))[:, 0].tolist() for h in range(H)]
        lim = max(k, min(n, int(math.ceil(POOL_CAP * k))))
        rank = torch.argsort(torch.argsort(-s, dim=1, stable=True), dim=1)
        s = torch.where(rank < lim, s, torch.tensor(float("-inf")))
        top = torch.topk(s.reshape(-1), min(H * k, H * n)).indices
        mask = torch.zeros(H * n, dtype=torch.bool)
        mask[top] = True
        mask = mask.reshape(H, n)
        return [torch.nonzero(mask[h])[:, 0].tolist() for h in range(H)]

    def _scores(self, q, k_cache, block_table, seq_lens, num_blocks):
        b, Hq, D = q.shape
        Hkv, bs = self.num_kv_heads, self.block_size
        G = Hq // Hkv
        M = block_table.shape[1]
        kb = k_cache[block_table.long()].float()                    # [b, M, bs, Hkv, D]
        if self.MEANS > 1:
            g = self.MEANS
            kb = kb.reshape(b, M, bs // g, g, Hkv, D).mean(3)
        t = kb.shape[2]
        if self.BITS:
            m = 2 ** (self.BITS - 1) - 1
            sc = kb.abs().amax(2, keepdim=True).clamp_min(1e-12) / m
            kb = (kb / sc).round().clamp(-m, m) * sc
        keys = kb.reshape(b, M * t, Hkv, D)
        per = bs // t
        pos = torch.arange(M * t) * per
        valid = pos[None] < seq_lens[:, None]
        qf = q.float()
        idx = qf.abs().topk(self.R, -1).indices
        qr = qf * torch.zeros_like(qf).scatter_(2, idx, 1.0)
        temp = torch.sqrt(D * qr.abs().sum(-1) / qf.abs().sum(-1))[..., None]
        lt = torch.einsum("bhgd,bthd->bhgt", qr.reshape(b, Hkv, G, D), keys).reshape(b, Hq, -1)
        lt = (lt / temp).masked_fill(~valid[:, None], float("-inf"))
        if per > 1:
            lt = lt + math.log(per)
        blk = torch.logsumexp(lt.reshape(b, Hq, M, t), -1)
        nvalid = torch.arange(M)[None] < num_blocks[:, None]
        blk = blk.masked_fill(~nvalid[:, None], float("-inf"))
        return torch.softmax(blk, -1).reshape(b, Hkv, G, M).mean(2)

    def select(self, layer, states, q, k_cache, block_table, seq_lens, num_blocks, budget, tables):
        n = num_blocks.tolist()
        due = [i for i, st in enumerate(states)
               if layer not in st.selection or st.calls.get(layer, 0) % self.STRIDE == 0]
        rows = [None] * len(states)
        if due:
            di = torch.tensor(due)
            shares = self._scores(q[di], k_cache, block_table[di], seq_lens[di], num_blocks[di])
            for j, i in enumerate(due):
                rows[i] = self._pooled(shares[j], n[i], int(budget[i]))
        for i, st in enumerate(states):
            if rows[i] is None:
                f = self.forced(n[i])
                rows[i] = [sorted(set(r).union(f)) for r in st.selection[layer]]
            st.selection[layer] = rows[i]
        H = self.num_kv_heads
        width = max(len(r) for rs in rows for r in rs)
        sel = torch.full((len(rows), H, width), -1, dtype=torch.int32)
        count = torch.zeros(len(rows), H, dtype=torch.int32)
        for i, rs in enumerate(rows):
            for h, r in enumerate(rs):
                sel[i, h, :len(r)] = torch.tensor(r, dtype=torch.int32)
                count[i, h] = len(r)
        return sel, count


for r in (16, 64):
    for bits in (0, 2, 3, 4, 8):
        for stride in (1, 2, 4):
            for means in (1, 2):
                for pool in (True, False):
                    nm = f"sq{r}_b{bits}_s{stride}" + (f"_m{means}" if means > 1 else "") \
                        + ("" if pool else "_np")
                    ucm.sparse.METHODS[nm] = type(nm, (SparQ,), dict(
                        name=nm, R=r, BITS=bits, STRIDE=stride, MEANS=means, POOL=pool))

from evals.sparse_quality import main  # noqa: E402

sys.exit(main(sys.argv[1:]))
