"""Triton KV codecs (ucm.fast.triton.compress) against the PyTorch reference run on the CPU (the
documented rules), byte for byte: ``encode`` / ``decode`` for INT8, INT4 (keys per channel and
per token group, groups of 32 and 64) and sparse, over memory orders, element types, odd sizes,
rows of zeros, constants, exact rounding ties, tiny (subnormal scales), huge and largest values,
NaN and infinite rows (``ok`` False, and the reference's bytes even then), unaligned rows;
``learned`` within one bfloat16 step. The fused ``gather_encode`` / ``decode_scatter`` against the reference
(gather + encode per layer; decode + scatter) over the KV layouts of test_transfer.py, with
repeated and ``-1`` indices, layer subsets, a non-finite block, and a layout the fused kernels
cannot address (the unfused fallback).

Triton runs natively on CUDA tensors where a GPU is present; on CPU tensors through the Triton
interpreter (``TRITON_INTERPRET=1`` set per test, small shapes, marked ``triton_interpreter``).
"""
import importlib.util
import zlib

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from conftest import INTERPRETER_PROCESS  # noqa: E402
from ucm import dispatch  # noqa: E402
from ucm.codecs import MAGNITUDE_LIMIT  # noqa: E402
from ucm.compress import (CodecSpec, KVShape, decode, decode_scatter, encode,  # noqa: E402
                          encoded_bytes, fit_key_rounding, fit_projection, gather_encode,
                          query_moments)
from ucm.reference import compress as ref  # noqa: E402
from test_transfer import Cache  # noqa: E402

#: the interpreter evaluates the masked-out lanes too (divisions by a zero scale)
pytestmark = pytest.mark.filterwarnings("ignore:.*encountered in:RuntimeWarning")

HAS_CUDA = torch.cuda.is_available()
HAS_TRITON = importlib.util.find_spec("triton") is not None
SENTINEL = 0xA5

SPECS = {
    "int8": CodecSpec("quantize", 8, key_mode="channel"),
    "int8-tok": CodecSpec("quantize", 8),       # auto: keys per token below 128 tokens
    "int4-ch32": CodecSpec("quantize", 4, 32, "channel"),
    "int4-ch64": CodecSpec("quantize", 4, 64, "channel"),
    "int4-tok32": CodecSpec("quantize", 4, 32, "token"),
    "int4-tok64": CodecSpec("quantize", 4, 64, "token"),
    "sparse-ch32": CodecSpec("sparse", 4, 32, "channel", salient=0.125),
    "sparse-tok64": CodecSpec("sparse", 4, 64, "token", salient=0.3),
}

SMALL = [KVShape("kthd", 8, 2, 64, "bfloat16"), KVShape("hktd", 5, 3, 64, "float16"),
         KVShape("thkd", 4, 1, 64, "float32")]
LARGE = [KVShape("kthd", 16, 8, 128, "bfloat16"), KVShape("htkd", 16, 3, 64, "bfloat16"),
         KVShape("kthd", 7, 3, 96, "float16"), KVShape("hktd", 16, 2, 128, "float32"),
         KVShape("hktd", 128, 3, 64, "bfloat16")]     # (int8-tok: auto is per channel here)


def _params():
    out = []
    for shape in SMALL:
        out.append(pytest.param("cpu", shape, id=f"cpu-{shape.order}-{shape.tokens}x{shape.heads}x"
                                f"{shape.head_dim}-{shape.dtype}", marks=pytest.mark.triton_interpreter))
    if HAS_CUDA:
        for shape in SMALL + LARGE:
            out.append(pytest.param("cuda", shape, id=f"cuda-{shape.order}-{shape.tokens}x"
                                    f"{shape.heads}x{shape.head_dim}-{shape.dtype}"))
    return out


@pytest.fixture
def triton_on(monkeypatch):
    """Make Triton runnable on ``device``: the interpreter for CPU tensors."""
    def setup(device):
        if not HAS_TRITON:
            pytest.skip("triton is not installed")
        if device == "cpu":
            if not INTERPRETER_PROCESS:
                pytest.skip("Triton on CPU tensors runs in the Triton-interpreter process")
            monkeypatch.setenv("TRITON_INTERPRET", "1")
        dispatch._reset_for_tests()
        [impl] = [i for i in dispatch.implementations("encode") if i.name == "triton"]
        ok, why = impl.available(dispatch.detect_platform())
        if not ok:
            pytest.skip(f"triton: {why}")
        return device
    return setup


