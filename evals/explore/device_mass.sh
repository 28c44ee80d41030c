#!/bin/bash
# One device call (issue 20): the Pareto speed half for ESA's default and the two `mass`
# configurations at every ratio, the `mass` scoring's launch sweep and step parts, the GPU
# sparse tests.
export PYTHONPATH=. PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader
s=$(date +%s)
timeout 300 python3 benchmarks/bench_sparse_pareto.py --only "esa stride 4, g2;mass;mass per KV head;mass per KV head, own budgets" --json $OUT/sparse_pareto_mass_gpu.json 2>&1 | grep -v Warn | tail -30
echo "pareto $(( $(date +%s) - s ))s"
s=$(date +%s)
timeout 120 python3 evals/explore/mass_sweep.py $OUT/mass_sweep_gpu.json 2>&1 | grep -v Warn | tail -6
echo "sweep $(( $(date +%s) - s ))s"
s=$(date +%s)
timeout 150 python3 -m pytest -q -x -p no:cacheprovider tests/test_equiv_sparse.py -k "token or head_mass" 2>&1 | tail -4
echo "tests $(( $(date +%s) - s ))s"
