"""ucm.calibrate and ``ucm calibrate``: a key rounding fitted on the queries of a real model
(SmolLM2 through ucm's reference Llama), the same moments as transformers' own forward gives,
usable by a store of that model's shape; bad inputs are clear errors."""
import json
import os

import numpy as np
import pytest

from ucm.calibrate import fit_key_rounding_on, query_moments_on
from ucm.cli import main
from ucm.codecs import KeyRounding, KVShape, query_moments
from ucm.models import ensure_smollm2


@pytest.fixture(scope="module")
def smollm2():
    return ensure_smollm2()


def _ids(n, seed):
    return [int(t) for t in np.random.default_rng(seed).integers(0, 49152, n)]


def test_moments_match_transformers_queries(smollm2):
    """The queries after the rotary embedding, as transformers' Llama computes them (its
    apply_rotary_pos_emb wrapped), give the same per-layer moments."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from transformers.models.llama import modeling_llama

    seq = _ids(96, 0)
    got = query_moments_on(smollm2, [seq])
    model = transformers.AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32)
    want, rope = [], modeling_llama.apply_rotary_pos_emb

    def wrapped(q, k, *a, **kw):
        qo, ko = rope(q, k, *a, **kw)
        want.append(query_moments(qo[0].transpose(0, 1).numpy(), model.config.num_key_value_heads))
        return qo, ko
    modeling_llama.apply_rotary_pos_emb = wrapped
    try:
        with torch.no_grad():
            model(torch.tensor([seq]))
    finally:
        modeling_llama.apply_rotary_pos_emb = rope
    assert len(got) == len(want) == model.config.num_hidden_layers
    for a, b in zip(got, want):
        assert np.allclose(a, b, rtol=1e-5, atol=1e-6 * np.abs(b).max())


def test_cli_writes_a_rounding_for_the_model(smollm2, tmp_path, capsys):
    req = tmp_path / "req.jsonl"
    req.write_text(json.dumps(_ids(80, 1)) + "\n\n" + json.dumps({"prompt_token_ids": _ids(40, 2)})
                   + "\n")
    out = tmp_path / "kr.npz"
    assert main(["calibrate", "--requests", str(req), "--out", str(out), "--quiet"]) == 0
    r = KeyRounding.load(str(out))
    assert r.order.shape == (30, 3, 64)
    r.check(KVShape("hktd", 128, 3, 64, "float32", key_order="dt"), 29)
    assert r.digest in capsys.readouterr().out
    # the same as the API on the same tokens (weighted by token: 80 + 40)
    assert fit_key_rounding_on(smollm2, [_ids(80, 1), _ids(40, 2)]).digest == r.digest


@pytest.mark.parametrize("lines,match", [
    (["[]"], "no tokens"),
    (["[1, 2, 99999999]"], "sequence 0: token 99999999 is not an id"),
    (["[1, 2", "[3]"], "--requests line 1"),
    (["[" * 100000], "--requests line 1"),        # (was a RecursionError traceback)
])
def test_cli_bad_requests_are_clear_errors(smollm2, tmp_path, capsys, lines, match):
    req = tmp_path / "req.jsonl"
    req.write_text("\n".join(lines) + "\n")
    assert main(["calibrate", "--requests", str(req), "--out", str(tmp_path / "o.npz"),
                 "--quiet"]) == 2
    assert match in capsys.readouterr().err
    assert not (tmp_path / "o.npz").exists()


def test_cli_bad_options_are_clear_errors(smollm2, tmp_path, capsys):
    req = tmp_path / "req.jsonl"
    req.write_text("[1, 2, 3]\n")
    for extra, match in [(["--max-tokens", "0"], "max_tokens must be an int >= 1"),
                         (["--damp", "0"], "damp in (0, 10]"),
                         (["--out", str(tmp_path / "no" / "o.npz")], "--out")]:
        args = ["calibrate", "--requests", str(req), "--out", str(tmp_path / "o.npz"), "--quiet"]
        assert main(args + extra) == 2
        assert match in capsys.readouterr().err


def test_cli_model_that_is_not_a_llama_folder(tmp_path, capsys):
    req = tmp_path / "req.jsonl"
    req.write_text("[1, 2, 3]\n")
    assert main(["calibrate", "--requests", str(req), "--out", str(tmp_path / "o.npz"),
                 "--model", str(tmp_path)]) == 2
    assert "no config.json" in capsys.readouterr().err
    (tmp_path / "config.json").write_text("{}")
    assert main(["calibrate", "--requests", str(req), "--out", str(tmp_path / "o.npz"),
                 "--model", str(tmp_path)]) == 2
    assert "not a Llama-architecture checkpoint" in capsys.readouterr().err


def test_cli_checks_out_and_damp_before_running_the_model(tmp_path, capsys):
    """--out a directory (or below a file) and --damp nan were found only after the model had
    run over every request, and a directory --out left '<out>.tmp<pid>' beside it: they are
    checked first (the model folder here does not even exist)."""
    req = tmp_path / "req.jsonl"
    req.write_text("[1, 2, 3]\n")
    (tmp_path / "d").mkdir()
    for extra, match in [(["--out", str(tmp_path / "d")], "--out"),
                         (["--out", str(req / "o.npz")], "--out"),
                         (["--out", str(tmp_path / "o.npz"), "--damp", "nan"], "damp in (0, 10]"),
                         (["--out", str(tmp_path / "o.npz"), "--max-tokens", "0"], "max_tokens")]:
        assert main(["calibrate", "--requests", str(req), "--model", str(tmp_path / "none"),
                     "--quiet"] + extra) == 2
        err = capsys.readouterr().err
        assert match in err and "model" not in err, err
    assert sorted(os.listdir(tmp_path)) == ["d", "req.jsonl"]


def _tiny(folder, weights=None, **changes):
    """A tiny Llama folder (tests/tiny_llama.py: 2 layers, vocabulary 97) with its config.json
    changed by ``changes`` and, given ``weights``, those bytes as its model.safetensors."""
    from tiny_llama import write_llama

    path = write_llama(folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(changes)
    (folder / "config.json").write_text(json.dumps(cfg))
    if weights is not None:
        (folder / "model.safetensors").write_bytes(weights(folder / "model.safetensors"))
    return path


@pytest.mark.parametrize("changes,match", [
    ({"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"]}, "model_type 'qwen2'"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "rope_type 'llama3'"),
    ({"rope_parameters": {"type": "yarn", "rope_theta": 1e4}}, "rope_type 'yarn'"),
    ({"attention_bias": True}, "attention_bias"),
    ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
])
def test_model_the_reference_would_run_differently_is_refused(tmp_path, changes, match):
    """ucm's reference Llama applies the default rotary embedding, no biases, SiLU: a Qwen2
    folder, Llama 3.1's 'llama3' rope scaling, attention biases or another activation were
    run without a word, and the rounding fitted on queries the model never makes."""
    model = _tiny(tmp_path / "m", **changes)
    with pytest.raises(ValueError, match=f"model '{model}': .*{match}"):
        query_moments_on(model, [[1, 2, 3]])


@pytest.mark.parametrize("case", ["config not json", "config a list", "layers a string",
                                  "weights garbage", "weights truncated", "kv heads unlike weights",
                                  "vocab larger than the embedding"])
def test_broken_model_folders_are_clear_errors(tmp_path, case):
    """Each raised from inside json, torch or the reference (JSONDecodeError without the
    folder's name, TypeError, MemoryError, torch's buffer-length ValueError, RuntimeError
    'split_with_sizes', IndexError on a token the config's vocab_size allowed)."""
    m = tmp_path / "m"
    model = {"config not json": lambda: _tiny(m),
             "config a list": lambda: _tiny(m),
             "layers a string": lambda: _tiny(m, num_hidden_layers="2"),
             "weights garbage": lambda: _tiny(m, weights=lambda p: bytes(range(256)) * 4),
             "weights truncated": lambda: _tiny(m, weights=lambda p: p.read_bytes()[:20000]),
             "kv heads unlike weights": lambda: _tiny(m, num_key_value_heads=1),
             "vocab larger than the embedding": lambda: _tiny(m, vocab_size=1000)}[case]()
    if case == "config not json":
        (m / "config.json").write_text("{not json")
    if case == "config a list":
        (m / "config.json").write_text("[]")
    with pytest.raises(ValueError, match=f"model '{model}': "):
        query_moments_on(model, [[1, 2, 500]])


def test_api_bad_arguments_are_clear_errors(tmp_path):
    """sequences None or a flat list of ids: TypeError ('int' object is not iterable); device
    'bogus': torch's RuntimeError; damp '0.1': TypeError after the whole model run; max_tokens
    a numpy int was refused as 'must be an int'."""
    model = _tiny(tmp_path / "m")
    with pytest.raises(ValueError, match="sequences: token-id sequences"):
        query_moments_on(model, None)
    with pytest.raises(ValueError, match="sequence 0: token-id sequences"):
        query_moments_on(model, [1, 2, 3])
    with pytest.raises(ValueError, match="device 'bogus'"):
        query_moments_on(model, [[1, 2, 3]], device="bogus")
    with pytest.raises(ValueError, match=r"damp in \(0, 10\]"):
        fit_key_rounding_on(str(tmp_path / "none"), [[1, 2, 3]], damp="0.1")
    assert len(query_moments_on(model, [[1, 2, 3, 4, 5]], max_tokens=np.int64(2))) == 2


def test_cli_requests_that_are_not_a_regular_file(tmp_path, capsys):
    """--requests naming a FIFO blocked until a writer came; /dev/zero (one endless line)
    grew memory without limit. Both are refused before anything is read."""
    from fifo import returns_within

    fifo = str(tmp_path / "req.fifo")
    os.mkfifo(fifo)
    args = ["calibrate", "--requests", fifo, "--out", str(tmp_path / "o.npz"), "--quiet"]
    ok, box = returns_within(lambda: main(args), fifo)
    assert ok, "reading --requests from a FIFO blocked"
    assert box.get("value") == 2
    assert "not a regular file" in capsys.readouterr().err
    args[2] = "/dev/zero"
    assert main(args) == 2
    assert "not a regular file" in capsys.readouterr().err
