#!/usr/bin/env bash
# Issue 17 on one H200 (one device call, about 7 minutes): ddtree-bench rounds of a random
# Qwen3-30B-A3B-shaped target (bf16, ~61 GB, Pallas attention, 1k context) with the default MoE dispatch
# (on the GPU, moe.choose_dispatch: gather up to 4 tokens, the Pallas grouped kernel above): ar and
# ddtree 7 / 15 at batch 1 and 16 in one call (batch 16 was never measured: it runs before anything
# optional); then the batch-1 ar step with the one-token alternatives (grouped, grouped_split) that
# decide moe.GPU_GATHER_MAX_TOKENS; then, if time is left, the dispatch
# micro-benchmark (scripts/bench_moe.py: Pallas grouped, grouped with more K splits, gather,
# ragged_dot at 1 / 8 / 16 / 64 / 512 tokens, 2048 x 768 experts).
# Each step runs under `timeout` (its cap or what is left of $DEADLINE, default 470 s); results and
# logs under $OUT. With TP=2 on a two-GPU kind it adds the expert-parallel and tensor-parallel rows.
set -u
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
OUT=${OUT:-results/h200/moe}
TP=${TP:-1}
DEADLINE=${DEADLINE:-470}
mkdir -p "$OUT"
source "$(dirname "$0")/h200_lib.sh"
B="python3 -m ddtree_jax.bench rounds --shape qwen3-30b-a3b --attention pallas --rounds 4 --contexts 1024"

step batch 30 230 $B --methods ar,ddtree --budgets 7,15 --batches 1,16 --out "$OUT/batch.json"
step ar_grouped 30 75 $B --methods ar --batches 1 --moe-dispatch grouped --out "$OUT/ar_grouped.json"
step ar_split 30 75 $B --methods ar --batches 1 --moe-dispatch grouped_split --out "$OUT/ar_split.json"
step dispatch 30 130 python3 scripts/bench_moe.py --deadline-s 95 --out "$OUT/dispatch.json"
if [ "$TP" -gt 1 ]; then
  step ep$TP 120 $B --methods ar,ddtree --budgets 15 --batches 1 --tp "$TP" --moe-sharding ep --out "$OUT/ep$TP.json"
  step tpexp$TP 120 $B --methods ar,ddtree --budgets 15 --batches 1 --tp "$TP" --moe-sharding tp \
    --out "$OUT/tpexp$TP.json"
fi
echo "total $SECONDS s"; date -u
