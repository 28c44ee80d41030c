"""Mass: blocks ranked at every step by their attention mass under every token's key in int4.

Each full block keeps its tokens' keys as int4 codes, symmetric per (block, KV head, channel)
with a float16 scale (:func:`ucm.sparse.ops.quantize_token_keys`: a sixteenth of the block's
keys and values in bfloat16, plus a quarter of that for the scales). At every decode step each
query head scores each block by ``logsumexp`` over the block's tokens of its scaled logits
under those keys (:func:`ucm.sparse.ops.score_token_mass`): a softmax over the blocks is then
each block's share of the head's attention, up to the int4 rounding of the keys, where mean keys
and bounds (ESA, Quest) only estimate it. The shares are averaged over the query heads
(:meth:`SparseMethod.head_mass`), per KV head with ``sparse_per_kv_head: true``, and the top
blocks within the budget are kept with the windows.

Per KV head the budget is pooled over the request's KV heads
(:func:`ucm.sparse.ops.pool_head_budgets`): beyond its windows each head keeps its share of the
``Hkv * budget`` (head, block) pairs of largest share, at most ``HEAD_BUDGET_CAP`` times the
per-head budget, so a head whose attention sits on a few blocks leaves blocks to one whose
attention is spread. The blocks attended in total stay those of the ratio.

On SmolLM2 (``evals/sparse_quality.py``, 2K / 4K / 8K pooled, ``benchmarks/RESULTS.md``) this
ranking, re-made every step and per KV head, costs less perplexity at ``sparse_ratio`` 0.2 than
the exact-mass oracle with one selection per request; what a stride or coarser summaries save in
reads they lose in accuracy, so the method has no stride. The partial last block is always
attended (the windows), so only full blocks are quantized.
"""
from __future__ import annotations

import math

from ucm.sparse import ops
from ucm.sparse.base import SparseMethod


#: per KV head, the most blocks one head may take of the request's pooled budget, as a multiple
#: of the per-head budget
HEAD_BUDGET_CAP = 2


class Mass(SparseMethod):
    name = "mass"
    reprs = ("keys4",)
    supports_per_kv_head = True

    def __init__(self, config=None, **shape):
        super().__init__(config, **shape)
        if self.head_dim % 2:
            raise ValueError(f"head_dim: {self.head_dim} is odd; the 'mass' method packs two "
                             f"int4 key channels per byte (expected an even head_dim)")

    def select(self, layer, states, q, k_cache, block_table, seq_lens, num_blocks, budget, tables):
        scale = 1.0 / math.sqrt(self.head_dim)
        per_head = ops.score_token_mass(q, block_table, num_blocks, keys4=tables["keys4"],
                                        scale4=tables["scale4"], scale=scale)
        if not self.per_kv_head:
            return self.pick_by_mass(per_head, num_blocks, budget)
        shares = self.kv_head_mass(per_head)                       # [b, Hkv, M]
        b, H, M = shares.shape
        windows = dict(init_window=self.init_window, local_window=self.local_window)
        budgets = ops.pool_head_budgets(shares, num_blocks, budget, cap=HEAD_BUDGET_CAP, **windows)
        sel, count = ops.select_blocks(shares.reshape(b * H, M).contiguous(),
                                       num_blocks.repeat_interleave(H), budgets.reshape(-1),
                                       **windows)
        return sel.reshape(b, H, -1), count.reshape(b, H)
