#!/usr/bin/env python3
"""vLLM-CPU figures of the connector: warm TTFT against vLLM's ExampleConnector and its own prefix
cache, and the miss path against plain vLLM, each engine compared inside one run.

    python benchmarks/bench_vllm.py warm [--rounds 3] [--repeats 5] [--json benchmarks/results/bench_vllm_warm_cpu.json]
    python benchmarks/bench_vllm.py miss [--pairs 3] [--ttft-prompts 8] [--decode-prompts 6] [--save-end-arm]
                                         [--null] [--spin-arm] [--no-control] [--json benchmarks/results/bench_vllm_miss_cpu.json]
    pytest benchmarks/bench_vllm.py    # the report's arithmetic and its refusals (no engine started)

SmolLM2-135M (``ucm.models.ensure_smollm2``), bf16, block size 128, eager mode, ``--tokens``
(4,000) token prompts cut from real text, one reserved CPU for every engine (``--reserved-cpus``;
unset, vLLM-CPU reserves one more for an engine with a KV connector, so the engines would
differ). The figures are ratios of engines measured in the same run: this VM drifts by 10-20%
over minutes. A run whose engines disagree on the first generated token of any prompt (and, in
``miss``, on any generated token) reports no ratio: it exits with an error.

``warm``: one prompt is stored once by a ucm engine (``memory|posix`` store on local disk) and
once by an ExampleConnector engine. Then, per round, restarted engines serve it ``--repeats`` + 1
times each, one request at a time, one output token (TTFT): ``ucm`` (the first request loads from
disk, the others from the memory tier), ``ucm_no_overlap`` (``connector.overlap_load`` off),
``example`` (ExampleConnector's safetensors files, in the page cache after the first request) and
``vllm_prefix_cache`` (no connector, vLLM's own prefix cache: after its first, computed, request
it finds the prompt's 31 full blocks in its own KV cache and computes the last 32 tokens; no copy
at all). Each engine's first request is reported apart and left out of its median. Reported per
round: ucm / example, ucm_no_overlap / example, ucm / prefix cache; and their medians over rounds.

``miss``: ``--pairs`` child processes, each starting the engines side by side: ``plain`` (no
connector), ``ucm`` (empty ``memory|posix`` store), unless ``--no-control`` a second plain engine
(the A/A control: what separates it from ``plain`` is noise), with ``--null`` an engine whose
connector does nothing (``benchmarks/null_connector.py``: vLLM's own cost of having a connector),
with ``--spin-arm`` ucm with vLLM's own spinning engine-core wait (``connector.engine_poll_us=0``,
``ucm/integration/vllm/engine_wait.py``), with ``--save-end-arm`` ucm saving each step's blocks
after its forward (``connector.save_during_forward=false``). Each engine gets a 512-token
warm-up request (not counted), then the engines serve the measured requests in turn, the order
rotating from request to request, each after a 1.5 s pause (vLLM's idle engine cores spin for
1 s). Distinct prompts, so ucm looks each up, misses, computes it and saves it: the miss path in
full. ``--ttft-prompts`` with one output token (TTFT), then ``--decode-prompts`` generating 64
tokens: decode rate from vLLM's engine-core timestamps (first to last token) and generation rate
over the whole request. Reported per arm: per request arm / plain - 1, medians over all pairs.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from ucm.demo.vllm_demo import _engine, doc_tokens, scratch_dir  # noqa: E402
from _argtypes import count as _count, write_json  # noqa: E402

PAUSE_S = 1.5


class Disagreement(SystemExit):
    """Engines generated different tokens for one prompt: the run's ratios are not reported."""


def _refuse(out: dict, path: str | None, why: str) -> None:
    """Keep the raw record (for diagnosis, marked refused) and stop without a ratio."""
    out = {k: v for k, v in out.items() if "_vs_" not in k and k not in ("overall", "per_pair")}
    out["rounds"] = [{k: v for k, v in r.items() if "_vs_" not in k} for r in out.get("rounds", [])]
    out["refused"] = why
    if path:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as f:
            json.dump(out, f, indent=1)
    raise Disagreement(f"REFUSED, no ratio reported: {why}")


