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
3. **Sparse decode** (with ``max_ppl_increase``): every sparse method at every ratio of
   :data:`SPARSE_RATIOS` decodes the last tokens of the sample requests long enough to be
   sparse (``min_blocks``), teacher-forced on the reference model (:mod:`ucm.reference.llama`,
   the weights of ``model``), against dense attention; the sparsest ratio whose perplexity
   change stays within the bound wins (ties: the smaller change). None within it: dense.
4. **Block size**: the sample requests hashed at each of :data:`BLOCK_SIZES` the engine's
   attention takes (:func:`engine_block_sizes`: multiples of 32 on vLLM-CPU) and
   replayed at the same memory budget, with the tiers' load time measured on blocks of each
   size and the prefill time per token measured on the reference model; the size that saves
   the most prefill time wins. The choice is an engine setting (vLLM's ``block_size``):
   :attr:`AutoTuner.engine_args` and the report carry it, and the TTFT stage runs with it.
5. **TTFT** (``measure_vllm=True``): vLLM engines (``ucm.demo.engine``, vLLM-CPU here) with the
   tuned configuration and with the workload's nearest preset held to the same memory budget
   serve the sample requests one at a time; the tuned configuration is kept only if its mean
   TTFT is not worse, and ``max_latency_ms`` is checked against it.

Constraints: ``max_memory_gb`` (the memory tier's pool; held to half the memory this machine
has available, with a note in the report, where it is larger), ``max_disk_gb`` (0: no disk tier;
absent: a disk tier under ``cache_capacity``'s default), ``max_latency_ms`` (mean TTFT of the
sample requests), ``max_ppl_increase`` (percent perplexity change of sparse decode against
dense; absent: decode stays dense). A constraint that cannot be met is named in a
:class:`TuneError`.
"""
from __future__ import annotations

import json
import math
import numbers
import os
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Optional, Sequence

import numpy as np

from ucm.config import PRESETS, Config
from ucm.store.factory import pipeline_is_process_local

WORKLOAD_PRESET = {"chat": "realtime_chat", "batch": "batch", "long_context": "high_quality"}
CONSTRAINTS = ("max_latency_ms", "max_memory_gb", "max_disk_gb", "max_ppl_increase")
#: sparse methods and ratios the sparse stage measures (the harness baselines are not deployable)
SPARSE_METHODS = ("esa", "quest", "mass", "kvstar", "gsa", "adaptive")
SPARSE_RATIOS = (0.7, 0.5, 0.3, 0.2)
#: tokens per KV block the block-size stage compares, where the engine's attention takes them
#: (vLLM-CPU's attention needs a multiple of 32, FlashAttention a multiple of 16)
BLOCK_SIZES = (16, 32, 64, 128)


def engine_block_sizes(device: Optional[str] = None) -> tuple:
    """The sizes of :data:`BLOCK_SIZES` the engine on ``device`` (default: CUDA when present,
    else CPU) can run."""
    if device is None:
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    step = 32 if device == "cpu" else 16
    return tuple(b for b in BLOCK_SIZES if b % step == 0)


#: the largest share of the machine's available memory the tuner gives the memory tier: the
#: engine's weights, its own KV cache and the process need the rest
MEMORY_SHARE = 0.5


def machine_memory_bytes() -> Optional[int]:
    """Memory available to a new allocation on this machine (``MemAvailable`` of
    ``/proc/meminfo``; elsewhere the physical memory), or None where neither is known."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return int(os.sysconf("SC_PHYS_PAGES")) * int(os.sysconf("SC_PAGE_SIZE"))
    except (AttributeError, ValueError, OSError):
        return None


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
    def count(key, value):  # a positive whole number (a KV block of 0 or -1 bytes is no shape)
        if isinstance(value, bool) or not isinstance(value, (int, float)) \
                or value != value or value in (math.inf, -math.inf) or value != int(value) \
                or value < 1:
            raise TuneError(f"model {path!r}: config.json {key}={value!r}: expected an int >= 1")
        return int(value)

    try:
        layers = count("num_hidden_layers", cfg["num_hidden_layers"])
        heads = count("num_attention_heads", cfg["num_attention_heads"])
        kv_heads = count("num_key_value_heads", cfg.get("num_key_value_heads", heads))
        head_dim = count("head_dim", cfg["head_dim"]) if cfg.get("head_dim") else \
            count("hidden_size // num_attention_heads",
                  count("hidden_size", cfg["hidden_size"]) // heads)
    except (KeyError, TypeError) as exc:
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
        try:
            toks = np.asarray(p)
        except (TypeError, ValueError) as exc:
            raise TuneError(f"sample_requests[{i}]: expected a list of token ids ({exc})") from None
        if toks.ndim != 1 or (len(toks) and toks.dtype.kind not in "iu"):
            raise TuneError(f"sample_requests[{i}]: expected a list of token ids (ints), got "
                            f"{'a ' + str(toks.ndim) + '-d array' if toks.ndim != 1 else toks.dtype}")
        if len(toks) and (int(toks.min()) < 0 or int(toks.max()) >= 2**32):
            raise TuneError(f"sample_requests[{i}]: token ids must lie in [0, 2**32), got "
                            f"{int(toks.min())}..{int(toks.max())}")
        toks = toks.astype(np.int64)
        if len(toks) < block_size:
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
                 progress: bool = True, tune_block_size: bool = True, sparse_samples: int = 4,
                 sparse_tokens: int = 16):
        if not isinstance(workload, str) or workload not in WORKLOAD_PRESET:
            raise TuneError(f"workload {workload!r}: expected one of {', '.join(WORKLOAD_PRESET)}")
        if constraints is not None and not isinstance(constraints, Mapping):
            raise TuneError(f"constraints: expected a dict of {', '.join(CONSTRAINTS)}, got "
                            f"{type(constraints).__name__}")
        constraints = dict(constraints or {})
        for key, value in constraints.items():
            if key not in CONSTRAINTS:
                raise TuneError(f"constraint {key!r}: expected one of {', '.join(CONSTRAINTS)}")
            try:  # (an int past the floats, 10**400, is no finite bound either)
                finite = math.isfinite(value)
            except (TypeError, OverflowError):
                finite = False
            if isinstance(value, bool) or not isinstance(value, numbers.Real) \
                    or not finite or value < 0:
                raise TuneError(f"constraint {key}={value!r}: expected a finite number >= 0")
            constraints[key] = float(value) if not isinstance(value, int) else value
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
            raise TuneError(f"block_size={block_size!r}: expected an int >= 1 (tokens per block)")
        if "max_latency_ms" in constraints and not measure_vllm:
            raise TuneError(f"max_latency_ms={constraints['max_latency_ms']} cannot be checked "
                            f"without the TTFT stage: it needs measure_vllm=True (drop --no-vllm)")
        if constraints.get("max_memory_gb", 1) == 0 and constraints.get("max_disk_gb", 1) == 0:
            raise TuneError("max_memory_gb=0 and max_disk_gb=0 contradict: no tier could hold a "
                            "block, so nothing could be reused")
        if constraints.get("max_ppl_increase", 1) == 0:
            raise TuneError("max_ppl_increase=0 allows no change at all: leave it out to keep "
                            "decode dense")
        if constraints.get("max_latency_ms", 1) == 0:
            raise TuneError("max_latency_ms=0 cannot be met: a first token takes time")
        self.workload, self.constraints = workload, constraints
        self.block_size, self.dtype = block_size, dtype
        self.measure_vllm, self.progress = measure_vllm, progress
        self.tune_block_size = tune_block_size
        self.sparse_samples, self.sparse_tokens = sparse_samples, sparse_tokens
        self.stages: list[Stage] = []
        #: what the tuner had to decide beyond the measurements (a constraint held to the machine)
        self.notes: list[str] = []
        #: engine settings the tuner chose beside the ucm configuration (vLLM's ``block_size``)
        self.engine_args: dict = {"block_size": block_size}
        self.candidate_block_sizes: dict = {}
        self._llama = None
        self.preset = WORKLOAD_PRESET[workload]

    # -- stages ---------------------------------------------------------------------------------
    def _memory_bytes(self, block_bytes: int) -> int:
        """The memory tier's byte budget: ``max_memory_gb`` (or the preset's pool at the default
        block size), at most :data:`MEMORY_SHARE` of the memory this machine has available.
        ``max_memory_gb`` is a ceiling, not a request: a pool the machine cannot allocate would
        make the tuned configuration fail when an engine starts, so a larger one is held to what
        is there and the report says so."""
        gb = self.constraints.get("max_memory_gb")
        if gb is None:
            want = PRESETS[self.preset].get("buffer_number", Config()["buffer_number"]) * block_bytes
        else:
            want = int(gb * 2**30)
        have = machine_memory_bytes()
        if have is None or want <= MEMORY_SHARE * have:
            return want
        cap = int(MEMORY_SHARE * have)
        asked = f"max_memory_gb={gb}" if gb is not None else f"the {self.preset} preset's pool"
        note = (f"{asked}: this machine has {have / 2**30:.1f} GiB available; the memory tier "
                f"is held to {cap / 2**30:.1f} GiB ({MEMORY_SHARE:.0%} of it, the rest left to "
                f"the engine)")
        if note not in self.notes:       # (every stage asks for the budget)
            self.notes.append(note)
        return cap

    def _capacity(self, block_bytes: int) -> int:
        gb = self.constraints.get("max_memory_gb")
        slots = self._memory_bytes(block_bytes) // block_bytes
        if gb is None:
            return slots
        if slots < 1 and self.constraints.get("max_disk_gb", 1) == 0:
            raise TuneError(f"max_memory_gb={gb} is less than one KV block ({block_bytes} bytes) "
                            f"and max_disk_gb=0: no tier could hold a block")
        return slots

    def _check_disk(self, block_bytes: int) -> None:
        """A disk budget of less than one block holds nothing (0, not a sliver, means none)."""
        disk_gb = self.constraints.get("max_disk_gb")
        if disk_gb and int(disk_gb * 2**30) < block_bytes:
            raise TuneError(f"max_disk_gb={disk_gb} is less than one KV block ({block_bytes} "
                            f"bytes): no block could be stored on disk (max_disk_gb=0: no disk "
                            f"tier)")

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

    def _reference_model(self, model: str):
        from ucm.reference.llama import Llama

        if self._llama is None:
            weights = os.path.join(str(model), "model.safetensors")
            if not os.path.exists(weights):
                raise TuneError(f"model {model!r}: no model.safetensors; the sparse stage "
                                f"(max_ppl_increase) runs the model's weights")
            try:
                self._llama = Llama.load(str(model))
            except (OSError, KeyError, ValueError, RuntimeError) as exc:
                raise TuneError(f"model {model!r}: the reference Llama forward cannot load it "
                                f"({exc!r}); the sparse stage needs a Llama-architecture model") from None
        return self._llama

    def _sparse_stage(self, model: str, prompts: list, base: dict) -> Stage:
        """Perplexity change of each (method, ratio) against dense on the sample requests."""
        import torch

        import ucm.sparse
        from ucm.progress import bar
        from ucm.reference.llama import run_continuation

        st = Stage("sparse decode")
        bound = float(self.constraints["max_ppl_increase"])
        cfg = Config(base)
        T, bs = self.sparse_tokens, self.block_size
        need = cfg["min_blocks"] * bs + T + 1
        long = [list(map(int, p)) for p in prompts if len(p) >= need][:self.sparse_samples]
        if not long:
            st.choice = {"sparse_method": "none", "why": f"no sample request has the {need} tokens "
                         f"(min_blocks={cfg['min_blocks']} blocks of {bs} + {T} decoded) that "
                         f"sparse decode needs"}
            self.stages.append(st)
            return st
        llama = self._reference_model(model)
        top = max(max(p) for p in long)
        if top >= llama.vocab_size:
            raise TuneError(f"sample_requests: token id {top} is outside the model's vocabulary "
                            f"({llama.vocab_size})")
        shape = dict(num_layers=llama.num_layers, num_q_heads=llama.num_q_heads,
                     num_kv_heads=llama.num_kv_heads, head_dim=llama.head_dim, block_size=bs)
        keys, unusable = [], {}
        for m in SPARSE_METHODS:   # a method this model's shape rules out is reported, not run
            try:
                ucm.sparse.create(cfg, method=m, **shape)
                keys += [(m, r) for r in SPARSE_RATIOS]
            except ValueError as exc:
                unusable[m] = str(exc)
        keys.sort(key=lambda k: -k[1])
        nll = {k: [] for k in keys}
        agree = {k: [] for k in keys}
        dense_nll: list = []
        with bar(len(long), "tune: sparse decode", "request", quiet=not self.progress) as pb:
            for p in long:
                n = len(p)
                context, cont = p[:n - T - 1], p[n - T - 1:n - 1]
                targets = torch.tensor(p[n - T:])[:, None]
                rows = [None] + [ucm.sparse.create(dict(cfg.to_dict(), sparse_ratio=r), method=m,
                                                   **shape) for m, r in keys]
                res = run_continuation(llama, context, cont, rows, block_size=bs,
                                       measure_mass=False)
                dense_nll += (-torch.log_softmax(res.dense_logits, -1).gather(1, targets)[:, 0]).tolist()
                top1 = res.dense_logits.argmax(-1)
                for i, k in enumerate(keys, start=1):
                    lp = torch.log_softmax(res.logits[i], -1)
                    nll[k] += (-lp.gather(1, targets)[:, 0]).tolist()
                    agree[k] += (res.logits[i].argmax(-1) == top1).float().tolist()
                pb.update(1)
        dense = math.exp(float(np.mean(dense_nll)))
        for m, r in keys:
            change = 100 * (math.exp(float(np.mean(nll[m, r]))) / dense - 1)
            st.rows.append(dict(method=m, ratio=r, ppl_change_pct=change,
                                top1_agreement=float(np.mean(agree[m, r])),
                                steps=len(nll[m, r]), within=change <= bound, note=""))
        for m, why in unusable.items():
            st.rows += [dict(method=m, ratio=r, ppl_change_pct=float("nan"),
                             top1_agreement=float("nan"), steps=0, within=False, note=why)
                        for r in SPARSE_RATIOS]
        ok = [r for r in st.rows if r["within"]]
        if ok:
            best = min(ok, key=lambda r: (r["ratio"], r["ppl_change_pct"]))
            st.choice = {"sparse_method": best["method"], "sparse_ratio": best["ratio"]}
        else:
            st.choice = {"sparse_method": "none", "why": f"no method keeps the perplexity change "
                         f"within {bound}% at ratio {max(SPARSE_RATIOS)}"}
        self.stages.append(st)
        return st

    def _prefill_s_per_token(self, model: str, prompts: list) -> tuple:
        """Prefill seconds per token of the reference model on this machine (its weights), or
        the replay's default when the model folder has no weights."""
        from ucm.replay import Costs

        if not os.path.exists(os.path.join(str(model), "model.safetensors")):
            return Costs().prefill_s_per_token, "default (no weights to measure)"
        llama = self._reference_model(model)
        p = [int(t) % llama.vocab_size for t in max(prompts, key=len)][:512]
        llama.forward(p[:32], logits_from=len(p[:32]) - 1)   # warm up
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            llama.forward(p, logits_from=len(p) - 1)
            times.append(time.perf_counter() - t0)
        return float(np.median(times)) / len(p), f"measured (reference model, {len(p)} tokens)"

    def _block_stage(self, model: str, prompts: list, shape: "ModelShape", values: dict) -> Stage:
        """Prefill time saved on the sample requests at each block size, same memory budget."""
        from ucm import replay as rp

        st = Stage("block size")
        pf, how = self._prefill_s_per_token(model, prompts)
        mem_bytes = self._memory_bytes(shape.kv_bytes_per_token * self.block_size)
        tiers = values["store.pipeline"]
        for bs in engine_block_sizes():
            block_bytes = shape.kv_bytes_per_token * bs
            slots = mem_bytes // block_bytes
            try:
                trace = requests_to_trace(prompts, bs)
            except TuneError:
                continue                              # no prompt has a full block of this size
            if tiers != "posix" and slots < 1:
                continue                              # not one block of this size fits in memory
            lower = None
            if "posix" in tiers:
                gb = self.constraints.get("max_disk_gb")
                lower = trace.distinct_blocks if gb is None else max(1, int(gb * 2**30) // block_bytes)
            costs = rp.measure_costs(block_bytes, n_blocks=max(4, min(32, (64 << 20) // block_bytes)),
                                     rounds=3, prefill_s_per_token=pf)
            if tiers == "posix":  # one LRU tier of the disk's capacity, at the disk's load time
                r = rp.replay(trace, lower, "lru", costs=rp.Costs({"memory": costs.load_s["posix"]},
                                                                  pf),
                              kv_bytes_per_token=shape.kv_bytes_per_token)
            else:
                r = rp.replay(trace, slots, values["store.memory.policy"], tiers=tiers,
                              lower_capacity=lower, admission=values["store.admission"],
                              costs=costs, kv_bytes_per_token=shape.kv_bytes_per_token)
            st.rows.append(dict(block_size=bs, memory_blocks=int(slots),
                                token_hit_rate=r.token_hit_rate,
                                load_ms_per_block=1e3 * max(costs.load_s.get(t, 0.0)
                                                            for t in tiers.split("|")),
                                prefill_ms_per_token=1e3 * pf, prefill_saved_s=r.prefill_saved_s))
        if st.rows:  # the most prefill time saved; ties: the default size
            st.choice = dict(max(st.rows, key=lambda r: (round(r["prefill_saved_s"], 6),
                                                         r["block_size"] == self.block_size)))
            st.choice["prefill_cost"] = how
        else:
            st.choice = {"block_size": self.block_size, "why": "no block size fits a sample "
                         "request and the memory budget"}
        self.stages.append(st)
        return st

    def _ttft_stage(self, model: str, candidates: dict, prompts: list) -> Stage:
        st = Stage("ttft")
        for name, ttft in compare_ttft(model, candidates, prompts, dtype=self.dtype,
                                       block_size=self.block_size, progress=self.progress,
                                       block_sizes=self.candidate_block_sizes).items():
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
        try:  # (a generator would be spent by the first stage and leave the others nothing)
            sample_requests = list(sample_requests) if sample_requests is not None else []
        except TypeError:
            raise TuneError(f"sample_requests: expected a list of prompts (token ids), got "
                            f"{type(sample_requests).__name__}") from None
        if not sample_requests:
            raise TuneError("sample_requests: at least one prompt (token ids) is needed")
        shape = model_shape(model, self.dtype)
        block_bytes = shape.kv_bytes_per_token * self.block_size
        self.notes = []
        slots = self._capacity(block_bytes)
        self._check_disk(block_bytes)
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
        if "max_ppl_increase" in self.constraints:
            sp = self._sparse_stage(model, list(sample_requests), {**preset, **values}).choice
            values.update({k: sp[k] for k in ("sparse_method", "sparse_ratio") if k in sp})
        self.engine_args = {"block_size": self.block_size}
        if self.tune_block_size:
            bs = int(self._block_stage(model, list(sample_requests), shape, values)
                     .choice["block_size"])
            self.engine_args["block_size"] = bs
            if bs != self.block_size and "buffer_number" in values:   # the same bytes in memory
                values["buffer_number"] = max(1, self._memory_bytes(block_bytes)
                                              // (shape.kv_bytes_per_token * bs))
        tuned = {**preset, **values}
        self.candidates = {"tuned": tuned, f"preset {self.preset}": preset}
        self.candidate_block_sizes = {"tuned": self.engine_args["block_size"]}
        if self.measure_vllm:
            res = self._ttft_stage(model, self.candidates, list(sample_requests))
            by = {r["config"]: r for r in res.rows}
            if by["tuned"]["mean_ttft_ms"] > by[f"preset {self.preset}"]["mean_ttft_ms"]:
                tuned = preset  # measured worse: keep the preset
                self.engine_args = {"block_size": self.block_size}
            bound = self.constraints.get("max_latency_ms")
            best = min(r["mean_ttft_ms"] for r in res.rows)
            if bound is not None and best > bound:
                raise TuneError(f"max_latency_ms={bound} cannot be met: the best configuration "
                                f"measured a mean TTFT of {best:.0f} ms on the sample requests")
        if pipeline_is_process_local(Config(tuned)["store.pipeline"]):
            # every block lives in the worker's process: the scheduler sees them only when the
            # worker runs in the engine core's process (the connector refuses the store else)
            self.engine_args["distributed_executor_backend"] = "uni"
            self.notes.append("store.pipeline 'memory' keeps the blocks inside the worker "
                              "process: run vLLM with --distributed-executor-backend uni, and "
                              "on vLLM-CPU with VLLM_ENABLE_V1_MULTIPROCESSING=0 as well (as "
                              "the TTFT stage does; vLLM-CPU turns uni into mp otherwise), or "
                              "the connector refuses the store")
        self.chosen = tuned
        return Config(tuned)

    # -- report ---------------------------------------------------------------------------------
    def report_markdown(self) -> str:
        lines = [f"# ucm tune: workload {self.workload}, constraints {self.constraints}", ""]
        lines += [f"- {n}" for n in self.notes] + ([""] if self.notes else [])
        for st in self.stages:
            lines += [f"## {st.name}", ""]
            if st.rows:
                cols = [c for c in st.rows[0] if c != "hits_per_tier"]
                lines.append("| " + " | ".join(cols) + " |")
                lines.append("|" + "---|" * len(cols))
                for r in st.rows:
                    lines.append("| " + " | ".join(_fmt(r[c]) for c in cols) + " |")
            lines += ["", f"chosen: {st.choice}", ""]
        lines += ["## configuration", "", "```", json.dumps(self.chosen, indent=1), "```", "",
                  f"engine settings: {self.engine_args}", ""]
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
            elif st.name == "sparse decode":
                for m in SPARSE_METHODS:
                    rows = [r for r in st.rows if r["method"] == m]
                    ax.plot([r["ratio"] for r in rows], [r["ppl_change_pct"] for r in rows],
                            marker="o", label=m)
                if st.rows:
                    ax.axhline(self.constraints["max_ppl_increase"], color="k", ls="--", lw=0.8)
                    ax.legend(fontsize=7)
                ax.set_xlabel("sparse_ratio")
                ax.set_ylabel("perplexity change (%)")
            elif st.name == "block size":
                ax.bar([str(r["block_size"]) for r in st.rows],
                       [r["prefill_saved_s"] for r in st.rows])
                ax.set_xlabel("tokens per block")
                ax.set_ylabel("prefill time saved (s, modelled)")
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
                 block_size: int = 32, progress: bool = False,
                 block_sizes: Optional[dict] = None) -> dict:
    """TTFT lists of each candidate configuration on the same prompts (``block_sizes``: a
    candidate's own engine block size, default ``block_size``). Engines run side by side,
    each bound to its own CPU: as many at once as there are CPUs beyond the first (left to the
    rest of the machine), or one per CPU on a machine of two or fewer."""
    from concurrent.futures import ThreadPoolExecutor

    from ucm.progress import bar

    cpus = sorted(os.sched_getaffinity(0))
    lanes = max(1, len(cpus) - 1) if len(cpus) > 2 else len(cpus)
    names = list(candidates)
    out: dict = {}
    with bar(len(names), "tune: vLLM TTFT", "engine", quiet=not progress) as pb, \
            ThreadPoolExecutor(lanes) as ex:
        futs = {n: ex.submit(measure_ttft, model, candidates[n], prompts, dtype=dtype,
                             block_size=(block_sizes or {}).get(n, block_size),
                             cpu=str(cpus[i % lanes]))
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
