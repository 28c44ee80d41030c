"""Hostile input to the sparse-attention ops (ucm.sparse.ops) and methods (ucm.sparse.*):
non-contiguous index vectors, windows past the int32 range, and lifecycle / shape misuse of
``SparseMethod.attention_begin``. Each case either gives a clear ``ValueError`` naming the
argument or the reference and the Triton implementation agree (Triton on CPU tensors through the
interpreter; shapes are tiny)."""
import importlib.util
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

import ucm.sparse  # noqa: E402
from ucm import dispatch  # noqa: E402
from ucm.sparse import ops  # noqa: E402

I32 = torch.int32


@pytest.fixture
def triton_ready(monkeypatch):
    """The Triton implementations runnable on this machine's tensors (interpreter on CPU)."""
    if not HAS_TRITON:
        pytest.skip("triton is not installed")
    if not HAS_CUDA:
        import triton.language as tl
        from triton.runtime.jit import JITFunction

        if isinstance(tl.sum, JITFunction):
            pytest.fail("triton was imported before TRITON_INTERPRET=1 was set")
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    dispatch._reset_for_tests()
    return "triton"


def every_other(values, dtype=I32, poison=1):
    """A non-contiguous 1-D view (stride 2) holding ``values``; the entries in between are
    ``poison`` (what a kernel reading the view as a dense array sees). The poison stays a legal
    value, so that such a kernel gives a wrong answer rather than reading out of bounds (with
    larger values the unfixed kernels read and write past their tensors: a crashed process)."""
    full = torch.tensor([x for v in values for x in (v, poison)], dtype=dtype, device=DEV)
    view = full[::2]
    assert not view.is_contiguous() and view.tolist() == list(values)
    return view


def vec(values, dtype=I32):
    return torch.tensor(values, dtype=dtype, device=DEV)


def gen(seed):
    return torch.Generator().manual_seed(seed)


# ---------------------------------------------------------------------------------------------
# ops: index vectors given as strided views

def test_select_blocks_strided_num_blocks_and_budget(triton_ready):
    scores = torch.randn(2, 6, generator=gen(0)).to(DEV)
    dense = (vec([6, 3]), vec([2, 3]))
    strided = (every_other([6, 3]), every_other([2, 3]))
    want = ops.select_blocks(scores, *dense, init_window=1, local_window=1, backend="reference")
    for be in ("reference", triton_ready):
        sel, count = ops.select_blocks(scores, *strided, init_window=1, local_window=1, backend=be)
        assert torch.equal(sel, want[0]) and torch.equal(count, want[1]), be
        assert int(sel.max()) < 6          # never a block index past the row


def test_select_head_mass_strided_num_blocks(triton_ready):
    per_head = torch.randn(2, 3, 6, generator=gen(1)).to(DEV)
    per_head[1, :, 3:] = float("-inf")
    want = ops.select_head_mass(per_head, vec([6, 3]), 2, scale=0.5, init_window=0,
                                local_window=1, backend="reference")
    got = ops.select_head_mass(per_head, every_other([6, 3]), every_other([2, 2]), scale=0.5,
                               init_window=0, local_window=1, backend=triton_ready)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_sparse_block_table_strided_seq_lens_and_count(triton_ready):
    table = torch.arange(12, dtype=I32, device=DEV).reshape(2, 6)
    sel = vec([[0, 4], [0, 2]])
    want = ops.sparse_block_table(table, vec([20, 9]), sel, vec([2, 2]), 4, backend="reference")
    assert want[1].tolist() == [8, 5]
    for be in ("reference", triton_ready):
        t, lens = ops.sparse_block_table(table, every_other([20, 9]), sel, every_other([2, 2]), 4,
                                         backend=be)
        assert torch.equal(t, want[0]) and lens.tolist() == [8, 5], be


def test_score_blocks_strided_num_blocks(triton_ready):
    g = gen(2)
    q = torch.randn(2, 4, 16, generator=g).to(DEV)
    mean = torch.randn(8, 2, 16, generator=g).to(DEV)
    table = vec([[0, 1, 2], [3, 4, 5]])
    want = ops.score_blocks(q, table, vec([3, 1]), kind="mean", mean=mean, backend="reference")
    got = ops.score_blocks(q, table, every_other([3, 1], poison=2), kind="mean", mean=mean,
                           backend=triton_ready)
    assert torch.allclose(got, want, atol=1e-5)
    assert torch.isfinite(got[1, 0])


def test_update_block_reprs_strided_ids_and_counts(triton_ready):
    k = torch.randn(8, 4, 2, 16, generator=gen(3)).to(DEV)
    want = torch.zeros(8, 2, 16, device=DEV)
    ops.update_block_reprs(k, vec([1, 2], torch.int64), vec([4, 3], torch.int64), mean=want,
                           backend="reference")
    for be in ("reference", triton_ready):
        mean = torch.zeros(8, 2, 16, device=DEV)
        ops.update_block_reprs(k, every_other([1, 2], torch.int64, poison=5),
                               every_other([4, 3], torch.int64), mean=mean, backend=be)
        assert torch.allclose(mean, want, atol=1e-6), be   # blocks 1 and 2, no other block