# ---------------------------------------------------------------------------------------------
# warm: restarted engines, round after round

def _ucm_extra(root: str, cache: str, **connector) -> dict:
    return {"store": {"pipeline": "memory|posix", "posix": {"roots": [root]}}, "buffer_number": 256,
            "cache_capacity": cache, "connector": connector}


def warm(args, model, ids) -> dict:
    work = scratch_dir("ucm-bench-warm-")
    store, exdir = os.path.join(work, "kv"), os.path.join(work, "example")
    os.makedirs(store)
    os.makedirs(exdir)
    common = {"model": model, "dtype": "bfloat16", "prompts": [ids[:args.tokens]], "block_size": 128,
              "env": {"VLLM_CPU_NUM_OF_RESERVED_CPU": str(args.reserved_cpus)}}
    n = args.repeats + 1
    phases = [{"name": "warm", "prompts": [0] * n, "ttft": True}]

    def ucm_spec(name, **connector):
        stats = os.path.join(work, f"stats-{name}.jsonl")
        return {**common, "connector": "ucm", "extra_config": _ucm_extra(store, "8GiB", stats_file=stats, **connector),
                "stats_file": stats, "phases": phases}

    ex_spec = {**common, "connector": "example", "extra_config": {"shared_storage_path": exdir}, "phases": phases}
    t0 = time.time()
    _engine(ucm_spec("fill"), work, "ucm-fill")
    _engine(ex_spec, work, "example-fill")
    floor_spec = {**common, "prefix_caching": True, "phases": phases}
    kinds = {"ucm": lambda r: ucm_spec(f"ucm{r}"),
             "ucm_no_overlap": lambda r: ucm_spec(f"ucm-no-overlap{r}", overlap_load=False),
             "example": lambda r: ex_spec,
             "vllm_prefix_cache": lambda r: floor_spec}
    out = {"mode": "warm", "date": time.strftime("%Y-%m-%d %H:%M"),
           "machine": f"{os.uname().nodename} {os.cpu_count()} cores", "tokens": args.tokens,
           "repeats": args.repeats, "reserved_cpus": args.reserved_cpus, "rounds": []}
    first_tokens = set()
    from ucm import progress

    for r in progress.track(range(args.rounds), "rounds", unit="round"):
        row = {}
        for kind, spec in kinds.items():
            ph = _engine(spec(r), work, f"{kind}-{r}")["phases"][0]
            ttfts = [o["ttft"] for o in ph["outputs"]]
            first_tokens.update(tuple(o["tokens"][:1]) for o in ph["outputs"])
            row[kind] = {"first_s": ttfts[0], "median_s": statistics.median(ttfts[1:]), "ttfts": ttfts}
            if ph.get("connector_stats"):
                row[kind]["connector_stats"] = ph["connector_stats"]
        out["rounds"].append(row)
        if len(first_tokens) != 1:
            _refuse(out, args.json, f"round {r}: engines' first tokens differ ({sorted(first_tokens)})")
        row.update(warm_ratios(row))
        print(f"round {r}: ucm {row['ucm']['median_s'] * 1e3:.1f} ms, no overlap "
              f"{row['ucm_no_overlap']['median_s'] * 1e3:.1f} ms, example {row['example']['median_s'] * 1e3:.1f} ms"
              f", vLLM prefix cache {row['vllm_prefix_cache']['median_s'] * 1e3:.1f} ms"
              f" -> ucm / example {row['ucm_vs_example']:.3f} (no overlap {row['ucm_no_overlap_vs_example']:.3f})",
              flush=True)

    def per_request(stats, count):
        keys = {"load_store_ms": "ucm_load_store_seconds_total",
                "scatter_ms": "ucm_load_scatter_seconds_total",
                "scatter_wait_ms": "ucm_load_scatter_wait_seconds_total",
                "forward_ms": "ucm_forward_seconds_total"}
        return {out: (stats or {}).get(k, 0.0) / count * 1000 for out, k in keys.items()}

    rounds = out["rounds"]
    out.update({
        "median_ucm_vs_example": statistics.median(x["ucm_vs_example"] for x in rounds),
        "median_ucm_no_overlap_vs_example": statistics.median(x["ucm_no_overlap_vs_example"] for x in rounds),
        "worst_ucm_vs_example": max(x["ucm_vs_example"] for x in rounds),
        "median_ucm_vs_prefix_cache": statistics.median(x["ucm_vs_prefix_cache"] for x in rounds),
        # counters over a whole engine (its disk request included), per request
        "breakdown_per_request": {k: per_request(rounds[-1][k].get("connector_stats"), n)
                                  for k in ("ucm", "ucm_no_overlap")},
        "first_tokens_agree": True, "wall_s": time.time() - t0})
    return out


