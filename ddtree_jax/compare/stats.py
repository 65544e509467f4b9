"""Sampled tokens against exact probabilities: a G-test per sampled prefix, summed over positions.

At output position k the exact distribution depends on the tokens sampled before it, so samples are
grouped by their prefix (x_0 .. x_{k-1}) and each group's x_k counts are tested against the target's
exact conditional P(x_k | prompt, prefix). By the chain rule the groups' G statistics add up to the
test of the joint distribution of (x_0 .. x_{K-1}) (and their degrees of freedom add up too), without
the V^K table: one target forward per distinct prefix. Cells expected fewer than MIN_EXPECTED times
are pooled into one bin (merged into the smallest cell when the pool itself is too small), the usual
rule for the chi-squared approximation.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable

import numpy as np
from scipy import stats

MIN_EXPECTED = 5.0


def pooled(observed: np.ndarray, expected: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Bins with expected >= MIN_EXPECTED, plus one bin pooling the rest (merged away when too small)."""
    big = expected >= MIN_EXPECTED
    obs, exp = list(observed[big]), list(expected[big])
    rest_obs, rest_exp = observed[~big].sum(), expected[~big].sum()
    if rest_exp >= MIN_EXPECTED or not exp:
        obs.append(rest_obs)
        exp.append(rest_exp)
    elif rest_exp > 0 or rest_obs > 0:
        i = int(np.argmin(exp))
        obs[i] += rest_obs
        exp[i] += rest_exp
    return np.asarray(obs, np.float64), np.asarray(exp, np.float64)


def g_statistic(observed: np.ndarray, expected: np.ndarray) -> tuple[float, int]:
    """G = 2 sum obs log(obs / exp) over the pooled bins, and its degrees of freedom (bins - 1).

    A count in a bin of zero expectation (a token outside the exact support) makes G infinite."""
    obs, exp = pooled(np.asarray(observed, np.float64), np.asarray(expected, np.float64))
    if np.any((exp == 0) & (obs > 0)):
        return float("inf"), max(len(obs) - 1, 1)
    terms = np.where(obs > 0, obs * np.log(np.maximum(obs, 1) / np.where(exp > 0, exp, 1)), 0.0)
    return float(2 * terms.sum()), len(obs) - 1


def p_value(g: float, dof: int) -> float:
    """P(chi2_dof >= g); 1 when there is nothing to test (dof 0)."""
    return float(stats.chi2.sf(g, dof)) if dof > 0 else 1.0


@dataclasses.dataclass
class PositionTest:
    """The G-test at one output position (0-based), summed over the sampled prefixes before it."""

    position: int
    samples: int  # samples that reached this position
    prefixes: int  # distinct sampled prefixes (groups)
    g: float
    dof: int

    @property
    def p_value(self) -> float:
        """This position's p-value."""
        return p_value(self.g, self.dof)


def prefix_groups(samples: list[list[int]], position: int) -> dict[tuple[int, ...], list[int]]:
    """Sampled prefix (tokens before `position`) -> the tokens sampled at `position` after it."""
    groups: dict[tuple[int, ...], list[int]] = collections.defaultdict(list)
    for s in samples:
        if len(s) > position:
            groups[tuple(s[:position])].append(s[position])
    return dict(groups)


def position_tests(
    samples: list[list[int]],
    positions: int,
    next_probs: Callable[[list[tuple[int, ...]]], np.ndarray],
) -> list[PositionTest]:
    """One test per output position < `positions`; `next_probs(prefixes)` gives the exact [P, V]
    distributions of the token after each prefix (prompt implied)."""
    out = []
    for k in range(positions):
        groups = prefix_groups(samples, k)
        prefixes = sorted(groups)
        probs = next_probs(prefixes) if prefixes else np.zeros((0, 0))
        g, dof = 0.0, 0
        for prefix, p in zip(prefixes, probs, strict=True):
            counts = np.bincount(groups[prefix], minlength=len(p)).astype(np.float64)
            gi, di = g_statistic(counts, p * len(groups[prefix]))
            g, dof = g + gi, dof + di
        out.append(PositionTest(k, sum(len(v) for v in groups.values()), len(prefixes), g, dof))
    return out


def combined_p_value(tests: list[PositionTest]) -> float:
    """The joint test over all positions: G and degrees of freedom summed."""
    return p_value(sum(t.g for t in tests), sum(t.dof for t in tests))


def processed_probs(logits: np.ndarray, temperature: float, top_k: int, top_p: float) -> np.ndarray:
    """Exact sampling distribution [..., V] by sorting (HF's order: temperature, top-k, then top-p over
    the top-k survivors renormalised); an oracle independent of the engine's floor search."""
    z = np.asarray(logits, np.float64) / temperature
    order = np.argsort(-z, axis=-1, kind="stable")
    ranked = np.take_along_axis(z, order, axis=-1)
    keep = np.ones(ranked.shape, bool)
    if top_k > 0:
        keep[..., top_k:] = False
    p = np.where(keep, np.exp(ranked - ranked[..., :1]), 0.0)
    p /= p.sum(axis=-1, keepdims=True)
    if top_p < 1.0:
        before = np.cumsum(p, axis=-1) - p  # mass of the strictly more likely tokens
        keep &= before < top_p
        p = np.where(keep, p, 0.0)
        p /= p.sum(axis=-1, keepdims=True)
    out = np.empty_like(p)
    np.put_along_axis(out, order, p, axis=-1)
    return out
