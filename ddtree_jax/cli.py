"""`ddtree-generate`: batched offline generation from a JSONL prompts file to a JSONL outputs file."""

from __future__ import annotations

import argparse
import collections
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

from ddtree_jax.budgets import (
    DEFAULT_BUDGETS,
    MOE_DEFAULT_BUDGETS,
    default_branching,
    default_budget,
    describe,
    rows_per_device,
    run_context,
)
from ddtree_jax.errors import DDTreeError
from ddtree_jax.outfile import STDOUT, Interrupted, Writer, check_out, finished_ids, interruptible
from ddtree_jax.prompts import KNOWN_KEYS, LIMIT, MAX_LINE_BYTES, id_key, scan_prompts, tokenize

BUNDLED = Path(__file__).parent / "assets" / "default_pair"


EXIT_ERROR = 1  # bad flags (argparse's too), input, checkpoint or output path: one line, no output file
EXIT_SIGNAL = 128  # + the signal's number: 130 after SIGINT, 143 after SIGTERM (finished lines kept)

EPILOG = f"""prompt lines (JSONL, one object per line; keys: {", ".join(KNOWN_KEYS)}):
  {{"id": ..., "prompt": "text"}}, {{"id": ..., "messages": [{{"role": ..., "content": ...}}]}} or
  {{"id": ..., "input_ids": [ints]}}; optional per-line temperature, top_k, top_p, seed override the flags;
  an optional per-line max_new_tokens (at most --max-new-tokens) ends that prompt earlier.
  Ids must be unique (default: the line's index among the prompts); unknown keys are refused.

output: one JSON line per prompt, in input order, flushed as each prompt finishes; the settings that
  decide its contents go to OUT.settings.json, which --resume checks.

exit status: 0 done; {EXIT_ERROR} an error (flag, input, checkpoint or output path; one line on stderr);
  {EXIT_SIGNAL + 2} after SIGINT, {EXIT_SIGNAL + 15} after SIGTERM (finished lines kept; --resume goes on)."""