# ---------------------------------------------------------------------------------------------
# inputs

def kv_rows(shape: KVShape, gen: torch.Generator):
    """Raw rows (uint8 [n, raw_bytes], CPU) of one shape: random KV with outlier channels and
    tokens, then special rows: zeros, a constant, exact ties for INT8 and for INT4, tiny values,
    huge values, values up to the magnitude limit, one at it, a NaN, an infinity."""
    T, H, D = shape.tokens, shape.heads, shape.head_dim
    dims = (2, T, H, D)
    rand = lambda: torch.randn(dims, generator=gen)  # noqa: E731
    rows = []
    for _ in range(3):
        x = rand() * 2
        x[..., 3] *= 20                                   # an outlier channel
        x[:, T // 2] *= 5                                 # an outlier token
        rows.append(x)
    rows.append(torch.zeros(dims))
    rows.append(torch.full(dims, 0.7))
    tie8 = torch.randint(-254, 255, dims, generator=gen).float() / 32  # s = 1/16: halves tie
    tie8[..., 0] = 254 / 32
    rows.append(tie8)
    tie4 = torch.randint(0, 31, dims, generator=gen).float() / 32      # m = 0, s = 1/16
    tie4[..., 0::32] = 0
    tie4[..., 1::32] = 30 / 32
    tie4[:, 0] = 0
    tie4[:, 1] = 30 / 32
    rows.append(tie4)
    tiny = 1e-6 if shape.dtype == "float16" else 1e-39
    rows.append(rand() * tiny)
    huge = 500.0 if shape.dtype == "float16" else 1e36
    rows.append((rand() * huge).clamp(-32000, 32000) if shape.dtype == "float16" else rand() * huge)
    # up to just below the magnitude limit (ucm.codecs.MAGNITUDE_LIMIT), both signs
    limit = MAGNITUDE_LIMIT[shape.dtype]
    rows.append(rand().clamp(-1.0, 1.0) * (limit * (1 - 2 ** -8)))
    # refused: one value at the limit, a NaN, an infinity
    at = rand()
    at[1, 0, H - 1, D - 1] = -limit
    rows.append(at)
    nan = rand()
    nan[1, T - 1, H - 1, D // 2] = float("nan")
    rows.append(nan)
    inf = rand()
    inf[0, 0, 0, 1] = float("-inf")
    rows.append(inf)
    return ref.from_canonical(torch.stack(rows), shape)


# ---------------------------------------------------------------------------------------------
# encode / decode

@pytest.mark.parametrize("name", list(SPECS))
@pytest.mark.parametrize("device,shape", _params())
def test_encode_decode_exact(triton_on, device, shape, name):
    spec = SPECS[name]
    try:
        spec.check(shape)
    except ValueError as exc:
        pytest.skip(str(exc))
    triton_on(device)
    gen = torch.Generator().manual_seed(zlib.crc32(f"{name}{shape}".encode()))
    src = kv_rows(shape, gen)
    n, E = src.shape[0], encoded_bytes(spec, shape)

    want = torch.full((n, E), SENTINEL, dtype=torch.uint8)
    ok_want = encode(spec, shape, src, want, backend="reference")
    got = torch.full((n, E), 0x5A, dtype=torch.uint8, device=device)
    ok_got = encode(spec, shape, src.to(device), got, backend="triton")
    np.testing.assert_array_equal(ok_got, ok_want)
    assert list(ok_want[-3:]) == [False] * 3 and ok_want[:-3].all()
    diff = (got.cpu() != want).nonzero()
    assert diff.numel() == 0, f"{diff.shape[0]} bytes differ, first at (row, byte) {diff[:5].tolist()}"

    rows = want[ok_want]
    out_want = torch.full((rows.shape[0], shape.raw_bytes), SENTINEL, dtype=torch.uint8)
    decode(spec, shape, rows, out_want, backend="reference")
    out_got = torch.full(out_want.shape, 0x5A, dtype=torch.uint8, device=device)
    decode(spec, shape, rows.to(device), out_got, backend="triton")
    diff = (out_got.cpu() != out_want).nonzero()
    assert diff.numel() == 0, f"{diff.shape[0]} bytes differ, first at (row, byte) {diff[:5].tolist()}"


@pytest.mark.parametrize("name", ["int8", "int8-tok", "int4-tok32", "sparse-ch32"])
@pytest.mark.parametrize("device", [pytest.param("cpu", marks=pytest.mark.triton_interpreter)]
                         + (["cuda"] if HAS_CUDA else []))
def test_unaligned_rows(triton_on, device, name):
    """Rows at odd byte offsets of wider buffers (the kernels then work on aligned copies) and
    a single row."""
    spec, shape = SPECS[name], KVShape("kthd", 8, 2, 64, "bfloat16")
    triton_on(device)
    src = kv_rows(shape, torch.Generator().manual_seed(5))[:4]
    n, R, E = src.shape[0], shape.raw_bytes, encoded_bytes(spec, shape)
    want = torch.empty((n, E), dtype=torch.uint8)
    encode(spec, shape, src, want, backend="reference")

    wide_src = torch.zeros((n, R + 9), dtype=torch.uint8, device=device)
    wide_src[:, 1:1 + R] = src.to(device)
    wide = torch.full((n, E + 7), SENTINEL, dtype=torch.uint8, device=device)
    encode(spec, shape, wide_src[:, 1:1 + R], wide[:, 3:3 + E], backend="triton")
    assert torch.equal(wide[:, 3:3 + E].cpu(), want)
    assert (wide[:, :3] == SENTINEL).all() and (wide[:, 3 + E:] == SENTINEL).all()
    one = torch.empty((1, E), dtype=torch.uint8, device=device)
    encode(spec, shape, src[2:3].to(device), one, backend="triton")
    assert torch.equal(one.cpu(), want[2:3])

    raw_want = torch.empty((n, R), dtype=torch.uint8)
    decode(spec, shape, want, raw_want, backend="reference")
    enc_odd = torch.zeros((n, E + 5), dtype=torch.uint8, device=device)
    enc_odd[:, 1:1 + E] = want.to(device)
    raw_wide = torch.full((n, R + 3), SENTINEL, dtype=torch.uint8, device=device)
    decode(spec, shape, enc_odd[:, 1:1 + E], raw_wide[:, 1:1 + R], backend="triton")
    assert torch.equal(raw_wide[:, 1:1 + R].cpu(), raw_want)
    assert (raw_wide[:, 0] == SENTINEL).all() and (raw_wide[:, 1 + R:] == SENTINEL).all()


@pytest.mark.parametrize("name", ["int4-ch32", "int4-tok32", "sparse-ch32"])
@pytest.mark.parametrize("device", [pytest.param("cpu", marks=pytest.mark.triton_interpreter)]
                         + (["cuda"] if HAS_CUDA else []))
def test_signed_zero_extremes(triton_on, device, name):
    """A group whose min or max is a zero, with zeros of both signs in it: the stored minimum
    and scale are those of +0 (the reference's rule), whichever zero a reduction meets first."""
    spec, shape = SPECS[name], KVShape("hktd", 16, 2, 64, "bfloat16")
    triton_on(device)
    gen = torch.Generator().manual_seed(11)
    x = torch.rand((3, 2, 16, 2, 64), generator=gen)
    x[0] = torch.where(torch.rand(x[0].shape, generator=gen) < 0.5, -0.0, 0.0)  # zeros only
    x[1, 0, :, 0, 5] = -0.0                       # a channel whose min is -0 and +0
    x[1, 0, 3, 0, 5] = 0.0
    x[2] = -x[2]                                  # a token group whose max is a zero
    x[2, 1, 4, 1, :] = -0.0
    x[2, 1, 4, 1, 7] = 0.0
    src = ref.from_canonical(x, shape)
    want = torch.empty((3, encoded_bytes(spec, shape)), dtype=torch.uint8)
    encode(spec, shape, src, want, backend="reference")
    got = torch.empty_like(want, device=device)
    encode(spec, shape, src.to(device), got, backend="triton")
    assert torch.equal(got.cpu(), want)


#: INT8 with keys per channel in two launches (keys, then values) at any block size, in chunks
#: of 2 tokens (channel ranges) and 4 (codes), value programs of 4 vectors
INT8_SPLIT = dict(int8_channel_fused=0, int8_channel_range_elems=128, int8_channel_key_tokens=4,
                  int8_value_elems=256, int8_channel_key_warps=1, int8_value_warps=1)
LAUNCHES = [dict(int8_vectors=8, int8_warps=2, int8_tokens=4, int8_channel_warps=4),
            INT8_SPLIT,
            dict(int4_channel_warp_words=64, int4_token_heads=1, int4_token_warps=2,
                 int4_decode_heads=1),
            dict(int4_channel_warp_words=4096, int4_token_heads=2, int4_decode_heads=3,
                 int4_decode_warps=2, int4_decode_warps_token=2, sparse_select_warps=2)]


def _launch_params():
    """Every launch variant with every codec on CUDA; interpreted (CI's CPU run), each variant
    with the codecs whose kernels it changes (INT8 tiles with INT8, the INT4 variants with INT4
    and sparse). The shape has 3 heads: by default the INT4 encodes take 4 per program (one
    absent)."""
    ids = ["int8-small", "int8-split", "int4-small", "int4-large"]
    out = []
    for changes, cid in zip(LAUNCHES, ids):
        for name in ["int8", "int8-tok", "int4-ch32", "int4-tok64", "sparse-ch32"]:
            if HAS_CUDA:
                out.append(pytest.param("cuda", name, changes, id=f"cuda-{name}-{cid}"))
            if name.startswith("int8") == cid.startswith("int8"):
                out.append(pytest.param("cpu", name, changes, id=f"cpu-{name}-{cid}",
                                        marks=pytest.mark.triton_interpreter))
    return out


@pytest.mark.parametrize("device,name,changes", _launch_params())
def test_launch_variants(triton_on, device, name, changes):
    """Other launch constants (more or fewer heads per program, other warps, small INT8 tiles)
    give the same bytes."""
    from ucm.fast.triton import compress as tc

    spec, shape = SPECS[name], KVShape("hktd", 8, 3, 64, "bfloat16")
    triton_on(device)
    src = kv_rows(shape, torch.Generator().manual_seed(21))
    E = encoded_bytes(spec, shape)
    want = torch.empty((src.shape[0], E), dtype=torch.uint8)
    ok = encode(spec, shape, src, want, backend="reference")
    got = torch.empty((src.shape[0], E), dtype=torch.uint8, device=device)
    launch = tc.LAUNCH.replace(**changes)
    np.testing.assert_array_equal(tc.encode(spec, shape, src.to(device), got, 0, launch=launch), ok)
    assert torch.equal(got.cpu(), want)
    raw_want = torch.empty((int(ok.sum()), shape.raw_bytes), dtype=torch.uint8)
    decode(spec, shape, want[ok], raw_want, backend="reference")
    raw_got = torch.empty(raw_want.shape, dtype=torch.uint8, device=device)
    tc.decode(spec, shape, want[ok].to(device), raw_got, 0, launch=launch)
    assert torch.equal(raw_got.cpu(), raw_want)


@pytest.mark.parametrize("device", [pytest.param("cpu", marks=pytest.mark.triton_interpreter)]
                         + (["cuda"] if HAS_CUDA else []))
def test_learned_within_one_bf16_step(triton_on, device):
    shape = KVShape("kthd", 8, 2, 64, "bfloat16")
    gen = torch.Generator().manual_seed(9)
    samples = [torch.randn(64, 2, 2, 64, generator=gen).numpy() for _ in range(2)]
    spec = CodecSpec("learned", ratio=0.25, projection=fit_projection(samples))
    triton_on(device)
    src = kv_rows(shape, gen)[:3]
    E = encoded_bytes(spec, shape)
    want = torch.empty((3, E), dtype=torch.uint8)
    encode(spec, shape, src, want, 1, backend="reference")
    got = torch.empty((3, E), dtype=torch.uint8, device=device)
    encode(spec, shape, src.to(device), got, 1, backend="triton")
    w, g = ref.from_bf16_bits(want.view(torch.int16)), ref.from_bf16_bits(got.cpu().view(torch.int16))
    assert torch.allclose(g, w, rtol=2 ** -7, atol=1e-6)
    raw_want = torch.empty((3, shape.raw_bytes), dtype=torch.uint8)
    decode(spec, shape, want, raw_want, 1, backend="reference")
    raw_got = torch.empty((3, shape.raw_bytes), dtype=torch.uint8, device=device)
    decode(spec, shape, want.to(device), raw_got, 1, backend="triton")
    a = ref.to_canonical(raw_got.cpu(), shape)
    b = ref.to_canonical(raw_want, shape)
    assert torch.allclose(a, b, rtol=2 ** -7, atol=1e-5)


@pytest.mark.parametrize("device", [pytest.param("cpu", marks=pytest.mark.triton_interpreter)]
                         + (["cuda"] if HAS_CUDA else []))
def test_key_rounding_matches_the_cpu_reference(triton_on, device):
    """Keys per channel (INT8, INT4, sparse) whose codes a key rounding picks: the device's encode (the reference on the
    device's tensors) writes the bytes the reference writes on the CPU, refusals included, and
    the Triton decode reads them back as the reference does."""
    gen = torch.Generator().manual_seed(4)
    triton_on(device)
    shapes = [KVShape("kthd", 8, 2, 64, "bfloat16"), KVShape("hktd", 16, 3, 64, "float32")]
    if device == "cuda":
        shapes.append(KVShape("kthd", 128, 8, 128, "bfloat16"))
    for shape in shapes:
        h, d = shape.heads, shape.head_dim
        mix = torch.randn(d, d, generator=gen) / d ** 0.5 + torch.eye(d)
        rounding = fit_key_rounding([query_moments((torch.randn(32, 2 * h, d, generator=gen)
                                                    @ mix).numpy(), h) for _ in range(2)])
        src = kv_rows(shape, gen)
        for spec in (CodecSpec("quantize", 8, key_mode="channel", rounding=rounding),
                     CodecSpec("quantize", 4, 32, "channel", rounding=rounding),
                     CodecSpec("sparse", 4, 64, "channel", salient=0.125, rounding=rounding)):
            E = encoded_bytes(spec, shape)
            want = torch.empty((len(src), E), dtype=torch.uint8)
            ok_want = encode(spec, shape, src, want, 1, backend="reference")
            got = torch.empty((len(src), E), dtype=torch.uint8, device=device)
            ok_got = encode(spec, shape, src.to(device), got, 1, backend="triton")
            assert np.array_equal(ok_got, ok_want) and not ok_want.all()
            assert torch.equal(got.cpu()[ok_want], want[ok_want])
            raw_want = torch.empty((int(ok_want.sum()), shape.raw_bytes), dtype=torch.uint8)
            decode(spec, shape, want[ok_want], raw_want, 1, backend="reference")
            raw_got = torch.empty(raw_want.shape, dtype=torch.uint8, device=device)
            decode(spec, shape, want[ok_want].to(device), raw_got, 1, backend="triton")
            assert torch.equal(raw_got.cpu(), raw_want)


# ---------------------------------------------------------------------------------------------
# gather_encode / decode_scatter

#: test_transfer.py layouts whose shards are plain KV, and the memory order of a shard
FUSED_LAYOUTS = {"fa": "kthd", "fa_packed": "kthd", "flashinfer": "kthd", "cpu_BHN2D": "htkd",
                 "padded": "kthd", "heads_slice": "kthd", "vllm_LHBNC": "htkd",
                 "vllm_BLNHC": "thkd"}
FUSED_SPECS = ["int8", "int8-tok", "int4-ch32", "int4-tok64", "sparse-ch32"]
# under the interpreter (CI's CPU run, ~2-4 s a case) a subset with each kind of run structure:
# one run per block, one per head (head-outer), one per token (token-outer) and padded rows;
# every layout runs natively on CUDA
INTERPRETED_LAYOUTS = ["fa", "cpu_BHN2D", "vllm_BLNHC", "padded"]


def _fused_params():
    out = []
    small = dict(B=6, N=8, H=2, D=64, L=2)
    for lay in INTERPRETED_LAYOUTS:
        out.append(pytest.param("cpu", lay, small, id=f"cpu-{lay}", marks=pytest.mark.triton_interpreter))
    if HAS_CUDA:
        large = dict(B=12, N=16, H=8, D=128, L=3)
        for lay in FUSED_LAYOUTS:
            out.append(pytest.param("cuda", lay, large, id=f"cuda-{lay}"))
    return out


def _fill_kv(cache: Cache, gen: torch.Generator):
    """Finite KV values in every view (outlier channels included); padding bytes random."""
    for r in cache.raw():
        r.copy_(torch.randint(0, 256, r.shape, generator=gen, dtype=torch.uint8).to(r.device))
    for v in cache.views:
        x = torch.randn(v.shape, generator=gen) * 2
        x[..., 5] *= 10
        v.copy_(x.to(v.dtype).to(v.device))
    return cache


def _twin(cache: Cache, layout_name: str, dtype, size: dict) -> Cache:
    """The same cache on the CPU, byte for byte."""
    cpu = Cache(layout_name, dtype, "cpu", **size)
    for a, b in zip(cpu.raw(), cache.raw()):
        a.copy_(b.cpu())
    return cpu


@pytest.mark.parametrize("name", FUSED_SPECS)
@pytest.mark.parametrize("device,layout_name,size", _fused_params())
def test_gather_encode_decode_scatter(triton_on, device, layout_name, size, name):
    spec = SPECS[name]
    dtype = torch.bfloat16 if layout_name != "padded" else torch.float16
    shape = KVShape(FUSED_LAYOUTS[layout_name], size["N"], size["H"], size["D"],
                    str(dtype).replace("torch.", ""))
    triton_on(device)
    gen = torch.Generator().manual_seed(11)
    cache = _fill_kv(Cache(layout_name, dtype, device, **size), gen)
    B, L, E = size["B"], size["L"], encoded_bytes(spec, shape)
    # a NaN in block 4, last layer
    bad = [v for v, lay in zip(cache.views, cache.layer_of_view) if lay == L - 1][0]
    bad[(4,) + (0,) * (bad.dim() - 2) + (7,)] = float("nan")
    twin = _twin(cache, layout_name, dtype, size)
    before = cache.snapshot()

    for idx, layers in (([3, -1, 0, 3, B - 1, 4], None), ([4, 1, -1], [L - 1, 0]), ([2], [1]), ([], None)):
        nl = L if layers is None else len(layers)
        want = torch.full((len(idx), nl * E), SENTINEL, dtype=torch.uint8)
        ok_want = gather_encode(twin.layout, idx, spec, shape, want, layers, backend="reference")
        got = torch.full((len(idx), nl * E), SENTINEL, dtype=torch.uint8, device=device)
        ok_got = gather_encode(cache.layout, torch.tensor(idx, dtype=torch.int64, device=device),
                               spec, shape, got, layers, backend="triton")
        np.testing.assert_array_equal(ok_got, ok_want)
        diff = (got.cpu() != want).nonzero()
        assert diff.numel() == 0, f"{idx} {layers}: {diff.shape[0]} bytes differ, first {diff[:5].tolist()}"
        if idx == [3, -1, 0, 3, B - 1, 4]:
            assert list(ok_want) == [True, True, True, True, True, False]
    assert cache.equals(before), "gather_encode wrote into the cache"

    # decode_scatter: encodings of finite blocks into a sentinel cache
    idx, layers = [5, -1, 0, 2], [L - 1, 0]
    src = torch.empty((len(idx), 2 * E), dtype=torch.uint8)
    gather_encode(twin.layout, [1, 3, 2, 0], spec, shape, src, layers, backend="reference")
    out_want = _twin(cache, layout_name, dtype, size).fill(SENTINEL)
    decode_scatter(out_want.layout, src, idx, spec, shape, layers, backend="reference")
    out_got = Cache(layout_name, dtype, device, **size).fill(SENTINEL)
    decode_scatter(out_got.layout, src.to(device), torch.tensor(idx, device=device), spec, shape,
                   layers, backend="triton")
    for a, b in zip(out_got.raw(), out_want.raw()):
        diff = (a.cpu() != b).nonzero()
        assert diff.numel() == 0, f"{diff.shape[0]} cache bytes differ, first {diff[:5].tolist()}"


@pytest.mark.parametrize("device", [pytest.param("cpu", marks=pytest.mark.triton_interpreter)]
                         + (["cuda"] if HAS_CUDA else []))
def test_fused_fallback_layout(triton_on, device):
    """Views at an odd byte address (elements not aligned to their size): the Triton ops take
    the unfused path (gather, then encode) and still match."""
    from ucm.layout import KVLayout

    triton_on(device)
    spec, B, N, H, D, L = SPECS["int8"], 4, 8, 2, 64, 2
    shape = KVShape("kthd", N, H, D, "bfloat16")
    gen = torch.Generator().manual_seed(3)
    page = 2 * N * H * D * 2
    raw = torch.zeros(L * B * page + 1, dtype=torch.uint8)
    x = (torch.randn(L * B * page // 2, generator=gen)).to(torch.bfloat16).view(torch.uint8)
    raw[1:] = x
    views_of = lambda r: [r[1 + l * B * page:1 + (l + 1) * B * page].view(B, page)  # noqa: E731
                          for l in range(L)]
    dev_raw = raw.to(device)
    lay_cpu, lay_dev = KVLayout.from_views(views_of(raw)), KVLayout.from_views(views_of(dev_raw))
    from ucm.fast.triton.compress import _layout_tables
    assert _layout_tables(lay_dev, (0, 1), shape) is None
    E = encoded_bytes(spec, shape)
    want = torch.full((3, L * E), SENTINEL, dtype=torch.uint8)
    gather_encode(lay_cpu, [2, -1, 0], spec, shape, want, backend="reference")
    got = torch.full((3, L * E), SENTINEL, dtype=torch.uint8, device=device)
    gather_encode(lay_dev, [2, -1, 0], spec, shape, got, backend="triton")
    assert torch.equal(got.cpu(), want)
    raw2, dev2 = raw.clone().fill_(SENTINEL), dev_raw.clone().fill_(SENTINEL)
    decode_scatter(KVLayout.from_views(views_of(raw2)), want, [3, -1, 1], spec, shape, backend="reference")
    decode_scatter(KVLayout.from_views(views_of(dev2)), want.to(device), [3, -1, 1], spec, shape,
                   backend="triton")
    assert torch.equal(dev2.cpu(), raw2)


@pytest.mark.parametrize("shape", [KVShape("hktd", 8, 3, 64, "float16"),
                                   KVShape("kthd", 5, 2, 96, "float32"),
                                   KVShape("thkd", 9, 2, 40, "bfloat16")],
                         ids=lambda s: f"{s.order}-{s.tokens}x{s.heads}x{s.head_dim}-{s.dtype}")
@pytest.mark.parametrize("device", [pytest.param("cpu", marks=pytest.mark.triton_interpreter)]
                         + (["cuda"] if HAS_CUDA else []))
def test_int8_channel_split_types(triton_on, device, shape):
    """The two-launch INT8 keys-per-channel encode (:data:`INT8_SPLIT`) over element types,
    memory orders, odd token counts and head dims, and the special rows of :func:`kv_rows`
    (ties, tiny and huge values, NaN, infinity): the reference's bytes and ``ok`` flags."""
    from ucm.fast.triton import compress as tc

    spec = SPECS["int8"]
    triton_on(device)
    src = kv_rows(shape, torch.Generator().manual_seed(zlib.crc32(str(shape).encode())))
    E = encoded_bytes(spec, shape)
    want = torch.full((src.shape[0], E), SENTINEL, dtype=torch.uint8)
    ok = encode(spec, shape, src, want, backend="reference")
    got = torch.full(want.shape, 0x5A, dtype=torch.uint8, device=device)
    launch = tc.LAUNCH.replace(**INT8_SPLIT)
    np.testing.assert_array_equal(tc.encode(spec, shape, src.to(device), got, 0, launch=launch), ok)
    assert list(ok[-3:]) == [False] * 3 and ok[:-3].all()
    diff = (got.cpu() != want).nonzero()
    assert diff.numel() == 0, f"{diff.shape[0]} bytes differ, first at (row, byte) {diff[:5].tolist()}"


@pytest.mark.parametrize("device", [pytest.param("cpu", marks=pytest.mark.triton_interpreter)]
                         + (["cuda"] if HAS_CUDA else []))
@pytest.mark.parametrize("launch_id", ["default", "split"])
def test_gather_encode_int8_channel_blocks(triton_on, device, launch_id):
    """INT8 keys per channel fused with the gather at 128-token blocks (the keys and the values
    in two launches by default there) and, with :data:`INT8_SPLIT`, at small ones: ``-1`` rows,
    a layer subset, a non-finite block."""
    from ucm.fast.triton import compress as tc

    triton_on(device)
    size = dict(B=5, N=128 if launch_id == "default" else 8, H=2, D=64, L=2)
    launch = tc.LAUNCH if launch_id == "default" else tc.LAUNCH.replace(**INT8_SPLIT)
    spec = SPECS["int8"]
    shape = KVShape(FUSED_LAYOUTS["fa"], size["N"], size["H"], size["D"], "bfloat16")
    cache = _fill_kv(Cache("fa", torch.bfloat16, device, **size), torch.Generator().manual_seed(5))
    cache.views[2][3, 0, 0, 6] = float("inf")          # block 3, layer 1: a key of token 0
    twin = _twin(cache, "fa", torch.bfloat16, size)
    E = encoded_bytes(spec, shape)
    for idx, layers in (([4, -1, 0, 3], (0, 1)), ([3, 1], (1,))):
        want = torch.full((len(idx), len(layers) * E), SENTINEL, dtype=torch.uint8)
        ok_want = gather_encode(twin.layout, idx, spec, shape, want, list(layers),
                                backend="reference")
        got = torch.full(want.shape, SENTINEL, dtype=torch.uint8, device=device)
        ok_got = tc.gather_encode(cache.layout, torch.tensor(idx, device=device), spec, shape,
                                  got, layers, launch=launch)
        np.testing.assert_array_equal(ok_got, ok_want)
        assert not ok_want[-1 if idx[-1] == 3 else 0]
        diff = (got.cpu() != want).nonzero()
        assert diff.numel() == 0, f"{diff.shape[0]} bytes differ, first {diff[:5].tolist()}"


def test_fused_ops_registered_and_validated():
    from ucm.layout import KVLayout

    names = {i.name for i in dispatch.implementations("gather_encode")}
    assert {"reference", "triton"} <= names
    assert {i.name for i in dispatch.implementations("decode_scatter")} >= {"reference", "triton"}
    kv = torch.zeros(2, 4, 8, 2, 64, dtype=torch.bfloat16)
    lay = KVLayout.from_views(list(kv.unbind(0)), [0, 0])
    spec, shape = SPECS["int8"], KVShape("kthd", 8, 2, 64, "bfloat16")
    E = encoded_bytes(spec, shape)
    with pytest.raises(ValueError, match="shard"):
        gather_encode(lay, [0], spec, KVShape("kthd", 4, 2, 64, "bfloat16"),
                      torch.empty(1, E, dtype=torch.uint8), backend="reference")
    with pytest.raises(ValueError, match="dst"):
        gather_encode(lay, [0, 1], spec, shape, torch.empty(1, E, dtype=torch.uint8),
                      backend="reference")
    with pytest.raises(ValueError, match="appears twice"):
        decode_scatter(lay, torch.zeros(2, E, dtype=torch.uint8), [1, 1], spec, shape,
                       backend="reference")
    ok = gather_encode(lay, [], spec, shape, torch.empty(0, E, dtype=torch.uint8))
    assert ok.shape == (0,)
