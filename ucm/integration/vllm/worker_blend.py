"""The worker's Blend path: stored chunk KV -> rotated -> blended into the paged cache, and chunks
computed alone -> the store. Imports nothing from vLLM (the model and the cache come as
adapters, see :mod:`ucm.integration.vllm.blend_hook`).

Per step, after the prefix loads (:meth:`WorkerBlend.run`, from ``start_load_kv``): for each
:class:`~ucm.blend.chunks.BlendJob`, the stored blocks of its chunks are read into a scratch
cache of the engine's own layout (the store's rows are the engine's block bytes), their keys are
rotated from their chunk positions to their positions in the request
(:func:`ucm.blend.ops.rope_rotate`) and :func:`ucm.blend.engine.blend_fill` fills the region.
A chunk block that fails to load only means more tokens recomputed. If the region cannot be
blended at all (no model, a model or cache Blend does not support, an error), its blocks are
reported as failed loads: vLLM computes them (a full prefill of the region), never wrong output.

After the forward (:meth:`WorkerBlend.store_chunks`, from ``wait_for_save``): each chunk the
store lacked is stored under its chunk ids. ``blend.chunk_source: context``: in the step whose
forward computed the chunk's last full block, its rows are gathered from the request's cache and
their keys rotated back to start at ``len(sink)`` (the positions a loader rotates from); a chunk
whose blocks took a failed load in that step is not stored (their content is not the prompt's).
``alone``: the chunk is computed again after the job's sink tokens
(:func:`ucm.blend.engine.chunk_fill`) in the scratch cache.
"""
from __future__ import annotations

import logging
import time
from typing import Callable, Optional

import numpy as np
import torch

import ucm
from ucm.blend.engine import BlendStats, blend_fill, chunk_fill
from ucm.integration.core import WorkerCore

log = logging.getLogger("ucm.integration.vllm")


def warm_up_ops(dtype: torch.dtype, device: torch.device) -> None:
    """Compile (or load from ucm's JIT cache) the Blend ops for the cache's dtype now, at the
    engine's start, not in the first Blend request: on CPU the first rotation took 0.5 s with
    the compiled code on disk and 3 s without it, added to that request's time to first token.
    A failure here only leaves the compile to the first request."""
    from ucm.blend import ops

    try:
        with torch.inference_mode():
            x = torch.zeros((1, 1, 2), dtype=dtype, device=device)
            ops.rope_rotate(x, torch.zeros(1, dtype=torch.int64, device=device),
                            torch.ones(1, dtype=torch.float32, device=device))
            ops.kv_deviation(x, x, x, x)
    except Exception as exc:  # (an op that cannot run here fails the same way in a request)
        log.debug("ucm blend: ops warm-up failed (%s); they compile on first use", exc)


