"""ucm.metrics: the series catalogue, recorders, payload merging, the Prometheus and JSON-lines
sinks, the store collector on a real store, and the HTTP exporter (a real port; a port in use
is a clear error)."""
import json
import re
import socket
import urllib.request

import numpy as np
import pytest

prometheus_client = pytest.importorskip("prometheus_client")

from ucm import metrics as M  # noqa: E402
from ucm.store import open_store  # noqa: E402


def test_series_names_follow_prometheus_conventions():
    for s in M.SERIES.values():
        assert re.fullmatch(r"ucm_[a-z0-9_]+", s.name), s.name
        assert s.kind in ("counter", "gauge", "histogram")
        assert s.name.endswith("_total") == (s.kind == "counter"), s.name
        if s.kind == "histogram":
            assert s.name.endswith("_seconds") and list(s.buckets) == sorted(s.buckets)
        assert s.help.endswith(".") and len(s.help) > 20


def test_recorder_drain_and_merge():
    r = M.Recorder()
    r.inc("ucm_load_blocks_total", 3)
    r.inc("ucm_load_blocks_total", 2)
    r.inc("ucm_tier_load_bytes_total", 100, tier="memory")
    r.set("ucm_tier_used_bytes", 7, tier="posix")
    r.observe("ucm_load_seconds", 0.01)
    p = r.drain()
    assert p == {"ucm_load_blocks_total": {"": 5}, "ucm_tier_load_bytes_total": {"tier=memory": 100},
                 "ucm_tier_used_bytes": {"tier=posix": 7}, "ucm_load_seconds": {"": [0.01]}}
    assert r.drain() == {}
    q = {"ucm_load_blocks_total": {"": 1}, "ucm_tier_used_bytes": {"tier=posix": 9},
         "ucm_load_seconds": {"": [0.5]}}
    M.merge(p, q)
    assert p["ucm_load_blocks_total"][""] == 6 and p["ucm_tier_used_bytes"]["tier=posix"] == 9
    assert p["ucm_load_seconds"][""] == [0.01, 0.5]
    # survives JSON (vLLM ships payloads between processes)
    assert json.loads(json.dumps(p)) == p


@pytest.mark.parametrize("call", [
    lambda r: r.inc("ucm_no_such_total"),
    lambda r: r.inc("ucm_tier_used_bytes", 1, tier="x"),      # a gauge
    lambda r: r.set("ucm_load_blocks_total", 1),               # a counter
    lambda r: r.inc("ucm_tier_load_bytes_total", 1),           # missing label
    lambda r: r.observe("ucm_load_seconds", 1, tier="x"),      # extra label
])
def test_recorder_refuses_wrong_names_kinds_and_labels(call):
    with pytest.raises(ValueError, match="metric|unknown"):
        call(M.Recorder())


def test_histogram_observations_are_capped_and_counted():
    r = M.Recorder()
    for _ in range(M.MAX_OBSERVATIONS + 5):
        r.observe("ucm_save_seconds", 0.001)
    p = r.drain()
    assert len(p["ucm_save_seconds"][""]) == M.MAX_OBSERVATIONS
    assert p["ucm_metrics_dropped_observations_total"][""] == 5


def test_prometheus_sink_text():
    sink = M.PrometheusSink(labelnames=["engine"])
    r = M.Recorder()
    r.inc("ucm_lookup_hit_blocks_total", 4)
    r.inc("ucm_tier_save_bytes_total", 4096, tier="posix")
    r.observe("ucm_load_seconds", 0.003)
    r.observe("ucm_load_seconds", 0.2)
    sink.apply(r.drain(), ["0"])
    text = prometheus_client.generate_latest(sink.registry).decode()
    assert 'ucm_lookup_hit_blocks_total{engine="0"} 4.0' in text
    assert 'ucm_tier_save_bytes_total{engine="0",tier="posix"} 4096.0' in text
    assert 'ucm_load_seconds_count{engine="0"} 2.0' in text
    assert 'ucm_load_seconds_bucket{engine="0",le="0.005"} 1.0' in text
    # every series is declared with its help text, even before a value
    for s in M.SERIES.values():
        assert f"# HELP {s.name}" in text


def test_store_collector_reports_tier_increments(tmp_path):
    store = open_store({"store": {"pipeline": "memory|posix", "posix": {"roots": [str(tmp_path)]}},
                        "cache_capacity": "1MiB"}, block_bytes=4096)
    try:
        col, r = M.StoreCollector(store), M.Recorder()
        ids = np.arange(8, dtype=np.uint64).reshape(4, 2)
        store.wait(store.dump(ids, 0, np.ones((4, 4096), np.uint8)))
        store.commit(ids, [True] * 4)
        col.collect(r)
        p = r.drain()
        assert p["ucm_tier_save_bytes_total"] == {"tier=memory": 16384, "tier=posix": 16384}
        slots = store.stats()["memory"]["slots"]
        assert p["ucm_tier_capacity_bytes"]["tier=memory"] == slots * 4096
        assert p["ucm_tier_used_bytes"]["tier=memory"] == 16384
        out = np.zeros((4, 4096), np.uint8)
        store.wait(store.load(ids, 0, out))
        col.collect(r)
        p = r.drain()
        assert p["ucm_tier_load_bytes_total"] == {"tier=memory": 16384}
        assert "ucm_tier_save_bytes_total" not in p        # increments only
    finally:
        store.close()


