"""Hostile input to the integration-side surfaces: the metrics recorders and sinks
(:mod:`ucm.metrics`), the engine-free core's synchronous block transfers
(:class:`ucm.integration.core.WorkerCore`) over real stores, and the part of SGLang's HiCache
backend that needs no SGLang (:mod:`ucm.integration.sglang.pages`, loaded from its file because
the package itself imports SGLang).

The rules checked: bad input is a ValueError naming the argument and changes nothing; a block
reported loaded holds its own bytes, a block reported stored is stored with its own bytes, never
another block's."""
import importlib.util
import json
import math
import os
import sys
import threading
import time

import numpy as np
import pytest
import torch

import ucm
from ucm import metrics as M
from ucm.integration.core import WorkerCore
from ucm.store import open_store

# --------------------------------------------------------------------------------------------
# metrics


@pytest.mark.parametrize("value", [-1, -0.5, math.nan, math.inf, -math.inf, "3", None, b"1"])
def test_counter_refuses_bad_increments_and_keeps_its_total(value):
    r = M.Recorder()
    r.inc("ucm_load_blocks_total", 2)
    with pytest.raises(ValueError, match="ucm_load_blocks_total"):
        r.inc("ucm_load_blocks_total", value)
    assert r.get("ucm_load_blocks_total") == 2
    assert r.drain() == {"ucm_load_blocks_total": {"": 2}}
    # what was recorded still publishes (a negative or NaN increment used to make
    # prometheus_client raise, or poison the counter, in the middle of a payload)
    pytest.importorskip("prometheus_client")
    r.inc("ucm_load_blocks_total", 1)
    M.PrometheusSink().apply(r.drain())


@pytest.mark.parametrize("value", [math.nan, math.inf, "0.5", None])
def test_gauges_and_histograms_refuse_non_finite_values(value, tmp_path):
    r = M.Recorder()
    with pytest.raises(ValueError, match="ucm_sparse_kept_block_ratio"):
        r.set("ucm_sparse_kept_block_ratio", value)
    with pytest.raises(ValueError, match="ucm_load_seconds"):
        r.observe("ucm_load_seconds", value)
    assert r.drain() == {}
    t = r.totals()
    assert t["ucm_load_seconds_count"] == 0 and "ucm_sparse_kept_block_ratio" not in t
    # so the stats file stays strict JSON (NaN / Infinity are not JSON)
    sink = M.JsonLinesSink(str(tmp_path / "s.jsonl"))
    sink.write(t)
    sink.close()
    json.loads((tmp_path / "s.jsonl").read_text(), parse_constant=lambda c: pytest.fail(c))


HOSTILE_TIERS = ["nvme,fast", "x=y", "a,tier=b", "100%2C", "%3D", 'q"uote', "new\nline",
                 "back\\slash", "é" * 300, ""]


def test_label_values_with_separators_survive_payloads_and_prometheus():
    prometheus_client = pytest.importorskip("prometheus_client")
    from prometheus_client.parser import text_string_to_metric_families

    r = M.Recorder()
    want = {}
    for i, tier in enumerate(HOSTILE_TIERS):
        r.inc("ucm_tier_load_bytes_total", i + 1, tier=tier)
        want[tier] = float(i + 1)
        assert r.get("ucm_tier_load_bytes_total", tier=tier) == i + 1
    payload = json.loads(json.dumps(r.drain()))        # as it crosses vLLM's processes
    again = M.Recorder()
    again.add(payload)                                   # labels parsed back from the keys
    for tier, v in want.items():
        assert again.get("ucm_tier_load_bytes_total", tier=tier) == v, tier
    sink = M.PrometheusSink(labelnames=["engine"])
    sink.apply(payload, ["0"])
    text = prometheus_client.generate_latest(sink.registry).decode()
    got = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == "ucm_tier_load_bytes_total":
                got[s.labels["tier"]] = s.value
    assert got == want


