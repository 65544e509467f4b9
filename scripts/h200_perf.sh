#!/usr/bin/env bash
# Issue 22 on one H200, one device call (~4 min): the tree build's variants alone (before: "climb",
# after: "paths", "paths-unrolled"), the batch-1 budget-63 stage breakdown with the new build
# against the ar step, and tree attention at T = 64 as the Triton kernel against the cuDNN prefix
# merged by log-sum-exp. Each step is cut at the time left before $DEADLINE (seconds, default 230)
# and at its own cap; JSON and logs land in $OUT (default /tmp/perf).
#   OUT=$OUT DEADLINE=230 bash scripts/h200_perf.sh
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/perf}
DEADLINE=${DEADLINE:-230}
mkdir -p "$OUT"
source "$(dirname "$0")/h200_lib.sh"
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv > "$OUT/gpu.txt" 2>&1
step tree 15 40 python3 scripts/bench_tree.py --cases 1:63,16:7,16:15 --variants climb,paths,paths-unrolled \
  --reps 100 --out "$OUT/tree.json"
step stages 15 110 python3 -m ddtree_jax.bench rounds --shape qwen3-8b --attention pallas --rounds 16 --methods ar,ddtree \
  --budgets 63 --contexts 1024 --batches 1 --stages --out "$OUT/stages.json"
step attention 15 90 python3 scripts/bench_prefix_attention.py --shapes 16:8192,1:1024,16:32768 --out "$OUT/prefix.json"
date -u
