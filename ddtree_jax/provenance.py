"""What produced an output: the package version and source commit, the jax and jaxlib versions, the device.

Every benchmark JSON (`bench.report.run_header`), every output file's settings sidecar (`outfile`) and
every `ddtree-compare` report record `provenance()`; `numerics_differences` names what two records
differ in that changes bfloat16 outputs (float32 outputs are the same whatever the mesh, schedule or
device: tests/test_sharding.py, test_scheduling.py).
"""

from __future__ import annotations

import functools
import os
import platform
import subprocess
from pathlib import Path
from typing import Any

import ddtree_jax

# Fields of a provenance record whose difference can change bfloat16 outputs: the code (its commit and
# uncommitted edits), the compiler (jax, jaxlib) and the device (its kind decides kernels and tilings).
NUMERICS = ("commit", "dirty", "jax", "jaxlib", "device_kind", "platform")
# The fields of a provenance record --resume compares between the run that wrote a file's lines and the
# one continuing it (outfile): what made the lines, whether or not it changes their numerics.
MADE_BY = ("ddtree_jax", "commit", "dirty", "jax", "jaxlib", "platform", "device_kind", "device_count")
# The settings that decide a run's shapes, kernels and reduction orders: float32 outputs do not depend
# on them (the same tokens whatever the batch, mesh or schedule), bfloat16 outputs do, so --resume
# refuses to change them unless both runs are float32 (outfile). auto_budgets (--budget auto) is one: a
# choosing job runs each round at the budget it chose, and a bfloat16 round at another budget can give
# other tokens (docs/scheduling.md), so auto against a fixed budget is a difference in bfloat16 only.
SCHEDULE_SETTINGS = (
    "batch_size",
    "static_batches",
    "batch_invariant",
    "host_stepped",
    "tp",
    "dp",
    "prefill_chunk",
    "prefill_slots",
    "host_loop",
    "prefill_attention",
    "attention",
    "moe_sharding",
    "scan_layers",
    "auto_budgets",
)
# The settings (outfile.SETTINGS names) that change the programs a run compiles, and so bfloat16
# outputs, beyond the ones that change what is generated at all.
PROGRAM_SETTINGS = (
    "dtype",
    *SCHEDULE_SETTINGS,
    "budget",
    "branching",
    "block_size",
    "draft_window",
    "dequantize",
)


@functools.cache
def source_commit() -> tuple[str | None, bool | None]:
    """(commit, dirty) of the git tree the package runs from; (None, None) when it is not one (an
    installed wheel) or git is missing. `dirty`: tracked files differ from the commit."""
    root = Path(ddtree_jax.__file__).resolve().parent.parent

    def git(*args: str) -> str | None:
        try:
            done = subprocess.run(
                ["git", "-C", str(root), *args], capture_output=True, text=True, timeout=10, check=True
            )
        except (OSError, subprocess.SubprocessError):
            return None
        return done.stdout.strip()

    top = git("rev-parse", "--show-toplevel")
    if top is None or Path(top).resolve() != root:  # a site-packages inside some other repository
        return None, None
    commit = git("rev-parse", "HEAD")
    status = git("status", "--porcelain", "--untracked-files=no")
    return commit, (None if status is None else status != "")


def provenance(device: tuple[str, int] | None = None) -> dict[str, Any]:
    """{ddtree_jax, commit, dirty, jax, jaxlib, python, platform, device_kind, device_count, cpu}. `device`:
    (kind, count) of a device jax does not run on (a torch benchmark): jax's devices are then not
    asked, so no device memory is claimed, and `platform` is None."""
    import jax
    import jaxlib

    if device is None:
        first = jax.devices()[0]
        kind, count, plat = first.device_kind, jax.device_count(), first.platform
    else:
        (kind, count), plat = device, None
    commit, dirty = source_commit()
    return {
        "ddtree_jax": ddtree_jax.__version__,
        "commit": commit,
        "dirty": dirty,
        "jax": jax.__version__,
        "jaxlib": jaxlib.__version__,
        "python": platform.python_version(),
        "platform": plat,
        "device_kind": kind,
        "device_count": count,
        "cpu": f"{cpu_name()}, {os.cpu_count()} CPUs",
    }


def cpu_name() -> str:
    """The CPU model from /proc/cpuinfo (Linux), else the platform's word for it."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        return next(ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def numerics_differences(
    a: dict[str, Any] | None,
    b: dict[str, Any] | None,
    settings_a: dict[str, Any] | None = None,
    settings_b: dict[str, Any] | None = None,
) -> list[str]:
    """What two runs differ in that can change bfloat16 outputs: 'FIELD A -> B' for each of NUMERICS
    in the provenance records and each of PROGRAM_SETTINGS in the settings (a field missing on one side
    is not a difference: it was not recorded); ['provenance not recorded on one side'] when a record
    is None. A commit with uncommitted edits is never the same code as another run's."""
    if a is None or b is None:
        return ["provenance not recorded on one side"] if a is not b else []
    out = [f"{k} {a[k]!r} -> {b[k]!r}" for k in NUMERICS if k in a and k in b and a[k] != b[k]]
    if a.get("dirty") and b.get("dirty") and a.get("commit") == b.get("commit"):
        out.append(f"dirty True -> True (uncommitted edits on {a.get('commit')}: may differ)")
    sa, sb = settings_a or {}, settings_b or {}
    out += [f"{k} {sa[k]!r} -> {sb[k]!r}" for k in PROGRAM_SETTINGS if k in sa and k in sb and sa[k] != sb[k]]
    return out


def changed_fields(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    """The MADE_BY fields two provenance records both hold with different values, in MADE_BY's order."""
    return [k for k in MADE_BY if k in a and k in b and a[k] != b[k]]


def line(p: dict[str, Any] | None) -> str:
    """One line of a provenance record: 'ddtree_jax 0.1.0 @ 0071344 (dirty), jax 0.11.2 / jaxlib 0.11.2,
    8 x cpu'."""
    if p is None:
        return "not recorded"
    commit = "no git tree" if p.get("commit") is None else p["commit"][:7] + " (dirty)" * bool(p.get("dirty"))
    return (
        f"ddtree_jax {p.get('ddtree_jax')} @ {commit}, jax {p.get('jax')} / jaxlib {p.get('jaxlib')}, "
        f"{p.get('device_count')} x {p.get('device_kind')}"
    )
