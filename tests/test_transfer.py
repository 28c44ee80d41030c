"""KV transfer ops (gather_blocks / scatter_blocks): bit-exact against an independent oracle
over the KV layouts engines hand out (the reference over every layout and dtype, the other
implementations on layer subsets, awkward sizes and int64 offsets; test_equiv_transfer.py holds
every implementation to the reference per layout and dtype), with no stray writes, -1 rows
skipped, and clear errors for bad input.

The oracle never uses the layout plan: the staged bytes of block ``b`` of a view are
``view[b]`` with its dims ordered by stride, made contiguous (its bytes in address order), and
the views of a row come layer by layer, in view order inside a layer.

Triton runs natively on CUDA tensors when a GPU is present; on CPU tensors it runs through the
Triton interpreter (``TRITON_INTERPRET=1`` set per test, small shapes).
"""
import importlib.util

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import ucm  # noqa: E402
from ucm import dispatch  # noqa: E402
from conftest import INTERPRETER_PROCESS  # noqa: E402
from ucm.layout import MAX_RUNS_PER_VIEW, KVLayout  # noqa: E402

SENTINEL = 0xA5
HAS_CUDA = torch.cuda.is_available()
HAS_TRITON = importlib.util.find_spec("triton") is not None

# ---------------------------------------------------------------------------------------------
# implementations x devices


def _impl_params():
    out = []
    for impl in ("reference", "native", "triton"):
        marks = [pytest.mark.triton_interpreter] if impl == "triton" else []
        out.append(pytest.param(impl, "cpu", id=f"{impl}-cpu", marks=marks))
    if HAS_CUDA:
        for impl in ("reference", "triton"):
            out.append(pytest.param(impl, "cuda", id=f"{impl}-cuda"))
    return out


IMPLS = _impl_params()


@pytest.fixture
def use_impl(monkeypatch):
    """Make (impl, device) runnable: Triton on CPU goes through the interpreter; skip what this
    machine cannot run (the native engine's absence fails in CI through UCM_REQUIRE_NATIVE)."""
    def setup(impl, device):
        if impl == "triton":
            if not HAS_TRITON:
                pytest.skip("triton is not installed")
            if device == "cpu":
                if not INTERPRETER_PROCESS:  # (a test not marked triton_interpreter: see conftest)
                    pytest.skip("Triton on CPU tensors runs in the Triton-interpreter process")
                monkeypatch.setenv("TRITON_INTERPRET", "1")
            dispatch._reset_for_tests()
        [entry] = [i for i in dispatch.implementations("gather_blocks") if i.name == impl]
        ok, why = entry.available(dispatch.detect_platform())
        if not ok:
            pytest.skip(f"{impl}: {why}")
        return impl
    return setup


# ---------------------------------------------------------------------------------------------
# KV layouts: each builder returns (backing buffers, views with the block dim first, layer ids)

def _fa(dtype, B, N, H, D, L, dev):
    """CUDA FlashAttention per layer [2, B, N, H, D]: pass kv.unbind(0)."""
    bufs = [torch.empty(2, B, N, H, D, dtype=dtype, device=dev) for _ in range(L)]
    return bufs, [v for b in bufs for v in b.unbind(0)], [l for l in range(L) for _ in range(2)]


def _fa_packed(dtype, B, N, H, D, L, dev):
    """One allocation [L, 2, B, N, H, D]: strided views of one packed tensor across layers."""
    buf = torch.empty(L, 2, B, N, H, D, dtype=dtype, device=dev)
    return [buf], [buf[l, kv] for l in range(L) for kv in range(2)], [l for l in range(L) for _ in range(2)]


def _flashinfer(dtype, B, N, H, D, L, dev):
    """FlashInfer per layer [B, 2, N, H, D]."""
    bufs = [torch.empty(B, 2, N, H, D, dtype=dtype, device=dev) for _ in range(L)]
    return bufs, bufs, list(range(L))


def _cpu(dtype, B, N, H, D, L, dev):
    """vLLM 0.32 CPU per layer [B, H, N, 2 * D]."""
    bufs = [torch.empty(B, H, N, 2 * D, dtype=dtype, device=dev) for _ in range(L)]
    return bufs, bufs, list(range(L))


