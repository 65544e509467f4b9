#!/usr/bin/env bash
# Where a tiny round's time goes, on one H200 (~2-4 min): the bundled pair's shape (`default-pair`: the
# 6-layer, 256-wide Qwen3 target of ddtree_jax/assets/default_pair, its 2-layer DFlash drafter with block
# 16), bf16, random weights, 1k context, the Pallas attention (what the bundled job's --attention auto
# picks on a GPU: attention.default_implementation), ar and ddtree budget 7, each as its verify alone and
# as the round in the device loop (64 rounds a call, 3 traced calls), by ddtree-bench profile: kernel
# time by category and by the engine's scopes (draft, build, verify, walk, commit), top 25 kernels, busy
# against wall. The ddtree 7 round costs 2.8-2.9x an ar step there (2026-12-02/load-and-graphs); the
# goal is 2.5x.
#   b1.json / b1.log    batch 1 (the ar step runs as two rows, one inactive)
#   b16.json / b16.log  batch 16
# Each command stops starting new measurements at --deadline-s 120 (compiles here take 2-7 s each).
# Run from the repository root:  OUT=$OUT bash results/h200/2026-12-03/round-profile/run.sh   (PY=echo: print only)
set -u
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.95}
OUT=${OUT:-/tmp/round-profile} PY=${PY:-python3}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$OUT/gpu.txt" 2>&1
P="$PY -m ddtree_jax.bench profile --shape default-pair --draft-layers 2 --block-size 16 --context 1024 \
--attention pallas --methods ar,ddtree --budgets 7 --programs verify,round --rounds 64 --iters 3"
$P --batch-size 1 --deadline-s 120 --out "$OUT/b1.json" > "$OUT/b1.log" 2>&1
$P --batch-size 16 --deadline-s 120 --out "$OUT/b16.json" > "$OUT/b16.log" 2>&1
