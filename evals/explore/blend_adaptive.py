"""Exploration (issue 22): a recompute budget per prompt from the lookahead's mass instead of a
fixed ratio. Rule ``cover:X:LO:HI``: the fewest stored tokens whose lookahead mass reaches X of
the stored tokens' total, at least LO and at most HI of them (as ratios). Runs
evals/blend_quality.py's workload with ``ucm.blend.ops.select_recompute`` replaced, and records
each prompt's effective ratio, so a fixed ratio at the same average can be compared.

    .venv/bin/python evals/explore/blend_adaptive.py --rules cover:0.6:0.05:0.4 --samples 12 \
        --corpus $(ls /usr/share/vim/vim90/doc/usr_*.txt | paste -sd,)
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import evals.blend_quality as bq  # noqa: E402
from evals.sparse_quality import corpus_ids  # noqa: E402
from ucm.blend import ops  # noqa: E402
from ucm.blend.reference import blended_logits  # noqa: E402
from ucm.models import ensure_smollm2  # noqa: E402
from ucm.reference.llama import Llama  # noqa: E402

_orig = ops.select_recompute
RULE = {"rule": None, "ratios": []}


def select(deviation, ratio, forced, *, backend=None):
    rule = RULE["rule"]
    if rule is None or ratio in (0.0, 1.0):
        return _orig(deviation, ratio, forced, backend=backend)
    x, lo, hi = rule
    free = ~forced
    U = int(free.sum())
    m = torch.where(free, deviation.float(), torch.zeros_like(deviation, dtype=torch.float32))
    total = float(m.sum())
    if U == 0 or total <= 0:
        return _orig(deviation, ratio, forced, backend=backend)
    srt = torch.sort(m[free], descending=True).values
    k = int(torch.searchsorted(torch.cumsum(srt, 0) / total, torch.tensor(x)).item()) + 1
    k = max(math.ceil(lo * U), min(k, math.floor(hi * U)))
    r = k / U
    RULE["ratios"].append(r)
    return _orig(deviation, r, forced, backend=backend)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rules", default="cover:0.6:0.05:0.4")
    ap.add_argument("--fixed", default="0.15,0.2,0.25")
    ap.add_argument("--samples", type=int, default=12)
    ap.add_argument("--retrieval", type=int, default=0)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--corpus", default=None)
    ap.add_argument("--json")
    a = ap.parse_args()
    ops.select_recompute = select
    path = ensure_smollm2()
    model = Llama.load(path)
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(os.path.join(path, "tokenizer.json"))
    ids = corpus_ids(path, a.corpus.split(",") if a.corpus else None)
    rng = random.Random(a.seed)
    samples = [("text",) + bq.text_sample(ids, rng, tok) for _ in range(a.samples)] + \
        [("retrieval",) + bq.retrieval_sample(ids, rng, tok) for _ in range(a.retrieval)]
    with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
        sink = [json.load(f)["bos_token_id"]]
    memos = [dict() for _ in samples]
    configs = [("fixed", float(r)) for r in a.fixed.split(",") if r] + \
        [("cover", tuple(float(v) for v in s.split(":")[1:])) for s in a.rules.split(",") if s]
    out = {}
    for name, arg in configs:
        RULE["rule"] = arg if name == "cover" else None
        RULE["ratios"] = []
        ratio = 0.15 if name == "cover" else arg
        agree, kl, right, n_ret = [], [], 0, 0
        for (kind, prefix, chunks, suffix, n_answer), memo in zip(samples, memos):
            res = blended_logits(model, prefix, chunks, suffix, ratio, check_layer=1,
                                 lookahead=len(suffix) - n_answer, sink=sink, chunk_cache=memo)
            a_, k_, ok, _ = bq.score(res, suffix, n_answer)
            if kind == "text":
                agree.append(a_); kl.append(k_)
            else:
                n_ret += 1; right += int(ok)
        key = f"{name}:{arg}"
        eff = sum(RULE["ratios"]) / len(RULE["ratios"]) if RULE["ratios"] else ratio
        out[key] = {"agreement": sum(agree) / max(len(agree), 1), "kl": sum(kl) / max(len(kl), 1),
                    "retrieval": f"{right}/{n_ret}", "mean_ratio": eff,
                    "ratios": RULE["ratios"]}
        print(key, {k: v for k, v in out[key].items() if k != "ratios"}, flush=True)
    if a.json:
        json.dump(out, open(a.json, "w"), indent=1)


if __name__ == "__main__":
    main()
