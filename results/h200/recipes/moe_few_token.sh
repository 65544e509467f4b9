#!/usr/bin/env bash
# Issue 40 on one H100 or H200 (each call <= 4 min), from the repository root.
#   OUT=$OUT bash results/h200/recipes/moe_few_token.sh          # layers (default)
#   OUT=$OUT bash results/h200/recipes/moe_few_token.sh rounds   # Kimi-K2, 4 layers, INT4 experts
#   OUT=$OUT bash results/h200/recipes/moe_few_token.sh rounds-few   # the same, --moe-dispatch few
# layers: one MoE layer of the Qwen3-30B-A3B shape (E 128, hidden 2048, expert width 768, top-8; 8
#   layers stacked, ms per layer) at 1 / 8 / 16 / 64 tokens with bf16, INT4 (int32 words, bf16 scales
#   of 32 rows) and FP8 (128 x 128 blocks) experts, through every dispatch: few (Triton) and few_mgpu
#   (Mosaic GPU; kernels/few_experts*.py, issue 40), gather and grouped (today's rule), fused (Mosaic
#   GPU, issue 33), grouped_split, sorted_mgpu (bf16 only); each row beside its floor (the distinct chosen experts' stored bytes over
#   the run's measured read ceiling). moe_few_token.json's "dispatch_table" is the fastest dispatch per
#   format and token count as rows for kernels.tuning.MOE_GPU_DISPATCH.
# rounds: ddtree-bench rounds of the Kimi-K2 shape at 4 layers (1 dense + 3 MoE, real width) with INT4
#   routed experts: ar and ddtree 3 / 7 / 15 at batch 1 and 16, 1k context, Pallas attention, with the
#   default dispatch (rounds: kimi_int4.json) or --moe-dispatch few (rounds-few: kimi_int4_few.json;
#   above 64 tokens a device, e.g. ddtree 7 and 15 at batch 16 and the prefill, `few` runs `grouped`);
#   each row has the chosen-expert floor (ddtree-bench's --chosen-floor, on by default).
# PY=echo prints the commands only.
set -u
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.95}
OUT=${OUT:-/tmp/moe_few_token} PY=${PY:-python3}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader > "$OUT/gpu.txt" 2>&1
case ${1:-layers} in
  layers)
    $PY -m ddtree_jax.bench moe --tokens 1,8,16,64 --formats plain,int4,fp8 \
      --dispatches few,few_mgpu,gather,grouped,fused,grouped_split,sorted_mgpu --reps 10 --deadline-s 180 \
      --out "$OUT/moe_few_token.json" > "$OUT/layers.log" 2>&1 ;;
  rounds|rounds-few)
    B="$PY -m ddtree_jax.bench rounds --shape kimi-k2 --num-layers 4 --quantize int4-experts --attention pallas
       --draft-layers 6 --block-size 8 --rounds 4 --methods ar,ddtree --budgets 3,7,15 --batch-sizes 1,16
       --contexts 1024"
    if [ "$1" = rounds ]; then name=kimi_int4 few=""; else name=kimi_int4_few few="--moe-dispatch few"; fi
    $B $few --deadline-s 150 --out "$OUT/$name.json" > "$OUT/$name.log" 2>&1 ;;
  *) echo "usage: $0 [layers|rounds|rounds-few]" >&2; exit 1 ;;
esac
