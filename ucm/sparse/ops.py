"""Sparse-attention ops: the validated public surface (contracts in ``docs/sparse.md``).

Each op checks its inputs here, once (shapes, dtypes, devices, head counts, windows and budgets,
and the values that index memory: block ids, sequence lengths, selections), then dispatches
through :mod:`ucm.dispatch` to

==========================  ====================================  ===============================
op                          reference (priority 0)                fast
==========================  ====================================  ===============================
update_block_reprs          ucm.reference.sparse (PyTorch)        ucm.fast.triton.sparse (20)
hash_codes                  (same)                                (same)
score_blocks                (same)                                (same)
select_blocks               (same: two stable sorts)              (same: threshold search;
                                                                  histogram for one long row)
select_head_mass            (same: softmax, mean, select_blocks)  (same: histogram selection)
score_select_head_mass      (same: score_blocks, select_head_mass) (same: per-head scores, then
                                                                  the head-mass selection)
sparse_block_table          (same)                                (same: one gather kernel)
quantize_token_keys         (same)                                (same, bit-identical)
score_token_mass            (same: float32 products)              (same: bfloat16 products on a
                                                                  GPU, float32 otherwise)
paged_decode_attention      (same: per-request softmax)           (same: split-K flash decoding)
pool_head_budgets           (same: two stable sorts)              (same: radix histograms over
                                                                  the GPU, a scan per request)
block_attention_mass        (same; an oracle, reference only)     --
quantize_rows               (same: elementwise PyTorch, any       --
                            device)
==========================  ====================================  ===============================

The Triton implementations take CUDA tensors, or CPU tensors when ``TRITON_INTERPRET=1`` (tests).

Value checks (ids in range, lengths, selections) read a few scalars back from the tensors' device:
one synchronization per call on CUDA. Hot loops that already hold validated inputs can call the
implementations in :mod:`ucm.fast.triton.sparse` directly.
"""
from __future__ import annotations

import math
from typing import Optional, Union

import torch

from ucm import dispatch, fast
from ucm.dispatch import ImplSpec

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
#: Dtypes of the mean / kmin / kmax tables (bfloat16 halves what scoring reads).
REPR_DTYPES = (torch.float32, torch.bfloat16)
KINDS = ("mean", "quest", "hamming")
REDUCES = ("sum", "none")

# ---------------------------------------------------------------------------------------------
# registry


def _first_tensor(args, kwargs) -> Optional[torch.Tensor]:
    for value in list(args) + list(kwargs.values()):
        if isinstance(value, torch.Tensor):
            return value
    return None


def on_triton_device(*args, **kwargs):
    """Verifier: the Triton kernels take CUDA tensors (CPU tensors through the interpreter)."""
    t = _first_tensor(args, kwargs)
    return fast.triton_takes(None if t is None else t.device)


TRITON_OPS = ("update_block_reprs", "hash_codes", "score_blocks", "select_blocks",
              "select_head_mass", "score_select_head_mass", "sparse_block_table",
              "paged_decode_attention", "quantize_token_keys", "score_token_mass",
              "pool_head_budgets")
REFERENCE_ONLY_OPS = ("block_attention_mass", "quantize_rows")
REFERENCE = ImplSpec("reference", "ucm.reference.sparse:{op}")
IMPLEMENTATIONS = (
    REFERENCE,
    ImplSpec("triton", "ucm.fast.triton.sparse:{op}", 20, frozenset({"cuda", "cpu"}),
             fast.triton_status, on_triton_device),
)
dispatch.register_table(TRITON_OPS, IMPLEMENTATIONS)
dispatch.register_table(REFERENCE_ONLY_OPS, (REFERENCE,))

# ---------------------------------------------------------------------------------------------
# validation helpers


def _tensor(x, name: str, dtypes, ndim: Optional[int] = None, device=None) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in dtypes:
        raise ValueError(f"{name}: expected dtype {' or '.join(str(d) for d in dtypes)}, got {x.dtype}")
    if ndim is not None and x.ndim != ndim:
        raise ValueError(f"{name}: expected {ndim} dimensions, got shape {list(x.shape)}")
    if device is not None and x.device != device:
        raise ValueError(f"{name}: on {x.device}, expected {device} (all tensors on one device)")
    return x


def _shape(x: torch.Tensor, name: str, expected: tuple, what: str) -> None:
    if tuple(x.shape) != tuple(expected):
        raise ValueError(f"{name}: expected shape {list(expected)} ({what}), got {list(x.shape)}")


def _int(value, name: str, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name}: expected an int >= {minimum}, got {value!r}")
    return value


def _cache(k_cache, name: str = "k_cache") -> torch.Tensor:
    k = _tensor(k_cache, name, FLOAT_DTYPES, 4)
    if min(k.shape) < 1:
        raise ValueError(f"{name}: [num_blocks, block_size, num_kv_heads, head_dim] must all be "
                         f">= 1, got {list(k.shape)}")
    return k


