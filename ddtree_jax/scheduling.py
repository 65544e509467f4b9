"""Continuous batching: the rows of one decode state are refilled with waiting prompts as they finish.

The device programs of `generation.Generator.stream` (README, "Scheduling"):
  refill        a chunked prefill of the new prompts alone (R rows), scattered into the freed rows
                of the state (every state leaf has rows on axis 0)
  decode_chunk  rounds until `stop_at` rows are done (a refill is due) or every row is
  grow          more cache slots for every row (longer prompts join), padded on each entry's time axis

The prefill runs the prompt in chunks of C tokens through the cache path: each chunk attends to the
cache written so far and to itself under a causal mask, the same attention a verify uses, so the
[P, P] scores are never materialised. The end of the prompt runs in tail chunks of C / 4 tokens, so
a prompt computes at most C / 4 - 1 padding tokens (one prompt program serves every length: on the
H200 a 128-token chunk of one row costs about what reading the weights does, 3.4 ms for Qwen3-8B).
The drafter's context K/V of each chunk come from the chunk's target features, written at the same
slots. On CUDA the chunk's attention can be cuDNN flash attention (`Schedule.prefill_attention`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from ddtree_jax import drafter, kv_cache, target
from ddtree_jax.engine import (
    ALL,
    ROW,
    DecodeState,
    Plan,
    decode_round,
    first_token,
    initial_state,
    on_mesh,
    param_specs,
    state_specs,
)
from ddtree_jax.kv_cache import KVCache
from ddtree_jax.sampling import SamplingParams
from ddtree_jax.sharding import DATA
from ddtree_jax.weights import Params


@dataclasses.dataclass(frozen=True)
class Schedule:
    """How prompts are scheduled onto the rows of a decode state."""

    chunk: int = 256  # C: prefill tokens per row per step (a power of two); the tail runs in C / 4
    refill_at: int = 1  # return to the host for a refill once this many rows are done
    batch_invariant: bool = False  # fixed shapes: a row's tokens do not depend on the other rows
    # "same": the plan's attention; "cudnn": cuDNN flash attention where it applies (CUDA, bf16/f16,
    # GQA, not batch-invariant), else the plan's; or an implementation name (attention.kernel).
    prefill_attention: str = "same"

    def __post_init__(self):
        if self.chunk < 16 or self.chunk & (self.chunk - 1):
            raise ValueError(f"the prefill chunk must be a power of two >= 16, got {self.chunk}")
        if self.refill_at < 1:
            raise ValueError(f"refill_at must be >= 1, got {self.refill_at}")


def prompt_slots(length: int, chunk: int) -> int:
    """Prompt slots of a state that holds a prompt of `length` tokens: a multiple of the chunk, the
    number of chunks a power of two (so few capacities compile; the compute stops at the prompt)."""
    chunks = -(-length // chunk)
    return chunk * (1 << (chunks - 1).bit_length())


def tail_chunk(chunk: int) -> int:
    """The chunk of a prompt's end: C / 4, at least 16 (the prompt computes < C / 4 padding tokens)."""
    return max(chunk // 4, 16)


def chunk_steps(length, chunk: int) -> tuple:
    """(full chunks, tail chunks) of a prompt of `length` tokens (an int, or an int array on the
    device): full chunks while more than C - C / 4 tokens are left (four tail chunks would cost one
    full one), then tail chunks. At most tail - 1 tokens are left after the full chunks' ceiling
    division, so the tail count is never negative."""
    tail = tail_chunk(chunk)
    full = (length + tail - 1) // chunk
    return full, (length - full * chunk + tail - 1) // tail


def _with_lengths(cache: KVCache, lengths: jax.Array) -> KVCache:
    return KVCache(cache.layers, lengths)


def chunked_prefill(
    params: Params,
    draft_params: Params | None,
    prompts: jax.Array,
    prompt_lengths: jax.Array,
    active: jax.Array,
    stop_ids: jax.Array,
    sampling: SamplingParams | None = None,
    max_new_tokens: jax.Array | None = None,
    *,
    plan: Plan,
    chunk: int,
    attention: str | None = None,
) -> DecodeState:
    """The state of R new rows: prompts [R, P] (P a multiple of `chunk`, lengths [R]) run chunk by
    chunk through the cache path (`attention`: the chunks' implementation, default the plan's);
    caches of plan.capacity slots; the first token chosen; each row's limit `max_new_tokens` [R]
    (None: the plan's)."""
    attention = attention or plan.attention
    cfg, (r, p) = plan.target, prompts.shape
    axis, dtype = plan.model_axis, params["embed"].dtype
    tail = tail_chunk(chunk)
    probe = jax.eval_shape(
        lambda: target.forward(
            params,
            cfg,
            prompts[:, :chunk],
            jnp.zeros((r, chunk), jnp.int32),
            jnp.ones((r, chunk, chunk), bool),
            None,
            feature_layers=plan.feature_layers,
            model_axis=axis,
        )
    )
    cache = kv_cache.empty_like(_zeros(probe.kv), plan.capacity)
    draft_cache = None
    if plan.method != "ar":
        ctx = jax.eval_shape(
            lambda f: drafter.context_kv(draft_params, plan.draft, f, jnp.zeros((r, chunk), jnp.int32)),
            jax.ShapeDtypeStruct(probe.features.shape, dtype),
        )
        draft_cache = kv_cache.empty_like(_zeros(ctx), plan.capacity)
    last = jnp.zeros((r, probe.hidden.shape[-1]), probe.hidden.dtype)

    def step(size: int, base: jax.Array):
        """One chunk of `size` tokens, the i-th from position `base`."""
        arange = jnp.arange(size, dtype=jnp.int32)
        causal = arange[None, :] <= arange[:, None]  # [C, C]

        def run(carry):
            i, cache, draft_cache, last = carry
            start = base + i * size
            tokens = jax.lax.dynamic_slice_in_dim(prompts, start, size, axis=1)
            positions = jnp.broadcast_to(start + arange, (r, size))
            mask = causal[None] & (positions[:, None, :] < prompt_lengths[:, None, None])
            seen = jnp.minimum(start, prompt_lengths)  # each row's cache holds its prompt before the chunk
            out = target.forward(
                params,
                cfg,
                tokens,
                positions,
                mask,
                _with_lengths(cache, seen),
                feature_layers=plan.feature_layers,
                attention=attention,
                model_axis=axis,
            )
            at = jnp.full((r,), start, jnp.int32)
            cache = kv_cache.write(cache, out.kv, at)
            if draft_cache is not None:
                ctx = drafter.context_kv(draft_params, plan.draft, out.features.astype(dtype), positions)
                draft_cache = kv_cache.write(draft_cache, ctx, at)
            here = prompt_lengths - 1 - start  # the last prompt token's index in this chunk
            inside = (here >= 0) & (here < size)
            picked = out.hidden[jnp.arange(r), jnp.clip(here, 0, size - 1)]
            return i + 1, cache, draft_cache, jnp.where(inside[:, None], picked, last)

        return run

    if p % chunk:
        raise ValueError(f"prompt width {p} is not a multiple of the chunk {chunk}")
    longest = _all_rows_max(jnp.max(prompt_lengths), plan)
    full, tails = chunk_steps(longest, chunk)
    carry = (jnp.int32(0), cache, draft_cache, last)
    _, cache, draft_cache, last = jax.lax.while_loop(lambda c: c[0] < full, step(chunk, 0), carry)
    if tail < chunk:  # (with tail == chunk there are no tail chunks)
        carry = (jnp.int32(0), cache, draft_cache, last)
        _, cache, draft_cache, last = jax.lax.while_loop(
            lambda c: c[0] < tails, step(tail, full * chunk), carry
        )
    cache = _with_lengths(cache, prompt_lengths)
    if draft_cache is not None:
        draft_cache = _with_lengths(draft_cache, prompt_lengths)
    first = first_token(params, last, prompt_lengths, sampling, plan)
    return initial_state(cache, draft_cache, first, active, stop_ids, sampling, plan, max_new_tokens)


def _zeros(tree):
    return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), tree)


