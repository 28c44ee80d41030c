"""The connector's scheduler side: pure bookkeeping, no data movement.

* ``get_num_new_matched_tokens``: hash the request's full blocks (chained, cached per request),
  ask the store how many blocks after vLLM's own prefix hit it holds; the last prompt token is
  always left to compute. When every full block hits, the prompt's partial last block (its
  "tail", stored under an id of its exact tokens) is looked up too: a repeated prompt then
  computes only its last token instead of up to ``block_size`` tokens
  (``connector.partial_tail``). A block counts as present only once every rank committed it
  (a save in flight is not a hit: a failed save would become a failed load, but it is not
  planned again either: another request reaching the same blocks before the first save lands,
  e.g. after vLLM evicted or preempted them, does not store them twice). Block ids follow
  :mod:`ucm.integration.vllm.keys`: LoRA adapter, ``cache_salt``, multimodal items and prompt
  embeds separate requests exactly as in vLLM's prefix cache, each rank stores its own shard,
  and ``reset_prefix_cache(reset_connector=True)`` raises the namespace's generation (stored
  with a posix tier, so it outlives the engine), which retires every block stored before;
* ``update_state_after_alloc``: remember which vLLM blocks to fill;
* ``build_connector_meta``: per step, the loads to run and the newly completed blocks to save
  (prompt and, by default, generated tokens), with chunked prefill and preemption handled
  through vLLM's per-step block tables;
* ``update_connector_output``: blocks whose load failed are saved again once recomputed;
* ``request_finished``: with background saves, vLLM keeps a finished request's blocks until the
  worker reports its saves done (see :mod:`ucm.integration.vllm.worker_save`).

:class:`ConnectorScheduler` takes vLLM's objects (requests, scheduler output) as they are; the
adapter :class:`ucm.integration.vllm.connector.UCMConnector` only forwards to it.
"""
from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any, Optional

import numpy as np

import ucm
from ucm import metrics as ucm_metrics
from ucm.config import Config, ConfigError
from ucm.ids import Namespace
from ucm.blend import chunks as blend_chunks
from ucm.blend.engine import LOOKAHEAD_TOKENS
from ucm.integration.vllm import keys, stores
from ucm.integration.vllm.records import Match, PlannedLoad, ReqState, Transfer
from ucm.murmur import murmur3_x64_128

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

log = logging.getLogger("ucm.integration.vllm")

# A planned save is taken as landing for this many scheduler steps: within them no request plans
# the same block again; after them a block the store still lacks (its save failed) may be saved
# again. Saves land within a few steps (the barrier after preemption, the async drain at finish).
SAVING_STEPS = 64

#: the ``kv_transfer_params`` keys ucm reads (its own keys all begin with ``ucm_``)
KNOWN_PARAMS = (blend_chunks.PARAM,)


def refuse_unreachable_store(cfg: Config, vllm_config, shape: keys.ParallelShape) -> None:
    """A store whose every tier lives in one process (``memory``) is empty for a scheduler
    whose workers run elsewhere (vLLM's multiprocess executor, the CPU default): refuse it
    rather than silently never hit."""
    from ucm.store.factory import pipeline_is_process_local

    try:
        local = pipeline_is_process_local(cfg["store.pipeline"])
    except ValueError:
        return  # (an unknown tier is reported when the store opens)
    backend = getattr(vllm_config.parallel_config, "distributed_executor_backend", None)
    beside = backend == "uni" or (backend == "external_launcher" and shape.world == 1)
    if local and not beside:
        raise ValueError(
            f"config key 'store.pipeline' = {cfg['store.pipeline']!r}: every tier keeps "
            f"its blocks inside the worker process, and this engine's workers run in other "
            f"processes (distributed_executor_backend={backend!r}, {shape.world} rank(s)), "
            f"so the scheduler could never see a stored block. Add a shared tier (e.g. "
            f"'memory|posix' with store.posix.roots) or run one worker in the engine's "
            f"process: --distributed-executor-backend uni, and on vLLM-CPU also "
            f"VLLM_ENABLE_V1_MULTIPROCESSING=0 (with multiprocessing on, vLLM-CPU turns uni "
            f"into mp)")


