"""The static cache: per layer one entry of the family's type, per sequence a committed length.

An entry is a pytree (e.g. `models.gqa.KVEntry`) whose cached leaves share one time axis, named by the
entry type's `time_axis`; the same type in flight (a forward's new tokens) has time on axis 1. Writing,
gathering and sizing below work leaf by leaf and know nothing else of the layout.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from ddtree_jax.sharding import MODEL


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class KVCache:
    """Per-layer cache entries (S slots on their time axis); `lengths` [B] int32 = committed entries."""

    layers: list[Any]
    lengths: jax.Array

    @property
    def capacity(self) -> int:
        """S, the static number of slots per sequence."""
        entry = self.layers[0]
        return jax.tree.leaves(entry)[0].shape[type(entry).time_axis]


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class SharedRows:
    """A cache whose rows a forward's sequences share (a packed prefill pass: several pieces of one
    prompt in one forward, `prefill.py`). Sequence b reads row `rows[b]` up to `lengths[b]` and, under
    the forward's mask, its own new tokens, after the new entries of EVERY sequence were written at
    (rows[b], lengths[b] + t): a piece sees the earlier pieces of its prompt in the same forward.
    `rows[b]` >= R marks a padding sequence (it writes nothing; its output is not used). `width`: the
    slots of each row a sequence may read (static, at most the capacity)."""

    layers: list[Any]
    lengths: jax.Array  # [Bq] int32
    rows: jax.Array  # [Bq] int32
    width: int = dataclasses.field(metadata=dict(static=True))

    def view(self, entry: Any, new: Any) -> Any:
        """What the sequences read of one layer's entry [R, ...]: `new` [Bq, T, ...] written as
        `write_rows` writes it, then each sequence's row, its first `width` slots -> [Bq, ...]."""
        written = _write_rows_entry(entry, new, self.rows, self.lengths)
        axis = type(entry).time_axis

        def read(x):
            x = jax.lax.slice_in_dim(x, 0, self.width, axis=axis)
            return jnp.take(x, self.rows, axis=0, mode="clip")

        return jax.tree.map(read, written)


def gather_slots(x: jax.Array, index: jax.Array) -> jax.Array:
    """x [B, T, ...] gathered at index [B, W] -> [B, W, ...]."""
    return jax.vmap(lambda row, i: row[i])(x, index)


def gather(new: list[Any], index: jax.Array) -> list[Any]:
    """In-flight entries [B, T, ...] gathered at index [B, W] along time -> [B, W, ...]."""
    return [jax.tree.map(lambda x: gather_slots(x, index), entry) for entry in new]


def _write_leaf(buf: jax.Array, new: jax.Array, start: jax.Array, axis: int, keep=None) -> jax.Array:
    # buf [B, ..., S (axis), ...], new [B, W, ...] written at time offset start[b] of each sequence
    # (where keep[b], else the slots keep what they hold).
    new = jnp.moveaxis(new, 1, axis).astype(buf.dtype)

    def one(c, n, s, k):
        if k is not None:
            n = jnp.where(k, n, jax.lax.dynamic_slice_in_dim(c, s, n.shape[axis - 1], axis - 1))
        return jax.lax.dynamic_update_slice_in_dim(c, n, s, axis - 1)

    return jax.vmap(one)(buf, new, start, keep)


def write(cache: KVCache, new: list[Any], start: jax.Array, keep: jax.Array | None = None) -> KVCache:
    """Write per-layer in-flight entries [B, W, ...] at slot `start[b]`; lengths are left to the caller.
    With `keep` [B] bool, a row where it is False is left as it was.

    Slots past what the caller later counts as committed are written too and simply never read:
    the capacity must leave W spare slots past the longest sequence (dynamic_update_slice clamps).
    """
    layers = [_write_entry(c, n, start, keep) for c, n in zip(cache.layers, new, strict=True)]
    return KVCache(layers, cache.lengths)


def write_rows(cache: KVCache, new: list[Any], rows: jax.Array, starts: jax.Array) -> KVCache:
    """Write per-layer in-flight entries [Bq, W, ...] of sequences that share rows: token t of sequence
    b at slot starts[b] + t of row rows[b] (a row >= R, or a slot past the capacity: not written);
    lengths are left to the caller."""
    layers = [_write_rows_entry(c, n, rows, starts) for c, n in zip(cache.layers, new, strict=True)]
    return KVCache(layers, cache.lengths)


def _write_rows_entry(cached: Any, new: Any, rows: jax.Array, starts: jax.Array) -> Any:
    axis = type(cached).time_axis
    leaves, tree = jax.tree.flatten(cached)
    fresh = jax.tree.leaves(new)

    def scatter(buf, x):
        # buf [R, ..., S (axis), ...]; indexing rows and slots with [Bq, W] arrays selects [Bq, W, ...]:
        # the in-flight layout, whatever the time axis (NumPy's rule for advanced indices)
        index = [slice(None)] * buf.ndim
        index[0] = rows[:, None]
        index[axis] = starts[:, None] + jnp.arange(x.shape[1], dtype=starts.dtype)
        return buf.at[tuple(index)].set(x.astype(buf.dtype), mode="drop")

    return jax.tree.unflatten(tree, [scatter(c, n) for c, n in zip(leaves, fresh, strict=True)])


def _write_entry(cached: Any, new: Any, start: jax.Array, keep=None) -> Any:
    # new: the same entry in flight (or its leaves in the same order, e.g. a (k, v) tuple)
    axis = type(cached).time_axis
    leaves, tree = jax.tree.flatten(cached)
    fresh = jax.tree.leaves(new)
    return jax.tree.unflatten(
        tree, [_write_leaf(c, n, start, axis, keep) for c, n in zip(leaves, fresh, strict=True)]
    )


def _cached_shape(new_shape: tuple[int, ...], axis: int, capacity: int) -> tuple[int, ...]:
    """The cached shape of an in-flight leaf [B, T, ...]: time moved to `axis`, with `capacity` slots."""
    rest = list(new_shape[:1] + new_shape[2:])
    return tuple(rest[:axis] + [capacity] + rest[axis:])


def empty_like(new: list[Any], capacity: int) -> KVCache:
    """A zeroed cache of `capacity` slots for entries shaped like the in-flight `new` [B, T, ...]."""

    def zeros(entry):
        axis = type(entry).time_axis
        return jax.tree.map(lambda x: jnp.zeros(_cached_shape(x.shape, axis, capacity), x.dtype), entry)

    batch = jax.tree.leaves(new[0])[0].shape[0]
    return KVCache([zeros(e) for e in new], jnp.zeros((batch,), jnp.int32))


def from_prefill(new: list[Any], capacity: int, lengths: jax.Array) -> KVCache:
    """A cache holding the prefill's entries [B, P, ...] from slot 0, committed up to `lengths` [B]."""
    cache = write(empty_like(new, capacity), new, jnp.zeros_like(lengths))
    cache.lengths = lengths
    return cache


def bytes_per_token(entries: list[Any], tp: int) -> float:
    """Bytes one device of a `tp`-way "model" axis holds per cached token of one row: entries are the
    global cache shapes (arrays or ShapeDtypeStructs); leaves split over "model" count 1 / tp."""
    total = 0.0
    for entry in entries:
        specs = jax.tree.leaves(type(entry).cache_spec(), is_leaf=lambda x: isinstance(x, P))
        for leaf, spec in zip(jax.tree.leaves(entry), specs, strict=True):
            per_token = leaf.size // (leaf.shape[0] * leaf.shape[type(entry).time_axis])
            total += per_token * leaf.dtype.itemsize / (tp if MODEL in tuple(spec) else 1)
    return total
