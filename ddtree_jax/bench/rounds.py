"""`ddtree-bench rounds`: round and stage times on random-weight models of real shapes, against the HBM floor.

Random weights give meaningless acceptance, but exactly the cost of a round: every round does the
same work whatever the drafter proposes. The cache is filled with random K/V up to the context
length (no prefill), so long contexts cost no prefill memory.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import statistics
import sys
import time

import jax
import jax.numpy as jnp

from ddtree_jax import compile_cache, drafter, models, target, tree
from ddtree_jax.attention import IMPLEMENTATIONS
from ddtree_jax.bench import report
from ddtree_jax.bench.floor import chosen_expert_floor, record_routing, step_weight_bytes, weight_bytes
from ddtree_jax.bench.programs import device_stage_ms, round_program, synthetic_state
from ddtree_jax.bench.shapes import QUANTIZE, SHAPES, draft_shape
from ddtree_jax.bench.timing import device_memory, read_ceiling_gbs
from ddtree_jax.config import DFlash2Config, DraftConfig, TargetConfig
from ddtree_jax.engine import DecodeState, Plan
from ddtree_jax.errors import DDTreeError
from ddtree_jax.kv_cache import bytes_per_token
from ddtree_jax.models import common, moe
from ddtree_jax.pair import batch_shape, make_plan
from ddtree_jax.programs import Programs, Shape
from ddtree_jax.quant import load as quant_load
from ddtree_jax.sampling import GREEDY
from ddtree_jax.sharding import make_mesh, param_sharding
from ddtree_jax.weights import random_params

METHODS = ("ar", "dflash", "ddtree")
EXIT_ERROR = report.EXIT_ERROR


def parse_sampling(text: str) -> dict | None:
    """'greedy' -> None; 'T:top_k:top_p' -> the settings of every row (seed 0)."""
    if text == "greedy":
        return None
    temperature, top_k, top_p = text.split(":")
    return GREEDY | {"temperature": float(temperature), "top_k": int(top_k), "top_p": float(top_p)}


def bench_one(
    params,
    dparams,
    plan: Plan,
    shape: Shape,
    context: int,
    rounds: int,
    ceiling_gbs: float,
    stages: bool,
    options: dict | None = None,
    batch: int | None = None,
    chosen_floor: bool = True,
) -> dict:
    """Device-loop round time of one configuration; with `stages`, its stages timed host-stepped
    (a sync per stage) and each alone in a device loop. `batch`: the rows requested, when the shape
    runs more (`programs.rows_to_run`); the floor counts only their K/V. `chosen_floor`: for a MoE
    target also the floor of the experts chosen (`chosen_expert_floor`; compiles the round again).
    `options`: every row's sampling settings (None: greedy), the row's "sampling"."""
    batch = batch or shape.rows
    dparams = None if plan.method == "ar" else dparams

    def fresh(seed: int) -> DecodeState:  # callers drop their last state first: at 32k one fills half the GPU
        return synthetic_state(plan, shape, context, seed, params["embed"].dtype, options, batch)

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
        "batch_size": batch,
        "rows": shape.rows,
        "context": context,
        "attention": plan.attention,
        "tp": plan.tp,
        "sampling": options,
        "round_ms": round_ms,
        "stages_ms": stage_ms,
        "host_stepped_round_ms": sum(stage_ms.values()),
        "device_stages_ms": device_ms,
        "target_floor_ms": floor_ms,
        "floor_tokens": tokens,
        "round_over_floor": round_ms / chosen.get("chosen_floor_ms", floor_ms),
        "compile_s": compile_s,
    } | chosen


def build_parser() -> argparse.ArgumentParser:
    """ddtree-bench's flags (their defaults shown by --help)."""
    p = report.parser(
        "rounds",
        __doc__,
        epilog=f"shapes: {', '.join(sorted(SHAPES))} (tiny*, default-pair: CPU-sized; the others: real "
        "widths). "
        f"exit status: 0 every configuration measured (or skipped past --deadline-s); {EXIT_ERROR} a bad "
        "flag or --out (refused before any work), or a configuration that failed (its row in --out holds "
        "the error). Progress goes to stderr.",
    )
    p.add_argument(
        "--shape",
        choices=sorted(SHAPES),
        required=True,
        help="the random-weight target (no default: it decides everything the run measures, and the "
        "real-width ones take many GB)",
    )
    p.add_argument("--num-layers", type=int, help="the target's depth (default: the shape's)")
    p.add_argument(
        "--scan-layers",
        action="store_true",
        help="run the target's decoder stack as one lax.scan over stacked layers (dense shapes only; "
        "default: every layer unrolled)",
    )
    p.add_argument(
        "--unfused-projections",
        action="store_true",
        help="the drafter's layers and a dense target's: q, k, v and gate, up as five weights and matmuls "
        "a layer, as HF stores them (default: fused, one q/k/v and one gate/up matmul a layer)",
    )
    p.add_argument("--draft-layers", type=int, default=5, help="the drafter's depth")
    p.add_argument("--block-size", type=int, default=16, help="the drafter's block (depth = block - 1)")
    p.add_argument(
        "--dflash2",
        action="store_true",
        help="a DFlash2 drafter (the published Qwen3.8-27B-DFlash2's settings: 2 conv taps, groups of 16, "
        "selector rank 256, top-16 candidates, every layer sliding with window 2048, not causal)",
    )
    p.add_argument("--methods", default="ar,dflash,ddtree", help=f"comma list of {', '.join(METHODS)}")
    p.add_argument(
        "--budgets", default="15,63", help="comma list of ddtree budgets (tree nodes besides the root)"
    )
    p.add_argument("--batch-sizes", default="1", help="comma list of batch sizes (rows)")
    report.add_deprecated(p, "--batches", "--batch-sizes")
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
    p.add_argument(
        "--build-variant",
        choices=tree.BUILD_VARIANTS,
        help="the tree build every ddtree round runs (default: the backend's, tree.DEFAULT_BUILD)",
    )
    p.add_argument("--out", required=True, help="the JSON written (rewritten after every configuration)")
    report.add_deadline(p)
    compile_cache.add_flag(p)
    return p


