#!/usr/bin/env bash
# Drafter variants for the bundled target, trained side by side on one GPU (issue 7). Each variant
# copies the bundled pair to /tmp/v-NAME and retrains its draft/ with the flags given in $VARIANTS
# ("NAME:flags;NAME:flags").
# Each variant comes back as one uncompressed tar, $OUT/variants-NAME.tar ($OUT/variants-$TAG-NAME.tar
# with $TAG set, for invocations side by side, e.g. one per GPU with CUDA_VISIBLE_DEVICES), holding
# draft/, train-NAME.log and training-NAME.json(l): one file a variant, as the device tool returns
# at most 8 files of 16 MiB each.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD XLA_PYTHON_CLIENT_MEM_FRACTION=${MEM_FRACTION:-0.3}
NAME=variants${TAG:+-$TAG}
W=/tmp/$NAME
mkdir -p $W
pids=()
IFS=';' read -ra specs <<< "$VARIANTS"
for spec in "${specs[@]}"; do
  name=${spec%%:*}; flags=${spec#*:}
  dir=/tmp/v-$name
  rm -rf $dir; mkdir -p $dir; cp -r ddtree_jax/assets/default_pair/target $dir/
  # shellcheck disable=SC2086
  timeout ${MAX_WALL:-520} python3 scripts/train_default_pair.py --out $dir --log-json $W/training-$name.json \
    --stages draft --warmup 100 --log-every 500 $flags > $W/train-$name.log 2>&1 &
  pids+=($!)
done
for p in "${pids[@]}"; do wait $p; echo "rc $?"; done
for spec in "${specs[@]}"; do
  name=${spec%%:*}
  tail -n 2 $W/train-$name.log
  # shellcheck disable=SC2046
  tar cf "$OUT/$NAME-$name.tar" -C $W $(cd $W && ls -d *-$name.*) $([ -d /tmp/v-$name/draft ] && echo -C /tmp/v-$name draft)
done
date -u