def _padded(dtype, B, N, H, D, L, dev):
    """Dense pages with padding between blocks ([B, page + 24 elements], sliced)."""
    page = N * H * D
    bufs = [torch.empty(B, page + 24, dtype=dtype, device=dev) for _ in range(2 * L)]
    return bufs, [b[:, :page].unflatten(1, (N, H, D)) for b in bufs], [l for l in range(L) for _ in range(2)]


def _heads_slice(dtype, B, N, H, D, L, dev):
    """FA views restricted to the upper half of the heads: N runs per block."""
    bufs = [torch.empty(2, B, N, 2 * H, D, dtype=dtype, device=dev) for _ in range(L)]
    return bufs, [v[:, :, H:] for b in bufs for v in b.unbind(0)], [l for l in range(L) for _ in range(2)]


def _mixed(dtype, B, N, H, D, L, dev):
    """A quantized-cache shape: per layer an FA K/V pair plus a float32 [B, H] scale tensor."""
    bufs, views, layers = [], [], []
    for l in range(L):
        kv = torch.empty(2, B, N, H, D, dtype=dtype, device=dev)
        scale = torch.empty(H, B, dtype=torch.float32, device=dev).t()  # block dim strided
        bufs += [kv, scale]
        views += [*kv.unbind(0), scale]
        layers += [l, l, l]
    return bufs, views, layers


def _vllm(order):
    """vLLM 0.32 generic per-layer views: one flat int8 buffer as a 5-D [L, B, H, N, C] byte
    tensor whose strides follow ``order`` (physical order of the logical axes, as in
    ``KVCacheLayout``), each layer a 4-D [B, H, N, C] view reinterpreted as ``dtype``."""
    def build(dtype, B, N, H, D, L, dev):
        esize = torch.empty(0, dtype=dtype).element_size()
        shape = (L, B, H, N, 2 * D * esize)
        strides, cur = [0] * 5, 1
        for dim in reversed(order):
            strides[dim] = cur
            cur *= shape[dim]
        raw = torch.empty(cur + 64, dtype=torch.int8, device=dev)
        v5 = torch.as_strided(raw, shape, strides, 64)  # offset: data not at the start
        return [raw], [v5[l].view(dtype) for l in range(L)], list(range(L))
    return build


LAYOUTS = {
    "fa": _fa, "fa_packed": _fa_packed, "flashinfer": _flashinfer, "cpu_BHN2D": _cpu,
    "padded": _padded, "heads_slice": _heads_slice, "mixed": _mixed,
    "vllm_LBHNC": _vllm((0, 1, 2, 3, 4)),   # block = one dense page
    "vllm_LHBNC": _vllm((0, 2, 1, 3, 4)),   # H outer: a block is H runs
    "vllm_BLNHC": _vllm((1, 0, 3, 2, 4)),   # layers interleaved per block, N before H
    "vllm_BHLNC": _vllm((1, 2, 0, 3, 4)),   # block outer, then H, then layers: H runs, interleaved
}

DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.int8]
if hasattr(torch, "float8_e4m3fn"):
    DTYPES.append(torch.float8_e4m3fn)
DTYPE_IDS = [str(d).replace("torch.", "") for d in DTYPES]


class Cache:
    """A KV cache built by a layout builder; compares and fills its backing bytes."""

    def __init__(self, layout_name, dtype, device, B=7, N=16, H=2, D=64, L=2):
        self.bufs, self.views, self.layer_of_view = LAYOUTS[layout_name](dtype, B, N, H, D, L, device)
        self.B, self.L = B, L
        self.layout = KVLayout.from_views(self.views, self.layer_of_view)

    def raw(self):
        return [b.detach().reshape(-1).view(torch.uint8) if b.is_contiguous() else
                torch.empty(0, dtype=torch.uint8, device=b.device).set_(b.untyped_storage())
                for b in self.bufs]

    def fill_random(self, gen):
        for r in self.raw():
            r.copy_(torch.randint(0, 256, r.shape, generator=gen, dtype=torch.uint8).to(r.device))
        return self

    def fill(self, value):
        for r in self.raw():
            r.fill_(value)
        return self

    def snapshot(self):
        return [r.clone() for r in self.raw()]

    def equals(self, snapshot):
        return all(torch.equal(a, b) for a, b in zip(self.raw(), snapshot))


