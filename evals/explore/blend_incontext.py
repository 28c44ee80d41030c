"""Exploration (issue 22): store each chunk's KV as a real prompt computed it (in context)
instead of computed alone after BOS. Reference forward, SmolLM2-135M float32.

Modes (the chunk KV each blended request loads; keys rotated to positions 1.., as blend.sink:
bos stores them, so the shipped loader is unchanged):
  bos      shipped: each chunk computed alone after BOS;
  warmup   the chunk's rows of the full prefill of a warm-up prompt: the same instruction and
           the same chunks in another order (what the vLLM eval's warm-up request computes);
  other    the chunk's rows of the full prefill of BOS + two other random passages of the same
           text + the chunk (the chunk first seen beside other documents, not this prompt's).

    .venv/bin/python evals/explore/blend_incontext.py --samples 12 --retrieval 12 --seed 21
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from evals import argtypes  # noqa: E402
from evals.blend_quality import _chunks, retrieval_sample, score, text_sample  # noqa: E402
from evals.sparse_quality import corpus_ids  # noqa: E402
from ucm.blend import ops  # noqa: E402
from ucm.blend.reference import PagedRequestKV, blended_logits, chunk_kv  # noqa: E402
from ucm.models import ensure_smollm2  # noqa: E402
from ucm.reference.llama import Llama  # noqa: E402


@torch.inference_mode()
def rows_in_context(model, ids, spans):
    """Per span (start, length) of ``ids``: its per-layer (k, v) from one full prefill of
    ``ids``, keys rotated from positions start.. to 1.."""
    bs = 16
    nb = math.ceil(len(ids) / bs)
    cache = model.new_cache(nb, bs)
    model.prefill(list(ids), cache, list(range(nb)), logits_from=len(ids) - 1)
    kv = PagedRequestKV(cache, range(nb))
    inv = model.inv_freq.to(torch.float32)
    out = []
    for a, n in spans:
        per = []
        for layer in range(model.num_layers):
            k, v = kv.read(layer, a + n)
            k, v = k[a:a + n], v[a:a + n]
            d = torch.full((n,), 1 - a, dtype=torch.int64)
            per.append((ops.rope_rotate(k, d, inv), v.clone()))
        out.append(per)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--samples", type=int, default=12)
    ap.add_argument("--retrieval", type=int, default=12)
    ap.add_argument("--ratios", default="0,0.15")
    ap.add_argument("--corpus", type=argtypes.names, default=None)
    ap.add_argument("--seed", type=int, default=21)
    ap.add_argument("--modes", default="bos,warmup,other")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    from tokenizers import Tokenizer

    path = ensure_smollm2()
    tok = Tokenizer.from_file(os.path.join(path, "tokenizer.json"))
    model = Llama.load(path)
    ids = corpus_ids(path, args.corpus)
    bos = json.load(open(os.path.join(path, "config.json")))["bos_token_id"]
    sink = [bos]
    ratios = [float(r) for r in args.ratios.split(",")]
    modes = args.modes.split(",")
    rng = random.Random(args.seed)
    side = random.Random(args.seed + 1000)       # the warm-up orders and the other passages
    res = {(m, r): {"agree": [], "kl": [], "ret": 0, "full": 0, "n_ret": 0, "margin": []}
           for m in modes for r in ratios}
    kinds = ["text"] * args.samples + ["retrieval"] * args.retrieval
    t0 = time.time()
    for i, kind in enumerate(kinds):
        prefix, chunks, suffix, n_answer = (text_sample if kind == "text" else retrieval_sample)(ids, rng, tok)
        order = list(range(len(chunks)))
        while len(order) > 1 and order == list(range(len(chunks))):
            side.shuffle(order)
        memos = {"bos": {}}
        if "warmup" in modes:
            w_ids = [bos] + list(prefix)
            spans = [None] * len(chunks)
            for j in order:
                spans[j] = (len(w_ids), len(chunks[j]))
                w_ids += list(chunks[j])
            kvs = rows_in_context(model, w_ids, spans)
            memos["warmup"] = {(tuple(sink), tuple(c)): kv for c, kv in zip(chunks, kvs)}
        if "other" in modes:
            memo = {}
            for c in chunks:
                others = _chunks(ids, side)[:2]
                o_ids = [bos] + [t for o in others for t in o]
                memo[(tuple(sink), tuple(c))] = rows_in_context(model, o_ids + list(c), [(len(o_ids), len(c))])[0]
            memos["other"] = memo
        for m in modes:
            for r in ratios:
                out = blended_logits(model, prefix, chunks, suffix, r, chunk_cache=memos[m],
                                     lookahead=len(suffix) - n_answer, sink=sink)
                agree, kl, ok_b, ok_f = score(out, suffix, n_answer)
                row = res[(m, r)]
                if kind == "text":
                    row["agree"].append(agree)
                    row["kl"].append(kl)
                else:
                    row["n_ret"] += 1
                    row["ret"] += ok_b
                    row["full"] += ok_f
        print(f"sample {i + 1}/{len(kinds)} {kind} {time.time() - t0:.0f} s", flush=True)
    table = []
    for (m, r), row in res.items():
        a = sum(row["agree"]) / max(1, len(row["agree"]))
        k = sum(row["kl"]) / max(1, len(row["kl"]))
        table.append({"mode": m, "ratio": r, "agreement": a, "kl": k,
                      "retrieval": row["ret"], "retrieval_full": row["full"], "n_retrieval": row["n_ret"],
                      "per_prompt_kl": row["kl"]})
        print(f"{m:7s} {r:.2f} agreement {a:.3f} KL {k:.4f} retrieval {row['ret']}/{row['n_ret']} (full {row['full']})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"seed": args.seed, "corpus": args.corpus or "pydoc_data.topics",
                       "samples": args.samples, "retrieval": args.retrieval, "rows": table}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
