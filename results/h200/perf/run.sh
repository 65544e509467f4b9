#!/usr/bin/env bash
# Issue 22 on one H200 (~4 min): the tree build's variants alone (before: "climb", after: "paths",
# "paths-unrolled"), the batch-1 budget-63 stage breakdown with the new build against the ar step, and
# tree attention at T = 64 as the Triton kernel against the cuDNN prefix merged by log-sum-exp.
# Run from the repository root:  OUT=$OUT bash results/h200/perf/run.sh   (PY=echo: print only)
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/perf} PY=${PY:-python3}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv > "$OUT/gpu.txt" 2>&1
$PY -m ddtree_jax.bench tree --cases 1:63,16:7,16:15 --variants climb,paths,paths-unrolled --reps 100 \
  --deadline-s 30 --out "$OUT/tree.json" > "$OUT/tree.log" 2>&1
$PY -m ddtree_jax.bench rounds --shape qwen3-8b --attention pallas --rounds 16 --methods ar,ddtree --budgets 63 \
  --contexts 1024 --batch-sizes 1 --stages --deadline-s 80 --out "$OUT/stages.json" > "$OUT/stages.log" 2>&1
$PY -m ddtree_jax.bench prefix-attention --cases 16:8192,1:1024,16:32768 --deadline-s 60 --out "$OUT/prefix.json" \
  > "$OUT/attention.log" 2>&1
