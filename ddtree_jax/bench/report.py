"""What every `ddtree-bench` sub-command shares: its flag parser (one-line errors), its main's prologue
(`run_subcommand`), the run header written into its JSON, `--deadline-s`, and the checks and writes of
`--out`."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import platform
import shlex
import sys
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import jax

from ddtree_jax import settings
from ddtree_jax.errors import DDTreeError

EXIT_ERROR = 1  # a bad flag or --out (one line, before any work), or a measurement that failed


class Parser(settings.Parser):
    """ddtree-generate's parser class: no abbreviations, one-line usage errors (EXIT_ERROR), a "did you
    mean" for unknown flags."""


def parser(name: str, doc: str, epilog: str | None = None) -> Parser:
    """The parser of sub-command `name` (prog "ddtree-bench NAME"), described by the first line of `doc`."""
    return Parser(
        prog=f"ddtree-bench {name}",
        description=doc.strip().splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        epilog=epilog,
    )


def add_deadline(p: argparse.ArgumentParser) -> None:
    """`--deadline-s`: the one time limit of every sub-command that takes one (`--budget-s`, its old
    spelling, still accepted: "budget" is the tree's node count)."""
    p.add_argument(
        "--deadline-s",
        type=float,
        default=None,
        help="start no new measurement this many seconds after the command started; what is left out is "
        "listed under 'skipped' in --out, and the exit status stays 0 (default: no limit)",
    )
    add_deprecated(p, "--budget-s", "--deadline-s", type=float)


# The release after which the old spellings of flags are refused (docs/layout.md, "Which name").
DEPRECATED_UNTIL = "0.2"


class _Deprecated(argparse.Action):
    """An old spelling of a flag: stores into the new flag's dest and says so on stderr."""

    def __init__(self, option_strings, dest, new: str, **kwargs):
        self.new = new
        super().__init__(option_strings, dest, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        print(
            f"{parser.prog}: warning: {option_string} is deprecated and goes after {DEPRECATED_UNTIL}: "
            f"use {self.new}",
            file=sys.stderr,
        )
        setattr(namespace, self.dest, True if self.nargs == 0 else values)  # nargs 0: a store_true flag


def add_deprecated(p: argparse.ArgumentParser, old: str, new: str, flag: bool = False, **kwargs) -> None:
    """Accept `old` as a deprecated spelling of the flag `new` (declared on `p` too): the same dest, a
    warning when used, hidden from --help. `flag`: a store_true flag (no value)."""
    dest = new.lstrip("-").replace("-", "_")
    if flag:
        kwargs["nargs"] = 0
    p.add_argument(
        old,
        dest=dest,
        action=_Deprecated,
        new=new,
        default=argparse.SUPPRESS,
        help=argparse.SUPPRESS,
        **kwargs,
    )


def run_subcommand(
    name: str,
    p: argparse.ArgumentParser,
    argv: list[str] | None,
    run: Callable[[argparse.Namespace, list[str], Deadline], int],
) -> int:
    """A sub-command's main: parse `argv` (None: sys.argv's) with `p`, start the `--deadline-s` clock,
    check `--deadline-s` and `--out`, then `run(args, command, deadline)` (`command`: the command line as
    run, for the run header). The exit status: run's; 0 for --help; EXIT_ERROR for a usage error or a
    DDTreeError, printed as one line `ddtree-bench NAME: error: ...`."""
    try:
        args = p.parse_args(argv)
    except SystemExit as e:  # --help (0) or a usage error (EXIT_ERROR)
        return e.code if isinstance(e.code, int) else EXIT_ERROR
    deadline = Deadline(args.deadline_s)
    try:
        check_deadline(args.deadline_s)
        if args.out is not None:  # None: a sub-command's --print, which writes nothing
            check_out_path(args.out)
        return run(args, command_line(name, argv), deadline)
    except DDTreeError as e:
        print(f"ddtree-bench {name}: error: {e}", file=sys.stderr)
        return EXIT_ERROR


def run_header(command: list[str], device: tuple[str, int] | None = None) -> dict[str, Any]:
    """What every benchmark JSON records of its run (its "meta"): date, machine, the device's name, the
    provenance (`provenance.provenance`: package version, source commit and whether the tree is dirty,
    jax and jaxlib, Python, platform, device kind and count) and the command line (`argv`, a list;
    `command`, the same as one shell line). `device`: (kind, count) of a device jax does not run on (a
    torch benchmark); jax is then not asked, so it claims no device memory."""
    from ddtree_jax.provenance import provenance

    name = str(jax.devices()[0]) if device is None else device[0]
    return {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": platform.node(),
        "device": name,
        **provenance(device),
        "argv": command,
        "command": shlex.join(command),
    }


def command_line(name: str, argv: list[str] | None) -> list[str]:
    """The command line of sub-command `name` as run: `ddtree-bench NAME ARGS...` (argv None: sys.argv's)."""
    return ["ddtree-bench", name, *(sys.argv[1:] if argv is None else argv)]


@dataclasses.dataclass
class Deadline:
    """`--deadline-s` of one run: whether a new measurement may start, and what was left out (`prog`:
    the program named on stderr)."""

    seconds: float | None
    start: float = dataclasses.field(default_factory=time.monotonic)
    skipped: list[Any] = dataclasses.field(default_factory=list)
    prog: str = "ddtree-bench"

    def left(self) -> float:
        """Seconds until the deadline: inf without one, negative once it has passed."""
        return math.inf if self.seconds is None else self.seconds - (time.monotonic() - self.start)

    def allows(self, what: Any) -> bool:
        """True while the deadline has not passed; else records `what` as skipped and says so on stderr."""
        if self.seconds is None or time.monotonic() - self.start < self.seconds:
            return True
        self.skipped.append(what)
        print(
            f"{self.prog}: --deadline-s {self.seconds:g} passed: skipped {what}", file=sys.stderr, flush=True
        )
        return False


def check_deadline(seconds: float | None) -> None:
    """--deadline-s, when given, is positive."""
    if seconds is not None and not seconds > 0:
        raise DDTreeError(f"--deadline-s {seconds:g}: must be > 0")


def check_out_path(out: str) -> None:
    """--out can be written: not a directory, in a directory that exists and is writable."""
    path = Path(out)
    if path.is_dir():
        raise DDTreeError(f"--out {out}: is a directory")
    parent = path.resolve().parent
    if not parent.is_dir():
        raise DDTreeError(f"--out {out}: directory {parent} does not exist")
    if not os.access(parent, os.W_OK | os.X_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise DDTreeError(f"--out {out}: not writable")


def write_json(out: str | Path, data: dict) -> None:
    """Write `data` to `out` whole (a temporary file renamed over it: a run cut short leaves the last
    complete version)."""
    path = Path(out)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(data, indent=1, default=str) + "\n")  # default: numpy scalars, dtypes
    os.replace(tmp, path)
