"""AutoTuner (ucm/autotune.py, `ucm tune`): constraints checked by name, every stage measured
and reported, the choice is the measured best. The vLLM TTFT stage runs in
evals/autotune_vllm.py (engines take minutes); here ``measure_vllm=False``."""
import json

import numpy as np
import pytest

from ucm import replay as rp
from ucm.autotune import AutoTuner, TuneError, model_shape, requests_to_trace
from ucm.cli import main
from tiny_llama import write_llama

SMOLLM2 = {"num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
           "hidden_size": 576}


@pytest.fixture
def model(tmp_path):
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(SMOLLM2))
    return str(d)


def workload(n=40, seed=0):
    """Three shared system prompts with short turns, and one-off documents between them."""
    rng = np.random.default_rng(seed)
    apps = [rng.integers(0, 30000, 320).tolist() for _ in range(3)]
    out = []
    for i in range(n):
        if i % 3 == 2:
            out.append(rng.integers(0, 30000, 512).tolist())
        else:
            out.append(apps[int(rng.integers(3))] + rng.integers(0, 30000, 64).tolist())
    return out


def test_model_shape_and_bad_models(model, tmp_path):
    s = model_shape(model)
    assert s.kv_bytes_per_token == 2 * 30 * 3 * 64 * 2
    with pytest.raises(TuneError, match="config.json"):
        model_shape(str(tmp_path / "nowhere"))
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "config.json").write_text(json.dumps({"hidden_size": 8}))
    with pytest.raises(TuneError, match="attention shape"):
        model_shape(str(tmp_path / "bad"))
    with pytest.raises(TuneError, match="dtype"):
        model_shape(model, "int3")


@pytest.mark.parametrize("kw,match", [
    (dict(workload="chatty"), "workload 'chatty'"),
    (dict(constraints={"max_gpu": 1}), "constraint 'max_gpu'"),
    (dict(constraints={"max_memory_gb": -1}), "max_memory_gb=-1"),
    (dict(constraints={"max_memory_gb": "8"}), "max_memory_gb='8'"),
    (dict(constraints={"max_memory_gb": 0, "max_disk_gb": 0}), "contradict"),
    (dict(constraints={"max_latency_ms": 0}), "cannot be met"),
])
def test_constraints_are_checked_by_name(kw, match):
    with pytest.raises(TuneError, match=match):
        AutoTuner(**kw)


def test_memory_below_one_block_without_disk_and_empty_samples(model):
    t = AutoTuner("chat", {"max_memory_gb": 1e-6, "max_disk_gb": 0}, measure_vllm=False,
                  progress=False)
    with pytest.raises(TuneError, match="less than one KV block"):
        t.tune(model, workload())
    with pytest.raises(TuneError, match="sample_requests"):
        AutoTuner(measure_vllm=False).tune(model, [])
    with pytest.raises(TuneError, match="full block"):
        AutoTuner(measure_vllm=False, progress=False).tune(model, [[1, 2, 3]])


def test_tune_picks_the_measured_best_policy_within_the_memory_budget(model, tmp_path):
    reqs = workload()
    block_bytes = model_shape(model).kv_bytes_per_token * 32
    distinct = requests_to_trace(reqs, 32).distinct_blocks
    gb = distinct // 4 * block_bytes / 2**30
    t = AutoTuner("chat", {"max_memory_gb": gb, "max_disk_gb": 0}, measure_vllm=False,
                  progress=False, tune_block_size=False)
    cfg = t.tune(model, reqs)
    assert cfg["store.pipeline"] == "memory"
    assert cfg["buffer_number"] * block_bytes <= gb * 2**30
    rows = t.stages[0].rows
    assert {r["policy"] for r in rows} == set(rp.POLICIES)
    best = max(r["token_hit_rate"] for r in rows)
    chosen = [r for r in rows if r["policy"] == cfg["store.memory.policy"]][0]
    assert chosen["token_hit_rate"] == best
    # the choice is what replaying the real store says: a scan of one-off documents between
    # shared system prompts is where LRU loses
    trace = requests_to_trace(reqs, 32)
    lru = rp.replay(trace, cfg["buffer_number"], "lru").token_hit_rate
    assert best > lru
    # a memory-only store is refused by the connector unless the worker runs in the engine
    # core's process: the tuner says how to run it (on vLLM-CPU uni needs multiprocessing off)
    assert t.engine_args["distributed_executor_backend"] == "uni"
    md, png = t.write_report(str(tmp_path / "rep"))
    text = open(md).read()
    assert "capacity and policy" in text
    assert "VLLM_ENABLE_V1_MULTIPROCESSING=0" in text and "'uni'" in text
    assert (tmp_path / "rep" / "report.png").stat().st_size > 5000


