"""Blend ops (ucm.blend.ops): rope_rotate and kv_deviation, every registered implementation
against the reference (tests/equivalence.py: per implementation and device, outputs the ops
allocate poisoned), the reference against RoPE's mathematics, select_recompute against a
brute-force oracle, and clear errors for bad input.

Equivalence cases: float32 / float16 / bfloat16 (tolerances below) x the layouts a cache hands
out (contiguous; tokens-heads transposed; channels outermost; every dimension sliced, channels
of stride 2; the key half of a ``[num_blocks, H, block_size, 2 D]`` page) x where the result
goes (a new tensor; a strided ``out`` inside a sentinel buffer; in place, ``out=x``), each over
awkward shapes (one token, primes, one head, ``rotary_dim < head_dim`` with an odd number of
pairs, ``head_dim`` not a power of two), both pairings (rotate-half / GPT-J), int32 and int64
shifts including 0, negative ones and +-131071, float32 and float64 frequencies. Untouched
memory around every destination is compared bit for bit; channels past ``rotary_dim`` are exact
copies.

Properties (every implementation): a shift of 0 is a bit-exact copy; rotating by d1 then d2
equals rotating by d1 + d2; rotations keep each pair's norm; a key computed with Hugging Face /
GPT-J style RoPE at position p, rotated by d, is the key computed at p + d.

On a CPU machine the Triton kernels run through the Triton interpreter (which rounds float32 to
bfloat16 toward zero, hence one bfloat16 step of tolerance); on a GPU machine natively, on CUDA
tensors, with an int64-offset case of more than 2^31 elements.
"""
import math
import re

import pytest

torch = pytest.importorskip("torch")

from ucm import dispatch  # noqa: E402
from ucm.blend import ops  # noqa: E402
from conftest import run_python  # noqa: E402
from equivalence import compare, devices, implementation_params, runnable, tensor_impls  # noqa: E402

FLOATS = [torch.float32, torch.float16, torch.bfloat16]
FLOAT_IDS = ["float32", "float16", "bfloat16"]
HAS_CUDA = torch.cuda.is_available()

#: dtype -> (atol, rtol) of a rope_rotate output against the float64 reference: the fast paths
#: rotate in float32 (a few float32 ulps of the inputs, ~1e-6 here), then round to the output
#: type, which may then land one step (2^-10 float16, 2^-7 bfloat16, relative) from the
#: reference's rounding
ROPE_TOL = {torch.float32: (1e-5, 1e-5), torch.float16: (1e-5, 2.0 ** -10),
            torch.bfloat16: (1e-5, 2.0 ** -7)}
#: kv_deviation (float32): the same float32 differences and squares, summed in another order
DEVIATION_TOL = (1e-6, 3e-5)


impls = tensor_impls


def gen(seed):
    return torch.Generator().manual_seed(seed)


def inv_freq_of(R: int, theta: float = 10000.0, dtype=torch.float32) -> torch.Tensor:
    """A model's rotary inverse frequencies ``theta ** (-2 i / R)``, ``[R / 2]``."""
    return (1.0 / theta ** (torch.arange(0, R, 2, dtype=torch.float64) / R)).to(dtype)


# ---------------------------------------------------------------------------------------------
# layouts: (shape of the base tensor, the [N, H, D] view of it)

