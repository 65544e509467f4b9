#!/usr/bin/env bash
# Issue 32 (the whole job's cost) on one H200 (~7 min), results under $OUT:
#   load.json      item 4: the Qwen3-8B shape's 16.4 GB of safetensors (random bf16, 4 GB shards): cold
#                  (drop_caches when root may) and warm loads, the --params-cache convert and its orbax
#                  restores, GB/s (ddtree-bench load)
#   torch_graph.json  item 3: a plain-PyTorch decode step of the `tiny` and `default-pair` shapes at 1k
#                  context, batch 1 and 16, T = 1 and 8: eager, one-step CUDA graph replays, one 16-step
#                  graph (ddtree-bench torch-step)
#   rows_{tiny,default_pair}.json  item 3: ddtree-bench rows of the same shapes: ar and ddtree 7 at
#                  batch 1 and 16
#   profile_default_pair_b16.json  item 3: where a default-pair round's time goes (kernels, busy vs
#                  wall), batch 16, ar and ddtree 7 (ddtree-bench profile)
# Run from the repository root:  OUT=$OUT bash results/h200/2026-12-02/load-and-graphs/run.sh   (PY=echo: print only)
set -u
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.95}
OUT=${OUT:-/tmp/jobcost} PY=${PY:-python3}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$OUT/gpu.txt" 2>&1
{ nproc; free -g; } > "$OUT/host.txt" 2>&1
$PY -m ddtree_jax.bench load --shape qwen3-8b --reps 1 --dir /tmp/ddtree_load --deadline-s 200 \
  --out "$OUT/load.json" > "$OUT/load.log" 2>&1
$PY -m ddtree_jax.bench torch-step --shapes tiny,default-pair --batch-sizes 1,16 --tokens 1,8 --context 1024 \
  --deadline-s 90 --out "$OUT/torch_graph.json" > "$OUT/torch_graph.log" 2>&1
B="$PY -m ddtree_jax.bench rounds --draft-layers 2 --block-size 16 --methods ar,ddtree --budgets 7 --batch-sizes 1,16"
$B --shape tiny --contexts 1024 --attention pallas --rounds 64 --deadline-s 60 --out "$OUT/rows_tiny.json" \
  > "$OUT/tiny_rows.log" 2>&1
$B --shape default-pair --contexts 1024 --attention pallas --rounds 64 --deadline-s 60 \
  --out "$OUT/rows_default_pair.json" >> "$OUT/tiny_rows.log" 2>&1
$PY -m ddtree_jax.bench profile --shape default-pair --draft-layers 2 --block-size 16 --batch-size 16 --context 1024 \
  --methods ar,ddtree --budgets 7 --attention pallas --programs round --rounds 16 --deadline-s 60 \
  --out "$OUT/profile_default_pair_b16.json" > "$OUT/tiny_profile.log" 2>&1
