"""`ddtree-bench`: round and stage times on random-weight models of real shapes, against the HBM floor.

Random weights give meaningless acceptance, but exactly the cost of a round: every round does the
same work whatever the drafter proposes. The cache is filled with random K/V up to the context
length (no prefill), so long contexts cost no prefill memory.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from ddtree_jax import compile_cache, drafter, engine, models, target
from ddtree_jax.attention import IMPLEMENTATIONS
from ddtree_jax.config import DraftConfig, RopeConfig, TargetConfig, default_target_layer_ids
from ddtree_jax.engine import MAX_STOP_IDS, ROW, DecodeState, Plan
from ddtree_jax.errors import DDTreeError
from ddtree_jax.kv_cache import KVCache, bytes_per_token
from ddtree_jax.models import common, moe
from ddtree_jax.pair import batch_shape, make_plan
from ddtree_jax.programs import Programs, Shape
from ddtree_jax.quant import load as quant_load
from ddtree_jax.quant.formats import Fp8Block, Int4Group
from ddtree_jax.sampling import GREEDY, SamplingParams
from ddtree_jax.sharding import make_mesh, param_sharding
from ddtree_jax.weights import random_params

SHAPES = models.bench_shapes()  # every family's benchmark shapes (Family.SHAPES)


# --quantize: the target's weights as the published checkpoints store them (quant.load.published_form)
QUANTIZE = {"none": None, "fp8": Fp8Block((128, 128)), "int4-experts": Int4Group(32)}


def draft_shape(cfg: TargetConfig, layers: int, block_size: int) -> DraftConfig:
    """A DFlash drafter of the layer shape the target's family gives (`Family.draft_dims`)."""
    d = models.family(cfg).draft_dims(cfg)
    return DraftConfig(
        layers,
        d,
        RopeConfig(cfg.rope.theta, d.head_dim),
        block_size,
        cfg.vocab_size - 1,
        # DFlash's spacing over [1, L - 3] runs below 0 for targets cut to 2 or 3 layers: clamp
        # (the drafter still reads `layers` feature vectors, as the full-depth one does)
        tuple(min(max(i, 0), cfg.num_layers - 1) for i in default_target_layer_ids(cfg.num_layers, layers)),
        cfg.vocab_size,
        cfg.architecture,
    )