def test_with_a_disk_tier_the_io_stage_measures_threads(model):
    t = AutoTuner("chat", {"max_memory_gb": 0.01, "max_disk_gb": 1}, measure_vllm=False,
                  progress=False)
    cfg = t.tune(model, workload(20))
    assert cfg["store.pipeline"] == "memory|posix" and cfg["cache_capacity"] == 2**30
    assert "distributed_executor_backend" not in t.engine_args   # the posix tier is shared
    io = [s for s in t.stages if s.name == "io threads"][0]
    assert [r["io_threads"] for r in io.rows] == [1, 2, 4, 8]
    assert cfg["store.io_threads"] == min(io.rows, key=lambda r: r["seconds"])["io_threads"]
    assert {r["admission"] for r in t.stages[0].rows} == {"all", "second_hit"}


def test_cli_tune(model, tmp_path, capsys):
    path = tmp_path / "reqs.jsonl"
    path.write_text("\n".join(json.dumps({"prompt_token_ids": p}) for p in workload(20)) + "\n")
    rep = tmp_path / "rep"
    assert main(["tune", "--requests", str(path), "--model", model, "--max-memory-gb", "0.01",
                 "--max-disk-gb", "0", "--no-vllm", "--quiet", "--report", str(rep)]) == 0
    assert "store.memory.policy" in capsys.readouterr().out
    assert (rep / "report.md").exists()
    bad = tmp_path / "bad.jsonl"
    bad.write_text('[1, 2]\n{"prompt_token_ids": "x"}\n')
    assert main(["tune", "--requests", str(bad), "--model", model, "--no-vllm", "--quiet"]) == 2
    assert "line 2" in capsys.readouterr().err
    assert main(["tune", "--requests", str(path), "--model", model, "--max-memory-gb", "0",
                 "--max-disk-gb", "0", "--no-vllm", "--quiet"]) == 2
    assert "contradict" in capsys.readouterr().err


def test_memory_below_one_block_with_a_disk_tier_means_the_disk_alone(model):
    t = AutoTuner("chat", {"max_memory_gb": 1e-6}, measure_vllm=False, progress=False)
    cfg = t.tune(model, workload(10))
    assert cfg["store.pipeline"] == "posix"
    assert [s.name for s in t.stages] == ["io threads", "block size"]


# ---------------------------------------------------------------------------------------------
# block size and sparse decode: measured on a small random Llama written as a real checkpoint

def long_requests(n=3, tokens=560, vocab=97, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, tokens).tolist() for _ in range(n)]


def test_block_size_stage_keeps_the_memory_budget_and_saves_the_most(model):
    reqs = workload()        # shared 320-token prompts: 128-token blocks lose their last 64
    gb = 0.02
    t = AutoTuner("chat", {"max_memory_gb": gb, "max_disk_gb": 0}, measure_vllm=False,
                  progress=False)
    cfg = t.tune(model, reqs)
    st = [s for s in t.stages if s.name == "block size"][0]
    from ucm.autotune import engine_block_sizes

    assert [r["block_size"] for r in st.rows] == list(engine_block_sizes())
    assert engine_block_sizes("cpu") == (32, 64, 128) and 16 in engine_block_sizes("cuda")
    by = {r["block_size"]: r for r in st.rows}
    assert by[128]["token_hit_rate"] < by[64]["token_hit_rate"]
    best = max(st.rows, key=lambda r: r["prefill_saved_s"])
    assert t.engine_args["block_size"] == best["block_size"]
    kv = model_shape(model).kv_bytes_per_token
    assert cfg["buffer_number"] * kv * t.engine_args["block_size"] <= gb * 2**30
    assert st.choice["prefill_cost"].startswith("default")   # config.json alone: no weights
    assert "engine settings" in t.report_markdown()


