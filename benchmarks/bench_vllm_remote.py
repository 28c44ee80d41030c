#!/usr/bin/env python3
"""vLLM-CPU: warm TTFT on a second node whose KV comes from Redis, against cold TTFT on the node
that computed it, both measured in one run.

    python benchmarks/bench_vllm_remote.py [--prompts 4] [--rounds 1] [--tokens 4000] [--redis URL]
                                           [--timeout-s 2] [--json benchmarks/results/bench_vllm_remote_cpu.json]
    pytest benchmarks/bench_vllm_remote.py    # the report's arithmetic (no engine started)

SmolLM2-135M (``ucm.models.ensure_smollm2``), bf16 (``--dtype``), block size 128, eager mode,
one reserved CPU per engine, store ``memory|redis`` (no local disk tier). A redis-server is
started on loopback for the run (``tests/services/redis.py``) unless ``--redis`` names one; each
round uses keys of its own (``store.redis.key_prefix``), so nothing from an earlier round or run
is found.

Per round, two engine processes, one after the other, as two nodes:

* node A (empty store) serves ``--prompts`` distinct ``--tokens``-token prompts cut from real
  text, one request at a time, one output token: cold TTFT (computes the prompt and saves its KV
  to its memory tier and to Redis);
* node B, a fresh process (its memory tier empty), serves the same prompts: every one is a hit
  on Redis (warm TTFT: the 31 full blocks and the partial last block of a 4,000-token prompt are
  read from Redis, only the last token is computed). Then B serves them once more
  (``memory_s``: from its own memory tier, where the Redis loads were promoted), for reference.

Both engines first serve a 512-token warm-up prompt (not measured; on B it is a Redis hit
too, so B's load path is warm as well). Reported: per prompt warm / cold, and per round and
overall median warm / median cold (target <= 0.5). A round whose nodes disagree on any prompt's
first token, whose node A did not get every block it saved committed on Redis (counted on the
server: a put that failed on Redis alone still counts as saved for the connector, the memory
tier having stored it), or whose node B did not load every full block, reports no ratio.

``--timeout-s`` (default 2 s) sets ``store.remote.timeout_s``: ucm's default, 0.2 s, bounds a
whole pipelined put of up to 16 MiB, and on a busy 2-core VM puts timed out ("Timeout writing to
socket"): blocks were missing on Redis and node B recomputed them. The timeout bounds only
failing requests; it does not change the speed of those that succeed.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks.bench_vllm import _refuse  # noqa: E402
from ucm.demo.vllm_demo import _engine, doc_tokens, scratch_dir  # noqa: E402
from _argtypes import count as _count, write_json  # noqa: E402

BS = 128


def _extra(url: str, prefix: str, stats: str, timeout_s: float) -> dict:
    return {"store": {"pipeline": "memory|redis", "redis": {"servers": [url], "key_prefix": prefix},
                      "remote": {"timeout_s": timeout_s}},
            "buffer_number": 256, "cache_capacity": "2GiB", "connector": {"stats_file": stats}}


def _server(url: str, prefix: str) -> dict:
    """What the server holds and has served: commit markers under ``prefix`` and GET commands
    answered so far (``{}`` when it cannot be asked)."""
    try:
        import redis

        c = redis.Redis.from_url(url, socket_timeout=5)
        try:
            return {"markers": sum(1 for _ in c.scan_iter(match=f"{prefix}:*:m", count=1000)),
                    "gets": int(c.info("commandstats").get("cmdstat_get", {}).get("calls", 0))}
        finally:
            c.close()
    except Exception:
        return {}


def _final_stats(path: str) -> dict:
    """The connector's last counters line (written when the engine shut down)."""
    with open(path) as f:
        return json.loads(f.read().strip().splitlines()[-1])


def ratios(cold: list, warm: list) -> dict:
    """warm / cold per prompt, and median warm / median cold."""
    return {"per_prompt": [w / c for w, c in zip(warm, cold)],
            "median_warm_vs_cold": statistics.median(warm) / statistics.median(cold)}


