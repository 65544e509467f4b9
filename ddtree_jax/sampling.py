"""The target's choice at every tree node: greedy argmax, or a seeded sample (docs/design.md, "Sampling
that stays lossless on a tree").

A sampled choice is Gumbel-max over the processed target distribution:

    choice = argmax_v  logits[v] / temperature + gumbel(seed, position, v)   over the kept support

where `position` is the absolute position of the token being CHOSEN: the logits at position p choose
the token at p + 1 (prefill: the last prompt token at L - 1 chooses the token at L; verify: tree node i
at L + depth[i] chooses the token at L + depth[i] + 1). The noise is a counter-based integer hash of
(seed, position, token id) only, so ar, dflash and ddtree emit the same tokens under the same seed,
whatever the budget, the batch or the other requests in it; and the walk, which follows the sampled
child, emits exactly the target's sampling distribution.

Processing order, as in Hugging Face: temperature, then top-k, then top-p on the renormalised
tempered distribution. Ties keep every token equal to the threshold: top-k keeps all tokens whose
logit equals the k-th largest (possibly more than k); top-p keeps the smallest set {p >= t} whose mass
is >= top_p, so tokens tied at t are all in or all out. Both cut-offs keep an upper set of logits, so
the kept support is {logit >= floor} with one `floor` per node, found in one of two ways:

- the shortlist (fast, the usual case): the SHORTLIST largest logits of each node, sorted
  (`collectives.tiled_top_k`: one pass over the vocabulary). top-k <= SHORTLIST
  reads its threshold there; top-p runs a cumulative sum down the shortlist, normalised by the kept
  mass from one pass over the vocabulary. Two passes over [T, V] in all.
- bisection (exact for any setting): for the nodes whose top-k exceeds the shortlist or whose top-p
  mass is not reached inside it, both thresholds come from 32 halvings over the bit patterns of
  float32 values (32 masked counts or sums over the vocabulary each, no sort). It runs over the
  whole [B, T, V] when any node needs it, so one such node costs the whole batch its passes.

The two ways agree up to float rounding of the top-p mass (a cumulative sum down the shortlist
against masked sums): a node whose top_p lies within rounding of a partial sum may keep one set or
the other. Which way a node takes depends only on its own logits and settings, so outputs stay
independent of the batch and the tree.

Vocabulary-parallel (`model_axis` set, logits [..., V_local] per device): the noise takes global
token ids, the shortlist is the top of an all-gather of each device's shortlist, the top-p mass and
the bisection's counts and sums are all-reduced, and the argmax is the global one with the lowest-id
tie rule (collectives.py), so the choice equals the unsplit one.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from ddtree_jax.collectives import Axis, axis_size, pmax, pmin, psum, sharded_top_k, vocab_offset
from ddtree_jax.collectives import argmax as vocab_argmax
from ddtree_jax.collectives import softmax as vocab_softmax

MAX_SEED = 2**32  # seeds are uint32


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class SamplingArrays:
    """The rows' sampling settings as device arrays, traced (not static): one compiled program serves
    any values (on the host: one {temperature, top_k, top_p, seed} dict per row; `api.SamplingParams`
    is the Python API's per-prompt object)."""

    temperature: jax.Array  # [B] float32; 0 = greedy (argmax) for that row
    top_k: jax.Array  # [B] int32; 0 = off
    top_p: jax.Array  # [B] float32; 1.0 = off
    seed: jax.Array  # [B] uint32

    @classmethod
    def from_rows(cls, rows: list[dict]) -> SamplingArrays:
        """From one {temperature, top_k, top_p, seed} dict per row (already validated)."""
        column = {
            "temperature": np.array([r["temperature"] for r in rows], np.float32),
            "top_k": np.array([r["top_k"] for r in rows], np.int32),
            "top_p": np.array([r["top_p"] for r in rows], np.float32),
            "seed": np.array([r["seed"] for r in rows], np.uint32),
        }  # placed, not staged: jnp.asarray compiles a program per shape outside jit (jax 0.11)
        return cls(**jax.device_put(column))


GREEDY = {"temperature": 0.0, "top_k": 0, "top_p": 1.0, "seed": 0}


def check(name: str, value) -> str | None:
    """Why `value` is not a valid setting `name` (temperature, top_k, top_p, seed), or None if it is."""
    if name in ("top_k", "seed"):
        if not isinstance(value, int) or isinstance(value, bool):
            return "must be an integer"
        if name == "top_k" and value < 0:
            return f"must be >= 0 (0 = off), got {value}"
        if name == "seed" and not 0 <= value < MAX_SEED:
            return f"must be in [0, 2^32), got {value}"
        return None
    if not isinstance(value, int | float) or isinstance(value, bool) or not math.isfinite(value):
        return f"must be a finite number, got {value!r}"
    if name == "temperature" and value < 0:
        return f"must be >= 0 (0 = greedy), got {value}"
    if name == "top_p" and not 0 < value <= 1:
        return f"must be in (0, 1] (1 = off), got {value}"
    return None


# -- counter-based noise -------------------------------------------------------------------------


def _mix(h: jax.Array) -> jax.Array:
    """murmur3's 32-bit finaliser: a bijection of uint32 with full avalanche."""
    h = h ^ (h >> 16)
    h = h * jnp.uint32(0x85EBCA6B)
    h = h ^ (h >> 13)
    h = h * jnp.uint32(0xC2B2AE35)
    return h ^ (h >> 16)


def gumbel(seed: jax.Array, position: jax.Array, vocab_size: int, first_token=0) -> jax.Array:
    """Gumbel(0, 1) noise [B, T, V] from seed [B] uint32, position [B, T] and the token id.

    A pure function of (seed, position, token id): the same under any batch, tree or vocab sharding
    (a vocabulary slice passes its first global id as `first_token`).
    """
    h = _mix(seed.astype(jnp.uint32) ^ jnp.uint32(0x9E3779B9))[:, None]  # [B, 1]
    h = _mix(h + position.astype(jnp.uint32) * jnp.uint32(0x9E3779B1))  # [B, T]
    token = jnp.arange(vocab_size, dtype=jnp.uint32) + jnp.asarray(first_token).astype(jnp.uint32)
    h = _mix(h[:, :, None] + token * jnp.uint32(0x85EBCA77))  # [B, T, V]
    # 23 bits -> u in (0, 1) strictly, exactly representable (1 - 2^-24 at most): -log(-log u) is finite.
    u = ((h >> 9).astype(jnp.float32) + 0.5) * (1.0 / (1 << 23))
    return -jnp.log(-jnp.log(u))


# -- exact thresholds by bisection -----------------------------------------------------------------


def _ordered_bits(x: jax.Array) -> jax.Array:
    """float32 -> uint32 with the same order (negative floats below positive ones)."""
    bits = jax.lax.bitcast_convert_type(x, jnp.uint32)
    return jnp.where(bits >> 31 == 1, ~bits, bits | jnp.uint32(0x80000000))


def _largest_threshold(keys: jax.Array, weight: jax.Array, need: jax.Array, axis: Axis = None) -> jax.Array:
    """Per row of keys [..., V] uint32: the largest t with sum(weight[keys >= t]) >= need [..., 1].

    Bisection over uint32 (32 halvings make the interval a point), so t is exactly one of the keys
    whenever the whole row meets `need`; rows that do not, get the row minimum (keep everything).
    A vocabulary split over `axis` all-reduces the bounds and every masked sum.
    """
    lo = pmin(jnp.min(keys, axis=-1, keepdims=True), axis)
    hi = pmax(jnp.max(keys, axis=-1, keepdims=True), axis)

    def step(_, bounds):
        lo, hi = bounds
        gap = hi - lo
        mid = lo + (gap >> 1) + (gap & 1)  # ceil midpoint without overflow
        ok = psum(jnp.sum(jnp.where(keys >= mid, weight, 0), axis=-1, keepdims=True), axis) >= need
        return jnp.where(ok, mid, lo), jnp.where(ok, hi, mid - 1)

    lo, _ = jax.lax.fori_loop(0, 32, step, (lo, hi))
    return lo


def top_k_mask(logits: jax.Array, top_k: jax.Array, axis: Axis = None) -> jax.Array:
    """logits [B, T, V], top_k [B] (0 = off) -> keep [B, T, V]: logits >= the k-th largest."""
    v = logits.shape[-1] * axis_size(axis)
    k = jnp.where(top_k > 0, jnp.minimum(top_k, v), v)[:, None, None]
    keys = _ordered_bits(logits)
    return keys >= _largest_threshold(keys, jnp.ones((), jnp.int32), k, axis)


def top_p_mask(probs: jax.Array, top_p: jax.Array, axis: Axis = None) -> jax.Array:
    """probs [B, T, V], top_p [B] (1 = off) -> keep [B, T, V]: the smallest {p >= t} of mass >= top_p."""
    keys = jax.lax.bitcast_convert_type(probs, jnp.uint32)  # probs >= 0: bits are ordered
    need = top_p[:, None, None]
    keep = keys >= _largest_threshold(keys, probs, need, axis)
    return keep | (need >= 1.0)


def tempered(logits: jax.Array, sampling: SamplingArrays) -> jax.Array:
    """logits [B, T, V] / each row's temperature (greedy rows: / 1)."""
    temperature = sampling.temperature[:, None, None]
    return logits / jnp.where(temperature > 0, temperature, 1.0)


def bisection_floor(logits: jax.Array, sampling: SamplingArrays, axis: Axis = None) -> jax.Array:
    """The smallest kept logit per node [B, T] after top-k and top-p, by bisection (any setting)."""
    keep = jax.lax.cond(
        jnp.any(sampling.top_k > 0),
        lambda: top_k_mask(logits, sampling.top_k, axis),
        lambda: jnp.ones(logits.shape, jnp.bool_),
    )
    keep = jax.lax.cond(
        jnp.any(sampling.top_p < 1.0),
        lambda: (
            keep
            & top_p_mask(
                vocab_softmax(jnp.where(keep, tempered(logits, sampling), -jnp.inf), axis),
                sampling.top_p,
                axis,
            )
        ),
        lambda: keep,
    )
    return pmin(jnp.min(jnp.where(keep, logits, jnp.inf), axis=-1), axis)


# -- the shortlist --------------------------------------------------------------------------------

SHORTLIST = 64  # largest logits kept sorted per node: top-k up to 64 and most top-p settings use them


def shortlist(logits: jax.Array, axis: Axis = None) -> jax.Array:
    """The min(SHORTLIST, V) largest logits of each node [..., V_local] -> [..., n], descending."""
    return sharded_top_k(logits, min(SHORTLIST, logits.shape[-1] * axis_size(axis)), axis)[0]


def shortlist_floor(
    logits: jax.Array, sampling: SamplingArrays, axis: Axis = None
) -> tuple[jax.Array, jax.Array]:
    """The smallest kept logit per node from the shortlist [B, T], and where that is exact [B, T] bool.

    Not exact (the caller falls back to bisection) when top-k exceeds the shortlist, or when the
    shortlist's kept tokens do not reach the top-p mass. Greedy rows are always "exact" (unused).
    """
    top = shortlist(logits, axis)  # [B, T, n] descending
    n, vocab = top.shape[-1], logits.shape[-1] * axis_size(axis)
    k = jnp.where(sampling.top_k > 0, jnp.minimum(sampling.top_k, vocab), 0)[:, None]  # [B, 1]
    kth = jnp.take_along_axis(top, jnp.clip(k - 1, 0, n - 1)[..., None], axis=-1)[..., 0]
    k_floor = jnp.where(k > 0, kth, -jnp.inf)  # [B, T]
    # top-p over the top-k survivors, renormalised: Z from one pass over the vocabulary.
    peak = tempered(top[..., :1], sampling)
    weight = jnp.where(logits >= k_floor[..., None], jnp.exp(tempered(logits, sampling) - peak), 0.0)
    mass = psum(jnp.sum(weight, axis=-1, keepdims=True), axis)
    probs = jnp.where(top >= k_floor[..., None], jnp.exp(tempered(top, sampling) - peak) / mass, 0.0)
    reached = jnp.cumsum(probs, axis=-1) >= sampling.top_p[:, None, None]
    first = jnp.argmax(reached, axis=-1)  # first shortlist entry at which the mass is reached
    t = jnp.take_along_axis(probs, first[..., None], axis=-1)
    last = jnp.sum(probs >= t, axis=-1) - 1  # probs descend: ties with entry `first` extend it
    p_floor = jnp.take_along_axis(top, last[..., None], axis=-1)[..., 0]
    use_p = (sampling.top_p < 1.0)[:, None]
    floor = jnp.where(use_p, p_floor, k_floor)
    exact = (k <= n) & (~use_p | jnp.any(reached, axis=-1)) | (sampling.temperature == 0)[:, None]
    return floor, exact


def support_floor(logits: jax.Array, sampling: SamplingArrays, axis: Axis = None) -> jax.Array:
    """The smallest logit each node keeps after top-k and top-p [B, T] (-inf when neither is set)."""

    def filtered():
        floor, exact = shortlist_floor(logits, sampling, axis)
        # Nodes the shortlist cannot decide take bisection's floor; every other node keeps its own, so a
        # node's choice never depends on the other rows of the batch or nodes of the tree.
        return jax.lax.cond(
            jnp.all(exact),
            lambda: floor,
            lambda: jnp.where(exact, floor, bisection_floor(logits, sampling, axis)),
        )

    return jax.lax.cond(
        jnp.any((sampling.top_k > 0) | (sampling.top_p < 1.0)),
        filtered,
        lambda: jnp.full(logits.shape[:-1], -jnp.inf, jnp.float32),
    )


def choose(
    logits: jax.Array,
    sampling: SamplingArrays | None = None,
    position: jax.Array | None = None,
    model_axis: Axis = None,
):
    """logits [B, T, V] -> the target's token at each node [B, T] int32.

    sampling None: greedy. Otherwise `position` [B, T] is the absolute position of the token each node
    chooses (the node's own position + 1); rows with temperature 0 stay greedy. `model_axis`: the
    vocabulary is split over it (logits [B, T, V_local]); the result is the same global token id.
    """
    greedy = vocab_argmax(logits, model_axis)
    if sampling is None:
        return greedy
    logits = logits.astype(jnp.float32)
    floor = support_floor(logits, sampling, model_axis)[..., None]
    v = logits.shape[-1]
    noisy = tempered(logits, sampling) + gumbel(sampling.seed, position, v, vocab_offset(v, model_axis))
    sampled = vocab_argmax(jnp.where(logits >= floor, noisy, -jnp.inf), model_axis)
    return jnp.where(sampling.temperature[:, None] > 0, sampled, greedy)
