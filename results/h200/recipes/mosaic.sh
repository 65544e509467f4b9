#!/usr/bin/env bash
# Issue 31 on one H200: the Mosaic GPU tree-attention and MLA kernels checked against the jnp reference
# and the Triton kernels on the device, then timed against Triton, cuDNN-merged and the bundled decode
# kernel with floors (`ddtree-bench mosaic-attention`, most informative rows first; its recorded
# runs: results/h200/2026-12-02/mosaic-*); then the engine's ddtree 15 / 63 rounds at 32k, batch 16,
# with each kernel as --attention (~2.5 min: run it once the kernels' checks pass; not run yet).
# After a hang (the bench's watchdog names the step), rerun with SKIP=<kernel or form> (passed to
# --skip, e.g. SKIP=mosaic-smem or SKIP=mosaic).
#   OUT=$OUT bash results/h200/recipes/mosaic.sh kernels   # call 1, ~6 min
#   OUT=$OUT bash results/h200/recipes/mosaic.sh rounds    # call 2, ~2.5 min
# PY=echo prints the command only.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/mosaic} PY=${PY:-python3}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv > "$OUT/gpu.txt" 2>&1
case ${1:-kernels} in
  kernels)
    $PY -m ddtree_jax.bench mosaic-attention --deadline-s 290 --skip "${SKIP:-}" --out "$OUT/mosaic_attention.json" \
      > "$OUT/kernels.log" 2>&1 ;;
  rounds)
    $PY -m ddtree_jax.bench rounds --shape qwen3-8b --attention pallas,mosaic --rounds 8 --methods ddtree \
      --budgets 15,63 --batch-sizes 16 --contexts 32768 --deadline-s 110 --out "$OUT/rounds.json" \
      > "$OUT/rounds.log" 2>&1 ;;
  *) echo "usage: $0 kernels|rounds" >&2; exit 1 ;;
esac
