"""The kernels, each file a kernel beside its pure-jnp reference of the same signature; they import jax
and each other only (tests/test_layout.py); quantized weights reach them as plain arrays and scales
(quant.arrays' `kernel_experts` and `expert_weight`).

Pallas Triton (any CUDA GPU):
  tree_attention      decode-time GQA attention over a cache prefix plus in-flight tokens under a mask
  mla_attention       the same contract over MLA's latent cache (absorbed form)
  quant_matmul        grouped matmul over rows sorted by expert, reading bf16, FP8 or INT4 experts
Mosaic GPU (Hopper: wgmma, TMA; `--attention mosaic`, the MoE 'fused' dispatch):
  tree_attention_mgpu  tree_attention's contract
  mla_attention_mgpu   mla_attention's contract
  fused_experts        the routed experts of a MoE layer (gate + up + SiLU, then down), bf16/FP8/INT4
Shared pieces:
  flash               the cache loop and online softmax of the attention kernels, the split merges
  tuning              every attention kernel's tuning tables and split rules (Triton and Mosaic GPU),
                      the grouped matmul's splits
"""
