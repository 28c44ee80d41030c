"""Numba block hashing: the same MurmurHash3_x64_128 chain as ``ucm.reference.hashing``.

One jitted call hashes all blocks of a sequence (``nogil``, no ``parallel``: the chain is
sequential and engines may call this from several threads). Results are bit-identical to the
reference; see tests/test_hashing.py.
"""
from __future__ import annotations

import numpy as np

from ucm.fast.numba._jit import njit

_C1 = np.uint64(0x87C37B91114253D5)
_C2 = np.uint64(0x4CF5AD432745937F)
_F1 = np.uint64(0xFF51AFD7ED558CCD)
_F2 = np.uint64(0xC4CEB9FE1A85EC53)
_N1 = np.uint64(0x52DCE729)
_N2 = np.uint64(0x38495AB5)
_FIVE = np.uint64(5)
_U33 = np.uint64(33)
_U32 = np.uint64(32)


@njit(inline="always")
def _rotl(x, r):
    return (x << np.uint64(r)) | (x >> np.uint64(64 - r))


@njit(inline="always")
def _fmix(k):
    k ^= k >> _U33
    k *= _F1
    k ^= k >> _U33
    k *= _F2
    k ^= k >> _U33
    return k


@njit(inline="always")
def _mix_body(h1, h2, k1, k2):
    k1 *= _C1
    k1 = _rotl(k1, 31)
    k1 *= _C2
    h1 ^= k1
    h1 = _rotl(h1, 27)
    h1 += h2
    h1 = h1 * _FIVE + _N1
    k2 *= _C2
    k2 = _rotl(k2, 33)
    k2 *= _C1
    h2 ^= k2
    h2 = _rotl(h2, 31)
    h2 += h1
    h2 = h2 * _FIVE + _N2
    return h1, h2


@njit(nogil=True)
def _hash_blocks(tokens, block_size, ns0, ns1, p0, p1, out):
    n_blocks = out.shape[0]
    length = np.uint64(32 + 4 * block_size)
    full_pairs = block_size // 4  # 16-byte body blocks made of 4 tokens
    rem = block_size - 4 * full_pairs  # 0..3 tokens left = a 4/8/12-byte tail
    for b in range(n_blocks):
        base = b * block_size
        h1 = np.uint64(0)
        h2 = np.uint64(0)
        h1, h2 = _mix_body(h1, h2, ns0, ns1)
        h1, h2 = _mix_body(h1, h2, p0, p1)
        for q in range(full_pairs):
            o = base + 4 * q
            k1 = np.uint64(tokens[o]) | (np.uint64(tokens[o + 1]) << _U32)
            k2 = np.uint64(tokens[o + 2]) | (np.uint64(tokens[o + 3]) << _U32)
            h1, h2 = _mix_body(h1, h2, k1, k2)
        if rem > 0:
            o = base + 4 * full_pairs
            k1 = np.uint64(tokens[o])
            if rem > 1:
                k1 |= np.uint64(tokens[o + 1]) << _U32
            if rem > 2:
                k2 = np.uint64(tokens[o + 2])
                k2 *= _C2
                k2 = _rotl(k2, 33)
                k2 *= _C1
                h2 ^= k2
            k1 *= _C1
            k1 = _rotl(k1, 31)
            k1 *= _C2
            h1 ^= k1
        h1 ^= length
        h2 ^= length
        h1 += h2
        h2 += h1
        h1 = _fmix(h1)
        h2 = _fmix(h2)
        h1 += h2
        h2 += h1
        out[b, 0] = h1
        out[b, 1] = h2
        p0 = h1
        p1 = h2


def hash_blocks(tokens: np.ndarray, block_size: int, namespace: np.ndarray,
                parent: np.ndarray) -> np.ndarray:
    """Same contract as :func:`ucm.reference.hashing.hash_blocks`."""
    out = np.empty((len(tokens) // block_size, 2), dtype=np.uint64)
    if out.shape[0] == 0:  # also a block_size beyond int64, which the jitted code cannot type
        return out
    _hash_blocks(tokens, block_size, namespace[0], namespace[1], parent[0], parent[1], out)
    return out
