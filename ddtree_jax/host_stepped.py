"""Host-stepped rounds (`--host-stepped`): the round driven from the host one jitted step
(engine.STAGES) at a time, each step's wall time kept, compilation kept apart.

A baseline and a profiling aid, not the fast path: every step returns to the host. The scheduler's
other policies run the same steps inside one device program (programs.Programs.rounds).
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable

import jax
import numpy as np

from ddtree_jax.engine import DecodeState
from ddtree_jax.programs import Programs
from ddtree_jax.results import fetch


class HostStepper:
    """The round driven from the host, one jitted step (engine.STAGES) at a time, with the wall time
    of each call; a step's first call on new shapes compiles and counts as compilation."""

    def __init__(self, programs: Programs, timed: bool = True):
        self.programs = programs
        self.timed = timed  # prefill() times its program (a host-stepped run), else just calls it
        self.times: dict[str, list[float]] = collections.defaultdict(list)
        self.stage_seconds: dict[str, float] = {}  # summed over rounds run (and prefill)
        self._compiled: set[tuple] = set()

    def _timed(self, stage: str, shapes: tuple, *args):
        begin = time.perf_counter()
        out = jax.block_until_ready(self.programs.stages()[stage](*args))
        seconds = time.perf_counter() - begin
        if (stage, *shapes) in self._compiled:
            self.times[stage].append(seconds)
        else:
            self._compiled.add((stage, *shapes))
            self.programs.count_compile(stage, seconds)
        return out

    def round(self, state: DecodeState) -> DecodeState:
        """One round (the state donated), step by step, each step's wall time appended to `times`."""
        p, d, plan = self.programs.params, self.programs.draft_params, self.programs.plan
        shapes = (state.bonus.shape, state.cache.capacity, state.sampling is not None)
        logp = tok = None
        if plan.method != "ar":
            logp, tok = self._timed("draft", shapes, p, d, state)
        t = self._timed("build", shapes, state, logp, tok)
        choice, kv, features = self._timed("verify", shapes, p, state, t)
        w = self._timed("walk", shapes, t, choice)
        return self._timed("commit", shapes, d, state, w, kv, features)

    def rounds(self, state: DecodeState, until: int, most: int) -> tuple[DecodeState, int]:
        """Rounds until `until` rows are done or all are, or `most` ran: (state, rounds run)."""
        ran, rows = 0, state.bonus.shape[0]
        while ran < most and int(np.sum(fetch({"done": state.done})["done"])) < min(until, rows):
            state = self.round(state)
            ran += 1
        for stage, times in self.times.items():
            self.stage_seconds[stage] = self.stage_seconds.get(stage, 0.0) + sum(times)
        self.times.clear()
        return state, ran

    def prefill(self, program: Callable[[], DecodeState]) -> DecodeState:
        """`program()`; timed as the "prefill" step when `timed` (its compilation left out)."""
        if not self.timed:
            return program()
        begin, compiled = time.perf_counter(), self.programs.compile_seconds
        state = jax.block_until_ready(program())
        seconds = time.perf_counter() - begin - (self.programs.compile_seconds - compiled)
        self.stage_seconds["prefill"] = self.stage_seconds.get("prefill", 0.0) + seconds
        return state
