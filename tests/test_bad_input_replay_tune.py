"""Hostile input to the trace replay (ucm/replay.py, `ucm replay`) and the AutoTuner
(ucm/autotune.py, `ucm tune`): every bad file, line, number and option is a clear error that
names it (a line number for a trace line), never a Python traceback and never a figure computed
from nonsense. Each test here failed before the fix it comes with."""
import gzip
import json

import numpy as np
import pytest

from ucm import replay as rp
from ucm.autotune import AutoTuner, TuneError, model_shape
from ucm.cli import main

from test_autotune import SMOLLM2  # noqa: E402


def line(ts=5, n_in=700, ids=(1, 2), **kw):
    return json.dumps({"timestamp": ts, "input_length": n_in, "output_length": 3,
                       "hash_ids": list(ids), **kw})


def write(tmp_path, name, lines):
    p = tmp_path / name
    p.write_text("".join(x + "\n" for x in lines))
    return str(p)


def cli(capsys, *argv):
    """(exit status, stderr) of ``ucm ARGV``: an exception escaping main fails the test."""
    rc = main(list(argv))
    return rc, capsys.readouterr().err


@pytest.fixture
def trace_file(tmp_path):
    p = tmp_path / "s.jsonl"
    rp.write_trace(rp.synthetic_trace(n_requests=120, seed=2), str(p))
    return str(p)


# ---------------------------------------------------------------------------------------------
# trace files


def test_a_trace_path_that_is_missing_or_a_directory_is_a_clear_error(tmp_path, capsys):
    for path in (str(tmp_path / "nope.jsonl"), str(tmp_path / "nope.jsonl.gz"), str(tmp_path)):
        with pytest.raises(ValueError, match="cannot read"):
            rp.load_trace(path)
        rc, err = cli(capsys, "replay", path, "--quiet")
        assert rc == 2 and path in err and "Traceback" not in err


