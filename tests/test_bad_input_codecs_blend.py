"""Hostile inputs to KV compression (ucm.compress, ucm.codecs) and Blend (ucm.blend.ops, chunks,
engine): each test pins a bug found by feeding the features what a careless or hostile caller
would."""
import math
import os
import re

import numpy as np
import pytest
import torch

import ucm.compress as C
from equivalence import runnable, tensor_impls
from fifo import returns_within
from ucm.blend import chunks, ops
from ucm.codecs import offsets

pytest.importorskip("numba")

BACKENDS = ("reference", "numba")


def _rows(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().view(torch.uint8).reshape(x.shape[0], -1)


# ---------------------------------------------------------------------------------------------
# compression: the spec's parameters


@pytest.mark.parametrize("kw,key", [({"bits": 8.0}, "bits"), ({"bits": 4, "group": 32.0}, "group"),
                                    ({"bits": 4.0}, "bits"), ({"bits": 4, "group": True}, "group")])
def test_codec_spec_refuses_non_int_bits_and_group(kw, key):
    """bits=8.0 / group=32.0 passed ``in (4, 8)``: group 32.0 then made encoded_bytes a float
    (1664.0) and a digest unlike group=32's."""
    with pytest.raises(ValueError, match=rf"compression\.{key}: one of"):
        C.CodecSpec(**kw)


def test_codec_spec_takes_numpy_ints_as_ints():
    """np.int64 passed the checks, then digest() raised 'Object of type int64 is not JSON
    serializable' (the store names blocks by it)."""
    a = C.CodecSpec(bits=np.int64(4), group=np.int64(32))
    b = C.CodecSpec(bits=4, group=32)
    assert a.digest() == b.digest() and a == b
    shape = C.KVShape("kthd", 8, 2, 64, "bfloat16")
    assert type(C.encoded_bytes(a, shape)) is int


# ---------------------------------------------------------------------------------------------
# compression: the layer argument


def _learned(layers=2, heads=2, d=64):
    rng = np.random.default_rng(0)
    return C.fit_projection([rng.standard_normal((16, 2, heads, d)) for _ in range(layers)])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("layer", [True, 0.5, 1.9, "0", -1, None])
def test_encode_and_decode_want_a_non_negative_int_layer(backend, layer):
    """layer True ran layer 1's projection, 0.5 / 1.9 / "0" were truncated by int() (a float
    layer silently used another layer's projection), -1 and None were accepted or failed
    inside int()."""
    spec = C.CodecSpec("learned", ratio=0.25, projection=_learned())
    shape = C.KVShape("kthd", 8, 2, 64, "bfloat16")
    src = torch.zeros(1, shape.raw_bytes, dtype=torch.uint8)
    enc = torch.zeros(1, C.encoded_bytes(spec, shape), dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"layer: expected an int >= 0"):
        C.encode(spec, shape, src, enc, layer, backend=backend)
    with pytest.raises(ValueError, match=r"layer: expected an int >= 0"):
        C.decode(spec, shape, enc, src, layer, backend=backend)
    # a numpy integer is an int
    assert C.encode(spec, shape, src, enc, np.int64(1), backend=backend).all()


# ---------------------------------------------------------------------------------------------
# compression: a damaged sparse shard


@pytest.mark.parametrize("backend", BACKENDS)
def test_sparse_shard_with_a_damaged_bitmap_is_a_clear_error_in_every_implementation(backend):
    """The reference raised torch's 'shape mismatch ... cannot be broadcast' RuntimeError where
    numba names the problem (ValueError)."""
    shape = C.KVShape("kthd", 12, 2, 32, "bfloat16")
    spec = C.CodecSpec("sparse", group=32, salient=0.25)
    g = torch.Generator().manual_seed(0)
    src = _rows(torch.randn(2, shape.raw_bytes // 2, generator=g).to(torch.bfloat16))
    enc = torch.zeros(2, C.encoded_bytes(spec, shape), dtype=torch.uint8)
    assert C.encode(spec, shape, src, enc, backend=backend).all()
    at = offsets(spec, shape)["bitmap"][0]
    for flip in (0x80, 0x02):                     # one bit more or one bit less
        bad = enc.clone()
        bad[1, at] ^= flip
        out = torch.zeros_like(src)
        with pytest.raises(ValueError, match=r"row 1: its bitmap does not mark 3 exact tokens"):
            C.decode(spec, shape, bad, out, backend=backend)


# ---------------------------------------------------------------------------------------------
# compression: finite KV at the edge of its type


def _edge(case):
    g = torch.Generator().manual_seed(1)
    sign = torch.randn(1, 2, 8, 2, 64, generator=g).sign()
    if case == "float16-max":
        return "float16", C.CodecSpec(bits=8), sign * 65504.0
    if case == "bfloat16-max":
        return "bfloat16", C.CodecSpec(bits=8), sign * torch.finfo(torch.bfloat16).max
    if case == "bfloat16-range":                  # +-2e38: max - min overflows float32
        return "bfloat16", C.CodecSpec(bits=4, group=32), sign * 2e38
    return "float32", C.CodecSpec(bits=8, key_mode="channel"), sign * 3e38


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", ["float16-max", "bfloat16-max", "bfloat16-range", "float32-range"])
def test_finite_kv_at_the_type_limit_is_refused(case, backend):
    """Finite KV near its type's largest value was encoded with ok=True and decoded to inf /
    NaN: INT8's 127 * bf16_up(max / 127) rounds past float16's 65504, and an asymmetric range
    max - min overflows float32 (scale inf, q * inf + m = NaN). Such a shard is now refused as
    a NaN one is (ucm.codecs.MAGNITUDE_LIMIT), with the same bytes in every implementation."""
    dtype, spec, x = _edge(case)
    shape = C.KVShape("kthd", 8, 2, 64, dtype)
    x = x.to(getattr(torch, dtype))
    assert torch.isfinite(x).all()
    src = _rows(x)
    enc = torch.zeros(1, C.encoded_bytes(spec, shape), dtype=torch.uint8)
    ok = C.encode(spec, shape, src, enc, backend=backend)
    assert not ok[0]
    zero = torch.zeros(1, C.encoded_bytes(spec, shape), dtype=torch.uint8)
    C.encode(spec, shape, torch.zeros_like(src), zero, backend="reference")
    assert torch.equal(enc, zero)                 # a refused shard: the all-zero shard's bytes


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("spec", [C.CodecSpec(bits=8, key_mode="token"),
                                  C.CodecSpec(bits=8, key_mode="channel"),
                                  C.CodecSpec(bits=4, group=32, key_mode="token"),
                                  C.CodecSpec(bits=4, group=64, key_mode="channel"),
                                  C.CodecSpec(method="sparse", bits=4, group=32)],
                         ids=["int8-token", "int8-channel", "int4-token", "int4-channel", "sparse"])
def test_kv_just_below_the_limit_decodes_finite_and_at_it_is_refused(spec, dtype, backend):
    """The rule's edge, both sides, in every quantizing codec: values of both signs up to just
    below MAGNITUDE_LIMIT (ranges up to twice it) encode ok and decode to finite values within
    the codec's step; one value at the limit refuses the shard."""
    from ucm.codecs import MAGNITUDE_LIMIT

    limit = MAGNITUDE_LIMIT[dtype]
    shape = C.KVShape("kthd", 16, 2, 64, dtype)
    g = torch.Generator().manual_seed(7)
    x = (torch.rand(1, 2, 16, 2, 64, generator=g) * 2 - 1) * (limit * (1 - 2 ** -8))
    x[0, 0, :, :, 0] = limit * (1 - 2 ** -8)
    x[0, 1, :, :, 1] = -limit * (1 - 2 ** -8)
    x = x.to(getattr(torch, dtype))
    enc = torch.zeros(1, C.encoded_bytes(spec, shape), dtype=torch.uint8)
    assert C.encode(spec, shape, _rows(x), enc, backend=backend)[0]
    out = torch.zeros_like(_rows(x))
    C.decode(spec, shape, enc, out, backend=backend)
    y = out.view(getattr(torch, dtype)).float().reshape(x.shape)
    assert torch.isfinite(y).all()
    step = (2 * limit) / (15 if spec.bits == 4 else 127)
    assert (y - x.float()).abs().max() <= step
    x[0, 1, 15, 1, 63] = -limit
    assert not C.encode(spec, shape, _rows(x), enc, backend=backend)[0]


@pytest.mark.parametrize("backend", BACKENDS)
def test_learned_values_that_would_decode_past_the_type_are_refused(backend):
    """The learned codec decodes ``mean + P (x - mean)`` (P its rank-r projector): a float16
    key of +-30000 along a row of P decoded to inf while encode said ok. Its refusal limit now
    comes from the projection (ucm.codecs.magnitude_limit: a power of two, 8192 here), and
    whatever it stores decodes finite."""
    from ucm.codecs import magnitude_limit

    proj = _learned(layers=1)
    spec = C.CodecSpec("learned", ratio=0.5, projection=proj)
    shape = C.KVShape("kthd", 16, 2, 64, "float16")
    lim = magnitude_limit(spec, shape, 0)
    assert lim < 2 ** 15 and math.log2(lim).is_integer()
    b = proj.bases[0][..., :32].astype(np.float64)
    row = np.sign(np.einsum("hdr,her->hde", b[0], b[0])[0, 0])     # the worst row's signs
    for val, stored in ((30000.0, False), (lim * (1 - 2 ** -8), True), (lim, False)):
        x = torch.zeros(1, 2, 16, 2, 64)
        x[0, 0, :, 0] = torch.as_tensor(row * val, dtype=torch.float32)
        src = _rows(x.to(torch.float16))
        enc = torch.zeros(1, C.encoded_bytes(spec, shape), dtype=torch.uint8)
        assert bool(C.encode(spec, shape, src, enc, backend=backend)[0]) is stored, val
        out = torch.zeros_like(src)
        C.decode(spec, shape, enc, out, backend=backend)
        assert torch.isfinite(out.view(torch.float16).float()).all(), val


# ---------------------------------------------------------------------------------------------
# blend: rope_rotate


def _freq(R):
    return (1.0 / 10000.0 ** (torch.arange(0, R, 2, dtype=torch.float64) / R)).float()


def _bits(t):
    return t.view({2: torch.int16, 4: torch.int32}[t.element_size()])


@tensor_impls("rope_rotate")
@pytest.mark.parametrize("neox", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_rope_delta_zero_is_a_bit_exact_copy_of_signed_zeros_and_infinities(impl, dtype, neox,
                                                                          monkeypatch):
    """The documented 'delta = 0 is an exact copy' failed: a * cos - b * sin with cos 1, sin 0
    turned a (-0, -0) pair's first channel into +0 and an inf's partner into NaN."""
    backend, dev = runnable("rope_rotate", impl, monkeypatch)
    x = torch.zeros(3, 2, 8, dtype=dtype)
    x[0, 0, 0], x[0, 0, 4], x[0, 0, 1] = -0.0, -0.0, -0.0   # -0 pairs (both pairings)
    x[1, 1, 2] = float("inf")
    x[1, 1, 6], x[1, 1, 3] = 1.0, 2.0
    x[2, 0, 5] = float("-inf")
    x[2, 1] = torch.arange(8, dtype=dtype)
    x = x.to(dev)
    d = torch.tensor([0, 0, 0], dtype=torch.int64, device=dev)
    y = ops.rope_rotate(x, d, _freq(8).to(dev), neox=neox, backend=backend)
    assert torch.equal(_bits(y.cpu()), _bits(x.cpu()))
    # and in place
    z = x.clone()
    ops.rope_rotate(z, d, _freq(8).to(dev), neox=neox, out=z, backend=backend)
    assert torch.equal(_bits(z.cpu()), _bits(x.cpu()))


@pytest.mark.parametrize("backend", BACKENDS)
def test_rope_out_partially_overlapping_x_is_refused(backend):
    """out overlapping x without being x (shifted by a token, or x's memory transposed) was
    accepted; numba then read keys it had already rotated (errors of ~4)."""
    g = torch.Generator().manual_seed(2)
    base = torch.randn(5, 4, 8, generator=g)
    d = torch.arange(4, dtype=torch.int64) * 7
    f = _freq(8)
    with pytest.raises(ValueError, match=r"out: overlaps x in memory"):
        ops.rope_rotate(base[0:4], d, f, out=base[1:5], backend=backend)
    sq = base[:4].clone()
    with pytest.raises(ValueError, match=r"out: overlaps x in memory"):
        ops.rope_rotate(sq, d, f, out=sq.transpose(0, 1), backend=backend)
    # still fine: in place through another view object, and interleaved views sharing nothing
    want = ops.rope_rotate(base[0:4].clone(), d, f, backend="reference")
    a = base[0:4].clone()
    ops.rope_rotate(a, d, f, out=a.view(4, 4, 8), backend=backend)
    torch.testing.assert_close(a, want, atol=1e-5, rtol=1e-5)
    inter = torch.zeros(8, 4, 8)
    inter[0::2] = base[0:4]
    ops.rope_rotate(inter[0::2], d, f, out=inter[1::2], backend=backend)
    torch.testing.assert_close(inter[1::2], want, atol=1e-5, rtol=1e-5)
    assert torch.equal(inter[0::2], base[0:4])
    # one token: strides of a size-1 dimension do not matter
    one = base[:1].clone()
    ops.rope_rotate(one, d[:1] + 3, f, out=torch.as_strided(one, (1, 4, 8), (999, 8, 1)),
                    backend=backend)


@pytest.mark.parametrize("delta", [2 ** 31 + 1, 2 ** 40, 2 ** 53 + 1, -2 ** 62, -2 ** 63])
def test_rope_shifts_past_any_context_are_refused(delta):
    """Past ~2^36 the fast paths (angle reduced modulo 2 pi in float64) and the reference (cos /
    sin of the float64 angle) disagreed: 1.5e-4 at 2^40, 0.17 at 2^53, garbage at 2^62. A shift
    is a position: |delta| <= 2^31 is the contract, and a larger one an error naming delta."""
    x = torch.randn(4, 2, 8, generator=torch.Generator().manual_seed(3))
    d = torch.zeros(4, dtype=torch.int64)
    d[2] = delta
    for backend in ("reference", "numba"):
        with pytest.raises(ValueError, match=r"delta: a shift of -?\d+ positions"):
            ops.rope_rotate(x, d, _freq(8), backend=backend)


@pytest.mark.parametrize("delta", [2 ** 31, -2 ** 31, 2 ** 31 - 12345])
def test_rope_largest_shifts_agree(delta):
    """At the contract's edge the implementations still agree (int32's whole range is in it)."""
    x = torch.randn(4, 2, 8, generator=torch.Generator().manual_seed(3))
    d = torch.full((4,), delta, dtype=torch.int64)
    want = ops.rope_rotate(x, d, _freq(8), backend="reference")
    got = ops.rope_rotate(x, d, _freq(8), backend="numba")
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    if delta >= -2 ** 31 and delta < 2 ** 31:
        got32 = ops.rope_rotate(x, d.to(torch.int32), _freq(8), backend="numba")
        torch.testing.assert_close(got32, want, atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------------------------------------
# blend: chunks and the engine


@pytest.mark.parametrize("sep", [[2 ** 63], [3, 2 ** 70], [-1]])
def test_a_separator_token_id_outside_int64_is_a_chunk_spec_error(sep):
    """A request's separator [2**63] raised OverflowError out of np.asarray: the scheduler
    catches ChunkSpecError only (ucm/integration/vllm/scheduler.py _blend_job), so one request
    could take down the scheduler's step."""
    with pytest.raises(chunks.ChunkSpecError, match=re.escape("['separator']: expected a non-empty "
                                                              "list of token ids")):
        chunks.parse_request(list(range(20)), {"ucm_blend": {"separator": sep}})


@pytest.mark.parametrize("ratio", [float("nan"), 1.5, -0.1, True, "0.5", math.inf])
def test_blend_fill_refuses_a_bad_ratio(ratio):
    """ratio NaN or 1.5 ran the full prefill without a word ('ratio < 1' is False for both)."""
    from tiny_llama import tiny_model
    from ucm.blend.engine import blend_fill
    from ucm.blend.reference import LlamaBlendModel, PagedRequestKV, chunk_kv

    model = tiny_model(scale=3.0)
    bm = LlamaBlendModel(model)
    toks = torch.randint(0, 97, (20,), generator=torch.Generator().manual_seed(3))
    stored = chunk_kv(model, toks.tolist())
    kv = PagedRequestKV(model.new_cache(4, 16), [0, 1])
    with pytest.raises(ValueError, match=r"ratio: expected a real number in \[0, 1\]"):
        blend_fill(bm, kv, toks, 0, lambda layer: stored[layer],
                   torch.ones(20, dtype=torch.bool), ratio=ratio)


# ---------------------------------------------------------------------------------------------
# compression: key rounding


def test_key_rounding_refuses_malformed_inputs():
    rng = np.random.default_rng(3)
    good = C.query_moments(rng.standard_normal((32, 6, 64)), 2)
    with pytest.raises(ValueError, match="multiple of kv_heads=4"):
        C.query_moments(rng.standard_normal((32, 6, 64)), 4)
    with pytest.raises(ValueError, match=r"\[n >= 1, Hq, D\]"):
        C.query_moments(rng.standard_normal((6, 64)), 2)
    with pytest.raises(ValueError, match=r"damp in \(0, 10\]"):
        C.fit_key_rounding([good], damp=0.0)
    with pytest.raises(ValueError, match=r"layer 1: expected finite \[H, D, D\]"):
        C.fit_key_rounding([good, good[:, :, :8]])
    nan = good.copy()
    nan[0, 1, 1] = np.nan
    with pytest.raises(ValueError, match="layer 0: expected finite"):
        C.fit_key_rounding([nan])
    with pytest.raises(ValueError, match="layer 0, head 1: zero moments"):
        C.fit_key_rounding([np.stack([good[0], np.zeros((64, 64))])])
    r = C.fit_key_rounding([good])
    with pytest.raises(ValueError, match="permutation"):
        C.KeyRounding.build(np.zeros_like(r.order), r.feedback)
    big = r.feedback.copy()
    big[0, 0, 0, 1] = 2.0 ** 30
    with pytest.raises(ValueError, match="finite and within"):
        C.KeyRounding.build(r.order, big)
    with pytest.raises(ValueError, match=r"order \[L, H, D\] and feedback \[L, H, D, D\]"):
        C.KeyRounding.build(r.order, r.feedback[..., :8])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("layer", [-1, 2, True])
def test_key_rounding_layer_out_of_range_is_refused(backend, layer):
    """A layer beyond the rounding's (or negative: numpy would have taken the last) is an error
    before any code is chosen, as for the learned codec's projection."""
    rng = np.random.default_rng(1)
    r = C.fit_key_rounding([C.query_moments(rng.standard_normal((16, 4, 64)), 2)] * 2)
    spec = C.CodecSpec(bits=4, rounding=r)
    shape = C.KVShape("kthd", 8, 2, 64, "bfloat16")
    src = torch.zeros(1, shape.raw_bytes, dtype=torch.uint8)
    enc = torch.zeros(1, C.encoded_bytes(spec, shape), dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"layer"):
        C.encode(spec, shape, src, enc, layer, backend=backend)
    assert C.encode(spec, shape, src, enc, 1, backend=backend).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_key_rounding_lowers_the_logit_error_it_was_fitted_for(backend):
    """Keys coded with a rounding fitted on queries of strongly correlated channels: the error
    of q . k for new queries of that distribution falls well below rounding to nearest's (the
    keys' own error rises: the rounding trades it), and the sink token 0 stays exact."""
    rng = np.random.default_rng(5)
    h, d, t = 2, 64, 128
    mix = rng.standard_normal((d, d)) * np.linspace(2.0, 0.05, d)[:, None]
    rounding = C.fit_key_rounding([C.query_moments(rng.standard_normal((4096, 2 * h, d)) @ mix, h)])
    shape = C.KVShape("kthd", t, h, d, "float32")
    x = torch.from_numpy(rng.standard_normal((4, 2, t, h, d)).astype(np.float32))
    raw = _rows(x)
    out = {}
    for name, spec in (("nearest", C.CodecSpec(key_mode="channel")),
                       ("rounded", C.CodecSpec(key_mode="channel", rounding=rounding))):
        enc = torch.zeros((4, C.encoded_bytes(spec, shape)), dtype=torch.uint8)
        assert C.encode(spec, shape, raw, enc, 0, backend=backend).all()
        dec = torch.zeros_like(raw)
        C.decode(spec, shape, enc, dec, 0, backend=backend)
        out[name] = dec.view(torch.float32).reshape(x.shape)
        assert torch.equal(out[name][:, :, 0], x[:, :, 0])
    q = torch.from_numpy((rng.standard_normal((512, d)) @ mix).astype(np.float32))
    err = {n: float(((torch.einsum("qd,nthd->qnth", q, y[:, 0] - x[:, 0])) ** 2).mean())
           for n, y in out.items()}
    kerr = {n: float(((y[:, 0] - x[:, 0]) ** 2).mean()) for n, y in out.items()}
    assert err["rounded"] < 0.5 * err["nearest"], err
    assert kerr["rounded"] > kerr["nearest"], kerr
    assert torch.equal(out["rounded"][:, 1], out["nearest"][:, 1])      # values untouched


def _moments(seed=3, h=2, d=8):
    return C.query_moments(np.random.default_rng(seed).standard_normal((32, 2 * h, d)), h)


@pytest.mark.parametrize("damp", ["0.1", None, [0.1], True, 1j])
def test_fit_key_rounding_refuses_damp_that_is_not_a_real_number(damp):
    """damp "0.1", None, [0.1] or 1j raised TypeError from inside the fit ("can't multiply
    sequence by non-int"); True was taken as 1.0."""
    with pytest.raises(ValueError, match=r"fit_key_rounding: damp in \(0, 10\] \(a real number\)"):
        C.fit_key_rounding([_moments()], damp=damp)


@pytest.mark.parametrize("moments,match", [
    (None, "moments: a sequence over layers"), (np.array(1.0), "moments: a sequence over layers"),
    ([], "moments: a sequence over layers"),
    ([np.zeros((2, 0, 0))], r"layer 0: expected finite \[H, D, D\] with H, D >= 1"),
    ([np.zeros((0, 8, 8))], r"layer 0: expected finite \[H, D, D\] with H, D >= 1"),
    ([_moments(), _moments()[:1]], r"layer 1: \[1, 8, 8\], layer 0 has \[2, 8, 8\]"),
])
def test_fit_key_rounding_refuses_malformed_moment_lists(moments, match):
    """None or a 0-d array: TypeError; []: numpy's 'need at least one array to stack'; D = 0:
    ZeroDivisionError; H = 0: a rounding for no heads, silently; layers of unlike shapes:
    numpy's 'all input arrays must have the same shape'."""
    with pytest.raises(ValueError, match=f"fit_key_rounding: {match}"):
        C.fit_key_rounding(moments)


def test_fit_key_rounding_does_not_depend_on_the_moments_scale():
    """The feedback is scale-free (the damping is relative), but moments of subnormal or
    near-overflow size were refused as 'feedback must be finite and within ...'."""
    m = _moments()
    want = C.fit_key_rounding([m])
    assert C.fit_key_rounding([m * 2.0 ** 1000]).digest == want.digest
    assert C.fit_key_rounding([m * 2.0 ** -1000]).digest == want.digest
    for scaled in (m * 1e-310, m / np.abs(m).max() * 1.7e308):
        r = C.fit_key_rounding([scaled])
        assert (r.order == want.order).all()
        assert np.allclose(r.feedback, want.feedback, rtol=1e-4, atol=1e-5)


def test_fit_key_rounding_names_moments_that_are_not_positive_semidefinite():
    """Second moments are positive semi-definite; an indefinite matrix raised numpy's 'Matrix
    is not positive definite' (no layer, no head) or was called 'zero moments', a singular one
    with a damp too small to matter numpy's 'Singular matrix'."""
    bad = _moments()
    bad[1, 0, 0] = -0.5 * np.trace(bad[1])
    with pytest.raises(ValueError, match="layer 0, head 1: not positive semi-definite"):
        C.fit_key_rounding([bad])
    with pytest.raises(ValueError, match="layer 0, head 0: not positive semi-definite"):
        C.fit_key_rounding([-_moments()])
    with pytest.raises(ValueError, match="layer 0, head 0: singular with damp 1e-300"):
        C.fit_key_rounding([np.ones((1, 8, 8))], damp=1e-300)      # (was numpy's LinAlgError)
    # float32 moments of fewer queries than channels: rounding leaves eigenvalues of about
    # -1e-7 of the largest, which are no reason to refuse them
    q = torch.randn(8, 3, 128, generator=torch.Generator().manual_seed(0)).reshape(-1, 128)
    C.fit_key_rounding([(q.T @ q / len(q)).numpy()[None]])


@pytest.mark.parametrize("kv_heads", ["2", 2.0, None, True])
def test_query_moments_refuses_kv_heads_that_is_not_an_int(kv_heads):
    """A str, float or None raised TypeError from a comparison or numpy's reshape."""
    with pytest.raises(ValueError, match=r"query_moments: kv_heads: an int >= 1"):
        C.query_moments(np.ones((4, 4, 8)), kv_heads)


@pytest.mark.parametrize("shape", [(4, 0, 8), (4, 4, 0)])
def test_query_moments_refuses_queries_without_heads_or_channels(shape):
    """No query heads gave NaN moments (0 / 0) without a word; no channels, numpy's 'cannot
    reshape array of size 0'."""
    with pytest.raises(ValueError, match=r"query_moments: expected \[n >= 1, Hq, D\]"):
        C.query_moments(np.ones(shape), 2)


def test_query_moments_takes_bfloat16_tensors():
    """Queries as a model computes them (a bfloat16 tensor): 'Got unsupported ScalarType
    BFloat16' from numpy's conversion."""
    q = torch.randn(8, 4, 16).bfloat16()
    assert np.array_equal(C.query_moments(q, 2), C.query_moments(q.float().numpy(), 2))


@pytest.mark.parametrize("order,feedback,match", [
    (np.zeros((0, 2, 8), int), np.zeros((0, 2, 8, 8)), r"L, H, D >= 1"),
    (np.zeros((1, 0, 8), int), np.zeros((1, 0, 8, 8)), r"L, H, D >= 1"),
    (np.zeros((1, 2, 0), int), np.zeros((1, 2, 0, 0)), r"L, H, D >= 1"),
    (None, None, r"order: integer"),
    (np.tile(np.arange(8), (1, 2, 1)), np.zeros((1, 2, 8, 8), complex), r"feedback: real"),
])
def test_key_rounding_build_refuses_empty_or_non_numeric_arrays(order, feedback, match):
    """Empty roundings (no layers, heads or channels) were built and saved, then failed only
    where a store checked its shape; None: TypeError; complex feedback lost its imaginary part
    with a warning."""
    with pytest.raises(ValueError, match=f"key rounding: .*{match}"):
        C.KeyRounding.build(order, feedback)


def test_fitted_objects_copy_the_callers_arrays():
    """KeyRounding.build and Projection.build kept the caller's arrays: writing to them
    afterwards changed the rounding or projection under a digest that no longer described it."""
    r = C.fit_key_rounding([_moments()])
    order, feedback = r.order.copy(), r.feedback.copy()
    built = C.KeyRounding.build(order, feedback)
    feedback[:] = 0
    order[:] = order[..., ::-1].copy()
    assert np.array_equal(built.feedback, r.feedback) and np.array_equal(built.order, r.order)
    assert C.KeyRounding.build(built.order, built.feedback).digest == built.digest == r.digest
    means = np.zeros((1, 2, 2, 8), np.float32)
    bases = np.tile(np.eye(8, 4, dtype=np.float32), (1, 2, 2, 1, 1))
    p = C.Projection.build(means, bases)
    means += 1
    bases[:] = 0
    assert not p.means.any() and p.bases.any()
    assert C.Projection.build(p.means, p.bases).digest == p.digest


def _npz_member(shape, dtype, payload):
    import io
    from numpy.lib import format as npformat

    b = io.BytesIO()
    npformat.write_array_header_1_0(b, {"descr": np.dtype(dtype).str, "fortran_order": False,
                                        "shape": shape})
    return b.getvalue() + payload


@pytest.mark.parametrize("cls,key", [(C.KeyRounding, "compression.key_rounding"),
                                     (C.Projection, "compression.projection")])
def test_fitted_file_that_is_npy_or_claims_huge_arrays(tmp_path, cls, key):
    """A .npy file (np.load returns an array): TypeError 'does not support the context manager
    protocol'; an archive whose array header claims 8 TiB: MemoryError."""
    import zipfile

    npy = tmp_path / "a.npz"
    with open(npy, "wb") as f:
        np.save(f, np.zeros(3))
    with pytest.raises(ValueError, match=f"config key '{key}': cannot read .*not an .npz"):
        cls.load(str(npy))
    bomb = tmp_path / "b.npz"
    with zipfile.ZipFile(bomb, "w") as z:
        for name in ("order", "feedback", "means", "bases"):
            z.writestr(f"{name}.npy", _npz_member((2 ** 40,), "<f4", bytes(64)))
        z.writestr("digest.npy", _npz_member((), "<U1", b"a\0\0\0"))
    with pytest.raises(ValueError, match=f"config key '{key}': cannot read"):
        cls.load(str(bomb))


def test_fitted_file_save_leaves_nothing_behind_on_failure(tmp_path):
    """Saving over a directory raised IsADirectoryError and left '<path>.tmp<pid>' beside it."""
    r = C.fit_key_rounding([_moments()])
    (tmp_path / "d").mkdir()
    with pytest.raises(OSError):
        r.save(str(tmp_path / "d"))
    assert sorted(os.listdir(tmp_path)) == ["d"]


def test_fitted_file_saved_by_two_threads_at_once(tmp_path):
    """Threads of one process shared the temporary name '<path>.tmp<pid>': one thread's
    rename took the other's file mid-write, whose own rename then failed (FileNotFoundError)."""
    import threading

    rs = [C.fit_key_rounding([_moments()], damp=x) for x in (0.1, 0.2)]
    path, errors = str(tmp_path / "kr.npz"), []

    def save(r):
        for _ in range(150):
            try:
                r.save(path)
            except OSError as exc:
                errors.append(exc)
    threads = [threading.Thread(target=save, args=(r,)) for r in rs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert C.KeyRounding.load(path).digest in {r.digest for r in rs}
    assert os.listdir(tmp_path) == ["kr.npz"]


@pytest.mark.parametrize("which", ["src", "dst"])
def test_encode_names_reversed_numpy_rows(which):
    """numpy rows with a negative stride (a reversed view) raised torch's 'At least one
    stride in the given numpy array is negative', naming neither src nor dst."""
    spec, shape = C.CodecSpec(bits=4), C.KVShape("kthd", 8, 2, 64, "float32")
    src = np.zeros((3, shape.raw_bytes), np.uint8)
    dst = np.zeros((3, C.encoded_bytes(spec, shape)), np.uint8)
    args = (src[::-1], dst) if which == "src" else (src, dst[::-1])
    with pytest.raises(ValueError, match=f"{which}: .*negative stride"):
        C.encode(spec, shape, *args)


@pytest.mark.parametrize("cls,key", [(C.KeyRounding, "compression.key_rounding"),
                                     (C.Projection, "compression.projection")])
def test_fitted_file_that_is_a_fifo_or_a_device(tmp_path, cls, key):
    """A FIFO as the fitted file blocked the load forever (np.load opens it for reading and
    waits for a writer); a character device such as /dev/zero is not a file either. Both are
    refused at once, as is a symlink to one."""
    fifo = str(tmp_path / "f.npz")
    os.mkfifo(fifo)
    ok, box = returns_within(lambda: cls.load(fifo), fifo)
    assert ok, "loading a FIFO blocked"
    assert isinstance(box.get("error"), ValueError)
    assert re.search(f"config key '{key}'.*not a regular file", str(box["error"]))
    link = tmp_path / "zero.npz"
    link.symlink_to("/dev/zero")
    with pytest.raises(ValueError, match=f"config key '{key}'.*not a regular file"):
        cls.load(str(link))
