"""Where two outputs first differ, and the target's margin there (a near-tie or a real difference).

The margin is recomputed in float32, teacher-forced over prompt + the reference output: greedy, the gap
between the target's two largest logits at that position; sampled, the gap between the two largest
Gumbel-max scores (tempered logits + the request's noise at that position, over the top-k / top-p
support), which is what decided the token. `gap` is the same difference between the two tokens the
outputs chose. A gap within the dtype's tolerance is a near-tie that rounding may flip.
"""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from ddtree_jax.compare.report import Divergence
from ddtree_jax.config import TargetConfig
from ddtree_jax.sampling import GREEDY, SamplingArrays, gumbel, support_floor, tempered
from ddtree_jax.weights import Params

# Largest float32 gap between the two chosen tokens' scores still called a near-tie, by the dtype the
# outputs were computed in (bfloat16 keeps 8 bits of mantissa: logits of magnitude ~10 move by ~0.05).
NEAR_TIE = {"float32": 1e-3, "bfloat16": 0.25}


def first_divergence(reference: list[int], other: list[int]) -> int | None:
    """The first output position where `other` differs from `reference` (None when identical)."""
    for i, (a, b) in enumerate(zip(reference, other, strict=False)):
        if a != b:
            return i
    return None if len(reference) == len(other) else min(len(reference), len(other))


@dataclasses.dataclass
class Scorer:
    """The target in float32 on one device, for teacher-forced logits."""

    cfg: TargetConfig
    params: Params

    @classmethod
    def load(cls, target_dir: str | Path) -> Scorer:
        """Load the target in float32 (whatever dtype the outputs were made in)."""
        from ddtree_jax import target
        from ddtree_jax.sharding import make_mesh, param_sharding

        cfg, params = target.load(target_dir, jnp.float32, param_sharding(make_mesh(1, 1)))
        return cls(cfg, params)

    def logits(self, ids: list[int]) -> np.ndarray:
        """float32 logits [n, V] at every position of one sequence `ids` (row i predicts token i + 1)."""
        n = len(ids)
        padded = -(-n // 64) * 64  # few shapes to compile
        tokens = jnp.asarray([ids + [0] * (padded - n)], jnp.int32)
        with jax.default_matmul_precision("highest"):
            out = _all_logits(self.params, tokens, cfg=self.cfg)
        return np.asarray(out[0, :n])

    def next_logits(self, rows: list[list[int]], batch_size: int = 64) -> np.ndarray:
        """float32 logits [R, V] of the token after each row (all rows of one length)."""
        n = len(rows[0])
        padded = -(-n // 64) * 64  # few shapes to compile
        out = []
        for start in range(0, len(rows), batch_size):
            part = rows[start : start + batch_size]
            part = part + [part[-1]] * (min(batch_size, len(rows)) - len(part))  # one shape per length
            tokens = jnp.asarray([r + [0] * (padded - n) for r in part], jnp.int32)
            with jax.default_matmul_precision("highest"):
                out.append(np.asarray(_next_logits(self.params, tokens, jnp.int32(n - 1), cfg=self.cfg)))
        return np.concatenate(out)[: len(rows)]


@functools.partial(jax.jit, static_argnames="cfg")
def _all_logits(params: Params, tokens: jax.Array, cfg: TargetConfig) -> jax.Array:
    """Causal forward over tokens [1, n]; the logits [1, n, V] at every position."""
    from ddtree_jax import target

    n = tokens.shape[1]
    positions = jnp.arange(n)[None]
    mask = jnp.tril(jnp.ones((n, n), bool))[None]
    return target.logits(params, target.forward(params, cfg, tokens, positions, mask, None).hidden)


@functools.partial(jax.jit, static_argnames="cfg")
def _next_logits(params: Params, tokens: jax.Array, last: jax.Array, cfg: TargetConfig) -> jax.Array:
    """Causal forward over tokens [R, n]; the logits [R, V] at position `last` only."""
    from ddtree_jax import target

    r, n = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(n), (r, n))
    mask = jnp.broadcast_to(jnp.tril(jnp.ones((n, n), bool)), (r, n, n))
    hidden = target.forward(params, cfg, tokens, positions, mask, None).hidden
    return target.logits(params, jax.lax.dynamic_index_in_dim(hidden, last, axis=1, keepdims=False))


def decision_scores(logits: np.ndarray, options: dict, position: int) -> np.ndarray:
    """The scores the target's choice maximises at one position: logits (greedy) or, sampled, tempered
    logits + the request's Gumbel noise at `position`, -inf outside the top-k / top-p support (`options`:
    the prompt's sampling settings)."""
    settings = GREEDY | options
    if settings["temperature"] == 0:
        return logits
    sp = SamplingArrays.from_rows([settings])
    row = jnp.asarray(logits, jnp.float32)[None, None]  # [1, 1, V]
    floor = support_floor(row, sp)[..., None]
    noise = gumbel(sp.seed, jnp.asarray([[position]]), row.shape[-1])
    return np.asarray(jnp.where(row >= floor, tempered(row, sp) + noise, -jnp.inf)[0, 0])


def divergence(
    scorer: Scorer,
    id_,
    prompt_ids: list[int],
    reference: list[int],
    other: list[int],
    options: dict,
    dtype: str,
) -> Divergence | None:
    """The first divergence of `other` from `reference`, with the target's margin there (None if equal)."""
    pos = first_divergence(reference, other)
    if pos is None:
        return None
    extra = {"reference_token": reference[pos] if pos < len(reference) else None}
    extra["token"] = other[pos] if pos < len(other) else None
    if pos >= len(reference) or pos == 0 and not prompt_ids:
        return Divergence(id_, pos, None, extra)
    row = scorer.next_logits([prompt_ids + reference[:pos]])[0]
    scores = decision_scores(row, options, len(prompt_ids) + pos)
    top2 = np.sort(scores)[-2:]
    extra["reference_is_top1"] = bool(scores[reference[pos]] == top2[1])
    if extra["token"] is not None:
        gap = float(abs(scores[reference[pos]] - scores[extra["token"]]))  # inf: outside the support
        extra["gap"] = gap if np.isfinite(gap) else None
        extra["near_tie"] = bool(gap <= NEAR_TIE.get(dtype, NEAR_TIE["float32"]))
    return Divergence(id_, pos, float(top2[1] - top2[0]), extra)
