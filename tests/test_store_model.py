"""Every tier and pipeline against the dictionary model of tests/store_model.py: random operation
sequences (duplicates, present and pending ids, refusals, eviction pressure, prefetch, reopen).

6,000 operations for each of 16 store kinds (8 stores, roomy and tight: 96,000 in all) in CI; ``UCM_MODEL_OPS`` sets
the number per kind, ``UCM_MODEL_SEED`` the first seed."""
import os

import numpy as np
import pytest

import ucm
from ucm.store.memory import MemoryStore
from ucm.store.pipeline import PipelineStore
from ucm.store.posix import PosixStore

from store_model import GEOMETRY, ModelError, block_ids, content, run_model, run_threads

NS = ucm.Namespace("model-test", "bfloat16", 16).digest()
OPS = int(os.environ.get("UCM_MODEL_OPS", "6000"))
SEED = int(os.environ.get("UCM_MODEL_SEED", "1"))
FILE = 4096 + GEOMETRY.block_bytes


def _memory(slots, policy="lru"):
    return MemoryStore(GEOMETRY, buffer_number=slots, io_threads=2, namespace=NS, policy=policy)


def _posix(roots, budget_blocks):
    return PosixStore(GEOMETRY, [str(r) for r in roots], NS, capacity_bytes=budget_blocks * FILE * len(roots),
                      io_threads=2)


def _factory(kind, roomy, tmp_path):
    slots = 128 if roomy else 10
    budget = 160 if roomy else 14
    roots = [tmp_path / "a"] if roomy or kind != "posix" else [tmp_path / "a", tmp_path / "b"]
    for r in roots:
        r.mkdir(exist_ok=True)
    if kind == "memory":
        return lambda: _memory(slots), False
    if kind.startswith("memory ("):            # "memory (arc)": another eviction policy
        return lambda: _memory(slots, kind[len("memory ("):-1]), False
    if kind == "posix":
        return lambda: _posix(roots, budget), True
    write_back = kind.endswith("write-back")
    admission = "second_hit" if "second-hit" in kind else "all"
    return lambda: PipelineStore([_memory(slots), _posix(roots, budget)], write_back=write_back,
                                 admission=admission), "admitted" if admission != "all" else True


KINDS = ["memory", "posix", "memory|posix", "memory|posix write-back", "memory (arc)",
         "memory (prefix)", "memory|posix second-hit", "memory|posix second-hit write-back"]


@pytest.mark.parametrize("roomy", [True, False], ids=["roomy", "tight"])
@pytest.mark.parametrize("kind", KINDS)
def test_store_matches_the_model(kind, roomy, tmp_path):
    open_store, persistent = _factory(kind, roomy, tmp_path)
    seed = SEED + 100 * KINDS.index(kind) + roomy
    counts = run_model(open_store, seed, OPS, roomy=roomy, persistent=persistent)
    print(f"model {kind} {'roomy' if roomy else 'tight'}: {counts}")
    assert counts.get("mismatch", 0) == 0
    assert counts["load_ok"] > OPS // 20 and counts["reopen"] > 0  # the sequence really exercised it


def test_reference_file_ops_match_the_model(tmp_path):
    """The posix tier on the reference implementations (Python open_beneath and io_batch)."""
    open_store, _ = _factory("posix", False, tmp_path)
    ucm.set_backend("reference")
    try:
        counts = run_model(open_store, SEED + 7, max(500, OPS // 10), roomy=False)
    finally:
        ucm.set_backend(None)
    assert counts.get("mismatch", 0) == 0 and counts["load_ok"] > 0


def test_the_model_catches_a_store_that_returns_another_blocks_bytes(tmp_path):
    """The harness can fail: a memory tier whose dump copies rows by position (the bug of
    issue 14) is caught."""
    class RowShift(MemoryStore):
        def _copy(self, bufs, slots, offset, nbytes, to_pool, ready=None, rows=None):
            return super()._copy(bufs, slots, offset, nbytes, to_pool, ready, None if to_pool else rows)

    with pytest.raises(ModelError, match="other bytes"):
        run_model(lambda: RowShift(GEOMETRY, buffer_number=10, namespace=NS), SEED, 20000, roomy=False,
                  persistent=False)


def test_issue_14_smallest_case_memory_and_write_back(tmp_path):
    """4 slots; ids 0-3, then [4, 5], [6], [7, 8, 9], [1, 10]; then [8, 11] with 8 present:
    11 must load its own bytes, in memory and persisted by write-back. (Each batch's write-back
    ends before the next dump: a write-back reads its blocks out of the memory tier, and with all
    4 slots being read a dump finds no slot and fails, as it may; here it must not.)"""
    def run(store):
        for batch in ([0, 1, 2, 3], [4, 5], [6], [7, 8, 9], [1, 10], [8, 11]):
            ids = block_ids(batch)
            r = store.wait(store.dump(ids, 0, np.stack([content(k) for k in batch])))
            assert r.all_ok, batch
            store.commit(ids, r.ok)
            if hasattr(store, "flush"):
                store.flush()
        dst = np.zeros((1, GEOMETRY.block_bytes), np.uint8)
        r = store.wait(store.load(block_ids([11]), 0, dst))
        assert not r.ok[0] or np.array_equal(dst[0], content(11))
        return bool(r.ok[0])

    mem = MemoryStore(GEOMETRY, buffer_number=4, namespace=NS)
    assert run(mem)
    mem.close()
    (tmp_path / "wb").mkdir()
    pipe = PipelineStore([MemoryStore(GEOMETRY, buffer_number=4, namespace=NS), _posix([tmp_path / "wb"], 64)],
                         write_back=True)
    run(pipe)
    pipe.close()
    disk = _posix([tmp_path / "wb"], 64)
    dst = np.zeros((1, GEOMETRY.block_bytes), np.uint8)
    assert disk.wait(disk.load(block_ids([11]), 0, dst)).ok[0] and np.array_equal(dst[0], content(11))
    disk.close()


@pytest.mark.parametrize("kind", ["memory", "memory|posix write-back"])
def test_eight_threads_never_load_wrong_bytes(kind, tmp_path):
    """Eight threads dump (duplicates, present ids), commit, load and look up one shared pool
    of blocks on a store with eviction pressure; every block loaded ok holds its own bytes."""
    open_store, _ = _factory(kind, False, tmp_path)
    loaded, errors = run_threads(open_store())
    assert not errors, errors[:5]
    assert loaded > 50  # loads really happened (eviction keeps many of them misses)
