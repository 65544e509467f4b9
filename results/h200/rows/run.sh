#!/usr/bin/env bash
# One H200 call (~8 min), results under $OUT (JSON per command, with its run header):
# 1. issue 18, the Kimi-K2-shaped rows not run before: 2 layers (1 dense + 1 MoE of 384 experts), 32k
#    context at batch 16 (ar, ddtree 15), 1k at batch 16 (dflash, ddtree 63); then 4 layers (1 dense +
#    3 MoE, ~108 GB of bf16 with the drafter: the most one H200 holds) at 1k, batch 1 and 16 (ar,
#    dflash, ddtree 15 / 63);
# 2. issue 22 item 5, the Qwen3-8B shape at 32k context and batch 16: ar and ddtree 3 / 7 / 15 / 63
#    with each stage timed alone in the device loop (--stages), for where a round's time goes and
#    which budget pays at long context.
# Run from the repository root:  OUT=$OUT bash results/h200/rows/run.sh   (PY=echo: print only)
set -u
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.95}
OUT=${OUT:-/tmp/rows} PY=${PY:-python3}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$OUT/gpu.txt" 2>&1
K="$PY -m ddtree_jax.bench rounds --shape kimi-k2 --draft-layers 6 --block-size 8 --rounds 4 --attention pallas"
$K --num-layers 2 --methods ar,ddtree --budgets 15 --batch-sizes 16 --contexts 32768 --deadline-s 45 \
  --out "$OUT/kimi2_ctx32k_b16.json" > "$OUT/kimi2_ctx32k_b16.log" 2>&1
$K --num-layers 2 --methods dflash,ddtree --budgets 63 --batch-sizes 16 --contexts 1024 --deadline-s 45 \
  --out "$OUT/kimi2_ctx1k_b16.json" > "$OUT/kimi2_ctx1k_b16.log" 2>&1
$K --num-layers 4 --methods ar,ddtree,dflash --budgets 15,63 --batch-sizes 1,16 --contexts 1024 --deadline-s 120 \
  --out "$OUT/kimi4_ctx1k.json" > "$OUT/kimi4_ctx1k.log" 2>&1
$PY -m ddtree_jax.bench rounds --shape qwen3-8b --attention pallas --rounds 8 --methods ar,ddtree \
  --budgets 7,15,63,3 --batch-sizes 16 --contexts 32768 --stages --deadline-s 160 \
  --out "$OUT/qwen8b_ctx32k_b16.json" > "$OUT/qwen8b_ctx32k_b16.log" 2>&1
