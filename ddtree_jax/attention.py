"""Which attention implementation a forward pass uses: the jnp reference or the Pallas kernel.

"causal-cudnn" (a prefill chunk only, chosen by `prefill_implementation`): cuDNN flash attention
through `jax.nn.dot_product_attention`, the chunk's queries against the cached prefix and, causally,
against the chunk itself; "causal-xla" is the same composition through XLA (how CPU tests check it).

"pallas-invariant" is the kernel with its cache splits fixed by the head and tree shapes alone (the
tree rule's splits for 4 rows and a 1M-token cache, at every T: between what one row and 16 rows
would take, so the split merge stays small at large batches), never by the batch or the capacity: a
row's result then depends on its own length only (batch-invariant generation, generation.py).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp

from ddtree_jax.kernels.flash import merge_by_lse
from ddtree_jax.kernels.tree_attention import tree_attention, tree_attention_reference
from ddtree_jax.kernels.tuning import TREE_TUNING, default_tree_splits, resolve_tree_tuning

IMPLEMENTATIONS = ("reference", "pallas", "pallas-invariant")
PREFILL_IMPLEMENTATIONS = ("causal-cudnn", "causal-xla")  # prefill chunks only: a causal mask assumed
SPLIT_ROWS, LONG_CACHE = 4, 1 << 20  # the batch and capacity the invariant splits are chosen for


def default_implementation() -> str:
    """The Pallas kernel on CUDA, the jnp reference elsewhere."""
    return "pallas" if jax.default_backend() == "gpu" else "reference"


def invariant(impl: str) -> str:
    """The batch-invariant form of an implementation."""
    return "pallas-invariant" if impl == "pallas" else impl


def pallas_invariant(q: jax.Array, k_cache: jax.Array, *args, **kwargs) -> jax.Array:
    """`tree_attention` with splits that depend on neither the batch nor the cache capacity."""
    tuning = resolve_tree_tuning(q.shape, k_cache.shape)
    # The tree rule at every T, T = 1 included (9 splits at Hkv 8 for T = 1): what the H200 figures of
    # the batch-invariant mode ran (results/notes.md); the decode rule would give 17 (not measured).
    rule = {k: TREE_TUNING[k] for k in ("waves", "min_blocks_per_split")}
    splits = default_tree_splits(
        SPLIT_ROWS, k_cache.shape[1], tuning["row_tiles"], LONG_CACHE, tuning["block_k"], **rule
    )
    return tree_attention(q, k_cache, *args, splits=splits, **kwargs)


def causal_chunk(
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    lengths: jax.Array,
    k_new: jax.Array,
    v_new: jax.Array,
    mask: jax.Array,
    *,
    window: int | None = None,
    implementation: str = "cudnn",
) -> jax.Array:
    """Attention of a prefill chunk q [B, T, Hq, D] that starts at position `lengths` [B]: over the
    cache [B, Hkv, S, D] up to `lengths` and over the chunk's own K/V [B, T, Hkv, D] causally, as two
    flash-attention calls merged by their log-sum-exps. `mask` is not read: it must be the causal
    mask (a query past its prompt's end sees padding keys; its output is never used)."""
    if window is not None:
        raise ValueError("causal_chunk has no sliding window")
    dpa = jax.nn.dot_product_attention
    prefix_k, prefix_v = (jnp.swapaxes(x, 1, 2) for x in (k_cache, v_cache))  # [B, S, Hkv, D]
    lengths = lengths.astype(jnp.int32)
    out_c, lse_c = dpa(
        q, prefix_k, prefix_v, key_value_seq_lengths=jnp.maximum(lengths, 1),
        implementation=implementation, return_residual=True,
    )  # fmt: skip
    out_n, lse_n = dpa(q, k_new, v_new, is_causal=True, implementation=implementation, return_residual=True)
    # lse: [B, T, Hq]; an empty prefix (lengths 0: the first chunk) weighs nothing.
    lse_c = jnp.where(lengths[:, None, None] > 0, lse_c.astype(jnp.float32), -jnp.inf)
    parts = [(out_c.astype(jnp.float32), lse_c), (out_n.astype(jnp.float32), lse_n.astype(jnp.float32))]
    return merge_by_lse(parts).astype(q.dtype)


def prefill_implementation(impl: str, dtype: jnp.dtype, head_dim: int, batch_invariant: bool) -> str:
    """The attention of a prefill chunk: cuDNN flash attention on CUDA for bf16/f16 and head dims up to
    128 (what it supports on every GPU since Ampere), except batch-invariant runs (their kernel's
    splits are fixed); elsewhere the decode implementation `impl`."""
    cuda = jax.default_backend() == "gpu" and "cuda" in jax.devices()[0].client.platform_version.lower()
    half = jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
    if cuda and half and head_dim <= 128 and head_dim % 8 == 0 and not batch_invariant:
        return "causal-cudnn"
    return impl


def kernel(impl: str) -> Callable:
    """The tree-attention function of `impl` (all share one signature: ddtree_jax.kernels)."""
    if impl in PREFILL_IMPLEMENTATIONS:
        return functools.partial(causal_chunk, implementation=impl.removeprefix("causal-"))
    return {"pallas": tree_attention, "pallas-invariant": pallas_invariant}.get(
        impl, tree_attention_reference
    )
