"""`ddtree-compare reference`: our target and pair against the project's independent PyTorch reference.

The reference (torch_reference.py: HF transformers target, a torch DFlash drafter, a heap-built tree
verified under a 4-D ancestor mask) runs in float32 at batch 1 on the CPU; our side runs as
ddtree-generate would with the same flags. Compared, per prompt:
  - target logits, teacher-forced over prompt + the reference's output of the first method: largest
    absolute and relative error, KL(reference || ours), top-1 agreement; the first failing position;
  - drafter logits at the block after the prompt (bonus: the reference's first output token);
  - greedy outputs of every method (ar, dflash, ddtree at each of --budgets): token match, with the
    first divergence and the reference target's top-2 margin there;
  - acceptance lengths round by round, and their means.
Greedy only: the reference has no sampler.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import sys

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

from ddtree_jax import drafter, target
from ddtree_jax.compare.divergence import NEAR_TIE, Scorer, first_divergence
from ddtree_jax.compare.inputs import (
    Inputs,
    check_generation_flags,
    generate_all,
    load_inputs,
    settings_of,
)
from ddtree_jax.compare.logits import TOLERANCE, LogitStats, logit_stats, top2_margin
from ddtree_jax.compare.lossless import parse_budgets
from ddtree_jax.compare.report import Comparison, Divergence, Report, Table, verdict_of
from ddtree_jax.config import DraftConfig
from ddtree_jax.errors import DDTreeError
from ddtree_jax.kv_cache import from_prefill
from ddtree_jax.pair import Pair, generator, plan_from_args
from ddtree_jax.results import Result
from ddtree_jax.sampling import GREEDY
from ddtree_jax.weights import Params

HELP = "our target and pair against an independent PyTorch reference: logits, greedy tokens, acceptance"


def add_arguments(p: argparse.ArgumentParser) -> None:
    """--budgets, and the reference side's own checkpoint directories."""
    p.add_argument("--budgets", default="15", help="comma list of ddtree budgets (default 15)")
    p.add_argument("--reference-target", help="target directory the PyTorch side loads (default: --target's)")
    p.add_argument("--reference-draft", help="drafter directory the PyTorch side loads (default: --draft's)")


@dataclasses.dataclass(frozen=True)
class Run:
    """One decoding both sides run: its label, method and ddtree budget."""

    label: str
    method: str
    budget: int | None = None


def check(args: argparse.Namespace) -> list[Run]:
    """Reject what the reference cannot run; returns the runs (ar, then dflash and ddtree with a drafter)."""
    if args.budget is not None:
        raise DDTreeError("--budget does not apply: use --budgets")
    if args.temperature != 0:
        raise DDTreeError("reference compares greedy decoding only (the PyTorch side has no sampler)")
    if args.draft_window is not None:
        raise DDTreeError("--draft-window is not implemented by the PyTorch reference")
    budgets = parse_budgets(args.budgets)
    method = args.method
    check_generation_flags(args)  # fills the bundled pair and a default --method
    if method is not None:
        return (
            [Run(f"ddtree-{n}", "ddtree", n) for n in budgets]
            if method == "ddtree"
            else [Run(method, method)]
        )
    runs = [Run("ar", "ar")]
    if args.draft:
        runs += [Run("dflash", "dflash")] + [Run(f"ddtree-{n}", "ddtree", n) for n in budgets]
    return runs


def load_reference(args: argparse.Namespace, with_draft: bool):
    """The PyTorch pair (float32) from --reference-target / --reference-draft, else --target / --draft."""
    from ddtree_jax.compare.torch_reference import TorchPair

    draft = (args.reference_draft or args.draft) if with_draft else None
    return TorchPair(args.reference_target or args.target, draft, "float32")


def check_greedy_prompts(inputs: Inputs) -> None:
    """Prompt lines may set their own sampling: reference compares greedy decoding only."""
    for p in inputs.prompts:
        if p.options.get("temperature", 0) != 0:
            raise DDTreeError(f"prompt {p.id!r} (line {p.line}) sets a temperature: reference is greedy only")


