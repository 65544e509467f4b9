#!/usr/bin/env bash
# Issue 22 item 2 on one H200 (~2.5 min): tree attention at T = 1 (Qwen3-8B heads: Hkv 8, G 4, D 128,
# bf16) for B in {1, 4, 16} and S in {1k, 8k, 32k}: the kernel at its defaults (DECODE_TUNING in
# ddtree_jax/kernels/tuning.py) and JAX's bundled Pallas decode kernel (decode_attention.mqa, its
# defaults: 16 splits, block_k 256) on the same cache, both profiled (device time and launches per call
# by kernel), then a sweep of candidate tunings around the defaults on every shape, ending with a table
# of ours / bundled per shape and tuning. The swept specs ("old" = the tuning before this change):
#   waves=2,mb=4,merge=xla   merge=xla   k=64   waves=8
# Run from the repository root:  OUT=$OUT bash results/h200/decode/run.sh   (PY=echo: print only)
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/decode} PY=${PY:-python3}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv > "$OUT/gpu.txt" 2>&1
$PY -m ddtree_jax.bench attention --nodes 1 --batch-sizes 1,4,16 --contexts 1024,8192,32768 \
  --tunings "waves=2,mb=4,merge=xla;merge=xla;k=64;waves=8" --no-reference --profile --target-s 0.1 \
  --deadline-s 150 --out "$OUT/decode.json" > "$OUT/decode.log" 2>&1
