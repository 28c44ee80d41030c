"""Triton KV codecs: :func:`encode` / :func:`decode` (same contract as
:mod:`ucm.reference.compress`, inputs validated by :mod:`ucm.compress`) and the fused
:func:`gather_encode` / :func:`decode_scatter` (quantize straight out of the paged KV cache and
dequantize straight into it, no raw staging rows in between).

Integer formats are bit-identical to the reference: float32 arithmetic, correctly rounded
divisions (``tl.math.div_rn``: Triton's ``/`` is approximate; the per-token INT4 encode gets
``rint((x - m) / s)`` without dividing, see
:func:`~ucm.fast.triton.compress_kernels._int4_encode_token`), round half to even, the
reference's ``bf16_up`` / ``bf16_down`` bit rules, ``q * s`` (exact) then ``+ m``, round to
nearest even into the cache's type; padding bytes between segments are written as zeros. A shard
holding NaN, infinite values or values past :data:`ucm.codecs.MAGNITUDE_LIMIT` gets ``ok = False`` and the encoding of an all-zero shard (what
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

Kernels (:mod:`ucm.fast.triton.compress_kernels`; one launch per call, but two for an INT4
encode with keys per channel, for a sparse encode and for an INT8 encode with keys per channel
beyond small blocks):

* ``_int8_encode`` / ``_int8_decode``: INT8, a program per ``BV`` consecutive vectors (over all
  shards of the call).
* ``_int8c_encode`` / ``_int8c_decode``: INT8 with keys per channel (asymmetric; token 0's
  key and value exact), a program per (shard, head); beyond small blocks the encode takes the
  keys only and ``_int8_encode`` quantizes the values of tokens 1.., a second launch. With a
  key rounding (``CodecSpec.rounding``) the encode is the reference's (below), as for INT4 and
  sparse keys per channel.
* ``_int4_encode_token``: INT4 and sparse values (groups of channels per token), and the keys
  too when they are per token: a program per (shard, group of heads).
* ``_int4_encode_channel``: INT4 keys per channel (``quantize`` bits 4 defaults to them), a
  program per (shard, head), launched after ``_int4_encode_token``: each kernel lays its tile
  out for its reductions (over channels for the values, over tokens for these keys).
* ``_int4_decode``: INT4 and sparse, a program per (shard, chunk of heads).
* sparse: ``_sparse_select`` (:mod:`ucm.fast.triton.compress_sparse`) first, a program per
  shard: the salient tokens (token 0, then the largest ``max |K|`` over heads and channels,
  ties to the lower token) into the bitmap, their keys and values into the exact rows, and
  with keys per channel (the default) the other tokens' keys quantized, laid out as
  ``_int4_encode_channel``'s; then
  ``_int4_encode_token`` quantizes the other tokens' values (and keys per token), their rows
  counted from the bitmap.
* ``learned``: the reference (PyTorch einsum, cuBLAS on CUDA tensors); so is an encode whose
  keys' codes a key rounding picks (a loop over the channels, each step elementwise
  kernels over the whole batch, the same bits as on a CPU: no fused multiply-adds).

Every kernel takes the encoded rows' pitch in 8-byte units, so that Triton knows their
alignment when the pitch is not a multiple of 16 (a sparse encoding's often is not). Launch
constants live in :class:`LaunchConfig` (:data:`LAUNCH` is the default); every function takes
``launch=``. The interpreter (``TRITON_INTERPRET=1``) runs the kernels on CPU tensors.
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

from ucm.codecs import (LIMIT_BITS, MAGNITUDE_LIMIT, CodecSpec, KVShape, encoded_bytes, n_salient,
                        offsets)
from ucm.fast.triton.compress_kernels import (_int4_decode, _int4_encode_channel,
                                              _int4_encode_token, _int8_decode, _int8_encode,
                                              _int8c_decode, _int8c_encode, jit)
from ucm.fast.triton.compress_sparse import _sparse_select
from ucm.layout import COL_BASE, COL_BLOCK_STRIDE, COL_LENGTH, COL_OFFSET, COL_STAGING, KVLayout
from ucm.reference import compress as _ref

_TORCH = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


@dataclass(frozen=True)
class LaunchConfig:
    """Launch constants of the codec kernels."""
    #: Vectors (of ``head_dim`` channels) per program of the INT8 kernels.
    int8_vectors: int = 32
    int8_warps: int = 4
    #: Tokens per chunk of the INT8 decode with keys per channel (a program per shard and head).
    int8_tokens: int = 64
    #: INT8 encode with keys per channel. Blocks whose key tile (tokens x head_dim, each rounded
    #: up to a power of two) has at most ``int8_channel_fused`` elements: one launch, keys and
    #: values of a (shard, head) in one program, a warp per 2,048 elements of the tile
    #: (``int8_channel_warps``: 0) or that many warps. Longer blocks: two launches, the keys
    #: (``int8_channel_key_warps`` warps; channel ranges over chunks of
    #: ``int8_channel_range_elems`` elements, codes over chunks of ``int8_channel_key_tokens``
    #: tokens) and the values as per-token vectors (``int8_value_elems`` elements per program,
    #: ``int8_value_warps`` warps). Measured on an H200, 1 GiB of bf16 KV, 3 heads x 64 and
    #: 8 x 128: one launch 0.78 / 0.67 of a device copy at 16 tokens (two: 0.67 / 0.69), 0.61 /
    #: 0.56 at 128 (two, these constants the best of a sweep of 1-8 key warps, 16-128-token
    #: chunks, 1-4 KiB value tiles and 2-8 value warps: 0.75 / 0.72).
    int8_channel_fused: int = 4096
    int8_channel_warps: int = 0
    int8_channel_key_warps: int = 2
    int8_channel_range_elems: int = 8192
    int8_channel_key_tokens: int = 32
    int8_value_elems: int = 2048
    int8_value_warps: int = 2
    #: INT4 and sparse, values (and keys per token; ``_int4_encode_token``): KV heads per
    #: program (rounded down to a power of two, at most the head count rounded up to one); 0: as
    #: many as make a tile of about ``int4_token_tile`` pair words of values and as many of keys
    #: (twice as many heads when the keys are per channel, in ``_int4_encode_channel``).
    int4_token_heads: int = 0
    int4_token_tile: int = 2048
    int4_token_warps: int = 4
    #: INT4 and sparse, keys per channel (``_int4_encode_channel``, a program per shard and
    #: head; ``_sparse_select``, a program per shard, in chunks of heads of at most 8 times as
    #: many): a warp per this many pair words of keys (1 to 8 warps).
    int4_channel_warp_words: int = 1024
    #: Warps of the sparse codec's first kernel with keys per token (``_sparse_select``, which
    #: then only selects).
    sparse_select_warps: int = 4
    #: Registers a thread of ``_sparse_select`` with keys per channel where a program of 8 warps
    #: holds a whole shard of at most 16 tokens (each thread then holds 2 pair words of keys of
    #: every token): under 85, 3 programs fit a multiprocessor rather than 2, for a few spilled
    #: bytes (0: the compiler's choice; CUDA only).
    sparse_select_registers: int = 80
    #: KV heads per program of the INT4 / sparse decode (a divisor of the head count is used:
    #: the largest one not above this).
    int4_decode_heads: int = 2
    #: Warps of the INT4 / sparse decode, keys per channel and keys per token.
    int4_decode_warps: int = 4
    int4_decode_warps_token: int = 8

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


def _format(spec: CodecSpec, shape: KVShape) -> tuple:
    """Segment offsets, the padding bytes (int32 array) and the size of one encoded shard."""
    def build():
        offs = offsets(spec, shape)
        pad = []
        for at, dt, shp in offs.values():
            end = at + math.prod(shp) * {"uint8": 1, "int8": 1, "bfloat16": 2, "float16": 2,
                                         "float32": 4}[dt]
            pad.extend(range(end, -(-end // 8) * 8))
        return ({name: at for name, (at, _, _) in offs.items()}, np.array(pad, dtype=np.int32),
                encoded_bytes(spec, shape))
    key = ("format", spec.method, spec.bits, spec.group, spec.key_mode, float(spec.salient), shape)
    return _cached(key, build)


def _pad_table(spec, shape, device):
    def build():
        _, pad, _ = _format(spec, shape)
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


def _align(values, unit: int) -> int:
    """Largest power of two (at most 16 bytes' worth of ``unit``-byte items) dividing every
    value."""
    g = int(np.gcd.reduce(np.abs(np.asarray(values, dtype=np.int64)).ravel())) if len(values) else 0
    a = max(1, 16 // unit)
    while a > 1 and g % a:
        a //= 2
    return a


@dataclass(frozen=True)
class _Tables:
    """Per (selected layer, canonical vector): offset from the anchor and stride per block
    (row), in elements (``voff``, ``vstride``, hint ``align``: the INT8 kernels and every
    decode) and in pair words (``pvoff``, ``pvstride``, ``palign``: the INT4 encode; None when
    an offset is odd)."""
    voff: torch.Tensor
    vstride: torch.Tensor
    align: int
    pvoff: object
    pvstride: object
    palign: int


def _tables(voff: np.ndarray, vstride: np.ndarray, esize: int, device) -> _Tables:
    elem = np.concatenate([voff.ravel(), vstride.ravel()])
    to = lambda a: torch.from_numpy(np.ascontiguousarray(a)).to(device)  # noqa: E731
    if (elem % 2).any():
        return _Tables(to(voff), to(vstride), _align(elem, esize), None, None, 1)
    return _Tables(to(voff), to(vstride), _align(elem, esize), to(voff // 2), to(vstride // 2),
                   _align(elem // 2, 2 * esize))


def _plain_tables(shape: KVShape, pitch: int, device) -> _Tables:
    """Tables for plain rows of ``pitch`` elements."""
    def build():
        voff = _positions(shape) * shape.head_dim
        return _tables(voff[None], np.full((1, len(voff)), pitch, dtype=np.int64), shape.esize,
                       device)
    return _cached(("plain", shape, pitch, str(device)), build)


def _anchor(layout: KVLayout) -> torch.Tensor:
    """A uint8 tensor starting where the storage of ``layout.views[0]`` starts, a multiple of
    8 bytes long."""
    view = layout.views[0]
    flat = torch.empty(0, dtype=torch.uint8, device=view.device).set_(view.untyped_storage())
    return flat[: flat.numel() // 8 * 8]


def _layout_tables(layout: KVLayout, layers: tuple, shape: KVShape):
    """(anchor, tables) for the fused kernels, or None when a vector of a shard is cut by a run
    boundary or an address is not a multiple of the element size (the caller then takes the
    unfused path); cached per layout."""
    def build():
        anchor = _anchor(layout)
        a0, e = anchor.data_ptr(), shape.esize
        tab = layout.table(layers)
        vec = shape.head_dim * e
        pos = _positions(shape) * vec                      # byte offset in the shard
        voff = np.empty((len(layers), len(pos)), dtype=np.int64)
        vstride = np.empty_like(voff)
        for k in range(len(layers)):
            at = k * shape.raw_bytes + pos                   # byte offset in the staged row
            r = np.searchsorted(tab[:, COL_STAGING], at, side="right") - 1
            if not (at + vec <= tab[r, COL_STAGING] + tab[r, COL_LENGTH]).all():
                return None
            addr = tab[r, COL_BASE] + tab[r, COL_OFFSET] + (at - tab[r, COL_STAGING]) - a0
            bst = tab[r, COL_BLOCK_STRIDE]
            if (addr % e).any() or (bst % e).any():
                return None
            voff[k], vstride[k] = addr // e, bst // e
        return anchor, _tables(voff, vstride, e, layout.device)
    return layout.cached(("triton_codec", layers, shape), build)


def _as(t: torch.Tensor, dtype: torch.dtype):
    """``t`` (uint8 or typed rows, or a flat anchor) viewed as ``dtype``, or None if its
    address or row pitch does not allow it."""
    size = dtype.itemsize
    if t.data_ptr() % size or (t.dim() == 2 and t.shape[0] > 1 and
                               (t.stride(0) * t.element_size()) % size):
        return None
    try:
        if t.dim() == 2 and t.shape[0] == 1:
            t = t.as_strided(t.shape, (t.shape[1], 1))
        return t.view(dtype)
    except RuntimeError:
        return None


def _pitch(rows: torch.Tensor) -> int:
    return rows.stride(0) if rows.shape[0] > 1 else rows.shape[1]


def _aligned_enc(rows: torch.Tensor) -> bool:
    """Encoded rows the kernels write in place: 8-byte aligned rows (scales and exact tokens
    are stored as words)."""
    return rows.data_ptr() % 8 == 0 and _pitch(rows) % 8 == 0


def _device_ctx(t: torch.Tensor):
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


# ---------------------------------------------------------------------------------------------
# launches

_PAIR = {2: torch.int32, 4: torch.int64}
_DT = {"bfloat16": 0, "float16": 1, "float32": 2}


def _divisor_heads(shape: KVShape, heads: int) -> int:
    """The largest divisor of the head count not above ``heads``."""
    hpp = max(1, min(heads, shape.heads))
    while shape.heads % hpp:
        hpp -= 1
    return hpp


def _pow2_floor(n: int) -> int:
    return 1 << (max(1, int(n)).bit_length() - 1)


def _token_heads(shape: KVShape, launch: LaunchConfig, keys: bool = True) -> int:
    """KV heads per program of ``_int4_encode_token`` (twice as many without the keys)."""
    words = _pow2(shape.tokens) * (shape.head_dim // 2) * (2 if keys else 1)
    want = launch.int4_token_heads or 2 * launch.int4_token_tile // words
    return min(_pow2_floor(want), _pow2(shape.heads))


def _channel_warps(shape: KVShape, launch: LaunchConfig) -> int:
    """Warps of ``_int4_encode_channel``."""
    words = _pow2(shape.tokens) * _pow2(shape.head_dim // 2)
    return max(1, min(8, words // launch.int4_channel_warp_words))


def _select_launch(shape: KVShape, launch: LaunchConfig, channel: bool) -> tuple:
    """Heads per chunk and launch options of ``_sparse_select`` (a program per shard): chunks of
    at most ``8 * int4_channel_warp_words`` pair words of keys (the whole shard when it fits:
    read once), and with keys per channel a warp per ``int4_channel_warp_words`` of them, as in
    ``_int4_encode_channel``, and ``sparse_select_registers`` where it applies."""
    per_head = _pow2(shape.tokens) * _pow2(shape.head_dim // 2)
    words = launch.int4_channel_warp_words
    hc = min(_pow2(shape.heads), _pow2_floor(max(1, 8 * words // per_head)))
    if not channel:
        return hc, {"num_warps": launch.sparse_select_warps}
    opts = {"num_warps": max(1, min(8, per_head * hc // words))}
    if (launch.sparse_select_registers and opts["num_warps"] == 8 and hc >= shape.heads
            and shape.tokens <= 16 and torch.version.hip is None):
        opts["maxnreg"] = launch.sparse_select_registers
    return hc, opts


def _encodable(spec: CodecSpec, shape: KVShape, raw: torch.Tensor, tabs: _Tables):
    """The tensor the encode kernel reads ``raw`` (uint8 rows or anchor) as, or None when the
    fused / in-place path cannot take it."""
    if spec.method == "quantize" and spec.bits == 8:
        return _as(raw, _TORCH[shape.dtype])
    if tabs.pvoff is None:
        return None
    return _as(raw, _PAIR[shape.esize])


def _encode_launch(spec, shape, raw, tabs: _Tables, idx, enc, enc_pitch, flags, n, L,
                   launch: LaunchConfig) -> None:
    """``raw``: from :func:`_encodable`."""
    offs, pad, E = _format(spec, shape)
    padt = _pad_table(spec, shape, enc.device)
    npad = len(pad)
    T, H, D = shape.tokens, shape.heads, shape.head_dim
    indexed = idx is not None
    if idx is None:
        idx = flags                                        # unused
    # refused shards: a value at or past MAGNITUDE_LIMIT (its float32 bits: LIMB), NaN, inf;
    # (x * ovf) overflows to inf exactly from the limit on (ovf = 2 ** (128 - log2 limit))
    limb = LIMIT_BITS[shape.dtype]
    ovf = 2.0 ** (128 - int(math.log2(MAGNITUDE_LIMIT[shape.dtype])))
    with _device_ctx(enc):
        if spec.method == "quantize" and spec.bits == 8:
            V, DP, bf16 = 2 * T * H, _pow2(D), shape.dtype == "bfloat16"
            if spec.key_mode == "channel":
                tile = _pow2(T) * DP
                fused = tile <= launch.int8_channel_fused
                if fused:
                    tb = tq = _pow2(T)
                    warps = launch.int8_channel_warps or max(1, min(8, tile // 2048))
                else:
                    tb = min(_pow2(T), _pow2_floor(max(1, launch.int8_channel_range_elems // DP)))
                    tq = min(_pow2(T), _pow2(launch.int8_channel_key_tokens))
                    warps = launch.int8_channel_key_warps
                jit(_int8c_encode)[(n * L, H)](
                    raw, tabs.voff, tabs.vstride, idx, enc, enc_pitch // 8, flags, padt, n * L,
                    T=T, H=H, D=D, DP=DP, TB=tb, TQ=tq, L=L, E=E, KP=offs["kp"],
                    VS=offs["vscale"], X0=offs["x0"], VALUES=fused, NPAD=npad,
                    NPADP=_pow2(npad), INDEXED=indexed, ALIGN=tabs.align, BF16=bf16,
                    LIMB=limb, num_warps=warps)
                if fused:
                    return
                # the values of tokens 1..: vectors (T + 1) H .. 2 T H of each shard, codes
                # from vector (T - 1) H of q, scales at ``vscale``
                v0, vn, qv, scale, npad = (T + 1) * H, (T - 1) * H, (T - 1) * H, offs["vscale"], 0
                bv = _pow2_floor(max(1, launch.int8_value_elems // DP))
                warps = launch.int8_value_warps
            else:
                v0, vn, qv, scale = 0, V, 0, offs["scale"]
                bv, warps = _pow2(launch.int8_vectors), launch.int8_warps
            total = n * L * vn
            jit(_int8_encode)[(triton.cdiv(total, bv),)](
                raw, tabs.voff, tabs.vstride, idx, enc, enc_pitch // 8, flags, padt, total, n * L,
                V=V, V0=v0, VN=vn, QV=qv, L=L, D=D, DP=DP, E=E, SCALE=scale, NPAD=npad,
                NPADP=_pow2(npad), BV=bv, INDEXED=indexed, ALIGN=tabs.align, BF16=bf16,
                LIMB=limb, num_warps=warps)
            return
        sparse = spec.method == "sparse"
        G = spec.group
        NG = D // G
        TP = _pow2(T)
        channel = spec.key_mode == "channel"
        if sparse:
            hc, opts = _select_launch(shape, launch, channel)
            jit(_sparse_select)[(n * L,)](
                raw, tabs.pvoff, tabs.pvstride, idx, enc, enc_pitch // 8, flags, n * L,
                T=T, TP=TP, H=H, HC=hc, D=D, HWP=_pow2(D // 2), L=L, E=E, KQ=offs["kq"],
                KP=offs["kp"], BITMAP=offs["bitmap"], EXACT=offs["exact"],
                C=n_salient(spec, shape), CHANNEL=channel, INDEXED=indexed,
                ALIGN=min(tabs.palign, 2), DT=_DT[shape.dtype], LIMB=limb, **opts)
        hp = _token_heads(shape, launch, keys=not channel)
        jit(_int4_encode_token)[(n * L, triton.cdiv(H, hp))](
            raw, tabs.pvoff, tabs.pvstride, idx, enc, enc_pitch // 8, flags, padt, n * L,
            T=T, TP=TP, H=H, HP=hp, D=D, NG=NG, NGP=_pow2(NG), GH=G // 2, L=L, E=E,
            KQ=offs["kq"], VQ=offs["vq"], KP=offs["kp"], VP=offs["vp"],
            BITMAP=offs.get("bitmap", 0), KEYS=not channel, SPARSE=sparse,
            C=n_salient(spec, shape) if sparse else 0, NPAD=npad,
            NPADP=_pow2(npad), INDEXED=indexed, ALIGN=tabs.palign, DT=_DT[shape.dtype],
            OVF=ovf, num_warps=launch.int4_token_warps)
        if channel and not sparse:
            jit(_int4_encode_channel)[(n * L, H)](
                raw, tabs.pvoff, tabs.pvstride, idx, enc, enc_pitch // 8, flags, n * L,
                T=T, TP=TP, H=H, D=D, HWP=_pow2(D // 2), L=L, E=E, KQ=offs["kq"],
                KP=offs["kp"], INDEXED=indexed, ALIGN=tabs.palign, DT=_DT[shape.dtype],
                OVF=ovf, num_warps=_channel_warps(shape, launch))


def _decode_launch(spec, shape, raw, tabs: _Tables, idx, enc, enc_pitch, n, L,
                   launch: LaunchConfig) -> None:
    """``raw``: the cache's element type (rows or anchor)."""
    offs, _, E = _format(spec, shape)
    T, H, D = shape.tokens, shape.heads, shape.head_dim
    indexed = idx is not None
    if idx is None:
        idx = tabs.voff                                    # unused
    bf16 = shape.dtype == "bfloat16"
    with _device_ctx(enc):
        if spec.method == "quantize" and spec.bits == 8 and spec.key_mode == "channel":
            jit(_int8c_decode)[(n * L, H)](
                raw, tabs.voff, tabs.vstride, idx, enc, enc_pitch // 8,
                T=T, H=H, D=D, DP=_pow2(D), TB=min(_pow2(T), launch.int8_tokens), L=L, E=E,
                KP=offs["kp"], VS=offs["vscale"], X0=offs["x0"], INDEXED=indexed, ALIGN=tabs.align,
                BF16=bf16, num_warps=launch.int8_warps)
            return
        if spec.method == "quantize" and spec.bits == 8:
            V = 2 * T * H
            bv = _pow2(launch.int8_vectors)
            total = n * L * V
            jit(_int8_decode)[(triton.cdiv(total, bv),)](
                raw, tabs.voff, tabs.vstride, idx, enc, enc_pitch // 8, total,
                V=V, L=L, D=D, DP=_pow2(D), E=E, SCALE=offs["scale"], BV=bv, INDEXED=indexed,
                ALIGN=tabs.align, BF16=bf16, num_warps=launch.int8_warps)
            return
        hpp = _divisor_heads(shape, launch.int4_decode_heads)
        jit(_int4_decode)[(n * L, H // hpp)](
            raw, tabs.voff, tabs.vstride, idx, enc, enc_pitch // 8,
            T=T, TP=_pow2(T), H=H, D=D, DP=_pow2(D), G=spec.group, L=L, E=E,
            KQ=offs["kq"], VQ=offs["vq"], KP=offs["kp"], VP=offs["vp"],
            BITMAP=offs.get("bitmap", 0), EXACT=offs.get("exact", 0),
            CHANNEL=spec.key_mode == "channel", SPARSE=spec.method == "sparse",
            C=n_salient(spec, shape) if spec.method == "sparse" else 0, HPP=hpp,
            INDEXED=indexed, ALIGN=tabs.align, BF16=bf16,
            num_warps=launch.int4_decode_warps if spec.key_mode == "channel"
            else launch.int4_decode_warps_token)


_local = threading.local()


def _new_flags(shards: int, device) -> torch.Tensor:
    """int32 [shards + 1] of ones: per shard, then "all finite"; the kernels store 0s. A view of
    a buffer per thread and device: the kernels leave it all ones unless a shard is refused,
    and :func:`_fix_refused` drops it then (the next call allocates a new one), so the common
    case costs neither an allocation nor a fill. (An op reads its flags back before it returns,
    so one thread's calls never overlap.)"""
    bufs = getattr(_local, "flags", None)
    if bufs is None:
        bufs = _local.flags = {}
    buf = bufs.get(device)
    if buf is None or buf.numel() <= shards:
        buf = bufs[device] = torch.ones(max(shards + 1, 1024), dtype=torch.int32, device=device)
    return buf[:shards + 1]


def _drop_flags(device) -> None:
    bufs = getattr(_local, "flags", None)
    if bufs is not None:
        bufs.pop(device, None)


def _fix_refused(flags: torch.Tensor, spec, shape, dst: torch.Tensor, L: int) -> np.ndarray:
    """ok per (row, layer) from the kernel's flags: one synchronizing read of the last flag
    (4 bytes), and of the others only when a shard was refused; refused shards get the
    reference's bytes (the encoding of zeros)."""
    shards = flags.numel() - 1
    if flags[shards].item() != 0:
        return np.ones((shards // L, L), dtype=bool)
    ok = flags[:shards].cpu().numpy().reshape(-1, L) != 0
    _drop_flags(flags.device)                              # it holds zeros now
    E = encoded_bytes(spec, shape)
    zero = _zero_row(spec, shape, dst.device)
    for i, k in zip(*np.nonzero(~ok)):
        dst[int(i), int(k) * E:(int(k) + 1) * E] = zero
    return ok


# ---------------------------------------------------------------------------------------------
# ops

def _encoded_by_reference(spec: CodecSpec) -> bool:
    """The encodes the reference makes on the device: ``learned`` (an einsum: cuBLAS) and keys
    whose codes a key rounding picks (a loop over the channels, each step a few elementwise
    kernels over the whole batch)."""
    return spec.method == "learned" or spec.rounds_keys


def encode(spec: CodecSpec, shape: KVShape, src: torch.Tensor, dst: torch.Tensor, layer: int,
           *, launch: LaunchConfig = LAUNCH) -> np.ndarray:
    """Same contract as :func:`ucm.reference.compress.encode` (CUDA tensors, or CPU tensors
    under the interpreter); synchronizes once (the ``ok`` flags)."""
    spec = spec.for_shape(shape)
    if _encoded_by_reference(spec):
        return _ref.encode(spec, shape, src, dst, layer)
    if shape.key_order == "dt":       # (vLLM-CPU's layout; a torch transposition on the device)
        src, shape = _ref.swap_key_planes(src, shape, True), shape.with_token_major_keys()
    n = src.shape[0]
    esize = shape.esize
    pitch = _pitch(src)
    tabs = _plain_tables(shape, pitch // esize, src.device) if pitch % esize == 0 else None
    raw = _encodable(spec, shape, src, tabs) if tabs is not None else None
    if raw is None:                                        # odd address or pitch: a copy
        src = src.clone(memory_format=torch.contiguous_format)
        tabs = _plain_tables(shape, shape.raw_bytes // esize, src.device)
        raw = _encodable(spec, shape, src, tabs)
    enc = dst if _aligned_enc(dst) else torch.empty(dst.shape, dtype=torch.uint8, device=dst.device)
    flags = _new_flags(n, src.device)
    try:
        _encode_launch(spec, shape, raw, tabs, None, enc, _pitch(enc), flags, n, 1, launch)
        if enc is not dst:
            dst.copy_(enc)
        return _fix_refused(flags, spec, shape, dst, 1)[:, 0]
    except BaseException:
        _drop_flags(src.device)                            # in an unknown state
        raise


def decode(spec: CodecSpec, shape: KVShape, src: torch.Tensor, dst: torch.Tensor, layer: int,
           *, launch: LaunchConfig = LAUNCH) -> None:
    """Same contract as :func:`ucm.reference.compress.decode`; asynchronous on the current CUDA
    stream."""
    spec = spec.for_shape(shape)
    if spec.method == "learned":
        return _ref.decode(spec, shape, src, dst, layer)
    if shape.key_order == "dt":
        tmp = torch.empty(dst.shape, dtype=torch.uint8, device=dst.device)
        decode(spec, shape.with_token_major_keys(), src, tmp, layer, launch=launch)
        dst.copy_(_ref.swap_key_planes(tmp, shape, False))
        return None
    n = src.shape[0]
    enc = src if _aligned_enc(src) else src.clone(memory_format=torch.contiguous_format)
    raw = _as(dst, _TORCH[shape.dtype])
    out = raw if raw is not None else torch.empty((n, shape.raw_bytes), dtype=torch.uint8,
                                                  device=dst.device).view(_TORCH[shape.dtype])
    tabs = _plain_tables(shape, _pitch(out), out.device)
    _decode_launch(spec, shape, out, tabs, None, enc, _pitch(enc), n, 1, launch)
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
    staging = torch.empty((rows.numel(), L * R), dtype=torch.uint8, device=dst.device)
    transfer.gather_blocks(layout, block_indices[rows], staging, layers)
    out = torch.empty((rows.numel(), L * E), dtype=torch.uint8, device=dst.device)
    host_rows = rows.cpu().numpy()
    for k, layer in enumerate(layers):
        ok[host_rows] &= encode(spec, shape, staging[:, k * R:(k + 1) * R],
                                out[:, k * E:(k + 1) * E], layer, launch=launch)
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
    (two where the encode takes two, see the module docstring) reads each selected layer's
    shard of each block from the paged cache and writes its encoding into ``dst``;
    synchronizes once (the ``ok`` flags)."""
    spec = spec.for_shape(shape)
    n, L = block_indices.shape[0], len(layers)
    if n == 0:
        return np.ones(0, dtype=bool)
    found = None if _encoded_by_reference(spec) or shape.key_order == "dt" else \
        _layout_tables(layout, layers, shape)
    raw = None if found is None else _encodable(spec, shape, found[0], found[1])
    if raw is None:
        return _unfused_gather_encode(layout, block_indices, spec, shape, dst, layers, launch)
    enc = dst if _aligned_enc(dst) else torch.empty(dst.shape, dtype=torch.uint8, device=dst.device)
    if enc is not dst:
        enc.copy_(dst)                                     # rows of -1 stay as they were
    flags = _new_flags(n * L, dst.device)
    try:
        _encode_launch(spec, shape, raw, found[1], block_indices, enc, _pitch(enc), flags, n, L,
                       launch)
        if enc is not dst:
            dst.copy_(enc)
        return _fix_refused(flags, spec, shape, dst, L).all(axis=1)
    except BaseException:
        _drop_flags(dst.device)                            # in an unknown state
        raise


def decode_scatter(layout: KVLayout, src: torch.Tensor, block_indices: torch.Tensor,
                   spec: CodecSpec, shape: KVShape, layers: tuple, *,
                   launch: LaunchConfig = LAUNCH) -> None:
    """Same contract as :func:`ucm.reference.compress_transfer.decode_scatter`: one launch
    decodes each row's shards straight into the blocks of the paged cache; asynchronous on the
    current CUDA stream (the fused path)."""
    spec = spec.for_shape(shape)
    n, L = block_indices.shape[0], len(layers)
    if n == 0:
        return
    found = None if spec.method == "learned" or shape.key_order == "dt" else \
        _layout_tables(layout, layers, shape)
    raw = None if found is None else _as(found[0], _TORCH[shape.dtype])
    if raw is None:
        return _unfused_decode_scatter(layout, src, block_indices, spec, shape, layers, launch)
    enc = src if _aligned_enc(src) else src.clone(memory_format=torch.contiguous_format)
    _decode_launch(spec, shape, raw, found[1], block_indices, enc, _pitch(enc), n, L, launch)
