"""Reference byte movers: segment copies with ``ctypes.memmove``, aligned buffers from numpy.

Same names and signatures as :mod:`ucm.fast.native`; inputs are validated by ``ucm.ops``.
"""
from __future__ import annotations

import ctypes

import numpy as np


def copy_segments(src_ptrs: np.ndarray, dst_ptrs: np.ndarray, lengths: np.ndarray,
                  n_threads: int) -> None:
    """Copy ``lengths[i]`` bytes from address ``src_ptrs[i]`` to ``dst_ptrs[i]`` for every i.

    src_ptrs, dst_ptrs, lengths: ``uint64 [n]`` contiguous. ``n_threads`` is accepted for
    signature parity and ignored (one thread).
    """
    for s, d, n in zip(src_ptrs.tolist(), dst_ptrs.tolist(), lengths.tolist()):
        if n:
            ctypes.memmove(d, s, n)


def alloc_aligned(nbytes: int, alignment: int) -> np.ndarray:
    """A zero-filled ``uint8 [nbytes]`` array whose data pointer is a multiple of ``alignment``."""
    raw = np.zeros(nbytes + alignment, dtype=np.uint8)
    skew = (-raw.ctypes.data) % alignment
    return raw[skew:skew + nbytes]