# -- our side: teacher-forced target and drafter logits ---------------------------------------------------


@functools.partial(jax.jit, static_argnames=("cfg", "dcfg"))
def _draft_logits(
    params: Params, dparams: Params, tokens: jax.Array, length: jax.Array, bonus: jax.Array, cfg, dcfg
) -> jax.Array:
    """Drafter logits [1, D, V] after the prompt tokens [1, P] (right-padded to P, `length` [1] real)."""
    p = tokens.shape[1]
    positions = jnp.arange(p, dtype=jnp.int32)[None]
    mask = jnp.tril(jnp.ones((p, p), bool))[None]
    out = target.forward(params, cfg, tokens, positions, mask, None, feature_layers=dcfg.target_layer_ids)
    dtype = params["embed"].dtype
    kv = drafter.context_kv(dparams, dcfg, out.features.astype(dtype), positions)
    cache = from_prefill(kv, p + dcfg.block_size, length)
    return drafter.draft_logits(dparams, dcfg, params, bonus, cache)


def our_draft_logits(pair: Pair, dcfg: DraftConfig, ids: list[int], bonus: int) -> np.ndarray:
    """Our drafter's float32 logits [D, V] for the block `[bonus, mask x D]` after `ids`."""
    n = len(ids)
    padded = -(-n // 64) * 64  # few shapes to compile
    tokens = jnp.asarray([ids + [0] * (padded - n)], jnp.int32)
    with jax.default_matmul_precision("highest"):
        out = _draft_logits(
            pair.params, pair.draft_params, tokens, jnp.asarray([n]), jnp.asarray([bonus]), pair.target, dcfg
        )
    return np.asarray(out[0])


# -- the comparisons ----------------------------------------------------------------------------------


@dataclasses.dataclass
class PromptLogits:
    """One prompt's teacher-forced logit agreement (the drafter's: None without a drafter)."""

    id: object
    target: LogitStats
    draft: LogitStats | None


def compare_logits(
    inputs: Inputs, ref, sequences: list[list[int]], dtype: str, dcfg: DraftConfig | None
) -> list[PromptLogits]:
    """Target logits over each prompt + reference output; drafter logits at the block after the prompt."""
    scorer = Scorer(inputs.pair.target, inputs.pair.params)
    tolerance = TOLERANCE.get(dtype, TOLERANCE["float32"])
    found = []
    for prompt, seq in zip(inputs.prompts, sequences, strict=True):
        ref_logits = ref.logits(seq)
        stats = logit_stats(scorer.logits(seq), ref_logits, tolerance)
        draft = None
        if dcfg is not None:
            bonus = seq[len(prompt.input_ids)]  # the reference's first output token
            ours = our_draft_logits(inputs.pair, dcfg, prompt.input_ids, bonus)
            theirs = ref.draft_logits(ref.features(prompt.input_ids), bonus, dcfg.block_size)
            draft = logit_stats(ours, theirs, tolerance)
        found.append(PromptLogits(prompt.id, stats, draft))
    return found


def logit_comparisons(found: list[PromptLogits], dtype: str) -> list[Comparison]:
    """'target logits' (position = index into prompt + output) and 'drafter logits' (position = depth)."""

    def divergence(id_, s: LogitStats, offset: int) -> Divergence:
        detail = dict(s.at_first_bad)
        margin = detail.pop("margin")
        flipped = detail["token"] != detail["reference_token"]
        detail["near_tie"] = flipped and detail["gap"] <= NEAR_TIE.get(dtype, NEAR_TIE["float32"])
        stats = {"max_abs": s.max_abs, "max_rel": s.max_rel, "kl_max": s.kl_max, "top1": s.top1}
        return Divergence(id_, s.first_bad + offset, margin, detail | stats)

    target_div = [divergence(f.id, f.target, 0) for f in found if f.target.first_bad is not None]
    out = [Comparison("target logits", len(found), len(found) - len(target_div), target_div)]
    drafts = [f for f in found if f.draft is not None]
    if drafts:
        div = [divergence(f.id, f.draft, 1) for f in drafts if f.draft.first_bad is not None]
        out.append(Comparison("drafter logits", len(drafts), len(drafts) - len(div), div))
    return out


def output_divergence(
    ref, id_, prompt_ids: list[int], theirs: list[int], ours: list[int], dtype: str
) -> Divergence:
    """Where our output leaves the reference's, with the reference target's top-2 margin there."""
    pos = first_divergence(theirs, ours)
    extra = {"reference_token": theirs[pos] if pos < len(theirs) else None}
    extra["token"] = ours[pos] if pos < len(ours) else None
    if pos >= len(theirs):
        return Divergence(id_, pos, None, extra)
    row = ref.logits(prompt_ids + theirs[:pos])[-1]
    if extra["token"] is not None:
        extra["gap"] = float(abs(row[theirs[pos]] - row[extra["token"]]))
        extra["near_tie"] = extra["gap"] <= NEAR_TIE.get(dtype, NEAR_TIE["float32"])
    return Divergence(id_, pos, top2_margin(row), extra)


def run_comparisons(
    run: Run, inputs: Inputs, ref, ours: list[Result], theirs: list[tuple[list[int], list[int]]], dtype: str
) -> list[Comparison]:
    """Tokens, then (speculative methods) acceptance lengths, of one run: ours against the reference."""
    tokens, rounds = [], []
    for prompt, res, (out, acc) in zip(inputs.prompts, ours, theirs, strict=True):
        if res.output_ids != out:
            tokens.append(output_divergence(ref, prompt.id, prompt.input_ids, out, res.output_ids, dtype))
        if res.acceptance_lengths != acc:
            r = first_divergence(acc, res.acceptance_lengths)
            extra = {"ours": res.acceptance_lengths[r : r + 1], "reference": acc[r : r + 1]}
            rounds.append(Divergence(prompt.id, r, None, extra))
    n = len(inputs.prompts)
    means = {
        "ours": mean_of([r.acceptance_lengths for r in ours]),
        "reference": mean_of([a for _, a in theirs]),
    }
    out = [Comparison(f"{run.label} tokens", n, n - len(tokens), tokens, {run.label: means["ours"]})]
    if run.method != "ar":
        agree = sum(
            a == b
            for r, (_, acc) in zip(ours, theirs, strict=True)
            for a, b in zip(r.acceptance_lengths, acc, strict=False)
        )
        total = sum(
            max(len(r.acceptance_lengths), len(acc)) for r, (_, acc) in zip(ours, theirs, strict=True)
        )
        extra = {"rounds": total, "rounds_identical": agree}
        out.append(Comparison(f"{run.label} acceptance", n, n - len(rounds), rounds, means, extra))
    return out


def mean_of(lists: list[list[int]]) -> float | None:
    """Mean over every element of `lists` (None when empty)."""
    flat = [a for xs in lists for a in xs]
    return sum(flat) / len(flat) if flat else None


# -- the sub-command ----------------------------------------------------------------------------------


def run(args: argparse.Namespace) -> Report:
    """Both sides on every prompt: logits, then every run's outputs and acceptance."""
    runs = check(args)
    with_draft = any(r.method != "ar" for r in runs)
    inputs = load_inputs(args, with_draft=with_draft)
    check_greedy_prompts(inputs)
    ref = load_reference(args, with_draft)
    from ddtree_jax.compare.torch_reference import read_stop_ids

    ref_stops = read_stop_ids(args.reference_target or args.target)
    ours, theirs = {}, {}
    for r in runs:
        plan = plan_from_args(inputs.pair, args, r.method, r.budget)
        ours[r.label] = generate_all(generator(inputs.pair, plan, GREEDY), inputs.prompts, args.batch_size)
        block = plan.draft.block_size if plan.draft is not None else None
        theirs[r.label] = [
            ref.generate(
                p.input_ids, r.method, args.max_new_tokens, plan.budget, plan.branching, ref_stops, block
            )
            for p in tqdm(inputs.prompts, desc=f"reference {r.label}", unit="prompt", file=sys.stderr)
        ]
    first = theirs[runs[0].label]
    sequences = [p.input_ids + out for p, (out, _) in zip(inputs.prompts, first, strict=True)]
    dcfg = inputs.pair.draft if with_draft else None
    if dcfg is not None and args.block_size is not None:
        dcfg = dataclasses.replace(dcfg, block_size=args.block_size)
    found = compare_logits(inputs, ref, sequences, args.dtype, dcfg)
    comparisons = logit_comparisons(found, args.dtype)
    for r in runs:
        comparisons += run_comparisons(r, inputs, ref, ours[r.label], theirs[r.label], args.dtype)
    return make_report(args, runs, found, comparisons, ours, theirs)


def make_report(args, runs: list[Run], found: list[PromptLogits], comparisons, ours, theirs) -> Report:
    """The verdict, the summary line, the tables and the plots."""
    from ddtree_jax.compare.plots import histogram_bars, logit_errors

    figures = {"logit_error": logit_errors({f.id: f.target.row_abs for f in found})}
    for r in runs:
        if r.method != "ar":
            hists = {
                f"ours {r.label}": histogram(x.acceptance_lengths for x in ours[r.label]),
                f"reference {r.label}": histogram(a for _, a in theirs[r.label]),
            }
            figures[f"acceptance_{r.label}"] = histogram_bars(hists, f"{r.label}: acceptance lengths")
    return Report(
        command="reference",
        verdict=verdict_of(comparisons),
        summary=summary_line(found, comparisons, args),
        comparisons=comparisons,
        tables=tables(found, comparisons),
        notes=[NOTE.format(first=runs[0].label)],
        figures=figures,
        details={"settings": settings(args, runs), "logits": [logits_json(f) for f in found]},
    )


NOTE = (
    "Our side runs as ddtree-generate does with the flags below; the reference side is "
    "`ddtree_jax/compare/torch_reference.py` (HF transformers target, a torch DFlash drafter, a heap-built "
    "tree verified in one pass under a 4-D ancestor mask, every round recomputed), float32, batch 1. "
    "Logits are teacher-forced over each prompt + the reference's {first} output (position: index into "
    "prompt + output; a position fails when the top-1 token differs or the row's largest error exceeds "
    "the tolerance relative to the row's largest |logit|); drafter logits are those of the block after "
    "the prompt (position: depth). A token divergence's margin is the reference target's top-2 gap there."
)


def histogram(lists) -> dict[int, int]:
    """Rounds per acceptance length over every list in `lists`."""
    counts: dict[int, int] = {}
    for xs in lists:
        for a in xs:
            counts[a] = counts.get(a, 0) + 1
    return counts


def summary_line(found: list[PromptLogits], comparisons: list[Comparison], args) -> str:
    """One line: logit agreement, tokens and acceptance identical per run, the first divergence."""
    rows = sum(f.target.rows for f in found)
    top1 = sum(f.target.top1 * f.target.rows for f in found) / max(rows, 1)
    max_rel = max((f.target.max_rel for f in found), default=0.0)
    parts = [f"target logits max rel error {max_rel:.2g}, top-1 {100 * top1:.1f}% of {rows} positions"]
    drafts = [f.draft for f in found if f.draft is not None]
    if drafts:
        parts.append(f"drafter logits max rel error {max(d.max_rel for d in drafts):.2g}")
    n = len(found)
    parts.append(
        "identical: "
        + ", ".join(
            f"{c.name} {c.identical}/{n}" for c in comparisons if c.name.endswith(("tokens", "acceptance"))
        )
    )
    line = "; ".join(parts) + f" ({args.dtype} against float32, greedy, {args.max_new_tokens} new tokens)"
    first = next((c for c in comparisons if c.divergences), None)
    if first is not None:
        d = first.divergences[0]
        line += f"; first difference: {first.name}, prompt {d.id!r}, position {d.position}"
    return line


def tables(found: list[PromptLogits], comparisons: list[Comparison]) -> list[Table]:
    """Runs, then logits per prompt, then every difference (when there is one)."""
    out = [run_table(comparisons, len(found)), logit_table(found)]
    diffs = difference_table(comparisons)
    return out + ([diffs] if diffs.rows else [])


def run_table(comparisons: list[Comparison], n: int) -> Table:
    """Per run: outputs and acceptance identical, rounds identical, mean acceptance of both sides."""
    rows = []
    for c in comparisons:
        if not c.name.endswith(" tokens"):
            continue
        label = c.name.removesuffix(" tokens")
        acc = next((a for a in comparisons if a.name == f"{label} acceptance"), None)
        if acc is None:
            rows.append([label, f"{c.identical}/{n}", "", "", None, None])
            continue
        rounds = f"{acc.extra['rounds_identical']}/{acc.extra['rounds']}"
        means = acc.mean_acceptance
        rows.append(
            [label, f"{c.identical}/{n}", f"{acc.identical}/{n}", rounds, means["ours"], means["reference"]]
        )
    header = [
        "run",
        "outputs identical",
        "acceptance identical",
        "rounds identical",
        "mean acc. ours",
        "ref.",
    ]
    return Table("Generation: ours against the reference", header, rows)


def logit_table(found: list[PromptLogits]) -> Table:
    """Per prompt: the target's logit agreement, and the drafter's where there is one."""
    header = ["prompt", "positions", "max abs err", "max rel err", "mean KL", "max KL", "top-1"]
    with_draft = any(f.draft is not None for f in found)
    if with_draft:
        header += ["drafter max abs", "drafter max rel", "drafter top-1"]
    rows = []
    for f in found:
        t = f.target
        row = [f.id, t.rows, t.max_abs, t.max_rel, t.kl_mean, t.kl_max, t.top1]
        rows.append(row + ([f.draft.max_abs, f.draft.max_rel, f.draft.top1] if with_draft else []))
    return Table("Logits, teacher-forced", header, rows)


def difference_table(comparisons: list[Comparison]) -> Table:
    """Every comparison's first difference per prompt, with the reference's margin there."""
    rows = [
        [c.name, d.id, d.position, d.margin, d.extra.get("gap"), d.extra.get("near_tie")]
        + [
            d.extra.get("reference_token", d.extra.get("reference")),
            d.extra.get("token", d.extra.get("ours")),
        ]
        for c in comparisons
        for d in c.divergences
    ]
    header = ["comparison", "prompt", "position", "margin", "gap", "near-tie", "reference", "ours"]
    return Table("Differences (first per prompt)", header, rows)


def logits_json(f: PromptLogits) -> dict:
    """One prompt's logit statistics for report.json (without the per-row errors)."""

    def stats(s: LogitStats | None) -> dict | None:
        if s is None:
            return None
        return {k: v for k, v in dataclasses.asdict(s).items() if k not in ("row_abs", "at_first_bad")}

    return {"id": f.id, "target": stats(f.target), "draft": stats(f.draft)}


def settings(args: argparse.Namespace, runs: list[Run]) -> dict:
    """What both sides ran with."""
    return settings_of(
        args,
        method=", ".join(r.label for r in runs),
        budgets=args.budgets,
        reference_target=args.reference_target or args.target,
        reference_draft=args.reference_draft or args.draft,
        reference_dtype="float32",
        tolerance=TOLERANCE.get(args.dtype, TOLERANCE["float32"]),
    )
