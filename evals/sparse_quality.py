"""Sparse attention accuracy on SmolLM2-135M: perplexity, top-1 agreement, KL and attention
mass of every sparse method against dense attention, on real text.

Contexts of 2K, 4K and 8K tokens of Python documentation (CPython's ``pydoc_data.topics``, the
text the vLLM benchmarks use), several documents each (distinct offsets in the text); each
context is prefilled densely, then ``T`` continuation tokens are teacher-forced one decode step at
a time (``ucm/reference/llama.py``), each method choosing the blocks every layer attends to
at every step, for every ``sparse_ratio``. Per method and ratio, pooled over the documents of a
context length:

* perplexity change vs dense, % (``exp(mean NLL_sparse) / exp(mean NLL_dense) - 1``),
* top-1 agreement: fraction of steps whose argmax equals dense's,
* mean KL(dense || sparse) of the next-token distributions (nats),
* attention mass kept: exact softmax mass of the attended blocks under dense attention,
  averaged over steps, layers and query heads,
* blocks kept: attended blocks / request blocks, averaged the same way (adaptive keeps fewer
  than the budget).

``oracle`` (exact block mass, top-k) and ``random`` are baselines. One dense decode row per run
checks the paged decode path against the dense prefill (``decode vs prefill`` line), and the
model is checked against ``transformers`` at start when it is installed.

Run with the project's virtualenv (it has ``tokenizers``)::

    .venv/bin/python evals/sparse_quality.py --json benchmarks/results/sparse_quality.json \\
        --markdown benchmarks/results/sparse_quality.md
    .venv/bin/python evals/sparse_quality.py --quick      # about a minute
"""
from __future__ import annotations

import argparse
import math
import os
import platform
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from evals import argtypes  # noqa: E402
from evals.sparse_model import check_methods, method_variant  # noqa: E402
from ucm.reference.llama import Llama, run_continuation  # noqa: E402

METHODS = ("esa", "gsa", "kvstar", "quest", "adaptive", "oracle", "random")
RATIOS = (0.7, 0.5, 0.3, 0.2)


def corpus_texts(files: list) -> list:
    """The text of each file (an eval's ``--corpus``: another domain's text than the default
    Python documentation); SystemExit naming a file that cannot be read."""
    texts = []
    for f in files:
        try:
            with open(f, encoding="utf-8", errors="replace") as fh:
                texts.append(fh.read())
        except OSError as exc:
            raise SystemExit(f"--corpus: cannot read {f}: {exc}")
    return texts


def corpus_ids(path: str, files=None) -> list:
    """SmolLM2 token ids of the Python documentation topics, in a fixed order; or of the text
    ``files`` joined by blank lines (at least 20,000 tokens: the Blend evals draw from token
    5,000 on)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(os.path.join(path, "tokenizer.json"))
    if files is None:
        from pydoc_data.topics import topics

        return tok.encode("\n".join(topics[k] for k in sorted(topics)),
                          add_special_tokens=False).ids
    ids = tok.encode("\n\n".join(corpus_texts(files)), add_special_tokens=False).ids
    if len(ids) < 20000:
        raise SystemExit(f"--corpus: {len(ids)} tokens; at least 20000 are needed")
    return ids


def documents(ids: list, length: int, tokens: int, count: int) -> list:
    """``count`` windows of ``length + tokens + 1`` ids at evenly spread offsets."""
    span = length + tokens + 1
    room = len(ids) - span
    if room < 0:
        raise ValueError(f"a context of {length} tokens (+ {tokens + 1} continuation tokens) does "
                         f"not fit the {len(ids)}-token corpus")
    starts = [round(i * room / max(count, 1)) for i in range(count)]
    return [ids[s:s + span] for s in starts]


def self_check(model: Llama, path: str, ids: list) -> dict:
    """Max |logit difference| against transformers' LlamaForCausalLM on 128 tokens (if present)."""
    try:
        from transformers import LlamaForCausalLM
    except ImportError:
        print("self-check vs transformers: skipped (transformers is not installed)")
        return {"transformers": None}
    hf = LlamaForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    x = ids[:128]
    with torch.inference_mode():
        ref = hf(torch.tensor([x])).logits[0]
    diff = float((ref - model.forward(x)).abs().max())
    print(f"self-check vs transformers LlamaForCausalLM, 128 tokens: max |logit diff| {diff:.2e} "
          f"(logits up to {float(ref.abs().max()):.1f})")
    if diff > 1e-3:
        raise SystemExit("self-check failed: the PyTorch model does not match transformers")
    del hf
    return {"transformers": diff}


