"""Plots of `ddtree-bench rounds` results: round time and projected speed-up vs budget per batch size,
round time vs context, the stage breakdown. Needs matplotlib (the `compare` extra).

Projected speed-up of budget N at batch B = acceptance(N) x ar step(B) / ddtree round(N, B), with the
acceptance curve of a trained pair and the round times of the benchmark; the budget that maximises it
per batch size is written to default_budgets.json, the input to `budgets.DEFAULT_BUDGETS`'s 1k-context
entries (the long-context ones: results/notes.md, "The budget at long context").

    ddtree-bench plot --bench results/h200/sweep/budgets.json results/h200/sweep/batches.json \\
        results/h200/sweep/small_budgets.json results/h200/sweep/batch32_budget7.json \\
        results/h200/sweep/ar_rows.json results/h200/sweep/ar_rows_inactive.json \\
        --stage-bench results/h200/sweep/stages.json \\
        --context-bench results/h200/sweep/budgets.json results/h200/bench_ar_kernel.json \\
        results/h200/sweep/contexts.json \\
        --acceptance results/default-pair-eval-greedy.json --out results/h200/plots

(later files win where two give the same configuration: small_budgets.json re-measures ar and budget
7 at batch 16 beside budgets 3 and 5, batch32_budget7.json ar at batch 32; ar_rows.json and
ar_rows_inactive.json hold the one-row ar step run as two rows, as `ddtree-generate` runs it, the
second with its padding row inactive as generation pads.)
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

from ddtree_jax.bench import report
from ddtree_jax.errors import DDTreeError

TICKS = [3, 7, 15, 31, 63, 127, 255]  # the budgets of the sweeps (5 also swept at batch 16)


def load_rows(paths: list[Path]) -> list[dict]:
    """Greedy, error-free rows of every bench JSON given, each with its `batch_size` (files before the
    field's name was settled call it `batch`)."""
    rows = []
    for path in paths:
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, ValueError) as e:
            raise DDTreeError(f"{path}: cannot read a benchmark JSON ({e})") from None
        rows += [r for r in data.get("rows", []) if "error" not in r and not r.get("sampling")]
    return [r | {"batch_size": r.get("batch_size", r.get("batch"))} for r in rows]


def acceptance_curve(path: Path) -> dict[int, float]:
    """{budget: mean acceptance} of ddtree (budget 0: dflash) from an eval_default_pair.py JSON."""
    runs = json.loads(Path(path).read_text())["runs"]
    return {r["budget"]: r["mean_acceptance"] for r in runs if r["method"] in ("ddtree", "dflash")}


def round_ms_at(rows: list[dict], context: int) -> tuple[dict[int, float], dict[int, dict[int, float]]]:
    """({batch size: ar step ms}, {batch size: {budget: ddtree round ms}}) of the rows at `context`."""
    at = [r for r in rows if r["context"] == context]
    ar = {r["batch_size"]: r["round_ms"] for r in at if r["method"] == "ar"}
    by_batch = defaultdict(dict)
    for r in at:
        if r["method"] == "ddtree":
            by_batch[r["batch_size"]][r["budget"]] = r["round_ms"]
    return ar, dict(by_batch)


def default_budgets(ar: dict, by_batch: dict, acc: dict[int, float]) -> dict[int, dict]:
    """{batch size: {budget, projected_speedup}}: the budget maximising acceptance x ar step / round."""
    choice = {}
    for b in sorted(by_batch):
        budgets = [n for n in sorted(by_batch[b]) if n in acc]
        best = max(budgets, key=lambda n: acc[n] / by_batch[b][n])
        choice[b] = {"budget": best, "projected_speedup": acc[best] * ar[b] / by_batch[b][best]}
    return choice


def main(argv: list[str] | None = None) -> int:
    """`ddtree-bench plot`; the exit status."""
    ap = report.parser("plot", __doc__)
    ap.add_argument("--bench", type=Path, nargs="+", required=True, help="budget and batch sweeps")
    ap.add_argument(
        "--context-bench", type=Path, nargs="*", default=[], help="context sweeps (default: --bench)"
    )
    ap.add_argument(
        "--stage-bench", type=Path, nargs="*", default=[], help="runs with --stages (default: --bench)"
    )
    ap.add_argument("--acceptance", type=Path, help="eval_default_pair.py JSON with ddtree at the budgets")
    ap.add_argument("--context", type=int, default=1024, help="context of the budget plots")
    ap.add_argument("--out", type=Path, required=True, help="directory for the PNGs and default_budgets.json")
    try:
        args = ap.parse_args(argv)
    except SystemExit as e:  # --help (0) or a usage error (EXIT_ERROR)
        return e.code if isinstance(e.code, int) else report.EXIT_ERROR
    try:
        plot(args)
    except (DDTreeError, KeyError) as e:
        print(f"ddtree-bench plot: error: {e}", file=sys.stderr)
        return report.EXIT_ERROR
    return 0


