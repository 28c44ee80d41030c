"""pytest-benchmark versions of the foundation figures (providers: reference, fast).

    pytest benchmarks/bench_foundation.py                      # timings
    pytest benchmarks/bench_foundation.py --benchmark-disable  # smoke run (CI)

Ratios for RESULTS.md come from benchmarks/foundation.py, which times everything in one run.
"""
import numpy as np
import pytest

import ucm

N_TOKENS = 131072
N_IDS = 1_000_000
COPY_BYTES, SEGMENT = 256 << 20, 64 << 10


@pytest.fixture(scope="module")
def tokens():
    return np.random.default_rng(0).integers(0, 49152, size=N_TOKENS)


@pytest.mark.parametrize("backend", ["reference", "numba"])
def test_hash_blocks(benchmark, tokens, backend):
    ns = ucm.Namespace("bench", "bfloat16", 16)
    expected = ucm.hash_blocks(tokens, ns, backend="reference")
    out = benchmark.pedantic(ucm.hash_blocks, args=(tokens, ns), kwargs={"backend": backend},
                             rounds=3 if backend == "reference" else 20, warmup_rounds=1)
    assert np.array_equal(out, expected)
    benchmark.extra_info.update(n_tokens=N_TOKENS, block_size=16)


@pytest.fixture(scope="module")
def resident_ids():
    return np.random.default_rng(0).integers(0, 2**64 - 1, size=(N_IDS, 2), dtype=np.uint64, endpoint=True)


@pytest.mark.parametrize("backend", ["reference", "numba"])
def test_index_lookup_prefix(benchmark, resident_ids, backend):
    idx = ucm.BlockIndex(N_IDS, backend=backend)
    idx.insert(resident_ids, np.arange(N_IDS))
    hit = benchmark.pedantic(idx.lookup_prefix, args=(resident_ids,), rounds=3, warmup_rounds=0)
    assert hit == N_IDS
    benchmark.extra_info.update(n_ids=N_IDS)


@pytest.fixture(scope="module")
def copy_plan():
    rng = np.random.default_rng(0)
    src = ucm.alloc_aligned(COPY_BYTES)
    src[:] = rng.integers(0, 256, COPY_BYTES, dtype=np.uint8)
    n = COPY_BYTES // SEGMENT
    so = np.arange(n, dtype=np.uint64) * SEGMENT
    do = rng.permutation(n).astype(np.uint64) * SEGMENT
    expected = np.empty_like(src)
    expected.reshape(n, SEGMENT)[(do // SEGMENT).astype(np.int64)] = \
        src.reshape(n, SEGMENT)
    return src, so, do, np.full(n, SEGMENT, dtype=np.uint64), expected


@pytest.mark.parametrize("provider,threads", [("numpy", 1), ("reference", 1), ("native", 1), ("native", 2)])
def test_copy_segments(benchmark, copy_plan, provider, threads):
    src, so, do, lengths, expected = copy_plan
    dst = ucm.alloc_aligned(COPY_BYTES)
    if provider == "numpy":
        pairs = list(zip(so.tolist(), do.tolist()))

        def run():
            for a, b in pairs:
                dst[b:b + SEGMENT] = src[a:a + SEGMENT]
    else:
        def run():
            ucm.copy_ranges(src, so, dst, do, lengths, threads, backend=provider)
    benchmark.pedantic(run, rounds=5, warmup_rounds=1)
    assert np.array_equal(dst, expected)
    stats = getattr(benchmark, "stats", None)
    if stats:
        benchmark.extra_info["GBps"] = COPY_BYTES / stats.stats.min / 1e9
