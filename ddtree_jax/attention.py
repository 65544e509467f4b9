"""Which attention implementation a forward pass uses: the jnp reference or the Pallas kernel."""

from __future__ import annotations

import jax

from ddtree_jax.kv_cache import KVCache
from ddtree_jax.layers import Attend
from pallas_kernels import tree_attention, tree_attention_reference

IMPLEMENTATIONS = ("reference", "pallas")


def default_implementation() -> str:
    """The Pallas kernel on CUDA, the jnp reference elsewhere."""
    return "pallas" if jax.default_backend() == "gpu" else "reference"


def cache_attend(impl: str, cache: KVCache, layer: int, mask: jax.Array, window: int | None = None) -> Attend:
    """attend(q, k_new, v_new) over cache layer `layer` up to its lengths plus the new tokens under mask."""
    fn = tree_attention if impl == "pallas" else tree_attention_reference

    def attend(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
        return fn(q, cache.k[layer], cache.v[layer], cache.lengths, k, v, mask, window=window)

    return attend


def self_attend(mask: jax.Array) -> Attend:
    """attend(q, k, v) over the new tokens only (prefill: nothing cached yet)."""

    def attend(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
        b, _, hkv, d = k.shape
        empty = k[:, :0].reshape(b, hkv, 0, d)
        lengths = jax.numpy.zeros((b,), jax.numpy.int32)
        return tree_attention_reference(q, empty, empty, lengths, k, v, mask)

    return attend
