#!/usr/bin/env bash
# One H200 call within $DEADLINE seconds (default 480), results under $OUT (JSON per step, with argv):
# 1. issue 18, the Kimi-K2-shaped rows not run before: 2 layers (1 dense + 1 MoE of 384 experts),
#    32k context at batch 16 (ar, ddtree 15), 1k at batch 16 (dflash, ddtree 63); then 4 layers (1
#    dense + 3 MoE, ~108 GB of bf16 with the drafter: the most one H200 holds) at 1k, batch 1 and 16
#    (ar, dflash, ddtree 15 / 63);
# 2. issue 22 item 5, the Qwen3-8B shape at 32k context and batch 16: ar and ddtree 3 / 7 / 15 / 63
#    with each stage timed alone in the device loop (--stages), for where a round's time goes and
#    which budget pays at long context.
# Each step runs under `timeout` with what is left of DEADLINE; ddtree-bench writes its JSON after
# every row, so a step cut short keeps what it measured. DRY_RUN=1 prints the commands only.
set -u
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.95}
OUT=${OUT:-/tmp/rows}
DEADLINE=${DEADLINE:-480}
PY=${PY:-python3}
DRY_RUN=${DRY_RUN:-0}
mkdir -p "$OUT"
source "$(dirname "$0")/h200_lib.sh"
K="$PY -m ddtree_jax.bench rounds --shape kimi-k2 --draft-layers 6 --block-size 8 --rounds 4 --attention pallas"
[ "$DRY_RUN" = 1 ] || nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$OUT/gpu.txt" 2>&1
# shellcheck disable=SC2086  # K is a word list
step kimi2_ctx32k_b16 40 70 $K --num-layers 2 --methods ar,ddtree --budgets 15 --batches 16 \
  --contexts 32768 --out "$OUT/kimi2_ctx32k_b16.json"
# shellcheck disable=SC2086
step kimi2_ctx1k_b16 40 70 $K --num-layers 2 --methods dflash,ddtree --budgets 63 --batches 16 \
  --contexts 1024 --out "$OUT/kimi2_ctx1k_b16.json"
# shellcheck disable=SC2086
step kimi4_ctx1k 60 150 $K --num-layers 4 --methods ar,ddtree,dflash --budgets 15,63 --batches 1,16 \
  --contexts 1024 --out "$OUT/kimi4_ctx1k.json"
step qwen8b_ctx32k_b16 60 200 $PY -m ddtree_jax.bench rounds --shape qwen3-8b --attention pallas --rounds 8 \
  --methods ar,ddtree --budgets 7,15,63,3 --batches 16 --contexts 32768 --stages \
  --out "$OUT/qwen8b_ctx32k_b16.json"
date -u
