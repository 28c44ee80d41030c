"""Sparse-attention ops, every registered implementation against the reference
(tests/equivalence.py): update_block_reprs, hash_codes, score_blocks, select_blocks,
select_head_mass, score_select_head_mass, sparse_block_table and paged_decode_attention, per
float dtype (float32 / float16 / bfloat16 where the op takes them), representation dtype
(float32 / bfloat16 / int8 means) and cache layout (canonical, vLLM CPU's K/V-interleaved
pages, every dimension padded), on random and edge inputs (one block, one request, full and
partial blocks, windows covering the row, budgets over the row, NaN / +-inf / tied scores).

Shapes are small: on a CPU machine the Triton kernels run in the Triton interpreter. Selections
that go through a head mass are compared on integer-spaced scores (equal masses stay equal in
float32 whichever order they are summed in). test_sparse_ops.py checks the reference against
independent oracles and the kernels' internal paths (histograms, split-K, tiles)."""
import pytest

torch = pytest.importorskip("torch")

from ucm.sparse import ops  # noqa: E402
from equivalence import (Poison, compare, devices, implementation_params, tensor_impls,  # noqa: E402
                         runnable)

FLOATS = [torch.float32, torch.float16, torch.bfloat16]
FLOAT_IDS = ["float32", "float16", "bfloat16"]
LAYOUTS = ["canonical", "vllm_cpu", "strided"]
NAN = Poison(0)


impls = tensor_impls


def gen(seed):
    return torch.Generator().manual_seed(seed)


def rand(shape, g, dtype=torch.float32, device="cpu"):
    return torch.randn(*shape, generator=g).to(dtype).to(device)


def kv_cache(g, n, bs, Hkv, D, dtype, layout, device):
    """(k, v) ``[n, bs, Hkv, D]`` views in ``layout``."""
    if layout == "canonical":
        return rand((n, bs, Hkv, D), g, dtype, device), rand((n, bs, Hkv, D), g, dtype, device)
    if layout == "vllm_cpu":                       # [n, Hkv, bs, 2D]: K and V interleaved
        kv = rand((n, Hkv, bs, 2 * D), g, dtype, device)
        return kv[..., :D].permute(0, 2, 1, 3), kv[..., D:].permute(0, 2, 1, 3)
    big = rand((n, bs + 1, Hkv + 1, 2, D + 3), g, dtype, device)
    return big[:, :bs, :Hkv, 0, :D], big[:, 1:, 1:, 1, 3:]


