"""Triton KV codecs: :func:`encode` / :func:`decode` (same contract as
:mod:`ucm.reference.compress`, inputs validated by :mod:`ucm.compress`) and the fused
:func:`gather_encode` / :func:`decode_scatter` (quantize straight out of the paged KV cache and
dequantize straight into it, no raw staging rows in between).

Integer formats are bit-identical to the reference: float32 arithmetic, correctly rounded
divisions (``tl.math.div_rn``: Triton's ``/`` is approximate), round half to even,
the reference's ``bf16_up`` / ``bf16_down`` bit rules, ``q * s`` (exact) then ``+ m``, round to
nearest even into the cache's type; padding bytes between segments are written as zeros. A shard
holding NaN or infinite values gets ``ok = False`` and the encoding of an all-zero shard (what
the reference writes), so even refused rows match byte for byte.

Addressing. Every kernel sees a shard as ``2 * T * H`` *vectors* of ``D`` contiguous elements,
numbered canonically ``v = (kv * T + t) * H + h``. Two small int64 tables give, per (selected
layer, vector), the vector's element offset from an anchor pointer and its stride per block
(row), so that element ``d`` of vector ``v`` of block ``b`` is at
``anchor + voff[l, v] + b * vstride[l, v] + d``. For plain rows (:func:`encode` / :func:`decode`)
the anchor is the raw rows (typed), ``voff`` the vector's position in the shard's memory order
and ``vstride`` the row pitch; for the fused ops they come from :class:`ucm.layout.KVLayout`'s
byte runs (a layout whose runs cut a vector, or whose addresses are not multiples of the element
size, takes the unfused path: Triton gather + encode). One kernel family serves both.

Kernels (:mod:`ucm.fast.triton.compress_kernels`; one launch per call):

* ``_int8_encode`` / ``_int8_decode``: INT8, a program per ``BV`` consecutive vectors (over all
  shards of the call).
* ``_int4_encode`` / ``_int4_decode``: INT4 (``quantize`` bits 4, keys per channel or per token
  group) and ``sparse`` (``SPARSE``: per shard, salient tokens by ``max |K|`` over heads and
  channels, ties to the lower token, kept exact; the rest INT4), a program per (shard, chunk of
  heads); sparse runs one chunk of all heads per shard.
* ``learned``: the reference (PyTorch einsum, cuBLAS on CUDA tensors).

Launch constants live in :class:`LaunchConfig` (:data:`LAUNCH` is the default); every function
takes ``launch=``. The interpreter (``TRITON_INTERPRET=1``) runs the kernels on CPU tensors.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
import threading
from dataclasses import dataclass

import numpy as np
import torch
import triton

from ucm.codecs import CodecSpec, KVShape, encoded_bytes, n_salient, offsets
from ucm.fast.triton.compress_kernels import (_int4_decode, _int4_encode, _int8_decode,
                                              _int8_encode, jit)
from ucm.layout import COL_BASE, COL_BLOCK_STRIDE, COL_LENGTH, COL_OFFSET, COL_STAGING, KVLayout
from ucm.reference import compress as _ref

_TORCH = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


@dataclass(frozen=True)
class LaunchConfig:
    """Launch constants of the codec kernels."""
    #: Vectors (of ``head_dim`` channels) per program of the INT8 kernels.
    int8_vectors: int = 32
    int8_warps: int = 4
    #: KV heads per program of the INT4 kernels (a divisor of the head count is used: the
    #: largest one not above this); sparse shards always take all heads in one program.
    int4_heads: int = 1
    int4_warps: int = 4
    sparse_warps: int = 4

    def replace(self, **changes) -> "LaunchConfig":
        return dataclasses.replace(self, **changes)


LAUNCH = LaunchConfig()
_lock = threading.Lock()

# ---------------------------------------------------------------------------------------------
# formats and address tables

def _pow2(n: int, least: int = 1) -> int:
    return max(least, triton.next_power_of_2(int(n)))


_cache: dict = {}


def _cached(key, build):
    val = _cache.get(key)
    if val is None:
        val = build()
        with _lock:
            _cache[key] = val
    return val


def _format(spec: CodecSpec, shape: KVShape) -> dict:
    """Segment offsets and the padding bytes of one encoded shard (host ints / int32 array)."""
    def build():
        offs = offsets(spec, shape)
        pad = []
        for at, dt, shp in offs.values():
            end = at + math.prod(shp) * {"uint8": 1, "int8": 1, "bfloat16": 2, "float16": 2,
                                         "float32": 4}[dt]
            pad.extend(range(end, -(-end // 8) * 8))
        return {name: at for name, (at, _, _) in offs.items()}, np.array(pad, dtype=np.int32)
    key = ("format", spec.method, spec.bits, spec.group, spec.key_mode, float(spec.salient), shape)
    return _cached(key, build)


def _pad_table(spec, shape, device):
    def build():
        _, pad = _format(spec, shape)
        return torch.from_numpy(pad if len(pad) else np.zeros(1, np.int32)).to(device)
    return _cached(("pad", spec.method, spec.bits, spec.group, spec.key_mode,
                    float(spec.salient), shape, str(device)), build)


def _zero_row(spec: CodecSpec, shape: KVShape, device) -> torch.Tensor:
    """uint8 [E]: what the reference writes for a refused (non-finite) shard, i.e. the encoding
    of an all-zero shard."""
    def build():
        out = torch.empty((1, encoded_bytes(spec, shape)), dtype=torch.uint8)
        _ref.encode(spec, shape, torch.zeros((1, shape.raw_bytes), dtype=torch.uint8), out, 0)
        return out[0].to(device)
    return _cached(("zero", spec.method, spec.bits, spec.group, spec.key_mode,
                    float(spec.salient), shape, str(device)), build)


def _positions(shape: KVShape) -> np.ndarray:
    """int64 [2 * T * H]: memory position (in vectors) of canonical vector (kv, t, h) in a
    shard stored in ``shape.order``."""
    sizes = shape.sizes()
    dims = shape.order[:-1]
    stride, st = {}, 1
    for c in reversed(dims):
        stride[c] = st
        st *= sizes[c]
    kv, t, h = np.meshgrid(np.arange(2), np.arange(shape.tokens), np.arange(shape.heads),
                           indexing="ij")
    return (kv * stride["k"] + t * stride["t"] + h * stride["h"]).reshape(-1).astype(np.int64)


def _align(values, esize: int) -> int:
    """Largest power of two (at most 16 bytes' worth of elements) dividing every value."""
    g = int(np.gcd.reduce(np.abs(np.asarray(values, dtype=np.int64)).ravel())) if len(values) else 0
    a = max(1, 16 // esize)
    while a > 1 and g % a:
        a //= 2
    return a


def _plain_tables(shape: KVShape, pitch: int, device):
    """Tables for plain rows of ``pitch`` elements: (voff [1, V], vstride [1, V], align)."""
    def build():
        voff = _positions(shape) * shape.head_dim
        vstride = np.full_like(voff, pitch)
        align = _align(np.concatenate([voff, [pitch]]), shape.esize)
        return (torch.from_numpy(voff[None]).to(device), torch.from_numpy(vstride[None]).to(device),
                align)
    return _cached(("plain", shape, pitch, str(device)), build)


def _anchor(layout: KVLayout, dtype: torch.dtype) -> torch.Tensor:
    """A tensor of ``dtype`` starting where the storage of ``layout.views[0]`` starts."""
    view = layout.views[0]
    flat = torch.empty(0, dtype=torch.uint8, device=view.device).set_(view.untyped_storage())
    esize = torch.tensor([], dtype=dtype).element_size()
    return flat[: flat.numel() // esize * esize].view(dtype)


def _layout_tables(layout: KVLayout, layers: tuple, shape: KVShape):
    """(anchor, voff [L, V], vstride [L, V], align) for the fused kernels, or None when a
    vector of a shard is cut by a run boundary or an address is not a multiple of the element
    size (the caller then takes the unfused path); cached per layout."""
    def build():
        dtype = _TORCH[shape.dtype]
        anchor = _anchor(layout, dtype)
        a0, e = anchor.data_ptr(), shape.esize
        tab = layout.table(layers)
        vec = shape.head_dim * e
        pos = _positions(shape) * vec                      # byte offset in the shard
        voff = np.empty((len(layers), len(pos)), dtype=np.int64)
        vstride = np.empty_like(voff)
        start = 0
        for k in range(len(layers)):
            at = start + pos                                 # byte offset in the staged row
            r = np.searchsorted(tab[:, COL_STAGING], at, side="right") - 1
            inside = at + vec <= tab[r, COL_STAGING] + tab[r, COL_LENGTH]
            if not inside.all():
                return None
            addr = tab[r, COL_BASE] + tab[r, COL_OFFSET] + (at - tab[r, COL_STAGING]) - a0
            bst = tab[r, COL_BLOCK_STRIDE]
            if (addr % e).any() or (bst % e).any():
                return None
            voff[k], vstride[k] = addr // e, bst // e
            start += shape.raw_bytes
        align = _align(np.concatenate([voff.ravel(), vstride.ravel()]), e)
        return (anchor, torch.from_numpy(voff).to(layout.device),
                torch.from_numpy(vstride).to(layout.device), align)
    return layout.cached(("triton_codec", layers, shape), build)


def _typed_rows(rows: torch.Tensor, dtype: torch.dtype):
    """``rows`` (uint8 [n, R]) viewed as ``dtype``, or None if its offsets do not allow it."""
    esize = torch.tensor([], dtype=dtype).element_size()
    if rows.data_ptr() % esize or (rows.shape[0] > 1 and rows.stride(0) % esize):
        return None
    try:
        if rows.shape[0] == 1:
            rows = rows.as_strided(rows.shape, (rows.shape[1], 1))
        return rows.view(dtype)
    except RuntimeError:
        return None


def _pitch(rows: torch.Tensor) -> int:
    return rows.stride(0) if rows.shape[0] > 1 else rows.shape[1]


def _aligned_enc(rows: torch.Tensor) -> bool:
    """Encoded rows the kernels write in place: 8-byte aligned rows (the exact tokens of the
    sparse codec are stored as elements)."""
    return rows.data_ptr() % 8 == 0 and _pitch(rows) % 8 == 0


def _device_ctx(t: torch.Tensor):
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


# ---------------------------------------------------------------------------------------------
# launches

def _heads_per_program(spec: CodecSpec, shape: KVShape, launch: LaunchConfig) -> int:
    if spec.method == "sparse":
        return shape.heads
    hpp = max(1, min(launch.int4_heads, shape.heads))
    while shape.heads % hpp:
        hpp -= 1
    return hpp


def _encode_launch(spec, shape, raw, voff, vstride, align, idx, enc, enc_pitch, flags, n, L,
                   launch: LaunchConfig) -> None:
    offs, pad = _format(spec, shape)
    padt = _pad_table(spec, shape, enc.device)
    npad = len(pad)
    T, H, D = shape.tokens, shape.heads, shape.head_dim
    E = encoded_bytes(spec, shape)
    indexed = idx is not None
    if idx is None:
        idx = flags                                        # unused
    with _device_ctx(enc):
        if spec.method == "quantize" and spec.bits == 8:
            V = 2 * T * H
            bv = _pow2(launch.int8_vectors)
            total = n * L * V
            jit(_int8_encode)[(triton.cdiv(total, bv),)](
                raw, voff, vstride, idx, enc, enc_pitch, flags, padt, total,
                V=V, L=L, D=D, DP=_pow2(D), E=E, SCALE=offs["scale"], NPAD=npad,
                NPADP=_pow2(npad), BV=bv, INDEXED=indexed, ALIGN=align,
                BF16=shape.dtype == "bfloat16", num_warps=launch.int8_warps)
            return
        sparse = spec.method == "sparse"
        hpp = _heads_per_program(spec, shape, launch)
        jit(_int4_encode)[(n * L, H // hpp)](
            raw, voff, vstride, idx, enc, enc_pitch, flags, padt,
            T=T, TP=_pow2(T), H=H, D=D, DP=_pow2(D), G=spec.group, L=L, E=E,
            KQ=offs["kq"], VQ=offs["vq"], KP=offs["kp"], VP=offs["vp"],
            BITMAP=offs.get("bitmap", 0), EXACT=offs.get("exact", 0),
            C=n_salient(spec, shape) if sparse else 0, TB=_pow2(T, 8),
            CHANNEL=spec.key_mode == "channel", SPARSE=sparse, HPP=hpp, NPAD=npad,
            NPADP=_pow2(npad), INDEXED=indexed, ALIGN=align, BF16=shape.dtype == "bfloat16",
            num_warps=launch.sparse_warps if sparse else launch.int4_warps)


def _decode_launch(spec, shape, raw, voff, vstride, align, idx, enc, enc_pitch, n, L,
                   launch: LaunchConfig) -> None:
    offs, _ = _format(spec, shape)
    T, H, D = shape.tokens, shape.heads, shape.head_dim
    E = encoded_bytes(spec, shape)
    indexed = idx is not None
    if idx is None:
        idx = voff                                         # unused
    with _device_ctx(enc):
        if spec.method == "quantize" and spec.bits == 8:
            V = 2 * T * H
            bv = _pow2(launch.int8_vectors)
            total = n * L * V
            jit(_int8_decode)[(triton.cdiv(total, bv),)](
                raw, voff, vstride, idx, enc, enc_pitch, total,
                V=V, L=L, D=D, DP=_pow2(D), E=E, SCALE=offs["scale"], BV=bv, INDEXED=indexed,
                ALIGN=align, BF16=shape.dtype == "bfloat16", num_warps=launch.int8_warps)
            return
        sparse = spec.method == "sparse"
        hpp = _heads_per_program(spec, shape, launch)
        jit(_int4_decode)[(n * L, H // hpp)](
            raw, voff, vstride, idx, enc, enc_pitch,
            T=T, TP=_pow2(T), H=H, D=D, DP=_pow2(D), G=spec.group, L=L, E=E,
            KQ=offs["kq"], VQ=offs["vq"], KP=offs["kp"], VP=offs["vp"],
            BITMAP=offs.get("bitmap", 0), EXACT=offs.get("exact", 0),
            CHANNEL=spec.key_mode == "channel", SPARSE=sparse, HPP=hpp, INDEXED=indexed,
            ALIGN=align, BF16=shape.dtype == "bfloat16", num_warps=launch.sparse_warps if sparse else launch.int4_warps)


def _fix_refused(flags: torch.Tensor, spec, shape, dst: torch.Tensor, L: int) -> np.ndarray:
    """ok per (row, layer) from the kernel's flags (one synchronizing copy); refused shards get
    the reference's bytes (the encoding of zeros)."""
    ok = flags.reshape(-1, L).cpu().numpy() != 0
    if not ok.all():
        E = encoded_bytes(spec, shape)
        zero = _zero_row(spec, shape, dst.device)
        for i, k in zip(*np.nonzero(~ok)):
            dst[int(i), int(k) * E:(int(k) + 1) * E] = zero
    return ok


# ---------------------------------------------------------------------------------------------
# ops

def encode(spec: CodecSpec, shape: KVShape, src: torch.Tensor, dst: torch.Tensor, layer: int,
           *, launch: LaunchConfig = LAUNCH) -> np.ndarray:
    """Same contract as :func:`ucm.reference.compress.encode` (CUDA tensors, or CPU tensors
    under the interpreter); synchronizes once (the ``ok`` flags)."""
    if spec.method == "learned":
        return _ref.encode(spec, shape, src, dst, layer)
    n = src.shape[0]
    raw = _typed_rows(src, _TORCH[shape.dtype])
    if raw is None:
        raw = src.clone(memory_format=torch.contiguous_format).view(_TORCH[shape.dtype])
    enc = dst if _aligned_enc(dst) else torch.empty(dst.shape, dtype=torch.uint8, device=dst.device)
    voff, vstride, align = _plain_tables(shape, _pitch(raw), raw.device)
    flags = torch.ones(n, dtype=torch.int32, device=src.device)
    _encode_launch(spec, shape, raw, voff, vstride, align, None, enc, _pitch(enc), flags, n, 1,
                   launch)
    if enc is not dst:
        dst.copy_(enc)
    return _fix_refused(flags, spec, shape, dst, 1)[:, 0]


def decode(spec: CodecSpec, shape: KVShape, src: torch.Tensor, dst: torch.Tensor, layer: int,
           *, launch: LaunchConfig = LAUNCH) -> None:
    """Same contract as :func:`ucm.reference.compress.decode`; asynchronous on the current CUDA
    stream."""
    if spec.method == "learned":
        return _ref.decode(spec, shape, src, dst, layer)
    n = src.shape[0]
    enc = src if _aligned_enc(src) else src.clone(memory_format=torch.contiguous_format)
    raw = _typed_rows(dst, _TORCH[shape.dtype])
    out = raw if raw is not None else torch.empty((n, shape.raw_bytes), dtype=torch.uint8,
                                                  device=dst.device).view(_TORCH[shape.dtype])
    voff, vstride, align = _plain_tables(shape, _pitch(out), out.device)
    _decode_launch(spec, shape, out, voff, vstride, align, None, enc, _pitch(enc), n, 1, launch)
    if raw is None:
        dst.copy_(out.view(torch.uint8))


def _unfused_gather_encode(layout, block_indices, spec, shape, dst, layers, launch):
    from ucm.fast.triton import transfer

    n, L = block_indices.shape[0], len(layers)
    R, E = shape.raw_bytes, encoded_bytes(spec, shape)
    ok = np.ones(n, dtype=bool)
    rows = torch.nonzero(block_indices >= 0).squeeze(1)
    if rows.numel() == 0:
        return ok
    blocks = block_indices[rows]
    staging = torch.empty((rows.numel(), L * R), dtype=torch.uint8, device=dst.device)
    transfer.gather_blocks(layout, blocks, staging, layers)
    out = torch.empty((rows.numel(), L * E), dtype=torch.uint8, device=dst.device)
    for k, layer in enumerate(layers):
        okk = encode(spec, shape, staging[:, k * R:(k + 1) * R], out[:, k * E:(k + 1) * E],
                     layer, launch=launch)
        ok[rows.cpu().numpy()] &= okk
    dst[rows] = out
    return ok


def _unfused_decode_scatter(layout, src, block_indices, spec, shape, layers, launch):
    from ucm.fast.triton import transfer

    L = len(layers)
    R, E = shape.raw_bytes, encoded_bytes(spec, shape)
    rows = torch.nonzero(block_indices >= 0).squeeze(1)
    if rows.numel() == 0:
        return
    enc = src[rows]
    staging = torch.empty((rows.numel(), L * R), dtype=torch.uint8, device=src.device)
    for k, layer in enumerate(layers):
        decode(spec, shape, enc[:, k * E:(k + 1) * E], staging[:, k * R:(k + 1) * R], layer,
               launch=launch)
    transfer.scatter_blocks(layout, staging, block_indices[rows], layers)


def gather_encode(layout: KVLayout, block_indices: torch.Tensor, spec: CodecSpec,
                  shape: KVShape, dst: torch.Tensor, layers: tuple, *,
                  launch: LaunchConfig = LAUNCH) -> np.ndarray:
    """Same contract as :func:`ucm.reference.compress_transfer.gather_encode`: one launch
    reads each selected layer's shard of each block from the paged cache and writes its
    encoding into ``dst``; synchronizes once (the ``ok`` flags)."""
    n, L = block_indices.shape[0], len(layers)
    if n == 0:
        return np.ones(0, dtype=bool)
    tables = None if spec.method == "learned" else _layout_tables(layout, layers, shape)
    if tables is None:
        return _unfused_gather_encode(layout, block_indices, spec, shape, dst, layers, launch)
    anchor, voff, vstride, align = tables
    enc = dst if _aligned_enc(dst) else torch.empty(dst.shape, dtype=torch.uint8, device=dst.device)
    if enc is not dst:
        enc.copy_(dst)                                     # rows of -1 stay as they were
    flags = torch.ones(n * L, dtype=torch.int32, device=dst.device)
    _encode_launch(spec, shape, anchor, voff, vstride, align, block_indices, enc, _pitch(enc),
                   flags, n, L, launch)
    if enc is not dst:
        dst.copy_(enc)
    return _fix_refused(flags, spec, shape, dst, L).all(axis=1)


def decode_scatter(layout: KVLayout, src: torch.Tensor, block_indices: torch.Tensor,
                   spec: CodecSpec, shape: KVShape, layers: tuple, *,
                   launch: LaunchConfig = LAUNCH) -> None:
    """Same contract as :func:`ucm.reference.compress_transfer.decode_scatter`: one launch
    decodes each row's shards straight into the blocks of the paged cache; asynchronous on the
    current CUDA stream (the fused path)."""
    n, L = block_indices.shape[0], len(layers)
    if n == 0:
        return
    tables = None if spec.method == "learned" else _layout_tables(layout, layers, shape)
    if tables is None:
        return _unfused_decode_scatter(layout, src, block_indices, spec, shape, layers, launch)
    anchor, voff, vstride, align = tables
    enc = src if _aligned_enc(src) else src.clone(memory_format=torch.contiguous_format)
    _decode_launch(spec, shape, anchor, voff, vstride, align, block_indices, enc, _pitch(enc),
                   n, L, launch)
