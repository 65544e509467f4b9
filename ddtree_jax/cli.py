"""`ddtree-generate`: batched offline generation from a JSONL prompts file to a JSONL outputs file."""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import tempfile
import time
from pathlib import Path

from ddtree_jax.errors import DDTreeError

# The ddtree budget when --budget is not given, by the rows each data-parallel device runs
# (--batch-size / --dp; the entry of the largest key <= it): the budget with the highest projected
# tokens/s = acceptance(budget) x ar step / ddtree round, from the bundled pair's acceptance curve and
# Qwen3-8B-shaped round times on one H200 at 1k context (results/h200/README.md, "Default budget per
# batch size"): from 16 rows budget 7 beats 3, 5 and 15 (batch 16) and 15 (batch 32). At batch 1, 15
# and 31 project within 0.3% of each other; the smaller tree is kept.
DEFAULT_BUDGETS = {1: 15, 16: 7}


def default_budget(batch_size: int) -> int:
    """The ddtree budget used for `batch_size` rows when --budget is not given."""
    return DEFAULT_BUDGETS[max(b for b in DEFAULT_BUDGETS if b <= batch_size)]


BUNDLED = Path(__file__).parent / "assets" / "default_pair"


def build_parser() -> argparse.ArgumentParser:
    """The command-line interface."""
    p = argparse.ArgumentParser(
        prog="ddtree-generate",
        description="Batched generation with autoregressive, DFlash or DDTree decoding.",
    )
    p.add_argument("--target", help="HF target directory (Qwen3 or Llama 3); default: the bundled code model")
    p.add_argument(
        "--draft", help="DFlash drafter directory (z-lab layout); default with no --target: the bundled one"
    )
    p.add_argument(
        "--prompts",
        help="JSONL: {id, prompt | messages | input_ids}; default with no --target: bundled code starts",
    )
    p.add_argument("--out", required=True, help="JSONL output, one line per prompt, input order")
    p.add_argument(
        "--method", choices=["ar", "dflash", "ddtree"], help="default: ddtree with --draft, else ar"
    )
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    p.add_argument("--seed", type=int, default=0, help="sampling seed of prompts that set none")
    p.add_argument("--no-chat-template", action="store_true", help="encode 'prompt' text as is")
    p.add_argument(
        "--budget",
        type=int,
        help="ddtree: tree nodes besides the root (default by rows per --dp device: "
        + ", ".join(f"{n} from batch {b}" for b, n in DEFAULT_BUDGETS.items())
        + ")",
    )
    p.add_argument("--block-size", type=int, help="draft block size (<= the drafter's; depth = block - 1)")
    p.add_argument(
        "--branching", type=int, help="ddtree: drafter candidates per depth (default min(budget, 32))"
    )
    p.add_argument("--draft-window", type=int, help="drafter attends to the last N context tokens only")
    p.add_argument(
        "--attention",
        choices=["auto", "reference", "pallas"],
        default="auto",
        help="decode attention: the Pallas kernel (auto on GPU) or the jnp reference",
    )
    p.add_argument("--host-stepped", action="store_true", help="drive rounds from Python, time each stage")
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (0 = greedy)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1 = off)")
    p.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens (0 = off)")
    p.add_argument(
        "--tp", type=int, default=1, help="tensor-parallel devices: heads, MLP columns and vocabulary split"
    )
    p.add_argument(
        "--dp", type=int, default=1, help="data-parallel devices: the batch split (padded to a multiple)"
    )
    return p


def _positive(args, *names):
    for name in names:
        value = getattr(args, name)
        if value is not None and value < 1:
            raise DDTreeError(f"--{name.replace('_', '-')} must be >= 1, got {value}")


def use_bundled_pair(args: argparse.Namespace) -> None:
    """No --target: the bundled default pair (and its prompts unless --prompts is given)."""
    if args.target is not None:
        if args.prompts is None:
            raise DDTreeError("--prompts FILE is required with --target")
        return
    if args.draft is not None:
        raise DDTreeError("--draft needs --target (the bundled target comes with its own drafter)")
    args.target, args.draft = str(BUNDLED / "target"), str(BUNDLED / "draft")
    if args.prompts is None:
        args.prompts = str(BUNDLED / "prompts.jsonl")