def test_a_label_that_is_not_utf8_is_refused_and_the_metrics_page_survives():
    prometheus_client = pytest.importorskip("prometheus_client")
    r = M.Recorder()
    r.inc("ucm_tier_load_bytes_total", 5, tier="posix")
    with pytest.raises(ValueError, match="tier"):
        r.inc("ucm_tier_load_bytes_total", 7, tier="bad\udcff")     # os.fsdecode's escape
    with pytest.raises(ValueError, match="tier"):
        r.set("ucm_tier_used_bytes", 7, tier="bad\udcff")
    sink = M.PrometheusSink()
    sink.apply(r.drain())
    text = prometheus_client.generate_latest(sink.registry).decode()   # a scrape still works
    assert 'ucm_tier_load_bytes_total{tier="posix"} 5.0' in text


def test_merging_full_histograms_counts_what_it_drops():
    """Two recorders' full histograms merged (the exporter merges every recorder's payload):
    the observations beyond MAX_OBSERVATIONS are counted, as the recorder itself counts them."""
    a, b = M.Recorder(), M.Recorder()
    for r in (a, b):
        for _ in range(M.MAX_OBSERVATIONS):
            r.observe("ucm_save_seconds", 0.001)
    merged = M.merge(a.drain(), b.drain())
    kept = len(merged["ucm_save_seconds"][""])
    dropped = merged.get("ucm_metrics_dropped_observations_total", {}).get("", 0)
    assert kept == M.MAX_OBSERVATIONS
    assert kept + dropped == 2 * M.MAX_OBSERVATIONS


def test_totals_are_a_consistent_snapshot_under_concurrent_observations():
    """A histogram's count and sum in :meth:`Recorder.totals` come from the same moment while
    another thread observes (they were read outside the lock). A race: it shows within seconds
    on the unfixed code, most runs, not every one."""
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    r, stop = M.Recorder(), threading.Event()

    def observe():
        while not stop.is_set():
            r.observe("ucm_load_seconds", 0.5)

    t = threading.Thread(target=observe, daemon=True)
    t.start()
    try:
        deadline = time.monotonic() + 3.0
        while time.monotonic() < deadline:
            tot = r.totals()
            assert tot["ucm_load_seconds_sum"] == tot["ucm_load_seconds_count"] * 0.5
            r.drain()
    finally:
        stop.set()
        t.join()
        sys.setswitchinterval(old)


# --------------------------------------------------------------------------------------------
# WorkerCore

from test_integration_core import D, H, L, NB, PS, _pool  # noqa: E402,F401  (the same pool)

NS = b"bad-input-integr"


def _store(layout, root=None, **extra):
    cfg = {"store": {"pipeline": "memory"}}
    if root is not None:
        cfg = {"store": {"pipeline": "memory|posix", "posix": {"roots": [str(root)]}}}
    cfg.update(extra)
    return open_store(cfg, block_bytes=layout.block_bytes, shard_bytes=layout.block_bytes,
                      namespace=NS)


def _core(layout, store, **kw):
    return WorkerCore(layout, store, "cpu", shard_bytes=layout.block_bytes, **kw)


def _ids(n, salt=7):
    return np.array([[salt, 1000 + i] for i in range(n)], dtype=np.uint64)


def _page(buf, p):
    return buf[:, p * PS:(p + 1) * PS].view(torch.int16)


def test_save_with_index_minus_one_stores_nothing_not_another_blocks_bytes():
    """-1 is the transfer layer's "skip this row": a save of it used to dump whatever the
    reused staging row held (the previous save's block) under the new id, and report it saved."""
    src, lay = _pool(seed=1)
    store = _store(lay)
    try:
        core = _core(lay, store)
        assert core.save_blocks(_ids(2), [3, 4]).all()          # leaves page 3 in staging
        victim = _ids(1, salt=9)
        with pytest.raises(ValueError, match=r"^indices"):
            core.save_blocks(victim, [-1])
        assert not np.asarray(store.lookup(victim)).any()
    finally:
        store.close()


@pytest.mark.parametrize("through_memory", [True, False])
def test_load_with_index_minus_one_is_refused_not_reported_loaded(tmp_path, through_memory):
    src, lay = _pool(seed=2)
    store = _store(lay, tmp_path)
    _core(lay, store).save_blocks(_ids(2), [0, 1])
    if not through_memory:          # a fresh memory tier: the staged path, not the borrowed one
        store.close()
        store = _store(lay, tmp_path)
    try:
        dst, lay2 = _pool()
        core = _core(lay2, store)
        with pytest.raises(ValueError, match=r"^indices"):
            core.load_blocks(_ids(2), [-1, 5])
        assert (_page(dst, 5) == -3).all()
        assert core.load_blocks(_ids(2), [6, 5]).all()          # the right call still works
        assert torch.equal(_page(dst, 6), _page(src, 0)) and torch.equal(_page(dst, 5), _page(src, 1))
    finally:
        store.close()


