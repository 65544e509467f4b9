"""`ddtree-bench profile`: where a round's device time goes, kernel by kernel.

Builds the bench's random-weight model (`ddtree_jax.bench.shapes`), runs the ar step, the ddtree round and
their stages alone (the bench's device loops) under `jax.profiler.trace`, and reads the captured
XSpace with `jax.profiler.ProfileData` (no TensorFlow or TensorBoard). On a GPU the kernels are the
events of the device plane's stream lines; where no device plane holds any (the CPU backend, or a
GPU whose CUPTI tracer did not start) the host plane's XLA op events stand in, each counted for its
self time (a while loop's op encloses its body's ops on the same thread).

Each kernel is put in a category (`categorize`) and in a scope of the model (`scope_of`, from the
op_name metadata of the HLO instruction that launched it: the engine's named scopes, one per step of
the round (engine.STAGES: "draft", "build", "verify", "walk", "commit"), and within a layer
"attention" and "mlp").
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import os
import re
import tempfile
import time
import warnings
from collections import defaultdict
from collections.abc import Callable, Iterable
from typing import Any

import jax
import jax.numpy as jnp

from ddtree_jax import drafter, target, tree
from ddtree_jax.bench import report
from ddtree_jax.bench.floor import weight_bytes
from ddtree_jax.bench.programs import round_program, stage_args, stage_programs, synthetic_state
from ddtree_jax.bench.shapes import SHAPES, draft_shape
from ddtree_jax.bench.timing import device_memory
from ddtree_jax.engine import STAGES
from ddtree_jax.pair import batch_shape, make_plan
from ddtree_jax.weights import random_params

# lines of a device plane that the profiler derives from the kernels (would count them twice)
DERIVED_LINES = {
    "XLA Modules",
    "XLA Ops",
    "Async XLA Ops",
    "Steps",
    "Framework Ops",
    "Framework Name Scope",
    "Source code",
    "CUPTI overhead",
    "XLA TraceMe",
}
COLLECTIVE = re.compile(
    r"nccl|all-reduce|all_reduce|allreduce|all-gather|all_gather|reduce-scatter|"
    r"reduce_scatter|collective-permute|all-to-all|all_to_all",
    re.I,
)
ATTENTION = re.compile(r"attention|sdpa|fmha|flash_", re.I)
GEMM = re.compile(
    r"gemm|gemv|splitk|nvjet|xmma|cutlass|cublas|s16816|matmul|wgmma|(^|[_.\-])dot([_.\-]|$)", re.I
)
SORT = re.compile(r"sort|topk|top_k|top-k|radix", re.I)
COPY = re.compile(r"^memcpy|^memset|(^|_)copy|dynamic[-_]update[-_]slice", re.I)
CONTROL = re.compile(r"^(while|conditional|call)(\.\d+)?$")


@dataclasses.dataclass(frozen=True)
class KernelEvent:
    """One kernel (or host XLA op) execution: its name, the HLO instruction that launched it, and
    its start and self time in ns (self: less any event it encloses on the same line)."""

    name: str
    hlo_op: str
    start_ns: float
    self_ns: float
    end_ns: float


def categorize(name: str, hlo_op: str = "", op_name: str = "") -> str:
    """The category of a kernel: "collective", "attention:<kernel>", "gemm", "sort_topk", "copy",
    "control", "pallas:<kernel>", "fusion" (any other XLA kernel) or "other" (no HLO op known).

    `name` is the kernel's (or host op's) name, `hlo_op` the launching HLO instruction, `op_name`
    that instruction's JAX op_name metadata (its last component is the primitive, e.g. dot_general).
    """
    prim = op_name.rsplit("/", 1)[-1]
    if COLLECTIVE.search(name) or COLLECTIVE.search(hlo_op):
        return "collective"
    if ATTENTION.search(name):
        return f"attention:{_short(name)}"
    if GEMM.search(name) or GEMM.search(hlo_op) or prim in ("dot_general", "ragged_dot_general"):
        return "gemm"
    if SORT.search(name) or SORT.search(hlo_op) or prim in ("sort", "top_k", "approx_top_k"):
        return "sort_topk"
    if COPY.search(name) or COPY.search(hlo_op):
        return "copy"
    if CONTROL.match(hlo_op or name):
        return "control"
    if prim == "pallas_call" or "pallas" in op_name:
        return f"pallas:{_short(name)}"
    return "fusion" if hlo_op else "other"


def _short(name: str) -> str:
    return re.split(r"[(<\s]", name, maxsplit=1)[0][:60]


def scope_of(op_name: str) -> str:
    """Where in a round an op sits, from its op_name: "<stage>/<region>", stage one of STAGES (absent
    in a stage program, which runs one stage alone), region "attention" or "mlp" inside a layer,
    "layer_other" elsewhere in a layer, "outside_layers" (embedding, head, logits, tree, cache) else."""
    parts = op_name.split("/")
    stage = next((p for p in parts if p in STAGES), "")
    if "attention" in parts:
        region = "attention"
    elif "mlp" in parts:
        region = "mlp"
    elif any(re.fullmatch(r"(draft_)?layer\d+", p) for p in parts):
        region = "layer_other"
    else:
        region = "outside_layers"
    return f"{stage}/{region}" if stage else region


_INSTR = re.compile(r"^\s*(ROOT\s+)?%?([^\s=(]+)\s*=")
_OP_NAME = re.compile(r'metadata=\{[^}]*?op_name="([^"]*)"')
_CALLS = re.compile(r"calls=%?([\w.\-]+)")
_DOT = re.compile(r"\s(dot|convolution|ragged-dot)\(")
_COMPUTATION = re.compile(r"^\s*(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")


def hlo_op_names(hlo_text: str) -> dict[str, str]:
    """HLO instruction name -> its op_name metadata, from a module's text (`compiled.as_text()`). A
    fusion that computes a dot takes the dot's op_name (the dot is what its time is spent on), one
    without metadata its called computation's root op_name."""
    names, roots, dots, calls = {}, {}, {}, {}
    computation = ""
    for line in hlo_text.splitlines():
        m = _INSTR.match(line)
        if m is None:
            c = _COMPUTATION.match(line)
            if c:
                computation = c.group(1)
            continue
        name = m.group(2)
        op = _OP_NAME.search(line)
        if op:
            names[name] = op.group(1)
            if m.group(1):
                roots[computation] = op.group(1)
            if _DOT.search(line):
                dots.setdefault(computation, op.group(1))
        called = _CALLS.search(line)
        if called:
            calls[name] = called.group(1)
    for name, computation in calls.items():
        if computation in dots:
            names[name] = dots[computation]
        elif name not in names and computation in roots:
            names[name] = roots[computation]
    return names