def quiet_engine_wait(cfg, vllm_config) -> None:
    """CPU engines: vLLM's engine core (this process) sleeps between checks for the
    worker's step result instead of spinning on the CPU ucm's background threads use."""
    poll_us = float(cfg["connector.engine_poll_us"])
    device = str(getattr(getattr(vllm_config, "device_config", None), "device_type", "") or "")
    if device != "cpu":
        return
    try:
        from ucm.integration.vllm import engine_wait

        if engine_wait.enable(poll_us):
            log.info("ucm: engine core polls its worker every %g us (pid %d)", poll_us, os.getpid())
    except Exception as exc:  # an optimisation only: never fail the engine for it
        log.warning("ucm: engine wait patch not applied (%r)", exc)


#: decoders whose layers ucm's Blend forward drives (ucm.integration.vllm.blend_hook)
BLEND_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
#: RoPE variants whose angle is position x a fixed frequency (a delta rotation is exact)
BLEND_ROPE_TYPES = (None, "default", "linear", "llama3")


def blend_available(cfg: Config, vllm_config, kv_transfer_config) -> bool:
    """Whether this engine can blend: a supported decoder and RoPE, the ``blend_model`` patch
    allowed (the worker needs the model), and failed loads recomputed (the fall back of a
    Blend the worker cannot run). Otherwise Blend requests are computed in full (logged once)."""
    from ucm.integration.patch import disabled

    why = None
    hf = getattr(getattr(vllm_config, "model_config", None), "hf_config", None)
    archs = list(getattr(hf, "architectures", None) or [])
    rope = getattr(hf, "rope_scaling", None) or getattr(hf, "rope_parameters", None) or {}
    rope_type = rope.get("rope_type", rope.get("type")) if isinstance(rope, dict) else "?"
    if not any(a in BLEND_ARCHITECTURES for a in archs):
        why = f"architecture {archs} (Blend drives {', '.join(BLEND_ARCHITECTURES)})"
    elif rope_type not in BLEND_ROPE_TYPES:
        why = f"RoPE scaling {rope_type!r} (a delta rotation is exact for plain, linear and " \
              f"llama3 RoPE only)"
    elif disabled():
        why = "UCM_DISABLE_PATCHES=1 (the worker cannot reach the model)"
    elif getattr(kv_transfer_config, "kv_load_failure_policy", None) != "recompute":
        why = "failed loads are not recomputed (connector.load_failure), so a Blend the " \
              "worker cannot run would fail its request"
    elif int(getattr(hf, "num_hidden_layers", 0) or 0) and \
            cfg["blend.check_layer"] >= int(hf.num_hidden_layers):
        raise ConfigError(f"config key 'blend.check_layer' = {cfg['blend.check_layer']}: the "
                         f"model has {hf.num_hidden_layers} layers")
    if why is not None:
        log.warning("ucm blend: off for this engine: %s; requests that mark chunks are computed "
                    "in full", why)
        return False
    return True


def blend_sink(cfg: Config, vllm_config) -> np.ndarray:
    """The tokens a chunk computed alone follows: the model's BOS token (``blend.sink``; none
    for ``none`` or a model whose config names no BOS), then ``blend.context``. A context id
    outside the model's vocabulary is a :class:`ConfigError`."""
    hf = getattr(getattr(vllm_config, "model_config", None), "hf_config", None)
    vocab = getattr(hf, "vocab_size", None)
    context = [int(t) for t in cfg["blend.context"]]
    if isinstance(vocab, int) and not isinstance(vocab, bool):
        bad = [t for t in context if t >= vocab]
        if bad:
            raise ConfigError(f"config key 'blend.context': token ids {bad[:8]} are outside the "
                              f"model's vocabulary of {vocab}")
    bos = getattr(hf, "bos_token_id", None)
    if cfg["blend.sink"] == "none":
        head = []
    elif isinstance(bos, bool) or not isinstance(bos, int) or bos < 0 or \
            (isinstance(vocab, int) and bos >= vocab):
        log.info("ucm blend: the model's config names no BOS token (bos_token_id %r); chunks "
                 "are computed as if they began the sequence%s", bos,
                 " after blend.context" if context else "")
        head = []
    else:
        head = [bos]
    return np.array(head + context, np.int64)


