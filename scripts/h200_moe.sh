#!/usr/bin/env bash
# Issue 17 on one H200 (one device call, under 8 minutes): the MoE dispatches against the floor of the
# distinct experts their tokens select (scripts/bench_moe.py), then ddtree-bench rounds of a random
# Qwen3-30B-A3B-shaped target (bf16, ~61 GB, Pallas attention, 1k context): ar against its floor and
# ddtree against budget at batch 1 and 16. Steps are cut at $DEADLINE seconds; results under $OUT.
# With TP=2 on a two-GPU kind it adds the expert-parallel and tensor-parallel-expert rows.
set -u
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
OUT=${OUT:-results/h200/moe}
TP=${TP:-1}
mkdir -p "$OUT"
B="python3 scripts/bench.py --shape qwen3-30b-a3b --attention pallas --rounds 8 --contexts 1024"
left() { echo $((${DEADLINE:-470} - SECONDS)); }
step() {
  local name=$1; shift
  if [ "$(left)" -lt 30 ]; then echo "== $name: skipped, $(left) s left"; return; fi
  echo "== $name ($(left) s left)"
  timeout "$(left)" "$@" > "$OUT/$name.log" 2>&1
  echo "rc $?"; tail -n 12 "$OUT/$name.log"
}

step dispatch python3 scripts/bench_moe.py --out "$OUT/dispatch.json"
step batch1 $B --methods ar,ddtree --budgets 7,15,63 --batches 1 --out "$OUT/batch1.json"
step batch16 $B --methods ar,ddtree --budgets 7,15 --batches 16 --out "$OUT/batch16.json"
if [ "$TP" -gt 1 ]; then
  step ep$TP $B --methods ar,ddtree --budgets 15 --batches 1 --tp "$TP" --moe-sharding ep --out "$OUT/ep$TP.json"
  step tpexp$TP $B --methods ar,ddtree --budgets 15 --batches 1 --tp "$TP" --moe-sharding tp \
    --out "$OUT/tpexp$TP.json"
fi
date -u