class _Formatter(argparse.RawDescriptionHelpFormatter):
    """Help lines end with the flag's default unless they already say it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        quiet = action.default is None or action.default is False or action.default == argparse.SUPPRESS
        if not quiet and "default" not in text:
            text += " (default: %(default)s)"
        return text


class _Parser(argparse.ArgumentParser):
    """argparse whose usage errors exit with EXIT_ERROR, like every other error."""

    def error(self, message: str):
        self.print_usage(sys.stderr)
        self.exit(EXIT_ERROR, f"{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    """The command-line interface."""
    p = _Parser(
        prog="ddtree-generate",
        description="Batched generation with autoregressive, DFlash or DDTree decoding.",
        epilog=EPILOG,
        formatter_class=_Formatter,
    )
    p.add_argument("--target", help="HF target directory (Qwen3 or Llama 3); default: the bundled code model")
    p.add_argument(
        "--draft", help="DFlash drafter directory (z-lab layout); default with no --target: the bundled one"
    )
    p.add_argument(
        "--prompts",
        help="JSONL: {id, prompt | messages | input_ids}; default with no --target: bundled code starts",
    )
    p.add_argument(
        "--out",
        required=True,
        help="JSONL output, one line per prompt, in the order they finish; '-' for standard output (the "
        "summary then goes to stderr). An existing file needs --resume or --overwrite",
    )
    p.add_argument("--resume", action="store_true", help="skip the ids already in --out, append the rest")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --out")
    p.add_argument(
        "--method", choices=["ar", "dflash", "ddtree"], help="default: ddtree with --draft, else ar"
    )
    p.add_argument("--max-new-tokens", type=int, default=128, help="tokens generated per prompt at most")
    p.add_argument("--batch-size", type=int, default=8, help="prompts generated together")
    p.add_argument(
        "--dtype",
        choices=["bfloat16", "float32"],
        default="bfloat16",
        help="compute dtype (float32 also sets the highest matmul precision)",
    )
    p.add_argument("--seed", type=int, default=0, help="sampling seed of prompts that set none")
    p.add_argument("--no-chat-template", action="store_true", help="encode 'prompt' text as is")
    p.add_argument(
        "--budget",
        type=int,
        help="ddtree: tree nodes besides the root (default by rows per --dp device and the prompts' mean "
        f"length plus their new tokens: {describe(DEFAULT_BUDGETS)}; mixture-of-experts targets: "
        f"{describe(MOE_DEFAULT_BUDGETS)})",
    )
    p.add_argument(
        "--block-size", type=int, help="draft block size (<= the drafter's, the default; depth = block - 1)"
    )
    p.add_argument(
        "--branching", type=int, help="ddtree: drafter candidates per depth (default min(budget, 32))"
    )
    p.add_argument(
        "--draft-window", type=int, help="drafter attends to the last N context tokens only (default: all)"
    )
    p.add_argument(
        "--draft-yarn-scaling",
        choices=["legacy", "hf"],
        help="a yarn drafter's cos/sin factor when its config gives none: legacy = 1 + 0.1 ln(factor) "
        "(default: what the Kimi-K2.5 DFlash drafter was trained with), hf = today's transformers "
        "mscale ratio; default: the drafter config's dflash_config.yarn_scaling, else legacy",
    )
    p.add_argument(
        "--attention",
        choices=["auto", "reference", "pallas"],
        default="auto",
        help="decode attention: the Pallas kernel (auto on GPU) or the jnp reference",
    )
    p.add_argument("--host-stepped", action="store_true", help="drive rounds from Python, time each stage")
    p.add_argument(
        "--prefill-chunk",
        type=int,
        default=256,
        help="prefill tokens per row per step (a power of two >= 16)",
    )
    p.add_argument(
        "--prefill-attention",
        choices=("same", "cudnn"),
        default="same",
        help="the prefill chunks' attention: the decode attention (same) or, on CUDA in bf16, cuDNN flash "
        "attention (faster for one long prompt, slower for continuous refills: results/notes.md)",
    )
    p.add_argument(
        "--batch-invariant",
        action="store_true",
        help="fixed shapes: a prompt's tokens do not depend on the prompts beside it (bfloat16 too)",
    )
    p.add_argument(
        "--static-batches",
        action="store_true",
        help="run --batch-size prompts at a time, each batch until its slowest row (no continuous batching)",
    )
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (0 = greedy)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1 = off)")
    p.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens (0 = off)")
    p.add_argument(
        "--tp", type=int, default=1, help="tensor-parallel devices: heads, MLP columns and vocabulary split"
    )
    p.add_argument(
        "--dp", type=int, default=1, help="data-parallel devices: the batch split (padded to a multiple)"
    )
    p.add_argument(
        "--params-cache",
        metavar="DIR",
        help="convert the checkpoints once into orbax checkpoints under DIR (keyed by the checkpoint's "
        "files, --dtype and the layout) and restore them from there afterwards (default: off)",
    )
    p.add_argument(
        "--max-line-bytes",
        type=int,
        default=MAX_LINE_BYTES,
        help="refuse a prompts line longer than this before decoding it",
    )
    p.add_argument(
        "--coordinator",
        metavar="HOST:PORT",
        help="several processes (one per host): process 0's address for jax.distributed "
        "(default: one process)",
    )
    p.add_argument("--num-processes", type=int, help="several processes: how many (with --coordinator)")
    p.add_argument(
        "--process-id", type=int, help="several processes: this one's index; process 0 writes --out"
    )
    p.add_argument(
        "--moe-sharding",
        choices=["ep", "tp"],
        default="ep",
        help="MoE targets under --tp: whole experts per device (ep) or columns of every expert (tp)",
    )
    p.add_argument(
        "--dequantize",
        action="store_true",
        help="a quantized target (FP8 block-scaled, INT4 experts): expand its weights to --dtype at load, "
        "for comparison (default: kept quantized in device memory)",
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
    if args.method == "ar" and args.draft is not None:
        raise DDTreeError("--draft applies to --method dflash and ddtree; --method ar uses no drafter")
    use_bundled_pair(args)
    _positive(
        args,
        "max_new_tokens",
        "batch_size",
        "budget",
        "branching",
        "draft_window",
        "tp",
        "dp",
        "max_line_bytes",
    )
    if args.prefill_chunk < 16 or args.prefill_chunk & (args.prefill_chunk - 1):
        raise DDTreeError(f"--prefill-chunk must be a power of two >= 16, got {args.prefill_chunk}")
    if args.method is None:
        args.method = "ddtree" if args.draft else "ar"
    if args.method == "ar":
        args.draft = None  # the bundled pair's drafter is not used
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
    check_processes(args)


def check_processes(args: argparse.Namespace) -> None:
    """--coordinator, --num-processes and --process-id come together, with a valid process id."""
    given = [args.coordinator is not None, args.num_processes is not None, args.process_id is not None]
    if not any(given):
        return
    if not all(given):
        raise DDTreeError("--coordinator, --num-processes and --process-id go together")
    if args.num_processes < 1 or not 0 <= args.process_id < args.num_processes:
        raise DDTreeError(
            f"--process-id {args.process_id} must be in [0, --num-processes {args.num_processes})"
        )
    if args.resume and args.num_processes > 1:
        raise DDTreeError("--resume runs in one process only (the others cannot read --out)")
    if ":" not in args.coordinator:
        raise DDTreeError(f"--coordinator {args.coordinator}: expected HOST:PORT")


def is_writer(args: argparse.Namespace) -> bool:
    """Whether this process writes --out and the summary (process 0, or the only process)."""
    return not args.process_id


def start_processes(args: argparse.Namespace) -> None:
    """Join the other processes through jax.distributed (before JAX touches any device)."""
    if args.num_processes is None:
        return
    import jax

    try:
        jax.distributed.initialize(args.coordinator, args.num_processes, args.process_id)
    except Exception as e:  # noqa: BLE001 (jax raises RuntimeError or XlaRuntimeError, with long texts)
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise DDTreeError(f"--coordinator {args.coordinator}: cannot join the processes ({first})") from None


def resolve_budget(args: argparse.Namespace, cfg, prompts: list) -> None:
    """Fill in --budget when ddtree runs without one: the default for the run's rows per device, its
    target's kind (`cfg`) and the mean context of `prompts` (each one's length plus its new tokens)."""
    if args.method != "ddtree" or args.budget is not None:
        return
    context = run_context([len(p.input_ids) + p.options.get(LIMIT, args.max_new_tokens) for p in prompts])
    args.budget = default_budget(rows_per_device(args.batch_size, args.dp), cfg, context)


def resolved_budget(args: argparse.Namespace) -> int:
    """The ddtree budget this run uses (0 for ar and dflash), once `resolve_budget` has filled it in."""
    return args.budget if args.method == "ddtree" else 0


def output_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The settings an output line depends on (`outfile.SETTINGS`), as this run resolves them."""
    budget = resolved_budget(args)
    return {
        "target": str(Path(args.target).resolve()),
        "draft": str(Path(args.draft).resolve()) if args.draft else None,
        "method": args.method,
        "dtype": args.dtype,
        "max_new_tokens": args.max_new_tokens,
        "temperature": args.temperature,
        "top_k": args.top_k,
        "top_p": args.top_p,
        "seed": args.seed,
        "no_chat_template": args.no_chat_template,
        "budget": budget,
        "branching": (args.branching or default_branching(args.method, budget))
        if args.method == "ddtree"
        else None,
        "block_size": args.block_size,
        "draft_window": args.draft_window,
    }


