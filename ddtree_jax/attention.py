"""Which attention implementation a forward pass uses: the jnp reference or the Pallas kernel."""

from __future__ import annotations

from collections.abc import Callable

import jax

from pallas_kernels import tree_attention, tree_attention_reference

IMPLEMENTATIONS = ("reference", "pallas")


def default_implementation() -> str:
    """The Pallas kernel on CUDA, the jnp reference elsewhere."""
    return "pallas" if jax.default_backend() == "gpu" else "reference"


def kernel(impl: str) -> Callable:
    """The tree-attention function of `impl` (both share one signature: pallas_kernels)."""
    return tree_attention if impl == "pallas" else tree_attention_reference
