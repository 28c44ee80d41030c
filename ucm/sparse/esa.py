"""ESA: retrieval by mean keys, re-selected every ``retrieval_stride`` decode steps.

Each block is represented by the mean keys of its ``sparse_repr_group`` sub-blocks (default 2
tokens; a block scores as its best sub-block). A request's selection in a layer is computed
from the current query (``q_h . mean`` per query head, combined as shares of attention by
:meth:`SparseMethod.head_mass`; top blocks within the budget: one
:func:`ucm.sparse.ops.score_select_head_mass` call: scoring and selection) on its
first sparse step and then every ``retrieval_stride`` steps; in between, the previous selection is
reused, extended by the blocks that are new since (the windows and the last block are always
current, so a step never misses the token being decoded or its neighbours).
"""
from __future__ import annotations

import torch

from ucm.sparse.base import SparseMethod, pack_selection


class ESA(SparseMethod):
    name = "esa"
    reprs = ("mean",)
    sub_blocks = True

    def __init__(self, config=None, **shape):
        super().__init__(config, **shape)
        self.retrieval_stride = int(self.config["retrieval_stride"])
        self.retrievals = 0          # fresh selections made (all requests, layers)

    def select(self, layer, states, q, k_cache, block_table, seq_lens, num_blocks, budget, tables):
        n = num_blocks.tolist()
        due = [i for i, st in enumerate(states)
               if layer not in st.selection or st.calls.get(layer, 0) % self.retrieval_stride == 0]
        rows: list = [None] * len(states)
        folded = ()
        if due:
            di = torch.tensor(due, device=q.device)
            fold = len(due) == len(states)   # every row attends to its new selection
            out = self.score_pick_by_mass(q[di], block_table[di], num_blocks[di], budget[di],
                                          "mean", tables, seq_lens=seq_lens if fold else None)
            sel, count = out[:2]
            for j, i in enumerate(due):
                rows[i] = sel[j, :int(count[j])].tolist()
            folded = tuple(out[2:])
            self.retrievals += len(due)
        for i, st in enumerate(states):
            if rows[i] is None:
                rows[i] = sorted(set(st.selection[layer]).union(self.forced(n[i])))
            st.selection[layer] = rows[i]
        return pack_selection(rows, q.device) + folded
