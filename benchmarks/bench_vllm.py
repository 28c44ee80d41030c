#!/usr/bin/env python3
"""vLLM-CPU figures for the connector, measured in one run (SmolLM2-135M, bf16, block size 128).

    python benchmarks/bench_vllm.py [--tokens 4000] [--repeats 5] [--json out.json]

1. Warm TTFT: a 4,000-token prompt served after an engine restart, from ucm (disk, then memory)
   and from vLLM's ExampleConnector, median of ``--repeats`` requests; ratio ucm / Example.
2. Miss path: ucm enabled with nothing cached vs vLLM without a connector: TTFT of distinct
   4,000-token prompts (every one a miss) and decode throughput (tokens/s of 128-token
   generations), median of ``--repeats``; each engine runs the same prompts. Measured for the
   default configuration (saves written through to every tier inside the step) and for
   ``store.write_back`` (the step stores into the memory tier only; the posix tier is written by
   a background thread).
3. Where the time goes, from the worker connector's counters (per request): store load and
   scatter of a warm request, gather and store of a miss, the forward pass, engine steps.

Every engine is a separate process (``ucm.demo.engine``); first tokens are compared across runs.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from ucm.demo.vllm_demo import _engine  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=4000)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json")
    args = p.parse_args()

    from pydoc_data.topics import topics
    from transformers import AutoTokenizer

    from ucm.models import ensure_smollm2

    model = ensure_smollm2()
    tok = AutoTokenizer.from_pretrained(model)
    ids = tok("\n".join(topics[k] for k in sorted(topics)), add_special_tokens=False)["input_ids"]
    n, r = args.tokens, args.repeats
    warm_prompt = ids[:n]
    # distinct prompts, all misses; the last one only for the decode run (a prompt the TTFT runs
    # did not store, or ucm would load its prefill and the decode comparison would be unfair)
    miss_prompts = [ids[(k + 1) * 9000:(k + 1) * 9000 + n] for k in range(r + 1)]
    prompts = [warm_prompt] + miss_prompts
    work = tempfile.mkdtemp(prefix="ucm-bench-vllm-")
    store, exdir = os.path.join(work, "kv"), os.path.join(work, "example")
    os.makedirs(store)
    os.makedirs(exdir)
    common = {"model": model, "dtype": "bfloat16", "prompts": prompts, "block_size": 128}

    def ucm_spec(name, phases, write_back=False, root=store):
        stats = os.path.join(work, f"stats-{name}.jsonl")
        extra = {"store": {"pipeline": "memory|posix", "posix": {"roots": [root]}, "write_back": write_back},
                 "buffer_number": 256, "cache_capacity": "8GiB", "connector": {"stats_file": stats}}
        return {**common, "connector": "ucm", "extra_config": extra, "stats_file": stats, "phases": phases}

    misses = list(range(1, r + 1))
    miss_phases = [{"name": "miss-ttft", "prompts": misses, "ttft": True},
                   {"name": "decode", "prompts": [r + 1], "max_tokens": 128}]
    t0 = time.time()
    res = {}
    # miss path: the same distinct prompts through plain vLLM and through ucm (empty store)
    res["plain"] = _engine({**common, "phases": miss_phases}, work, "plain")
    res["ucm_miss"] = _engine(ucm_spec("miss", miss_phases + [{"name": "fill", "prompts": [0], "ttft": True}]),
                              work, "ucm-miss")
    wb_store = os.path.join(work, "kv-write-back")
    os.makedirs(wb_store)
    res["ucm_miss_write_back"] = _engine(ucm_spec("miss-wb", miss_phases, write_back=True, root=wb_store),
                                         work, "ucm-miss-write-back")
    # warm: restart, then the 4,000-token prompt repeatedly (disk first, memory after)
    res["ucm_warm"] = _engine(ucm_spec("warm", [{"name": "disk", "prompts": [0], "ttft": True},
                                                {"name": "memory", "prompts": [0] * r, "ttft": True}]),
                              work, "ucm-warm")
    ex_extra = {"shared_storage_path": exdir}
    _engine({**common, "connector": "example", "extra_config": ex_extra,
             "phases": [{"name": "fill", "prompts": [0], "ttft": True}]}, work, "example-fill")
    res["example_warm"] = _engine({**common, "connector": "example", "extra_config": ex_extra,
                                   "phases": [{"name": "warm", "prompts": [0] * r, "ttft": True}]},
                                  work, "example-warm")

    def ttfts(result, phase):
        return [o["ttft"] for o in next(x for x in result["phases"] if x["name"] == phase)["outputs"]]

    def decode_tps(result):
        ph = next(x for x in result["phases"] if x["name"] == "decode")
        return len(ph["outputs"][0]["tokens"]) / ph["seconds"]

    def per_request(result, phase, before, count):
        """The worker connector's counters over one phase, per request (ms for times)."""
        names = [x["name"] for x in result["phases"]]
        now = result["phases"][names.index(phase)]["connector_stats"] or {}
        prev = (result["phases"][names.index(before)]["connector_stats"] or {}) if before else {}
        keys = ("load_store_s", "scatter_s", "gather_s", "save_s", "forward_s", "steps", "load_blocks",
                "save_blocks")
        return {k[:-2] + "_ms" if k.endswith("_s") else k:
                (now.get(k, 0) - prev.get(k, 0)) / count * (1000 if k.endswith("_s") else 1) for k in keys}

    out = {
        "machine": f"{platform.node()} {platform.machine()} {os.cpu_count()} cores",
        "date": time.strftime("%Y-%m-%d"), "tokens": n, "repeats": r, "dtype": "bfloat16",
        "plain_miss_ttft_s": statistics.median(ttfts(res["plain"], "miss-ttft")),
        "ucm_miss_ttft_s": statistics.median(ttfts(res["ucm_miss"], "miss-ttft")),
        "plain_decode_tps": decode_tps(res["plain"]), "ucm_decode_tps": decode_tps(res["ucm_miss"]),
        "ucm_write_back_miss_ttft_s": statistics.median(ttfts(res["ucm_miss_write_back"], "miss-ttft")),
        "ucm_write_back_decode_tps": decode_tps(res["ucm_miss_write_back"]),
        "breakdown_per_request": {
            "miss": per_request(res["ucm_miss"], "miss-ttft", None, r),
            "miss_write_back": per_request(res["ucm_miss_write_back"], "miss-ttft", None, r),
            "warm_disk": per_request(res["ucm_warm"], "disk", None, 1),
            "warm_memory": per_request(res["ucm_warm"], "memory", "disk", r)},
        "ucm_warm_disk_ttft_s": ttfts(res["ucm_warm"], "disk")[0],
        "ucm_warm_memory_ttft_s": statistics.median(ttfts(res["ucm_warm"], "memory")),
        "example_warm_ttft_s": statistics.median(ttfts(res["example_warm"], "warm")),
        "all_ttfts": {k: {ph["name"]: [o.get("ttft") for o in ph["outputs"]] for ph in v["phases"]}
                      for k, v in res.items()},
        "first_tokens_agree": len({tuple(o["tokens"][:1]) for v in res.values() for ph in v["phases"]
                                   for o in ph["outputs"] if o["prompt"] == 0}) == 1,
        "wall_s": time.time() - t0,
    }
    out["warm_memory_vs_example"] = out["ucm_warm_memory_ttft_s"] / out["example_warm_ttft_s"]
    out["warm_disk_vs_example"] = out["ucm_warm_disk_ttft_s"] / out["example_warm_ttft_s"]
    out["miss_ttft_overhead"] = out["ucm_miss_ttft_s"] / out["plain_miss_ttft_s"] - 1
    out["miss_decode_overhead"] = 1 - out["ucm_decode_tps"] / out["plain_decode_tps"]
    out["write_back_miss_ttft_overhead"] = out["ucm_write_back_miss_ttft_s"] / out["plain_miss_ttft_s"] - 1
    out["write_back_miss_decode_overhead"] = 1 - out["ucm_write_back_decode_tps"] / out["plain_decode_tps"]
    print(json.dumps({k: v for k, v in out.items() if k != "all_ttfts"}, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