def evaluate(model, doc: list, length: int, tokens: int, ratios, methods, base_cfg: dict) -> list:
    """One document: per (ratio, method) the NLL, agreement, KL and mass arrays of its T steps."""
    shape = dict(num_layers=model.num_layers, num_q_heads=model.num_q_heads,
                 num_kv_heads=model.num_kv_heads, head_dim=model.head_dim, block_size=16)
    rows, keys = [None], [("dense", None)]
    for ratio in ratios:
        for name in methods:
            cfg = dict(base_cfg, sparse_method="esa", sparse_ratio=ratio)
            rows.append(method_variant(name, cfg, **shape))
            keys.append((name, ratio))
    context, cont = doc[:length], doc[length:length + tokens]
    targets = torch.tensor(doc[length + 1:length + tokens + 1])
    res = run_continuation(model, context, cont, rows)
    check = float((res.logits[0] - res.dense_logits).abs().max())
    dense_lp = torch.log_softmax(res.dense_logits, -1)
    dense_nll = -dense_lp.gather(1, targets[:, None])[:, 0]
    out = []
    for r, (name, ratio) in enumerate(keys):
        if name == "dense":
            continue
        lp = torch.log_softmax(res.logits[r], -1)
        out.append({
            "method": name, "ratio": ratio, "context": length,
            "nll": (-lp.gather(1, targets[:, None])[:, 0]).tolist(),
            "dense_nll": dense_nll.tolist(),
            "agree": (res.logits[r].argmax(-1) == res.dense_logits.argmax(-1)).float().tolist(),
            "kl": (dense_lp.exp() * (dense_lp - lp)).sum(-1).tolist(),
            "mass": res.mass[r].tolist(),
            "kept": (res.blocks[r] / torch.tensor([math.ceil((length + t + 1) / 16)
                                                   for t in range(tokens)])).tolist(),
        })
    return out, check


def summarize(records: list) -> list:
    """Pool the steps of all documents per (context, ratio, method); also over all contexts."""
    groups: dict = {}
    for rec in records:
        for ctx in (rec["context"], "all"):
            g = groups.setdefault((ctx, rec["ratio"], rec["method"]), {k: [] for k in
                                  ("nll", "dense_nll", "agree", "kl", "mass", "kept")})
            for k in g:
                g[k].extend(rec[k])
    rows = []
    for (ctx, ratio, method), g in groups.items():
        mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
        ppl, dppl = math.exp(mean(g["nll"])), math.exp(mean(g["dense_nll"]))
        rows.append({"context": ctx, "ratio": ratio, "method": method, "steps": len(g["nll"]),
                     "ppl": ppl, "dense_ppl": dppl, "ppl_change_pct": 100 * (ppl / dppl - 1),
                     "top1_agreement": mean(g["agree"]), "kl": mean(g["kl"]),
                     "mass_kept": mean(g["mass"]), "blocks_kept": mean(g["kept"])})
    order = {m: i for i, m in enumerate(METHODS)}
    rows.sort(key=lambda r: (r["context"] == "all", r["context"] if r["context"] != "all" else 0,
                             -r["ratio"], order.get(r["method"].partition(":")[0], 99)))
    return rows


