#!/usr/bin/env bash
# Issue 18 on one H200 (one device call, under 5 minutes): ddtree-bench rounds of a random Kimi-K2-shaped
# target at 4 of its 61 layers (real width: hidden 7168, 64 heads, q_lora 1536, latent 512 + 64,
# 384 experts top-8 of width 2048 + 1 shared, the first layer dense at 18432, vocab 163840; 4 layers
# = 1 dense + 3 MoE, ~110 GB of bf16) with a 6-layer block-8 drafter (assumed 64 / 8 heads), Pallas
# attention (the MLA latent kernel for the target). 1k context: ar, dflash, ddtree 15 / 63 at batch
# 1 and 16; then 32k: ar, ddtree 15 / 63 at batch 1 and 16 (dflash left out at 32k for time).
# Each step is cut at $DEADLINE seconds (default 285); ddtree-bench writes its JSON after every row.
set -u
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.95}
OUT=${OUT:-results/h200/kimi}
mkdir -p "$OUT"
B="python3 scripts/bench.py --shape kimi-k2 --attention pallas --draft-layers 6 --block-size 8 --rounds 4"
left() { echo $((${DEADLINE:-285} - SECONDS)); }
step() {
  local name=$1; shift
  if [ "$(left)" -lt 40 ]; then echo "== $name: skipped, $(left) s left"; return; fi
  echo "== $name ($(left) s left)"
  timeout "$(left)" "$@" > "$OUT/$name.log" 2>&1
  echo "rc $?"; tail -n 14 "$OUT/$name.log"
}

nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
step ctx1k $B --methods ar,dflash,ddtree --budgets 15,63 --batches 1,16 --contexts 1024 --out "$OUT/ctx1k.json"
step ctx32k $B --methods ar,ddtree --budgets 15,63 --batches 1,16 --contexts 32768 --out "$OUT/ctx32k.json"
date -u
