#!/usr/bin/env bash
# Packed prefill passes (issue 46) against the passes before them (each prompt's own [R, C] chunk
# schedule), and the main job at batch 64 against the PyTorch anchor (issue 50), in one call (~8 min):
#  1. Qwen3-8B shape, 64 prompts of 16-512 tokens x 64 new, batch 16, ar, output lengths spread
#     (--min-new-tokens 8): continuous and static with this tree's code, continuous with the base's;
#  2. the bundled pair's main job at batch 64 (192 prompts x 128, ar; the second of two runs) for this
#     tree and the base, and the anchor at the same batch;
#  3. as 1 with every prompt running 64 tokens, while the call's time lasts.
# BASE: a copy of the code to compare with (a folder holding its ddtree_jax/; carry it). ANCHOR: the
# PyTorch job (../shared/anchors/torch_job_anchor.py; carry a copy). Writes under $OUT.
#   BASE=.devcarry/base ANCHOR=.devcarry/torch_job_anchor.py bash results/h200/recipes/packed_call.sh
set -u
R=/tmp/r; mkdir -p $R; T0=$(date +%s)
left() { echo $(( ${1} - ($(date +%s) - T0) )); }
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; git log -1 --format=%H 2>/dev/null; date -u; } > $OUT/device.txt
cat $OUT/device.txt
# (--repeats, not --reps: the base code of before 2026-12-08 knows only that spelling)
S="-m ddtree_jax.bench scheduling --shape qwen3-8b --dtype bfloat16 --attention pallas --prompts 64
  --min-len 16 --max-len 512 --max-new-tokens 64 --stop-fraction 0 --batch-size 16 --repeats 2 --method ar"
run8b() {  # name, code path, extra flags
  local l; l=$(left $LIMIT); [ $l -gt 40 ] || return
  PYTHONPATH=$2 timeout $(( l < 130 ? l : 130 )) python3 $S ${@:3} --deadline-s 70 --out $R/$1.json > $R/$1.txt 2>&1
  echo "$1 done t=$(( $(date +%s) - T0 ))"
}
LIMIT=300
run8b spread-new $PWD --min-new-tokens 8
run8b spread-base $BASE --min-new-tokens 8 --skip-static
summary() {
python3 - $R <<'PY' | tee $OUT/8b-summary.txt
import json, sys
from pathlib import Path
for f in sorted(Path(sys.argv[1]).glob("*.json")):
    d = json.loads(f.read_text())
    for policy in ("continuous", "static"):
        c = d.get(policy)
        if c:
            drop = ("rounds_per_prompt", "compiled", "generate_s_runs")
            print(f.stem, policy, {k: v for k, v in c.items() if k not in drop}, c.get("generate_s_runs"))
PY
for f in $R/*.txt; do echo "#### $f"; tail -12 $f; done > $OUT/8b-logs.txt
}
summary
P=/tmp/heldout-192.jsonl
python3 results/h200/recipes/heldout_twice.py "$P"
for code in new base; do
  dir=$PWD; [ $code = base ] && dir=$BASE
  for run in 1 2; do
    PYTHONPATH=$dir timeout 60 python3 -m ddtree_jax.cli --prompts $P --max-new-tokens 128 --batch-size 64 \
      --method ar --compile-cache /tmp/cc-$code --out /tmp/b64-$code.jsonl --overwrite > $R/b64-$code-$run.log 2>&1
  done
  echo "== b64 $code"; sed -n 2,6p $R/b64-$code-2.log
done | tee $OUT/b64-summary.txt
cmp /tmp/b64-new.jsonl /tmp/b64-base.jsonl && echo "b64 outputs identical" | tee -a $OUT/b64-summary.txt
OUT=$R BATCH=64 PROMPTS=192 NEW=128 timeout 90 python3 "$ANCHOR" > $OUT/anchor-b64.txt 2>&1
tail -3 $OUT/anchor-b64.txt
for f in $R/b64-*.log; do echo "#### $f"; cat $f; done > $OUT/b64-logs.txt
echo "t=$(( $(date +%s) - T0 ))"
LIMIT=570
run8b uniform-new $PWD
run8b uniform-base $BASE --skip-static
summary
echo "t=$(( $(date +%s) - T0 ))"
