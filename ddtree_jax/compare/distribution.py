"""`ddtree-compare distribution`: sampled tokens against the target's exact distribution.

Each prompt is sampled --samples times (seeds --seed, --seed + 1, ...) for --positions tokens with the
chosen method; the first K tokens are tested against the exact processed target distribution
(temperature, top-k, top-p; float32 logits, sorted in numpy) by a G-test per sampled prefix, summed
over positions (stats.py). A prompt "differs" when the combined p-value is below --alpha; the position
reported is the one with the smallest p-value (0-based, as divergence positions).
"""

from __future__ import annotations

import argparse

import numpy as np

from ddtree_jax.compare import stats
from ddtree_jax.compare.divergence import Scorer
from ddtree_jax.compare.inputs import (
    check_generation_flags,
    generate_all,
    load_inputs,
    resolve_budget,
    settings_of,
)
from ddtree_jax.compare.report import Comparison, Divergence, Report, Table, verdict_of
from ddtree_jax.errors import DDTreeError
from ddtree_jax.pair import generator, plan_from_args, sampling_from_args
from ddtree_jax.prompts import Prompt
from ddtree_jax.sampling import MAX_SEED

HELP = "sampled tokens at the first --positions positions against the target's exact distribution"


def add_arguments(p: argparse.ArgumentParser) -> None:
    """--samples, --positions, --alpha; --batch-size defaults to 256 rows here."""
    p.add_argument(
        "--samples", type=int, default=2000, help="samples per prompt (seeds --seed, --seed + 1, ...)"
    )
    p.add_argument("--positions", type=int, default=2, help="output positions tested (K, default 2)")
    p.add_argument("--alpha", type=float, default=1e-3, help="a prompt differs below this p-value")
    p.set_defaults(batch_size=256)


def check(args: argparse.Namespace) -> None:
    """Sampling must be on; counts must be positive."""
    check_generation_flags(args)
    if args.samples < 1 or args.positions < 1:
        raise DDTreeError("--samples and --positions must be >= 1")
    if not 0 < args.alpha < 1:
        raise DDTreeError(f"--alpha must be in (0, 1), got {args.alpha}")
    if args.temperature == 0:
        raise DDTreeError("distribution needs --temperature > 0 (greedy has nothing to sample)")


def sample(args: argparse.Namespace, inputs, prompt: Prompt) -> list[list[int]]:
    """The first --positions tokens of --samples runs of `prompt`, one seed each."""
    plan = plan_from_args(inputs.pair, args, max_new_tokens=args.positions)
    gen = generator(inputs.pair, plan, sampling_from_args(args), args.host_stepped)
    copies = [
        Prompt(
            prompt.id, prompt.line, prompt.input_ids, prompt.options | {"seed": (args.seed + i) % MAX_SEED}
        )
        for i in range(args.samples)
    ]
    return [r.output_ids for r in generate_all(gen, copies, args.batch_size)]


def exact(scorer: Scorer, prompt: Prompt, settings: dict):
    """next_probs(prefixes) -> the exact [P, V] distribution after prompt + each prefix."""

    def next_probs(prefixes: list[tuple[int, ...]]) -> np.ndarray:
        logits = scorer.next_logits([prompt.input_ids + list(p) for p in prefixes])
        return stats.processed_probs(logits, settings["temperature"], settings["top_k"], settings["top_p"])

    return next_probs


