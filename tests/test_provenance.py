"""What produced an output: the provenance record against git and the installed packages, the output
file's sidecar, the benchmarks' run header, and ddtree-compare external's warning when the two sides
differ in what changes bfloat16 outputs."""

import argparse
import importlib.metadata
import json
import shutil
import subprocess
from pathlib import Path

import pytest

import ddtree_jax
from ddtree_jax import outfile, provenance
from ddtree_jax.outfile import Writer, release_locks

REPO = Path(__file__).resolve().parent.parent
FIELDS = {"ddtree_jax", "commit", "dirty", "jax", "jaxlib", "python", "platform", "device_kind"}
FIELDS |= {"device_count", "cpu"}
needs_git = pytest.mark.skipif(shutil.which("git") is None, reason="needs git")


def git(root: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, check=True).stdout


def test_the_record_names_versions_and_devices():
    p = provenance.provenance()
    assert set(p) == FIELDS
    assert p["ddtree_jax"] == ddtree_jax.__version__
    assert p["jax"] == importlib.metadata.version("jax") and p["jaxlib"] == importlib.metadata.version(
        "jaxlib"
    )
    assert (p["device_kind"], p["device_count"], p["platform"]) == ("cpu", 8, "cpu")  # conftest's 8 devices
    torch_side = provenance.provenance(device=("NVIDIA H200", 1))
    assert (torch_side["device_kind"], torch_side["device_count"], torch_side["platform"]) == (
        "NVIDIA H200",
        1,
        None,
    )


@needs_git
def test_the_commit_is_the_source_trees(monkeypatch):
    """In a git tree: HEAD and whether tracked files differ from it, as git itself says."""
    if not (REPO / ".git").exists():
        pytest.skip("not run from a git tree")
    if not Path(ddtree_jax.__file__).resolve().is_relative_to(REPO.resolve()):
        pytest.skip("the package is installed, not the tree's (CI: a non-editable install)")
    commit, dirty = provenance.source_commit.__wrapped__()
    assert commit == git(REPO, "rev-parse", "HEAD").strip()
    assert dirty == (git(REPO, "status", "--porcelain", "--untracked-files=no").strip() != "")


@needs_git
def test_no_commit_outside_the_packages_own_tree(tmp_path, monkeypatch):
    """A package inside another repository (a site-packages in someone's checkout) or in no repository
    has no commit; one at the top of its own records HEAD and turns dirty with an edit."""

    def commit_of(init: Path):
        monkeypatch.setattr(ddtree_jax, "__file__", str(init))
        return provenance.source_commit.__wrapped__()

    bare = tmp_path / "bare" / "ddtree_jax" / "__init__.py"
    bare.parent.mkdir(parents=True)
    bare.write_text("")
    assert commit_of(bare) == (None, None)

    repo = tmp_path / "repo"
    nested = repo / "site" / "ddtree_jax" / "__init__.py"
    nested.parent.mkdir(parents=True)
    nested.write_text("")
    git(repo.parent, "init", "-q", str(repo))
    git(repo, "add", ".")
    git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "x")
    assert commit_of(nested) == (None, None)
    own = repo / "ddtree_jax" / "__init__.py"
    own.parent.mkdir()
    own.write_text("")
    git(repo, "add", ".")
    git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "y")
    assert commit_of(own) == (git(repo, "rev-parse", "HEAD").strip(), False)
    own.write_text("x = 1\n")
    assert commit_of(own)[1] is True


