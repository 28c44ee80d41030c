"""KV compression: codecs that turn one layer's part of a KV block (a *shard*) into a smaller
fixed-size byte string and back.

A codec sees a shard as the tensor ``x[kv, t, h, d]`` (keys then values, ``T`` tokens, ``H`` KV
heads, ``D`` channels) of the cache's element type, whatever the engine's memory order
(:class:`KVShape`; every implementation also reads and writes key planes stored channel-major,
``key_order="dt"``, as vLLM-CPU keeps them). Every encoded shard of a given codec and shape has the same size, so the
store's geometry stays fixed. Integer payloads and scales are bit-identical between
implementations (the reference here and the fast paths); the learned codec's coefficients are
floating point and match within the equivalence tolerance.

Codecs (:class:`CodecSpec`):

* ``quantize``, ``bits=8``: values symmetric INT8, one scale per (token, head) vector:
  ``s = bf16_up(max|x| / 127)``, ``q = clamp(rint(x / s), -127, 127)``, ``x' = q * s``. Keys
  like the values (``key_mode="token"``) or per channel (``key_mode="channel"``): then token 0's
  key and value are stored exact in the cache's type (the attention sink of the block that
  starts a sequence), and the other keys asymmetric per (head, channel) over tokens 1..:
  ``m = bf16_down(min)``, ``s = bf16_up((max - m) / 255)``, ``q = clamp(rint((x - m) / s), 0,
  255)``, ``x' = q * s + m``; with a :class:`KeyRounding` (``compression.key_rounding``) the
  encoder picks those codes on the same grid so that the error of ``q . k`` is small for the
  calibration queries (:func:`fit_key_rounding`), which decodes the same way. ``auto`` picks
  keys per channel in blocks of at least 128 tokens (:meth:`CodecSpec.for_shape`).
* ``quantize``, ``bits=4``: asymmetric INT4, two values per byte (low nibble first):
  ``m = bf16_down(min)``, ``s = bf16_up((max - m) / 15)``, ``q = clamp(rint((x - m) / s), 0, 15)``,
  ``x' = q * s + m`` (a zero min or max counts as +0, whatever the sign of the zeros). Values:
  groups of ``group`` channels per (token, head). Keys: per channel
  over the block's tokens as KIVI does (``key_mode="channel"``, INT4's default: a few channels of
  the keys carry outliers across all tokens; codes picked by a :class:`KeyRounding` when one
  is configured, as for INT8) or like the values (``key_mode="token"``).
* ``sparse``: ``ceil(salient * T)`` tokens kept exact in the cache's type: token 0 (the block
  that starts a sequence holds its attention sink there), then those whose keys have the
  largest magnitude (``max |K[t, :, :]|``; ties to the lower token); the others
  INT4 as above over the remaining tokens only (their ranges no longer stretched by the
  outliers); a bitmap says which tokens are exact.
* ``learned``: per layer, per head and for keys and values apart, a mean and a rank-``r``
  basis fitted by PCA on calibration KV (:func:`fit_projection`); ``r = round(ratio * D)``;
  coefficients stored as bfloat16; the decode multiplies them by the basis rounded to
  bfloat16 (products of two bfloat16 values are exact in float32, so a CPU can take two
  coefficients per instruction). The projection is one file per namespace whose digest is
  part of the codec's identity (:meth:`CodecSpec.digest`), so a block is never decoded with
  another projection.

``bf16_up`` / ``bf16_down`` round a positive float32 scale up (and a minimum down) to bfloat16,
so a group's extremes never clip and the scales cost 2 bytes. All arithmetic is float32 with
IEEE rounding (divisions correctly rounded, ``rint`` = round half to even); ``q * s`` is exact in
float32, so every implementation decodes to the same bits.

Values that are NaN, infinite or at the top of the element type's range
(:data:`ucm.codecs.MAGNITUDE_LIMIT`: ``|x| >= 2**15`` in float16, ``2**126`` in bfloat16 and
float32, where a rounded-up scale or a float32 range would overflow on decode) make ``encode``
refuse the shard (``ok[i] = False``; the store then does not keep the block) instead of
poisoning a group or decoding to infinities.

Ops (dispatched through :mod:`ucm.dispatch`): :func:`encode`, :func:`decode`; implementations
``reference`` (:mod:`ucm.reference.compress`, PyTorch), ``numba`` (:mod:`ucm.fast.numba.compress`,
CPU) and ``triton`` (:mod:`ucm.fast.triton.compress`, CUDA).
"""
from __future__ import annotations

