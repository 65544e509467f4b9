"""One chunked prefill for every program: requests' prompts into fresh caches, the first token chosen.

A prompt runs in chunks of C tokens through the cache path (each chunk attends to the cache written
so far and to itself under a causal mask, as a verify does: no [P, P] scores; a chunk at least the
prompt is one pass), its end in chunks of C / 4, so a prompt computes fewer than C / 4 padding tokens.
The drafter's context entries of each chunk come from the chunk's target features, at the same slots.

R prompts prefill together, one weight read per step for all of them. In a static batch they share
the longest prompt's chunk schedule ([R, C] steps). The continuous job's passes (`packed`) must not
let a prompt's tokens depend on its companions, and should not compute its companions' padding: each
prompt is cut into pieces of g = C / 4 tokens (`piece_count`), the pass's pieces are laid end to end,
prompt after prompt, and each step runs the next R of them, one forward of [R, g] tokens whatever
prompts they belong to (512 tokens at 8 slots of 256: about where a GPU's matmuls turn from reading
weights to computing, so a larger step would mostly compute more padding). Piece i of a prompt attends
to its row of the pass's cache up to i g (its prompt's earlier pieces, whether an earlier step or this
one wrote them: `kv_cache.SharedRows`) and causally to itself. A prompt then sees the same arithmetic
(fixed shapes, its own tokens, its own pieces; a matmul's rows do not depend on their neighbours at a
fixed shape) whichever prompts share its pass and wherever its pieces land, and a pass computes its
prompts' tokens rounded up to pieces, plus its last step's unused pieces, where the shared schedule
computed every slot for as many steps as the longest prompt needs.
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


def piece_count(length, chunk: int):
    """The pieces of a prompt of `length` tokens in a packed pass: ceil(length / (C / 4))."""
    piece = tail_chunk(chunk)
    return (length + piece - 1) // piece


def packed_steps(lengths: jax.Array, active: jax.Array, chunk: int) -> jax.Array:
    """The steps of a packed pass over requests of `lengths` [R] (those `active`): their pieces, R a
    step, rounded up."""
    r = lengths.shape[0]
    return (jnp.sum(jnp.where(active, piece_count(lengths, chunk), 0)) + r - 1) // r


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
    packed: bool = False,
) -> DecodeState:
    """The state of the R requests [R, P] (this device's rows): prompts run in chunks of min(`chunk`,
    P) tokens through the cache path (`attention`: the chunks' implementation), caches of `capacity`
    slots, the first token chosen; a request bound for row `rows` or beyond is inactive. With `packed`
    (the continuous job's passes, whose companions must not matter) in packed pieces, each prompt on
    its own; else every request on the longest's chunk schedule (a static batch: one set of shapes)."""
    cfg, (r, p) = plan.target, req.tokens.shape
    axis, dtype = plan.model_axis, params["embed"].dtype
    chunk = min(chunk, p)  # a chunk of the whole prompt buffer is one pass
    if p % chunk:
        raise ValueError(f"prompt width {p} is not a multiple of the chunk {chunk}")

    def forward(tokens, positions, mask, cache):
        return target.forward(
            params, cfg, tokens, positions, mask, cache,
            feature_layers=plan.feature_layers, attention=attention, model_axis=axis,
        )  # fmt: skip

    def context(features, positions):
        return drafter.context_kv(draft_params, plan.draft, features.astype(dtype), positions)

    probe = jax.eval_shape(
        lambda: forward(
            req.tokens[:, :chunk], jnp.zeros((r, chunk), jnp.int32), jnp.ones((r, chunk, chunk), bool), None
        )
    )
    cache = kv_cache.empty_like(_zeros(probe.kv), capacity)
    draft_cache = None
    if plan.method != "ar":
        ctx = jax.eval_shape(context, probe.features, jnp.zeros((r, chunk), jnp.int32))
        draft_cache = kv_cache.empty_like(_zeros(ctx), capacity)
    last = jnp.zeros((r, probe.hidden.shape[-1]), probe.hidden.dtype)
    run = _packed if packed else _chunked
    cache, draft_cache, last = run(
        forward, context if draft_cache is not None else None, req, (cache, draft_cache, last),
        active=req.rows < rows, chunk=chunk,
    )  # fmt: skip

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


def _chunked(forward, context, req: Requests, carry, *, active, chunk: int):
    """(cache, draft cache, last hidden [R, H]) after every request ran the longest's chunk schedule:
    [R, C] steps, then [R, C / 4] tail steps."""
    (r, p), tail = req.tokens.shape, tail_chunk(chunk)
    full, tails = chunk_steps(jnp.full_like(req.lengths, jnp.max(req.lengths)), chunk)

    def step(size: int, starts, keep_at):
        """One chunk step of `size` tokens: request r's chunk `i` from position starts(i)[r], kept
        where keep_at(i)[r]."""
        arange = jnp.arange(size, dtype=jnp.int32)
        causal = arange[None, :] <= arange[:, None]  # [C, C]

        def run(carry):
            i, cache, draft_cache, last = carry
            start, keep = starts(i), keep_at(i)  # [R] each
            positions = start[:, None] + arange[None, :]  # [R, C]
            tokens = jnp.take_along_axis(req.tokens, jnp.minimum(positions, p - 1), axis=1)
            real = keep[:, None] & (positions < req.lengths[:, None])
            mask = causal[None] & real[:, None, :]
            seen = jnp.minimum(start, req.lengths)  # each request's cache holds its prompt before the chunk
            out = forward(tokens, positions, mask, KVCache(cache.layers, seen))
            cache = kv_cache.write(cache, out.kv, start, keep)  # (a request without this chunk: unchanged)
            if draft_cache is not None:
                draft_cache = kv_cache.write(draft_cache, context(out.features, positions), start, keep)
            here = req.lengths - 1 - start  # the last prompt token's index in this chunk
            inside = keep & (here >= 0) & (here < size)
            picked = out.hidden[jnp.arange(r), jnp.clip(here, 0, size - 1)]
            return i + 1, cache, draft_cache, jnp.where(inside[:, None], picked, last)

        return run

    carry = (jnp.int32(0), *carry)
    full_step = step(chunk, lambda i: jnp.full((r,), i * chunk, jnp.int32), lambda i: i < full)
    carry = jax.lax.while_loop(lambda c: c[0] < jnp.max(full), full_step, carry)
    if tail < chunk:  # (with tail == chunk there are no tail chunks)
        tail_step = step(tail, lambda j: full * chunk + j * tail, lambda j: j < tails)
        carry = jax.lax.while_loop(lambda c: c[0] < jnp.max(tails), tail_step, (jnp.int32(0), *carry[1:]))
    return carry[1:]


def _packed(forward, context, req: Requests, carry, *, active, chunk: int):
    """(cache, draft cache, last hidden [R, H]) after the active requests' pieces ran, R of them a step
    ([R, g] tokens, g = C / 4), laid end to end in request order."""
    (r, p), piece = req.tokens.shape, tail_chunk(chunk)
    count = jnp.where(active, piece_count(req.lengths, chunk), 0)  # [R] pieces per request
    ends = jnp.cumsum(count)  # request i's pieces are [ends[i] - count[i], ends[i]) of the pass
    arange = jnp.arange(piece, dtype=jnp.int32)
    causal = arange[None, :] <= arange[:, None]  # [g, g]

    def run(carry):
        k, cache, draft_cache, last = carry
        index = k * r + jnp.arange(r, dtype=jnp.int32)  # [R] the step's pieces
        owner = jnp.searchsorted(ends, index, side="right").astype(jnp.int32)  # [R]; R: past the last
        live = index < ends[-1]
        o = jnp.minimum(owner, r - 1)
        start = (index - (ends - count)[o]) * piece  # [R] the piece's first position in its prompt
        positions = start[:, None] + arange[None, :]  # [R, g]
        tokens = req.tokens[o[:, None], jnp.minimum(positions, p - 1)]
        real = live[:, None] & (positions < req.lengths[o][:, None])
        mask = causal[None] & real[:, None, :]
        row = jnp.where(live, owner, r)  # the pass's cache row each piece writes and reads (r: none)
        out = forward(tokens, positions, mask, kv_cache.SharedRows(cache.layers, start, row, p))
        cache = kv_cache.write_rows(cache, out.kv, row, start)
        if draft_cache is not None:
            draft_cache = kv_cache.write_rows(draft_cache, context(out.features, positions), row, start)
        here = req.lengths[o] - 1 - start  # the prompt's last token's index in this piece
        inside = live & (here >= 0) & (here < piece)
        picked = out.hidden[jnp.arange(r), jnp.clip(here, 0, piece - 1)]  # [R, H]
        return k + 1, cache, draft_cache, last.at[jnp.where(inside, owner, r)].set(picked, mode="drop")

    steps = packed_steps(req.lengths, active, chunk)
    carry = jax.lax.while_loop(lambda c: c[0] < steps, run, (jnp.int32(0), *carry))
    return carry[1:]


def _zeros(tree):
    return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), tree)
