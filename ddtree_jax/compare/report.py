"""A comparison's report: the verdict, tables and plots, written as one directory (or not at all)."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from ddtree_jax.errors import DDTreeError

VERDICTS = ("agree", "differ")


@dataclasses.dataclass
class Divergence:
    """Where one output first leaves the reference: the prompt id, the output position, the target's
    top-2 logit margin there (None when not recomputed) and anything else worth a column."""

    id: Any
    position: int
    margin: float | None
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        """{id, position, margin, ...}."""
        return {"id": self.id, "position": self.position, "margin": self.margin, **self.extra}


@dataclasses.dataclass
class Comparison:
    """One pairing of outputs (e.g. ddtree-15 against ar) over the same prompts."""

    name: str
    prompts: int
    identical: int
    divergences: list[Divergence]
    mean_acceptance: dict[str, float | None] = dataclasses.field(default_factory=dict)
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def agrees(self) -> bool:
        """Every prompt identical."""
        return self.identical == self.prompts

    def to_json(self) -> dict[str, Any]:
        """The comparison's entry in report.json."""
        return {
            "name": self.name,
            "prompts": self.prompts,
            "identical": self.identical,
            "divergences": [d.to_json() for d in self.divergences],
            "mean_acceptance": self.mean_acceptance,
            **self.extra,
        }


@dataclasses.dataclass
class Table:
    """A markdown table with a heading."""

    title: str
    header: list[str]
    rows: list[list[Any]]

    def markdown(self) -> str:
        """The table as GitHub markdown."""
        cell = lambda v: f"{v:.4g}" if isinstance(v, float) else ("" if v is None else str(v))  # noqa: E731
        lines = [f"## {self.title}", "", "| " + " | ".join(self.header) + " |"]
        lines.append("| " + " | ".join("---" for _ in self.header) + " |")
        lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in self.rows]
        return "\n".join(lines)


@dataclasses.dataclass
class Report:
    """What a sub-command found: the verdict and its one-line summary first, then tables and plots."""

    command: str
    verdict: str  # "agree" | "differ"
    summary: str  # one line, printed
    comparisons: list[Comparison]
    tables: list[Table] = dataclasses.field(default_factory=list)
    notes: list[str] = dataclasses.field(default_factory=list)  # paragraphs after the verdict
    figures: dict[str, Any] = dataclasses.field(default_factory=dict)  # file stem -> matplotlib Figure
    details: dict[str, Any] = dataclasses.field(default_factory=dict)  # extra report.json fields

    def __post_init__(self):
        if self.verdict not in VERDICTS:
            raise ValueError(f"verdict must be one of {VERDICTS}, got {self.verdict!r}")

    def markdown(self, meta: dict[str, Any]) -> str:
        """report.md: verdict, summary, notes, tables, plots, then how it was made."""
        parts = [f"# ddtree-compare {self.command}: {self.verdict}", "", self.summary, ""]
        parts += [n + "\n" for n in self.notes]
        if "settings" in self.details:
            given = {k: v for k, v in self.details["settings"].items() if v is not None}
            settings = ", ".join(f"{k} {v}" for k, v in given.items())
            parts += [f"Settings: {settings}.\n"]
        parts += [t.markdown() + "\n" for t in self.tables]
        parts += [f"![{stem}]({stem}.png)\n" for stem in self.figures]
        parts += ["## Run", "", f"- command: `{meta['command']}`"]
        shown = {k: "not recorded" if v is None else v for k, v in meta.items()}
        shown = {k: v for k, v in shown.items() if k not in ("command", "argv")}
        parts += [f"- {k}: {v}" for k, v in shown.items()]
        return "\n".join(parts) + "\n"

    def to_json(self, meta: dict[str, Any]) -> dict[str, Any]:
        """report.json."""
        return {
            "command": self.command,
            "verdict": self.verdict,
            "summary": self.summary,
            "comparisons": [c.to_json() for c in self.comparisons],
            **self.details,
            "meta": meta,
        }


def verdict_of(comparisons: list[Comparison]) -> str:
    """ "agree" when every comparison agrees on every prompt, else "differ"."""
    return "agree" if all(c.agrees for c in comparisons) else "differ"


def check_report_dir(path: Path) -> None:
    """Refuse a report directory that cannot be written (before any model runs): its parent must exist
    and take a new directory (tried: write_report builds the report beside it), an existing one must be
    an earlier report."""
    if not path.parent.is_dir():
        raise DDTreeError(f"--report {path}: parent directory {path.parent} does not exist")
    if path.exists() and not (path / "report.json").exists():
        raise DDTreeError(f"--report {path}: exists and holds no report.json (not replacing it)")
    try:
        tempfile.TemporaryDirectory(dir=path.parent, prefix=f".{path.name}.").cleanup()
    except OSError as e:
        raise DDTreeError(f"--report {path}: cannot write in {path.parent} ({e.strerror})") from None
    if path.exists() and not os.access(path, os.W_OK | os.X_OK):
        raise DDTreeError(f"--report {path}: not writable (an earlier report cannot be replaced)")


def write_report(path: Path, report: Report, meta: dict[str, Any]) -> None:
    """Write report.md, report.json and one PNG per figure into `path`, replacing an older report.

    Everything goes into a temporary directory beside `path` first: an error leaves no partial report.
    """
    check_report_dir(path)
    tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp"))
    try:
        (tmp / "report.md").write_text(report.markdown(meta))
        (tmp / "report.json").write_text(json.dumps(report.to_json(meta), indent=1) + "\n")
        for stem, figure in report.figures.items():
            figure.savefig(tmp / f"{stem}.png", dpi=110, bbox_inches="tight")
        if path.exists():
            shutil.rmtree(path)
        os.replace(tmp, path)
    except OSError as e:  # a disk filled or a directory made read-only during the run: one line
        shutil.rmtree(tmp, ignore_errors=True)
        raise DDTreeError(f"--report {path}: cannot write the report ({e.strerror or e})") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
