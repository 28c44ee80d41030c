"""Blend on vLLM-CPU (SmolLM2-135M, float32): agreement with full prefill, retrieval accuracy and
TTFT, for a sweep of recompute ratios, in one engine.

The workload is ``evals/blend_quality.py``'s (documentation chunks in shuffled orders after an
instruction, then a question with 32 answer tokens; and the code-word retrieval variant). Per
sample, in this order:

1. warm-up, one output token: the chunks are stored (``blend.store_chunks``), from this
   prompt's own prefill (``blend.chunk_source: context``, the default) or each computed again
   alone (``--chunk-source alone``). The warm-up prompt holds the same instruction and chunks in
   another order (``--warm rotated``), or one warm-up prompt per chunk: the instruction, two
   other passages of the text and the chunk (``--warm apart``: each chunk first seen beside
   documents the measured prompt lacks);
2. Blend at each ratio (``kv_transfer_params: {"ucm_blend": {"chunks": ..., "recompute_ratio":
   r}}``): the top-1 token of every answer position (``prompt_logprobs``, read after the cache
   hit), then the time to first token of the prompt without the answer, alone;
3. full prefill (``{"ucm_blend": false}``, vLLM told to skip cache hits): the same top-1 tokens
   and TTFT.

A blended request stores nothing under its prefix, so step 3 is never served from step 2's
blocks, and step 2 never from step 3's. Agreement: the fraction of answer positions whose top-1
token equals full prefill's. Its answer tokens are part of the prompt (teacher forcing), so
Blend's lookahead (the prompt after the chunks, :func:`ucm.blend.engine.lookahead_mass`) reads
them too. Retrieval is generated instead (the prompt ends with the question, the answer is
greedy decoding), so the lookahead sees only what a user's prompt holds: a sample is correct
when the generated tokens are the code word.

    .venv/bin/python evals/blend_vllm.py --samples 8 --retrieval 8 --json OUT.json
"""
from __future__ import annotations

import argparse
import atexit
import os
import random
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from evals import argtypes  # noqa: E402

