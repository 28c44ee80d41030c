#!/usr/bin/env bash
# A virtualenv with SGLang 0.5.23's storage interface, for ucm's HiCache backend tests
# (tests/sglang_backend). SGLang cannot serve on this CPU (its CPU kernels need AMX and an unpublished
# sgl-kernel build), but its host pools and storage classes run: torch 2.14.1 (the CUDA build;
# the CPU-only wheel breaks torchvision's imports) and SGLang without its dependency set, plus
# the modules its mem_cache imports (scripts/sglang-requirements.txt). About 6 GB.
#
#   bash scripts/install_sglang.sh [VENV] [PYTHON]      (default .venv-sglang, python3)
set -euo pipefail
VENV=${1:-.venv-sglang}
PYTHON=${2:-python3}
HERE=$(cd "$(dirname "$0")" && pwd)
STAMP=$VENV/.ucm-sglang-installed
if [ -f "$STAMP" ] && cmp -s "$HERE/sglang-requirements.txt" "$STAMP"; then
    exit 0
fi
rm -rf "$VENV"
"$PYTHON" -m venv "$VENV"
"$VENV/bin/pip" install -q --disable-pip-version-check --no-compile torch==2.14.1
"$VENV/bin/pip" install -q --disable-pip-version-check --no-compile --no-deps -r "$HERE/sglang-requirements.txt"
"$VENV/bin/python" -c "import sglang.srt.mem_cache.pool_host.mha, sglang.srt.mem_cache.storage.backend_factory"
cp "$HERE/sglang-requirements.txt" "$STAMP"
