#!/bin/bash
# One device call: the whole of tests/test_compress_triton.py (the last runs reached ~70% in
# 120 s), the attention_begin read-back probe, then the Triton-interpreter cases in their own
# process (make test-gpu's second step).
export PYTHONPATH=. PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader
s=$(date +%s)
timeout 330 python3 -m pytest -q -p no:cacheprovider tests/test_compress_triton.py > $OUT/compress_triton.log 2>&1
echo "test_compress_triton rc=$? $(( $(date +%s) - s ))s: $(tail -1 $OUT/compress_triton.log)"
timeout 60 python3 evals/explore/attn_begin_overhead.py $OUT/attn_begin_overhead_h200.json 2>&1 | tail -8
s=$(date +%s)
UCM_TEST_TRITON_INTERPRETER=1 timeout 170 python3 -m pytest -q -p no:cacheprovider -m triton_interpreter tests > $OUT/interpreter.log 2>&1
echo "interpreter rc=$? $(( $(date +%s) - s ))s: $(tail -1 $OUT/interpreter.log)"
grep -E "FAILED|ERROR" $OUT/interpreter.log $OUT/compress_triton.log | head -20
