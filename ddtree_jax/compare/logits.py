"""How close two sets of logits over the same positions are: error, KL, top-1 agreement.

Rows are positions (row i predicts token i + 1), columns the vocabulary. A row passes when both sides
pick the same top-1 token and its largest error, relative to the reference row's largest |logit|,
is within the tolerance of the dtype our side computed in.
"""

from __future__ import annotations

import dataclasses

import numpy as np

# Largest |ours - reference| / max |reference| allowed in one row, by our compute dtype: float32 runs
# agree to ~1e-6 on the test checkpoints; bfloat16 keeps 8 mantissa bits (relative steps of 2^-8).
TOLERANCE = {"float32": 1e-4, "bfloat16": 5e-2}


@dataclasses.dataclass
class LogitStats:
    """Agreement of two [n, V] logit arrays."""

    rows: int
    max_abs: float  # largest |ours - reference|
    max_rel: float  # largest row error over the row's largest |reference logit|
    kl_mean: float  # mean over rows of KL(reference || ours), nats
    kl_max: float
    top1: float  # share of rows with the same argmax
    first_bad: int | None  # first row that fails (top-1 differs or relative error over tolerance)
    row_abs: np.ndarray  # [n] largest |ours - reference| per row (for plots)
    at_first_bad: dict | None = None  # that row's top-1 tokens, the reference's top-2 margin, their gap


def log_softmax(x: np.ndarray) -> np.ndarray:
    """Row-wise log-softmax in float64."""
    x = x.astype(np.float64)
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def logit_stats(ours: np.ndarray, reference: np.ndarray, tolerance: float) -> LogitStats:
    """Compare `ours` with `reference` ([n, V] each) row by row."""
    if ours.shape != reference.shape:
        raise ValueError(f"logit shapes differ: {ours.shape} vs {reference.shape}")
    diff = np.abs(ours.astype(np.float64) - reference.astype(np.float64))
    row_abs = diff.max(-1)
    row_rel = row_abs / np.maximum(np.abs(reference).max(-1), 1e-30)
    lp_ref, lp_ours = log_softmax(reference), log_softmax(ours)
    kl = (np.exp(lp_ref) * (lp_ref - lp_ours)).sum(-1)
    same = ours.argmax(-1) == reference.argmax(-1)
    bad = np.flatnonzero(~same | (row_rel > tolerance))
    first_bad = int(bad[0]) if len(bad) else None
    return LogitStats(
        rows=len(ours),
        max_abs=float(row_abs.max(initial=0.0)),
        max_rel=float(row_rel.max(initial=0.0)),
        kl_mean=float(kl.mean()) if len(kl) else 0.0,
        kl_max=float(kl.max(initial=0.0)),
        top1=float(same.mean()) if len(same) else 1.0,
        first_bad=first_bad,
        row_abs=row_abs,
        at_first_bad=None if first_bad is None else row_detail(ours[first_bad], reference[first_bad]),
    )


def row_detail(ours: np.ndarray, reference: np.ndarray) -> dict:
    """Both sides' top-1 tokens in one row, the reference's top-2 margin, and the gap between the two
    tokens in the reference's logits (0 when they agree)."""
    ref_token, token = int(reference.argmax()), int(ours.argmax())
    gap = float(reference[ref_token] - reference[token])
    return {"reference_token": ref_token, "token": token, "margin": top2_margin(reference), "gap": gap}


def top2_margin(row: np.ndarray) -> float:
    """The gap between a row's two largest logits."""
    top2 = np.sort(row)[-2:]
    return float(top2[1] - top2[0])
