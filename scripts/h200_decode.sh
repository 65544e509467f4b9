#!/usr/bin/env bash
# Issue 22 item 2 on one H200, one device call (~2.5 min): tree attention at T = 1 (Qwen3-8B heads:
# Hkv 8, G 4, D 128, bf16) for B in {1, 4, 16} and S in {1k, 8k, 32k}: the kernel at its defaults
# (DECODE_TUNING in ddtree_jax/kernels/tuning.py) and JAX's bundled Pallas decode kernel
# (decode_attention.mqa, its defaults: 16 splits, block_k 256) on the same cache, both profiled
# (device time and launches per call by kernel), then a sweep of candidate tunings around the
# defaults on every shape, ending with a table of ours / bundled per shape and tuning.
# The swept specs ("old" = the tuning before this change, waves=2,mb=4,merge=xla):
#   waves=2,mb=4,merge=xla   merge=xla   k=64   waves=8
# Each step is cut at the time left before $DEADLINE (seconds, default 170) and at its own cap;
# JSON (rewritten after every row) and logs land in $OUT (default /tmp/decode).
#   OUT=$OUT DEADLINE=170 bash scripts/h200_decode.sh
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/decode}
DEADLINE=${DEADLINE:-170}
mkdir -p "$OUT"
source "$(dirname "$0")/h200_lib.sh"
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv > "$OUT/gpu.txt" 2>&1
git log -1 --format='%H %s' > "$OUT/commit.txt" 2>&1
# --deadline-s stops starting new configurations 10 s before the step's cap (each is written as it ends).
cap=$(( $(left) - 5 )); [ "$cap" -gt 165 ] && cap=165
step decode 15 "$cap" python3 scripts/bench_attention.py --nodes 1 --batches 1,4,16 --contexts 1024,8192,32768 \
  --tunings "waves=2,mb=4,merge=xla;merge=xla;k=64;waves=8" --no-reference --profile --target-s 0.1 \
  --deadline-s $((cap - 10)) --out "$OUT/decode.json"
# If the step was cut before its tables, print them from the JSON written so far.
grep -q "^T = 1, us per call" "$OUT/decode.log" 2>/dev/null || \
  timeout 20 python3 scripts/bench_attention.py --print "$OUT/decode.json" 2>&1 | tail -n 30
date -u
