"""The target's choice at every tree node: greedy argmax (sampling arrives with its own issue)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def choose(logits: jax.Array) -> jax.Array:
    """logits [B, T, V] float32 -> the target's token at each node [B, T] int32 (greedy)."""
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)
