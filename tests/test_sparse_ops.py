"""Sparse-attention ops (ucm.sparse.ops): the reference against independent checks, the Triton
kernels against the reference, and clear errors for bad input.

Independent checks: paged attention vs ``scaled_dot_product_attention`` on the gathered
contiguous K/V (float64); block representations vs per-block loops; hash codes vs a bit-by-bit
loop; Quest scores as upper bounds of every ``q . k`` of a block; selection invariants (windows
and the last block kept, ``count == min(budget, n)``, increasing indexes, the best scores kept);
sparse tables through attention over exactly the selected tokens.

Triton runs natively on CUDA tensors when a GPU is present; otherwise on CPU tensors through the
Triton interpreter, which must be active when triton is imported (its standard library is
jitted at import), so this module imports triton under ``TRITON_INTERPRET=1`` on such machines.
The interpreter is slow: where a test loops over many input combinations, it runs them all on a
GPU and, under the interpreter, a subset that still meets every code path and input kind. Launch
constants that gate a path (the histogram selection's thresholds, tile sizes) are passed as an
explicit ``LaunchConfig`` so that small shapes reach every path.
"""
import importlib.util
import itertools
import math
import re

import pytest

torch = pytest.importorskip("torch")

HAS_CUDA = torch.cuda.is_available()
HAS_TRITON = importlib.util.find_spec("triton") is not None
DEV = "cuda" if HAS_CUDA else "cpu"

if HAS_TRITON and not HAS_CUDA:  # (conftest did it already under pytest)
    from ucm.fast.triton import prepare_interpreter

    prepare_interpreter()

from ucm import dispatch  # noqa: E402
from ucm.sparse import ops  # noqa: E402

TOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.5e-2}


@pytest.fixture
def triton_ready(monkeypatch):
    """Make the Triton implementations runnable on this machine's tensors (interpreter on CPU)."""
    if not HAS_TRITON:
        pytest.skip("triton is not installed")
    if not HAS_CUDA:
        import triton.language as tl
        from triton.runtime.jit import JITFunction

        if isinstance(tl.sum, JITFunction):
            pytest.fail("triton was imported before TRITON_INTERPRET=1 was set: its standard "
                        "library cannot run in the interpreter in this process")
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    dispatch._reset_for_tests()
    [impl] = [i for i in dispatch.implementations("paged_decode_attention") if i.name == "triton"]
    ok, why = impl.available(dispatch.detect_platform())
    assert ok, why
    return "triton"


def tri_modules():
    """The Triton implementations' package and its histogram module (imported once the
    interpreter setting above is in place)."""
    from ucm.fast.triton import sparse as tri
    from ucm.fast.triton.sparse import histogram

    return tri, histogram


def launch(**changes):
    """The default launch configuration with ``changes``."""
    from ucm.fast.triton.sparse import LAUNCH

    return LAUNCH.replace(**changes)


#: The split-K attention cut short sequences into many slices: 16-token tiles and slices,
#: up to 8 programs per (interpreter) multiprocessor.
SMALL_SPLITS = dict(decode_block_n=16, decode_min_split_tokens=16, decode_programs_per_sm=8)
#: The histogram selection and the fused head-mass selection at every batch and row length,
#: with programs and search steps of 16 blocks.
HIST = dict(hist_min_blocks=0, hist_max_rows=1 << 20, mass_hist_min_blocks=0,
            mass_hist_max_rows=1 << 20, hist_tile=16, hist_span=16, hist_chunk=16)


def gen(seed):
    return torch.Generator().manual_seed(seed)


def rand(shape, g, dtype=torch.float32):
    return torch.randn(*shape, generator=g).to(dtype).to(DEV)


def paged_case(g, *, B=3, Hq=4, Hkv=2, D=16, bs=4, M=6, dtype=torch.float32, lens=None,
               layout="canonical"):
    """(q, k_cache, v_cache, block_table, seq_lens): blocks handed out in a random order.

    layout: "canonical" [N, bs, Hkv, D]; "vllm_cpu": views of one vLLM-CPU-like
    ``[N, Hkv, bs, 2D]`` K/V-interleaved cache (``kv[..., :D].permute(0, 2, 1, 3)``);
    "strided": every dimension padded (no unit strides but the channel one)."""
    n_phys = B * M + 3
    if layout == "canonical":
        k = rand((n_phys, bs, Hkv, D), g, dtype)
        v = rand((n_phys, bs, Hkv, D), g, dtype)
    elif layout == "vllm_cpu":
        kv = rand((n_phys, Hkv, bs, 2 * D), g, dtype)
        k, v = kv[..., :D].permute(0, 2, 1, 3), kv[..., D:].permute(0, 2, 1, 3)
    else:
        big = rand((n_phys, bs + 1, Hkv + 1, 2, D + 3), g, dtype)
        k, v = big[:, :bs, :Hkv, 0, :D], big[:, 1:, 1:, 1, 3:]
    q = rand((B, Hq, D), g, dtype)
    perm = torch.randperm(n_phys, generator=g)[: B * M]
    table = perm.reshape(B, M).to(torch.int32).to(DEV)
    if lens is None:
        lens = torch.randint(1, M * bs + 1, (B,), generator=g)
    seq_lens = torch.as_tensor(lens, dtype=torch.int32).to(DEV)
    return q, k, v, table, seq_lens


