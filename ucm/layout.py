"""Where the bytes of one KV block live in an engine's paged cache: :class:`KVLayout`.

An engine hands ucm its KV cache as per-layer tensors in many layouts, often strided views of one
packed allocation. :class:`KVLayout` reads their strides once and describes, for every view, a
list of contiguous byte *runs* at fixed offsets from the block's base address
(``data_ptr + b * block_stride``). A dense page is one run; a head-outer layout (vLLM ``LHBNC``,
``BHLNC``) is one run per head. The staged row format is described in :mod:`ucm.transfer`.

A low-level module: the transfer ops (:mod:`ucm.transfer`) and their implementations
(:mod:`ucm.reference.transfer`, :mod:`ucm.fast.native.transfer`, :mod:`ucm.fast.triton.transfer`)
import it; it imports no op module. torch is imported lazily.
"""
from __future__ import annotations

import math
import threading
from typing import Optional, Sequence

import numpy as np

#: A view whose block is made of more separate byte runs than this is rejected (an element-wise
#: strided view: the transfer would move a few bytes per descriptor).
MAX_RUNS_PER_VIEW = 4096
#: Pairs of runs examined by the exact overlap check, at most (beyond that, not verifiable).
_MAX_OVERLAP_PAIRS = 1 << 24
_MAX_BRUTE_INTERVALS = 1 << 23

# Columns of KVLayout.table(): one row per run of a selection.
COL_VIEW, COL_BASE, COL_BLOCK_STRIDE, COL_OFFSET, COL_LENGTH, COL_STAGING = range(6)


def _torch():
    import torch

    return torch


def _is_tensor(x) -> bool:
    return type(x).__module__.startswith("torch") and hasattr(x, "data_ptr") and hasattr(x, "stride")


def _view_runs(shape: Sequence[int], strides: Sequence[int], esize: int, where: str):
    """Byte runs of one block of a strided view (block dim removed): (offsets, lengths), sorted by
    address, adjacent runs merged. Raises if elements of one block share bytes."""
    dims = sorted(((st * esize, n) for n, st in zip(shape, strides) if n > 1), reverse=True)
    run_len = esize
    outer = []
    for st, n in reversed(dims):  # innermost first: extend the run while the bytes continue
        if not outer and st == run_len:
            run_len *= n
        else:
            outer.append((st, n))
    count = math.prod(n for _, n in outer)
    if count > MAX_RUNS_PER_VIEW:
        raise ValueError(
            f"{where}: one block is made of {count} separate byte runs (shape {list(shape)}, "
            f"strides {list(strides)}); at most {MAX_RUNS_PER_VIEW} are supported. Pass views "
            f"whose innermost dimensions are contiguous.")
    offsets = np.zeros(1, dtype=np.int64)
    for st, n in outer:
        offsets = (offsets[:, None] + np.arange(n, dtype=np.int64)[None, :] * st).reshape(-1)
    offsets = np.sort(offsets)
    if len(offsets) > 1 and (np.diff(offsets) < run_len).any():
        raise ValueError(f"{where}: elements of one block overlap in memory (shape {list(shape)}, "
                         f"strides {list(strides)}): a zero or aliasing stride")
    # merge runs that touch
    starts = np.ones(len(offsets), dtype=bool)
    starts[1:] = offsets[1:] != offsets[:-1] + run_len
    first = np.flatnonzero(starts)
    lengths = np.diff(np.append(first, len(offsets))) * run_len
    return offsets[first], lengths.astype(np.int64)


def _pairs_overlap(a_i, l_i, a_j, l_j, stride, num_blocks, same_run):
    """Do intervals ``[a_i + b*S, +l_i)`` and ``[a_j + c*S, +l_j)`` meet for some blocks
    ``b, c < num_blocks`` (``b != c`` where ``same_run``)? Vectorized over broadcast arrays."""
    d = a_j - a_i
    kmax_blocks = num_blocks - 1
    if kmax_blocks == 0:  # one block: only k = 0
        return (d > -l_j) & (d < l_i) & ~same_run
    if stride == 0:  # every block at the same address
        return (d > -l_j) & (d < l_i)
    # integer k with -l_j < d + k*S < l_i
    k_lo = np.floor_divide(-l_j - d, stride) + 1
    k_hi = -np.floor_divide(d - l_i, stride) - 1
    lo = np.maximum(k_lo, -kmax_blocks)
    hi = np.minimum(k_hi, kmax_blocks)
    hit = lo <= hi
    # for a run against itself k = 0 is the same block: overlap needs another k in range
    only_zero = (lo == 0) & (hi == 0)
    return hit & ~(same_run & only_zero)


