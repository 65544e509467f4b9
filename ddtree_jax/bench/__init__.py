"""`ddtree-bench`: benchmarks on random-weight models of real shapes, one sub-command each (`cli`).

shapes     the targets measured (every family's `Family.SHAPES`), their quantized forms, the drafter
timing     the median of synced calls, the HBM read ceiling, the device's memory
programs   a batch's synthetic mid-generation state; the round and each stage in a device loop
floor      the weight bytes a round must read (and for MoE targets the experts the router chose)
report     the shared flag parser, run header, --deadline-s and --out writes
rounds     `ddtree-bench rounds`: round and stage times against the HBM floor
profile    `ddtree-bench profile`: a round's device time kernel by kernel
scheduling `ddtree-bench scheduling`: continuous against static batching on a mixed workload
prefill    `ddtree-bench prefill`: chunked prefill of one long prompt
load       `ddtree-bench load`: load times, HF safetensors against the params cache
attention, mla_attention, mosaic_attention, prefix_attention, quant, topk, tree
           `ddtree-bench attention`, `mla-attention`, ...: one kernel or op alone against its
           alternatives and its floor (prefix_attention also holds the unwired cuDNN-merged form)
moe, moe_fused
           `ddtree-bench moe`, `moe-fused`: the MoE expert dispatches against the floor of the experts
           chosen; the fused expert kernel's checks, dispatches and rounds, phase by phase
torch_step `ddtree-bench torch-step`: a plain-PyTorch decode step replayed from CUDA graphs (a baseline)
plot       `ddtree-bench plot`: plots of rounds sweeps, the default budget per batch size
"""
