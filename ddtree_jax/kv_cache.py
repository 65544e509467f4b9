"""Static K/V cache: per layer [B, Hkv, S, D], per sequence a committed length."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class KVCache:
    """Per-layer keys and values [B, Hkv, S, D]; `lengths` [B] int32 = committed entries."""

    k: list[jax.Array]
    v: list[jax.Array]
    lengths: jax.Array

    @property
    def capacity(self) -> int:
        """S, the static number of slots per sequence."""
        return self.k[0].shape[2]


def empty_cache(
    num_layers: int, batch: int, num_kv_heads: int, capacity: int, head_dim: int, dtype: jnp.dtype
) -> KVCache:
    """A zeroed cache with all lengths 0."""
    shape = (batch, num_kv_heads, capacity, head_dim)
    return KVCache(
        k=[jnp.zeros(shape, dtype) for _ in range(num_layers)],
        v=[jnp.zeros(shape, dtype) for _ in range(num_layers)],
        lengths=jnp.zeros((batch,), jnp.int32),
    )


def gather_slots(x: jax.Array, index: jax.Array) -> jax.Array:
    """x [B, T, ...] gathered at index [B, W] -> [B, W, ...]."""
    return jax.vmap(lambda row, i: row[i])(x, index)


def _write_rows(buf: jax.Array, new: jax.Array, start: jax.Array) -> jax.Array:
    # buf [B, Hkv, S, D], new [B, W, Hkv, D] written at S-offset start[b] of each sequence.
    new = jnp.swapaxes(new, 1, 2).astype(buf.dtype)
    return jax.vmap(lambda c, n, s: jax.lax.dynamic_update_slice(c, n, (0, s, 0)))(buf, new, start)


def write(cache: KVCache, kv: list[tuple[jax.Array, jax.Array]], start: jax.Array) -> KVCache:
    """Write per-layer new K/V [B, W, Hkv, D] at slot `start[b]`; lengths are left to the caller.

    Slots past what the caller later counts as committed are written too and simply never read:
    the capacity must leave W spare slots past the longest sequence (dynamic_update_slice clamps).
    """
    return KVCache(
        k=[_write_rows(c, k, start) for c, (k, _) in zip(cache.k, kv, strict=True)],
        v=[_write_rows(c, v, start) for c, (_, v) in zip(cache.v, kv, strict=True)],
        lengths=cache.lengths,
    )
