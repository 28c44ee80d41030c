"""Plain records of the vLLM connector: what the scheduler side plans, what the worker's load and
save paths carry between threads. Nothing here imports vLLM.

Conventions: store ids are ``uint64 [n, 2]``; vLLM block numbers are Python ints; a "tail" is a
prompt's partial last block, stored under an id of its exact tokens.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, Optional, Union

import numpy as np


# ---------------------------------------------------------------------------------------------
# scheduler -> worker, once per step

@dataclass
class Transfer:
    """Blocks of one request: store ids ``uint64 [n, 2]`` and vLLM block numbers ``[n]``.
    ``tail``: the last entry is the prompt's partial last block (a "tail")."""
    req_id: str
    ids: np.ndarray
    blocks: list
    tail: bool = False


def concat(transfers: list) -> tuple[np.ndarray, list, np.ndarray]:
    """(ids, vLLM blocks, which entries are partial tails) of several transfers."""
    ids = np.concatenate([t.ids for t in transfers]) if transfers else np.zeros((0, 2), np.uint64)
    blocks = [b for t in transfers for b in t.blocks]
    ends = np.cumsum([len(t.blocks) for t in transfers], dtype=np.int64)
    is_tail = np.zeros(len(blocks), dtype=bool)
    is_tail[[e - 1 for e, t in zip(ends, transfers) if t.tail]] = True
    return ids, blocks, is_tail


# ---------------------------------------------------------------------------------------------
# scheduler side

@dataclass
class Match:
    """What ``get_num_new_matched_tokens`` found for a request, until its blocks are allocated."""
    local: int  # tokens vLLM's own prefix cache had
    hit: int  # leading full blocks the store holds (counted from block 0)
    tail: Optional[tuple] = None  # (tail id uint64 [2], tokens in it) when the tail hit too
    blend: Any = None  # ucm.blend.chunks.BlendJob (blocks unknown yet) when chunks blend


@dataclass
class PlannedLoad:
    """Blocks ``[first, end)`` of a request to load, plus the block after them (its tail, or the
    full block ``end``) when ``tail_id`` is set."""
    first: int
    end: int
    tail_id: Optional[np.ndarray] = None


@dataclass
class ReqState:
    """The scheduler side's state of one request it can key."""
    request: Any
    chain: Any = None  # keys.RequestKeys: the request's block ids
    blocks: list = field(default_factory=list)
    known: int = 0  # leading blocks known to be stored (saved, loaded or found)
    load: Optional[PlannedLoad] = None
    tail_done: bool = False  # the prompt's partial last block was saved, found or loaded
    saved: bool = False  # some save of this request was planned (its blocks wait for it)
    blend: Any = None  # the BlendJob to send with the request's first step
    blended: bool = False  # its KV is partly blended: nothing of it is stored under its prefix
    chunk_saves: list = field(default_factory=list)  # in-context ChunkSaves not yet computed


# ---------------------------------------------------------------------------------------------
# worker side

@dataclass
class SavePlan:
    """A step's saves, each block once: rank ids ``uint64 [n, 2]``, vLLM blocks, tail flags
    ``bool [n]`` and the requests whose blocks vLLM keeps until the save ended."""
    ids: np.ndarray
    blocks: list
    is_tail: np.ndarray
    reqs: list


@dataclass
class LayerSave:
    """A step's save run layer by layer during the forward (``connector.save_during_forward``).

    ``staging`` holds the step's blocks layer-major (each layer's part of every block
    contiguous); the save thread fills it layer by layer and dumps each part at its offset."""
    ids: np.ndarray
    blocks: Any  # torch int64 [n] vLLM block numbers
    is_tail: np.ndarray
    reqs: list
    staging: Any  # torch uint8 [>= n * block_bytes]
    queued: set = field(default_factory=set)  # layers whose job was queued
    tasks: list = field(default_factory=list)  # the store's dump tasks, one per layer done
    failed: bool = False  # some layer's copy or dump raised
    busy_s: float = 0.0  # the save thread's time on it
    gather_s: float = 0.0  # of which copying out of the cache


@dataclass
class LayerLoad:
    """One layer's load in layer-wise mode: its staged rows and the store's task."""
    layer: int
    rows: Any  # torch uint8 [n, shard bytes]
    task: Any


@dataclass
class LayerDump:
    """One layer's dump in layer-wise mode, committed at the end of the step."""
    ids: np.ndarray
    task: Any
    rows: Any  # kept alive until the dump completed


@dataclass
class Overlap:
    """A load being copied into the paged cache layer by layer on the load thread."""
    src: Any  # torch uint8 [rows, block_bytes]: full staged (or borrowed) rows
    idx: Any  # torch int64 [rows]: the cache block of each row, -1 to skip it
    n_layers: int
    release: Optional[Any] = None  # called once the copy is done
    done: list = field(default_factory=list)  # one threading.Event per layer
    failed: dict = field(default_factory=dict)  # layer -> exception of the background copy
    waited: set = field(default_factory=set)  # layers known to be in the cache
    future: Optional[Any] = None
    seconds: float = 0.0
    layer_copy: Optional[Any] = None  # copy (or decode) of layer k, prepared once

    def __post_init__(self):
        if not self.done:
            self.done = [threading.Event() for _ in range(self.n_layers)]


LayerSaveState = Union[None, bool, LayerSave]  # None: not begun this step; False: nothing to save
