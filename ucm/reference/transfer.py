"""Reference KV transfer: gather/scatter blocks with plain PyTorch indexing, one byte run at a time.

Same names and signatures as :mod:`ucm.fast.triton.transfer` and :mod:`ucm.fast.native.transfer`;
inputs are validated by :mod:`ucm.transfer` (layout built, ``block_indices`` an int64 1-D tensor
with values in ``[-1, num_blocks)``, ``staging`` a contiguous ``uint8 [n, row_bytes]`` on the
cache's device, ``layers`` a tuple of layer ids).

For each byte run of each view (see :class:`ucm.layout.KVLayout`), the run of every block is a
``uint8 [num_blocks, run_length]`` strided view of the view's storage (row stride = the view's
block stride in bytes); a gather is then ``staging[rows, cols] = runs[blocks]`` and a scatter the
other way round.
"""
from __future__ import annotations

import torch

from ucm.layout import COL_LENGTH, COL_OFFSET, COL_STAGING, COL_VIEW, KVLayout


def _bytes_of(view: torch.Tensor) -> torch.Tensor:
    """A flat uint8 tensor over the whole storage of ``view`` (any dtype, any strides)."""
    return torch.empty(0, dtype=torch.uint8, device=view.device).set_(view.untyped_storage())


def _runs_of_all_blocks(layout: KVLayout, view_index: int, offset: int, length: int) -> torch.Tensor:
    """``uint8 [num_blocks, length]``: bytes ``[offset, offset + length)`` of every block of one
    view, as a writable strided view of its storage."""
    view = layout.views[view_index]
    storage_bytes = _bytes_of(view)
    start = view.storage_offset() * view.element_size() + offset
    return storage_bytes.as_strided((layout.num_blocks, length), (layout.block_stride(view_index), 1),
                                    start)


def _valid_rows(block_indices: torch.Tensor, device):
    """(rows of staging, block numbers) for the entries that are not -1."""
    block_indices = block_indices.to(device)
    rows = torch.nonzero(block_indices >= 0).squeeze(1)
    return rows, block_indices[rows]


def _pieces(layout: KVLayout, layers: tuple, rows: torch.Tensor):
    """Per byte run of the selected layers: a ``[num_blocks, length]`` view of that run in every
    block, and the columns it fills in a staged row (nothing when no row is moved)."""
    if rows.numel() == 0:
        return
    for view, offset, length, staging_offset in layout.table(layers)[
            :, [COL_VIEW, COL_OFFSET, COL_LENGTH, COL_STAGING]].tolist():
        yield _runs_of_all_blocks(layout, view, offset, length), \
            slice(staging_offset, staging_offset + length)


def gather_blocks(layout: KVLayout, block_indices: torch.Tensor, staging: torch.Tensor,
                  layers: tuple) -> None:
    """``staging[i] = staged bytes of block block_indices[i]`` for every ``i`` with index >= 0."""
    rows, blocks = _valid_rows(block_indices, staging.device)
    for runs, cols in _pieces(layout, layers, rows):
        staging[rows, cols] = runs[blocks]


def scatter_blocks(layout: KVLayout, staging: torch.Tensor, block_indices: torch.Tensor,
                   layers: tuple) -> None:
    """Block ``block_indices[i]`` of the cache = staged row ``i``, for every index >= 0."""
    rows, blocks = _valid_rows(block_indices, staging.device)
    for runs, cols in _pieces(layout, layers, rows):
        runs[blocks] = staging[rows, cols]
