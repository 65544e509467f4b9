#!/usr/bin/env bash
# Issue 31 on one H200: the Mosaic GPU tree-attention and MLA kernels checked against the jnp reference
# and the Triton kernels on the device, then timed against Triton, cuDNN-merged and the bundled decode
# kernel with floors (step "kernels": scripts/bench_mosaic_attention.py, most informative rows first,
# its own deadline KERNEL_S, default 290 s); then the engine's ddtree 15 / 63 rounds at 32k, batch 16,
# with each kernel as --attention (step "rounds", ~2.5 min: run it once the kernels' checks pass).
# Each step is cut at the time left before $DEADLINE (seconds) and at its own cap; JSON and logs land
# in $OUT (default /tmp/mosaic). After a hang (the bench's watchdog names the step), rerun with
# SKIP=<kernel or form> (passed to --skip, e.g. SKIP=mosaic-smem or SKIP=mosaic).
#   OUT=$OUT DEADLINE=350 STEPS=kernels bash scripts/h200_mosaic.sh    # call 1, ~6 min
#   OUT=$OUT DEADLINE=170 STEPS=rounds bash scripts/h200_mosaic.sh     # call 2, ~2.5 min
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/mosaic}
DEADLINE=${DEADLINE:-350}
KERNEL_S=${KERNEL_S:-290}
mkdir -p "$OUT"
source "$(dirname "$0")/h200_lib.sh"
[ "${DRY_RUN:-0}" = 1 ] || nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv > "$OUT/gpu.txt" 2>&1
step kernels 60 $((KERNEL_S + 50)) python3 scripts/bench_mosaic_attention.py --out "$OUT/mosaic_attention.json" \
  --deadline-s "$KERNEL_S" --skip "${SKIP:-}"
step rounds 100 160 python3 -m ddtree_jax.bench rounds --shape qwen3-8b --attention pallas,mosaic --rounds 8 \
  --methods ddtree --budgets 15,63 --batches 16 --contexts 32768 --out "$OUT/rounds.json"
date -u
