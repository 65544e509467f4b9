#!/usr/bin/env bash
# Issue 41, goal 3 on one H200 (~4 min): the cost of a DFlash2 drafter's convolutions, sliding layers and
# candidate selector in a round. ddtree-bench rounds, Qwen3-8B shape (random bf16 weights), Pallas
# attention, batch 1 and 16, 1k context, a 5-layer block-8 drafter, methods dflash and ddtree (budgets 7
# and 15), --stages (each stage alone in a device loop): first the v1 drafter, then the same with
# --dflash2 (the published Qwen3.8-27B-DFlash2's settings: 2 conv taps, groups of 16, selector rank 256,
# top-16 candidates, every layer sliding with window 2048, not causal). Each run stops at --deadline-s
# 100 and is capped by `timeout` 130 s.
# Answers: round_ms of dflash2.json over v1.json per (method, budget, batch) (goal: <= 1.1), and where
# the difference goes (the draft and build stage times); summary.txt prints the ratios.
# Run from the repository root:  OUT=$OUT bash results/h200/recipes/dflash2_rounds.sh
# A CPU check at toy size: SHAPE=tiny ATTENTION=reference OUT=/tmp/d2 bash results/h200/recipes/dflash2_rounds.sh
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
OUT=${OUT:-/tmp/dflash2-rounds} PY=${PY:-python3}
SHAPE=${SHAPE:-qwen3-8b} ATTENTION=${ATTENTION:-pallas}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv > "$OUT/gpu.txt" 2>&1
R="--shape $SHAPE --attention $ATTENTION --draft-layers 5 --block-size 8 --methods dflash,ddtree --budgets 7,15"
R="$R --batch-sizes 1,16 --contexts 1024 --rounds 16 --stages --deadline-s 100"
# shellcheck disable=SC2086  # R is a word list
timeout 130 $PY -m ddtree_jax.bench rounds $R --out "$OUT/v1.json" > "$OUT/v1.log" 2>&1
# shellcheck disable=SC2086
timeout 130 $PY -m ddtree_jax.bench rounds $R --dflash2 --out "$OUT/dflash2.json" > "$OUT/dflash2.log" 2>&1
$PY - "$OUT" <<'PY' | tee "$OUT/summary.txt"
import json, sys
from pathlib import Path

out = Path(sys.argv[1])

def rows(name):
    p = out / f"{name}.json"
    found = json.loads(p.read_text())["rows"] if p.exists() else []
    return {(r["method"], r.get("budget"), r.get("batch_size")): r for r in found if "round_ms" in r}

v1, v2 = rows("v1"), rows("dflash2")
print("method budget batch | v1 round ms | dflash2 round ms | ratio | device-loop stage ms v1, dflash2")
for key in sorted(v1, key=str):
    if key in v2:
        a, b = v1[key]["round_ms"], v2[key]["round_ms"]
        d1, d2 = v1[key].get("device_stages_ms") or {}, v2[key].get("device_stages_ms") or {}
        stages = {s: (d1.get(s), d2.get(s)) for s in ("draft", "build")}
        print(*key, "|", f"{a:.3f} | {b:.3f} | {b / a:.3f} |", stages)
PY
date -u