class ConnectorScheduler:
    """The scheduler side of one engine's connector (see the module doc).

    ``kv_transfer_config``: vLLM's, whose ``kv_load_failure_policy`` is set to ``recompute`` when
    ``connector.load_failure`` asks for it and vLLM could be patched."""

    def __init__(self, cfg: Config, ns: Namespace, shape: keys.ParallelShape, vllm_config,
                 kv_cache_config, kv_transfer_config, *, is_producer: bool, is_consumer: bool):
        self.cfg, self.ns, self.shape = cfg, ns, shape
        self.block_size = ns.block_size
        self.is_producer, self.is_consumer = is_producer, is_consumer
        refuse_unreachable_store(cfg, vllm_config, shape)
        if cfg["connector.load_failure"] == "recompute":
            # Storage faults are cache misses: vLLM must recompute failed blocks, not fail the
            # request (its default). The scheduler reads this right after creating us. vLLM
            # keeps a failed block in its prefix cache under that policy; the patch drops it.
            from ucm.integration.patch import apply_patch

            if apply_patch("evict_failed_loads"):
                kv_transfer_config.kv_load_failure_policy = "recompute"
            else:
                log.warning("ucm: vLLM could not be patched to drop blocks whose load failed "
                            "(UCM_DISABLE_PATCHES or an untested vLLM); a failed load fails its "
                            "request instead of being recomputed")
        quiet_engine_wait(cfg, vllm_config)
        self._reqs: dict[str, ReqState] = {}
        self._matched: dict[str, Match] = {}
        self._lookup_store = None
        self._block_bytes = stores.block_bytes_from_spec(kv_cache_config)
        self._kv_shape = stores.kv_shape(vllm_config, kv_cache_config) \
            if cfg["compression.enabled"] else None
        self._async = bool(cfg["connector.async_save"]) and not cfg["connector.layerwise"]
        self._tail = bool(cfg["connector.partial_tail"])
        self._prefetch = bool(cfg["connector.prefetch"])
        self._blend = bool(cfg["blend.enabled"]) and blend_available(cfg, vllm_config,
                                                                     kv_transfer_config)
        self._separator = list(cfg["blend.separator"])
        self._store_chunks = bool(cfg["blend.store_chunks"])
        self._in_context = cfg["blend.chunk_source"] == "context"
        self._sink = blend_sink(cfg, vllm_config) if self._blend else np.zeros(0, np.int64)
        self._max_len = int(getattr(getattr(vllm_config, "model_config", None), "max_model_len",
                                    0) or 0)
        self._arrived: dict = {}  # request id -> request, added since the last step (prefetch)
        self._warned_params: set = set()  # request ids warned of unknown ucm_* parameters
        # ids of partial tails live in their own namespace: a tail of t tokens is never
        # mistaken for a full block (and vice versa)
        self._tail_ns = murmur3_x64_128(ns.digest() + b"ucm-partial-tail-v1", 0)
        self._generation = 0
        # ids whose save is planned and not known done -> the step that planned it; a request's
        # ids leave when its saves are reported done (``_saves_done``), or SAVING_STEPS steps
        # after planning when no report comes
        self._saving: dict[bytes, int] = {}
        self._saving_of: dict[str, list] = {}   # request id -> the ids it planned to save
        self._step = 0
        self.metrics = ucm_metrics.Recorder()   # lookups (drained into vLLM's connector stats)
        ucm.hash_blocks(np.zeros(self.block_size, np.int64), ns)  # compile now, not per request
        try:  # open the store and compile its lookups now: the first request would pay ~0.2 s
            probe = np.zeros((1, 2), dtype=np.uint64)
            self._lookup().lookup(probe)
            self._lookup().lookup_prefix(probe)
            self._generation = self._lookup().generation()
        except Exception as exc:  # (every lookup then fails the same way: misses, logged)
            log.warning("ucm: the store is not ready for lookups (%r)", exc)

    def close(self) -> None:
        """Release the store this scheduler opened for its own lookups (if any)."""
        store, self._lookup_store = self._lookup_store, None
        if store is not None:
            stores.release(store)

    # lookups ----------------------------------------------------------------------------------
    def _lookup(self):
        """The store as seen from the scheduler: the one an in-process worker uses (so lookups
        see its memory tier), else this process's own view of the shared tiers."""
        store = stores.in_process(self.cfg, self.ns)
        if store is not None:
            return store
        if self._lookup_store is None:
            bb, shard = self._block_bytes
            self._lookup_store = stores.acquire(self.cfg, self.ns, bb, shard, self._kv_shape)
        return self._lookup_store

    def _present(self, ids: np.ndarray) -> np.ndarray:
        """Which blocks every rank has committed (bool ``[n]``)."""
        found = np.asarray(self._lookup().lookup(keys.all_rank_ids(ids, self.shape)), dtype=bool)
        return found.reshape(self.shape.world, len(ids)).all(axis=0)

    def _prefix_hits(self, ids: np.ndarray) -> int:
        """Length of the leading run of blocks every rank has committed."""
        store = self._lookup()
        n = len(ids)
        for r in range(self.shape.world):
            if n == 0:
                break
            n = min(n, int(store.lookup_prefix(keys.rank_ids(ids[:n], r, self.shape))))
        return n

    # requests ---------------------------------------------------------------------------------
    def _state(self, request: "Request") -> Optional[ReqState]:
        """The request's state (None: a request ucm cannot key, neither looked up nor saved)."""
        st = self._reqs.get(request.request_id)
        if st is None:
            if not keys.keyable(request):
                return None
            st = self._reqs[request.request_id] = ReqState(request)
        st.request = request
        return st

    def _hashes(self, st: ReqState, n_blocks: int) -> np.ndarray:
        """Ids of the request's first ``n_blocks`` full blocks (computed once)."""
        if st.chain is None or st.chain.generation != self._generation:
            st.chain = keys.RequestKeys(st.request, self.ns, self._generation, self._tail_ns)
        return st.chain.full(st.request, n_blocks)

    def _tail_id(self, st: ReqState, n_full: int, t: int) -> Optional[np.ndarray]:
        """Id of the ``t`` tokens after the request's first ``n_full`` full blocks (the full
        block ``n_full`` when ``t`` is the block size), or None when the request's partial
        blocks are not stored."""
        if t == self.block_size:
            return self._hashes(st, n_full + 1)[n_full]
        self._hashes(st, 0)
        return st.chain.tail(st.request, n_full, t)

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int
                                   ) -> tuple[Optional[int], bool]:
        if not self.is_consumer:
            return 0, False
        self._check_params(request)
        st = self._state(request)
        if st is None:
            return 0, False
        bs = self.block_size
        n_full = (request.num_tokens - 1) // bs  # the last token is always computed
        start = num_computed_tokens // bs
        if n_full < start:
            return 0, False
        hit, tail = start, None
        try:
            if n_full > start:
                hit = start + self._prefix_hits(self._hashes(st, n_full)[start:])
            t = request.num_tokens - n_full * bs  # tokens in the last block, 1..block_size
            if self._tail and hit == n_full and t >= 2:
                tid = self._tail_id(st, n_full, t)
                if tid is not None and self._present(tid[None])[0]:
                    tail = (tid, t)
        except Exception as exc:  # a store fault is a miss, never an engine failure
            log.warning("ucm: lookup failed (%r); treating as a miss", exc)
            hit, tail = start, None
        job = self._blend_job(st, request, hit) if self._blend and tail is None else None
        self._matched[request.request_id] = Match(num_computed_tokens, hit, tail, job)
        ext = (hit - start) * bs + (tail[1] - 1 if tail else 0)
        if job is not None and job.end > job.start:
            ext = job.end - num_computed_tokens
        log.debug("ucm: %s: %d tokens, %d local, store hit %d of %d blocks, tail %s",
                  request.request_id, request.num_tokens, num_computed_tokens, hit, n_full,
                  tail is not None)
        return ext, False

    def _check_params(self, request: "Request") -> None:
        """A ``ucm_*`` key of the request's ``kv_transfer_params`` that ucm does not know (a
        typo of ``ucm_blend``, say) is ignored with a warning, once per request (other
        connectors' keys are not ucm's business)."""
        params = getattr(request, "kv_transfer_params", None)
        if not isinstance(params, dict) or request.request_id in self._warned_params:
            return
        unknown = [k for k in params
                   if isinstance(k, str) and k.startswith("ucm_") and k not in KNOWN_PARAMS]
        if unknown:
            self._warned_params.add(request.request_id)
            shown = ", ".join(repr(k if len(k) <= 40 else k[:40] + "...") for k in unknown[:4])
            log.warning("ucm: request %s: unknown kv_transfer_params key(s) %s%s ignored (ucm "
                        "knows %s)", request.request_id, shown,
                        f" and {len(unknown) - 4} more" if len(unknown) > 4 else "",
                        ", ".join(KNOWN_PARAMS))

    def _blend_job(self, st: ReqState, request: "Request", hit: int):
        """The request's Blend (:mod:`ucm.blend.chunks`) after a prefix hit of ``hit`` blocks:
        which stored chunk blocks fill which positions, and which chunks to store; None when
        the request marks no chunks (or marks them wrongly: logged, served without Blend)."""
        if st.chain is None or st.chain.per_block:
            return None                    # (multimodal and prompt-embeds requests: no chunks)
        prompt = request.prompt_token_ids
        if prompt is None or request.num_output_tokens:
            return None
        try:
            spans, ratio = blend_chunks.parse_request(prompt, request.kv_transfer_params,
                                                      self._separator)
        except blend_chunks.ChunkSpecError as exc:
            log.warning("ucm blend: request %s: %s; served without Blend", request.request_id, exc)
            return None
        except Exception:   # a request's parameters are untrusted: whatever they make the
            # parser raise costs that request its Blend, never the scheduler step of all
            log.exception("ucm blend: request %s: its chunk marking could not be read (a "
                          "parser error, not the request's); served without Blend",
                          request.request_id)
            return None
        if not spans:
            return None
        longest = max(b - a for a, b in spans)
        if self._max_len and len(self._sink) + longest > self._max_len:
            # a chunk is computed at positions after the sink: they must exist in the model
            log.warning("ucm blend: request %s: a chunk of %d tokens after the %d sink tokens "
                        "(blend.sink, blend.context) passes max_model_len %d; served without "
                        "Blend", request.request_id, longest, len(self._sink), self._max_len)
            return None
        bs = self.block_size
        try:
            ids = [blend_chunks.chunk_ids(prompt[a:b], self.ns, st.chain.root, self._sink,
                                          self._in_context) for a, b in spans]
            stored = [self._prefix_hits(i) if len(i) else 0 for i in ids]
        except Exception as exc:  # a store fault: no Blend, the prompt is computed
            log.warning("ucm blend: chunk lookup failed (%r); served without Blend", exc)
            return None
        start = hit * bs
        end, runs = blend_chunks.plan_region(spans, start, request.num_tokens, bs, stored)
        pieces = [blend_chunks.Piece(ids[i][first:first + n].copy(), first, spans[i][0])
                  for i, first, n in runs]
        saves = []
        if self._store_chunks and self.is_producer:
            for (a, _), i, n in zip(spans, ids, stored):
                if n < len(i) and not self._planned(i[n:]).all():
                    saves.append(blend_chunks.ChunkSave(
                        np.asarray(prompt[a:a + len(i) * bs], dtype=np.int64), i.copy(), n,
                        a if self._in_context else -1))
        if not pieces and not saves:
            return None
        lo = max(end, request.num_tokens - LOOKAHEAD_TOKENS)
        return blend_chunks.BlendJob(request.request_id, start, end,
                                     np.asarray(prompt[start:end], dtype=np.int64), [],
                                     pieces, saves, ratio,
                                     np.asarray(prompt[lo:request.num_tokens], dtype=np.int64), lo,
                                     self._sink)

    def on_new_request(self, request: "Request") -> None:
        """A request joined the waiting queue. It is looked up when the step is built, and only
        if that step does not schedule it (then its load runs at once): the blocks the store
        holds for it become a prefetch hint to the workers."""
        if self._prefetch and self.is_consumer:
            self._arrived[request.request_id] = request

    def _prefetch_hints(self, scheduled_now: set) -> list:
        """Stored block ids of the requests that arrived since the last step and still wait."""
        hints = []
        for rid, request in self._arrived.items():
            if rid in scheduled_now:
                continue
            st = self._state(request)
            n_full = (request.num_tokens - 1) // self.block_size
            if st is None or n_full < 1:
                continue
            try:
                ids = self._hashes(st, n_full)
                hit = self._prefix_hits(ids)
            except Exception as exc:  # a hint is an optimisation: a fault costs nothing but it
                log.debug("ucm: prefetch lookup failed (%r)", exc)
                continue
            if hit:
                hints.append(ids[:hit])
        self._arrived.clear()
        return hints

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks",
                                 num_external_tokens: int) -> None:
        st = self._state(request)
        m = self._matched.pop(request.request_id, None) or Match(request.num_computed_tokens, 0)
        if st is not None:
            self._count_lookup(request, m, num_external_tokens)
        if st is not None and m.blend is not None:
            st.blend = m.blend  # (its chunk saves go out even when nothing is blended)
            if m.blend.end > m.blend.start:
                st.blended = True
        if st is not None and num_external_tokens > 0:
            start = m.local // self.block_size
            if m.blend is not None and m.blend.end > m.blend.start:
                end = m.hit  # the prefix hit loads as always; the region after it blends
            else:
                end = start + num_external_tokens // self.block_size
            partial = m.tail is not None and num_external_tokens % self.block_size
            if end > start or partial:
                st.load = PlannedLoad(start, end, m.tail[0] if partial else None)

    def _count_lookup(self, request, m: "Match", num_external_tokens: int) -> None:
        """One lookup's outcome as vLLM accepted it (counted once per allocation: vLLM asks
        ``get_num_new_matched_tokens`` again while a request waits for blocks)."""
        bs = self.block_size
        start = m.local // bs
        n_full = max(start, (request.num_tokens - 1) // bs)
        hit = num_external_tokens // bs
        r = self.metrics
        r.inc("ucm_lookups_total")
        r.inc("ucm_lookup_hit_blocks_total", hit)
        r.inc("ucm_lookup_miss_blocks_total", max(0, n_full - start - hit))
        r.inc("ucm_lookup_hit_tokens_total", num_external_tokens)
        r.inc("ucm_lookup_miss_tokens_total",
              max(0, request.num_tokens - m.local - num_external_tokens))

    # per step ---------------------------------------------------------------------------------
    def build_connector_meta(self, scheduler_output: "SchedulerOutput", meta):
        """Fill ``meta`` (a fresh ``UCMConnectorMetadata``) with the step's plan and return it."""
        self._step += 1
        if self._saving and self._step % 16 == 0:
            old = self._step - SAVING_STEPS
            self._saving = {k: v for k, v in self._saving.items() if v >= old}
            self._saving_of = {r: ks for r, ks in self._saving_of.items()
                               if any(k in self._saving for k in ks)}
        meta.idle = not getattr(scheduler_output, "total_num_scheduled_tokens", 1)
        # vLLM frees a preempted request's blocks at once and may hand them out in this very
        # step: saves still reading them must finish before the step writes the cache.
        meta.barrier = self._async and bool(getattr(scheduler_output, "preempted_req_ids", None))
        scheduled = scheduler_output.num_scheduled_tokens
        if self._arrived:
            now = {new.req_id for new in scheduler_output.scheduled_new_reqs}
            meta.prefetch = self._prefetch_hints(now)
        for new in scheduler_output.scheduled_new_reqs:
            st = self._reqs.get(new.req_id)
            if st is None:
                continue  # not cacheable or not seen by get_num_new_matched_tokens
            st.blocks = list(new.block_ids[0])
            st.known = max(st.known, new.num_computed_tokens // self.block_size)
            self._plan(st, meta, new.num_computed_tokens + scheduled.get(new.req_id, 0))
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            st = self._reqs.get(req_id)
            if st is None:
                continue
            new_blocks = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:  # after preemption: a whole new block table
                st.blocks = list(new_blocks[0]) if new_blocks else []
                meta.resumed.append(req_id)
            elif new_blocks:
                st.blocks.extend(new_blocks[0])
            self._plan(st, meta, cached.num_computed_tokens[i] + scheduled.get(req_id, 0))
        for t in meta.saves:
            st = self._reqs.get(t.req_id)
            if st is not None:
                st.saved = True
        if meta.loads or meta.saves:
            log.debug("ucm: step plan: load %d blocks, save %d blocks",
                      sum(len(t.blocks) for t in meta.loads), sum(len(t.blocks) for t in meta.saves))
        return meta

    def _plan(self, st: ReqState, meta, computed_after: int) -> None:
        bs = self.block_size
        if st.load is not None:
            a, b, tail = st.load.first, st.load.end, st.load.tail_id
            st.load = None
            ids = self._hashes(st, b)[a:b].copy() if b > a and len(st.blocks) >= b \
                else np.zeros((0, 2), np.uint64)
            blocks = st.blocks[a:b] if len(ids) else []
            if len(ids):
                st.known = max(st.known, b)
            is_tail = False
            if tail is not None and len(ids) == b - a and len(st.blocks) > b:
                is_tail = st.request.num_tokens - b * bs < bs  # else the full block b (see _tail_id)
                ids = np.concatenate([ids, tail[None]])
                blocks = blocks + [st.blocks[b]]
                if is_tail:
                    st.tail_done = True
                else:
                    st.known = max(st.known, b + 1)
            if len(ids):
                meta.loads.append(Transfer(st.request.request_id, ids, blocks, tail=is_tail))
        if st.blend is not None:
            job, st.blend = st.blend, None
            job.blocks = st.blocks[:-(-job.end // bs)] if job.end > job.start else []
            for cs in job.saves:
                self._mark_planned(cs.ids[cs.skip:], st.request.request_id)
            # chunks taken from the prompt's own prefill wait for the step that computes them
            st.chunk_saves = [cs for cs in job.saves if cs.start >= 0]
            job.saves = [cs for cs in job.saves if cs.start < 0]
            if job.end > job.start or job.saves:
                meta.blends.append(job)
        if st.chunk_saves:
            self._plan_chunk_saves(st, meta, computed_after)
        if not self.is_producer or st.blended:
            return  # (a blended request's KV is approximate: never stored under its prefix)
        limit = st.request.num_tokens if self.cfg["connector.save_generated"] \
            else st.request.num_prompt_tokens
        n_full = min(computed_after, limit) // bs
        n_full = min(n_full, len(st.blocks))
        if n_full > st.known:
            ids = self._hashes(st, n_full)
            todo = np.arange(st.known, n_full)
            todo = todo[~self._planned(ids[todo])]
            try:
                present = self._present(ids[todo]) if len(todo) else np.zeros(0, dtype=bool)
            except Exception:
                present = np.zeros(len(todo), dtype=bool)
            todo = todo[~present]
            if len(todo):
                meta.saves.append(Transfer(st.request.request_id, ids[todo].copy(),
                                           [st.blocks[k] for k in todo]))
                self._mark_planned(ids[todo], st.request.request_id)
            st.known = n_full
        prompt = st.request.num_prompt_tokens
        if self._tail and not st.tail_done and computed_after >= prompt:
            st.tail_done = True  # the prompt's partial last block, once its tokens are computed
            nf = (prompt - 1) // bs
            t = prompt - nf * bs
            if 2 <= t < bs and len(st.blocks) > nf:
                try:
                    tid = self._tail_id(st, nf, t)
                    if tid is not None and not self._planned(tid[None])[0] \
                            and not self._present(tid[None])[0]:
                        meta.saves.append(Transfer(st.request.request_id, tid[None].copy(),
                                                   [st.blocks[nf]], tail=True))
                        self._mark_planned(tid[None], st.request.request_id)
                except Exception as exc:
                    log.warning("ucm: tail lookup failed (%r); not saving it", exc)

    def _plan_chunk_saves(self, st: ReqState, meta, computed_after: int) -> None:
        """Send the request's pending in-context chunk saves whose tokens are in its cache once
        this step ran (a save-only :class:`~ucm.blend.chunks.BlendJob`): the worker takes their
        rows after the forward, unless a load into those blocks failed in the step."""
        bs = self.block_size
        ready, wait = [], []
        for cs in st.chunk_saves:
            end = cs.start + len(cs.ids) * bs
            (ready if end <= computed_after and len(st.blocks) * bs >= end else wait).append(cs)
        st.chunk_saves = wait
        if not ready:
            return
        for cs in ready:
            cs.blocks = list(st.blocks[cs.start // bs:-(-(cs.start + len(cs.ids) * bs) // bs)])
        meta.blends.append(blend_chunks.BlendJob(
            st.request.request_id, 0, 0, np.zeros(0, dtype=np.int64), [], [], ready,
            sink=self._sink))

    def _mark_planned(self, ids: np.ndarray, req_id: str) -> None:
        keys = [row.tobytes() for row in ids]
        for k in keys:
            self._saving[k] = self._step
        self._saving_of.setdefault(req_id, []).extend(keys)

    def _saves_done(self, req_id: str) -> None:
        """The request's saves are over (committed or failed): its ids are no longer in flight.
        A block saved and then evicted must be planned again by the next request that computes
        it, which the planning window alone would prevent for SAVING_STEPS steps (requests
        served one at a time would miss it for that long)."""
        for k in self._saving_of.pop(req_id, ()):
            self._saving.pop(k, None)

    def _planned(self, ids: np.ndarray) -> np.ndarray:
        """Which ids a recent step planned to save (bool ``[n]``)."""
        if not self._saving:
            return np.zeros(len(ids), dtype=bool)
        return np.fromiter((row.tobytes() in self._saving for row in ids), dtype=bool,
                           count=len(ids))

    def update_connector_output(self, connector_output) -> None:
        """Requests whose background saves the worker reports done leave the planned saves.
        Blocks whose load failed are recomputed by vLLM: they (and the blocks after them) are
        no longer known to be stored, so they are saved again once recomputed."""
        for req_id in getattr(connector_output, "finished_sending", None) or ():
            self._saves_done(req_id)
        bad = getattr(connector_output, "invalid_block_ids", None)
        if not bad:
            return
        for st in self._reqs.values():
            first = next((k for k, b in enumerate(st.blocks) if b in bad), None)
            if first is not None:
                if st.chain is not None and st.known > first:
                    for row in self._hashes(st, st.known)[first:]:
                        self._saving.pop(row.tobytes(), None)
                st.known = min(st.known, first)
                st.tail_done = False  # (the prompt's partial block comes after any full one)

    def reset_cache(self) -> bool:
        """``reset_prefix_cache(reset_connector=True)``: raise the namespace's generation, so
        that no block stored before is found again (by this engine or, with a tier that
        persists the generation, any engine opening the store later). False when the new
        generation could not be stored (this engine uses it anyway)."""
        self._generation += 1
        ok = True
        try:
            self._generation = self._lookup().set_generation(self._generation)
        except Exception as exc:
            log.error("ucm: reset_cache: the store could not record generation %d (%r); this "
                      "engine uses it, engines started later would not", self._generation, exc)
            ok = False
        for st in self._reqs.values():  # their ids are recomputed under the new generation
            st.chain, st.known, st.tail_done = None, 0, False
        self._matched.clear()
        self._saving.clear()
        self._saving_of.clear()
        log.info("ucm: connector cache reset: generation %d", self._generation)
        return ok

    def request_finished(self, request: "Request", block_ids: list[int]
                         ) -> tuple[bool, Optional[dict[str, Any]]]:
        st = self._reqs.pop(request.request_id, None)
        self._matched.pop(request.request_id, None)
        self._arrived.pop(request.request_id, None)
        self._warned_params.discard(request.request_id)
        # With background saves vLLM keeps the blocks until the worker reports the request's
        # saves done (get_finished); the worker tracks exactly the requests it got saves for.
        delayed = bool(self._async and st is not None and st.saved)
        if not delayed:   # its saves ran inside the steps (or there were none)
            self._saves_done(request.request_id)
        return delayed, None
