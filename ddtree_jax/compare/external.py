"""`ddtree-compare external`: another system's outputs against ours on the same prompts.

Ours are generated with the given flags (or read from --ours FILE); theirs come from --theirs FILE in
any format outputs.py accepts. Per prompt: identical tokens, else the first divergence with our
target's float32 margin there (over prompt + our output); mean acceptance lengths and histograms side
by side; where both sides give the chosen tokens' log-probabilities (output_token_logprobs), their
maximum and mean absolute difference over the tokens both generated alike (each prompt's common
prefix) and the positions of the largest. Prompts theirs does not cover are listed, not compared. An
output given as text only (SGLang without output_ids) is compared as text: encoding it again may
tokenize the same text otherwise.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from ddtree_jax.compare import outputs
from ddtree_jax.compare.divergence import Scorer, divergence
from ddtree_jax.compare.inputs import (
    check_generation_flags,
    generate_all,
    load_inputs,
    resolve_budget,
    settings_of,
)
from ddtree_jax.compare.outputs import OutputRecord
from ddtree_jax.compare.report import Comparison, Divergence, Report, Table, verdict_of
from ddtree_jax.pair import generator, plan_from_args, sampling_from_args

HELP = "another system's outputs (SGLang, the DDTree reference, ours) against ours on the same prompts"


def add_arguments(p: argparse.ArgumentParser) -> None:
    """--theirs, --ours."""
    p.add_argument(
        "--theirs", required=True, help="JSONL: their outputs (ours, SGLang or DDTree reference lines)"
    )
    p.add_argument("--ours", help="JSONL: our outputs already generated (default: generate with the flags)")


def our_records(args: argparse.Namespace, inputs) -> list[OutputRecord]:
    """Our outputs: read from --ours, or generated with ddtree-generate's flags."""
    if args.ours is not None:
        return outputs.read_outputs(args.ours)
    plan = plan_from_args(inputs.pair, args)
    gen = generator(inputs.pair, plan, sampling_from_args(args), args.host_stepped)
    results = generate_all(gen, inputs.prompts, args.batch_size)
    return [outputs.parse_line(r.to_json(), f"generated:{i + 1}", i) for i, r in enumerate(results)]


