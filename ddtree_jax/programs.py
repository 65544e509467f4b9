"""The device programs of a run over a typed batch of requests (`Requests`), each compiled once.

  start     a new decode state of B rows: the requests prefilled into their rows, the others done
  empty     a new decode state of B rows, every row done, without a prefill: what a continuous batch
            starts from, so that its only prefill program is `refill`'s (one compilation, not two)
  refill    the requests prefilled into rows of a running state (rows freed by finished prompts)
  rounds    decoding rounds (engine.decode_round) until `until` rows are done, or every row is, or
            `most` rounds ran (a host that checks stop strings after each round)
  generate  start, then rounds until every row is done: a static batch's whole generation as ONE
            program (no round returns to the host)
  stages    the round's five steps as programs of their own, for a host that times each
  job_start a continuous job's first state: every row free (job.py)
  job       a stretch of a continuous job on the device: rounds, harvests and refills from a queue
            of prompts held on the device, until `most` iterations ran or the finished buffer is full

One prefill serves every program (prefill.py: the prompts in chunks through the cache path).
One bucket rule (`prompt_slots`) sizes every program's prompt buffer; `Shape` records a batch's
shapes (rows, prompt slots, capacity) apart from the `Plan`, which holds what a round is.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from ddtree_jax import engine, executables, job, models, prefill
from ddtree_jax.config import TargetConfig
from ddtree_jax.engine import ALL, ROW, DecodeState, Plan, on_mesh, param_specs, state_specs
from ddtree_jax.kv_cache import KVCache
from ddtree_jax.requests import REQUEST_SPECS, Requests, prompt_slots
from ddtree_jax.sharding import DATA, make_mesh
from ddtree_jax.weights import Params

__all__ = ["REQUEST_SPECS", "Requests", "prompt_slots", "Programs", "Shape"]


@dataclasses.dataclass(frozen=True)
class Shape:
    """The shapes of one decode state: B rows, P prompt slots, S cache slots per row."""

    rows: int
    prompt_slots: int
    capacity: int

    @classmethod
    def of(cls, plan: Plan, rows: int, prompt_slots: int) -> Shape:
        """The shape of `rows` rows holding prompts of up to `prompt_slots` tokens under `plan`."""
        return cls(rows, prompt_slots, plan.capacity(prompt_slots))


EVERY_ROUND = 2**31 - 1  # `most` rounds of a program that runs until its rows are done


def rows_to_run(method: str, rows: int, cfg: TargetConfig) -> int:
    """The rows rule: rows per device a program runs for `rows` requested. One ar row runs as two (the
    second inactive): XLA's one-row matmuls read the weights slower than its two-row ones (H200,
    Qwen3-8B shapes: 6.2-6.5 ms a step at one row, 5.0 ms at two; results/h200/README.md), unless the
    target's family says a second row costs more (`PAD_ONE_ROW_AR`: a MoE row reads its own experts)."""
    pad = models.family(cfg).PAD_ONE_ROW_AR
    return 2 if pad and method == "ar" and rows == 1 else rows


# -- the programs, per device (shard_map bodies) ---------------------------------------------------


def _rows_sum(x: jax.Array, plan: Plan) -> jax.Array:
    """The sum over the "data" axis (every device runs the same number of rounds)."""
    return jax.lax.psum(x, DATA) if plan.dp > 1 else x


def run_rounds(params, draft_params, state: DecodeState, until, most, *, plan: Plan, rows: int):
    """Rounds until `until` (a scalar) of the `rows` rows are done or all are, or `most` (a scalar)
    rounds ran; also the rounds run ([B], every entry the same)."""

    def going(c):
        done = _rows_sum(jnp.sum(c[0].done.astype(jnp.int32)), plan)
        return (done < until) & (done < rows) & (c[1] < most)

    def body(c):
        return engine.decode_round(params, draft_params, c[0], plan), c[1] + 1

    state, n = jax.lax.while_loop(going, body, (state, jnp.int32(0)))
    return state, jnp.full(state.bonus.shape, n)


# -- the programs over the whole batch (jit bodies) ------------------------------------------------


def _prefill_on_mesh(params, draft_params, req, stop_ids, plan, rows, capacity, chunk, attention):
    tspec, dspec = param_specs(plan)
    fn = on_mesh(
        lambda *a, plan: prefill.prefill(
            *a, plan=plan, rows=rows, capacity=capacity, chunk=chunk, attention=attention
        ),
        plan,
        (tspec, dspec, REQUEST_SPECS, ALL),
        state_specs(plan),
    )
    return fn(params, draft_params, req, stop_ids)


place_rows, map_rows = job.place_rows, job.map_rows


