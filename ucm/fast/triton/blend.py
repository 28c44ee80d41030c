"""Triton Blend ops: same names and signatures as :mod:`ucm.reference.blend` (inputs validated
by :mod:`ucm.blend.ops`), one launch each. CUDA tensors, or CPU tensors under
``TRITON_INTERPRET=1`` (set before triton is imported).

Every tensor is addressed through its own strides with int64 offsets (a transposed view, the key
half of a ``[num_blocks, H, block_size, 2 D]`` page, channels of stride 2 ...), never copied.

* :func:`rope_rotate` (``_rope_kernel``): a program per ``(tile of tokens, group of heads)``.
  It computes its tokens' angles ``delta * inv_freq`` once, as float64 products reduced modulo
  2 pi to ``[-pi, pi]`` in float64, then float32 cosines and sines, and rotates each head's pairs
  in float32 (stored rounded to nearest even): rotate-half pairs as two contiguous halves,
  GPT-J pairs as one contiguous load split into its even and odd channels (two loads of stride 2
  instead ran 15x slower on the H200, in place). Channels past ``rotary_dim`` are copied as they
  are (exact), and skipped in place.
* :func:`kv_deviation` (``_deviation_kernel``): a program per tile of tokens, a float32
  ``[tokens, channels]`` accumulator over heads and channel chunks, summed at the end.

Launch constants live in :class:`LaunchConfig` (:data:`LAUNCH` is the default); both functions
take ``launch=``. Tiles shrink (to one token at least) until the grid has
``programs_per_sm`` programs per multiprocessor, so short batches still spread over the GPU.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl

from ucm.fast.triton import interpreting

# float64 constants of the angle reduction (made float64 tensors in the kernel: a bare Python
# float in an expression would be a float32 constant)
TWO_PI = tl.constexpr(2.0 * math.pi)
INV_TWO_PI = tl.constexpr(1.0 / (2.0 * math.pi))


@dataclass(frozen=True)
class LaunchConfig:
    """Launch constants of the Blend kernels (tile sizes rounded to powers of two)."""

    #: Elements of one ``[tokens, pairs]`` tile of the rotation (tokens = tile // pairs).
    rope_tile: int = 2048
    #: Heads one rotation program walks through (its angles computed once for all of them).
    rope_heads: int = 8
    rope_warps: int = 4
    #: Channels per chunk of the pass-through copy (``rotary_dim < head_dim``).
    tail_chunk: int = 64
    #: Elements of one ``[tokens, channels]`` tile of the deviation.
    deviation_tile: int = 2048
    deviation_warps: int = 4
    #: Channels per chunk of the deviation (at most).
    deviation_chunk: int = 128
    #: Tiles shrink until the grid has this many programs per multiprocessor.
    programs_per_sm: int = 4

    def replace(self, **changes) -> "LaunchConfig":
        """A copy with ``changes`` (field names as above)."""
        return dataclasses.replace(self, **changes)


LAUNCH = LaunchConfig()

_jitted: dict = {}


def jit(fn):
    """``triton.jit(fn)`` made on first use, per mode (``TRITON_INTERPRET`` is read by
    ``triton.jit`` when it decorates); the kernels call no jitted helpers."""
    key = (fn.__name__, interpreting())
    k = _jitted.get(key)
    if k is None:
        k = _jitted[key] = triton.jit(fn)
    return k


def _pow2(n: int, least: int = 1) -> int:
    return max(least, triton.next_power_of_2(int(n)))


_sm_counts: dict = {}


def _sm_count(device: torch.device) -> int:
    """Multiprocessors of a CUDA device; 1 under the interpreter (few, large programs: each
    program costs there, the arithmetic little)."""
    if device.type != "cuda":
        return 1
    n = _sm_counts.get(device.index)
    if n is None:
        props = torch.cuda.get_device_properties(device)
        n = _sm_counts[device.index] = props.multi_processor_count
    return n


# ---------------------------------------------------------------------------------------------
# kernels


def _rope_kernel(x_ptr, y_ptr, delta_ptr, freq_ptr, N, H, D,
                 sxn, sxh, sxd, syn, syh, syd,
                 HALF: tl.constexpr, HALF_P: tl.constexpr, BLOCK_N: tl.constexpr,
                 HEADS: tl.constexpr, NEOX: tl.constexpr, TAIL: tl.constexpr,
                 TAIL_P: tl.constexpr):
    """Tokens ``[BLOCK_N pid0, +BLOCK_N)``, heads ``[HEADS pid1, +HEADS)``: pair ``i < HALF`` is
    channels ``(i, i + HALF)`` (``NEOX``) or ``(2 i, 2 i + 1)``; ``TAIL``: copy channels
    ``2 HALF..D-1``."""
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    n64 = n.to(tl.int64)
    i = tl.arange(0, HALF_P)
    i_ok = i < HALF
    d = tl.load(delta_ptr + n64, mask=n_ok, other=0).to(tl.float64)
    f = tl.load(freq_ptr + i, mask=i_ok, other=0.0).to(tl.float64)
    angle = d[:, None] * f[None, :]                              # float64 [BLOCK_N, HALF_P]
    turns = tl.floor(angle * tl.full([], INV_TWO_PI, tl.float64) + 0.5)
    r = (angle - turns * tl.full([], TWO_PI, tl.float64)).to(tl.float32)   # in [-pi, pi]
    c = tl.cos(r)
    s = tl.sin(r)
    z = (d == 0.0)[:, None]                                      # delta 0: an exact copy
    ca = i.to(tl.int64)[None, :]                                 # NEOX: pair (ca, ca + HALF)
    c2 = tl.arange(0, 2 * HALF_P).to(tl.int64)[None, :]          # GPT-J: channels 2 i, 2 i + 1
    ok = n_ok[:, None] & i_ok[None, :]
    ok2 = n_ok[:, None] & (c2 < 2 * HALF)
    h0 = tl.program_id(1) * HEADS
    xr = x_ptr + n64[:, None] * sxn + h0.to(tl.int64) * sxh      # head h0's rows, then on
    yr = y_ptr + n64[:, None] * syn + h0.to(tl.int64) * syh
    for hh in range(HEADS):
        h_ok = ((n * 0 + h0 + hh) < H)[:, None]                  # [BLOCK_N, 1]: the head exists
        if NEOX:                                                 # two contiguous halves
            m = ok & h_ok
            a0 = tl.load(xr + ca * sxd, mask=m, other=0.0)
            b0 = tl.load(xr + (ca + HALF) * sxd, mask=m, other=0.0)
            a, b = a0.to(tl.float32), b0.to(tl.float32)
            tl.store(yr + ca * syd, tl.where(z, a0, (a * c - b * s).to(y_ptr.dtype.element_ty)),
                     mask=m)
            tl.store(yr + (ca + HALF) * syd,
                     tl.where(z, b0, (b * c + a * s).to(y_ptr.dtype.element_ty)), mask=m)
        else:                                                    # one load, split into pairs
            m = ok2 & h_ok
            v0 = tl.load(xr + c2 * sxd, mask=m, other=0.0)
            a, b = tl.split(tl.reshape(v0.to(tl.float32), [BLOCK_N, HALF_P, 2]))
            rotated = tl.join(a * c - b * s, b * c + a * s)     # [BLOCK_N, HALF_P, 2]
            rotated = tl.reshape(rotated, [BLOCK_N, 2 * HALF_P]).to(y_ptr.dtype.element_ty)
            tl.store(yr + c2 * syd, tl.where(z, v0, rotated), mask=m)
        if TAIL:
            for c0 in range(2 * HALF, D, TAIL_P):
                cc = c0 + tl.arange(0, TAIL_P).to(tl.int64)
                mt = n_ok[:, None] & h_ok & (cc < D)[None, :]
                rest = tl.load(xr + cc[None, :] * sxd, mask=mt)      # (own name: Triton
                tl.store(yr + cc[None, :] * syd, rest, mask=mt)      # types loop variables)
        xr += sxh
        yr += syh


def _deviation_kernel(kn_ptr, vn_ptr, ko_ptr, vo_ptr, out_ptr, N, H, D,
                      s_kn_n, s_kn_h, s_kn_d, s_vn_n, s_vn_h, s_vn_d,
                      s_ko_n, s_ko_h, s_ko_d, s_vo_n, s_vo_h, s_vo_d,
                      BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    """``out[n] = sum_{h, c} (kn - ko)^2 + (vn - vo)^2`` (float32) for tokens
    ``[BLOCK_N pid, +BLOCK_N)``."""
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    n64 = n.to(tl.int64)[:, None]
    acc = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    kn_row = kn_ptr + n64 * s_kn_n                  # head 0's rows, then one head per step
    vn_row = vn_ptr + n64 * s_vn_n
    ko_row = ko_ptr + n64 * s_ko_n
    vo_row = vo_ptr + n64 * s_vo_n
    for _ in range(H):
        for d0 in range(0, D, BLOCK_D):
            cc = (d0 + tl.arange(0, BLOCK_D)).to(tl.int64)[None, :]
            m = n_ok[:, None] & (cc < D)
            dk = tl.load(kn_row + cc * s_kn_d, mask=m, other=0.0).to(tl.float32) \
                - tl.load(ko_row + cc * s_ko_d, mask=m, other=0.0).to(tl.float32)
            dv = tl.load(vn_row + cc * s_vn_d, mask=m, other=0.0).to(tl.float32) \
                - tl.load(vo_row + cc * s_vo_d, mask=m, other=0.0).to(tl.float32)
            acc += dk * dk + dv * dv
        kn_row += s_kn_h
        vn_row += s_vn_h
        ko_row += s_ko_h
        vo_row += s_vo_h
    tl.store(out_ptr + n.to(tl.int64), tl.sum(acc, axis=1), mask=n_ok)


# ---------------------------------------------------------------------------------------------
# ops


def _token_tile(N: int, groups: int, tile: int, width: int, device, launch: LaunchConfig) -> int:
    """Tokens per program: ``tile // width`` (a power of two, at least 1), halved until
    ``cdiv(N, tokens) * groups`` programs reach ``programs_per_sm`` per multiprocessor."""
    block = max(1, tile // width)
    block = min(block, _pow2(N))
    enough = launch.programs_per_sm * _sm_count(device)
    while block > 1 and triton.cdiv(N, block) * groups < enough:
        block //= 2
    return block


def rope_rotate(x: torch.Tensor, delta: torch.Tensor, inv_freq: torch.Tensor, *,
                neox: bool = True, rotary_dim: Optional[int] = None,
                out: Optional[torch.Tensor] = None,
                launch: LaunchConfig = LAUNCH) -> torch.Tensor:
    """Same contract as :func:`ucm.reference.blend.rope_rotate`; asynchronous on CUDA."""
    N, H, D = x.shape
    R = D if rotary_dim is None else rotary_dim
    y = torch.empty((N, H, D), dtype=x.dtype, device=x.device) if out is None else out
    if y.numel() == 0:
        return y
    in_place = y.data_ptr() == x.data_ptr() and y.stride() == x.stride()
    half = R // 2
    half_p = _pow2(half)
    heads = min(launch.rope_heads, H)
    groups = triton.cdiv(H, heads)
    block_n = _token_tile(N, groups, launch.rope_tile, half_p, x.device, launch)
    tail = R < D and not in_place
    grid = (triton.cdiv(N, block_n), groups)
    jit(_rope_kernel)[grid](
        x, y, delta, inv_freq, N, H, D, *x.stride(), *y.stride(),
        HALF=half, HALF_P=half_p, BLOCK_N=block_n, HEADS=heads, NEOX=bool(neox), TAIL=tail,
        TAIL_P=min(_pow2(max(D - R, 1)), launch.tail_chunk), num_warps=launch.rope_warps)
    return y


def kv_deviation(k_new: torch.Tensor, v_new: torch.Tensor, k_old: torch.Tensor,
                 v_old: torch.Tensor, *, launch: LaunchConfig = LAUNCH) -> torch.Tensor:
    """Same contract as :func:`ucm.reference.blend.kv_deviation`; asynchronous on CUDA."""
    N, H, D = k_new.shape
    out = torch.empty(N, dtype=torch.float32, device=k_new.device)
    if k_new.numel() == 0:
        return out.zero_()
    block_d = min(_pow2(D), _pow2(launch.deviation_chunk))
    block_n = _token_tile(N, 1, launch.deviation_tile, block_d, k_new.device, launch)
    jit(_deviation_kernel)[(triton.cdiv(N, block_n),)](
        k_new, v_new, k_old, v_old, out, N, H, D,
        *k_new.stride(), *v_new.stride(), *k_old.stride(), *v_old.stride(),
        BLOCK_N=block_n, BLOCK_D=block_d, num_warps=launch.deviation_warps)
    return out