def _self_times(events: list[tuple[str, str, float, float]]) -> list[KernelEvent]:
    """(name, hlo_op, start, duration) of one line -> KernelEvents with what each encloses taken off."""
    order = sorted(events, key=lambda e: (e[2], -e[3]))
    selfs = [e[3] for e in order]
    stack: list[int] = []  # indices of open (enclosing) events
    for i, (_, _, start, dur) in enumerate(order):
        while stack and order[stack[-1]][2] + order[stack[-1]][3] <= start:
            stack.pop()
        if stack:
            parent = stack[-1]
            selfs[parent] -= min(start + dur, order[parent][2] + order[parent][3]) - start
        stack.append(i)
    return [
        KernelEvent(name, hlo_op, start, max(s, 0.0), start + dur)
        for (name, hlo_op, start, dur), s in zip(order, selfs, strict=True)
    ]


def device_events(data: Any, device: int = 0) -> tuple[str, list[KernelEvent]]:
    """The kernels of a `jax.profiler.ProfileData`: (plane name, events).

    GPU: the plane "/device:GPU:<device>", its "Stream #" lines (or all lines but the derived ones).
    Else (or when that plane holds no events): the host plane's events that carry an `hlo_op` stat.
    """
    planes = {p.name: p for p in data.planes}
    gpu = planes.get(f"/device:GPU:{device}")
    if gpu is not None:
        lines = list(gpu.lines)
        streams = [ln for ln in lines if ln.name.startswith("Stream #")]
        chosen = streams or [ln for ln in lines if ln.name not in DERIVED_LINES]
        out = []
        for ln in chosen:
            raw = [(e.name, str(_stats(e).get("hlo_op", "")), e.start_ns, e.duration_ns) for e in ln.events]
            out += _self_times(raw)
        if out:
            return gpu.name, out
    host = planes.get("/host:CPU")
    out = []
    for ln in [] if host is None else host.lines:
        raw = []
        for e in ln.events:
            hlo_op = _stats(e).get("hlo_op")
            if hlo_op:
                raw.append((e.name, str(hlo_op), e.start_ns, e.duration_ns))
        out += _self_times(raw)
    return ("/host:CPU" if host is not None else "none"), out


