#!/usr/bin/env bash
# Issue 32 (the whole job's cost) on one H200, results under $OUT. Two device calls:
#   OUT=$OUT DEADLINE=560 bash scripts/h200_jobcost.sh                  # call A (~7.5 min)
#   OUT=$OUT DEADLINE=570 STEPS=batch_sweep bash scripts/h200_jobcost.sh  # call B (~8 min)
# Call A, in order (what a cut loses last comes first):
#   compile_cache (~100 s)  item 1: the bundled pair's main job on the held-out prompts (96, 128 new
#                 tokens, batch 16), ddtree then ar, each run twice against an empty --compile-cache:
#                 the summaries' "compile:" seconds, first run against second; also item 3's end-to-end
#                 ddtree/ar tokens/s at batch 16
#   load (~150 s)  item 4: the Qwen3-8B shape's 16.4 GB of safetensors (random bf16, 4 GB shards):
#                 cold (drop_caches when root may) and warm loads, the --params-cache convert and its
#                 orbax restores, GB/s (ddtree-bench load)
#   torch_graph (~45 s)  item 3: a plain-PyTorch decode step of the `tiny` and `default-pair` shapes at
#                 1k context, batch 1 and 16, T = 1 and 8: eager, one-step CUDA graph replays, one
#                 16-step graph (scripts/torch_graph_step.py)
#   tiny_rows (~90 s)  item 3: ddtree-bench rows of the same shapes: ar and ddtree 7 at batch 1 and 16
#   tiny_profile (~60 s)  item 3: where a default-pair round's time goes (kernels, busy vs wall),
#                 batch 16, ar and ddtree 7 (ddtree-bench profile)
# Call B:
#   batch_sweep (~480 s)  item 5: the Qwen3-8B shape, 1k context, rows 16/32/64/128/256: ar, dflash and
#                 ddtree 3/7/15 round times (ddtree-bench writes its JSON after every row: a cut keeps
#                 the smaller batches, which come first)
# DRY_RUN=1 prints the commands only.
set -u
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.95}
OUT=${OUT:-/tmp/jobcost}
DEADLINE=${DEADLINE:-560}
PY=${PY:-python3}
DRY_RUN=${DRY_RUN:-0}
STEPS=${STEPS:-compile_cache load torch_graph tiny_rows tiny_profile}
mkdir -p "$OUT"
source "$(dirname "$0")/h200_lib.sh"
[ "$DRY_RUN" = 1 ] || nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$OUT/gpu.txt" 2>&1
[ "$DRY_RUN" = 1 ] || { nproc; free -g; } > "$OUT/host.txt" 2>&1

G="$PY -m ddtree_jax.cli --prompts results/heldout-prompts-96.jsonl --max-new-tokens 128 --batch-size 16"
# shellcheck disable=SC2086  # G is a word list
step compile_cache 60 200 bash -c "set -e; rm -rf $OUT/xla
  for method in ddtree ar; do for run in first second; do echo \"== \$method \$run\"
    $G --method \$method --compile-cache $OUT/xla --out $OUT/gen_\${method}_\$run.jsonl --overwrite; done; done
  du -sh $OUT/xla; ls $OUT/xla/*/ | wc -l"
step load 60 300 $PY -m ddtree_jax.bench load --shape qwen3-8b --repeats 1 --dir /tmp/ddtree_load \
  --out "$OUT/load.json"
step torch_graph 20 120 $PY scripts/torch_graph_step.py --shapes tiny,default-pair --batches 1,16 \
  --tokens 1,8 --context 1024 --out "$OUT/torch_graph.json"
B="$PY -m ddtree_jax.bench rounds --draft-layers 2 --block-size 16 --methods ar,ddtree --budgets 7 --batches 1,16"
# shellcheck disable=SC2086  # B is a word list
step tiny_rows 30 180 bash -c "$B --shape tiny --contexts 1024 --attention pallas --rounds 64 --out $OUT/rows_tiny.json &&
  $B --shape default-pair --contexts 1024 --attention pallas --rounds 64 --out $OUT/rows_default_pair.json"
step tiny_profile 30 120 $PY -m ddtree_jax.bench profile --shape default-pair --draft-layers 2 --block-size 16 \
  --batch 16 --context 1024 --methods ar,ddtree --budget 7 --attention pallas --programs round --rounds 16 \
  --out "$OUT/profile_default_pair_b16.json"
step batch_sweep 60 560 $PY -m ddtree_jax.bench rounds --shape qwen3-8b --contexts 1024 --batches 16,32,64,128,256 \
  --methods ar,dflash,ddtree --budgets 3,7,15 --attention pallas --rounds 8 --out "$OUT/batch_sweep.json"
date -u