BAD_INDICES = [
    ([0.7, 1.2], "float"),                    # used to be truncated to blocks 0 and 1
    ([True, False], "bool"),
    ([[1], [2]], "shape"),
    (["1", "2"], "str"),
    ([2, NB], "out of range"),
    ([2, -2], "negative"),
    (np.array([2, 2**63 + 5], dtype=np.uint64), "huge"),
]


@pytest.mark.parametrize("indices,what", BAD_INDICES, ids=[w for _, w in BAD_INDICES])
def test_bad_indices_are_a_clear_error_that_changes_nothing(tmp_path, indices, what):
    src, lay = _pool(seed=3)
    store = _store(lay, tmp_path)
    try:
        core = _core(lay, store)
        fresh = _ids(2, salt=31)
        with pytest.raises(ValueError, match=r"^indices"):
            core.save_blocks(fresh, indices)
        assert not np.asarray(store.lookup(fresh)).any()        # nothing stored
        assert core.save_blocks(_ids(2), [0, 1]).all()
        dst, lay2 = _pool()
        core2 = _core(lay2, store)
        with pytest.raises(ValueError, match=r"^indices"):
            core2.load_blocks(_ids(2), indices)
        assert (dst.view(torch.int16) == -3).all()              # nothing written
        assert core.stats()["ucm_save_failed_blocks_total"] == 0
    finally:
        store.close()


@pytest.mark.parametrize("through_memory", [True, False])
def test_two_blocks_into_one_engine_block_is_refused_on_every_load_path(tmp_path, through_memory):
    """Both loads would be reported done with one engine block holding one of them: refused,
    as a clear error on the borrowed path and the staged path alike (the staged path used to
    swallow it into an all-False result; the borrowed one raised the transfer layer's error)."""
    src, lay = _pool(seed=4)
    store = _store(lay, tmp_path)
    _core(lay, store).save_blocks(_ids(2), [0, 1])
    if not through_memory:
        store.close()
        store = _store(lay, tmp_path)
    try:
        dst, lay2 = _pool()
        with pytest.raises(ValueError, match=r"^indices: block index 5 appears twice"):
            _core(lay2, store).load_blocks(_ids(2), [5, 5])
        assert (dst.view(torch.int16) == -3).all()
    finally:
        store.close()


def test_duplicate_ids_and_pages_in_one_save_are_fine(tmp_path):
    """One page stored under two ids, one id given twice: each id holds that page's bytes."""
    src, lay = _pool(seed=5)
    store = _store(lay, tmp_path)
    try:
        core = _core(lay, store)
        ids = np.concatenate([_ids(2), _ids(1)])                 # id 0 twice
        assert core.save_blocks(ids, [4, 4, 4]).all()
        dst, lay2 = _pool()
        assert _core(lay2, store).load_blocks(ids, [0, 1, 2]).all()
        for p in (0, 1, 2):
            assert torch.equal(_page(dst, p), _page(src, 4))
    finally:
        store.close()


def test_a_full_memory_tier_refuses_blocks_and_they_are_misses():
    """More blocks than the memory tier's slots in one save: those refused are False (and
    counted failed), those reported stored load back their own bytes, the rest are misses."""
    src, lay = _pool(seed=6)
    store = _store(lay, cache_capacity="8KiB")        # raised to the tier's minimum of slots
    try:
        slots = store.stats()["memory"]["slots"]
        n = slots + 50
        ids = _ids(n, salt=41)
        core = _core(lay, store)
        ok = core.save_blocks(ids, np.arange(n) % NB)
        assert 0 < ok.sum() < n
        assert core.stats()["ucm_save_failed_blocks_total"] == n - ok.sum()
        assert np.array_equal(np.asarray(store.lookup(ids), dtype=bool), ok)
        stored, refused = np.flatnonzero(ok), np.flatnonzero(~ok)
        dst, lay2 = _pool()
        core2 = _core(lay2, store)
        pick = np.array([stored[-1], refused[0], refused[-1]])
        got = core2.load_blocks(ids[pick], [7, 8, 9])
        assert got.tolist() == [True, False, False]
        assert torch.equal(_page(dst, 7), _page(src, int(stored[-1]) % NB))
        assert (_page(dst, 8) == -3).all() and (_page(dst, 9) == -3).all()
    finally:
        store.close()