from typing import Optional

import numpy as np

from ucm import dispatch, fast
from ucm.codecs import (BITS, GROUPS, KEY_MODES, METHODS, CodecSpec, KeyRounding,  # noqa: F401
                        KVShape, Projection, encoded_bytes, fit_key_rounding, fit_projection,
                        offsets, query_moments, segments)
from ucm.dispatch import ImplSpec


# ---------------------------------------------------------------------------------------------
# ops

def _rows(buf, nbytes: int, name: str, n: Optional[int] = None):
    import torch

    if not isinstance(buf, torch.Tensor):
        arr = np.asarray(buf)
        if arr.dtype != np.uint8:
            raise ValueError(f"{name}: expected uint8 rows, got {arr.dtype}")
        if min(arr.strides, default=0) < 0:       # torch cannot wrap it (and dst must be written)
            raise ValueError(f"{name}: an array with a negative stride (a reversed view): pass "
                             f"np.ascontiguousarray of it")
        buf = torch.from_numpy(arr) if arr.flags.writeable else torch.from_numpy(arr.copy())
    if buf.dtype != torch.uint8 or buf.dim() != 2:
        raise ValueError(f"{name}: expected a uint8 [n, {nbytes}] tensor, got {buf.dtype} "
                         f"{list(buf.shape)}")
    if buf.shape[1] != nbytes or buf.stride(1) != 1 or (buf.shape[0] > 1 and buf.stride(0) < nbytes):
        raise ValueError(f"{name}: expected rows of {nbytes} contiguous bytes, got shape "
                         f"{list(buf.shape)} strides {buf.stride()}")
    if n is not None and buf.shape[0] != n:
        raise ValueError(f"{name}: {buf.shape[0]} rows, expected {n}")
    return buf


def _check(spec, shape, layer):
    if not isinstance(spec, CodecSpec):
        raise ValueError(f"spec: expected a ucm.compress.CodecSpec, got {type(spec).__name__}")
    if not isinstance(shape, KVShape):
        raise ValueError(f"shape: expected a ucm.compress.KVShape, got {type(shape).__name__}")
    if isinstance(layer, (bool, np.bool_)) or not isinstance(layer, (int, np.integer)) \
            or layer < 0:
        raise ValueError(f"layer: expected an int >= 0 (the shard's layer), got {layer!r}")
    spec = spec.for_shape(shape)
    spec.check(shape)
    if spec.method == "learned" and not 0 <= int(layer) < spec.projection.layers:
        raise ValueError(f"layer {layer}: the projection has {spec.projection.layers} layers")
    if spec.rounds_keys and not int(layer) < spec.rounding.layers:
        raise ValueError(f"layer {layer}: the key rounding has {spec.rounding.layers} layers")
    return spec


def encode(spec: CodecSpec, shape: KVShape, src, dst, layer: int = 0, *,
           backend: Optional[str] = None) -> np.ndarray:
    """Encode each row of ``src`` (uint8 ``[n, shape.raw_bytes]``: raw shards of layer
    ``layer``) into the same row of ``dst`` (uint8 ``[n, encoded_bytes]``, same device).
    Returns ``ok``: bool ``[n]``, False where the shard held NaN, infinite or too large values (its row of
    ``dst`` is then undefined)."""
    spec = _check(spec, shape, layer)
    s = _rows(src, shape.raw_bytes, "src")
    d = _rows(dst, encoded_bytes(spec, shape), "dst", s.shape[0])
    if s.device != d.device:
        raise ValueError(f"src on {s.device}, dst on {d.device}: expected one device")
    if s.shape[0] == 0:
        return np.zeros(0, dtype=bool)
    return dispatch.call("encode", spec, shape, s, d, int(layer), backend=backend)


