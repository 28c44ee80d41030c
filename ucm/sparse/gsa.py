"""GSA: hash-code retrieval (sign bits on the device, Hamming top-k), with a prefetch hook.

Each block's mean key is hashed to ``sparse_hash_bits`` sign bits of a fixed seeded Gaussian
projection; the query of each KV group (its query heads summed) is hashed the same way, and
blocks are ranked by the number of equal bits, summed over KV groups. Codes are small (16 bytes
per block and head at 128 bits), so they can live on the device for a cache much larger than the
blocks kept there.

``prefetch`` (optional, settable attribute or constructor argument) is called after each
selection as ``prefetch(layer, req_id, block_ids)`` with the request's selected physical block
ids (int32 tensor, increasing logical order): a store can start moving them to a faster tier.
"""
from __future__ import annotations

from typing import Callable, Optional

from ucm.sparse import ops
from ucm.sparse.base import SparseMethod

Prefetch = Callable[[int, str, "object"], None]


class GSA(SparseMethod):
    name = "gsa"
    reprs = ("codes",)

    def __init__(self, config=None, *, prefetch: Optional[Prefetch] = None, **shape):
        super().__init__(config, **shape)
        if prefetch is not None and not callable(prefetch):
            raise ValueError(f"prefetch: expected a callable (layer, req_id, block_ids) or None, "
                             f"got {type(prefetch).__name__}")
        self.prefetch = prefetch

    def select(self, layer, states, q, k_cache, block_table, seq_lens, num_blocks, budget, tables):
        scores = ops.score_blocks(q, block_table, num_blocks, kind="hamming", codes=tables["codes"],
                                  proj=self._proj)
        sel, count = self.pick(scores, num_blocks, budget)
        if self.prefetch is not None:
            picked = block_table.gather(1, sel.long().clamp(min=0))
            for i, st in enumerate(states):
                self.prefetch(layer, st.req_id, picked[i, :int(count[i])])
        return sel, count
