#!/usr/bin/env bash
# Issue 20 on one H200, at most 6 minutes (each step under its own timeout), results under $OUT:
#   prefill.jsonl     chunked prefill of a 1k and a 32k prompt (Qwen3-8B shape, random bf16 weights):
#                     seconds, peak memory, the FLOP floor at 790 TFLOP/s; Pallas attention, chunks 1k / 4k
#   bf16-layouts.json the bundled prompts in two batch layouts, bfloat16, Pallas attention: prompts whose
#                     outputs change, for static batches, continuous and batch-invariant batching
#   mixed-8b.json     continuous against static batching on a mixed workload (64 prompts of 64 to 1024
#                     tokens, 64 new tokens, batch 16, ddtree budget 7, a calibrated stop id), then the
#                     batch-invariant schedule's tokens/s against the default's (the JSON is rewritten
#                     after each phase, so a timeout keeps what was measured)
# Run from the repository root: OUT=/some/dir bash scripts/h200_scheduling.sh
set -u
OUT=${OUT:-results/h200/scheduling}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/gpu.txt" 2>&1
timeout 100 python3 scripts/bench_prefill.py --runs 1024:1024,32768:1024,32768:4096 \
    --attention pallas --out "$OUT/prefill.jsonl" || echo "bench_prefill: exit $?"
timeout 50 python3 scripts/batch_layouts.py --attention pallas --prefill-chunk 64 \
    --out "$OUT/bf16-layouts.json" || echo "batch_layouts: exit $?"
timeout 200 python3 scripts/bench_scheduling.py --shape qwen3-8b --dtype bfloat16 --attention pallas \
    --prompts 64 --min-len 64 --max-len 1024 --max-new-tokens 64 --batch-size 16 --budget 7 \
    --prefill-chunk 512 --batch-invariant --out "$OUT/mixed-8b.json" || echo "bench_scheduling: exit $?"
