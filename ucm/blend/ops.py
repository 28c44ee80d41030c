"""Blend ops: the validated public surface of non-prefix KV reuse (CacheBlend-style).

Each op checks its inputs here, once (types, dtypes, shapes, devices, the rotary dimension and
the output's memory), then dispatches through :mod:`ucm.dispatch` to

================  ===================================  ====================================
op                reference (priority 0)               fast
================  ===================================  ====================================
rope_rotate       ucm.reference.blend (PyTorch,        ucm.fast.numba.blend (10, CPU tensors:
                  float64 angles and rotation)         one nogil call);
                                                       ucm.fast.triton.blend (20, CUDA
                                                       tensors: one launch)
kv_deviation      (same: float32 PyTorch)              (same)
select_recompute  (same: a stable sort; reference      --
                  only, a few thousand scalars)
================  ===================================  ====================================

The Triton implementations take CUDA tensors, or CPU tensors when ``TRITON_INTERPRET=1`` (tests);
the Numba ones take CPU tensors. Every implementation reads and writes the tensors where they
are (any strides, int64 offsets): no contiguous copies of the cache.

Numerics of :func:`rope_rotate`: the angle ``delta * inv_freq`` (up to ~1e5 radians for 128K
contexts) is a float64 product everywhere; the reference keeps float64 to the end, the fast
paths reduce the angle modulo 2 pi in float64 and rotate in float32 (errors within
``tests/test_blend_ops.py``'s table: a few float32 ulps, or one rounding step of a 16-bit
output). ``delta = 0`` is an exact copy in every implementation. Shifts are positions:
``|delta| <= MAX_DELTA`` (2**31, beyond any int32), checked; past ~2**36 the float64 angle loses the digits
that its reduction modulo 2 pi needs, and the implementations would disagree.
"""
from __future__ import annotations

import math
import numbers
from typing import Optional

import torch

from ucm import dispatch, fast
from ucm.dispatch import ImplSpec

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
INDEX_DTYPES = (torch.int32, torch.int64)
#: the largest position shift rope_rotate takes (module doc: its numerics)
MAX_DELTA = 2 ** 31
FREQ_DTYPES = (torch.float32, torch.float64)
DEVIATION_DTYPES = FLOAT_DTYPES + (torch.float64,)

# ---------------------------------------------------------------------------------------------
# registry


def on_triton_device(*args, **kwargs):
    """Verifier: the Triton kernels take CUDA tensors (CPU tensors through the interpreter)."""
    return fast.triton_takes(fast.device_of(args, kwargs))


def on_cpu(*args, **kwargs):
    """Verifier: the Numba kernels take CPU tensors."""
    return fast.cpu_takes(fast.device_of(args, kwargs))


FAST_OPS = ("rope_rotate", "kv_deviation")
REFERENCE_ONLY_OPS = ("select_recompute",)
REFERENCE = ImplSpec("reference", "ucm.reference.blend:{op}")
IMPLEMENTATIONS = (
    REFERENCE,
    ImplSpec("numba", "ucm.fast.numba.blend:{op}", 10, frozenset({"cpu", "cuda"}),
             fast.numba_status, on_cpu),
    ImplSpec("triton", "ucm.fast.triton.blend:{op}", 20, frozenset({"cuda", "cpu"}),
             fast.triton_status, on_triton_device),
)
dispatch.register_table(FAST_OPS, IMPLEMENTATIONS)
dispatch.register_table(REFERENCE_ONLY_OPS, (REFERENCE,))

# ---------------------------------------------------------------------------------------------
# validation helpers


def _tensor(x, name: str, dtypes, ndim: int, device=None) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in dtypes:
        raise ValueError(f"{name}: expected dtype {' or '.join(str(d) for d in dtypes)}, "
                         f"got {x.dtype}")
    if x.ndim != ndim:
        raise ValueError(f"{name}: expected {ndim} dimensions, got shape {list(x.shape)}")
    if device is not None and x.device != device:
        raise ValueError(f"{name}: on {x.device}, expected {device} (all tensors on one device)")
    return x


def _shape(x: torch.Tensor, name: str, expected: tuple, what: str) -> None:
    if tuple(x.shape) != tuple(expected):
        raise ValueError(f"{name}: expected shape {list(expected)} ({what}), got {list(x.shape)}")


def _bool(value, name: str) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{name}: expected a bool, got {value!r}")
    return value


def _heads(x, name: str) -> torch.Tensor:
    """A ``[N, H, D]`` float tensor, ``H, D >= 1`` (``N`` may be 0)."""
    x = _tensor(x, name, FLOAT_DTYPES, 3)
    if x.shape[1] < 1 or x.shape[2] < 1:
        raise ValueError(f"{name}: expected [num_tokens, num_heads >= 1, head_dim >= 1], got "
                         f"{list(x.shape)}")
    return x