def _stats(event: Any) -> dict:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # the binding's stat type has no __module__
        try:
            return dict(event.stats)
        except Exception:  # a stat the binding cannot convert: the event still counts, without its hlo_op
            return {}


def busy_ns(events: Iterable[KernelEvent]) -> float:
    """Time covered by at least one event (the union of their intervals), ns."""
    total, end = 0.0, -float("inf")
    for e in sorted(events, key=lambda e: e.start_ns):
        if e.end_ns > end:
            total += e.end_ns - max(e.start_ns, end)
            end = e.end_ns
    return total


def summarize(
    events: list[KernelEvent], op_names: dict[str, str], wall_s: float, rounds: int, top: int = 25
) -> dict:
    """Per-round totals of a traced run of `rounds` rounds that took `wall_s` seconds on the host:
    kernel time by category, by scope and category, the `top` (kernel, op) pairs by time, and
    the kernel sum and busy time against the wall (what is left is idle device time)."""
    per = 1e6 * rounds  # ns over all rounds -> ms per round
    cats: dict[str, float] = defaultdict(float)
    scopes: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    ops: dict[tuple[str, str], list] = {}
    # an XLA kernel is named after its HLO instruction ("loop_add_fusion.1" -> "loop_add_fusion_1"): the
    # instruction of a kernel event that carries no hlo_op stat
    by_kernel = {re.sub(r"[.\-]", "_", n): n for n in op_names}
    unattributed = 0.0
    for e in events:
        hlo_op = e.hlo_op or by_kernel.get(e.name, "")
        op_name = op_names.get(hlo_op, "")
        unattributed += 0.0 if op_name else e.self_ns
        cat = categorize(e.name, hlo_op, op_name)
        cats[cat] += e.self_ns
        scopes[scope_of(op_name)][cat] += e.self_ns
        # the same op in every layer is one entry ("layer12" -> "layer*", "fusion_12" -> "fusion")
        key = (re.sub(r"[_.]\d+$", "", e.name), re.sub(r"layer\d+", "layer*", op_name) or hlo_op)
        entry = ops.setdefault(key, [0.0, 0, cat, hlo_op, scope_of(op_name)])
        entry[0] += e.self_ns
        entry[1] += 1
    kernels = sum(cats.values())
    busy = busy_ns(events)
    ranked = sorted(ops.items(), key=lambda kv: -kv[1][0])[:top]
    return {
        "events": len(events),
        "kernels_per_round": len(events) / rounds,
        "us_per_kernel": 1e-3 * kernels / max(len(events), 1),
        "wall_ms_per_round": 1e3 * wall_s / rounds,
        "kernel_ms_per_round": kernels / per,
        "busy_ms_per_round": busy / per,
        "idle_ms_per_round": 1e3 * wall_s / rounds - busy / per,
        "no_op_name_ms_per_round": unattributed / per,  # kernels whose scope is unknown
        "categories_ms_per_round": {k: v / per for k, v in sorted(cats.items(), key=lambda kv: -kv[1])},
        "scopes_ms_per_round": {
            s: {k: v / per for k, v in sorted(c.items(), key=lambda kv: -kv[1])}
            for s, c in sorted(scopes.items(), key=lambda kv: -sum(kv[1].values()))
        },
        "top_kernels": [
            {
                "name": name[:200],
                "op_name": op,  # layer numbers replaced by "*" (the HLO op's name where none is known)
                "hlo_op_example": hlo_op,
                "category": cat,
                "scope": scope,
                "calls_per_round": n / rounds,
                "ms_per_round": t / per,
                "us_per_call": t / n / 1e3,
            }
            for (name, op), (t, n, cat, hlo_op, scope) in ranked
        ],
    }


def read_trace(logdir: str) -> Any:
    """The `ProfileData` of the newest XSpace file under a `jax.profiler.trace` log directory."""
    files = sorted(glob.glob(f"{logdir}/**/*.xplane.pb", recursive=True))
    if not files:
        raise FileNotFoundError(f"no .xplane.pb under {logdir}")
    return jax.profiler.ProfileData.from_file(files[-1])