def _all_rows_max(x: jax.Array, plan: Plan) -> jax.Array:
    """The maximum over the "data" axis (every device runs the same number of loop steps)."""
    return jax.lax.pmax(x, DATA) if plan.dp > 1 else x


def _all_rows_sum(x: jax.Array, plan: Plan) -> jax.Array:
    return jax.lax.psum(x, DATA) if plan.dp > 1 else x


def place_rows(state: DecodeState, new: DecodeState, rows: jax.Array) -> DecodeState:
    """The state with rows [R] replaced by the R rows of `new` (row index B or more: dropped)."""
    return jax.tree.map(lambda old, x: old.at[rows].set(x, mode="drop"), state, new)


def _prefill_on_mesh(plan: Plan, chunk: int, attention: str | None):
    """`chunked_prefill` for plan.batch_size rows, per device on the plan's mesh."""
    target_specs, draft_specs = param_specs(plan)
    return on_mesh(
        lambda *a, plan: chunked_prefill(*a, plan=plan, chunk=chunk, attention=attention),
        plan,
        (target_specs, draft_specs, ROW, ROW, ROW, ALL, ROW, ROW),
        state_specs(plan),
    )


def start(
    params: Params,
    draft_params: Params | None,
    prompts: jax.Array,
    prompt_lengths: jax.Array,
    active: jax.Array,
    stop_ids: jax.Array,
    sampling: SamplingParams | None,
    max_new_tokens: jax.Array | None = None,
    *,
    plan: Plan,
    chunk: int,
    attention: str | None = None,
) -> DecodeState:
    """A new state of B rows: prompts [B, P] (lengths [B], limits [B]) prefilled in chunks, inactive
    rows done."""
    fn = _prefill_on_mesh(plan, chunk, attention)
    return fn(params, draft_params, prompts, prompt_lengths, active, stop_ids, sampling, max_new_tokens)


