"""Which store keys a vLLM request's blocks have: one rule for the scheduler and the workers.

A block's id is the chained hash of its tokens (:func:`ucm.hash_blocks`) under the engine's
namespace, with three more inputs:

* **the request's root** (the parent of its first block): the namespace's generation (raised by
  ``reset_prefix_cache(reset_connector=True)``) and the request-wide keys vLLM's own prefix cache
  uses: the LoRA adapter (name and path) and ``cache_salt``. Plain requests of generation 0
  keep the plain chain (no root), so stores written before generations existed stay valid;
* **per-block extra keys**: multimodal items (their identifier and offset in the block) and
  prompt-embeds digests, taken from vLLM's ``generate_block_hash_extra_keys`` exactly as its
  prefix cache takes them, mixed into the parent of the block they touch;
* **the rank**: every rank of a tensor/pipeline/context-parallel engine stores its own shard of
  a block, under the block's id XOR a salt of (rank, parallel shape). The scheduler asks for
  all ranks' keys (:func:`all_rank_ids`), a worker reads and writes its own (:func:`rank_ids`).

A vLLM whose ``generate_block_hash_extra_keys`` is missing or different cannot key multimodal
or prompt-embeds requests; those are then neither looked up nor saved (:func:`keyable`).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional

import numpy as np

import ucm
from ucm.ids import Namespace, derived_id
from ucm.murmur import murmur3_x64_128

log = logging.getLogger("ucm.integration.vllm")

try:  # vLLM's own rule for per-block extra keys (multimodal items, prompt embeds)
    from vllm.v1.core.kv_cache_utils import generate_block_hash_extra_keys as _vllm_extra_keys
except ImportError:  # pragma: no cover - another vLLM version
    _vllm_extra_keys = None

_REQUEST_WIDE = ("lora", "cache_salt")  # go into the root, not into each block


# -- ranks -----------------------------------------------------------------------------------

@dataclass(frozen=True)
class ParallelShape:
    """The ranks of one engine that each hold a shard of every block."""
    tp: int = 1
    pp: int = 1
    pcp: int = 1

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.pcp

    @classmethod
    def of(cls, vllm_config) -> "ParallelShape":
        pc = vllm_config.parallel_config
        return cls(int(getattr(pc, "tensor_parallel_size", 1) or 1),
                   int(getattr(pc, "pipeline_parallel_size", 1) or 1),
                   int(getattr(pc, "prefill_context_parallel_size", 1) or 1))


def worker_rank(vllm_config) -> int:
    """This worker's rank within its engine (vLLM's global rank without the data-parallel part:
    data-parallel engines hold the same KV and share blocks)."""
    return int(getattr(vllm_config.parallel_config, "rank", 0) or 0) % ParallelShape.of(vllm_config).world


def _rank_salt(rank: int, shape: ParallelShape) -> np.ndarray:
    tag = f"ucm-rank-v1:{rank}:tp{shape.tp}:pp{shape.pp}:pcp{shape.pcp}".encode()
    return np.frombuffer(murmur3_x64_128(tag, 0), dtype="<u8").astype(np.uint64)


def rank_ids(ids: np.ndarray, rank: int, shape: ParallelShape) -> np.ndarray:
    """The keys under which ``rank`` stores its shard of the blocks ``ids`` (the ids
    themselves for an engine of one rank)."""
    if shape.world <= 1:
        return ids
    if not 0 <= rank < shape.world:
        raise ValueError(f"rank {rank} is outside an engine of {shape.world} ranks")
    return ids ^ _rank_salt(rank, shape)


def all_rank_ids(ids: np.ndarray, shape: ParallelShape) -> np.ndarray:
    """Every rank's keys of ``ids``, rank-major: ``[world * n, 2]``."""
    if shape.world <= 1:
        return ids
    return np.concatenate([rank_ids(ids, r, shape) for r in range(shape.world)])


# -- requests --------------------------------------------------------------------------------

def _per_block_inputs(request) -> bool:
    return bool(getattr(request, "mm_features", None)) or getattr(request, "prompt_embeds", None) is not None


def keyable(request) -> bool:
    """Whether this vLLM lets ucm key the request exactly as vLLM's prefix cache does."""
    return _vllm_extra_keys is not None or not _per_block_inputs(request)


def request_root(request, ns: Namespace, generation: int) -> Optional[np.ndarray]:
    """Parent of the request's first block (None: the plain chain)."""
    wide = []
    lora = getattr(request, "lora_request", None)
    if lora:
        wide.append(("lora", str(lora.lora_name), str(getattr(lora, "lora_path", "") or "")))
    salt = getattr(request, "cache_salt", None)
    if salt:
        wide.append(("cache_salt", str(salt)))
    if not wide and not generation:
        return None
    return derived_id(np.frombuffer(ns.digest(), dtype="<u8"), b"ucm-root-v1\0", (int(generation), tuple(wide)))


class RequestKeys:
    """The ids of one request's blocks, computed as its tokens become known (cached)."""

    def __init__(self, request, ns: Namespace, generation: int, tail_ns: bytes):
        self.ns, self.tail_ns, self.generation = ns, tail_ns, generation
        self.root = request_root(request, ns, generation)
        self.per_block = _per_block_inputs(request)
        self.ids = np.zeros((0, 2), np.uint64)
        self._mm_idx = 0

    def _extras(self, request, first: int, end: int) -> list:
        """Per-block extra keys of blocks ``first..end-1`` (in order: vLLM's multimodal cursor
        moves forward only), without the request-wide ones."""
        if not self.per_block:
            return [None] * (end - first)
        bs, out = self.ns.block_size, []
        for k in range(first, end):
            keys, self._mm_idx = _vllm_extra_keys(request, k * bs, (k + 1) * bs, self._mm_idx)
            keys = tuple(x for x in (keys or ()) if not (isinstance(x, tuple) and x and x[0] in _REQUEST_WIDE))
            out.append(keys or None)
        return out

    def full(self, request, n_blocks: int) -> np.ndarray:
        """Ids of the request's first ``n_blocks`` full blocks."""
        have, bs = len(self.ids), self.ns.block_size
        if n_blocks <= have:
            return self.ids[:n_blocks]
        toks = request.all_token_ids
        extras = self._extras(request, have, n_blocks)
        parts = [self.ids]
        parent = self.ids[have - 1] if have else self.root
        k = have
        while k < n_blocks:
            if extras[k - have] is not None:
                parent = derived_id(parent, b"ucm-extra-v1\0", extras[k - have])
            j = k + 1  # blocks without extra keys continue the chain in one call
            while j < n_blocks and extras[j - have] is None:
                j += 1
            new = ucm.hash_blocks(np.asarray(toks[k * bs:j * bs], dtype=np.int64), self.ns, parent=parent)
            parts.append(new)
            parent = new[-1]
            k = j
        self.ids = np.concatenate(parts)
        return self.ids[:n_blocks]

    def tail(self, request, n_full: int, t: int) -> Optional[np.ndarray]:
        """Id of the ``t`` (< block size) tokens after the first ``n_full`` full blocks, or
        None for requests with per-block extra keys (their partial blocks are not stored)."""
        if self.per_block:
            return None
        bs = self.ns.block_size
        toks = np.asarray(request.all_token_ids[n_full * bs:n_full * bs + t], dtype=np.int64)
        parent = self.full(request, n_full)[n_full - 1] if n_full else self.root
        return ucm.hash_blocks(toks, self.tail_ns, block_size=t, parent=parent)[0]
