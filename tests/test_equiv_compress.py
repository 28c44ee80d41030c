"""KV codecs (ucm.compress encode / decode), every registered implementation against the reference
(tests/equivalence.py): every method (INT8 with keys per channel and per token; INT4 with keys per channel and per token, groups 32
and 64; sparse; learned) x cache dtype (float16, bfloat16, float32) x memory order ("hktd",
"kthd"; the other orders once) x odd sizes (tokens 1, 7, 16, 128; heads 1, 3, 8; head_dim 64
and 128), on rows of random and edge values (NaN and infinities: ok False, the other rows
unaffected; constant rows: scale 0; zeros of both signs; 1e30, 1e-30 and subnormals; outlier
channels and tokens; tied token scores; exact halves), contiguous and with a row stride larger
than the row (elements aligned or not).

Integer formats (INT8, INT4, sparse) must match byte for byte: every encoded byte of an ok row
(padding included) and every decoded byte; the learned codec's coefficients and decoded values
within the tolerance of float32 sums in another order. The buffers the ops write start as a
sentinel, so a byte not written, or written outside the rows, shows. Also: the ops' validation
errors, the reference's rule for zero extremes, and that a deliberately wrong implementation is
caught by these comparisons."""
import dataclasses
import importlib.util
import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import ucm.reference.compress as ref  # noqa: E402
from ucm import compress, dispatch  # noqa: E402
from ucm.codecs import (MAGNITUDE_LIMIT, CodecSpec, KVShape, encoded_bytes,  # noqa: E402
                        fit_key_rounding, fit_projection, n_salient, offsets, query_moments)
from equivalence import assert_equivalent, compare, implementation_params, runnable  # noqa: E402

TORCH = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
NUMPY = {"float16": np.float16, "float32": np.float32}
DTYPES = ["float16", "bfloat16", "float32"]
ORDERS = ["hktd", "kthd"]
SENTINEL = 0xA5
SEG_SIZE = {"uint8": 1, "int8": 1, "bfloat16": 2, "float16": 2, "float32": 4}

# (tokens, heads, head_dim): every token count with a few head counts, both head dims
SHAPES = [(1, 1, 64), (7, 3, 64), (16, 8, 128), (128, 3, 64), (7, 1, 128), (16, 3, 64),
          (128, 1, 128)]
SPECS = ["int8-channel", "int8-token", "int8-auto", "int8-channel-rounded", "int4-channel-g32",
         "int4-channel-g64", "int4-channel-g32-rounded", "int4-token-g32", "int4-token-g64",
         "sparse-channel-g32", "sparse-channel-g64-rounded", "sparse-token-g64", "learned"]


def make_spec(name, projection=None, rounding=None):
    if name.endswith("-rounded"):       # keys per channel coded by a key rounding
        return dataclasses.replace(make_spec(name[:-len("-rounded")]), rounding=rounding)
    method, _, rest = name.partition("-")
    if method == "int8":
        return CodecSpec("quantize", bits=8, key_mode=rest or "channel")
    if method == "learned":
        return CodecSpec("learned", ratio=0.25, projection=projection)
    key_mode, group = rest.split("-g")
    return CodecSpec("quantize" if method == "int4" else "sparse", bits=4, group=int(group),
                     key_mode=key_mode)


def _sample(device):
    return (None, None, torch.empty(0, device=device))


def impls(op):
    """The CPU implementations (reference, numba). The Triton codecs are pinned to the
    reference by tests/test_compress_triton.py: natively on CUDA for every case, and under the
    interpreter for a subset (every case here interpreted would take CI minutes)."""
    return pytest.mark.parametrize("impl", [p for p in implementation_params(op, _sample)
                                            if not p.values[0][2]])


def backend_of(op, impl, monkeypatch):
    """runnable(), and a skip for an implementation whose module is not written yet."""
    name, device = runnable(op, impl, monkeypatch)
    [entry] = [i for i in dispatch.implementations(op) if i.name == name]
    module = entry.target.partition(":")[0]
    if importlib.util.find_spec(module) is None:
        pytest.skip(f"{op}: implementation {name!r}: {module} is not written yet")
    return name, device


# ---------------------------------------------------------------------------------------------
# inputs

