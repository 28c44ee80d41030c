#!/bin/bash
# One device call (issue 20): the Pareto speed half for ESA's default and the two `mass`
# configurations at every ratio, then the `mass` scoring's launch sweep and step parts.
export PYTHONPATH=. PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader
s=$(date +%s)
timeout 200 python3 benchmarks/bench_sparse_pareto.py --only "esa stride 4, g2;mass;mass per KV head" --json $OUT/sparse_pareto_mass_h200.json 2>&1 | grep -v Warn | tail -30
echo "pareto $(( $(date +%s) - s ))s"
s=$(date +%s)
timeout 100 python3 evals/explore/mass_sweep.py $OUT/mass_sweep_h200.json 2>&1 | grep -v Warn | tail -6
echo "sweep $(( $(date +%s) - s ))s"