RATIOS = (0.0, 0.05, 0.15, 0.3, 1.0)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--samples", type=argtypes.count(0), default=8,
                    help="text samples (top-1 agreement; default %(default)s)")
    ap.add_argument("--retrieval", type=argtypes.count(0), default=8,
                    help="retrieval samples (default %(default)s)")
    ap.add_argument("--ratios", type=argtypes.listed(argtypes.ratio(zero=True)),
                    default=",".join(map(str, RATIOS)),
                    help="recompute ratios in [0, 1], comma-separated (default %(default)s)")
    ap.add_argument("--sink", choices=("bos", "none"), default="bos",
                    help="ucm's blend.sink: what each chunk is computed after")
    ap.add_argument("--chunk-source", choices=("context", "alone"), default="context",
                    help="ucm's blend.chunk_source: chunks stored from the warm-up prompt's "
                         "prefill, or computed again alone (default %(default)s)")
    ap.add_argument("--warm", choices=("rotated", "apart"), default="rotated",
                    help="the warm-up: the chunks in another order, or each chunk after two "
                         "other passages (default %(default)s)")
    ap.add_argument("--context", default=None, metavar="START:LEN",
                    help="ucm's blend.context: LEN corpus tokens from START (a passage of the "
                         "documents' kind that no prompt holds)")
    ap.add_argument("--corpus", type=argtypes.names, default=None, metavar="FILE[,FILE...]",
                    help="text files the chunks, questions and context are drawn from, in this "
                         "order (default: the Python documentation's topics): another domain's "
                         "text for a held-out check")
    ap.add_argument("--seed", type=int, default=0, help="the samples' random seed (default %(default)s)")
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args(argv)
    if args.samples + args.retrieval == 0:
        ap.error("--samples and --retrieval are both 0: nothing to measure")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    from tokenizers import Tokenizer
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from evals.blend_quality import _chunks, context_tokens, retrieval_sample, text_sample
    from evals.sparse_quality import corpus_ids
    from ucm.demo.engine import llm_kwargs
    from ucm.models import ensure_smollm2

    path = ensure_smollm2()
    tok = Tokenizer.from_file(os.path.join(path, "tokenizer.json"))
    ids = corpus_ids(path, args.corpus)
    ratios = list(dict.fromkeys(args.ratios))
    root = tempfile.mkdtemp(prefix="ucm-blend-eval-")
    atexit.register(shutil.rmtree, root, True)   # (a 100-prompt run stores tens of GB)
    spec = dict(model=path, dtype="float32", connector="ucm", block_size=32, max_model_len=8192,
                extra_config={"store": {"pipeline": "memory|posix", "posix": {"roots": [root]}},
                              "blend": {"sink": args.sink, "chunk_source": args.chunk_source,
                                        "context": context_tokens(ids, args.context)}})
    llm = LLM(**llm_kwargs(spec))

    def params(spans, ratio):
        if spans is None:
            return {"ucm_blend": False}
        return {"ucm_blend": {"chunks": spans, "recompute_ratio": ratio}}

    def top1(prompt, spans, ratio, first):
        sp = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1,
                            skip_reading_prefix_cache=spans is None, detokenize=False,
                            extra_args={"kv_transfer_params": params(spans, ratio)})
        o = llm.generate([TokensPrompt(prompt_token_ids=prompt)], sp, use_tqdm=False)[0]
        out = []
        for p in range(first + 1, len(prompt)):          # entry p: the top-1 guess of token p
            lp = o.prompt_logprobs[p]
            if lp is None:
                raise RuntimeError(f"no prompt logprobs at position {p} (served from cache)")
            out.append(min(lp.items(), key=lambda kv: kv[1].rank)[0])
        return out

    def answer(prompt, spans, ratio, n):
        """Greedy generation of n tokens (retrieval: the answer is not in the prompt, so the
        Blend lookahead, which reads the prompt after the chunks, never sees it)."""
        sp = SamplingParams(max_tokens=n, temperature=0.0, skip_reading_prefix_cache=spans is None,
                            detokenize=False, extra_args={"kv_transfer_params": params(spans, ratio)})
        o = llm.generate([TokensPrompt(prompt_token_ids=prompt)], sp, use_tqdm=False)[0]
        return list(o.outputs[0].token_ids)

    def ttft(prompt, spans, ratio):
        sp = SamplingParams(max_tokens=1, temperature=0.0, skip_reading_prefix_cache=spans is None,
                            extra_args={"kv_transfer_params": params(spans, ratio)})
        t = time.perf_counter()
        llm.generate([TokensPrompt(prompt_token_ids=prompt)], sp, use_tqdm=False)
        return time.perf_counter() - t

    rng = random.Random(args.seed)
    kinds = [("text", text_sample)] * args.samples + [("retrieval", retrieval_sample)] * args.retrieval
    rows = {r: {"agree": [], "ret_ok": 0, "ttft": []} for r in ratios}
    full = {"ret_ok": 0, "ttft": [], "n_ret": 0}
    t0 = time.time()
    ttft(list(range(100, 400)), None, None)            # (first request: warm the engine)
    for i, (kind, make) in enumerate(kinds):
        prefix, chunks, suffix, n_answer = make(ids, rng, tok)
        order = list(range(len(chunks)))
        if args.warm == "rotated":
            warm_ups = [(chunks, order[1:] + order[:1])]
        else:   # (own random streams: the measured prompts are the same for every --warm)
            wrng = random.Random(f"warm-{args.seed}-{i}")
            warm_ups = [(_chunks(ids, wrng)[:2] + [c], [0, 1, 2]) for c in chunks]
        for pool, warm in warm_ups:
            toks = list(prefix)
            for j in warm:
                toks += pool[j]
            llm.generate([TokensPrompt(prompt_token_ids=toks + suffix[:4])],
                         SamplingParams(max_tokens=1, temperature=0.0, extra_args={
                             "kv_transfer_params": {"ucm_blend": {
                                 "chunks": _spans(prefix, pool, warm)}}}), use_tqdm=False)
        spans = _spans(prefix, chunks, order)
        prompt = list(prefix) + [t for c in chunks for t in c] + list(suffix)
        question = prompt[:len(prompt) - n_answer]
        first = len(prompt) - n_answer - 1               # predicts answer[0]
        target = prompt[first + 1:]
        read = top1 if kind == "text" else (lambda p, s, r, _: answer(question, s, r, n_answer))
        for r in ratios:
            b = read(prompt, spans, r, first)
            rows[r]["ttft"].append(ttft(question, spans, r))
            rows[r].setdefault("tops", []).append(b)
        f = read(prompt, None, None, first)
        full["ttft"].append(ttft(question, None, None))
        for r in ratios:
            b = rows[r]["tops"][-1]
            agree = sum(x == y for x, y in zip(b[:n_answer], f[:n_answer])) / n_answer
            if kind == "text":
                rows[r]["agree"].append(agree)
            else:
                rows[r]["ret_ok"] += b[:n_answer] == target
                rows[r].setdefault("ret", []).append(b[:n_answer] == target)
        if kind == "retrieval":
            full["n_ret"] += 1
            full["ret_ok"] += f[:n_answer] == target
            full.setdefault("ret", []).append(f[:n_answer] == target)
        print(f"sample {i + 1}/{len(kinds)} ({kind}, {len(prompt)} tokens) {time.time() - t0:.0f} s",
              flush=True)
    n_ret = full["n_ret"]       # (retrieval rates None without retrieval samples)
    out = []
    full_ttft = statistics.median(full["ttft"])
    for r in ratios:
        row = rows[r]
        ag = row["agree"]
        out.append({"ratio": r, "top1_agreement": statistics.mean(ag) if ag else None,
                    # standard error over the prompts (positions of one prompt are correlated)
                    "top1_agreement_se": statistics.stdev(ag) / len(ag) ** 0.5 if len(ag) > 1
                    else None,
                    "top1_agreement_per_prompt": ag,
                    "retrieval_correct": row["ret_ok"], "retrieval_full_correct": full["ret_ok"],
                    "retrieval_per_prompt": row.get("ret", []),
                    "retrieval_full_per_prompt": full.get("ret", []),
                    "retrieval": row["ret_ok"] / n_ret if n_ret else None,
                    "retrieval_full": full["ret_ok"] / n_ret if n_ret else None,
                    "ttft_ratio": statistics.median(row["ttft"]) / full_ttft,
                    "ttft_ratio_per_sample": statistics.median(
                        [a / b for a, b in zip(row["ttft"], full["ttft"])])})
    print(f"full prefill: median TTFT {1e3 * full_ttft:.0f} ms")
    print("| ratio | top-1 agreement (± s.e.) | retrieval: Blend | retrieval: full | "
          "TTFT / full prefill |")
    print("|---|---|---|---|---|")
    for o in out:
        ag = "-" if o["top1_agreement"] is None else f"{o['top1_agreement']:.3f}"
        if o["top1_agreement_se"] is not None:
            ag += f" ± {o['top1_agreement_se']:.3f}"
        ret = ("-", "-") if o["retrieval"] is None else \
            (f"{o['retrieval']:.3f}", f"{o['retrieval_full']:.3f}")
        print(f"| {o['ratio']} | {ag} | {ret[0]} | {ret[1]} | {o['ttft_ratio_per_sample']:.3f} |")
    if args.json:
        argtypes.write_json(args.json, {
            "model": "SmolLM2-135M", "dtype": "float32", "engine": "vLLM-CPU",
            "samples": args.samples, "retrieval_samples": args.retrieval, "seed": args.seed,
            "ratios": ratios, "sink": args.sink, "context": args.context,
            "chunk_source": args.chunk_source, "warm": args.warm,
            "corpus": args.corpus or "pydoc_data.topics",
            "full_ttft_ms": 1e3 * full_ttft, "rows": out}, indent=1)
    return 0


def _spans(prefix, chunks, order) -> list:
    out, at = [], len(prefix)
    for j in order:
        out.append([at, at + len(chunks[j])])
        at += len(chunks[j])
    return out


if __name__ == "__main__":
    raise SystemExit(main())
