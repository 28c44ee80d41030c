"""Trace replay (ucm/replay.py, `ucm replay`): the real store against an independent LRU model
and the offline optimum, the policies' floor (never below LRU), bad traces and capacities."""
import gzip
import json
import os
from collections import OrderedDict

import numpy as np
import pytest

from ucm import replay as rp
from ucm.cli import main

TRACE = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "data", "conversation_trace.jsonl.gz")
SYNTHETIC = os.path.join(os.path.dirname(TRACE), "synthetic_trace.jsonl.gz")


@pytest.fixture(scope="module")
def conv():
    return rp.load_trace(TRACE, limit=2000)


@pytest.fixture(scope="module")
def agentic():
    return rp.synthetic_trace("agentic", n_requests=1500, seed=1)


def lru_model(trace, cap):
    """Prefix hits of a plain LRU over blocks, written independently of the store. A request
    touches its prefix hits, then its other blocks already held, then evicts the least recent
    blocks its new ones need and inserts those, then touches the blocks it read again; each
    group deepest first, so that a chain ages from its tip (ucm/store/policy.py says why)."""
    cache, hits, blocks = OrderedDict(), 0, 0
    for r in trace.requests:
        ids = list(r.hash_ids)
        k = 0
        while k < len(ids) and ids[k] in cache:
            k += 1
        for h in reversed(ids[:k]):
            cache.move_to_end(h)
        rest = ids[k:]
        for h in reversed([h for h in rest if h in cache]):
            cache.move_to_end(h)
        new = [h for h in rest if h not in cache][:cap]
        while cache and len(cache) + len(new) > cap:
            cache.popitem(last=False)
        for h in reversed(new):
            cache[h] = None
        if new:
            for h in reversed(ids[:k]):
                cache.move_to_end(h)
            for h in reversed([h for h in rest if h in cache and h not in new]):
                cache.move_to_end(h)
        hits += k
        blocks += len(ids)
    return hits / blocks


def test_the_trace_is_in_the_project_with_its_attribution():
    assert os.path.getsize(TRACE) > 700_000
    readme = open(os.path.join(os.path.dirname(TRACE), "README.md")).read()
    assert "Mooncake" in readme and "Apache-2.0" in readme
    full = rp.load_trace(TRACE)
    assert (len(full.requests), full.blocks, full.distinct_blocks) == (12031, 288500, 182790)


def test_the_second_real_trace_is_in_the_project_with_its_attribution():
    readme = open(os.path.join(os.path.dirname(SYNTHETIC), "README.md")).read()
    assert "synthetic_trace.jsonl.gz" in readme and readme.count("Apache-2.0") >= 2
    full = rp.load_trace(SYNTHETIC)
    assert (len(full.requests), full.blocks, full.distinct_blocks) == (3993, 121877, 43924)
    # its documents are long: the store's LRU against the independent model on the first 600
    # requests (about 9,000 distinct blocks), under eviction
    head = rp.Trace(full.requests[:600], [], full.block_tokens)
    r = rp.replay(head, 0.05, "lru")
    assert r.evictions["memory"] > 0
    assert r.hit_rate == pytest.approx(lru_model(head, r.capacity_blocks), abs=1e-12)


@pytest.mark.parametrize("cap", [0.02, 0.1])
def test_replay_of_the_store_matches_an_independent_lru(conv, cap):
    r = rp.replay(conv, cap, "lru")
    assert r.hit_rate == pytest.approx(lru_model(conv, r.capacity_blocks), abs=1e-12)
    assert r.evictions["memory"] > 0
    bb = 131072 * 512
    assert r.bytes_written["memory"] % bb == 0 and r.bytes_read["memory"] == r.hits_per_tier["memory"] * bb


def test_optimum_bounds_every_policy_and_full_capacity_reaches_it(conv):
    for cap in (0.05, 1.0):
        opt, opt_tok = rp.belady(conv, cap)
        for pol in rp.POLICIES:
            r = rp.replay(conv, cap, pol)
            assert r.hit_rate <= opt + 1e-12
            if cap == 1.0:
                assert r.hit_rate == pytest.approx(opt) and r.token_hit_rate == pytest.approx(opt_tok)


