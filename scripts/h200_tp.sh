#!/usr/bin/env bash
# Issue 9 on a multi-GPU kind (one device call, under 10 minutes): round times at tp = $TP (bf16,
# Qwen3-8B shapes, batch 1 and 16), the same with the layers' all-reduce dropped (its cost by
# difference), then outputs at tp = 1 and $TP compared in float32. Steps are cut at $DEADLINE (s).
set -u
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
TP=${TP:-2}
W=/tmp/tp
DEADLINE=${DEADLINE:-570}
LOGS=$W
mkdir -p $W
source "$(dirname "$0")/h200_lib.sh"
B="python3 -m ddtree_jax.bench rounds --shape qwen3-8b --attention pallas --rounds 16 --contexts 1024 --tp $TP"

nvidia-smi topo -m > $W/topo.txt 2>&1
step rounds 20 $DEADLINE $B --methods ar,dflash,ddtree --budgets 15,63 --batches 1,16 --out "$W/tp$TP.json"
step no_all_reduce 20 $DEADLINE $B --methods ar,ddtree --budgets 63 --batches 1,16 --drop-layer-all-reduce \
  --out "$W/tp$TP-no-all-reduce.json"
step identity 20 $DEADLINE python3 scripts/tp_identity.py --tp 1,$TP --models pair,shape --shape qwen3-8b \
  --methods ar,dflash,ddtree --budgets 15,63 --num-prompts 4 --max-new-tokens 32 --out "$W/identity.json"
date -u
tar czf "$OUT/tp.tgz" -C /tmp tp