def sdpa_oracle(q, k, v, table, seq_lens, scale=None):
    """float64 attention of each request over its gathered contiguous K/V through
    scaled_dot_product_attention (GQA by repeating K/V heads)."""
    B, Hq, D = q.shape
    bs, Hkv = k.shape[1], k.shape[2]
    outs = []
    for b in range(B):
        n = int(seq_lens[b])
        ids = table[b, : -(-n // bs)].long()
        kk = k[ids].double().reshape(-1, Hkv, D)[:n].permute(1, 0, 2).repeat_interleave(Hq // Hkv, 0)
        vv = v[ids].double().reshape(-1, Hkv, D)[:n].permute(1, 0, 2).repeat_interleave(Hq // Hkv, 0)
        o = torch.nn.functional.scaled_dot_product_attention(q[b].double()[:, None], kk, vv,
                                                             scale=scale)
        outs.append(o[:, 0])
    return torch.stack(outs)


def rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


# ---------------------------------------------------------------------------------------------
# paged decode attention

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("heads", [(4, 4), (6, 2), (8, 1)], ids=["mha", "gqa3", "mqa"])
def test_reference_attention_matches_sdpa(dtype, heads):
    g = gen(1)
    q, k, v, table, lens = paged_case(g, Hq=heads[0], Hkv=heads[1], dtype=dtype, lens=[1, 13, 24])
    out = ops.paged_decode_attention(q, k, v, table, lens, backend="reference")
    assert out.dtype == dtype and out.shape == q.shape
    assert rel(out, sdpa_oracle(q, k, v, table, lens)) < TOL[dtype]


@pytest.mark.parametrize("dtype,heads,layout,bs,D", [
    (torch.float32, (4, 2), "canonical", 4, 16),
    (torch.float16, (6, 2), "vllm_cpu", 4, 16),
    (torch.bfloat16, (3, 3), "strided", 5, 24),
    (torch.float32, (8, 1), "vllm_cpu", 16, 32),
])
def test_triton_attention_matches_reference(triton_ready, dtype, heads, layout, bs, D):
    """Many slices per request (16-token slices), ragged lengths, every layout and dtype."""
    tri, _ = tri_modules()
    g = gen(2)
    q, k, v, table, lens = paged_case(g, Hq=heads[0], Hkv=heads[1], D=D, bs=bs, M=7, dtype=dtype,
                                      layout=layout, lens=[7 * bs, 1, 3 * bs + 2])
    want = ops.paged_decode_attention(q, k, v, table, lens, backend="reference")
    out = torch.full_like(q, float("nan"))
    got = tri.paged_decode_attention(q, k, v, table, lens, scale=D ** -0.5, out=out,
                                     launch=launch(**SMALL_SPLITS))
    assert got is out and not torch.isnan(out).any()
    assert rel(out, want) < TOL[dtype]
    assert rel(out, sdpa_oracle(q, k, v, table, lens)) < TOL[dtype]


def test_triton_attention_single_split_and_scale(triton_ready):
    """Default launch (one slice for these lengths), custom scale, strided query."""
    g = gen(3)
    q, k, v, table, lens = paged_case(g, B=2, Hq=4, Hkv=2, D=16, bs=8, M=5, lens=[40, 9])
    qs = torch.cat([q, q], dim=2)[:, :, ::2]  # non-unit channel stride, same values
    want = ops.paged_decode_attention(qs, k, v, table, lens, scale=0.3, backend="reference")
    got = ops.paged_decode_attention(qs, k, v, table, lens, scale=0.3, backend="triton")
    assert rel(got, want) < 2e-5
    assert rel(got, sdpa_oracle(qs, k, v, table, lens, scale=0.3)) < 2e-5


# ---------------------------------------------------------------------------------------------
# representations and hashing

def bitwise_codes(x, proj):
    """Hash codes word by word, bit by bit (independent of the vectorized reference)."""
    y = (x.double() @ proj.double()).reshape(-1, proj.shape[1])
    words = []
    for row in y:
        ws = []
        for w in range(proj.shape[1] // 32):
            value = sum(1 << i for i in range(32) if row[32 * w + i] > 0)
            ws.append(value - (1 << 32) if value >= 1 << 31 else value)
        words.append(ws)
    return torch.tensor(words, dtype=torch.int32).reshape(*x.shape[:-1], -1)


def test_hash_codes_reference_bitwise():
    g = gen(4)
    x, proj = rand((3, 2, 16), g), rand((16, 64), g)
    codes = ops.hash_codes(x, proj, backend="reference")
    assert codes.shape == (3, 2, 2) and codes.dtype == torch.int32
    assert torch.equal(codes.cpu(), bitwise_codes(x.cpu(), proj.cpu()))


def test_hash_codes_triton(triton_ready):
    g = gen(5)
    x, proj = rand((5, 3, 24), g, torch.bfloat16), rand((24, 96), g)
    assert torch.equal(ops.hash_codes(x, proj, backend="triton"),
                       ops.hash_codes(x, proj, backend="reference"))


def _repr_tables(n, Hkv, D, words):
    nan = float("nan")
    return dict(mean=torch.full((n, Hkv, D), nan, device=DEV), kmin=torch.full((n, Hkv, D), nan, device=DEV),
                kmax=torch.full((n, Hkv, D), nan, device=DEV),
                codes=torch.full((n, Hkv, words), 7, dtype=torch.int32, device=DEV))


@pytest.mark.parametrize("layout", ["canonical", "vllm_cpu"])
def test_update_block_reprs_reference(layout):
    g = gen(6)
    _, k, _, _, _ = paged_case(g, Hkv=2, D=16, bs=4, layout=layout)
    proj = rand((16, 32), g)
    ids = torch.tensor([5, 0, 9], dtype=torch.int64, device=DEV)
    ntok = torch.tensor([4, 1, 3], dtype=torch.int32, device=DEV)
    t = _repr_tables(k.shape[0], 2, 16, 1)
    ops.update_block_reprs(k, ids, ntok, proj=proj, backend="reference", **t)
    for blk, n in zip(ids.tolist(), ntok.tolist()):
        keys = k[blk, :n].double()
        assert torch.allclose(t["mean"][blk].double(), keys.mean(0), atol=1e-6)
        assert torch.equal(t["kmin"][blk], keys.min(0).values.float())
        assert torch.equal(t["kmax"][blk], keys.max(0).values.float())
        assert torch.equal(t["codes"][blk].cpu(), bitwise_codes(t["mean"][blk].cpu(), proj.cpu()))
    untouched = [i for i in range(k.shape[0]) if i not in ids.tolist()]
    assert torch.isnan(t["mean"][untouched]).all() and (t["codes"][untouched] == 7).all()


@pytest.mark.parametrize("dtype,layout", [(torch.float32, "strided"), (torch.bfloat16, "vllm_cpu")])
def test_update_block_reprs_triton(triton_ready, dtype, layout):
    g = gen(7)
    _, k, _, _, _ = paged_case(g, Hkv=2, D=16, bs=4, dtype=dtype, layout=layout)
    proj = rand((16, 64), g)
    ids = torch.tensor([2, 11, 4, 7], dtype=torch.int32, device=DEV)
    ntok = torch.tensor([4, 2, 1, 3], dtype=torch.int64, device=DEV)
    want, got = _repr_tables(k.shape[0], 2, 16, 2), _repr_tables(k.shape[0], 2, 16, 2)
    ops.update_block_reprs(k, ids, ntok, proj=proj, backend="reference", **want)
    ops.update_block_reprs(k, ids, ntok, proj=proj, backend="triton", **got)
    rows = ids.long()
    assert torch.allclose(got["mean"][rows], want["mean"][rows], atol=1e-6)
    for name in ("kmin", "kmax", "codes"):
        assert torch.equal(got[name][rows], want[name][rows]), name
    assert torch.isnan(got["mean"]).sum() == torch.isnan(want["mean"]).sum()
    # only the requested tables: kmax alone
    only = torch.zeros(k.shape[0], 2, 16, device=DEV)
    ops.update_block_reprs(k, ids, ntok, kmax=only, backend="triton")
    assert torch.equal(only[rows], want["kmax"][rows])


# ---------------------------------------------------------------------------------------------
# scoring

def scoring_case(seed, B=3, Hq=6, Hkv=2, D=16, bs=4, M=6):
    g = gen(seed)
    q, k, _, table, _ = paged_case(g, B=B, Hq=Hq, Hkv=Hkv, D=D, bs=bs, M=M)
    t = _repr_tables(k.shape[0], Hkv, D, 2)
    proj = rand((D, 64), g)
    ops.update_block_reprs(k, torch.arange(k.shape[0], device=DEV),
                           torch.full((k.shape[0],), bs, device=DEV), proj=proj,
                           backend="reference", **t)
    nblk = torch.tensor([M, 2, 5][:B], dtype=torch.int32, device=DEV)
    mask = torch.rand(B, Hq, D, generator=g).to(DEV) > 0.3
    return q, k, table, nblk, t, proj, mask


def test_scores_reference_independent():
    q, k, table, nblk, t, proj, mask = scoring_case(8)
    B, Hq, D = q.shape
    Hkv, group = k.shape[2], Hq // k.shape[2]
    quest = ops.score_blocks(q, table, nblk, kind="quest", kmin=t["kmin"], kmax=t["kmax"],
                             reduce="none", backend="reference")
    mean = ops.score_blocks(q, table, nblk, kind="mean", mean=t["mean"], channel_mask=mask,
                            reduce="none", backend="reference")
    ham = ops.score_blocks(q, table, nblk, kind="hamming", codes=t["codes"], proj=proj,
                           reduce="none", backend="reference")
    assert quest.shape == (B, Hq, 6) and ham.shape == (B, Hkv, 6)
    for b in range(B):
        for j in range(table.shape[1]):
            if j >= nblk[b]:
                assert torch.isinf(quest[b, :, j]).all() and (quest[b, :, j] < 0).all()
                assert (mean[b, :, j] == float("-inf")).all() and (ham[b, :, j] == float("-inf")).all()
                continue
            blk = int(table[b, j])
            for h in range(Hq):
                keys = k[blk, :, h // group].double()
                true_max = float((keys @ q[b, h].double()).max())
                assert float(quest[b, h, j]) >= true_max - 1e-4          # an upper bound
                qm = q[b, h].double() * mask[b, h]
                assert abs(float(mean[b, h, j]) - float(qm @ t["mean"][blk, h // group].double())) < 1e-4
            for grp in range(Hkv):
                qsum = q[b, grp * group:(grp + 1) * group].double().sum(0)
                qc = bitwise_codes(qsum[None].float().cpu(), proj.cpu())[0]
                diff = sum(bin((int(a) ^ int(c)) & 0xFFFFFFFF).count("1")
                           for a, c in zip(qc.tolist(), t["codes"][blk, grp].tolist()))
                assert float(ham[b, grp, j]) == 64 - diff
    summed = ops.score_blocks(q, table, nblk, kind="quest", kmin=t["kmin"], kmax=t["kmax"],
                              backend="reference")
    valid = torch.isfinite(summed)
    assert torch.allclose(summed[valid], quest.sum(1)[valid], atol=1e-4)


@pytest.mark.parametrize("kind", ["mean", "quest", "hamming"])
@pytest.mark.parametrize("tile_elems", [None, 64], ids=["one_tile", "tiles_of_2"])
def test_scores_triton_match_reference(triton_ready, kind, tile_elems):
    tri, _ = tri_modules()
    cfg = launch(hamming_tile_elems=tile_elems) if tile_elems else launch()
    q, k, table, nblk, t, proj, mask = scoring_case(9, Hq=8, Hkv=2)
    kw = dict(mean=t["mean"]) if kind == "mean" else dict(kmin=t["kmin"], kmax=t["kmax"]) \
        if kind == "quest" else dict(codes=t["codes"], proj=proj)
    masks = [None, mask] if kind == "mean" else [None]
    for channel_mask in masks:
        for reduce in ("sum", "none"):
            args = dict(kind=kind, reduce=reduce, channel_mask=channel_mask, **kw)
            want = ops.score_blocks(q, table, nblk, backend="reference", **args)
            got = ops.score_blocks(q, table, nblk, backend="triton", **args) if not tile_elems \
                else tri.score_blocks(q, table, nblk, launch=cfg, **args)
            assert got.shape == want.shape and got.dtype == torch.float32
            assert torch.equal(torch.isinf(got), torch.isinf(want))
            fin = torch.isfinite(want)
            assert torch.allclose(got[fin], want[fin], rtol=1e-5, atol=1e-4)


# ---------------------------------------------------------------------------------------------
# selection and sparse tables

def check_selection(scores, nblk, budget, iw, lw, sel, count):
    """Invariants of one selection, from its definition."""
    B, M = scores.shape
    for b in range(B):
        n = int(nblk[b])
        bud = budget if isinstance(budget, int) else int(budget[b])
        forced = set(range(min(iw, n))) | set(range(max(0, n - lw), n)) | {n - 1}
        c = int(count[b])
        assert c == min(n, max(bud, len(forced)))
        row = sel[b].tolist()
        kept = row[:c]
        assert kept == sorted(set(kept)) and all(0 <= j < n for j in kept)
        assert all(x == -1 for x in row[c:])
        assert forced <= set(kept) and kept[-1] == n - 1
        s = torch.nan_to_num(scores[b, :n].double(), nan=float("-inf"))
        others = [j for j in range(n) if j not in forced]
        chosen = [j for j in kept if j not in forced]
        dropped = [j for j in others if j not in kept]
        if chosen and dropped:  # every kept block scores at least as high as every dropped one
            assert min(s[chosen]) >= max(s[dropped])
            worst = min(s[chosen])
            assert all(j > max(c2 for c2 in chosen if s[c2] == worst) for j in dropped if s[j] == worst)


def selection_cases(seed):
    g = gen(seed)
    B, M = 4, 23
    ties = torch.randint(0, 4, (B, M), generator=g).float()          # many equal scores
    ties[0, ::3] = float("nan")
    ties[1, 1::4] = -0.0
    ties[2, 2] = float("inf")
    ties[3, :5] = float("-inf")
    nblk = torch.tensor([23, 1, 9, 17], dtype=torch.int32)
    return ties.to(DEV), nblk.to(DEV)


@pytest.mark.parametrize("budget", [1, 4, 7, 100, "per_row"])
@pytest.mark.parametrize("windows", [(0, 0), (2, 3)])
def test_select_reference_invariants(budget, windows):
    scores, nblk = selection_cases(10)
    if budget == "per_row":
        budget = torch.tensor([3, 1, 9, 6], dtype=torch.int32, device=DEV)
    sel, count = ops.select_blocks(scores, nblk, budget, init_window=windows[0],
                                   local_window=windows[1], backend="reference")
    assert sel.dtype == torch.int32 and count.dtype == torch.int32
    check_selection(scores.cpu(), nblk.cpu(), budget, *windows, sel.cpu(), count.cpu())


def _pooled_model(shares, n, per, cap, init_window, local_window):
    """Per-head budgets of one request, greedily: every head its windows, then the free
    (head, block) pairs by decreasing share while the pooled budget lasts, a head stopping at
    ``cap * per`` blocks."""
    H = shares.shape[0]
    forced = set(range(min(init_window, n))) | set(range(max(0, n - local_window), n)) | {n - 1}
    f = len(forced)
    pairs = sorted(((float(shares[h, j]), h) for h in range(H) for j in range(n)
                    if j not in forced), key=lambda t: -t[0])
    counts, left = [f] * H, max(0, H * (per - f))
    for _, h in pairs:
        if left == 0:
            break
        if counts[h] < cap * per:
            counts[h] += 1
            left -= 1
    return [min(n, c) for c in counts]


@pytest.mark.parametrize("cap", [1, 2, 3])
def test_pool_head_budgets_reference(cap):
    """Pooled per-head budgets against a greedy model; cap 1 gives every head its own budget;
    heads of equal shares get equal budgets; the windows always fit; NaN ranks last."""
    g = torch.Generator().manual_seed(cap)
    B, H, M = 6, 3, 40
    logits = torch.randn(B, H, M, generator=g) * torch.tensor([0.5, 2.0, 6.0])[None, :, None]
    shares = torch.softmax(logits, -1)
    nblk = torch.tensor([40, 33, 7, 1, 20, 12], dtype=torch.int32)
    per = torch.tensor([8, 5, 3, 1, 20, 4], dtype=torch.int32)
    for iw, lw in [(1, 2), (0, 0), (3, 1)]:
        got = ops.pool_head_budgets(shares.to(DEV), nblk.to(DEV), per.to(DEV), cap=cap,
                                    init_window=iw, local_window=lw)
        assert got.dtype == torch.int32 and got.shape == (B, H)
        for b in range(B):
            n, p = int(nblk[b]), int(per[b])
            want = _pooled_model(shares[b], n, p, cap, iw, lw)
            assert got[b].tolist() == want, (cap, iw, lw, b)
            if cap == 1:   # no pooling: what each head's own selection keeps
                f = len(set(range(min(iw, n))) | set(range(max(0, n - lw), n)) | {n - 1})
                assert got[b].tolist() == [min(n, max(p, f))] * H
        # the pooled total is the heads' budgets together where the blocks allow it
        assert int(got[0].sum()) == H * 8 and int(got[0].max()) <= cap * 8
    # the head whose attention is spread (scale 0.5) takes what the concentrated one leaves
    if cap > 1:
        got = ops.pool_head_budgets(shares[:1].to(DEV), nblk[:1].to(DEV), 8, cap=cap,
                                    init_window=1, local_window=2).tolist()[0]
        assert got[0] > 8 > got[2]
    same = shares[:, :1].expand(B, H, M).contiguous()
    got = ops.pool_head_budgets(same.to(DEV), nblk.to(DEV), per.to(DEV), cap=cap, init_window=1,
                                local_window=2)
    assert (got == got[:, :1]).all()
    nan = shares.clone()
    nan[0, 0, 5] = float("nan")
    nan[0, 1, 5] = float("inf")
    got = ops.pool_head_budgets(nan.to(DEV), nblk.to(DEV), per.to(DEV), cap=cap, init_window=1,
                                local_window=2)
    want = _pooled_model(torch.nan_to_num(nan[0], nan=-1.0), 40, 8, cap, 1, 2)
    assert got[0].tolist() == want


def tri_select(s, nblk, budget, cfg, *, init_window, local_window, table=None, lens=None,
               block_size=None):
    """The Triton selection (with the sparse table folded in when ``table`` is given) under the
    launch configuration ``cfg``, on inputs validated as ops.select_blocks validates them."""
    tri, _ = tri_modules()
    bud = budget if isinstance(budget, torch.Tensor) else torch.full_like(nblk, budget)
    width = ops.select_width(s.shape[1], int(bud.max()), init_window, local_window)
    kw = dict(init_window=init_window, local_window=local_window, width=width, launch=cfg)
    if table is None:
        return tri.select_blocks(s, nblk, bud, **kw)
    return tri.select_sparse_table(s, nblk, bud, table, lens, block_size=block_size, **kw)


def test_select_triton_identical(triton_ready):
    """The single-program selection and, past select_kernel_max_blocks, the top-k glue ==
    the reference: ties, NaN, +-0, +-inf, scores spanning 70 decades, per-row budgets."""
    scores, nblk = selection_cases(11)
    g = gen(12)
    continuous = torch.randn(3, 40, generator=g).to(DEV)
    cont_n = torch.tensor([40, 12, 1], dtype=torch.int32, device=DEV)
    wide = (torch.randn(3, 40, generator=g) * 10.0 ** torch.randint(-35, 35, (3, 40), generator=g)).to(DEV)
    per_row = torch.arange(2, 5, dtype=torch.int32, device=DEV) * 3
    runs = [("kernel", data, budget) for data in ((scores, nblk), (continuous, cont_n), (wide, cont_n))
            for budget in (1, 5, 12)]
    runs += [("kernel", (continuous, cont_n), per_row), ("topk", (scores, nblk), 5),
             ("topk", (wide, cont_n), per_row)]
    for path, (s, n), budget in runs:
        cfg = launch(select_kernel_max_blocks=0 if path == "topk" else 1 << 20)
        kw = dict(init_window=1, local_window=2)
        want = ops.select_blocks(s, n, budget, backend="reference", **kw)
        got = tri_select(s, n, budget, cfg, **kw)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), (path, budget)
    # the public op, default launch
    want = ops.select_blocks(scores, nblk, 5, init_window=1, local_window=2, backend="reference")
    got = ops.select_blocks(scores, nblk, 5, init_window=1, local_window=2, backend="triton")
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def _hist_cases(full: bool):
    """(scores, budget, windows) cases of the histogram selection tests: on a GPU every
    combination; under the interpreter (CPU) a subset that still meets every data kind, budget
    kind and window setting, and both list outcomes (pairwise ranks or searches)."""
    budgets = ("one", "five", "thirty", "per_row")
    windows = ((1, 2), (3, 0))
    data = ("ties", "continuous", "wide")
    if full:
        return list(itertools.product(data, budgets, windows))
    return [("ties", "five", (1, 2)), ("ties", "per_row", (3, 0)), ("continuous", "one", (3, 0)),
            ("continuous", "thirty", (1, 2)), ("wide", "per_row", (1, 2)), ("wide", "five", (3, 0))]


@pytest.mark.parametrize("bins,listed", [(2, 16), (4, 0), (4, 1), (12, 64)],
                         ids=["bins4-list", "bins16-search", "bins16-list1", "bins4096-list"])
def test_select_hist_triton_identical(triton_ready, bins, listed):
    """The histogram selection (the row's bounds; histogram atomics; the threshold bin's
    candidates listed; every program resolving the list, by pairwise ranks or searches, and
    writing its chunk) == the reference: ties, NaN, +-0, +-inf, per-row budgets, short rows;
    programs and search steps of 16 blocks; the table folded in."""
    _, histogram = tri_modules()
    cfg = launch(**HIST, hist_bits=bins, hist_list=listed)
    scores, nblk = selection_cases(31)
    g = gen(32)
    M = scores.shape[1]
    rows = dict(ties=scores, continuous=rand((4, M), g),
                wide=(torch.randn(4, M, generator=g)
                      * 10.0 ** torch.randint(-35, 35, (4, M), generator=g)).to(DEV))
    budgets = dict(one=1, five=5, thirty=30,
                   per_row=torch.tensor([3, 1, 9, 6], dtype=torch.int32, device=DEV))
    _, _, _, table, lens = paged_case(g, B=4, M=M, bs=4, lens=[92, 2, 33, 66])
    for data, budget, windows in _hist_cases(HAS_CUDA):
        s, budget = rows[data], budgets[budget]
        kw = dict(init_window=windows[0], local_window=windows[1])
        want = ops.select_blocks(s, nblk, budget, backend="reference", **kw)
        got = tri_select(s, nblk, budget, cfg, **kw)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), (data, budget)
        folded = tri_select(s, nblk, budget, cfg, table=table, lens=lens, block_size=4, **kw)
        want_t = ops.sparse_block_table(table, lens, *want, 4, backend="reference")
        for a, b in zip(folded, want + want_t):
            assert torch.equal(a, b), (data, budget, windows)
    assert histogram.scratch_zeroed()


@pytest.mark.parametrize("bins,listed,span", [(4, 16, 0), (4, 0, 0), (12, 64, 0), (4, 16, 16),
                                              (12, 64, 8)],
                         ids=["bins16-list", "bins16-search", "bins4096-list",
                              "bins16-list-parts16", "bins4096-list-parts8"])
def test_select_head_mass_triton(triton_ready, bins, listed, span):
    """The fused head mass + histogram selection: the mass it writes == softmax over blocks per
    head, averaged (float32 rounding), and its selection == the reference's on that mass; with
    integer-spaced per-head scores (many equal masses) == the reference op end to end. With
    lse_span the per-head statistics come in parts (some of them all -inf past a short row's
    end) that the head-mass launch combines. On a GPU every budget and window setting; under
    the interpreter a subset meeting each budget and window setting once."""
    tri, histogram = tri_modules()
    cfg = launch(**HIST, hist_bits=bins, hist_list=listed, lse_span=span, lse_chunk=8)
    g = gen(33)
    B, H, M = 3, 6, 45
    nblk = torch.tensor([45, 20, 1], dtype=torch.int32, device=DEV)
    smooth = rand((B, H, M), g) * 20
    coarse = torch.randint(0, 3, (B, H, M), generator=g).float().to(DEV)
    for x in (smooth, coarse):
        x[1, :, 20:] = float("-inf")
        x[2, :, 1:] = float("-inf")
    _, _, _, table, lens = paged_case(g, B=B, M=M, bs=4, lens=[180, 77, 3])
    cases = list(itertools.product((smooth, coarse), (1, 7, 30), ((1, 4), (0, 0))))
    if not HAS_CUDA:
        cases = [(smooth, 7, (1, 4)), (smooth, 30, (0, 0)), (coarse, 1, (0, 0)),
                 (coarse, 7, (1, 4))]
    for x, budget, windows in cases:
        kw = dict(init_window=windows[0], local_window=windows[1])
        bud = torch.full_like(nblk, budget)
        width = ops.select_width(M, budget, *windows)
        sel, count, t, n, mass = tri.select_head_mass(x, nblk, bud, scale=0.5, width=width,
                                                      block_table=table, seq_lens=lens,
                                                      block_size=4, return_mass=True,
                                                      launch=cfg, **kw)
        want_mass = torch.softmax(x * 0.5, dim=-1).mean(1)
        assert torch.allclose(mass, want_mass, rtol=1e-5, atol=1e-9)
        want = ops.select_blocks(mass, nblk, budget, backend="reference", **kw)
        want_t = ops.sparse_block_table(table, lens, *want, 4, backend="reference")
        for a, b in zip((sel, count, t, n), want + want_t):
            assert torch.equal(a, b), (budget, windows)
        if x is coarse:  # equal masses stay equal: the Triton selection == the reference op
            got = tri.select_head_mass(x, nblk, bud, scale=0.5, width=width, launch=cfg, **kw)
            ref_op = ops.select_head_mass(x, nblk, budget, scale=0.5, backend="reference", **kw)
            assert torch.equal(got[0], ref_op[0]) and torch.equal(got[1], ref_op[1])
    assert histogram.scratch_zeroed()


def test_sparse_block_table_attends_to_selected_tokens():
    """Attention over the sparse table == attention over exactly the selected blocks' tokens."""
    g = gen(13)
    bs = 4
    q, k, v, table, lens = paged_case(g, B=3, M=8, bs=bs, lens=[30, 5, 17])
    nblk = ((lens + bs - 1) // bs).int()
    scores = rand((3, 8), g)
    sel, count = ops.select_blocks(scores, nblk, 3, init_window=1, local_window=1)
    stab, slens = ops.sparse_block_table(table, lens, sel, count, bs, backend="reference")
    out = ops.paged_decode_attention(q, k, v, stab, slens, backend="reference")
    for b in range(3):
        n, c = int(lens[b]), int(count[b])
        tokens = [j * bs + t for j in sel[b, :c].tolist() for t in range(bs) if j * bs + t < n]
        assert int(slens[b]) == len(tokens)
        ids = table[b].long()
        kk = k[ids].reshape(-1, k.shape[2], k.shape[3])[tokens].double()
        vv = v[ids].reshape(-1, v.shape[2], v.shape[3])[tokens].double()
        kk, vv = (x.permute(1, 0, 2).repeat_interleave(2, 0) for x in (kk, vv))
        want = torch.nn.functional.scaled_dot_product_attention(q[b].double()[:, None], kk, vv)[:, 0]
        assert rel(out[b], want) < 2e-5
        assert (stab[b, c:] == 0).all()


def test_sparse_block_table_triton(triton_ready):
    g = gen(14)
    bs = 5
    _, _, _, table, lens = paged_case(g, B=3, M=9, bs=bs, lens=[45, 3, 22])
    nblk = ((lens + bs - 1) // bs).int()
    sel, count = ops.select_blocks(rand((3, 9), g), nblk, 4, init_window=1, local_window=1)
    want = ops.sparse_block_table(table, lens, sel, count, bs, backend="reference")
    got = ops.sparse_block_table(table, lens, sel, count, bs, backend="triton")
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_decode_selected_triton(triton_ready):
    """The sparse table folded into the attention kernel == sparse table + attention."""
    tri, _ = tri_modules()
    g = gen(21)
    bs = 4
    for dtype in (torch.float32, torch.bfloat16):
        q, k, v, table, lens = paged_case(g, B=3, M=9, bs=bs, dtype=dtype, lens=[35, 3, 22])
        nblk = ((lens + bs - 1) // bs).int()
        sel, count = ops.select_blocks(rand((3, 9), g), nblk, 4, init_window=1, local_window=1)
        stab, slens = ops.sparse_block_table(table, lens, sel, count, bs, backend="reference")
        want = ops.paged_decode_attention(q.float(), k.float(), v.float(), stab, slens,
                                          backend="reference")
        out = torch.full_like(q, float("nan"))
        got = tri.decode_selected(q, k, v, table, lens, sel, count, scale=16 ** -0.5, out=out,
                                  launch=launch(**SMALL_SPLITS))
        assert got is out and not torch.isnan(out).any()
        assert rel(got, want) < TOL[dtype], dtype


def test_decode_table_loads_triton(triton_ready):
    """Table entries loaded one tile ahead: the same attention with one or two tiles per slice,
    dense (ragged lengths, a table wider than the lengths, empty slices), on a sparse table and
    on a folded selection."""
    tri, _ = tri_modules()
    g = gen(27)
    bs = 4
    q, k, v, table, lens = paged_case(g, B=3, M=9, bs=bs, dtype=torch.bfloat16, lens=[35, 3, 22])
    nblk = ((lens + bs - 1) // bs).int()
    sel, count = ops.select_blocks(rand((3, 9), g), nblk, 4, init_window=1, local_window=1)
    stab, slens = ops.sparse_block_table(table, lens, sel, count, bs, backend="reference")
    for args in ((table, lens), (stab, slens)):
        want = ops.paged_decode_attention(q.float(), k.float(), v.float(), *args,
                                          backend="reference")
        for block_n in (16, 32):          # 1 / 2 tiles per slice at 16-token slices
            out = torch.full_like(q, float("nan"))
            tri.decode(q, k, v, *args, 16 ** -0.5, out,
                       launch=launch(**dict(SMALL_SPLITS, decode_block_n=block_n)))
            assert rel(out, want) < TOL[torch.bfloat16], (args[0] is table, block_n)
    want = ops.paged_decode_attention(q.float(), k.float(), v.float(), stab, slens,
                                      backend="reference")
    out = tri.decode(q, k, v, table, lens, 16 ** -0.5, sel=sel, count=count,
                     launch=launch(**SMALL_SPLITS))
    assert rel(out, want) < TOL[torch.bfloat16]


def test_decode_slice_counts_triton(triton_ready):
    """Explicit slice counts (slices of whole token tiles, empty slices past short requests):
    the same attention as the reference, dense (ragged lengths) and on a sparse table."""
    tri, _ = tri_modules()
    from ucm.fast.triton.sparse.attention import split_length

    g = gen(29)
    bs = 4
    q, k, v, table, lens = paged_case(g, B=3, M=12, bs=bs, dtype=torch.bfloat16,
                                      lens=[47, 5, 30])
    nblk = ((lens + bs - 1) // bs).int()
    sel, count = ops.select_blocks(rand((3, 12), g), nblk, 5, init_window=1, local_window=1)
    stab, slens = ops.sparse_block_table(table, lens, sel, count, bs, backend="reference")
    for args in ((table, lens), (stab, slens)):
        want = ops.paged_decode_attention(q.float(), k.float(), v.float(), *args,
                                          backend="reference")
        for splits in (None, 2, 3, 5):
            out = torch.full_like(q, float("nan"))
            tri.decode(q, k, v, *args, 16 ** -0.5, out, num_splits=splits,
                       launch=launch(**SMALL_SPLITS))
            assert rel(out, want) < TOL[torch.bfloat16], (args[0] is table, splits)
    # about 3 slices of 47 tokens: 16 tokens (one tile) each; about 5: still 16 (whole tiles), 3
    assert split_length(47, 3, 16) == (3, 16) and split_length(47, 5, 16) == (3, 16)
    assert split_length(48, 2, 16) == (2, 32)


def test_decode_merge_channels_triton(triton_ready):
    """The merge launch over chunks of channels (16: 4 chunks of a 64-channel head) or all of
    them in one program: the same attention as the reference."""
    tri, _ = tri_modules()
    g = gen(23)
    for dtype in (torch.float32, torch.bfloat16):
        q, k, v, table, lens = paged_case(g, B=2, M=5, bs=4, D=64, dtype=dtype, lens=[19, 7])
        want = ops.paged_decode_attention(q.float(), k.float(), v.float(), table, lens,
                                          backend="reference")
        for channels in (16, 64):
            got = tri.decode(q, k, v, table, lens, 0.125,
                             launch=launch(**SMALL_SPLITS, merge_channels=channels))
            assert rel(got, want) < TOL[dtype], (dtype, channels)


def test_select_sparse_table_triton(triton_ready):
    """Selection with the sparse table folded in == select_blocks then sparse_block_table."""
    tri, _ = tri_modules()
    g = gen(24)
    bs = 5
    _, _, _, table, lens = paged_case(g, B=4, M=11, bs=bs, lens=[55, 3, 22, 41])
    nblk = ((lens + bs - 1) // bs).int()
    scores = rand((4, 11), g)
    scores[0, 3] = float("nan")
    for budget in (2, 5, 11):
        want = ops.select_blocks(scores, nblk, budget, init_window=1, local_window=2,
                                 backend="reference")
        want_t = ops.sparse_block_table(table, lens, *want, bs, backend="reference")
        bud = torch.full((4,), budget, dtype=torch.int32, device=DEV)
        width = ops.select_width(11, budget, 1, 2)
        got = tri.select_sparse_table(scores, nblk, bud, table, lens, init_window=1,
                                      local_window=2, width=width, block_size=bs)
        for a, b in zip(got, want + want_t):
            assert torch.equal(a, b), budget


def test_head_mass_triton(triton_ready):
    """The two-launch head mass == softmax over blocks per head, averaged over heads; the public
    op (default launch: the head mass, then the selection kernel) == the reference op."""
    tri, _ = tri_modules()

    g = gen(25)
    per_head = rand((3, 8, 2100), g) * 30
    per_head[1, :, 700:] = float("-inf")               # a shorter request
    per_head[2, 3, :5] = float("-inf")
    want = torch.softmax(per_head * 0.125, dim=-1).mean(1)
    got = tri.head_mass(per_head, 0.125)
    assert got.shape == want.shape and torch.allclose(got, want, rtol=1e-5, atol=1e-9)
    assert (got[1, 700:] == 0).all()
    coarse = torch.randint(0, 3, (3, 4, 40), generator=g).float().to(DEV)
    coarse[1, :, 25:] = float("-inf")
    nblk = torch.tensor([40, 25, 33], dtype=torch.int32, device=DEV)
    coarse[2, :, 33:] = float("-inf")
    kw = dict(scale=0.5, init_window=1, local_window=2)
    got = ops.select_head_mass(coarse, nblk, 9, backend="triton", **kw)
    want = ops.select_head_mass(coarse, nblk, 9, backend="reference", **kw)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def per_head_case(g, dtype=torch.float32, bs=4, M=9, lens=(35, 3, 22), Hq=6, Hkv=3):
    """A per-KV-head selection: each KV head of each request its own blocks (select_blocks over
    [B * Hkv, M] scores, sparse_block_table over the repeated table) -> the [B, Hkv, K] table,
    [B, Hkv] lengths, and the selection [B, Hkv, K] / counts [B, Hkv]."""
    q, k, v, table, seq = paged_case(g, B=len(lens), Hq=Hq, Hkv=Hkv, M=M, bs=bs, dtype=dtype,
                                     lens=list(lens))
    B = len(lens)
    nblk = ((seq + bs - 1) // bs).int().repeat_interleave(Hkv)
    sel, count = ops.select_blocks(rand((B * Hkv, M), g), nblk, 3, init_window=1, local_window=1)
    t, n = ops.sparse_block_table(table.repeat_interleave(Hkv, 0), seq.repeat_interleave(Hkv), sel,
                                  count, bs)
    return (q, k, v, table, seq, t.reshape(B, Hkv, -1), n.reshape(B, Hkv),
            sel.reshape(B, Hkv, -1), count.reshape(B, Hkv))


def test_per_kv_head_attention_reference():
    """A [B, Hkv, K] table: each KV head's query heads attend to exactly their own tokens (float64
    SDPA per head on the gathered tokens); identical heads' tables equal the shared table."""
    g = gen(26)
    bs, Hq, Hkv = 4, 6, 3
    q, k, v, table, seq, t, n, _, _ = per_head_case(g)
    out = ops.paged_decode_attention(q, k, v, t, n, backend="reference")
    for b in range(q.shape[0]):
        for h in range(Hq):
            kv = h // (Hq // Hkv)
            ids = t[b, kv].long()
            kk = k[ids, :, kv].reshape(-1, k.shape[3])[: int(n[b, kv])].double()
            vv = v[ids, :, kv].reshape(-1, v.shape[3])[: int(n[b, kv])].double()
            want = torch.softmax(kk @ q[b, h].double() / 4.0, 0) @ vv
            assert rel(out[b, h], want) < 2e-5
    shared = ops.paged_decode_attention(q, k, v, table, seq, backend="reference")
    same = ops.paged_decode_attention(q, k, v, table[:, None].expand(-1, Hkv, -1).contiguous(),
                                      seq[:, None].expand(-1, Hkv).contiguous(), backend="reference")
    assert torch.allclose(same, shared, atol=1e-6)
    with pytest.raises(ValueError, match="per KV head"):
        ops.paged_decode_attention(q, k, v, t[:, :2], n[:, :2])
    with pytest.raises(ValueError, match="seq_lens"):
        ops.paged_decode_attention(q, k, v, t, n[:, 0])


def test_per_kv_head_attention_triton(triton_ready):
    tri, _ = tri_modules()
    g = gen(27)
    for dtype in (torch.float32, torch.bfloat16):
        q, k, v, table, seq, t, n, sel, count = per_head_case(g, dtype)
        want = ops.paged_decode_attention(q.float(), k.float(), v.float(), t, n,
                                          backend="reference")
        got = ops.paged_decode_attention(q, k, v, t, n, backend="triton")
        assert rel(got, want) < TOL[dtype], dtype
        folded = tri.decode_selected(q, k, v, table, seq, sel, count, scale=0.25,
                                     launch=launch(**SMALL_SPLITS))
        assert rel(folded, want) < TOL[dtype], dtype
        assert rel(folded, got) < 1e-6


def test_bf16_block_reprs(triton_ready):
    """bfloat16 mean / kmin / kmax tables: written rounded from the float32 values, scored like
    their float32 values (reference and Triton)."""
    q, k, table, nblk, t, _, mask = scoring_case(22, Hq=8, Hkv=2)
    ids = torch.arange(k.shape[0], device=DEV)
    ntok = torch.full((k.shape[0],), k.shape[1], device=DEV)
    for backend in ("reference", "triton"):
        half = {n: torch.full_like(t[n], float("nan"), dtype=torch.bfloat16)
                for n in ("mean", "kmin", "kmax")}
        ops.update_block_reprs(k, ids, ntok, backend=backend, **half)
        for n, table_bf16 in half.items():   # at most one bfloat16 rounding step away
            assert torch.allclose(table_bf16.float(), t[n], rtol=2 ** -7, atol=0), (backend, n)
    for kind, kw in (("mean", dict(mean=half["mean"], channel_mask=mask)),
                     ("quest", dict(kmin=half["kmin"], kmax=half["kmax"]))):
        up = {n: x.float() if x.dtype == torch.bfloat16 else x for n, x in kw.items()}
        want = ops.score_blocks(q, table, nblk, kind=kind, backend="reference", **up)
        for backend in ("reference", "triton"):
            got = ops.score_blocks(q, table, nblk, kind=kind, backend=backend, **kw)
            fin = torch.isfinite(want)
            assert torch.equal(torch.isfinite(got), fin)
            assert torch.allclose(got[fin], want[fin], rtol=1e-5, atol=1e-4), (kind, backend)


# ---------------------------------------------------------------------------------------------
# sub-block summaries: tables [num_blocks, G, Hkv, X], max over G inside score_blocks

def _sub_tables(n, G, Hkv, D, words, dtype=torch.float32):
    nan = float("nan")
    return dict(mean=torch.full((n, G, Hkv, D), nan, dtype=dtype, device=DEV),
                kmin=torch.full((n, G, Hkv, D), nan, dtype=dtype, device=DEV),
                kmax=torch.full((n, G, Hkv, D), nan, dtype=dtype, device=DEV),
                codes=torch.full((n, G, Hkv, words), 7, dtype=torch.int32, device=DEV))


def sub_block_oracle(k, blk, n, G):
    """Per sub-block key ranges of one block, by a plain loop: sub-block ``s`` covers tokens
    ``[s t, (s + 1) t)`` cut at ``n``; an empty one repeats the last non-empty one."""
    t = k.shape[1] // G
    out = []
    for s in range(G):
        src = min(s, (n - 1) // t)
        out.append(k[blk, src * t: min((src + 1) * t, n)].double())      # [tokens, Hkv, D]
    return out


@pytest.mark.parametrize("bs,G", [(8, 2), (12, 3), (16, 4), (4, 1)])
def test_sub_block_reprs_reference(bs, G):
    g = gen(30 + bs)
    _, k, _, _, _ = paged_case(g, Hkv=2, D=16, bs=bs, layout="vllm_cpu")
    proj = rand((16, 64), g)
    ids = torch.tensor([5, 0, 9, 12], dtype=torch.int64, device=DEV)
    ntok = torch.tensor([bs, 1, bs // 2 + 1, bs - 1], dtype=torch.int32, device=DEV)
    t = _sub_tables(k.shape[0], G, 2, 16, 2)
    ops.update_block_reprs(k, ids, ntok, proj=proj, backend="reference", **t)
    for blk, n in zip(ids.tolist(), ntok.tolist()):
        for s, keys in enumerate(sub_block_oracle(k, blk, n, G)):
            assert torch.allclose(t["mean"][blk, s].double(), keys.mean(0), atol=1e-6)
            assert torch.equal(t["kmin"][blk, s], keys.min(0).values.float())
            assert torch.equal(t["kmax"][blk, s], keys.max(0).values.float())
            assert torch.equal(t["codes"][blk, s].cpu(),
                               bitwise_codes(t["mean"][blk, s].cpu(), proj.cpu()))
    untouched = [i for i in range(k.shape[0]) if i not in ids.tolist()]
    assert torch.isnan(t["mean"][untouched]).all() and (t["codes"][untouched] == 7).all()
    # G = 1: the 4-D table equals the 3-D one
    if G == 1:
        flat = _repr_tables(k.shape[0], 2, 16, 2)
        ops.update_block_reprs(k, ids, ntok, proj=proj, backend="reference", **flat)
        for name in ("mean", "kmin", "kmax", "codes"):
            assert torch.equal(flat[name][ids], t[name][ids, 0]), name


@pytest.mark.parametrize("bs,G,dtype", [(8, 2, torch.float32), (12, 3, torch.bfloat16),
                                        (16, 4, torch.bfloat16), (16, 8, torch.float32)])
def test_sub_block_reprs_triton(triton_ready, bs, G, dtype):
    g = gen(40 + G)
    _, k, _, _, _ = paged_case(g, Hkv=2, D=16, bs=bs, dtype=dtype, layout="strided")
    proj = rand((16, 64), g)
    ids = torch.tensor([2, 11, 4, 7, 0], dtype=torch.int32, device=DEV)
    ntok = torch.tensor([bs, 2, 1, bs - 1, bs // 2 + 1], dtype=torch.int64, device=DEV)
    for tdtype in (torch.float32, torch.bfloat16):
        want = _sub_tables(k.shape[0], G, 2, 16, 2, tdtype)
        got = _sub_tables(k.shape[0], G, 2, 16, 2, tdtype)
        ops.update_block_reprs(k, ids, ntok, proj=proj, backend="reference", **want)
        ops.update_block_reprs(k, ids, ntok, proj=proj, backend="triton", **got)
        rows = ids.long()
        tol = 1e-6 if tdtype == torch.float32 else 2 ** -7   # bf16: one rounding step
        for name in ("mean", "kmin", "kmax"):
            assert torch.allclose(got[name][rows].float(), want[name][rows].float(), rtol=tol,
                                  atol=1e-6), (name, tdtype)
        assert torch.equal(got["codes"][rows], want["codes"][rows])
        assert torch.isnan(got["mean"].float()).sum() == torch.isnan(want["mean"].float()).sum()


def sub_scoring_case(seed, G, bs, B=3, Hq=8, Hkv=2, D=16, M=7, tdtype=torch.float32,
                     qdtype=torch.float32):
    g = gen(seed)
    q, k, _, table, _ = paged_case(g, B=B, Hq=Hq, Hkv=Hkv, D=D, bs=bs, M=M, dtype=qdtype)
    proj = rand((D, 64), g)
    t = _sub_tables(k.shape[0], G, Hkv, D, 2, tdtype)
    n = k.shape[0]
    ntok = torch.randint(1, bs + 1, (n,), generator=g).to(DEV)   # some partial blocks too
    ops.update_block_reprs(k, torch.arange(n, device=DEV), ntok, proj=proj, backend="reference", **t)
    nblk = torch.tensor([M, 2, 5][:B], dtype=torch.int32, device=DEV)
    mask = torch.rand(B, Hq, D, generator=g).to(DEV) > 0.3
    return q, k, table, nblk, t, proj, mask


@pytest.mark.parametrize("G", [2, 3, 4])
def test_sub_block_scores_reference_independent(G):
    """score_blocks on [n, G, Hkv, X] tables == the maximum over sub-blocks of per-sub-block
    scores computed by plain loops (float64), for mean (with a channel mask), quest, hamming."""
    q, k, table, nblk, t, proj, mask = sub_scoring_case(50 + G, G, 4 * G)
    B, Hq, D = q.shape
    Hkv = k.shape[2]
    group = Hq // Hkv
    got = {
        "mean": ops.score_blocks(q, table, nblk, kind="mean", mean=t["mean"], channel_mask=mask,
                                 reduce="none", backend="reference"),
        "quest": ops.score_blocks(q, table, nblk, kind="quest", kmin=t["kmin"], kmax=t["kmax"],
                                  reduce="none", backend="reference"),
        "hamming": ops.score_blocks(q, table, nblk, kind="hamming", codes=t["codes"], proj=proj,
                                    reduce="none", backend="reference"),
    }
    assert got["mean"].shape == (B, Hq, 7) and got["hamming"].shape == (B, Hkv, 7)
    for b in range(B):
        for j in range(int(nblk[b])):
            blk = int(table[b, j])
            for h in range(Hq):
                kv = h // group
                qh = q[b, h].double()
                m = max(float((qh * mask[b, h]) @ t["mean"][blk, s, kv].double()) for s in range(G))
                qu = max(sum(max(float(qh[d] * t["kmin"][blk, s, kv, d]),
                                 float(qh[d] * t["kmax"][blk, s, kv, d])) for d in range(D))
                         for s in range(G))
                assert abs(float(got["mean"][b, h, j]) - m) < 1e-4
                assert abs(float(got["quest"][b, h, j]) - qu) < 1e-4
            for grp in range(Hkv):
                qsum = q[b, grp * group:(grp + 1) * group].double().sum(0)
                qc = bitwise_codes(qsum[None].float().cpu(), proj.cpu())[0]
                best = max(64 - sum(bin((int(a) ^ int(c)) & 0xFFFFFFFF).count("1")
                                    for a, c in zip(qc.tolist(), t["codes"][blk, s, grp].tolist()))
                           for s in range(G))
                assert float(got["hamming"][b, grp, j]) == best
        for x in got.values():
            assert (x[b, :, int(nblk[b]):] == float("-inf")).all()
    summed = ops.score_blocks(q, table, nblk, kind="quest", kmin=t["kmin"], kmax=t["kmax"],
                              backend="reference")
    fin = torch.isfinite(summed)
    assert torch.allclose(summed[fin], got["quest"].sum(1)[fin], atol=1e-4)


def test_sub_block_scores_one_group_views():
    """G = 1: a [n, 1, Hkv, X] table scores exactly like the [n, Hkv, X] one."""
    q, k, table, nblk, t, proj, mask = sub_scoring_case(60, 1, 4)
    for kind, four in (("mean", dict(mean=t["mean"], channel_mask=mask)),
                       ("quest", dict(kmin=t["kmin"], kmax=t["kmax"])),
                       ("hamming", dict(codes=t["codes"], proj=proj))):
        three = {n: (x[:, 0] if n in ("mean", "kmin", "kmax", "codes") else x) for n, x in four.items()}
        a = ops.score_blocks(q, table, nblk, kind=kind, reduce="none", backend="reference", **four)
        b = ops.score_blocks(q, table, nblk, kind=kind, reduce="none", backend="reference", **three)
        assert torch.equal(a, b), kind


@pytest.mark.parametrize("G,bs", [(1, 4), (2, 8), (3, 12), (4, 16)])
@pytest.mark.parametrize("rows", [None, 16], ids=["rows_default", "rows_16"])
def test_sub_block_scores_triton_match_reference(triton_ready, G, bs, rows):
    tri, _ = tri_modules()
    # rows 16: many small tiles, several programs per request
    cfg = launch(score_rows=rows, hamming_tile_elems=64) if rows else launch()
    # one (table, query) dtype pair per case, rotating: every pair meets both row settings and
    # several group sizes (all three per case cost 3x the interpreter time for no new path)
    pairs = ((torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
             (torch.bfloat16, torch.float32))
    for tdtype, qdtype in (pairs[(G + (rows is None)) % 3],):
        q, k, table, nblk, t, proj, mask = sub_scoring_case(70 + G, G, bs, M=23, tdtype=tdtype,
                                                            qdtype=qdtype)
        tables = {n: x[:, 0] for n, x in t.items()} if G == 1 and rows else t   # 3-D when G = 1
        for kind, kw in (("mean", dict(mean=tables["mean"])),
                         ("mean", dict(mean=tables["mean"], channel_mask=mask)),
                         ("quest", dict(kmin=tables["kmin"], kmax=tables["kmax"])),
                         ("hamming", dict(codes=tables["codes"], proj=proj))):
            for reduce in ("sum", "none"):
                want = ops.score_blocks(q, table, nblk, kind=kind, reduce=reduce,
                                        backend="reference", **kw)
                got = tri.score_blocks(q, table, nblk, kind=kind, reduce=reduce, launch=cfg, **kw)
                assert got.shape == want.shape and got.dtype == torch.float32
                assert torch.equal(torch.isinf(got), torch.isinf(want)), (kind, reduce)
                fin = torch.isfinite(want)
                assert torch.allclose(got[fin], want[fin], rtol=1e-5, atol=1e-4), \
                    (kind, reduce, tdtype, qdtype, float((got[fin] - want[fin]).abs().max()))


def test_quantize_rows_reference():
    """int8 rows within half a scale step of the input, the largest magnitude at +-127, zero
    rows all zero with scale 0; scores of the int8 table (with its scales) == scores of its
    dequantized float table; bad scale arguments raise."""
    g = gen(83)
    x = rand((7, 4, 3, 16), g) * 3.0
    x[2, 1, 0] = 0.0
    qx, sc = ops.quantize_rows(x)
    assert qx.dtype == torch.int8 and sc.dtype == torch.float32 and sc.shape == x.shape[:-1]
    back = qx.float() * sc[..., None]
    assert ((back - x).abs() <= sc[..., None] / 2 + 1e-6).all()
    assert torch.equal(qx.abs().amax(-1)[sc > 0], torch.full_like(sc[sc > 0], 127).to(torch.int8))
    assert sc[2, 1, 0] == 0 and not qx[2, 1, 0].any()
    q, k, table, nblk, t, proj, mask = sub_scoring_case(84, 4, 16, M=9)
    qm, sm = ops.quantize_rows(t["mean"])
    deq = (qm.float() * sm[..., None]).to(t["mean"].dtype)
    for reduce in ("sum", "none"):
        for kw in ({}, {"channel_mask": mask}):
            want = ops.score_blocks(q, table, nblk, kind="mean", mean=deq.float(), reduce=reduce,
                                    backend="reference", **kw)
            got = ops.score_blocks(q, table, nblk, kind="mean", mean=qm, mean_scale=sm,
                                   reduce=reduce, backend="reference", **kw)
            fin = torch.isfinite(want)
            assert torch.equal(fin, torch.isfinite(got))
            assert torch.allclose(got[fin], want[fin], rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="mean_scale: required"):
        ops.score_blocks(q, table, nblk, kind="mean", mean=qm)
    with pytest.raises(ValueError, match="mean_scale: required"):
        ops.score_blocks(q, table, nblk, kind="mean", mean=t["mean"], mean_scale=sm)
    with pytest.raises(ValueError, match="mean_scale: expected shape"):
        ops.score_blocks(q, table, nblk, kind="mean", mean=qm, mean_scale=sm[:, :2])
    with pytest.raises(ValueError, match="mean_scale: expected dtype"):
        ops.score_blocks(q, table, nblk, kind="mean", mean=qm, mean_scale=sm.double())
    with pytest.raises(ValueError, match="kmin: expected dtype"):
        ops.score_blocks(q, table, nblk, kind="quest", kmin=qm, kmax=qm)
    with pytest.raises(ValueError, match="x: expected dtype"):
        ops.quantize_rows(qm)


def _int8_reprs_case(seed, bs=16, G=4, dtype=torch.float32):
    g = gen(seed)
    _, k, _, _, _ = paged_case(g, Hkv=2, D=16, bs=bs, dtype=dtype, layout="strided")
    ids = torch.tensor([2, 11, 4, 7, 0], dtype=torch.int64, device=DEV)
    ntok = torch.tensor([bs, 2, 1, bs - 1, bs // 2 + 1], dtype=torch.int32, device=DEV)
    n = k.shape[0]
    int8 = dict(mean=torch.full((n, G, 2, 16), 99, dtype=torch.int8, device=DEV),
                mean_scale=torch.full((n, G, 2), -1.0, device=DEV))
    return k, ids, ntok, int8


def test_update_block_reprs_int8_reference():
    """An int8 mean table: each listed row is quantize_rows of the float32 mean the float path
    writes (values and scales exactly), other rows untouched; 3-D tables likewise; a scale
    without an int8 table, an int8 table without scales, int8 bounds: clear errors."""
    k, ids, ntok, t8 = _int8_reprs_case(91)
    ref = _sub_tables(k.shape[0], 4, 2, 16, 2)
    ops.update_block_reprs(k, ids, ntok, mean=ref["mean"], backend="reference")
    ops.update_block_reprs(k, ids, ntok, backend="reference", **t8)
    want_q, want_s = ops.quantize_rows(ref["mean"][ids])
    assert torch.equal(t8["mean"][ids], want_q) and torch.equal(t8["mean_scale"][ids], want_s)
    assert (want_q.abs().amax(-1) == 127).all()                    # rows use the full range
    rest = torch.tensor([i for i in range(k.shape[0]) if i not in ids.tolist()], device=DEV)
    assert (t8["mean"][rest] == 99).all() and (t8["mean_scale"][rest] == -1).all()
    k1, ids1, ntok1, _ = _int8_reprs_case(92, bs=4, G=1)
    flat = dict(mean=torch.zeros(k1.shape[0], 2, 16, dtype=torch.int8, device=DEV),
                mean_scale=torch.zeros(k1.shape[0], 2, device=DEV))
    ref1 = torch.zeros(k1.shape[0], 2, 16, device=DEV)
    ops.update_block_reprs(k1, ids1, ntok1, mean=ref1, backend="reference")
    ops.update_block_reprs(k1, ids1, ntok1, backend="reference", **flat)
    assert torch.equal(flat["mean"][ids1], ops.quantize_rows(ref1[ids1])[0])
    with pytest.raises(ValueError, match="mean_scale: required"):
        ops.update_block_reprs(k, ids, ntok, mean=t8["mean"])
    with pytest.raises(ValueError, match="mean_scale: required"):
        ops.update_block_reprs(k, ids, ntok, mean=ref["mean"], mean_scale=t8["mean_scale"])
    with pytest.raises(ValueError, match="mean_scale: expected shape"):
        ops.update_block_reprs(k, ids, ntok, mean=t8["mean"], mean_scale=t8["mean_scale"][:, :2])
    with pytest.raises(ValueError, match="kmin: expected dtype"):
        ops.update_block_reprs(k, ids, ntok, kmin=t8["mean"])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_update_block_reprs_int8_triton(triton_ready, dtype):
    """The Triton kernel's int8 rows and scales == the reference's (a value may differ by one
    step only where the float32 means differ in their last bit), with codes and bounds in the
    same call."""
    k, ids, ntok, want = _int8_reprs_case(93, dtype=dtype)
    _, _, _, got = _int8_reprs_case(93, dtype=dtype)
    extra = {name: _sub_tables(k.shape[0], 4, 2, 16, 2)[name] for name in ("kmin", "codes")}
    proj = rand((16, 64), gen(94))
    ops.update_block_reprs(k, ids, ntok, backend="reference", **want)
    ops.update_block_reprs(k, ids, ntok, backend="triton", proj=proj, **extra, **got)
    assert torch.allclose(got["mean_scale"], want["mean_scale"], rtol=1e-6, atol=0)
    diff = (got["mean"].int() - want["mean"].int()).abs()
    assert int(diff.max()) <= 1 and float((diff > 0).float().mean()) < 0.01
    assert not torch.isnan(extra["kmin"][ids]).any() and (extra["codes"][ids] != 7).any()


@pytest.mark.parametrize("rows", [None, 16], ids=["rows_default", "rows_16"])
def test_int8_mean_scores_triton(triton_ready, rows):
    """Scores of an int8 mean table with per-row scales: Triton == reference (one or several
    tiles, G = 4 and G = 1, a channel mask, float32 and bfloat16 queries), and the scoring +
    head-mass selection takes it too."""
    tri, _ = tri_modules()
    cfg = launch(score_rows=rows) if rows else launch()
    for G, bs, qdtype in ((4, 16, torch.bfloat16), (4, 16, torch.float32), (1, 4, torch.float32)):
        q, k, table, nblk, t, proj, mask = sub_scoring_case(85 + G, G, bs, M=23, qdtype=qdtype)
        qm, sm = ops.quantize_rows(t["mean"][:, 0] if G == 1 else t["mean"])
        for kw in ({}, {"channel_mask": mask}):
            for reduce in ("sum", "none"):
                want = ops.score_blocks(q, table, nblk, kind="mean", mean=qm, mean_scale=sm,
                                        reduce=reduce, backend="reference", **kw)
                got = tri.score_blocks(q, table, nblk, kind="mean", mean=qm, mean_scale=sm,
                                       reduce=reduce, launch=cfg, **kw)
                assert torch.equal(torch.isinf(got), torch.isinf(want)), (G, reduce)
                fin = torch.isfinite(want)
                assert torch.allclose(got[fin], want[fin], rtol=1e-5, atol=1e-4), \
                    (G, reduce, float((got[fin] - want[fin]).abs().max()))
        if rows:  # the op's launch does not depend on the scoring tile: once is enough
            continue
        budget = torch.full_like(nblk, 5)
        args = (q, table, nblk, budget)
        kw = dict(kind="mean", mean=qm, mean_scale=sm, scale=0.5, init_window=1, local_window=1)
        want = ops.score_select_head_mass(*args, backend="reference", **kw)
        got = ops.score_select_head_mass(*args, backend="triton", **kw)
        assert torch.equal(want[1], got[1]) and torch.equal(want[0], got[0]), G
        # with seq_lens: the attention's table too, == sparse_block_table of the selection
        lens = (nblk.long() * bs - 1).to(torch.int32)
        for backend in ("reference", "triton"):
            sel, count, t_, n_ = ops.score_select_head_mass(*args, backend=backend, seq_lens=lens,
                                                            block_size=bs, **kw)
            assert torch.equal(sel, want[0]) and torch.equal(count, want[1]), backend
            wt, wn = ops.sparse_block_table(table, lens, sel, count, bs, backend="reference")
            assert torch.equal(t_[:, :wt.shape[1]], wt) and torch.equal(n_, wn), backend
        with pytest.raises(ValueError, match="seq_lens, block_size"):
            ops.score_select_head_mass(*args, seq_lens=lens, **kw)
        with pytest.raises(ValueError, match="must equal num_blocks"):
            ops.score_select_head_mass(*args, seq_lens=lens + bs, block_size=bs, **kw)


def test_score_select_head_mass_triton(triton_ready):
    """score_select_head_mass on the fused path (per-head scores in small tiles, the head mass
    computed by the histogram launch) writes the head mass of the scores (float32 rounding) and
    selects exactly the reference selection on that mass; the public op (default launch) == the
    reference op end to end on integer-spaced scores; the reference op == score_blocks then
    select_head_mass."""
    tri, histogram = tri_modules()
    cfg = launch(**HIST, hist_bits=4, hist_list=16, score_rows=16)
    q, k, table, nblk, t, proj, mask = sub_scoring_case(92, 4, 16, M=23)
    B, M = table.shape
    g = gen(93)
    tbl = torch.randint(0, 3, t["mean"].shape, generator=g).to(t["mean"].dtype).to(DEV)
    qi = torch.randint(-1, 2, q.shape, generator=g).to(q.dtype).to(DEV)
    cases = list(itertools.product((1, 5, 11), ((1, 2), (0, 0))))
    if not HAS_CUDA:
        cases = [(1, (0, 0)), (5, (1, 2)), (11, (0, 0))]
    for budget, windows in cases:
        kw = dict(init_window=windows[0], local_window=windows[1])
        width = ops.select_width(M, budget, *windows)
        bud = torch.full_like(nblk, budget)
        for kind, reprs in (("mean", dict(mean=t["mean"], channel_mask=mask)),
                            ("quest", dict(kmin=t["kmin"], kmax=t["kmax"]))):
            sel, count, mass = tri.score_select_head_mass(q, table, nblk, bud, kind=kind,
                                                          scale=0.5, width=width,
                                                          return_mass=True, launch=cfg,
                                                          **reprs, **kw)
            per_head = ops.score_blocks(q, table, nblk, kind=kind, reduce="none",
                                        backend="reference", **reprs)
            want_mass = torch.softmax(per_head * 0.5, dim=-1).mean(1)
            assert torch.allclose(mass, want_mass, rtol=1e-5, atol=1e-9), (kind, budget)
            want = ops.select_blocks(mass, nblk, budget, backend="reference", **kw)
            assert torch.equal(sel, want[0]) and torch.equal(count, want[1]), (kind, budget)
            ref_op = ops.score_select_head_mass(q, table, nblk, budget, kind=kind, scale=0.5,
                                                backend="reference", **reprs, **kw)
            two = ops.select_head_mass(per_head, nblk, budget, scale=0.5, backend="reference",
                                       **kw)
            assert torch.equal(ref_op[0], two[0]) and torch.equal(ref_op[1], two[1])
        # equal masses stay equal: the Triton selection (fused path, and the public op's
        # default launch) == the reference op
        ref_op = ops.score_select_head_mass(qi, table, nblk, budget, kind="mean", mean=tbl,
                                            scale=0.5, backend="reference", **kw)
        fused = tri.score_select_head_mass(qi, table, nblk, bud, kind="mean", mean=tbl, scale=0.5,
                                           width=width, launch=cfg, **kw)
        public = ops.score_select_head_mass(qi, table, nblk, budget, kind="mean", mean=tbl,
                                            scale=0.5, backend="triton", **kw)
        for got in (fused, public):
            assert torch.equal(got[0], ref_op[0]) and torch.equal(got[1], ref_op[1])
    assert histogram.scratch_zeroed()
    with pytest.raises(ValueError, match="kind: expected 'mean' or 'quest'"):
        ops.score_select_head_mass(q, table, nblk, 3, kind="hamming", scale=0.5, init_window=0,
                                   local_window=0)


def test_sub_block_bad_tables():
    g = gen(80)
    q, k, _, table, _ = paged_case(g, B=2, Hq=4, Hkv=2, D=16, bs=8, M=3)
    nblk = torch.tensor([3, 2], dtype=torch.int32, device=DEV)
    n = k.shape[0]
    ids, ntok = torch.tensor([1], device=DEV), torch.tensor([2], device=DEV)
    t2, t4 = torch.zeros(n, 2, 2, 16, device=DEV), torch.zeros(n, 4, 2, 16, device=DEV)
    t3 = torch.zeros(n, 3, 2, 16, device=DEV)
    for fragment, call in [
        ("does not divide block_size", lambda: ops.update_block_reprs(k, ids, ntok, mean=t3)),
        ("kmax: expected shape", lambda: ops.update_block_reprs(k, ids, ntok, kmin=t2, kmax=t4)),
        ("codes: expected shape", lambda: ops.update_block_reprs(
            k, ids, ntok, mean=t2, codes=torch.zeros(n, 4, 2, 2, dtype=torch.int32, device=DEV),
            proj=torch.zeros(16, 64, device=DEV))),
        ("mean: expected [num_blocks, Hkv, X] or", lambda: ops.update_block_reprs(
            k, ids, ntok, mean=t2[None])),
        ("kmax: expected shape", lambda: ops.score_blocks(q, table, nblk, kind="quest", kmin=t2,
                                                          kmax=t4)),
        ("kmax: expected 4 dimensions", lambda: ops.score_blocks(q, table, nblk, kind="quest",
                                                                 kmin=t2[:, :1], kmax=t2[:, 0])),
        ("mean: expected shape", lambda: ops.score_blocks(q, table, nblk, kind="mean",
                                                          mean=t2[..., :8])),
    ]:
        with pytest.raises(ValueError, match=re.escape(fragment)):
            call()


def test_block_attention_mass():
    g = gen(15)
    q, k, _, table, lens = paged_case(g, B=2, Hq=4, Hkv=2, bs=4, M=5, lens=[18, 4])
    mass = ops.block_attention_mass(q, k, table, lens)
    assert mass.shape == (2, 5) and torch.allclose(mass.sum(1), torch.ones(2, device=DEV))
    assert (mass[0, 5:] == 0).all() and (mass[1, 1:] == 0).all()
    keys = k[table[0].long()].reshape(-1, 2, 16)[:18].double().repeat_interleave(2, 1)
    p = torch.softmax(torch.einsum("hd,nhd->hn", q[0].double(), keys) / 4.0, dim=-1)
    per_block = torch.nn.functional.pad(p, (0, 2)).reshape(4, 5, 4).sum(-1).mean(0)
    assert torch.allclose(mass[0].double(), per_block, atol=1e-6)


# ---------------------------------------------------------------------------------------------
# dispatch and errors

def test_registered_and_auto_falls_back_on_cpu(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    info = dispatch.backend_info()["ops"]
    for op in ("update_block_reprs", "hash_codes", "score_blocks", "select_blocks",
               "sparse_block_table", "paged_decode_attention"):
        assert set(info[op]["implementations"]) == {"reference", "triton"}
    assert set(info["block_attention_mass"]["implementations"]) == {"reference"}
    impl, reason = dispatch.select("paged_decode_attention", None, (torch.zeros(1),), {})
    assert impl.name == "reference"
    with pytest.raises(dispatch.BackendUnavailableError, match="CUDA"):
        dispatch.select("paged_decode_attention", "triton", (torch.zeros(1),), {})


def _bad_calls():
    g = gen(16)
    q, k, v, table, lens = paged_case(g, B=2, Hq=4, Hkv=2, D=16, bs=4, M=3, lens=[12, 5])
    nblk = torch.tensor([3, 2], dtype=torch.int32, device=DEV)
    mean = torch.zeros(k.shape[0], 2, 16, device=DEV)
    scores = rand((2, 3), g)
    sel, count = ops.select_blocks(scores, nblk, 2, init_window=0, local_window=1)
    att = ops.paged_decode_attention
    shares = rand((2, 2, 3), g)
    pool = ops.pool_head_budgets
    return [
        ("cap: expected an int >= 1", lambda: pool(shares, nblk, 2, cap=0, init_window=0,
                                                   local_window=1)),
        ("cap: expected an int >= 1", lambda: pool(shares, nblk, 2, cap=1.5, init_window=0,
                                                   local_window=1)),
        ("shares: expected dtype", lambda: pool(shares.double(), nblk, 2, cap=2, init_window=0,
                                                local_window=1)),
        ("shares: expected 3 dimensions", lambda: pool(scores, nblk, 2, cap=2, init_window=0,
                                                       local_window=1)),
        ("num_blocks: entries must lie in", lambda: pool(
            shares, nblk + 1, 2, cap=2, init_window=0, local_window=1)),
        ("budget: entries must be >= 1", lambda: pool(
            shares, nblk, torch.zeros(2, dtype=torch.int32, device=DEV), cap=2, init_window=0,
            local_window=1)),
        ("seq_lens", lambda: att(q, k, v, table, torch.tensor([0, 5], dtype=torch.int32, device=DEV))),
        ("seq_lens", lambda: att(q, k, v, table, torch.tensor([13, 5], dtype=torch.int32, device=DEV))),
        ("seq_lens", lambda: att(q, k, v, table, lens.long())),
        ("block_table", lambda: att(q, k, v, table.long(), lens)),
        ("block_table", lambda: att(q, k, v, table.clone().fill_(10_000), lens)),
        ("block_table", lambda: att(q, k, v, table[:1], lens)),
        ("num_q_heads=3", lambda: att(q[:, :3], k, v, table, lens)),
        ("head_dim", lambda: att(q[..., :8], k, v, table, lens)),
        ("q: dtype", lambda: att(q.half(), k, v, table, lens)),
        ("k_cache: expected dtype", lambda: att(q, k.int(), v, table, lens)),
        ("v_cache", lambda: att(q, k, v[:, :2], table, lens)),
        ("empty batch", lambda: att(q[:0], k, v, table[:0], lens[:0])),
        ("scale", lambda: att(q, k, v, table, lens, scale=-1.0)),
        ("out", lambda: att(q, k, v, table, lens, out=torch.empty(2, 4, 8, device=DEV))),
        ("kind", lambda: ops.score_blocks(q, table, nblk, kind="max", mean=mean)),
        ("reduce", lambda: ops.score_blocks(q, table, nblk, kind="mean", mean=mean, reduce="avg")),
        ("kmax: required", lambda: ops.score_blocks(q, table, nblk, kind="quest", kmin=mean)),
        ("num_blocks", lambda: ops.score_blocks(q, table, nblk * 0, kind="mean", mean=mean)),
        ("channel_mask", lambda: ops.score_blocks(q, table, nblk, kind="quest", kmin=mean, kmax=mean,
                                                  channel_mask=torch.ones(2, 4, 16, dtype=torch.bool))),
        ("proj", lambda: ops.score_blocks(q, table, nblk, kind="hamming",
                                          codes=torch.zeros(k.shape[0], 2, 1, dtype=torch.int32, device=DEV),
                                          proj=torch.zeros(16, 33, device=DEV))),
        ("budget", lambda: ops.select_blocks(scores, nblk, 0, init_window=0, local_window=1)),
        ("budget", lambda: ops.select_blocks(scores, nblk, torch.tensor([1, 0], dtype=torch.int32, device=DEV),
                                             init_window=0, local_window=1)),
        ("init_window", lambda: ops.select_blocks(scores, nblk, 2, init_window=-1, local_window=1)),
        ("num_blocks", lambda: ops.select_blocks(scores, nblk + 1, 2, init_window=0, local_window=1)),
        ("scores", lambda: ops.select_blocks(scores.double(), nblk, 2, init_window=0, local_window=1)),
        ("increasing", lambda: ops.sparse_block_table(table, lens, sel.flip(1), count, 4)),
        ("last selected block", lambda: ops.sparse_block_table(
            table, lens, torch.tensor([[0, 1], [0, 1]], dtype=torch.int32, device=DEV), count, 4)),
        ("count", lambda: ops.sparse_block_table(table, lens, sel, count * 0, 4)),
        ("block_size", lambda: ops.sparse_block_table(table, lens, sel, count, 0)),
        ("num_tokens", lambda: ops.update_block_reprs(k, torch.tensor([1], device=DEV),
                                                      torch.tensor([5], device=DEV), mean=mean)),
        ("block_ids", lambda: ops.update_block_reprs(k, torch.tensor([1, 1], device=DEV),
                                                     torch.tensor([2, 2], device=DEV), mean=mean)),
        ("block_ids", lambda: ops.update_block_reprs(k, torch.tensor([99], device=DEV),
                                                     torch.tensor([2], device=DEV), mean=mean)),
        ("at least one", lambda: ops.update_block_reprs(k, torch.tensor([1], device=DEV),
                                                        torch.tensor([2], device=DEV))),
        ("proj: required", lambda: ops.update_block_reprs(
            k, torch.tensor([1], device=DEV), torch.tensor([2], device=DEV),
            codes=torch.zeros(k.shape[0], 2, 1, dtype=torch.int32, device=DEV))),
        ("mean: expected shape", lambda: ops.update_block_reprs(k, torch.tensor([1], device=DEV),
                                                                torch.tensor([2], device=DEV),
                                                                mean=mean[:, :1])),
        ("x: expected a non-empty", lambda: ops.hash_codes(torch.zeros(0, 16), torch.zeros(16, 32))),
        ("mean: expected dtype torch.float32 or torch.bfloat16", lambda: ops.update_block_reprs(
            k, torch.tensor([1], device=DEV), torch.tensor([2], device=DEV), mean=mean.half())),
        ("mean: expected dtype torch.float32 or torch.bfloat16", lambda: ops.score_blocks(
            q, table, nblk, kind="mean", mean=mean.half())),
        ("kmax: expected dtype torch.bfloat16", lambda: ops.score_blocks(
            q, table, nblk, kind="quest", kmin=mean.bfloat16(), kmax=mean)),
    ]


def test_bad_input_errors():
    for fragment, call in _bad_calls():
        with pytest.raises(ValueError, match=fragment.replace("(", r"\(").replace(")", r"\)")):
            call()