def device_memory() -> int:
    """Bytes of one device's memory (the host's RAM for CPU devices, which report none)."""
    import jax

    stats = jax.local_devices()[0].memory_stats() or {}
    if "bytes_limit" in stats:
        return int(stats["bytes_limit"])
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def check_limits(args: argparse.Namespace, cfg, dcfg) -> None:
    """Upper bounds of --max-new-tokens, --block-size and --branching from the configs."""
    if args.max_new_tokens >= cfg.max_position_embeddings:
        raise DDTreeError(
            f"--max-new-tokens {args.max_new_tokens}: the target's context holds "
            f"{cfg.max_position_embeddings} positions, prompt included"
        )
    if dcfg is not None and args.block_size is not None and args.block_size > dcfg.block_size:
        raise DDTreeError(f"--block-size {args.block_size} exceeds the drafter's {dcfg.block_size}")
    if args.method != "ddtree":
        return
    if args.branching is not None and args.branching > cfg.vocab_size:
        raise DDTreeError(f"--branching {args.branching} exceeds the vocabulary ({cfg.vocab_size} tokens)")


def check_budget(args: argparse.Namespace, cfg, dcfg) -> None:
    """--budget (as resolved) at most the nodes of the drafter's top-k lattice."""
    if args.method != "ddtree":
        return
    budget = resolved_budget(args)
    k = min(args.branching or default_branching(args.method, budget), cfg.vocab_size)
    depth = (args.block_size or dcfg.block_size) - 1
    lattice = sum(k**d for d in range(1, depth + 1))
    if budget > lattice:
        raise DDTreeError(
            f"--budget {budget} exceeds the {lattice} nodes of the drafter's lattice "
            f"({depth} depths of {k} candidates, --branching): no tree that large exists"
        )


