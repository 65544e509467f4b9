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
    SPEED_HEADER,
    Speed,
    check_generation_flags,
    generate_timed,
    load_inputs,
    resolve_budget,
    settings_of,
    speed_rows,
    token_text,
)
from ddtree_jax.compare.outputs import OutputRecord
from ddtree_jax.compare.report import Comparison, Divergence, Report, Table, verdict_of
from ddtree_jax.pair import generator, plan_from_args, sampling_from_args

HELP = "another system's outputs (SGLang, the DDTree reference, ours) against ours on the same prompts"


def add_arguments(p: argparse.ArgumentParser) -> None:
    """--theirs, --ours (--n: ddtree-generate's, the samples per prompt each file holds)."""
    p.add_argument(
        "--theirs", required=True, help="JSONL: their outputs (ours, SGLang or DDTree reference lines)"
    )
    p.add_argument("--ours", help="JSONL: our outputs already generated (default: generate with the flags)")


def our_records(args: argparse.Namespace, inputs) -> tuple[list[OutputRecord], Speed | None]:
    """Our outputs (every prompt's --n samples) and their generation speed: read from --ours (no
    speed), or generated with ddtree-generate's flags."""
    if args.ours is not None:
        return outputs.read_outputs(args.ours), None
    plan = plan_from_args(inputs.pair, args)
    gen = generator(inputs.pair, plan, sampling_from_args(args) | {"n": args.n}, args.host_stepped)
    results, speed = generate_timed(gen, inputs.prompts, args.batch_size)
    return [outputs.parse_line(r.to_json(), f"generated:{i + 1}", i) for i, r in enumerate(results)], speed


def run(args: argparse.Namespace) -> Report:
    """Read theirs, get ours, compare sample by sample: (prompt id, index), the prompt's --n samples."""
    from ddtree_jax.compare import plots  # matplotlib: imported when a report is made, not for --help
    from ddtree_jax.scheduler import sample_seed

    check_generation_flags(args)
    theirs = outputs.read_outputs(args.theirs)  # bad input fails before any model loads
    inputs = load_inputs(args, with_draft=args.ours is None and args.method != "ar")
    args = resolve_budget(args, inputs.pair.target, inputs.prompts)  # one --budget, as ddtree-generate's
    their_by_key = outputs.match_samples(theirs, inputs.prompts, args.prompts)
    ours_given, speed = our_records(args, inputs)
    our_by_key = outputs.match_samples(ours_given, inputs.prompts, args.prompts)
    defaults = sampling_from_args(args)  # the sampling settings a prompt's own override
    codec = inputs.pair.codec
    wanted = [(p, i) for p in inputs.prompts for i in range(p.options.get("n", args.n))]
    wanted_keys = {(p.id, i) for p, i in wanted}
    scorer, found, compared, missing = None, [], [], []
    for prompt, i in wanted:
        key = (prompt.id, i)
        if key not in their_by_key or key not in our_by_key:
            missing.append(
                {"id": prompt.id, "index": i, "missing_in": "theirs" if key not in their_by_key else "ours"}
            )
            continue
        compared.append(key)
        mine, other_record = our_by_key[key], their_by_key[key]
        texts = outputs.texts_to_compare(mine, other_record, codec)
        if texts is not None and texts[0] == texts[1]:
            continue  # one side has text only: the same text is the same output, however tokenized
        ours = outputs.tokens_of(mine, codec)
        other = outputs.tokens_of(other_record, codec)
        if ours == other and texts is None:
            continue
        scorer = scorer or Scorer.load(args.target)
        options = defaults | {k: v for k, v in prompt.options.items() if k in defaults}
        options["seed"] = sample_seed(options["seed"], i)
        d = divergence(scorer, prompt.id, prompt.input_ids, ours, other, options, args.dtype)
        d = d or Divergence(prompt.id, len(ours), None, {"text_differs": True})  # same tokens, other text
        d.extra["index"] = i
        found.append(d)
    extra = [
        {"id": k[0], "index": k[1], "in": side}
        for side, given in (("theirs", their_by_key), ("ours", our_by_key))
        for k in given
        if k not in wanted_keys
    ]
    our_list = [our_by_key[k] for k in compared]
    their_list = [their_by_key[k] for k in compared]
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
            "samples_per_prompt": args.n,
            "acceptance_source": {k: s for k, (_, s) in acceptance.items()},
            "not_compared": missing,
            "extra_samples": extra,
            "text_only": [{"id": r.id, "index": r.index} for r in their_list if r.output_ids is None],
            "logprobs": logprob_differences(compared, our_list, their_list),
            "speed": None if speed is None else {
                "tokens": speed.tokens,
                "generate_seconds": speed.generate_seconds,
                "tokens_per_second": speed.tokens_per_second,
                "compile_seconds": speed.compile_seconds,
            },
        },
    )  # fmt: skip
    hists = {ours_name: outputs.histogram(our_list), theirs_name: outputs.histogram(their_list)}
    resolved_settings = check_generation_flags(args).with_budget(inputs.pair.target, inputs.prompts).record()
    sides, warning = provenance_of_sides(args, theirs_name, resolved_settings)
    return Report(
        command="external",
        verdict=verdict_of([comparison]),
        summary=summary_line(comparison, acceptance, theirs_name),
        comparisons=[comparison],
        tables=tables(comparison, acceptance, hists, speed, codec),
        notes=notes(comparison) + provenance_notes(sides, warning),
        figures={"acceptance": plots.histogram_bars(hists, f"acceptance lengths: ours vs {theirs_name}")},
        details={
            "settings": settings_of(args, theirs=args.theirs, ours=args.ours or "generated", n=args.n),
            "provenance": {name: p for name, (p, _) in sides.items()},
            "numerics_differences": warning,
        },
    )


