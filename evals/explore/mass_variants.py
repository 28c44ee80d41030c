"""Exploration (issue 20): `mass` with a re-ranking stride and `mass` with one budget pooled over
a request's KV heads, measured with evals/sparse_quality.py's harness.

    OMP_NUM_THREADS=1 .venv/bin/python evals/explore/mass_variants.py --contexts 2048,4096 \
        --docs 3 --tokens 32 --ratios 0.3,0.2 --methods mass_s:kvhead+s2,mass_pool:kvhead
"""
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402

import ucm.sparse  # noqa: E402
from ucm.sparse import ops  # noqa: E402
from ucm.sparse.mass import Mass  # noqa: E402


def _pack(rows, b, H, device):
    width = max(len(r) for rr in rows for r in rr)
    sel = torch.full((b, H, width), -1, dtype=torch.int32)
    count = torch.zeros((b, H), dtype=torch.int32)
    for i in range(b):
        for h in range(H):
            sel[i, h, :len(rows[i][h])] = torch.tensor(rows[i][h], dtype=torch.int32)
            count[i, h] = len(rows[i][h])
    return sel.to(device), count.to(device)


class MassStride(Mass):
    """Mass re-ranked every ``retrieval_stride`` steps; in between the previous selection
    plus the windows (as ESA)."""
    name = "mass_s"

    def __init__(self, config=None, **shape):
        super().__init__(config, **shape)
        self.retrieval_stride = int(self.config["retrieval_stride"])

    def select(self, layer, states, q, k_cache, block_table, seq_lens, num_blocks, budget, tables):
        due = [layer not in st.selection or st.calls.get(layer, 0) % self.retrieval_stride == 0
               for st in states]
        n = num_blocks.tolist()
        if all(due):
            sel, count = super().select(layer, states, q, k_cache, block_table, seq_lens,
                                        num_blocks, budget, tables)
        else:
            di = [i for i, d in enumerate(due) if d]
            fresh = {}
            if di:
                t = torch.tensor(di, device=q.device)
                s2, c2 = super().select(layer, [states[i] for i in di], q[t], k_cache,
                                        block_table[t], seq_lens[t], num_blocks[t], budget[t],
                                        tables)
                for j, i in enumerate(di):
                    fresh[i] = (s2[j], c2[j])
            rows = []
            for i, st in enumerate(states):
                if i in fresh:
                    s_, c_ = fresh[i]
                    rows.append(self._lists(s_, c_))
                else:
                    forced = set(self.forced(n[i]))
                    rows.append([sorted(set(r).union(forced)) for r in st.selection[layer]])
            if self.per_kv_head:
                sel, count = _pack(rows, len(states), self.num_kv_heads, q.device)
            else:
                sel, count = ucm.sparse.base.pack_selection([r[0] for r in rows], q.device)
        for i, st in enumerate(states):
            st.selection[layer] = self._lists(sel[i], count[i])
        return sel, count

    @staticmethod
    def _lists(sel, count):
        if sel.dim() == 1:
            return [sel[:int(count)].tolist()]
        return [sel[h, :int(count[h])].tolist() for h in range(sel.shape[0])]


class MassPooled(Mass):
    """Mass per KV head with one budget pooled over the request's KV heads (a head at most twice
    its share): the blocks of largest share across the heads."""
    name = "mass_pool"
    supports_per_kv_head = True

    def select(self, layer, states, q, k_cache, block_table, seq_lens, num_blocks, budget, tables):
        assert self.per_kv_head
        scale = 1.0 / math.sqrt(self.head_dim)
        per_head = ops.score_token_mass(q, block_table, num_blocks, keys4=tables["keys4"],
                                        scale4=tables["scale4"], scale=scale)
        shares = self.kv_head_mass(per_head.float())         # [b, H, M]
        b, H, M = shares.shape
        budgets = torch.empty(b, H, dtype=torch.int32, device=q.device)
        for i in range(b):
            n = int(num_blocks[i])
            s = shares[i, :, :n].clone()
            forced = self.forced(n)
            s[:, forced] = float("inf")
            per = int(budget[i])
            cap = min(n, 2 * per)
            top = s.topk(cap, dim=1).values                        # [H, cap]
            flat = top.flatten().topk(H * per).indices
            cnt = torch.bincount(flat // cap, minlength=H)
            budgets[i] = cnt.clamp(min=len(forced) + 1).to(torch.int32)
        sel, count = ops.select_blocks(shares.reshape(b * H, M).contiguous(),
                                       num_blocks.repeat_interleave(H), budgets.reshape(-1),
                                       init_window=self.init_window,
                                       local_window=self.local_window)
        return sel.reshape(b, H, -1), count.reshape(b, H)


ucm.sparse.METHODS[MassStride.name] = MassStride
ucm.sparse.METHODS[MassPooled.name] = MassPooled

if __name__ == "__main__":
    from evals import sparse_quality
    sys.exit(sparse_quality.main())
