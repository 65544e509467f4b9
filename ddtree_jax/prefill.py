"""One chunked prefill for every program: requests' prompts into fresh caches, the first token chosen.

A prompt runs in chunks of C tokens through the cache path (each chunk attends to the cache written
so far and to itself under a causal mask, as a verify does: no [P, P] scores; a chunk at least the
prompt is one pass), its end in chunks of C / 4, so a prompt computes fewer than C / 4 padding tokens.
The drafter's context entries of each chunk come from the chunk's target features, at the same slots.

R prompts prefill together, one weight read per chunk step for all of them. In a static batch they
share the longest prompt's chunk schedule; in the continuous job's passes (`own_schedules`) each follows
its OWN chunk schedule (`chunk_steps` of its own length): step k of the full chunks covers [kC, kC + C) of
the requests that have more than k full chunks, tail step j covers [f C + j C/4, ...) of a request with
f full chunks and more than j tail chunks; a request with no chunk at a step computes it masked and
keeps nothing of it. So a prompt sees the same arithmetic (shapes [R, C], its own tokens, its own
chunks) whichever prompts share its prefill and whichever slot it lands in; a step a request has no
chunk in leaves its caches as they were. Each "data" device loops over its own requests' chunks only.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ddtree_jax import drafter, kv_cache, logprobs, target
from ddtree_jax.engine import DecodeState, Plan
from ddtree_jax.kv_cache import KVCache
from ddtree_jax.requests import Requests
from ddtree_jax.sampling import choose
from ddtree_jax.weights import Params


def tail_chunk(chunk: int) -> int:
    """The chunk of a prompt's end: C / 4, at least 16 (the prompt computes < C / 4 padding tokens)."""
    return max(chunk // 4, 16)


def chunk_steps(length, chunk: int) -> tuple:
    """(full chunks, tail chunks) of a prompt of `length` tokens (an int, or an int array on the
    device, one schedule per request): full chunks while more than C - C / 4 tokens are left (four
    tail chunks would cost one full one), then tail chunks. At most tail - 1 tokens are left after
    the full chunks' ceiling division, so the tail count is never negative."""
    tail = tail_chunk(chunk)
    full = (length + tail - 1) // chunk
    return full, (length - full * chunk + tail - 1) // tail


def initial_state(
    cache: KVCache,
    draft_cache: list | None,
    first: jax.Array,
    req: Requests,
    active,
    stop_ids,
    plan: Plan,
    first_scores: logprobs.Logprobs | None = None,
) -> DecodeState:
    """The state of freshly prefilled rows: caches filled up to the prompts' lengths, the first token
    [R] chosen (the next root, its Logprobs [R, 1] in `first_scores` when the plan keeps them); each
    row finishes at its own limit; inactive rows are done."""
    r = first.shape[0]
    kept = None
    if plan.logprobs:
        buf = logprobs.empty(r, plan.max_new_tokens + plan.path_slots, plan.logprobs)
        kept = logprobs.write(buf, first_scores, jnp.zeros((r,), jnp.int32))
    stopped = active & jnp.isin(first, stop_ids) & (True if req.stops is None else req.stops)
    limits = jnp.minimum(req.limits.astype(jnp.int32), plan.max_new_tokens)
    return DecodeState(
        cache=cache,
        draft_cache=draft_cache,
        bonus=first,
        output=jnp.zeros((r, plan.max_new_tokens + plan.path_slots), jnp.int32).at[:, 0].set(first),
        num_output=active.astype(jnp.int32),
        done=~active | stopped | (limits <= 1),
        stopped=stopped,
        acceptance=jnp.zeros((r, plan.max_new_tokens), jnp.int32),
        rounds=jnp.zeros((r,), jnp.int32),
        max_new_tokens=limits,
        stop_ids=stop_ids,
        sampling=req.sampling,
        logprobs=kept,
        stops=req.stops,
    )


def prefill(
    params: Params,
    draft_params: Params | None,
    req: Requests,
    stop_ids: jax.Array,
    *,
    plan: Plan,
    rows: int,
    capacity: int,
    chunk: int,
    attention: str,
    own_schedules: bool = False,
) -> DecodeState:
    """The state of the R requests [R, P] (this device's rows): prompts run in chunks of min(`chunk`,
    P) tokens through the cache path (`attention`: the chunks' implementation), caches of `capacity`
    slots, the first token chosen; a request bound for row `rows` or beyond is inactive. Each request
    on its own chunk schedule (`own_schedules`: the continuous job's passes, whose companions must not
    matter), else every request on the longest's (a static batch: one set of shapes for all)."""
    cfg, (r, p) = plan.target, req.tokens.shape
    axis, dtype = plan.model_axis, params["embed"].dtype
    chunk = min(chunk, p)  # a chunk of the whole prompt buffer is one pass
    if p % chunk:
        raise ValueError(f"prompt width {p} is not a multiple of the chunk {chunk}")
    tail = tail_chunk(chunk)

    def forward(tokens, positions, mask, cache):
        return target.forward(
            params, cfg, tokens, positions, mask, cache,
            feature_layers=plan.feature_layers, attention=attention, model_axis=axis,
        )  # fmt: skip

    probe = jax.eval_shape(
        lambda: forward(
            req.tokens[:, :chunk], jnp.zeros((r, chunk), jnp.int32), jnp.ones((r, chunk, chunk), bool), None
        )
    )
    cache = kv_cache.empty_like(_zeros(probe.kv), capacity)
    draft_cache = None
    if plan.method != "ar":
        ctx = jax.eval_shape(
            lambda f: drafter.context_kv(draft_params, plan.draft, f, jnp.zeros((r, chunk), jnp.int32)),
            jax.ShapeDtypeStruct(probe.features.shape, dtype),
        )
        draft_cache = kv_cache.empty_like(_zeros(ctx), capacity)
    last = jnp.zeros((r, probe.hidden.shape[-1]), probe.hidden.dtype)

    lengths = req.lengths if own_schedules else jnp.full_like(req.lengths, jnp.max(req.lengths))
    full, tails = chunk_steps(lengths, chunk)  # [R] each request's schedule

    def step(size: int, starts, active):
        """One chunk step of `size` tokens: request r's chunk `i` from position starts(i)[r], kept
        where active(i)[r]."""
        arange = jnp.arange(size, dtype=jnp.int32)
        causal = arange[None, :] <= arange[:, None]  # [C, C]

        def run(carry):
            i, cache, draft_cache, last = carry
            start, keep = starts(i), active(i)  # [R] each
            positions = start[:, None] + arange[None, :]  # [R, C]
            tokens = jnp.take_along_axis(req.tokens, jnp.minimum(positions, p - 1), axis=1)
            real = keep[:, None] & (positions < req.lengths[:, None])
            mask = causal[None] & real[:, None, :]
            seen = jnp.minimum(start, req.lengths)  # each request's cache holds its prompt before the chunk
            out = forward(tokens, positions, mask, KVCache(cache.layers, seen))
            cache = kv_cache.write(cache, out.kv, start, keep)  # (a request without this chunk: unchanged)
            if draft_cache is not None:
                ctx = drafter.context_kv(draft_params, plan.draft, out.features.astype(dtype), positions)
                draft_cache = kv_cache.write(draft_cache, ctx, start, keep)
            here = req.lengths - 1 - start  # the last prompt token's index in this chunk
            inside = keep & (here >= 0) & (here < size)
            picked = out.hidden[jnp.arange(r), jnp.clip(here, 0, size - 1)]
            return i + 1, cache, draft_cache, jnp.where(inside[:, None], picked, last)

        return run

    carry = (jnp.int32(0), cache, draft_cache, last)
    full_step = step(chunk, lambda i: jnp.full((r,), i * chunk, jnp.int32), lambda i: i < full)
    _, cache, draft_cache, last = jax.lax.while_loop(lambda c: c[0] < jnp.max(full), full_step, carry)
    if tail < chunk:  # (with tail == chunk there are no tail chunks)
        carry = (jnp.int32(0), cache, draft_cache, last)
        tail_step = step(tail, lambda j: full * chunk + j * tail, lambda j: j < tails)
        _, cache, draft_cache, last = jax.lax.while_loop(lambda c: c[0] < jnp.max(tails), tail_step, carry)
    # the target's choice after each prompt: the token at position L, also its noise position (sampling.py)
    head = target.logits(params, last[:, None], cfg.vocab_size, axis)
    first = choose(head, req.sampling, req.lengths[:, None], axis)[:, 0]
    scores = None
    if plan.logprobs:
        scores = logprobs.node_logprobs(
            head, first[:, None], req.sampling, plan.logprobs, plan.logprobs_mode, axis
        )
    layers = None if draft_cache is None else draft_cache.layers
    cache = KVCache(cache.layers, req.lengths)
    return initial_state(cache, layers, first, req, req.rows < rows, stop_ids, plan, scores)


def _zeros(tree):
    return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), tree)
