"""Blend accuracy against full prefill on SmolLM2-135M (float32): top-1 agreement over
teacher-forced answer tokens, and synthetic retrieval accuracy, for a sweep of recompute ratios.

Workload (real text: CPython's documentation topics, the text of the sparse harness, at offsets
the demo does not use): each sample is a short instruction, 4-6 chunks of 300-800 tokens from
random places of the text in shuffled order, then a question (a passage of the text) and 32
answer tokens (the text that follows it), teacher-forced. The retrieval variant hides "The code
word for <name> is <word>." in one chunk of filler text and asks for it; a sample is correct
when every answer token is the argmax of its position.

Each chunk's KV is computed alone, after the model's BOS token as ``blend.chunk_source: alone``
with ``blend.sink: bos`` does (``--sink none``: as if the chunk began the sequence; the default
``blend.chunk_source: context`` is measured inside vLLM by ``evals/blend_vllm.py``), rotated to
its place and blended
(:func:`ucm.blend.reference.blended_logits`, the computation the vLLM integration runs);
ratio 1.0 recomputes everything and must reproduce the full prefill. The lookahead that
steers part of the recompute reads the question only (``--lookahead``): the answer tokens are
teacher-forced here but would be generated in use.

    .venv/bin/python evals/blend_quality.py --samples 8 --json OUT.json
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from evals import argtypes  # noqa: E402
from evals.sparse_quality import corpus_ids  # noqa: E402
from ucm.blend.reference import blended_logits  # noqa: E402
from ucm.models import ensure_smollm2  # noqa: E402
from ucm.reference.llama import Llama  # noqa: E402

RATIOS = (0.0, 0.05, 0.15, 0.3, 1.0)
NAMES = ["Ada", "Borges", "Curie", "Dirac", "Euler", "Fermi", "Gauss", "Hopper", "Noether",
         "Turing", "Lovelace", "Kepler"]
WORDS = ["apple", "river", "falcon", "marble", "lantern", "orchid", "thunder", "copper",
         "velvet", "glacier", "harbor", "meadow"]


def _chunks(ids: list, rng: random.Random) -> list:
    """4-6 chunks of 300-800 tokens from random places of the text."""
    out = []
    for _ in range(rng.randint(4, 6)):
        size = rng.randint(300, 800)
        start = rng.randrange(5000, len(ids) - size - 5000)
        out.append(ids[start:start + size])
    return out


def text_sample(ids: list, rng: random.Random, tok) -> tuple:
    """(prefix, chunks, question + answer, answer length) from the documentation text."""
    chunks = _chunks(ids, rng)
    rng.shuffle(chunks)
    prefix = tok.encode("Read the following documentation excerpts and continue the text.\n\n",
                        add_special_tokens=False).ids
    q0 = rng.randrange(5000, len(ids) - 200)
    question = ids[q0:q0 + 24]
    answer = ids[q0 + 24:q0 + 24 + 32]
    return prefix, chunks, question + answer, len(answer)


def retrieval_sample(ids: list, rng: random.Random, tok) -> tuple:
    name, word = rng.choice(NAMES), rng.choice(WORDS)
    needle = tok.encode(f" The code word for {name} is {word}. ", add_special_tokens=False).ids
    chunks = _chunks(ids, rng)
    which = rng.randrange(len(chunks))
    at = rng.randrange(0, len(chunks[which]) - 1)
    chunks[which] = chunks[which][:at] + needle + chunks[which][at:]
    prefix = tok.encode("Remember the code words in the documents below.\n\n",
                        add_special_tokens=False).ids
    question = tok.encode(f"\n\nQuestion: what is the code word for {name}? Answer: The code "
                          f"word for {name} is", add_special_tokens=False).ids
    answer = tok.encode(f" {word}", add_special_tokens=False).ids
    return prefix, chunks, question + answer, len(answer)


def context_tokens(ids: list, spec) -> list:
    """``blend.context`` for the evals: ``LEN`` corpus tokens from ``START`` (``"START:LEN"``),
    or none. Prompts draw their text from token 5000 on, so a context below it is in no
    prompt."""
    if not spec:
        return []
    try:
        a, n = (int(x) for x in spec.split(":"))
    except ValueError:
        a, n = -1, 0
    if a < 0 or n < 1 or a + n > 5000:
        raise SystemExit(f"--context {spec}: expected START:LEN within the first 5000 tokens")
    return list(ids[a:a + n])


def score(res, suffix: list, n_answer: int) -> tuple:
    """(agreement with full prefill, mean KL(full || Blend), blend correct, full correct) over
    the answer positions."""
    first = len(suffix) - n_answer - 1            # the position that predicts answer[0]
    bl = res.logits[first:first + n_answer].float().log_softmax(-1)
    fl = res.full_logits[first:first + n_answer].float().log_softmax(-1)
    b, f = bl.argmax(-1), fl.argmax(-1)
    kl = float((fl.exp() * (fl - bl)).sum(-1).mean())
    target = torch.tensor(suffix[first + 1:first + 1 + n_answer])
    return (float((b == f).float().mean()), kl, bool((b == target).all()),
            bool((f == target).all()))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--samples", type=argtypes.count(0), default=8,
                    help="text samples (default %(default)s)")
    ap.add_argument("--retrieval", type=argtypes.count(0), default=8,
                    help="retrieval samples (default %(default)s)")
    ap.add_argument("--ratios", type=argtypes.listed(argtypes.ratio(zero=True)),
                    default=",".join(map(str, RATIOS)),
                    help="recompute ratios in [0, 1], comma-separated (default %(default)s)")
    ap.add_argument("--check-layer", type=argtypes.count(0), default=1,
                    help="ucm's blend.check_layer: the layer whose KV deviation picks the tokens "
                         "to recompute (default %(default)s)")
    ap.add_argument("--lookahead", choices=("question", "all", "none"), default="question",
                    help="what Blend's lookahead reads after the chunks: the prompt (question), "
                         "the prompt and the teacher-forced answer (as the vLLM agreement run), "
                         "nothing (deviation-only selection)")
    ap.add_argument("--sink", choices=("bos", "none"), default="bos",
                    help="what each chunk is computed after (ucm's blend.sink)")
    ap.add_argument("--context", default=None, metavar="START:LEN",
                    help="ucm's blend.context: each chunk is also computed after LEN corpus "
                         "tokens from START (a passage of the documents' kind that no prompt "
                         "holds; prompts take the text from token 5000 on)")
    ap.add_argument("--corpus", type=argtypes.names, default=None, metavar="FILE[,FILE...]",
                    help="text files the chunks and questions are drawn from (default: the "
                         "Python documentation's topics)")
    ap.add_argument("--seed", type=int, default=0, help="the samples' random seed (default %(default)s)")
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args(argv)
    if args.samples + args.retrieval == 0:
        ap.error("--samples and --retrieval are both 0: nothing to measure")
    from tokenizers import Tokenizer

    path = ensure_smollm2()
    tok = Tokenizer.from_file(os.path.join(path, "tokenizer.json"))
    model = Llama.load(path)
    if args.check_layer >= model.num_layers:
        ap.error(f"--check-layer: {args.check_layer} is outside the model's {model.num_layers} "
                 f"layers (0 to {model.num_layers - 1})")
    ids = corpus_ids(path, args.corpus)
    with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
        bos = json.load(f).get("bos_token_id")
    head = [bos] if args.sink == "bos" and isinstance(bos, int) else []
    sink = head + context_tokens(ids, args.context)
    ratios = list(dict.fromkeys(args.ratios))
    rng = random.Random(args.seed)
    rows = {r: {"agree": [], "text_agree": [], "text_kl": [], "blend_correct": 0, "full_correct": 0,
                "retrieval": 0, "recomputed": 0, "tokens": 0} for r in ratios}
    t0 = time.time()
    kinds = [("text", text_sample)] * args.samples + [("retrieval", retrieval_sample)] * args.retrieval
    for i, (kind, make) in enumerate(kinds):
        prefix, chunks, suffix, n_answer = make(ids, rng, tok)
        memo: dict = {}
        for r in ratios:
            seen = {"question": len(suffix) - n_answer, "all": len(suffix), "none": 0}
            res = blended_logits(model, prefix, chunks, suffix, r, check_layer=args.check_layer,
                                 chunk_cache=memo, lookahead=seen[args.lookahead], sink=sink)
            agree, kl, ok_b, ok_f = score(res, suffix, n_answer)
            row = rows[r]
            row["tokens"] += res.stats.tokens
            row["recomputed"] += res.stats.recomputed
            if kind == "text":
                row["text_agree"].append(agree)
                row["text_kl"].append(kl)
            else:
                row["retrieval"] += 1
                row["blend_correct"] += ok_b
                row["full_correct"] += ok_f
        print(f"sample {i + 1}/{len(kinds)} ({kind}, {sum(map(len, chunks))} chunk tokens) "
              f"{time.time() - t0:.0f} s", flush=True)
    out = []
    for r in ratios:         # (None: no sample of that kind)
        row = rows[r]
        n_ret, n_text = row["retrieval"], len(row["text_agree"])
        out.append({"ratio": r,
                    "top1_agreement": sum(row["text_agree"]) / n_text if n_text else None,
                    "mean_kl": sum(row["text_kl"]) / n_text if n_text else None,
                    "retrieval_blend": row["blend_correct"] / n_ret if n_ret else None,
                    "retrieval_full": row["full_correct"] / n_ret if n_ret else None,
                    "recomputed_fraction": row["recomputed"] / max(1, row["tokens"])})

    def cell(x, fmt):
        return "-" if x is None else format(x, fmt)
    print("| ratio | top-1 agreement (32 answer tokens) | KL(full \u2016 Blend) | retrieval: Blend "
          "| retrieval: full | tokens recomputed |")
    print("|---|---|---|---|---|---|")
    for o in out:
        print(f"| {o['ratio']} | {cell(o['top1_agreement'], '.3f')} | {cell(o['mean_kl'], '.4f')} | "
              f"{cell(o['retrieval_blend'], '.3f')} | "
              f"{cell(o['retrieval_full'], '.3f')} | {o['recomputed_fraction']:.3f} |")
    if args.json:
        argtypes.write_json(args.json, {
            "model": "SmolLM2-135M", "dtype": "float32", "samples": args.samples,
            "retrieval_samples": args.retrieval, "seed": args.seed, "ratios": ratios,
            "check_layer": args.check_layer, "lookahead": args.lookahead, "sink": head,
            "context": args.context, "corpus": args.corpus or "pydoc_data.topics",
            "rows": out}, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
