"""MurmurHash3_x64_128 in plain Python: the one keyed digest behind every id ucm derives
(namespace digests, rank and tail salts, request roots, and the chained block ids of
:mod:`ucm.reference.hashing`). A base module: any layer may use it.

Austin Appleby's MurmurHash3_x64_128 (public domain, SMHasher); digest = h1 then h2, each
little-endian (the same 16 bytes ``mmh3.hash_bytes`` returns). Vectors in
``tests/vectors/hashing.json``.
"""
from __future__ import annotations

import struct

M64 = 0xFFFFFFFFFFFFFFFF
C1 = 0x87C37B91114253D5
C2 = 0x4CF5AD432745937F


def _rotl(x: int, r: int) -> int:
    return ((x << r) | (x >> (64 - r))) & M64


def _fmix(k: int) -> int:
    k ^= k >> 33
    k = (k * 0xFF51AFD7ED558CCD) & M64
    k ^= k >> 33
    k = (k * 0xC4CEB9FE1A85EC53) & M64
    k ^= k >> 33
    return k


def murmur3_x64_128(data: bytes, seed: int = 0) -> bytes:
    """MurmurHash3_x64_128 of ``data`` with a 32-bit ``seed``; returns the 16-byte digest."""
    assert 0 <= seed <= 0xFFFFFFFF
    n = len(data)
    h1 = h2 = seed
    nblocks = n // 16
    for i in range(nblocks):
        k1, k2 = struct.unpack_from("<QQ", data, 16 * i)
        k1 = (k1 * C1) & M64
        k1 = _rotl(k1, 31)
        k1 = (k1 * C2) & M64
        h1 ^= k1
        h1 = _rotl(h1, 27)
        h1 = (h1 + h2) & M64
        h1 = (h1 * 5 + 0x52DCE729) & M64
        k2 = (k2 * C2) & M64
        k2 = _rotl(k2, 33)
        k2 = (k2 * C1) & M64
        h2 ^= k2
        h2 = _rotl(h2, 31)
        h2 = (h2 + h1) & M64
        h2 = (h2 * 5 + 0x38495AB5) & M64

    tail = data[16 * nblocks:]
    k1 = k2 = 0
    for j in range(len(tail) - 1, 7, -1):  # bytes 8..15 of the tail feed k2
        k2 ^= tail[j] << (8 * (j - 8))
    if len(tail) > 8:
        k2 = (k2 * C2) & M64
        k2 = _rotl(k2, 33)
        k2 = (k2 * C1) & M64
        h2 ^= k2
    for j in range(min(len(tail), 8) - 1, -1, -1):  # bytes 0..7 feed k1
        k1 ^= tail[j] << (8 * j)
    if len(tail) > 0:
        k1 = (k1 * C1) & M64
        k1 = _rotl(k1, 31)
        k1 = (k1 * C2) & M64
        h1 ^= k1

    h1 ^= n
    h2 ^= n
    h1 = (h1 + h2) & M64
    h2 = (h2 + h1) & M64
    h1 = _fmix(h1)
    h2 = _fmix(h2)
    h1 = (h1 + h2) & M64
    h2 = (h2 + h1) & M64
    return struct.pack("<QQ", h1, h2)