def provenance_of_sides(args: argparse.Namespace, theirs_name: str, resolved: dict) -> tuple[dict, list[str]]:
    """{side: (provenance, settings)} of ours (this run's, its settings `resolved` as a sidecar records
    them: ar's budget 0, ddtree's branching; or --ours' sidecar) and theirs (--theirs' sidecar: None for
    another system's file), and what they differ in that changes bfloat16 outputs; both sides printed on
    stderr, the differences as a warning."""
    import sys

    from ddtree_jax import outfile, provenance

    if args.ours is None:
        ours = (
            provenance.provenance(),
            {k: v for k, v in resolved.items() if k in provenance.PROGRAM_SETTINGS},
        )
    else:
        ours = outfile.recorded_provenance(args.ours)
    sides = {"ours": ours, theirs_name: outfile.recorded_provenance(args.theirs)}
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


def logprob_differences(keys: list, ours: list[OutputRecord], theirs: list[OutputRecord]) -> dict | None:
    """|our logprob - theirs| of the chosen tokens over each sample's common token prefix (`keys`: each
    sample's (prompt id, index)): the maximum, the mean and the LARGEST largest (sample, position); None
    when no sample has both sides'."""
    diffs = []
    for id_, a, b in zip(keys, ours, theirs, strict=True):
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
        "largest": [
            {"id": k[0], "index": k[1], "position": p, "ours": x, "theirs": y, "diff": d}
            for d, k, p, x, y in largest
        ],
    }


def summary_line(c: Comparison, acceptance: dict, theirs_name: str) -> str:
    """Match rate, the first divergence, mean acceptance of both."""
    line = f"{theirs_name} identical to ours on {c.identical}/{c.prompts} samples"
    if c.divergences:
        d = c.divergences[0]
        margin = "n/a" if d.margin is None else f"{d.margin:.4g}"
        where = f"prompt {d.id!r} sample {d.extra.get('index', 0)}, position {d.position}"
        line += f" (first divergence: {where}, margin {margin})"
    means = ", ".join(f"{k} {v:.3f}" for k, (v, _) in acceptance.items() if v is not None)
    return line + (f"; mean acceptance {means}" if means else "")


def _samples(keys: list[dict]) -> str:
    return ", ".join(f"{k['id']!r} #{k['index']}" for k in keys)


def notes(c: Comparison) -> list[str]:
    """Caveats a reader needs: samples not compared (missing or extra), outputs re-tokenized from text."""
    out = []
    for side in ("theirs", "ours"):
        if missing := [k for k in c.extra["not_compared"] if k["missing_in"] == side]:
            out.append(f"Not compared, missing in {side}: {_samples(missing)} (prompt id #sample index).")
    for side in ("theirs", "ours"):
        if extra := [k for k in c.extra["extra_samples"] if k["in"] == side]:
            out.append(
                f"Extra samples in {side}, beyond --n {c.extra['samples_per_prompt']} (or the prompt's own "
                f"n), not compared: {_samples(extra)}."
            )
    if c.extra["text_only"]:
        out.append(
            "Compared as text (no output_ids given; the same text agrees, however tokenized): "
            + _samples(c.extra["text_only"])
            + ". Where the texts differ, the divergence's position is in their text encoded with our "
            "tokenizer."
        )
    return out


def tables(c: Comparison, acceptance: dict, hists: dict, speed: Speed | None, codec) -> list[Table]:
    """Match rate, speed and acceptance side by side; divergences (tokens as ids and text); the
    histograms as numbers."""
    side = [[name, mean, source] for name, (mean, source) in acceptance.items()]
    out = [
        Table(
            "Match",
            ["samples compared", "identical", "match rate"],
            [[c.prompts, c.identical, c.identical / max(c.prompts, 1)]],
        ),
    ]
    if speed is not None:
        out.append(
            Table(
                "Our generation (theirs gives no time to compare)", SPEED_HEADER, speed_rows({"ours": speed})
            )
        )
    out.append(
        Table("Mean acceptance length (tokens per round, bonus included)", ["side", "mean", "from"], side)
    )
    if (lp := c.extra.get("logprobs")) is not None:
        out.append(
            Table(
                f"Chosen tokens' log-probabilities, ours vs theirs ({lp['tokens']} tokens generated alike): "
                f"max |diff| {lp['max_abs_diff']:.4g}, mean {lp['mean_abs_diff']:.4g}",
                ["prompt", "sample", "position", "ours", "theirs", "|diff|"],
                [
                    [d["id"], d["index"], d["position"], d["ours"], d["theirs"], d["diff"]]
                    for d in lp["largest"]
                ],
            )
        )
    if c.divergences:
        rows = [
            [
                d.id,
                d.extra.get("index", 0),
                d.position,
                d.margin,
                d.extra.get("gap"),
                d.extra.get("near_tie"),
                token_text(d.extra.get("reference_token"), codec),
                token_text(d.extra.get("token"), codec),
                d.extra.get("reference_is_top1"),
            ]
            for d in c.divergences
        ]
        header = [
            "prompt",
            "sample",
            "position",
            "margin",
            "gap",
            "near-tie",
            "our token",
            "their token",
            "ours top-1 in f32",
        ]
        out.append(Table("Divergences (first position per sample)", header, rows))
    lengths = sorted({n for h in hists.values() for n in h})
    if lengths:
        rows = [[n, *(h.get(n, 0) for h in hists.values())] for n in lengths]
        out.append(Table("Rounds per acceptance length", ["length", *hists], rows))
    return out