def empty_rows(new: DecodeState, rows: int) -> DecodeState:
    """A state of `rows` rows shaped like `new`, every row done (one cached token, as padding)."""
    zeros = map_rows(lambda x: jnp.zeros((rows, *x.shape[1:]), x.dtype), new)
    cache = KVCache(zeros.cache.layers, jnp.ones((rows,), jnp.int32))
    return dataclasses.replace(zeros, cache=cache, done=jnp.ones((rows,), bool))


def start(
    params, draft_params, req: Requests, stop_ids, *, plan: Plan, shape: Shape, chunk: int, attention: str
):
    """A new state of shape.rows rows: the requests prefilled into their rows, every other row done.
    Requests for every row (R = B) are the rows in order."""
    new = _prefill_on_mesh(
        params, draft_params, req, stop_ids, plan, shape.rows, shape.capacity, chunk, attention
    )
    if req.tokens.shape[0] == shape.rows:
        return new
    return place_rows(empty_rows(new, shape.rows), new, req.rows)


def empty(
    params, draft_params, req: Requests, stop_ids, *, plan: Plan, shape: Shape, chunk: int, attention: str
):
    """A new state of shape.rows rows, every row done, shaped as `start`'s (the prefill is traced for its
    shapes only, `req` read for its shapes only): `refill` then fills its rows as `start` would have."""
    new = jax.eval_shape(
        lambda: _prefill_on_mesh(
            params, draft_params, req, stop_ids, plan, shape.rows, shape.capacity, chunk, attention
        )
    )
    state = dataclasses.replace(empty_rows(new, shape.rows), stop_ids=stop_ids)
    # laid out as refill's state is (by rows over "data"), so that refill compiles once for both
    return _laid_out(state, state_specs(plan), plan)


def _laid_out(tree, specs, plan: Plan):
    """`tree` laid out over the plan's mesh by `specs`, as the programs' outputs are (also on one
    device: a 1 x 1 mesh, the parameters' layout), so that a program compiled for the one compiles
    for the other."""
    mesh = make_mesh(plan.tp, plan.dp)
    def sharding(spec: P) -> NamedSharding:
        return NamedSharding(mesh, spec)

    shardings = jax.tree.map(sharding, specs, is_leaf=lambda x: isinstance(x, P))
    return jax.lax.with_sharding_constraint(tree, shardings)


def job_start(
    params, draft_params, req: Requests, stop_ids, *, plan: Plan, shape: Shape, chunk: int, attention: str,
    observe: bool = False,
) -> job.Job:  # fmt: skip
    """A continuous job's first state: `empty`'s rows, every one free (req: for its shapes only);
    `observe`: with rank counts (job.RankCounts), for a job that chooses its budget."""
    state = empty(
        params, draft_params, req, stop_ids, plan=plan, shape=shape, chunk=chunk, attention=attention
    )
    dp = plan.dp
    new = job.Job(
        state=state,
        occupant=jnp.full((shape.rows,), -1, jnp.int32),
        admitted=jnp.zeros((shape.rows,), jnp.int32),
        next=jnp.zeros((dp,), jnp.int32),
        counters=jax.tree.map(lambda x: jnp.zeros((dp,), jnp.int32), job.new_counters()),
        ranks=job.new_rank_counts(plan.depth, dp) if observe else None,
    )
    return _laid_out(new, job.job_specs(plan, observe), plan)


def run_job(
    params, draft_params, state: job.Job, queue: job.Queue, most, refill_at, call, *,
    plan: Plan, slots: int, stride: int, finished_size: int, chunk: int, attention: str,
):  # fmt: skip
    """A stretch of a continuous job (job.run_job on every device): the job and what finished."""
    tspec, dspec = param_specs(plan)
    observe = state.ranks is not None
    jspec = job.job_specs(plan, observe)
    fn = on_mesh(
        lambda *a, plan: job.run_job(
            *a, plan=plan, slots=slots, stride=stride, finished_size=finished_size, chunk=chunk,
            attention=attention,
        ),
        plan,
        (tspec, dspec, jspec, job.queue_specs(), ALL, ALL, ALL),
        (jspec, job.finished_specs(plan, observe)),
    )
    return fn(params, draft_params, state, queue, most, refill_at, call)


def refill(
    params, draft_params, state: DecodeState, req: Requests, *, plan: Plan, chunk: int, attention: str
):
    """The state with the requests prefilled into their rows."""
    rows, capacity = state.bonus.shape[0], state.cache.capacity
    new = _prefill_on_mesh(params, draft_params, req, state.stop_ids, plan, rows, capacity, chunk, attention)
    return place_rows(state, new, req.rows)