def _query(q, name: str, device, dtypes=FLOAT_DTYPES) -> torch.Tensor:
    q = _tensor(q, name, dtypes, 3, device)
    if q.shape[0] < 1 or q.shape[1] < 1:
        raise ValueError(f"{name}: expected [batch >= 1, num_q_heads >= 1, head_dim], got "
                         f"{list(q.shape)} (empty batch)")
    return q


def _heads(Hq: int, Hkv: int, where: str) -> None:
    if Hq % Hkv:
        raise ValueError(f"{where}: num_q_heads={Hq} is not a multiple of num_kv_heads={Hkv} (GQA)")


def _table(block_table, B: int, device) -> torch.Tensor:
    t = _tensor(block_table, "block_table", (torch.int32,), 2, device)
    if t.shape[0] != B or t.shape[1] < 1:
        raise ValueError(f"block_table: expected shape [{B}, M >= 1] (batch, blocks per request), "
                         f"got {list(t.shape)}")
    return t


def _vector(x, name: str, B: int, device, dtypes=(torch.int32,)) -> torch.Tensor:
    v = _tensor(x, name, dtypes, 1, device)
    _shape(v, name, (B,), "one entry per request")
    # the Triton kernels index these vectors as dense arrays (entry b at offset b)
    return v.contiguous()


def _fail_if(checks: dict) -> None:
    """Raise the first failed check (message -> bool or bool tensor scalar); the tensor flags are
    read back from their device in one transfer."""
    tensors = [v.reshape(()) for v in checks.values() if isinstance(v, torch.Tensor)]
    flags = iter(torch.stack(tensors).tolist() if tensors else [])
    for message, value in checks.items():
        if (next(flags) if isinstance(value, torch.Tensor) else value):
            raise ValueError(message)


def _ids_used_out_of_range(table: torch.Tensor, used_blocks: torch.Tensor, n: int) -> torch.Tensor:
    """bool scalar: some entry ``table[b, j]`` with ``j < used_blocks[b]`` is outside ``[0, n)``."""
    j = torch.arange(table.shape[1], device=table.device)[None, :]
    used = j < used_blocks.long()[:, None]
    return (used & ((table < 0) | (table >= n))).any()


def _scale(scale, D: int) -> float:
    if scale is None:
        return 1.0 / math.sqrt(D)
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale) \
            or scale <= 0:
        raise ValueError(f"scale: expected a finite float > 0 (default head_dim ** -0.5), got {scale!r}")
    return float(scale)


def _sub_table(x, name: str, dtypes, device, n_phys: Optional[int], Hkv: Optional[int],
               last: Optional[int], groups: Optional[int] = None) -> tuple:
    """Validate a representation table ``[num_blocks, Hkv, X]`` (one summary per block) or
    ``[num_blocks, G, Hkv, X]`` (``G`` sub-block summaries per block); ``None`` entries of the
    expected sizes are taken from the table. Returns ``(n_phys, G, Hkv, X)``."""
    t = _tensor(x, name, dtypes, None, device)
    if t.ndim not in (3, 4):
        raise ValueError(f"{name}: expected [num_blocks, Hkv, X] or [num_blocks, G, Hkv, X] "
                         f"(G sub-block summaries per block), got shape {list(t.shape)}")
    dims = (t.shape[0], 1, t.shape[1], t.shape[2]) if t.ndim == 3 else tuple(t.shape)
    want = (n_phys, groups, Hkv, last)
    if any(w is not None and w != d for w, d in zip(want, dims)) or min(dims) < 1:
        shown = ["num_blocks" if w is None else w for w in want]
        shown[1] = "G" if groups is None else groups
        raise ValueError(f"{name}: expected shape {shown} (or without the G dimension when "
                         f"G = 1), indexed by physical block id, got {list(t.shape)}")
    return dims


def _proj(proj, D: int, device) -> torch.Tensor:
    p = _tensor(proj, "proj", (torch.float32,), 2, device)
    if p.shape[0] != D or p.shape[1] < 32 or p.shape[1] % 32:
        raise ValueError(f"proj: expected shape [head_dim={D}, hash_bits] with hash_bits a positive "
                         f"multiple of 32, got {list(p.shape)}")
    return p


# ---------------------------------------------------------------------------------------------
# ops


def hash_codes(x, proj, *, backend: Optional[str] = None) -> torch.Tensor:
    """Sign-bit codes of ``x @ proj`` (float32): int32 ``[..., hash_bits // 32]``, bit ``i`` of
    word ``w`` set when channel ``32 w + i`` is positive.

    x: float tensor ``[..., D]`` (float32/float16/bfloat16, at least one row);
    proj: float32 ``[D, hash_bits]``, hash_bits a multiple of 32, on ``x``'s device.
    """
    x = _tensor(x, "x", FLOAT_DTYPES)
    if x.ndim < 1 or x.numel() == 0:
        raise ValueError(f"x: expected a non-empty tensor [..., head_dim], got shape {list(x.shape)}")
    proj = _proj(proj, x.shape[-1], x.device)
    return dispatch.call("hash_codes", x, proj, backend=backend)


