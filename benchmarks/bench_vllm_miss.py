#!/usr/bin/env python3
"""Miss path on vLLM-CPU with interleaved engines: plain vLLM and ucm (empty store) alternate,
so each ucm engine is compared with the plain engines run just before and after it.

    python benchmarks/bench_vllm_miss.py [--pairs 3] [--json out.json]

Engines: plain, ucm, plain, ucm, ..., plain (``--pairs`` ucm engines). Each serves the same
four distinct 4,000-token prompts one at a time (TTFT, the first one is a warm-up and not
counted) and then two more distinct prompts generating 64 tokens each (decode tokens/s, the
prompt's prefill and its background save included), and their decode rate proper: generated
tokens after the first per second from the first to the last token (vLLM's own engine-core
timestamps: the decode steps alone). Per ucm engine: its median TTFT and median rates against
the mean of its two neighbouring plain engines; reported: each ratio, their median, and the
spread between neighbouring plain engines (the machine's noise). bf16, block
size 128, vLLM's default reserved CPU (one OpenMP thread on a 2-core machine) unless
``--reserved-cpus`` says otherwise.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from ucm.demo.vllm_demo import _engine, doc_tokens, scratch_dir  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pairs", type=int, default=3)
    p.add_argument("--tokens", type=int, default=4000)
    p.add_argument("--reserved-cpus", type=int, default=1,
                   help="VLLM_CPU_NUM_OF_RESERVED_CPU (1: vLLM's default; 0: what `ucm demo` uses)")
    p.add_argument("--json")
    args = p.parse_args()

    from ucm.models import ensure_smollm2

    model = ensure_smollm2()
    ids = doc_tokens(model)
    n = args.tokens
    prompts = [ids[(k + 1) * 9000:(k + 1) * 9000 + n] for k in range(6)]
    work = scratch_dir("ucm-bench-miss-")
    phases = [{"name": "ttft", "prompts": [0, 1, 2, 3], "ttft": True},
              {"name": "decode0", "prompts": [4], "max_tokens": 64},
              {"name": "decode1", "prompts": [5], "max_tokens": 64}]
    common = {"model": model, "dtype": "bfloat16", "prompts": prompts, "block_size": 128, "log_stats": True,
              "env": {"VLLM_CPU_NUM_OF_RESERVED_CPU": str(args.reserved_cpus)}, "phases": phases}
    t0 = time.time()
    runs = []
    for i in range(2 * args.pairs + 1):
        spec = dict(common)
        kind = "plain" if i % 2 == 0 else "ucm"
        if kind == "ucm":
            root = os.path.join(work, f"kv{i}")
            os.makedirs(root)
            stats = os.path.join(work, f"stats{i}.jsonl")
            spec.update(connector="ucm", stats_file=stats, extra_config={
                "store": {"pipeline": "memory|posix", "posix": {"roots": [root]}},
                "buffer_number": 256, "cache_capacity": "8GiB", "connector": {"stats_file": stats}})
        r = _engine(spec, work, f"{i}-{kind}")
        ph = {x["name"]: x for x in r["phases"]}
        ttft = statistics.median(o["ttft"] for o in ph["ttft"]["outputs"][1:])
        tps = statistics.median(len(ph[f"decode{k}"]["outputs"][0]["tokens"]) / ph[f"decode{k}"]["seconds"]
                                for k in range(2))
        outs = [ph[f"decode{k}"]["outputs"][0] for k in range(2)]
        tpot_tps = statistics.median((len(o["tokens"]) - 1) / o["decode_s"] for o in outs)
        runs.append({"kind": kind, "ttft_s": ttft, "decode_tps": tps, "decode_only_tps": tpot_tps,
                     "ttfts": [o["ttft"] for o in ph["ttft"]["outputs"]],
                     "first_tokens": [o["tokens"][:1] for o in ph["ttft"]["outputs"]],
                     "connector_stats": ph["decode1"].get("connector_stats")})
        print(f"{i} {kind}: TTFT {ttft:.3f} s, generation {tps:.2f} tok/s (decode steps {tpot_tps:.2f})",
              flush=True)
    pairs = []
    for i in range(1, len(runs), 2):
        a, u, b = runs[i - 1], runs[i], runs[i + 1]
        base_ttft = (a["ttft_s"] + b["ttft_s"]) / 2
        base_tps = (a["decode_tps"] + b["decode_tps"]) / 2
        pairs.append({"ttft_overhead": u["ttft_s"] / base_ttft - 1,
                      "decode_overhead": 1 - u["decode_tps"] / base_tps,
                      "decode_only_overhead": 1 - u["decode_only_tps"] /
                      ((a["decode_only_tps"] + b["decode_only_tps"]) / 2),
                      "plain_spread_decode_only": abs(b["decode_only_tps"] / a["decode_only_tps"] - 1),
                      "plain_spread_ttft": abs(b["ttft_s"] / a["ttft_s"] - 1),
                      "plain_spread_decode": abs(b["decode_tps"] / a["decode_tps"] - 1)})
    out = {"date": time.strftime("%Y-%m-%d %H:%M"), "machine": f"{os.uname().nodename} {os.cpu_count()} cores",
           "tokens": n, "reserved_cpus": args.reserved_cpus, "runs": runs, "pairs": pairs,
           "median_ttft_overhead": statistics.median(x["ttft_overhead"] for x in pairs),
           "median_decode_overhead": statistics.median(x["decode_overhead"] for x in pairs),
           "median_decode_only_overhead": statistics.median(x["decode_only_overhead"] for x in pairs),
           "first_tokens_agree": len({json.dumps(r["first_tokens"]) for r in runs}) == 1,
           "wall_s": time.time() - t0}
    print(json.dumps({k: v for k, v in out.items() if k != "runs"}, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
