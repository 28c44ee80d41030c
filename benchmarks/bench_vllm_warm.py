#!/usr/bin/env python3
"""Warm TTFT on vLLM-CPU with interleaved engines: ucm vs vLLM's ExampleConnector, round after
round, so each ratio compares engines run minutes apart on the same machine state.

    python benchmarks/bench_vllm_warm.py [--rounds 3] [--repeats 5] [--json out.json]

One 4,000-token prompt (Python documentation, SmolLM2-135M, bf16, block size 128) is stored
once by a ucm engine (memory|posix store on local disk) and once by an ExampleConnector engine.
Then, per round, restarted engines serve it ``--repeats`` + 1 times each, one request at a
time, one output token (TTFT):

* ``ucm``: the first request loads from disk (the memory tier is empty after a restart), the
  others from the memory tier; default configuration (``connector.overlap_load`` on);
* ``ucm_no_overlap``: the same with ``connector.overlap_load`` off (the copy into the paged
  cache ends before the forward starts);
* ``example``: ExampleConnector (safetensors files per request and layer; the page cache holds
  them after the first request);
* ``vllm_prefix_cache``: no connector, vLLM's own prefix cache on: after the first request
  (computed), every request finds the prompt's 31 full blocks in the engine's own KV cache (no
  copy at all) and computes the last 32 tokens. The floor a connector can approach on this
  machine: the same engine work without any load.

The first request of each engine is reported apart (disk, cold process) and left out of the
medians. Per round: each engine's median, the ratios ucm / example; reported: every round and
the median over rounds. First tokens must agree everywhere.
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
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--tokens", type=int, default=4000)
    p.add_argument("--reserved-cpus", type=int, default=1,
                   help="VLLM_CPU_NUM_OF_RESERVED_CPU (vLLM's default on a 2-core machine is 1)")
    p.add_argument("--json")
    args = p.parse_args()

    from ucm.models import ensure_smollm2

    model = ensure_smollm2()
    ids = doc_tokens(model)
    work = scratch_dir("ucm-bench-warm-")
    store, exdir = os.path.join(work, "kv"), os.path.join(work, "example")
    os.makedirs(store)
    os.makedirs(exdir)
    common = {"model": model, "dtype": "bfloat16", "prompts": [ids[:args.tokens]], "block_size": 128,
              "env": {"VLLM_CPU_NUM_OF_RESERVED_CPU": str(args.reserved_cpus)}}
    n = args.repeats + 1

    def ucm_spec(name, **connector):
        stats = os.path.join(work, f"stats-{name}.jsonl")
        extra = {"store": {"pipeline": "memory|posix", "posix": {"roots": [store]}},
                 "buffer_number": 256, "cache_capacity": "8GiB",
                 "connector": {"stats_file": stats, **connector}}
        return {**common, "connector": "ucm", "extra_config": extra, "stats_file": stats,
                "phases": [{"name": "warm", "prompts": [0] * n, "ttft": True}]}

    ex_spec = {**common, "connector": "example", "extra_config": {"shared_storage_path": exdir},
               "phases": [{"name": "warm", "prompts": [0] * n, "ttft": True}]}
    t0 = time.time()
    _engine(ucm_spec("fill"), work, "ucm-fill")
    _engine(ex_spec, work, "example-fill")
    floor_spec = {**common, "prefix_caching": True,
                  "phases": [{"name": "warm", "prompts": [0] * n, "ttft": True}]}
    kinds = {"ucm": lambda r: ucm_spec(f"ucm{r}"),
             "ucm_no_overlap": lambda r: ucm_spec(f"ucm-no-overlap{r}", overlap_load=False),
             "example": lambda r: ex_spec,
             "vllm_prefix_cache": lambda r: floor_spec}
    rounds, first_tokens = [], set()
    for r in range(args.rounds):
        row = {}
        for kind, spec in kinds.items():
            res = _engine(spec(r), work, f"{kind}-{r}")
            ph = res["phases"][0]
            ttfts = [o["ttft"] for o in ph["outputs"]]
            first_tokens.update(tuple(o["tokens"][:1]) for o in ph["outputs"])
            row[kind] = {"first_s": ttfts[0], "median_s": statistics.median(ttfts[1:]), "ttfts": ttfts}
            stats = ph.get("connector_stats")
            if stats:
                row[kind]["connector_stats"] = stats
        row["ucm_vs_example"] = row["ucm"]["median_s"] / row["example"]["median_s"]
        row["ucm_no_overlap_vs_example"] = row["ucm_no_overlap"]["median_s"] / row["example"]["median_s"]
        row["ucm_vs_prefix_cache"] = row["ucm"]["median_s"] / row["vllm_prefix_cache"]["median_s"]
        rounds.append(row)
        print(f"round {r}: ucm {row['ucm']['median_s'] * 1e3:.1f} ms, no overlap "
              f"{row['ucm_no_overlap']['median_s'] * 1e3:.1f} ms, example {row['example']['median_s'] * 1e3:.1f} ms"
              f", vLLM prefix cache {row['vllm_prefix_cache']['median_s'] * 1e3:.1f} ms"
              f" -> {row['ucm_vs_example']:.3f} / {row['ucm_no_overlap_vs_example']:.3f}", flush=True)

    def per_request(stats, count):
        keys = ("load_store_s", "scatter_s", "scatter_wait_s", "forward_s")
        return {k[:-2] + "_ms": (stats or {}).get(k, 0.0) / count * 1000 for k in keys}

    out = {"date": time.strftime("%Y-%m-%d %H:%M"), "machine": f"{os.uname().nodename} {os.cpu_count()} cores",
           "tokens": args.tokens, "repeats": args.repeats, "reserved_cpus": args.reserved_cpus,
           "rounds": rounds,
           "median_ucm_vs_example": statistics.median(x["ucm_vs_example"] for x in rounds),
           "median_ucm_no_overlap_vs_example": statistics.median(x["ucm_no_overlap_vs_example"] for x in rounds),
           "worst_ucm_vs_example": max(x["ucm_vs_example"] for x in rounds),
           "median_ucm_vs_prefix_cache": statistics.median(x["ucm_vs_prefix_cache"] for x in rounds),
           # counters over a whole engine (its disk request included), per request
           "breakdown_per_request": {k: per_request(rounds[-1][k].get("connector_stats"), n)
                                     for k in ("ucm", "ucm_no_overlap")},
           "first_tokens_agree": len(first_tokens) == 1,
           "wall_s": time.time() - t0}
    print(json.dumps({k: v for k, v in out.items() if k != "rounds"}, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