def round_(args, model, prompts, warmup, url, work, r, out) -> dict:
    n = len(prompts)
    common = {"model": model, "dtype": args.dtype, "prompts": [warmup] + prompts, "block_size": BS,
              "env": {"VLLM_CPU_NUM_OF_RESERVED_CPU": str(args.reserved_cpus)}}
    prefix = f"bench-{os.getpid()}-{r}"
    measured = list(range(1, n + 1))
    specs = {}
    for node, phases in (("A", [{"name": "cold", "prompts": measured, "ttft": True}]),
                         ("B", [{"name": "warm", "prompts": measured, "ttft": True},
                                {"name": "memory", "prompts": measured, "ttft": True}])):
        stats = os.path.join(work, f"stats-{node}{r}.jsonl")
        specs[node] = {**common, "connector": "ucm", "extra_config": _extra(url, prefix, stats, args.timeout_s),
                       "stats_file": stats,
                       "phases": [{"name": "warmup", "prompts": [0], "ttft": True}] + phases}
    a = _engine(specs["A"], work, f"node-A{r}")
    a_final = _final_stats(specs["A"]["stats_file"])
    before_b = _server(url, prefix)
    b = _engine(specs["B"], work, f"node-B{r}")
    after_b = _server(url, prefix)
    gets = after_b["gets"] - before_b["gets"] if before_b and after_b else None
    ph = {p["name"]: p for p in a["phases"] + b["phases"]}
    t = {k: [o["ttft"] for o in ph[k]["outputs"]] for k in ("cold", "warm", "memory")}
    row = {"cold_s": t["cold"], "warm_s": t["warm"], "memory_s": t["memory"], "redis_gets_node_b": gets,
           "redis_markers_after_a": before_b.get("markers"), "node_a_stats": a_final,
           "node_b_stats": ph["warm"].get("connector_stats")}
    out["rounds"].append(row)
    firsts = [{tuple(o["tokens"][:1]) for o in (ph[k]["outputs"][i] for k in ("cold", "warm", "memory"))}
              for i in range(n)]
    bad = [i for i, f in enumerate(firsts) if len(f) != 1]
    if bad:
        _refuse(out, args.json, f"round {r}: nodes' first tokens differ for prompts {bad}")
    before, after = ph["warmup"].get("connector_stats") or {}, row["node_b_stats"] or {}
    want = n * ((args.tokens - 1) // BS)
    got = after.get("ucm_load_blocks_total", 0) - before.get("ucm_load_blocks_total", 0)
    if got != want or after.get("ucm_load_failed_blocks_total", 0):
        _refuse(out, args.json, f"round {r}: node B loaded {got} full blocks from Redis (expected {want}), "
                                f"{after.get('ucm_load_failed_blocks_total')} failed")
    saved = a_final["ucm_save_blocks_total"] + a_final["ucm_save_tail_blocks_total"]
    if a_final["ucm_save_failed_blocks_total"] or (before_b and before_b["markers"] != saved):
        # (a put that failed on Redis alone is not a failed save for the connector: the memory
        # tier stored the block; only the server's count shows it)
        _refuse(out, args.json, f"round {r}: node A saved {saved} blocks ({a_final['ucm_save_failed_blocks_total']} failed), "
                                f"{before_b.get('markers')} of them committed on Redis")
    row.update(ratios(t["cold"], t["warm"]))
    row["redis_blocks_per_prompt"] = got // n
    print(f"round {r}: cold {statistics.median(t['cold']):.3f} s, warm from Redis "
          f"{statistics.median(t['warm']):.3f} s, from B's memory tier {statistics.median(t['memory']):.3f} s "
          f"(medians of {n}) -> warm / cold {row['median_warm_vs_cold']:.3f}", flush=True)
    return row


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="vLLM-CPU: warm TTFT on a second node, KV from Redis, vs cold TTFT.",
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--prompts", type=_count(1), default=4, help="distinct prompts per round (each measured once cold, once warm)")
    p.add_argument("--rounds", type=_count(1), default=1, help="pairs of nodes A, B")
    p.add_argument("--tokens", type=_count(1), default=4000, help="prompt length")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--reserved-cpus", type=_count(0), default=1, help="VLLM_CPU_NUM_OF_RESERVED_CPU of every engine")
    p.add_argument("--redis", help="a running server's URL (default: start redis-server on loopback)")
    p.add_argument("--timeout-s", type=float, default=2.0,
                   help="store.remote.timeout_s (ucm's default 0.2 s bounds a whole 16 MiB pipelined put: on "
                        "a busy 2-core VM puts timed out, blocks were not stored and node B recomputed them)")
    p.add_argument("--json", help="write the record here")
    args = p.parse_args(argv)
    if not args.timeout_s > 0:
        p.error(f"--timeout-s: expected a positive number of seconds, got {args.timeout_s}")

    from ucm.models import ensure_smollm2

    model = ensure_smollm2()
    ids = doc_tokens(model)
    stride = (len(ids) - 1000) // (args.prompts + 1)
    if stride < args.tokens:
        raise SystemExit(f"the document has {len(ids)} tokens: too few for {args.prompts} prompts of {args.tokens}")
    prompts = [ids[(k + 1) * stride:(k + 1) * stride + args.tokens] for k in range(args.prompts)]
    warmup = ids[:512]
    work = scratch_dir("ucm-bench-remote-")
    server = None
    if args.redis:
        url = args.redis
    else:
        sys.path.insert(0, os.path.join(ROOT, "tests"))
        from services.redis import redis_server

        server = redis_server(work)
        url = server.url
    out = {"mode": "remote", "date": time.strftime("%Y-%m-%d %H:%M"),
           "machine": f"{os.uname().nodename} {os.cpu_count()} cores", "tokens": args.tokens,
           "dtype": args.dtype, "prompts": args.prompts, "pipeline": "memory|redis",
           "reserved_cpus": args.reserved_cpus, "timeout_s": args.timeout_s, "rounds": []}
    t0 = time.time()
    try:
        for r in range(args.rounds):
            round_(args, model, prompts, warmup, url, work, r, out)
    finally:
        if server is not None:
            server.stop()
    rounds = out["rounds"]
    cold = [x for r in rounds for x in r["cold_s"]]
    warm = [x for r in rounds for x in r["warm_s"]]
    mem = [x for r in rounds for x in r["memory_s"]]
    out.update({"median_cold_s": statistics.median(cold), "median_warm_s": statistics.median(warm),
                "median_memory_s": statistics.median(mem),
                "median_warm_vs_cold": statistics.median(warm) / statistics.median(cold),
                "worst_warm_vs_cold": max(x for r in rounds for x in r["per_prompt"]),
                "target_warm_vs_cold": 0.5, "first_tokens_agree": True, "wall_s": time.time() - t0})
    print(json.dumps({k: v for k, v in out.items() if k != "rounds"}, indent=1))
    if args.json:
        write_json(args.json, out, indent=1)
    return 0


def test_ratios():
    r = ratios([6.0, 5.0, 7.0], [1.0, 2.0, 1.5])
    assert abs(r["median_warm_vs_cold"] - 1.5 / 6.0) < 1e-12
    assert abs(r["per_prompt"][1] - 0.4) < 1e-12


if __name__ == "__main__":
    sys.exit(main())
