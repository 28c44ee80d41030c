"""Run one vLLM engine in a child process and report what it generated (JSON on stdout).

Used by ``ucm demo``, the end-to-end tests and the benchmarks, so that every engine start is a
real, separate process (a restart is a new process) and nothing leaks between runs::

    python -m ucm.demo.engine spec.json  > result.json

The spec (JSON) holds: ``model``, ``dtype``, ``connector`` (null | "ucm" | "example"),
``extra_config`` (kv_connector_extra_config), ``kv_role``, ``max_num_batched_tokens``,
``max_model_len``, ``prefix_caching`` (vLLM's own prefix cache, off by default),
``gpu_memory_utilization``, ``max_num_seqs``, ``num_gpu_blocks_override`` (a KV cache of
exactly that many blocks), ``log_stats`` (report vLLM's counters, e.g. ``vllm:num_preemptions``,
under ``"metrics"``, and per generated output ``decode_s``: engine-core time from its first to
its last token), ``prompts`` (lists of token ids), ``phases`` (list of {"name", "prompts":
[indices], "max_tokens", "ttft": bool, "logprobs": bool, "prompt_logprobs": bool,
"read_cache": bool, "wait_for": path, "kv_params": [one kv_transfer_params object or null per
prompt of the phase]}), ``env`` (extra environment for the engine). Each phase is one
``generate`` call with all its prompts in flight together; with ``ttft`` each prompt is instead
timed alone with one output token (time to first token), the engine stepped between prompts
until the previous one's saves are done, as a server's loop would between requests. With
``logprobs`` the log-probability of each generated token is reported, and its ``margins``: how
far (in log-probability) it led the most likely other token, a near-tie's measure. With ``prompt_logprobs`` the log-probability of each prompt
token given its prefix is reported (``None`` for the first token). vLLM then skips prefix-cache
and connector hits, unless ``read_cache`` is set: it then computes log-probabilities only for the
prompt tokens it computed itself (the positions after the loaded prefix); ``prompt_logprobs_from``
is the first position with a value. With ``wait_for`` the engine, idle before that phase,
creates ``path + ".ready"`` and waits for ``path`` to exist (a test stops or restarts a
service in between).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from typing import Optional


def _kv_config(spec: dict):
    kind = spec.get("connector")
    if not kind:
        return None
    from vllm.config import KVTransferConfig

    if kind == "ucm":
        return KVTransferConfig(kv_connector="UCMConnector", kv_connector_module_path="ucm.integration.vllm",
                                kv_role=spec.get("kv_role", "kv_both"),
                                kv_connector_extra_config=spec.get("extra_config") or {})
    if kind == "example":
        return KVTransferConfig(kv_connector="ExampleConnector", kv_role=spec.get("kv_role", "kv_both"),
                                kv_connector_extra_config=spec.get("extra_config") or {})
    raise ValueError(f"connector: expected null, 'ucm' or 'example', got {kind!r}")


def llm_kwargs(spec: dict) -> dict:
    """Keyword arguments of ``vllm.LLM`` for an engine spec (module docstring)."""
    kwargs = dict(model=spec["model"], dtype=spec.get("dtype", "bfloat16"),
                  max_model_len=spec.get("max_model_len", 8192),
                  enable_prefix_caching=bool(spec.get("prefix_caching", False)),
                  gpu_memory_utilization=spec.get("gpu_memory_utilization", 0.25), seed=0,
                  enforce_eager=spec.get("enforce_eager", True))
    if spec.get("block_size"):
        kwargs["block_size"] = spec["block_size"]
    if spec.get("num_gpu_blocks_override"):
        kwargs["num_gpu_blocks_override"] = spec["num_gpu_blocks_override"]
    if spec.get("log_stats"):
        kwargs["disable_log_stats"] = False
    if spec.get("max_num_seqs"):
        kwargs["max_num_seqs"] = spec["max_num_seqs"]
    if spec.get("max_num_batched_tokens"):
        kwargs["max_num_batched_tokens"] = spec["max_num_batched_tokens"]
        kwargs["enable_chunked_prefill"] = True
    kv = _kv_config(spec)
    if kv is not None:
        kwargs["kv_transfer_config"] = kv
    return kwargs


def run_in_child(spec: dict, workdir: str, name: str, env: Optional[dict] = None) -> dict:
    """Run ``spec`` in a fresh process (``python -m ucm.demo.engine``, environment ``env`` over
    this one's) and return its result; RuntimeError with the end of its stderr if it fails."""
    path = os.path.join(workdir, f"{name}.json")
    with open(path, "w") as f:
        json.dump(spec, f)
    proc = subprocess.run([sys.executable, "-m", "ucm.demo.engine", path], capture_output=True,
                          text=True, env=dict(os.environ, **(env or {})))
    if proc.returncode != 0:
        tail = "\n".join(proc.stderr.strip().splitlines()[-25:])
        raise RuntimeError(f"engine '{name}' failed (exit {proc.returncode}):\n{tail}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def run(spec: dict) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    t0 = time.perf_counter()
    kwargs = llm_kwargs(spec)
    llm = LLM(**kwargs)
    out = {"load_seconds": time.perf_counter() - t0, "phases": []}
    prompts = spec["prompts"]
    for phase in spec["phases"]:
        if phase.get("wait_for"):
            _handshake(phase["wait_for"])
        print(f"[engine] phase {phase['name']}: {len(phase['prompts'])} prompts", file=sys.stderr, flush=True)
        res = {"name": phase["name"], "outputs": []}
        kvp = phase.get("kv_params") or [None] * len(phase["prompts"])

        def extra(j):  # the j-th prompt's kv_transfer_params (ucm_blend chunks ...)
            return {"extra_args": {"kv_transfer_params": kvp[j]}} if kvp[j] is not None else {}

        if phase.get("ttft"):
            for j, i in enumerate(phase["prompts"]):
                sp = SamplingParams(max_tokens=1, temperature=0.0, **extra(j))
                t = time.perf_counter()
                o = llm.generate([TokensPrompt(prompt_token_ids=prompts[i])], sp, use_tqdm=False)[0]
                res["outputs"].append({"prompt": i, "ttft": time.perf_counter() - t,
                                       "tokens": list(o.outputs[0].token_ids)})
                # a server's engine loop finishes the request's save while it waits for the
                # next one; in process nothing steps it, and the next prompt would miss
                # blocks still being saved
                _drain_in_process(llm)
        else:
            plp = phase.get("prompt_logprobs")
            sp = [SamplingParams(max_tokens=phase.get("max_tokens", 24), temperature=0.0,
                                 logprobs=2 if phase.get("logprobs") else None,
                                 prompt_logprobs=1 if plp else None,
                                 skip_reading_prefix_cache=False if phase.get("read_cache") else None,
                                 detokenize=not plp,  # (vLLM 0.32 fails detokenizing prompt logprobs)
                                 **extra(j)) for j in range(len(phase["prompts"]))]
            t = time.perf_counter()
            outs = llm.generate([TokensPrompt(prompt_token_ids=prompts[i]) for i in phase["prompts"]], sp,
                                use_tqdm=False)
            res["seconds"] = time.perf_counter() - t
            for i, o in zip(phase["prompts"], outs):
                item = {"prompt": i, "tokens": list(o.outputs[0].token_ids),
                        "num_cached_tokens": getattr(o, "num_cached_tokens", None)}
                m = getattr(o, "metrics", None)  # (with log_stats) engine-core timestamps
                if m is not None and getattr(m, "last_token_ts", 0) > getattr(m, "first_token_ts", 0) > 0:
                    item["decode_s"] = m.last_token_ts - m.first_token_ts  # first to last token
                if phase.get("logprobs") and o.outputs[0].logprobs:
                    item["logprobs"] = [lp[tok].logprob for tok, lp in
                                        zip(o.outputs[0].token_ids, o.outputs[0].logprobs)]
                    item["margins"] = [_margin(tok, lp) for tok, lp in
                                       zip(o.outputs[0].token_ids, o.outputs[0].logprobs)]
                if plp:
                    item.update(_prompt_logprobs(prompts[i], o.prompt_logprobs, o.num_cached_tokens or 0))
                res["outputs"].append(item)
        _drain_in_process(llm)
        if spec.get("stats_file"):
            res["connector_stats"] = _last_stats(spec["stats_file"])
        out["phases"].append(res)
    if spec.get("log_stats"):
        out["metrics"] = {m.name: getattr(m, "value", None) for m in llm.get_metrics()
                          if hasattr(m, "value")}
    del llm
    return out


def _margin(token: int, logprobs: dict):
    """The generated token's log-probability minus the best other token's (of the two most
    likely, which vLLM returns beside the generated one); None when vLLM gave no other."""
    others = [v.logprob for k, v in logprobs.items() if k != token]
    return logprobs[token].logprob - max(others) if others else None


def _drain_in_process(llm, limit_s: float = 60.0) -> None:
    """With the engine core in this process nothing steps the engine between ``generate``
    calls, so requests whose KV the connector is still saving stay pending (their saves not yet
    reported): step until the scheduler holds no request, as the engine-core process's loop
    does on its own."""
    sched = getattr(getattr(getattr(llm.llm_engine, "engine_core", None), "engine_core", None),
                    "scheduler", None)
    if sched is None:     # (an engine-core process: it drains by itself)
        return
    deadline = time.monotonic() + limit_s
    while sched.has_requests() and time.monotonic() < deadline:
        llm.llm_engine.step()
        time.sleep(0.002)


def _handshake(path: str, limit_s: float = 600.0) -> None:
    """Between two phases: tell the test the engine is idle (``path + ".ready"``) and wait until
    it creates ``path`` (it may stop a server meanwhile, say)."""
    with open(path + ".ready", "w") as f:
        f.write(str(os.getpid()))
    deadline = time.monotonic() + limit_s
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {path} after {limit_s} s")
        time.sleep(0.05)


def _prompt_logprobs(tokens: list, plps, num_cached: int) -> dict:
    """Log-probabilities of the prompt's own tokens, one per position (``None`` for the first
    token). After a cache hit of ``num_cached`` tokens vLLM 0.32 still returns one entry per
    position, but only those it computed (from ``num_cached + 1`` on) hold values; the earlier
    ones are uninitialised memory and are dropped here."""
    start = num_cached + 1 if num_cached else 1
    plps = list(plps or [])
    vals = [None] * start + [plps[k][tokens[k]].logprob for k in range(start, len(plps))]
    return {"prompt_logprobs": vals, "prompt_logprobs_from": start}


def _last_stats(path: str, quiet_s: float = 0.3, limit_s: float = 10.0):
    """The worker connector's latest cumulative counters. The worker appends one JSON line per
    engine step, and vLLM may still be stepping when ``generate`` returns (finishing background
    saves), so a read can meet a line being written: only complete lines count, and the file is
    read once it has been quiet for ``quiet_s`` (at most ``limit_s``)."""
    deadline = time.monotonic() + limit_s
    size = -1
    while True:
        try:
            now = os.path.getsize(path)
        except OSError:
            now = -1
        if now == size or time.monotonic() > deadline:
            return _last_complete_line(path)
        size = now
        time.sleep(quiet_s)


def _last_complete_line(path: str):
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 65536))
            data = f.read()
    except OSError:
        return None
    for line in reversed(data.split(b"\n")[:-1]):  # the piece after the last newline is unfinished
        try:
            return json.loads(line)
        except ValueError:
            continue  # (the first line of the window may be cut)
    return None


