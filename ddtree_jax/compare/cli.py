"""`ddtree-compare SUBCOMMAND`: the parser (ddtree-generate's flags on every sub-command) and main.

A sub-command is a module of this package with `HELP` (one line), `add_arguments(parser)` for its own
flags and `run(args) -> Report`; listing its name in SUBCOMMANDS plugs it in.
"""

from __future__ import annotations

import argparse
import copy
import importlib
import importlib.util
import sys
import time
from pathlib import Path

from ddtree_jax.errors import DDTreeError

SUBCOMMANDS = ("lossless", "reference", "external", "distribution")
NOT_GENERATION_FLAGS = (  # ddtree-generate's flags no sub-command takes: the output file and processes
    "help",
    "out",
    "resume",
    "overwrite",
    "coordinator",
    "num_processes",
    "process_id",
)


def subcommand(name: str):
    """The module that implements sub-command `name`."""
    return importlib.import_module(f"ddtree_jax.compare.{name}")


def add_generation_flags(parser: argparse.ArgumentParser) -> None:
    """Give `parser` ddtree-generate's model, prompt and generation flags (the same definitions)."""
    from ddtree_jax.cli import build_parser

    for action in build_parser()._actions:
        if action.dest not in NOT_GENERATION_FLAGS:
            parser._add_action(copy.copy(action))  # a copy: sub-commands may change defaults
        elif action.dest != "help":
            parser.set_defaults(**{action.dest: action.default})  # ddtree-generate's checks read them


class _Parser(argparse.ArgumentParser):
    """argparse whose usage errors exit 1, like every other error (sub-parsers are of this class too)."""

    def error(self, message: str):
        self.exit(1, f"{self.prog}: error: {message} (--help lists the flags)\n")


def build_parser() -> argparse.ArgumentParser:
    """ddtree-compare's parser: one sub-parser per module in SUBCOMMANDS."""
    p = _Parser(
        prog="ddtree-compare",
        description="Compare decoders' outputs, acceptance and sampling distributions; write a report.",
    )
    subs = p.add_subparsers(dest="command", required=True, metavar="SUBCOMMAND")
    for name in SUBCOMMANDS:
        module = subcommand(name)
        sub = subs.add_parser(name, help=module.HELP, description=module.HELP)
        sub.add_argument("--report", required=True, help="directory for report.md, report.json and plots")
        add_generation_flags(sub)
        module.add_arguments(sub)
    return p


def run(args: argparse.Namespace, argv: list[str]) -> str:
    """Run the sub-command and write its report; returns the one-line verdict."""
    from ddtree_jax import compile_cache
    from ddtree_jax.compare.report import check_report_dir, run_metadata, write_report

    start = time.perf_counter()
    report_dir = Path(args.report)
    check_report_dir(report_dir)
    compile_cache.enable(args.compile_cache)  # the flag comes with ddtree-generate's (add_generation_flags)
    report = subcommand(args.command).run(args)
    write_report(report_dir, report, run_metadata(argv, time.perf_counter() - start))
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
