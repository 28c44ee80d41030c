"""Patch ``evict_failed_loads``: no request attends to a block whose load failed.

With ``kv_load_failure_policy="recompute"`` (the policy ucm asks for: storage faults are cache
misses), vLLM 0.32's ``Scheduler._handle_invalid_blocks`` rewinds the affected requests so that
they recompute from their first failed block, but leaves the failed blocks (and the blocks
computed after them in the same step, which attended to them) in its prefix cache. If the
request is aborted or preempted before it recomputes them, a later request with the same prefix
gets them as a cache hit and attends to garbage. And a second request that found such a block in
the prefix cache in the same step keeps counting it as computed, trusting the first request to
recompute it.

The patch wraps the method: before vLLM's own handling it notes, for every running request,
its first failed block among the blocks it counts as computed; afterwards it evicts those blocks
and every later block of those requests from the prefix cache (what vLLM does under the
``fail`` policy) and rewinds each such request to its first failed block, so each one
recomputes what it attends to. Requests are rewound only, never failed.

Applied by ``ucm.integration.patch()`` (vLLM's plugin hook) and by the connector's scheduler
half when it asks for the recompute policy; it checks the method's signature and the scheduler
attributes it uses, and reports itself unapplied on any other vLLM.
"""
from __future__ import annotations

import inspect
import logging

from ucm.integration.patch import register_patch

log = logging.getLogger("ucm.integration")

_NAME = "evict_failed_loads"
_MARK = "__ucm_evict_failed_loads__"


def _scheduler_cls():
    from vllm.v1.core.sched.scheduler import Scheduler

    return Scheduler


def _compatible(method) -> bool:
    try:
        params = list(inspect.signature(method).parameters)
    except (TypeError, ValueError):
        return False
    return params[:3] == ["self", "invalid_block_ids", "num_scheduled_tokens"]


def _wrap(original):
    def _handle_invalid_blocks(self, invalid_block_ids, num_scheduled_tokens):
        if not getattr(self, "recompute_kv_load_failures", False) or not invalid_block_ids \
                or len(self.kv_cache_config.kv_cache_groups) != 1:
            return original(self, invalid_block_ids, num_scheduled_tokens)
        bs = self.block_size
        rewind = []  # (request, index of its first failed block, its block ids)
        for request in self.running:
            (blocks,) = self.kv_cache_manager.get_block_ids(request.request_id)
            computed = request.num_computed_tokens - num_scheduled_tokens.get(request.request_id, 0)
            n = min(len(blocks), -(-computed // bs))
            first = next((k for k in range(n) if blocks[k] in invalid_block_ids), None)
            if first is not None:
                rewind.append((request, first, list(blocks)))
        affected = original(self, invalid_block_ids, num_scheduled_tokens)
        evict = set()
        for request, first, blocks in rewind:
            evict.update(blocks[first:])
            if request.num_computed_tokens > first * bs:
                request.num_computed_tokens = first * bs
            affected = set(affected) | {request.request_id}
        if evict:
            self.kv_cache_manager.evict_blocks(evict)
        return affected

    setattr(_handle_invalid_blocks, _MARK, original)
    _handle_invalid_blocks.__doc__ = original.__doc__
    return _handle_invalid_blocks


def _apply() -> None:
    cls = _scheduler_cls()
    current = cls.__dict__.get("_handle_invalid_blocks")
    if current is None or hasattr(current, _MARK) or not _compatible(current):
        return
    needed = ("_update_requests_with_invalid_blocks",)
    if not all(hasattr(cls, a) for a in needed):
        return
    from vllm.v1.core.kv_cache_manager import KVCacheManager

    if not hasattr(KVCacheManager, "evict_blocks"):
        return
    cls._handle_invalid_blocks = _wrap(current)


def _revert() -> None:
    cls = _scheduler_cls()
    current = cls.__dict__.get("_handle_invalid_blocks")
    if current is not None and hasattr(current, _MARK):
        cls._handle_invalid_blocks = getattr(current, _MARK)


def _check() -> bool:
    return hasattr(_scheduler_cls().__dict__.get("_handle_invalid_blocks"), _MARK)


register_patch(_NAME, _apply, _revert, _check)