def warm_ratios(row: dict) -> dict:
    med = lambda k: row[k]["median_s"]  # noqa: E731
    return {"ucm_vs_example": med("ucm") / med("example"),
            "ucm_no_overlap_vs_example": med("ucm_no_overlap") / med("example"),
            "ucm_vs_prefix_cache": med("ucm") / med("vllm_prefix_cache")}


# ---------------------------------------------------------------------------------------------
# miss: live engines in one process per pair, taking turns request by request

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
    rows = []
    for k, req in enumerate(spec["requests"]):
        prompt = spec["prompts"][req["prompt"]]
        decode = req["kind"] == "decode"
        turn = names[k % len(names):] + names[:k % len(names)]
        row = {"request": k, "prompt": req["prompt"], "kind": req["kind"], "order": turn}
        for name in turn:
            time.sleep(PAUSE_S)
            t = time.perf_counter()
            o = engines[name].generate([TokensPrompt(prompt_token_ids=prompt)], many if decode else one,
                                       use_tqdm=False)[0]
            wall = time.perf_counter() - t
            toks = list(o.outputs[0].token_ids)
            rec = {"seconds": wall, "first_token": toks[:1], "tokens": toks}
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


def arms_of(row: dict) -> list:
    return [a for a in row if isinstance(row[a], dict)]


def disagreements(rows: list) -> list:
    """Requests whose engines generated different tokens (all of them: one for a TTFT request,
    64 for a decode request)."""
    return [r["request"] for r in rows if len({json.dumps(r[a]["tokens"]) for a in arms_of(r)}) != 1]


def miss_ratios(rows, arm: str, base: str = "plain") -> dict:
    """Per request ``arm`` against ``base``: TTFT (and decode, generation) overheads, medians."""
    ttft = [r[arm]["seconds"] / r[base]["seconds"] - 1 for r in rows if r["kind"] == "ttft"]
    dec = [1 - r[arm]["decode_tps"] / r[base]["decode_tps"] for r in rows
           if r["kind"] == "decode" and "decode_tps" in r[arm] and "decode_tps" in r[base]]
    gen = [1 - r[arm]["generation_tps"] / r[base]["generation_tps"] for r in rows
           if r["kind"] == "decode" and "generation_tps" in r[arm] and "generation_tps" in r[base]]
    med = lambda xs: statistics.median(xs) if xs else None  # noqa: E731
    return {"ttft_overhead": med(ttft), "decode_overhead": med(dec), "generation_overhead": med(gen),
            "ttft_each": ttft, "decode_each": dec, "generation_each": gen}


def _brief(r: dict) -> dict:
    return {k: v for k, v in r.items() if not k.endswith("_each")}


def _own_dir(root: str, name: str) -> str:
    """A store of its own for a second ucm engine (a shared disk tier would turn its misses into
    hits on what the other one saved)."""
    path = os.path.join(root, name)
    os.makedirs(path)
    return path


