#!/usr/bin/env bash
# Issue 39 item 1 on one H100/H200 (~4 min): kernels per round and ms per round of the bundled pair's
# shape (`default-pair`, 2-layer drafter, block 16, 1k context, Pallas attention, bf16 random weights),
# ar step and ddtree 7 round, batch 1 and 16, per tree build variant (tree.BUILD_VARIANTS: `paths` = the
# scan, the engine's build before issue 39; `paths-unrolled` = the GPU default since; `ranked` = straight-
# line beams selected by pairwise rank, no sort kernels) and per XLA flag preset (ddtree_jax/xla_flags.py:
# `xla` = XLA's own command buffers, `graphs` = + while loops and conditionals in the CUDA graphs, graphs of
# any size), by `ddtree-bench profile --programs round` (one warm call, 2 untraced calls of 64 rounds = the
# ms per round, then 2 traced calls = the kernels). Steps, most wanted first (each under --deadline-s and
# a `timeout`; a step cut short keeps the rows it wrote):
#   1-2. xla / paths           batch 1, 16   (the baseline: 368 / 362 kernels, 0.437 / 0.584 ms on 12-03)
#   3-4. xla / paths-unrolled  batch 1, 16   (the new default)
#   5-6. graphs / paths-unrolled  batch 1, 16
#   7-8. xla / ranked          batch 1, 16
# Then a table (printed and $OUT/launches.txt): preset, build, batch, program, kernels per round, untraced
# ms per round, us per kernel, the ddtree round over the ar step.
# Answers: item 1's "kernels per round and us per kernel before and after" (1-2 against 3-4 and 7-8); the
# goal "ddtree 7 round <= 2.0x the ar step at batch 16" (the ratio column); whether `graphs` should become
# xla_flags.DEFAULT_PRESET (5-6 against 3-4: lower ms per round, the same kernels).
# Run from the repository root:  OUT=$OUT bash results/h200/recipes/launches.sh   (PY=echo: print only)
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.9}
OUT=${OUT:-/tmp/launches} PY=${PY:-python3}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$OUT/gpu.txt" 2>&1
START=$(date +%s)
step() {  # preset build batch
  local left=$((225 - $(date +%s) + START))
  [ "$left" -gt 20 ] || { echo "skipped $1 $2 b$3 (time)" | tee -a "$OUT/skipped.txt"; return; }
  DDTREE_XLA_PRESET=$1 timeout $((left + 15)) $PY -m ddtree_jax.bench profile --shape default-pair \
    --draft-layers 2 --block-size 16 --context 1024 --attention pallas --methods ar,ddtree --budgets 7 \
    --programs round --rounds 64 --iters 2 --build-variant "$2" --batch-size "$3" \
    --deadline-s $((left - 10)) --out "$OUT/$1-$2-b$3.json" > "$OUT/$1-$2-b$3.log" 2>&1
  echo "$1 $2 b$3: rc $? after $(($(date +%s) - START)) s"
}
for run in "xla paths" "xla paths-unrolled" "graphs paths-unrolled" "xla ranked"; do
  for batch in 1 16; do step $run $batch; done
done
$PY - "$OUT" <<'EOF' | tee "$OUT/launches.txt"
import glob, json, os, sys
print("preset build batch program kernels/round ms/round us/kernel round/ar")
for f in sorted(glob.glob(os.path.join(sys.argv[1], "*-b*.json"))):
    d = json.load(open(f))
    preset, build = os.path.basename(f).rsplit("-b", 1)[0].split("-", 1)
    rows = {r.get("name"): r for r in d["rows"]}
    ar = rows.get("ar_round", {}).get("untraced_wall_ms_per_round")
    for name, r in rows.items():
        if "error" in r:
            print(preset, build, d["meta"].get("batch_size", "?"), r.get("method"), "error:", r["error"][:120])
            continue
        ms = r["untraced_wall_ms_per_round"]
        ratio = f"{ms / ar:.2f}" if ar and name != "ar_round" else "-"
        print(preset, build, r["batch_size"], name, f"{r['kernels_per_round']:.0f}", f"{ms:.3f}",
              f"{r['us_per_kernel']:.2f}", ratio)
EOF
echo "total $(($(date +%s) - START)) s"