def test_numerics_differences():
    a = {"commit": "a" * 40, "dirty": False, "jax": "0.11.2", "jaxlib": "0.11.2", "device_kind": "cpu"}
    a |= {"device_count": 8, "cpu": "x", "machine": "m"}
    assert provenance.numerics_differences(a, dict(a)) == []
    other_machine = a | {"device_count": 1, "cpu": "y"}  # not what decides bf16 numerics
    assert provenance.numerics_differences(a, other_machine) == []
    b = a | {"jaxlib": "0.11.3", "device_kind": "NVIDIA H200"}
    assert provenance.numerics_differences(a, b) == [
        "jaxlib '0.11.2' -> '0.11.3'",
        "device_kind 'cpu' -> 'NVIDIA H200'",
    ]
    dirty = a | {"dirty": True}
    assert provenance.numerics_differences(dirty, dirty)[0].startswith("dirty True -> True")
    settings = {"method": "ddtree", "attention": "pallas", "batch_size": 4, "seed": 0}
    found = provenance.numerics_differences(a, a, settings, settings | {"attention": "reference", "seed": 1})
    assert found == ["attention 'pallas' -> 'reference'"]  # seed: what is generated, not how
    assert provenance.numerics_differences(a, None) == ["provenance not recorded on one side"]
    assert provenance.numerics_differences(None, None) == []


def test_the_output_files_sidecar_records_it(tmp_path):
    out = tmp_path / "o.jsonl"
    writer = Writer(str(out), {"method": "ar", "dtype": "bfloat16"}, append=False)
    try:
        writer.write([{"id": "a", "output_ids": [1]}])
    finally:
        writer.close()
        release_locks()
    record = json.loads((tmp_path / "o.jsonl.settings.json").read_text())
    assert record["method"] == "ar" and record["provenance"] == provenance.provenance()
    assert outfile.recorded_provenance(out) == (record["provenance"], record)
    assert outfile.recorded_provenance(tmp_path / "none.jsonl") == (None, None)


MADE = {
    "ddtree_jax": "0.1.0",
    "commit": "a" * 40,
    "dirty": False,
    "jax": "0.11.2",
    "jaxlib": "0.11.2",
    "python": "3.12.3",
    "platform": "gpu",
    "device_kind": "NVIDIA H100 80GB HBM3",
    "device_count": 1,
    "cpu": "x, 16 CPUs",
}


def _resume(tmp_path, monkeypatch, capsys, sidecar: dict | None, now: dict, lines: str = "{}\n"):
    """A --resume's writer appending one line to a file of `lines` whose sidecar is `sidecar` (None: no
    sidecar file), this run's provenance `now`: (its stderr, the sidecar it leaves)."""
    out = tmp_path / "o.jsonl"
    out.write_text(lines)
    if sidecar is not None:
        outfile.settings_path(out).write_text(json.dumps(sidecar))
    monkeypatch.setattr(provenance, "provenance", lambda: now)
    writer = Writer(str(out), {"method": "ar", "dtype": "bfloat16"}, append=True)
    try:
        writer.write([{"id": "b", "output_ids": [2]}])
    finally:
        writer.close()
        release_locks()
    return capsys.readouterr().err, json.loads(outfile.settings_path(out).read_text())


def test_resume_warns_when_other_code_jax_or_device_made_the_lines(tmp_path, monkeypatch, capsys):
    """--resume's writer names what differs between the sidecar's provenance and this run's, and which of
    it changes bfloat16 outputs (jax, device kind; not the package version or device count); the new
    sidecar keeps the earlier record."""
    now = MADE | {"ddtree_jax": "0.1.1", "jax": "0.11.3", "device_kind": "NVIDIA H200", "device_count": 2}
    err, record = _resume(tmp_path, monkeypatch, capsys, {"method": "ar", "provenance": MADE}, now)
    (line,) = err.strip().splitlines()
    assert line.startswith("ddtree-generate: warning: --resume: the lines so far in ")
    assert line.split(": ", 4)[-1] == (
        "ddtree_jax '0.1.0' -> '0.1.1', jax '0.11.2' -> '0.11.3', device_kind 'NVIDIA H100 80GB HBM3' -> "
        "'NVIDIA H200', device_count 1 -> 2; jax, device_kind change bfloat16 outputs, so its bfloat16 "
        "lines may differ from one run's"
    )
    assert record["provenance"] == now and record["earlier_provenance"] == [MADE]
    # a change that leaves numerics alone is named without the bfloat16 clause
    err, _ = _resume(tmp_path, monkeypatch, capsys, {"provenance": MADE}, MADE | {"device_count": 8})
    assert err.strip().endswith("device_count 1 -> 8")


