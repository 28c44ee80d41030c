"""Which parts of a prompt are chunks, and what Blend does with them: pure planning, no model.

A request marks its chunks in vLLM's ``kv_transfer_params`` (``SamplingParams(extra_args=
{"kv_transfer_params": {"ucm_blend": ...}})``, or the same object in an OpenAI request's
``kv_transfer_params``)::

    {"ucm_blend": {"chunks": [[0, 412], [412, 950]]}}     # token ranges [start, end)
    {"ucm_blend": {"separator": [1127, 1127]}}            # chunks between these token ids
    {"ucm_blend": {"chunks": [...], "recompute_ratio": 0.3}}   # this request's own ratio
    {"ucm_blend": false}                                  # never blend this request

With ``blend.separator`` set in ucm's configuration every prompt is split on it unless the
request says otherwise. With a separator, the text before its first occurrence and after its
last are not chunks (typically a system prompt and a question), and the separators themselves
belong to no chunk.

A chunk's KV is computed alone, after the model's BOS token (``blend.sink``: ``bos``; the
sink's own KV is dropped), and stored under ids of the chunk's tokens alone (:func:`chunk_ids`,
chained from a root that names the sink): the same chunk anywhere in any prompt finds it.
With ``blend.sink: none`` the chunk is computed as if it began the sequence and its ids are
those of a request that begins with the chunk, so such a request stores it too. Only a
chunk's full blocks are stored; its last partial block is recomputed in place.
"""
from __future__ import annotations

import reprlib
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import numpy as np

PARAM = "ucm_blend"


class ChunkSpecError(ValueError):
    """A request's chunk marking cannot be used (the message says why)."""


_SHOW = reprlib.Repr()
_SHOW.maxlevel, _SHOW.maxstring, _SHOW.maxother, _SHOW.maxlong = 3, 60, 60, 60


def _show(x: Any) -> str:
    """A short repr of a request's (untrusted) value for an error message: bounded in length,
    and never an exception of its own (a huge int's repr raises ValueError, a deeply nested
    list's RecursionError: neither is the ChunkSpecError the scheduler logs)."""
    try:
        if isinstance(x, int) and not isinstance(x, bool) and x.bit_length() > 64:
            return f"<int of {x.bit_length()} bits>"
        out = _SHOW.repr(x)
    except Exception:
        return f"<{type(x).__name__}>"
    return out if len(out) <= 200 else out[:200] + "..."


def _kmp(prompt: list, sep: list) -> list:
    """Start positions of every occurrence of ``sep`` in ``prompt``, overlapping ones included
    (Knuth-Morris-Pratt: O(len(prompt) + len(sep)) whatever the input)."""
    m = len(sep)
    fail, k = [0] * m, 0
    for i in range(1, m):
        while k and sep[i] != sep[k]:
            k = fail[k - 1]
        if sep[i] == sep[k]:
            k += 1
        fail[i] = k
    out, k = [], 0
    for i, t in enumerate(prompt):
        while k and t != sep[k]:
            k = fail[k - 1]
        if t == sep[k]:
            k += 1
            if k == m:
                out.append(i - m + 1)
                k = fail[k - 1]
    return out


_FILTER = 16   # separator tokens matched vectorised before the candidates are checked


def _find(prompt: np.ndarray, sep: np.ndarray) -> list:
    """Start positions of non-overlapping occurrences of ``sep`` in ``prompt`` (leftmost first).
    Linear in ``len(prompt) + len(sep)``: a request's separator is untrusted input, and a long
    one that almost matches everywhere must not cost the scheduler O(len(prompt) * len(sep))."""
    n, m = len(prompt), len(sep)
    if m == 0 or n < m:
        return []
    hits = np.flatnonzero(prompt[:n - m + 1] == sep[0])
    for j in range(1, min(m, _FILTER)):
        if not len(hits):
            return []
        hits = hits[prompt[hits + j] == sep[j]]
    if m > _FILTER and len(hits):
        if len(hits) * (m - _FILTER) > 4 * (n + m):   # checking each would be quadratic
            hits = _kmp(prompt.tolist(), sep.tolist())
        else:
            hits = [h for h in hits.tolist()
                    if np.array_equal(prompt[h + _FILTER:h + m], sep[_FILTER:])]
    out, last = [], -m
    for h in hits:
        if h >= last + m:
            out.append(int(h))
            last = int(h)
    return out


def spans_from_separator(prompt: Sequence[int], sep: Sequence[int]) -> list:
    """Chunks between consecutive occurrences of ``sep`` (none before the first or after the
    last), empty spans dropped."""
    p = np.asarray(prompt, dtype=np.int64)
    s = np.asarray(sep, dtype=np.int64)
    at = _find(p, s)
    spans = [(a + len(s), b) for a, b in zip(at, at[1:])]
    return [(a, b) for a, b in spans if b > a]


