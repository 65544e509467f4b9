"""The fused expert kernel on one GPU in one command (issue 33): checked against its references, the
MoE dispatches timed against the floor of the experts chosen, and MoE rounds with the new dispatch.

    ddtree-bench moe-fused --out-dir $OUT --deadline-s 420
    ddtree-bench moe-fused --print results/h200/2026-12-02/moe-fused      # a recorded run's tables

Each phase runs in a process of its own under its share of --deadline-s (a kernel that hangs or a case
that does not fit costs that phase only; device memory is freed between phases) and writes its JSON
($OUT/<phase>.json: the run header under "meta", "rows", "skipped") after every case; a phase starts
no case past its share, and is killed --grace-s after it. When `check` finds the fused kernel wrong on
bf16 or fails to run it, the later phases run without it (--no-fused: the rule's dispatch without
`fused`, forced; dispatch `fused` left out). $OUT/summary.json lists the phases. A second call with
--skip-done <the first call's out dir> measures only what the first one left.

Phases, in order (--phases picks some; share of the deadline in brackets):
  check           [0.12] kernels.fused_experts against fused_experts_reference (bf16, as the model runs
                  it) and a float32 reference; Qwen3-30B-A3B's layer (128 experts, hidden 2048, width
                  768, top-8) in bf16 at 1 / 8 / 64 / 128 tokens, FP8 and INT4 at 1 / 64; Kimi-K2's (384
                  experts, hidden 7168, width 2048) in INT4 at 1 / 16 and bf16 at 1
  qwen3-dispatch  [0.16] ms a layer of a stack of 4 Qwen3-30B-A3B expert layers at 1-128 tokens: fused,
                  gather (up to 16 tokens), grouped (the Triton kernel), sorted (ragged_dot; 1, 16, 128)
  qwen3-rounds    [0.28] ddtree-bench rows of the Qwen3-30B-A3B shape (bf16, Pallas attention, 1k
                  context): ar and ddtree 7 at batch 1, ar at 16, ddtree 7 at 16, ddtree 3 / 15 at 1 and
                  16, then the old one-token dispatch (gather) for ar at batch 1; each with the floor of
                  the experts chosen
  kimi-dispatch   [0.08] 2 Kimi-K2 MoE layers, INT4 (1-128 tokens) then bf16 (1, 16, 128)
  kimi2-rounds    [0.18] Kimi-K2 shape cut to 2 layers (--num-layers 2, 6 draft layers, blocks of 8):
                  ar and ddtree 15 at batch 1 and 16
  kimi4-rounds    [0.18] the same at 4 layers (108 GB of bf16 target weights)

--tiny runs every phase on the CPU at toy sizes (kernels interpreted): a check that the command runs.
(Formerly scripts/bench_moe_fused.py: its files, "cases" for "rows" and "batch" for "batch_size",
print the same.)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from ddtree_jax.bench import report
from ddtree_jax.errors import DDTreeError

PHASES = {  # name -> share of the deadline (about what its first cases need on the H200, estimated)
    "check": 0.12,
    "qwen3-dispatch": 0.16,
    "qwen3-rounds": 0.28,
    "kimi-dispatch": 0.08,
    "kimi2-rounds": 0.18,
    "kimi4-rounds": 0.18,
}
LAYERS = {  # expert layer shapes: experts, hidden, width, experts per token
    "qwen3": (128, 2048, 768, 8),
    "kimi": (384, 7168, 2048, 8),
}
TINY_LAYERS = {"qwen3": (4, 128, 128, 2), "kimi": (8, 128, 128, 2)}
CHECK_CASES = [  # (layer, format, tokens), in order
    ("qwen3", "bf16", 1),
    ("qwen3", "int4", 1),
    ("qwen3", "fp8", 1),
    ("qwen3", "bf16", 64),
    ("kimi", "int4", 1),
    ("qwen3", "bf16", 8),
    ("qwen3", "bf16", 128),
    ("qwen3", "int4", 64),
    ("qwen3", "fp8", 64),
    ("kimi", "int4", 16),
    ("kimi", "bf16", 1),
]
ROUNDS = {  # phase -> (shape, layers or None, draft layers, block size, [(method, budget, batch, dispatch)])
    "qwen3-rounds": (
        "qwen3-30b-a3b",
        None,
        5,
        16,
        [("ar", 0, 1, None), ("ddtree", 7, 1, None), ("ar", 0, 16, None), ("ddtree", 7, 16, None)]
        + [("ddtree", 3, 1, None), ("ddtree", 15, 1, None), ("ddtree", 3, 16, None), ("ddtree", 15, 16, None)]
        + [("ar", 0, 1, "gather")],
    ),
    "kimi2-rounds": (
        "kimi-k2",
        2,
        6,
        8,
        [("ar", 0, 1, None), ("ddtree", 15, 1, None), ("ar", 0, 16, None), ("ddtree", 15, 16, None)],
    ),
    "kimi4-rounds": (
        "kimi-k2",
        4,
        6,
        8,
        [("ar", 0, 1, None), ("ddtree", 15, 1, None), ("ar", 0, 16, None), ("ddtree", 15, 16, None)],
    ),
}
TINY_ROUNDS = {
    "qwen3-rounds": ("tiny-moe", None),
    "kimi2-rounds": ("tiny-mla", 2),
    "kimi4-rounds": ("tiny-mla", 3),
}


# ---- the parent: phases in processes of their own ----------------------------------------------------


def orchestrate(args: argparse.Namespace, command: list[str]) -> int:
    """Run the phases one after another, each under its share of the deadline (none: no limit); write
    summary.json."""
    start, share, summary, no_fused = time.monotonic(), 0.0, [], args.no_fused
    total = math.inf if args.deadline_s is None else args.deadline_s
    for name in args.phases:
        share += PHASES[name] / sum(PHASES[p] for p in args.phases)
        left = start + share * total - time.monotonic()
        entry = {"phase": name, "limit_s": round(left, 1) if math.isfinite(left) else None}
        if left < args.min_phase_s:
            entry["status"] = f"skipped: {left:.0f} s left of its share"
        else:
            entry |= run_phase(args, name, left, no_fused)
        if name == "check" and not no_fused and "seconds" in entry:
            no_fused = entry["fused_wrong"] = fused_is_wrong(args.out_dir / "check.json", args.skip_done)
        summary.append(entry)
        print(json.dumps(entry), flush=True)
        report.write_json(args.out_dir / "summary.json", {"argv": command, "phases": summary})
    print_tables(args.out_dir, args.phases)
    return 0


def run_phase(args: argparse.Namespace, name: str, left: float, no_fused: bool) -> dict:
    """One phase in a child process (`ddtree-bench moe-fused --phase NAME`), stopped from starting cases
    after `left` seconds (inf: no limit) and killed --grace-s later; its output in $OUT/<phase>.log."""
    cmd = [sys.executable, "-m", "ddtree_jax.bench", "moe-fused", "--phase", name]
    cmd += ["--out-dir", str(args.out_dir)]
    cmd += ["--deadline-s", f"{max(left, 1):.0f}"] if math.isfinite(left) else []
    cmd += ["--tiny"] * args.tiny + ["--no-fused"] * no_fused
    cmd += ["--skip-done", str(args.skip_done)] if args.skip_done else []
    package_root = str(Path(__file__).resolve().parents[2])  # the child imports this same package
    env = os.environ | {"PYTHONUNBUFFERED": "1"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
    env.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")  # Kimi-K2 at 4 layers needs 115 GB
    timeout = left + args.grace_s if math.isfinite(left) else None
    t0 = time.monotonic()
    with open(args.out_dir / f"{name}.log", "w") as log:
        try:
            done = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, timeout=timeout)
            status = "done" if done.returncode == 0 else f"exit {done.returncode}"
        except subprocess.TimeoutExpired:
            status = f"killed after {timeout:.0f} s"
    return {"status": status, "seconds": round(time.monotonic() - t0, 1)}


def fused_is_wrong(path: Path, earlier: Path | None = None) -> bool:
    """Whether the check (at `path`, with the --skip-done run's in `earlier`) found a bf16 case wrong,
    or ran none (the rounds and dispatches are bf16)."""
    if not path.exists():
        return True
    cases = read_rows(path) + done_cases(earlier / "check.json" if earlier else None)
    ran = [c for c in cases if c.get("format") == "bf16" and "skipped" not in c]
    return not ran or not all(c.get("ok") for c in ran)


# ---- the children: one phase each ----------------------------------------------------------------


def read_rows(path: Path) -> list[dict]:
    """The rows of a phase's JSON; files of scripts/bench_moe_fused.py ("cases", skipped cases among
    them, "batch") read as this command's ("rows", "batch_size")."""
    data = json.loads(path.read_text())
    rows = data["rows"] if "rows" in data else data["cases"]
    return [{("batch_size" if k == "batch" else k): v for k, v in r.items()} for r in rows]


