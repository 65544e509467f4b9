"""Pallas (Triton) kernels, each file a kernel beside its pure-jnp reference of the same signature.

tree_attention  decode-time GQA attention over a cache prefix plus in-flight tokens under a mask
mla_attention   the same contract over MLA's latent cache (absorbed form)
quant_matmul    grouped matmul over rows sorted by expert, reading bf16, FP8 or INT4 experts
"""
