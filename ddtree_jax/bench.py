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
import platform
import statistics
import sys
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from ddtree_jax import drafter, engine, models, target
from ddtree_jax.config import DraftConfig, RopeConfig, TargetConfig, default_target_layer_ids
from ddtree_jax.engine import ALL, ROW, DecodeState, Plan
from ddtree_jax.kv_cache import KVCache, bytes_per_token
from ddtree_jax.models import common, moe
from ddtree_jax.pair import make_plan
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
    plan: Plan, context: int, seed: int, dtype, sampling: dict | None = None, active: int | None = None
) -> DecodeState:
    """A batch mid-generation: random K/V committed up to `context` in both caches, placed on the
    plan's mesh (K/V heads split over "model", rows over "data"). Rows from `active` on (default: none)
    are padding, as `ddtree-generate` pads: done, with one cached token."""
    key = jax.random.key(seed)
    b, s = plan.batch_size, plan.capacity
    padding = jnp.arange(b) >= (b if active is None else active)

    def cache(shapes) -> KVCache:  # random leaves of the family's entry shapes (global, placed below)
        leaves, tree = jax.tree.flatten(shapes)
        keys = jax.random.split(key, len(leaves))
        made = [_normal(k, x.shape, x.dtype) for k, x in zip(keys, leaves, strict=True)]
        lengths = jnp.where(padding, 1, context).astype(jnp.int32)  # a buffer per cache: both are donated
        return KVCache(jax.tree.unflatten(tree, made), lengths)

    t = plan.target
    state = DecodeState(
        cache=cache(models.family(t).cache_shapes(t, b, s, plan.tp, dtype)),
        draft_cache=None
        if plan.method == "ar"
        else cache(drafter.cache_shapes(plan.draft, b, s, plan.tp, dtype)),
        bonus=jax.random.randint(key, (b,), 0, t.vocab_size, jnp.int32),
        output=jnp.zeros((b, plan.max_new_tokens + plan.path_slots), jnp.int32),
        num_output=jnp.zeros((b,), jnp.int32),
        done=padding,
        stopped=jnp.zeros((b,), bool),
        acceptance=jnp.zeros((b, plan.max_new_tokens), jnp.int32),
        rounds=jnp.zeros((b,), jnp.int32),
        max_new_tokens=jnp.full((b,), plan.max_new_tokens, jnp.int32),
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


def decode_rounds(params, draft_params, state, stop_ids, *, plan: Plan, rounds: int):
    """`rounds` decode rounds in one program (the device loop)."""
    return jax.lax.fori_loop(
        0, rounds, lambda _, s: engine.decode_round(params, draft_params, s, stop_ids, plan), state
    )


def round_program(plan: Plan, rounds: int):
    """`decode_rounds`, jitted on the plan's mesh (the state is donated)."""
    tspec, dspec = engine.param_specs(plan)
    sspec = engine.state_specs(plan)
    return mesh_program(decode_rounds, plan, (tspec, dspec, sspec, ALL), sspec, donate=(2,), rounds=rounds)


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
        lengths = state.draft_cache.lengths + _never(carry)
        passed = dataclasses.replace(
            state, bonus=bonus, draft_cache=dataclasses.replace(state.draft_cache, lengths=lengths)
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


def stage_programs(plan: Plan, rounds: int) -> dict:
    """The device-loop stage timers, jitted on the plan's mesh: name -> program.

    verify(params, state, tree); draft(params, draft_params, state); tree_build(state, logp, tok).
    """
    tspec, dspec = engine.param_specs(plan)
    sspec = engine.state_specs(plan)
    programs = {"verify": mesh_program(verify_passes, plan, (tspec, sspec, ROW), ROW, rounds=rounds)}
    if plan.method != "ar":
        programs["draft"] = mesh_program(draft_passes, plan, (tspec, dspec, sspec), ROW, rounds=rounds)
        programs["tree_build"] = mesh_program(build_passes, plan, (sspec, ROW, ROW), ROW, rounds=rounds)
    return programs


def stage_args(params, dparams, state: DecodeState, plan: Plan) -> dict[str, tuple]:
    """The arguments of each `stage_programs` program: one draft and one tree built from `state`."""
    tspec, dspec = engine.param_specs(plan)
    sspec = engine.state_specs(plan)
    logp = tok = None
    if plan.method != "ar":
        logp, tok = mesh_program(engine.draft, plan, (tspec, dspec, sspec), (ROW, ROW))(
            params, dparams, state
        )
    t = mesh_program(engine.build, plan, (sspec, ROW, ROW), ROW)(state, logp, tok)
    return {"verify": (params, state, t), "draft": (params, dparams, state), "tree_build": (state, logp, tok)}


def device_stage_ms(params, dparams, state: DecodeState, plan: Plan, rounds: int) -> dict[str, float]:
    """Each stage alone in a device loop (no host sync between passes), ms per pass; the caller adds
    walk + commit as what remains of the round (`walk_commit_rest`)."""
    programs = stage_programs(plan, rounds)
    args = stage_args(params, dparams, state, plan)
    return {
        name: 1e3 * median_seconds(lambda p=p, a=args[name]: p(*a), 3) / rounds
        for name, p in programs.items()
    }


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


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


def bench_one(
    params,
    dparams,
    plan: Plan,
    context: int,
    rounds: int,
    ceiling_gbs: float,
    stages: bool,
    sampling=None,
    batch: int | None = None,
) -> dict:
    """Device-loop round time of one configuration; with `stages`, its stages timed host-stepped
    (a sync per stage) and each alone in a device loop. `batch`: the rows requested, when the plan
    runs more (`engine.rows_to_run`); the floor counts only their K/V."""
    batch = batch or plan.batch_size
    dparams = None if plan.method == "ar" else dparams
    stop = jnp.full((8,), -1, jnp.int32)
    if plan.tp * plan.dp > 1:
        stop = jax.device_put(stop, NamedSharding(make_mesh(plan.tp, plan.dp), ALL))

    def fresh(seed: int) -> DecodeState:  # callers drop their last state first: at 32k one fills half the GPU
        return synthetic_state(plan, context, seed, params["embed"].dtype, sampling, batch)

    state = fresh(0)
    start = time.perf_counter()
    compiled = round_program(plan, rounds).lower(params, dparams, state, stop).compile()
    compile_s = time.perf_counter() - start
    times = []
    for _ in range(3):
        state = None
        state = fresh(0)
        jax.block_until_ready(state)
        start = time.perf_counter()
        jax.block_until_ready(compiled(params, dparams, state, stop))
        times.append((time.perf_counter() - start) / rounds)
    round_ms = 1e3 * statistics.median(times)

    stage_ms, device_ms = {}, {}
    if stages:
        stepper = engine.HostStepper(plan)
        state = None
        state = fresh(1)
        for _ in range(rounds + 2):  # round 1 compiles (kept apart), round 2 warms up
            state = stepper.round(params, dparams, state, stop)
        stage_ms = {k: 1e3 * statistics.median(v[1:]) for k, v in stepper.times.items()}
        state = None
        state = fresh(2)
        device_ms = device_stage_ms(params, dparams, state, plan, rounds)
        device_ms["walk_commit_rest"] = round_ms - sum(device_ms.values())

    # one device's K/V: its rows, its share of every layer's cache entry
    t = plan.target
    shapes = models.family(t).cache_shapes(t, plan.batch_size, plan.capacity, plan.tp, params["embed"].dtype)
    kv_bytes = bytes_per_token(shapes, plan.tp) * -(-batch // plan.dp) * context
    tokens = plan.tree_size * -(-batch // plan.dp)  # one device's tokens per round (its live rows')
    floor_ms = 1e3 * (step_weight_bytes(params, plan.target, tokens) + kv_bytes) / (ceiling_gbs * 1e9)
    return {
        "method": plan.method,
        "budget": plan.budget,
        "tree_size": plan.tree_size,
        "batch": batch,
        "rows": plan.batch_size,
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
        "round_over_floor": round_ms / floor_ms,
        "compile_s": compile_s,
    }


def main(argv: list[str] | None = None) -> int:
    """Entry point: sweep the configurations and write one JSON file."""
    p = argparse.ArgumentParser(prog="ddtree-bench", description=__doc__.splitlines()[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-8b")
    p.add_argument("--num-layers", type=int, help="the target's depth (default: the shape's)")
    p.add_argument("--draft-layers", type=int, default=5)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--methods", default="ar,dflash,ddtree")
    p.add_argument("--budgets", default="15,63")
    p.add_argument("--batches", default="1")
    p.add_argument("--contexts", default="1024")
    p.add_argument("--attention", default="reference", help="comma list of reference,pallas")
    p.add_argument("--rounds", type=int, default=16)
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
    p.add_argument("--ceiling-bytes", type=int, default=4 << 30)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    if args.drop_layer_all_reduce and args.tp == 1:
        p.error("--drop-layer-all-reduce needs --tp > 1 (one device has no all-reduce)")

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
    if args.quantize != "none":
        scheme = type(QUANTIZE[args.quantize])
        if scheme not in family.QUANTIZED_FORMATS:
            fit = sorted(n for n, c in SHAPES.items() if scheme in models.family(c).QUANTIZED_FORMATS)
            p.error(f"--quantize {args.quantize} needs a shape whose family reads it ({', '.join(fit)})")
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
        return _sweep(args, cfg, dcfg, params, dparams)
    finally:
        common.psum = psum


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


def _sweep(args, cfg: TargetConfig, dcfg: DraftConfig, params, dparams) -> int:
    """Time every configuration of the grid, writing the JSON after each."""
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

    trees = [(m, n) for m in args.methods.split(",") for n in (_ints(args.budgets) if m == "ddtree" else [0])]
    grid = itertools.product(
        args.attention.split(","), _ints(args.batches), _ints(args.contexts), trees, args.sampling.split(",")
    )
    for attention, batch, context, (method, budget), sampling_arg in grid:
        sampling = parse_sampling(sampling_arg)
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
            prompt_len=context,
        )
        try:
            row = bench_one(
                params, dparams, plan, context, args.rounds, ceiling, args.stages, sampling, batch
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
    return 0


if __name__ == "__main__":
    sys.exit(main())
