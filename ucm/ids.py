"""Block identity: the namespace digest and conversions of 128-bit block ids.

A block id is 16 bytes, carried in arrays as ``np.uint64 [n, 2]`` (see
:mod:`ucm.reference.hashing` for the chained hash). The namespace digest covers everything
that makes the KV bytes of the same tokens differ, so two engines share blocks only when their
namespaces are equal:

    digest = MurmurHash3_x64_128(b"ucm-namespace-v1\\0" + canonical JSON of the fields, seed 0)

The canonical JSON is ``json.dumps(fields, sort_keys=True, separators=(",", ":"),
ensure_ascii=True)`` of the dataclass fields below. MurmurHash3 is not cryptographic: a tenant who
can choose prompts could in principle craft a colliding block; deployments that serve mutually
untrusting tenants set a secret ``tenant_salt`` per tenant, which puts each tenant in its own
namespace.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Any, Iterable, Optional, Sequence, Union

import numpy as np

from ucm.murmur import murmur3_x64_128

ID_BYTES = 16
ZERO_ID = np.zeros(2, dtype=np.uint64)

KV_LAYOUTS = ("vllm_cuda", "vllm_cpu", "blocks_first", "layers_first", "mla")


@dataclass(frozen=True)
class Namespace:
    """What must be equal for two engines to share KV blocks."""

    model: str
    dtype: str
    block_size: int
    kv_layout: str = "vllm_cuda"
    tp_rank: int = 0
    tp_size: int = 1
    codec: str = "none"
    tenant_salt: str = ""

    def __post_init__(self):
        if not isinstance(self.model, str) or not self.model:
            raise ValueError(f"Namespace.model must be a non-empty string, got {self.model!r}")
        if not isinstance(self.dtype, str) or not self.dtype:
            raise ValueError(f"Namespace.dtype must be a non-empty string, got {self.dtype!r}")
        # a plain int: numpy ints are not JSON-serializable (the digest) and must equal ints
        object.__setattr__(self, "block_size", _check_block_size(self.block_size,
                                                                 "Namespace.block_size"))
        if not isinstance(self.kv_layout, str) or not self.kv_layout:
            raise ValueError(f"Namespace.kv_layout must be a non-empty string (e.g. one of "
                             f"{list(KV_LAYOUTS)}), got {self.kv_layout!r}")
        if isinstance(self.tp_size, bool) or not (isinstance(self.tp_size, int) and self.tp_size >= 1):
            raise ValueError(f"Namespace.tp_size must be an int >= 1, got {self.tp_size!r}")
        if isinstance(self.tp_rank, bool) or \
                not (isinstance(self.tp_rank, int) and 0 <= self.tp_rank < self.tp_size):
            raise ValueError(f"Namespace.tp_rank must be an int in [0, tp_size={self.tp_size}), "
                             f"got {self.tp_rank!r}")

    def canonical(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True, separators=(",", ":"),
                          ensure_ascii=True).encode("ascii")

    def digest(self) -> bytes:
        """16-byte namespace digest."""
        return murmur3_x64_128(b"ucm-namespace-v1\0" + self.canonical(), 0)

    def digest_words(self) -> np.ndarray:
        return np.frombuffer(self.digest(), dtype="<u8").astype(np.uint64)


def _check_block_size(block_size, name="block_size") -> int:
    if isinstance(block_size, bool) or not isinstance(block_size, (int, np.integer)) or block_size <= 0:
        raise ValueError(f"{name} must be a positive int, got {block_size!r}")
    return int(block_size)


IdsLike = Union[np.ndarray, Sequence[bytes], Iterable[bytes]]


def as_ids(ids: IdsLike, name: str = "ids") -> np.ndarray:
    """Normalize block ids to a C-contiguous ``uint64 [n, 2]`` array.

    Accepts such an array (or any integer array of shape ``[n, 2]`` with values in uint64 range),
    a ``uint8 [n, 16]`` array, or a sequence of 16-byte ``bytes``. Anything else raises
    ``ValueError`` naming ``name``.
    """
    if isinstance(ids, np.ndarray):
        if ids.dtype == np.uint8 and ids.ndim == 2 and ids.shape[1] == ID_BYTES:
            return np.ascontiguousarray(ids).view("<u8").astype(np.uint64, copy=False).reshape(-1, 2)
        if ids.ndim != 2 or ids.shape[1] != 2:
            raise ValueError(f"{name}: expected shape [n, 2] (uint64) or [n, 16] (uint8), "
                             f"got shape {list(ids.shape)} dtype {ids.dtype}")
        if ids.dtype == np.uint64:
            return np.ascontiguousarray(ids)
        if ids.dtype.kind in "iu":
            if ids.size and ids.min() < 0:
                raise ValueError(f"{name}: block ids are unsigned; got negative values")
            return np.ascontiguousarray(ids, dtype=np.uint64)
        raise ValueError(f"{name}: expected an integer array, got dtype {ids.dtype}")
    if isinstance(ids, (bytes, bytearray, str)):
        raise ValueError(f"{name}: expected a sequence of 16-byte ids, got a single {type(ids).__name__}")
    items = list(ids)
    out = np.empty((len(items), 2), dtype=np.uint64)
    for i, item in enumerate(items):
        if not isinstance(item, (bytes, bytearray)) or len(item) != ID_BYTES:
            raise ValueError(f"{name}[{i}]: expected {ID_BYTES} bytes, got {type(item).__name__} "
                             f"of length {len(item) if hasattr(item, '__len__') else '?'}")
        out[i] = np.frombuffer(bytes(item), dtype="<u8")
    return out


def id_bytes(ids: np.ndarray) -> list[bytes]:
    """``uint64 [n, 2]`` → list of 16-byte digests."""
    return [row.astype("<u8").tobytes() for row in as_ids(ids)]


def id_hex(ids: np.ndarray) -> list[str]:
    """``uint64 [n, 2]`` → list of 32-character lowercase hex names (used for files and keys)."""
    return [b.hex() for b in id_bytes(ids)]


def derived_id(parent: Optional[np.ndarray], tag: bytes, payload: Any) -> np.ndarray:
    """An id ``uint64 [2]`` derived from ``parent`` (an id, or None) and ``payload`` (any value
    with a stable ``repr``) under ``tag``: the roots of id chains (a request's LoRA adapter,
    cache salt and generation; what a Blend chunk was computed after) and their per-block
    extras."""
    base = bytes(16) if parent is None else np.ascontiguousarray(parent, dtype="<u8").tobytes()
    digest = murmur3_x64_128(tag + base + repr(payload).encode("utf-8", "backslashreplace"), 0)
    return np.frombuffer(digest, dtype="<u8").astype(np.uint64)