def miss(args, model, ids) -> dict:
    work = scratch_dir("ucm-bench-miss-")
    n_prompts = args.ttft_prompts + args.decode_prompts
    stride = (len(ids) - 1000) // (n_prompts + 1)
    if stride < args.tokens:
        raise SystemExit(f"the document has {len(ids)} tokens: too few for {n_prompts} distinct prompts "
                         f"of {args.tokens}")
    prompts = [ids[(k + 1) * stride:(k + 1) * stride + args.tokens] for k in range(n_prompts)]
    requests = [{"prompt": k, "kind": "ttft" if k < args.ttft_prompts else "decode"} for k in range(n_prompts)]
    # (2 GiB of memory tier holds the 92 MB prompts; two ucm engines of 8 GiB each would not fit
    # beside the others in a 23 GB VM)
    ucm_engine = lambda root, **c: {"connector": "ucm", "extra_config": _ucm_extra(root, "2GiB", **c)}  # noqa: E731
    out = {"mode": "miss", "date": time.strftime("%Y-%m-%d %H:%M"),
           "machine": f"{os.uname().nodename} {os.cpu_count()} cores", "tokens": args.tokens,
           "pairs": args.pairs, "reserved_cpus": args.reserved_cpus, "base": "plain", "per_pair": [], "rows": []}
    t0 = time.time()
    for i in range(args.pairs):
        root = os.path.join(work, f"kv{i}")
        os.makedirs(root)
        engines = {"plain": {}, "ucm": ucm_engine(root)}
        if not args.no_control:
            engines["control"] = {}
        if args.null:
            engines["null"] = {"null_connector": True}
        if args.spin_arm:
            engines["ucm_spin"] = ucm_engine(_own_dir(root, "spin"), engine_poll_us=0)
        if args.save_end_arm:
            engines["ucm_save_end"] = ucm_engine(_own_dir(root, "save_end"), save_during_forward=False)
        order = list(engines)
        order = order[i % len(order):] + order[:i % len(order)]  # who starts first rotates too
        spec = {"common": {"model": model, "dtype": "bfloat16", "block_size": 128, "log_stats": True},
                "engines": engines, "order": order, "prompts": prompts, "requests": requests,
                "warmup": ids[-600:-88],
                "env": {"VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_CPU_NUM_OF_RESERVED_CPU": str(args.reserved_cpus),
                        # engine processes import ucm / benchmarks.null_connector from this tree
                        "PYTHONPATH": os.pathsep.join(x for x in (ROOT, os.environ.get("PYTHONPATH")) if x)},
                "out": os.path.join(work, f"pair{i}-result.json")}
        path = os.path.join(work, f"pair{i}.json")
        with open(path, "w") as f:
            json.dump(spec, f)
        print(f"pair {i}: engines {order}", flush=True)
        proc = subprocess.run([sys.executable, os.path.abspath(__file__), "_child", path],
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"pair {i} failed (exit {proc.returncode}):\n"
                               + "\n".join(proc.stderr.strip().splitlines()[-25:]))
        with open(spec["out"]) as f:
            rows = json.load(f)["rows"]
        for r in rows:
            r["pair"] = i
        out["rows"].extend(rows)
        bad = disagreements(rows)
        if bad:
            _refuse(out, args.json, f"pair {i}: engines generated different tokens for requests {bad}")
        pr = {arm: _brief(miss_ratios(rows, arm)) for arm in engines if arm != "plain"}
        out["per_pair"].append(pr)
        print(f"pair {i}: " + "; ".join(f"{arm} vs plain: " + ", ".join(
            f"{k} {v:+.2%}" for k, v in r.items() if v is not None) for arm, r in pr.items()), flush=True)
    rows = out["rows"]
    out["overall"] = {a: miss_ratios(rows, a) for a in arms_of(rows[0]) if a != "plain"}
    out.update(tokens_agree_per_request=True, wall_s=time.time() - t0)
    return out


# ---------------------------------------------------------------------------------------------

