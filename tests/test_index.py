"""Block index, each implementation: LRU semantics, bytes ids, a full churn of the probe table,
clear errors for bad input. test_equiv_foundation.py replays random logs (>= 100,000 mixed
calls, malformed ones among them) through every implementation against the reference."""
import numpy as np
import pytest

import ucm
from conftest import impls_of


def _ids(rng, n):
    return rng.integers(0, 2**64 - 1, size=(n, 2), dtype=np.uint64, endpoint=True)


@pytest.mark.parametrize("backend", impls_of("block_index"))
def test_lru_semantics(backend):
    idx = ucm.BlockIndex(3, backend=backend)
    ids = np.arange(12, dtype=np.uint64).reshape(6, 2)
    new, ev_ids, ev_vals = idx.insert(ids[:3], [10, 11, 12])
    assert new.tolist() == [1, 1, 1] and len(ev_ids) == 0
    assert idx.touch(ids[[0, 5]]).tolist() == [1, 0]  # order now 1, 2, 0
    new, ev_ids, ev_vals = idx.insert(ids[3:4], [13])
    assert new.tolist() == [1] and ev_ids.tolist() == ids[1:2].tolist() and ev_vals.tolist() == [11]
    new, _, _ = idx.insert(ids[2:3], [22])  # update: not new, becomes most recent
    assert new.tolist() == [0]
    assert idx.lookup(ids).tolist() == [10, -1, 22, 13, -1, -1]
    assert idx.lookup(ids).tolist() == [10, -1, 22, 13, -1, -1]  # lookup does not reorder
    assert idx.entries()[0].tolist() == ids[[0, 3, 2]].tolist()
    assert idx.lookup_prefix(ids[[0, 3, 1, 2]]) == 2
    assert idx.lookup_prefix(ids[:0]) == 0
    assert idx.remove(ids[[3, 3, 4]]).tolist() == [13, -1, -1]
    ev_ids, ev_vals = idx.evict(1)
    assert ev_ids.tolist() == ids[[0]].tolist() and ev_vals.tolist() == [10] and len(idx) == 1
    assert idx.evict(5)[0].shape == (0, 2)
    # a batch larger than the capacity evicts its own earlier members, in order
    new, ev_ids, _ = idx.insert(ids, np.arange(6))
    assert len(idx) == 3 and idx.entries()[0].tolist() == ids[3:].tolist()


@pytest.mark.parametrize("backend", impls_of("block_index"))
def test_accepts_bytes_ids_and_scalar_value(backend):
    idx = ucm.BlockIndex(4, backend=backend)
    ids = [bytes([i]) * 16 for i in range(3)]
    idx.insert(ids, 7)
    assert idx.lookup(ids).tolist() == [7, 7, 7]
    assert idx.lookup(np.frombuffer(b"".join(ids), np.uint8).reshape(3, 16)).tolist() == [7, 7, 7]


@pytest.mark.parametrize("backend", impls_of("block_index"))
def test_full_churn_keeps_probe_table_consistent(backend, rng):
    """Fill, remove every other id, refill many times: every resident id stays findable."""
    idx = ucm.BlockIndex(5000, backend=backend)
    live = {}
    for round_ in range(20):
        ids = _ids(rng, 5000)
        idx.insert(ids, np.arange(5000) + round_)
        for row, v in zip(ids.tolist(), range(5000)):
            live[tuple(row)] = v + round_
        drop = ids[::2]
        idx.remove(drop)
        keep = ids[1::2]
        assert (idx.lookup(keep) >= 0).all()
    assert len(idx) <= 5000


BAD = [
    (lambda b: ucm.BlockIndex(-1, backend=b), "capacity"),
    (lambda b: ucm.BlockIndex(0, backend=b), "capacity"),
    (lambda b: ucm.BlockIndex(2.5, backend=b), "capacity"),
    (lambda b: ucm.BlockIndex(4, backend=b).insert(np.zeros((2, 3), np.uint64), [1, 2]), r"\[n, 2\]"),
    (lambda b: ucm.BlockIndex(4, backend=b).insert(np.zeros(4, np.uint64), [1, 2]), r"\[n, 2\]"),
    (lambda b: ucm.BlockIndex(4, backend=b).insert(np.zeros((2, 2), np.float64), [1, 2]), "integer"),
    (lambda b: ucm.BlockIndex(4, backend=b).insert(np.zeros((2, 2), np.int64) - 1, [1, 2]), "negative"),
    (lambda b: ucm.BlockIndex(4, backend=b).insert(np.zeros((2, 2), np.uint64), [1]), "values"),
    (lambda b: ucm.BlockIndex(4, backend=b).insert(np.zeros((2, 2), np.uint64), [1, -2]), "values"),
    (lambda b: ucm.BlockIndex(4, backend=b).insert(np.zeros((2, 2), np.uint64), [1.5, 2]), "values"),
    (lambda b: ucm.BlockIndex(4, backend=b).lookup([b"short"]), "16 bytes"),
    (lambda b: ucm.BlockIndex(4, backend=b).lookup(b"x" * 16), "single bytes"),
    (lambda b: ucm.BlockIndex(4, backend=b).lookup([1, 2]), "16 bytes"),
    (lambda b: ucm.BlockIndex(4, backend=b).evict(-1), "target"),
]


@pytest.mark.parametrize("backend", impls_of("block_index"))
@pytest.mark.parametrize("i", range(len(BAD)))
def test_bad_input(i, backend):
    fn, match = BAD[i]
    with pytest.raises(ValueError, match=match):
        fn(backend)