def _order(blk):
    return sorted(range(blk.dim()), key=lambda d: blk.stride(d), reverse=True)


def oracle_block_bytes(view, b):
    """Bytes of block b of view, in address order (independent of the layout plan)."""
    blk = view[b]
    return blk.permute(_order(blk)).contiguous().reshape(-1).view(torch.uint8)


def oracle_write_block(view, b, data):
    blk = view[b]
    p = blk.permute(_order(blk))
    p.copy_(data.contiguous().view(view.dtype).reshape(p.shape))


def oracle_views(cache, layers):
    layers = range(cache.L) if layers is None else layers
    return [i for l in layers for i, lv in enumerate(cache.layer_of_view) if lv == l]


def oracle_row(cache, b, layers=None):
    return torch.cat([oracle_block_bytes(cache.views[i], b) for i in oracle_views(cache, layers)])


def oracle_scatter(cache, staging, indices, layers=None):
    for row, b in enumerate(indices):
        if b < 0:
            continue
        pos = 0
        for i in oracle_views(cache, layers):
            n = oracle_block_bytes(cache.views[i], b).numel()
            oracle_write_block(cache.views[i], b, staging[row, pos:pos + n])
            pos += n


@pytest.fixture
def gen():
    return torch.Generator().manual_seed(1234)


def _random_bytes(gen, shape, device):
    return torch.randint(0, 256, shape, generator=gen, dtype=torch.uint8).to(device)


GATHER_IDX = [5, -1, 0, 6, 5, 2]   # -1 skipped; a repeated block is fine for a gather
SCATTER_IDX = [5, -1, 0, 6, 2]     # unique


# ---------------------------------------------------------------------------------------------
# bit-exactness and no stray writes

