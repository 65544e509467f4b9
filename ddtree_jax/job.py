"""The continuous batch on the device: one program runs rounds, harvests finished rows and refills them
from a queue of prompts held on the device, prefilling up to R admitted prompts together.

One call of `run_job` is a stretch of the job: a `lax.while_loop` whose every iteration
  1. harvests the rows that finished (eos, stop ids, limits) into the call's `Finished` buffer and
     frees them,
  2. admits the next queued prompts into free rows while enough rows are free (`refill_at`, or no row
     is running), up to R at once in each prefill pass (prefill.py: the prompts' pieces packed into
     fixed-shape steps, so a prompt's tokens do not depend on its companions or its slot),
  3. runs `stride` decoding rounds (engine.decode_round; a row that finishes among them waits for
     the next harvest, frozen).
It returns to the host after `most` rounds, when the Finished buffer could not take another
harvest of every row, or when the job is over; the host writes the finished lines while the next call
runs. Where the call ends changes nothing on the device: the next call goes on from the same state,
so the tokens are the same for any `most` (and for the host loop's refills: a prompt's tokens depend
on its prompt, its settings and the shapes alone).

Per device (inside shard_map on a mesh): the queue is split over "data" (each device admits its own
share into its own rows); every device runs the same number of iterations (the loop's test is summed
over "data").
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from ddtree_jax import engine, prefill, tree
from ddtree_jax.engine import ROW, DecodeState, Plan
from ddtree_jax.logprobs import Logprobs
from ddtree_jax.requests import Requests
from ddtree_jax.sampling import SamplingArrays
from ddtree_jax.sharding import DATA
from ddtree_jax.weights import Params


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Queue:
    """Q prompts waiting for rows, in the order they enter (Q_d per device on a mesh)."""

    tokens: jax.Array  # [Q, P] int32, right-padded
    lengths: jax.Array  # [Q] int32 (>= 1)
    limits: jax.Array  # [Q] int32: each one's max_new_tokens
    sampling: SamplingArrays | None  # [Q] each; None: the greedy-only program
    stops: jax.Array  # [Q] bool: the stop ids end it (ignore_eos: False)
    base: jax.Array  # [1] int32: the job's index of this block's first prompt (a job's prompts come
    end: jax.Array  # [1] int32: ... in blocks of Q; its indices [base, end) are real, the rest padding)
    last: jax.Array  # [1] bool: no block follows


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Finished:
    """F finished rows harvested by one call, in the order they finished (`count` of them)."""

    prompt: jax.Array  # [F] int32: the queue index of each
    admitted: jax.Array  # [F] int32: the call that admitted it (the host's clock for latency)
    output: jax.Array  # [F, max_new + W]
    num_output: jax.Array  # [F]
    stopped: jax.Array  # [F] bool
    rounds: jax.Array  # [F]
    acceptance: jax.Array  # [F, max_new]
    logprobs: Logprobs | None  # [F, max_new + W] (top: [F, max_new + W, K]); None: K = 0
    count: jax.Array  # [1] int32
    next: jax.Array  # [1] int32: the job's next prompt to admit, after the call
    occupied: jax.Array  # [1] int32: rows holding a prompt, after the call
    counters: Counters | None = None  # the job's, after the call
    ranks: RankCounts | None = None  # the job's, after the call (a job that chooses its budget)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class RankCounts:
    """The acceptance a job observed since its start (tree.rank_counts summed over its rounds, for
    plan_choice.AcceptanceCounts): how often the target's token at depth d + 1 was the drafter's rank c
    (`hits`) and how often rank c could be seen there (`exposure`), [D, RANK_WIDTH] int32 per device."""

    hits: jax.Array
    exposure: jax.Array


RANK_WIDTH = 32  # the ranks counted (plan_choice.MAX_BRANCHING: the widest default branching)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Counters:
    """What a job's iterations did, summed since its start ([1] int32 each per device)."""

    rounds: jax.Array  # decoding rounds run
    busy: jax.Array  # row-rounds spent on a live prompt
    waiting_busy: jax.Array  # of those, while prompts waited for a row
    waiting_rounds: jax.Array  # rounds run while prompts waited
    passes: jax.Array  # prefill passes
    admitted: jax.Array  # prompts prefilled
    prefill_steps: jax.Array  # the passes' steps (forwards of [R, C / 4] tokens: prefill.packed_steps)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Job:
    """The job's device state between calls."""

    state: DecodeState  # [B] rows
    occupant: jax.Array  # [B] int32: the queue index in each row, -1 free
    admitted: jax.Array  # [B] int32: the call that admitted it
    next: jax.Array  # [1] int32: the next queue index to admit
    counters: Counters
    ranks: RankCounts | None = None  # the acceptance observed (None: not counted, a fixed plan)