def check_memory(args: argparse.Namespace, cfg, dcfg) -> None:
    """An upper bound of --budget from the device's memory: the tree's float32 attention scores."""
    if args.method != "ddtree":
        return
    from ddtree_jax import models
    from ddtree_jax.engine import rows_to_run

    budget = resolved_budget(args)
    depth = (args.block_size or dcfg.block_size) - 1
    rows = rows_to_run(args.method, rows_per_device(args.batch_size, args.dp))
    heads = models.family(cfg).heads_per_device(cfg, args.tp)
    context = 16 + args.max_new_tokens + depth + 1  # the smallest cache a prompt gets
    per_pair = rows * heads * 4  # float32 attention scores per (tree token, key) pair
    memory = device_memory()
    tree = budget + 1
    need = per_pair * tree * (tree + context)
    if need > memory // 2:
        fits = int((-context + math.sqrt(context**2 + 4 * (memory // 2) / per_pair)) / 2) - 1
        raise DDTreeError(
            f"--budget {budget}: verifying {tree} tree tokens takes float32 attention scores of {rows} rows "
            f"x {heads} heads x {tree} x {tree + context} positions = {need / 1e9:.1f} GB per device, more "
            f"than half of its {memory / 1e9:.1f} GB; at most --budget {max(fits, 0)} fits"
        )


def make_generator(args: argparse.Namespace):
    """Load target, drafter and tokenizer, and describe the program to compile (ddtree_jax.pair)."""
    from ddtree_jax.pair import load_generator

    return load_generator(args)


def check_lengths(prompts, max_positions: int, max_new_tokens: int, path: str = "prompts") -> None:
    """Every prompt plus its generation must fit the model's context."""
    for p in prompts:
        if len(p.input_ids) + max_new_tokens > max_positions:
            raise DDTreeError(
                f"{path}:{p.line}: prompt {p.id!r}: {len(p.input_ids)} tokens + --max-new-tokens "
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
    occ = gen.occupancy
    if occ.chunks:
        lines.append(
            f"rows busy: {occ.busy / max(occ.row_rounds, 1):.1%} of {occ.row_rounds} row-rounds, "
            f"{occ.waiting_fraction():.1%} while prompts waited   refills: {occ.refills}"
        )
    if gen.stage_seconds:
        lines.append("stage seconds: " + " ".join(f"{k}={v:.3f}" for k, v in gen.stage_seconds.items()))
    return "\n".join(lines)


def prepare(args: argparse.Namespace) -> tuple[list, dict[str, Any], int]:
    """Every check that needs no weight: flags, --out, the prompts file, the configs, the limits.
    Returns the prompts still to generate (tokenised), the output settings and how many are done."""
    from ddtree_jax.config import load_draft_config
    from ddtree_jax.models import load_target_config
    from ddtree_jax.text import TextCodec

    check_args(args)
    if is_writer(args):
        check_out(args.out, args.prompts, args.resume, args.overwrite)
    records = scan_prompts(args.prompts, args.max_line_bytes, args.max_new_tokens)
    cfg = load_target_config(args.target)
    dcfg = load_draft_config(args.draft, cfg) if args.method != "ar" else None
    check_limits(args, cfg, dcfg)
    codec = TextCodec(args.target) if (Path(args.target) / "tokenizer.json").exists() else None
    prompts = tokenize(records, args.prompts, codec, not args.no_chat_template, cfg.vocab_size)
    resolve_budget(args, cfg, prompts)  # from the whole file, resumed or not: one budget per --out
    check_budget(args, cfg, dcfg)
    check_lengths(prompts, cfg.max_position_embeddings, args.max_new_tokens, args.prompts)
    settings = output_settings(args)
    done = finished_ids(args.out, settings) if args.resume else set()
    prompts = [p for p in prompts if id_key(p.id) not in done]
    start_processes(args)
    check_memory(args, cfg, dcfg)
    return prompts, settings, len(done)


def generate_all(args: argparse.Namespace, gen, prompts: list, writer: Writer) -> list:
    """Run the prompts (continuous batching, or static batches); process 0 writes each line as its
    prompt finishes."""
    from tqdm import tqdm

    if args.static_batches or args.host_stepped or (args.num_processes or 1) > 1:
        # several processes gather each batch's outputs (generation._fetch); the stream does not yet
        batches = [prompts[i : i + args.batch_size] for i in range(0, len(prompts), args.batch_size)]
        finished = (r for batch in batches for r in gen.run_batch(batch))
    else:
        finished = gen.stream(prompts)  # continuous batching: each result as its row finishes
    results = []
    try:
        for result in tqdm(
            finished,
            total=len(prompts),
            desc="prompts",
            unit="prompt",
            file=sys.stderr,
            disable=not is_writer(args),
        ):
            results.append(result)
            if is_writer(args):
                writer.write([result.to_json()])
    except Interrupted as e:
        e.kept = f"{writer.written} new results written to {args.out}"  # not a note: JAX adds its own
        raise
    finally:
        writer.close()
    return results


def run(args: argparse.Namespace) -> None:
    """Generate for every prompt not yet in --out, appending each result as it finishes."""
    from ddtree_jax.checkpoint import params_cache

    start = time.perf_counter()
    prompts, settings, done = prepare(args)
    report = sys.stderr if args.out == STDOUT else sys.stdout
    if not prompts:
        print(f"all {done} prompts are already in {args.out}: nothing to do", file=report)
        return
    with params_cache(args.params_cache):
        gen = make_generator(args)
    results = generate_all(args, gen, prompts, Writer(args.out, settings, append=args.resume))
    if is_writer(args):
        print(summarize(results, gen, time.perf_counter() - start, args.batch_size), file=report)


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the exit status (see EPILOG)."""
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as e:  # --help (0) or a usage error (EXIT_ERROR)
        return e.code if isinstance(e.code, int) else EXIT_ERROR
    try:
        with interruptible():
            run(args)
    except DDTreeError as e:
        print(f"ddtree-generate: error: {e}", file=sys.stderr)
        return EXIT_ERROR
    except Interrupted as e:
        where = f" ({e.kept}; --resume continues)" if e.kept else ""
        print(f"ddtree-generate: interrupted by {e}{where}", file=sys.stderr)
        return EXIT_SIGNAL + e.signum
    except OSError as e:  # an unreadable file the checks above did not foresee: one line, no traceback
        print(f"ddtree-generate: error: {e.filename or ''}: {e.strerror or e}", file=sys.stderr)
        return EXIT_ERROR
    except RuntimeError as e:
        if type(e).__name__ not in ("JaxRuntimeError", "XlaRuntimeError"):
            raise  # a bug: keep its traceback
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        print(
            f"ddtree-generate: error: the device failed ({first}); finished lines are kept", file=sys.stderr
        )
        return EXIT_ERROR
    return 0


if __name__ == "__main__":
    sys.exit(main())