@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64], ids=["i32", "i64"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("layout_name", list(LAYOUTS))
@pytest.mark.parametrize("impl,device", [p for p in IMPLS if p.values[0] == "reference"])
def test_gather_scatter_bit_exact(impl, device, layout_name, dtype, index_dtype, use_impl, gen):
    backend = use_impl(impl, device)
    cache = Cache(layout_name, dtype, device).fill_random(gen)
    lay = cache.layout
    before = cache.snapshot()

    idx = torch.tensor(GATHER_IDX, dtype=index_dtype, device=device)
    staging = torch.full((len(GATHER_IDX), lay.block_bytes), SENTINEL, dtype=torch.uint8, device=device)
    ucm.gather_blocks(lay, idx, staging, backend=backend)
    for row, b in enumerate(GATHER_IDX):
        want = oracle_row(cache, b) if b >= 0 else torch.full_like(staging[row], SENTINEL)
        assert torch.equal(staging[row], want), f"row {row} (block {b})"
    assert cache.equals(before), "gather wrote into the cache"

    # scatter random rows into a sentinel-filled cache; everything else must stay sentinel
    target = Cache(layout_name, dtype, device).fill(SENTINEL)
    expected = Cache(layout_name, dtype, device).fill(SENTINEL)
    src = _random_bytes(gen, (len(SCATTER_IDX), lay.block_bytes), device)
    src_before = src.clone()
    ucm.scatter_blocks(target.layout, src, torch.tensor(SCATTER_IDX, dtype=index_dtype, device=device),
                       backend=backend)
    oracle_scatter(expected, src, SCATTER_IDX)
    assert target.equals(expected.snapshot())
    assert torch.equal(src, src_before), "scatter wrote into staging"


@pytest.mark.parametrize("layout_name", ["fa", "vllm_LHBNC", "vllm_BLNHC", "mixed"])
@pytest.mark.parametrize("impl,device", IMPLS)
def test_layer_subsets(impl, device, layout_name, use_impl, gen):
    backend = use_impl(impl, device)
    cache = Cache(layout_name, torch.float16, device, L=3).fill_random(gen)
    lay = cache.layout
    idx = torch.tensor([4, -1, 1], device=device)
    full = torch.zeros(3, lay.block_bytes, dtype=torch.uint8, device=device)
    ucm.gather_blocks(lay, idx, full, backend="reference")
    assert sum(lay.shard_bytes(l) for l in range(3)) == lay.block_bytes
    for layers in ([1], [2, 0], 2, [0, 1, 2]):
        sel = [layers] if isinstance(layers, int) else layers
        part = torch.full((3, lay.row_bytes(layers)), SENTINEL, dtype=torch.uint8, device=device)
        ucm.gather_blocks(lay, idx, part, layers, backend=backend)
        want = torch.cat([full[:, lay.shard_offset(l):lay.shard_offset(l) + lay.shard_bytes(l)]
                          for l in sel], dim=1)
        assert torch.equal(part[[0, 2]], want[[0, 2]])
        assert bool((part[1] == SENTINEL).all())
        for r, b in ((0, 4), (2, 1)):
            assert torch.equal(part[r], oracle_row(cache, b, sel))

    # column slices of full rows (one layer's bytes of each staged block, rows a block apart):
    # the same bytes as a contiguous staging of that layer, both ways
    for l in range(3):
        a, n = lay.shard_offset(l), lay.shard_bytes(l)
        wide = torch.full((3, lay.block_bytes), SENTINEL, dtype=torch.uint8, device=device)
        ucm.gather_blocks(lay, idx, wide[:, a:a + n], [l], backend=backend)
        assert torch.equal(wide[[0, 2], a:a + n], full[[0, 2], a:a + n])
        assert bool((wide[:, :a] == SENTINEL).all()) and bool((wide[:, a + n:] == SENTINEL).all())
        assert bool((wide[1] == SENTINEL).all())
        dst = Cache(layout_name, torch.float16, device, L=3).fill(SENTINEL)
        want = Cache(layout_name, torch.float16, device, L=3).fill(SENTINEL)
        ucm.scatter_blocks(dst.layout, full[:, a:a + n], [6, -1, 2], layers=[l], backend=backend)
        oracle_scatter(want, full[:, a:a + n].contiguous(), [6, -1, 2], layers=[l])
        assert dst.equals(want.snapshot()), f"layer {l}"


@pytest.mark.parametrize("layout_name", ["fa", "vllm_LHBNC", "mixed"])
@pytest.mark.parametrize("impl,device", [p for p in IMPLS if p.values[0] != "triton"])
def test_layer_scatter_is_scatter_blocks_a_layer_at_a_time(impl, device, layout_name, use_impl,
                                                           gen):
    # the load thread's prepared copy: layer by layer, in any order, the same bytes as one
    # scatter_blocks of whole rows, -1 rows skipped, nothing else written
    from ucm.transfer import layer_scatter

    backend = use_impl(impl, device)
    lay = Cache(layout_name, torch.float16, device, L=3).layout
    src = _random_bytes(gen, (len(SCATTER_IDX), lay.block_bytes), device)
    want = Cache(layout_name, torch.float16, device, L=3).fill(SENTINEL)
    ucm.scatter_blocks(want.layout, src, SCATTER_IDX, backend="reference")
    got = Cache(layout_name, torch.float16, device, L=3).fill(SENTINEL)
    run = layer_scatter(got.layout, src, torch.tensor(SCATTER_IDX, device=device), backend=backend)
    for k in (1, 2, 0):
        run(k)
    assert got.equals(want.snapshot())
    with pytest.raises(ValueError, match="staging"):
        layer_scatter(got.layout, src[:, :8], torch.tensor(SCATTER_IDX, device=device))

    # scatter one layer: only that layer's views change
    target = Cache(layout_name, torch.float16, device, L=3).fill(SENTINEL)
    expected = Cache(layout_name, torch.float16, device, L=3).fill(SENTINEL)
    rows = _random_bytes(gen, (2, lay.shard_bytes(1)), device)
    ucm.scatter_blocks(target.layout, rows, [6, 0], layers=[1], backend=backend)
    oracle_scatter(expected, rows, [6, 0], layers=[1])
    assert target.equals(expected.snapshot())


SHAPES = [  # (num_blocks, block_size, heads, head_dim, layers): 1 block, primes, block_size 1
    pytest.param((1, 16, 2, 64, 1), id="B1-N16-D64"),
    pytest.param((13, 1, 3, 128, 3), id="B13-N1-H3-D128"),
    pytest.param((5, 3, 1, 5, 2), id="B5-N3-D5-odd"),
    pytest.param((2, 16, 8, 128, 2), id="B2-N16-H8-D128"),
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.int8], ids=["bf16", "int8"])
@pytest.mark.parametrize("layout_name", ["fa", "vllm_LHBNC", "heads_slice"])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("impl,device", IMPLS)
def test_awkward_sizes(impl, device, shape, layout_name, dtype, use_impl, gen):
    backend = use_impl(impl, device)
    B, N, H, D, L = shape
    cache = Cache(layout_name, dtype, device, B=B, N=N, H=H, D=D, L=L).fill_random(gen)
    before = cache.snapshot()
    idx = [B - 1, -1, 0] if B > 1 else [0, -1]
    staging = torch.full((len(idx), cache.layout.block_bytes), SENTINEL, dtype=torch.uint8, device=device)
    ucm.gather_blocks(cache.layout, idx, staging, backend=backend)
    for r, b in enumerate(idx):
        assert torch.equal(staging[r], oracle_row(cache, b) if b >= 0 else
                           torch.full_like(staging[r], SENTINEL))
    cache.fill(SENTINEL)
    ucm.scatter_blocks(cache.layout, staging, idx, backend=backend)
    fresh = Cache(layout_name, dtype, device, B=B, N=N, H=H, D=D, L=L).fill(SENTINEL)
    for i, v in enumerate(fresh.views):
        for b in range(B):
            if b in idx:
                oracle_write_block(v, b, oracle_block_bytes(cache.views[i], b))
    assert cache.equals(fresh.snapshot())
    del before


