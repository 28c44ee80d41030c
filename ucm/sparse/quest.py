"""Quest: per-channel key bounds, scored by the upper bound of ``q . k`` inside each block.

Each block keeps the per-channel minimum and maximum of its keys; ``sum_d max(q_d kmin_d,
q_d kmax_d)`` bounds every ``q . k`` in the block from above. Blocks are selected every step by
that bound, combined over query heads as shares of attention (:meth:`SparseMethod.head_mass`:
per-head softmax over blocks, averaged; on SmolLM2 this lost less perplexity than summing the
bounds over heads). The bounds are kept per ``sparse_repr_group`` sub-block (default 2 tokens) and
a block scores as its best sub-block: a tighter bound (``benchmarks/RESULTS-archive.md``, "Scoring
improvements").

``sparse_per_kv_head: true`` (or the constructor keyword ``per_kv_head=True``, which wins): each
KV head keeps its own top blocks by the shares of its query heads; ``attention_begin`` then
returns per-KV-head tables ``[B, Hkv, K]`` / lengths ``[B, Hkv]``, which
``ucm.sparse.ops.paged_decode_attention`` takes (the vLLM-CPU hook cannot and refuses the option).
"""
from __future__ import annotations

from ucm.sparse.base import SparseMethod


class Quest(SparseMethod):
    name = "quest"
    reprs = ("kmin", "kmax")
    sub_blocks = True
    supports_per_kv_head = True

    def select(self, layer, states, q, k_cache, block_table, seq_lens, num_blocks, budget, tables):
        if self.per_kv_head:   # each KV head its own top blocks, by its query heads' shares
            bound = self.score_per_head(q, block_table, num_blocks, "quest", tables)
            return self.pick_per_kv_head(self.kv_head_mass(bound), num_blocks, budget)
        return self.score_pick_by_mass(q, block_table, num_blocks, budget, "quest", tables)