def check_args(args: argparse.Namespace) -> None:
    """Reject flag combinations before any model is loaded."""
    use_bundled_pair(args)
    _positive(args, "max_new_tokens", "batch_size", "budget", "branching", "draft_window", "tp", "dp")
    if args.method is None:
        args.method = "ddtree" if args.draft else "ar"
    if args.method != "ar" and not args.draft:
        raise DDTreeError(f"--method {args.method} needs --draft DIR")
    if args.method != "ddtree" and (args.budget or args.branching):
        raise DDTreeError("--budget and --branching apply to --method ddtree only")
    from ddtree_jax.sampling import check

    for name in ("temperature", "top_k", "top_p", "seed"):
        if (why := check(name, getattr(args, name))) is not None:
            raise DDTreeError(f"--{name.replace('_', '-')} {why}")
    if args.block_size is not None and args.block_size < 2:
        raise DDTreeError("--block-size must be >= 2")


def make_generator(args: argparse.Namespace):
    """Load target, drafter and tokenizer, and describe the program to compile (ddtree_jax.pair)."""
    from ddtree_jax.pair import load_generator

    return load_generator(args)


def check_lengths(prompts, max_positions: int, max_new_tokens: int) -> None:
    """Every prompt plus its generation must fit the model's context."""
    for p in prompts:
        if len(p.input_ids) + max_new_tokens > max_positions:
            raise DDTreeError(
                f"prompt {p.id!r} (line {p.line}): {len(p.input_ids)} tokens + --max-new-tokens "
                f"{max_new_tokens} exceed the model's context of {max_positions}"
            )


def summarize(results, gen, wall: float, batch_size: int) -> str:
    """The end-of-run summary (`batch_size`: the prompts per batch asked for)."""
    tokens = sum(len(r.output_ids) for r in results)
    accepted = [a for r in results for a in r.acceptance_lengths]
    plan = gen.plan_template
    lines = [
        f"method: {plan.method}"
        + (f"   budget: {plan.budget}   branching: {plan.branching}" if plan.method == "ddtree" else "")
        + f"   batch size: {batch_size}"
        + (f" (run as {plan.batch_size} rows)" if plan.batch_size != batch_size else "")
        + f"   attention: {plan.attention}",
        f"prompts: {len(results)}   output tokens: {tokens}   "
        f"generation: {gen.generate_seconds:.2f} s ({tokens / max(gen.generate_seconds, 1e-9):.1f} tok/s)   "
        f"compile: {gen.compile_seconds:.2f} s   wall: {wall:.2f} s",
    ]
    if accepted:
        hist = collections.Counter(accepted)
        lines.append(
            f"mean acceptance length: {sum(accepted) / len(accepted):.3f} over {len(accepted)} rounds   "
            "histogram: " + " ".join(f"{k}:{hist[k]}" for k in sorted(hist))
        )
    if gen.stage_seconds:
        lines.append("stage seconds: " + " ".join(f"{k}={v:.3f}" for k, v in gen.stage_seconds.items()))
    return "\n".join(lines)


def run(args: argparse.Namespace) -> None:
    """Generate for every prompt and write the output file atomically."""
    from tqdm import tqdm

    from ddtree_jax.prompts import read_prompts

    start = time.perf_counter()
    check_args(args)
    out_path = Path(args.out)
    if not out_path.parent.exists():
        raise DDTreeError(f"{out_path.parent}: output directory does not exist")
    gen = make_generator(args)
    cfg = gen.plan_template.target
    prompts = read_prompts(args.prompts, gen.codec, not args.no_chat_template, cfg.vocab_size)
    check_lengths(prompts, cfg.max_position_embeddings, args.max_new_tokens)
    batches = [prompts[i : i + args.batch_size] for i in range(0, len(prompts), args.batch_size)]
    fd, tmp = tempfile.mkstemp(dir=out_path.parent, prefix=f".{out_path.name}.", suffix=".tmp")
    results = []
    try:
        with os.fdopen(fd, "w") as f:
            for batch in tqdm(batches, desc="batches", unit="batch", file=sys.stderr):
                for result in gen.run_batch(batch):
                    results.append(result)
                    f.write(json.dumps(result.to_json()) + "\n")
        os.replace(tmp, out_path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    print(summarize(results, gen, time.perf_counter() - start, args.batch_size))


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the exit status."""
    args = build_parser().parse_args(argv)
    try:
        run(args)
    except DDTreeError as e:
        print(f"ddtree-generate: error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