def test_sparse_stage_picks_the_sparsest_ratio_within_the_bound(tmp_path):
    from ucm.autotune import SPARSE_METHODS, SPARSE_RATIOS

    model = write_llama(tmp_path / "llama", scale=3.0)
    reqs = long_requests()
    runs = {}
    for bound in (1e-9, 1e6):
        t = AutoTuner("chat", {"max_ppl_increase": bound, "max_disk_gb": 0},
                      measure_vllm=False, progress=False, tune_block_size=False, sparse_tokens=8)
        cfg = t.tune(model, reqs)
        st = [s for s in t.stages if s.name == "sparse decode"][0]
        assert {(r["method"], r["ratio"]) for r in st.rows} == \
            {(m, r) for m in SPARSE_METHODS for r in SPARSE_RATIOS}
        ran = [r for r in st.rows if not r["note"]]
        assert all(r["steps"] == 8 * len(reqs) for r in ran)
        # head_dim 8 rules out kvstar's 16 channels: reported, not run
        assert {r["method"] for r in st.rows if r["note"]} == {"kvstar"}
        assert all("kvstar_channels" in r["note"] for r in st.rows if r["note"])
        runs[bound] = (cfg, st)
    # measured, not assumed: sparse decode changes this model's predictions
    rows = runs[1e6][1].rows
    assert any(abs(r["ppl_change_pct"]) > 1e-3 for r in rows)
    cfg, st = runs[1e6]                       # everything allowed: the sparsest ratio
    assert cfg["sparse_ratio"] == min(SPARSE_RATIOS) and cfg["sparse_method"] in SPARSE_METHODS
    at = [r for r in st.rows if r["ratio"] == min(SPARSE_RATIOS) and not r["note"]]
    assert st.choice["sparse_method"] == min(at, key=lambda r: r["ppl_change_pct"])["method"]
    cfg, st = runs[1e-9]                      # nothing within the bound (unless a change < 0)
    within = [r for r in st.rows if r["ppl_change_pct"] <= 1e-9]
    if within:
        assert cfg["sparse_ratio"] == min(r["ratio"] for r in within)
    else:
        assert cfg["sparse_method"] == "none" and "within" in st.choice["why"]


def test_sparse_stage_bad_models_and_short_requests(model, tmp_path):
    short = AutoTuner("chat", {"max_ppl_increase": 1, "max_disk_gb": 0}, measure_vllm=False,
                      progress=False, tune_block_size=False)
    cfg = short.tune(model, workload(6))      # no request reaches min_blocks: stays dense
    assert cfg["sparse_method"] == "none"
    assert "min_blocks" in [s for s in short.stages if s.name == "sparse decode"][0].choice["why"]
    t = AutoTuner("chat", {"max_ppl_increase": 1, "max_disk_gb": 0}, measure_vllm=False,
                  progress=False, tune_block_size=False)
    with pytest.raises(TuneError, match="model.safetensors"):
        t.tune(model, long_requests())        # config.json alone: no weights to run
    llama = write_llama(tmp_path / "llama", scale=3.0)
    with pytest.raises(TuneError, match="vocabulary"):
        t.tune(llama, long_requests(vocab=500))
    with pytest.raises(TuneError, match="max_ppl_increase=0"):
        AutoTuner(constraints={"max_ppl_increase": 0})


def test_a_memory_budget_beyond_the_machine_is_held_to_it_and_reported(model):
    """max_memory_gb is a ceiling: one larger than this machine's available memory must not
    become a pool no engine can allocate; the tuner holds the memory tier to MEMORY_SHARE of
    what is there and says so in the report."""
    from ucm.autotune import MEMORY_SHARE, machine_memory_bytes

    have = machine_memory_bytes()
    assert have and have > 0
    reqs = workload(12)
    t = AutoTuner("chat", {"max_memory_gb": 1e6, "max_disk_gb": 0}, measure_vllm=False,
                  progress=False, tune_block_size=False)
    cfg = t.tune(model, reqs)
    block_bytes = model_shape(model).kv_bytes_per_token * 32
    assert 0 < cfg["buffer_number"] * block_bytes <= MEMORY_SHARE * have
    held = [n for n in t.notes if "max_memory_gb" in n]
    assert len(held) == 1 and "max_memory_gb=1000000.0" in held[0]
    assert held[0] in t.report_markdown()
    small = AutoTuner("chat", {"max_memory_gb": 0.001, "max_disk_gb": 0}, measure_vllm=False,
                      progress=False, tune_block_size=False)
    assert small._capacity(block_bytes) == int(0.001 * 2**30) // block_bytes and not small.notes