def test_gzip_is_told_by_content_and_a_cut_gzip_names_the_line(tmp_path, capsys):
    body = "".join(line(ts=i, ids=(10 * i + 1, 10 * i + 2)) + "\n" for i in range(400)).encode()
    plain_gz_name = tmp_path / "plain.jsonl.gz"        # plain text, named .gz
    plain_gz_name.write_bytes(body)
    gz_plain_name = tmp_path / "packed.jsonl"          # gzip, named as plain text
    packed = gzip.compress(body)
    gz_plain_name.write_bytes(packed)
    for p in (plain_gz_name, gz_plain_name):
        assert len(rp.load_trace(str(p)).requests) == 400
    cut = tmp_path / "cut.jsonl.gz"                    # a download cut short
    cut.write_bytes(packed[: len(packed) // 2])
    with pytest.raises(rp.TraceError, match=r"trace line \d+: .*cut short"):
        rp.load_trace(str(cut))
    t = rp.load_trace(str(cut), on_error="skip")       # the lines before it, the cut reported
    assert 0 < len(t.requests) < 400 and "cut short" in t.skipped[-1][1]
    assert t.skipped[-1][0] == len(t.requests) + 1
    rc, err = cli(capsys, "replay", str(cut), "--quiet", "--capacities", "0.5")
    assert rc == 2 and "cut short" in err


def test_a_line_that_is_not_utf8_is_reported_by_number_and_can_be_skipped(tmp_path, capsys):
    p = tmp_path / "u.jsonl"
    p.write_bytes(line(ids=(1, 2)).encode() + b"\n" + b'{"timestamp": 1, "x": "\xff\xfe"}\n'
                  + line(ids=(1, 2, 3), n_in=1100).encode() + b"\n")
    with pytest.raises(rp.TraceError, match="trace line 2: not UTF-8"):
        rp.load_trace(str(p))
    t = rp.load_trace(str(p), on_error="skip")
    assert len(t.requests) == 2 and [n for n, _ in t.skipped] == [2]
    rc, err = cli(capsys, "replay", str(p), "--quiet", "--on-error", "skip", "--capacities", "1.0",
                  "--policies", "lru")
    assert rc == 0 and "skipped line 2: not UTF-8" in err


@pytest.mark.parametrize("bad", [
    dict(ts=10**400),                      # an int no float holds
    dict(n_in=2**63),                      # past int64: the token counts cannot hold it
    dict(ids=(1, 2**64)),                  # past a 64-bit id
    dict(ids=(2**70,), n_in=10),
])
def test_numbers_too_large_for_the_replay_are_malformed_lines(tmp_path, capsys, bad):
    p = write(tmp_path, "big.jsonl", [line(ids=(5, 6)), line(**bad)])
    with pytest.raises(rp.TraceError, match="trace line 2"):
        rp.load_trace(p)
    t = rp.load_trace(p, on_error="skip")
    assert [n for n, _ in t.skipped] == [2]
    assert rp.replay(t, 1.0).hit_rate == 0.0
    rc, err = cli(capsys, "replay", p, "--quiet")
    assert rc == 2 and "line 2" in err
    # the largest id and length that fit are fine
    ok = rp.load_trace(write(tmp_path, "ok.jsonl", [line(ids=(2**64 - 1,), n_in=300)] * 2))
    assert rp.replay(ok, 1.0).hit_rate == 0.5


def test_a_line_with_more_blocks_than_tokens_is_malformed(tmp_path):
    """3 tokens cannot fill 3 blocks of 512: the token-weighted figures would count 1,025 tokens
    the request never had. It is also what a trace read at the wrong block size looks like."""
    p = write(tmp_path, "t.jsonl", [line(n_in=700, ids=(1, 2)), line(n_in=3, ids=(7, 8, 9))])
    with pytest.raises(rp.TraceError, match="line 2: input_length 3 is too short for 3 hash_ids"):
        rp.load_trace(p)
    with pytest.raises(rp.TraceError, match="line 1: .*block_tokens"):
        rp.load_trace(p, block_tokens=1024)         # 700 tokens are 1 block of 1024, not 2
    good = write(tmp_path, "g.jsonl", [line(n_in=600, ids=(1, 2)), line(n_in=600, ids=(1, 2))])
    r = rp.replay(rp.load_trace(good), 1.0)         # 512 + 88 tokens, both hit the second time
    assert r.hit_rate == pytest.approx(0.5) and r.token_hit_rate == pytest.approx(0.5)


def test_limit_zero_or_negative(tmp_path, capsys, trace_file):
    p = write(tmp_path, "t.jsonl", [line(ts=i, ids=(i + 1,), n_in=10) for i in range(5)])
    for bad in (0, -1, True, "2"):
        with pytest.raises(ValueError, match="limit"):
            rp.load_trace(p, limit=bad)
    assert len(rp.load_trace(p, limit=2).requests) == 2
    rc, err = cli(capsys, "replay", trace_file, "--quiet", "--limit", "-1")
    assert rc == 2 and "--limit" in err
    rc, err = cli(capsys, "replay", "--synthetic", "agentic", "--quiet", "--limit", "-1")
    assert rc == 2 and "--limit" in err
    with pytest.raises(ValueError, match="n_requests"):
        rp.synthetic_trace(n_requests=0)


# ---------------------------------------------------------------------------------------------
# replay options


def test_costs_and_sizes_that_would_make_every_figure_wrong_are_refused(trace_file, capsys):
    t = rp.load_trace(trace_file)
    for kv in (0, -1, 1.5):
        with pytest.raises(ValueError, match="kv_bytes_per_token"):
            rp.replay(t, 0.1, kv_bytes_per_token=kv)
    for costs in (rp.Costs({"memory": float("nan")}), rp.Costs({"memory": -1.0}),
                  rp.Costs(prefill_s_per_token=-1e-4), rp.Costs(prefill_s_per_token=float("inf"))):
        with pytest.raises(ValueError, match="costs"):
            rp.replay(t, 0.1, costs=costs)
    for flag, value in (("--memory-load-s", "nan"), ("--posix-load-s", "-1"),
                        ("--prefill-s-per-token", "-1"), ("--kv-bytes-per-token", "-1")):
        rc, err = cli(capsys, "replay", trace_file, "--quiet", "--capacities", "0.1",
                      "--policies", "lru", flag, value)
        assert rc == 2 and ("costs" in err or "kv_bytes_per_token" in err), (flag, err)


def test_a_trace_object_without_requests(capsys):
    empty = rp.Trace([], [])
    with pytest.raises(ValueError, match="no request"):
        rp.replay(empty, 1)
    with pytest.raises(ValueError, match="no request"):
        rp.belady(empty, 1)


def test_cli_empty_capacity_or_policy_lists(trace_file, capsys):
    for caps in ("", ",", " , "):
        rc, err = cli(capsys, "replay", trace_file, "--quiet", "--capacities", caps)
        assert rc == 2 and "--capacities" in err
    for pols in ("", ",", "lru,lfu"):
        rc, err = cli(capsys, "replay", trace_file, "--quiet", "--capacities", "0.1",
                      "--policies", pols)
        assert rc == 2 and "--policies" in err and "lru, arc, prefix" in err
    assert "'lfu'" in err


def test_cli_slower_tier_options_without_a_slower_tier(trace_file, capsys):
    for extra in (["--lower-capacity", "0.5"], ["--admission", "second_hit"]):
        rc, err = cli(capsys, "replay", trace_file, "--quiet", "--capacities", "0.1",
                      "--policies", "lru", *extra)
        assert rc == 2 and extra[0] in err and "memory|posix" in err
    rc, err = cli(capsys, "replay", trace_file, "--quiet", "--capacities", "0.1", "--policies",
                  "lru", "--tiers", "memory|posix", "--lower-capacity", "0")
    assert rc == 2 and "lower_capacity" in err


def test_cli_synthetic_honours_block_tokens(tmp_path, capsys):
    rc, err = cli(capsys, "replay", "--synthetic", "agentic", "--limit", "50", "--quiet",
                  "--block-tokens", "0")
    assert rc == 2 and "block_tokens" in err
    written = {}
    for bt in (64, 512):
        js = tmp_path / f"{bt}.json"
        assert main(["replay", "--synthetic", "agentic", "--limit", "60", "--quiet",
                     "--capacities", "1.0", "--policies", "lru", "--kv-bytes-per-token", "1",
                     "--block-tokens", str(bt), "--json", str(js)]) == 0
        written[bt] = json.load(open(js))["rows"][0]["bytes_written"]["memory"]
    capsys.readouterr()
    assert written[512] == 8 * written[64]


def test_cli_output_path_that_is_a_directory_fails_before_the_replay(tmp_path, trace_file, capsys):
    for flag in ("--json", "--png"):
        rc, err = cli(capsys, "replay", trace_file, "--quiet", "--capacities", "0.1",
                      "--policies", "lru", flag, str(tmp_path))
        assert rc == 2 and flag in err and "directory" in err


# ---------------------------------------------------------------------------------------------
# AutoTuner


from test_autotune import model  # noqa: E402,F401 (a fixture: a model folder of SmolLM2's config)


def requests(n=8, seed=0):
    rng = np.random.default_rng(seed)
    app = rng.integers(0, 30000, 320).tolist()
    return [app + rng.integers(0, 30000, 64).tolist() for _ in range(n)]


@pytest.mark.parametrize("key,value", [
    ("num_hidden_layers", 0), ("num_hidden_layers", -2), ("num_key_value_heads", 0),
    ("head_dim", -64), ("num_hidden_layers", 30.5), ("num_hidden_layers", True),
    ("hidden_size", 4),                    # fewer than the 9 heads: a head of 0 dims
])
def test_a_model_shape_of_zero_negative_or_fractional_counts(tmp_path, capsys, key, value):
    d = tmp_path / "m"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(dict(SMOLLM2, **{key: value})))
    with pytest.raises(TuneError, match=f"config.json {key}"):
        model_shape(str(d))
    reqs = tmp_path / "r.jsonl"
    reqs.write_text("".join(json.dumps(r) + "\n" for r in requests(2)))
    rc, err = cli(capsys, "tune", "--requests", str(reqs), "--model", str(d), "--no-vllm",
                  "--quiet", "--max-disk-gb", "0", "--max-memory-gb", "0.01")
    assert rc == 2 and key in err


def test_a_generator_of_sample_requests_feeds_every_stage(model):
    kw = dict(measure_vllm=False, progress=False)
    c = {"max_memory_gb": 0.01, "max_disk_gb": 0}
    ref = AutoTuner("chat", c, **kw)
    ref.tune(model, requests())
    gen = AutoTuner("chat", c, **kw)
    gen.tune(model, (r for r in requests()))
    rows = {t: [s for s in t.stages if s.name == "block size"][0].rows for t in (ref, gen)}
    assert rows[ref]                        # (the choice rests on measured times: not compared)
    assert [(r["block_size"], r["token_hit_rate"]) for r in rows[gen]] == \
        [(r["block_size"], r["token_hit_rate"]) for r in rows[ref]]
    with pytest.raises(TuneError, match="sample_requests"):
        AutoTuner("chat", c, **kw).tune(model, 5)


def test_a_latency_bound_without_the_ttft_stage_is_refused(model, tmp_path, capsys):
    with pytest.raises(TuneError, match="max_latency_ms.*measure_vllm"):
        AutoTuner("chat", {"max_latency_ms": 0.001}, measure_vllm=False)
    reqs = tmp_path / "r.jsonl"
    reqs.write_text("".join(json.dumps(r) + "\n" for r in requests(2)))
    rc, err = cli(capsys, "tune", "--requests", str(reqs), "--model", model, "--no-vllm",
                  "--quiet", "--max-latency-ms", "1", "--max-disk-gb", "0")
    assert rc == 2 and "max_latency_ms" in err and "--no-vllm" in err


@pytest.mark.parametrize("memory_gb", [1e-9, 0.01])
def test_a_disk_budget_below_one_block_is_named(model, memory_gb):
    t = AutoTuner("chat", {"max_memory_gb": memory_gb, "max_disk_gb": 1e-9}, measure_vllm=False,
                  progress=False, tune_block_size=False)
    with pytest.raises(TuneError, match="max_disk_gb=1e-09 is less than one KV block"):
        t.tune(model, requests(4))


@pytest.mark.parametrize("kw,match", [
    (dict(block_size=0), "block_size=0"),
    (dict(block_size=-32), "block_size=-32"),
    (dict(workload=["chat"]), "workload"),
    (dict(constraints="max_memory_gb"), "constraints: expected a dict"),
    (dict(constraints={"max_memory_gb": 10**400}), "max_memory_gb"),
])
def test_bad_tuner_arguments_are_named(kw, match):
    kw = dict(dict(workload="chat", measure_vllm=False), **kw)
    with pytest.raises(TuneError, match=match):
        AutoTuner(**kw)


def test_numpy_numbers_are_constraints_too(model):
    t = AutoTuner("chat", {"max_memory_gb": np.float32(0.01), "max_disk_gb": np.int64(0)},
                  measure_vllm=False, progress=False, tune_block_size=False)
    assert t.tune(model, requests(4))["store.pipeline"] == "memory"


@pytest.mark.parametrize("bad", [
    [1.5] * 400,                           # floats: truncated to other tokens before
    [True] * 400,
    [10**30] * 400,
    [-1] * 400,
    [2**32] * 400,
    [[1, 2]] * 400,
    None,
    "a prompt as text",
])
def test_sample_token_ids_are_checked_by_request(model, bad):
    t = AutoTuner("chat", {"max_memory_gb": 0.01, "max_disk_gb": 0}, measure_vllm=False,
                  progress=False, tune_block_size=False)
    with pytest.raises(TuneError, match=r"sample_requests\[1\]"):
        t.tune(model, [requests(1)[0], bad])


def test_cli_tune_requests_not_utf8_or_bools_name_the_line(model, tmp_path, capsys):
    p = tmp_path / "r.jsonl"
    good = json.dumps(requests(1)[0]).encode()
    for bad in (b"[1, 2, \"\xff\"]", b"[true, false]", json.dumps([2**32]).encode()):
        p.write_bytes(good + b"\n" + bad + b"\n")
        rc, err = cli(capsys, "tune", "--requests", str(p), "--model", model, "--no-vllm",
                      "--quiet", "--max-disk-gb", "0")
        assert rc == 2 and "--requests line 2" in err, err


def test_a_trace_that_is_a_fifo_or_a_device_is_refused_at_once(tmp_path, capsys):
    """A FIFO as the trace blocked load_trace until a writer came; /dev/zero never ends."""
    import os

    from fifo import returns_within

    fifo = str(tmp_path / "trace.jsonl")
    os.mkfifo(fifo)
    ok, box = returns_within(lambda: rp.load_trace(fifo), fifo)
    assert ok, "loading a FIFO as the trace blocked"
    assert isinstance(box.get("error"), ValueError) and "not a regular file" in str(box["error"])
    with pytest.raises(ValueError, match="not a regular file"):
        rp.load_trace("/dev/zero")