def job_specs(plan: Plan, observe: bool = False) -> Job:
    """PartitionSpecs of a Job: by rows (its [1] counters and its rank counts: one per "data" device)."""
    ranks = RankCounts(ROW, ROW) if observe else None
    return Job(engine.state_specs(plan), ROW, ROW, ROW, _counter_specs(), ranks)


def _counter_specs() -> Counters:
    return Counters(*[ROW] * len(dataclasses.fields(Counters)))


def queue_specs() -> Queue:
    """PartitionSpecs of a Queue: split over "data" (each device's share contiguous)."""
    return Queue(ROW, ROW, ROW, ROW, ROW, ROW, ROW, ROW)


def finished_specs(plan: Plan, observe: bool = False) -> Finished:
    """PartitionSpecs of a Finished buffer: by entries (each device's own)."""
    lp = Logprobs(ROW, ROW, ROW) if plan.logprobs else None
    ranks = RankCounts(ROW, ROW) if observe else None
    return Finished(ROW, ROW, ROW, ROW, ROW, ROW, ROW, lp, ROW, ROW, ROW, _counter_specs(), ranks)


def _count(x: jax.Array, plan: Plan) -> jax.Array:
    """The sum of a per-device scalar over "data"."""
    return jax.lax.psum(x, DATA) if plan.dp > 1 else x


def new_counters() -> Counters:
    """Zero counters ([1] each)."""
    zero = jnp.zeros((1,), jnp.int32)
    return Counters(*[zero] * len(dataclasses.fields(Counters)))


def new_rank_counts(depth: int, devices: int = 1) -> RankCounts:
    """No acceptance observed yet: [devices * depth, RANK_WIDTH] zeros each ([depth, ...] per device)."""
    zero = jnp.zeros((devices * depth, RANK_WIDTH), jnp.int32)
    return RankCounts(zero, zero)


def empty_finished(state: DecodeState, size: int) -> Finished:
    """An empty Finished buffer of `size` entries shaped like the state's rows."""

    def like(x):
        return jnp.zeros((size, *x.shape[1:]), x.dtype)

    lp = None if state.logprobs is None else jax.tree.map(like, state.logprobs)
    minus = jnp.full((size,), -1, jnp.int32)
    return Finished(
        prompt=minus,
        admitted=minus,
        output=like(state.output),
        num_output=like(state.num_output),
        stopped=like(state.stopped),
        rounds=like(state.rounds),
        acceptance=like(state.acceptance),
        logprobs=lp,
        count=jnp.zeros((1,), jnp.int32),
        next=jnp.zeros((1,), jnp.int32),
        occupied=jnp.zeros((1,), jnp.int32),
    )


def harvest(job: Job, finished: Finished) -> tuple[Job, Finished]:
    """The finished rows' outputs appended to `finished` (room for every row is the caller's
    guarantee), their rows freed."""
    s = job.state
    ready = (job.occupant >= 0) & s.done  # [B]
    slot = finished.count[0] + jnp.cumsum(ready) - 1
    slot = jnp.where(ready, slot, finished.prompt.shape[0])  # not ready: dropped

    def put(buf, rows):
        return buf.at[slot].set(rows, mode="drop")

    lp = None if s.logprobs is None else jax.tree.map(put, finished.logprobs, s.logprobs)
    finished = Finished(
        prompt=put(finished.prompt, job.occupant),
        admitted=put(finished.admitted, job.admitted),
        output=put(finished.output, s.output),
        num_output=put(finished.num_output, s.num_output),
        stopped=put(finished.stopped, s.stopped),
        rounds=put(finished.rounds, s.rounds),
        acceptance=put(finished.acceptance, s.acceptance),
        logprobs=lp,
        count=finished.count + jnp.sum(ready).astype(jnp.int32),
        next=finished.next,
        occupied=finished.occupied,
    )
    return dataclasses.replace(job, occupant=jnp.where(ready, -1, job.occupant)), finished


