#!/usr/bin/env bash
# Continuous batching (the device job, prompts prefilled together) against static batches at the Qwen3-8B
# shape, random bf16 weights (issue 46's workload): 64 prompts of 16-512 tokens x 64 new at batch 16, ar
# and ddtree, and ar with output lengths spread (each prompt's max_new_tokens log-uniform in [8, 64]).
# RUNS picks some of them (default: all three, ~4-5 minutes on an H100 with a cold compile).
#   [RUNS="ar ddtree spread"] bash results/h200/recipes/prefill_together.sh   (writes $OUT/8b-*.json)
set -u
OUT=${OUT:-/tmp/prefill-together}; mkdir -p "$OUT"
S="python3 -m ddtree_jax.bench scheduling --shape qwen3-8b --dtype bfloat16 --attention pallas --prompts 64
  --min-len 16 --max-len 512 --max-new-tokens 64 --stop-fraction 0 --batch-size 16 --reps 2"
for run in ${RUNS:-ar ddtree spread}; do
  case $run in
    ar) $S --method ar --deadline-s 90 --out "$OUT/8b-ar-b16.json" > "$OUT/8b-ar-b16.txt" 2>&1 ;;
    ddtree) $S --method ddtree --deadline-s 100 --out "$OUT/8b-ddtree-b16.json" > "$OUT/8b-ddtree-b16.txt" 2>&1 ;;
    spread) $S --method ar --min-new-tokens 8 --deadline-s 90 --out "$OUT/8b-ar-b16-spread.json" \
      > "$OUT/8b-ar-b16-spread.txt" 2>&1 ;;
  esac
done
python3 - "$OUT" <<'PY'
import json, sys
from pathlib import Path
for f in sorted(Path(sys.argv[1]).glob("8b-*.json")):
    d = json.loads(f.read_text())
    c, s = d.get("continuous", {}), d.get("static", {})
    drop = ("rounds_per_prompt", "compiled", "generate_s_runs")
    print(f.stem, "continuous/static", d.get("speedup"), "identical", d.get("identical_outputs"))
    print("  continuous", {k: v for k, v in c.items() if k not in drop})
    print("  static", {k: v for k, v in s.items() if k not in drop})
PY
