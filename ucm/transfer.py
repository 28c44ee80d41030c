"""KV-cache transfer: gather blocks of a paged KV cache into a contiguous staging buffer and
scatter them back.

An engine hands ucm its KV cache as per-layer tensors in many layouts, often strided views of one
packed allocation. :class:`KVLayout` reads their strides once and describes where the bytes of one
block live: for every view, a list of contiguous byte *runs* at fixed offsets from the block's
base address (``data_ptr + b * block_stride``). A dense page is one run; a head-outer layout
(vLLM ``LHBNC``, ``BHLNC``) is one run per head.

Staged block format (one row of ``staging``, ``block_bytes`` long): the views of layer 0, then
layer 1, ... (views of one layer in the order given); inside a view, the block's bytes in
increasing address order. So a layer's bytes are one contiguous shard of the row
(:meth:`KVLayout.shard_offset` / :meth:`KVLayout.shard_bytes`), and a block stored from one
stride order reads back into the same stride order only (the KV layout is part of the
namespace digest).

Ops (validated here, dispatched through :mod:`ucm.dispatch`):

- :func:`gather_blocks` (paged cache -> staging), :func:`scatter_blocks` (staging -> cache);
  implementations ``reference`` (:mod:`ucm.reference.transfer`, PyTorch indexing),
  ``native`` (:mod:`ucm.fast.native.transfer`, CPU tensors, C threads) and ``triton``
  (:mod:`ucm.fast.triton.transfer`, CUDA tensors, one launch per call).

torch is imported lazily: ``import ucm`` works without it.
"""
from __future__ import annotations

from typing import Optional

import numpy as np

from ucm import dispatch, fast
from ucm.dispatch import ImplSpec
from ucm.layout import (COL_BASE, COL_BLOCK_STRIDE, COL_LENGTH, COL_OFFSET,  # noqa: F401
                        COL_STAGING, COL_VIEW, MAX_RUNS_PER_VIEW, KVLayout, _torch)


def _check_layout(layout) -> None:
    if not isinstance(layout, KVLayout):
        raise ValueError(f"layout: expected a ucm.KVLayout (KVLayout.from_views(...)), got "
                         f"{type(layout).__name__}")


def _check_indices(block_indices, layout: KVLayout, unique: bool):
    """int64 1-D tensor on the layout's device; -1 = skip; ValueError naming block_indices."""
    torch = _torch()
    name = "block_indices"
    if isinstance(block_indices, torch.Tensor):
        if block_indices.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{name}: expected an int32 or int64 tensor, got {block_indices.dtype}")
        if block_indices.dim() != 1:
            raise ValueError(f"{name}: expected a 1-D tensor, got shape {list(block_indices.shape)}")
        if block_indices.device.type != "cpu" and block_indices.device != layout.device:
            raise ValueError(f"{name}: on {block_indices.device}, the KV views on {layout.device}")
        host = block_indices.detach().to("cpu", torch.int64).numpy()
        on_device = block_indices.device == layout.device
    else:
        arr = np.asarray(block_indices)
        if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
            raise ValueError(f"{name}: expected a 1-D sequence of ints, got shape "
                             f"{list(arr.shape)} dtype {arr.dtype}")
        if arr.size and arr.dtype.kind == "u" and int(arr.max()) >= layout.num_blocks:
            # before the cast to int64: 2**64 - 1 would wrap to -1 (a skipped row)
            raise ValueError(f"{name}: index {int(arr.max())} out of range "
                             f"[0, {layout.num_blocks}) (-1 skips a row)")
        host = arr.astype(np.int64)
        on_device = False
    if host.size:
        lo, hi = int(host.min()), int(host.max())
        if lo < -1 or hi >= layout.num_blocks:
            bad = host[(host < -1) | (host >= layout.num_blocks)][0]
            raise ValueError(f"{name}: index {int(bad)} out of range [0, {layout.num_blocks}) "
                             f"(-1 skips a row)")
        if unique:
            valid = host[host >= 0]
            if len(np.unique(valid)) != len(valid):
                raise ValueError(f"{name}: a block index appears twice (scatter would write one "
                                 f"block from two rows)")
    if on_device and block_indices.dtype == torch.int64 and block_indices.is_contiguous():
        idx = block_indices.detach()
    else:
        idx = torch.from_numpy(np.ascontiguousarray(host))
        if layout.device.type != "cpu":
            # through torch's caching pinned allocator: an asynchronous copy, no stream sync
            idx = idx.pin_memory().to(layout.device, non_blocking=True)
    return idx


