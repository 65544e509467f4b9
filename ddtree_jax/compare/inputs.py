"""What every sub-command starts from: ddtree-generate's flags checked, the pair loaded, the prompts read.

The parsed flags are resolved once into a new namespace (`resolved`: the bundled pair, the method
default); nothing changes a namespace in place."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from ddtree_jax.errors import DDTreeError
from ddtree_jax.pair import Pair, load_pair
from ddtree_jax.prompts import Prompt
from ddtree_jax.results import Result
from ddtree_jax.settings import Settings


@dataclasses.dataclass
class Inputs:
    """The loaded pair and the prompts, in file order."""

    pair: Pair
    prompts: list[Prompt]


def check_generation_flags(args: argparse.Namespace) -> Settings:
    """ddtree-generate's own checks (bundled pair, method, counts, sampling values): its settings. A
    comparison runs one fixed budget (its generator is not the continuous job that chooses)."""
    s = Settings.from_flags(args)
    if s.auto_budgets:
        raise DDTreeError(
            "--budget auto: the comparisons run one fixed budget (only ddtree-generate's continuous job "
            "chooses); give --budget N"
        )
    return s


def resolved(args: argparse.Namespace, method: bool = True) -> argparse.Namespace:
    """The flags with ddtree-generate's defaults filled in (the bundled pair and its prompts; the
    method when `method`), as a new namespace."""
    s = check_generation_flags(args)
    fill = dict(target=s.target, draft=s.draft, prompts=s.prompts) | (dict(method=s.method) if method else {})
    return argparse.Namespace(**vars(args) | fill)


def resolve_budget(args: argparse.Namespace, cfg, prompts: list[Prompt]) -> argparse.Namespace:
    """The flags with ddtree's one --budget resolved as ddtree-generate resolves it (from the target's
    kind and the prompts' mean context), as a new namespace."""
    budget = check_generation_flags(args).with_budget(cfg, prompts).budget
    return argparse.Namespace(**vars(args) | {"budget": budget if args.method == "ddtree" else args.budget})


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
    """Run `gen` over every prompt, static batches of `batch_size` in prompt order."""
    return list(gen.scheduled(policy="static", batch_size=batch_size).run(prompts))


@dataclasses.dataclass(frozen=True)
class Speed:
    """One method's generation over the prompts: output tokens and seconds, compilation left out."""

    tokens: int
    generate_seconds: float
    compile_seconds: float

    @property
    def tokens_per_second(self) -> float | None:
        """Output tokens per second of generation (None when nothing was timed)."""
        return self.tokens / self.generate_seconds if self.generate_seconds > 0 else None


def generate_timed(gen, prompts: list[Prompt], batch_size: int) -> tuple[list[Result], Speed]:
    """`generate_all`, with its generation and compilation seconds."""
    g = gen.scheduled(policy="static", batch_size=batch_size)
    compiled = g.compile_seconds
    results = list(g.run(prompts))
    tokens = sum(len(r.output_ids) for r in results)
    return results, Speed(tokens, g.generate_seconds, g.compile_seconds - compiled)


def speed_rows(speeds: dict[str, Speed]) -> list[list]:
    """The rows of a report's speed table: method, output tokens, generation s, tok/s, compile s."""
    return [
        [name, s.tokens, round(s.generate_seconds, 3), s.tokens_per_second, round(s.compile_seconds, 2)]
        for name, s in speeds.items()
    ]


SPEED_HEADER = ["method", "output tokens", "generation s", "tok/s", "compile s"]


def token_text(token: int | None, codec) -> str | None:
    """A token as a report shows it: its id and, with a tokenizer, its text beside it."""
    if token is None:
        return None
    return f"{token} {codec.decode([token])!r}" if codec is not None else str(token)


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
    """The generation settings a report records (the flags as checked, defaults filled in; a setting
    left unset, such as ar's budget, left out)."""
    from ddtree_jax.pair import sampling_from_args

    out = {
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
    return {k: v for k, v in out.items() if v is not None}
