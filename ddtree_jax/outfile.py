"""The outputs file: checked before any work, appended and flushed line by line, resumable, and
interrupted only between lines (SIGINT, SIGTERM)."""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import hashlib
import json
import os
import signal
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TextIO

from ddtree_jax import provenance
from ddtree_jax.errors import DDTreeError
from ddtree_jax.prompts import id_key, sample_key, scan_prompts

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
    "n",
    "stop",
    "include_stop_str_in_output",
    "logprobs",
    "logprobs_mode",
    "no_chat_template",
    "budget",
    "branching",
    "block_size",
    "draft_window",
    "draft_yarn_scaling",
    "dequantize",
    "output_format",
)
SCHEDULE_SETTINGS = provenance.SCHEDULE_SETTINGS  # the shapes' settings: --resume holds them in bf16
# Settings added since the first sidecars: a sidecar without one was made with this value.
ADDED_SETTINGS = {
    "n": 1, "stop": [], "include_stop_str_in_output": False, "logprobs": 0, "logprobs_mode": "raw",
    "output_format": "ours", "scan_layers": False, "auto_budgets": [],
}  # fmt: skip
STDOUT = "-"


class Interrupted(Exception):
    """SIGINT or SIGTERM arrived; raised between output lines, never inside one."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum
        self.kept: str | None = None  # what was written before it (set by the writer's caller)
        self.results: list = []  # the results written before it (their summary is printed)


def settings_path(out: Path) -> Path:
    """The sidecar recording the settings an outputs file was made with: OUT.settings.json."""
    return out.with_name(out.name + ".settings.json")


def recorded_provenance(path: str | Path) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    """(provenance, settings) an outputs file's sidecar OUT.settings.json records; (None,
    None) without a readable sidecar (another system's file), provenance None for a sidecar older than
    the record."""
    try:
        record = json.loads(settings_path(Path(path)).read_text())
    except (OSError, ValueError):
        return None, None
    if not isinstance(record, dict):
        return None, None
    return record.get("provenance"), record


def lock_path(out: Path) -> Path:
    """The lock file held while a run writes an outputs file: OUT.lock, beside it."""
    return out.with_name(out.name + ".lock")


# The locks this process holds: resolved --out path -> the open lock file. One run at a time per process
# (a new check_out releases the last run's lock), every lock released at exit.
_locks: dict[Path, int] = {}


def lock_out(target: Path, out: str) -> None:
    """Hold an exclusive lock on --out (its resolved path) for this run, or refuse: another run writing
    the same file would splice its lines into ours and rewrite the settings sidecar."""
    if target in _locks:
        return
    release_locks()
    path = lock_path(target)
    while True:  # the holder unlinks the lock file before closing it: lock, then check it is still there
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 64).decode(errors="replace").strip()
            os.close(fd)
            pid = f" (pid {holder})" if holder.isdigit() else ""
            raise DDTreeError(
                f"--out {out}: another run{pid} is writing it (lock {path}); "
                "wait for it or choose another --out"
            ) from None
        try:
            same = os.fstat(fd).st_ino == os.stat(path).st_ino
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()}\n".encode())
    _locks[target] = fd


def release_locks() -> None:
    """Drop every --out lock this process holds (the lock file is removed while still locked)."""
    while _locks:
        target, fd = _locks.popitem()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(lock_path(target))
        os.close(fd)


atexit.register(release_locks)


# The settings sidecar's record of each prompt as it was generated: id_key(id) -> the SHA-256 of the
# prompt as written (its prompt / messages / input_ids and its own settings, `prompt_digest`). The token
# ids themselves are not hashed: they follow from the prompt and the settings the sidecar already
# checks (--target's tokenizer and template, --no-chat-template). --resume refuses a prompt whose line
# changed since its output was written, naming its id.
PROMPT_DIGESTS = "prompt_sha256"
_digests: dict[Path, dict[str, str]] = {}  # resolved --out -> this run's prompt digests


def prompt_digest(record) -> str:
    """SHA-256 of one scanned prompt line (`prompts.Record`) as written, its id left out."""
    text = json.dumps([record.kind, record.value, record.options], sort_keys=True, ensure_ascii=False)
    return hashlib.sha256(text.encode()).hexdigest()


def _prompt_digests(prompts: str) -> dict[str, str] | None:
    """Every prompt's digest by id_key, or None when the file does not scan (the run's own scan,
    next, reports why)."""
    try:
        return {id_key(r.id): prompt_digest(r) for r in scan_prompts(prompts, max_line_bytes=1 << 40)}
    except DDTreeError:
        return None


def check_out(out: str, prompts: str, resume: bool, overwrite: bool) -> None:
    """Refuse an --out that would be lost or would clobber something, before any work starts; then lock
    it for this run (`lock_out`) and note its prompts' digests (`PROMPT_DIGESTS`)."""
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
    lock_out(target, out)
    _digests.clear()
    if (digests := _prompt_digests(prompts)) is not None:
        _digests[target] = digests
    if target.exists():
        if not os.access(target, os.W_OK):
            raise DDTreeError(f"--out {out}: not writable")
        if not (resume or overwrite):
            raise DDTreeError(f"--out {out}: exists; --resume continues it, --overwrite replaces it")