class KVLayout:
    """Where the bytes of each block of a paged KV cache live, and how a block is staged.

    Build with :meth:`from_views`. Immutable; keeps the views alive (the addresses it recorded
    stay valid as long as the layout exists and nobody resizes the tensors).

    Attributes: ``device``, ``num_blocks``, ``num_views``, ``num_layers``, ``block_bytes`` (bytes
    of one staged block over all views), ``layer_of_view``, ``views``.
    """

    def __init__(self):  # use from_views
        raise TypeError("use KVLayout.from_views(views, layer_of_view=None)")

    @classmethod
    def from_views(cls, views, layer_of_view: Optional[Sequence[int]] = None) -> "KVLayout":
        """Describe a paged KV cache given as a list of tensors with the BLOCK dimension first.

        views: non-empty list of strided tensors ``[num_blocks, ...]``, any dtype, any strides
        (non-contiguous views of one packed allocation are expected), all on one device, all with
        the same ``num_blocks``. For the FlashAttention layout ``[2, num_blocks, N, H, D]`` pass
        ``kv.unbind(0)``; FlashInfer ``[num_blocks, 2, N, H, D]`` and vLLM's 4D byte views
        ``[B, H, N, C]`` pass as they are.
        layer_of_view: layer id of each view (ints, every id in ``[0, num_layers)`` used at least
        once); default: each view is its own layer.

        Raises ValueError naming the view for: a non-tensor, a view without a block dimension, an
        empty view, a different device or ``num_blocks``, a block made of more than
        :data:`MAX_RUNS_PER_VIEW` byte runs, or bytes shared between blocks or views.
        """
        torch = _torch()
        if isinstance(views, torch.Tensor) or not isinstance(views, (list, tuple)) or not views:
            raise ValueError("views: expected a non-empty list of tensors with the block "
                             "dimension first (for [2, num_blocks, ...] pass kv.unbind(0))")
        self = object.__new__(cls)
        first = views[0]
        for i, v in enumerate(views):
            where = f"views[{i}]"
            if not isinstance(v, torch.Tensor):
                raise ValueError(f"{where}: expected a torch.Tensor, got {type(v).__name__}")
            if v.layout != torch.strided:
                raise ValueError(f"{where}: expected a strided (dense) tensor, got {v.layout}")
            if v.dim() < 1:
                raise ValueError(f"{where}: expected a block dimension first, got a 0-d tensor")
            if v.numel() == 0:
                raise ValueError(f"{where}: empty tensor of shape {list(v.shape)}")
            if v.device != first.device:
                raise ValueError(f"{where}: on {v.device}, views[0] on {first.device} "
                                 f"(all views must share one device)")
            if v.shape[0] != first.shape[0]:
                raise ValueError(f"{where}: num_blocks {v.shape[0]} (dim 0) differs from views[0] "
                                 f"({first.shape[0]})")
        n_views = len(views)
        if layer_of_view is None:
            layer_of_view = list(range(n_views))
        else:
            if isinstance(layer_of_view, (str, bytes)) or not hasattr(layer_of_view, "__len__"):
                raise ValueError(f"layer_of_view: expected a sequence of {n_views} ints")
            layer_of_view = list(layer_of_view)
            if len(layer_of_view) != n_views:
                raise ValueError(f"layer_of_view: {len(layer_of_view)} entries for {n_views} views")
            for i, lay in enumerate(layer_of_view):
                if isinstance(lay, bool) or not isinstance(lay, (int, np.integer)) or lay < 0:
                    raise ValueError(f"layer_of_view[{i}]: expected a layer id >= 0, got {lay!r}")
            layer_of_view = [int(x) for x in layer_of_view]
            # ids 0..L-1 all used means L <= n_views: look no further than n_views (a huge id
            # would otherwise build and print a range of that size)
            top = min(max(layer_of_view), n_views)
            missing = sorted(set(range(top + 1)) - set(layer_of_view))
            if missing:
                raise ValueError(f"layer_of_view: layer ids must be 0..num_layers-1 with none "
                                 f"missing; missing {missing}")

        num_blocks = int(first.shape[0])
        self.device = first.device
        self.num_blocks = num_blocks
        self.num_views = n_views
        self.num_layers = max(layer_of_view) + 1
        self.layer_of_view = tuple(layer_of_view)
        self.views = tuple(views)

        esizes, bases, bstrides, offsets, lengths = [], [], [], [], []
        for i, v in enumerate(views):
            e = v.element_size()
            off, ln = _view_runs(v.shape[1:], v.stride()[1:], e, f"views[{i}]")
            esizes.append(e)
            bases.append(int(v.data_ptr()))
            bstrides.append(int(v.stride(0)) * e)
            offsets.append(off)
            lengths.append(ln)
        self._bases, self._bstrides = bases, bstrides
        self._offsets, self._lengths = offsets, lengths
        self._view_bytes = [int(ln.sum()) for ln in lengths]
        self._check_overlap()

        # staging order: by layer, then view order
        self._order = sorted(range(n_views), key=lambda i: (layer_of_view[i], i))
        self._shard_bytes = [0] * self.num_layers
        for i in range(n_views):
            self._shard_bytes[layer_of_view[i]] += self._view_bytes[i]
        self._shard_offset = list(np.concatenate([[0], np.cumsum(self._shard_bytes)[:-1]]).astype(int))
        self.block_bytes = int(sum(self._view_bytes))
        self._tables: dict = {}
        self._lock = threading.Lock()
        return self

    # -- overlap check -----------------------------------------------------------------------
    def _check_overlap(self) -> None:
        B = self.num_blocks
        lo = np.array([b + int(o[0]) for b, o in zip(self._bases, self._offsets)], dtype=np.int64)
        hi = np.array([b + (B - 1) * s + int(o[-1] + ln[-1]) for b, s, o, ln in
                       zip(self._bases, self._bstrides, self._offsets, self._lengths)], dtype=np.int64)
        self._extents = (lo, hi)
        by_lo = np.argsort(lo, kind="stable")
        for pos, u in enumerate(by_lo):
            self._check_pair(int(u), int(u))
            for v in by_lo[pos + 1:]:
                if lo[v] >= hi[u]:
                    break
                self._check_pair(int(u), int(v))

    def _check_pair(self, u: int, v: int) -> None:
        B = self.num_blocks
        a_u = self._bases[u] + self._offsets[u]
        a_v = self._bases[v] + self._offsets[v]
        l_u, l_v = self._lengths[u], self._lengths[v]
        s_u, s_v = self._bstrides[u], self._bstrides[v]
        what = f"views[{u}]: blocks overlap each other in memory" if u == v else \
            f"views[{u}] and views[{v}]: their blocks share bytes in memory"
        if s_u == s_v or B == 1:
            if len(a_u) * len(a_v) > _MAX_OVERLAP_PAIRS:
                raise ValueError(f"views[{u}], views[{v}]: too many byte runs to verify that "
                                 f"blocks do not overlap")
            same = np.zeros((len(a_u), len(a_v)), dtype=bool)
            if u == v:
                np.fill_diagonal(same, True)
            hit = _pairs_overlap(a_u[:, None], l_u[:, None], a_v[None, :], l_v[None, :],
                                 s_u, B, same)
            if hit.any():
                raise ValueError(what)
            return
        # different block strides and overlapping extents: enumerate the intervals
        count = B * (len(a_u) + len(a_v))
        if count > _MAX_BRUTE_INTERVALS:
            raise ValueError(f"views[{u}], views[{v}]: interleaved views with different block "
                             f"strides ({s_u} vs {s_v} bytes); cannot verify they do not overlap")
        blocks = np.arange(B, dtype=np.int64)[:, None]
        starts = np.concatenate([(a_u[None, :] + blocks * s_u).ravel(), (a_v[None, :] + blocks * s_v).ravel()])
        lens = np.concatenate([np.broadcast_to(l_u, (B, len(l_u))).ravel(),
                               np.broadcast_to(l_v, (B, len(l_v))).ravel()])
        order = np.argsort(starts, kind="stable")
        s, ln = starts[order], lens[order]
        if (s[:-1] + ln[:-1] > s[1:]).any():
            raise ValueError(what)

    # -- description -------------------------------------------------------------------------
    def __repr__(self) -> str:
        return (f"KVLayout(num_blocks={self.num_blocks}, views={self.num_views}, "
                f"layers={self.num_layers}, block_bytes={self.block_bytes}, "
                f"runs_per_block={sum(len(o) for o in self._offsets)}, device={self.device})")

    def overlapping_view(self, lo: int, hi: int) -> Optional[int]:
        """The first view whose bytes' extent meets the address range ``[lo, hi)``, or None."""
        v_lo, v_hi = self._extents
        hit = np.flatnonzero((v_lo < hi) & (v_hi > lo))
        return int(hit[0]) if len(hit) else None

    def _check_view(self, view) -> int:
        if isinstance(view, bool) or not isinstance(view, (int, np.integer)) or \
                not 0 <= view < self.num_views:
            raise ValueError(f"view: expected a view number in [0, {self.num_views}), got {view!r}")
        return int(view)

    def _check_layer(self, layer, name: str = "layer") -> int:
        if isinstance(layer, bool) or not isinstance(layer, (int, np.integer)) or \
                not 0 <= layer < self.num_layers:
            raise ValueError(f"{name}: expected a layer id in [0, {self.num_layers}), got {layer!r}")
        return int(layer)

    def shard_bytes(self, layer: int) -> int:
        """Bytes of ``layer`` inside one staged block."""
        return self._shard_bytes[self._check_layer(layer)]

    def shard_offset(self, layer: int) -> int:
        """Offset of ``layer``'s contiguous shard inside one staged block (all layers)."""
        return int(self._shard_offset[self._check_layer(layer)])

    def view_runs(self, view: int):
        """``(offsets, lengths)`` int64 arrays: the byte runs of one block of ``views[view]``,
        relative to that block's first byte (``data_ptr + b * block_stride``)."""
        view = self._check_view(view)
        return self._offsets[view].copy(), self._lengths[view].copy()

    def block_stride(self, view: int) -> int:
        """Bytes between block ``b`` and ``b + 1`` of ``views[view]``."""
        return self._bstrides[self._check_view(view)]

    def select(self, layers=None) -> tuple:
        """Normalize a layer selection: ``None`` = all layers in order; an int or a sequence of
        distinct layer ids (the staged row holds their shards in the order given)."""
        if layers is None:
            return tuple(range(self.num_layers))
        if _is_tensor(layers) or isinstance(layers, np.ndarray):
            layers = layers.tolist()   # a 0-d tensor or array becomes one int
        if isinstance(layers, (int, np.integer)) and not isinstance(layers, bool):
            layers = (layers,)
        if isinstance(layers, (str, bytes)) or not hasattr(layers, "__iter__"):
            raise ValueError(f"layers: expected None, a layer id or a sequence of layer ids, "
                             f"got {layers!r}")
        out = tuple(self._check_layer(x, "layers") for x in layers)
        if not out:
            raise ValueError("layers: empty selection")
        if len(set(out)) != len(out):
            raise ValueError(f"layers: duplicate layer ids in {list(out)}")
        return out

    def row_bytes(self, layers=None) -> int:
        """Bytes of one staged row for this layer selection."""
        return int(sum(self._shard_bytes[x] for x in self.select(layers)))

    def table(self, layers=None) -> np.ndarray:
        """The runs of a layer selection as an ``int64 [R, 6]`` table in staging order, columns
        ``COL_VIEW, COL_BASE`` (view ``data_ptr``), ``COL_BLOCK_STRIDE``, ``COL_OFFSET`` (run
        offset in the block), ``COL_LENGTH``, ``COL_STAGING`` (offset in the staged row); all in
        bytes. Read-only, cached."""
        key = self.select(layers)
        tab = self._tables.get(key)
        if tab is None:
            rows = []
            soff = 0
            for layer in key:
                for i in self._order:
                    if self.layer_of_view[i] != layer:
                        continue
                    off, ln = self._offsets[i], self._lengths[i]
                    st = soff + np.concatenate([[0], np.cumsum(ln)[:-1]])
                    part = np.empty((len(off), 6), dtype=np.int64)
                    part[:, COL_VIEW] = i
                    part[:, COL_BASE] = self._bases[i]
                    part[:, COL_BLOCK_STRIDE] = self._bstrides[i]
                    part[:, COL_OFFSET] = off
                    part[:, COL_LENGTH] = ln
                    part[:, COL_STAGING] = st
                    rows.append(part)
                    soff += int(ln.sum())
            tab = np.concatenate(rows)
            tab.setflags(write=False)
            with self._lock:
                self._tables[key] = tab
        return tab

    def cached(self, key, build):
        """Per-layout cache for implementations (device tables ...): ``build()`` once per key."""
        val = self._tables.get(("impl",) + tuple(key))
        if val is None:
            val = build()
            with self._lock:
                self._tables[("impl",) + tuple(key)] = val
        return val


# ---------------------------------------------------------------------------------------------
# public ops
