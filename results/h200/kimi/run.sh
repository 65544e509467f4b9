#!/usr/bin/env bash
# Issue 18 on one H200 (~5 min), results under $OUT:
# 1. the latent-cache (MLA) kernel against its jnp path at Kimi-K2 widths (latent 512 + RoPE 64, bf16):
#    H = 64 (TP1) and 8 (a TP8 shard), B = 1, S = 4k and 32k, T = 1 and 64, then the first 5 tunings
#    of each sweep shape (`ddtree-bench mla-attention`);
# 2. ddtree-bench rounds of a random Kimi-K2-shaped target at 2 of its 61 layers (real width: hidden
#    7168, 64 heads, q_lora 1536, latent 512 + 64, 384 experts, 8 per token, of width 2048 + 1 shared,
#    the first layer dense at 18432, vocab 163840; 2 layers = 1 dense + 1 MoE, ~40 GB of bf16, so that
#    compiles stay short) with a 6-layer block-8 drafter (assumed 64 / 8 heads), Pallas attention, 4
#    rounds per timing: 1k context ar and ddtree 15 at batch 1 and 16, then 32k ar and ddtree 15 at
#    batch 1, then ddtree 63 and dflash at 1k, batch 1, and the jnp attention path for ar and ddtree 15
#    at 32k, batch 1.
# Run from the repository root:  OUT=$OUT bash results/h200/kimi/run.sh   (PY=echo: print only)
# FLAGS are added at the end of every rounds command (the last of a flag wins), MLA_ARGS replace the
# kernel bench's sizes; a CPU check at toy size:
#   FLAGS="--shape tiny-mla --attention reference --contexts 64" MLA_ARGS=--quick PY=python3 bash $0
set -u
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.95}
OUT=${OUT:-/tmp/kimi} PY=${PY:-python3} FLAGS=${FLAGS:-}
MLA_ARGS=${MLA_ARGS:---heads 64,8 --batch-sizes 1 --contexts 4096,32768 --nodes 1,64 --sweep first}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader > "$OUT/gpu.txt" 2>&1
B="$PY -m ddtree_jax.bench rounds --shape kimi-k2 --num-layers 2 --draft-layers 6 --block-size 8 --rounds 4"
# shellcheck disable=SC2086  # MLA_ARGS, B and FLAGS are word lists
$PY -m ddtree_jax.bench mla-attention $MLA_ARGS --deadline-s 85 --out "$OUT/bench_mla_attention.json" \
  > "$OUT/mla_kernel.log" 2>&1
# shellcheck disable=SC2086
$B --attention pallas --methods ar,ddtree --budgets 15 --batch-sizes 1,16 --contexts 1024 $FLAGS \
  --deadline-s 80 --out "$OUT/kimi_ctx1k.json" > "$OUT/kimi_ctx1k.log" 2>&1
# shellcheck disable=SC2086
$B --attention pallas --methods ar,ddtree --budgets 15 --batch-sizes 1 --contexts 32768 $FLAGS \
  --deadline-s 45 --out "$OUT/kimi_ctx32k.json" > "$OUT/kimi_ctx32k.log" 2>&1
# shellcheck disable=SC2086
$B --attention pallas --methods ddtree,dflash --budgets 63 --batch-sizes 1 --contexts 1024 $FLAGS \
  --deadline-s 35 --out "$OUT/kimi_ctx1k_more.json" > "$OUT/kimi_ctx1k_more.log" 2>&1
# shellcheck disable=SC2086
$B --attention reference --methods ar,ddtree --budgets 15 --batch-sizes 1 --contexts 32768 $FLAGS \
  --deadline-s 35 --out "$OUT/kimi_ctx32k_jnp.json" > "$OUT/kimi_ctx32k_jnp.log" 2>&1
