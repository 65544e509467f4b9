#!/usr/bin/env bash
# Issue 42 item 1 on one H200 (~4 min): the Qwen3-8B-shape target's decoder stack unrolled (the default)
# against one lax.scan over stacked layers (`ddtree-bench rounds --scan-layers`), in one session on one
# card: ar and ddtree 15 rounds at batch 1 and 16, 1k context, Pallas attention, bf16 random weights,
# each row with its round ms and compile_s; then the compile at 9 layers, for the 36-vs-9 ratio. Every
# step is bounded by its own --deadline-s; each JSON starts with the run header (provenance).
# Run from the repository root:  OUT=$OUT bash results/h200/recipes/scan_layers.sh
# Answers: run time with scan <= 1.03x unrolled at batch 1 and 16 (round_ms of scan36.json against
# unrolled36.json, per method and batch) decides the default; compile_s of scan36 / scan9 <= 1.5 (the
# unrolled ratio, unrolled36 / unrolled9, was 2.3x on the H200 on 2026-12-04).
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/scan-layers} PY=${PY:-python3}
# (SHAPE, ATTN, BATCHES: a CPU smoke run of this script, e.g. SHAPE=default-pair ATTN=reference)
SHAPE=${SHAPE:-qwen3-8b} ATTN=${ATTN:-pallas} BATCHES=${BATCHES:-1,16}
mkdir -p "$OUT"
R="$PY -m ddtree_jax.bench rounds --shape $SHAPE --methods ar,ddtree --budgets 15 --attention $ATTN --compile-cache off"
for way in unrolled scan; do
  flag=$([ $way = scan ] && echo --scan-layers)
  $R $flag --num-layers 36 --batch-sizes $BATCHES --contexts 1024 --rounds 16 --deadline-s 60 \
    --out "$OUT/${way}36.json" > "$OUT/${way}36.log" 2>&1
done
for way in unrolled scan; do
  flag=$([ $way = scan ] && echo --scan-layers)
  $R $flag --num-layers 9 --batch-sizes 1 --contexts 1024 --rounds 2 --deadline-s 35 \
    --out "$OUT/${way}9.json" > "$OUT/${way}9.log" 2>&1
done
$PY - "$OUT" <<'PY' > "$OUT/summary.txt" 2>&1
import json, sys
out = sys.argv[1]
rows = {}
for way in ("unrolled", "scan"):
    for layers in (36, 9):
        try:
            data = json.load(open(f"{out}/{way}{layers}.json"))
        except (OSError, ValueError) as e:
            print(way, layers, "missing:", e)
            continue
        for r in data["rows"]:
            rows[way, layers, r.get("method"), r.get("batch_size")] = r
print("layers method batch | unrolled ms  scan ms  ratio | unrolled compile_s  scan compile_s")
for (way, layers, method, batch), r in sorted(rows.items(), key=lambda kv: (kv[0][1], kv[0][2], kv[0][3])):
    if way != "unrolled":
        continue
    s = rows.get(("scan", layers, method, batch), {})
    u_ms, s_ms = r.get("round_ms"), s.get("round_ms")
    ratio = s_ms / u_ms if u_ms and s_ms else None
    print(layers, method, batch, "|", u_ms, s_ms, ratio, "|", r.get("compile_s"), s.get("compile_s"), r.get("error") or s.get("error") or "")
PY
cat "$OUT/summary.txt"
date -u
