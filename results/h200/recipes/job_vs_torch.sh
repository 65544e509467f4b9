#!/usr/bin/env bash
# The main job beside a gpt-fast-style PyTorch job, one device call (issue 50): the anchor at batch 16
# (96 prompts x 128) and 64 (192 x 128), then the README's main job on the held-out prompts (ar and ddtree
# at batch 16, ar at 64 on the prompts twice over; each run twice on one warm compile cache, the second
# counted) and the host loop beside the device job; prints ours / PyTorch. With EIGHT_B=1 also the Qwen3-8B
# shape (random bf16 weights, 64 prompts of 128 tokens x 64, batch 16): the anchor and `ddtree-bench
# scheduling` (continuous and static).
# HOST_LOOP=0 leaves the host-loop run out, DDTREE_B64=0 ddtree at batch 64, CACHES=0 the two runs
# below; GRAPHS=1 adds ar and ddtree at batch 16 under the 'graphs' XLA preset (xla_flags.py). The ar job at batch 16 also
# runs without the serialized executables (JAX's compile cache only) and with no compile cache at all.
#   ANCHOR=path/to/torch_job_anchor.py [EIGHT_B=1] bash results/h200/recipes/job_vs_torch.sh   (under $OUT)
set -u
OUT=${OUT:-/tmp/job-vs-torch}; mkdir -p "$OUT"
ANCHOR=${ANCHOR:-../shared/anchors/torch_job_anchor.py}
CACHE=/tmp/ddtree-job-cache
P96=results/heldout-prompts-96.jsonl
P192=/tmp/heldout-192.jsonl
python3 results/h200/recipes/heldout_twice.py "$P192"
nvidia-smi --query-gpu=name --format=csv,noheader > "$OUT/device.txt"
git log -1 --format=%H > "$OUT/commit.txt" 2>/dev/null
for b in 16 64; do
  n=$(( b == 16 ? 96 : 192 ))
  OUT="$OUT" BATCH=$b PROMPTS=$n NEW=128 timeout 150 python3 "$ANCHOR" > "$OUT/anchor-b$b.txt" 2>&1
done
job() {  # name, then ddtree-generate flags
  local name=$1; shift
  for run in 1 2; do
    timeout 120 python3 -m ddtree_jax.cli --max-new-tokens 128 --compile-cache "$CACHE" \
      --out "/tmp/$name-$run.jsonl" --overwrite "$@" > "$OUT/$name-$run.txt" 2>/dev/null
  done
}
job ar-b16 --prompts "$P96" --batch-size 16 --method ar
job ddtree-b16 --prompts "$P96" --batch-size 16 --method ddtree
job ar-b64 --prompts "$P192" --batch-size 64 --method ar
[ "${DDTREE_B64:-1}" = 1 ] && job ddtree-b64 --prompts "$P192" --batch-size 64 --method ddtree
[ "${HOST_LOOP:-1}" = 1 ] && job ar-b16-hostloop --prompts "$P96" --batch-size 16 --method ar --host-loop
if [ "${CACHES:-1}" = 1 ]; then
  DDTREE_EXECUTABLES=off job ar-b16-noexec --prompts "$P96" --batch-size 16 --method ar  # JAX's cache only
  job ar-b16-nocache --prompts "$P96" --batch-size 16 --method ar --compile-cache off  # compiled in-process
fi
if [ "${GRAPHS:-0}" = 1 ]; then  # the 'graphs' XLA preset: while loops and conditionals inside CUDA graphs
  DDTREE_XLA_PRESET=graphs job ar-b16-graphs --prompts "$P96" --batch-size 16 --method ar
  DDTREE_XLA_PRESET=graphs job ddtree-b16-graphs --prompts "$P96" --batch-size 16 --method ddtree
fi
if [ -n "${EIGHT_B:-}" ]; then  # the Qwen3-8B shape: 64 prompts of 128 tokens x 64, batch 16, both sides
  OUT="$OUT" SHAPE=qwen3-8b BATCH=16 PROMPTS=64 NEW=64 PLEN=128 timeout 200 python3 "$ANCHOR" \
    > "$OUT/anchor-8b-b16.txt" 2>&1
  timeout 240 python3 -m ddtree_jax.bench scheduling --shape qwen3-8b --dtype bfloat16 --attention pallas \
    --prompts 64 --min-len 128 --max-len 128 --max-new-tokens 64 --stop-fraction 0 --batch-size 16 \
    --method ar --reps 2 --deadline-s 200 --out "$OUT/8b-ar-b16.json" > "$OUT/8b-ar-b16.txt" 2>&1
fi
python3 - "$OUT" <<'PY'
import json, re, sys
from pathlib import Path
out = Path(sys.argv[1])
def tok_s(name):
    text = (out / name).read_text() if (out / name).exists() else ""
    m = re.search(r"\(([\d.]+) tok/s\)", text)
    return float(m.group(1)) if m else None
rows = {}
for b in (16, 64):
    text = (out / f"anchor-b{b}.txt").read_text()
    m = re.findall(r"\{.*\}", text)
    anchor = json.loads(m[-1]) if m else {}
    rows[f"anchor-b{b}"] = anchor
    for method in ("ar", "ddtree"):
        ours = tok_s(f"{method}-b{b}-2.txt")
        tps = anchor.get("tok_s") or anchor.get("tokens_per_s")
        rows[f"{method}-b{b}"] = {"tok_s": ours, "first_run_tok_s": tok_s(f"{method}-b{b}-1.txt"),
                                 "vs_torch": round(ours / tps, 3) if ours and tps else None}
rows["ar-b16-hostloop"] = {"tok_s": tok_s("ar-b16-hostloop-2.txt")}
rows["ar-b16-noexec"] = {"tok_s": tok_s("ar-b16-noexec-2.txt")}
rows["ar-b16-nocache"] = {"tok_s": tok_s("ar-b16-nocache-2.txt")}
for name in ("ar-b16-graphs", "ddtree-b16-graphs"):
    rows[name] = {"tok_s": tok_s(f"{name}-2.txt"), "first_run_tok_s": tok_s(f"{name}-1.txt")}
(out / "summary.json").write_text(json.dumps(rows, indent=1))
print(json.dumps(rows, indent=1))
PY