class Phase:
    """A phase's JSON (meta, rows, skipped), rewritten after every case, and its deadline."""

    def __init__(self, args: argparse.Namespace, name: str) -> None:
        from ddtree_jax.models import moe

        self.path = args.out_dir / f"{name}.json"
        self.deadline = report.Deadline(args.deadline_s, prog="ddtree-bench moe-fused")
        self.done = done_cases(args.skip_done / f"{name}.json" if args.skip_done else None)
        self.rows: list[dict] = []
        self.meta = report.run_header(args.command) | {"phase": name, "tiny": args.tiny}
        self.meta |= {
            "no_fused": args.no_fused,
            "hopper": moe.hopper(),
            "fused_max_tokens": moe.FUSED_MAX_TOKENS,
        }
        self.write()

    def time_left(self) -> float:
        """Seconds until the phase's deadline (inf without one)."""
        return self.deadline.left()

    def add(self, case: dict) -> None:
        """A case's row (measured, or its error), or a skipped case (its label and why), written."""
        (self.deadline.skipped if "skipped" in case else self.rows).append(case)
        print(json.dumps(case), flush=True)
        self.write()

    def write(self) -> None:
        """The phase's JSON as it stands."""
        data = {"meta": self.meta, "rows": self.rows, "skipped": self.deadline.skipped}
        report.write_json(self.path, data)