def read_ceiling_gbs(nbytes: int) -> float:
    """Read bandwidth of a large bf16 `jnp.sum`, GB/s (the floor's denominator)."""
    x = jnp.ones((nbytes // 2,), jnp.bfloat16)
    f = jax.jit(lambda a: jnp.sum(a, dtype=jnp.float32))
    return nbytes / median_seconds(lambda: f(x), 10) / 1e9


def median_seconds(fn: Callable[[], Any], reps: int) -> float:
    """Median wall time of `reps` synced calls of fn() after one warm-up call, in seconds."""
    jax.block_until_ready(fn())
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return statistics.median(times)


@functools.partial(jax.jit, static_argnums=(1, 2))
def _normal(key: jax.Array, shape: tuple[int, ...], dtype) -> jax.Array:
    return jax.random.normal(key, shape, dtype)


def synthetic_state(
    plan: Plan,
    shape: Shape,
    context: int,
    seed: int,
    dtype,
    sampling: dict | None = None,
    active: int | None = None,
) -> DecodeState:
    """A batch of `shape` mid-generation: random K/V committed up to `context` in both caches, placed
    on the plan's mesh (K/V heads split over "model", rows over "data"). Rows from `active` on (default:
    none) are padding, as `ddtree-generate` pads: done, with one cached token."""
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
        sampling=None if sampling is None else SamplingParams.from_rows([sampling] * b),
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
        lp = None if logp is None else logp + zero.astype(logp.dtype)
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


def parse_sampling(text: str) -> dict | None:
    """'greedy' -> None; 'T:top_k:top_p' -> the settings of every row (seed 0)."""
    if text == "greedy":
        return None
    temperature, top_k, top_p = text.split(":")
    return GREEDY | {"temperature": float(temperature), "top_k": int(top_k), "top_p": float(top_p)}


def weight_bytes(params) -> int:
    """Bytes of all parameters at their global (placed) shapes, each counted once."""
    return sum(x.nbytes for x in jax.tree.leaves(params))


def _device_bytes(x: jax.Array) -> int:
    return x.addressable_shards[0].data.nbytes


def device_memory() -> dict | None:
    """bytes_in_use and peak_bytes_in_use of the first device (None where the backend has no stats)."""
    stats = jax.devices()[0].memory_stats()
    return None if stats is None else {k: stats.get(k) for k in ("bytes_in_use", "peak_bytes_in_use")}


def step_weight_bytes(params, cfg: TargetConfig, tokens: int = 1) -> float:
    """Weight bytes a pass over `tokens` tokens (per device) must read on one device: all it holds,
    less what the family says such a pass need not read (the embedding table when lm_head is
    separate; a MoE target's experts its tokens are not expected to select)."""
    held = sum(_device_bytes(x) for x in jax.tree.leaves(params))
    return held - models.family(cfg).unread_weight_bytes(params, cfg, tokens, _device_bytes)


def distinct_per_device(experts: np.ndarray, num_experts: int, tp: int, sharding: str) -> int:
    """The most distinct experts one device must read for the chosen experts [..., k] (global ids):
    under expert parallelism ("ep", tp > 1) each device reads its own E / tp experts' share, else every
    device reads (its columns of) all of them."""
    chosen = np.unique(experts)
    if sharding != "ep" or tp == 1:
        return int(chosen.size)
    return int(np.bincount(chosen // (num_experts // tp), minlength=tp).max())


def chosen_expert_floor(
    log: dict[int, list[np.ndarray]], params, cfg: TargetConfig, plan: Plan, shape: Shape, batch: int
) -> dict:
    """Weight bytes one device must read per round given the experts the router chose (`log`:
    moe.RoutingLog.calls of `rounds` rounds: per MoE layer in order, the experts [rows x T, k] of each
    round), counting the live rows' tokens only: all it holds, less the embedding table, less each
    sparse layer's held experts that no live token chose (the busiest device under "ep"). Returns
    {"weight_bytes": mean over rounds, "distinct_experts": mean distinct a layer and round}."""
    sparse = [p for i, p in enumerate(params["layers"]) if cfg.is_sparse(i)]
    if len(log) != len(sparse):
        raise ValueError(
            f"the routing log has {len(log)} MoE call sites, the target {len(sparse)} sparse layers"
        )
    held = sum(_device_bytes(x) for x in jax.tree.leaves(params))
    # every expert expected (a huge token count): what is left unread is the embedding table alone
    static = held - models.family(cfg).unread_weight_bytes(params, cfg, 1 << 40, _device_bytes)
    rows, live = shape.rows // plan.dp, -(-batch // plan.dp)
    sharding = getattr(cfg, "moe_sharding", "ep")
    per_round, distinct = [], []
    for site, p in enumerate(sparse):
        local = moe.num_experts(p["experts_gate"])  # experts a device holds (all of them under "tp")
        if sharding == "ep" and plan.tp > 1:
            local //= plan.tp
        expert_bytes = (
            sum(_device_bytes(a) for n in moe.EXPERT_WEIGHTS for a in jax.tree.leaves(p[n])) / local
        )
        for r, experts in enumerate(log[site]):
            tokens = experts.reshape(rows, -1, experts.shape[-1])[:live]
            count = distinct_per_device(tokens, cfg.num_experts, plan.tp, sharding)
            distinct.append(count)
            if r == len(per_round):
                per_round.append(static)
            per_round[r] -= (local - count) * expert_bytes
    return {"weight_bytes": float(np.mean(per_round)), "distinct_experts": float(np.mean(distinct))}


def record_routing(params, dparams, state: DecodeState, plan: Plan, rounds: int) -> dict:
    """`rounds` rounds of a separately compiled program that logs every MoE layer's routing (one
    host callback a layer and round: never the timed program) -> moe.RoutingLog.calls."""
    with moe.RoutingLog() as log:
        compiled = round_program(plan, rounds).lower(params, dparams, state).compile()
    jax.block_until_ready(compiled(params, dparams, state))
    jax.effects_barrier()  # every callback has run
    return log.calls


def bench_one(
    params,
    dparams,
    plan: Plan,
    shape: Shape,
    context: int,
    rounds: int,
    ceiling_gbs: float,
    stages: bool,
    sampling=None,
    batch: int | None = None,
    chosen_floor: bool = True,
) -> dict:
    """Device-loop round time of one configuration; with `stages`, its stages timed host-stepped
    (a sync per stage) and each alone in a device loop. `batch`: the rows requested, when the shape
    runs more (`programs.rows_to_run`); the floor counts only their K/V. `chosen_floor`: for a MoE
    target also the floor of the experts chosen (`chosen_expert_floor`; compiles the round again)."""
    batch = batch or shape.rows
    dparams = None if plan.method == "ar" else dparams

    def fresh(seed: int) -> DecodeState:  # callers drop their last state first: at 32k one fills half the GPU
        return synthetic_state(plan, shape, context, seed, params["embed"].dtype, sampling, batch)

    state = fresh(0)
    start = time.perf_counter()
    compiled = round_program(plan, rounds).lower(params, dparams, state).compile()
    compile_s = time.perf_counter() - start
    times = []
    for _ in range(3):
        state = None
        state = fresh(0)
        jax.block_until_ready(state)
        start = time.perf_counter()
        jax.block_until_ready(compiled(params, dparams, state))
        times.append((time.perf_counter() - start) / rounds)
    round_ms = 1e3 * statistics.median(times)

    stage_ms, device_ms = {}, {}
    if stages:
        from ddtree_jax.host_stepped import HostStepper

        stepper = HostStepper(Programs(params, dparams, plan, 256, plan.attention))
        state = None
        state = fresh(1)
        for _ in range(rounds + 2):  # round 1 compiles (kept apart), round 2 warms up
            state = stepper.round(state)
        stage_ms = {k: 1e3 * statistics.median(v[1:]) for k, v in stepper.times.items()}
        state = None
        state = fresh(2)
        device_ms = device_stage_ms(params, dparams, state, plan, rounds)
        device_ms["commit"] = round_ms - sum(device_ms.values())

    # one device's K/V: its rows, its share of every layer's cache entry
    t = plan.target
    shapes = models.family(t).cache_shapes(t, shape.rows, shape.capacity, plan.tp, params["embed"].dtype)
    kv_bytes = bytes_per_token(shapes, plan.tp) * -(-batch // plan.dp) * context
    tokens = plan.tree_size * -(-batch // plan.dp)  # one device's tokens per round (its live rows')
    floor_ms = 1e3 * (step_weight_bytes(params, plan.target, tokens) + kv_bytes) / (ceiling_gbs * 1e9)
    chosen = {}
    if chosen_floor and models.family(t).ROUTED_EXPERTS:  # the floor of the experts the router chose
        state = None
        log = record_routing(params, dparams, fresh(0), plan, rounds)
        chosen = chosen_expert_floor(log, params, t, plan, shape, batch)
        chosen_ms = 1e3 * (chosen["weight_bytes"] + kv_bytes) / (ceiling_gbs * 1e9)
        chosen = {"chosen_floor_ms": chosen_ms, "chosen_distinct_experts": chosen["distinct_experts"]}
        chosen |= {"round_over_uniform_floor": round_ms / floor_ms}
    return {
        "method": plan.method,
        "budget": plan.budget,
        "tree_size": plan.tree_size,
        "batch": batch,
        "rows": shape.rows,
        "context": context,
        "attention": plan.attention,
        "tp": plan.tp,
        "sampling": sampling,
        "round_ms": round_ms,
        "stages_ms": stage_ms,
        "host_stepped_round_ms": sum(stage_ms.values()),
        "device_stages_ms": device_ms,
        "target_floor_ms": floor_ms,
        "floor_tokens": tokens,
        "round_over_floor": round_ms / chosen.get("chosen_floor_ms", floor_ms),
        "compile_s": compile_s,
    } | chosen


METHODS = ("ar", "dflash", "ddtree")
EXIT_ERROR = 1  # a bad flag or --out (one line, before any work), or a configuration that failed


class _Parser(argparse.ArgumentParser):
    """argparse whose usage errors are one line and exit with EXIT_ERROR, like every other error."""

    def error(self, message: str):
        self.exit(EXIT_ERROR, f"{self.prog}: error: {message} (--help lists the flags)\n")


def build_parser() -> argparse.ArgumentParser:
    """ddtree-bench's flags (their defaults shown by --help)."""
    p = _Parser(
        prog="ddtree-bench",
        description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        epilog=f"shapes: {', '.join(sorted(SHAPES))} (tiny*, default-pair: CPU-sized; the others: real "
        "widths). "
        f"exit status: 0 every configuration measured; {EXIT_ERROR} a bad flag or --out (refused before any "
        "work), or a configuration that failed (its row in --out holds the error). Progress goes to stderr.",
    )
    p.add_argument(
        "--shape",
        choices=sorted(SHAPES),
        required=True,
        help="the random-weight target (no default: it decides everything the run measures, and the "
        "real-width ones take many GB)",
    )
    p.add_argument("--num-layers", type=int, help="the target's depth (default: the shape's)")
    p.add_argument("--draft-layers", type=int, default=5, help="the drafter's depth")
    p.add_argument("--block-size", type=int, default=16, help="the drafter's block (depth = block - 1)")
    p.add_argument("--methods", default="ar,dflash,ddtree", help=f"comma list of {', '.join(METHODS)}")
    p.add_argument(
        "--budgets", default="15,63", help="comma list of ddtree budgets (tree nodes besides the root)"
    )
    p.add_argument("--batches", default="1", help="comma list of batch sizes (rows)")
    p.add_argument("--contexts", default="1024", help="comma list of cached tokens per row")
    p.add_argument("--attention", default="reference", help=f"comma list of {', '.join(IMPLEMENTATIONS)}")
    p.add_argument("--rounds", type=int, default=16, help="decode rounds per timed program")
    p.add_argument(
        "--stages", action="store_true", help="also time each stage, host-stepped and alone in a device loop"
    )
    p.add_argument(
        "--sampling",
        default="greedy",
        help="comma list of greedy or T:top_k:top_p settings, e.g. greedy,0.7:0:1,0.7:20:0.9",
    )
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel devices (the model split over them)")
    p.add_argument(
        "--moe-sharding",
        choices=["ep", "tp"],
        default="ep",
        help="MoE shapes under --tp: whole experts per device (ep) or columns of every expert (tp)",
    )
    p.add_argument(
        "--moe-dispatch",
        choices=[*moe.DISPATCHES, *moe.GPU_DISPATCHES],
        default=None,
        help="MoE shapes: force moe.run_experts' dispatch (moe.DISPATCHES, moe.GPU_DISPATCHES); "
        "default: by token count and backend (moe.choose_dispatch)",
    )
    p.add_argument(
        "--drop-layer-all-reduce",
        action="store_true",
        help="timing only, outputs are wrong: skip the all-reduce after o_proj and down_proj (its cost "
        "is the difference to a run without this flag)",
    )
    p.add_argument(
        "--quantize",
        choices=sorted(QUANTIZE),
        default="none",
        help="DeepSeek-V3 shapes: the target's weights in a published quantized form: fp8 (128x128 blocks, "
        "every projection, as DeepSeek-V3/Kimi-K2) or int4-experts (group 32, routed experts, as Kimi-K2.5)",
    )
    p.add_argument(
        "--chosen-floor",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="MoE shapes: also the floor of the experts the router chose, which round_over_floor then "
        "divides by (costs a second compile of each configuration's round)",
    )
    p.add_argument(
        "--ceiling-bytes", type=int, default=4 << 30, help="bytes summed to measure the read ceiling"
    )
    p.add_argument("--out", required=True, help="the JSON written (rewritten after every configuration)")
    compile_cache.add_flag(p)
    return p


@dataclasses.dataclass(frozen=True)
class Grid:
    """The configurations a run sweeps, parsed and checked from the flags."""

    methods: tuple[str, ...]
    budgets: tuple[int, ...]
    batches: tuple[int, ...]
    contexts: tuple[int, ...]
    attentions: tuple[str, ...]
    samplings: tuple[dict | None, ...]

    def configurations(self) -> list[tuple]:
        """(attention, batch, context, (method, budget), sampling) in sweep order (budget 0: no tree)."""
        trees = [(m, n) for m in self.methods for n in (self.budgets if m == "ddtree" else [0])]
        return list(itertools.product(self.attentions, self.batches, self.contexts, trees, self.samplings))


def _positive_ints(flag: str, text: str) -> tuple[int, ...]:
    """A comma list of integers >= 1, or a one-line error naming the flag and the item."""
    items = text.split(",")
    for item in items:
        if not item.strip().isdigit() or int(item) < 1:
            raise DDTreeError(f"{flag} {text}: {item!r} is not an integer >= 1")
    return tuple(int(item) for item in items)


def _names(flag: str, text: str, known: tuple[str, ...]) -> tuple[str, ...]:
    """A comma list of names out of `known`, or a one-line error naming the flag and the item."""
    items = tuple(text.split(","))
    for item in items:
        if item not in known:
            raise DDTreeError(f"{flag} {text}: {item!r} is not one of {', '.join(known)}")
    return items


def _sampling(text: str) -> dict | None:
    """One --sampling item, checked: greedy, or T >= 0 : top_k >= 0 : 0 < top_p <= 1."""
    try:
        s = parse_sampling(text)
    except ValueError:
        raise DDTreeError(f"--sampling {text!r}: not greedy or T:top_k:top_p (e.g. 0.7:20:0.9)") from None
    if s is not None and not (s["temperature"] >= 0 and s["top_k"] >= 0 and 0 < s["top_p"] <= 1):
        raise DDTreeError(f"--sampling {text!r}: needs temperature >= 0, top_k >= 0, 0 < top_p <= 1")
    return s


def check_args(args: argparse.Namespace) -> Grid:
    """Every check that needs no device work, before any: the flags (one line naming the first bad one)
    and --out's directory. Returns the sweep's configurations."""
    from ddtree_jax.budgets import default_branching

    for flag, value, least in [
        ("--draft-layers", args.draft_layers, 1),
        ("--block-size", args.block_size, 2),
        ("--rounds", args.rounds, 1),
        ("--num-layers", args.num_layers or 1, 1),
        ("--ceiling-bytes", args.ceiling_bytes, 1 << 20),
    ]:
        if value < least:
            raise DDTreeError(f"{flag} {value}: must be >= {least}")
    grid = Grid(
        methods=_names("--methods", args.methods, METHODS),
        budgets=_positive_ints("--budgets", args.budgets),
        batches=_positive_ints("--batches", args.batches),
        contexts=_positive_ints("--contexts", args.contexts),
        attentions=_names("--attention", args.attention, IMPLEMENTATIONS),
        samplings=tuple(_sampling(s) for s in args.sampling.split(",")),
    )
    cfg = SHAPES[args.shape]
    depth = args.block_size - 1
    for budget in grid.budgets if "ddtree" in grid.methods else ():
        k = min(default_branching("ddtree", budget), cfg.vocab_size)
        if budget > sum(k**d for d in range(1, depth + 1)):
            raise DDTreeError(f"--budgets: {budget} exceeds the drafter's lattice ({depth} depths of {k})")
    pallas = [a for a in grid.attentions if a != "reference"]  # the Pallas kernels: Triton and Mosaic GPU
    if pallas and jax.default_backend() != "gpu":
        raise DDTreeError(
            f"--attention {pallas[0]}: the Pallas kernels need a GPU (backend: {jax.default_backend()})"
        )
    if not 1 <= args.tp <= jax.device_count():
        raise DDTreeError(f"--tp {args.tp}: between 1 and the {jax.device_count()} devices here")
    if args.drop_layer_all_reduce and args.tp == 1:
        raise DDTreeError("--drop-layer-all-reduce needs --tp > 1 (one device has no all-reduce)")
    scheme = type(QUANTIZE.get(args.quantize))
    if args.quantize != "none" and scheme not in models.family(cfg).QUANTIZED_FORMATS:
        fit = sorted(n for n, c in SHAPES.items() if scheme in models.family(c).QUANTIZED_FORMATS)
        raise DDTreeError(
            f"--quantize {args.quantize} needs a shape whose family reads it ({', '.join(fit)})"
        )
    check_out_path(args.out)
    return grid


def check_out_path(out: str) -> None:
    """--out can be written: not a directory, in a directory that exists and is writable."""
    path = Path(out)
    if path.is_dir():
        raise DDTreeError(f"--out {out}: is a directory")
    parent = path.resolve().parent
    if not parent.is_dir():
        raise DDTreeError(f"--out {out}: directory {parent} does not exist")
    if not os.access(parent, os.W_OK | os.X_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise DDTreeError(f"--out {out}: not writable")


def main(argv: list[str] | None = None) -> int:
    """Entry point: check the flags, sweep the configurations, write one JSON file; the exit status."""
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as e:  # --help (0) or a usage error (EXIT_ERROR)
        return e.code if isinstance(e.code, int) else EXIT_ERROR
    try:
        grid = check_args(args)
        return run(args, grid)
    except DDTreeError as e:
        print(f"ddtree-bench: error: {e}", file=sys.stderr)
        return EXIT_ERROR


def run(args: argparse.Namespace, grid: Grid) -> int:
    """Make the random-weight models of the checked flags and sweep the grid."""
    compile_cache.enable(args.compile_cache)  # before the first compile
    cfg = SHAPES[args.shape]
    if args.num_layers:
        cfg = dataclasses.replace(cfg, num_layers=args.num_layers)
    family = models.family(cfg)
    if family.ROUTED_EXPERTS:
        cfg = dataclasses.replace(cfg, moe_sharding=args.moe_sharding, moe_dispatch=args.moe_dispatch)
    dcfg = draft_shape(cfg, args.draft_layers, args.block_size)
    family.check_divisible(cfg, args.tp)
    drafter.check_divisible(dcfg, args.tp)
    place = None if args.tp == 1 else param_sharding(make_mesh(args.tp)).place
    _progress(f"making random {args.shape} weights")
    if args.quantize != "none":
        placement = param_sharding(make_mesh(args.tp))
        params = quant_load.random_params(
            target.weight_specs(cfg), QUANTIZE[args.quantize], 0, jnp.bfloat16, placement
        )
    else:
        params = random_params(target.weight_specs(cfg), 0, jnp.bfloat16, place=place)
    dparams = random_params(drafter.weight_specs(dcfg), 1, jnp.bfloat16, place=place)
    psum = common.psum
    if args.drop_layer_all_reduce:
        common.psum = lambda x, axis: x  # read when the programs are traced, below; restored at the end
    try:
        return _sweep(args, grid, cfg, dcfg, params, dparams)
    finally:
        common.psum = psum


def _progress(message: str) -> None:
    """One progress line on stderr."""
    print(f"ddtree-bench: {message}", file=sys.stderr, flush=True)


def run_meta(argv: list[str]) -> dict:
    """What every benchmark JSON records of its run: date, device, jax and Python versions, argv."""
    return {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "device": str(jax.devices()[0]),
        "device_kind": jax.devices()[0].device_kind,
        "jax": jax.__version__,
        "python": platform.python_version(),
        "argv": argv,
    }


def _sweep(args, grid: Grid, cfg: TargetConfig, dcfg: DraftConfig, params, dparams) -> int:
    """Time every configuration of the grid, writing the JSON after each; EXIT_ERROR if any failed."""
    ceiling = read_ceiling_gbs(args.ceiling_bytes)
    print(f"read ceiling {ceiling:.0f} GB/s; target weights {weight_bytes(params) / 1e9:.2f} GB", flush=True)
    meta = run_meta(sys.argv) | {
        "shape": args.shape,
        "tp": args.tp,
        "moe_sharding": getattr(cfg, "moe_sharding", None),
        "moe_dispatch": getattr(cfg, "moe_dispatch", None),
        "devices": [str(d) for d in jax.devices()[: args.tp]],
        "layer_all_reduce": not args.drop_layer_all_reduce,
        "read_ceiling_gbs": ceiling,
        "target_weight_bytes": weight_bytes(params),
        "draft_weight_bytes": weight_bytes(dparams),
        "quantize": args.quantize,
        "device_memory": device_memory(),
    }
    rows = []

    def save():  # after every row, so a run cut short keeps what it measured
        with open(args.out, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)

    save()
    configurations = grid.configurations()
    for n, (attention, batch, context, (method, budget), sampling) in enumerate(configurations, start=1):
        label = f"{method}{f' {budget}' if budget else ''} batch {batch} context {context} {attention}"
        label += f" {'greedy' if sampling is None else 'sampled'}"
        _progress(f"[{n}/{len(configurations)}] {label} ...")
        start = time.perf_counter()
        # batch rows as ddtree-generate runs them (one ar row runs as two), the CLI's branching rule
        plan = make_plan(
            cfg,
            dcfg,
            method,
            batch_size=batch,
            max_new_tokens=64,
            budget=budget or None,
            attention=attention,
            tp=args.tp,
        )
        try:
            shape = batch_shape(plan, batch, context)
            row = bench_one(
                params,
                dparams,
                plan,
                shape,
                context,
                args.rounds,
                ceiling,
                args.stages,
                sampling,
                batch,
                args.chosen_floor,
            )
        except Exception as e:  # keep the other configurations
            row = {
                "method": method,
                "budget": budget,
                "batch": batch,
                "context": context,
                "attention": attention,
                "sampling": sampling,
                "error": f"{type(e).__name__}: {e}"[:500],
            }
        row["device_memory"] = device_memory()
        rows.append(row)
        save()
        print(json.dumps(row), flush=True)
        result = row["error"][:80] if "error" in row else f"{row['round_ms']:.2f} ms per round"
        _progress(f"[{n}/{len(configurations)}] {label}: {result} ({time.perf_counter() - start:.0f} s)")
    print(
        f"{'method':8}{'N':>5}{'B':>4}{'ctx':>7}{'attn':>10}{'sampling':>16}{'round ms':>10}{'floor ms':>10}"
    )
    for r in rows:
        s = r["sampling"]
        label = "greedy" if s is None else f"{s['temperature']}:{s['top_k']}:{s['top_p']}"
        head = f"{r['method']:8}{r['budget']:5}{r['batch']:4}{r['context']:7}{r['attention']:>10}{label:>16}"
        if "error" in r:
            print(f"{head}  {r['error'][:60]}")
            continue
        stages = " ".join(f"{k}={v:.2f}" for k, v in r["stages_ms"].items())
        if r["device_stages_ms"]:
            stages += "  device loop: " + " ".join(f"{k}={v:.2f}" for k, v in r["device_stages_ms"].items())
        print(f"{head}{r['round_ms']:10.2f}{r['target_floor_ms']:10.2f}  {stages}")
    failed = sum("error" in r for r in rows)
    if failed:
        _progress(f"error: {failed} of {len(rows)} configurations failed (their rows in {args.out} say why)")
        return EXIT_ERROR
    return 0


if __name__ == "__main__":
    sys.exit(main())
