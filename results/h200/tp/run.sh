#!/usr/bin/env bash
# Issue 9 on a multi-GPU kind (one device call, under 10 minutes): round times at tp = $TP (bf16,
# Qwen3-8B shapes, batch 1 and 16), the same with the layers' all-reduce dropped (its cost by
# difference), then outputs at tp = 1 and $TP compared in float32 (scripts/tp_identity.py).
# The JSON and logs come back as $OUT/tp.tgz.
# Run from the repository root:  TP=2 OUT=$OUT bash results/h200/tp/run.sh   (PY=echo: print only)
set -u
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp} PY=${PY:-python3} TP=${TP:-2} W=/tmp/tp
mkdir -p "$W"
nvidia-smi topo -m > "$W/topo.txt" 2>&1
B="$PY -m ddtree_jax.bench rounds --shape qwen3-8b --attention pallas --rounds 16 --contexts 1024 --tp $TP"
$B --methods ar,dflash,ddtree --budgets 15,63 --batch-sizes 1,16 --deadline-s 200 --out "$W/tp$TP.json" \
  > "$W/rounds.log" 2>&1
$B --methods ar,ddtree --budgets 63 --batch-sizes 1,16 --drop-layer-all-reduce --deadline-s 120 \
  --out "$W/tp$TP-no-all-reduce.json" > "$W/no_all_reduce.log" 2>&1
# tp_identity.py generates whole outputs and takes no --deadline-s: `timeout` bounds it.
timeout 200 $PY scripts/tp_identity.py --tp 1,"$TP" --models pair,shape --shape qwen3-8b --methods ar,dflash,ddtree \
  --budgets 15,63 --num-prompts 4 --max-new-tokens 32 --out "$W/identity.json" > "$W/identity.log" 2>&1
tar czf "$OUT/tp.tgz" -C /tmp tp
