"""Which attention implementation a forward pass uses: the jnp reference or the Pallas kernel, one
table per attention kind (GQA over a K/V cache, MLA over a latent cache); an unknown name is refused.

"causal-cudnn" (a prefill chunk only, chosen by `prefill_implementation`): cuDNN flash attention
through `jax.nn.dot_product_attention`, the chunk's queries against the cached prefix and, causally,
against the chunk itself; "causal-xla" is the same composition through XLA (how CPU tests check it).

"pallas-invariant" is the kernel with its cache splits fixed by the head and tree shapes alone (the
tree rule's splits for 4 rows and a 1M-token cache, at every T: between what one row and 16 rows
would take, so the split merge stays small at large batches), never by the batch or the capacity: a
row's result then depends on its own length only (batch-invariant generation, scheduler.py). The
MLA kernel has the same form: its splits by its own rule for 4 rows and a 1M-token cache.

"mosaic" is the Mosaic GPU kernel of each kind (`ddtree_jax.kernels.tree_attention_mgpu`,
`mla_attention_mgpu`: wgmma, TMA, Hopper only); it has no batch-invariant form yet, so
batch-invariant runs take "pallas-invariant". A cache whose capacity is not a multiple of 8 goes to
the Triton kernel instead: Mosaic GPU's TMA in jax 0.11.2 reads it in 8-row tiles (results/notes.md;
the engine pads capacities to 64, so only other callers meet it).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp

from ddtree_jax.kernels.flash import merge_by_lse
from ddtree_jax.kernels.mla_attention import mla_attention, mla_attention_reference
from ddtree_jax.kernels.mla_attention_mgpu import mla_attention_mgpu
from ddtree_jax.kernels.tree_attention import tree_attention, tree_attention_reference
from ddtree_jax.kernels.tree_attention_mgpu import TMA_ROW_TILE, tree_attention_mgpu
from ddtree_jax.kernels.tuning import (
    TREE_TUNING,
    default_mla_splits,
    default_tree_splits,
    resolve_mla_tuning,
    resolve_tree_tuning,
)

IMPLEMENTATIONS = ("reference", "pallas", "pallas-invariant", "mosaic")
PREFILL_IMPLEMENTATIONS = ("causal-cudnn", "causal-xla")  # prefill chunks only: a causal mask assumed
SPLIT_ROWS, LONG_CACHE = 4, 1 << 20  # the batch and capacity the invariant splits are chosen for


def default_implementation() -> str:
    """The Pallas kernel on CUDA, the jnp reference elsewhere."""
    return "pallas" if jax.default_backend() == "gpu" else "reference"


def invariant(impl: str) -> str:
    """The batch-invariant form of an implementation."""
    return "pallas-invariant" if impl in ("pallas", "mosaic") else impl


def pallas_invariant(q: jax.Array, k_cache: jax.Array, *args, **kwargs) -> jax.Array:
    """`tree_attention` with splits that depend on neither the batch nor the cache capacity."""
    tuning = resolve_tree_tuning(q.shape, k_cache.shape)
    # The tree rule at every T, T = 1 included (9 splits at Hkv 8 for T = 1): what the H200 figures of
    # the batch-invariant mode ran (results/notes.md); the decode rule would give 17 (not measured).
    rule = {k: TREE_TUNING[k] for k in ("waves", "min_tiles_per_split")}
    splits = default_tree_splits(
        SPLIT_ROWS, k_cache.shape[1], tuning["row_tiles"], LONG_CACHE, tuning["tile_k"], **rule
    )
    return tree_attention(q, k_cache, *args, splits=splits, **kwargs)


def mla_invariant(
    q_latent: jax.Array, q_rope: jax.Array, latent_cache: jax.Array, *args, **kwargs
) -> jax.Array:
    """`mla_attention` with splits that depend on neither the batch nor the cache capacity."""
    tuning = resolve_mla_tuning(q_latent.shape, latent_cache.shape[1])
    per_sm = 2 if tuning["tile_q"] <= 16 and tuning["num_warps"] <= 4 else 1  # as resolve_mla_tuning's
    programs = tuning["row_tiles"] * tuning["value_splits"]
    splits = default_mla_splits(SPLIT_ROWS, programs, LONG_CACHE, tuning["tile_k"], programs_per_sm=per_sm)
    return mla_attention(q_latent, q_rope, latent_cache, *args, splits=splits, **kwargs)


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


def mosaic_gqa(q: jax.Array, k_cache: jax.Array, *args, **kwargs) -> jax.Array:
    """`tree_attention_mgpu`, or the Triton kernel for a cache [B, Hkv, S, D] with S not a multiple of 8
    (Mosaic GPU's TMA cannot read it in jax 0.11.2: `TMA_ROW_TILE`)."""
    fn = tree_attention if k_cache.shape[2] % TMA_ROW_TILE else tree_attention_mgpu
    return fn(q, k_cache, *args, **kwargs)


def mosaic_mla(q_latent: jax.Array, q_rope: jax.Array, latent_cache: jax.Array, *args, **kwargs) -> jax.Array:
    """`mla_attention_mgpu`, or the Triton kernel for a latent cache [B, S, C] with S not a multiple of 8
    (as `mosaic_gqa`)."""
    fn = mla_attention if latent_cache.shape[1] % TMA_ROW_TILE else mla_attention_mgpu
    return fn(q_latent, q_rope, latent_cache, *args, **kwargs)


# Per attention kind, every implementation by name; those of one kind share one signature (GQA:
# tree_attention's, MLA: mla_attention's; every kernel in ddtree_jax.kernels).
KERNELS: dict[str, dict[str, Callable]] = {
    "gqa": {
        "reference": tree_attention_reference,
        "pallas": tree_attention,
        "pallas-invariant": pallas_invariant,
        "mosaic": mosaic_gqa,
        "causal-cudnn": functools.partial(causal_chunk, implementation="cudnn"),
        "causal-xla": functools.partial(causal_chunk, implementation="xla"),
    },
    "mla": {
        "reference": mla_attention_reference,
        "pallas": mla_attention,
        "pallas-invariant": mla_invariant,
        "mosaic": mosaic_mla,
    },
}


def kernel(impl: str, kind: str = "gqa") -> Callable:
    """The attention function named `impl` for attention `kind` ("gqa" or "mla"); an unknown name is
    refused, naming the known ones (never a silent fallback to the reference)."""
    table = KERNELS[kind]
    if impl not in table:
        raise ValueError(f"no {kind.upper()} attention implementation {impl!r}; known: {', '.join(table)}")
    return table[impl]