def done_cases(path: Path | None) -> list[dict]:
    """The rows an earlier run of a phase measured (its JSON at `path`), if any."""
    if path is None or not path.exists():
        return []
    return [c for c in read_rows(path) if "skipped" not in c and "error" not in c]


def run_cases(phase: Phase, cases: list[tuple[dict, Callable[[], dict]]]) -> None:
    """Each (label, run) in order: run() -> fields, or the error; none starts past the deadline, nor
    one that the --skip-done run measured."""
    done = phase.done
    for label, run in cases:
        if any(all(c.get(k) == v for k, v in label.items()) for c in done):
            phase.add(label | {"skipped": "measured in the --skip-done run"})
            continue
        if phase.time_left() <= 0:
            phase.add(label | {"skipped": "deadline"})
            continue
        try:
            phase.add(label | run())
        except Exception as e:  # noqa: BLE001 - keep the other cases (a kernel that does not compile, memory)
            phase.add(label | {"error": f"{type(e).__name__}: {e}"[:600]})


def expert_layer(layer: str, fmt: str, seed: int, tiny: bool) -> dict:
    """Random router and experts of one layer in a published form (bf16, FP8 128-blocks, INT4 group 32)."""
    import jax.numpy as jnp

    from ddtree_jax.models import moe
    from ddtree_jax.quant import load as quant_load
    from ddtree_jax.quant.formats import Fp8Block, Int4Group
    from ddtree_jax.sharding import make_mesh, param_sharding

    experts, hidden, width, _ = (TINY_LAYERS if tiny else LAYERS)[layer]
    specs = moe.expert_specs("model.layers.0.", ("layers", 0), hidden, width, experts, "ep")
    scheme = {"bf16": None, "fp8": Fp8Block((128, 128)), "int4": Int4Group(32)}[fmt]
    params = quant_load.random_params(specs, scheme, seed, jnp.bfloat16, param_sharding(make_mesh(1)))
    return params["layers"][0]


def gpu_name(dispatch: str, tiny: bool) -> str:
    """The dispatch as run here: the Pallas ones interpreted on the CPU (--tiny)."""
    return f"{dispatch}_interpret" if tiny and dispatch in ("fused", "grouped") else dispatch


