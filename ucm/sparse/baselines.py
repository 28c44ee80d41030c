"""Baselines for the accuracy harness, not methods to deploy.

* ``oracle``: the exact softmax mass of every block (:func:`ucm.sparse.ops.block_attention_mass`,
  which reads every key of the request, so it saves nothing), top blocks within the budget: the
  best any block selection of this budget can do by attention mass.
* ``random``: random blocks besides the windows, from a seeded generator: what a method must beat.
"""
from __future__ import annotations

import torch

from ucm.sparse import ops
from ucm.sparse.base import SparseMethod


class Oracle(SparseMethod):
    name = "oracle"
    supports_per_kv_head = True   # the ceiling for per-KV-head methods: each KV head's exact mass

    def select(self, layer, states, q, k_cache, block_table, seq_lens, num_blocks, budget, tables):
        valid = (torch.arange(block_table.shape[1], device=q.device)[None, :]
                 < num_blocks.long()[:, None])
        if self.per_kv_head:
            mass = self.kv_head_block_mass(q, k_cache, block_table, seq_lens)
            return self.pick_per_kv_head(torch.where(valid[:, None], mass, float("-inf")),
                                         num_blocks, budget)
        mass = ops.block_attention_mass(q, k_cache, block_table, seq_lens)
        return self.pick(torch.where(valid, mass, float("-inf")), num_blocks, budget)

    def kv_head_block_mass(self, q, k_cache, block_table, seq_lens) -> torch.Tensor:
        """float32 ``[B, Hkv, M]``: each block's exact softmax mass, averaged over the query
        heads of each KV head (0 past a request's blocks)."""
        mass = ops.block_attention_mass(q, k_cache, block_table, seq_lens, per_query_head=True)
        B, Hq, M = mass.shape
        Hkv = k_cache.shape[2]
        return mass.reshape(B, Hkv, Hq // Hkv, M).mean(2)


class Random(SparseMethod):
    name = "random"

    def __init__(self, config=None, *, seed: int = 0, **shape):
        super().__init__(config, **shape)
        self.generator = torch.Generator().manual_seed(seed)

    def select(self, layer, states, q, k_cache, block_table, seq_lens, num_blocks, budget, tables):
        scores = torch.rand(block_table.shape, generator=self.generator).to(q.device)
        return self.pick(scores, num_blocks, budget)
