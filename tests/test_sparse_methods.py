"""Sparse-attention methods (ucm.sparse): valid selections, lifecycle, strides, adaptive bounds,
accuracy on a synthetic cache, validation; and the harness model's paged decode path."""
from __future__ import annotations

import math
import os
import sys

import pytest
import torch

import ucm.sparse
from tiny_llama import tiny_model
from ucm.config import Config
from ucm.reference import sparse as ref
from ucm.sparse import ops

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

HQ, HKV, D, BS = 6, 2, 32, 8
SHAPE = dict(num_layers=3, num_q_heads=HQ, num_kv_heads=HKV, head_dim=D, block_size=BS)
ALL = list(ucm.sparse.METHODS)
SMART = [m for m in ALL if m != "random"]


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Small tensors: one torch thread is faster (and much faster on a busy 2-core machine)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def make(method, per_kv_head=None, **opts):
    cfg = {"min_blocks": 8, "init_window": 1, "local_window": 2, "sparse_ratio": 0.25, **opts}
    extra = {} if per_kv_head is None else {"per_kv_head": per_kv_head}
    return ucm.sparse.create(cfg, method=method, **extra, **SHAPE)


def cache(num_blocks=120, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(num_blocks, BS, HKV, D, generator=g)


def tables(lens, num_blocks=120, seed=1, grow=0):
    """Disjoint random physical blocks per request (so a wrong id shows), room for ``grow`` more
    tokens each."""
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(num_blocks, generator=g)
    nbs = [math.ceil((n + grow) / BS) for n in lens]
    M = max(nbs)
    table = torch.zeros(len(lens), M, dtype=torch.int32)
    start = 0
    for b, nb in enumerate(nbs):
        table[b, :nb] = perm[start:start + nb].to(torch.int32)
        start += nb
    return table, torch.tensor(lens, dtype=torch.int32)


def plant(k, table, b, blocks, q, strength=4.0):
    """Make the keys of logical ``blocks`` of request ``b`` point along its query."""
    for j in blocks:
        direction = q[b].reshape(HKV, HQ // HKV, D).sum(1)
        direction = direction / direction.norm(dim=-1, keepdim=True)
        k[int(table[b, j])] += strength * direction[None]


def check_selection(m, table, lens, out, row):
    """The row's sparse table: its own blocks, windows + last block, length consistent."""
    t_sel, l_sel = out
    n = math.ceil(int(lens[row]) / BS)
    count = math.ceil(int(l_sel[row]) / BS)
    chosen = t_sel[row, :count].tolist()
    own = table[row, :n].tolist()
    logical = [own.index(p) for p in chosen]                         # raises if not its block
    assert logical == sorted(set(logical)), "increasing, no repeats"
    forced = set(range(m.init_window)) | set(range(n - m.local_window, n)) | {n - 1}
    assert forced <= set(logical)
    last_len = int(lens[row]) - (n - 1) * BS
    assert int(l_sel[row]) == (count - 1) * BS + last_len
    return logical


@pytest.mark.parametrize("method", ALL)
def test_valid_selection_and_budget(method):
    torch.manual_seed(0)
    m = make(method)
    k = cache()
    table, lens = tables([40 * BS + 3, 24 * BS], grow=3)
    for rid in ("a", "b"):
        m.request_begin(rid, 100)
    for step in range(2):
        m.step_begin()
        lens_t = lens + step
        q = torch.randn(2, HQ, D)
        for layer in range(SHAPE["num_layers"]):
            out = m.attention_begin(layer, ["a", "b"], q, k, table, lens_t)
            assert out is not None
            for row in range(2):
                n = math.ceil(int(lens_t[row]) / BS)
                logical = check_selection(m, table, lens_t, out, row)
                budget = max(m.init_window + m.local_window + 1, math.ceil(0.25 * n))
                if method == "adaptive":
                    assert m.init_window + m.local_window + 1 <= len(logical) <= budget
                elif method == "esa":
                    assert budget <= len(logical) <= budget + step + 1   # + new trailing blocks
                else:
                    assert len(logical) == budget
            m.attention_finished(layer, ["a", "b"])
        m.step_end()


@pytest.mark.parametrize("method", ALL)
def test_short_requests_and_ratio_one_stay_dense(method):
    k = cache()
    table, lens = tables([7 * BS, 3])          # 7 blocks < min_blocks=8
    q = torch.randn(2, HQ, D)
    m = make(method)
    m.request_begin("a", 1), m.request_begin("b", 1)
    assert m.attention_begin(0, ["a", "b"], q, k, table, lens) is None
    table, lens = tables([40 * BS, 30 * BS + 1])
    dense = make(method, sparse_ratio=1.0)
    dense.request_begin("a", 1), dense.request_begin("b", 1)
    assert dense.attention_begin(0, ["a", "b"], q, k, table, lens) is None


@pytest.mark.parametrize("method", ["esa", "quest", "adaptive"])
def test_mixed_batch_dense_rows_keep_their_table(method):
    k = cache()
    table, lens = tables([5 * BS, 40 * BS + 2])
    m = make(method)
    m.request_begin("short", 1), m.request_begin("long", 1)
    t_sel, l_sel = m.attention_begin(1, ["short", "long"], torch.randn(2, HQ, D), k, table, lens)
    assert t_sel.shape[1] <= table.shape[1]
    assert int(l_sel[0]) == int(lens[0])
    assert t_sel[0, :5].tolist() == table[0, :5].tolist()
    check_selection(m, table, lens, (t_sel, l_sel), 1)
    assert int(l_sel[1]) < int(lens[1])


def test_dense_layers_for_every_method():
    k = cache()
    table, lens = tables([40 * BS])
    for method in ALL:
        m = make(method, sparse_dense_layers=2)
        m.request_begin("a", 1)
        q = torch.randn(1, HQ, D)
        assert m.attention_begin(0, ["a"], q, k, table, lens) is None
        assert m.attention_begin(1, ["a"], q, k, table, lens) is None
        assert m.attention_begin(2, ["a"], q, k, table, lens) is not None


def test_esa_reselects_exactly_every_stride():
    stride, steps = 3, 10
    m = make("esa", retrieval_stride=stride)
    k = cache()
    table, lens = tables([30 * BS + 5, 26 * BS], grow=2 * steps)
    m.request_begin("a", 1), m.request_begin("b", 1)
    prev = None
    for step in range(steps):
        m.step_begin()
        before = m.retrievals
        lens_t = lens + 2 * step              # blocks fill as the decode goes on
        out = m.attention_begin(1, ["a", "b"], torch.randn(2, HQ, D), k, table, lens_t)
        fresh = m.retrievals - before
        assert fresh == (2 if step % stride == 0 else 0), step
        logical = [check_selection(m, table, lens_t, out, r) for r in range(2)]
        if fresh == 0:                        # reused: the old selection plus new trailing blocks
            for r in range(2):
                assert set(prev[r]) <= set(logical[r])
                n = math.ceil(int(lens_t[r]) / BS)
                assert set(logical[r]) - set(prev[r]) <= set(range(n - m.local_window, n))
        prev = logical
    assert m.retrievals == 2 * math.ceil(steps / stride)


def test_esa_reselection_is_used_at_once_with_the_folded_table(monkeypatch):
    """A re-selection computed at step t is attended at step t itself. Two sets of planted
    blocks, the query switching from one to the other on a re-selection step, tell it apart.
    When every row selects for this very step, the table comes from the selection op (no
    sparse_block_table call) and equals it."""
    k = cache(seed=21)
    table, lens = tables([64 * BS + 4], seed=22)
    g = torch.Generator().manual_seed(23)
    qa, qb = torch.randn(1, HQ, D, generator=g), torch.randn(1, HQ, D, generator=g)
    hot_a, hot_b = [9, 25, 40], [5, 17, 33]
    plant(k, table, 0, hot_a, qa, strength=6.0)
    plant(k, table, 0, hot_b, qb, strength=6.0)
    calls = {"n": 0}
    real = ucm.sparse.ops.sparse_block_table

    def counted(*a, **kw):
        calls["n"] += 1
        return real(*a, **kw)
    monkeypatch.setattr(ucm.sparse.ops, "sparse_block_table", counted)
    m = make("esa", sparse_ratio=0.125, retrieval_stride=2)
    m.request_begin("a", 1)
    got = []
    for step, q in enumerate((qa, qa, qb, qb, qb)):
        m.step_begin()
        before = calls["n"]
        out = m.attention_begin(1, ["a"], q, k, table, lens)
        got.append(set(check_selection(m, table, lens, out, 0)))
        if step % 2 == 0:                        # fresh for this step: the folded table
            assert calls["n"] == before, step
            sel = torch.tensor([sorted(got[-1])], dtype=torch.int32)
            want = real(table, lens, sel, torch.tensor([len(got[-1])], dtype=torch.int32), BS)
            assert torch.equal(out[0][:, :sel.shape[1]], want[0]) and torch.equal(out[1], want[1])
    assert set(hot_a) <= got[0] and set(hot_a) <= got[1]
    assert set(hot_b) <= got[2] and set(hot_b) <= got[3] and set(hot_b) <= got[4]
    with pytest.raises(ValueError, match="esa_async_retrieval"):
        make("esa", esa_async_retrieval=True)     # removed: an unknown option, named


def test_adaptive_budget_follows_concentration():
    torch.manual_seed(0)
    k = cache() * 0.05                        # nearly flat attention unless planted
    table, lens = tables([60 * BS, 60 * BS])
    q = torch.randn(2, HQ, D)
    plant(k, table, 0, [20], q, strength=60.0)          # request 0: one block takes the mass
    m = make("adaptive", sparse_ratio=0.5, adaptive_mass=0.9)
    m.request_begin("a", 1), m.request_begin("b", 1)
    t_sel, l_sel = m.attention_begin(1, ["a", "b"], q, k, table, lens)
    kept = [math.ceil(int(n) / BS) for n in l_sel]
    lower = m.init_window + m.local_window + 1
    assert kept[0] <= lower + 1               # concentrated: the windows and the hot block
    assert 20 in check_selection(m, table, lens, (t_sel, l_sel), 0)
    assert kept[1] == math.ceil(0.5 * 60)     # diffuse: the upper bound
    assert m.kept_blocks == sum(kept) and m.seen_blocks == 120


def test_request_finished_frees_state_and_interleaving_keeps_requests_apart():
    k = cache()
    table, lens = tables([30 * BS + 1, 40 * BS + 7], grow=6)
    g = torch.Generator().manual_seed(5)
    qs = [torch.randn(2, HQ, D, generator=g) for _ in range(5)]
    for method in ("esa", "kvstar"):
        alone = {}
        for r, rid in enumerate(("a", "b")):        # each request with a method of its own
            m = make(method, retrieval_stride=2)
            m.request_begin(rid, 1)
            sel = []
            for s, q in enumerate(qs):
                m.step_begin()
                out = m.attention_begin(0, [rid], q[r:r + 1], k, table[r:r + 1], lens[r:r + 1] + s)
                sel.append(out[0][0].tolist())
            alone[rid] = sel
        m = make(method, retrieval_stride=2)         # one method, the requests interleaved
        m.request_begin("a", 1), m.request_begin("b", 1)
        for s, q in enumerate(qs):
            m.step_begin()
            for r, rid in ((1, "b"), (0, "a")):
                out = m.attention_begin(0, [rid], q[r:r + 1], k, table[r:r + 1], lens[r:r + 1] + s)
                assert out[0][0].tolist() == alone[rid][s], (method, rid, s)
        assert m.live_requests == 2
        m.request_finished("a")
        assert m.live_requests == 1
        with pytest.raises(ValueError, match="was not begun"):
            m.attention_begin(0, ["a"], qs[0][:1], k, table[:1], lens[:1])
        m.request_finished("b")
        m.request_finished("never-begun")
        assert m.live_requests == 0


@pytest.mark.parametrize("group", [0, 4])
@pytest.mark.parametrize("method", SMART)
def test_finds_the_blocks_aligned_with_the_query(method, group):
    """A synthetic cache where three blocks per request hold keys along the query: every method
    but random keeps them (random is checked to miss some, so the check can fail)."""
    torch.manual_seed(3)
    k = cache(seed=3)
    table, lens = tables([64 * BS + 4, 48 * BS], seed=4)
    q = torch.randn(2, HQ, D)
    hot = {0: [9, 25, 40], 1: [5, 17, 33]}
    for b in (0, 1):
        plant(k, table, b, hot[b], q)
    m = make(method, sparse_ratio=0.125, sparse_repr_group=group)
    m.request_begin("a", 1), m.request_begin("b", 1)
    for layer in range(2):
        m.step_begin()
        out = m.attention_begin(layer, ["a", "b"], q, k, table, lens)
        for b in (0, 1):
            assert set(hot[b]) <= set(check_selection(m, table, lens, out, b)), (method, b)


def test_sub_block_summaries_are_exact_and_bound_tighter():
    """sparse_repr_group=4 (two 4-token summaries per 8-token block): the tables hold each
    sub-range's min/max, and Quest's per-head score is the best sub-block bound, which lies
    between the exact max of q.k in the block and the whole-block bound."""
    k = cache(seed=5)
    table, lens = tables([30 * BS + 3], seed=6)
    q = torch.randn(1, HQ, D)
    fine, whole = make("quest", sparse_repr_group=4), make("quest", sparse_repr_group=0)
    for m in (fine, whole):
        m.request_begin("a", 1)
        m.attention_begin(0, ["a"], q, k, table, lens)
    t = fine._tables[0]
    assert fine.groups == 2 and t["kmin"].shape[:2] == (k.shape[0], 2)
    n = math.ceil(int(lens[0]) / BS)
    ids = table[0, :n - 1].long()                                      # full blocks
    for i in range(2):
        torch.testing.assert_close(t["kmin"][ids, i], k[ids, 4 * i:4 * i + 4].amin(1))
        torch.testing.assert_close(t["kmax"][ids, i], k[ids, 4 * i:4 * i + 4].amax(1))
    nb = torch.tensor([n], dtype=torch.int32)
    got = fine.score_per_head(q, table, nb, "quest", t)[0, :, :n - 1]     # [Hq, n - 1]
    bound = whole.score_per_head(q, table, nb, "quest", whole._tables[0])[0, :, :n - 1]
    kq = k[ids].repeat_interleave(HQ // HKV, dim=2)                      # [n-1, BS, Hq, D]
    exact = torch.einsum("hd,jthd->hjt", q[0], kq).amax(-1)
    assert bool((exact <= got + 1e-4).all()) and bool((got <= bound + 1e-4).all())
    assert bool((got < bound - 1e-3).any()), "the finer bound is tighter somewhere"
    assert whole.groups == 1 and make("quest", sparse_repr_group=BS).groups == 1
    assert make("gsa", sparse_repr_group=4).groups == 1              # GSA: whole-block codes
    with pytest.raises(ValueError, match="sparse_repr_group"):
        make("quest", sparse_repr_group=3)


@pytest.mark.parametrize("method", ["esa", "kvstar", "quest"])
def test_sub_blocks_one_op_call_per_layer(monkeypatch, method):
    """The methods score every sub-block in one score_blocks (or score_select_head_mass: ESA,
    Quest) call (the maximum over sub-blocks is the op's), update them in one update_block_reprs
    call, and keep bfloat16 tables for a bfloat16 cache (float32 otherwise)."""
    calls = {"score_blocks": 0, "score_select_head_mass": 0, "update_block_reprs": 0}
    for name in calls:
        real = getattr(ops, name)

        def counted(*a, _real=real, _name=name, **kw):
            calls[_name] += 1
            return _real(*a, **kw)
        monkeypatch.setattr(ops, name, counted)
    k = cache(seed=7)
    table, lens = tables([40 * BS + 3, 33 * BS], seed=8)
    q = torch.randn(2, HQ, D)
    m = make(method, sparse_repr_group=4, retrieval_stride=1, kvstar_votes=1)
    m.request_begin("a", 1), m.request_begin("b", 1)
    m.attention_begin(1, ["a", "b"], q, k, table, lens)
    assert calls["score_blocks"] + calls["score_select_head_mass"] == 1
    assert calls["update_block_reprs"] == 1
    assert calls["score_select_head_mass"] == (method in ("esa", "quest"))
    t = m._tables[1]
    assert t["mean" if method != "quest" else "kmin"].shape == (k.shape[0], 2, HKV, D)
    assert t["mean" if method != "quest" else "kmin"].dtype == torch.float32
    half = make(method, sparse_repr_group=4)
    half.request_begin("a", 1)
    half.attention_begin(1, ["a"], q[:1].bfloat16(), k.bfloat16(), table[:1], lens[:1])
    assert half._tables[1]["mean" if method != "quest" else "kmax"].dtype == torch.bfloat16


@pytest.mark.parametrize("method", ["esa", "kvstar", "adaptive"])
def test_int8_mean_tables(method):
    """sparse_repr_dtype='int8': the mean table holds int8 rows with one float32 scale each,
    exactly quantize_rows of the float32 table the same method keeps without it; the planted
    blocks are still found; ESA's selection equals the float32 selection on the dequantized
    table (so the scales reach the scoring). 'auto' picks int8 only for a bfloat16 cache on a
    GPU; Quest's bounds keep the cache's precision."""
    k = cache(seed=11)
    table, lens = tables([64 * BS + 4, 48 * BS], seed=12)
    q = torch.randn(2, HQ, D, generator=torch.Generator().manual_seed(13))
    hot = {0: [9, 25, 40], 1: [5, 17, 33]}
    for b in (0, 1):
        plant(k, table, b, hot[b], q)
    opts = dict(sparse_ratio=0.125, sparse_repr_group=4, retrieval_stride=1)
    m8, m32 = make(method, sparse_repr_dtype="int8", **opts), make(method, **opts)
    outs = []
    for m in (m8, m32):
        m.request_begin("a", 1), m.request_begin("b", 1)
        m.step_begin()
        outs.append(m.attention_begin(1, ["a", "b"], q, k, table, lens))
    t8, t32 = m8._tables[1], m32._tables[1]
    assert t8["mean"].dtype == torch.int8 and t8["mean_scale"].shape == t8["mean"].shape[:-1]
    used = table[table > 0].long().unique()
    want_q, want_s = ops.quantize_rows(t32["mean"][used])
    full = [int(table[b, j]) for b in (0, 1) for j in range(int(lens[b]) // BS)]
    full = torch.tensor(sorted(full))
    if method != "adaptive":     # adaptive also keeps partial last blocks current: compare full
        used = full
        want_q, want_s = ops.quantize_rows(t32["mean"][used])
    assert torch.equal(t8["mean"][used], want_q) and torch.equal(t8["mean_scale"][used], want_s)
    for b in (0, 1):
        assert set(hot[b]) <= set(check_selection(m8, table, lens, outs[0], b)), (method, b)
    if method == "esa":
        deq = {"mean": t8["mean"].float() * t8["mean_scale"][..., None]}
        n = torch.tensor([math.ceil(int(x) / BS) for x in lens], dtype=torch.int32)
        budget = torch.tensor([m8.budget(int(x)) for x in n], dtype=torch.int32)
        sel, count = m32.score_pick_by_mass(q, table, n, budget, "mean", deq)
        want = ops.sparse_block_table(table, lens, sel, count, BS)
        assert torch.equal(outs[0][0], want[0]) and torch.equal(outs[0][1], want[1])
    auto = make(method)
    assert auto.repr_dtype(torch.bfloat16, "cuda:0", "mean") == torch.int8
    assert auto.repr_dtype(torch.bfloat16, "cpu", "mean") == torch.bfloat16
    assert auto.repr_dtype(torch.float32, "cuda:0", "mean") == torch.float32
    assert m8.repr_dtype(torch.float32, "cpu", "mean") == torch.int8
    assert m8.repr_dtype(torch.bfloat16, "cuda:0", "kmin") == torch.bfloat16
    quest = make("quest", sparse_repr_dtype="int8")
    quest.request_begin("a", 1)
    quest.attention_begin(1, ["a"], q[:1], k, table[:1], lens[:1])
    assert quest._tables[1]["kmin"].dtype == torch.float32 and "mean_scale" not in quest._tables[1]
    with pytest.raises(ValueError, match="sparse_repr_dtype"):
        make(method, sparse_repr_dtype="int4")


def test_quest_per_kv_head_selects_each_heads_blocks():
    """per_kv_head=True: each KV head keeps the blocks its own queries point at (planted per KV
    head), tables [B, Hkv, K] / lengths [B, Hkv] that paged_decode_attention takes; a short row
    stays dense (its table copied per head); other methods refuse the option."""
    torch.manual_seed(5)
    k = cache(seed=9)
    table, lens = tables([64 * BS + 4, 5 * BS], seed=10)
    q = torch.randn(2, HQ, D)
    hot = {0: [9, 25, 40], 1: [13, 30, 51]}                  # KV head -> its planted blocks
    for kv, blocks in hot.items():
        direction = q[0, kv * (HQ // HKV):(kv + 1) * (HQ // HKV)].sum(0)
        direction = direction / direction.norm()
        for j in blocks:
            k[int(table[0, j]), :, kv] += 4.0 * direction
    m = make("quest", sparse_ratio=0.125, sparse_repr_group=4)
    per = ucm.sparse.create({"min_blocks": 8, "init_window": 1, "local_window": 2,
                             "sparse_ratio": 0.125, "sparse_repr_group": 4}, method="quest",
                            per_kv_head=True, **SHAPE)
    for meth in (m, per):
        meth.request_begin("a", 1), meth.request_begin("b", 1)
    t_sel, l_sel = per.attention_begin(0, ["a", "b"], q, k, table, lens)
    assert t_sel.shape[:2] == (2, HKV) and l_sel.shape == (2, HKV)
    n = math.ceil(int(lens[0]) / BS)
    own = table[0, :n].tolist()
    for kv, blocks in hot.items():
        count = math.ceil(int(l_sel[0, kv]) / BS)
        logical = [own.index(p) for p in t_sel[0, kv, :count].tolist()]
        assert logical == sorted(set(logical)) and {0, n - 2, n - 1} <= set(logical)
        assert set(blocks) <= set(logical), kv
        other = hot[1 - kv]
        assert not set(other) <= set(logical), "the other head's blocks are not all needed"
    nb1 = math.ceil(int(lens[1]) / BS)                       # the short row: dense, per head
    assert (l_sel[1] == lens[1]).all() and (t_sel[1, :, :nb1] == table[1, :nb1]).all()
    out = ops.paged_decode_attention(q, k, k, t_sel, l_sel)
    assert out.shape == q.shape and torch.isfinite(out).all()
    shared = m.attention_begin(0, ["a", "b"], q, k, table, lens)
    assert shared[0].dim() == 2
    with pytest.raises(ValueError, match=r"per_kv_head.*'esa'.*supported: quest, mass, oracle"):
        make("esa", per_kv_head=True)
    # the same through the configuration option: identical selection; the keyword wins
    cfg = {"min_blocks": 8, "init_window": 1, "local_window": 2, "sparse_ratio": 0.125,
           "sparse_repr_group": 4, "sparse_per_kv_head": True}
    by_cfg = ucm.sparse.create(cfg, method="quest", **SHAPE)
    by_cfg.request_begin("a", 1), by_cfg.request_begin("b", 1)
    t_cfg, l_cfg = by_cfg.attention_begin(0, ["a", "b"], q, k, table, lens)
    assert torch.equal(t_cfg, t_sel) and torch.equal(l_cfg, l_sel)
    assert not ucm.sparse.create(cfg, method="quest", per_kv_head=False, **SHAPE).per_kv_head
    with pytest.raises(ValueError, match="sparse_per_kv_head"):
        ucm.sparse.create(dict(cfg, sparse_method="esa"), **SHAPE)
    # the per-KV-head oracle (harness ceiling) finds each head's planted blocks from exact mass
    oracle = ucm.sparse.create(cfg, method="oracle", **SHAPE)
    oracle.request_begin("a", 1), oracle.request_begin("b", 1)
    t_or, l_or = oracle.attention_begin(0, ["a", "b"], q, k, table, lens)
    for kv, blocks in hot.items():
        logical = [own.index(p) for p in t_or[0, kv, :math.ceil(int(l_or[0, kv]) / BS)].tolist()]
        assert set(blocks) <= set(logical), kv
    # the int4-key mass ranking per KV head finds each head's planted blocks the same way
    mk = ucm.sparse.create(cfg, method="mass", **SHAPE)
    mk.request_begin("a", 1), mk.request_begin("b", 1)
    t_mk, l_mk = mk.attention_begin(0, ["a", "b"], q, k, table, lens)
    assert t_mk.shape[:2] == (2, HKV)
    for kv, blocks in hot.items():
        logical = [own.index(p) for p in t_mk[0, kv, :math.ceil(int(l_mk[0, kv]) / BS)].tolist()]
        assert set(blocks) <= set(logical), kv
        assert not set(hot[1 - kv]) <= set(logical), "the other head's blocks are not all needed"
    mass = oracle.kv_head_block_mass(q, k, table, lens)
    assert torch.allclose(mass.mean(1), ops.block_attention_mass(q, k, table, lens), atol=1e-5)
    per_q = ops.block_attention_mass(q, k, table, lens, per_query_head=True)
    assert per_q.shape == (q.shape[0], q.shape[1], table.shape[1])
    # KV head h's mass is the mean over its own query heads (GQA groups are consecutive)
    g = q.shape[1] // mass.shape[1]
    assert torch.allclose(mass[:, 1], per_q[:, g:2 * g].mean(1), atol=1e-6)
    assert torch.allclose(per_q.sum(2), torch.ones_like(per_q.sum(2)), atol=1e-4)  # each head's softmax sums to 1
    with pytest.raises(ValueError, match="per_query_head"):
        ops.block_attention_mass(q, k, table, lens, per_query_head=1)


def test_random_baseline_misses_planted_blocks():
    torch.manual_seed(3)
    k = cache(seed=3)
    table, lens = tables([64 * BS + 4, 48 * BS], seed=4)
    q = torch.randn(2, HQ, D)
    hot = {0: [9, 25, 40], 1: [5, 17, 33]}
    m = make("random", sparse_ratio=0.125)
    m.request_begin("a", 1), m.request_begin("b", 1)
    out = m.attention_begin(0, ["a", "b"], q, k, table, lens)
    found = sum(len(set(hot[b]) & set(check_selection(m, table, lens, out, b))) for b in (0, 1))
    assert found < 6


def test_gsa_prefetch_gets_the_selected_physical_blocks():
    calls = []
    m = ucm.sparse.create({"min_blocks": 8, "sparse_ratio": 0.25}, method="gsa",
                          prefetch=lambda layer, rid, ids: calls.append((layer, rid, ids.tolist())),
                          **SHAPE)
    k = cache()
    table, lens = tables([40 * BS])
    m.request_begin("a", 1)
    t_sel, l_sel = m.attention_begin(2, ["a"], torch.randn(1, HQ, D), k, table, lens)
    assert calls == [(2, "a", t_sel[0, :math.ceil(int(l_sel[0]) / BS)].tolist())]


def test_kvstar_votes_break_ties_by_current_score():
    m = make("kvstar", kvstar_votes=3, kvstar_channels=8)
    mask = m.channel_mask(torch.randn(4, HQ, D))
    assert mask.sum(-1).eq(8).all()
    k = cache()
    table, lens = tables([40 * BS], grow=5)
    m.request_begin("a", 1)
    for s in range(5):
        m.attention_begin(0, ["a"], torch.randn(1, HQ, D), k, table, lens + s)
    assert len(m._requests["a"].extra[0]) == 3          # only the last kvstar_votes queries


def test_bad_input_names_the_argument():
    with pytest.raises(ValueError, match="sparse_ratio"):
        Config({"sparse_ratio": 0.0})
    with pytest.raises(ValueError, match="sparse_ratio"):
        Config({"sparse_ratio": 1.5})
    with pytest.raises(ValueError, match="min_blocks"):
        Config({"init_window": 4, "local_window": 5, "min_blocks": 8})
    with pytest.raises(ValueError, match="sparse_hash_bits"):
        Config({"sparse_hash_bits": 48})
    with pytest.raises(ValueError, match="sparse_method"):
        Config({"sparse_method": "oracle"})
    with pytest.raises(ValueError, match="method"):
        ucm.sparse.create({}, method="nope", **SHAPE)
    with pytest.raises(ValueError, match="num_q_heads"):
        ucm.sparse.create({"sparse_method": "esa"}, **dict(SHAPE, num_q_heads=5))
    with pytest.raises(ValueError, match="block_size"):
        ucm.sparse.create({"sparse_method": "quest"}, **dict(SHAPE, block_size=0))
    with pytest.raises(ValueError, match="kvstar_channels"):
        ucm.sparse.create({"sparse_method": "kvstar", "kvstar_channels": D + 1}, **SHAPE)
    with pytest.raises(ValueError, match="prefetch"):
        ucm.sparse.create({"sparse_method": "gsa"}, prefetch=3, **SHAPE)
    with pytest.raises(ValueError, match="layer"):
        m = make("esa")
        m.request_begin("a", 1)
        m.attention_begin(3, ["a"], torch.randn(1, HQ, D), cache(), *tables([40 * BS]))
    assert ucm.sparse.create({"sparse_method": "none"}, **SHAPE) is None
    assert isinstance(ucm.sparse.create(Config({"sparse_method": "quest"}), **SHAPE),
                      ucm.sparse.SparseMethod)


# ---------------------------------------------------------------------------------------------
# the harness model (ucm/reference/llama.py), with small random weights

def test_model_paged_attention_matches_the_op():
    from ucm.reference.llama import paged_attention

    k, v = cache(seed=7), cache(seed=8)
    table, lens = tables([30 * BS + 3, 12 * BS])
    q = torch.randn(2, HQ, D)
    sel, count = ops.select_blocks(torch.randn(2, table.shape[1]), torch.tensor([31, 12], dtype=torch.int32),
                                   8, init_window=1, local_window=2)
    t_sel, l_sel = ops.sparse_block_table(table, lens, sel, count, BS)
    for t, n in ((table, lens), (t_sel, l_sel)):
        ref = ops.paged_decode_attention(q, k, v, t, n, backend="reference")
        assert torch.allclose(paged_attention(q, k, v, t, n), ref, atol=1e-5)
    out, mass = paged_attention(q, k, v, t_sel, l_sel, full=(table, lens))
    exact = ops.block_attention_mass(q, k, table, lens)
    kept = torch.stack([exact[b, sel[b, :int(count[b])].long()].sum() for b in range(2)])
    assert torch.allclose(mass, kept, atol=1e-5)


def test_model_decode_matches_prefill_and_runs_methods():
    from ucm.reference.llama import run_continuation

    model = tiny_model()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 97, (16 * 20 + 5 + 6,), generator=g).tolist()
    shape = dict(num_layers=2, num_q_heads=6, num_kv_heads=2, head_dim=8, block_size=16)
    methods = [None, ucm.sparse.create({"sparse_ratio": 1.0}, method="esa", **shape),
               ucm.sparse.create({"sparse_ratio": 0.3}, method="quest", **shape),
               ucm.sparse.create({"sparse_ratio": 0.3}, method="oracle", **shape)]
    res = run_continuation(model, ids[:325], ids[325:], methods)
    assert res.logits.shape == (4, 6, 97)
    for r in (0, 1):                          # dense and ratio 1.0 = the prefill's logits
        assert torch.allclose(res.logits[r], res.dense_logits, atol=1e-4)
        assert res.mass[r].eq(1).all()
    for r in (2, 3):                          # sparse: fewer blocks, less mass, other logits
        assert (res.blocks[r] < 21).all() and (res.mass[r] < 1).all()
        assert not torch.allclose(res.logits[r], res.dense_logits, atol=1e-4)
    assert (res.mass[3] >= res.mass[2] - 1e-6).all()    # the oracle keeps the most mass
    assert all(m is None or m.live_requests == 0 for m in methods)


def test_mass_ranks_by_the_int4_keys_exact_mass():
    """``mass`` keeps every full block's keys in int4 and ranks the blocks by their attention mass
    under them: on a random cache its scores equal the exact per-head mass computed from the
    dequantized keys, its selection is the top of that mass, an odd head_dim is refused by name,
    and a block that fills later is quantized when it does."""
    k = cache(seed=21)
    table, lens = tables([40 * BS + 3], seed=22)
    q = torch.randn(1, HQ, D)
    m = make("mass", sparse_ratio=0.25)
    m.request_begin("a", 1)
    m.step_begin()
    t_sel, l_sel = m.attention_begin(1, ["a"], q, k, table, lens)
    tabs = m._tables[1]
    n = math.ceil(int(lens[0]) / BS)
    full = table[0, :n - 1].long()
    want4, wants = ref.token_key_codes(k[full])
    assert torch.equal(tabs["keys4"][full], want4) and torch.equal(tabs["scale4"][full], wants)
    keys = ref.token_keys(tabs["keys4"], tabs["scale4"])             # [n, Hkv, BS, D]
    kk = keys[table[0, :n].long()].permute(0, 2, 1, 3).reshape(n * BS, HKV, D)
    logits = torch.einsum("hd,thd->ht", q[0].float(),
                          kk.repeat_interleave(HQ // HKV, 1)) / math.sqrt(D)
    logits[:, int(lens[0]):] = float("-inf")
    share = torch.softmax(logits, -1).reshape(HQ, n, BS).sum(-1).mean(0)   # exact, int4 keys
    forced = set(m.forced(n))
    budget = m.budget(n)
    top = [int(j) for j in torch.argsort(share[:n - 1], descending=True) if int(j) not in forced]
    want = sorted(forced | set(top[:budget - len(forced)]))
    got = [table[0, :n].tolist().index(p) for p in t_sel[0, :math.ceil(int(l_sel[0]) / BS)].tolist()]
    assert got == want
    with pytest.raises(ValueError, match="head_dim: 31 is odd"):
        ucm.sparse.create({"sparse_ratio": 0.25}, method="mass",
                          **dict(SHAPE, head_dim=31))
    # one more token fills the last block: the next call quantizes it
    last = int(table[0, n - 1])
    lens2 = torch.tensor([n * BS], dtype=torch.int32)
    m.attention_begin(1, ["a"], q, k, table, lens2)
    assert torch.equal(tabs["keys4"][last], ref.token_key_codes(k[last:last + 1])[0][0])


def test_mass_keys_past_float16_range_rank_without_nan():
    """A bfloat16 cache may hold keys far past float16's range (and inf): their int4 scale stops
    at float16's largest finite value, so every dequantized key and every score stays finite
    (an infinite scale made the zero codes of its channel NaN), and such a block still ranks
    first for a query along it."""
    k = cache(seed=23).to(torch.bfloat16)
    table, lens = tables([30 * BS + 2], seed=24)
    hot = int(table[0, 7])
    k[hot, :, :, 0] = 1e30
    k[hot, 3, 0, 1] = float("inf")
    codes, scale = ref.token_key_codes(k[hot:hot + 1])
    assert torch.isfinite(scale.float()).all() and float(scale.float().max()) == 65504.0
    assert torch.isfinite(ref.token_keys(codes, scale)).all()
    q = torch.zeros(1, HQ, D)
    q[..., 0] = 1.0
    m = make("mass", sparse_ratio=0.125)
    m.request_begin("a", 1)
    t_sel, l_sel = m.attention_begin(0, ["a"], q.to(torch.bfloat16), k, table, lens)
    per_head = ops.score_token_mass(q, table, torch.tensor([31], dtype=torch.int32),
                                    keys4=m._tables[0]["keys4"], scale4=m._tables[0]["scale4"],
                                    scale=D ** -0.5)
    assert torch.isfinite(per_head[:, :, :30]).all()
    assert hot in t_sel[0, :math.ceil(int(l_sel[0]) / BS)].tolist()


def test_mass_per_kv_head_pools_the_budget_over_kv_heads():
    """mass per KV head: a KV head whose queries point at two blocks leaves blocks to one whose
    attention is spread; the request attends the same number of (head, block) pairs as with one
    budget per head, and no head more than twice its budget; the concentrated head still keeps
    its two blocks."""
    torch.manual_seed(3)
    k = cache(seed=4)
    table, lens = tables([64 * BS], seed=5)
    q = torch.randn(1, HQ, D)
    hot = [11, 40]
    direction = q[0, :HQ // HKV].sum(0)
    for j in hot:                                   # KV head 0 only
        k[int(table[0, j]), :, 0] += 12.0 * direction / direction.norm()
    m = make("mass", per_kv_head=True)
    m.request_begin("a", 1)
    t_sel, l_sel = m.attention_begin(0, ["a"], q, k, table, lens)
    budget = m.budget(64)
    counts = [math.ceil(int(l_sel[0, h]) / BS) for h in range(HKV)]
    assert budget == 16 and sum(counts) == HKV * budget, counts
    assert counts[0] < budget < counts[1] <= 2 * budget, counts
    own = table[0].tolist()
    kept0 = {own.index(p) for p in t_sel[0, 0, :counts[0]].tolist()}
    assert set(hot) <= kept0 and {0, 62, 63} <= kept0
