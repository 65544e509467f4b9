"""The outputs file: checked before any work, appended and flushed line by line, resumable, and
interrupted only between lines (SIGINT, SIGTERM)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TextIO

from ddtree_jax.errors import DDTreeError
from ddtree_jax.prompts import id_key

# The settings that decide what an output line holds. --resume refuses to continue a file made with
# other values.
SETTINGS = (
    "target",
    "draft",
    "method",
    "dtype",
    "max_new_tokens",
    "temperature",
    "top_k",
    "top_p",
    "seed",
    "no_chat_template",
    "budget",
    "branching",
    "block_size",
    "draft_window",
    "draft_yarn_scaling",
    "dequantize",
)
# The settings that decide a run's shapes, kernels and reduction orders: float32 outputs do not depend
# on them (the same tokens whatever the batch, mesh or schedule), bfloat16 outputs do, so --resume
# refuses to change them unless both runs are float32.
SCHEDULE_SETTINGS = (
    "batch_size",
    "static_batches",
    "batch_invariant",
    "host_stepped",
    "tp",
    "dp",
    "prefill_chunk",
    "prefill_attention",
    "attention",
    "moe_sharding",
)
STDOUT = "-"


class Interrupted(Exception):
    """SIGINT or SIGTERM arrived; raised between output lines, never inside one."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum
        self.kept: str | None = None  # what was written before it (set by the writer's caller)


def settings_path(out: Path) -> Path:
    """The sidecar recording the settings an outputs file was made with: OUT.settings.json."""
    return out.with_name(out.name + ".settings.json")


def check_out(out: str, prompts: str, resume: bool, overwrite: bool) -> None:
    """Refuse an --out that would be lost or would clobber something, before any work starts."""
    if resume and overwrite:
        raise DDTreeError("--resume and --overwrite exclude each other")
    if out == STDOUT:
        if resume:
            raise DDTreeError("--resume needs an --out file (standard output cannot be resumed)")
        return
    path = Path(out)
    if path.is_dir():
        raise DDTreeError(f"--out {out}: is a directory")
    target = path.resolve()  # a symlinked --out is written through its link
    same = target.exists() and Path(prompts).exists() and os.path.samefile(target, prompts)
    if same or target == Path(prompts).resolve():
        raise DDTreeError(f"--out {out}: is the prompts file")
    parent = target.parent
    if not parent.is_dir():
        raise DDTreeError(f"--out {out}: directory {parent} does not exist")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise DDTreeError(f"--out {out}: directory {parent} is not writable")
    if target.exists():
        if not os.access(target, os.W_OK):
            raise DDTreeError(f"--out {out}: not writable")
        if not (resume or overwrite):
            raise DDTreeError(f"--out {out}: exists; --resume continues it, --overwrite replaces it")


def finished_ids(out: str, settings: dict[str, Any]) -> set[str]:
    """--resume: the ids (`prompts.id_key`) already in --out, after checking its settings sidecar.
    A last line cut short (a killed run) is dropped from the file."""
    path = Path(out)
    if not path.exists():
        return set()
    raw = path.read_bytes()
    if raw and not raw.endswith(b"\n"):
        keep = raw.rfind(b"\n") + 1
        with open(path, "r+b") as f:
            f.truncate(keep)
        print(f"ddtree-generate: {out}: dropped an unfinished last line", file=sys.stderr)
        raw = raw[:keep]
    if not raw:
        return set()
    _check_settings(path, settings)
    done = set()
    for n, line in enumerate(raw.decode("utf-8", errors="replace").splitlines(), start=1):
        try:
            record = json.loads(line)
            done.add(id_key(record["id"]))
        except (json.JSONDecodeError, KeyError, TypeError):
            raise DDTreeError(f"{out}:{n}: not an output line of ddtree-generate; cannot resume") from None
    return done


def _check_settings(path: Path, settings: dict[str, Any]) -> None:
    """Refuse to resume a file made with other settings (or with no record of them)."""
    sidecar = settings_path(path)
    try:
        stored = json.loads(sidecar.read_text())
    except FileNotFoundError:
        raise DDTreeError(
            f"--resume: {sidecar} is missing, so {path} cannot be checked against these settings; "
            "--overwrite starts afresh"
        ) from None
    except json.JSONDecodeError:
        raise DDTreeError(f"--resume: {sidecar}: not valid JSON") from None
    keys = SETTINGS
    if not stored.get("dtype") == settings.get("dtype") == "float32":
        keys += SCHEDULE_SETTINGS
    diff = [k for k in keys if stored.get(k) != settings.get(k)]
    if diff:
        what = ", ".join(f"--{k.replace('_', '-')} {stored.get(k)!r} (now {settings.get(k)!r})" for k in diff)
        raise DDTreeError(f"--resume: {path} was made with other settings: {what}")


class Writer:
    """Appends one JSON line per finished prompt, flushed at once; opens --out at the first line, so
    that a run failing before any result leaves no file."""

    def __init__(self, out: str, settings: dict[str, Any], append: bool):
        self.out, self.settings, self.append = out, settings, append
        self.file: TextIO | None = None
        self.written = 0

    def _open(self) -> TextIO:
        if self.out == STDOUT:
            return sys.stdout
        path = Path(self.out)
        file = open(path, "a" if self.append else "w")  # noqa: SIM115 (0666 less the umask; through links)
        settings_path(path).write_text(json.dumps(self.settings, indent=1) + "\n")
        return file

    def write(self, rows: list[dict]) -> None:
        """Write and flush `rows`, each a whole line; a signal arriving meanwhile waits for the last."""
        with _guard.critical():
            if self.file is None:
                self.file = self._open()
            for row in rows:
                self.file.write(json.dumps(row) + "\n")
                self.file.flush()
                self.written += 1

    def close(self) -> None:
        """Close the file (not standard output)."""
        if self.file is not None and self.file is not sys.stdout:
            self.file.close()
        self.file = None


class _Guard:
    """SIGINT/SIGTERM handling: raise `Interrupted`, or, inside `critical()`, right after it."""

    def __init__(self):
        self.depth = 0
        self.pending: int | None = None

    def handler(self, signum: int, frame) -> None:
        self.pending = signum
        if self.depth == 0:
            raise Interrupted(signum)

    @contextlib.contextmanager
    def critical(self) -> Iterator[None]:
        self.depth += 1
        try:
            yield
        finally:
            self.depth -= 1
        if self.depth == 0 and self.pending is not None:
            raise Interrupted(self.pending)


_guard = _Guard()


@contextlib.contextmanager
def interruptible() -> Iterator[None]:
    """SIGINT and SIGTERM raise `Interrupted` (between output lines) within this block."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = {s: signal.signal(s, _guard.handler) for s in (signal.SIGINT, signal.SIGTERM)}
    _guard.pending = None
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)
