"""The request batch: R prompts bound for rows of a decode state, and the one bucket rule that sizes
every program's prompt buffer. Below both the prefill (prefill.py) and the device programs
(programs.py, job.py), which both take it.
"""

from __future__ import annotations

import dataclasses

import jax

from ddtree_jax.engine import ROW
from ddtree_jax.sampling import SamplingArrays


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Requests:
    """R prompts bound for rows of a decode state (a row index of B or more: padding, dropped)."""

    tokens: jax.Array  # [R, P] int32, right-padded
    lengths: jax.Array  # [R] int32 (>= 1)
    rows: jax.Array  # [R] int32: the state row each goes to
    sampling: SamplingArrays | None  # [R] each; None: every row greedy (the greedy-only program)
    limits: jax.Array  # [R] int32: each one's own max_new_tokens
    stops: jax.Array | None = None  # [R] bool: the run's stop ids end it (ignore_eos: False); None: all


REQUEST_SPECS = Requests(ROW, ROW, ROW, ROW, ROW, ROW)


def prompt_slots(length: int) -> int:
    """The prompt slots of a batch whose longest prompt has `length` tokens, the one bucket rule: the
    next power of two, at least 16 (few shapes compile; a prefill chunk is the smaller of its own size
    and these slots, so the slots are whole chunks)."""
    return max(16, 1 << (length - 1).bit_length())