def trace_calls(step: Callable[[], Any], calls: int, logdir: str) -> tuple[Any, float]:
    """`calls` synced calls of step() under the profiler: (ProfileData, host wall seconds of all)."""
    options = jax.profiler.ProfileOptions()
    options.python_tracer_level = 0  # Python frames are not wanted and cost host time
    with jax.profiler.trace(logdir, profiler_options=options):
        start = time.perf_counter()
        for _ in range(calls):
            jax.block_until_ready(step())
        wall = time.perf_counter() - start
    return read_trace(logdir), wall


def profile(
    step: Callable[[], Any], hlo_text: str, rounds: int, calls: int, keep: str | None = None, device: int = 0
) -> dict:
    """Time `calls` warm calls of step() (each `rounds` rounds) untraced, then trace as many and
    summarize their kernels (`summarize`); `keep`: a directory to leave the trace in."""
    jax.block_until_ready(step())  # warm
    start = time.perf_counter()
    for _ in range(calls):
        jax.block_until_ready(step())
    untraced = time.perf_counter() - start
    with tempfile.TemporaryDirectory() as tmp:
        data, wall = trace_calls(step, calls, keep or tmp)
        plane, events = device_events(data, device)
    out = {"plane": plane, "untraced_wall_ms_per_round": 1e3 * untraced / (calls * rounds)}
    return out | summarize(events, hlo_op_names(hlo_text), wall, calls * rounds)


def profile_plan(
    params, dparams, plan, shape, context: int, args, deadline: report.Deadline | None = None
) -> list[dict]:
    """Profile the stage programs of one plan (`args.programs`), then its round (the state donated,
    each call's output state the next one's input); none starts past the deadline."""
    deadline = deadline or report.Deadline(None)
    rows = []
    state = synthetic_state(plan, shape, context, 0, params["embed"].dtype, None, args.batch_size)
    label = plan.method if plan.method == "ar" else f"{plan.method}{plan.budget}"
    wanted = args.programs.split(",")
    # the stages alone (ar has no draft or build), their programs and inputs made for the first one run
    stage_names = [n for n in wanted if n != "round" and (plan.method != "ar" or n not in ("draft", "build"))]
    programs = stage_inputs = None
    for name in stage_names:
        if not deadline.allows(f"{label}_{name}"):
            continue
        if programs is None:
            programs = stage_programs(plan, args.rounds)
            stage_inputs = stage_args(params, dparams, state, plan)
        start = time.perf_counter()
        compiled = programs[name].lower(*stage_inputs[name]).compile()
        compile_s = time.perf_counter() - start
        a = stage_inputs[name]
        keep = args.keep_trace and f"{args.keep_trace}/{label}_{name}"
        result = profile(lambda c=compiled, a=a: c(*a), compiled.as_text(), args.rounds, args.iters, keep)
        rows.append(_row(label, name, plan, shape, context, args, compile_s) | result)
        print(_line(rows[-1]), flush=True)
    stage_inputs = None
    if "round" in wanted and deadline.allows(f"{label}_round"):
        start = time.perf_counter()
        compiled = round_program(plan, args.rounds).lower(params, dparams, state).compile()
        compile_s = time.perf_counter() - start
        box = [state]
        state = None

        def step():
            box[0] = compiled(params, dparams, box[0])
            return box[0]

        keep = args.keep_trace and f"{args.keep_trace}/{label}_round"
        result = profile(step, compiled.as_text(), args.rounds, args.iters, keep)
        rows.append(_row(label, "round", plan, shape, context, args, compile_s) | result)
        print(_line(rows[-1]), flush=True)
    return rows


def _row(label: str, program: str, plan, shape, context: int, args, compile_s: float) -> dict:
    return {
        "name": f"{label}_{program}",
        "method": plan.method,
        "budget": plan.budget,
        "tree_size": plan.tree_size,
        "program": program,
        "batch_size": args.batch_size,
        "rows": shape.rows,
        "context": context,
        "attention": plan.attention,
        "rounds_per_call": args.rounds,
        "calls": args.iters,
        "compile_s": compile_s,
    }


def _line(r: dict) -> str:
    cats = " ".join(f"{k}={v:.3f}" for k, v in list(r["categories_ms_per_round"].items())[:6])
    return (
        f"{r['name']:>16} B{r['batch_size']} S{r['context']}: wall {r['untraced_wall_ms_per_round']:.3f} ms "
        f"(traced {r['wall_ms_per_round']:.3f}), kernels {r['kernel_ms_per_round']:.3f}, "
        f"busy {r['busy_ms_per_round']:.3f}, idle {r['idle_ms_per_round']:.3f} | {cats}"
    )


