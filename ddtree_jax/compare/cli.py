"""`ddtree-compare SUBCOMMAND`: the parser and main. Every sub-command takes ddtree-generate's shared
flag groups (settings.py) that it honours, declared in FLAGS, and no other of ddtree-generate's.

A sub-command is a module of this package with `HELP` (one line), `add_arguments(parser)` for its own
flags and `run(args) -> Report`; listing its name in SUBCOMMANDS plugs it in.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys
import time
from pathlib import Path

from ddtree_jax import settings
from ddtree_jax.errors import DDTreeError

SUBCOMMANDS = ("lossless", "reference", "external", "distribution")
# ddtree-generate's flags each sub-command honours: the pair, the prompts and the decoding flags for
# all; lossless runs every method at its --budgets (no --method, --budget); reference decodes greedily
# (its PyTorch side has no sampler and no draft window) and not host-stepped; external and
# distribution run one method at one budget; external compares --n samples per prompt.
SHARED = (*settings.PAIR, *settings.PROMPTS, "max_new_tokens", "batch_size", "block_size", "branching")
SHARED += ("attention", *settings.COMPILE)
FLAGS = {
    "lossless": (*SHARED, "draft_window", *settings.SAMPLING, "host_stepped"),
    "reference": (*SHARED, "method"),
    "external": (*SHARED, "draft_window", *settings.SAMPLING, *settings.RUN, "n"),
    "distribution": (*SHARED, "draft_window", *settings.SAMPLING, *settings.RUN),
}
# The sub-commands that run one method: ddtree-generate's default --method is filled in (reference runs
# every method unless --method names one; lossless runs them all).
ONE_METHOD = ("external", "distribution")


def subcommand(name: str):
    """The module that implements sub-command `name`."""
    return importlib.import_module(f"ddtree_jax.compare.{name}")


def add_generation_flags(parser: argparse.ArgumentParser, name: str) -> None:
    """Give sub-command `name`'s parser the flags of ddtree-generate it honours; the others keep their
    defaults (ddtree-generate's checks read them)."""
    settings.add_flags(parser, FLAGS[name])
    parser.set_defaults(**settings.defaults(tuple(f for f in settings.GENERATE if f not in FLAGS[name])))


def build_parser() -> argparse.ArgumentParser:
    """ddtree-compare's parser: one sub-parser per module in SUBCOMMANDS."""
    p = settings.Parser(  # (its sub-parsers are of its class: no abbreviations, one-line errors)
        prog="ddtree-compare",
        description="Compare decoders' outputs, acceptance and sampling distributions; write a report.",
    )
    subs = p.add_subparsers(dest="command", required=True, metavar="SUBCOMMAND")
    for name in SUBCOMMANDS:
        module = subcommand(name)
        sub = subs.add_parser(
            name, help=module.HELP, description=module.HELP, formatter_class=settings.HelpFormatter
        )
        sub.add_argument("--report", required=True, help="directory for report.md, report.json and plots")
        add_generation_flags(sub, name)
        module.add_arguments(sub)
    return p


def run(args: argparse.Namespace, argv: list[str]) -> str:
    """Run the sub-command and write its report; returns the one-line verdict."""
    from ddtree_jax import compile_cache
    from ddtree_jax.bench.report import run_header
    from ddtree_jax.compare.inputs import resolved
    from ddtree_jax.compare.report import check_report_dir, write_report

    start = time.perf_counter()
    report_dir = Path(args.report)
    check_report_dir(report_dir)
    compile_cache.enable(args.compile_cache)  # a shared flag (settings.COMPILE)
    report = subcommand(args.command).run(resolved(args, method=args.command in ONE_METHOD))
    meta = run_header(["ddtree-compare", *argv]) | {"wall_s": round(time.perf_counter() - start, 1)}
    write_report(report_dir, report, meta)
    return f"{args.command}: {report.verdict}: {report.summary}"


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the exit status (0 when it ran, whatever the verdict)."""
    argv = sys.argv[1:] if argv is None else argv
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as e:  # --help (0) or a usage error (1)
        return e.code if isinstance(e.code, int) else 1
    if importlib.util.find_spec("matplotlib") is None:  # the report's plots; --help reads without it
        print("ddtree-compare: error: needs matplotlib: pip install 'ddtree-jax[compare]'", file=sys.stderr)
        return 1
    try:
        print(run(args, argv))
    except DDTreeError as e:
        print(f"ddtree-compare: error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
