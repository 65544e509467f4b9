#!/usr/bin/env bash
# The README's main job (the bundled pair, 96 held-out prompts x 128, batch 16, ar and ddtree) under each
# XLA flag preset of ddtree_jax/xla_flags.py (DDTREE_XLA_PRESET): each run twice on its own compile cache,
# the second's summary kept (issue 50: whether loops and conditionals inside CUDA graphs remove the device
# job's host syncs). METHODS="ar" runs ar alone.
#   bash results/h200/recipes/job_presets.sh [PRESETS...]   (default: xla graphs graphs-unrolled; under $OUT)
set -u
OUT=${OUT:-/tmp/job-presets}; mkdir -p "$OUT"
P96=results/heldout-prompts-96.jsonl
for preset in ${@:-xla graphs graphs-unrolled}; do
  for method in ${METHODS:-ar ddtree}; do
    for run in 1 2; do
      DDTREE_XLA_PRESET=$preset timeout 150 python3 -m ddtree_jax.cli --prompts "$P96" --max-new-tokens 128 \
        --batch-size 16 --method "$method" --compile-cache "/tmp/cc-$preset" --out "/tmp/$preset-$method.jsonl" \
        --overwrite > "/tmp/$preset-$method-$run.txt" 2>&1
    done
    grep -E "^(method|prompts|loop)" "/tmp/$preset-$method-2.txt" | sed "s/^/$preset $method: /" | tee -a "$OUT/presets.txt"
    python3 - "/tmp/$preset-$method.jsonl" "/tmp/xla-$method.jsonl" <<'PY' | sed "s/^/$preset $method: /" | tee -a "$OUT/presets.txt"
import json, sys
ids = [{(x["id"], x["index"]): x["output_ids"] for x in map(json.loads, open(f))} for f in sys.argv[1:]]
print("output ids equal to xla's" if ids[0] == ids[1] else "OUTPUT IDS DIFFER from xla's")
PY
  done
done