def run(args: argparse.Namespace) -> Report:
    """Read theirs, get ours, compare prompt by prompt."""
    from ddtree_jax.compare import plots  # matplotlib: imported when a report is made, not for --help

    check_generation_flags(args)
    theirs = outputs.read_outputs(args.theirs)  # bad input fails before any model loads
    inputs = load_inputs(args, with_draft=args.ours is None and args.method != "ar")
    args = resolve_budget(args, inputs.pair.target, inputs.prompts)  # one --budget, as ddtree-generate's
    their_by_id = outputs.match_prompts(theirs, inputs.prompts, args.prompts)
    our_by_id = outputs.match_prompts(our_records(args, inputs), inputs.prompts, args.prompts)
    sampling = sampling_from_args(args)
    scorer, found, compared, missing = None, [], [], []
    for prompt in inputs.prompts:
        if prompt.id not in their_by_id or prompt.id not in our_by_id:
            missing.append(prompt.id)
            continue
        compared.append(prompt.id)
        texts = outputs.texts_to_compare(our_by_id[prompt.id], their_by_id[prompt.id], inputs.pair.codec)
        if texts is not None and texts[0] == texts[1]:
            continue  # one side has text only: the same text is the same output, however tokenized
        ours = outputs.tokens_of(our_by_id[prompt.id], inputs.pair.codec)
        other = outputs.tokens_of(their_by_id[prompt.id], inputs.pair.codec)
        if ours == other and texts is None:
            continue
        scorer = scorer or Scorer.load(args.target)
        options = sampling | {k: v for k, v in prompt.options.items() if k in sampling}
        found.append(
            divergence(scorer, prompt.id, prompt.input_ids, ours, other, options, args.dtype)
            or Divergence(prompt.id, len(ours), None, {"text_differs": True})  # same tokens, other text
        )
    our_list = [our_by_id[i] for i in compared]
    their_list = [their_by_id[i] for i in compared]
    ours_name, theirs_name = "ours", Path(args.theirs).stem
    acceptance = {
        ours_name: outputs.mean_acceptance(our_list),
        theirs_name: outputs.mean_acceptance(their_list),
    }
    if acceptance[theirs_name][1] == outputs.RATIO:  # counts the prefill's token too: ours by the same rule
        acceptance[f"{ours_name} (same rule)"] = outputs.mean_acceptance(our_list, outputs.RATIO)
    comparison = Comparison(
        name=f"{theirs_name} vs ours",
        prompts=len(compared),
        identical=len(compared) - len(found),
        divergences=found,
        mean_acceptance={k: v for k, (v, _) in acceptance.items()},
        extra={
            "acceptance_source": {k: s for k, (_, s) in acceptance.items()},
            "not_compared": missing,
            "text_only": [r.id for r in their_list if r.output_ids is None],
            "logprobs": logprob_differences(compared, our_list, their_list),
        },
    )
    hists = {ours_name: outputs.histogram(our_list), theirs_name: outputs.histogram(their_list)}
    sides, warning = provenance_of_sides(args, theirs_name)
    return Report(
        command="external",
        verdict=verdict_of([comparison]),
        summary=summary_line(comparison, acceptance, theirs_name),
        comparisons=[comparison],
        tables=tables(comparison, acceptance, hists),
        notes=notes(comparison) + provenance_notes(sides, warning),
        figures={"acceptance": plots.histogram_bars(hists, f"acceptance lengths: ours vs {theirs_name}")},
        details={
            "settings": settings_of(args, theirs=args.theirs, ours=args.ours or "generated"),
            "provenance": {name: p for name, (p, _) in sides.items()},
            "numerics_differences": warning,
        },
    )


def provenance_of_sides(args: argparse.Namespace, theirs_name: str) -> tuple[dict, list[str]]:
    """{side: (provenance, settings)} of ours (this run's, or --ours' sidecar) and theirs (--theirs'
    sidecar: None for another system's file), and what they differ in that changes bfloat16 outputs;
    both sides printed on stderr, the differences as a warning."""
    import sys

    from ddtree_jax import provenance

    if args.ours is None:
        ours = (
            provenance.provenance(),
            {k: v for k, v in vars(args).items() if k in provenance.PROGRAM_SETTINGS},
        )
    else:
        ours = provenance.of_outputs(args.ours)
    sides = {"ours": ours, theirs_name: provenance.of_outputs(args.theirs)}
    (p_ours, s_ours), (p_theirs, s_theirs) = sides.values()
    differ = provenance.numerics_differences(p_ours, p_theirs, s_ours, s_theirs)
    for name, (p, _) in sides.items():
        print(f"ddtree-compare external: {name}: {provenance.line(p)}", file=sys.stderr)
    if differ:
        print(
            "ddtree-compare external: warning: the sides differ in what changes bfloat16 outputs: "
            + "; ".join(differ),
            file=sys.stderr,
        )
    return sides, differ


def provenance_notes(sides: dict, differ: list[str]) -> list[str]:
    """report.md's lines on what produced each side, and the warning when bfloat16 outputs may differ."""
    from ddtree_jax.provenance import line

    out = ["Provenance: " + "; ".join(f"{name}: {line(p)}" for name, (p, _) in sides.items()) + "."]
    if differ:
        out.append(
            "Warning: the sides differ in what changes bfloat16 outputs (divergences may come from it, "
            "not from the decoder): " + "; ".join(differ) + "."
        )
    return out


LARGEST = 5  # positions of the largest log-probability differences reported