def bind_in_process() -> None:
    """With vLLM's engine core in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) nobody
    binds the compute threads (vLLM does it when it starts a worker process): bind this
    thread, and the OpenMP threads it will start, as vLLM would, before torch starts them:
    ``VLLM_CPU_OMP_THREADS_BIND`` (a CPU list), else the CPUs vLLM's automatic binding takes
    (all but the last ``VLLM_CPU_NUM_OF_RESERVED_CPU``, default 1). ucm then places its
    background threads beside them, as in a worker process."""
    if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "1") != "0" or not hasattr(os, "sched_setaffinity"):
        return
    mask = os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "auto").strip()
    if mask == "nobind":
        return
    cpus = sorted(os.sched_getaffinity(0))
    if mask == "auto":
        reserved = int(os.environ.get("VLLM_CPU_NUM_OF_RESERVED_CPU", "1"))
        cpus = cpus[:max(1, len(cpus) - reserved)]
    else:
        from ucm.threads import parse_cpu_list

        cpus = sorted(parse_cpu_list(mask))
    os.environ["OMP_NUM_THREADS"] = str(len(cpus))
    os.sched_setaffinity(0, cpus)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    with open(argv[0]) as f:
        spec = json.load(f)
    # A fixed KV cache size (skips vLLM's memory-profiling pass). vLLM's default of one reserved
    # CPU stays: ucm's background saves run there (with none reserved they take compute time from
    # the OpenMP threads: +8-10% decode time on 2 cores, benchmarks/RESULTS.md).
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    os.environ.update({k: str(v) for k, v in (spec.get("env") or {}).items()})
    bind_in_process()
    result = run(spec)
    sys.stdout.write(json.dumps(result) + "\n")
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
