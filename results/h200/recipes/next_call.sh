#!/usr/bin/env bash
# The next GPU call, ~9 minutes (planned 2026-12-07, session 4, when no device was lent): issue 50 at batch 64
# (the anchor, the ar round alone and the traced job: job_b64.sh; then --prefill-slots 64 and 16 against the
# default 8), issue 46 at the Qwen3-8B shape (the spread case at --refill-at 1 and 4: wait for more free rows
# or not; and --prefill-slots 4: less padding a pass), fused projections at the Qwen3-8B shape (ar and
# ddtree 15 at batch 16, fused against unfused; the drafter computes Q and fused K/V apart since
# 2026-12-07), the batch-64 job's optimized HLO. Each step is cut by the time left.
#   ANCHOR=../shared/anchors/torch_job_anchor.py bash results/h200/recipes/next_call.sh   (writes under $OUT)
# (The device machine gets the working tree only: copy the anchor into a git-ignored folder of the checkout
# and pass that folder with the run tool's carry, as the lead's .devcarry/ is.)
R=/tmp/r; mkdir -p $R; T0=$(date +%s)
left() { echo $(( ${1} - ($(date +%s) - T0) )); }
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; git log -1 --format=%H 2>/dev/null; date -u; } > $OUT/device.txt
cat $OUT/device.txt
OUT=$R BATCH=64 PROMPTS=192 NEW=128 timeout 80 python3 "${ANCHOR:-../shared/anchors/torch_job_anchor.py}" > $OUT/anchor-b64.txt 2>&1
tail -3 $OUT/anchor-b64.txt; echo "t=$(( $(date +%s) - T0 ))"
(OUT=$R/b64 timeout 150 bash results/h200/recipes/job_b64.sh > $R/b64.log 2>&1); cat $R/b64.log; echo "t=$(( $(date +%s) - T0 ))"
for sl in 64 16; do for run in 1 2; do
  timeout 50 python3 -m ddtree_jax.cli --prompts /tmp/heldout-192.jsonl --max-new-tokens 128 --batch-size 64 --method ar \
    --prefill-slots $sl --compile-cache /tmp/cc-b64 --out /tmp/b64s.jsonl --overwrite > $R/slots-$sl-$run.txt 2>&1
done; echo "== slots $sl"; sed -n 2,6p $R/slots-$sl-2.txt; done; echo "t=$(( $(date +%s) - T0 ))"
# the job program's optimized HLO at batch 64: cache-sized copies inside the round loop? (on the CPU,
# 2026-12-07, both the job's and the bench's round bodies copy every layer's K and V twice a round; the
# bench's GPU rounds at 8B ran at 1.04x the HBM floor, so the GPU likely elides them: this checks the job)
XLA_FLAGS="--xla_dump_to=$R/hlo --xla_dump_hlo_as_text --xla_dump_hlo_pass_re=^$" timeout 60 python3 -m ddtree_jax.cli \
  --prompts /tmp/heldout-192.jsonl --max-new-tokens 128 --batch-size 64 --method ar --compile-cache off \
  --out /tmp/b64d.jsonl --overwrite > $R/dump.txt 2>&1
for f in $R/hlo/*run_job*after_optimizations.txt; do
  echo "$f: $(grep -c ' copy(' $f) copies; cache-shaped: $(grep -oE 'bf16\[64,[0-9]+,[0-9]+,[0-9]+\][^ ]* copy\(' $f | sort | uniq -c)"
done | tee $OUT/hlo-copies.txt; echo "t=$(( $(date +%s) - T0 ))"
for f in $R/b64.log $R/b64/*.txt $R/slots-*.txt; do echo "#### $f"; cat $f; done > $OUT/b64-all.txt
cp $R/b64/rounds.json $OUT/b64-rounds.json 2>/dev/null
S="python3 -m ddtree_jax.bench scheduling --shape qwen3-8b --dtype bfloat16 --attention pallas --prompts 64
  --min-len 16 --max-len 512 --max-new-tokens 64 --stop-fraction 0 --batch-size 16 --reps 2 --method ar --min-new-tokens 8"
# refill_at 1 (today's), 4 (wait for more free rows), and prefill slots 4 (less padding a pass: docs/scheduling.md)
for v in "r1 --refill-at 1" "r4 --refill-at 4" "s4 --prefill-slots 4"; do
  l=$(left 460); [ $l -gt 40 ] || break
  timeout $(( l < 80 ? l : 80 )) $S ${v#* } --skip-static --deadline-s 60 --out $R/spread-${v%% *}.json > $R/spread-${v%% *}.txt 2>&1
done; echo "t=$(( $(date +%s) - T0 ))"
python3 - $R <<'PY' | tee $OUT/spread-summary.txt
import json, sys
from pathlib import Path
for f in sorted(Path(sys.argv[1]).glob("spread-*.json")):
    d = json.loads(f.read_text()); c = d.get("continuous", {})
    print(f.stem, {k: v for k, v in c.items() if k not in ("rounds_per_prompt", "compiled", "generate_s_runs")})
PY
for f in $R/spread-*.txt; do echo "#### $f"; tail -20 $f; done > $OUT/spread-logs.txt
l=$(left 560)
if [ $l -gt 50 ]; then
  for f in "" --unfused-projections; do
    timeout $(( l / 2 )) python3 -m ddtree_jax.bench rounds --shape qwen3-8b --budgets 15 --rounds 16 --deadline-s $(( l / 2 - 25 )) \
      --methods ar,ddtree --batch-sizes 16 --contexts 1024 --attention pallas --compile-cache off $f \
      --out $R/fp8b$f.json > $R/fp8b$f.log 2>&1
  done
fi
python3 - $R <<'PY' | tee $OUT/fp-summary.txt
import glob, json, sys
for p in sorted(glob.glob(f"{sys.argv[1]}/fp8b*.json")):
    d = json.load(open(p))
    for r in d["rows"]:
        print(p.split("/")[-1], r["method"], r["batch_size"], r.get("round_ms"), r.get("error"), d.get("skipped"))
PY
for f in $R/fp8b*.log; do echo "#### $f"; tail -15 $f; done > $OUT/fp-logs.txt
echo "t=$(( $(date +%s) - T0 ))"
