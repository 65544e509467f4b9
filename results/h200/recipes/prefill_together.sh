#!/usr/bin/env bash
# Continuous batching (the device job, prompts prefilled together) against static batches at the Qwen3-8B
# shape, random bf16 weights (issue 46's workload): ar at batch 16, 64 prompts of 16-512 tokens x 64 new.
#   bash results/h200/recipes/prefill_together.sh   (writes $OUT/8b-ar-b16.json)
set -u
OUT=${OUT:-/tmp/prefill-together}; mkdir -p "$OUT"
python3 -m ddtree_jax.bench scheduling --shape qwen3-8b --dtype bfloat16 --attention pallas --prompts 64 \
  --min-len 16 --max-len 512 --max-new-tokens 64 --stop-fraction 0 --batch-size 16 --method ar \
  --repeats 2 --deadline-s 150 --out "$OUT/8b-ar-b16.json" > "$OUT/8b-ar-b16.txt" 2>&1
