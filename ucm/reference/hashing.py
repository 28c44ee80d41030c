"""Reference block hashing: MurmurHash3_x64_128 in plain Python, and the chained block ids.

Algorithm (documented in docs/hashing.md, vectors in tests/vectors/hashing.json):

* ``murmur3_x64_128(data, seed)``: :mod:`ucm.murmur`.
* ``id_i = murmur3_x64_128(namespace_digest || id_{i-1} || tokens of block i as uint32 LE, 0)``
  with ``id_{-1}`` = the ``parent`` argument (16 zero bytes for the first block of a sequence).
  Only full blocks get an id.

Block ids travel as ``np.uint64`` arrays of shape ``[n, 2]`` holding ``(h1, h2)``, so on a
little-endian host ``ids[i].tobytes()`` is the digest.
"""
from __future__ import annotations

import struct

import numpy as np

from ucm.murmur import murmur3_x64_128


def hash_blocks(tokens: np.ndarray, block_size: int, namespace: np.ndarray,
                parent: np.ndarray) -> np.ndarray:
    """Chained ids of the full blocks of ``tokens``.

    tokens: ``uint32 [n_tokens]`` contiguous; block_size > 0; namespace, parent: ``uint64 [2]``.
    Returns ``uint64 [n_tokens // block_size, 2]``.
    """
    n_blocks = len(tokens) // block_size
    out = np.empty((n_blocks, 2), dtype=np.uint64)
    ns = struct.pack("<QQ", int(namespace[0]), int(namespace[1]))
    prev = struct.pack("<QQ", int(parent[0]), int(parent[1]))
    for i in range(n_blocks):
        block = tokens[i * block_size:(i + 1) * block_size]
        payload = struct.pack(f"<{block_size}I", *(int(t) for t in block))
        prev = murmur3_x64_128(ns + prev + payload, 0)
        out[i] = struct.unpack("<QQ", prev)
    return out