def admissible(job: Job, queue: Queue, slots: int) -> jax.Array:
    """How many queued prompts could enter rows now: free rows, waiting prompts, `slots`, the least."""
    left = queue.end[0] - job.next[0]
    return jnp.minimum(jnp.minimum(jnp.sum(job.occupant < 0), left), slots).astype(jnp.int32)


def requests(job: Job, queue: Queue, slots: int, n: jax.Array) -> Requests:
    """Requests [R = slots] for the next `n` queued prompts bound for the first free rows (the rest
    padding, bound for row B)."""
    b = job.occupant.shape[0]
    j = jnp.arange(slots, dtype=jnp.int32)
    taken = j < n
    free_rows = jnp.nonzero(job.occupant < 0, size=slots, fill_value=b)[0].astype(jnp.int32)
    q = jnp.minimum(job.next[0] - queue.base[0] + j, queue.lengths.shape[0] - 1)
    sampling = None if queue.sampling is None else jax.tree.map(lambda x: x[q], queue.sampling)
    return Requests(
        tokens=queue.tokens[q],
        lengths=jnp.where(taken, queue.lengths[q], 1),
        rows=jnp.where(taken, free_rows, b),
        sampling=sampling,
        limits=queue.limits[q],
        stops=queue.stops[q],
    )


def _refill(params, draft_params, job: Job, req: Requests, n, call, *, plan, chunk, attention) -> Job:
    """The job with `n` admitted requests prefilled together into their rows."""
    s = job.state
    rows, capacity = s.bonus.shape[0], s.cache.capacity
    new = prefill.prefill(
        params, draft_params, req, s.stop_ids,
        plan=plan, rows=rows, capacity=capacity, chunk=chunk, attention=attention, packed=True,
    )  # fmt: skip
    state = place_rows(s, new, req.rows)
    j = jnp.arange(req.rows.shape[0], dtype=jnp.int32)
    occupant = job.occupant.at[req.rows].set(job.next[0] + j, mode="drop")
    admitted = job.admitted.at[req.rows].set(call, mode="drop")
    c = job.counters
    steps = prefill.packed_steps(req.lengths, req.rows < rows, min(chunk, req.tokens.shape[1]))
    counters = dataclasses.replace(
        c, passes=c.passes + (n > 0), admitted=c.admitted + n, prefill_steps=c.prefill_steps + steps
    )
    return dataclasses.replace(
        job, state=state, occupant=occupant, admitted=admitted, next=job.next + n, counters=counters
    )


def map_rows(fn, *states: DecodeState) -> DecodeState:
    """`fn` over the leaves that have rows (axis 0) of `states`; the stop ids are the first's."""
    fields = [f.name for f in dataclasses.fields(DecodeState) if f.name != "stop_ids"]
    mapped = {name: jax.tree.map(fn, *(getattr(s, name) for s in states)) for name in fields}
    return DecodeState(**mapped, stop_ids=states[0].stop_ids)


def place_rows(state: DecodeState, new: DecodeState, rows: jax.Array) -> DecodeState:
    """The state with rows [R] replaced by the R rows of `new` (row index B or more: dropped)."""
    return map_rows(lambda old, x: old.at[rows].set(x, mode="drop"), state, new)


