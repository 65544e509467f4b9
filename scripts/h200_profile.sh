#!/usr/bin/env bash
# Issue 22 items 4 and 5 on one H200, one device call (~3 min): a per-kernel profile
# (ddtree-bench profile: jax.profiler trace read with ProfileData, kernel time by category and
# by the engine's scopes, top 25 kernels, busy against wall) of the Qwen3-8B shape, bf16, Pallas
# attention:
# 1. batch 1, 1k context: the ar step (two rows, one inactive) and the budget-63 round, each also as
#    its verify alone in the device loop (verify 6.04 ms against the ar verify's 4.60 ms: item 4);
# 2. batch 16, 32k context: ar, budget 63 and budget 7, verify alone and the round (84.8 ms against
#    ar's 24.2: item 5).
# Each step runs under `timeout` with what is left of $DEADLINE (seconds, default 240); the script
# writes its JSON after each plan, so a step cut short keeps what it measured. Results in $OUT:
# gpu.txt, b1_1k.json/.log, b16_32k.json/.log. DRY_RUN=1 prints the commands only.
#   OUT=$OUT DEADLINE=240 bash scripts/h200_profile.sh
set -u
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.95}
OUT=${OUT:-/tmp/profile}
DEADLINE=${DEADLINE:-240}
PY=${PY:-python3}
DRY_RUN=${DRY_RUN:-0}
mkdir -p "$OUT"
source "$(dirname "$0")/h200_lib.sh"
P="$PY -m ddtree_jax.bench profile --shape qwen3-8b --attention pallas --programs verify,round --rounds 4 --iters 3"
[ "$DRY_RUN" = 1 ] || nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$OUT/gpu.txt" 2>&1
# ~70 s: init ~10 s, compiles ar verify ~8 + round ~9, ddtree draft/build ~6 + verify ~10 + round ~17
# shellcheck disable=SC2086  # P is a word list
step b1_1k 40 100 $P --batch 1 --context 1024 --methods ar,ddtree --budget 63 --out "$OUT/b1_1k.json"
# ~110 s: as above for three plans; ar first, then budget 63, then 7 (a cut loses the least asked for)
# shellcheck disable=SC2086
step b16_32k 40 140 $P --batch 16 --context 32768 --methods ar,ddtree --budget 63,7 --out "$OUT/b16_32k.json"
date -u
