"""CPU fast path of the KV transfer ops: every (source, destination, length) of a call computed at
once with numpy, then one :func:`ucm.copy_segments` on the native engine's C threads.

Same names and signatures as :mod:`ucm.reference.transfer`; CPU tensors only (the registry's
verifier routes other devices elsewhere); inputs validated by :mod:`ucm.transfer`.
"""
from __future__ import annotations

import numpy as np

from ucm.fast import native
from ucm.threads import default_threads
from ucm.layout import COL_BASE, COL_BLOCK_STRIDE, COL_LENGTH, COL_OFFSET, COL_STAGING, KVLayout


def _segments(layout: KVLayout, block_indices, staging, layers):
    """(cache addresses, staging addresses, lengths) as uint64 [rows * runs], row-major."""
    idx = block_indices.numpy()
    rows = np.flatnonzero(idx >= 0).astype(np.int64)
    blocks = idx[rows].astype(np.int64)
    tab = layout.table(layers)
    pitch = staging.stride(0)  # row_bytes, or more for a column slice of wider rows
    cache = (tab[None, :, COL_BASE] + tab[None, :, COL_OFFSET]
             + blocks[:, None] * tab[None, :, COL_BLOCK_STRIDE])
    stage = staging.data_ptr() + rows[:, None] * pitch + tab[None, :, COL_STAGING]
    lengths = np.broadcast_to(tab[None, :, COL_LENGTH], cache.shape)
    as_u64 = lambda a: np.ascontiguousarray(a, dtype=np.int64).reshape(-1).view(np.uint64)
    return as_u64(cache), as_u64(stage), as_u64(lengths)


def _copy(src, dst, lengths) -> None:
    if len(lengths):
        native.copy_segments(src, dst, lengths, default_threads())


def gather_blocks(layout: KVLayout, block_indices, staging, layers: tuple) -> None:
    """Same contract as :func:`ucm.reference.transfer.gather_blocks`."""
    cache, stage, lengths = _segments(layout, block_indices, staging, layers)
    _copy(cache, stage, lengths)


def scatter_blocks(layout: KVLayout, staging, block_indices, layers: tuple) -> None:
    """Same contract as :func:`ucm.reference.transfer.scatter_blocks`."""
    cache, stage, lengths = _segments(layout, block_indices, staging, layers)
    _copy(stage, cache, lengths)


def layer_scatter(layout: KVLayout, staging, block_indices):
    """:func:`scatter_blocks` prepared a layer at a time (:func:`ucm.transfer.layer_scatter`):
    every layer's segment table made now, so ``f(k)`` is one native copy."""
    tables = []
    for k in range(layout.num_layers):
        a = layout.shard_offset(k)
        cache, stage, lengths = _segments(layout, block_indices,
                                          staging[:, a:a + layout.shard_bytes(k)], (k,))
        tables.append((stage, cache, lengths))
    threads = default_threads()

    def run(k: int) -> None:
        stage, cache, lengths = tables[layout._check_layer(k)]
        if len(lengths):
            native.copy_segments(stage, cache, lengths, threads)
    return run
