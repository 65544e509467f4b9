#!/usr/bin/env bash
# The README's main job through ddtree-generate, one run a process (what a user runs), beside the PyTorch
# anchor at batch 16 (issue 50): each variant twice, the second counted: with the serialized executables
# (exec), JAX's cache alone (noexec), compiled in the process (nocache), the 'graphs' XLA preset, and
# traced (--trace-device: how long the device was busy during that single run).
#   ANCHOR=path/to/torch_job_anchor.py bash results/h200/recipes/cli_first_run.sh   (writes under $OUT)
set -u
OUT=${OUT:-/tmp/cli-first-run}; mkdir -p "$OUT"
ANCHOR=${ANCHOR:-../shared/anchors/torch_job_anchor.py}
P=results/heldout-prompts-96.jsonl
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$OUT/gpu.txt"
OUT=$OUT BATCH=16 PROMPTS=96 NEW=128 timeout 80 python3 "$ANCHOR" > "$OUT/anchor-b16.txt" 2>&1
tail -1 "$OUT/anchor-b16.txt"
j() {  # name, then extra flags; $E: environment settings for the run
  local n=$1; shift
  for r in 1 2; do
    env $E timeout 60 python3 -m ddtree_jax.cli --prompts $P --max-new-tokens 128 --batch-size 16 --method ar \
      --compile-cache /tmp/cc --out "/tmp/$n.jsonl" --overwrite "$@" > "$OUT/$n-$r.txt" 2>/dev/null
  done
  echo "== $n"; sed -n 2,5p "$OUT/$n-2.txt"
}
E= j exec
E=DDTREE_EXECUTABLES=off j noexec
E= j nocache --compile-cache off
E=DDTREE_XLA_PRESET=graphs j graphs --compile-cache off
E= j traced --trace-device  # the summary's device-busy line for a process's single run (with its warm-up)