# ---------------------------------------------------------------------------------------------
# ops: windows past the int32 range (any window >= the row keeps every block)

@pytest.mark.parametrize("windows", [(2**31, 0), (0, 2**31), (2**40, 3), (2**63, 0), (0, 2**64)])
def test_select_huge_windows_keep_every_block(triton_ready, windows):
    init, local = windows
    scores = torch.randn(2, 6, generator=gen(4)).to(DEV)
    nblk = vec([6, 3])
    for be in ("reference", triton_ready):
        sel, count = ops.select_blocks(scores, nblk, 2, init_window=init, local_window=local,
                                       backend=be)
        assert count.tolist() == [6, 3], be
        assert sel.tolist() == [[0, 1, 2, 3, 4, 5], [0, 1, 2, -1, -1, -1]], be
        sel, count = ops.select_head_mass(scores[:, None], nblk, 2, scale=1.0, init_window=init,
                                          local_window=local, backend=be)
        assert count.tolist() == [6, 3], be


# ---------------------------------------------------------------------------------------------
# methods: attention_begin misuse

HQ, HKV, D, BS = 4, 2, 16, 4
SHAPE = dict(num_layers=2, num_q_heads=HQ, num_kv_heads=HKV, head_dim=D, block_size=BS)


def make(method):
    cfg = {"min_blocks": 4, "init_window": 1, "local_window": 1, "sparse_ratio": 0.25,
           "kvstar_channels": 8}
    m = ucm.sparse.create(cfg, method=method, **SHAPE)
    m.request_begin("a", 10)
    m.request_begin("b", 10)
    return m


def case(seed=5):
    g = gen(seed)
    k = torch.randn(40, BS, HKV, D, generator=g)
    table = torch.arange(32, dtype=I32).reshape(2, 16)
    q = torch.randn(2, HQ, D, generator=g)
    return q, k, table


Q, K, TABLE = case()
LENS = torch.tensor([60, 40], dtype=I32)
#: (argument the message starts with, the misuse, the call on a method with "a", "b" begun)
MISUSE = [
    ("seq_lens", "zero_length", lambda m: m.attention_begin(0, ["a", "b"], Q, K, TABLE,
                                                            LENS * torch.tensor([0, 1], dtype=I32))),
    ("seq_lens", "negative", lambda m: m.attention_begin(0, ["a", "b"], Q, K, TABLE, LENS - 65)),
    ("seq_lens", "past_the_table", lambda m: m.attention_begin(0, ["a", "b"], Q, K, TABLE,
                                                               LENS + 16 * BS - 57)),
    ("seq_lens", "float", lambda m: m.attention_begin(0, ["a", "b"], Q, K, TABLE, LENS.float())),
    ("seq_lens", "shorter_than_prompt", lambda m: (m.request_begin("a", 100), m.attention_begin(
        0, ["a", "b"], Q, K, TABLE, LENS))),
    ("q", "other_head_count", lambda m: m.attention_begin(0, ["a", "b"], Q[:, :2], K, TABLE, LENS)),
    ("q", "other_head_dim", lambda m: m.attention_begin(
        0, ["a", "b"], torch.randn(2, HQ, 2 * D), torch.randn(40, BS, HKV, 2 * D), TABLE, LENS)),
    ("k_cache", "other_block_size", lambda m: m.attention_begin(
        0, ["a", "b"], Q, torch.randn(40, 2 * BS, HKV, D), TABLE, LENS)),
    ("k_cache", "other_kv_heads", lambda m: m.attention_begin(
        0, ["a", "b"], Q, torch.randn(40, BS, 1, D), TABLE, LENS)),
    ("req_ids", "request_twice", lambda m: m.attention_begin(0, ["a", "a"], Q, K, TABLE, LENS)),
    ("block_table", "minus_one_ids", lambda m: m.attention_begin(
        0, ["a", "b"], Q, K, torch.full_like(TABLE, -1), LENS)),
    ("block_table", "ids_past_the_cache", lambda m: m.attention_begin(
        0, ["a", "b"], Q, K, TABLE + 30, LENS)),
]


@pytest.mark.parametrize("name, what, call", MISUSE, ids=[w for _, w, _ in MISUSE])
def test_attention_begin_misuse_is_a_value_error(name, what, call):
    """Every method: a ValueError whose message starts with the argument, never a silent
    selection or another exception."""
    for method in ucm.sparse.METHODS:
        m = make(method)
        try:
            call(m)
        except ValueError as exc:
            assert str(exc).startswith(name + ":"), (method, str(exc))
        except Exception as exc:   # noqa: BLE001 - the failure to report
            pytest.fail(f"{method}: {type(exc).__name__} {exc}")
        else:
            pytest.fail(f"{method}: {what} accepted")