@pytest.mark.parametrize("which,caps", [("conv", (0.02, 0.1, 0.5)), ("agentic", (0.01, 0.05, 0.3))])
def test_prefix_policy_is_never_below_lru_and_beats_it_when_small(request, which, caps):
    trace = request.getfixturevalue(which)
    rates = {cap: (rp.replay(trace, cap, "lru").hit_rate, rp.replay(trace, cap, "prefix").hit_rate)
             for cap in caps}
    for cap, (lru, pre) in rates.items():
        assert pre >= lru - 0.002, (cap, lru, pre)
    lru, pre = rates[caps[0]]
    assert pre > lru * 1.1, rates


def test_write_admission_saves_slow_tier_writes(conv):
    short = rp.Trace(conv.requests[:300], [], conv.block_tokens)
    kw = dict(tiers="memory|posix", lower_capacity=0.2)
    every = rp.replay(short, 0.02, "lru", admission="all", **kw)
    second = rp.replay(short, 0.02, "lru", admission="second_hit", **kw)
    assert second.bytes_written["posix"] < 0.5 * every.bytes_written["posix"]
    assert sum(second.hits_per_tier.values()) == pytest.approx(second.hit_rate * short.blocks)


def _write(tmp_path, lines):
    p = tmp_path / "t.jsonl"
    p.write_text("\n".join(lines) + "\n")
    return str(p)


def test_malformed_lines_are_reported_by_number(tmp_path):
    good = json.dumps({"timestamp": 5, "input_length": 700, "output_length": 3, "hash_ids": [1, 2]})
    path = _write(tmp_path, [good, "{oops", json.dumps({"timestamp": 1, "input_length": 3}),
                             json.dumps({"timestamp": 2, "input_length": 3, "hash_ids": [4, 4]}),
                             json.dumps({"timestamp": 2, "input_length": "x", "hash_ids": [4]}), "",
                             good])
    with pytest.raises(rp.TraceError, match="line 2: not JSON"):
        rp.load_trace(path)
    t = rp.load_trace(path, on_error="skip")
    assert len(t.requests) == 2
    assert [line for line, _ in t.skipped] == [2, 3, 4, 5]
    assert "missing key 'hash_ids'" in t.skipped[1][1] and "repeats" in t.skipped[2][1]
    with pytest.raises(rp.TraceError, match="no valid request"):
        rp.load_trace(_write(tmp_path, ["[1, 2]"]), on_error="skip")
    with pytest.raises(ValueError, match="on_error"):
        rp.load_trace(path, on_error="ignore")


def test_capacities_zero_negative_or_past_the_trace(conv):
    for bad in (0, -1, 0.0, 1.5, float("nan"), True, "10"):
        with pytest.raises(ValueError, match="capacity"):
            rp.resolve_capacity(bad, 100)
    assert rp.resolve_capacity(10**12, 100) == 100  # more than every distinct block: all of them
    with pytest.raises(ValueError, match="policy 'lfu'"):
        rp.replay(conv, 0.1, "lfu")


def test_cli_replays_plots_and_fails_cleanly(tmp_path, capsys):
    gz = tmp_path / "t.jsonl.gz"
    rp.write_trace(rp.synthetic_trace(n_requests=300), str(gz))
    png, js = tmp_path / "r.png", tmp_path / "r.json"
    assert main(["replay", str(gz), "--capacities", "0.05,40", "--policies", "lru,prefix", "--quiet",
                 "--png", str(png), "--json", str(js)]) == 0
    out = capsys.readouterr().out
    assert "optimum" in out and png.stat().st_size > 10_000
    rows = json.load(open(js))["rows"]
    assert {r["policy"] for r in rows} == {"lru", "prefix", "optimum"} and len(rows) == 6
    assert main(["replay", str(gz), "--capacities", "0", "--quiet"]) == 2
    assert "capacity 0" in capsys.readouterr().err
    bad = _write(tmp_path, ["nope"])
    assert main(["replay", bad, "--quiet"]) == 2
    assert "line 1" in capsys.readouterr().err
    assert main(["replay", "--quiet"]) == 2