def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["_child"]:
        _child(argv[1])
        return 0
    p = argparse.ArgumentParser(description="vLLM-CPU connector figures: warm TTFT (warm) and the miss path (miss), ratios of one run.",
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    sub = p.add_subparsers(dest="mode", required=True)
    w = sub.add_parser("warm", help="warm TTFT: ucm vs ExampleConnector vs vLLM's prefix cache, restarted engines")
    w.add_argument("--rounds", type=_count(1), default=3, help="default %(default)s")
    w.add_argument("--repeats", type=_count(1), default=5, help="measured requests per engine and round")
    m = sub.add_parser("miss", help="miss path: ucm vs plain vLLM (and an A/A control), engines taking turns")
    m.add_argument("--pairs", type=_count(1), default=3, help="child processes, each with its own engines")
    m.add_argument("--ttft-prompts", type=_count(0), default=8, help="prompts timed with one output token")
    m.add_argument("--decode-prompts", type=_count(0), default=6, help="prompts generating 64 tokens")
    m.add_argument("--no-control", action="store_true", help="no second plain engine (A/A control)")
    m.add_argument("--null", action="store_true", help="add an engine whose connector does nothing")
    m.add_argument("--spin-arm", action="store_true", help="add ucm with connector.engine_poll_us=0")
    m.add_argument("--save-end-arm", action="store_true", help="add ucm with connector.save_during_forward=false")
    for sp in (w, m):
        sp.add_argument("--tokens", type=_count(1), default=4000, help="prompt length")
        sp.add_argument("--reserved-cpus", type=_count(0), default=1,
                        help="VLLM_CPU_NUM_OF_RESERVED_CPU of every engine")
        sp.add_argument("--json", help="write the record here")
    args = p.parse_args(argv)
    if args.mode == "miss" and args.ttft_prompts + args.decode_prompts == 0:
        m.error("--ttft-prompts and --decode-prompts are both 0: nothing to measure")

    from ucm.models import ensure_smollm2

    model = ensure_smollm2()
    ids = doc_tokens(model)
    out = (warm if args.mode == "warm" else miss)(args, model, ids)
    if args.mode == "warm":
        summary = {k: v for k, v in out.items() if k != "rounds"}
    else:
        summary = {"overall vs plain (positive: slower)": {a: _brief(r) for a, r in out["overall"].items()},
                   "per_pair": out["per_pair"], "wall_s": out["wall_s"]}
    print(json.dumps(summary, indent=1))
    if args.json:
        write_json(args.json, out, indent=1)
    return 0


# ---------------------------------------------------------------------------------------------
# pytest: the arithmetic and the refusals, on made-up rows (no engine)

def _row(k, kind, **arms):
    return {"request": k, "prompt": k, "kind": kind, "order": list(arms), **arms}


def test_miss_ratios_and_agreement():
    rows = [_row(0, "ttft", plain={"seconds": 1.0, "tokens": [5]}, ucm={"seconds": 1.02, "tokens": [5]}),
            _row(1, "decode", plain={"seconds": 2.0, "tokens": [5, 6], "decode_tps": 10.0, "generation_tps": 4.0},
                 ucm={"seconds": 2.0, "tokens": [5, 6], "decode_tps": 9.0, "generation_tps": 4.0})]
    r = miss_ratios(rows, "ucm")
    assert abs(r["ttft_overhead"] - 0.02) < 1e-12 and abs(r["decode_overhead"] - 0.1) < 1e-12
    assert r["generation_overhead"] == 0.0 and disagreements(rows) == []
    rows[1]["ucm"]["tokens"] = [5, 7]  # a later token differs: that request disagrees
    assert disagreements(rows) == [1]


def test_refusal_reports_no_ratio(tmp_path):
    import pytest

    path = str(tmp_path / "out.json")
    with pytest.raises(Disagreement):
        _refuse({"mode": "warm", "rounds": [{"ucm_vs_example": 0.3}], "median_ucm_vs_example": 0.3}, path, "x")
    with open(path) as f:
        kept = json.load(f)
    assert kept["refused"] == "x" and "median_ucm_vs_example" not in kept


def test_warm_ratios():
    row = {k: {"median_s": v} for k, v in
           (("ucm", 0.06), ("ucm_no_overlap", 0.055), ("example", 0.24), ("vllm_prefix_cache", 0.18))}
    r = warm_ratios(row)
    assert abs(r["ucm_vs_example"] - 0.25) < 1e-12 and abs(r["ucm_vs_prefix_cache"] - 1 / 3) < 1e-12


if __name__ == "__main__":
    sys.exit(main())
