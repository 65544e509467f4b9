#!/usr/bin/env bash
# Issue 32 item 5 on one H200 (run 2026-12-03: 379 s, all 25 rows; the results beside it, README.md):
# the Qwen3-8B shape, 1k context, rows 16 / 32 / 64 / 128 / 256: ar, dflash and ddtree 3 / 7 / 15 round
# times (ddtree-bench writes its JSON after every row; past the deadline the larger batches, which come
# last, are left out).
# Run from the repository root (PY=echo: print only):
#   OUT=$OUT bash results/h200/2026-12-03/batch-sweep/run.sh
set -u
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.95}
OUT=${OUT:-/tmp/batch-sweep} PY=${PY:-python3}
mkdir -p "$OUT"
$PY -m ddtree_jax.bench rounds --shape qwen3-8b --contexts 1024 --batch-sizes 16,32,64,128,256 \
  --methods ar,dflash,ddtree --budgets 3,7,15 --attention pallas --rounds 8 --deadline-s 480 \
  --out "$OUT/batch_sweep.json" > "$OUT/batch_sweep.log" 2>&1
