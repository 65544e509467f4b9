#!/usr/bin/env bash
# The H200 benchmark batch of issues 6 and 8 (one device call, under 10 minutes). Each step is cut at
# the time left before $DEADLINE (seconds); $STEPS (a space-separated list, default all) picks steps.
# The JSON and logs of all steps come back as $OUT/sweep.tgz.
set -u
export PYTHONUNBUFFERED=1
W=/tmp/sweep
DEADLINE=${DEADLINE:-570}
LOGS=$W
mkdir -p $W
source "$(dirname "$0")/h200_lib.sh"
B="python3 -m ddtree_jax.bench rounds --shape qwen3-8b --attention pallas --rounds 16"
ALL="topk sampling budgets batches stages tp1 contexts llama arbatch"

step topk 20 $DEADLINE python3 scripts/bench_topk.py --out "$W/topk.json"
step sampling 20 $DEADLINE $B --methods ddtree,ar --budgets 63 --contexts 1024 --batches 1 \
  --sampling greedy,0.7:0:1,0.7:20:0.9,0.7:0:0.9 --out "$W/sampling.json"
step budgets 20 $DEADLINE $B --methods ar,dflash,ddtree --budgets 7,15,31,63,127,255 --contexts 1024 --batches 1,16 \
  --out "$W/budgets.json"
step batches 20 $DEADLINE $B --methods ar,ddtree --budgets 15,63 --contexts 1024 --batches 4,32 --out "$W/batches.json"
step stages 20 $DEADLINE $B --methods ar,ddtree --budgets 63 --contexts 1024 --batches 1,16 --stages --out "$W/stages.json"
step tp1 20 $DEADLINE $B --methods dflash,ddtree --budgets 15 --contexts 1024 --batches 1,16 --out "$W/tp1.json"
step contexts 20 $DEADLINE $B --methods ar,ddtree --budgets 63 --contexts 8192,32768 --batches 16 --out "$W/contexts.json"
step llama 20 $DEADLINE python3 -m ddtree_jax.bench rounds --shape llama-3.1-8b --attention pallas --rounds 16 --methods ar,ddtree \
  --budgets 15,63 --contexts 1024 --batches 1,16 --out "$W/llama.json"
step arbatch 20 $DEADLINE $B --methods ar,ddtree --budgets 7 --contexts 1024 --batches 2,8,32 --out "$W/arbatch.json"
date -u
tar czf "$OUT/sweep.tgz" -C /tmp sweep
