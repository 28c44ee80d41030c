"""ucm.calibrate and ``ucm calibrate``: a key rounding fitted on the queries of a real model
(SmolLM2 through ucm's reference Llama), the same moments as transformers' own forward gives,
usable by a store of that model's shape; bad inputs are clear errors."""
import json

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