def _no_self_overlap(t: torch.Tensor, name: str) -> None:
    """Writable: no two elements of ``t`` share memory. Sufficient test: with the dimensions of
    more than one element sorted by stride, each stride passes the span of the smaller ones
    (every view a cache hands out, transposed or sliced, passes; a broadcast does not)."""
    dims = sorted((st, sz) for sz, st in zip(t.shape, t.stride()) if sz > 1)
    span = 0
    for st, sz in dims:
        if st <= span:
            raise ValueError(f"{name}: its elements overlap in memory (shape {list(t.shape)}, "
                             f"strides {list(t.stride())}): a broadcast or self-overlapping view "
                             f"cannot be written")
        span += st * (sz - 1)


def _element_offsets(t: torch.Tensor) -> torch.Tensor:
    """int64 ``[numel]``: each element's offset in its storage, in elements (metadata only)."""
    off = torch.full((), t.storage_offset(), dtype=torch.int64)
    for dim, (n, st) in enumerate(zip(t.shape, t.stride())):
        shape = [1] * t.dim()
        shape[dim] = n
        off = off + (torch.arange(n, dtype=torch.int64) * st).reshape(shape)
    return off.reshape(-1)


def _in_place_or_apart(out: torch.Tensor, x: torch.Tensor, name: str) -> None:
    """``out`` (``x``'s shape and dtype) is ``x``'s memory element for element (in place) or
    shares none of it: an implementation that writes ``out`` while it reads ``x`` (the fast
    paths do, token by token) would otherwise read values it has already rotated."""
    if x.device.type == "meta" or out.numel() == 0:
        return
    same = [(a, b) for n, a, b in zip(x.shape, x.stride(), out.stride()) if n > 1]
    if out.data_ptr() == x.data_ptr() and all(a == b for a, b in same):
        return                                                      # in place
    if out.untyped_storage().data_ptr() != x.untyped_storage().data_ptr():
        return
    es = x.element_size()

    def extent(t):
        lo = t.data_ptr()
        return lo, lo + (1 + sum((n - 1) * st for n, st in zip(t.shape, t.stride()))) * es
    (a0, a1), (b0, b1) = extent(out), extent(x)
    if a1 <= b0 or b1 <= a0:
        return
    if (out.data_ptr() - x.data_ptr()) % es == 0:
        oo, xo = _element_offsets(out), _element_offsets(x)
        if torch.equal(oo, xo):
            return                                                  # in place, other strides
        if not bool(torch.isin(oo, xo).any()):
            return                                                  # interleaved, apart
    raise ValueError(f"{name}: overlaps x in memory without being x (shape {list(out.shape)}, "
                     f"strides {list(out.stride())} vs x's {list(x.stride())}): pass out=x to "
                     f"rotate in place, or a tensor that shares no memory with x")


def _rotary_dim(rotary_dim, D: int) -> int:
    if rotary_dim is None:
        if D % 2:
            raise ValueError(f"rotary_dim: head_dim {D} is odd; pass an even rotary_dim <= {D}")
        return D
    if isinstance(rotary_dim, bool) or not isinstance(rotary_dim, int):
        raise ValueError(f"rotary_dim: expected an int or None, got {rotary_dim!r}")
    if rotary_dim < 2 or rotary_dim % 2 or rotary_dim > D:
        raise ValueError(f"rotary_dim: expected an even int in [2, head_dim={D}], got "
                         f"{rotary_dim}")
    return rotary_dim


# ---------------------------------------------------------------------------------------------
# ops