def decode(spec: CodecSpec, shape: KVShape, src, dst, layer: int = 0, *,
           backend: Optional[str] = None) -> None:
    """Decode each row of ``src`` (uint8 ``[n, encoded_bytes]``) into the same row of ``dst``
    (uint8 ``[n, shape.raw_bytes]``, in the shard's memory order)."""
    spec = _check(spec, shape, layer)
    s = _rows(src, encoded_bytes(spec, shape), "src")
    d = _rows(dst, shape.raw_bytes, "dst", s.shape[0])
    if s.device != d.device:
        raise ValueError(f"src on {s.device}, dst on {d.device}: expected one device")
    if s.shape[0]:
        dispatch.call("decode", spec, shape, s, d, int(layer), backend=backend)


def _device(args, kwargs):
    return args[2].device if len(args) > 2 else None


def on_cpu(*args, **kwargs):
    return fast.cpu_takes(_device(args, kwargs))


def on_cuda(*args, **kwargs):
    return fast.triton_takes(_device(args, kwargs))


OPS = ("encode", "decode")
IMPLEMENTATIONS = (
    ImplSpec("reference", "ucm.reference.compress:{op}"),
    ImplSpec("numba", "ucm.fast.numba.compress:{op}", 10, frozenset({"cpu", "cuda"}),
             fast.numba_status, on_cpu),
    ImplSpec("triton", "ucm.fast.triton.compress:{op}", 20, frozenset({"cuda", "cpu"}),
             fast.triton_status, on_cuda),
)
dispatch.register_table(OPS, IMPLEMENTATIONS)


# ---------------------------------------------------------------------------------------------
# fused with the KV transfer (GPU connector): gather_encode / decode_scatter

def _check_fused(layout, spec, shape, layers) -> tuple:
    from ucm.transfer import _check_layout

    _check_layout(layout)
    layers = layout.select(layers)
    for layer in layers:
        spec = _check(spec, shape, layer)
        if layout.shard_bytes(layer) != shape.raw_bytes:
            raise ValueError(f"shape: layer {layer}'s shard is {layout.shard_bytes(layer)} bytes, "
                             f"the KVShape describes {shape.raw_bytes}")
    return layers, spec.for_shape(shape)


def gather_encode(layout, block_indices, spec: CodecSpec, shape: KVShape, dst, layers=None, *,
                  backend: Optional[str] = None) -> np.ndarray:
    """Quantize blocks straight out of a paged KV cache: row ``i`` of ``dst`` (uint8
    ``[n, len(layers) * encoded_bytes]`` on the cache's device) receives, at
    ``k * encoded_bytes``, the encoding of the ``k``-th selected layer's shard of block
    ``block_indices[i]`` (the shard's bytes as :func:`ucm.transfer.gather_blocks` stages them,
    read as ``shape``); ``-1`` leaves the row untouched. Same as ``gather_blocks`` into a
    temporary then :func:`encode` per layer, without the temporary.

    layout: a :class:`ucm.KVLayout`; block_indices: as for ``gather_blocks``; layers: ``None``
    (all) or the layer ids, in row order. Returns ``ok``: bool ``[n]``, False where a selected
    shard of the block held NaN, infinite or too large values
    (:data:`ucm.codecs.MAGNITUDE_LIMIT`)."""
    from ucm.transfer import _check_indices

    layers, spec = _check_fused(layout, spec, shape, layers)
    idx = _check_indices(block_indices, layout, unique=False)
    d = _rows(dst, len(layers) * encoded_bytes(spec, shape), "dst", idx.shape[0])
    if d.device != layout.device:
        raise ValueError(f"dst on {d.device}, the KV views on {layout.device}")
    if idx.shape[0] == 0:
        return np.zeros(0, dtype=bool)
    return dispatch.call("gather_encode", layout, idx, spec, shape, d, layers, backend=backend)


