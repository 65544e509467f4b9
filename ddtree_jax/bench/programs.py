"""The programs `ddtree-bench` times on random weights: a batch's synthetic mid-generation state, the
round in a device loop, and each stage of the round alone in a device loop.

Shapes: a DecodeState of `Shape` rows x capacity; the stage programs return [B] int32.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from ddtree_jax import drafter, engine, models
from ddtree_jax.bench.timing import median_seconds
from ddtree_jax.engine import MAX_STOP_IDS, ROW, DecodeState, Plan
from ddtree_jax.kv_cache import KVCache
from ddtree_jax.programs import Shape
from ddtree_jax.sampling import SamplingArrays
from ddtree_jax.sharding import make_mesh


@functools.partial(jax.jit, static_argnums=(1, 2))
def _normal(key: jax.Array, shape: tuple[int, ...], dtype) -> jax.Array:
    return jax.random.normal(key, shape, dtype)


def synthetic_state(
    plan: Plan,
    shape: Shape,
    context: int,
    seed: int,
    dtype,
    options: dict | None = None,
    active: int | None = None,
) -> DecodeState:
    """A batch of `shape` mid-generation: random K/V committed up to `context` in both caches, placed
    on the plan's mesh (K/V heads split over "model", rows over "data"). Rows from `active` on (default:
    none) are padding, as `ddtree-generate` pads: done, with one cached token. `options`: every row's
    sampling settings (None: the greedy-only program)."""
    key = jax.random.key(seed)
    b, s = shape.rows, shape.capacity
    padding = jnp.arange(b) >= (b if active is None else active)

    def layers(shapes) -> list:  # random leaves of the family's entry shapes (global, placed below)
        leaves, tree = jax.tree.flatten(shapes)
        keys = jax.random.split(key, len(leaves))
        return jax.tree.unflatten(
            tree, [_normal(k, x.shape, x.dtype) for k, x in zip(keys, leaves, strict=True)]
        )

    t = plan.target
    lengths = jnp.where(padding, 1, context).astype(jnp.int32)  # the one length both caches read
    state = DecodeState(
        cache=KVCache(layers(models.family(t).cache_shapes(t, b, s, plan.tp, dtype)), lengths),
        draft_cache=None
        if plan.method == "ar"
        else layers(drafter.cache_shapes(plan.draft, b, s, plan.tp, dtype)),
        bonus=jax.random.randint(key, (b,), 0, t.vocab_size, jnp.int32),
        output=jnp.zeros((b, plan.max_new_tokens + plan.path_slots), jnp.int32),
        num_output=jnp.zeros((b,), jnp.int32),
        done=padding,
        stopped=jnp.zeros((b,), bool),
        acceptance=jnp.zeros((b, plan.max_new_tokens), jnp.int32),
        rounds=jnp.zeros((b,), jnp.int32),
        max_new_tokens=jnp.full((b,), plan.max_new_tokens, jnp.int32),
        stop_ids=jnp.full((MAX_STOP_IDS,), -1, jnp.int32),
        sampling=None if options is None else SamplingArrays.from_rows([options] * b),
    )
    return place_state(state, plan)


def place_state(state: DecodeState, plan: Plan) -> DecodeState:
    """Put a DecodeState on the plan's mesh as `engine.state_specs` lays it out."""
    if plan.tp * plan.dp == 1:
        return state
    mesh = make_mesh(plan.tp, plan.dp)
    return jax.tree.map(
        lambda spec, x: jax.device_put(x, NamedSharding(mesh, spec)),
        engine.state_specs(plan),
        state,
        is_leaf=lambda x: isinstance(x, P),
    )


def mesh_program(fn, plan: Plan, in_specs, out_specs, donate=(), **static):
    """`fn(*args, plan=plan, **static)` jitted, and shard_mapped over the plan's mesh when it has one."""
    return jax.jit(
        engine.on_mesh(functools.partial(fn, **static), plan, in_specs, out_specs), donate_argnums=donate
    )


def decode_rounds(params, draft_params, state, *, plan: Plan, rounds: int):
    """`rounds` decode rounds in one program (the device loop)."""
    return jax.lax.fori_loop(
        0, rounds, lambda _, s: engine.decode_round(params, draft_params, s, plan), state
    )


def round_program(plan: Plan, rounds: int):
    """`decode_rounds`, jitted on the plan's mesh (the state is donated)."""
    tspec, dspec = engine.param_specs(plan)
    sspec = engine.state_specs(plan)
    return mesh_program(decode_rounds, plan, (tspec, dspec, sspec), sspec, donate=(2,), rounds=rounds)


# The stage loops below chain each pass to the previous one through a value that depends on all of
# the pass's output and feeds all of its input (`_never(c)` is 0, but XLA cannot know it), so no part
# of a pass is loop-invariant: XLA can neither hoist it out of the loop nor drop it.


def _never(carry: jax.Array) -> jax.Array:
    """[B] int32 zeros that depend on `carry` [B] (which is never negative)."""
    return (carry < 0).astype(jnp.int32)


