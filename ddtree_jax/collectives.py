"""Collectives over the "model" mesh axis, written so that model code stays mesh-agnostic.

Every function takes `axis`: the mesh axis the heads, MLP columns and vocabulary are split over
inside `jax.shard_map`, or None when nothing is split (one device, or outside shard_map); with None
each is the plain single-device operation. Vocabulary-split arrays hold the contiguous slice
[offset, offset + V_local) of the vocabulary on each device, in device order.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

Axis = str | None


def psum(x: jax.Array, axis: Axis) -> jax.Array:
    """All-reduce sum (Megatron's reduction after o_proj and down_proj)."""
    return x if axis is None else jax.lax.psum(x, axis)


def pmax(x: jax.Array, axis: Axis) -> jax.Array:
    """All-reduce max."""
    return x if axis is None else jax.lax.pmax(x, axis)


def pmin(x: jax.Array, axis: Axis) -> jax.Array:
    """All-reduce min."""
    return x if axis is None else jax.lax.pmin(x, axis)


def axis_size(axis: Axis) -> int:
    """Devices along `axis` (1 when unsplit)."""
    return 1 if axis is None else jax.lax.axis_size(axis)


def vocab_offset(local_vocab: int, axis: Axis) -> jax.Array | int:
    """Global id of this device's first vocabulary entry."""
    return 0 if axis is None else jax.lax.axis_index(axis) * local_vocab


def argmax(x: jax.Array, axis: Axis) -> jax.Array:
    """Global argmax over a vocabulary-split last dim [..., V_local] -> [...] int32 global ids.

    Ties go to the lowest global id, as `jnp.argmax` does: each device's first maximum, then the
    smallest id among the devices holding the global maximum.
    """
    local = jnp.argmax(x, axis=-1).astype(jnp.int32)
    if axis is None:
        return local
    best = jnp.max(x, axis=-1)
    big = jnp.iinfo(jnp.int32).max
    ids = jnp.where(best == pmax(best, axis), local + vocab_offset(x.shape[-1], axis), big)
    return pmin(ids, axis)


def log_softmax(x: jax.Array, axis: Axis) -> jax.Array:
    """log_softmax over a vocabulary-split last dim (the formula of `jax.nn.log_softmax`)."""
    shifted = x - jax.lax.stop_gradient(pmax(jnp.max(x, axis=-1, keepdims=True), axis))
    return shifted - jnp.log(psum(jnp.sum(jnp.exp(shifted), axis=-1, keepdims=True), axis))


def softmax(x: jax.Array, axis: Axis) -> jax.Array:
    """softmax over a vocabulary-split last dim (the formula of `jax.nn.softmax`)."""
    e = jnp.exp(x - jax.lax.stop_gradient(pmax(jnp.max(x, axis=-1, keepdims=True), axis)))
    return e / psum(jnp.sum(e, axis=-1, keepdims=True), axis)


TILE = 128  # ids per tile in `tiled_top_k`


def tiled_top_k(x: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """`jax.lax.top_k(x, k)` (values, int32 ids; ties: lower id first), reading the row once.

    The row is cut into tiles of TILE ids (padded with -inf to a whole number of tiles), and only
    the k tiles with the largest maxima (ties: lower tile first, as `lax.top_k` orders them) are
    searched. Why that is exact: take any element e of a tile c that was not chosen. Each of the k
    chosen tiles has a maximum above e's value, or equal to it in a lower tile and so at a lower
    id; either way that maximum comes before e in `lax.top_k`'s order, so k elements come before e
    and e is not in the top k. Gathering the chosen tiles in ascending order keeps ids ascending
    among the k * TILE candidates, so the top-k of those has the same values and ids. Padding ids
    (past the row) lose every tie at -inf to real ids and are never among the top k <= V.
    """
    v = x.shape[-1]
    padded = -(-v // TILE) * TILE
    if padded // TILE <= k:  # too few tiles for the shortcut to pay
        values, ids = jax.lax.top_k(x, k)
        return values, ids.astype(jnp.int32)
    if padded != v:
        x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, padded - v)], constant_values=-jnp.inf)
    lead = x.shape[:-1]
    tiles = x.reshape(*lead, padded // TILE, TILE)
    best = jnp.sort(jax.lax.top_k(jnp.max(tiles, axis=-1), k)[1], axis=-1)  # [..., k] ascending
    candidates = jnp.take_along_axis(tiles, best[..., None], axis=-2).reshape(*lead, k * TILE)
    values, pick = jax.lax.top_k(candidates, k)
    ids = jnp.take_along_axis(best, pick // TILE, axis=-1) * TILE + pick % TILE
    return values, ids.astype(jnp.int32)


def sharded_top_k(x: jax.Array, k: int, axis: Axis) -> tuple[jax.Array, jax.Array]:
    """Global top-k over a vocabulary-split last dim: values and int32 global ids [..., k], sorted.

    Each device's local top-k (global ids), an all-gather of the candidates in device order, then
    the top-k of those: equal values keep the lower id first, as `jax.lax.top_k` does.
    """
    if axis is None:
        return tiled_top_k(x, k)
    values, ids = tiled_top_k(x, min(k, x.shape[-1]))
    ids = ids + vocab_offset(x.shape[-1], axis)
    values = jax.lax.all_gather(values, axis, axis=x.ndim - 1, tiled=True)
    ids = jax.lax.all_gather(ids, axis, axis=x.ndim - 1, tiled=True)
    values, pick = jax.lax.top_k(values, k)
    return values, jnp.take_along_axis(ids, pick, axis=-1)