def update_block_reprs(k_cache, block_ids, num_tokens, *, mean=None, kmin=None, kmax=None,
                       codes=None, proj=None, mean_scale=None,
                       backend: Optional[str] = None) -> None:
    """Write the representations of the listed physical blocks in place.

    k_cache: ``[num_blocks, block_size, Hkv, D]`` (any strides); block_ids: int32/int64 ``[N]``
    distinct ids in ``[0, num_blocks)``; num_tokens: int32/int64 ``[N]``, each in
    ``[1, block_size]``: the block's valid tokens. mean/kmin/kmax: float32 or bfloat16
    ``[num_blocks, Hkv, D]`` (computed in float32, stored rounded to the table's dtype);
    codes: int32 ``[num_blocks, Hkv, hash_bits // 32]``, needs proj float32 ``[D, hash_bits]``.
    At least one of mean/kmin/kmax/codes. Sub-block summaries: every given table
    ``[num_blocks, G, Hkv, X]`` (one ``G``, dividing block_size): row ``g`` summarises tokens
    ``[g t, (g + 1) t)`` (``t = block_size // G``) cut at ``num_tokens``; a sub-block with no valid
    token repeats the last one that has some. ``mean`` may be int8, with ``mean_scale`` float32
    ``mean.shape[:-1]``: each row is stored as :func:`quantize_rows` rounds the float32 mean
    (what :func:`score_blocks` takes with ``mean_scale``).
    """
    k = _cache(k_cache)
    nb, bs, Hkv, D = k.shape
    dev = k.device
    # contiguous: the Triton kernel reads entry i at offset i
    ids = _tensor(block_ids, "block_ids", (torch.int32, torch.int64), 1, dev).contiguous()
    ntok = _tensor(num_tokens, "num_tokens", (torch.int32, torch.int64), 1, dev).contiguous()
    _shape(ntok, "num_tokens", ids.shape, "one count per entry of block_ids")
    if mean is None and kmin is None and kmax is None and codes is None:
        raise ValueError("update_block_reprs: pass at least one of mean, kmin, kmax, codes")
    groups = None
    for name, t in (("mean", mean), ("kmin", kmin), ("kmax", kmax)):
        if t is not None:
            dtypes = REPR_DTYPES + ((torch.int8,) if name == "mean" else ())
            groups = _sub_table(t, name, dtypes, dev, nb, Hkv, D, groups)[1]
    _quant_scale(mean, mean_scale, dev)
    if codes is not None:
        if proj is None:
            raise ValueError("proj: required with codes (codes hash the block mean)")
        proj = _proj(proj, D, dev)
        groups = _sub_table(codes, "codes", (torch.int32,), dev, nb, Hkv, proj.shape[1] // 32,
                            groups)[1]
    elif proj is not None:
        _proj(proj, D, dev)
    if bs % groups:
        raise ValueError(f"tables: G={groups} sub-blocks per block does not divide block_size={bs}")
    if ids.numel():
        _fail_if({
            f"block_ids: entries must lie in [0, num_blocks={nb})": ((ids < 0) | (ids >= nb)).any(),
            f"num_tokens: entries must lie in [1, block_size={bs}]": ((ntok < 1) | (ntok > bs)).any(),
            "block_ids: duplicate ids": (torch.sort(ids).values.diff() == 0).any(),
        })
    dispatch.call("update_block_reprs", k, ids, ntok, mean=mean, kmin=kmin, kmax=kmax, codes=codes,
                  proj=proj, mean_scale=mean_scale, backend=backend)


def _quant_scale(mean, mean_scale, dev, kind: str = "mean") -> None:
    """``mean_scale`` comes exactly with an int8 ``mean``: float32, one scale per row."""
    quantized = kind == "mean" and mean is not None and mean.dtype == torch.int8
    if quantized != (mean_scale is not None):
        raise ValueError("mean_scale: required with an int8 mean table (one float32 scale per "
                         "row, from quantize_rows) and only then"
                         + ("" if kind == "mean" else f"; kind={kind!r} takes none"))
    if quantized:
        _tensor(mean_scale, "mean_scale", (torch.float32,), mean.ndim - 1, dev)
        _shape(mean_scale, "mean_scale", tuple(mean.shape[:-1]), "one scale per row of mean")


