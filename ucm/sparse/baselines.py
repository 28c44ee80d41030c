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

    def select(self, layer, states, q, k_cache, block_table, seq_lens, num_blocks, budget, tables):
        mass = ops.block_attention_mass(q, k_cache, block_table, seq_lens)
        mass = torch.where(torch.arange(mass.shape[1], device=mass.device)[None, :]
                           < num_blocks.long()[:, None], mass, float("-inf"))
        return self.pick(mass, num_blocks, budget)


class Random(SparseMethod):
    name = "random"

    def __init__(self, config=None, *, seed: int = 0, **shape):
        super().__init__(config, **shape)
        self.generator = torch.Generator().manual_seed(seed)

    def select(self, layer, states, q, k_cache, block_table, seq_lens, num_blocks, budget, tables):
        scores = torch.rand(block_table.shape, generator=self.generator).to(q.device)
        return self.pick(scores, num_blocks, budget)
