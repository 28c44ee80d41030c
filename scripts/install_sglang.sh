#!/usr/bin/env bash
# SGLang 0.5.23's storage interface (HiCacheStorage, its host pools and backend factory) for
# ucm's HiCache backend tests (tests/sglang_backend) and benchmark: SGLang without its dependency
# set, plus the modules its mem_cache imports (scripts/sglang-requirements.txt), installed into
# a folder of their own (pip --target, about 340 MB) that runs on ucm's virtualenv and its CPU
# torch:
#
#   bash scripts/install_sglang.sh [SITE] [PYTHON]      (default .sglang-site, .venv/bin/python)
#   PYTHONPATH=.:.sglang-site .venv/bin/python -m pytest tests/sglang_backend
#
# SGLang cannot serve on this CPU (its CPU kernels need AMX and an unpublished sgl-kernel build),
# but its pools and storage classes run. torchvision, which SGLang's config package imports, has
# a named stand-in in the tests (tests/sglang_backend/torchvision_standin.py says why).
set -euo pipefail
SITE=${1:-.sglang-site}
PYTHON=${2:-.venv/bin/python}
HERE=$(cd "$(dirname "$0")" && pwd)
STAMP=$SITE/.ucm-sglang-installed
if [ -f "$STAMP" ] && cmp -s "$HERE/sglang-requirements.txt" "$STAMP"; then
    exit 0
fi
rm -rf "$SITE"
"$PYTHON" -m pip install -q --disable-pip-version-check --no-compile --no-deps \
    --target "$SITE" -r "$HERE/sglang-requirements.txt"
PYTHONPATH="$SITE" "$PYTHON" -c "import sglang, sglang.srt.mem_cache.hicache_storage"
cp "$HERE/sglang-requirements.txt" "$STAMP"