def table_case(g, B, M, bs, lens, device):
    """(block_table int32 [B, M] of distinct shuffled ids, seq_lens, num_blocks)."""
    n_phys = B * M + 2
    table = torch.randperm(n_phys, generator=g)[: B * M].reshape(B, M).to(torch.int32)
    seq = torch.tensor(lens, dtype=torch.int32)
    return n_phys, table.to(device), seq.to(device), ((seq + bs - 1) // bs).int().to(device)


# ---------------------------------------------------------------------------------------------
# representations and hash codes

@impls("hash_codes")
@pytest.mark.parametrize("layout", ["contiguous", "strided", "one_row"])
@pytest.mark.parametrize("dtype", FLOATS, ids=FLOAT_IDS)
def test_hash_codes(impl, dtype, layout, monkeypatch):
    backend, dev = runnable("hash_codes", impl, monkeypatch)
    g = gen(1)
    x = rand((5, 3, 2 * 24), g, dtype, dev)[..., ::2] if layout == "strided" else \
        rand((1, 24) if layout == "one_row" else (5, 3, 24), g, dtype, dev)
    for bits in (32, 96):
        proj = rand((24, bits), g, device=dev)
        compare("hash_codes", lambda b: ops.hash_codes(x, proj, backend=b), backend, torch.int32)


def _reprs_run(k, ids, ntok, shapes, proj, mean_scale_shape=None):
    """Run update_block_reprs into sentinel tables (rows not listed must keep the sentinel)."""
    def run(backend):
        tables = {name: torch.full(shape, 7 if dt in (torch.int32, torch.int8) else 1234.5,
                                   dtype=dt, device=k.device)
                  for name, (shape, dt) in shapes.items()}
        if mean_scale_shape is not None:
            tables["mean_scale"] = torch.full(mean_scale_shape, -1.0, device=k.device)
        ops.update_block_reprs(k, ids, ntok, proj=proj if "codes" in tables else None,
                               backend=backend, **tables)
        return tables
    return run


def _check_tables(op):
    from equivalence import assert_equivalent

    def check(got, want):
        for name in want:
            assert_equivalent(op, got[name], want[name], want[name].dtype, f"[{name!r}]")
    return check


@impls("update_block_reprs")
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", FLOATS, ids=FLOAT_IDS)
def test_update_block_reprs(impl, dtype, layout, monkeypatch):
    backend, dev = runnable("update_block_reprs", impl, monkeypatch)
    g = gen(2)
    bs, Hkv, D, n = 12, 2, 16, 12
    k, _ = kv_cache(g, n, bs, Hkv, D, dtype, layout, dev)
    proj = rand((D, 64), g, device=dev)
    # full and partial blocks, one token, int32 and int64 ids / counts, one block, none
    cases = [(torch.tensor([5, 0, 11, 3], dtype=torch.int64), torch.tensor([12, 1, 5, 10])),
             (torch.tensor([9], dtype=torch.int32), torch.tensor([2], dtype=torch.int32)),
             (torch.zeros(0, dtype=torch.int64), torch.zeros(0, dtype=torch.int64))]
    every = ("mean", "kmin", "kmax", "codes")
    # (ids, counts, [(G, table dtype, tables)]): 3-D tables (G = 1) and sub-block ones (G = 3:
    # not a power of two), float32 and bfloat16, one table alone; int8 means with their scales
    plans = [(*cases[0], [(1, torch.float32, every), (4, torch.bfloat16, every),
                          (2, torch.int8, ("mean",))]),
             (*cases[1], [(3, torch.float32, every), (2, torch.float32, ("kmax",))]),
             (*cases[2], [(1, torch.float32, every)])]
    for ids, ntok, tables in plans:
        ids, ntok = ids.to(dev), ntok.to(dev)
        for G, tdtype, names in tables:
            sub = (n, G, Hkv) if G > 1 else (n, Hkv)
            shapes = {name: (sub + (2,), torch.int32) if name == "codes" else (sub + (D,), tdtype)
                      for name in names}
            run = _reprs_run(k, ids, ntok, shapes, proj,
                             sub if tdtype == torch.int8 else None)
            compare("update_block_reprs", run, backend, None,
                    check=_check_tables("update_block_reprs"))


# ---------------------------------------------------------------------------------------------
# scoring

def _reprs(k, G, tdtype, proj):
    """Representation tables of every block of k (through the reference)."""
    n, bs, Hkv, D = k.shape
    sub = (n, G, Hkv) if G > 1 else (n, Hkv)
    t = {"mean": torch.empty(sub + (D,), dtype=tdtype, device=k.device),
         "kmin": torch.empty(sub + (D,), dtype=tdtype, device=k.device),
         "kmax": torch.empty(sub + (D,), dtype=tdtype, device=k.device),
         "codes": torch.empty(sub + (2,), dtype=torch.int32, device=k.device)}
    ntok = torch.randint(1, bs + 1, (n,), generator=gen(3)).to(k.device)
    ops.update_block_reprs(k, torch.arange(n, device=k.device), ntok, proj=proj,
                           backend="reference", **t)
    return t


@impls("score_blocks")
@pytest.mark.parametrize("tables", ["float32", "bfloat16", "int8"])
@pytest.mark.parametrize("dtype", FLOATS, ids=FLOAT_IDS)
def test_score_blocks(impl, dtype, tables, monkeypatch):
    backend, dev = runnable("score_blocks", impl, monkeypatch)
    g = gen(4)
    B, Hq, Hkv, D, bs, M = 3, 4, 2, 16, 4, 6
    n_phys, table, _, _ = table_case(g, B, M, bs, [1, 1, 1], dev)
    nblk = torch.tensor([M, 1, 4], dtype=torch.int32, device=dev)   # a full row, one block
    q = rand((B, Hq, D), g, dtype, dev)
    k, _ = kv_cache(g, n_phys, bs, Hkv, D, torch.float32, "canonical", dev)
    proj = rand((D, 64), g, device=dev)
    mask = torch.rand(B, Hq, D, generator=g).to(dev) > 0.3
    reprs = {G: _reprs(k, G, torch.bfloat16 if tables == "bfloat16" else torch.float32, proj)
             for G in (1, 2)}
    if tables == "int8":
        quant = {G: ops.quantize_rows(t["mean"]) for G, t in reprs.items()}
        kinds = [(1, "mean", dict(mean=quant[1][0], mean_scale=quant[1][1])),
                 (2, "mean", dict(mean=quant[2][0], mean_scale=quant[2][1], channel_mask=mask))]
    else:  # 3-D tables (G = 1) and two sub-block summaries per block (G = 2)
        kinds = [(1, "mean", dict(mean=reprs[1]["mean"])),
                 (2, "mean", dict(mean=reprs[2]["mean"], channel_mask=mask)),
                 (2, "quest", dict(kmin=reprs[2]["kmin"], kmax=reprs[2]["kmax"])),
                 (1, "quest", dict(kmin=reprs[1]["kmin"], kmax=reprs[1]["kmax"])),
                 (2, "hamming", dict(codes=reprs[2]["codes"], proj=proj)),
                 (1, "hamming", dict(codes=reprs[1]["codes"], proj=proj))]
    for i, (G, kind, kw) in enumerate(kinds):
        reduce = ("sum", "none")[i % 2]
        compare("score_blocks", lambda b: ops.score_blocks(
            q, table, nblk, kind=kind, reduce=reduce, backend=b, **kw), backend, torch.float32)


# ---------------------------------------------------------------------------------------------
# selection

def selection_scores(g, layout, device):
    """[4, 11] scores: ties, NaN, +-0, +-inf; ``strided``: a column slice of wider rows."""
    s = torch.randint(0, 4, (4, 11), generator=g).float()
    s[0, ::3] = float("nan")
    s[1, 1::4] = -0.0
    s[2, 2] = float("inf")
    s[3, :5] = float("-inf")
    if layout == "strided":
        wide = torch.zeros(4, 15)
        wide[:, 2:13] = s
        s = wide[:, 2:13]
    return s.to(device)


SELECT_ARGS = [  # (budget, init_window, local_window): budgets of one, some, over the row;
    (1, 0, 0), (3, 1, 2), (20, 0, 1), (2, 4, 4), ("per_row", 1, 1)]   # windows over the row


@impls("select_blocks")
@pytest.mark.parametrize("layout", ["contiguous", "strided"])
def test_select_blocks(impl, layout, monkeypatch):
    backend, dev = runnable("select_blocks", impl, monkeypatch)
    g = gen(5)
    s = selection_scores(g, layout, dev)
    nblk = torch.tensor([11, 1, 7, 9], dtype=torch.int32, device=dev)
    for budget, iw, lw in SELECT_ARGS:
        bud = torch.tensor([3, 1, 9, 6], dtype=torch.int32, device=dev) if budget == "per_row" \
            else budget
        compare("select_blocks", lambda b: ops.select_blocks(s, nblk, bud, init_window=iw,
                                                             local_window=lw, backend=b),
                backend, torch.int32)
    one = torch.tensor([[0.5]], device=dev)                      # one request, one block
    compare("select_blocks", lambda b: ops.select_blocks(
        one, torch.ones(1, dtype=torch.int32, device=dev), 1, init_window=0, local_window=0,
        backend=b), backend, torch.int32)


def coarse_per_head(g, B, H, M, nblk, device):
    x = torch.randint(0, 3, (B, H, M), generator=g).float()
    for b, n in enumerate(nblk):
        x[b, :, n:] = float("-inf")
    return x.to(device)


@impls("select_head_mass")
def test_select_head_mass(impl, monkeypatch):
    backend, dev = runnable("select_head_mass", impl, monkeypatch)
    g = gen(6)
    lens = [13, 1, 6]
    x = coarse_per_head(g, 3, 4, 13, lens, dev)
    nblk = torch.tensor(lens, dtype=torch.int32, device=dev)
    for budget, iw, lw in SELECT_ARGS:
        bud = torch.tensor([5, 1, 2], dtype=torch.int32, device=dev) if budget == "per_row" \
            else budget
        compare("select_head_mass", lambda b: ops.select_head_mass(
            x, nblk, bud, scale=0.5, init_window=iw, local_window=lw, backend=b), backend,
            torch.int32)


@impls("pool_head_budgets")
@pytest.mark.parametrize("heads", [3, 4])
def test_pool_head_budgets(impl, heads, monkeypatch):
    """Pooled per-KV-head budgets, bit-identical: shares with many ties (small integers, as
    underflowed softmax shares tie at 0), NaN, -0.0 and inf, short and long rows, per-row and
    scalar budgets, caps 1-3 and the window cases of the selections."""
    backend, dev = runnable("pool_head_budgets", impl, monkeypatch)
    g = gen(8)
    lens = [40, 1, 7, 23, 3]
    B, M = len(lens), 40
    coarse = torch.randint(0, 4, (B, heads, M), generator=g).float()
    fine = torch.rand(B, heads, M, generator=g)
    odd = fine.clone()
    odd[0, 0, 5], odd[0, 1, 6], odd[0, 2, 7] = float("nan"), -0.0, float("inf")
    odd[3, :, 2:9] = 0.0
    nblk = torch.tensor(lens, dtype=torch.int32, device=dev)
    # the Triton interpreter is slow: there, the tie-heavy and odd shares, three window cases
    # and two caps (every path of the kernel); on a GPU every combination
    slow = backend != "reference" and dev == "cpu"
    kinds = (coarse, odd) if slow else (coarse, fine, odd)
    cases = [SELECT_ARGS[i] for i in (1, 2, 4)] if slow else SELECT_ARGS
    for x in kinds:
        for budget, iw, lw in cases:
            bud = torch.tensor([9, 1, 2, 6, 3], dtype=torch.int32, device=dev) \
                if budget == "per_row" else budget
            for cap in ((1, 2) if slow else (1, 2, 3)):
                compare("pool_head_budgets", lambda b: ops.pool_head_budgets(
                    x.to(dev), nblk, bud, cap=cap, init_window=iw, local_window=lw, backend=b),
                    backend, torch.int32)
    if impl[0] == "triton":   # several histogram programs per request, several scan steps
        from ucm.fast.triton import sparse as tri

        cfg = tri.LAUNCH.replace(pool_span=16, pool_tile_elems=64, pool_scan_elems=1024)
        bud = torch.tensor([9, 1, 2, 6, 3], dtype=torch.int32, device=dev)
        for x in kinds:
            for cap in (1, 2):
                want = ops.pool_head_budgets(x.to(dev), nblk, bud, cap=cap, init_window=1,
                                             local_window=2, backend="reference")
                got = tri.pool_head_budgets(x.to(dev), nblk, bud, cap=cap, init_window=1,
                                            local_window=2, launch=cfg)
                assert torch.equal(got, want), (cap, got, want)
    one = torch.ones(1, heads, 1, device=dev)                    # one request, one block
    compare("pool_head_budgets", lambda b: ops.pool_head_budgets(
        one, torch.ones(1, dtype=torch.int32, device=dev), 1, cap=1, init_window=1,
        local_window=1, backend=b), backend, torch.int32)


@impls("score_select_head_mass")
@pytest.mark.parametrize("kind", ["mean", "quest", "mean_int8"])
def test_score_select_head_mass(impl, kind, monkeypatch):
    backend, dev = runnable("score_select_head_mass", impl, monkeypatch)
    g = gen(7)
    B, Hq, Hkv, D, bs, M = 3, 4, 2, 16, 4, 9
    n_phys, table, _, _ = table_case(g, B, M, bs, [1, 1, 1], dev)
    nblk = torch.tensor([9, 1, 5], dtype=torch.int32, device=dev)
    seq = (nblk * bs - 1).clamp(min=1).int()
    q = torch.randint(-1, 2, (B, Hq, D), generator=g).float().to(dev)       # integer-spaced
    t = torch.randint(0, 3, (n_phys, Hkv, D), generator=g).float().to(dev)
    mask = torch.rand(B, Hq, D, generator=g).to(dev) > 0.3
    if kind == "quest":
        kw = dict(kind="quest", kmin=t - 1, kmax=t)
    elif kind == "mean_int8":
        kw = dict(kind="mean", mean=t.to(torch.int8), mean_scale=torch.ones(n_phys, Hkv,
                                                                          device=dev))
    else:
        kw = dict(kind="mean", mean=t, channel_mask=mask)
    for i, (budget, iw, lw) in enumerate(SELECT_ARGS):   # alternately with the table folded in
        bud = torch.tensor([4, 1, 2], dtype=torch.int32, device=dev) if budget == "per_row" \
            else budget
        for fold in [({}, dict(seq_lens=seq, block_size=bs))[i % 2]]:
            compare("score_select_head_mass", lambda b: ops.score_select_head_mass(
                q, table, nblk, bud, scale=0.5, init_window=iw, local_window=lw, backend=b,
                **kw, **fold), backend, torch.int32)


@impls("sparse_block_table")
def test_sparse_block_table(impl, monkeypatch):
    backend, dev = runnable("sparse_block_table", impl, monkeypatch)
    g = gen(8)
    bs, M = 5, 9
    _, table, seq, nblk = table_case(g, 3, M, bs, [45, 3, 22], dev)   # full, one partial block
    for budget, iw, lw in SELECT_ARGS:
        bud = torch.tensor([4, 1, 2], dtype=torch.int32, device=dev) if budget == "per_row" \
            else budget
        sel, count = ops.select_blocks(rand((3, M), g, device=dev), nblk, bud, init_window=iw,
                                       local_window=lw, backend="reference")
        compare("sparse_block_table", lambda b: ops.sparse_block_table(table, seq, sel, count,
                                                                       bs, backend=b),
                backend, torch.int32)


# ---------------------------------------------------------------------------------------------
# attention

@impls("paged_decode_attention")
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", FLOATS, ids=FLOAT_IDS)
def test_paged_decode_attention(impl, dtype, layout, monkeypatch):
    backend, dev = runnable("paged_decode_attention", impl, monkeypatch)
    g = gen(9)
    bs, M, Hkv, D = 4, 5, 2, 16
    # a full table, one token, a partial last block
    n_phys, table, seq, _ = table_case(g, 3, M, bs, [M * bs, 1, 2 * bs + 3], dev)
    k, v = kv_cache(g, n_phys, bs, Hkv, D, dtype, layout, dev)
    q = rand((3, 4, D), g, dtype, dev)                        # GQA: 2 query heads per KV head
    compare("paged_decode_attention", lambda b: ops.paged_decode_attention(
        q, k, v, table, seq, backend=b), backend, dtype)
    # a strided query, one head per KV head, a scale, out= starting as NaN (every element
    # must be written)
    q2 = rand((3, 2, 2 * D), g, dtype, dev)[..., ::2]          # a channel stride of 2
    compare("paged_decode_attention", lambda b: ops.paged_decode_attention(
        q2, k, v, table, seq, scale=0.3, out=NAN.fill(torch.empty_like(q2)), backend=b),
        backend, dtype)
    # one table per KV head: [B, Hkv, M] and lengths [B, Hkv]
    per_head = torch.stack([table, table.flip(1)], 1).contiguous()
    lens = torch.stack([seq, torch.tensor([3, M * bs, 1], dtype=torch.int32, device=dev)], 1)
    compare("paged_decode_attention", lambda b: ops.paged_decode_attention(
        q, k, v, per_head, lens.contiguous(), backend=b), backend, dtype)


# ---------------------------------------------------------------------------------------------
# int4 token keys and their block mass (the ``mass`` method)

def _token_tables(n, Hkv, bs, D, dev):
    return (torch.full((n, Hkv, bs, D // 2), 0xA5, dtype=torch.uint8, device=dev),
            torch.full((n, Hkv, D), -3.0, dtype=torch.float16, device=dev))


@impls("quantize_token_keys")
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", FLOATS, ids=FLOAT_IDS)
def test_quantize_token_keys(impl, dtype, layout, monkeypatch):
    backend, dev = runnable("quantize_token_keys", impl, monkeypatch)
    g = gen(9)
    for bs, Hkv, D in ((12, 2, 16), (16, 3, 20)):      # padded tokens and channels
        n = 10
        k, _ = kv_cache(g, n, bs, Hkv, D, dtype, layout, dev)
        k[1, :, 0, 3] = 0.0                            # an all-zero channel: scale 0
        k[2, 4, Hkv - 1, 5] = float("nan")             # a NaN key counts as 0
        k[3, 0, 0, 0] = float("inf")                   # an infinite scale: codes 0
        k[4] *= 1e-6                                   # scales below float16's normal range
        k[5, :, :, D // 2:] *= 1e4

        def run(b, k=k, n=n, bs=bs, Hkv=Hkv, D=D):
            keys4, scale4 = _token_tables(n, Hkv, bs, D, dev)
            ops.quantize_token_keys(k, torch.tensor([0, 1, 2, 3, 4, 5, 8], device=dev),
                                    keys4=keys4, scale4=scale4, backend=b)
            return {"keys4": keys4, "scale4": scale4}

        compare("quantize_token_keys", run, backend, None, check=_check_tables(
            "quantize_token_keys"))


@impls("score_token_mass")
@pytest.mark.parametrize("dtype", FLOATS, ids=FLOAT_IDS)
def test_score_token_mass(impl, dtype, monkeypatch):
    from equivalence import assert_equivalent

    backend, dev = runnable("score_token_mass", impl, monkeypatch)
    g = gen(10)
    for B, Hq, Hkv, D, bs, M in ((3, 4, 2, 16, 4, 6), (2, 3, 3, 20, 12, 5), (1, 8, 1, 64, 16, 9)):
        n_phys, table, _, _ = table_case(g, B, M, bs, [1] * B, dev)
        nblk = torch.tensor([M, 1, 4][:B], dtype=torch.int32, device=dev)
        k, _ = kv_cache(g, n_phys, bs, Hkv, D, torch.float32, "canonical", dev)
        keys4, scale4 = _token_tables(n_phys, Hkv, bs, D, dev)
        ops.quantize_token_keys(k, torch.arange(n_phys, device=dev), keys4=keys4, scale4=scale4,
                                backend="reference")
        q = rand((B, Hq, D), g, dtype, dev)
        gpu_bf16 = dev != "cpu" and dtype != torch.float32   # bfloat16 products on the GPU

        def check(got, want):
            if not gpu_bf16:
                return assert_equivalent("score_token_mass", got, want, torch.float32)
            assert torch.equal(torch.isinf(got), torch.isinf(want))
            fin = torch.isfinite(want)
            # a logit's error: bfloat16 rounding of q and of each dequantized key entry
            bound = 2.0 ** -7 * (q.float().abs().sum(-1, keepdim=True) * 7
                                 * scale4.float().abs().max()) + 1e-4
            assert bool(((got - want).abs() <= bound)[fin].all())

        for scale in (D ** -0.5, 1.0):
            compare("score_token_mass", lambda b: ops.score_token_mass(
                q, table, nblk, keys4=keys4, scale4=scale4, scale=scale, backend=b), backend,
                torch.float32, check=check)
        if impl[0] == "triton":   # the kernel's other tile shapes
            from ucm.fast.triton import sparse as tri

            want = ops.score_token_mass(q, table, nblk, keys4=keys4, scale4=scale4,
                                        scale=D ** -0.5, backend="reference")
            for rows, run in ((16, 1), (32, 3), (64, 64)):
                cfg = tri.LAUNCH.replace(score_mass_rows=rows, score_mass_blocks_per_program=run)
                check(tri.score_token_mass(q, table, nblk, keys4=keys4, scale4=scale4,
                                           scale=D ** -0.5, launch=cfg), want)