def check_phase(args) -> None:
    """(a): the two kernels on the GPU against the bf16 jnp reference and a float32 one."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from ddtree_jax.kernels import fused_experts as fe
    from ddtree_jax.models import moe
    from ddtree_jax.quant.arrays import expert_weight

    phase = Phase(args, "check")

    def run(layer: str, fmt: str, tokens: int):
        def case() -> dict:
            p = expert_layer(layer, fmt, 0, args.tiny)
            experts_per_token = (TINY_LAYERS if args.tiny else LAYERS)[layer][3]
            x = jax.random.normal(jax.random.key(tokens), (tokens, p["router"].shape[0]), jnp.bfloat16)
            routing = moe.route(p["router"], x, experts_per_token, True)
            here = jnp.ones(routing.experts.shape, bool)
            w = [expert_weight(p[n]) for n in moe.EXPERT_WEIGHTS]
            fused = jax.jit(lambda *a: fe.fused_experts(*a, interpret=args.tiny))
            got = np.asarray(fused(x, routing.experts, here, routing.weights, *w), np.float32)
            ref = np.asarray(
                jax.jit(fe.fused_experts_reference)(x, routing.experts, here, routing.weights, *w), np.float32
            )
            f32 = x.astype(jnp.float32), routing.weights.astype(jnp.float32)
            exact = np.asarray(jax.jit(fe.fused_experts_reference)(f32[0], routing.experts, here, f32[1], *w))
            scale = float(np.abs(exact).max())
            err, ref_err = float(np.abs(got - exact).max()) / scale, float(np.abs(ref - exact).max()) / scale
            ok = bool(np.isfinite(got).all() and err <= max(2 * ref_err, 1e-2))
            return {"max_abs": scale, "fused_rel_err": err, "reference_rel_err": ref_err, "ok": ok}

        return case

    cases = CHECK_CASES[:5] if args.tiny else CHECK_CASES  # interpreted: a few
    run_cases(phase, [({"layer": lay, "format": f, "tokens": n}, run(lay, f, n)) for lay, f, n in cases])


def dispatch_phase(args, name: str) -> None:
    """(b): ms a layer of each dispatch at each token count against the floor of the experts chosen
    (bench.moe.stack: each layer its own weights, feeding the next)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from ddtree_jax.bench.moe import stack  # each layer its own weights, feeding the next
    from ddtree_jax.bench.timing import median_seconds, read_ceiling_gbs
    from ddtree_jax.models import moe
    from ddtree_jax.quant import arrays

    phase = Phase(args, name)
    ceiling = read_ceiling_gbs(1 << 20 if args.tiny else 4 << 30)
    phase.meta["read_ceiling_gbs"] = ceiling
    fused = [] if args.no_fused else ["fused"]
    if name == "qwen3-dispatch":
        plan = [("qwen3", "bf16", 4, [1, 8, 16, 64, 128, 2, 4, 32], [*fused, "gather", "grouped"], 16)]
        plan.append(("qwen3", "bf16", 4, [1, 16, 128], ["sorted"], 16))
    else:
        plan = [("kimi", "int4", 2, [1, 16, 128, 4, 64], [*fused, "gather", "grouped"], 4)]
        plan.append(("kimi", "bf16", 2, [1, 16, 128], [*fused, "gather", "grouped"], 1))
    made = {}

    def layers(layer: str, fmt: str, count: int) -> list[dict]:
        if (layer, fmt) not in made:
            made.clear()  # one stack in memory at a time (Kimi bf16: 34 GB a layer)
            made[layer, fmt] = [expert_layer(layer, fmt, seed, args.tiny) for seed in range(count)]
        return made[layer, fmt]

    def run(layer: str, fmt: str, count: int, tokens: int, dispatch: str):
        def case() -> dict:
            ls = layers(layer, fmt, count)
            experts_per_token = (TINY_LAYERS if args.tiny else LAYERS)[layer][3]
            x = jax.random.normal(jax.random.key(tokens), (tokens, ls[0]["router"].shape[0]), jnp.bfloat16)
            fn = jax.jit(lambda w, x: stack(w, x, experts_per_token, gpu_name(dispatch, args.tiny)))
            t0 = time.monotonic()
            _, chosen = jax.block_until_ready(fn(ls, x))
            compile_s = time.monotonic() - t0
            layer_ms = 1e3 * median_seconds(lambda: fn(ls, x), 2 if args.tiny else 5) / count
            expert_bytes = sum(arrays.stored_bytes(ls[0][n]) for n in moe.EXPERT_WEIGHTS) / moe.num_experts(
                ls[0]["experts_gate"]
            )
            distinct = float(np.mean([np.unique(c).size for c in np.asarray(chosen)]))
            floor_ms = 1e3 * distinct * expert_bytes / (ceiling * 1e9)
            return {
                "layer_ms": layer_ms,
                "floor_ms": floor_ms,
                "over_floor": layer_ms / floor_ms,
                "distinct_experts": distinct,
                "compile_s": compile_s,
            }

        return case

    cases = []
    for layer, fmt, count, tokens_list, dispatches, gather_max in plan:
        if args.tiny:  # interpreted kernels: one layer, two token counts
            count, tokens_list = 1, tokens_list[:2]
        for tokens in tokens_list:
            for dispatch in dispatches:
                if dispatch == "gather" and tokens > gather_max:
                    continue
                label = {
                    "layer": layer,
                    "format": fmt,
                    "layers": count,
                    "tokens": tokens,
                    "dispatch": dispatch,
                }
                cases.append((label, run(layer, fmt, count, tokens, dispatch)))
    run_cases(phase, cases)