def chunk_spans(prompt: Sequence[int], params: Optional[dict], separator: Sequence[int] = ()
                ) -> list:
    """The request's chunks as sorted, disjoint ``(start, end)`` token ranges (``[]``: not a
    Blend request). ``params``: the request's ``kv_transfer_params`` (or None);
    ``separator``: ``blend.separator``. Raises :class:`ChunkSpecError` naming what is wrong."""
    return parse_request(prompt, params, separator)[0]


def parse_request(prompt: Sequence[int], params: Optional[dict], separator: Sequence[int] = ()
                  ) -> tuple:
    """``(chunks, recompute_ratio or None)`` of a request (see :func:`chunk_spans`)."""
    spec: Any = (params or {}).get(PARAM) if isinstance(params, dict) else None
    if spec is False:
        return [], None
    if spec is None or spec is True:
        return (spans_from_separator(prompt, separator) if len(separator) else []), None
    if not isinstance(spec, dict):
        raise ChunkSpecError(f"kv_transfer_params[{PARAM!r}]: expected an object with 'chunks' "
                             f"or 'separator' (or false), got {type(spec).__name__}")
    spec = dict(spec)
    ratio = spec.pop("recompute_ratio", None)
    if ratio is not None and (isinstance(ratio, bool) or not isinstance(ratio, (int, float))
                              or not 0 <= ratio <= 1):
        raise ChunkSpecError(f"kv_transfer_params[{PARAM!r}]['recompute_ratio']: expected a "
                             f"number in [0, 1], got {_show(ratio)}")
    unknown = set(spec) - {"chunks", "separator"}
    if unknown or len(spec) != 1:
        # (keys of any type, any number: sorted by their short repr, at most 8 shown)
        got = sorted(_show(k) for k in spec)
        raise ChunkSpecError(f"kv_transfer_params[{PARAM!r}]: expected exactly one of 'chunks' "
                             f"or 'separator' (and optionally 'recompute_ratio'), got keys "
                             f"[{', '.join(got[:8])}{', ...' if len(got) > 8 else ''}] "
                             f"({len(got)})")
    return _spans(prompt, spec), (None if ratio is None else float(ratio))


def _spans(prompt: Sequence[int], spec: dict) -> list:
    n = len(prompt)
    if "separator" in spec:
        sep = spec["separator"]
        if not isinstance(sep, (list, tuple)) or not sep or \
                not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 2 ** 63
                        for t in sep):
            # (token ids past int64 would overflow the search below: a request's bad input
            # must be this error, which the scheduler logs, not an OverflowError)
            raise ChunkSpecError(f"kv_transfer_params[{PARAM!r}]['separator']: expected a "
                                 f"non-empty list of token ids (ints in [0, 2**63)), got "
                                 f"{_show(sep)}")
        return spans_from_separator(prompt, sep)
    chunks = spec["chunks"]
    if not isinstance(chunks, (list, tuple)):
        raise ChunkSpecError(f"kv_transfer_params[{PARAM!r}]['chunks']: expected a list of "
                             f"[start, end] token ranges, got {type(chunks).__name__}")
    out, prev = [], 0
    for i, c in enumerate(chunks):
        ok = isinstance(c, (list, tuple)) and len(c) == 2 and \
            all(isinstance(x, int) and not isinstance(x, bool) for x in c)
        if not ok:
            raise ChunkSpecError(f"kv_transfer_params[{PARAM!r}]['chunks'][{i}]: expected "
                                 f"[start, end] (ints), got {_show(c)}")
        a, b = c
        if not 0 <= a < b <= n:
            raise ChunkSpecError(f"kv_transfer_params[{PARAM!r}]['chunks'][{i}] = "
                                 f"[{_show(a)}, {_show(b)}]: expected 0 <= start < end <= {n} "
                                 f"(the prompt's tokens)")
        if a < prev:
            raise ChunkSpecError(f"kv_transfer_params[{PARAM!r}]['chunks'][{i}] = {[a, b]}: "
                                 f"chunks must be sorted and must not overlap (previous end "
                                 f"{prev})")
        out.append((a, b))
        prev = b
    return out


