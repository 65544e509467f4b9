#!/usr/bin/env bash
# Issue 30 item 4 on one H200 (~4 min; not run yet): the cost of --logprobs 5 on ddtree-generate's main
# job (the bundled pair, bf16, continuous batching, ddtree at its default budget). Each pair of runs is
# the same job without and with log-probabilities:
#   greedy-off / greedy-k5        greedy, --logprobs 5 (raw)
#   sampled-off / sampled-k5      --temperature 0.7 --top-p 0.9 --seed 1, --logprobs 5 --logprobs-mode processed
# The four jobs run twice, in the order off, on, off, on (passes 1 and 2; pass 1 also fills the compile
# cache). tok/s from each summary line (compilation excluded), the ratio from the two passes' means;
# whether off and on wrote the same tokens. Goal: on within 5% of off. summary.json holds the figures.
# Run from the repository root:  OUT=$OUT bash results/h200/recipes/logprobs.sh
# ddtree-generate takes no --deadline-s: `timeout` ($LIMIT s, default 35) bounds each run.
# A CPU check at toy size (PAIR: flags naming another pair):  MAX_NEW=8 LIMIT=300 PY=python3 \
#   PAIR="--target tests/fixtures/qwen3_gqa4_tp --draft tests/fixtures/dflash_qwen3_gqa4_tp \
#   --prompts tests/fixtures/prompts.jsonl --dtype float32" OUT=/tmp/lp bash results/h200/recipes/logprobs.sh
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/logprobs-cost} PY=${PY:-python3} MAX_NEW=${MAX_NEW:-128} LIMIT=${LIMIT:-35} PAIR=${PAIR:-}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv > "$OUT/gpu.txt" 2>&1
SAMPLED="--temperature 0.7 --top-p 0.9 --seed 1"
G="timeout $LIMIT $PY -m ddtree_jax.cli $PAIR --max-new-tokens $MAX_NEW --overwrite"
for pass in 1 2; do
  # shellcheck disable=SC2086  # G and SAMPLED are word lists
  $G --out "$OUT/$pass-greedy-off.jsonl" > "$OUT/$pass-greedy-off.log" 2>&1
  # shellcheck disable=SC2086
  $G --out "$OUT/$pass-greedy-k5.jsonl" --logprobs 5 > "$OUT/$pass-greedy-k5.log" 2>&1
  # shellcheck disable=SC2086
  $G --out "$OUT/$pass-sampled-off.jsonl" $SAMPLED > "$OUT/$pass-sampled-off.log" 2>&1
  # shellcheck disable=SC2086
  $G --out "$OUT/$pass-sampled-k5.jsonl" $SAMPLED --logprobs 5 --logprobs-mode processed \
    > "$OUT/$pass-sampled-k5.log" 2>&1
done
$PY - "$OUT" <<'PY' | tee "$OUT/summary.txt"
import json, re, sys
from pathlib import Path

out = Path(sys.argv[1])

def tok_s(name):
    found = []
    for n in (1, 2):
        log = out / f"{n}-{name}.log"
        m = re.search(r"generation: [\d.]+ s \(([\d.]+) tok/s\)", log.read_text()) if log.exists() else None
        found += [float(m.group(1))] if m else []
    return found

def tokens(name):
    p = out / f"2-{name}.jsonl"
    if not p.exists():
        return None
    return {d["id"]: d["output_ids"] for d in map(json.loads, p.read_text().splitlines())}

figures = {}
for job in ("greedy", "sampled"):
    off, on = tok_s(f"{job}-off"), tok_s(f"{job}-k5")
    f = {"off_tok_s": off, "k5_tok_s": on}
    if off and on:
        ratio = (sum(off) / len(off)) / (sum(on) / len(on))
        f["k5_over_off_time"] = round(ratio, 4)
        f["within_5pct"] = ratio <= 1.05
    f["same_tokens"] = tokens(f"{job}-off") is not None and tokens(f"{job}-off") == tokens(f"{job}-k5")
    figures[job] = f
    print(job, f)
(out / "summary.json").write_text(json.dumps(figures, indent=1))
PY
