"""Exploration: Blend with mid-layer re-entry.

Where Blend loses retrieval (RESULTS, Blend section) is the stale KV of the other chunks in the
middle-upper layers (16-23 of SmolLM2's 30). Re-entry: with each chunk's KV, also keep the hidden
state its tokens enter layer ``L0`` with (computed alone, like the KV). At load, the recomputed
tokens go through every layer as today; a further set ``S`` of stored tokens re-enters at
``L0`` from the kept hidden state and goes through layers ``L0..`` together with them, over
the blended cache: their KV above ``L0`` is computed with the other chunks in view, at
``(layers - L0) / layers`` of a token's cost.

Per prompt: full prefill, the shipped Blend at ``--ratio``, and re-entry at each ``--l0`` with
``S`` = the next ``--reenter`` fraction of the region by the lookahead's mass, or every stored
token not recomputed (``all``). Reports retrieval accuracy and answer margin, and text top-1
agreement and KL.

    .venv/bin/python evals/explore/blend_reentry.py --retrieval 12 --samples 6 --seed 1
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

from evals.blend_quality import retrieval_sample, text_sample  # noqa: E402
from evals.sparse_quality import corpus_ids  # noqa: E402
from ucm.blend import ops as bops  # noqa: E402
from ucm.blend.engine import (LOOKAHEAD_TOKENS, AfterSink, _forward, _write_stored,  # noqa: E402
                              blend_fill, lookahead_mass)
from ucm.blend.reference import LlamaBlendModel, PagedRequestKV  # noqa: E402
from ucm.models import ensure_smollm2  # noqa: E402
from ucm.reference.llama import Llama  # noqa: E402


def chunk_state(model, bm, ids, sink, l0s):
    """The chunk computed alone after ``sink``: per layer (k, v) and, per L0, the hidden state
    its tokens enter layer L0 with."""
    n, bs = len(ids), 16
    dev = model.device
    cache = model.new_cache(math.ceil(n / bs), bs)
    kv = PagedRequestKV(cache, range(math.ceil(n / bs)))
    s = len(sink)
    full = torch.tensor(list(sink) + list(ids), dtype=torch.long, device=dev)
    wrapped = AfterSink(kv, s) if s else kv
    pos = torch.arange(len(full), device=dev)
    sel = torch.arange(len(full), device=dev)
    hs, h, first = {}, None, 0
    for l0 in sorted(l0s):
        h = _forward(bm, wrapped, full, pos, sel, h, first, len(full), last=l0)
        hs[l0] = h[s:].clone()
        first = l0
    _forward(bm, wrapped, full, pos, sel, h, first, len(full))
    return [kv.read(layer, n) for layer in range(model.num_layers)], hs


@torch.inference_mode()
def run(model, prefix, chunks, suffix, n_seen, ratio, sink, memo, l0=None, reenter=None):
    """Logits of the suffix positions: Blend at ``ratio`` (re-entry at ``l0`` of ``reenter``:
    a fraction, or "all")."""
    bm = LlamaBlendModel(model)
    dev = model.device
    ids = list(prefix) + [t for c in chunks for t in c] + list(suffix)
    n, P = len(ids), len(prefix)
    E = n - len(suffix)
    bs = 16
    cache = model.new_cache(math.ceil(n / bs), bs)
    kv = PagedRequestKV(cache, range(math.ceil(n / bs)))
    if P:
        model.prefill(list(prefix), cache, list(range(math.ceil(P / bs))), logits_from=P - 1)
    region = E - P
    pieces, off = [], 0
    h0 = {}
    for c in chunks:
        key = tuple(c)
        if key not in memo:
            memo[key] = chunk_state(model, bm, c, sink, memo["l0s"])
        pieces.append((off, memo[key]))
        off += len(c)

    def loaded(layer):
        ks, vs = [], []
        for o, (per_layer, _) in pieces:
            ck, cv = per_layer[layer]
            delta = torch.full((len(ck),), P + o - len(sink), dtype=torch.int64, device=dev)
            ks.append(bops.rope_rotate(ck, delta, bm.inv_freq))
            vs.append(cv)
        return torch.cat(ks), torch.cat(vs)

    rid = torch.tensor(ids[P:E], dtype=torch.long, device=dev)
    pos = torch.arange(P, E, device=dev)
    mask = torch.ones(region, dtype=torch.bool, device=dev)
    forced = ~mask
    _write_stored(kv, pos, loaded, mask, range(model.num_layers))
    lo = max(E, E + n_seen - LOOKAHEAD_TOKENS)
    look = (torch.tensor(ids[lo:E + n_seen], dtype=torch.long, device=dev),
            torch.arange(lo, E + n_seen, device=dev))
    mass = lookahead_mass(bm, kv, P, E, mask, look[0], look[1], 1)
    chosen = bops.select_recompute(mass, float(ratio), forced)
    if l0 is None:
        _forward(bm, kv, rid, pos, chosen, None, 0, E)
    else:
        if reenter == "all":
            extra = torch.ones(region, dtype=torch.bool, device=dev)
        else:
            wider = bops.select_recompute(mass, min(1.0, float(ratio) + float(reenter)), forced)
            extra = torch.zeros(region, dtype=torch.bool, device=dev)
            extra[wider] = True
        extra[chosen] = False
        hc = _forward(bm, kv, rid, pos, chosen, None, 0, E, last=l0)
        stored_h = torch.cat([hs[l0] for _, (_, hs) in pieces])          # [region, hidden]
        h_all = stored_h.clone()
        h_all[chosen] = hc
        union = torch.zeros(region, dtype=torch.bool, device=dev)
        union[chosen] = True
        union |= extra
        sel = union.nonzero().flatten()
        _forward(bm, kv, rid, pos, sel, h_all[sel], l0, E)
    h = blend_fill(bm, kv, torch.tensor(ids[E:], dtype=torch.long, device=dev), E, None,
                   torch.zeros(n - E, dtype=torch.bool, device=dev), ratio=1.0)
    return bm.logits(h)


def measure(logits, full, suffix, n_answer):
    first = len(suffix) - n_answer - 1
    bl = logits[first:first + n_answer].float().log_softmax(-1)
    fl = full[first:first + n_answer].float().log_softmax(-1)
    target = torch.tensor(suffix[first + 1:first + 1 + n_answer])
    tgt = bl.gather(1, target[:, None])[:, 0]
    other = bl.scatter(1, target[:, None], float("-inf")).max(-1).values
    margin = float((tgt - other).min())
    agree = float((bl.argmax(-1) == fl.argmax(-1)).float().mean())
    kl = float((fl.exp() * (fl - bl)).sum(-1).mean())
    return dict(ok=bool((bl.argmax(-1) == target).all()), margin=margin, agree=agree, kl=kl)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--retrieval", type=int, default=12)
    ap.add_argument("--samples", type=int, default=6)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--ratio", type=float, default=0.15)
    ap.add_argument("--l0", default="8,16")
    ap.add_argument("--reenter", default="0.15,all")
    ap.add_argument("--shipped-ratios", default="",
                    help="more ratios of the shipped Blend (equal-cost comparisons)")
    ap.add_argument("--json")
    a = ap.parse_args()
    from tokenizers import Tokenizer

    torch.set_num_threads(2)
    path = ensure_smollm2()
    tok = Tokenizer.from_file(os.path.join(path, "tokenizer.json"))
    model = Llama.load(path)
    ids = corpus_ids(path, None)
    with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
        bos = json.load(f).get("bos_token_id")
    sink = [bos]
    l0s = [int(x) for x in a.l0.split(",")]
    reenters = [x if x == "all" else float(x) for x in a.reenter.split(",")]
    variants = [("shipped", None, None)] + [(f"L0={l0} S={r}", l0, r) for l0 in l0s
                                            for r in reenters]
    more = [float(x) for x in a.shipped_ratios.split(",") if x]
    variants += [(f"shipped@{r}", None, r) for r in more]
    rng = random.Random(a.seed)
    kinds = [("retrieval", retrieval_sample)] * a.retrieval + [("text", text_sample)] * a.samples
    rows = {name: {"retrieval": [], "text": []} for name, _, _ in variants + [("full", 0, 0)]}
    t0 = time.time()
    for i, (kind, make) in enumerate(kinds):
        prefix, chunks, suffix, n_answer = make(ids, rng, tok)
        seen = len(suffix) - n_answer
        allids = list(prefix) + [t for c in chunks for t in c] + list(suffix)
        E = len(allids) - len(suffix)
        full = model.forward(allids, logits_from=E)
        rows["full"][kind].append(measure(full, full, suffix, n_answer))
        memo = {"l0s": l0s}
        for name, l0, r in variants:
            if name.startswith("shipped@"):
                lg = run(model, prefix, chunks, suffix, seen, r, sink, memo)
            else:
                lg = run(model, prefix, chunks, suffix, seen, a.ratio, sink, memo, l0, r)
            rows[name][kind].append(measure(lg, full, suffix, n_answer))
        print(f"{i + 1}/{len(kinds)} {kind} {time.time() - t0:.0f} s: " + ", ".join(
            f"{n} {rows[n][kind][-1]['margin']:+.2f}" for n in rows), flush=True)
    summary = {}
    for name, r in rows.items():
        ret, txt = r["retrieval"], r["text"]
        summary[name] = dict(
            retrieval_ok=sum(x["ok"] for x in ret), retrieval_n=len(ret),
            retrieval_margin=sum(x["margin"] for x in ret) / max(1, len(ret)),
            text_agree=sum(x["agree"] for x in txt) / max(1, len(txt)),
            text_kl=sum(x["kl"] for x in txt) / max(1, len(txt)))
        print(name, json.dumps(summary[name]))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"args": vars(a), "summary": summary, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
