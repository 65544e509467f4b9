#!/usr/bin/env bash
# Issue 44 item 2 on one H200 (~4 min): the kernel micro-benchmarks that were scripts/bench_*.py, run
# once each as `ddtree-bench` sub-commands at one or two shapes, to see that they still run on the GPU
# (Triton, Mosaic GPU, cuDNN, the profiler) and measure what their recorded runs measured. Every step
# is bounded by its own --deadline-s; each JSON starts with the run header (its `provenance`: commit,
# jax/jaxlib, device). Run from the repository root:  OUT=$OUT bash results/h200/recipes/bench_subcommands.sh
# Compare with: attention B=1 S=8192 T=1 kernel ~ decode/decode.json's default row; tree paths at
# 16:7 ~ 2026-12-03/round-profile/build_variants.json; topk ~ sweep/topk.json; every row error-free.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/bench-subcommands} PY=${PY:-python3}
mkdir -p "$OUT"
B="$PY -m ddtree_jax.bench"
$B attention --batch-sizes 1 --contexts 8192 --nodes 1,64 --no-sweep --profile --deadline-s 25 \
  --out "$OUT/attention.json" > "$OUT/attention.log" 2>&1
$B mla-attention --heads 64 --batch-sizes 1 --contexts 32768 --nodes 1,64 --sweep none --deadline-s 25 \
  --out "$OUT/mla_attention.json" > "$OUT/mla_attention.log" 2>&1
$B mosaic-attention --phases checks,gqa --deadline-s 45 --hang-s 40 --min-left-s 5 \
  --out "$OUT/mosaic_attention.json" > "$OUT/mosaic_attention.log" 2>&1
$B prefix-attention --cases 1:1024 --deadline-s 20 --out "$OUT/prefix_attention.json" > "$OUT/prefix.log" 2>&1
$B quant --tokens 1,16 --deadline-s 25 --out "$OUT/quant.json" > "$OUT/quant.log" 2>&1
$B topk --deadline-s 10 --out "$OUT/topk.json" > "$OUT/topk.log" 2>&1
$B tree --cases 1:7,16:7 --depth 15 --branching 7 --variants paths,climb --deadline-s 15 \
  --out "$OUT/tree.json" > "$OUT/tree.log" 2>&1
date -u