def logprob_differences(ids: list, ours: list[OutputRecord], theirs: list[OutputRecord]) -> dict | None:
    """|our logprob - theirs| of the chosen tokens over each prompt's common token prefix: the maximum,
    the mean and the LARGEST largest (prompt, position); None when no prompt has both sides'."""
    diffs = []
    for id_, a, b in zip(ids, ours, theirs, strict=True):
        if None in (a.token_logprobs, b.token_logprobs, a.output_ids, b.output_ids):
            continue
        for i, (x, y) in enumerate(zip(a.token_logprobs, b.token_logprobs, strict=False)):
            if i >= min(len(a.output_ids), len(b.output_ids)) or a.output_ids[i] != b.output_ids[i]:
                break
            if x is not None and y is not None:
                diffs.append((abs(x - y), id_, i, x, y))
    if not diffs:
        return None
    largest = sorted(diffs, key=lambda d: -d[0])[:LARGEST]
    return {
        "tokens": len(diffs),
        "max_abs_diff": largest[0][0],
        "mean_abs_diff": sum(d[0] for d in diffs) / len(diffs),
        "largest": [{"id": i, "position": p, "ours": x, "theirs": y, "diff": d} for d, i, p, x, y in largest],
    }


def summary_line(c: Comparison, acceptance: dict, theirs_name: str) -> str:
    """Match rate, the first divergence, mean acceptance of both."""
    line = f"{theirs_name} identical to ours on {c.identical}/{c.prompts} prompts"
    if c.divergences:
        d = c.divergences[0]
        margin = "n/a" if d.margin is None else f"{d.margin:.4g}"
        line += f" (first divergence: prompt {d.id!r}, position {d.position}, margin {margin})"
    means = ", ".join(f"{k} {v:.3f}" for k, (v, _) in acceptance.items() if v is not None)
    return line + (f"; mean acceptance {means}" if means else "")


def notes(c: Comparison) -> list[str]:
    """Caveats a reader needs: prompts not compared, outputs re-tokenized from text."""
    out = []
    if c.extra["not_compared"]:
        out.append(f"Not compared (no output on one side): {', '.join(map(repr, c.extra['not_compared']))}.")
    if c.extra["text_only"]:
        out.append(
            "Compared as text (no output_ids given; the same text agrees, however tokenized): "
            + ", ".join(map(repr, c.extra["text_only"]))
            + ". Where the texts differ, the divergence's position is in their text encoded with our "
            "tokenizer."
        )
    return out


def tables(c: Comparison, acceptance: dict, hists: dict) -> list[Table]:
    """Match rate and acceptance side by side; divergences; the histograms as numbers."""
    side = [[name, mean, source] for name, (mean, source) in acceptance.items()]
    out = [
        Table(
            "Match",
            ["prompts compared", "identical", "match rate"],
            [[c.prompts, c.identical, c.identical / max(c.prompts, 1)]],
        ),
        Table("Mean acceptance length (tokens per round, bonus included)", ["side", "mean", "from"], side),
    ]
    if (lp := c.extra.get("logprobs")) is not None:
        out.append(
            Table(
                f"Chosen tokens' log-probabilities, ours vs theirs ({lp['tokens']} tokens generated alike): "
                f"max |diff| {lp['max_abs_diff']:.4g}, mean {lp['mean_abs_diff']:.4g}",
                ["prompt", "position", "ours", "theirs", "|diff|"],
                [[d["id"], d["position"], d["ours"], d["theirs"], d["diff"]] for d in lp["largest"]],
            )
        )
    if c.divergences:
        rows = [
            [
                d.id,
                d.position,
                d.margin,
                d.extra.get("gap"),
                d.extra.get("near_tie"),
                d.extra.get("reference_token"),
                d.extra.get("token"),
                d.extra.get("reference_is_top1"),
            ]
            for d in c.divergences
        ]
        header = [
            "prompt",
            "position",
            "margin",
            "gap",
            "near-tie",
            "our token",
            "their token",
            "ours top-1 in f32",
        ]
        out.append(Table("Divergences (first position per prompt)", header, rows))
    lengths = sorted({n for h in hists.values() for n in h})
    if lengths:
        rows = [[n, *(h.get(n, 0) for h in hists.values())] for n in lengths]
        out.append(Table("Rounds per acceptance length", ["length", *hists], rows))
    return out
