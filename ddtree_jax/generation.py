"""Offline generation: continuous batching (`Generator.stream`) or static batches (`run_batch`).

`stream` keeps one decode state of B rows (never more rows than prompts): the device runs rounds until
a row finishes, the host collects it and prefills the next waiting prompt into its row, and the rounds
resume (scheduling.py). Prompts go shortest first, so the cache capacity only grows and few shapes
compile. `run_batch` runs a fixed batch until its slowest row finishes (the baseline).
"""

from __future__ import annotations

import collections
import dataclasses
import time
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ddtree_jax import attention, models, scheduling
from ddtree_jax.engine import DecodeState, HostStepper, Plan, generate_jit, rows_to_run
from ddtree_jax.prompts import LIMIT, Prompt
from ddtree_jax.sampling import GREEDY, SamplingParams
from ddtree_jax.scheduling import Schedule
from ddtree_jax.text import TextCodec
from ddtree_jax.weights import Params

MAX_STOP_IDS = 8
# Compiled programs of `Generator.stream` on one device, by (program, plan, shapes, dtype): they depend
# on shapes only, so every generator of the same plan shares them.
STREAM_PROGRAMS: dict[tuple, Any] = {}


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
class Occupancy:
    """Row-rounds of `Generator.stream`: how busy the rows were."""

    rounds: int = 0  # decode rounds run (each over every row of the state)
    row_rounds: int = 0  # rows x rounds
    busy: int = 0  # row-rounds spent on a live prompt
    waiting_row_rounds: int = 0  # row-rounds run while prompts waited for a row
    waiting_busy: int = 0  # of those, busy ones
    refills: int = 0  # prefill programs run
    chunks: int = 0  # returns to the host

    def waiting_fraction(self) -> float:
        """The busy fraction of the row-rounds run while prompts waited (1 when none waited)."""
        return self.waiting_busy / self.waiting_row_rounds if self.waiting_row_rounds else 1.0


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
    schedule: Schedule = Schedule()
    compile_log: list = dataclasses.field(default_factory=list)  # (program, seconds) as stream compiles
    occupancy: Occupancy = dataclasses.field(default_factory=lambda: Occupancy())

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
        return (*arrays, self._sampling(batch, b), self._limits(batch, b))

    def _limits(self, batch: list[Prompt], rows: int) -> jax.Array:
        """Each row's limit of new tokens [rows]: the prompt's own `max_new_tokens`, else the plan's."""
        most = self.plan_template.max_new_tokens
        limits = np.full((rows,), most, np.int32)
        for i, prompt in enumerate(batch):
            n = prompt.options.get(LIMIT, most)
            if not 1 <= n <= most:
                raise ValueError(f"prompt {prompt.id!r}: max_new_tokens {n} is not in [1, {most}]")
            limits[i] = n
        return jnp.asarray(limits)

    def _settings(self, prompt: Prompt) -> dict:
        """The prompt's sampling settings: its own over the defaults."""
        return self.sampling | {k: prompt.options[k] for k in GREEDY if k in prompt.options}

    def _sampling(self, batch: list[Prompt], batch_size: int) -> SamplingParams | None:
        """Each row's settings (the prompt's own over the defaults); None when every row is greedy."""
        rows = [self._settings(p) for p in batch]
        rows += [dict(GREEDY)] * (batch_size - len(rows))
        if all(r["temperature"] == 0 for r in rows):
            return None
        return SamplingParams.from_rows(rows)

    def _program(self, plan: Plan, args) -> Callable:
        _tokens, _lengths, _active, _stop_ids, sampling, _limits = args  # Generator._inputs
        key = (plan, sampling is not None)  # greedy-only and sampling programs compile apart
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

    def stream_rows(self, num_prompts: int) -> int:
        """Rows of the decode state `stream` runs for `num_prompts`: never more than the prompts (on
        every "data" device), except batch-invariant runs, which keep the plan's rows."""
        plan = self.plan_template
        if self.schedule.batch_invariant:
            return plan.batch_size
        per_device = min(plan.batch_size, num_prompts + plan.dp - 1) // plan.dp
        return rows_to_run(plan.method, max(per_device, 1)) * plan.dp

    def _run(self, key: tuple, jitted, *args, **static):
        """`jitted(*args, **static)`, compiled ahead on first use of `key` (compile time kept apart;
        programs are shared by generators of the same shapes); on a mesh the jit itself compiles
        (its first call counted as compile)."""
        plan = self.plan_template
        key = (*key, self.params["embed"].dtype)
        start = time.perf_counter()
        if plan.tp * plan.dp > 1:
            out = jax.block_until_ready(jitted(*args, **static))
            if key not in self._compiled:
                self._compiled[key] = True
                self.compile_seconds += time.perf_counter() - start
            return out
        if key not in STREAM_PROGRAMS:
            STREAM_PROGRAMS[key] = jitted.lower(*args, **static).compile()
            self.compile_seconds += time.perf_counter() - start
            self.compile_log.append((key[0], round(time.perf_counter() - start, 2)))
        return STREAM_PROGRAMS[key](*args)

    def _refill(self, state, prompts: list[Prompt], rows: list[int], plan: Plan, width: int, sampling):
        """Prefill `prompts` into `rows` of the state (None: a new state of plan.batch_size rows)."""
        count = len(prompts) if state is not None else plan.batch_size
        r = _row_bucket(count, plan.batch_size, plan.dp)
        tokens = np.zeros((r, width), np.int32)
        lengths = np.ones((r,), np.int32)
        where = np.full((r,), plan.batch_size, np.int32)
        for j, (prompt, row) in enumerate(zip(prompts, rows, strict=True)):
            tokens[j, : len(prompt.input_ids)] = prompt.input_ids
            lengths[j] = len(prompt.input_ids)
            where[j] = row
        settings = [self._settings(p) for p in prompts] + [dict(GREEDY)] * (r - len(prompts))
        rows_sampling = SamplingParams.from_rows(settings) if sampling else None
        limits = self._limits(prompts, r)
        chunk, impl = self.schedule.chunk, self.prefill_attention(plan)
        stop = self._stop_array()
        args = jnp.asarray(tokens), jnp.asarray(lengths)
        self.occupancy.refills += 1
        if state is None:
            active = jnp.asarray(where < plan.batch_size)
            key = ("start", plan, chunk, r, sampling, impl)
            return self._run(
                key,
                scheduling.start_jit,
                self.params,
                self.draft_params,
                *args,
                active,
                stop,
                rows_sampling,
                limits,
                plan=plan,
                chunk=chunk,
                attention=impl,
            )
        key = ("refill", plan, chunk, r, sampling, impl)
        return self._run(
            key,
            scheduling.refill_jit,
            self.params,
            self.draft_params,
            state,
            *args,
            jnp.asarray(where),
            stop,
            rows_sampling,
            limits,
            plan=plan,
            chunk=chunk,
            attention=impl,
        )

    def prefill_attention(self, plan: Plan) -> str:
        """The attention of the prefill chunks: the plan's ("same"), cuDNN flash attention on CUDA for
        GQA families in bf16/f16 ("cudnn", attention.prefill_implementation; else the plan's), or the
        implementation the schedule names."""
        choice = self.schedule.prefill_attention
        if choice == "same":
            return plan.attention
        if choice != "cudnn":
            return choice
        cfg = plan.target
        if not models.family(cfg).CUDNN_PREFILL:
            return plan.attention
        dtype = self.params["embed"].dtype
        return attention.prefill_implementation(
            plan.attention, dtype, cfg.dims.head_dim, self.schedule.batch_invariant
        )

    def stream(self, prompts: list[Prompt]) -> Iterator[Result]:
        """Continuous batching: each prompt's Result as soon as its row finishes (completion order).

        Prompts run shortest first; a freed row takes the next waiting prompt between chunks of rounds.
        """
        if not prompts:
            return
        tmpl, sched = self.plan_template, self.schedule
        b = self.stream_rows(len(prompts))
        sampling = any(self._settings(p)["temperature"] != 0 for p in prompts)
        waiting = collections.deque(sorted(prompts, key=lambda p: len(p.input_ids)))
        row_of: list[Prompt | None] = [None] * b
        seen_rounds = np.zeros((b,), np.int64)
        state, plan, stop = None, None, self._stop_array()
        impl = attention.invariant(tmpl.attention) if sched.batch_invariant else tmpl.attention
        occ = self.occupancy
        while waiting or any(p is not None for p in row_of):
            start = time.perf_counter()
            compiled_before = self.compile_seconds
            free = [r for r in range(b) if row_of[r] is None]
            take = [waiting.popleft() for _ in range(min(len(free), len(waiting)))]
            if take:
                need = scheduling.prompt_slots(max(len(p.input_ids) for p in take), sched.chunk)
                if plan is None or need > plan.prompt_len:
                    plan = dataclasses.replace(tmpl, batch_size=b, prompt_len=need, attention=impl)
                    if state is not None:
                        state = self._run(
                            ("grow", plan, sampling), scheduling.grow_jit, state, capacity=plan.capacity
                        )
                if state is None and sched.batch_invariant:  # every prompt is prefilled the same way
                    state = self._refill(None, [], [], plan, plan.prompt_len, sampling)
                # One prompt per "data" device at a time: one prefill program per chunk and capacity
                # compiles (a pow2 bucket of new rows made 2-3x as many, and R rows share one chunk);
                # the first fill prefills all rows at once, unless batch-invariant.
                groups = [take[i : i + plan.dp] for i in range(0, len(take), plan.dp)]
                if state is None:
                    groups = [take]
                for group in groups:
                    rows = free[: len(group)]
                    free = free[len(group) :]
                    state = self._refill(state, group, rows, plan, plan.prompt_len, sampling)
                    for r, p in zip(rows, group, strict=True):
                        row_of[r], seen_rounds[r] = p, 0
            live = sum(p is not None for p in row_of)
            stop_at = (b - live) + sched.refill_at if waiting else b
            state, ran = self._run(
                ("decode", plan, sampling),
                scheduling.decode_chunk_jit,
                self.params,
                self.draft_params,
                state,
                stop,
                jnp.int32(stop_at),
                plan=plan,
            )
            out = jax.device_get(_outputs(state))
            ran = int(jax.device_get(ran)[0])
            self.generate_seconds += time.perf_counter() - start - (self.compile_seconds - compiled_before)
            busy = int(sum(out["rounds"][r] - seen_rounds[r] for r in range(b) if row_of[r] is not None))
            occ.chunks += 1
            occ.rounds += ran
            occ.row_rounds += ran * b
            occ.busy += busy
            if waiting:
                occ.waiting_row_rounds += ran * b
                occ.waiting_busy += busy
            for r in range(b):
                if row_of[r] is not None:
                    seen_rounds[r] = out["rounds"][r]
                    if out["done"][r]:
                        prompt, row_of[r] = row_of[r], None
                        yield self._result(prompt, out, r)

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
        "done": state.done,
    }


def _row_bucket(count: int, batch: int, dp: int) -> int:
    """Rows of a refill program for `count` new prompts: a power of two (few shapes compile), at
    most the state's rows, a multiple of the "data" devices."""
    rows = min(1 << max(count - 1, 0).bit_length(), batch)
    return -(-rows // dp) * dp
