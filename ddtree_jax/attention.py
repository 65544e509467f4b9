"""Which attention implementation a forward pass uses: the jnp reference or the Pallas kernel.

"pallas-invariant" is the kernel with its cache splits fixed by the head and tree shapes alone (as for
4 rows and a long cache: between the 33 splits one row would take and the 2 of 16 rows, so the split
combine stays small at large batches), never by the batch or the capacity: a row's result then
depends on its own length only (batch-invariant generation, generation.py).
"""

from __future__ import annotations

from collections.abc import Callable

import jax

from pallas_kernels import tree_attention, tree_attention_reference
from pallas_kernels.tree_attention import default_splits, resolve_tuning

IMPLEMENTATIONS = ("reference", "pallas", "pallas-invariant")
SPLIT_ROWS, LONG_CACHE = 4, 1 << 20  # the batch and capacity the invariant splits are chosen for


def default_implementation() -> str:
    """The Pallas kernel on CUDA, the jnp reference elsewhere."""
    return "pallas" if jax.default_backend() == "gpu" else "reference"


def invariant(impl: str) -> str:
    """The batch-invariant form of an implementation."""
    return "pallas-invariant" if impl == "pallas" else impl


def pallas_invariant(q: jax.Array, k_cache: jax.Array, *args, **kwargs) -> jax.Array:
    """`tree_attention` with splits that depend on neither the batch nor the cache capacity."""
    tuning = resolve_tuning(q.shape, k_cache.shape)
    splits = default_splits(SPLIT_ROWS, k_cache.shape[1], tuning["row_tiles"], LONG_CACHE, tuning["block_k"])
    return tree_attention(q, k_cache, *args, splits=splits, **kwargs)


def kernel(impl: str) -> Callable:
    """The tree-attention function of `impl` (all share one signature: pallas_kernels)."""
    return {"pallas": tree_attention, "pallas-invariant": pallas_invariant}.get(
        impl, tree_attention_reference
    )
