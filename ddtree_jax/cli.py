"""`ddtree-generate`: batched offline generation from a JSONL prompts file to a JSONL outputs file.

What runs: the flags become one frozen `settings.Settings`; `prepare` checks everything that needs no
weight (the --out path, the prompts file, the configs, the limits) and resolves the budget; the pair
loads (pair.py); one host loop (scheduler.py) drives the device programs (programs.py) whose rounds
are engine.py's; each finished prompt's line is appended to --out as it comes.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import math
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

from ddtree_jax import compile_cache
from ddtree_jax.errors import DDTreeError
from ddtree_jax.outfile import STDOUT, Interrupted, Writer, check_out, finished_ids, interruptible
from ddtree_jax.prompts import KNOWN_KEYS, id_key, scan_prompts, tokenize
from ddtree_jax.settings import BUNDLED, GENERATE, Settings, add_flags

__all__ = ["BUNDLED", "main"]

EXIT_ERROR = 1  # bad flags (argparse's too), input, checkpoint or output path: one line, no output file
EXIT_SIGNAL = 128  # + the signal's number: 130 after SIGINT, 143 after SIGTERM (finished lines kept)

EPILOG = f"""prompt lines (JSONL, one object per line; keys: {", ".join(KNOWN_KEYS)}):
  {{"id": ..., "prompt": "text"}}, {{"id": ..., "messages": [{{"role": ..., "content": ...}}]}} or
  {{"id": ..., "input_ids": [ints]}}; optional per-line temperature, top_k, top_p, seed override the flags;
  an optional per-line max_new_tokens (at most --max-new-tokens) ends that prompt earlier.
  Ids must be unique (default: the line's index among the prompts); unknown keys are refused.

output: one JSON line per prompt, written as each prompt finishes (so in finishing order; with
  --static-batches batch by batch, in input order); the settings go to OUT.settings.json, which --resume
  checks: a resumed run's lines are those of an uninterrupted run with the same settings.

exit status: 0 done; {EXIT_ERROR} an error (flag, input, checkpoint or output path; one line on stderr);
  {EXIT_SIGNAL + 2} after SIGINT, {EXIT_SIGNAL + 15} after SIGTERM (finished lines kept; --resume goes on);
  {EXIT_SIGNAL + 13} when standard output closes early (--out - | head)."""


class _Formatter(argparse.RawDescriptionHelpFormatter):
    """Help lines end with the flag's default unless they already say it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        quiet = action.default is None or action.default is False or action.default == argparse.SUPPRESS
        if not quiet and "default" not in text:
            text += " (default: %(default)s)"
        return text


class _Parser(argparse.ArgumentParser):
    """argparse whose usage errors are one line and exit with EXIT_ERROR, like every other error."""

    def error(self, message: str):
        self.exit(EXIT_ERROR, f"{self.prog}: error: {message} (--help lists the flags)\n")


def build_parser() -> argparse.ArgumentParser:
    """The command-line interface."""
    p = _Parser(
        prog="ddtree-generate",
        description="Batched generation with autoregressive, DFlash or DDTree decoding.",
        epilog=EPILOG,
        formatter_class=_Formatter,
    )
    add_flags(p, GENERATE)
    return p


# -- checks that need the configs -----------------------------------------------------------------


def check_limits(s: Settings, cfg, dcfg) -> None:
    """Upper bounds of --max-new-tokens, --block-size and --branching from the configs."""
    if s.max_new_tokens >= cfg.max_position_embeddings:
        raise DDTreeError(
            f"--max-new-tokens {s.max_new_tokens}: the target's context holds "
            f"{cfg.max_position_embeddings} positions, prompt included"
        )
    if dcfg is not None and s.block_size is not None and s.block_size > dcfg.block_size:
        raise DDTreeError(f"--block-size {s.block_size} exceeds the drafter's {dcfg.block_size}")
    if s.method == "ddtree" and s.branching is not None and s.branching > cfg.vocab_size:
        raise DDTreeError(f"--branching {s.branching} exceeds the vocabulary ({cfg.vocab_size} tokens)")


def check_budget(s: Settings, dcfg) -> None:
    """--budget (as resolved) at most the nodes of the drafter's top-k lattice."""
    if s.method != "ddtree":
        return
    depth = (s.block_size or dcfg.block_size) - 1
    lattice = sum(s.branching**d for d in range(1, depth + 1))
    if s.budget > lattice:
        raise DDTreeError(
            f"--budget {s.budget} exceeds the {lattice} nodes of the drafter's lattice "
            f"({depth} depths of {s.branching} candidates, --branching): no tree that large exists"
        )


def device_memory() -> int:
    """Bytes of one device's memory (the host's RAM for CPU devices, which report none)."""
    import jax

    stats = jax.local_devices()[0].memory_stats() or {}
    if "bytes_limit" in stats:
        return int(stats["bytes_limit"])
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def check_memory(s: Settings, cfg, dcfg) -> None:
    """An upper bound of --budget from the device's memory: the tree's float32 attention scores."""
    if s.method != "ddtree":
        return
    from ddtree_jax import models
    from ddtree_jax.budgets import rows_per_device
    from ddtree_jax.programs import rows_to_run

    depth = (s.block_size or dcfg.block_size) - 1
    rows = rows_to_run(s.method, rows_per_device(s.batch_size, s.dp), cfg)
    heads = models.family(cfg).heads_per_device(cfg, s.tp)
    context = 16 + s.max_new_tokens + depth + 1  # the smallest cache a prompt gets
    per_pair = rows * heads * 4  # float32 attention scores per (tree token, key) pair
    memory = device_memory()
    tree = s.budget + 1
    need = per_pair * tree * (tree + context)
    if need > memory // 2:
        fits = int((-context + math.sqrt(context**2 + 4 * (memory // 2) / per_pair)) / 2) - 1
        raise DDTreeError(
            f"--budget {s.budget}: verifying {tree} tree tokens takes float32 attention scores of {rows} "
            f"rows x {heads} heads x {tree} x {tree + context} positions = {need / 1e9:.1f} GB per device, "
            f"more than half of its {memory / 1e9:.1f} GB; at most --budget {max(fits, 0)} fits"
        )


def check_lengths(prompts, max_positions: int, max_new_tokens: int, path: str = "prompts") -> None:
    """Every prompt plus its generation must fit the model's context."""
    for p in prompts:
        if len(p.input_ids) + max_new_tokens > max_positions:
            raise DDTreeError(
                f"{path}:{p.line}: prompt {p.id!r}: {len(p.input_ids)} tokens + --max-new-tokens "
                f"{max_new_tokens} exceed the model's context of {max_positions}"
            )


# -- the run --------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Prepared:
    """A run checked before any weight loads: its settings (budget resolved), the configs and the
    tokenizer (each read once), every prompt of the file and the ids already in --out."""

    settings: Settings
    target_cfg: Any
    draft_cfg: Any
    codec: Any
    prompts: list
    done: frozenset


def prepare(s: Settings) -> Prepared:
    """Every check that needs no weight: --out, the prompts file, the configs, the limits."""
    from ddtree_jax.config import load_draft_config
    from ddtree_jax.models import load_target_config
    from ddtree_jax.text import TextCodec

    if s.is_writer:
        check_out(s.out, s.prompts, s.resume, s.overwrite)
    records = scan_prompts(s.prompts, s.max_line_bytes, s.max_new_tokens)
    cfg = load_target_config(s.target, moe_sharding=s.moe_sharding)
    dcfg = load_draft_config(s.draft, cfg, s.draft_yarn_scaling) if s.draft else None
    check_limits(s, cfg, dcfg)
    codec = TextCodec(s.target) if (Path(s.target) / "tokenizer.json").exists() else None
    prompts = tokenize(records, s.prompts, codec, s.chat_template, cfg.vocab_size)
    s = s.with_budget(cfg, prompts)  # from the whole file, resumed or not: one budget per --out
    check_budget(s, dcfg)
    check_lengths(prompts, cfg.max_position_embeddings, s.max_new_tokens, s.prompts)
    done = finished_ids(s.out, s.record()) if s.resume else set()
    start_processes(s)
    check_memory(s, cfg, dcfg)
    return Prepared(s, cfg, dcfg, codec, prompts, frozenset(done))


def start_processes(s: Settings) -> None:
    """Join the other processes through jax.distributed (before JAX touches any device)."""
    if s.processes is None:
        return
    import jax

    p = s.processes
    try:
        jax.distributed.initialize(p.coordinator, p.count, p.index)
    except Exception as e:  # noqa: BLE001 (jax raises RuntimeError or XlaRuntimeError, with long texts)
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise DDTreeError(f"--coordinator {p.coordinator}: cannot join the processes ({first})") from None


def summarize(results, gen, wall: float, batch_size: int) -> str:
    """The end-of-run summary (`batch_size`: the prompts per batch asked for)."""
    tokens = sum(len(r.output_ids) for r in results)
    accepted = [a for r in results for a in r.acceptance_lengths]
    plan, rows = gen.plan, gen.rows_run
    lines = [
        f"method: {plan.method}"
        + (f"   budget: {plan.budget}   branching: {plan.branching}" if plan.method == "ddtree" else "")
        + f"   batch size: {batch_size}"
        + (f" (run as {rows} rows)" if rows != batch_size else "")
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


def generate_all(run: Prepared, gen, writer: Writer) -> list:
    """Run every prompt not yet in --out through the host loop; process 0 writes each line as its
    prompt finishes."""
    from tqdm import tqdm

    s = run.settings
    left = sum(id_key(p.id) not in run.done for p in run.prompts)
    results = []
    try:
        finished = gen.run(run.prompts, skip=run.done)
        for result in tqdm(
            finished, total=left, desc="prompts", unit="prompt", file=sys.stderr, disable=not s.is_writer
        ):
            results.append(result)
            if s.is_writer:
                writer.write([result.to_json()])
    except Interrupted as e:
        e.kept = f"{writer.written} new results written to {s.out}"  # not a note: JAX adds its own
        raise
    finally:
        writer.close()
    return results


def run(s: Settings) -> None:
    """Generate for every prompt not yet in --out, appending each result as it finishes."""
    from ddtree_jax.checkpoint import params_cache
    from ddtree_jax.pair import load_generator

    start = time.perf_counter()
    prepared = prepare(s)
    s = prepared.settings
    compile_cache.enable(s.compile_cache)  # after prepare: jax.distributed starts first
    report = sys.stderr if s.out == STDOUT else sys.stdout
    if all(id_key(p.id) in prepared.done for p in prepared.prompts):
        print(f"all {len(prepared.done)} prompts are already in {s.out}: nothing to do", file=report)
        return
    with params_cache(s.params_cache):
        gen = load_generator(s, prepared.target_cfg, prepared.draft_cfg, prepared.codec)
    results = generate_all(prepared, gen, Writer(s.out, s.record(), append=s.resume))
    if s.is_writer:
        print(summarize(results, gen, time.perf_counter() - start, s.batch_size), file=report)


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the exit status (see EPILOG)."""
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as e:  # --help (0) or a usage error (EXIT_ERROR)
        return e.code if isinstance(e.code, int) else EXIT_ERROR
    try:
        with interruptible():
            run(Settings.from_flags(args))
    except DDTreeError as e:
        print(f"ddtree-generate: error: {e}", file=sys.stderr)
        return EXIT_ERROR
    except Interrupted as e:
        where = f" ({e.kept}; --resume continues)" if e.kept else ""
        print(f"ddtree-generate: interrupted by {e}{where}", file=sys.stderr)
        return EXIT_SIGNAL + e.signum
    except BrokenPipeError:  # standard output closed early (| head): stop quietly, as other tools do
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit
        return EXIT_SIGNAL + signal.SIGPIPE
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
