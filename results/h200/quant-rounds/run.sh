#!/usr/bin/env bash
# Issue 19 on one H200 (~6 min): ddtree-bench rounds of the random Kimi-K2-shaped target of
# results/h200/kimi/run.sh (4 of 61 layers: 1 dense + 3 MoE, real width) with its weights in the
# published quantized forms, against the same shape in bf16 (results/h200/kimi): INT4 routed experts
# (group 32, as Kimi-K2.5/K2.6: ~36 GB of weights where bf16 takes ~110 GB) and FP8 128x128 blocks on
# every projection (as Kimi-K2 / DeepSeek-V3: ~60 GB). Rows: ar and ddtree 15 / 63 at batch 1 and 16
# (INT4), ar and ddtree 15 at batch 1 (FP8), 1k context, Pallas attention. Each JSON holds the quantized
# weight bytes, the floor counted at 4 or 8 bits plus scales, and device memory (meta and per row).
# Run from the repository root:  OUT=$OUT bash results/h200/quant-rounds/run.sh   (PY=echo: print only)
set -u
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.95}
OUT=${OUT:-/tmp/quant-rounds} PY=${PY:-python3}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader > "$OUT/gpu.txt" 2>&1
B="$PY -m ddtree_jax.bench rounds --shape kimi-k2 --num-layers 4 --attention pallas --draft-layers 6 --block-size 8 --rounds 4"
$B --quantize int4-experts --methods ar,ddtree --budgets 15,63 --batch-sizes 1,16 --contexts 1024 --deadline-s 240 \
  --out "$OUT/int4.json" > "$OUT/int4.log" 2>&1
$B --quantize fp8 --methods ar,ddtree --budgets 15 --batch-sizes 1 --contexts 1024 --deadline-s 90 \
  --out "$OUT/fp8.json" > "$OUT/fp8.log" 2>&1