@dataclasses.dataclass(frozen=True)
class Grid:
    """The configurations a run sweeps, parsed and checked from the flags."""

    methods: tuple[str, ...]
    budgets: tuple[int, ...]
    batch_sizes: tuple[int, ...]
    contexts: tuple[int, ...]
    attentions: tuple[str, ...]
    samplings: tuple[dict | None, ...]

    def configurations(self) -> list[tuple]:
        """(attention, batch, context, (method, budget), sampling) in sweep order (budget 0: no tree)."""
        trees = [(m, n) for m in self.methods for n in (self.budgets if m == "ddtree" else [0])]
        grid = (self.attentions, self.batch_sizes, self.contexts, trees, self.samplings)
        return list(itertools.product(*grid))


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
    """Every check of the sweep's flags that needs no device work, before any (one line naming the first
    bad one). Returns the sweep's configurations."""
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
        batch_sizes=_positive_ints("--batch-sizes", args.batch_sizes),
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
    if args.scan_layers:
        models.with_scan_layers(cfg)  # refuses a family that does not scan
        if args.quantize != "none":
            raise DDTreeError("--scan-layers: quantized weights run unrolled only (--quantize none)")
    scheme = type(QUANTIZE.get(args.quantize))
    if args.quantize != "none" and scheme not in models.family(cfg).QUANTIZED_FORMATS:
        fit = sorted(n for n, c in SHAPES.items() if scheme in models.family(c).QUANTIZED_FORMATS)
        raise DDTreeError(
            f"--quantize {args.quantize} needs a shape whose family reads it ({', '.join(fit)})"
        )
    return grid  # (--deadline-s and --out: report.run_subcommand checks them first)


def main(argv: list[str] | None = None) -> int:
    """`ddtree-bench rounds ARGS`: check the flags, sweep the configurations, write one JSON file; the
    exit status."""
    checked = lambda args, command, deadline: run(args, check_args(args), command, deadline)  # noqa: E731
    return report.run_subcommand("rounds", build_parser(), argv, checked)