def build_parser() -> argparse.ArgumentParser:
    """ddtree-bench profile's flags (their defaults shown by --help)."""
    p = report.parser("profile", __doc__)
    p.add_argument(
        "--shape", choices=sorted(SHAPES), default="qwen3-8b", help="the target's shape (random weights)"
    )
    p.add_argument("--num-layers", type=int, help="the target's depth (default: the shape's)")
    p.add_argument("--draft-layers", type=int, default=5, help="the drafter's decoder layers")
    p.add_argument("--block-size", type=int, default=16, help="the drafter's block (depth = block - 1)")
    p.add_argument("--batch-size", type=int, default=1, help="rows of the profiled state")
    p.add_argument("--context", type=int, default=1024, help="tokens cached in each row")
    p.add_argument("--methods", default="ar,ddtree", help="comma list of ar,dflash,ddtree")
    p.add_argument("--budgets", default="63", help="comma list of ddtree budgets")
    p.add_argument("--attention", default="pallas", help="reference or pallas (or pallas-invariant)")
    p.add_argument(
        "--programs",
        default="verify,round",
        help="comma list of round,draft,build,verify,walk (stages alone)",
    )
    p.add_argument("--rounds", type=int, default=4, help="rounds (stage passes) per call: the device loop")
    p.add_argument("--iters", type=int, default=3, help="traced calls (after one warm and as many untraced)")
    p.add_argument(
        "--max-new-tokens", type=int, default=256, help="the plan's (the round program's calls chain)"
    )
    p.add_argument(
        "--build-variant",
        choices=tree.BUILD_VARIANTS,
        help="the tree build every ddtree round runs (default: the backend's, tree.DEFAULT_BUILD)",
    )
    p.add_argument("--keep-trace", help="a directory to keep the XSpace traces in (default: a temporary one)")
    p.add_argument("--out", required=True, help="the JSON written (rewritten after every plan)")
    report.add_deadline(p)
    return p


def main(argv: list[str] | None = None) -> int:
    """`ddtree-bench profile ARGS`: profile ar and ddtree programs of one shape, batch and context;
    write one JSON; the exit status."""
    return report.run_subcommand("profile", build_parser(), argv, run)


def run(args: argparse.Namespace, command: list[str], deadline: report.Deadline) -> int:
    """Make the random-weight models and profile every plan, writing the JSON after each."""
    cfg = SHAPES[args.shape]
    if args.num_layers:
        cfg = dataclasses.replace(cfg, num_layers=args.num_layers)
    dcfg = draft_shape(cfg, args.draft_layers, args.block_size)
    tree.set_default_build(args.build_variant)  # before any round is traced
    start = time.perf_counter()
    params = random_params(target.weight_specs(cfg), 0, jnp.bfloat16)
    dparams = random_params(drafter.weight_specs(dcfg), 1, jnp.bfloat16)
    jax.block_until_ready((params, dparams))
    meta = report.run_header(command) | {
        "shape": args.shape,
        "num_layers": cfg.num_layers,
        "init_s": time.perf_counter() - start,
        "target_weight_bytes": weight_bytes(params),
        "draft_weight_bytes": weight_bytes(dparams),
        "build_variant": tree.default_build(),
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
    }
    rows: list[dict] = []
    budgets = [int(b) for b in args.budgets.split(",")]
    plans = [(m, b) for m in args.methods.split(",") for b in (budgets if m == "ddtree" else [0])]
    for method, budget in plans:
        plan = make_plan(
            cfg,
            dcfg,
            method,
            batch_size=args.batch_size,
            max_new_tokens=args.max_new_tokens,
            budget=budget or None,
            attention=args.attention,
        )
        try:
            shape = batch_shape(plan, args.batch_size, args.context)
            dp = None if method == "ar" else dparams
            rows += profile_plan(params, dp, plan, shape, args.context, args, deadline)
        except Exception as e:  # keep the other plans' rows
            rows.append({"method": method, "budget": budget, "error": f"{type(e).__name__}: {e}"[:500]})
            print(rows[-1], flush=True)
        meta["device_memory"] = device_memory()
        report.write_json(args.out, {"meta": meta, "rows": rows, "skipped": deadline.skipped})
    return 0
