#!/usr/bin/env bash
# Variants of the bundled pair, trained side by side on one GPU (issue 7). Each variant NAME works in
# /tmp/v-NAME with the flags of train_default_pair.py given in $VARIANTS ("NAME:flags;NAME:flags"):
# with STAGES=draft (the default) on a copy of the bundled pair whose draft/ it retrains; with STAGES
# naming target (e.g. target,eval,draft) on the bundled tokenizer alone, so target/ is new as well.
# EVAL=1 then measures each variant's greedy acceptance, dflash and ddtree at budget 32, on the
# bundled prompts and on results/heldout-prompts-96.jsonl over 64 and 128 new tokens
# (eval-NAME-{16,96}-{64,128}.json; EVAL_SETS picks some, e.g. "96-64 96-128"; EVAL_FLAGS are added to
# each, EVAL_WALL caps each in seconds).
# Each variant comes back as one uncompressed tar of its logs, evaluations and new checkpoints, split in
# 15 MiB parts $OUT/variants[-$TAG]-NAME.tar.part-NN (cat them to rejoin): the device tool returns at
# most 8 files of 16 MiB each. Set TAG for invocations side by side, e.g. one per CUDA_VISIBLE_DEVICES.
# Training and the evaluations take no --deadline-s: MAX_WALL and EVAL_WALL (seconds) bound them with
# `timeout`. Run from the repository root:  OUT=$OUT VARIANTS="..." bash results/h200/pair/run.sh
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD XLA_PYTHON_CLIENT_MEM_FRACTION=${MEM_FRACTION:-0.3}
STAGES=${STAGES:-draft}
NAME=variants${TAG:+-$TAG}
W=/tmp/$NAME
PAIR=ddtree_jax/assets/default_pair
mkdir -p $W

evaluate() {  # NAME DIR: acceptance on both prompt sets at both lengths
  local p96=results/heldout-prompts-96.jsonl spec
  for spec in "16-64:" "16-128:--max-new-tokens 128" "96-64:--prompts $p96" \
    "96-128:--prompts $p96 --max-new-tokens 128"; do
    [[ " ${EVAL_SETS:-16-64 16-128 96-64 96-128} " == *" ${spec%%:*} "* ]] || continue
    # shellcheck disable=SC2086
    timeout ${EVAL_WALL:-60} python3 scripts/eval_default_pair.py --target $2/target --draft $2/draft \
      --methods dflash,ddtree --budgets 32 ${spec#*:} ${EVAL_FLAGS:-} --out $W/eval-$1-${spec%%:*}.json \
      >> $W/train-$1.log 2>&1
    echo "$1 ${spec%%:*}: $(grep -o '"mean_acceptance": [0-9.]*' $W/eval-$1-${spec%%:*}.json 2>/dev/null | tr '\n' ' ')"
  done
}

variant() {  # NAME FLAGS
  local dir=/tmp/v-$1
  rm -rf $dir; mkdir -p $dir/target
  if [[ ,$STAGES, == *,target,* ]]; then cp $PAIR/target/tokenizer*.json $dir/target/; else cp -r $PAIR/target $dir/; fi
  # shellcheck disable=SC2086
  timeout ${MAX_WALL:-520} python3 scripts/train_default_pair.py --out $dir --log-json $W/training-$1.json \
    --stages $STAGES --warmup 100 --log-every 500 $2 > $W/train-$1.log 2>&1
  echo "$1: training rc $?; $(tail -n 1 $W/train-$1.log)"
  if [ "${EVAL:-0}" = 1 ] && [ -f $dir/draft/model.safetensors ]; then evaluate $1 $dir; fi
  local new=draft; [[ ,$STAGES, == *,target,* ]] && new="target draft"
  # shellcheck disable=SC2046,SC2086
  tar cf - -C $W $(cd $W && ls -d *-$1.* *-$1-*.json 2>/dev/null) -C $dir $(cd $dir && ls -d $new 2>/dev/null) \
    | split -b 15m -d - "$OUT/$NAME-$1.tar.part-"
}

IFS=';' read -ra specs <<< "$VARIANTS"
for spec in "${specs[@]}"; do variant "${spec%%:*}" "${spec#*:}" & done
wait
date -u