def chunk_ids(tokens: Sequence[int], ns, root: Optional[np.ndarray],
              sink: Sequence[int] = (), in_context: bool = False) -> np.ndarray:
    """Store ids ``uint64 [n_full, 2]`` of a chunk's full blocks.

    Computed alone after the ``sink`` tokens (``in_context`` False): the ids its tokens have at
    the start of a request with root ``root`` (LoRA adapter, cache salt, generation:
    :func:`ucm.integration.vllm.keys.request_root`), the root mixed with the sink when there is
    one (KV computed after a sink is never mistaken for a request's prefix, nor for KV computed
    after another sink). Taken from the prompt that first carried the chunk (``in_context``):
    under a root of their own (:func:`context_root`), never those of KV computed alone."""
    import ucm

    bs = ns.block_size
    full = len(tokens) // bs * bs
    if full == 0:
        return np.zeros((0, 2), np.uint64)
    if in_context:
        root = context_root(root, len(sink))
    elif len(sink):
        root = sink_root(root, sink)
    return ucm.hash_blocks(np.asarray(tokens[:full], dtype=np.int64), ns, parent=root)


def sink_root(root: Optional[np.ndarray], sink: Sequence[int]) -> np.ndarray:
    """The parent id of chunks computed after ``sink`` under request root ``root``."""
    from ucm.ids import derived_id

    return derived_id(root, b"ucm-blend-sink-v1\0", tuple(int(t) for t in sink))


def context_root(root: Optional[np.ndarray], offset: int) -> np.ndarray:
    """The parent id of chunks taken from a prompt's own prefill, their keys rotated to start at
    position ``offset``, under request root ``root``."""
    from ucm.ids import derived_id

    return derived_id(root, b"ucm-blend-context-v1\0", (int(offset),))


# ---------------------------------------------------------------------------------------------
# the plan of one request, scheduler -> worker

@dataclass
class Piece:
    """Stored blocks of one chunk that a region uses: chunk blocks ``[first, first + len(ids))``
    (store ids ``ids``), the chunk starting at request position ``chunk_start``. The stored KV
    of chunk token ``j`` (keys at position ``len(sink) + j``, see :class:`BlendJob`)
    belongs at position ``chunk_start + j``: its keys rotate by ``chunk_start - len(sink)``."""
    ids: np.ndarray
    first: int
    chunk_start: int


@dataclass
class ChunkSave:
    """A chunk to store: its full blocks' tokens and ids; ``skip`` leading blocks are stored
    already. ``start >= 0``: the chunk sits at request position ``start`` and its rows are taken
    from the request's cache once the prompt computed them; ``blocks``: the request's vLLM
    blocks from block ``start // block_size`` on, set in the step that computes the chunk's
    last full block. ``start < 0``: the chunk is computed alone after the job's sink."""
    tokens: np.ndarray
    ids: np.ndarray
    skip: int = 0
    start: int = -1
    blocks: Optional[list] = None


@dataclass
class BlendJob:
    """One request's Blend in one step: fill positions ``[start, end)`` (``tokens``: their ids)
    from ``pieces`` plus the recompute, into the request's vLLM ``blocks``; then store
    ``saves``. Every stored chunk's keys sit at positions ``len(sink) + j`` (chunk token
    ``j``): computed after the ``sink`` tokens, or taken from a prompt and rotated there. A job
    with ``end == start`` only stores."""
    req_id: str
    start: int
    end: int
    tokens: np.ndarray
    blocks: list
    pieces: list = field(default_factory=list)
    saves: list = field(default_factory=list)
    ratio: Optional[float] = None      # the request's recompute ratio (None: the configured one)
    #: prompt tokens after the region (at most LOOKAHEAD_TOKENS, the last ones) and the
    #: position of the first: the lookahead of :func:`ucm.blend.engine.blend_fill`
    after: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    after_start: int = 0
    sink: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))


def plan_region(spans: list, start: int, num_tokens: int, block_size: int,
                stored_blocks: list) -> tuple:
    """The region a Blend fills and the stored runs it uses.

    ``spans``: the chunks; ``start``: the first position not already in the cache (the prefix
    hit); ``stored_blocks[i]``: how many leading full blocks of chunk ``i`` the store holds.
    Returns ``(end, pieces)``: the region is ``[start, end)`` (the end of the last chunk, the
    last prompt token excluded: vLLM always computes it), ``pieces`` the ``(chunk index, first
    block, n blocks)`` runs of stored blocks that reach past ``start``; ``end == start`` when
    there is nothing to blend."""
    if not spans:
        return start, []
    end = min(spans[-1][1], num_tokens - 1)
    pieces = []
    for i, ((a, b), n) in enumerate(zip(spans, stored_blocks)):
        if n <= 0:
            continue
        stop = min(a + n * block_size, end)              # stored tokens of the chunk: [a, stop)
        if stop <= start:
            continue
        first = max(0, (start - a) // block_size)        # blocks wholly before start are not needed
        last = (stop - a + block_size - 1) // block_size
        pieces.append((i, first, last - first))
    if end <= start or not pieces:
        return start, []
    return end, pieces
