"""Reference codecs fused with the KV transfer (:func:`ucm.compress.gather_encode`,
:func:`ucm.compress.decode_scatter`): the reference gather into a temporary staging buffer, then
:func:`ucm.reference.compress.encode` per selected layer (and :func:`~ucm.reference.compress.decode`
per layer, then the reference scatter). Inputs validated by :mod:`ucm.compress`: ``block_indices``
an int64 1-D tensor on the cache's device (``-1`` = skip the row), ``layers`` a tuple, every
selected layer's shard ``shape.raw_bytes`` long.
"""
from __future__ import annotations

import numpy as np
import torch

from ucm.codecs import CodecSpec, KVShape, encoded_bytes
from ucm.layout import KVLayout
from ucm.reference import compress, transfer


def gather_encode(layout: KVLayout, block_indices: torch.Tensor, spec: CodecSpec,
                  shape: KVShape, dst: torch.Tensor, layers: tuple) -> np.ndarray:
    """``dst[i, k * E:(k + 1) * E]`` = encoding of layer ``layers[k]``'s shard of block
    ``block_indices[i]`` (``E = encoded_bytes``); rows of ``-1`` untouched. Returns ok per
    row: False where a selected shard held NaN, infinite or too large values."""
    n, L = block_indices.shape[0], len(layers)
    R, E = shape.raw_bytes, encoded_bytes(spec, shape)
    ok = np.ones(n, dtype=bool)
    rows = torch.nonzero(block_indices >= 0).squeeze(1)
    if rows.numel() == 0:
        return ok
    staging = torch.zeros((rows.numel(), L * R), dtype=torch.uint8, device=dst.device)
    transfer.gather_blocks(layout, block_indices[rows], staging, layers)
    host_rows = rows.cpu().numpy()
    for k, layer in enumerate(layers):
        out = torch.zeros((rows.numel(), E), dtype=torch.uint8, device=dst.device)
        ok[host_rows] &= compress.encode(spec, shape, staging[:, k * R:(k + 1) * R], out, layer)
        dst[rows, k * E:(k + 1) * E] = out
    return ok


def decode_scatter(layout: KVLayout, src: torch.Tensor, block_indices: torch.Tensor,
                   spec: CodecSpec, shape: KVShape, layers: tuple) -> None:
    """Block ``block_indices[i]``'s shard of layer ``layers[k]`` = decoding of
    ``src[i, k * E:(k + 1) * E]``; nothing written for rows of ``-1``."""
    L = len(layers)
    R, E = shape.raw_bytes, encoded_bytes(spec, shape)
    rows = torch.nonzero(block_indices >= 0).squeeze(1)
    if rows.numel() == 0:
        return
    enc = src[rows]
    staging = torch.zeros((rows.numel(), L * R), dtype=torch.uint8, device=src.device)
    for k, layer in enumerate(layers):
        out = torch.zeros((rows.numel(), R), dtype=torch.uint8, device=src.device)
        compress.decode(spec, shape, enc[:, k * E:(k + 1) * E].contiguous(), out, layer)
        staging[:, k * R:(k + 1) * R] = out
    transfer.scatter_blocks(layout, staging, block_indices[rows], layers)