def finished_ids(out: str, settings: dict[str, Any]) -> set[str]:
    """--resume: the samples (`prompts.sample_key` of each line's id and index) already in --out, after
    checking its settings sidecar, its lines and its prompts (none changed since). Only then is a last
    line cut short (a killed run) dropped from the file: a refused resume leaves it as it was."""
    path = Path(out)
    if not path.exists():
        return set()
    raw = path.read_bytes()
    if not raw:
        return set()
    stored = _check_settings(path, settings)
    keep = len(raw) if raw.endswith(b"\n") else raw.rfind(b"\n") + 1
    done, ids = set(), set()
    for n, line in enumerate(raw[:keep].decode("utf-8", errors="replace").splitlines(), start=1):
        try:
            record = json.loads(line)
            if "custom_id" in record:  # an OpenAI batch output line: every sample of its prompt
                body = (record.get("response") or {}).get("body") or {}
                for i in range(max(len(body.get("choices") or ()), 1)):
                    done.add(sample_key(record["custom_id"], i))
                ids.add(id_key(record["custom_id"]))
                continue
            done.add(sample_key(record["id"], record.get("index", 0)))
            ids.add(id_key(record["id"]))
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError):
            raise DDTreeError(f"{out}:{n}: not an output line of ddtree-generate; cannot resume") from None
    _check_prompts(path, stored.get(PROMPT_DIGESTS), _digests.get(path.resolve()), ids)
    if keep < len(raw):
        with open(path, "r+b") as f:
            f.truncate(keep)
        print(f"ddtree-generate: {out}: dropped an unfinished last line", file=sys.stderr)
    return done


def _check_prompts(path: Path, stored: dict | None, now: dict | None, done: set[str]) -> None:
    """Refuse to resume when a prompt with an output in `path` has changed since (its digest differs)."""
    if not stored or not now:  # a file from before digests were recorded: nothing to compare
        return
    changed = [key for key in sorted(done) if key in stored and key in now and stored[key] != now[key]]
    if changed:
        ids = ", ".join(changed[:5]) + (f" and {len(changed) - 5} more" if len(changed) > 5 else "")
        raise DDTreeError(
            f"--resume: {len(changed)} prompts changed since their outputs in {path} were written (ids "
            f"{ids}); delete their lines from {path} to generate them again, or --overwrite"
        )