def refill(
    params: Params,
    draft_params: Params | None,
    state: DecodeState,
    prompts: jax.Array,
    prompt_lengths: jax.Array,
    rows: jax.Array,
    stop_ids: jax.Array,
    sampling: SamplingParams | None,
    max_new_tokens: jax.Array | None = None,
    *,
    plan: Plan,
    chunk: int,
    attention: str | None = None,
) -> DecodeState:
    """Prefill prompts [R, P] (lengths [R], limits [R]) and put them into rows [R] of the state
    (B = dropped)."""
    fn = _prefill_on_mesh(dataclasses.replace(plan, batch_size=prompts.shape[0]), chunk, attention)
    active = rows < state.bonus.shape[0]
    new = fn(params, draft_params, prompts, prompt_lengths, active, stop_ids, sampling, max_new_tokens)
    return place_rows(state, new, rows)


def decode_chunk(
    params: Params,
    draft_params: Params | None,
    state: DecodeState,
    stop_ids: jax.Array,
    stop_at: jax.Array,
    *,
    plan: Plan,
) -> tuple[DecodeState, jax.Array]:
    """Rounds until `stop_at` (a scalar) rows are done or all are; also the rounds run ([B], equal)."""
    target_specs, draft_specs = param_specs(plan)

    def run(params, draft_params, state, stop_ids, stop_at, *, plan):
        def going(c):
            done = _all_rows_sum(jnp.sum(c[0].done.astype(jnp.int32)), plan)
            return (done < stop_at) & (done < plan.batch_size)

        def body(c):
            return decode_round(params, draft_params, c[0], stop_ids, plan), c[1] + 1

        state, n = jax.lax.while_loop(going, body, (state, jnp.int32(0)))
        return state, jnp.full(state.bonus.shape, n)

    specs = state_specs(plan)
    fn = on_mesh(run, plan, (target_specs, draft_specs, specs, ALL, ALL), (specs, ROW))
    return fn(params, draft_params, state, stop_ids, stop_at)


def grow(state: DecodeState, capacity: int) -> DecodeState:
    """The state with `capacity` cache slots per row (zeros appended on each entry's time axis)."""

    def pad_entry(entry):
        axis = type(entry).time_axis

        def pad(x):
            widths = [(0, 0)] * x.ndim
            widths[axis] = (0, capacity - x.shape[axis])
            return jnp.pad(x, widths)

        return jax.tree.map(pad, entry)

    def pad_cache(cache: KVCache | None) -> KVCache | None:
        if cache is None:
            return None
        return KVCache([pad_entry(e) for e in cache.layers], cache.lengths)

    return dataclasses.replace(state, cache=pad_cache(state.cache), draft_cache=pad_cache(state.draft_cache))


start_jit = jax.jit(start, static_argnames=("plan", "chunk", "attention"))
refill_jit = jax.jit(refill, static_argnames=("plan", "chunk", "attention"), donate_argnums=(2,))
decode_chunk_jit = jax.jit(decode_chunk, static_argnames=("plan",), donate_argnums=(2,))
grow_jit = jax.jit(grow, static_argnames=("capacity",))  # a pad cannot reuse its input
