#!/usr/bin/env python3
"""Check that vLLM (CPU) loads the converted SmolLM2 folder and generates sensible text.

    python scripts/check_model.py                      # float32 and bfloat16, one after the other
    python scripts/check_model.py --dtype bfloat16 --concurrent   # plus two engines at once

For each dtype an engine runs in its own process (vLLM spawns its engine core): it reports load
time, a greedy 24-token continuation of ~1,000 tokens of CPython documentation
(``pydoc_data.topics``), the time to first token of 4,000-token prompts (prefix caching off) and
the peak memory of the process tree. The last line of each child is a JSON record.

Measured on the 2-core machines (bf16 folder; noisy, the machine was shared): load 21-35 s with
--enforce-eager but ~110 s without (inductor compile); 4,000-token TTFT 3.6-5 s in bf16 and
11-16 s in float32 on vLLM's default single worker core, 2.0-2.2 s in bf16 with
VLLM_CPU_NUM_OF_RESERVED_CPU=0 (both cores); ~3.6 GiB peak RSS with --kv-gib 1, ~5.2 GiB with
gpu_memory_utilization=0.25. Two engines at once fit; pin them apart with
VLLM_CPU_OMP_THREADS_BIND=0 / =1 (by default both bind core 0).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _ensure_model(dtype: str) -> str:
    sys.path.insert(0, REPO)
    from ucm.models import ensure_smollm2

    return ensure_smollm2(dtype=dtype)


def _doc_token_ids(tokenizer) -> list[int]:
    from pydoc_data.topics import topics

    text = "\n\n".join(topics[k] for k in sorted(topics))
    return tokenizer(text)["input_ids"]


class _PeakRss(threading.Thread):
    """Peak resident memory of this process and its children (the engine core)."""

    def __init__(self):
        super().__init__(daemon=True)
        self.peak = 0
        self.stop = False

    def current(self) -> int:
        import psutil

        me = psutil.Process()
        total = 0
        for p in [me] + me.children(recursive=True):
            try:
                total += p.memory_info().rss
            except psutil.Error:
                pass
        return total

    def run(self):
        while not self.stop:
            self.peak = max(self.peak, self.current())
            time.sleep(0.2)


def child(args) -> dict:
    t0 = time.monotonic()
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    t_import = time.monotonic() - t0
    rss = _PeakRss()
    rss.start()
    kw = dict(model=args.model, dtype=args.dtype, max_model_len=8192, seed=0,
              enable_prefix_caching=False, enforce_eager=args.enforce_eager)
    if args.kv_gib:
        kw["kv_cache_memory_bytes"] = int(args.kv_gib * (1 << 30))
    else:
        kw["gpu_memory_utilization"] = args.mem_util
    t1 = time.monotonic()
    llm = LLM(**kw)
    t_load = time.monotonic() - t1
    rss_loaded = rss.current()
    tok = llm.get_tokenizer()
    ids = _doc_token_ids(tok)
    greedy = SamplingParams(temperature=0.0, max_tokens=24)

    # ~1,000 tokens ending just before a topic's text resumes: a sensible place to continue.
    prompt = ids[20000:21000]
    t2 = time.monotonic()
    out = llm.generate([TokensPrompt(prompt_token_ids=prompt)], greedy, use_tqdm=False)[0]
    t_gen1k = time.monotonic() - t2
    gen_ids = list(out.outputs[0].token_ids)
    text = out.outputs[0].text

    ttft = []
    one = SamplingParams(temperature=0.0, max_tokens=1)
    for start in (30000, 40000, 50000):          # different prompts: nothing cached
        t3 = time.monotonic()
        llm.generate([TokensPrompt(prompt_token_ids=ids[start:start + 4000])], one,
                     use_tqdm=False)
        ttft.append(round(time.monotonic() - t3, 2))
    t4 = time.monotonic()
    out4 = llm.generate([TokensPrompt(prompt_token_ids=ids[60000:64000])],
                        SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True),
                        use_tqdm=False)[0]
    t_4k64 = time.monotonic() - t4
    rss.stop = True
    rss.join()
    return {"dtype": args.dtype, "import_s": round(t_import, 1), "load_s": round(t_load, 1),
            "gen_1k_prompt_24_tokens_s": round(t_gen1k, 2),
            "ttft_4k_s": ttft, "prefill_4k_plus_64_tokens_s": round(t_4k64, 2),
            "decode_tok_per_s": round(63 / max(1e-9, t_4k64 - min(ttft)), 1),
            "rss_after_load_gib": round(rss_loaded / (1 << 30), 2),
            "peak_rss_gib": round(rss.peak / (1 << 30), 2),
            "prompt_tail": tok.decode(prompt[-40:]), "continuation": text, "token_ids": gen_ids,
            "n_out_4k": len(out4.outputs[0].token_ids)}


def run_child(model, dtype, extra, env=None):
    cmd = [sys.executable, os.path.abspath(__file__), "--child", "--model", model, "--dtype",
           dtype] + extra
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env)


def collect(proc, label, log_dir=None):
    out, err = proc.communicate()
    if log_dir:
        os.makedirs(log_dir, exist_ok=True)
        with open(os.path.join(log_dir, f"{label.replace(' ', '-')}.log"), "w") as f:
            f.write(out + err)
    lines = [ln for ln in out.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        print(f"--- {label} FAILED (rc {proc.returncode}) ---\n{err[-6000:]}", file=sys.stderr)
        return None
    return json.loads(lines[-1])


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", nargs="*", default=["float32", "bfloat16"])
    ap.add_argument("--model", help="model folder (default: ensure_smollm2())")
    ap.add_argument("--folder-dtype", default="bfloat16", help="dtype of the converted folder")
    ap.add_argument("--mem-util", type=float, default=0.25,
                    help="gpu_memory_utilization: on CPU the fraction of RAM for model + KV")
    ap.add_argument("--kv-gib", type=float, default=0, help="explicit KV cache size instead")
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--concurrent", action="store_true", help="also run two engines at once")
    ap.add_argument("--log-dir", help="write each engine's stderr (vLLM's log) there")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()

    if args.child:
        args.dtype = args.dtype[0]
        print(json.dumps(child(args)), flush=True)
        return 0
    model = args.model or _ensure_model(args.folder_dtype)
    extra = ["--mem-util", str(args.mem_util), "--kv-gib", str(args.kv_gib)]
    extra += ["--enforce-eager"] if args.enforce_eager else []
    results = {}
    ok = True
    for dtype in args.dtype:
        t = time.monotonic()
        r = collect(run_child(model, dtype, extra), dtype, args.log_dir)
        ok &= r is not None
        if r:
            r["process_s"] = round(time.monotonic() - t, 1)
            results[dtype] = r
            print(json.dumps(r, indent=1), flush=True)
    if args.concurrent:
        t = time.monotonic()
        procs = [run_child(model, args.dtype[-1], extra) for _ in range(2)]
        rs = [collect(p, f"concurrent {i}", args.log_dir) for i, p in enumerate(procs)]
        ok &= all(rs)
        if all(rs):
            same = rs[0]["token_ids"] == rs[1]["token_ids"]
            print(json.dumps({"concurrent": [{k: r[k] for k in ("load_s", "ttft_4k_s",
                                                                 "peak_rss_gib")} for r in rs],
                              "wall_s": round(time.monotonic() - t, 1),
                              "same_tokens": same}, indent=1), flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
