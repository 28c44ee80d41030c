"""pytest-benchmark smoke of the sparse-attention ops on CPU tensors (reference implementation,
tiny shapes; seconds with ``--benchmark-disable``).

    pytest benchmarks/bench_sparse_cpu.py                      # timings
    pytest benchmarks/bench_sparse_cpu.py --benchmark-disable  # smoke run (CI)

GPU figures (Triton vs SDPA, copy bandwidth, dense vs sparse) come from
benchmarks/bench_sparse.py on the H200.
"""
import math

import pytest

torch = pytest.importorskip("torch")

from ucm.sparse import ops  # noqa: E402

B, HQ, HKV, D, BS, M = 2, 8, 2, 32, 16, 64  # 1,024 tokens per request


@pytest.fixture(scope="module")
def case():
    g = torch.Generator().manual_seed(0)
    n_phys = B * M
    k = torch.randn(n_phys, BS, HKV, D, generator=g)
    v = torch.randn(n_phys, BS, HKV, D, generator=g)
    q = torch.randn(B, HQ, D, generator=g)
    table = torch.randperm(n_phys, generator=g).reshape(B, M).to(torch.int32)
    lens = torch.tensor([M * BS, M * BS - 5], dtype=torch.int32)
    mean = torch.empty(n_phys, HKV, D)
    ops.update_block_reprs(k, torch.arange(n_phys), torch.full((n_phys,), BS), mean=mean,
                           backend="reference")
    return q, k, v, table, lens, mean


def test_dense_decode(benchmark, case):
    q, k, v, table, lens, _ = case
    out = benchmark(ops.paged_decode_attention, q, k, v, table, lens, backend="reference")
    assert out.shape == q.shape and torch.isfinite(out).all()


def test_sparse_decode(benchmark, case):
    """Scoring (block means) + selection at 20% + sparse table + attention over it."""
    q, k, v, table, lens, mean = case
    nblk = torch.full((B,), M, dtype=torch.int32)
    budget = math.ceil(0.2 * M)

    def sparse():
        scores = ops.score_blocks(q, table, nblk, kind="mean", mean=mean, backend="reference")
        sel, count = ops.select_blocks(scores, nblk, budget, init_window=1, local_window=2,
                                       backend="reference")
        t, n = ops.sparse_block_table(table, lens, sel, count, BS, backend="reference")
        return ops.paged_decode_attention(q, k, v, t, n, backend="reference"), count

    out, count = benchmark(sparse)
    assert out.shape == q.shape and torch.isfinite(out).all()
    assert count.tolist() == [budget] * B
