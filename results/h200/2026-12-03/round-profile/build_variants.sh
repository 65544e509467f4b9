#!/usr/bin/env bash
# The tree build alone (`tree.lattice_tree`, jitted on its own, random sorted drafter log-probs), per
# build variant (paths = the engine's default, paths-unrolled, climb), at the bundled pair's build shape,
# on one H200 (~1-3 min): depth 15 (the bundled drafter's block 16 - 1), branching 7 (what the engine
# uses at the bundled pair's budget 7: budgets.default_branching = min(budget, 32), pair.make_plan /
# Settings.with_budget; vocabulary 4096 does not cap it), batch 1 and 16, budgets 7 and 15, by
# `ddtree-bench tree` (per row: compile_s = lower + compile of the standalone jit, median_us = median
# synced wall of 200 calls, host dispatch included). A follow-up of README.md beside this: the round
# profile put ~0.18 ms of the ddtree 7 round in the build's 15-step beam scan (inferred from command
# buffers).
#   build_variants.json / .log        the brief's cases, branching 7
#   build_variants_k15.json / .log    budget 15 at branching 15 (the engine's branching for budget 15,
#                                     the bundled pair's default budget at batch 1)
# Each command stops starting new rows at its --deadline-s (compiles take ~1-3 s each).
# Run from the repository root:  OUT=$OUT bash results/h200/2026-12-03/round-profile/build_variants.sh   (PY=echo: print only)
set -u
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.95}
OUT=${OUT:-/tmp/build-variants} PY=${PY:-python3}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$OUT/build_variants_gpu.txt" 2>&1
$PY -c "import jax, sys; print('jax', jax.__version__, 'python', sys.version.split()[0], jax.devices())" >> "$OUT/build_variants_gpu.txt" 2>&1
$PY -m ddtree_jax.bench tree --cases 1:7,16:7,1:15,16:15 --depth 15 --branching 7 \
  --variants paths,paths-unrolled,climb --deadline-s 150 --out "$OUT/build_variants.json" \
  2>&1 | tee "$OUT/build_variants.log"
$PY -m ddtree_jax.bench tree --cases 1:15,16:15 --depth 15 --branching 15 \
  --variants paths,paths-unrolled,climb --deadline-s 90 --out "$OUT/build_variants_k15.json" \
  2>&1 | tee "$OUT/build_variants_k15.log"
