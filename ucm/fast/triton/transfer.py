"""Triton KV transfer: gather/scatter blocks of a paged KV cache in one kernel launch per call.

Same names and signatures as :mod:`ucm.reference.transfer`; inputs validated by
:mod:`ucm.transfer`.

Every byte run of the selected views (see :class:`ucm.layout.KVLayout`) is cut into pieces of at
most ``PIECE_BYTES``; a small int64 table on the device holds, per piece and in copy words, the
view's base address, its block stride, the piece's offset in a block, its length and its offset in
a staged row. Program ``(piece, row)`` copies that piece of block ``block_indices[row]`` (nothing
when ``-1``). The copy word is the widest of 8/4/2/1 bytes that divides every address, offset and
length of the call; when 16 does, the kernel is told so (``tl.multiple_of``) and moves 16 bytes per
access (checked in the PTX: ``ld/st.global.v2.b64``). All offsets are int64. One fixed
configuration, no autotuning. The interpreter (``TRITON_INTERPRET=1``) runs it on CPU tensors.
"""
from __future__ import annotations

import contextlib
import math

import numpy as np
import torch
import triton
import triton.language as tl

from ucm.fast.triton import interpreting
from ucm.layout import (COL_BASE, COL_BLOCK_STRIDE, COL_LENGTH, COL_OFFSET, COL_STAGING,
                          KVLayout)

#: Bytes one program copies at most (a run longer than this is split across programs).
PIECE_BYTES = 32 << 10
#: Bytes moved per loop iteration of one program.
TILE_BYTES = 8 << 10
NUM_WARPS = 4
_MAX_GRID_Y = 65535

_WORD = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}


def _copy_blocks(table_ptr, idx_ptr, staging_ptr, staging_address, row_elems, row_start,
                 TO_STAGING: tl.constexpr, TILE: tl.constexpr, ALIGN: tl.constexpr):
    """One program: piece ``program_id(0)`` of block ``idx[row_start + program_id(1)]``.

    table: int64 [pieces, 5] = (view base address, block stride, offset in block, length,
    offset in staged row), all in words; staging_address: ``staging_ptr``'s address in words.
    ALIGN: every one of those, and ``row_elems``, is a multiple of ALIGN words.

    The cache pointer is formed as ``staging_ptr + (base - staging_address) + ...`` rather than
    by casting the address to a pointer: the compiler then knows its alignment (a cast loses it,
    and the copy falls back to 8-byte accesses).
    """
    piece = tl.program_id(0).to(tl.int64)
    row = tl.program_id(1).to(tl.int64) + row_start
    block = tl.load(idx_ptr + row)
    if block >= 0:
        entry = table_ptr + piece * 5
        to_base = tl.multiple_of(tl.load(entry) - staging_address, ALIGN)
        block_stride = tl.multiple_of(tl.load(entry + 1), ALIGN)
        offset = tl.multiple_of(tl.load(entry + 2), ALIGN)
        length = tl.multiple_of(tl.load(entry + 3), ALIGN)
        staging_offset = tl.multiple_of(tl.load(entry + 4), ALIGN)
        cache = staging_ptr + (to_base + block * block_stride + offset)
        stage = staging_ptr + (tl.multiple_of(row * row_elems, ALIGN) + staging_offset)
        cols = tl.arange(0, TILE).to(tl.int64)
        for start in range(0, length, TILE):
            c = start + cols
            mask = c < length
            if TO_STAGING:
                tl.store(stage + c, tl.load(cache + c, mask=mask), mask=mask)
            else:
                tl.store(cache + c, tl.load(stage + c, mask=mask), mask=mask)


_kernels: dict = {}


def _kernel():
    """The jitted kernel; decorated on first use so that ``TRITON_INTERPRET`` (read by
    ``triton.jit``) is honoured whenever it was set before the first call."""
    mode = interpreting()
    k = _kernels.get(mode)
    if k is None:
        k = _kernels[mode] = triton.jit(_copy_blocks)
    return k


def _piece_table(layout: KVLayout, layers: tuple):
    """(int64 [pieces, 5] in bytes, gcd of all its entries) for this selection; cached.
    Columns: view base address, block stride, offset in block, length, offset in staged row."""
    def build():
        tab = layout.table(layers)
        counts = -(-tab[:, COL_LENGTH] // PIECE_BYTES)
        run = np.repeat(np.arange(len(tab)), counts)
        first = np.concatenate([[0], np.cumsum(counts)[:-1]])
        k = np.arange(len(run)) - np.repeat(first, counts)  # piece number inside its run
        within = k * PIECE_BYTES
        pieces = np.empty((len(run), 5), dtype=np.int64)
        pieces[:, 0] = tab[run, COL_BASE]
        pieces[:, 1] = tab[run, COL_BLOCK_STRIDE]
        pieces[:, 2] = tab[run, COL_OFFSET] + within
        pieces[:, 3] = np.minimum(tab[run, COL_LENGTH] - within, PIECE_BYTES)
        pieces[:, 4] = tab[run, COL_STAGING] + within
        g = int(np.gcd.reduce(np.abs(pieces).ravel()))
        return pieces, g
    return layout.cached(("triton_pieces", layers, PIECE_BYTES), build)


def _device_table(layout: KVLayout, layers: tuple, word: int, device):
    def build():
        pieces, _ = _piece_table(layout, layers)
        scaled = pieces // word
        return torch.from_numpy(scaled).to(device)
    return layout.cached(("triton_table", layers, PIECE_BYTES, word, str(device)), build)


def _launch(layout: KVLayout, block_indices: torch.Tensor, staging: torch.Tensor, layers: tuple,
            to_staging: bool) -> None:
    n = block_indices.shape[0]
    if n == 0:
        return
    pieces, g = _piece_table(layout, layers)
    pitch = staging.stride(0) if n > 1 else staging.shape[1]  # bytes from one row to the next
    g = math.gcd(g, pitch, staging.data_ptr(), 16)
    word = 8 if g % 8 == 0 else 4 if g % 4 == 0 else 2 if g % 2 == 0 else 1
    align = g // word  # 16-byte multiples when g == 16 (2 words of 8 bytes), else 1
    table = _device_table(layout, layers, word, staging.device)
    words = staging.view(_WORD[word])
    idx = block_indices if block_indices.device == staging.device else block_indices.to(staging.device)
    tile = max(TILE_BYTES // word, 16)
    kernel = _kernel()
    with torch.cuda.device(staging.device) if staging.is_cuda else contextlib.nullcontext():
        for row_start in range(0, n, _MAX_GRID_Y):
            rows = min(_MAX_GRID_Y, n - row_start)
            kernel[(len(pieces), rows)](table, idx, words, staging.data_ptr() // word,
                                        pitch // word, row_start, TO_STAGING=to_staging,
                                        TILE=tile, ALIGN=align, num_warps=NUM_WARPS)


def gather_blocks(layout: KVLayout, block_indices: torch.Tensor, staging: torch.Tensor,
                  layers: tuple) -> None:
    """Same contract as :func:`ucm.reference.transfer.gather_blocks`; asynchronous on the
    current CUDA stream."""
    _launch(layout, block_indices, staging, layers, to_staging=True)


def scatter_blocks(layout: KVLayout, staging: torch.Tensor, block_indices: torch.Tensor,
                   layers: tuple) -> None:
    """Same contract as :func:`ucm.reference.transfer.scatter_blocks`; asynchronous on the
    current CUDA stream."""
    _launch(layout, block_indices, staging, layers, to_staging=False)