def rounds(params, draft_params, state: DecodeState, until, most, *, plan: Plan):
    """Rounds until `until` rows are done or all are, or `most` rounds ran; the state and the rounds
    run ([B], equal)."""
    tspec, dspec = param_specs(plan)
    sspec, rows = state_specs(plan), state.bonus.shape[0]
    fn = on_mesh(
        lambda *a, plan: run_rounds(*a, plan=plan, rows=rows),
        plan,
        (tspec, dspec, sspec, ALL, ALL),
        (sspec, ROW),
    )
    return fn(params, draft_params, state, until, most)


def generate(
    params, draft_params, req: Requests, stop_ids, *, plan: Plan, shape: Shape, chunk: int, attention: str
):
    """A static batch's whole generation: `start`, then rounds until every row is done."""
    state = start(
        params, draft_params, req, stop_ids, plan=plan, shape=shape, chunk=chunk, attention=attention
    )
    return rounds(params, draft_params, state, jnp.int32(shape.rows), jnp.int32(EVERY_ROUND), plan=plan)[0]


def stage_programs(plan: Plan) -> dict[str, Any]:
    """The round's steps (engine.STAGES) as jitted programs on the plan's mesh, for a host that calls
    and times each: draft(params, draft_params, state), build(state, logp, tok), verify(params, state,
    tree), walk(tree, choice), commit(draft_params, state, walk, kv, features) (the state donated)."""
    tspec, dspec = param_specs(plan)
    sspec, wspec = state_specs(plan), engine.walk_specs()
    entry, count = models.cache_entry(plan.target)
    kv = [entry.new_spec()] * count

    def program(fn, in_specs, out_specs, donate=()):
        return jax.jit(on_mesh(fn, plan, in_specs, out_specs), donate_argnums=donate)

    return {
        "draft": program(plan.draft_stage or engine.draft, (tspec, dspec, sspec), (ROW, ROW)),
        "build": program(engine.build, (sspec, ROW, ROW), ROW),
        "verify": program(engine.verify, (tspec, sspec, ROW), (ROW, kv, ROW)),
        "walk": program(engine.walk, (ROW, ROW), wspec),
        "commit": program(engine.commit, (dspec, sspec, wspec, kv, ROW), sspec, donate=(1,)),
    }


JITTED = {
    "start": jax.jit(start, static_argnames=("plan", "shape", "chunk", "attention")),
    "empty": jax.jit(empty, static_argnames=("plan", "shape", "chunk", "attention")),
    "refill": jax.jit(refill, static_argnames=("plan", "chunk", "attention"), donate_argnums=(2,)),
    "rounds": jax.jit(rounds, static_argnames=("plan",), donate_argnums=(2,)),
    "generate": jax.jit(generate, static_argnames=("plan", "shape", "chunk", "attention")),
    "job_start": jax.jit(job_start, static_argnames=("plan", "shape", "chunk", "attention", "observe")),
    "job": jax.jit(
        run_job,
        static_argnames=("plan", "slots", "stride", "finished_size", "chunk", "attention"),
        donate_argnums=(2,),
    ),
}
# The programs compiled in this process, by what determines each: its name, static arguments, and its
# arguments' tree, shapes, dtypes and layouts (shardings). Each is compiled ahead, its time counted once
# apart from generation by whichever `Programs` meets it first, and called directly: an argument laid
# out otherwise than at compile time is a new key, a counted compilation, never a silent retrace inside
# the generation timer (b450fd2's `empty` returned a state laid out unlike `refill`'s, so `refill`
# compiled twice, the second time uncounted). jax.clear_caches() does not empty this; `.clear()` does.
_COMPILED: dict[tuple, Any] = {}


def _all_processes_compiled(name: str, count: int) -> None:
    """With several processes, wait until every one has this program (the `count`-th compiled here, the
    same in each): one may read it from the cache or compile it minutes before another, and a first run
    on CPU gives up when another process is 30 s late (Gloo's context, a fixed wait in jax 0.11.2; seen
    with one process stopped for 45 s on 2026-12-07, issue 50). The coordination service's barrier
    waits up to an hour."""
    if jax.process_count() == 1:
        return
    from jax._src import distributed  # (the barrier has no public name in jax 0.11.2)

    client = distributed.global_state.client
    if client is not None:
        client.wait_at_barrier(f"ddtree-jax-compiled-{count}-{name}", 3_600_000)


def _layout(x) -> Any:
    """What of an argument leaf besides shape and dtype selects a compiled program: its sharding."""
    return x.sharding if isinstance(x, jax.Array) and x.committed else None


