#!/usr/bin/env bash
# Issue 41, item 4, first half on one H200 (~9 min): two DFlash2 drafters for the bundled target.
# 1. pair/draft: trained from scratch
# with the bundled drafter's recipe (hf1s1: 2 layers on target layers 1, 3, 5; 12,000 steps, batch 64,
# half of each batch from the target's own greedy continuations; seed 1) plus --dflash2 2,16,64,16
# (2 conv taps, groups of 16 channels, selector rank 64 over the top-16 candidates, no window, not
# causal), the selector trained by train.selector_loss beside the draft cross-entropy. The training
# stops at --max-seconds 270 (timeout 360 s): the drafter is written when it stops.
# 2. pair/draft-selector: the bundled v1 drafter with identity convolutions and a selector trained alone
# on it (--init-draft, --draft-train-only selector; batch 64, 3000 steps, lr 3e-3, --max-seconds 120,
# timeout 180 s): its marginals are exactly the bundled drafter's, so --marginal on it is the v1 drafter.
# Returns $OUT/pair/draft and $OUT/pair/draft-selector (~5 MB bf16 each), $OUT/training*.json, logs.
# Run from the repository root:  OUT=$OUT bash results/h200/recipes/dflash2_pair.sh
# Then, on any machine (CPU: a few minutes each), with each drafter (draft, draft-selector) beside the
# bundled target:
#   P=<returned>/pair; cp -r ddtree_jax/assets/default_pair/target $P/  (if not there)
#   for T in 0 0.7; do
#     python scripts/eval_default_pair.py --target $P/target --draft $P/draft --prompts results/heldout-prompts-96.jsonl \
#       --methods dflash,ddtree --budgets 3,7,15,31,63 --temperature $T --out results/dflash2-pair-edges-t$T.json
#     python scripts/eval_default_pair.py --target $P/target --draft $P/draft --prompts results/heldout-prompts-96.jsonl \
#       --methods dflash,ddtree --budgets 3,7,15,31,63 --temperature $T --marginal --out results/dflash2-pair-marginal-t$T.json
#     python scripts/eval_default_pair.py --prompts results/heldout-prompts-96.jsonl \
#       --methods dflash,ddtree --budgets 3,7,15,31,63 --temperature $T --out results/v1-pair-t$T.json
#   done
# Answers (issue 41 goals 1-2): mean_acceptance of the edge-score tree (dflash2-pair-edges) against the
# marginal tree of the same drafter (dflash2-pair-marginal) at every budget, and DFlash2 against v1
# (v1-pair: the bundled drafter) at the same budget.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
OUT=${OUT:-/tmp/dflash2-pair} PY=${PY:-python3}
P=$OUT/pair
mkdir -p "$P"
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv > "$OUT/gpu.txt" 2>&1
cp -r ddtree_jax/assets/default_pair/target "$P/"
timeout 360 $PY scripts/train_default_pair.py --out "$P" --log-json "$OUT/training.json" --stages draft \
  --warmup 100 --log-every 500 --draft-layers 2 --draft-target-layers 1,3,5 --draft-steps 12000 --seed 1 \
  --draft-batch 64 --selfgen-sequences 24576 --selfgen-batch 1024 --selfgen-fraction 0.5 --max-seconds 270 \
  --dflash2 2,16,64,16 > "$OUT/train.log" 2>&1
echo "train: rc $?"
tail -n 3 "$OUT/train.log"
timeout 180 $PY scripts/train_default_pair.py --out "$P" --log-json "$OUT/training-selector.json" --stages draft \
  --warmup 50 --log-every 500 --draft-layers 2 --draft-target-layers 1,3,5 --draft-steps 3000 --draft-lr 3e-3 \
  --seed 1 --draft-batch 64 --max-seconds 120 --dflash2 2,16,64,16 \
  --init-draft ddtree_jax/assets/default_pair/draft --draft-train-only selector --draft-dir draft-selector \
  > "$OUT/train-selector.log" 2>&1
echo "train selector: rc $?"
tail -n 3 "$OUT/train-selector.log"
rm -rf "$P/target"  # the bundled target: already in the repository
ls -la "$P/draft" "$P/draft-selector"
date -u
