#!/bin/bash
# One device call: the CUDA cases of the GPU-capable test files (one pytest process each), the
# attention_begin read-back probe, then the codec and Blend benchmarks.
export PYTHONPATH=. PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader
for f in tests/test_compress_triton.py tests/test_bad_input_codecs_blend.py tests/test_blend_ops.py \
         tests/test_bad_input_sparse.py tests/test_sparse_ops.py tests/test_sparse_methods.py \
         tests/test_equiv_compress.py tests/test_blend.py; do
  s=$(date +%s)
  timeout 120 python3 -m pytest -q -p no:cacheprovider -x "$f" > /tmp/t.log 2>&1
  echo "$f rc=$? $(( $(date +%s) - s ))s: $(tail -1 /tmp/t.log)"
  { echo "=== $f"; cat /tmp/t.log; } >> $OUT/tests.log
done
timeout 60 python3 evals/explore/attn_begin_overhead.py $OUT/attn_begin_overhead_h200.json 2>&1 | tail -12
s=$(date +%s)
timeout 150 python3 benchmarks/bench_compress_gpu.py --no-sweep --json $OUT/bench_compress_h200.json > $OUT/bench_compress.log 2>&1
echo "bench_compress rc=$? $(( $(date +%s) - s ))s"; tail -40 $OUT/bench_compress.log
timeout 60 python3 benchmarks/bench_blend_ops.py cuda --json $OUT/bench_blend_h200.json 2>&1 | tail -12