def rounds_phase(args, name: str) -> None:
    """(c): ddtree-bench rows (bench.rounds.bench_one, with the floor of the experts chosen), in process."""
    import jax.numpy as jnp

    from ddtree_jax import drafter, target
    from ddtree_jax.bench.floor import weight_bytes
    from ddtree_jax.bench.rounds import bench_one
    from ddtree_jax.bench.shapes import SHAPES, draft_shape
    from ddtree_jax.bench.timing import read_ceiling_gbs
    from ddtree_jax.models import moe
    from ddtree_jax.pair import batch_shape, make_plan
    from ddtree_jax.weights import random_params

    phase = Phase(args, name)
    shape, num_layers, draft_layers, block_size, rows = ROUNDS[name]
    context, rounds, attention = 1024, 8, "pallas"
    if args.tiny:
        shape, num_layers = TINY_ROUNDS[name]
        draft_layers, block_size, context, rounds, attention = 1, 4, 32, 2, "reference"
        rows = [r for r in rows if r[1] in (0, 3, 15)][:3]
    labels = [{"method": m, "budget": b, "batch_size": n, "forced_dispatch": d} for m, b, n, d in rows]
    if all(any(all(c.get(k) == v for k, v in label.items()) for c in phase.done) for label in labels):
        run_cases(phase, [(label, dict) for label in labels])  # all measured before: no weights to make
        return
    cfg = SHAPES[shape]
    cfg = dataclasses.replace(cfg, num_layers=num_layers) if num_layers else cfg
    dcfg = draft_shape(cfg, draft_layers, block_size)
    params = random_params(target.weight_specs(cfg), 0, jnp.bfloat16)
    dparams = random_params(drafter.weight_specs(dcfg), 1, jnp.bfloat16)
    ceiling = read_ceiling_gbs(1 << 20 if args.tiny else 4 << 30)
    phase.meta |= {"shape": shape, "num_layers": cfg.num_layers, "read_ceiling_gbs": ceiling}
    phase.meta |= {
        "target_weight_bytes": weight_bytes(params),
        "draft_weight_bytes": weight_bytes(dparams),
    }

    def run(method: str, budget: int, batch: int, dispatch: str | None):
        def plan_of(target_cfg):
            return make_plan(
                target_cfg,
                dcfg,
                method,
                batch_size=batch,
                max_new_tokens=64,
                budget=budget or None,
                attention=attention,
            )

        def case() -> dict:
            shape = batch_shape(plan_of(cfg), batch, context)
            tokens = plan_of(cfg).tree_size * shape.rows
            # --no-fused: the rule's dispatch for the verify's tokens without the fused kernel, forced
            forced = dispatch or (moe.choose_dispatch(tokens, fused=False) if args.no_fused else None)
            plan = plan_of(dataclasses.replace(cfg, moe_dispatch=forced))
            row = bench_one(params, dparams, plan, shape, context, rounds, ceiling, False, None, batch)
            return row | {"verify_tokens": tokens, "dispatch": forced or moe.choose_dispatch(tokens)}

        return case

    run_cases(phase, [(label, run(*row)) for label, row in zip(labels, rows, strict=True)])


