"""Pallas kernels of ddtree-jax, each beside a pure-jnp reference of the same signature."""

from pallas_kernels.tree_attention import tree_attention, tree_attention_reference

__all__ = ["tree_attention", "tree_attention_reference"]
