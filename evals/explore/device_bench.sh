#!/bin/bash
# One device call: the int4 per-token ranking's cost (evals/explore/tok4_bench.py), then every
# codec and the round trip on the current formats (bench_compress_gpu.py).
export PYTHONPATH=. PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader
s=$(date +%s)
timeout 240 python3 evals/explore/tok4_bench.py --json $OUT/tok4_h200.json 2>&1 | grep -v Warning | tail -30
echo "tok4 $(( $(date +%s) - s ))s"
s=$(date +%s)
timeout 200 python3 benchmarks/bench_compress_gpu.py --no-sweep --json $OUT/bench_compress_h200.json 2>&1 | tail -30
echo "compress $(( $(date +%s) - s ))s"
timeout 100 python3 benchmarks/bench_compress_gpu.py --no-sweep --skip-round-trip --tokens 128 --codecs int8_token int8_channel --json $OUT/bench_compress_int8_t128_h200.json 2>&1 | tail -8