def run(args: argparse.Namespace) -> Report:
    """Sample every prompt, test each against the exact distribution."""
    check(args)
    inputs = load_inputs(args, with_draft=args.method != "ar")
    args = resolve_budget(args, inputs.pair.target, inputs.prompts)  # one --budget, as ddtree-generate's
    scorer = Scorer.load(args.target)
    defaults = sampling_from_args(args)
    per_prompt, flagged = {}, []
    for prompt in inputs.prompts:
        settings = defaults | {k: v for k, v in prompt.options.items() if k in defaults}
        samples = sample(args, inputs, prompt)
        tests = stats.position_tests(samples, args.positions, exact(scorer, prompt, settings))
        p = stats.combined_p_value(tests)
        per_prompt[prompt.id] = (tests, p)
        if p < args.alpha:
            worst = min(tests, key=lambda t: t.p_value)
            flagged.append(
                Divergence(prompt.id, worst.position, None, {"p_value": p, "position_p_value": worst.p_value})
            )
    comparison = Comparison(
        name=f"{args.method} samples vs exact target distribution",
        prompts=len(inputs.prompts),
        identical=len(inputs.prompts) - len(flagged),
        divergences=flagged,
        extra={
            "samples": args.samples,
            "positions": args.positions,
            "alpha": args.alpha,
            "tests": {
                str(pid): {
                    "p_value": p,
                    "positions": [
                        {
                            "position": t.position,
                            "g": t.g,
                            "dof": t.dof,
                            "p_value": t.p_value,
                            "prefixes": t.prefixes,
                        }
                        for t in tests
                    ],
                }
                for pid, (tests, p) in per_prompt.items()
            },
        },
    )
    return Report(
        command="distribution",
        verdict=verdict_of([comparison]),
        summary=summary_line(comparison, args, per_prompt),
        comparisons=[comparison],
        tables=[table(per_prompt)],
        notes=[NOTE],
        figures={"p_values": p_value_plot(per_prompt, args.alpha)},
        details={"settings": settings_of(args, max_new_tokens=args.positions, samples=args.samples)},
    )


NOTE = (
    "Test: at output position k the samples are grouped by the tokens sampled before k, and each group's"
    " counts are G-tested against the target's exact conditional distribution (float32 logits; temperature,"
    " top-k, top-p applied by sorting); G and degrees of freedom add up over groups and positions (the"
    " chain rule: together a test of the joint distribution of the first K tokens). Cells expected fewer"
    " than 5 times are pooled."
)


def summary_line(c: Comparison, args: argparse.Namespace, per_prompt: dict) -> str:
    """Prompts consistent with the target distribution, the smallest p-value."""
    low = min(per_prompt.items(), key=lambda kv: kv[1][1])
    line = (
        f"{c.identical}/{c.prompts} prompts consistent with the target distribution at p >= {args.alpha:g} "
        f"({args.method}, {args.samples} samples x {args.positions} positions, temperature {args.temperature}"
        f", top-k {args.top_k}, top-p {args.top_p}); smallest p {low[1][1]:.3g} (prompt {low[0]!r})"
    )
    if c.divergences:
        d = c.divergences[0]
        line += f"; first flagged: prompt {d.id!r}, position {d.position}"
    return line


def table(per_prompt: dict) -> Table:
    """One row per prompt and position: samples, prefixes, G, dof, p-value."""
    rows = []
    for pid, (tests, p) in per_prompt.items():
        for t in tests:
            rows.append([pid, t.position, t.samples, t.prefixes, t.g, t.dof, t.p_value, p])
    header = ["prompt", "position", "samples", "prefixes", "G", "dof", "p (position)", "p (prompt)"]
    return Table("G-test per prompt and position", header, rows)


def p_value_plot(per_prompt: dict, alpha: float):
    """p-values per prompt and position on a log scale, with the alpha line."""
    from ddtree_jax.compare.plots import plt

    fig, ax = plt.subplots(figsize=(7, 3.5))
    for pid, (tests, _) in per_prompt.items():
        ax.plot([t.position for t in tests], [max(t.p_value, 1e-300) for t in tests], "o-", label=str(pid))
    ax.axhline(alpha, color="red", linestyle="--", label=f"alpha {alpha:g}")
    ax.set_yscale("log")
    ax.set_xticks(sorted({t.position for tests, _ in per_prompt.values() for t in tests}))
    ax.set_xlabel("output position")
    ax.set_ylabel("p-value")
    ax.set_title("sampled tokens vs exact target distribution")
    if len(per_prompt) <= 10:
        ax.legend(fontsize="small")
    plt.close(fig)
    return fig
