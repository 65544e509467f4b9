#!/usr/bin/env bash
# The H200 benchmark batch of issues 6 and 8 (one device call, under 10 minutes): lax.top_k against the
# chunked top-k; the cost of sampling at budget 63; round time against budget and batch; the stage
# breakdown; tp = 1 references; batch 16 at 8k / 32k; Llama-3.1-8B shapes; the ar step by rows.
# The device tool brings back few files: the JSON and logs come back as $OUT/sweep.tgz.
# Run from the repository root:  OUT=$OUT bash results/h200/sweep/run.sh   (PY=echo: print only)
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp} PY=${PY:-python3} W=/tmp/sweep
mkdir -p "$W"
B="$PY -m ddtree_jax.bench rounds --shape qwen3-8b --attention pallas --rounds 16"
$PY -m ddtree_jax.bench topk --deadline-s 20 --out "$W/topk.json" > "$W/topk.log" 2>&1
$B --methods ddtree,ar --budgets 63 --contexts 1024 --batch-sizes 1 --sampling greedy,0.7:0:1,0.7:20:0.9,0.7:0:0.9 \
  --deadline-s 50 --out "$W/sampling.json" > "$W/sampling.log" 2>&1
$B --methods ar,dflash,ddtree --budgets 7,15,31,63,127,255 --contexts 1024 --batch-sizes 1,16 --deadline-s 140 \
  --out "$W/budgets.json" > "$W/budgets.log" 2>&1
$B --methods ar,ddtree --budgets 15,63 --contexts 1024 --batch-sizes 4,32 --deadline-s 50 \
  --out "$W/batches.json" > "$W/batches.log" 2>&1
$B --methods ar,ddtree --budgets 63 --contexts 1024 --batch-sizes 1,16 --stages --deadline-s 50 \
  --out "$W/stages.json" > "$W/stages.log" 2>&1
$B --methods dflash,ddtree --budgets 15 --contexts 1024 --batch-sizes 1,16 --deadline-s 30 \
  --out "$W/tp1.json" > "$W/tp1.log" 2>&1
$B --methods ar,ddtree --budgets 63 --contexts 8192,32768 --batch-sizes 16 --deadline-s 50 \
  --out "$W/contexts.json" > "$W/contexts.log" 2>&1
$PY -m ddtree_jax.bench rounds --shape llama-3.1-8b --attention pallas --rounds 16 --methods ar,ddtree \
  --budgets 15,63 --contexts 1024 --batch-sizes 1,16 --deadline-s 50 --out "$W/llama.json" > "$W/llama.log" 2>&1
$B --methods ar,ddtree --budgets 7 --contexts 1024 --batch-sizes 2,8,32 --deadline-s 30 \
  --out "$W/arbatch.json" > "$W/arbatch.log" 2>&1
tar czf "$OUT/sweep.tgz" -C /tmp sweep
