#!/usr/bin/env bash
# Where the main job's time goes at batch 64 (issue 50: ar ran 0.62x the anchor there on an H100,
# 2026-12-07, against 1.19x at batch 16): the ar round alone at batch 16 and 64 and 256 cached tokens
# (`ddtree-bench rounds`), then the job at batch 64 twice, the second traced (`--trace-device`: the
# device's busy seconds beside the generation's). ~2 minutes; writes under $OUT.
#   bash results/h200/recipes/job_b64.sh
set -u
OUT=${OUT:-/tmp/job-b64}; mkdir -p "$OUT"
python3 -m ddtree_jax.bench rounds --shape default-pair --methods ar,ddtree --budgets 7 --batch-sizes 16,64 \
  --contexts 256 --attention pallas --deadline-s 60 --out "$OUT/rounds.json" > "$OUT/rounds.txt" 2>&1
tail -8 "$OUT/rounds.txt"
P=/tmp/heldout-192.jsonl
python3 results/h200/recipes/heldout_twice.py "$P"
for run in 1 2; do
  flags=$([ $run = 2 ] && echo --trace-device)
  timeout 120 python3 -m ddtree_jax.cli --prompts $P --max-new-tokens 128 --batch-size 64 --method ar \
    --compile-cache /tmp/cc-b64 --out /tmp/b64.jsonl --overwrite $flags > "$OUT/ar-b64-$run.txt" 2>&1
done
sed -n 2,8p "$OUT/ar-b64-2.txt"