def markdown(rows: list) -> str:
    lines = ["| context | ratio | method | ppl change % | top-1 agree | KL(dense‖sparse) | mass kept | blocks kept |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['context']} | {r['ratio']} | {r['method']} | {r['ppl_change_pct']:+.2f} | "
                     f"{r['top1_agreement']:.3f} | {r['kl']:.4f} | {r['mass_kept']:.3f} | "
                     f"{r['blocks_kept']:.3f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--contexts", type=argtypes.listed(argtypes.count(16)), default="2048,4096,8192",
                   help="context lengths in tokens, comma-separated (default %(default)s)")
    p.add_argument("--docs", type=argtypes.listed(argtypes.count(1)), default="1",
                   help="documents per context length (one number for all, or one per context)")
    p.add_argument("--tokens", type=argtypes.count(1), default=32,
                   help="continuation tokens per document (default %(default)s)")
    p.add_argument("--ratios", type=argtypes.listed(argtypes.ratio()), default=",".join(map(str, RATIOS)),
                   help="sparse_ratio values in (0, 1], comma-separated (default %(default)s)")
    p.add_argument("--methods", type=argtypes.names, default=",".join(METHODS),
                   help="comma-separated; options after ':' joined by '+': kvhead = per-KV-head "
                   "selection (quest, oracle), gN = sparse_repr_group N, sN = retrieval_stride N "
                   "(e.g. quest:kvhead+g2, esa:g2+s1)")
    p.add_argument("--config", type=argtypes.json_object, default="{}",
                   help="JSON object of extra ucm options for every method (e.g. init_window, "
                   "local_window, sparse_dense_layers)")
    p.add_argument("--quick", action="store_true", help="one 2K document, 16 tokens (~1 minute)")
    p.add_argument("--corpus", type=argtypes.names, default=None,
                   help="comma-separated text files to draw the documents from instead of the "
                   "Python documentation (another domain's text)")
    p.add_argument("--json", help="write the records and summary here")
    p.add_argument("--markdown", help="write the summary table here")
    args = p.parse_args(argv)
    if args.quick:
        args.contexts, args.docs, args.tokens = [2048], [1], 16
    contexts, docs = args.contexts, args.docs
    docs = docs * len(contexts) if len(docs) == 1 else docs
    if len(docs) != len(contexts):
        p.error("--docs: one number, or one per context length")
    ratios, methods = args.ratios, args.methods
    base_cfg = {"min_blocks": 16, **args.config}

    from ucm.models import ensure_smollm2

    t0 = time.time()
    path = ensure_smollm2()
    model = Llama.load(path)
    ids = corpus_ids(path, args.corpus)
    try:
        check_methods(methods, ratios, base_cfg, num_layers=model.num_layers,
                      num_q_heads=model.num_q_heads, num_kv_heads=model.num_kv_heads,
                      head_dim=model.head_dim, block_size=16)
        for length in contexts:
            documents(ids, length, args.tokens, 1)
    except ValueError as exc:
        p.error(str(exc))
    check = self_check(model, path, ids)
    print(f"corpus {len(ids)} tokens; contexts {contexts}, documents {docs}, {args.tokens} "
          f"continuation tokens; ratios {ratios}; methods {methods}; options {base_cfg}", flush=True)
    records, decode_checks = [], []
    from ucm import progress

    bar = progress.bar(sum(docs), "documents", unit="doc")
    for length, count in zip(contexts, docs):
        for i, doc in enumerate(documents(ids, length, args.tokens, count)):
            recs, diff = evaluate(model, doc, length, args.tokens, ratios, methods, base_cfg)
            records.extend(recs)
            decode_checks.append(diff)
            bar.set_postfix_str(f"context {length} doc {i}: decode vs prefill |logit diff| "
                                f"{diff:.1e}")
            bar.update(1)
            if diff > 1e-2:
                raise SystemExit("decode check failed: dense paged decode differs from the prefill")
    bar.close()
    rows = summarize(records)
    table = markdown(rows)
    print(table)
    print(f"total {time.time() - t0:.0f} s")
    meta = {"machine": f"{platform.machine()}, {os.cpu_count()} CPU cores, torch "
            f"{torch.__version__}, float32", "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "command": "python evals/sparse_quality.py " + " ".join(argv or sys.argv[1:]),
            "contexts": contexts, "docs": docs, "tokens": args.tokens, "ratios": ratios,
            "methods": methods, "options": base_cfg, "self_check": check,
            "decode_vs_prefill_max_logit_diff": max(decode_checks), "seconds": time.time() - t0}
    if args.json:
        argtypes.write_json(args.json, {"meta": meta, "summary": rows, "records": records},
                            indent=1)
    if args.markdown:
        os.makedirs(os.path.dirname(os.path.abspath(args.markdown)), exist_ok=True)
        with open(args.markdown, "w") as f:
            f.write(table + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
