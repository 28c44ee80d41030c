"""Byte movers: copy_segments of each implementation bit-exact against a plain slice copy, no
stray writes, clear errors for bad input; aligned buffers outlive their views. Implementations
against the reference, and alloc_aligned's alignment and zero fill: test_equiv_foundation.py."""
import numpy as np
import pytest

import ucm
from conftest import impls_of

SENTINEL = 0xA5


def _scattered_plan(rng, n, max_len, buf_size):
    """n non-overlapping segments at random places of two buffers (sizes up to max_len)."""
    lengths = rng.integers(0, max_len + 1, size=n)
    lengths[rng.random(n) < 0.1] = 0
    slot = max_len + 13
    src_slots = rng.permutation(buf_size // slot)[:n]
    dst_slots = rng.permutation(buf_size // slot)[:n]
    return src_slots * slot + rng.integers(0, 13, n), dst_slots * slot + rng.integers(0, 13, n), lengths


def _expected(src, dst, so, do, ln):
    out = dst.copy()
    for s, d, n in zip(so, do, ln):
        out[d:d + n] = src[s:s + n]
    return out


@pytest.mark.parametrize("backend", impls_of("copy_segments"))
@pytest.mark.parametrize("n_threads", [1, 2, 3, 8, 100])
@pytest.mark.parametrize("n,max_len", [(1, 1), (7, 33), (64, 4096), (300, 65536), (5, 3 << 20)],
                         ids=lambda v: str(v))
def test_copy_ranges_bit_exact_and_no_stray_writes(backend, n_threads, n, max_len, rng):
    buf = (max_len + 13) * (n + 2)
    src = rng.integers(0, 256, buf, dtype=np.uint8)
    dst = np.full(buf, SENTINEL, dtype=np.uint8)
    so, do, ln = _scattered_plan(rng, n, max_len, buf)
    expected = _expected(src, dst, so, do, ln)
    ucm.copy_ranges(src, so, dst, do, ln, n_threads=n_threads, backend=backend)
    assert np.array_equal(dst, expected)


@pytest.mark.parametrize("backend", impls_of("copy_segments"))
def test_empty_and_zero_length(backend):
    src = np.arange(10, dtype=np.uint8)
    dst = np.zeros(10, dtype=np.uint8)
    ucm.copy_ranges(src, [], dst, [], [], backend=backend)
    ucm.copy_ranges(src, [3], dst, [9], [0], backend=backend)
    ucm.copy_segments([0], [0], [0], backend=backend)  # null address, zero length: fine
    assert not dst.any()


def test_copy_between_torch_like_and_bytearray(rng):
    src = bytearray(rng.integers(0, 256, 4096, dtype=np.uint8).tobytes())
    dst = np.zeros(4096, dtype=np.uint8)
    ucm.copy_ranges(src, [0, 2048], dst, [2048, 0], [2048, 2048])
    assert dst[2048:].tobytes() == bytes(src[:2048]) and dst[:2048].tobytes() == bytes(src[2048:])
    wide = np.arange(512, dtype=np.float64)  # any dtype: offsets are in bytes
    out = np.zeros(512, dtype=np.float64)
    ucm.copy_ranges(wide, [8], out, [0], [8 * 511])
    assert np.array_equal(out[:511], wide[1:])


BAD = [
    (lambda b: ucm.copy_segments([1, 2], [3], [1, 1], backend=b), "dst_ptrs"),
    (lambda b: ucm.copy_segments([1], [3], [-1], backend=b), "negative"),
    (lambda b: ucm.copy_segments([0], [8], [4], backend=b), "null"),
    (lambda b: ucm.copy_segments([8], [8], [4], n_threads=0, backend=b), "n_threads"),
    (lambda b: ucm.copy_segments([[8]], [[8]], [[4]], backend=b), "1-D"),
    (lambda b: ucm.copy_segments([8.0], [8.0], [4.0], backend=b), "lengths|src_ptrs"),
    (lambda b: ucm.copy_ranges(np.zeros(10, np.uint8), [5], np.zeros(10, np.uint8), [0], [6], backend=b),
     "source buffer"),
    (lambda b: ucm.copy_ranges(np.zeros(10, np.uint8), [0], np.zeros(10, np.uint8), [5], [6], backend=b),
     "destination buffer"),
    (lambda b: ucm.copy_ranges(np.zeros(10, np.uint8), [0], np.zeros(20, np.uint8)[::2], [0], [1], backend=b),
     "contiguous"),
    (lambda b: ucm.copy_ranges(np.zeros(10, np.uint8), [0], b"x" * 10, [0], [1], backend=b), "read-only"),
]


@pytest.mark.parametrize("backend", impls_of("copy_segments"))
@pytest.mark.parametrize("i", range(len(BAD)))
def test_bad_input(i, backend):
    fn, match = BAD[i]
    with pytest.raises(ValueError, match=match):
        fn(backend)


@pytest.mark.parametrize("backend", impls_of("alloc_aligned"))
def test_alloc_aligned_bad_input(backend):
    for args, match in [((0,), "nbytes"), ((-5,), "nbytes"), ((64, 3), "alignment"),
                        ((64, 4), "alignment"), ((64, 4095), "power of two")]:
        with pytest.raises(ValueError, match=match):
            ucm.alloc_aligned(*args, backend=backend)


def test_native_buffer_outlives_its_views():
    buf = ucm.alloc_aligned(1 << 20, backend="native")
    view = buf[10:20]
    del buf
    import gc

    gc.collect()
    view[:] = 3  # memory still owned through the view's base chain
    assert view.sum() == 30