def _score_args(q, block_table, num_blocks, kind, mean, kmin, kmax, codes, proj, channel_mask,
                mean_scale=None):
    """Validated ``(q, block_table, num_blocks)`` of a scoring call (see :func:`score_blocks`;
    the caller has checked ``kind``)."""
    q, table, nblk = _scored_rows(q, block_table, num_blocks)
    B, Hq, D = q.shape
    dev = q.device
    M = table.shape[1]
    needed = {"mean": ("mean",), "quest": ("kmin", "kmax"), "hamming": ("codes", "proj")}[kind]
    given = {"mean": mean, "kmin": kmin, "kmax": kmax, "codes": codes, "proj": proj}
    for name in needed:
        if given[name] is None:
            raise ValueError(f"{name}: required for kind={kind!r}")
    if channel_mask is not None and kind != "mean":
        raise ValueError(f"channel_mask: only used with kind='mean', got kind={kind!r}")
    if kind == "hamming":
        proj = _proj(proj, D, dev)
        n_phys, _, Hkv, _ = _sub_table(codes, "codes", (torch.int32,), dev, None, None,
                                       proj.shape[1] // 32)
    else:
        first = mean if kind == "mean" else kmin
        dtypes = REPR_DTYPES + ((torch.int8,) if kind == "mean" else ())
        first = _tensor(first, needed[0], dtypes, None, dev)
        n_phys, groups, Hkv, _ = _sub_table(first, needed[0], dtypes, dev, None, None, D)
        for name in needed:  # kmin and kmax: one dtype, one shape
            _tensor(given[name], name, (first.dtype,), first.ndim, dev)
            _sub_table(given[name], name, (first.dtype,), dev, n_phys, Hkv, D, groups)
    _quant_scale(mean, mean_scale, dev, kind)
    if n_phys < 1 or Hkv < 1:
        raise ValueError(f"{needed[0]}: expected at least one block and one KV head")
    _heads(Hq, Hkv, "q")
    if channel_mask is not None:
        _tensor(channel_mask, "channel_mask", (torch.bool,), 3, dev)
        _shape(channel_mask, "channel_mask", (B, Hq, D), "per query head and channel")
    _check_scored_rows(table, nblk, n_phys, "the representation tables' rows")
    return q, table, nblk


def _scored_rows(q, block_table, num_blocks):
    """``(q [B, Hq, D], block_table int32 [B, M], num_blocks int32 [B])`` of a scoring call,
    validated for type, dtype, shape and device (values: :func:`_check_scored_rows`)."""
    q = _query(q, "q", None)
    B = q.shape[0]
    return q, _table(block_table, B, q.device), _vector(num_blocks, "num_blocks", B, q.device)


def _check_scored_rows(table, nblk, n_phys: int, rows: str) -> None:
    """Every request scores 1 to M blocks, each held in one of ``n_phys`` table rows."""
    M = table.shape[1]
    _fail_if({
        f"num_blocks: entries must lie in [1, M={M}] (an empty request has nothing to score)":
            ((nblk < 1) | (nblk > M)).any(),
        f"block_table: an entry below num_blocks lies outside [0, {n_phys}) ({rows})":
            _ids_used_out_of_range(table, nblk.clamp(0, M), n_phys),
    })


def score_blocks(q, block_table, num_blocks, *, kind: str, mean=None, kmin=None, kmax=None,
                 codes=None, proj=None, channel_mask=None, reduce: str = "sum",
                 mean_scale=None, backend: Optional[str] = None) -> torch.Tensor:
    """float32 scores of each request's logical blocks from their representations.

    q: ``[B, Hq, D]`` float; block_table: int32 ``[B, M]``; num_blocks: int32 ``[B]``, each in
    ``[1, M]``. kind: ``"mean"`` (needs mean; optional bool channel_mask ``[B, Hq, D]``),
    ``"quest"`` (kmin, kmax) or ``"hamming"`` (codes, proj). reduce: ``"sum"`` -> ``[B, M]``;
    ``"none"`` -> ``[B, Hq, M]`` (``[B, Hkv, M]`` for hamming). Positions past ``num_blocks`` are
    ``-inf``. Tables ``[num_blocks, Hkv, X]`` or, with ``G`` sub-block summaries per block,
    ``[num_blocks, G, Hkv, X]`` (as :func:`update_block_reprs` writes them): a block's per-head
    score is then the maximum over its sub-blocks (before the sum over heads). ``mean`` may be
    int8 with ``mean_scale`` (float32, ``mean.shape[:-1]``: one scale per row, as
    :func:`quantize_rows` makes them): half the bytes of a bfloat16 table to read; it scores as
    ``mean * mean_scale``.
    """
    if kind not in KINDS:
        raise ValueError(f"kind: expected one of {list(KINDS)}, got {kind!r}")
    if reduce not in REDUCES:
        raise ValueError(f"reduce: expected one of {list(REDUCES)}, got {reduce!r}")
    q, table, nblk = _score_args(q, block_table, num_blocks, kind, mean, kmin, kmax, codes, proj,
                                 channel_mask, mean_scale)
    return dispatch.call("score_blocks", q, table, nblk, kind=kind, mean=mean, kmin=kmin, kmax=kmax,
                         codes=codes, proj=proj, channel_mask=channel_mask, reduce=reduce,
                         mean_scale=mean_scale, backend=backend)


def _token_tables(keys4, scale4, dev, nb: Optional[int], Hkv: Optional[int],
                  bs: Optional[int], D: Optional[int]) -> tuple:
    """Validate ``keys4`` uint8 ``[num_blocks, Hkv, block_size, D // 2]`` and ``scale4``
    float16 ``[num_blocks, Hkv, D]`` (contiguous: the kernels index them as packed rows);
    ``None`` sizes are taken from ``keys4``. Returns ``(num_blocks, Hkv, block_size, D)``."""
    k4 = _tensor(keys4, "keys4", (torch.uint8,), 4, dev)
    s4 = _tensor(scale4, "scale4", (torch.float16,), 3, dev)
    n_, h_, b_, half = k4.shape
    want = (nb, Hkv, bs, None if D is None else D // 2)
    if (D is not None and D % 2) or any(w is not None and w != d for w, d in
                                        zip(want, k4.shape)) or min(k4.shape) < 1:
        shown = ["num_blocks" if nb is None else nb, "Hkv" if Hkv is None else Hkv,
                 "block_size" if bs is None else bs, "D // 2" if D is None else D / 2]
        raise ValueError(f"keys4: expected uint8 {shown} (two int4 codes per byte, indexed by "
                         f"physical block id), got {list(k4.shape)}")
    _shape(s4, "scale4", (n_, h_, 2 * half), "one float16 scale per (block, KV head, channel)")
    if not (k4.is_contiguous() and s4.is_contiguous()):
        raise ValueError("keys4, scale4: expected contiguous tensors (as allocated)")
    return n_, h_, b_, 2 * half


def quantize_token_keys(k_cache, block_ids, *, keys4, scale4,
                        backend: Optional[str] = None) -> None:
    """Write every token's key of the listed whole blocks in int4 (the ``mass`` method's table).

    k_cache: ``[num_blocks, block_size, Hkv, D]`` float (any strides), D even; block_ids:
    int32/int64 ``[N]`` distinct ids in ``[0, num_blocks)`` of blocks holding ``block_size``
    tokens; keys4: uint8 ``[num_blocks, Hkv, block_size, D // 2]``; scale4: float16
    ``[num_blocks, Hkv, D]``. Symmetric per (block, KV head, channel): ``scale = max |k| / 7`` in
    float16 (at most its largest finite value: a larger key is clipped), ``code = floor(k / scale
    + 1/2)`` in ``[-7, 7]`` (0 for a zero scale; a NaN key counts as 0), stored plus 8, channel
    ``c`` in the low nibble of byte ``c`` and channel ``c + D / 2`` in its high nibble. Rows not
    listed are left as they are.
    """
    k = _cache(k_cache)
    nb, bs, Hkv, D = k.shape
    dev = k.device
    ids = _tensor(block_ids, "block_ids", (torch.int32, torch.int64), 1, dev).contiguous()
    if D % 2:
        raise ValueError(f"k_cache: head_dim {D} is odd (int4 keys pack two channels per byte)")
    _token_tables(keys4, scale4, dev, nb, Hkv, bs, D)
    if ids.numel():
        _fail_if({
            f"block_ids: entries must lie in [0, num_blocks={nb})": ((ids < 0) | (ids >= nb)).any(),
            "block_ids: duplicate ids": (torch.sort(ids).values.diff() == 0).any(),
        })
    dispatch.call("quantize_token_keys", k, ids, keys4=keys4, scale4=scale4, backend=backend)


def score_token_mass(q, block_table, num_blocks, *, keys4, scale4, scale: float,
                     backend: Optional[str] = None) -> torch.Tensor:
    """Each block's attention mass under its tokens' int4 keys, as per-head logits.

    q: ``[B, Hq, D]`` float; block_table: int32 ``[B, M]``; num_blocks: int32 ``[B]`` in
    ``[1, M]``; keys4 / scale4 as :func:`quantize_token_keys` writes them; scale: the
    attention's softmax scale (``head_dim ** -0.5``). Returns float32 ``[B, Hq, M]``:
    ``logsumexp_t(scale * q_h . k_t) / scale`` over each block's tokens, ``-inf`` past
    ``num_blocks``; ``softmax(scale * x, -1)`` of a row is then each block's share of that head's
    attention (what :func:`select_head_mass` takes with the same ``scale``).
    """
    q, table, nblk = _scored_rows(q, block_table, num_blocks)
    scale = _scale_arg(scale)
    n_phys, Hkv, _, _ = _token_tables(keys4, scale4, q.device, None, None, None, q.shape[2])
    _heads(q.shape[1], Hkv, "q")
    _check_scored_rows(table, nblk, n_phys, "keys4's rows")
    return dispatch.call("score_token_mass", q, table, nblk, keys4=keys4, scale4=scale4,
                         scale=scale, backend=backend)


def quantize_rows(x):
    """``(int8 values, float32 scales)`` of a float table, one scale per last-axis row
    (``max |row| / 127``; values ``floor(row / scale + 1/2)``, within ``scale / 2`` of each
    entry; an all-zero row has scale 0): an int8 ``mean`` table and its ``mean_scale`` for
    :func:`score_blocks`. One implementation (elementwise PyTorch, on the tensor's device)."""
    t = _tensor(x, "x", FLOAT_DTYPES, None, x.device if isinstance(x, torch.Tensor) else None)
    if t.ndim < 1 or t.shape[-1] < 1:
        raise ValueError(f"x: expected rows along the last axis, got shape {list(t.shape)}")
    return dispatch.call("quantize_rows", t)


def select_width(M: int, max_budget: int, init_window: int, local_window: int) -> int:
    """Width ``K`` of :func:`select_blocks`' output: the most blocks any row can keep."""
    return min(M, max(max_budget, init_window + max(local_window, 1)))


def _selection_args(dev, B: int, M: int, num_blocks, budget, init_window, local_window):
    """Validated arguments of a selection over ``[B, M]`` blocks: ``(num_blocks int32 [B], budget
    int32 [B], init_window, local_window, width)`` (a tensor budget costs one read of its range)."""
    nblk = _vector(num_blocks, "num_blocks", B, dev)
    init_window = _int(init_window, "init_window", 0)
    local_window = _int(local_window, "local_window", 0)
    checks = {f"num_blocks: entries must lie in [1, M={M}] (an empty request has no block to keep)":
              ((nblk < 1) | (nblk > M)).any()}
    if isinstance(budget, torch.Tensor):
        bud = _vector(budget, "budget", B, dev)
        stats = torch.stack([bud.min(), bud.max()]).tolist()
        if stats[0] < 1:
            raise ValueError(f"budget: entries must be >= 1, got min {stats[0]}")
        max_budget = stats[1]
    else:
        max_budget = _int(budget, "budget", 1)
        bud = torch.full((B,), min(max_budget, 2**31 - 1), dtype=torch.int32, device=dev)
    _fail_if(checks)
    # a window of M blocks already covers every row (num_blocks <= M): larger ones select the
    # same blocks, and clamped they fit the kernels' int32 arithmetic (and the reference's int64)
    init_window, local_window = min(init_window, M), min(local_window, M)
    return nblk, bud, init_window, local_window, select_width(M, max_budget, init_window, local_window)


def select_blocks(scores, num_blocks, budget: Union[int, torch.Tensor], *, init_window: int,
                  local_window: int, backend: Optional[str] = None):
    """Pick each request's blocks: ``(sel int32 [B, K], count int32 [B])``.

    scores: float32 ``[B, M]`` (NaN ranks like ``-inf``); num_blocks: int32 ``[B]`` in
    ``[1, M]``; budget: int >= 1 or int32 ``[B]`` (each >= 1); init_window, local_window:
    ints >= 0. Keeps blocks ``[0, init_window)``, the last ``local_window`` blocks and the last
    block, then the highest scores (ties: lower index) until
    ``count = min(n, max(budget, kept so far))``. ``sel`` lists logical indexes in increasing
    order, padded with ``-1``; ``K = min(M, max(max(budget), init_window + max(local_window, 1)))``
    (a tensor budget costs one read of its maximum).
    """
    s = _tensor(scores, "scores", (torch.float32,), 2)
    B, M = s.shape
    if B < 1 or M < 1:
        raise ValueError(f"scores: expected [batch >= 1, M >= 1], got {list(s.shape)}")
    nblk, bud, init_window, local_window, width = _selection_args(s.device, B, M, num_blocks, budget,
                                                                  init_window, local_window)
    return dispatch.call("select_blocks", s, nblk, bud, init_window=init_window,
                         local_window=local_window, width=width, backend=backend)


def _scale_arg(scale) -> float:
    """``scale`` as a float, or a ``ValueError`` when it is not a finite number > 0."""
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale) \
            or scale <= 0:
        raise ValueError(f"scale: expected a finite float > 0, got {scale!r}")
    return float(scale)


def select_head_mass(per_head, num_blocks, budget: Union[int, torch.Tensor], *, scale: float,
                     init_window: int, local_window: int, backend: Optional[str] = None):
    """:func:`select_blocks` on the head mass of per-head scores: ``softmax(scale * per_head,
    -1).mean(1)``, each block's estimated share of attention averaged over heads
    (:meth:`ucm.sparse.base.SparseMethod.head_mass`). Returns ``(sel, count)`` as
    :func:`select_blocks` does.

    per_head: float32 ``[B, H, M]`` (``-inf`` past each request's blocks, as
    :func:`score_blocks` with ``reduce="none"`` writes them); scale: finite float > 0; the other
    arguments as :func:`select_blocks` takes them. The Triton implementation computes the head mass
    up to float32 rounding and selects exactly on what it computed.
    """
    x = _tensor(per_head, "per_head", (torch.float32,), 3)
    B, H, M = x.shape
    if B < 1 or H < 1 or M < 1:
        raise ValueError(f"per_head: expected [batch >= 1, heads >= 1, M >= 1], got {list(x.shape)}")
    scale = _scale_arg(scale)
    nblk, bud, init_window, local_window, width = _selection_args(x.device, B, M, num_blocks, budget,
                                                                  init_window, local_window)
    return dispatch.call("select_head_mass", x, nblk, bud, scale=scale,
                         init_window=init_window, local_window=local_window, width=width,
                         backend=backend)


def pool_head_budgets(shares, num_blocks, budget: Union[int, torch.Tensor], *, cap: int,
                      init_window: int, local_window: int, backend: Optional[str] = None):
    """One budget per request shared by its heads: int32 ``[B, H]``, the number of blocks each
    head keeps when ``H * budget[b]`` (head, block) pairs are taken by share across the heads.

    shares: float32 ``[B, H, M]``, each head's estimated share of attention per block (NaN
    ranks like ``-inf``); num_blocks, budget, init_window, local_window: as
    :func:`select_blocks` takes them (``budget`` is per head); cap: int >= 1, a head keeps at
    most ``cap * budget[b]`` blocks. Every head keeps its windows (they are not pooled); the
    other pairs go by share, ties to the lower rank within its head, then the lower head, so
    heads of equal shares get equal budgets. A head whose attention is concentrated leaves
    blocks to one whose attention is spread. Each result is at least the windows' count and at
    most ``num_blocks[b]``; feed it to :func:`select_blocks` per (request, head) row.
    """
    x = _tensor(shares, "shares", (torch.float32,), 3)
    B, H, M = x.shape
    if B < 1 or H < 1 or M < 1:
        raise ValueError(f"shares: expected [batch >= 1, heads >= 1, M >= 1], got {list(x.shape)}")
    cap = _int(cap, "cap", 1)
    nblk, bud, init_window, local_window, _ = _selection_args(x.device, B, M, num_blocks, budget,
                                                              init_window, local_window)
    return dispatch.call("pool_head_budgets", x, nblk, bud, cap=cap, init_window=init_window,
                         local_window=local_window, backend=backend)


def score_select_head_mass(q, block_table, num_blocks, budget: Union[int, torch.Tensor], *,
                           kind: str, mean=None, kmin=None, kmax=None, channel_mask=None,
                           scale: float, init_window: int, local_window: int,
                           mean_scale=None, seq_lens=None, block_size: Optional[int] = None,
                           backend: Optional[str] = None):
    """:func:`select_head_mass` on the per-head scores of :func:`score_blocks` (``reduce="none"``)
    as one op: ``(sel, count)``. kind: ``"mean"`` or ``"quest"``; the other arguments as those
    two ops take them. With ``seq_lens`` (int32 ``[B]``, ``ceil(seq_lens / block_size) ==
    num_blocks``) and ``block_size``, also the attention's table: ``(sel, count, table, lens)``,
    ``table, lens`` as :func:`sparse_block_table` makes them from ``block_table`` (the Triton
    selection writes them in its last launch). The Triton implementation selects exactly on the
    head mass it computes (float32 rounding)."""
    if kind not in ("mean", "quest"):
        raise ValueError(f"kind: expected 'mean' or 'quest', got {kind!r}")
    q, table, nblk = _score_args(q, block_table, num_blocks, kind, mean, kmin, kmax, None, None,
                                 channel_mask, mean_scale)
    B, M = table.shape
    scale = _scale_arg(scale)
    nblk, bud, init_window, local_window, width = _selection_args(q.device, B, M, nblk, budget,
                                                                  init_window, local_window)
    fold = {}
    if (seq_lens is None) != (block_size is None):
        raise ValueError("seq_lens, block_size: give both (the attention's table is returned "
                         "too) or neither")
    if seq_lens is not None:
        block_size = _int(block_size, "block_size", 1)
        lens = _vector(seq_lens, "seq_lens", B, q.device)
        nb = torch.div(lens.long() + block_size - 1, block_size, rounding_mode="floor")
        _fail_if({"seq_lens: ceil(seq_lens / block_size) must equal num_blocks":
                  (nb != nblk.long()).any()})
        fold = dict(seq_lens=lens, block_size=block_size)
    return dispatch.call("score_select_head_mass", q, table, nblk, bud, kind=kind, mean=mean,
                         kmin=kmin, kmax=kmax, channel_mask=channel_mask, scale=scale,
                         init_window=init_window, local_window=local_window, width=width,
                         mean_scale=mean_scale, backend=backend, **fold)


def sparse_block_table(block_table, seq_lens, sel, count, block_size: int, *,
                       backend: Optional[str] = None):
    """The block table and sequence lengths an attention kernel sees for the selected blocks:
    ``(table int32 [B, K], lens int32 [B])``; unused table entries are 0 (never read).

    block_table: int32 ``[B, M]``; seq_lens: int32 ``[B]`` in ``[1, M * block_size]``; sel, count:
    from :func:`select_blocks` (sel increasing, its last used entry the request's last block).
    """
    table = _tensor(block_table, "block_table", (torch.int32,), 2)
    B, M = table.shape
    if B < 1 or M < 1:
        raise ValueError(f"block_table: expected [batch >= 1, M >= 1], got {list(table.shape)}")
    dev = table.device
    block_size = _int(block_size, "block_size", 1)
    lens = _vector(seq_lens, "seq_lens", B, dev)
    s = _tensor(sel, "sel", (torch.int32,), 2, dev)
    if s.shape[0] != B or s.shape[1] < 1:
        raise ValueError(f"sel: expected shape [{B}, K >= 1], got {list(s.shape)}")
    K = s.shape[1]
    cnt = _vector(count, "count", B, dev)
    nb = torch.div(lens.long() + block_size - 1, block_size, rounding_mode="floor")
    k = torch.arange(K, device=dev)[None, :]
    used = k < cnt.long()[:, None]
    last = s.long().gather(1, (cnt.long() - 1).clamp(0, K - 1)[:, None])[:, 0]
    rising = (s[:, 1:].long() > s[:, :-1].long()) | ~used[:, 1:]
    _fail_if({
        f"seq_lens: entries must lie in [1, M * block_size = {M * block_size}]":
            ((lens < 1) | (lens > M * block_size)).any(),
        f"count: entries must lie in [1, K={K}]": ((cnt < 1) | (cnt > K)).any(),
        "sel: used entries must be increasing logical block indexes >= 0":
            (used & (s < 0)).any() | ~rising.all(),
        "sel: the last selected block of each request must be its last block "
        "(ceil(seq_lens / block_size) - 1)": (last != nb - 1).any(),
    })
    return dispatch.call("sparse_block_table", table, lens, s, cnt, block_size, backend=backend)


def _attention_inputs(q, k_cache, block_table, seq_lens, v_cache=None, per_head_ok=False):
    k = _cache(k_cache)
    n_phys, bs, Hkv, D = k.shape
    if v_cache is not None:
        v = _cache(v_cache, "v_cache")
        if v.shape != k.shape or v.dtype != k.dtype or v.device != k.device:
            raise ValueError(f"v_cache: expected the shape, dtype and device of k_cache "
                             f"({list(k.shape)}, {k.dtype}, {k.device}), got {list(v.shape)}, "
                             f"{v.dtype}, {v.device}")
    q = _query(q, "q", k.device)
    B, Hq, Dq = q.shape
    if Dq != D:
        raise ValueError(f"q: head_dim {Dq} differs from the cache's head_dim {D}")
    _heads(Hq, Hkv, "q")
    if per_head_ok and isinstance(block_table, torch.Tensor) and block_table.dim() == 3:
        # one table per KV head: [B, Hkv, M] and lengths [B, Hkv]
        table = _tensor(block_table, "block_table", (torch.int32,), 3, k.device)
        if table.shape[0] != B or table.shape[1] != Hkv or table.shape[2] < 1:
            raise ValueError(f"block_table: expected shape [{B}, {Hkv}, M >= 1] (per KV head) or "
                             f"[{B}, M], got {list(table.shape)}")
        lens = _tensor(seq_lens, "seq_lens", (torch.int32,), 2, k.device)
        _shape(lens, "seq_lens", (B, Hkv), "one length per request and KV head")
        flat_table, flat_lens = table.reshape(B * Hkv, -1), lens.reshape(-1)
    else:
        table = _table(block_table, B, k.device)
        lens = _vector(seq_lens, "seq_lens", B, k.device)
        flat_table, flat_lens = table, lens
    M = table.shape[-1]
    nb = torch.div(flat_lens.long() + bs - 1, bs, rounding_mode="floor")
    _fail_if({
        f"seq_lens: entries must lie in [1, M * block_size = {M * bs}] (an empty request has no "
        f"query to attend with)": ((flat_lens < 1) | (flat_lens > M * bs)).any(),
        f"block_table: an entry holding a request's tokens lies outside [0, num_blocks={n_phys})":
            _ids_used_out_of_range(flat_table, nb.clamp(0, M), n_phys),
    })
    return q, k, table, lens


def paged_decode_attention(q, k_cache, v_cache, block_table, seq_lens, *, scale=None, out=None,
                           backend: Optional[str] = None) -> torch.Tensor:
    """One decode query per request over its paged KV: ``[B, Hq, D]`` in ``q``'s dtype.

    q: ``[B, Hq, D]`` with the cache's dtype (float32/float16/bfloat16); k_cache, v_cache:
    ``[num_blocks, block_size, Hkv, D]`` (any strides), Hq a multiple of Hkv; block_table: int32
    ``[B, M]``; seq_lens: int32 ``[B]`` in ``[1, M * block_size]``; or one table per KV head
    (per-KV-head selection): block_table ``[B, Hkv, M]`` and seq_lens ``[B, Hkv]``, KV head ``g``
    (and its query heads) attending to the tokens of ``block_table[b, g]``; scale: default
    ``D ** -0.5``; out: optional ``[B, Hq, D]`` tensor of q's dtype and device, written and
    returned.
    """
    q, k, table, lens = _attention_inputs(q, k_cache, block_table, seq_lens, v_cache,
                                          per_head_ok=True)
    if q.dtype != k.dtype:
        raise ValueError(f"q: dtype {q.dtype} differs from the cache's {k.dtype}")
    if out is not None:
        _tensor(out, "out", (q.dtype,), 3, q.device)
        _shape(out, "out", q.shape, "like q")
    return dispatch.call("paged_decode_attention", q, k, v_cache, table, lens,
                         scale=_scale(scale, q.shape[2]), out=out, backend=backend)


def block_attention_mass(q, k_cache, block_table, seq_lens, *, scale=None, per_query_head: bool = False,
                         backend: Optional[str] = None) -> torch.Tensor:
    """Exact softmax mass of each logical block, averaged over query heads: float32 ``[B, M]``
    (0 past a request's last block); with ``per_query_head`` each query head's own, ``[B, Hq, M]``.
    Reference only: an oracle for selection quality."""
    q, k, table, lens = _attention_inputs(q, k_cache, block_table, seq_lens)
    if not isinstance(per_query_head, bool):
        raise ValueError(f"per_query_head: expected a bool, got {per_query_head!r}")
    return dispatch.call("block_attention_mass", q, k, table, lens, scale=_scale(scale, q.shape[2]),
                         per_query_head=per_query_head, backend=backend)