def test_resume_with_the_same_provenance_is_quiet(tmp_path, monkeypatch, capsys):
    earlier = [MADE | {"jax": "0.11.1"}]
    err, record = _resume(
        tmp_path, monkeypatch, capsys, {"provenance": MADE, "earlier_provenance": earlier}, MADE
    )
    assert err == "" and record["provenance"] == MADE and record["earlier_provenance"] == earlier
    # nothing to continue (an empty file, no sidecar): no warning either
    err, record = _resume(tmp_path, monkeypatch, capsys, None, MADE, lines="")
    assert err == "" and "earlier_provenance" not in record


def test_resume_warns_on_uncommitted_edits_and_unrecorded_provenance(tmp_path, monkeypatch, capsys):
    dirty = MADE | {"dirty": True}
    err, _ = _resume(tmp_path, monkeypatch, capsys, {"provenance": dirty}, dirty)
    assert err.strip().endswith(
        f"dirty True -> True (uncommitted edits on {MADE['commit']}: may differ); dirty change bfloat16 "
        "outputs, so its bfloat16 lines may differ from one run's"
    )
    err, record = _resume(
        tmp_path, monkeypatch, capsys, {"method": "ar"}, MADE
    )  # a sidecar before the record
    assert err.strip().endswith("records no provenance: what made the lines so far is unknown")
    assert record["earlier_provenance"] == [None]


def test_the_benchmarks_run_header_carries_it():
    from ddtree_jax.bench.report import run_header

    meta = run_header(["ddtree-bench", "rounds"])
    assert {k: meta[k] for k in FIELDS} == provenance.provenance()
    assert meta["argv"] == ["ddtree-bench", "rounds"] and meta["command"] == "ddtree-bench rounds"


def test_compare_external_prints_both_sides_and_warns(tmp_path, capsys):
    """--ours and --theirs from runs of other jaxlib versions and attention kinds: both sides on stderr
    and in the report's notes, the differences named; another system's file (no sidecar) is 'not
    recorded'."""
    from ddtree_jax.compare.external import provenance_notes, provenance_of_sides

    here = provenance.provenance() | {"dirty": False}  # this tree may have uncommitted edits
    for name, prov, attention in (("ours", here, "pallas"), ("theirs", here | {"jaxlib": "0.9.0"}, "mosaic")):
        (tmp_path / f"{name}.jsonl").write_text("")
        sidecar = {"method": "ddtree", "attention": attention, "provenance": prov}
        (tmp_path / f"{name}.jsonl.settings.json").write_text(json.dumps(sidecar))
    args = argparse.Namespace(ours=str(tmp_path / "ours.jsonl"), theirs=str(tmp_path / "theirs.jsonl"))
    sides, differ = provenance_of_sides(args, "theirs", {})
    assert differ == [f"jaxlib {here['jaxlib']!r} -> '0.9.0'", "attention 'pallas' -> 'mosaic'"]
    err = capsys.readouterr().err.splitlines()
    assert err[0] == f"ddtree-compare external: ours: {provenance.line(here)}"
    assert err[1].startswith("ddtree-compare external: theirs: ddtree_jax ") and "jaxlib 0.9.0" in err[1]
    assert err[2].startswith("ddtree-compare external: warning: the sides differ") and "mosaic" in err[2]
    notes = provenance_notes(sides, differ)
    assert notes[0].startswith("Provenance: ours: ") and notes[1].startswith("Warning: ")

    (tmp_path / "sglang.jsonl").write_text("")
    generated = argparse.Namespace(ours=None, theirs=str(tmp_path / "sglang.jsonl"), attention="pallas")
    sides, differ = provenance_of_sides(generated, "sglang", {"attention": "pallas", "seed": 0})
    assert sides["ours"] == (provenance.provenance(), {"attention": "pallas"})
    assert sides["sglang"] == (None, None)
    assert differ == ["provenance not recorded on one side"]
    assert "sglang: not recorded" in capsys.readouterr().err