def run_job(
    params: Params,
    draft_params: Params | None,
    job: Job,
    queue: Queue,
    most,
    refill_at,
    call,
    *,
    plan: Plan,
    slots: int,
    stride: int,
    finished_size: int,
    chunk: int,
    attention: str,
) -> tuple[Job, Finished]:
    """One stretch of the job (this device's rows and queue share): iterations of harvest, admit
    (`slots` prompts at most per prefill pass, once `refill_at` rows are free or none runs) and
    `stride` rounds, until `most` rounds ran; `call` numbers this call (the admission stamp). Returns
    the job and what finished."""
    rows = job.occupant.shape[0]
    finished = empty_finished(job.state, finished_size)

    def work_left(job):
        occupied, waiting = jnp.sum(job.occupant >= 0), queue.end[0] - job.next[0]
        # every device's block used up and a row free: the host brings the next blocks
        starved = (
            ~queue.last[0]
            & (_count((waiting > 0).astype(jnp.int32), plan) == 0)
            & (_count((occupied < rows).astype(jnp.int32), plan) > 0)
        )
        return (_count(occupied + waiting, plan) > 0) & ~starved

    def room(finished):
        return _count((finished.count[0] + rows > finished_size).astype(jnp.int32), plan) == 0

    def going(c):
        job, finished, i = c
        return (i < most) & work_left(job) & room(finished)

    def body(c):
        job, finished, i = c
        job, finished = harvest(job, finished)

        def to_admit(job):  # this device's prompts to admit in the next pass (0: none is due)
            n = admissible(job, queue, slots)
            free, waiting = jnp.sum(job.occupant < 0), queue.end[0] - job.next[0]
            due = (n > 0) & ((free >= jnp.minimum(refill_at, waiting)) | (free == rows))
            return jnp.where(due, n, 0)

        def admit(job):  # one prefill pass of up to `slots` prompts
            n = to_admit(job)
            req = requests(job, queue, slots, n)
            return _refill(
                params, draft_params, job, req, n, call, plan=plan, chunk=chunk, attention=attention
            )

        job = jax.lax.while_loop(lambda j: _count(to_admit(j), plan) > 0, admit, job)
        still_waiting = (queue.end[0] - job.next[0] > 0).astype(jnp.int32)

        def one_round(_, carry):  # (a row done mid-way waits for the next harvest: < `stride` rounds)
            state, c, ranks = carry
            active = (job.occupant >= 0) & ~state.done
            live = jnp.sum(active).astype(jnp.int32)
            if ranks is None:
                state = engine.decode_round(params, draft_params, state, plan)
            else:
                state, ranks = observed_round(params, draft_params, state, plan, ranks, active)
            counters = dataclasses.replace(
                c,
                rounds=c.rounds + 1,
                busy=c.busy + live,
                waiting_busy=c.waiting_busy + live * still_waiting,
                waiting_rounds=c.waiting_rounds + still_waiting,
            )
            return state, counters, ranks

        # `stride` rounds at a time, a loop of static length (XLA launches it as one graph, where a
        # loop whose test is on the device returns to its host thread every iteration)
        carry = (job.state, job.counters, job.ranks)
        state, counters, ranks = jax.lax.fori_loop(0, stride, one_round, carry)
        job = dataclasses.replace(job, state=state, counters=counters, ranks=ranks)
        return job, finished, i + stride

    job, finished, _ = jax.lax.while_loop(going, body, (job, finished, jnp.int32(0)))
    occupied = jnp.sum(job.occupant >= 0).astype(jnp.int32)[None]
    finished = dataclasses.replace(
        finished, next=job.next, occupied=occupied, counters=job.counters, ranks=job.ranks
    )
    return job, finished


def observed_round(
    params: Params, draft_params: Params, state: DecodeState, plan: Plan, ranks: RankCounts, active
) -> tuple[DecodeState, RankCounts]:
    """One round (engine.walked_round: the tokens are decode_round's), and the ranks of the target's
    tokens among the drafter's candidates at the depths the walk saw, counted over the `active` rows
    ([B] bool: holding a live prompt) into `ranks`; a root-only round drafts nothing and counts none."""
    new, tok, walk = engine.walked_round(params, draft_params, state, plan)
    if tok is None:
        return new, ranks
    seen_ranks, seen = tree.target_ranks(tok, walk.emitted, walk.length)
    hits, exposure = tree.rank_counts(seen_ranks, seen, active, plan.branching, RANK_WIDTH)
    return new, RankCounts(ranks.hits + hits, ranks.exposure + exposure)
