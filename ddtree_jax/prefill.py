"""One chunked prefill for every program: requests' prompts into fresh caches, the first token chosen.

A prompt runs in chunks of C tokens through the cache path (each chunk attends to the cache written
so far and to itself under a causal mask, as a verify does: no [P, P] scores; a chunk at least the
prompt is one pass), its end in chunks of C / 4, so a prompt computes fewer than C / 4 padding tokens.
Each "data" device loops over its own rows' chunks only. The drafter's context entries of each chunk
come from the chunk's target features, at the same slots.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp

from ddtree_jax import drafter, kv_cache, logprobs, target
from ddtree_jax.engine import DecodeState, Plan
from ddtree_jax.kv_cache import KVCache
from ddtree_jax.sampling import choose
from ddtree_jax.weights import Params

if TYPE_CHECKING:
    from ddtree_jax.programs import Requests


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
    stopped = active & jnp.isin(first, stop_ids)
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
) -> DecodeState:
    """The state of the R requests [R, P] (this device's rows): prompts run in chunks of min(`chunk`,
    P) tokens through the cache path (`attention`: the chunks' implementation), caches of `capacity`
    slots, the first token chosen; a request bound for row `rows` or beyond is inactive."""
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

    def step(size: int, base):
        """One chunk of `size` tokens, the i-th from position `base`."""
        arange = jnp.arange(size, dtype=jnp.int32)
        causal = arange[None, :] <= arange[:, None]  # [C, C]

        def run(carry):
            i, cache, draft_cache, last = carry
            start = base + i * size
            tokens = jax.lax.dynamic_slice_in_dim(req.tokens, start, size, axis=1)
            positions = jnp.broadcast_to(start + arange, (r, size))
            mask = causal[None] & (positions[:, None, :] < req.lengths[:, None, None])
            seen = jnp.minimum(start, req.lengths)  # each row's cache holds its prompt before the chunk
            out = forward(tokens, positions, mask, KVCache(cache.layers, seen))
            at = jnp.full((r,), start, jnp.int32)
            cache = kv_cache.write(cache, out.kv, at)
            if draft_cache is not None:
                ctx = drafter.context_kv(draft_params, plan.draft, out.features.astype(dtype), positions)
                draft_cache = kv_cache.write(draft_cache, ctx, at)
            here = req.lengths - 1 - start  # the last prompt token's index in this chunk
            inside = (here >= 0) & (here < size)
            picked = out.hidden[jnp.arange(r), jnp.clip(here, 0, size - 1)]
            return i + 1, cache, draft_cache, jnp.where(inside[:, None], picked, last)

        return run

    full, tails = chunk_steps(jnp.max(req.lengths), chunk)  # this device's rows only
    carry = (jnp.int32(0), cache, draft_cache, last)
    _, cache, draft_cache, last = jax.lax.while_loop(lambda c: c[0] < full, step(chunk, 0), carry)
    if tail < chunk:  # (with tail == chunk there are no tail chunks)
        carry = (jnp.int32(0), cache, draft_cache, last)
        _, cache, draft_cache, last = jax.lax.while_loop(
            lambda c: c[0] < tails, step(tail, full * chunk), carry
        )
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
