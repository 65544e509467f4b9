#!/usr/bin/env bash
# Issue 19 on one H200 (one device call, about 6 minutes): ddtree-bench rounds of the random Kimi-K2-shaped
# target of scripts/h200_kimi.sh (4 of 61 layers: 1 dense + 3 MoE, real width) with its weights in the
# published quantized forms, against the same shape in bf16 (results/h200/kimi): INT4 routed experts
# (group 32, as Kimi-K2.5/K2.6: ~36 GB of weights where bf16 takes ~110 GB) and FP8 128x128 blocks on
# every projection (as Kimi-K2 / DeepSeek-V3: ~60 GB). Rows: ar and ddtree 15 / 63 at batch 1 and 16
# (INT4), ar and ddtree 15 at batch 1 (FP8), 1k context, Pallas attention. Each JSON holds the quantized
# weight bytes, the floor counted at 4 or 8 bits plus scales, and device memory (meta and per row).
# Each step is cut at $DEADLINE seconds (default 420); ddtree-bench writes its JSON after every row.
set -u
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.95}
OUT=${OUT:-results/h200/quant}
DEADLINE=${DEADLINE:-420}
mkdir -p "$OUT"
source "$(dirname "$0")/h200_lib.sh"
B="python3 -m ddtree_jax.bench rounds --shape kimi-k2 --attention pallas --draft-layers 6 --block-size 8 --rounds 4"

nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
step int4 60 $DEADLINE $B --quantize int4-experts --methods ar,ddtree --budgets 15,63 --batches 1,16 --contexts 1024 \
  --out "$OUT/int4.json"
step fp8 60 $DEADLINE $B --quantize fp8 --methods ar,ddtree --budgets 15 --batches 1 --contexts 1024 --out "$OUT/fp8.json"
date -u
