"""Adaptive: a per request and per layer budget from the estimated attention mass.

The mass of each block is estimated from its mean key: a block of ``t`` tokens whose keys are
near their mean ``m`` receives about ``t * exp(scale * q . m)`` of the softmax numerator, so the
estimated logit of a block is ``scale * q_h . m + log(t)`` (``scale = head_dim ** -0.5``), turned
into a distribution over the request's blocks per query head and averaged over heads. The
request keeps the smallest set of blocks (windows and last block first, then by estimated mass)
whose estimated mass reaches ``adaptive_mass``, bounded below by the windows
(``init_window + local_window + 1`` blocks) and above by the usual budget
``max(init_window + local_window + 1, ceil(sparse_ratio * n))``: a layer whose attention is
concentrated keeps few blocks, a diffuse one up to the budget. The first
``sparse_dense_layers`` layers stay dense (base class).
"""
from __future__ import annotations

import math

import torch

from ucm.sparse import ops
from ucm.sparse.base import SparseMethod


class Adaptive(SparseMethod):
    name = "adaptive"
    reprs = ("mean",)
    partial_reprs = True

    def __init__(self, config=None, **shape):
        super().__init__(config, **shape)
        self.mass = float(self.config["adaptive_mass"])
        self.kept_blocks = 0        # blocks kept and blocks seen over all selections (reports)
        self.seen_blocks = 0

    def estimated_mass(self, q, block_table, seq_lens, num_blocks, tables) -> torch.Tensor:
        """float32 ``[b, M]``: estimated softmax mass per block, averaged over query heads."""
        per_head = ops.score_blocks(q, block_table, num_blocks, kind="mean", reduce="none",
                                    **self.score_tables("mean", tables))    # [b, Hq, M]
        b, _, M = per_head.shape
        bs = self.block_size
        j = torch.arange(M, device=q.device)[None, :]
        n = num_blocks.long()[:, None]
        tokens = torch.where(j < n - 1, bs, seq_lens.long()[:, None] - (n - 1) * bs).clamp(min=1)
        logits = per_head / math.sqrt(self.head_dim) + torch.log(tokens.float())[:, None, :]
        return torch.softmax(logits, dim=-1).mean(1)

    def select(self, layer, states, q, k_cache, block_table, seq_lens, num_blocks, budget, tables):
        est = self.estimated_mass(q, block_table, seq_lens, num_blocks, tables)
        b, M = est.shape
        j = torch.arange(M, device=q.device)[None, :]
        n = num_blocks.long()[:, None]
        forced = ((j < self.init_window) | (j >= n - self.local_window) | (j == n - 1)) & (j < n)
        reached = (est * forced).sum(1)
        rest = torch.where(forced | (j >= n), 0.0, est).sort(dim=1, descending=True).values
        # blocks beyond the forced ones needed so that forced + cumulative mass >= adaptive_mass
        need = (reached[:, None] + rest.cumsum(1) < self.mass - 1e-6).sum(1) + 1
        need = torch.where(reached >= self.mass, 0, need)
        lower = self.init_window + self.local_window + 1
        adaptive = torch.minimum(torch.clamp(forced.sum(1) + need, min=lower), budget.long())
        adaptive = adaptive.to(torch.int32)
        self.kept_blocks += int(adaptive.sum())
        self.seen_blocks += int(num_blocks.sum())
        return self.pick(est, num_blocks, adaptive)