LAYOUTS = {
    "contiguous": (lambda N, H, D: (N, H, D), lambda b: b),
    "transposed": (lambda N, H, D: (H, N, D), lambda b: b.transpose(0, 1)),
    "channels_outer": (lambda N, H, D: (D, H, N), lambda b: b.permute(2, 1, 0)),
    # every dimension sliced, channels of stride 2, a storage offset
    "sliced": (lambda N, H, D: (2 * N + 1, H + 1, 2 * D + 3),
               lambda b: b[1::2][:, :b.shape[1] - 1, 3:b.shape[2]:2]),
    # keys of block 1 of a [num_blocks, H, block_size, 2 D] cache (K | V in the last dim)
    "paged": (lambda N, H, D: (3, H, N, 2 * D),
              lambda b: b[1].transpose(0, 1)[..., :b.shape[3] // 2]),
}
LAYOUT_IDS = list(LAYOUTS)


def make_base(layout, N, H, D, g, dtype, device, fill=None):
    shape = LAYOUTS[layout][0](N, H, D)
    if fill is None:
        base = torch.randn(*shape, generator=g).to(dtype)
    else:
        base = torch.full(shape, fill, dtype=dtype)
    return base.to(device)


def view_of(layout, base):
    return LAYOUTS[layout][1](base)


def inside(layout, base) -> torch.Tensor:
    """bool mask of the base: True at the elements the [N, H, D] view covers."""
    mask = torch.zeros(base.shape, dtype=torch.bool, device=base.device)
    view_of(layout, mask).fill_(True)
    return mask


def bits(t: torch.Tensor) -> torch.Tensor:
    """The element bits of a float tensor (NaN equal to itself, -0 unequal to +0)."""
    return t.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(bits(a), bits(b))


def assert_close(got, want, tol, what=""):
    assert got.dtype == want.dtype, f"{what}: dtype {got.dtype}, reference {want.dtype}"
    assert got.shape == want.shape, f"{what}: shape {list(got.shape)}, reference {list(want.shape)}"
    atol, rtol = tol
    torch.testing.assert_close(got.cpu().float(), want.cpu().float(), atol=atol, rtol=rtol,
                               equal_nan=True, msg=lambda m: f"{what}: {m}")


# (N, H, D, rotary_dim): one token; primes; one head; rotary_dim < D with an odd number of
# pairs; D not a power of two
ROPE_SHAPES = [(1, 1, 2, None), (7, 3, 16, None), (13, 1, 24, 16), (31, 2, 10, 6),
               (37, 5, 64, 48)]


def deltas(N, g, dtype, device):
    """Shifts of N tokens: random in [-131071, 131071], the extremes, and 0."""
    d = torch.randint(-131071, 131072, (N,), generator=g)
    d[0] = 131071
    if N > 1:
        d[-1] = -131071
    if N > 2:
        d[N // 2] = 0
    return d.to(dtype).to(device)


def rope_cases(g, device):
    """(N, H, D, R, rotary_dim arg, delta, inv_freq, neox) over ROPE_SHAPES x pairings."""
    for j, (N, H, D, R) in enumerate(ROPE_SHAPES):
        r = D if R is None else R
        for neox in (True, False):
            delta = deltas(N, g, torch.int32 if j % 2 else torch.int64, device)
            freq = inv_freq_of(r, 500000.0 if j % 2 else 10000.0,
                               torch.float64 if j == 3 else torch.float32).to(device)
            yield N, H, D, r, R, delta, freq, neox


# ---------------------------------------------------------------------------------------------
# rope_rotate: equivalence

OUT_MODES = ["new", "out", "inplace"]


@impls("rope_rotate")
@pytest.mark.parametrize("mode", OUT_MODES)
@pytest.mark.parametrize("layout", LAYOUT_IDS)
@pytest.mark.parametrize("dtype", FLOATS, ids=FLOAT_IDS)
def test_rope_rotate(impl, dtype, layout, mode, monkeypatch):
    backend, dev = runnable("rope_rotate", impl, monkeypatch)
    g = gen(1)
    out_layout = "sliced" if layout != "sliced" else "transposed"
    tol = ROPE_TOL[dtype]
    for N, H, D, r, R, delta, freq, neox in rope_cases(g, dev):
        what = f"N={N} H={H} D={D} R={r} neox={neox} {layout} {mode}"
        base = make_base(layout, N, H, D, g, dtype, dev)
        original = base.clone()

        def run(b):
            if mode == "new":
                x = view_of(layout, base)
                y = ops.rope_rotate(x, delta, freq, neox=neox, rotary_dim=R, backend=b)
                assert y.is_contiguous(), what
                return y, base.clone()
            if mode == "out":
                x = view_of(layout, base)
                dst = make_base(out_layout, N, H, D, g, dtype, dev, fill=7.0)
                out = view_of(out_layout, dst)
                out.fill_(float("nan"))                  # every element must be written
                y = ops.rope_rotate(x, delta, freq, neox=neox, rotary_dim=R, out=out, backend=b)
                assert y.data_ptr() == out.data_ptr() and y.stride() == out.stride(), what
                return y.clone(), dst
            work = original.clone()
            x = view_of(layout, work)
            y = ops.rope_rotate(x, delta, freq, neox=neox, rotary_dim=R, out=x, backend=b)
            assert y.data_ptr() == x.data_ptr(), what
            return y.clone(), work

        def check(got, want):
            (y, mem), (y_ref, mem_ref) = got, want
            assert_close(y, y_ref, tol, what)
            x = view_of(layout, original)
            assert torch.equal(y[..., r:], x[..., r:]), f"{what}: channels past rotary_dim moved"
            # memory around the destination: untouched (sentinel / the input's other bytes)
            keep = ~inside(out_layout if mode == "out" else layout, mem)
            assert same_bits(mem[keep], mem_ref[keep]), f"{what}: a write outside the output"
            if mode != "inplace":
                assert same_bits(base, original), f"{what}: the input was modified"

        compare("rope_rotate", run, backend, dtype, check=check)


# ---------------------------------------------------------------------------------------------
# rope_rotate: properties (every implementation)

@impls("rope_rotate")
@pytest.mark.parametrize("dtype", FLOATS, ids=FLOAT_IDS)
def test_rope_delta_zero_is_exact_copy(impl, dtype, monkeypatch):
    backend, dev = runnable("rope_rotate", impl, monkeypatch)
    g = gen(2)
    for layout in ("contiguous", "sliced"):
        for neox in (True, False):
            x = view_of(layout, make_base(layout, 11, 3, 20, g, dtype, dev))
            zero = torch.zeros(11, dtype=torch.int64, device=dev)
            y = ops.rope_rotate(x, zero, inv_freq_of(16).to(dev), neox=neox, rotary_dim=16,
                                backend=backend)
            assert torch.equal(y, x), f"{layout} neox={neox}: delta 0 is not an exact copy"


@impls("rope_rotate")
def test_rope_composes(impl, monkeypatch):
    """R(d2) R(d1) = R(d1 + d2), in float32, at shifts up to 2 x 65535."""
    backend, dev = runnable("rope_rotate", impl, monkeypatch)
    g = gen(3)
    N, H, D = 23, 2, 32
    freq = inv_freq_of(D, 500000.0).to(dev)
    for neox in (True, False):
        x = torch.randn(N, H, D, generator=g).to(dev)
        d1 = torch.randint(-65535, 65536, (N,), generator=g).to(dev)
        d2 = torch.randint(-65535, 65536, (N,), generator=g).to(dev)
        twice = ops.rope_rotate(ops.rope_rotate(x, d1, freq, neox=neox, backend=backend), d2,
                                freq, neox=neox, backend=backend)
        once = ops.rope_rotate(x, d1 + d2, freq, neox=neox, backend=backend)
        assert_close(twice, once, (2e-5, 2e-5), f"neox={neox}")
        back = ops.rope_rotate(ops.rope_rotate(x, d1, freq, neox=neox, backend=backend), -d1,
                               freq, neox=neox, backend=backend)
        assert_close(back, x, (2e-5, 2e-5), f"neox={neox}: rotating back")


@impls("rope_rotate")
def test_rope_keeps_pair_norms(impl, monkeypatch):
    backend, dev = runnable("rope_rotate", impl, monkeypatch)
    g = gen(4)
    N, H, D, R = 29, 3, 24, 20
    freq = inv_freq_of(R).to(dev)
    x = torch.randn(N, H, D, generator=g).to(dev)
    delta = deltas(N, g, torch.int64, dev)
    for neox in (True, False):
        y = ops.rope_rotate(x, delta, freq, neox=neox, rotary_dim=R, backend=backend)
        i = torch.arange(R // 2)
        a, b = (i, i + R // 2) if neox else (2 * i, 2 * i + 1)
        before = torch.hypot(x[..., a].double(), x[..., b].double())
        after = torch.hypot(y[..., a].double(), y[..., b].double())
        assert_close(after, before, (1e-5, 1e-5), f"neox={neox}: pair norms")
        assert torch.equal(y[..., R:], x[..., R:])
        assert not torch.allclose(y[..., :R], x[..., :R], atol=1e-3), "nothing rotated"


def hf_rope(k: torch.Tensor, pos: torch.Tensor, inv_freq: torch.Tensor, R: int,
            neox: bool) -> torch.Tensor:
    """Keys ``k [N, H, D]`` (float64, before RoPE) at positions ``pos [N]`` as the models apply
    it: Hugging Face Llama's ``k * cos + rotate_half(k) * sin`` with ``cat(freqs, freqs)``
    (``neox``), or GPT-J's ``rotate_every_two`` with ``repeat_interleave(freqs, 2)``; channels
    ``R..D-1`` unrotated (partial rotary). Angles in float64."""
    freqs = pos.to(torch.float64)[:, None] * inv_freq.to(torch.float64)[None, :]   # [N, R/2]
    rot, rest = k[..., :R], k[..., R:]
    if neox:
        emb = torch.cat([freqs, freqs], dim=-1)
        x1, x2 = rot[..., :R // 2], rot[..., R // 2:]
        turned = torch.cat([-x2, x1], dim=-1)
    else:
        emb = freqs.repeat_interleave(2, dim=-1)
        x1, x2 = rot[..., 0::2], rot[..., 1::2]
        turned = torch.stack([-x2, x1], dim=-1).flatten(-2)
    cos, sin = emb.cos()[:, None, :], emb.sin()[:, None, :]
    return torch.cat([rot * cos + turned * sin, rest], dim=-1)


@impls("rope_rotate")
@pytest.mark.parametrize("rotary", ["full", "partial"])
def test_rope_moves_keys_between_positions(impl, rotary, monkeypatch):
    """A key stored at position p, rotated by d, is the key computed at p + d (float32 cache)."""
    backend, dev = runnable("rope_rotate", impl, monkeypatch)
    g = gen(5)
    N, H, D = 17, 4, 64
    R = D if rotary == "full" else 32
    freq = inv_freq_of(R, 500000.0)
    k0 = torch.randn(N, H, D, generator=g, dtype=torch.float64)
    p = torch.randint(0, 131072, (N,), generator=g)
    d = torch.randint(-131071, 131072, (N,), generator=g)
    d = torch.where(p + d < 0, -d, d)
    for neox in (True, False):
        stored = hf_rope(k0, p, freq, R, neox).float()
        want = hf_rope(k0, p + d, freq, R, neox).float()
        got = ops.rope_rotate(stored.to(dev), d.to(dev), freq.to(dev), neox=neox, rotary_dim=R,
                              backend=backend)
        assert_close(got, want, (2e-5, 2e-5), f"neox={neox} R={R}")
        # the other pairing is another function (the test can fail)
        other = ops.rope_rotate(stored.to(dev), d.to(dev), freq.to(dev), neox=not neox,
                                rotary_dim=R, backend=backend)
        assert not torch.allclose(other.cpu(), want, atol=1e-2)


# ---------------------------------------------------------------------------------------------
# kv_deviation: equivalence

DEVIATION_SHAPES = [(1, 1, 1), (7, 3, 16), (13, 1, 10), (31, 5, 64)]
DEVIATION_LAYOUTS = {"contiguous": ("contiguous",) * 4,
                     "mixed": ("transposed", "sliced", "paged", "channels_outer"),
                     "paged": ("paged", "sliced", "paged", "sliced")}


@impls("kv_deviation")
@pytest.mark.parametrize("layouts", list(DEVIATION_LAYOUTS))
@pytest.mark.parametrize("dtype", FLOATS, ids=FLOAT_IDS)
def test_kv_deviation(impl, dtype, layouts, monkeypatch):
    backend, dev = runnable("kv_deviation", impl, monkeypatch)
    g = gen(6)
    for N, H, D in DEVIATION_SHAPES:
        bases = [make_base(lay, N, H, D, g, dtype, dev) for lay in DEVIATION_LAYOUTS[layouts]]
        views = [view_of(lay, b) for lay, b in zip(DEVIATION_LAYOUTS[layouts], bases)]
        k_new, v_new, k_old, v_old = views
        if N > 2:                       # close and identical rows, a NaN, an infinity
            k_old[1] = k_new[1]
            v_old[1] = v_new[1]
            k_old[2] = (k_new[2].float() + 0.01).to(dtype)
            k_new[N - 1, 0, 0] = float("nan")
            v_old[N - 2, H - 1, D - 1] = float("inf")
        originals = [b.clone() for b in bases]
        got = compare("kv_deviation",
                      lambda b: ops.kv_deviation(k_new, v_new, k_old, v_old, backend=b),
                      backend, dtype,
                      check=lambda got, want: assert_close(got, want, DEVIATION_TOL,
                                                           f"N={N} H={H} D={D} {layouts}"))
        assert got.dtype == torch.float32 and got.shape == (N,)
        if N > 2:
            assert got[1] == 0 and torch.isnan(got[N - 1]) and torch.isinf(got[N - 2])
        for b, o in zip(bases, originals):
            assert same_bits(b, o), "an input was modified"


def test_kv_deviation_reference_formula():
    g = gen(7)
    k_new, v_new, k_old, v_old = (torch.randn(5, 3, 8, generator=g, dtype=torch.float64)
                                  for _ in range(4))
    want = torch.tensor([sum(float((k_new[n, h, d] - k_old[n, h, d]) ** 2
                                   + (v_new[n, h, d] - v_old[n, h, d]) ** 2)
                             for h in range(3) for d in range(8)) for n in range(5)],
                        dtype=torch.float64)
    got = ops.kv_deviation(*(t.float() for t in (k_new, v_new, k_old, v_old)),
                           backend="reference")
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------------------------------------
# Triton launch configurations: every head group, tile and chunk path on small shapes

@pytest.fixture
def triton_device(monkeypatch):
    """The device the Triton kernels run on here: CUDA, or CPU through the interpreter."""
    pytest.importorskip("triton")
    if not HAS_CUDA:
        import triton.language as tl
        from triton.runtime.jit import JITFunction

        if isinstance(tl.sum, JITFunction):
            pytest.skip("triton was imported natively in this process (no interpreter)")
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    dispatch._reset_for_tests()
    return "cuda" if HAS_CUDA else "cpu"


@pytest.mark.parametrize("config", [dict(rope_tile=16, rope_heads=2, tail_chunk=4),
                                    dict(rope_tile=8, rope_heads=1),
                                    dict(deviation_tile=16, deviation_chunk=8)],
                         ids=["small-tiles", "one-head", "deviation-chunks"])
def test_triton_launch_configs(triton_device, config):
    from ucm.fast.triton import blend as tb
    from ucm.reference import blend as rb

    launch = tb.LaunchConfig(**config)
    dev = triton_device
    g = gen(8)
    N, H, D, R = 19, 5, 20, 12
    freq = inv_freq_of(R).to(dev)
    for dtype in (torch.float32, torch.bfloat16):
        for layout in ("contiguous", "channels_outer"):
            x = view_of(layout, make_base(layout, N, H, D, g, dtype, dev))
            delta = deltas(N, g, torch.int64, dev)
            for neox in (True, False):
                got = tb.rope_rotate(x, delta, freq, neox=neox, rotary_dim=R, launch=launch)
                want = rb.rope_rotate(x, delta, freq, neox=neox, rotary_dim=R)
                assert_close(got, want, ROPE_TOL[dtype], f"{config} {layout} neox={neox}")
            kv = [view_of(layout, make_base(layout, N, H, D, g, dtype, dev)) for _ in range(4)]
            assert_close(tb.kv_deviation(*kv, launch=launch), rb.kv_deviation(*kv),
                         DEVIATION_TOL, f"{config} {layout}")


@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device (tensors of more than 2^31 elements)")
def test_int64_offsets_cuda():
    """Element offsets past 2^31 (channels outermost: channel stride N * H): the Triton kernels
    address them with int64 offsets."""
    N, H, D = 1 << 22, 8, 66                     # 2.2e9 elements of bfloat16
    base = torch.empty((D, H, N), dtype=torch.bfloat16, device="cuda").normal_()
    x = base.permute(2, 1, 0)
    assert x.stride(2) * (D - 1) > 2 ** 31
    delta = torch.randint(-131071, 131072, (N,), device="cuda")
    freq = inv_freq_of(64).cuda()
    rows = torch.tensor([0, 1, N // 2, N - 1], device="cuda")
    y = ops.rope_rotate(x, delta, freq, rotary_dim=64, backend="triton")
    want = ops.rope_rotate(x[rows], delta[rows], freq, rotary_dim=64, backend="reference")
    assert_close(y[rows], want, ROPE_TOL[torch.bfloat16], "int64 offsets")
    ops.rope_rotate(x, delta, freq, rotary_dim=64, out=x, backend="triton")     # in place
    assert torch.equal(x[rows], y[rows])
    del y
    other = base.flip(2).permute(2, 1, 0)        # another [N, H, D] view with large offsets
    dev = ops.kv_deviation(x, other, other, x, backend="triton")
    want = ops.kv_deviation(x[rows], other[rows], other[rows], x[rows], backend="reference")
    assert_close(dev[rows], want, DEVIATION_TOL, "int64 offsets")


# ---------------------------------------------------------------------------------------------
# select_recompute

def oracle_select(deviation, ratio, forced):
    """Brute force: sort the unforced tokens by (-deviation, index), NaN as +inf."""
    dev = [math.inf if math.isnan(v) else v for v in deviation.tolist()]
    flags = forced.tolist()
    free = [n for n in range(len(dev)) if not flags[n]]
    k = min(len(free), math.ceil(round(ratio * len(free), 9)))
    top = sorted(free, key=lambda n: (-dev[n], n))[:k]
    return sorted(set(top) | {n for n in range(len(dev)) if flags[n]})


@pytest.mark.parametrize("device", devices())
def test_select_recompute_oracle(device):
    g = gen(9)
    for trial in range(60):
        N = int(torch.randint(1, 40, (1,), generator=g))
        # integer-valued deviations: many ties; NaN, +-inf
        dev = torch.randint(0, 6, (N,), generator=g).double()
        special = torch.rand(N, generator=g)
        dev[special < 0.1] = float("nan")
        dev[(special >= 0.1) & (special < 0.15)] = float("inf")
        dev[(special >= 0.15) & (special < 0.2)] = float("-inf")
        forced = torch.rand(N, generator=g) < (trial % 4) / 4
        ratio = [0.0, 1.0, 0.3, 0.15, 0.5, 0.7][trial % 6]
        for dtype in (torch.float32, torch.float64, torch.bfloat16):
            d = dev.to(dtype).to(device)
            got = ops.select_recompute(d, ratio, forced.to(device))
            assert got.dtype == torch.int64 and got.device == d.device
            assert got.tolist() == oracle_select(d.cpu(), ratio, forced), (trial, dtype)


def test_select_recompute_cases():
    forced = torch.tensor([False, True, False, False, False, True, False, False, False, False,
                           False, False])
    dev = torch.arange(12, dtype=torch.float32)
    assert ops.select_recompute(dev, 0.0, forced).tolist() == [1, 5]
    assert ops.select_recompute(dev, 1.0, forced).tolist() == list(range(12))
    # 10 unforced tokens, 0.3 of them: 3 (0.3 * 10 is 3.0000000000000004 in float64)
    assert ops.select_recompute(dev, 0.3, forced).tolist() == [1, 5, 9, 10, 11]
    assert ops.select_recompute(dev, 0.31, forced).tolist() == [1, 5, 8, 9, 10, 11]
    # ties to the lower index; NaN above everything
    flat = torch.ones(12)
    assert ops.select_recompute(flat, 0.2, forced).tolist() == [0, 1, 2, 5]
    flat[7] = float("nan")
    flat[3] = 1e30
    assert ops.select_recompute(flat, 0.2, forced).tolist() == [1, 3, 5, 7]
    none = torch.zeros(12, dtype=torch.bool)
    assert ops.select_recompute(flat, 0.1, none).tolist() == [3, 7]
    assert ops.select_recompute(torch.zeros(0), 0.5, torch.zeros(0, dtype=torch.bool)).numel() == 0


# ---------------------------------------------------------------------------------------------
# registry, errors, empty inputs

def test_registered():
    info = dispatch.backend_info()["ops"]
    for op in ("rope_rotate", "kv_deviation"):
        assert set(info[op]["implementations"]) == {"reference", "numba", "triton"}
    assert set(info["select_recompute"]["implementations"]) == {"reference"}


def test_auto_on_cpu_tensors(monkeypatch):
    pytest.importorskip("numba")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.delenv("UCM_BACKEND", raising=False)
    dispatch._reset_for_tests()
    x = torch.zeros(2, 1, 4)
    impl, _ = dispatch.select("rope_rotate", None, (x,), {})
    assert impl.name == "numba"
    with pytest.raises(dispatch.BackendUnavailableError):
        dispatch.select("rope_rotate", "triton", (x,), {})


def test_empty_inputs():
    freq = inv_freq_of(8)
    for backend in ("reference", "numba"):
        y = ops.rope_rotate(torch.zeros(0, 2, 8), torch.zeros(0, dtype=torch.int64), freq,
                            backend=backend)
        assert y.shape == (0, 2, 8) and y.dtype == torch.float32
        out = torch.zeros(0, 2, 8, dtype=torch.bfloat16)
        assert ops.rope_rotate(out, torch.zeros(0, dtype=torch.int32), freq, out=out,
                               backend=backend) is out
        e = torch.zeros(0, 3, 4, dtype=torch.float16)
        d = ops.kv_deviation(e, e, e, e, backend=backend)
        assert d.shape == (0,) and d.dtype == torch.float32


def _bad_calls():
    x = torch.zeros(4, 2, 8)
    d = torch.zeros(4, dtype=torch.int64)
    f = inv_freq_of(8)
    meta = torch.device("meta")
    k = torch.zeros(4, 2, 8, dtype=torch.bfloat16)
    dev = torch.zeros(6)
    forced = torch.zeros(6, dtype=torch.bool)
    return [
        ("x: expected a torch.Tensor", lambda: ops.rope_rotate(x.numpy(), d, f)),
        ("x: expected dtype", lambda: ops.rope_rotate(x.double(), d, f)),
        ("x: expected 3 dimensions", lambda: ops.rope_rotate(x[0], d, f)),
        ("x: expected [num_tokens, num_heads >= 1", lambda: ops.rope_rotate(x[:, :0], d, f)),
        ("delta: expected dtype", lambda: ops.rope_rotate(x, d.float(), f)),
        ("delta: expected 1 dimensions", lambda: ops.rope_rotate(x, d[None], f)),
        ("delta: expected shape [4]", lambda: ops.rope_rotate(x, d[:3], f)),
        ("delta: on meta", lambda: ops.rope_rotate(x, d.to(meta), f)),
        ("inv_freq: expected dtype", lambda: ops.rope_rotate(x, d, f.half())),
        ("inv_freq: expected shape [4]", lambda: ops.rope_rotate(x, d, f[:3])),
        ("inv_freq: expected shape [2]", lambda: ops.rope_rotate(x, d, f, rotary_dim=4)),
        ("inv_freq: on meta", lambda: ops.rope_rotate(x, d, f.to(meta))),
        ("rotary_dim: expected an even int in [2, head_dim=8]",
         lambda: ops.rope_rotate(x, d, f, rotary_dim=5)),
        ("rotary_dim: expected an even int in [2, head_dim=8]",
         lambda: ops.rope_rotate(x, d, f, rotary_dim=10)),
        ("rotary_dim: expected an even int in [2, head_dim=8]",
         lambda: ops.rope_rotate(x, d, f, rotary_dim=0)),
        ("rotary_dim: expected an int or None", lambda: ops.rope_rotate(x, d, f, rotary_dim=8.0)),
        ("rotary_dim: expected an int or None", lambda: ops.rope_rotate(x, d, f, rotary_dim=True)),
        ("rotary_dim: head_dim 7 is odd", lambda: ops.rope_rotate(x[..., :7], d, f[:3])),
        ("neox: expected a bool", lambda: ops.rope_rotate(x, d, f, neox=1)),
        ("out: expected dtype", lambda: ops.rope_rotate(x, d, f, out=k)),
        ("out: expected shape [4, 2, 8]", lambda: ops.rope_rotate(x, d, f, out=x[:3])),
        ("out: on meta", lambda: ops.rope_rotate(x, d, f, out=x.to(meta))),
        ("out: expected a torch.Tensor", lambda: ops.rope_rotate(x, d, f, out=x.numpy())),
        ("out: its elements overlap", lambda: ops.rope_rotate(
            x, d, f, out=torch.zeros(1, 2, 8).expand(4, 2, 8))),
        ("k_new: expected dtype", lambda: ops.kv_deviation(k.long(), k, k, k)),
        ("k_new: expected 3 dimensions", lambda: ops.kv_deviation(k[0], k, k, k)),
        ("v_new: dtype torch.float32 differs from k_new's torch.bfloat16",
         lambda: ops.kv_deviation(k, k.float(), k, k)),
        ("k_old: expected shape [4, 2, 8]", lambda: ops.kv_deviation(k, k, k[:, :1], k)),
        ("v_old: on meta", lambda: ops.kv_deviation(k, k, k, k.to(meta))),
        ("v_old: expected a torch.Tensor", lambda: ops.kv_deviation(k, k, k, None)),
        *[("ratio: expected a real number in [0, 1]",
           lambda r=r: ops.select_recompute(dev, r, forced))
          for r in (1.5, -0.1, float("nan"), True, "0.5", None)],
        ("forced: expected dtype torch.bool", lambda: ops.select_recompute(dev, 0.5, forced.int())),
        ("forced: expected shape [6]", lambda: ops.select_recompute(dev, 0.5, forced[:5])),
        ("forced: on meta", lambda: ops.select_recompute(dev, 0.5, forced.to(meta))),
        ("deviation: expected 1 dimensions", lambda: ops.select_recompute(dev[None], 0.5, forced)),
        ("deviation: expected dtype", lambda: ops.select_recompute(dev.long(), 0.5, forced)),
    ]


@pytest.mark.parametrize("fragment,call", _bad_calls(),
                         ids=[f"{i}-{c[0].split(':')[0]}" for i, c in enumerate(_bad_calls())])
def test_bad_input(fragment, call):
    with pytest.raises(ValueError, match=re.escape(fragment)):
        call()


def test_numba_runs_without_jit():
    """Convention: the Numba code also runs as plain Python (NUMBA_DISABLE_JIT=1)."""
    pytest.importorskip("numba")
    code = (
        "import torch; from ucm.blend import ops\n"
        "g = torch.Generator().manual_seed(0)\n"
        "f = (1.0 / 10000 ** (torch.arange(0, 6, 2, dtype=torch.float64) / 6)).float()\n"
        "d = torch.tensor([0, 5, -131071])\n"
        "bad = 0\n"
        "for dt, tol in ((torch.float32, 1e-5), (torch.float16, 2e-3), (torch.bfloat16, 1.6e-2)):\n"
        "    x = torch.randn(3, 2, 8, generator=g).to(dt)\n"
        "    for neox in (True, False):\n"
        "        a = ops.rope_rotate(x, d, f, rotary_dim=6, neox=neox, backend='numba')\n"
        "        b = ops.rope_rotate(x, d, f, rotary_dim=6, neox=neox, backend='reference')\n"
        "        bad += not torch.allclose(a.float(), b.float(), atol=1e-5, rtol=tol)\n"
        "    k = [torch.randn(3, 2, 8, generator=g).to(dt) for _ in range(4)]\n"
        "    a = ops.kv_deviation(*k, backend='numba')\n"
        "    b = ops.kv_deviation(*k, backend='reference')\n"
        "    bad += not torch.allclose(a, b, rtol=3e-5)\n"
        "print('bad', bad)\n")
    r = run_python(code, env={"NUMBA_DISABLE_JIT": "1"})
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["bad", "0"], r.stdout
