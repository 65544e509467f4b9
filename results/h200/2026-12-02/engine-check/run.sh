#!/usr/bin/env bash
# Issue 28 on one H200 (~4 min): the one-engine code (this checkout) beside the code before it ($OLD, a
# copy of the previous tree inside the repository root; make it before the call:
# `mkdir old && git archive <previous commit> | tar -x -C old`). Each measurement runs old, then new:
#   rounds-{old,new}.json  ddtree-bench, Qwen3-8B shape (random bf16 weights), Pallas attention, batch 1,
#                          1k context: the ar step and the ddtree rounds at budgets 15 and 63 (round_ms:
#                          the median of 3 calls of 32 rounds in the device loop)
#   pair-{old,new}.*       ddtree-generate's main job on the bundled pair (the default path: bf16,
#                          continuous batching): tok/s from its summary line (compilation excluded),
#                          and whether old and new wrote the same tokens
# Goal: new within 3% of old on each figure; summary.json holds each pair and its ratio.
# Run from the repository root (OUT absolute):  OUT=$OUT OLD=old bash results/h200/2026-12-02/engine-check/run.sh
# The old tree's ddtree-bench (one command, --batches) and ddtree-generate take no --deadline-s:
# `timeout` bounds those; the new ddtree-bench stops at its own --deadline-s.
# A CPU check at toy size: SHAPE=tiny ATTENTION=reference MAX_NEW=8 OUT=/tmp/ec OLD=old PY=python3 bash $0
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/engine-check} OLD=${OLD:-old} PY=${PY:-python3}
SHAPE=${SHAPE:-qwen3-8b} ATTENTION=${ATTENTION:-pallas} MAX_NEW=${MAX_NEW:-128}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv > "$OUT/gpu.txt" 2>&1
R="--shape $SHAPE --attention $ATTENTION --rounds 32 --methods ar,ddtree --budgets 15,63 --contexts 1024"
# shellcheck disable=SC2086  # R is a word list
(cd "$OLD" && timeout 75 $PY -m ddtree_jax.bench $R --batches 1 --out "$OUT/rounds-old.json") > "$OUT/rounds-old.log" 2>&1
# shellcheck disable=SC2086
$PY -m ddtree_jax.bench rounds $R --batch-sizes 1 --deadline-s 45 --out "$OUT/rounds-new.json" > "$OUT/rounds-new.log" 2>&1
(cd "$OLD" && timeout 120 $PY -m ddtree_jax.cli --max-new-tokens "$MAX_NEW" --out "$OUT/pair-old.jsonl") \
  > "$OUT/pair-old.log" 2>&1
timeout 120 $PY -m ddtree_jax.cli --max-new-tokens "$MAX_NEW" --out "$OUT/pair-new.jsonl" > "$OUT/pair-new.log" 2>&1
$PY - "$OUT" <<'PY' | tee "$OUT/summary.txt"
import json, re, sys
from pathlib import Path

out = Path(sys.argv[1])

def rounds(side):
    p = out / f"rounds-{side}.json"
    rows = json.loads(p.read_text())["rows"] if p.exists() else []
    return {f"{r['method']}{r.get('budget') or ''}_round_ms": r["round_ms"] for r in rows if "round_ms" in r}

def pair(side):
    log = out / f"pair-{side}.log"
    m = re.search(r"generation: [\d.]+ s \(([\d.]+) tok/s\)", log.read_text()) if log.exists() else None
    return {"pair_tok_s": float(m.group(1))} if m else {}

def tokens(side):
    p = out / f"pair-{side}.jsonl"
    if not p.exists():
        return None
    return {d["id"]: d.get("output_ids") for d in map(json.loads, p.read_text().splitlines())}

old, new = rounds("old") | pair("old"), rounds("new") | pair("new")
figures = {k: {"old": old.get(k), "new": new.get(k)} for k in sorted(old.keys() | new.keys())}
for k, f in figures.items():
    if f["old"] and f["new"]:
        slower = f["new"] / f["old"] if k.endswith("_ms") else f["old"] / f["new"]
        f["new_over_old_time"] = round(slower, 4)
        f["within_3pct"] = slower <= 1.03
    print(k, f)
same = tokens("new") is not None and tokens("old") == tokens("new")
print("same tokens old/new:", same)
(out / "summary.json").write_text(json.dumps({"figures": figures, "same_tokens": same}, indent=1))
PY
