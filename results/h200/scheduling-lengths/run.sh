#!/usr/bin/env bash
# Issue 20 on one H200 (~5 min, most of it compilation: continuous ~95 s, static ~35 s, batch-invariant
# ~100 s, its attention differs so it compiles programs of its own), results under $OUT:
#   lengths-8b.json  continuous against static batching on a mixed workload whose spread of output
#                    lengths is drawn from the seed, not from the outputs: 64 prompts of 64 to 1024
#                    tokens, each with its own max_new_tokens log-uniform in [8, 128], no stop ids,
#                    batch 16, ddtree budget 7, Qwen3-8B shape (random bf16 weights), Pallas attention,
#                    prefill chunks of 512 through the same attention; phases continuous, static, then
#                    the batch-invariant schedule (its tokens/s against the default's: the issue's
#                    "default if it costs under 5%"); the JSON is rewritten after each phase
#   lengths-8b.log   the run's output; gpu.txt
# Run from the repository root:  OUT=$OUT bash results/h200/scheduling-lengths/run.sh   (PY=echo: print only)
# FLAGS are added at the end (the last of a flag wins); a CPU check at toy size:
#   FLAGS="--shape tiny --dtype float32 --attention reference --prompts 6 --min-len 4 --max-len 24
#   --max-new-tokens 8 --min-new-tokens 2 --batch-size 2 --budget 3 --prefill-chunk 16" PY=python3 bash $0
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/scheduling-lengths} PY=${PY:-python3} FLAGS=${FLAGS:-}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/gpu.txt" 2>&1
# shellcheck disable=SC2086  # FLAGS is a word list
$PY -m ddtree_jax.bench scheduling --shape qwen3-8b --dtype bfloat16 --attention pallas --prompts 64 --min-len 64 \
  --max-len 1024 --max-new-tokens 128 --min-new-tokens 8 --stop-fraction 0 --batch-size 16 --budget 7 \
  --prefill-chunk 512 --prefill-attention same --batch-invariant $FLAGS --deadline-s 300 \
  --out "$OUT/lengths-8b.json" > "$OUT/lengths-8b.log" 2>&1
