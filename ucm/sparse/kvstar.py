"""KVStar: channel-pruned mean-key scores and multi-query voting.

Scoring: for each query head only the ``kvstar_channels`` channels with the largest ``|q|`` count
(``q . mean`` over those channels; the others carry little of the dot product and mostly noise),
with the best of the block's ``sparse_repr_group`` sub-block means (default 2 tokens); heads are
combined as shares of attention (:meth:`SparseMethod.head_mass`).

Voting: a request keeps, per layer, the queries of its last ``kvstar_votes`` decode steps
(the current one included). Each of them votes for its own top-``budget`` blocks; blocks are
selected by number of votes, ties broken by the current query's score. Blocks that several
recent queries wanted survive a single query's miss, which keeps the selection stable across
steps, as the attention of neighbouring decode steps is.
"""
from __future__ import annotations

import torch

from ucm.sparse.base import SparseMethod


class KVStar(SparseMethod):
    name = "kvstar"
    reprs = ("mean",)
    sub_blocks = True

    def __init__(self, config=None, **shape):
        super().__init__(config, **shape)
        self.channels = int(self.config["kvstar_channels"])
        self.votes = int(self.config["kvstar_votes"])
        if self.channels > self.head_dim:
            raise ValueError(f"kvstar_channels: {self.channels} exceeds head_dim={self.head_dim} "
                             f"(channels kept per query head, at most head_dim)")

    def channel_mask(self, q: torch.Tensor) -> torch.Tensor:
        """bool ``[..., Hq, D]``: the top ``kvstar_channels`` channels of ``|q|`` per head."""
        top = q.abs().topk(self.channels, dim=-1).indices
        return torch.zeros(q.shape, dtype=torch.bool, device=q.device).scatter_(-1, top, True)

    def select(self, layer, states, q, k_cache, block_table, seq_lens, num_blocks, budget, tables):
        b, M = block_table.shape
        V = self.votes
        # recent queries per row, newest last; rows with fewer repeat their oldest one
        hist = []
        for i, st in enumerate(states):
            recent = st.extra.setdefault(layer, [])
            recent.append(q[i].float())
            del recent[:-V]
            hist.append([recent[0]] * (V - len(recent)) + recent)
        queries = torch.stack([torch.stack(h) for h in hist])              # [b, V, Hq, D]
        flat = queries.reshape(b * V, *q.shape[1:])
        per_head = self.score_per_head(flat, block_table.repeat_interleave(V, 0),
                                       num_blocks.repeat_interleave(V, 0), "mean", tables,
                                       channel_mask=self.channel_mask(flat))
        scores = self.head_mass(per_head).reshape(b, V, M)
        # each query's rank of every block (0 = best; ties to the lower index)
        order = torch.sort(scores, dim=-1, descending=True, stable=True).indices
        rank = torch.empty_like(order).scatter_(-1, order, torch.arange(M, device=q.device).expand_as(order))
        votes = (rank < budget.long()[:, None, None]).sum(1).float()       # [b, M]
        current = scores[:, -1]
        valid = torch.isfinite(current)
        lo = torch.where(valid, current, float("inf")).amin(-1, keepdim=True)
        hi = torch.where(valid, current, float("-inf")).amax(-1, keepdim=True)
        tie = (current - lo) / (hi - lo).clamp(min=1e-12) * 0.5             # in [0, 0.5]
        combined = torch.where(valid, votes + tie, float("-inf"))
        return self.pick(combined, num_blocks, budget)
