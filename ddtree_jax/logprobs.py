"""Log-probabilities of the target's chosen tokens and of its top K alternatives (docs/sampling.md,
"Log-probabilities").

Computed on the device from the logits the target chose from: the verify pass's nodes (the accepted
path's picked at commit) and the prefill's last token. Two distributions, as vLLM's `logprobs_mode`:
  raw        log_softmax of the target's logits (the default)
  processed  log_softmax after temperature, top-k and top-p (tokens outside the kept support: -inf);
             a greedy row (temperature 0) reads the raw distribution
Off (K = 0, the default) nothing is computed and the decode state carries nothing.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from ddtree_jax import collectives
from ddtree_jax.collectives import Axis, psum, vocab_offset
from ddtree_jax.sampling import SamplingArrays, support_floor, tempered

MODES = ("raw", "processed")


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Logprobs:
    """Per token: the chosen token's log-probability [..., N] and the top K's [..., N, K] (ids too)."""

    chosen: jax.Array  # [..., N] float32
    top: jax.Array  # [..., N, K] float32, descending
    top_ids: jax.Array  # [..., N, K] int32 global ids


def node_logprobs(
    logits: jax.Array,
    choice: jax.Array,
    sampling: SamplingArrays | None,
    k: int,
    mode: str,
    axis: Axis = None,
) -> Logprobs:
    """logits [B, T, V_local] and the chosen tokens [B, T] -> their Logprobs [B, T] / [B, T, K]."""
    logits = logits.astype(jnp.float32)
    if mode == "processed" and sampling is not None:
        floor = support_floor(logits, sampling, axis)[..., None]
        kept = jnp.where(logits >= floor, tempered(logits, sampling), -jnp.inf)
        logits = jnp.where(sampling.temperature[:, None, None] > 0, kept, logits)
    logp = collectives.log_softmax(logits, axis)
    v = logits.shape[-1]
    local = choice - vocab_offset(v, axis)
    inside = (local >= 0) & (local < v)
    picked = jnp.take_along_axis(logp, jnp.clip(local, 0, v - 1)[..., None], axis=-1)[..., 0]
    chosen = psum(jnp.where(inside, picked, 0.0), axis)
    top, top_ids = collectives.sharded_top_k(logp, k, axis)
    return Logprobs(chosen, top, top_ids)


def empty(rows: int, slots: int, k: int) -> Logprobs:
    """Buffers of `rows` rows x `slots` tokens, zero."""
    return Logprobs(
        jnp.zeros((rows, slots), jnp.float32),
        jnp.zeros((rows, slots, k), jnp.float32),
        jnp.zeros((rows, slots, k), jnp.int32),
    )


def at_path(node: Logprobs, path: jax.Array) -> Logprobs:
    """The nodes' Logprobs [B, T] gathered at the accepted path's nodes [B, W] -> [B, W]."""
    return Logprobs(
        jnp.take_along_axis(node.chosen, path, axis=1),
        jnp.take_along_axis(node.top, path[..., None], axis=1),
        jnp.take_along_axis(node.top_ids, path[..., None], axis=1),
    )


def write(buf: Logprobs, new: Logprobs, start: jax.Array) -> Logprobs:
    """`new` [B, W] written into the buffers [B, S] at each row's `start` [B]."""

    def put(b, n):
        index = lambda s: (s,) + (0,) * (b.ndim - 2)  # noqa: E731
        return jax.vmap(lambda row, x, s: jax.lax.dynamic_update_slice(row, x, index(s)))(b, n, start)

    return jax.tree.map(put, buf, new)


def to_lists(chosen, top, top_ids, ids: list[int]) -> tuple[list, list]:
    """Host side: SGLang's `output_token_logprobs` ([logprob, token_id] per token) and
    `output_top_logprobs` (K [logprob, token_id] per token) of the tokens `ids` (-inf: None)."""

    def num(x) -> float | None:
        x = float(x)
        return x if x > float("-inf") else None

    token = [[num(chosen[i]), int(t)] for i, t in enumerate(ids)]
    alts = [[[num(v), int(j)] for v, j in zip(top[i], top_ids[i], strict=True)] for i in range(len(ids))]
    return token, alts