def _check_settings(path: Path, settings: dict[str, Any]) -> dict[str, Any]:
    """Refuse to resume a file made with other settings (or with no record of them); returns the record."""
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
    elif stored.get("auto_budgets") or settings.get("auto_budgets"):  # (every budget's float32 tokens
        keys = tuple(k for k in keys if k not in ("budget", "branching"))  # are the same: --budget auto)
    diff = [k for k in keys if stored.get(k, ADDED_SETTINGS.get(k)) != settings.get(k)]
    if diff:
        what = ", ".join(_flag(k, stored.get(k, ADDED_SETTINGS.get(k)), settings.get(k)) for k in diff)
        raise DDTreeError(f"--resume: {path} was made with other settings: {what}")
    return stored


def _flag(name: str, before: Any, now: Any) -> str:
    """One setting --resume refuses to change, as the flag that sets it: '--top-k 0 (now 5)'."""
    if name == "auto_budgets":  # (no flag of its own: --budget auto, or a fixed --budget)
        before, now = (f"auto ({', '.join(map(str, v))})" if v else "fixed" for v in (before, now))
        return f"--budget {before} (now {now})"
    return f"--{name.replace('_', '-')} {before!r} (now {now!r})"


# The sidecar's list of the provenance records of earlier runs whose lines are in the file, when a
# --resume was made by other code, jax or device (None: a sidecar that recorded none).
EARLIER_PROVENANCE = "earlier_provenance"


def resumed_provenance_warning(path: Path, before: dict[str, Any] | None, now: dict[str, Any]) -> str | None:
    """--resume's warning when the lines already in `path` were made (`before`: its sidecar's provenance;
    None: a sidecar older than the record) by other code, jax, jaxlib or device than this run (`now`),
    naming the fields, and saying which change bfloat16 outputs (`provenance.numerics_differences`, as
    `ddtree-compare external` warns); None when they are the same."""
    if before is None:
        return f"--resume: {settings_path(path)} records no provenance: what made the lines so far is unknown"
    changed = provenance.changed_fields(before, now)
    numerics = provenance.numerics_differences(before, now)  # 'FIELD A -> B ...' each
    what = [f"{k} {before[k]!r} -> {now[k]!r}" for k in changed]
    what += [d for d in numerics if d.split(" ", 1)[0] not in changed]  # uncommitted edits on both
    if not what:
        return None
    message = (
        f"--resume: the lines so far in {path} were made by {provenance.line(before)}, this run by "
        f"{provenance.line(now)}: " + ", ".join(what)
    )
    if numerics:
        fields = ", ".join(dict.fromkeys(d.split(" ", 1)[0] for d in numerics))
        message += f"; {fields} change bfloat16 outputs, so its bfloat16 lines may differ from one run's"
    return message


def _has_lines(path: Path) -> bool:
    """Whether `path` exists and is not empty."""
    try:
        return path.stat().st_size > 0
    except OSError:
        return False


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
        # --resume of a file with lines: the sidecar records what made them (None: no sidecar)
        before, stored = recorded_provenance(path) if self.append and _has_lines(path) else (None, None)
        file = open(path, "a" if self.append else "w")  # noqa: SIM115 (0666 less the umask; through links)

        made_by = provenance.provenance()  # what made the lines: code, jax, device
        record = self.settings | {PROMPT_DIGESTS: _digests.get(path.resolve()), "provenance": made_by}
        if stored is not None:  # --resume: the lines so far may come from other code, jax or device
            warning = resumed_provenance_warning(path, before, made_by)
            if warning is not None:
                print(f"ddtree-generate: warning: {warning}", file=sys.stderr)
                record[EARLIER_PROVENANCE] = [*stored.get(EARLIER_PROVENANCE, []), before]
            elif EARLIER_PROVENANCE in stored:
                record[EARLIER_PROVENANCE] = stored[EARLIER_PROVENANCE]
        settings_path(path).write_text(json.dumps(record, indent=1) + "\n")
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
        """Close the file (not standard output) and release the run's lock on it."""
        if self.file is not None and self.file is not sys.stdout:
            self.file.close()
        self.file = None
        release_locks()


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


def critical() -> contextlib.AbstractContextManager:
    """A block that SIGINT and SIGTERM do not cut (within `interruptible`): they arrive after it."""
    return _guard.critical()


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