# ---- the tables ---------------------------------------------------------------------------------


def print_tables(out_dir: Path, phases: list[str]) -> None:
    """One line per case of every phase that wrote its JSON."""
    for name in phases:
        path = out_dir / f"{name}.json"
        if not path.exists():
            continue
        print(f"== {name}")
        data = json.loads(path.read_text())
        for c in read_rows(path) + [dict(s) for s in data.get("skipped", [])]:
            if "error" in c or "skipped" in c:
                print("  ", {k: v for k, v in c.items() if not isinstance(v, dict)})
            elif name == "check":
                errors = f"fused {c['fused_rel_err']:.2e}  bf16 reference {c['reference_rel_err']:.2e}"
                print(f"   {c['layer']:6}{c['format']:>5}{c['tokens']:5}  {errors}  ok {c['ok']}")
            elif name.endswith("dispatch"):
                head = f"{c['layer']:6}{c['format']:>5}{c['tokens']:5}{c['dispatch']:>9}"
                print(f"   {head}{c['layer_ms']:9.3f} ms {c['over_floor']:6.2f}x floor")
            else:
                head = f"{c['method']:7}{c['budget']:4}{c['batch_size']:4} {c['dispatch']:>8}"
                floor = c.get("chosen_floor_ms", c["target_floor_ms"])
                print(f"   {head}{c['round_ms']:9.2f} ms {floor:7.2f} ms floor {c['round_over_floor']:5.2f}x")


def main(argv: list[str] | None = None) -> int:
    """`ddtree-bench moe-fused`; the exit status."""
    ap = report.parser("moe-fused", __doc__)
    ap.add_argument(
        "--out-dir", type=Path, help="where the JSON of each phase goes (required unless --print)"
    )
    ap.add_argument("--print", dest="print_dir", type=Path, help="only print the tables of a run's out dir")
    report.add_deadline(ap)  # for all phases together (a child's --phase: its own share)
    ap.add_argument("--grace-s", type=float, default=60.0, help="a phase is killed this long after its share")
    ap.add_argument("--min-phase-s", type=float, default=15.0, help="a phase with less time left is skipped")
    ap.add_argument("--phases", default=",".join(PHASES), help=f"comma list of {', '.join(PHASES)}")
    ap.add_argument("--phase", choices=list(PHASES), help=argparse.SUPPRESS)  # a child's one phase
    ap.add_argument(
        "--no-fused",
        action="store_true",
        help="leave the fused kernel out (the rule's dispatch without it, forced)",
    )
    ap.add_argument("--tiny", action="store_true", help="toy sizes on the CPU, kernels interpreted")
    ap.add_argument(
        "--skip-done",
        type=Path,
        help="the --out-dir of an earlier run: its measured cases are skipped (a second call completes it)",
    )
    ap.set_defaults(out=None)  # run_subcommand's --out check: the phases write under --out-dir
    return report.run_subcommand("moe-fused", ap, argv, run)


def run(args: argparse.Namespace, command: list[str], deadline: report.Deadline) -> int:
    """--print's tables; else every phase in a child process (the parent), or one phase (a child)."""
    args.phases = args.phases.split(",")
    unknown = [p for p in args.phases if p not in PHASES]
    if unknown:
        raise DDTreeError(f"--phases: unknown {unknown}; choose from {list(PHASES)}")
    if args.print_dir is not None:
        if not args.print_dir.is_dir():
            raise DDTreeError(f"--print {args.print_dir}: not a directory")
        print_tables(args.print_dir, list(PHASES))
        return 0
    if args.out_dir is None:
        raise DDTreeError("--out-dir is required (or --print DIR)")
    try:
        args.out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise DDTreeError(f"--out-dir {args.out_dir}: {e.strerror}") from e
    report.check_out_path(str(args.out_dir / "summary.json"))
    args.command = command
    if args.phase is None:
        return orchestrate(args, command)
    if args.phase == "check":
        check_phase(args)
    elif args.phase.endswith("dispatch"):
        dispatch_phase(args, args.phase)
    else:
        rounds_phase(args, args.phase)
    return 0
