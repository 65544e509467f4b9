#!/usr/bin/env bash
# Issue 22 items 4 and 5 on one H200 (~3 min): a per-kernel profile (ddtree-bench profile: a
# jax.profiler trace read with ProfileData, kernel time by category and by the engine's scopes, top 25
# kernels, busy against wall) of the Qwen3-8B shape, bf16, Pallas attention:
# 1. batch 1, 1k context: the ar step (two rows, one inactive) and the budget-63 round, each also as its
#    verify alone in the device loop (~70 s: init ~10, compiles ar verify ~8 + round ~9, ddtree draft/
#    build ~6 + verify ~10 + round ~17);
# 2. batch 16, 32k context: ar, budget 63 and budget 7, verify alone and the round (~110 s; ar first,
#    then 63, then 7: past the deadline the least asked for is left out).
# Run from the repository root:  OUT=$OUT bash results/h200/profile/run.sh   (PY=echo: print only)
set -u
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.95}
OUT=${OUT:-/tmp/profile} PY=${PY:-python3}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$OUT/gpu.txt" 2>&1
P="$PY -m ddtree_jax.bench profile --shape qwen3-8b --attention pallas --programs verify,round --rounds 4 --iters 3"
$P --batch-size 1 --context 1024 --methods ar,ddtree --budgets 63 --deadline-s 70 --out "$OUT/b1_1k.json" \
  > "$OUT/b1_1k.log" 2>&1
$P --batch-size 16 --context 32768 --methods ar,ddtree --budgets 63,7 --deadline-s 100 --out "$OUT/b16_32k.json" \
  > "$OUT/b16_32k.log" 2>&1