def test_triton_small_pieces_and_odd_alignment(use_impl, monkeypatch, gen):
    """The Triton kernel with a fixed, deliberately tiny configuration: runs split into many
    pieces and tiles with partial tails, 1-, 2- and 4-byte copy words."""
    backend = use_impl("triton", "cuda" if HAS_CUDA else "cpu")
    device = "cuda" if HAS_CUDA else "cpu"
    from ucm.fast.triton import transfer as tt

    monkeypatch.setattr(tt, "PIECE_BYTES", 112)
    monkeypatch.setattr(tt, "TILE_BYTES", 32)
    for dtype, D in ((torch.int8, 5), (torch.float16, 3), (torch.float32, 7), (torch.bfloat16, 64)):
        cache = Cache("fa", dtype, device, B=4, N=3, H=2, D=D, L=2).fill_random(gen)
        idx = [3, -1, 1]
        staging = torch.full((3, cache.layout.block_bytes), SENTINEL, dtype=torch.uint8, device=device)
        ucm.gather_blocks(cache.layout, idx, staging, backend=backend)
        for r, b in enumerate(idx):
            assert torch.equal(staging[r], oracle_row(cache, b) if b >= 0 else
                               torch.full_like(staging[r], SENTINEL))
        dst = Cache("fa", dtype, device, B=4, N=3, H=2, D=D, L=2).fill(SENTINEL)
        ucm.scatter_blocks(dst.layout, staging, idx, backend=backend)
        for i, v in enumerate(dst.views):
            for b in range(4):
                got = oracle_block_bytes(v, b)
                assert torch.equal(got, oracle_block_bytes(cache.views[i], b)) if b in idx else \
                    bool((got == SENTINEL).all())


@pytest.mark.parametrize("impl", ["reference", "native",
                                  pytest.param("triton", marks=pytest.mark.triton_interpreter)])
