#!/usr/bin/env bash
# Issue 18 on one H200, one device call within $DEADLINE seconds (default 285), results under $OUT:
# 1. the latent-cache (MLA) kernel against its jnp path at Kimi-K2 widths (latent 512 + RoPE 64,
#    bf16): H = 64 (TP1) and 8 (a TP8 shard), B = 1, S = 4k and 32k, T = 1 and 64, then the first
#    5 tunings of each sweep shape (scripts/bench_mla_attention.py; about $KERNEL_S s);
# 2. ddtree-bench rounds of a random Kimi-K2-shaped target at $LAYERS of its 61 layers (real width:
#    hidden 7168, 64 heads, q_lora 1536, latent 512 + 64, 384 experts top-8 of width 2048 + 1 shared,
#    the first layer dense at 18432, vocab 163840; 2 layers = 1 dense + 1 MoE, ~40 GB of bf16, so
#    that compiles stay short) with a 6-layer block-8 drafter (assumed 64 / 8 heads), Pallas
#    attention, $ROUNDS rounds per timing: 1k context ar and ddtree 15 at batch 1 and 16, then 32k
#    ar and ddtree 15 at batch 1, then (if time is left) ddtree 63 and dflash at 1k, batch 1, and
#    the jnp attention path for ar and ddtree 15 at 32k, batch 1.
# Each step runs under `timeout` with what is left of DEADLINE; ddtree-bench and the kernel bench
# write their JSON after every row, so a step cut short keeps what it measured.
# CPU smoke (no GPU): SHAPE=tiny-mla ATTN=reference CTX=64 LONG_CTX=128 MLA_ARGS=--quick bash $0
# DRY_RUN=1 prints the commands only.
set -u
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.95}
OUT=${OUT:-results/h200/kimi}
DEADLINE=${DEADLINE:-285}
PY=${PY:-python3}
SHAPE=${SHAPE:-kimi-k2}
LAYERS=${LAYERS:-2}
ROUNDS=${ROUNDS:-4}
ATTN=${ATTN:-pallas}
CTX=${CTX:-1024}
LONG_CTX=${LONG_CTX:-32768}
KERNEL_S=${KERNEL_S:-105}
MLA_ARGS=${MLA_ARGS:---heads 64,8 --batches 1 --contexts 4096,32768 --nodes 1,64 --sweep first}
DRY_RUN=${DRY_RUN:-0}
mkdir -p "$OUT"
source "$(dirname "$0")/h200_lib.sh"
B="$PY -m ddtree_jax.bench rounds --shape $SHAPE --num-layers $LAYERS --draft-layers 6 --block-size 8 --rounds $ROUNDS"
# step NAME MIN_S LIMIT_S CMD...: run CMD under timeout min(LIMIT_S, time left), if MIN_S seconds are left.

[ "$DRY_RUN" = 1 ] || nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null
# shellcheck disable=SC2086  # MLA_ARGS and B are word lists
step mla_kernel 60 "$KERNEL_S" $PY scripts/bench_mla_attention.py $MLA_ARGS \
  --deadline-s $((KERNEL_S - 20)) --out "$OUT/bench_mla_attention.json"
# shellcheck disable=SC2086
step kimi_ctx1k 60 110 $B --attention "$ATTN" --methods ar,ddtree --budgets 15 --batches 1,16 \
  --contexts "$CTX" --out "$OUT/kimi_ctx1k.json"
# shellcheck disable=SC2086
step kimi_ctx32k 40 70 $B --attention "$ATTN" --methods ar,ddtree --budgets 15 --batches 1 \
  --contexts "$LONG_CTX" --out "$OUT/kimi_ctx32k.json"
# shellcheck disable=SC2086
step kimi_ctx1k_more 45 60 $B --attention "$ATTN" --methods ddtree,dflash --budgets 63 --batches 1 \
  --contexts "$CTX" --out "$OUT/kimi_ctx1k_more.json"
# shellcheck disable=SC2086
step kimi_ctx32k_jnp 40 60 $B --attention reference --methods ar,ddtree --budgets 15 --batches 1 \
  --contexts "$LONG_CTX" --out "$OUT/kimi_ctx32k_jnp.json"
date -u