def rope_rotate(x, delta, inv_freq, *, neox: bool = True, rotary_dim: Optional[int] = None,
                out=None, backend: Optional[str] = None) -> torch.Tensor:
    """Rotate RoPE keys by ``delta`` positions: keys stored at positions ``p`` become the keys at
    ``p + delta`` (rotations compose, ``R(p + d) = R(d) R(p)``).

    x: ``[N, H, D]`` float32 / float16 / bfloat16, any strides (e.g. the key half of a paged
    cache); delta: int32 / int64 ``[N]``, each token's shift (0 and negative allowed), on
    ``x``'s device; inv_freq: float32 / float64 ``[R / 2]``, the model's rotary inverse
    frequencies (``R = rotary_dim``, default ``D``; even, ``<= D``), on ``x``'s device. Only the
    first ``R`` channels of each head rotate, channels ``R..D-1`` are copied unchanged.

    neox: rotate-half pairing, channel ``i`` with ``i + R / 2`` (Llama / Hugging Face); False:
    GPT-J pairing ``(2 i, 2 i + 1)``. Pair ``i`` with angle ``t = delta * inv_freq[i]``:
    ``a' = a cos t - b sin t``, ``b' = b cos t + a sin t``.

    out: optional ``[N, H, D]`` tensor of ``x``'s dtype and device, any strides, written and
    returned; it may be ``x`` itself (in place). Other overlaps of ``out`` with ``x`` are
    refused (ValueError). Without ``out``: a new contiguous tensor. ``N = 0`` is fine (nothing runs).
    """
    x = _heads(x, "x")
    N, H, D = x.shape
    dev = x.device
    delta = _tensor(delta, "delta", INDEX_DTYPES, 1, dev)
    _shape(delta, "delta", (N,), "one shift per token of x")
    if N and delta.dtype == torch.int64:          # (int32 shifts are in range by their type)
        lo, hi = (int(v) for v in torch.aminmax(delta))   # one read back on CUDA
        if lo < -MAX_DELTA or hi > MAX_DELTA:
            bad = lo if lo < -MAX_DELTA else hi
            raise ValueError(f"delta: a shift of {bad} positions; expected |delta| <= "
                             f"{MAX_DELTA} (a position shift within any context)")
    R = _rotary_dim(rotary_dim, D)
    inv_freq = _tensor(inv_freq, "inv_freq", FREQ_DTYPES, 1, dev)
    _shape(inv_freq, "inv_freq", (R // 2,), f"rotary_dim / 2 = {R // 2} frequencies")
    neox = _bool(neox, "neox")
    if out is not None:
        out = _tensor(out, "out", (x.dtype,), 3, dev)
        _shape(out, "out", x.shape, "like x")
        _no_self_overlap(out, "out")
        _in_place_or_apart(out, x, "out")
    if N == 0:
        return torch.empty((0, H, D), dtype=x.dtype, device=dev) if out is None else out
    return dispatch.call("rope_rotate", x, delta, inv_freq, neox=neox, rotary_dim=R, out=out,
                         backend=backend)


def kv_deviation(k_new, v_new, k_old, v_old, *, backend: Optional[str] = None) -> torch.Tensor:
    """Per-token squared L2 deviation of freshly computed K/V from stored K/V on one layer:
    float32 ``[N]``, ``dev[n] = sum_{h, d} (k_new - k_old)^2 + (v_new - v_old)^2`` (differences
    and sums in float32).

    k_new, v_new, k_old, v_old: ``[N, H, D]``, one shape, one dtype (float32 / float16 /
    bfloat16), one device, any strides. ``N = 0`` is fine.
    """
    k_new = _heads(k_new, "k_new")
    dev, dt = k_new.device, k_new.dtype
    named = {"v_new": v_new, "k_old": k_old, "v_old": v_old}
    for name, t in named.items():
        t = _tensor(t, name, FLOAT_DTYPES, 3, dev)
        if t.dtype != dt:
            raise ValueError(f"{name}: dtype {t.dtype} differs from k_new's {dt}")
        _shape(t, name, k_new.shape, "like k_new")
    if k_new.shape[0] == 0:
        return torch.zeros(0, dtype=torch.float32, device=dev)
    return dispatch.call("kv_deviation", k_new, v_new, k_old, v_old, backend=backend)


def select_recompute(deviation, ratio, forced, *, backend: Optional[str] = None) -> torch.Tensor:
    """Tokens to recompute after the check layer: int64 indices, increasing, on ``deviation``'s
    device. Every index where ``forced`` (bool ``[N]``, e.g. tokens without stored KV) is True,
    plus the ``ceil(ratio * U)`` unforced tokens (``U`` of them) of largest ``deviation``
    (float ``[N]``, e.g. :func:`kv_deviation`; NaN counts as +inf; ties to the lower index).
    ``ratio * U`` within 1e-9 of an integer counts as that integer (0.3 of 10 tokens is 3).

    ratio: a real number in ``[0, 1]``. Reference only (a sort of ``N`` scalars).
    """
    deviation = _tensor(deviation, "deviation", DEVIATION_DTYPES, 1)
    forced = _tensor(forced, "forced", (torch.bool,), 1, deviation.device)
    _shape(forced, "forced", deviation.shape, "one flag per token of deviation")
    if isinstance(ratio, bool) or not isinstance(ratio, numbers.Real) \
            or not math.isfinite(ratio) or not 0 <= ratio <= 1:
        raise ValueError(f"ratio: expected a real number in [0, 1], got {ratio!r}")
    return dispatch.call("select_recompute", deviation, float(ratio), forced, backend=backend)
