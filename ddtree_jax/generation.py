"""Batched offline generation: bucket prompts, compile one program per shape, run, collect results."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ddtree_jax.engine import DecodeState, HostStepper, Plan, generate_jit
from ddtree_jax.prompts import Prompt
from ddtree_jax.sampling import GREEDY, SamplingParams
from ddtree_jax.text import TextCodec
from ddtree_jax.weights import Params

MAX_STOP_IDS = 8


@dataclasses.dataclass
class Result:
    """One output line."""

    id: Any
    output_ids: list[int]
    finish_reason: str  # "stop" | "length"
    rounds: int
    acceptance_lengths: list[int]
    text: str | None = None

    def to_json(self) -> dict[str, Any]:
        """The JSON object written for this prompt."""
        out = {"id": self.id, "output_ids": self.output_ids}
        if self.text is not None:
            out["text"] = self.text
        out |= {
            "finish_reason": self.finish_reason,
            "num_output_tokens": len(self.output_ids),
            "rounds": self.rounds,
            "acceptance_lengths": self.acceptance_lengths,
        }
        return out


def prompt_bucket(length: int) -> int:
    """Padded prompt length: the next power of two, at least 16."""
    return max(16, 1 << (length - 1).bit_length())


@dataclasses.dataclass
class Generator:
    """Holds the models and compiled programs; `run` generates for a list of prompts."""

    params: Params
    draft_params: Params | None
    plan_template: Plan  # prompt_len is filled per batch
    stop_ids: tuple[int, ...]
    codec: TextCodec | None = None
    host_stepped: bool = False
    sampling: dict = dataclasses.field(default_factory=lambda: dict(GREEDY))  # defaults; prompts override
    compile_seconds: float = 0.0
    generate_seconds: float = 0.0
    _compiled: dict = dataclasses.field(default_factory=dict)
    stage_seconds: dict = dataclasses.field(default_factory=dict)

    def _stop_array(self) -> jax.Array:
        ids = list(self.stop_ids)[:MAX_STOP_IDS]
        return jnp.asarray(ids + [-1] * (MAX_STOP_IDS - len(ids)), jnp.int32)

    def _inputs(self, batch: list[Prompt], plan: Plan):
        b, p = plan.batch_size, plan.prompt_len
        tokens = np.zeros((b, p), np.int32)
        lengths = np.ones((b,), np.int32)
        active = np.zeros((b,), bool)
        for i, prompt in enumerate(batch):
            tokens[i, : len(prompt.input_ids)] = prompt.input_ids
            lengths[i] = len(prompt.input_ids)
            active[i] = True
        arrays = jnp.asarray(tokens), jnp.asarray(lengths), jnp.asarray(active), self._stop_array()
        return (*arrays, self._sampling(batch, b))

    def _sampling(self, batch: list[Prompt], batch_size: int) -> SamplingParams | None:
        """Each row's settings (the prompt's own over the defaults); None when every row is greedy."""
        rows = [self.sampling | {k: p.options[k] for k in GREEDY if k in p.options} for p in batch]
        rows += [dict(GREEDY)] * (batch_size - len(rows))
        if all(r["temperature"] == 0 for r in rows):
            return None
        return SamplingParams.from_rows(rows)

    def _program(self, plan: Plan, args) -> Callable:
        key = (plan, args[-1] is not None)  # greedy-only and sampling programs compile apart
        if key not in self._compiled:
            start = time.perf_counter()
            if self.host_stepped:
                self._compiled[key] = HostStepper(plan)
            else:
                lowered = generate_jit.lower(self.params, self.draft_params, *args, plan=plan)
                self._compiled[key] = lowered.compile()
            self.compile_seconds += time.perf_counter() - start
        return self._compiled[key]

    def run_batch(self, batch: list[Prompt]) -> list[Result]:
        """Generate for up to batch_size prompts (the batch is padded with inactive rows)."""
        longest = max(len(p.input_ids) for p in batch)
        plan = dataclasses.replace(self.plan_template, prompt_len=prompt_bucket(longest))
        args = self._inputs(batch, plan)
        program = self._program(plan, args)
        start = time.perf_counter()
        if self.host_stepped:
            compiled_before = program.compile_seconds
            state = program.run(self.params, self.draft_params, *args)
            compiled = program.compile_seconds - compiled_before
            self.compile_seconds += compiled
            start += compiled  # first stage calls compile: not generation time
            for stage, times in program.times.items():
                self.stage_seconds[stage] = self.stage_seconds.get(stage, 0.0) + sum(times)
            program.times.clear()
        else:
            state = program(self.params, self.draft_params, *args)
        state = _fetch(_outputs(state))
        self.generate_seconds += time.perf_counter() - start
        return [self._result(prompt, state, i) for i, prompt in enumerate(batch)]

    def _result(self, prompt: Prompt, state: dict, i: int) -> Result:
        n, rounds = int(state["num_output"][i]), int(state["rounds"][i])
        ids = state["output"][i, :n].tolist()
        return Result(
            id=prompt.id,
            output_ids=ids,
            finish_reason="stop" if state["stopped"][i] else "length",
            rounds=rounds,
            acceptance_lengths=state["acceptance"][i, :rounds].tolist(),
            text=self.codec.decode(ids) if self.codec is not None else None,
        )


def _fetch(tree: dict[str, jax.Array]) -> dict[str, np.ndarray]:
    """The outputs on the host; with several processes, each gathers every process's rows."""
    if jax.process_count() == 1:
        return jax.device_get(tree)
    from jax.experimental import multihost_utils

    return multihost_utils.process_allgather(tree, tiled=True)


def _outputs(state: DecodeState) -> dict[str, jax.Array]:
    return {
        "output": state.output,
        "num_output": state.num_output,
        "stopped": state.stopped,
        "rounds": state.rounds,
        "acceptance": state.acceptance,
    }
