#!/bin/bash
# One device call: the CUDA cases of the GPU-capable test files (one pytest process each), then
# the codec and Blend benchmarks and the attention_begin read-back probe.
export PYTHONPATH=. PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader
for f in tests/test_compress_triton.py tests/test_blend_ops.py tests/test_bad_input_codecs_blend.py \
         tests/test_bad_input_sparse.py tests/test_sparse_ops.py tests/test_sparse_methods.py \
         tests/test_blend.py tests/test_equiv_compress.py tests/test_equiv_sparse.py \
         tests/test_transfer.py tests/test_store_cuda.py tests/test_dispatch.py; do
  s=$(date +%s)
  timeout 150 python3 -m pytest -q -p no:cacheprovider "$f" > /tmp/t.log 2>&1
  echo "$f rc=$? $(( $(date +%s) - s ))s: $(tail -1 /tmp/t.log)"
  { echo "=== $f"; cat /tmp/t.log; } >> $OUT/tests.log
done