def decode_scatter(layout, src, block_indices, spec: CodecSpec, shape: KVShape, layers=None, *,
                   backend: Optional[str] = None) -> None:
    """The inverse of :func:`gather_encode`: decode row ``i`` of ``src`` (uint8
    ``[n, len(layers) * encoded_bytes]`` on the cache's device) straight into block
    ``block_indices[i]`` of the paged cache, layer by selected layer; ``-1`` writes nothing; a
    block number may appear only once."""
    from ucm.transfer import _check_indices

    layers, spec = _check_fused(layout, spec, shape, layers)
    idx = _check_indices(block_indices, layout, unique=True)
    s = _rows(src, len(layers) * encoded_bytes(spec, shape), "src", idx.shape[0])
    if s.device != layout.device:
        raise ValueError(f"src on {s.device}, the KV views on {layout.device}")
    if idx.shape[0]:
        dispatch.call("decode_scatter", layout, s, idx, spec, shape, layers, backend=backend)


def layer_decoder(layout, src, block_indices, spec: CodecSpec, shape: KVShape, *,
                  backend: Optional[str] = None):
    """:func:`decode_scatter` of every layer, one layer per call: returns ``f(k)``, which
    decodes shard ``k`` of the rows ``src`` (``[n, num_layers * encoded_bytes]``) into layer
    ``k`` of blocks ``block_indices``. The checks and the choice of implementation run here,
    once, and the numba implementation prepares its arrays here too. For the load thread,
    which decodes a layer at a time while the forward runs: each Python step it takes waits
    for the GIL the forward's thread holds, up to the interpreter's switch interval (5 ms)."""
    from ucm.transfer import _check_indices

    layers, spec = _check_fused(layout, spec, shape, None)
    idx = _check_indices(block_indices, layout, unique=True)
    E = encoded_bytes(spec, shape)
    s = _rows(src, len(layers) * E, "src", idx.shape[0])
    if s.device != layout.device:
        raise ValueError(f"src on {s.device}, the KV views on {layout.device}")
    if not idx.shape[0]:
        return lambda k: None
    impl, _ = dispatch.select("decode_scatter", backend, (layout, s, idx, spec, shape, layers))
    if impl.name == "numba":
        from ucm.fast.numba.compress import layer_decoder as prepared

        return prepared(layout, s, idx, spec, shape, layers)
    fn = impl.load()
    return lambda k: fn(layout, s[:, k * E:(k + 1) * E], idx, spec, shape, (layers[k],))


def _layout_device(args, kwargs):
    layout = args[0] if args else kwargs.get("layout")
    return getattr(layout, "device", None)


def layout_on_cpu(*args, **kwargs):
    return fast.cpu_takes(_layout_device(args, kwargs))


def layout_on_cuda(*args, **kwargs):
    return fast.triton_takes(_layout_device(args, kwargs))


FUSED_OPS = ("gather_encode", "decode_scatter")
FUSED_IMPLEMENTATIONS = (
    ImplSpec("reference", "ucm.reference.compress_transfer:{op}"),
    ImplSpec("triton", "ucm.fast.triton.compress:{op}", 20, frozenset({"cuda", "cpu"}),
             fast.triton_status, layout_on_cuda),
)
dispatch.register_table(FUSED_OPS, FUSED_IMPLEMENTATIONS)
# on CPU the decode writes straight into the cache's blocks (the load path's critical step);
# the encode side has no fused CPU implementation (saves run off the critical path)
dispatch.register("decode_scatter", "numba", "ucm.fast.numba.compress:decode_scatter",
                  platforms=frozenset({"cpu", "cuda"}), priority=10, probe=fast.numba_status,
                  verifier=layout_on_cpu)
