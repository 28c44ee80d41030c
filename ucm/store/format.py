"""On-disk block format (version 1), documented in docs/block-format.md.

::

    offset  size  field
    0       8     magic b"UCMKVBLK"
    8       4     format version (1), little-endian u32
    12      4     header size H (a multiple of 4096, so the payload suits O_DIRECT)
    16      16    namespace digest
    32      16    block id
    48      4     codec (0 = raw)
    52      4     flags (0)
    56      8     block_bytes (payload length)
    64      8     shard_bytes
    72      4     number of shards S
    76      4     reserved (0)
    80      8     header checksum: ucm-sum64 of bytes [0, 88 + 8 S) with this field zeroed
    88      8 S   ucm-sum64 of each shard (shard k's first word is word k * shard_bytes / 8)
    ...           zero padding up to H
    H       block_bytes  payload

A reader trusts a block only if every field matches what it expects (magic, version, namespace,
id, codec, geometry), the header checksum holds, the file is exactly ``H + block_bytes`` long and
the checksum of every shard it reads matches the table.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np

from ucm.ops import checksum

MAGIC = b"UCMKVBLK"
VERSION = 1
_FIXED = struct.Struct("<8sII16s16sIIQQII")  # up to the header checksum (80 bytes)
assert _FIXED.size == 80
ALIGN = 4096


def header_size(n_shards: int, align: int = ALIGN) -> int:
    """Bytes of a header for ``n_shards`` shards, padded to ``align`` (files: 4096, so the
    payload suits O_DIRECT; values of the distributed tiers: 64)."""
    return -(-(88 + 8 * n_shards) // align) * align


@dataclass(frozen=True, eq=False)
class Header:
    namespace: bytes
    block_id: bytes
    codec: int
    block_bytes: int
    shard_bytes: int
    shard_checksums: np.ndarray  # uint64 [n_shards]
    align: int = ALIGN

    @property
    def n_shards(self) -> int:
        return len(self.shard_checksums)

    @property
    def size(self) -> int:
        return header_size(self.n_shards, self.align)

    def pack(self) -> np.ndarray:
        """The header as an aligned uint8 array of ``size`` bytes."""
        buf = np.zeros(self.size, dtype=np.uint8)
        fixed = _FIXED.pack(MAGIC, VERSION, self.size, self.namespace, self.block_id, self.codec,
                            0, self.block_bytes, self.shard_bytes, self.n_shards, 0)
        table = np.asarray(self.shard_checksums, dtype="<u8").tobytes()
        body = fixed + b"\0" * 8 + table
        buf[:len(body)] = np.frombuffer(body, dtype=np.uint8)
        ck = checksum(buf[:len(body)])
        buf[80:88] = np.frombuffer(struct.pack("<Q", ck), dtype=np.uint8)
        return buf


class BadBlock(Exception):
    """A header that fails a check (the reason is the message). ``foreign``: the header is
    intact but describes another block (namespace, id, codec, geometry or format version): a
    miss for this reader, not damage; anything else is corruption."""

    def __init__(self, reason: str, foreign: bool = False):
        super().__init__(reason)
        self.foreign = foreign


def describe(raw: np.ndarray) -> dict:
    """The fields of a header without expecting anything of them (for inspection tools):
    ``{"valid": bool, "reason": str, ...fields}``; ``valid`` when the magic, version, sizes and
    header checksum hold."""
    if raw.nbytes < 88:
        return {"valid": False, "reason": "header truncated"}
    (magic, version, hsize, ns, bid, cdc, flags, bbytes, sbytes, nsh, _r) = _FIXED.unpack(
        raw[:80].tobytes())
    out = {"magic": magic.decode("latin-1"), "version": version, "header_bytes": hsize,
           "namespace": ns.hex(), "block_id": bid.hex(), "codec": cdc, "flags": flags,
           "block_bytes": bbytes, "shard_bytes": sbytes, "shards": nsh}
    if magic != MAGIC:
        return {**out, "valid": False, "reason": "bad magic"}
    if version != VERSION:
        return {**out, "valid": False, "reason": f"format version {version}, expected {VERSION}"}
    if hsize != header_size(nsh) or raw.nbytes < 88 + 8 * nsh:
        return {**out, "valid": False, "reason": "header size inconsistent"}
    body = raw[:88 + 8 * nsh].copy()
    stored = struct.unpack("<Q", body[80:88].tobytes())[0]
    body[80:88] = 0
    if checksum(body) != stored:
        return {**out, "valid": False, "reason": "header checksum mismatch"}
    table = np.frombuffer(raw[88:88 + 8 * nsh].tobytes(), dtype="<u8").astype(np.uint64)
    return {**out, "valid": True, "reason": "", "shard_checksums": table}


def parse(raw: np.ndarray, namespace: bytes, block_id: bytes, block_bytes: int, shard_bytes: int,
          codec: int = 0, align: int = ALIGN) -> Header:
    """Validate the first ``header_size`` bytes of a block file against expectations: first
    that the header is intact (magic, size fields, its checksum), then that it is this block."""
    if raw.nbytes < 88:
        raise BadBlock("header truncated")
    (magic, version, hsize, ns, bid, cdc, _flags, bbytes, sbytes, nsh, _r) = _FIXED.unpack(
        raw[:80].tobytes())
    if magic != MAGIC:
        raise BadBlock("bad magic")
    if version != VERSION:
        raise BadBlock(f"format version {version}, expected {VERSION}", foreign=True)
    if hsize != header_size(nsh, align):
        raise BadBlock("header size inconsistent")
    if raw.nbytes < 88 + 8 * nsh:
        raise BadBlock(f"header of {nsh} shards, this reader expects fewer", foreign=True)
    body = raw[:88 + 8 * nsh].copy()
    stored = struct.unpack("<Q", body[80:88].tobytes())[0]
    body[80:88] = 0
    if checksum(body) != stored:
        raise BadBlock("header checksum mismatch")
    if ns != namespace:
        raise BadBlock("namespace differs", foreign=True)
    if bid != block_id:
        raise BadBlock("block id differs", foreign=True)
    if cdc != codec:
        raise BadBlock(f"codec {cdc}, expected {codec}", foreign=True)
    if bbytes != block_bytes or sbytes != shard_bytes or nsh * shard_bytes != block_bytes:
        raise BadBlock(f"geometry {bbytes}/{sbytes}/{nsh} differs from {block_bytes}/{shard_bytes}",
                       foreign=True)
    table = np.frombuffer(raw[88:88 + 8 * nsh].tobytes(), dtype="<u8").astype(np.uint64)
    return Header(ns, bid, cdc, bbytes, sbytes, table, align)