def test_offsets_beyond_4gib(impl, use_impl, gen):
    """Block offsets past 2**32 bytes: a 5 GB virtual cache (only touched pages are committed)."""
    backend = use_impl(impl, "cpu")
    B, stride = 140_000, 36 << 10
    try:
        raw = torch.empty(B * stride, dtype=torch.uint8)
    except RuntimeError as exc:  # pragma: no cover - no address space
        pytest.skip(f"cannot reserve {B * stride} bytes: {exc}")
    views = [raw.as_strided((B, 64), (stride, 1)), raw.as_strided((B, 8, 16), (stride, 32, 1), 4096)]
    lay = KVLayout.from_views(views)
    blocks = [B - 1, 3, B // 2 + 17]
    for v in views:
        for b in blocks:
            oracle_write_block(v, b, _random_bytes(gen, (oracle_block_bytes(v, b).numel(),), "cpu"))
    staging = torch.empty(3, lay.block_bytes, dtype=torch.uint8)
    ucm.gather_blocks(lay, torch.tensor(blocks), staging, backend=backend)
    for r, b in enumerate(blocks):
        assert torch.equal(staging[r], torch.cat([oracle_block_bytes(v, b) for v in views]))
    back = _random_bytes(gen, staging.shape, "cpu")
    ucm.scatter_blocks(lay, back, [B - 2, -1, B - 1], backend=backend)
    assert torch.equal(torch.cat([oracle_block_bytes(v, B - 2) for v in views]), back[0])
    assert torch.equal(torch.cat([oracle_block_bytes(v, B - 1) for v in views]), back[2])


# ---------------------------------------------------------------------------------------------
# the layout plan

def test_layout_runs_and_shards():
    kv = torch.empty(2, 11, 16, 8, 128, dtype=torch.bfloat16)
    lay = KVLayout.from_views(list(kv.unbind(0)), layer_of_view=[0, 0])
    assert lay.num_layers == 1 and lay.block_bytes == 2 * 16 * 8 * 128 * 2
    off, ln = lay.view_runs(0)
    assert off.tolist() == [0] and ln.tolist() == [16 * 8 * 128 * 2]   # a dense page: one run
    assert lay.block_stride(1) == 16 * 8 * 128 * 2

    c = Cache("vllm_LHBNC", torch.bfloat16, "cpu", B=5, N=16, H=4, D=64, L=3)
    page = 16 * 2 * 64 * 2   # N * C bytes per head
    off, ln = c.layout.view_runs(1)
    assert ln.tolist() == [page] * 4 and off.tolist() == [h * 5 * page for h in range(4)]
    assert c.layout.shard_offset(2) == 2 * 4 * page and c.layout.shard_bytes(2) == 4 * page

    c = Cache("vllm_BLNHC", torch.bfloat16, "cpu", B=5, H=4, L=3)
    assert [len(c.layout.view_runs(i)[0]) for i in range(3)] == [1, 1, 1]   # dense per layer
    assert c.layout.row_bytes([2, 0]) == 2 * c.layout.shard_bytes(0)

    # layer ids need not be grouped: staging follows layer order, then view order
    a, b, d = (torch.empty(3, 4, dtype=torch.float32) for _ in range(3))
    lay = KVLayout.from_views([a, b, d], layer_of_view=[1, 0, 1])
    assert lay.shard_offset(0) == 0 and lay.shard_offset(1) == 16 and lay.block_bytes == 48
    assert "KVLayout(" in repr(lay)


def test_auto_picks_by_device(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.delenv("UCM_BACKEND", raising=False)      # automatic selection is the subject
    dispatch._reset_for_tests()
    kv = torch.zeros(2, 4, 2, 2, 8, dtype=torch.float16)
    lay = KVLayout.from_views(list(kv.unbind(0)))
    idx = torch.tensor([1, 2])
    staging = torch.empty(2, lay.block_bytes, dtype=torch.uint8)
    args = (lay, idx, staging, lay.select())
    impl, reason = dispatch.select("gather_blocks", None, args)
    native_ok = dispatch.implementations("gather_blocks")[1].available(dispatch.detect_platform())[0]
    assert impl.name == ("native" if native_ok else "reference"), reason
    if not HAS_CUDA:
        with pytest.raises(ucm.BackendUnavailableError, match="triton"):
            ucm.gather_blocks(lay, idx, staging, backend="triton")
    ucm.gather_blocks(lay, idx, staging, backend="fast" if native_ok else "reference")
    info = ucm.backend_info()["ops"]
    assert set(info["scatter_blocks"]["implementations"]) == {"reference", "native", "triton"}


# ---------------------------------------------------------------------------------------------
# bad input

def _lay(B=6):
    kv = torch.zeros(2, B, 4, 2, 8, dtype=torch.bfloat16)
    return KVLayout.from_views(list(kv.unbind(0)), layer_of_view=[0, 1])


def _stg(n, lay=None, **kw):
    lay = lay or _lay()
    return torch.zeros(n, lay.block_bytes, dtype=kw.get("dtype", torch.uint8), device=kw.get("device", "cpu"))


LAY = _lay()
BAD_OPS = [
    ("staging dtype", lambda b: ucm.gather_blocks(LAY, [1], _stg(1, dtype=torch.int8), backend=b), "staging.*uint8"),
    ("staging rows", lambda b: ucm.gather_blocks(LAY, [1, 2], _stg(1), backend=b), r"staging.*shape \[2, 256\]"),
    ("staging bytes", lambda b: ucm.gather_blocks(LAY, [1], torch.zeros(1, 100, dtype=torch.uint8), backend=b),
     "staging.*shape"),
    ("staging layers", lambda b: ucm.scatter_blocks(LAY, _stg(1), [1], layers=[1], backend=b), r"staging.*\[1, 128\]"),
    ("staging strided", lambda b: ucm.gather_blocks(LAY, [1], torch.zeros(1, 512, dtype=torch.uint8)[:, ::2], backend=b),
     "staging.*contiguous"),
    ("staging rows overlap", lambda b: ucm.gather_blocks(
        LAY, [1, 2], torch.zeros(600, dtype=torch.uint8).as_strided((2, 256), (100, 1)), backend=b),
     r"staging.*do not overlap.*stride\(0\) >= 256"),
    ("staging device", lambda b: ucm.gather_blocks(LAY, [1], _stg(1, device="meta"), backend=b), "staging.*meta"),
    ("staging type", lambda b: ucm.gather_blocks(LAY, [1], np.zeros((1, 256), np.uint8), backend=b),
     "staging.*torch.Tensor"),
    ("index high", lambda b: ucm.gather_blocks(LAY, [1, 6], _stg(2), backend=b), "block_indices.*6 out of range"),
    ("index -2", lambda b: ucm.scatter_blocks(LAY, _stg(1), [-2], backend=b), "block_indices.*-2"),
    ("index float", lambda b: ucm.gather_blocks(LAY, torch.tensor([1.0]), _stg(1), backend=b), "block_indices.*int"),
    ("index int16", lambda b: ucm.gather_blocks(LAY, torch.tensor([1], dtype=torch.int16), _stg(1), backend=b),
     "block_indices.*int32 or int64"),
    ("index 2-D", lambda b: ucm.gather_blocks(LAY, [[1]], _stg(1), backend=b), "block_indices.*1-D"),
    ("index device", lambda b: ucm.gather_blocks(LAY, torch.tensor([1], device="meta"), _stg(1), backend=b),
     "block_indices.*meta"),
    ("scatter duplicate", lambda b: ucm.scatter_blocks(LAY, _stg(2), [3, 3], backend=b), "block_indices.*twice"),
    ("layers range", lambda b: ucm.gather_blocks(LAY, [1], _stg(1), layers=[2], backend=b), "layers"),
    ("layers duplicate", lambda b: ucm.gather_blocks(LAY, [1], _stg(1), layers=[0, 0], backend=b), "layers.*duplicate"),
    ("layers empty", lambda b: ucm.gather_blocks(LAY, [1], _stg(1), layers=[], backend=b), "layers.*empty"),
    ("layout type", lambda b: ucm.gather_blocks("kv", [1], _stg(1), backend=b), "layout"),
]


@pytest.mark.parametrize("backend", ["reference", "native"])
@pytest.mark.parametrize("case", BAD_OPS, ids=[c[0] for c in BAD_OPS])
def test_bad_op_input(case, backend):
    _, fn, match = case
    with pytest.raises(ValueError, match=match):
        fn(backend)


def test_unknown_backend():
    with pytest.raises(ValueError, match="unknown backend"):
        ucm.gather_blocks(LAY, [1], _stg(1), backend="cuda-magic")


def _overlapping_packed():
    buf = torch.zeros(10, 64, dtype=torch.uint8)
    return [buf[:, :40], buf[:, 32:]]          # bytes 32..39 of every block shared


BAD_VIEWS = [
    ("empty list", lambda: KVLayout.from_views([]), "views"),
    ("a tensor not a list", lambda: KVLayout.from_views(torch.zeros(2, 3)), "views.*list"),
    ("not a tensor", lambda: KVLayout.from_views([torch.zeros(3, 4), np.zeros((3, 4))]), r"views\[1\].*torch.Tensor"),
    ("0-d", lambda: KVLayout.from_views([torch.tensor(1.0)]), r"views\[0\].*block dimension"),
    ("empty view", lambda: KVLayout.from_views([torch.zeros(3, 0)]), r"views\[0\].*empty"),
    ("num_blocks differ", lambda: KVLayout.from_views([torch.zeros(3, 4), torch.zeros(4, 4)]),
     r"views\[1\].*num_blocks 4"),
    ("devices differ", lambda: KVLayout.from_views([torch.zeros(3, 4), torch.zeros(3, 4, device="meta")]),
     r"views\[1\].*meta"),
    ("same view twice", lambda: (lambda t: KVLayout.from_views([t, t]))(torch.zeros(3, 4)),
     r"views\[0\] and views\[1\]"),
    ("packed overlap", lambda: KVLayout.from_views(_overlapping_packed()), r"views\[0\] and views\[1\].*share"),
    ("blocks overlap", lambda: KVLayout.from_views([torch.zeros(100).as_strided((5, 8), (4, 1))]),
     r"views\[0\]: blocks overlap"),
    ("block stride 0", lambda: KVLayout.from_views([torch.zeros(1, 8).expand(4, 8)]), r"views\[0\]: blocks overlap"),
    ("inner stride 0", lambda: KVLayout.from_views([torch.zeros(4, 1).expand(4, 8)]), r"views\[0\].*overlap"),
    ("interleaved overlap", lambda: KVLayout.from_views([torch.zeros(64).as_strided((4, 2), (5, 10))]),
     r"views\[0\]"),
    ("too fragmented", lambda: KVLayout.from_views([torch.zeros(2, 70, 140, dtype=torch.int8)[:, :, ::2]]),
     rf"views\[0\].*4900 separate byte runs.*{MAX_RUNS_PER_VIEW}"),
    ("sparse", lambda: KVLayout.from_views([torch.zeros(3, 4).to_sparse()]), r"views\[0\].*strided"),
    ("layer_of_view length", lambda: KVLayout.from_views([torch.zeros(3, 4)], [0, 1]), "layer_of_view"),
    ("layer_of_view gap", lambda: KVLayout.from_views([torch.zeros(3, 4), torch.zeros(3, 4)], [0, 2]),
     r"layer_of_view.*missing \[1\]"),
    ("layer_of_view negative", lambda: KVLayout.from_views([torch.zeros(3, 4)], [-1]), r"layer_of_view\[0\]"),
    ("layer_of_view type", lambda: KVLayout.from_views([torch.zeros(3, 4)], "0"), "layer_of_view"),
    ("shard of unknown layer", lambda: _lay().shard_bytes(5), "layer"),
]


@pytest.mark.parametrize("case", BAD_VIEWS, ids=[c[0] for c in BAD_VIEWS])
def test_bad_views(case):
    _, fn, match = case
    with pytest.raises(ValueError, match=match):
        fn()


def test_interleaved_views_that_do_not_overlap_are_accepted():
    """Views interleaved block by block (a packed [B, L, ...] allocation) and head-outer views
    whose blocks interleave but never share a byte pass the exact overlap check."""
    raw = torch.zeros(4, 3, 2, 8)
    KVLayout.from_views([raw[:, l] for l in range(3)])
    heads_outer = torch.zeros(2, 5, 16).permute(1, 0, 2)   # [B, H, X] with H outermost in memory
    lay = KVLayout.from_views([heads_outer])
    assert lay.view_runs(0)[1].tolist() == [64, 64]
    # two views with different block strides over one buffer, disjoint
    buf = torch.zeros(1000, dtype=torch.uint8)
    KVLayout.from_views([buf.as_strided((4, 3), (10, 1)), buf.as_strided((4, 3), (12, 1), 500)])
    with pytest.raises(ValueError, match="share bytes"):
        KVLayout.from_views([buf.as_strided((4, 3), (10, 1)), buf.as_strided((4, 3), (12, 1), 20)])