def test_close_twice_writes_one_final_statistics_line(tmp_path):
    src, lay = _pool(seed=7)
    store = _store(lay)
    try:
        path = tmp_path / "stats.jsonl"
        core = _core(lay, store, stats_file=str(path))
        core.save_blocks(_ids(1), [0])
        core.close()
        core.close()
        lines = [json.loads(x) for x in path.read_text().splitlines()]
        assert len(lines) == 1 and "store" in lines[0]
        assert core.load_blocks(_ids(1), [1]).all()      # the store stays open after close
    finally:
        store.close()


# --------------------------------------------------------------------------------------------
# SGLang's pages (no SGLang needed)

def _pages_module():
    path = os.path.join(os.path.dirname(ucm.__file__), "integration", "sglang", "pages.py")
    spec = importlib.util.spec_from_file_location("_ucm_sglang_pages_under_test", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _tok(*pages_, ps=4):
    return torch.cat([torch.arange(p * ps, (p + 1) * ps) for p in pages_]).to(torch.int64)


def test_page_indices_accept_whole_pages_only():
    pages = _pages_module()
    assert pages.page_indices(_tok(3, 0, 7), 4, 3).tolist() == [3, 0, 7]
    assert pages.page_indices(torch.empty(0, dtype=torch.int64), 4, 0).tolist() == []
    # a negative page (would reach the core as -1, "skip", and be reported done)
    assert pages.page_indices(torch.arange(-4, 0), 4, 1) is None
    # a page's first token aligned but the rest another page's tokens
    assert pages.page_indices(torch.tensor([0, 1, 2, 3, 4, 9, 10, 11]), 4, 2) is None
    assert pages.page_indices(torch.tensor([0, 2, 1, 3]), 4, 1) is None
    # float token indices
    assert pages.page_indices(np.arange(4, dtype=np.float64), 4, 1) is None
    # beyond the host pool
    assert pages.page_indices(_tok(3), 4, 1, num_pages=3) is None
    assert pages.page_indices(_tok(2), 4, 1, num_pages=3).tolist() == [2]


def test_page_keys_that_are_not_hashes_have_no_id():
    pages = _pages_module()
    from ucm.ids import Namespace

    ns = Namespace(model="m", dtype="bfloat16", block_size=4, kv_layout="x", tp_rank=0, tp_size=1)
    good = "ab" * 32
    keys = [good, good.upper(), "", 17, None, b"ab" * 32, good + "\n", "zz" * 32, good]
    ids, valid = pages.key_ids(keys, ns)
    assert valid.tolist() == [True, True, False, False, False, False, False, False, True]
    assert (ids[~valid] == 0).all()
    assert (ids[0] == ids[1]).all() and (ids[0] == ids[8]).all()
    empty_ids, empty_valid = pages.key_ids([], ns)
    assert empty_ids.shape == (0, 2) and empty_valid.shape == (0,)


def test_a_payload_with_a_bad_value_is_recorded_whole_or_not_at_all():
    """Recorder.add recorded the items before a bad value, then raised: half a payload."""
    from ucm.metrics import Recorder

    r = Recorder()
    before = r.totals()
    bad = {"ucm_save_blocks_total": {"": 3}, "ucm_load_blocks_total": {"": -1}}
    with pytest.raises(ValueError, match="ucm_load_blocks_total"):
        r.add(bad)
    assert r.totals() == before
    bad = {"ucm_save_blocks_total": {"": 3}, "ucm_save_seconds": {"": [0.1, float("nan")]}}
    with pytest.raises(ValueError, match="ucm_save_seconds"):
        r.add(bad)
    assert r.totals() == before
    r.add({"ucm_save_blocks_total": {"": 3}, "ucm_save_seconds": {"": [0.1, 0.2]}})
    assert r.totals()["ucm_save_blocks_total"] == 3 and r.totals()["ucm_save_seconds_count"] == 2