def draft_passes(params, draft_params, state, *, plan: Plan, rounds: int):
    """`rounds` drafter passes; each pass's root and positions depend on all of the last pass's tokens."""

    def body(_, carry):
        bonus = (state.bonus + carry) % plan.target.vocab_size
        lengths = state.cache.lengths + _never(carry)
        passed = dataclasses.replace(
            state, bonus=bonus, cache=dataclasses.replace(state.cache, lengths=lengths)
        )
        _, tok = engine.draft(params, draft_params, passed, plan)
        return jnp.sum(tok, axis=(1, 2)) % plan.target.vocab_size

    return jax.lax.fori_loop(0, rounds, body, jnp.zeros_like(state.bonus))


def build_passes(state, logp, tok, *, plan: Plan, rounds: int):
    """`rounds` tree builds; each pass's inputs depend on all of the last tree."""

    def body(_, carry):
        zero = _never(carry)[:, None, None]
        lp = None if logp is None else logp + zero.reshape((-1,) + (1,) * (logp.ndim - 1)).astype(logp.dtype)
        t = engine.build(dataclasses.replace(state, bonus=carry), lp, tok + zero, plan)
        mixed = t.tokens.sum(-1) + t.parent.sum(-1) + t.depth.sum(-1) + t.mask.sum((1, 2))
        return mixed % plan.target.vocab_size

    return jax.lax.fori_loop(0, rounds, body, state.bonus)


def verify_passes(params, state, t, *, plan: Plan, rounds: int):
    """`rounds` verify passes over one tree; each pass's root token, positions and sampling seed depend
    on all of the last pass's choices."""

    def body(_, carry):
        zero = _never(carry)
        cache = dataclasses.replace(state.cache, lengths=state.cache.lengths + zero)
        sampling = state.sampling
        if sampling is not None:
            sampling = dataclasses.replace(sampling, seed=sampling.seed + zero.astype(jnp.uint32))
        tokens = t.tokens.at[:, 0].set(carry)
        passed = dataclasses.replace(state, cache=cache, sampling=sampling)
        choice = engine.verify(params, passed, t._replace(tokens=tokens), plan)[0]
        return jnp.sum(choice, axis=-1) % plan.target.vocab_size

    return jax.lax.fori_loop(0, rounds, body, t.tokens[:, 0])


def walk_passes(t, choice, *, plan: Plan, rounds: int):
    """`rounds` walks of one tree; each pass's choices depend on all of the last walk."""

    def body(_, carry):
        w = engine.walk(t, choice + _never(carry)[:, None], plan)
        mixed = w.path.sum(-1) + w.length + w.bonus + w.emitted.sum(-1)
        return mixed % plan.target.vocab_size

    return jax.lax.fori_loop(0, rounds, body, t.tokens[:, 0])


def stage_programs(plan: Plan, rounds: int) -> dict:
    """The device-loop stage timers (engine.STAGES but commit), jitted on the plan's mesh: name ->
    program. draft(params, draft_params, state); build(state, logp, tok); verify(params, state, tree);
    walk(tree, choice)."""
    tspec, dspec = engine.param_specs(plan)
    sspec = engine.state_specs(plan)
    programs = {}
    if plan.method != "ar":
        programs["draft"] = mesh_program(draft_passes, plan, (tspec, dspec, sspec), ROW, rounds=rounds)
        programs["build"] = mesh_program(build_passes, plan, (sspec, ROW, ROW), ROW, rounds=rounds)
    programs["verify"] = mesh_program(verify_passes, plan, (tspec, sspec, ROW), ROW, rounds=rounds)
    programs["walk"] = mesh_program(walk_passes, plan, (ROW, ROW), ROW, rounds=rounds)
    return programs


def stage_args(params, dparams, state: DecodeState, plan: Plan) -> dict[str, tuple]:
    """The arguments of each `stage_programs` program: one draft, tree and verify from `state`."""
    tspec, dspec = engine.param_specs(plan)
    sspec = engine.state_specs(plan)
    logp = tok = None
    if plan.method != "ar":
        logp, tok = mesh_program(engine.draft, plan, (tspec, dspec, sspec), (ROW, ROW))(
            params, dparams, state
        )
    t = mesh_program(engine.build, plan, (sspec, ROW, ROW), ROW)(state, logp, tok)
    choice = mesh_program(lambda *a, plan: engine.verify(*a, plan)[0], plan, (tspec, sspec, ROW), ROW)(
        params, state, t
    )
    return {
        "draft": (params, dparams, state),
        "build": (state, logp, tok),
        "verify": (params, state, t),
        "walk": (t, choice),
    }


def device_stage_ms(params, dparams, state: DecodeState, plan: Plan, rounds: int) -> dict[str, float]:
    """Each stage alone in a device loop (no host sync between passes), ms per pass; the caller adds
    the commit as what remains of the round (`commit`: the commit and the loop's own cost)."""
    programs = stage_programs(plan, rounds)
    args = stage_args(params, dparams, state, plan)
    return {
        name: 1e3 * median_seconds(lambda p=p, a=args[name]: p(*a), 3) / rounds
        for name, p in programs.items()
    }