def kv_rows(rng, dtype, t, h, d):
    """float32 ``[n, 2, T, H, D]`` (keys, values): random and edge rows, finite in ``dtype``
    except where a row is meant to hold a NaN or an infinity (rows 4, 5, 6, 10); row 15 reaches
    just below the magnitude limit (``ucm.codecs.MAGNITUDE_LIMIT``: stored), row 16 holds one
    value at it (refused)."""
    big = 2e4 if dtype == "float16" else 1e30
    tiny = 1e-3 if dtype == "float16" else 1e-30
    sub = 3e-6 if dtype == "float16" else 1e-40          # subnormal in the cache's type

    def normal(scale=1.0):
        return rng.standard_normal((2, t, h, d)).astype(np.float32) * np.float32(scale)
    rows = [normal(2.0)]
    x = normal()                                          # outlier key channels and a token
    x[0, :, :, 3] *= 50
    x[0, :, :, d - 1] -= 30
    x[:, t // 2] *= 20
    rows.append(x)
    rows.append(np.full((2, t, h, d), 0.75, np.float32))  # constant: INT4 scales 0
    x = np.zeros((2, t, h, d), np.float32)                # zeros, some -0: every scale 0
    x[rng.random(x.shape) < 0.3] = -0.0
    rows.append(x)
    x = normal()
    x[1, t - 1, h - 1, d // 2] = np.nan
    rows.append(x)
    x = normal()
    x[0, 0, 0, 0] = np.inf
    rows.append(x)
    x = normal()
    x[1, 0, h // 2, 1] = -np.inf
    rows.append(x)
    rows.append(np.clip(normal(big), -3.2e4, 3.2e4) if dtype == "float16" else normal(big))
    rows.append(normal(tiny))
    rows.append(normal(sub))
    x = normal()                                          # NaN in the values of the most
    x[0, t // 3] *= 1000                                  # salient token only
    x[1, t // 3, 0, 0] = np.nan
    rows.append(x)
    x = np.sign(normal())                                 # +-1: every token's score ties
    x[x == 0] = 1
    x[:, :, :, 1::3] *= 0.5
    rows.append(x)
    x = normal()                                          # zeros of both signs as extremes
    x[0, :, 0, :8] = 0.0
    x[0, : t // 2 + 1, 0, :8] = -0.0
    x[1, :, :, : d // 2] = np.abs(x[1, :, :, : d // 2])
    x[1, 0, :, :4] = -0.0
    rows.append(x)
    # exact halves of q (round half to even): INT8, max |x| 127 (scale 1), the others k + 1/2;
    # INT4, every group and channel from 0 to 15 (scale 1), the others k + 1/2
    halves = rng.integers(-126, 126, (2, t, h, d)) + 0.5
    halves[..., 0] = 127.0
    rows.append(halves.astype(np.float32))
    halves = rng.integers(0, 15, (2, t, h, d)) + 0.5
    halves[:, 0] = 0.0
    halves[:, min(1, t - 1)] = 15.0
    halves[..., 0::32] = 0.0
    halves[..., 1::32] = 15.0
    rows.append(halves.astype(np.float32))
    limit = MAGNITUDE_LIMIT[dtype]
    below = np.float32(limit * (1 - 2 ** -8))             # representable in every type
    x = np.clip(normal(limit / 4), -below, below)         # both signs: ranges up to 2 x below
    x[0, :, :, 0] = below
    x[1, :, :, 1] = -below
    rows.append(x)
    x = normal()
    x[0, t - 1, h - 1, d - 1] = np.float32(limit)
    rows.append(x)
    return np.stack(rows)


NOT_OK = [4, 5, 6, 10, 16]
# rows of normal magnitudes for the learned codec (its tolerance is relative to them)
LEARNED_ROWS, LEARNED_NOT_OK = [0, 2, 3, 4, 5, 6, 10, 11, 12], [3, 4, 5, 6]


def raw_rows(x, shape):
    """float32 canonical ``[n, 2, T, H, D]`` -> uint8 ``[n, raw_bytes]`` in ``shape.order``,
    rounded to the cache's type."""
    y = torch.from_numpy(x).to(TORCH[shape.dtype])
    y = y.permute([0] + [1 + "kthd".index(c) for c in shape.order]).contiguous()
    if shape.key_order == "dt":           # key planes channel-major ("hktd": [n, H, 2, T, D])
        assert shape.order == "hktd"
        y = y.clone()                     # (contiguous() may have returned x's own memory)
        y[:, :, 0] = y[:, :, 0].transpose(-1, -2).reshape(y[:, :, 0].shape).clone()
    return y.view(torch.uint8).reshape(x.shape[0], shape.raw_bytes)


def buffer(n, width, layout, rows=None):
    """``(whole, view)``: ``view`` uint8 ``[n, width]`` rows in a buffer of ``layout``:
    "contiguous"; "strided": 8 bytes into rows of width + 24; "unaligned": 1 byte into rows of
    width + 13 (elements not aligned, row stride not a multiple of the element size). Every byte
    is the sentinel, the rows ``rows`` when given."""
    pad, at = {"contiguous": (0, 0), "strided": (24, 8), "unaligned": (13, 1)}[layout]
    whole = torch.full((n, width + pad), SENTINEL, dtype=torch.uint8)
    view = whole[:, at:at + width]
    if rows is not None:
        view.copy_(rows)
    return whole, view


class Written:
    """What an op left in a buffer: its rows and the bytes around them."""

    def __init__(self, whole, view):
        self.rows = view.numpy().copy()
        at = view.data_ptr() - whole.data_ptr()
        keep = np.ones(whole.shape, dtype=bool)
        keep[:, at:at + view.shape[1]] = False
        self.outside = whole.numpy()[keep].copy()


def projection(rng, h, d, layers=2):
    """A projection fitted on synthetic KV whose channels have different scales."""
    scale = (1 + np.arange(d)) / d
    return fit_projection([rng.standard_normal((256, 2, h, d)) * scale for _ in range(layers)])


def rounding(rng, h, d, layers=2):
    """A key rounding fitted on synthetic queries with correlated channels of different
    scales (3 query heads per KV head)."""
    mix = rng.standard_normal((d, d)) / np.sqrt(d) + np.diag((1 + np.arange(d)) / d)
    return fit_key_rounding([query_moments(rng.standard_normal((64, 3 * h, d)) @ mix, h)
                             for _ in range(layers)])


def specs_for(name, rng, h, d):
    """``make_spec(name)`` with a projection or rounding fitted for ``h`` x ``d`` when it needs
    one."""
    return make_spec(name, projection(rng, h, d) if name == "learned" else None,
                     rounding(rng, h, d) if name.endswith("-rounded") else None)


def not_ok(name, dtype):
    """The rows of :func:`kv_rows` that ``encode`` refuses: with a key rounding also those past
    ``ROUNDING_LIMIT`` (rows 7 and 15, outside float16)."""
    if name == "learned":
        return LEARNED_NOT_OK
    if name.endswith("-rounded") and dtype != "float16":
        return sorted(NOT_OK + [7, 15])
    return NOT_OK


# ---------------------------------------------------------------------------------------------
# comparisons

def segment(rows, spec, shape, name):
    """Segment ``name`` of encoded rows ``[n, bytes]`` as numpy ``[n, *shape]`` (bfloat16 as
    float32)."""
    at, dt, shp = offsets(spec, shape)[name]
    b = np.ascontiguousarray(rows[:, at:at + math.prod(shp) * SEG_SIZE[dt]])
    if dt == "bfloat16":
        return (b.view(np.uint16).astype(np.uint32) << 16).view(np.float32).reshape(
            (len(b),) + tuple(shp))
    return b.view({"uint8": np.uint8, "int8": np.int8, "float16": np.float16,
                   "float32": np.float32}[dt]).reshape((len(b),) + tuple(shp))


def check_encoded(spec, shape):
    """got / want = (ok, Written): ok flags equal; ok rows byte for byte (learned: coefficients
    within tolerance, padding exact); nothing written outside the rows."""
    def check(got, want):
        (g_ok, g), (w_ok, w) = got, want
        assert_equivalent("encode", g_ok, w_ok, np.bool_, " ok")
        if spec.method == "learned":
            assert_equivalent("encode", segment(g.rows, spec, shape, "coef")[w_ok],
                              segment(w.rows, spec, shape, "coef")[w_ok], "bfloat16",
                              " coef (ok rows)")
            at, _, shp = offsets(spec, shape)["coef"]
            end = at + 2 * math.prod(shp)
            assert_equivalent("encode", g.rows[w_ok, end:], w.rows[w_ok, end:], np.uint8,
                              " padding (ok rows)")
        else:
            assert_equivalent("encode", g.rows[w_ok], w.rows[w_ok], np.uint8, " (ok rows)")
        assert_equivalent("encode", g.outside, w.outside, np.uint8, " outside the rows")
    return check


def check_decoded(spec, shape):
    """Every decoded byte (learned: values within tolerance); nothing written outside."""
    def check(got, want):
        if spec.method == "learned":
            as_float = (lambda r: torch.from_numpy(np.ascontiguousarray(r)).view(
                TORCH[shape.dtype]).float().numpy())
            assert_equivalent("decode", as_float(got.rows), as_float(want.rows), shape.dtype)
        else:
            assert_equivalent("decode", got.rows, want.rows, np.uint8)
        assert_equivalent("decode", got.outside, want.outside, np.uint8, " outside the rows")
    return check


def run_encode(spec, shape, raw, layer=1, src_layout="contiguous", dst_layout="contiguous"):
    _, src = buffer(raw.shape[0], raw.shape[1], src_layout, raw)

    def run(backend):
        whole, dst = buffer(raw.shape[0], encoded_bytes(spec, shape), dst_layout)
        ok = compress.encode(spec, shape, src, dst, layer, backend=backend)
        assert isinstance(ok, np.ndarray) and ok.dtype == np.bool_ and ok.shape == (len(raw),)
        return ok, Written(whole, dst)
    return run


def run_decode(spec, shape, enc, layer=1, src_layout="contiguous", dst_layout="contiguous"):
    _, src = buffer(enc.shape[0], enc.shape[1], src_layout, enc)

    def run(backend):
        whole, dst = buffer(enc.shape[0], shape.raw_bytes, dst_layout)
        assert compress.decode(spec, shape, src, dst, layer, backend=backend) is None
        return Written(whole, dst)
    return run


def round_trip(backend, spec, shape, raw, layer=1, layouts=("contiguous", "contiguous")):
    """Encode ``raw`` with the reference and ``backend`` and compare; decode the reference's
    encoding with both and compare. Returns the reference's ok flags."""
    ok, enc = compare("encode", run_encode(spec, shape, raw, layer, *layouts), backend, None,
                      check_encoded(spec, shape))
    compare("decode", run_decode(spec, shape, torch.from_numpy(enc.rows), layer, *layouts[::-1]),
            backend, None, check_decoded(spec, shape))
    return ok


def fits(spec, shape):
    try:
        spec.check(shape)
        return True
    except ValueError:
        return False


# ---------------------------------------------------------------------------------------------
# every method x dtype x order x shape

@impls("encode")
@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", SPECS)
def test_codec(impl, name, dtype, order, monkeypatch):
    backend, _ = backend_of("encode", impl, monkeypatch)
    rng = np.random.default_rng(18)
    ran = 0
    for t, h, d in SHAPES:
        spec = specs_for(name, rng, h, d)
        shape = KVShape(order, t, h, d, dtype)
        if not fits(spec, shape):                         # sparse or channel keys of one token
            continue
        x = kv_rows(rng, dtype, t, h, d)
        if name == "learned":
            x = x[LEARNED_ROWS]
        ok = round_trip(backend, spec, shape, raw_rows(x, shape))
        assert np.flatnonzero(~ok).tolist() == not_ok(name, dtype)
        ran += 1
    assert ran >= len(SHAPES) - 1


@impls("encode")
@pytest.mark.parametrize("name,dtype", [("int8-channel", "float32"), ("int8-token", "bfloat16"),
                                        ("int8-auto", "bfloat16"), ("int8-channel", "float16"),
                                        ("int4-channel-g64", "float16"),
                                        ("int4-token-g32", "float32"),
                                        ("sparse-channel-g32", "bfloat16"), ("learned", "float32"),
                                        ("int8-channel-rounded", "bfloat16"),
                                        ("sparse-channel-g64-rounded", "float32")])
def test_channel_major_keys(impl, name, dtype, monkeypatch):
    """vLLM-CPU's layout (key planes [D, T]): every implementation encodes it to the bytes of
    the same KV stored token-major, and decodes back to channel-major planes."""
    backend, _ = backend_of("encode", impl, monkeypatch)
    rng = np.random.default_rng(7)
    for t, h, d in [(16, 3, 64), (128, 1, 128), (7, 2, 64)]:
        spec = specs_for(name, rng, h, d)
        shape = KVShape("hktd", t, h, d, dtype, key_order="dt")
        if not fits(spec, shape):
            continue
        x = kv_rows(rng, dtype, t, h, d)
        ok = round_trip(backend, spec, shape, raw_rows(x, shape))
        # the encoding is the token-major one's (the reference's, compared byte for byte above)
        tm = shape.with_token_major_keys()
        a = torch.zeros((len(x), encoded_bytes(spec, shape)), dtype=torch.uint8)
        b = torch.zeros_like(a)
        compress.encode(spec, shape, raw_rows(x, shape), a, 1, backend=backend)
        compress.encode(spec, tm, raw_rows(x, tm), b, 1, backend="reference")
        if spec.method == "learned":
            assert np.allclose(segment(a.numpy()[ok], spec, shape, "coef"),
                               segment(b.numpy()[ok], spec, shape, "coef"), rtol=1e-2, atol=1e-2)
        else:
            assert torch.equal(a[torch.from_numpy(ok)], b[torch.from_numpy(ok)])


def _caches(kind, dtype, t, h, d, blocks=5, layers=3):
    """A paged cache of ``layers`` layers filled with a sentinel, its layout and KVShape:
    ``cpu``: vLLM-CPU's (a tensor ``[B, H, T, 2D]`` per layer, key planes channel-major: a
    block of a layer is one run); ``packed``: the same blocks in one allocation
    ``[B, layers, H, T, 2D]`` (a layer's view strided over the others); ``cuda``: the
    FlashAttention layout ``[2, B, T, H, D]`` per layer (a layer's block is two runs)."""
    from ucm.layout import KVLayout

    tt = TORCH[dtype]
    if kind == "cpu":
        ts = [torch.empty((blocks, h, t, 2 * d), dtype=tt) for _ in range(layers)]
        views, of = ts, None
    elif kind == "packed":
        ts = [torch.empty((blocks, layers, h, t, 2 * d), dtype=tt)]
        views, of = [ts[0][:, k] for k in range(layers)], None
    else:
        ts = [torch.empty((2, blocks, t, h, d), dtype=tt) for _ in range(layers)]
        views = [v for c in ts for v in c.unbind(0)]
        of = [k for k in range(layers) for _ in range(2)]
    for c in ts:
        c.view(torch.uint8).fill_(SENTINEL)
    shape = KVShape("kthd", t, h, d, dtype) if kind == "cuda" else \
        KVShape("hktd", t, h, d, dtype, key_order="dt")
    return ts, KVLayout.from_views(views, of), shape


@pytest.mark.parametrize("name,dtype,kind", [
    ("int8-token", "float32", "cpu"), ("int8-channel", "bfloat16", "packed"),
    ("int8-token", "float16", "cuda"), ("int4-channel-g32", "float16", "cpu"),
    ("int4-token-g64", "float32", "packed"), ("sparse-channel-g32", "bfloat16", "cpu"),
    ("sparse-token-g32", "float32", "cuda"), ("learned", "float32", "cpu")])
def test_decode_scatter(name, dtype, kind, monkeypatch):
    """The numba decode_scatter (straight into the cache's blocks where a layer's block is one
    run, through a staging row elsewhere) writes the reference's bytes into the same blocks and
    nothing else: rows of -1 skipped, blocks in any order, a subset of the layers in any order."""
    backend, _ = backend_of("decode_scatter", ("numba", "cpu", False), monkeypatch)
    rng = np.random.default_rng(11)
    t, h, d = (16, 3, 64) if name != "learned" else (16, 2, 64)
    proj = projection(rng, h, d, layers=3) if name == "learned" else None
    spec = make_spec(name, proj)
    _, _, shape = _caches(kind, dtype, t, h, d)
    E = encoded_bytes(spec, shape)
    layers = (2, 0)
    x = kv_rows(rng, dtype, t, h, d)[[0, 1, 2, 3, 8, 9, 11, 12]]  # finite rows
    if name == "learned":
        x = x[[0, 2, 3, 5]]
    n = len(x)
    src = torch.zeros((n, len(layers) * E + 24), dtype=torch.uint8)[:, 8:8 + len(layers) * E]
    for k, layer in enumerate(layers):   # (a row stride larger than the row)
        enc = torch.empty((n, E), dtype=torch.uint8)
        assert compress.encode(spec, shape, raw_rows(x[np.roll(np.arange(n), k)], shape), enc,
                               layer, backend="reference").all()
        src[:, k * E:(k + 1) * E] = enc
    idx = torch.full((n,), -1, dtype=torch.int64)
    idx[[0, 2, 3, n - 1]] = torch.tensor([4, 0, 2, 1])
    out = {}
    for b in ("reference", backend):
        ts, layout, _ = _caches(kind, dtype, t, h, d)
        compress.decode_scatter(layout, src, idx, spec, shape, layers, backend=b)
        out[b] = [c.view(torch.uint8).clone() for c in ts]
    for want, got in zip(out["reference"], out[backend]):
        if name == "learned":   # floating point: within the codec's tolerance, sentinels equal
            same = want == got
            w, g = (v.view(TORCH[dtype]).float() for v in (want, got))
            close = torch.isclose(w, g, rtol=1e-2, atol=1e-2) | (want.view(TORCH[dtype]) ==
                                                                 got.view(TORCH[dtype]))
            assert close.all() and same.float().mean() > 0.2
        else:
            assert torch.equal(want, got)
    ts, layout, _ = _caches(kind, dtype, t, h, d)
    compress.decode_scatter(layout, src, torch.full((n,), -1, dtype=torch.int64), spec, shape,
                            layers, backend=backend)
    assert all(bool((c.view(torch.uint8) == SENTINEL).all()) for c in ts)



@pytest.mark.parametrize("name,dtype,kind", [
    ("int8-channel", "float32", "cpu"), ("int4-token-g64", "bfloat16", "packed"),
    ("sparse-channel-g32", "float32", "cuda"), ("learned", "float32", "cpu")])
@pytest.mark.parametrize("backend", ["numba", "reference"])
def test_layer_decoder_is_decode_scatter_a_layer_at_a_time(name, dtype, kind, backend,
                                                            monkeypatch):
    """``compress.layer_decoder`` (prepared once; the load thread calls it per layer) writes
    what ``decode_scatter`` of all layers writes, whatever the order of the layers, and
    nothing for rows of -1."""
    if backend == "numba":
        backend, _ = backend_of("decode_scatter", ("numba", "cpu", False), monkeypatch)
    rng = np.random.default_rng(12)
    t, h, d = (16, 3, 64) if name != "learned" else (16, 2, 64)
    spec = make_spec(name, projection(rng, h, d, layers=3) if name == "learned" else None)
    _, _, shape = _caches(kind, dtype, t, h, d)
    E = encoded_bytes(spec, shape)
    x = kv_rows(rng, dtype, t, h, d)[[0, 1, 2, 3]]
    n = len(x)
    src = torch.empty((n, 3 * E), dtype=torch.uint8)
    for k in range(3):
        assert compress.encode(spec, shape, raw_rows(x[np.roll(np.arange(n), k)], shape),
                               src[:, k * E:(k + 1) * E], k, backend="reference").all()
    idx = torch.tensor([3, -1, 0, 4])
    want, layout, _ = _caches(kind, dtype, t, h, d)
    compress.decode_scatter(layout, src, idx, spec, shape, backend="reference")
    got, layout, _ = _caches(kind, dtype, t, h, d)
    run = compress.layer_decoder(layout, src, idx, spec, shape, backend=backend)
    for k in (2, 0, 1):
        run(k)
    for w, g in zip(want, got):
        if name == "learned":
            assert torch.allclose(w.float(), g.float(), rtol=1e-2, atol=1e-2)
        else:
            assert torch.equal(w.view(torch.uint8), g.view(torch.uint8))
    with pytest.raises(ValueError, match="src"):
        compress.layer_decoder(layout, src[:, :E], idx, spec, shape)

@impls("encode")
@pytest.mark.parametrize("layouts", [("strided", "strided"), ("unaligned", "unaligned"),
                                     ("strided", "unaligned"), ("unaligned", "contiguous")],
                         ids=lambda p: f"src-{p[0]}-dst-{p[1]}")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", ["int8", "int4-channel-g32", "sparse-token-g32", "learned"])
def test_codec_row_strides(impl, name, dtype, layouts, monkeypatch):
    """Rows with a row stride larger than the row, elements aligned or not: encode reads (and
    decode writes) only the rows."""
    backend, _ = backend_of("encode", impl, monkeypatch)
    rng = np.random.default_rng(5)
    for order, (t, h, d) in (("hktd", (16, 3, 64)), ("kthd", (7, 2, 64))):
        spec = make_spec(name, projection(rng, h, d))
        shape = KVShape(order, t, h, d, dtype)
        x = kv_rows(rng, dtype, t, h, d)[[0, 4, 9, 11, 12]]
        round_trip(backend, spec, shape, raw_rows(x, shape), layouts=layouts)
        round_trip(backend, spec, shape, raw_rows(x[:1], shape), layouts=layouts)  # one row


@impls("encode")
@pytest.mark.parametrize("order", ["thkd", "tkhd", "khtd", "htkd"])
@pytest.mark.parametrize("name", ["int8", "int4-channel-g64", "int4-token-g32",
                                  "sparse-channel-g64", "learned"])
def test_codec_other_orders(impl, name, order, monkeypatch):
    backend, _ = backend_of("encode", impl, monkeypatch)
    rng = np.random.default_rng(7)
    t, h, d = 9, 2, 64
    spec = make_spec(name, projection(rng, h, d))
    for dtype in DTYPES:
        shape = KVShape(order, t, h, d, dtype)
        rows = [0, 2, 5] if name == "learned" else [0, 1, 5, 13, 14]
        round_trip(backend, spec, shape, raw_rows(kv_rows(rng, dtype, t, h, d)[rows], shape))


@impls("encode")
def test_sparse_salient_selection(impl, monkeypatch):
    """The tokens kept exact: token 0 (where a sequence's attention sink sits), then the largest
    max |K| over heads and channels, ties to the lower token, stored in ascending token order;
    salient shares up to half of the tokens."""
    backend, _ = backend_of("encode", impl, monkeypatch)
    rng = np.random.default_rng(11)
    t, h, d = 37, 3, 64
    x = rng.standard_normal((4, 2, t, h, d)).astype(np.float32)
    x[1, 0, [5, 30, 2], 1, 7] = [40.0, 40.0, -40.0]       # three-way tie at the cut
    x[2, 0] = 1.0                                         # every token ties
    x[3, 0] *= 0.1
    x[3, 0, :, 0, 0] = np.linspace(1, 5, t)               # ascending: token 0 the smallest
    for salient in (0.0625, 0.1, 0.25, 0.5):
        spec = CodecSpec("sparse", group=32, salient=salient)
        for dtype in DTYPES:
            shape = KVShape("hktd", t, h, d, dtype)
            round_trip(backend, spec, shape, raw_rows(x, shape))
    spec = CodecSpec("sparse", group=32, salient=0.0625)
    shape = KVShape("hktd", t, h, d, "float32")
    _, dst = buffer(4, encoded_bytes(spec, shape), "contiguous")
    compress.encode(spec, shape, raw_rows(x, shape), dst, backend=backend)
    bits = np.unpackbits(segment(dst.numpy(), spec, shape, "bitmap"), axis=1,
                         bitorder="little")[:, :t]
    c = n_salient(spec, shape)
    assert (bits.sum(axis=1) == c).all()
    assert np.flatnonzero(bits[1]).tolist() == [0, 2, 5]
    assert np.flatnonzero(bits[2]).tolist() == [0, 1, 2]
    assert np.flatnonzero(bits[3]).tolist() == [0, t - 2, t - 1]
    exact = segment(dst.numpy(), spec, shape, "exact")    # [n, c, 2, H, D], ascending tokens
    assert np.array_equal(exact[1], x[1].transpose(1, 0, 2, 3)[[0, 2, 5]])


# ---------------------------------------------------------------------------------------------
# a wrong implementation is caught

def _round_half_away(x):
    return torch.sign(x) * torch.floor(x.abs() + 0.5)


@pytest.mark.parametrize("name", ["int8", "int4-token-g32"])
def test_wrong_rounding_is_caught(name, monkeypatch):
    """The reference with round half away from zero instead of half to even (a plausible slip in
    a fast path) differs on these inputs, and the comparison says so."""
    rng = np.random.default_rng(3)
    t, h, d = 16, 3, 64
    spec = make_spec(name)
    shape = KVShape("hktd", t, h, d, "bfloat16")
    raw = raw_rows(kv_rows(rng, "bfloat16", t, h, d), shape)
    run = run_encode(spec, shape, raw)
    want = run("reference")
    monkeypatch.setattr(ref.torch, "round", _round_half_away, raising=True)
    got = run("reference")
    monkeypatch.undo()
    with pytest.raises(AssertionError,
                       match=r"encode\[uint8\] \(ok rows\): \d+ of \d+ elements differ"):
        check_encoded(spec, shape)(got, want)


def test_wrong_scale_rounding_is_caught(monkeypatch):
    """bf16_up rounding a scale to nearest instead of up: caught."""
    rng = np.random.default_rng(4)
    t, h, d = 16, 3, 64
    spec = make_spec("int4-channel-g64")
    shape = KVShape("kthd", t, h, d, "float32")
    raw = raw_rows(kv_rows(rng, "float32", t, h, d), shape)
    run = run_encode(spec, shape, raw)
    want = run("reference")
    monkeypatch.setattr(ref, "bf16_up", lambda x: x.to(torch.bfloat16).float())
    got = run("reference")
    monkeypatch.undo()
    with pytest.raises(AssertionError, match="elements differ"):
        check_encoded(spec, shape)(got, want)


# ---------------------------------------------------------------------------------------------
# INT8 with keys per channel: what the format promises

@pytest.mark.parametrize("backend", ["reference", "numba"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_int8_channel_keys(backend, dtype):
    """Token 0's key and value come back bit for bit, however far its key sits from the
    others, and its key stays out of the channel ranges (a huge sink key leaves the other keys'
    error as without it); every other key is within half a step of its channel's (min,
    scale), values within half their token's step."""
    rng = np.random.default_rng(11)
    t, h, d = 32, 2, 64
    spec, shape = make_spec("int8-channel"), KVShape("kthd", t, h, d, dtype)
    x = rng.standard_normal((2, 2, t, h, d)).astype(np.float32)
    x[:, 0, :, :, 5] += 40.0                                  # an offset channel (asymmetric)
    x[1, 0, 0] = 3e3 * rng.standard_normal((h, d))             # row 1: a far-off token 0 key
    x[1, 0, 1:] = x[0, 0, 1:]
    raw = raw_rows(x, shape)
    exact = torch.from_numpy(x).to(TORCH[dtype]).float().numpy()
    enc = torch.empty((2, encoded_bytes(spec, shape)), dtype=torch.uint8)
    assert compress.encode(spec, shape, raw, enc, backend=backend).all()
    out = torch.empty_like(raw)
    compress.decode(spec, shape, enc, out, backend=backend)
    y = out.view(TORCH[dtype]).float().reshape(2, 2, t, h, d).numpy()
    assert np.array_equal(y[:, :, 0], exact[:, :, 0])
    kp = segment(enc.numpy(), spec, shape, "kp")               # [n, H, D, 2]
    assert np.array_equal(kp[0], kp[1]), "token 0's key moved the channel ranges"
    assert (kp[..., 0] <= exact[:, 0, 1:].min(axis=1)).all()
    step = np.maximum(kp[..., 1][:, None], 1e-30)
    slack = np.abs(exact[:, 0, 1:]) * 2.0 ** -7 if dtype == "bfloat16" else 1e-5 * step
    assert (np.abs(y[:, 0, 1:] - exact[:, 0, 1:]) <= step / 2 + slack).all()
    vstep = np.abs(exact[:, 1]).max(axis=-1, keepdims=True) / 127
    vslack = np.abs(exact[:, 1]) * 2.0 ** -7 if dtype == "bfloat16" else 1e-5 * vstep
    assert (np.abs(y[:, 1] - exact[:, 1]) <= vstep * (1 + 2.0 ** -7) / 2 + vslack).all()
    assert np.array_equal(y[0, 0, 1:], y[1, 0, 1:])


def test_int8_auto_key_mode_follows_the_block_length():
    """``key_mode="auto"`` of INT8: keys per channel from 128-token blocks (vLLM-CPU's), per
    token below (vLLM's 16-token CUDA blocks), within 0.52 of bfloat16's bytes either way; the
    resolved spec names the stored format (another format is another digest)."""
    auto = CodecSpec("quantize", 8)
    assert auto.key_mode == "auto"
    for t, h, d, mode in [(128, 3, 64, "channel"), (256, 8, 128, "channel"), (16, 8, 128, "token"),
                          (64, 3, 64, "token")]:
        shape = KVShape("kthd", t, h, d, "bfloat16")
        spec = auto.for_shape(shape)
        assert spec.key_mode == mode
        assert encoded_bytes(auto, shape) == encoded_bytes(spec, shape)
        assert encoded_bytes(spec, shape) <= 0.52 * shape.raw_bytes, (t, h, d)
        assert spec.for_shape(shape) is spec
    smol = KVShape("hktd", 128, 3, 64, "bfloat16", key_order="dt")
    assert len({CodecSpec("quantize", 8, key_mode=m).digest() for m in ("channel", "token")}) == 2
    assert auto.for_shape(smol).digest() == CodecSpec("quantize", 8, key_mode="channel").digest()
    with pytest.raises(ValueError, match=r"compression\.key_mode 'channel'.*1 token"):
        CodecSpec("quantize", 8, key_mode="channel").check(KVShape("kthd", 1, 2, 64, "bfloat16"))
    CodecSpec("quantize", 8).check(KVShape("kthd", 1, 2, 64, "bfloat16"))   # auto: per token


# ---------------------------------------------------------------------------------------------
# the reference's rules where they were ambiguous

@pytest.mark.parametrize("name", ["int4-channel-g32", "int4-token-g32", "sparse-channel-g32",
                                  "int8-channel"])
def test_reference_zero_extremes_are_positive(name):
    """A group whose minimum or maximum is a zero stores it as +0, whichever zeros (-0, +0) the
    group holds and wherever they sit: the min / max of -0 and +0 is either, and torch's choice
    follows its reduction order (the same values gave min bits 0x8000 or 0x0000 by position),
    which another implementation cannot follow."""
    spec = make_spec(name)
    shape = KVShape("kthd", 4, 1, 64, "float32")
    layouts = ([-0.0, 0.0, 0.0, 1.0], [0.0, -0.0, 0.0, 1.0], [0.0, 0.0, -0.0, 1.0],
               [-0.0, -0.0, 0.0, 1.0], [0.0, -0.0, -0.0, 1.0])
    params = set()
    for zeros in layouts:
        x = torch.ones(1, 2, 4, 1, 64)
        x[0, 0, :, 0, 0] = torch.tensor(zeros)              # keys, channel 0 over the tokens
        x[0, 0, 3, 0, 1] = 2.0                              # sparse: token 3 the salient one
        x[0, 1, 1, 0, :32] = torch.tensor(zeros * 8)        # values, token 1: a zero minimum
        x[0, 1, 1, 0, 32:] = -torch.tensor(zeros * 8)       # ... and a zero maximum
        src = x.reshape(1, -1).contiguous().view(torch.uint8)
        dst = torch.empty(1, encoded_bytes(spec, shape), dtype=torch.uint8)
        assert compress.encode(spec, shape, src, dst, backend="reference").all()
        kp = segment(dst.numpy(), spec, shape, "kp")
        vp = segment(dst.numpy(), spec, shape, "vp" if "vp" in offsets(spec, shape) else "kp")
        assert not np.signbit(kp[kp == 0]).any() and not np.signbit(vp[vp == 0]).any(), zeros
        params.add(kp.tobytes() + vp.tobytes())
    assert len(params) == 1, "the same values in another order gave other (min, scale) bits"


@pytest.mark.parametrize("name", ["int8", "int4-token-g32", "sparse-channel-g64", "learned"])
@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_reference_unaligned_contiguous_rows(name, dtype):
    """Rows that are contiguous (one row; rows back to back) but start at a byte that is not a
    multiple of the element size: the reference once viewed them as elements without copying
    (RuntimeError: storage_offset must be divisible by 2), on the raw side and the encoded."""
    rng = np.random.default_rng(2)
    t, h, d = 16, 2, 64
    spec = make_spec(name, projection(rng, h, d))
    shape = KVShape("hktd", t, h, d, dtype)
    raw = raw_rows(kv_rows(rng, dtype, t, h, d)[[0, 1, 2]], shape)
    width = encoded_bytes(spec, shape)
    want = torch.empty((3, width), dtype=torch.uint8)
    compress.encode(spec, shape, raw, want, backend="reference")
    want_raw = torch.empty_like(raw)
    compress.decode(spec, shape, want, want_raw, backend="reference")
    for n in (1, 3):
        src = torch.zeros(n * raw.shape[1] + 1, dtype=torch.uint8)[1:].view(n, -1)
        src.copy_(raw[:n])
        enc = torch.zeros(n * width + 3, dtype=torch.uint8)[3:].view(n, -1)
        compress.encode(spec, shape, src, enc, backend="reference")
        assert torch.equal(enc, want[:n])
        out = torch.zeros(n * raw.shape[1] + 1, dtype=torch.uint8)[1:].view(n, -1)
        compress.decode(spec, shape, enc, out, backend="reference")
        assert torch.equal(out, want_raw[:n])


# ---------------------------------------------------------------------------------------------
# validation (ucm.compress, before any implementation runs)

def _args(spec=None, shape=None, n=2):
    shape = shape or KVShape("hktd", 16, 2, 64, "bfloat16")
    spec = spec or CodecSpec()
    return (spec, shape, torch.zeros(n, shape.raw_bytes, dtype=torch.uint8),
            torch.zeros(n, encoded_bytes(spec, shape), dtype=torch.uint8))


@pytest.mark.parametrize("make,match", [
    (lambda: CodecSpec(bits=5), r"compression\.bits"),
    (lambda: CodecSpec(bits=4, group=48), r"compression\.group"),
    (lambda: CodecSpec("sparse", group=16), r"compression\.group"),
    (lambda: CodecSpec(bits=4, key_mode="head"), r"compression\.key_mode"),
    (lambda: CodecSpec("rle"), r"compression\.method"),
    (lambda: CodecSpec("sparse", salient=0.0), r"compression\.salient"),
    (lambda: CodecSpec("learned", ratio=0.25), r"compression\.method 'learned' needs a projection"),
    (lambda: CodecSpec("learned", ratio=1.0, projection=object()), r"compression\.ratio"),
    (lambda: KVShape("hktd", 16, 2, 64, "int8"), r"KVShape\.dtype"),
    (lambda: KVShape("hkdt", 16, 2, 64, "float16"), r"KVShape\.order"),
    (lambda: KVShape("hktd", 0, 2, 64, "float16"), r"KVShape\.tokens"),
])
def test_invalid_specs(make, match):
    with pytest.raises(ValueError, match=match):
        make()


@pytest.mark.parametrize("op", ["encode", "decode"])
@pytest.mark.parametrize("backend", ["reference", "numba"])
def test_validation(op, backend):
    fn = getattr(compress, op)

    def call(spec=None, shape=None, src=None, dst=None, layer=0, n=2):
        s, sh, a, b = _args(spec, shape, n)
        if op == "decode":
            a, b = b, a
        return fn(s, sh, a if src is None else src, b if dst is None else dst, layer,
                  backend=backend)
    # a group that does not divide head_dim names the key
    with pytest.raises(ValueError, match=r"compression\.group: 64 must divide head_dim 96 "
                                         r"\(allowed: \[32\]\)"):
        call(CodecSpec(bits=4, group=64), KVShape("hktd", 16, 2, 96, "float16"))
    with pytest.raises(ValueError, match=r"compression\.group: 32 must divide head_dim 48"):
        call(CodecSpec("sparse", group=32), KVShape("kthd", 16, 2, 48, "float16"))
    with pytest.raises(ValueError, match="INT4 packs two channels per byte"):
        call(CodecSpec(bits=4, group=32), KVShape("hktd", 16, 2, 33, "float16"))
    with pytest.raises(ValueError, match=r"compression\.salient: .* leaves none"):
        call(CodecSpec("sparse", group=32), KVShape("hktd", 1, 2, 64, "float16"))
    rng = np.random.default_rng(0)
    proj = projection(rng, 2, 64, layers=1)
    with pytest.raises(ValueError, match="fitted for 2 heads x 64 channels, the KV has 3 x 64"):
        call(CodecSpec("learned", projection=proj), KVShape("hktd", 16, 3, 64, "float16"))
    with pytest.raises(ValueError, match="layer 1: the projection has 1 layers"):
        call(CodecSpec("learned", projection=proj), KVShape("hktd", 16, 2, 64, "float16"),
             layer=1)
    with pytest.raises(ValueError, match="rank"):
        small = fit_projection([rng.standard_normal((8, 2, 2, 64))], max_rank=4)
        call(CodecSpec("learned", ratio=0.25, projection=small),
             KVShape("hktd", 16, 2, 64, "float16"))
    spec, shape, src, dst = _args()
    if op == "decode":
        src, dst = dst, src
    # shapes, dtypes, strides, row counts of the buffers
    with pytest.raises(ValueError, match=r"src: expected rows of \d+ contiguous bytes"):
        fn(spec, shape, src[:, 1:], dst, backend=backend)
    with pytest.raises(ValueError, match=r"dst: expected rows of \d+ contiguous bytes"):
        fn(spec, shape, src, dst[:, :-8], backend=backend)
    with pytest.raises(ValueError, match=r"src: expected a uint8"):
        fn(spec, shape, src.view(torch.int8), dst, backend=backend)
    with pytest.raises(ValueError, match=r"dst: expected a uint8"):
        fn(spec, shape, src, dst.reshape(-1), backend=backend)
    with pytest.raises(ValueError, match="dst: 1 rows, expected 2"):
        fn(spec, shape, src, dst[:1], backend=backend)
    with pytest.raises(ValueError, match="src: expected uint8 rows, got float32"):
        fn(spec, shape, np.zeros(src.shape, np.float32), dst, backend=backend)
    with pytest.raises(ValueError, match=r"contiguous bytes"):         # overlapping rows
        fn(spec, shape, torch.as_strided(src, src.shape, (8, 1)), dst, backend=backend)
    with pytest.raises(ValueError, match="spec: expected a ucm.compress.CodecSpec"):
        fn({"method": "quantize"}, shape, src, dst, backend=backend)
    with pytest.raises(ValueError, match="shape: expected a ucm.compress.KVShape"):
        fn(spec, (16, 2, 64), src, dst, backend=backend)
    # no rows: nothing to do
    out = fn(spec, shape, src[:0], dst[:0], backend=backend)
    if op == "encode":
        assert out.shape == (0,) and out.dtype == np.bool_


# ---------------------------------------------------------------------------------------------
# the numba implementation's element conversions, over wide sets of bit patterns

def test_numba_conversions():
    """float32 -> float16 / bfloat16 (round to nearest even, subnormals, overflow to inf) and
    float16 -> float32 as torch converts: every high half of a float32 with low halves at the
    rounding boundaries, a million random patterns; every float16."""
    pytest.importorskip("numba")
    from numba import njit

    cx = pytest.importorskip("ucm.fast.numba._elements")

    @njit
    def down(x, f16, bf16):
        for i in range(x.shape[0]):
            f16[i] = cx.to_f16(x[i])
            bf16[i] = cx.to_bf16(x[i])

    @njit
    def up(h, out):
        for i in range(h.shape[0]):
            out[i] = cx.f16_to_f32(h[i])
    lows = np.array([0, 1, 0x0FFF, 0x1000, 0x1001, 0x1FFF, 0x2000, 0x7FFF, 0x8000, 0x8001, 0xFFFF],
                    np.uint32)
    bits = (np.arange(1 << 16, dtype=np.uint32)[:, None] << 16 | lows).ravel()
    rand = np.random.default_rng(0).integers(0, 1 << 32, 1 << 20, dtype=np.uint64)
    bits = np.concatenate([bits, rand.astype(np.uint32)])
    x = bits.view(np.float32)
    x = x[~np.isnan(x)]
    f16, bf16 = np.empty(len(x), np.int64), np.empty(len(x), np.int64)
    down(x, f16, bf16)
    t = torch.from_numpy(x)

    def bits16(dtype):
        return t.to(dtype).view(torch.int16).numpy().astype(np.int64) & 0xFFFF
    assert_equivalent("decode", f16, bits16(torch.float16), np.uint8, " float32 -> float16 bits")
    assert_equivalent("decode", bf16, bits16(torch.bfloat16), np.uint8,
                      " float32 -> bfloat16 bits")
    h = np.arange(1 << 16, dtype=np.uint16)
    want = h.view(np.float16).astype(np.float32)
    got = np.empty(1 << 16, np.float32)
    up(h, got)
    keep = ~np.isnan(want)
    assert_equivalent("decode", got.view(np.uint32)[keep], want.view(np.uint32)[keep], np.uint8,
                      " float16 -> float32 bits")


@pytest.mark.parametrize("rows", ["bfloat16", "float32"])
@pytest.mark.parametrize("out_dtype", ["float32", "float32-bits", "bfloat16", "float16"])
def test_numba_affine_rows(out_dtype, rows):
    """The learned codec's products: rows of coefficients (bfloat16 read from bytes at any offset
    and pitch, or float32) times a float32 matrix plus a bias, rounded into each element type as
    ``Tensor.to`` rounds the float64 result (within one float32 rounding of the sum); every path
    (tiles of four rows by four vectors and of eight rows by one, the rows after them, single
    columns), nothing written outside the rows' columns."""
    pytest.importorskip("numba")
    from numba import njit

    el = pytest.importorskip("ucm.fast.numba._elements")
    tdt, bits = {"float32": (torch.float32, np.float32), "float32-bits": (torch.float32, np.uint32),
                 "bfloat16": (torch.bfloat16, np.uint16), "float16": (torch.float16, np.int16)}[out_dtype]

    @njit
    def run(y, yi, ys, a, ai, pitch, b, bias, n, k, m, w):
        el.affine_rows(y, yi, ys, a, ai, pitch, b, bias, n, k, m, w)
    rng = np.random.default_rng(11)
    for n, k, m in [(1, 1, 1), (3, 5, 19), (4, 16, 64), (7, 16, 64), (128, 16, 64), (9, 32, 128),
                    (5, 8, 80), (6, 3, 15), (130, 24, 144), (5, 40, 64), (128, 64, 16),
                    (19, 64, 32), (17, 7, 48)]:
        coef = torch.from_numpy(rng.standard_normal((n, k)).astype(np.float32))
        if rows == "bfloat16":
            coef = coef.to(torch.bfloat16)
            pitch, ai = 2 * k + 6, 3                       # odd start: unaligned 16-bit reads
            a = np.zeros(ai + n * pitch + 5, np.uint8)
            for r in range(n):
                a[ai + r * pitch:ai + r * pitch + 2 * k] = coef[r].view(torch.uint8).numpy()
        else:
            pitch, ai = k + 3, 2
            a = np.full(ai + n * pitch + 5, np.nan, np.float32)
            a[ai:ai + n * pitch].reshape(n, pitch)[:, :k] = coef.numpy()
        b = rng.standard_normal((k, m)).astype(np.float32)
        bias = (4 * rng.standard_normal(m)).astype(np.float32)
        ys, yi = m + 3, 5
        y = np.full(yi + n * ys + 4, 7, bits)
        run(y, yi, ys, a, ai, pitch, b, bias, n, k, m, np.empty(8 * k, np.float32))
        exact = coef.double().numpy() @ b.astype(np.float64) + bias
        got = torch.from_numpy(y[yi:yi + n * ys].view(np.int16 if bits == np.uint16 else bits)
                               ).view(tdt).reshape(n, ys)
        want = torch.from_numpy(exact).to(tdt)
        step = {torch.float32: 2.0 ** -23, torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}[tdt]
        err = (got[:, :m].double() - want.double()).abs()
        assert (err <= 2 * step * want.double().abs() + 1e-5 * k).all(), (n, k, m, float(err.max()))
        pad = y.copy()
        pad[yi:yi + n * ys].reshape(n, ys)[:, :m] = 7
        assert (pad == 7).all(), (n, k, m)


# ---------------------------------------------------------------------------------------------
# the numba kernels on CPUs with fewer instructions than this one

_OLDER_CPU = r"""
import numpy as np, torch
from ucm import compress
from ucm.codecs import CodecSpec, KVShape, encoded_bytes, fit_projection
rng = np.random.default_rng(0)
cal = rng.standard_normal((512, 2, 3, 64)).astype(np.float32)
proj = fit_projection([cal])
for method in ("learned", "int8"):
    spec = (CodecSpec("learned", ratio=0.25, projection=proj) if method == "learned"
            else CodecSpec("quantize", bits=8, key_mode="channel"))
    for dtype, tt in (("bfloat16", torch.bfloat16), ("float16", torch.float16)):
        shape = KVShape("hktd", 128, 3, 64, dtype)
        raw = torch.from_numpy(rng.standard_normal((4, 3, 2, 128, 64)).astype(np.float32))
        raw = raw.to(tt).contiguous().view(torch.uint8).reshape(4, shape.raw_bytes)
        enc = torch.empty((4, encoded_bytes(spec, shape)), dtype=torch.uint8)
        compress.encode(spec, shape, raw, enc, backend="reference")
        got, want = torch.empty_like(raw), torch.empty_like(raw)
        compress.decode(spec, shape, enc, got, backend="numba")
        compress.decode(spec, shape, enc, want, backend="reference")
        g, w = got.view(tt).float(), want.view(tt).float()
        step = 2.0 ** -7 if dtype == "bfloat16" else 2.0 ** -10
        assert bool(((g - w).abs() <= 2e-5 + step * w.abs()).all()), (method, dtype)
        if method == "int8":
            assert torch.equal(got, want), dtype
print("ok")
"""


@pytest.mark.skipif(__import__("platform").machine() not in ("x86_64", "AMD64"),
                    reason="x86 CPU models")
@pytest.mark.parametrize("cpu", ["skylake-avx512", "x86-64"], ids=["no-avx512bf16", "no-avx512-f16c"])
def test_numba_codecs_compile_and_agree_for_an_older_cpu(cpu, tmp_path):
    """The kernels are built for numba's target CPU; one without AVX512-BF16 (or AVX-512, or
    F16C) must get a portable rounding of the decoded values, not a call to a compiler-rt
    routine numba's JIT cannot resolve (which crashed the process)."""
    from conftest import run_python

    r = run_python(_OLDER_CPU, env={"NUMBA_CPU_NAME": cpu, "NUMBA_CPU_FEATURES": "",
                                    "UCM_JIT_CACHE": str(tmp_path / "jit")}, timeout=600)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), \
        f"rc {r.returncode}: {r.stderr[-2000:]}"


@impls("encode")
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("ratio,d", [(0.25, 64), (0.2, 64), (0.25, 40), (0.3, 24)])
def test_learned_decode_ranks_and_widths(impl, ratio, d, dtype, monkeypatch):
    """The learned decode takes two coefficients a step where the rank is even and the head
    dimension a multiple of 16, and one a step elsewhere (ranks 16, 13, 10, 7 here; D 64, 40,
    24): every case decodes as the reference does, token- and channel-major keys alike."""
    backend, _ = backend_of("encode", impl, monkeypatch)
    rng = np.random.default_rng(5)
    h, t = 2, 16
    proj = projection(rng, h, d)
    spec = CodecSpec("learned", ratio=ratio, projection=proj)
    for key_order in ("td", "dt"):
        shape = KVShape("hktd", t, h, d, dtype, key_order=key_order)
        x = rng.standard_normal((6, 2, t, h, d)).astype(np.float32)
        round_trip(backend, spec, shape, raw_rows(x, shape))
