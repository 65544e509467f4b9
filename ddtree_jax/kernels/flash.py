"""What the two attention kernels (`tree_attention`, `mla_attention`) share, written once: the finite
mask value, one online-softmax step in log2 units, the loop over a split's share of a cached prefix,
the loop over the in-flight tokens under their mask, and the merges of partial softmaxes.

A kernel supplies only its own loads and scores: `stream_cache` and `stream_new` walk the tiles and
call the kernel's `step`, which loads a tile, scores it against the program's query rows and folds
it into the carry (acc [rows, V], running max m [rows], running sum l [rows], float32).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental.pallas import triton as pltriton

MASK_VALUE = -1e30  # finite, so a fully masked row gives zeros instead of NaN
LOG2E = 1.4426950408889634
# The running max starts here: finite (no inf - inf = NaN) and far above MASK_VALUE, so that
# exp2(MASK_VALUE - m) is exactly 0 even on rows that see nothing yet.
M_INIT = 0.5 * MASK_VALUE

Carry = tuple[jax.Array, jax.Array, jax.Array]  # acc [rows, V], m [rows], l [rows]: float32


def next_pow2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1)."""
    return 1 << max(0, n - 1).bit_length()


def cdiv(a, b):
    """Ceiling division (ints or int32 arrays)."""
    return (a + b - 1) // b


def qk(q: jax.Array, k: jax.Array) -> jax.Array:
    """q [Q, D] . k [K, D]^T -> float32 [Q, K]."""
    return lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)


def online_softmax_step(carry: Carry, raw: jax.Array, v: jax.Array, scale_log2: float) -> Carry:
    """One flash step over raw scores [Q, K] = q . k (masked entries = MASK_VALUE / scale_log2).

    The max and the softmax run in log2 units: p = exp2(raw * scale_log2 - m), one FMA per score.
    """
    acc, m, l = carry
    m_new = jnp.maximum(m, jnp.max(raw, axis=1) * scale_log2)
    alpha = jnp.exp2(m - m_new)
    p = jnp.exp2(raw * scale_log2 - m_new[:, None])
    l_new = alpha * l + jnp.sum(p, axis=1)
    pv = jnp.dot(p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return acc * alpha[:, None] + pv, m_new, l_new


def empty_carry(rows: int, width: int) -> Carry:
    """The carry before any key: acc 0 [rows, width], max M_INIT, sum 0."""
    return (
        jnp.zeros((rows, width), jnp.float32),
        jnp.full((rows,), M_INIT, jnp.float32),
        jnp.zeros((rows,), jnp.float32),
    )


def load_rows(at, ok: jax.Array | None):
    """A [K, ...] tile of a ref view `at`: all rows (`ok` None), or masked rows read as 0."""
    return pltriton.load(at) if ok is None else pltriton.load(at, mask=ok[:, None], other=0)


# step(carry, start, ok) -> carry: fold cache rows [start, start + tile_k) into the carry; `ok` [tile_k]
# bool marks the rows inside the visible range (None: all of them, a full tile).
CacheStep = Callable[[Carry, jax.Array, jax.Array | None], Carry]


def stream_cache(
    carry: Carry,
    length: jax.Array,
    split: jax.Array,
    step: CacheStep,
    *,
    cache_len: int,
    tile_k: int,
    splits: int,
    window: int | None,
) -> Carry:
    """This split's share of a sequence's visible cache [max(0, len - window), len), in tiles of
    `tile_k`: the range is dynamic per sequence, so short sequences in a long cache still spread over
    every split. Only the last tile of the range can be partial: full tiles run unmasked, the tail
    with masked loads."""
    hi = jnp.minimum(length, cache_len)
    lo = jnp.maximum(hi - window, 0) if window is not None else jnp.int32(0)
    num_full = (hi - lo) // tile_k
    num_tiles = (hi - lo + tile_k - 1) // tile_k
    per_split = (num_tiles + splits - 1) // splits
    first = split * per_split
    last = jnp.minimum(first + per_split, num_tiles)

    def full_tile(j, carry):
        return step(carry, lo + j * tile_k, None)

    def tail_tile(carry):
        start = lo + num_full * tile_k
        return step(carry, start, start + jnp.arange(tile_k, dtype=jnp.int32) < hi)

    carry = lax.fori_loop(first, jnp.minimum(last, num_full), full_tile, carry)
    has_tail = (num_full < num_tiles) & (first <= num_full) & (num_full < last)
    return lax.cond(has_tail, tail_tile, lambda c: c, carry)


# step(carry, cols, col_ok, seen) -> carry: fold in-flight tokens `cols` [tile_new] (`col_ok`: real
# tokens) into the carry; seen() loads [rows, tile_new] int8: which of them each query row's node may
# see (called after the step's own loads, the order the kernels have always issued them in).
NewStep = Callable[[Carry, jax.Array, jax.Array, Callable[[], jax.Array]], Carry]


def stream_new(
    carry: Carry,
    step: NewStep,
    mask_ref,
    node: jax.Array,
    row_ok: jax.Array,
    *,
    num_nodes: int,
    tile_new: int,
    split: jax.Array,
    splits: int,
) -> Carry:
    """The T in-flight tokens under the [T, T] mask `mask_ref` (rows of node `node` [rows], real where
    `row_ok`), in tiles of `tile_new`; done by the last split only (the lightest)."""

    def new_tile(c, carry):
        cols = c * tile_new + jnp.arange(tile_new, dtype=jnp.int32)
        col_ok = cols < num_nodes

        def seen() -> jax.Array:
            at = mask_ref.at[node[:, None], cols[None, :]]
            return pltriton.load(at, mask=row_ok[:, None] & col_ok[None, :], other=0)

        return step(carry, cols, col_ok, seen)

    def new_part(carry):
        return lax.fori_loop(0, cdiv(num_nodes, tile_new), new_tile, carry)

    return new_part(carry) if splits == 1 else lax.cond(split == splits - 1, new_part, lambda c: c, carry)


def combine_splits(acc: jax.Array, m: jax.Array, l: jax.Array) -> jax.Array:
    """Merge split partials: acc [splits, ..., D], m, l [splits, ...] (log2 units) -> [..., D]."""
    m_all = jnp.max(m, axis=0)
    w = jnp.exp2(m - m_all[None])
    l_all = jnp.sum(w * l, axis=0)
    acc_all = jnp.sum(w[..., None] * acc, axis=0)
    return acc_all / jnp.where(l_all > 0, l_all, 1.0)[..., None]


def merge_by_lse(parts: list[tuple[jax.Array, jax.Array]]) -> jax.Array:
    """Softmax over the union of disjoint key sets from each set's (normalised output [..., D],
    natural lse [...]); a set with lse -inf adds nothing; a row no set sees gets zeros (as in
    `tree_attention_reference`)."""
    m = jnp.max(jnp.stack([lse for _, lse in parts]), axis=0)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    weights = [jnp.exp(lse - m) for _, lse in parts]
    total = sum(weights)
    acc = sum(w[..., None] * out for w, (out, _) in zip(weights, parts, strict=True))
    return acc / jnp.where(total > 0, total, 1.0)[..., None]
