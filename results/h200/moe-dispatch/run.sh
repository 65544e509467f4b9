#!/usr/bin/env bash
# Issue 17 on one H200 (~7 min): ddtree-bench rounds of a random Qwen3-30B-A3B-shaped target (bf16,
# ~61 GB, Pallas attention, 1k context) with the default MoE dispatch (on the GPU, moe.choose_dispatch:
# gather up to 4 tokens, the Pallas grouped kernel above): ar and ddtree 7 / 15 at batch 1 and 16 in
# one command (batch 16 was never measured: it runs before anything optional); then the batch-1 ar
# step with the one-token alternatives (grouped, grouped_split) that decide moe.GPU_GATHER_MAX_TOKENS;
# then the dispatch micro-benchmark (`ddtree-bench moe`: Pallas grouped, grouped with more K
# splits, gather, ragged_dot at 1 / 8 / 16 / 64 / 512 tokens, 2048 x 768 experts).
# With TP=2 on a two-GPU kind it adds the expert-parallel and tensor-parallel rows.
# Run from the repository root:  OUT=$OUT bash results/h200/moe-dispatch/run.sh   (PY=echo: print only)
set -u
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
OUT=${OUT:-/tmp/moe} PY=${PY:-python3} TP=${TP:-1}
mkdir -p "$OUT"
B="$PY -m ddtree_jax.bench rounds --shape qwen3-30b-a3b --attention pallas --rounds 4 --contexts 1024"
$B --methods ar,ddtree --budgets 7,15 --batch-sizes 1,16 --deadline-s 180 --out "$OUT/batch.json" > "$OUT/batch.log" 2>&1
$B --methods ar --batch-sizes 1 --moe-dispatch grouped --deadline-s 45 --out "$OUT/ar_grouped.json" \
  > "$OUT/ar_grouped.log" 2>&1
$B --methods ar --batch-sizes 1 --moe-dispatch grouped_split --deadline-s 45 --out "$OUT/ar_split.json" \
  > "$OUT/ar_split.log" 2>&1
$PY -m ddtree_jax.bench moe --deadline-s 95 --out "$OUT/dispatch.json" > "$OUT/dispatch.log" 2>&1
if [ "$TP" -gt 1 ]; then
  $B --methods ar,ddtree --budgets 15 --batch-sizes 1 --tp "$TP" --moe-sharding ep --deadline-s 90 \
    --out "$OUT/ep$TP.json" > "$OUT/ep$TP.log" 2>&1
  $B --methods ar,ddtree --budgets 15 --batch-sizes 1 --tp "$TP" --moe-sharding tp --deadline-s 90 \
    --out "$OUT/tpexp$TP.json" > "$OUT/tpexp$TP.log" 2>&1
fi