def run(args: argparse.Namespace, grid: Grid, command: list[str], deadline: report.Deadline) -> int:
    """Make the random-weight models of the checked flags and sweep the grid (`command`: the command
    line the run header records)."""
    compile_cache.enable(args.compile_cache)  # before the first compile
    tree.set_default_build(args.build_variant)  # before any round is traced
    cfg = SHAPES[args.shape]
    if args.num_layers:
        cfg = dataclasses.replace(cfg, num_layers=args.num_layers)
    if args.scan_layers:
        cfg = models.with_scan_layers(cfg)
    family = models.family(cfg)
    if args.unfused_projections:  # the drafter's too (below)
        cfg = family.unfused(cfg)
    if family.ROUTED_EXPERTS:
        cfg = dataclasses.replace(cfg, moe_sharding=args.moe_sharding, moe_dispatch=args.moe_dispatch)
    dcfg = draft_shape(cfg, args.draft_layers, args.block_size)
    if args.dflash2:
        layers = args.draft_layers
        dflash2 = DFlash2Config(
            2, 16, 256, 16, sliding_window=2048, sliding=(True,) * layers, causal=(False,) * layers
        )
        dcfg = dataclasses.replace(dcfg, dflash2=dflash2)
    if args.unfused_projections:
        dcfg = dataclasses.replace(dcfg, fused_projections=False)
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
    # the programs are traced inside _sweep: the ablation holds for every one of them
    with common.without_layer_all_reduce(args.drop_layer_all_reduce):
        return _sweep(args, grid, cfg, dcfg, params, dparams, command, deadline)


def _progress(message: str) -> None:
    """One progress line on stderr."""
    print(f"ddtree-bench: {message}", file=sys.stderr, flush=True)


def _sweep(args, grid: Grid, cfg: TargetConfig, dcfg: DraftConfig, params, dparams, command, deadline) -> int:
    """Time every configuration of the grid, writing the JSON after each; EXIT_ERROR if any failed.
    None starts past the deadline (those are listed under "skipped")."""
    ceiling = read_ceiling_gbs(args.ceiling_bytes)
    print(f"read ceiling {ceiling:.0f} GB/s; target weights {weight_bytes(params) / 1e9:.2f} GB", flush=True)
    meta = report.run_header(command) | {
        "shape": args.shape,
        "tp": args.tp,
        "moe_sharding": getattr(cfg, "moe_sharding", None),
        "moe_dispatch": getattr(cfg, "moe_dispatch", None),
        "devices": [str(d) for d in jax.devices()[: args.tp]],
        "layer_all_reduce": not args.drop_layer_all_reduce,
        "num_layers": cfg.num_layers,
        "scan_layers": cfg.scan_layers,
        "fused_projections": any(s.fuse for s in target.weight_specs(cfg)),
        "draft_fused_projections": dcfg.fused_projections,
        "read_ceiling_gbs": ceiling,
        "target_weight_bytes": weight_bytes(params),
        "draft_weight_bytes": weight_bytes(dparams),
        "quantize": args.quantize,
        "build_variant": tree.default_build(),
        "device_memory": device_memory(),
    }
    rows = []

    def save():  # after every row, so a run cut short keeps what it measured
        report.write_json(args.out, {"meta": meta, "rows": rows, "skipped": deadline.skipped})

    save()
    configurations = grid.configurations()
    for n, (attention, batch, context, (method, budget), sampling) in enumerate(configurations, start=1):
        label = f"{method}{f' {budget}' if budget else ''} batch {batch} context {context} {attention}"
        label += f" {'greedy' if sampling is None else 'sampled'}"
        if not deadline.allows(label):
            continue
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
                "batch_size": batch,
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
    save()  # with what the deadline skipped after the last row
    print(
        f"{'method':8}{'N':>5}{'B':>4}{'ctx':>7}{'attn':>10}{'sampling':>16}{'round ms':>10}{'floor ms':>10}"
    )
    for r in rows:
        s = r["sampling"]
        label = "greedy" if s is None else f"{s['temperature']}:{s['top_k']}:{s['top_p']}"
        head = f"{r['method']:8}{r['budget']:5}{r['batch_size']:4}{r['context']:7}"
        head += f"{r['attention']:>10}{label:>16}"
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
