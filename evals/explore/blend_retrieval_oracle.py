"""Exploration: is Blend's retrieval gap a matter of *which* tokens it recomputes?

Held-out retrieval prompts (evals/blend_quality.py's retrieval_sample, seed 1), reference
forward. Per prompt the answer margin (target logit minus the best other, min over the answer
tokens) of: full prefill; Blend at 0.15 as shipped (question lookahead over the blended cache);
the same budget chosen by oracles that know the full prefill:
  oracle-mass: the question's attention mass over the full prefill's cache;
  oracle-dev:  how far each stored token's KV is from the full prefill's (all layers);
  oracle-both: mass over the full cache times that deviation.
"""
import json
import math
import os
import random
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import ucm.blend.engine as engine  # noqa: E402
from evals.blend_quality import retrieval_sample  # noqa: E402
from evals.sparse_quality import corpus_ids  # noqa: E402
from ucm.blend.reference import (LlamaBlendModel, PagedRequestKV, blended_logits,  # noqa: E402
                                 chunk_kv)
from ucm.models import ensure_smollm2  # noqa: E402
from ucm.reference.llama import Llama  # noqa: E402


def margin(logits, suffix, n_answer):
    first = len(suffix) - n_answer - 1
    lg = logits[first:first + n_answer].float()
    tgt = torch.tensor(suffix[first + 1:first + 1 + n_answer])
    t = lg.gather(1, tgt[:, None])[:, 0]
    other = lg.scatter(1, tgt[:, None], float("-inf")).max(1).values
    return float((t - other).min())


def main():
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 20
    ratio = float(sys.argv[2]) if len(sys.argv) > 2 else 0.15
    variants = sys.argv[3].split(",") if len(sys.argv) > 3 else \
        ["shipped", "oracle-mass", "oracle-dev", "oracle-both"]
    from tokenizers import Tokenizer
    path = ensure_smollm2()
    tok = Tokenizer.from_file(os.path.join(path, "tokenizer.json"))
    model = Llama.load(path)
    ids = corpus_ids(path)
    bos = json.load(open(os.path.join(path, "config.json")))["bos_token_id"]
    sink = [bos]
    rng = random.Random(1)
    bm = LlamaBlendModel(model)
    real_mass = engine.lookahead_mass
    mark = tuple(tok.encode(" The code word for", add_special_tokens=False).ids)
    rows = []
    t0 = time.time()
    for i in range(n):
        prefix, chunks, suffix, n_answer = retrieval_sample(ids, rng, tok)
        all_ids = list(prefix) + [t for c in chunks for t in c] + list(suffix)
        P, E = len(prefix), len(all_ids) - len(suffix)
        # full prefill's KV of the prompt up to the region's end, and the stored chunk KV
        nb = math.ceil(E / 16)
        full = model.new_cache(nb, 16)
        model.prefill(all_ids[:E], full, list(range(nb)))
        fkv = PagedRequestKV(full, range(nb))
        memo = {}
        qlen = len(suffix) - n_answer
        q_ids = torch.tensor(all_ids[E:E + qlen])
        q_pos = torch.arange(E, E + qlen)
        mask = torch.ones(E - P, dtype=torch.bool)
        m_full = real_mass(bm, fkv, P, E, mask, q_ids, q_pos, 1)
        # deviation of stored KV from full, per token, over layers 2.. (relative L2)
        from ucm.blend import ops
        dev = torch.zeros(E - P)
        off = 0
        per_chunk = []
        for c in chunks:
            key = (tuple(sink), tuple(c))
            memo[key] = chunk_kv(model, c, sink)
            per_chunk.append((off, memo[key]))
            off += len(c)
        for layer in range(2, model.num_layers):
            fk, fv = fkv.read(layer, E)
            for o, kvl in per_chunk:
                ck, cv = kvl[layer]
                delta = torch.full((len(ck),), P + o - len(sink), dtype=torch.int64)
                rk = ops.rope_rotate(ck, delta, bm.inv_freq)
                a, b = P + o, P + o + len(ck)
                d = ((rk - fk[a:b]).norm(dim=(1, 2)) / fk[a:b].norm(dim=(1, 2)).clamp_min(1e-6)
                     + (cv - fv[a:b]).norm(dim=(1, 2)) / fv[a:b].norm(dim=(1, 2)).clamp_min(1e-6))
                dev[o:o + len(ck)] += d
        row = {"i": i}
        full_logits = None
        for v in variants:
            if v.startswith("stored:"):
                # which chunks keep stored KV: "needle" (only the needle's chunk), "others"
                which = v.split(":")[1]
                nc = next(j for j, c in enumerate(chunks)
                          if any(tuple(c[a:a + len(mark)]) == mark
                                 for a in range(len(c))))
                st = [(j == nc) == (which == "needle") for j in range(len(chunks))]
                engine.lookahead_mass = real_mass
                r = float(v.split(":")[2]) if v.count(":") == 2 else ratio
                res = blended_logits(model, prefix, chunks, suffix, r, chunk_cache=memo,
                                     lookahead=qlen, sink=sink, stored=st)
                row[v] = margin(res.logits, suffix, n_answer)
                full_logits = res.full_logits
                continue
            if v == "shipped":
                engine.lookahead_mass = real_mass
            else:
                fixed = {"oracle-mass": m_full, "oracle-dev": dev,
                         "oracle-both": m_full * dev}[v]
                engine.lookahead_mass = lambda *a, fixed=fixed, **k: fixed.clone()
            res = blended_logits(model, prefix, chunks, suffix, ratio, chunk_cache=memo,
                                 lookahead=qlen, sink=sink)
            row[v] = margin(res.logits, suffix, n_answer)
            full_logits = res.full_logits
        engine.lookahead_mass = real_mass
        row["full"] = margin(full_logits, suffix, n_answer)
        rows.append(row)
        print(json.dumps({k: (round(x, 2) if isinstance(x, float) else x) for k, x in row.items()}),
              f"{time.time() - t0:.0f}s", flush=True)
    print("correct (margin > 0):", {v: sum(r[v] > 0 for r in rows) for v in ["full"] + variants})
    print("mean margin:", {v: round(sum(r[v] for r in rows) / len(rows), 3)
                           for v in ["full"] + variants})
    print("full-solved lost:", {v: sum(r["full"] > 0 and r[v] <= 0 for r in rows) for v in variants})
    if len(sys.argv) > 4:
        json.dump(rows, open(sys.argv[4], "w"), indent=1)


if __name__ == "__main__":
    main()