class Programs:
    """The device programs of one plan over one pair of parameter trees, compiled on first use (the
    time kept apart in `compile_seconds`, each compilation in `compile_log`)."""

    def __init__(self, params: Params, draft_params: Params | None, plan: Plan, chunk: int, attention: str):
        if chunk < 16 or chunk & (chunk - 1):
            raise ValueError(f"the prefill chunk must be a power of two >= 16, got {chunk}")
        self.params, self.draft_params, self.plan = params, draft_params, plan
        self.chunk, self.attention = chunk, attention  # the prefill chunks' size and attention
        self.compile_seconds = 0.0
        self.compile_log: list[tuple[str, float]] = []
        self.cache_hits = 0  # programs of compile_log read from the compile cache (executables.py)
        self._stages: dict[str, Any] | None = None

    def _call(self, name: str, *args, **static):
        """Program `name` on (params, draft params, *args), compiled ahead (or read from the compile
        cache: executables.py) on its first use of these shapes and layouts, then called directly."""
        static |= {"plan": self.plan}
        args = (self.params, self.draft_params, *args)
        leaves, tree = jax.tree.flatten(args[2:])
        shapes = tuple((x.shape, x.dtype, _layout(x)) for x in leaves)
        key = (name, tree, shapes, *static.items(), self.params["embed"].dtype)
        compiled = _COMPILED.get(key)
        if compiled is None:
            begin = time.perf_counter()
            loaded = executables.load_or_compile(
                name, (static, executables.signature(*args)), lambda: JITTED[name].lower(*args, **static)
            )
            compiled = _COMPILED[key] = loaded.compiled
            self.cache_hits += loaded.hit
            _all_processes_compiled(name, len(_COMPILED))
            self.count_compile(name, time.perf_counter() - begin)
        return compiled(*args)

    def count_compile(self, name: str, seconds: float) -> None:
        """Count `seconds` of compiling program `name`."""
        self.compile_seconds += seconds
        self.compile_log.append((name, round(seconds, 2)))

    def start(self, req: Requests, stop_ids: jax.Array, shape: Shape) -> DecodeState:
        """A new state of `shape` holding the requests."""
        return self._call("start", req, stop_ids, shape=shape, chunk=self.chunk, attention=self.attention)

    def empty(self, req: Requests, stop_ids: jax.Array, shape: Shape) -> DecodeState:
        """A new state of `shape`, every row done, for `refill` to fill (req: for its shapes only)."""
        return self._call("empty", req, stop_ids, shape=shape, chunk=self.chunk, attention=self.attention)

    def refill(self, state: DecodeState, req: Requests) -> DecodeState:
        """The state (donated) with the requests in their rows."""
        return self._call("refill", state, req, chunk=self.chunk, attention=self.attention)

    def rounds(
        self, state: DecodeState, until: int, most: int = EVERY_ROUND
    ) -> tuple[DecodeState, jax.Array]:
        """Rounds over the state (donated) until `until` rows are done or all are, or `most` rounds ran;
        the rounds run ([B])."""
        return self._call("rounds", state, np.int32(until), np.int32(most))

    def generate(self, req: Requests, stop_ids: jax.Array, shape: Shape) -> DecodeState:
        """The requests' whole generation in one program."""
        return self._call("generate", req, stop_ids, shape=shape, chunk=self.chunk, attention=self.attention)

    def job_start(self, req: Requests, stop_ids: jax.Array, shape: Shape, observe: bool = False) -> job.Job:
        """A continuous job's first state of `shape`, every row free (req: for its shapes only;
        `observe`: counting the acceptance, job.RankCounts)."""
        return self._call(
            "job_start", req, stop_ids, shape=shape, chunk=self.chunk, attention=self.attention,
            **({"observe": True} if observe else {}),  # (a fixed plan's program keys stay as they were)
        )  # fmt: skip

    def job(
        self, state: job.Job, queue: job.Queue, most: int, refill_at: int, call: int, *, slots: int,
        stride: int, finished_size: int,
    ) -> tuple[job.Job, job.Finished]:  # fmt: skip
        """A stretch of the continuous job (the state donated): the job and the rows that finished."""
        scalars = (np.int32(most), np.int32(refill_at), np.int32(call))  # (jnp.int32: a compiled cast)
        return self._call(
            "job", state, queue, *scalars, slots=slots, stride=stride, finished_size=finished_size,
            chunk=self.chunk, attention=self.attention,
        )  # fmt: skip

    def stages(self) -> dict[str, Any]:
        """The round's steps as programs of their own (`stage_programs`)."""
        if self._stages is None:
            self._stages = stage_programs(self.plan)
        return self._stages