def test_serve_exposes_the_store_and_refuses_a_busy_port(tmp_path):
    store = open_store({"store": {"pipeline": "memory"}, "cache_capacity": "1MiB"}, block_bytes=4096)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ex = M.serve(port, store, interval=3600)
    try:
        ids = np.arange(2, dtype=np.uint64).reshape(1, 2)
        store.wait(store.dump(ids, 0, np.ones((1, 4096), np.uint8)))
        store.commit(ids, [True])
        ex.update()
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
        assert 'ucm_tier_save_bytes_total{tier="memory"} 4096.0' in body
        with pytest.raises(OSError, match=f"127.0.0.1:{port}"):
            M.serve(port)
    finally:
        ex.close()
        store.close()


def test_recorder_totals_outlive_drains():
    r = M.Recorder()
    r.inc("ucm_load_blocks_total", 3)
    r.observe("ucm_load_seconds", 0.25)
    r.inc("ucm_tier_load_bytes_total", 10, tier="posix")
    r.drain()
    r.inc("ucm_load_blocks_total", 2)
    r.observe("ucm_load_seconds", 0.5)
    r.set("ucm_background_cpus", 2)
    t = r.totals()
    assert t["ucm_load_blocks_total"] == 5 and r.get("ucm_load_blocks_total") == 5
    assert t["ucm_load_seconds_count"] == 2 and t["ucm_load_seconds_sum"] == 0.75
    assert t["ucm_tier_load_bytes_total{tier=posix}"] == 10
    assert t["ucm_background_cpus"] == 2
    assert t["ucm_save_failed_blocks_total"] == 0          # never recorded: reads 0
    assert t["ucm_save_seconds_count"] == 0
    assert "ucm_tier_used_bytes" not in t                   # gauges never set are absent
    assert r.drain() == {"ucm_load_blocks_total": {"": 2}, "ucm_load_seconds": {"": [0.5]},
                         "ucm_background_cpus": {"": 2}}
    other = M.Recorder()
    other.add({"ucm_load_blocks_total": {"": 5}, "ucm_load_seconds": {"": [0.25, 0.5]},
               "ucm_tier_load_bytes_total": {"tier=posix": 10}, "ucm_background_cpus": {"": 2}})
    assert other.totals() == t


def test_jsonlines_sink(tmp_path):
    path = tmp_path / "stats.jsonl"
    sink = M.JsonLinesSink(str(path))
    sink.write({"ucm_load_blocks_total": 2}, pid=1)
    sink.write({}, pid=1)
    sink.close()
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    assert lines[0]["ucm_load_blocks_total"] == 2 and lines[0]["pid"] == 1 and "t" in lines[0]
    assert len(lines) == 2
    bad = M.JsonLinesSink(str(tmp_path / "no" / "such" / "dir.jsonl"))
    bad.write({"x": 1})         # an unwritable file drops the line, never raises
    bad.close()


def test_worker_stats_file_is_a_sink_of_its_metrics(tmp_path):
    """The connector's stats file holds the worker recorder's totals, the same numbers vLLM's
    stats receive as increments (no separate counters)."""
    import torch

    import ucm
    from ucm.config import Config
    from ucm.integration.core import WorkerCore

    caches = [torch.zeros(4, 2, 16, 8) for _ in range(2)]
    layout = ucm.KVLayout.from_views(caches)
    store = open_store(Config({"store.pipeline": "memory"}), block_bytes=layout.block_bytes,
                       shard_bytes=layout.shard_bytes(0), namespace=bytes(16))
    core = WorkerCore(layout, store, "cpu", stats_file=str(tmp_path / "s.jsonl"))
    drained = M.Recorder()
    for step in range(3):
        core.forward_started()
        core.metrics.inc("ucm_load_blocks_total", 2)
        core.metrics.observe("ucm_load_seconds", 0.01)
        core.forward_ended()
        drained.add(core.drain_metrics())
        core.write_stats()
    core.close()
    lines = [json.loads(x) for x in (tmp_path / "s.jsonl").read_text().splitlines()]
    assert len(lines) == 4 and "store" in lines[-1] and "store" not in lines[0]
    assert [ln["ucm_load_blocks_total"] for ln in lines] == [2, 4, 6, 6]
    assert lines[-1]["ucm_steps_total"] == 3 and lines[-1]["ucm_load_seconds_count"] == 3
    assert drained.get("ucm_load_blocks_total") == 6 and drained.get("ucm_steps_total") == 3
    assert core.stats()["ucm_load_blocks_total"] == 6
    store.close()


def test_grafana_dashboard_queries_name_existing_series():
    """Every query of deploy/grafana/ucm-dashboard.json names series of ucm.metrics.SERIES
    (histograms through their _bucket / _sum / _count), and every series has a panel."""
    import os

    path = os.path.join(os.path.dirname(__file__), "..", "deploy", "grafana", "ucm-dashboard.json")
    with open(path) as f:
        dash = json.load(f)
    used = set()
    for panel in dash["panels"]:
        assert panel["targets"], panel["title"]
        for t in panel["targets"]:
            names = re.findall(r"\bucm_[a-z0-9_]+", t["expr"])
            assert names, (panel["title"], t["expr"])
            for n in names:
                base = re.sub(r"_(bucket|sum|count)$", "", n)
                s = M.SERIES.get(n) or M.SERIES.get(base)
                assert s is not None, f"panel {panel['title']!r}: {n} is not a ucm series"
                if n != s.name:
                    assert s.kind == "histogram", f"{n}: only histograms have _bucket/_sum/_count"
                if "by (tier)" in t["expr"]:
                    assert "tier" in s.labels, f"{n} has no tier label"
                used.add(s.name)
    assert used == set(M.SERIES), f"series without a panel: {sorted(set(M.SERIES) - used)}"


def test_observability_page_lists_every_series():
    import os

    page = open(os.path.join(os.path.dirname(__file__), "..", "docs", "observability.md")).read()
    assert M.markdown() in page, ("regenerate the table in docs/observability.md: "
                                  "python -c 'import ucm.metrics as m; print(m.markdown())'")