class WorkerBlend:
    """Blend jobs of one worker. ``views``: per layer (the core's layout order) the cache's key
    and value views ``[num_blocks, block_size, Hkv, D]``; ``make_scratch(n)``: ``(layout,
    views)`` of an ``n``-block cache shaped like the engine's; ``model()``: the
    :class:`~ucm.blend.engine.BlendModel` (raises when Blend cannot run)."""

    def __init__(self, core: WorkerCore, views: list, block_size: int,
                 make_scratch: Callable[[int], tuple], model: Callable[[], object], *,
                 ratio: float, check_layer: int, on_failed: Callable[[list], None],
                 failed_now: Callable[[], frozenset] = frozenset):
        self.core, self.views, self.bs = core, views, block_size
        self._make_scratch, self._model_fn = make_scratch, model
        self.ratio, self.check_layer = ratio, check_layer
        self._on_failed, self._failed_now = on_failed, failed_now
        self._scratch: Optional[tuple] = None
        self._scratch_blocks = 0
        self._saves: list = []
        self._model = None
        self._ran = False  # a job ran since the last store_chunks (its counters are news)
        if views:
            warm_up_ops(views[0][0].dtype, views[0][0].device)

    def model(self):
        if self._model is None:
            self._model = self._model_fn()
            if not 0 <= self.check_layer < self._model.num_layers:
                raise ValueError(f"config key 'blend.check_layer' = {self.check_layer}: the "
                                 f"model has {self._model.num_layers} layers")
        return self._model

    def scratch(self, n: int) -> tuple:
        if self._scratch is None or self._scratch_blocks < n:
            size = max(n, 2 * self._scratch_blocks, 16)
            self._scratch = self._make_scratch(size)
            self._scratch_blocks = size
        return self._scratch

    # -- blending -------------------------------------------------------------------------------
    def run(self, jobs: list) -> None:
        self._ran = self._ran or bool(jobs)
        for job in jobs:
            if job.saves:
                self._saves.append(job)
            if job.end <= job.start:
                continue
            t0 = time.perf_counter()
            try:
                stats = self._blend(job)
            except Exception as exc:
                log.warning("ucm blend: request %s not blended (%s); vLLM computes its %d "
                            "tokens", job.req_id, exc, job.end - job.start)
                first = job.start // self.bs
                self._on_failed(list(job.blocks[first:]))
                self.core.metrics.inc("ucm_blend_failed_requests_total")
                continue
            m = self.core.metrics
            m.inc("ucm_blend_requests_total")
            m.inc("ucm_blend_tokens_total", stats.tokens)
            m.inc("ucm_blend_stored_tokens_total", stats.loaded)
            m.inc("ucm_blend_recomputed_tokens_total", stats.recomputed)
            m.observe("ucm_blend_seconds", time.perf_counter() - t0)

    def _load_pieces(self, job) -> tuple:
        """Read the job's stored chunk blocks into the scratch cache: per piece ``(scratch block
        of its first row, ok [n] bool)``."""
        core = self.core
        total = sum(len(p.ids) for p in job.pieces)
        layout, _ = self.scratch(total)
        ids = core.rank_ids(np.concatenate([p.ids for p in job.pieces]))
        buf = core.take_staging(total * core.block_bytes)
        rows = buf[:total * core.block_bytes].view(total, core.block_bytes)
        try:
            try:
                ok = core.store.wait(core.store.load(ids, 0, rows)).ok
            except Exception as exc:
                log.warning("ucm blend: chunk load failed (%r); those tokens are recomputed", exc)
                ok = np.zeros(total, dtype=bool)
            idx = torch.tensor([i if good else -1 for i, good in enumerate(ok)], dtype=torch.int64)
            if ok.any():
                ucm.scatter_blocks(layout, rows, idx.to(core.device))
        finally:
            core.staging.give(buf)
        out, at = [], 0
        for p in job.pieces:
            out.append((at, ok[at:at + len(p.ids)]))
            at += len(p.ids)
        m = core.metrics
        m.inc("ucm_blend_load_blocks_total", int(ok.sum()))
        m.inc("ucm_blend_load_failed_blocks_total", int((~ok).sum()))
        return out

    def _blend(self, job) -> BlendStats:
        from ucm.blend import ops

        model = self.model()
        bs, dev = self.bs, self.core.device
        P, E = job.start, job.end
        n = E - P
        placed = self._load_pieces(job)
        _, sviews = self._scratch
        mask = torch.zeros(n, dtype=torch.bool, device=dev)
        # per piece: region offsets of its usable tokens, their scratch slots and the rotation
        runs = []
        for p, (row0, ok) in zip(job.pieces, placed):
            j = np.arange(p.first * bs, (p.first + len(p.ids)) * bs)      # chunk token index
            pos = p.chunk_start + j                                        # request position
            good = np.repeat(ok, bs) & (pos >= P) & (pos < E)
            if not good.any():
                continue
            j, pos = j[good], pos[good]
            slot = row0 * bs + (j - p.first * bs)                          # scratch token slot
            off = torch.as_tensor(pos - P, device=dev)
            mask[off] = True
            runs.append((off, torch.as_tensor(slot, device=dev), p.chunk_start))
        runs.sort(key=lambda r: int(r[0][0]))       # (loaded rows go in position order)
        if runs:
            s = len(job.sink)                        # (stored keys sit at positions s + j)
            slots = torch.cat([slot for _, slot, _ in runs])
            deltas = torch.cat([torch.full((len(slot),), delta - s, dtype=torch.int64,
                                           device=dev) for _, slot, delta in runs])
            blk, row = slots // bs, slots % bs

        def loaded(layer: int):
            sk, sv = sviews[layer]     # (strided views: index them, a reshape would copy)
            return (ops.rope_rotate(sk[blk, row], deltas, model.inv_freq, neox=model.neox,
                                    rotary_dim=model.rotary_dim), sv[blk, row])

        from ucm.integration.vllm.blend_hook import PagedKV

        kv = PagedKV(self.views, job.blocks, bs)
        stats = BlendStats()
        with torch.inference_mode():
            after = torch.as_tensor(job.after, device=dev)
            after_pos = torch.arange(job.after_start, job.after_start + len(job.after), device=dev)
            blend_fill(model, kv, torch.as_tensor(job.tokens, device=dev), P, loaded, mask,
                       ratio=self.ratio if job.ratio is None else job.ratio,
                       check_layer=self.check_layer, stats=stats, lookahead=(after, after_pos))
        return stats

    # -- storing chunks -------------------------------------------------------------------------
    def store_chunks(self) -> bool:
        """Store the step's chunk saves' missing blocks (after the forward). True when a job ran
        since the last call."""
        jobs, self._saves = self._saves, []
        ran, self._ran = self._ran, False
        failed = self._failed_now() if jobs else frozenset()
        for job in jobs:
            for cs in job.saves:
                t0 = time.perf_counter()
                if cs.start >= 0 and failed.intersection(cs.blocks):
                    log.info("ucm blend: a chunk of %d tokens of request %s not stored: a load "
                             "into its blocks failed", len(cs.tokens), job.req_id)
                    self.core.metrics.inc("ucm_blend_chunk_save_failed_total")
                    continue
                try:
                    if cs.start >= 0:
                        self._store_from_context(cs, len(job.sink))
                    else:
                        self._store_chunk(cs, job.sink)
                except Exception as exc:
                    log.warning("ucm blend: chunk of %d tokens not stored (%r)", len(cs.tokens), exc)
                    self.core.metrics.inc("ucm_blend_chunk_save_failed_total")
                    continue
                self.core.metrics.inc("ucm_blend_chunk_saves_total")
                self.core.metrics.inc("ucm_blend_chunk_save_blocks_total", len(cs.ids) - cs.skip)
                self.core.metrics.inc("ucm_blend_chunk_save_seconds_total", time.perf_counter() - t0)
        return ran

    def _store_from_context(self, cs, offset: int) -> None:
        """The chunk's rows from the request's cache (blocks ``cs.skip`` on) into the scratch
        cache's blocks ``cs.skip`` on, keys rotated from request position ``cs.start + j`` to
        ``offset + j``; then dumped."""
        from ucm.blend import ops

        bs, dev = self.bs, self.core.device
        model = self.model()
        nblk = len(cs.ids)
        _, sviews = self.scratch(nblk)
        j = torch.arange(cs.skip * bs, nblk * bs, device=dev)           # chunk token index
        pos = cs.start + j                                               # request position
        table = torch.as_tensor(cs.blocks, dtype=torch.int64, device=dev)
        blk, row = table[pos // bs - cs.start // bs], pos % bs
        delta = torch.full((len(j),), offset - cs.start, dtype=torch.int64, device=dev)
        with torch.inference_mode():
            for (k, v), (sk, sv) in zip(self.views, sviews):
                sk[j // bs, j % bs] = ops.rope_rotate(k[blk, row], delta, model.inv_freq,
                                                      neox=model.neox,
                                                      rotary_dim=model.rotary_dim).to(sk.dtype)
                sv[j // bs, j % bs] = v[blk, row]
        self._dump_scratch(cs)

    def _store_chunk(self, cs, sink: np.ndarray) -> None:
        from ucm.integration.vllm.blend_hook import PagedKV

        core, bs = self.core, self.bs
        model = self.model()
        nblk = len(cs.ids)
        _, sviews = self.scratch(nblk)
        kv = PagedKV(sviews, range(nblk), bs)
        with torch.inference_mode():
            chunk_fill(model, kv, torch.as_tensor(cs.tokens, device=core.device),
                       torch.as_tensor(sink, dtype=torch.int64, device=core.device))
        self._dump_scratch(cs)

    def _dump_scratch(self, cs) -> None:
        """Dump the scratch cache's blocks ``cs.skip`` to ``len(cs.ids)`` under their ids."""
        core = self.core
        layout, _ = self._scratch
        nblk = len(cs.ids)
        todo = nblk - cs.skip
        buf = core.take_staging(todo * core.block_bytes)
        rows = buf[:todo * core.block_bytes].view(todo, core.block_bytes)
        try:
            idx = torch.arange(cs.skip, nblk, dtype=torch.int64, device=core.device)
            ucm.gather_blocks(layout, idx, rows)
            ids = core.rank_ids(cs.ids[cs.skip:])
            res = core.store.wait(core.store.dump(ids, 0, rows))
            core.store.commit(ids, res.ok)
        finally:
            core.staging.give(buf)
