"""`ddtree-compare lossless`: ar, dflash and ddtree at each budget must emit the same tokens.

Greedy, every method's output must equal ar's token for token; with --temperature the Gumbel noise is
keyed by (seed, position, token), so sampled outputs must be equal as well. Each differing prompt is
reported at its first divergence with the target's float32 margin there (divergence.py).
"""

from __future__ import annotations

import argparse
import sys
import time

from ddtree_jax.compare.divergence import Scorer, divergence
from ddtree_jax.compare.inputs import (
    Inputs,
    check_generation_flags,
    generate_timed,
    load_inputs,
    mean_acceptance,
    settings_of,
    speed_rows,
    token_text,
)
from ddtree_jax.compare.report import Comparison, Report, Table, verdict_of
from ddtree_jax.errors import DDTreeError
from ddtree_jax.pair import generator, plan_from_args, sampling_from_args

HELP = (
    "ar, dflash and ddtree (at each of --budgets) on the same prompts: identical tokens, else where and why"
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """--budgets."""
    p.add_argument("--budgets", default="7,15", help="comma list of ddtree budgets (default 7,15)")


def parse_budgets(text: str) -> list[int]:
    """'7,15' -> [7, 15], each >= 1."""
    try:
        budgets = [int(b) for b in text.split(",")]
    except ValueError:
        raise DDTreeError(f"--budgets {text!r}: expected a comma list of integers") from None
    if not budgets or min(budgets) < 1:
        raise DDTreeError(f"--budgets {text!r}: every budget must be >= 1")
    return budgets


def check(args: argparse.Namespace) -> list[int]:
    """Flags that make no sense here; returns the budgets."""
    if args.method is not None:
        raise DDTreeError("--method does not apply: lossless runs ar, dflash and ddtree")
    if args.budget is not None:
        raise DDTreeError("--budget does not apply: use --budgets")
    budgets = parse_budgets(args.budgets)
    check_generation_flags(args)
    if not args.draft:
        raise DDTreeError("lossless needs --draft DIR (dflash and ddtree run the drafter)")
    return budgets


def methods(budgets: list[int]) -> list[tuple[str, str, int | None]]:
    """(label, method, budget) for every run, ar (the reference) first."""
    return [("ar", "ar", None), ("dflash", "dflash", None)] + [(f"ddtree-{n}", "ddtree", n) for n in budgets]


def progress(message: str) -> None:
    """One progress line on stderr (a lossless run is several whole generations)."""
    print(f"ddtree-compare lossless: {message}", file=sys.stderr, flush=True)


def run(args: argparse.Namespace) -> Report:
    """Every method on every prompt, each compared with ar."""
    budgets = check(args)
    progress("loading the target and the drafter")
    inputs = load_inputs(args, with_draft=True)
    defaults = sampling_from_args(args)  # the sampling settings a prompt's own override
    outputs, speeds = {}, {}
    runs = methods(budgets)
    for n, (label, method, budget) in enumerate(runs, start=1):
        progress(f"[{n}/{len(runs)}] {label}: {len(inputs.prompts)} prompts ...")
        start = time.perf_counter()
        plan = plan_from_args(inputs.pair, args, method=method, budget=budget)
        gen = generator(inputs.pair, plan, defaults, args.host_stepped)
        outputs[label], speeds[label] = generate_timed(gen, inputs.prompts, args.batch_size)
        progress(f"[{n}/{len(runs)}] {label}: done in {time.perf_counter() - start:.1f} s")
    progress("comparing with ar (a divergence loads the float32 scorer)")
    return make_report(args, inputs, outputs, defaults, speeds)


def make_report(
    args: argparse.Namespace, inputs: Inputs, outputs: dict, defaults: dict, speeds: dict | None = None
) -> Report:
    """Compare every method's outputs with ar's (`speeds`: each method's `Speed`, for the table)."""
    from ddtree_jax.compare.plots import acceptance_histograms  # matplotlib: not needed for --help

    scorer = None
    reference = outputs["ar"]
    comparisons = []
    for label, results in outputs.items():
        if label == "ar":
            continue
        found = []
        for prompt, ref, res in zip(inputs.prompts, reference, results, strict=True):
            if ref.output_ids == res.output_ids:
                continue
            scorer = scorer or Scorer.load(args.target)
            options = defaults | {k: v for k, v in prompt.options.items() if k in defaults}
            found.append(
                divergence(
                    scorer, prompt.id, prompt.input_ids, ref.output_ids, res.output_ids, options, args.dtype
                )
            )
        comparisons.append(
            Comparison(
                name=f"{label} vs ar",
                prompts=len(inputs.prompts),
                identical=len(inputs.prompts) - len(found),
                divergences=found,
                mean_acceptance={label: mean_acceptance(results)},
            )
        )
    verdict = verdict_of(comparisons)
    return Report(
        command="lossless",
        verdict=verdict,
        summary=summary_line(comparisons, args),
        comparisons=comparisons,
        tables=tables(comparisons, outputs, speeds or {}, inputs.pair.codec),
        figures={"acceptance": acceptance_histograms({k: v for k, v in outputs.items() if k != "ar"})},
        details={"settings": settings_of(args, method="ar, dflash, ddtree", budgets=args.budgets)},
    )


def summary_line(comparisons: list[Comparison], args: argparse.Namespace) -> str:
    """One line: which methods matched ar on how many prompts, and the first divergence if any."""
    mode = "greedy"
    if args.temperature > 0:
        mode = f"temperature {args.temperature}, top-k {args.top_k}, top-p {args.top_p}, seed {args.seed}"
    n = comparisons[0].prompts
    head = ", ".join(f"{c.name.split(' vs ')[0]} {c.identical}/{n}" for c in comparisons)
    line = f"identical to ar: {head} prompts ({args.dtype}, {mode}, {args.max_new_tokens} new tokens)"
    first = next((c for c in comparisons if c.divergences), None)
    if first is not None:
        d = first.divergences[0]
        margin = "n/a" if d.margin is None else f"{d.margin:.4g}"
        line += f"; first divergence: {first.name}, prompt {d.id!r}, position {d.position}, margin {margin}"
    return line


def tables(comparisons: list[Comparison], outputs: dict, speeds: dict, codec=None) -> list[Table]:
    """Per method: identical prompts, mean acceptance, generation time and tok/s (compilation left
    out); every divergence with its margin, tokens as ids and text."""
    n = comparisons[0].prompts
    timing = lambda label: speed_rows({label: speeds[label]})[0][2:4] if label in speeds else ["", ""]  # noqa: E731
    rows = [["ar", f"{n}/{n}", "", "1", *timing("ar")]]
    for c in comparisons:
        label = c.name.split(" vs ")[0]
        rows.append(
            [label, f"{c.identical}/{n}", len(c.divergences), c.mean_acceptance[label], *timing(label)]
        )
    div = [
        [
            c.name,
            d.id,
            d.position,
            d.margin,
            d.extra.get("gap"),
            d.extra.get("near_tie"),
            token_text(d.extra.get("reference_token"), codec),
            token_text(d.extra.get("token"), codec),
            d.extra.get("reference_is_top1"),
        ]
        for c in comparisons
        for d in c.divergences
    ]
    header = ["method", "identical", "divergences", "mean acceptance", "generation s", "tok/s"]
    out = [Table("Methods against ar", header, rows)]
    if div:
        header = [
            "comparison",
            "prompt",
            "position",
            "margin",
            "gap",
            "near-tie",
            "ar token",
            "token",
            "ar token top-1 in f32",
        ]
        out.append(Table("Divergences (first position per prompt)", header, div))
    return out
