"""Quantized checkpoints as published: FP8 block-scaled (DeepSeek-V3, Kimi-K2) and compressed-tensors
INT4 (Kimi-K2.5/K2.6 routed experts). `formats`: config and on-disk layout, NumPy references;
`arrays`: device containers and the matmuls that read them; `load`: reading and placement."""

from ddtree_jax.quant.arrays import (
    Fp8Weight,
    Int4Weight,
    Weight,
    dequantize,
    gather_matmul,
    matmul,
    ragged_matmul,
    slot_matmul,
    sorted_matmul,
    stored_bytes,
)
from ddtree_jax.quant.formats import Form, Fp8Block, Int4Group, Plain, parse_quantization, stored_form

__all__ = [
    "Form",
    "Fp8Block",
    "Fp8Weight",
    "Int4Group",
    "Int4Weight",
    "Plain",
    "Weight",
    "dequantize",
    "gather_matmul",
    "matmul",
    "parse_quantization",
    "ragged_matmul",
    "slot_matmul",
    "sorted_matmul",
    "stored_bytes",
    "stored_form",
]
