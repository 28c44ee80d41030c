"""Exploration (issue 22): the Blend lookahead run through the first L layers only (its mass
summed over layers check_layer+1 .. L-1), which would cut its cost by (30 - L) / 30. Reference
forward, evals/blend_quality.py's workload; compares agreement / KL with the full lookahead.

    .venv/bin/python evals/explore/blend_lookahead_layers.py --layers 30,20,15,10 --samples 16
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import evals.blend_quality as bq  # noqa: E402
from evals.sparse_quality import corpus_ids  # noqa: E402
from ucm.blend import engine  # noqa: E402
from ucm.blend.reference import blended_logits  # noqa: E402
from ucm.models import ensure_smollm2  # noqa: E402
from ucm.reference.llama import Llama  # noqa: E402

_orig = engine.lookahead_mass
LAYERS = {"L": None}


class Truncated:
    def __init__(self, m, n):
        self.m, self.num_layers = m, n

    def __getattr__(self, k):
        return getattr(self.m, k)


def lookahead(model, *args):
    L = LAYERS["L"]
    return _orig(model if L is None else Truncated(model, L), *args)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", default="30,20,15,10")
    ap.add_argument("--ratios", default="0.15,0.2")
    ap.add_argument("--samples", type=int, default=16)
    ap.add_argument("--retrieval", type=int, default=0)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--corpus", default=None)
    ap.add_argument("--json")
    a = ap.parse_args()
    engine.lookahead_mass = lookahead
    path = ensure_smollm2()
    model = Llama.load(path)
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(os.path.join(path, "tokenizer.json"))
    ids = corpus_ids(path, a.corpus.split(",") if a.corpus else None)
    with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
        sink = [json.load(f)["bos_token_id"]]
    rng = random.Random(a.seed)
    samples = [("text",) + bq.text_sample(ids, rng, tok) for _ in range(a.samples)] + \
        [("retrieval",) + bq.retrieval_sample(ids, rng, tok) for _ in range(a.retrieval)]
    memos = [dict() for _ in samples]
    out = {}
    for L in [int(x) for x in a.layers.split(",")]:
        LAYERS["L"] = L
        for r in [float(x) for x in a.ratios.split(",")]:
            agree, kl, right, n_ret = [], [], 0, 0
            for (kind, prefix, chunks, suffix, n_answer), memo in zip(samples, memos):
                res = blended_logits(model, prefix, chunks, suffix, r, check_layer=1,
                                     lookahead=len(suffix) - n_answer, sink=sink,
                                     chunk_cache=memo)
                a_, k_, ok, _ = bq.score(res, suffix, n_answer)
                if kind == "text":
                    agree.append(a_)
                    kl.append(k_)
                else:
                    n_ret += 1
                    right += int(ok)
            key = f"L{L}:r{r}"
            out[key] = {"agreement": sum(agree) / max(len(agree), 1),
                        "kl": sum(kl) / max(len(kl), 1), "retrieval": f"{right}/{n_ret}"}
            print(key, out[key], flush=True)
    if a.json:
        json.dump(out, open(a.json, "w"), indent=1)


if __name__ == "__main__":
    main()