def plot(args: argparse.Namespace) -> None:
    """The three figures (and default_budgets.json with --acceptance) into --out."""
    rows = load_rows(args.bench)  # a file that cannot be read fails first
    try:
        import matplotlib
    except ImportError:
        raise DDTreeError("needs matplotlib: pip install 'ddtree-jax[compare]'") from None

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    args.out.mkdir(parents=True, exist_ok=True)
    ar, by_batch = round_ms_at(rows, args.context)

    fig, axes = plt.subplots(1, 2 if args.acceptance else 1, figsize=(11 if args.acceptance else 6, 4))
    axes = axes if args.acceptance else [axes]
    for b in sorted(by_batch):
        budgets = sorted(by_batch[b])
        axes[0].plot(budgets, [by_batch[b][n] / ar[b] for n in budgets], "o-", label=f"batch {b}")
    axes[0].set(xscale="log", xlabel="budget N", ylabel="ddtree round / ar step", title="Cost of a round")
    axes[0].set_xticks(TICKS, [str(n) for n in TICKS])
    axes[0].legend()
    if args.acceptance:
        acc = acceptance_curve(args.acceptance)
        choice = default_budgets(ar, by_batch, acc)
        for b in sorted(by_batch):
            budgets = [n for n in sorted(by_batch[b]) if n in acc]
            speedup = [acc[n] * ar[b] / by_batch[b][n] for n in budgets]
            axes[1].plot(budgets, speedup, "o-", label=f"batch {b}")
        print(json.dumps({"default_budget_by_batch": choice}))
        (args.out / "default_budgets.json").write_text(json.dumps(choice, indent=1) + "\n")
        axes[1].axhline(1.0, color="grey", lw=0.8)
        axes[1].set(xscale="log", xlabel="budget N", ylabel="tokens/s over ar", title="Projected speed-up")
        axes[1].set_xticks(TICKS, [str(n) for n in TICKS])
        axes[1].legend()
    fig.tight_layout()
    fig.savefig(args.out / "budget.png", dpi=120)

    fig, ax = plt.subplots(figsize=(6, 4))
    series = defaultdict(dict)
    for r in load_rows(args.context_bench) if args.context_bench else rows:
        if r["method"] == "ar" or (r["method"] == "ddtree" and r["budget"] == 63):
            series[(r["method"], r["batch_size"], r["attention"])][r["context"]] = r["round_ms"]
    for (method, b, attention), points in sorted(series.items()):
        if len(points) > 1:
            xs = sorted(points)
            name = f"{method} {'63 ' * (method == 'ddtree')}B={b}, {attention}"
            ax.plot(xs, [points[x] for x in xs], "o-" if attention == "pallas" else "x--", label=name)
    ax.set(xscale="log", xlabel="context (tokens)", ylabel="ms per round", title="Round time vs context")
    ax.legend()
    fig.tight_layout()
    fig.savefig(args.out / "context.png", dpi=120)

    staged = [r for r in (load_rows(args.stage_bench) if args.stage_bench else rows) if r.get("stages_ms")]
    if staged:
        fig, ax = plt.subplots(figsize=(7, 4))
        labels = [f"{r['method']} {r['budget']} B={r['batch_size']}" for r in staged]
        bottom = [0.0] * len(staged)
        for stage in ("draft", "build", "verify", "walk", "commit"):  # engine.STAGES
            # each stage alone in a device loop; commit is the rest of the round (clipped at 0); files
            # recorded before 2026-12-02 name build "tree_build" and walk + commit "walk_commit_rest"
            values = [max(_stage_ms(r.get("device_stages_ms", {}), stage), 0.0) for r in staged]
            ax.bar(labels, values, bottom=bottom, label=stage)
            bottom = [a + v for a, v in zip(bottom, values, strict=True)]
        hosted = [r.get("host_stepped_round_ms", sum(r["stages_ms"].values())) for r in staged]
        ax.scatter(labels, hosted, color="black", marker="x", zorder=3, label="host-stepped round")
        ax.set(ylabel="ms", title="Stages, each in a device loop (bars: device-loop round)")
        ax.legend()
        fig.tight_layout()
        fig.savefig(args.out / "stages.png", dpi=120)


OLD_STAGE_NAMES = {"build": "tree_build", "commit": "walk_commit_rest"}  # in files before 2026-12-02


def _stage_ms(stages: dict, stage: str) -> float:
    """A stage's device-loop ms, under its name or the one it had before 2026-12-02."""
    return stages.get(stage, stages.get(OLD_STAGE_NAMES.get(stage, ""), 0.0))
