#!/usr/bin/env bash
# Issue 32 item 1 on one H200 (~70 s): the bundled pair's main job on the held-out prompts (96, 128 new
# tokens, batch 16), ddtree then ar, each run twice against an empty --compile-cache: the summaries'
# "compile:" seconds, first run against second; also item 3's end-to-end ddtree / ar tokens/s at batch 16.
# Run from the repository root:  OUT=$OUT bash results/h200/2026-12-02/compile-cache/run.sh   (PY=echo: print only)
# ddtree-generate takes no --deadline-s: `timeout` bounds each run.
set -u
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.95}
OUT=${OUT:-/tmp/compile-cache} PY=${PY:-python3}
mkdir -p "$OUT"
rm -rf "$OUT/xla"
G="$PY -m ddtree_jax.cli --prompts results/heldout-prompts-96.jsonl --max-new-tokens 128 --batch-size 16"
for method in ddtree ar; do
  for run in first second; do
    echo "== $method $run"
    # shellcheck disable=SC2086  # G is a word list
    timeout 60 $G --method $method --compile-cache "$OUT/xla" --out "$OUT/gen_${method}_$run.jsonl" --overwrite
  done
done > "$OUT/compile_cache.log" 2>&1
du -sh "$OUT/xla" >> "$OUT/compile_cache.log" 2>&1
