"""Exploration (issue 20): `mass` behind a coarse prefilter. A cheap block summary (16- or 8-token
mean keys in int8, or Quest bounds) ranks every block at every step; only the top ``c`` of the
blocks (with the windows) are then scored by `mass`'s int4 token keys, and the final selection
(per KV head, pooled budget) is made among them. The fine scoring then reads ``c`` of what
`mass` reads. Quality only (reference ops, SmolLM2 float32); run on the sparse_quality harness'
documents.

    .venv/bin/python evals/explore/mass_twolevel.py --contexts 2048,4096 --docs 3 --json out.json
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from evals.sparse_quality import corpus_ids, documents, summarize, markdown  # noqa: E402
from ucm.reference.llama import Llama, run_continuation  # noqa: E402
from ucm.sparse import ops  # noqa: E402
from ucm.sparse.mass import Mass, HEAD_BUDGET_CAP  # noqa: E402


class StaleCand(Mass):
    """Candidates from the last full scoring (top ``frac`` of blocks by shared head mass),
    refreshed every ``stride`` steps; in between only the candidates, the blocks new since and
    the windows are scored."""

    def __init__(self, config=None, *, frac=0.4, stride=4, **shape):
        super().__init__(config, **shape)
        self.frac, self.stride = frac, stride

    def select(self, layer, states, q, k_cache, block_table, seq_lens, num_blocks, budget, tables):
        scale = 1.0 / math.sqrt(self.head_dim)
        full = ops.score_token_mass(q, block_table, num_blocks, keys4=tables["keys4"],
                                    scale4=tables["scale4"], scale=scale)
        b, Hq, M = full.shape
        H = self.num_kv_heads
        mask = torch.ones(b, M, dtype=torch.bool)
        for i, st in enumerate(states):
            n = int(num_blocks[i])
            calls = st.calls.get(layer, 0)
            if calls % self.stride == 0 or layer not in st.extra:
                C = min(n, max(int(budget[i]), math.ceil(self.frac * n)))
                sel, cnt = self.pick_by_mass(full[i:i + 1], num_blocks[i:i + 1],
                                             torch.tensor([C], dtype=torch.int32))
                st.extra[layer] = (set(sel[0, :cnt[0]].tolist()), n)
            else:
                cand, n0 = st.extra[layer]
                m = torch.zeros(M, dtype=torch.bool)
                m[list(cand)] = True
                m[n0 - 1:n] = True          # the blocks new (or partial) since the refresh
                m[:self.init_window] = True
                m[max(0, n - self.local_window):n] = True
                mask[i] = m
        per_head = full.masked_fill(~mask[:, None, :], float("-inf"))
        shares = self.kv_head_mass(per_head)
        windows = dict(init_window=self.init_window, local_window=self.local_window)
        budgets = ops.pool_head_budgets(shares, num_blocks, budget, cap=HEAD_BUDGET_CAP, **windows)
        sel, count = ops.select_blocks(shares.reshape(b * H, M).contiguous(),
                                       num_blocks.repeat_interleave(H), budgets.reshape(-1),
                                       **windows)
        return sel.reshape(b, H, -1), count.reshape(b, H)


class TwoLevel(Mass):
    sub_blocks = True

    def __init__(self, config=None, *, coarse="mean", frac=0.4, kvcand=False, **shape):
        self.reprs = ("keys4", "mean") if coarse == "mean" else ("keys4", "kmin", "kmax")
        super().__init__(config, **shape)
        self.coarse, self.frac, self.kvcand = coarse, frac, kvcand
        self.recall = []

    def select(self, layer, states, q, k_cache, block_table, seq_lens, num_blocks, budget, tables):
        scale = 1.0 / math.sqrt(self.head_dim)
        coarse = self.score_per_head(q, block_table, num_blocks, self.coarse, tables)  # [b,Hq,M]
        b, Hq, M = coarse.shape
        H = self.num_kv_heads
        n = num_blocks.long()
        cand_budget = torch.maximum(budget, torch.ceil(self.frac * n).int())
        cand_budget = torch.minimum(cand_budget, num_blocks)
        if self.kvcand:
            shares_c = self.kv_head_mass(coarse)
            sel_c, cnt_c = self.pick_per_kv_head(shares_c, num_blocks, cand_budget)
            mask = torch.zeros(b, H, M, dtype=torch.bool)
            for i in range(b):
                for h in range(H):
                    mask[i, h, sel_c[i, h, :cnt_c[i, h]].long()] = True
            mask = mask.repeat_interleave(Hq // H, 1)
        else:
            sel_c, cnt_c = self.pick_by_mass(coarse, num_blocks, cand_budget)
            mask = torch.zeros(b, M, dtype=torch.bool)
            for i in range(b):
                mask[i, sel_c[i, :cnt_c[i]].long()] = True
            mask = mask[:, None, :].expand(b, Hq, M)
        full = ops.score_token_mass(q, block_table, num_blocks, keys4=tables["keys4"],
                                    scale4=tables["scale4"], scale=scale)
        per_head = full.masked_fill(~mask, float("-inf"))
        shares = self.kv_head_mass(per_head)
        windows = dict(init_window=self.init_window, local_window=self.local_window)
        # recall: the share of the full mass ranking's pooled selection the candidates hold
        budgets = ops.pool_head_budgets(shares, num_blocks, budget, cap=HEAD_BUDGET_CAP, **windows)
        sel, count = ops.select_blocks(shares.reshape(b * H, M).contiguous(),
                                       num_blocks.repeat_interleave(H), budgets.reshape(-1),
                                       **windows)
        return sel.reshape(b, H, -1), count.reshape(b, H)


def make(name, cfg, shape):
    if name == "mass":
        return Mass(cfg, per_kv_head=True, **shape)
    parts = name.split(":")
    if parts[0] == "stale":       # stale:<frac>:<stride>
        return StaleCand(cfg, frac=float(parts[1]), stride=int(parts[2]), per_kv_head=True, **shape)
    # twolevel:<mean16|mean8|quest16>:<frac>[:kv]
    summ, frac = parts[1], float(parts[2])
    kind = "quest" if summ.startswith("quest") else "mean"
    group = int(summ[len(kind):])
    c = dict(cfg, sparse_repr_group=group)
    if kind == "mean":
        c["sparse_repr_dtype"] = "int8"
    return TwoLevel(c, coarse=kind, frac=frac, kvcand=len(parts) > 3, per_kv_head=True, **shape)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--contexts", default="2048,4096,8192")
    p.add_argument("--docs", type=int, default=3)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--ratio", type=float, default=0.2)
    p.add_argument("--variants", default="mass,twolevel:mean16:0.4,twolevel:mean16:0.3,"
                   "twolevel:mean8:0.4,twolevel:quest16:0.4,twolevel:mean16:0.4:kv")
    p.add_argument("--corpus", default=None)
    p.add_argument("--json")
    a = p.parse_args()
    from ucm.models import ensure_smollm2
    path = ensure_smollm2()
    model = Llama.load(path)
    ids = corpus_ids(path, a.corpus.split(",") if a.corpus else None)
    shape = dict(num_layers=model.num_layers, num_q_heads=model.num_q_heads,
                 num_kv_heads=model.num_kv_heads, head_dim=model.head_dim, block_size=16)
    cfg = {"min_blocks": 16, "sparse_method": "mass", "sparse_ratio": a.ratio}
    variants = a.variants.split(",")
    records = []
    t0 = time.time()
    for length in map(int, a.contexts.split(",")):
        for d, doc in enumerate(documents(ids, length, a.tokens, a.docs)):
            rows = [None] + [make(v, cfg, shape) for v in variants]
            context, cont = doc[:length], doc[length:length + a.tokens]
            targets = torch.tensor(doc[length + 1:length + a.tokens + 1])
            res = run_continuation(model, context, cont, rows)
            dlp = torch.log_softmax(res.dense_logits, -1)
            for r, v in enumerate(variants, start=1):
                lp = torch.log_softmax(res.logits[r], -1)
                records.append({
                    "method": v, "ratio": a.ratio, "context": length,
                    "nll": (-lp.gather(1, targets[:, None])[:, 0]).tolist(),
                    "dense_nll": (-dlp.gather(1, targets[:, None])[:, 0]).tolist(),
                    "agree": (res.logits[r].argmax(-1) == res.dense_logits.argmax(-1)).float().tolist(),
                    "kl": (dlp.exp() * (dlp - lp)).sum(-1).tolist(),
                    "mass": res.mass[r].tolist(), "kept": [0.0] * a.tokens})
            print(f"context {length} doc {d} done, {time.time() - t0:.0f} s", flush=True)
    rows = summarize(records)
    print(markdown(rows))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"variants": variants, "summary": rows, "records": records}, f)


if __name__ == "__main__":
    main()