def test_rejected_ids_leave_the_request_state_untouched():
    """A call refused for a bad table does not count the request's blocks as summarised."""
    q, k, table = Q, K, TABLE
    m = make("esa")
    with pytest.raises(ValueError, match="block_table"):
        m.attention_begin(0, ["a", "b"], q, k, torch.where(table == 5, -1, table),
                          vec([60, 40]).cpu())
    assert m._requests["a"].done.get(0, 0) == 0
    good = make("esa")
    out = m.attention_begin(0, ["a", "b"], q, k, table, vec([60, 40]).cpu())
    ref = good.attention_begin(0, ["a", "b"], q, k, table, vec([60, 40]).cpu())
    assert torch.equal(out[0], ref[0]) and torch.equal(out[1], ref[1])
    assert torch.equal(m._tables[0]["mean"], good._tables[0]["mean"])


def test_valid_calls_still_select():
    """The checks let the ordinary calls through: a begun request decoding past its prompt."""
    q, k, table = case()
    for method in ucm.sparse.METHODS:
        m = make(method)
        m.request_begin("a", 59)
        out = m.attention_begin(1, ["a", "b"], q, k, table, vec([60, 40]).cpu())
        assert out is not None and out[1].shape == (2,)
        n = math.ceil(60 / BS)
        assert int(out[1][0]) < 60 and int(out[0][0, (int(out[1][0]) - 1) // BS]) == n - 1


def test_int4_token_key_ops_refuse_bad_tables_by_name():
    """quantize_token_keys / score_token_mass: a wrong dtype, shape or layout of keys4 / scale4,
    an odd head_dim, ids out of range or repeated, a scale that is not a positive finite number,
    a table entry past keys4's rows: each a ValueError naming the argument, nothing written."""
    n, bs, Hkv, D = 6, 4, 2, 8
    k = torch.randn(n, bs, Hkv, D)
    keys4 = torch.zeros(n, Hkv, bs, D // 2, dtype=torch.uint8)
    scale4 = torch.zeros(n, Hkv, D, dtype=torch.float16)
    ids = torch.tensor([0, 3])
    bad_tables = [
        (dict(keys4=keys4.to(torch.int8), scale4=scale4), "keys4"),
        (dict(keys4=keys4, scale4=scale4.float()), "scale4"),
        (dict(keys4=keys4[:, :, :, :3], scale4=scale4), "keys4"),
        (dict(keys4=keys4, scale4=scale4[:, :1]), "scale4"),
        (dict(keys4=keys4[:5], scale4=scale4[:5]), "keys4"),
        (dict(keys4=keys4.transpose(1, 2).contiguous().transpose(1, 2), scale4=scale4),
         "contiguous"),
        (dict(keys4=keys4, scale4=None), "scale4"),
    ]
    for kw, name in bad_tables:
        with pytest.raises(ValueError, match=name):
            ops.quantize_token_keys(k, ids, **kw)
    for bad_ids, what in ((torch.tensor([0, 6]), "block_ids"), (torch.tensor([2, 2]), "duplicate"),
                          (torch.tensor([0.0]), "block_ids")):
        with pytest.raises(ValueError, match=what):
            ops.quantize_token_keys(k, bad_ids, keys4=keys4, scale4=scale4)
    with pytest.raises(ValueError, match="head_dim 7 is odd"):
        ops.quantize_token_keys(torch.randn(n, bs, Hkv, 7), ids, keys4=keys4, scale4=scale4)
    assert not keys4.any() and not scale4.any()                      # nothing written
    ops.quantize_token_keys(k, torch.arange(n), keys4=keys4, scale4=scale4)
    q = torch.randn(2, 4, D)
    table = torch.tensor([[0, 1, 2], [3, 4, 5]], dtype=I32)
    nblk = torch.tensor([3, 2], dtype=I32)
    for scale in (0.0, -1.0, float("nan"), float("inf"), True, "0.3"):
        with pytest.raises(ValueError, match="scale"):
            ops.score_token_mass(q, table, nblk, keys4=keys4, scale4=scale4, scale=scale)
    with pytest.raises(ValueError, match="block_table"):
        ops.score_token_mass(q, torch.tensor([[0, 1, 9], [3, 4, 5]], dtype=I32), nblk,
                             keys4=keys4, scale4=scale4, scale=0.3)
    with pytest.raises(ValueError, match="num_blocks"):
        ops.score_token_mass(q, table, torch.tensor([4, 2], dtype=I32), keys4=keys4,
                             scale4=scale4, scale=0.3)
    with pytest.raises(ValueError, match="q"):                        # 3 query heads on 2 KV
        ops.score_token_mass(torch.randn(2, 3, D), table, nblk, keys4=keys4, scale4=scale4,
                             scale=0.3)
    with pytest.raises(ValueError, match="keys4"):                    # head_dim mismatch
        ops.score_token_mass(torch.randn(2, 4, 2 * D), table, nblk, keys4=keys4, scale4=scale4,
                             scale=0.3)
    # a partly filled entry past num_blocks may hold anything: not read, -inf out
    table2 = torch.tensor([[0, 1, 2], [3, 4, 99]], dtype=I32)
    out = ops.score_token_mass(q, table2, nblk, keys4=keys4, scale4=scale4, scale=0.3)
    assert torch.isinf(out[1, :, 2]).all() and torch.isfinite(out[:, :, :2]).all()
