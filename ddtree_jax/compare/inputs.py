"""What every sub-command starts from: ddtree-generate's flags checked, the pair loaded, the prompts read."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from ddtree_jax.errors import DDTreeError
from ddtree_jax.generation import Result
from ddtree_jax.pair import Pair, load_pair
from ddtree_jax.prompts import Prompt


@dataclasses.dataclass
class Inputs:
    """The loaded pair and the prompts, in file order."""

    pair: Pair
    prompts: list[Prompt]


def check_generation_flags(args: argparse.Namespace) -> None:
    """ddtree-generate's own checks (bundled pair defaults, method default, sampling values)."""
    from ddtree_jax.cli import check_args

    check_args(args)


def load_inputs(args: argparse.Namespace, with_draft: bool) -> Inputs:
    """Load the target (and the drafter when `with_draft`) and read the prompts as ddtree-generate does."""
    from ddtree_jax.cli import check_lengths
    from ddtree_jax.prompts import LIMIT, scan_prompts, tokenize

    records = scan_prompts(args.prompts)
    for r in records:  # the references run one limit for every prompt; refused before any weight loads
        if LIMIT in r.options:
            raise DDTreeError(
                f"{args.prompts}:{r.line}: '{LIMIT}' per prompt is for ddtree-generate; the comparisons "
                "run --max-new-tokens for every prompt"
            )
    pair = load_pair(
        args.target,
        args.draft if with_draft else None,
        args.dtype,
        args.tp,
        args.dp,
        moe_sharding=args.moe_sharding,
        draft_yarn_scaling=args.draft_yarn_scaling,
        dequantize=args.dequantize,
    )
    prompts = tokenize(records, args.prompts, pair.codec, not args.no_chat_template, pair.target.vocab_size)
    check_lengths(prompts, pair.target.max_position_embeddings, args.max_new_tokens)
    return Inputs(pair, prompts)


def generate_all(gen, prompts: list[Prompt], batch_size: int) -> list[Result]:
    """Run `gen` over every prompt, `batch_size` at a time, in prompt order."""
    results = []
    for start in range(0, len(prompts), batch_size):
        results += gen.run_batch(prompts[start : start + batch_size])
    return results


def mean_acceptance(results: list[Result]) -> float | None:
    """Tokens per round over every round of `results` (None when there were no rounds)."""
    accepted = [a for r in results for a in r.acceptance_lengths]
    return sum(accepted) / len(accepted) if accepted else None


def shown_path(path: str | None) -> str | None:
    """A path as a report shows it: relative to the working directory when inside it."""
    if path is None:
        return None
    here, full = Path.cwd(), Path(path).resolve()
    return str(full.relative_to(here)) if full.is_relative_to(here) else str(path)


def settings_of(args: argparse.Namespace, **extra) -> dict:
    """The generation settings a report records (the flags as checked, defaults filled in)."""
    from ddtree_jax.pair import sampling_from_args

    return {
        "target": shown_path(args.target),
        "draft": shown_path(args.draft),
        "prompts": shown_path(args.prompts),
        "method": args.method,
        "dtype": args.dtype,
        "max_new_tokens": args.max_new_tokens,
        "batch_size": args.batch_size,
        "budget": args.budget,
        "branching": args.branching,
        "block_size": args.block_size,
        "sampling": sampling_from_args(args),
        **extra,
    }
