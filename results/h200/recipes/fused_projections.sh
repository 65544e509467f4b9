#!/usr/bin/env bash
# Fused q/k/v and gate/up projections (the default) against the five projection weights a layer
# (`--unfused-projections`), issue 50: ar and ddtree rounds at batch 1 and 16, 1k context, Pallas attention,
# on the bundled pair (ddtree 7, 2 draft layers) and the Qwen3-8B shape (ddtree 15). ~4 minutes.
# The answer: round_ms of <shape>.json against <shape>-unfused.json, each method and batch size.
#   bash results/h200/recipes/fused_projections.sh   (writes under $OUT)
set -u
OUT=${OUT:-/tmp/fused-projections}; mkdir -p "$OUT"
for s in "default-pair --draft-layers 2 --budgets 7 --rounds 64 --deadline-s 25" \
         "qwen3-8b --budgets 15 --rounds 16 --deadline-s 55"; do
  for f in "" --unfused-projections; do
    name="${s%% *}${f:+-unfused}"
    python3 -m ddtree_jax.bench rounds --shape $s --methods ar,ddtree --batch-sizes 1,16 --contexts 1024 \
      --attention pallas --compile-cache off $f --out "$OUT/$name.json" > "$OUT/$name.log" 2>&1
  done
done
python3 - "$OUT" <<'PY'
import glob, json, sys
for p in sorted(glob.glob(f"{sys.argv[1]}/*.json")):
    d = json.load(open(p))
    for r in d["rows"]:
        print(p.split("/")[-1], r["method"], r["batch_size"], r.get("round_ms"), r.get("error"), d["skipped"])
PY