def _check_staging(staging, layout: KVLayout, n: int, row_bytes: int) -> None:
    torch = _torch()
    name = "staging"
    if not isinstance(staging, torch.Tensor):
        raise ValueError(f"{name}: expected a torch.Tensor, got {type(staging).__name__}")
    if staging.dtype != torch.uint8:
        raise ValueError(f"{name}: expected dtype torch.uint8, got {staging.dtype}")
    if tuple(staging.shape) != (n, row_bytes):
        raise ValueError(f"{name}: expected shape [{n}, {row_bytes}] (len(block_indices), bytes "
                         f"of the selected layers), got {list(staging.shape)}")
    rows_contiguous = row_bytes <= 1 or staging.stride(1) == 1
    rows_apart = n <= 1 or staging.stride(0) >= row_bytes
    if not (rows_contiguous and rows_apart):
        raise ValueError(f"{name}: expected contiguous rows (stride(1) == 1) that do not overlap "
                         f"(stride(0) >= {row_bytes}), got strides {list(staging.stride())}: a "
                         f"contiguous tensor, or a column slice of a wider one")
    if staging.device != layout.device:
        raise ValueError(f"{name}: on {staging.device}, the KV views on {layout.device} "
                         f"(staging must be on the KV cache's device)")
    if n and row_bytes:
        lo = staging.data_ptr()
        hi = lo + (n - 1) * staging.stride(0) + row_bytes
        view = layout.overlapping_view(lo, hi)
        if view is not None:
            raise ValueError(f"{name}: shares memory with the KV cache (views[{view}]); staging "
                             f"must be a separate buffer")


def gather_blocks(layout: KVLayout, block_indices, staging, layers=None, *,
                  backend: Optional[str] = None) -> None:
    """Copy blocks of the paged KV cache into rows of ``staging``.

    layout: a :class:`KVLayout`. block_indices: ``[n]`` int32/int64 tensor (CPU or the cache's
    device) or sequence of block numbers in ``[0, num_blocks)``; ``-1`` leaves that staging row
    untouched. Indices are range-checked on the host: CPU indices keep a CUDA call asynchronous,
    CUDA indices cost one synchronizing copy. staging: ``uint8 [n, layout.row_bytes(layers)]`` on the cache's device,
    contiguous or with rows spaced further apart (``stride(1) == 1``, ``stride(0) >= row_bytes``:
    a column slice of a wider buffer, e.g. one layer's bytes of full staged rows);
    row ``i`` receives block ``block_indices[i]`` in the staged format (see the module doc).
    layers: ``None`` (all) or layer ids whose shards make up the row, in that order.
    """
    _check_layout(layout)
    layers = layout.select(layers)
    idx = _check_indices(block_indices, layout, unique=False)
    _check_staging(staging, layout, idx.shape[0], layout.row_bytes(layers))
    dispatch.call("gather_blocks", layout, idx, staging, layers, backend=backend)


def scatter_blocks(layout: KVLayout, staging, block_indices, layers=None, *,
                   backend: Optional[str] = None) -> None:
    """Copy rows of ``staging`` into blocks of the paged KV cache: the inverse of
    :func:`gather_blocks` (same arguments; ``-1`` leaves nothing written for that row; a block
    number may appear only once)."""
    _check_layout(layout)
    layers = layout.select(layers)
    idx = _check_indices(block_indices, layout, unique=True)
    _check_staging(staging, layout, idx.shape[0], layout.row_bytes(layers))
    dispatch.call("scatter_blocks", layout, staging, idx, layers, backend=backend)


def layer_scatter(layout: KVLayout, staging, block_indices, *, backend: Optional[str] = None):
    """:func:`scatter_blocks` of every layer, one layer per call: returns ``f(k)``, which copies
    layer ``k``'s shard of the rows of ``staging`` (whole staged blocks, every layer) into
    blocks ``block_indices``. The checks, the choice of implementation and the native copy's
    segment table are made here, once, so that a call is one native copy with the GIL
    released: for the load thread, which copies a layer at a time while the forward runs and
    waits for the GIL at every Python step, up to the interpreter's switch interval (5 ms)."""
    _check_layout(layout)
    layers = layout.select(None)
    idx = _check_indices(block_indices, layout, unique=True)
    _check_staging(staging, layout, idx.shape[0], layout.row_bytes(layers))
    if not bool((idx >= 0).any()):
        return lambda k: None
    impl, _ = dispatch.select("scatter_blocks", backend, (layout, staging, idx, layers))
    if impl.name == "native":
        from ucm.fast.native.transfer import layer_scatter as prepared

        return prepared(layout, staging, idx)
    fn = impl.load()

    def run(k: int) -> None:
        a = layout.shard_offset(k)
        fn(layout, staging[:, a:a + layout.shard_bytes(k)], idx, (k,))
    return run


# ---------------------------------------------------------------------------------------------
# implementations

def _device_of(args, kwargs):
    layout = args[0] if args else kwargs.get("layout")
    return getattr(layout, "device", None)


def on_cpu(*args, **kwargs):
    return fast.cpu_takes(_device_of(args, kwargs))


def on_cuda(*args, **kwargs):
    return fast.triton_takes(_device_of(args, kwargs))


OPS = ("gather_blocks", "scatter_blocks")
IMPLEMENTATIONS = (
    ImplSpec("reference", "ucm.reference.transfer:{op}"),
    ImplSpec("native", "ucm.fast.native.transfer:{op}", 10, frozenset({"cpu", "cuda"}),
             fast.native_status, on_cpu),
    ImplSpec("triton", "ucm.fast.triton.transfer:{op}", 20, frozenset({"cuda", "cpu"}),
             fast.triton_status, on_cuda),
)
dispatch.register_table(OPS, IMPLEMENTATIONS)
