"""`ddtree-generate --out`: checked before any work, written line by line, resumable, interruptible."""

import codecs
import json
import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import FIXTURES, golden_prompts, xla_flags

from ddtree_jax.cli import main

TARGET = FIXTURES / "qwen3_gqa1"
ROOT = Path(__file__).parent.parent


def write_prompts(path: Path, n: int = 5) -> Path:
    """`n` prompts of the fixture (all in one length bucket), ids p0, p1, ..."""
    prompts = [p for p in golden_prompts("qwen3_gqa1") if len(p) <= 16]
    lines = [json.dumps({"id": f"p{i}", "input_ids": prompts[i % len(prompts)]}) for i in range(n)]
    path.write_text("\n".join(lines) + "\n")
    return path


def argv(prompts: Path, out, *extra: str) -> list[str]:
    """A small float32 ar run of the fixture target."""
    return [
        "--target",
        str(TARGET),
        "--prompts",
        str(prompts),
        "--out",
        str(out),
        "--dtype",
        "float32",
        "--max-new-tokens",
        "6",
        "--batch-size",
        "2",
        *extra,
    ]


def rows(path: Path | str) -> list[dict]:
    """The output file's lines (or the text of them), each parsed, without its e2e_latency (a wall
    time, checked here)."""
    text = path.read_text() if isinstance(path, Path) else path
    lines = [json.loads(line) for line in text.splitlines()]
    assert all(isinstance(line.pop("e2e_latency"), float) for line in lines)
    return lines


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> tuple[Path, list[dict]]:
    """An uninterrupted run over 5 prompts: (prompts file, its output lines)."""
    d = tmp_path_factory.mktemp("reference")
    prompts = write_prompts(d / "p.jsonl")
    assert main(argv(prompts, d / "out.jsonl")) == 0
    return prompts, rows(d / "out.jsonl")


@pytest.fixture
def no_loading(monkeypatch):
    """Fail the test if any weight is read (the refusals below come first)."""
    from ddtree_jax import checkpoint

    monkeypatch.setattr(checkpoint, "load_params", lambda *a: pytest.fail("weights loaded"))


def test_output_file_mode_and_settings(reference, tmp_path):
    prompts, expected = reference
    out = tmp_path / "o.jsonl"
    old = os.umask(0o022)
    try:
        assert main(argv(prompts, out)) == 0
    finally:
        os.umask(old)
    assert stat.S_IMODE(out.stat().st_mode) == 0o644
    assert rows(out) == expected
    settings = json.loads((tmp_path / "o.jsonl.settings.json").read_text())
    assert settings["method"] == "ar" and settings["max_new_tokens"] == 6 and settings["dtype"] == "float32"


def test_refuses_existing_out_without_overwrite(reference, tmp_path, capsys, no_loading):
    prompts, _ = reference
    out = tmp_path / "o.jsonl"
    out.write_text("precious\n")
    assert main(argv(prompts, out)) == 1
    assert "exists; --resume continues it, --overwrite replaces it" in capsys.readouterr().err
    assert out.read_text() == "precious\n"


def test_overwrite_replaces(reference, tmp_path):
    prompts, expected = reference
    out = tmp_path / "o.jsonl"
    out.write_text("old\n" * 50)
    assert main(argv(prompts, out, "--overwrite")) == 0
    assert rows(out) == expected


@pytest.mark.parametrize(
    "how,needle",
    [
        ("prompts", "is the prompts file"),
        ("hardlink", "is the prompts file"),
        ("directory", "is a directory"),
        ("no_parent", "does not exist"),
        ("resume_stdout", "--resume needs an --out file"),
        ("both", "--resume and --overwrite exclude each other"),
    ],
)
def test_out_refused_before_loading(reference, tmp_path, capsys, no_loading, how, needle):
    prompts, _ = reference
    local = tmp_path / "p.jsonl"
    local.write_bytes(prompts.read_bytes())
    if how == "hardlink":
        os.link(local, tmp_path / "o.jsonl")
    out, extra = {
        "prompts": (local, []),
        "hardlink": (tmp_path / "o.jsonl", ["--overwrite"]),
        "directory": (tmp_path, []),
        "no_parent": (tmp_path / "missing" / "o.jsonl", []),
        "resume_stdout": ("-", ["--resume"]),
        "both": (tmp_path / "o.jsonl", ["--resume", "--overwrite"]),
    }[how]
    assert main(argv(local, out, *extra)) == 1
    assert needle in capsys.readouterr().err
    assert local.read_bytes() == prompts.read_bytes()


def test_unwritable_directory_refused(reference, tmp_path, capsys, monkeypatch, no_loading):
    from ddtree_jax import outfile

    prompts, _ = reference
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o555)
    if os.geteuid() == 0:  # root writes anywhere: let access() answer as for anyone else
        monkeypatch.setattr(outfile.os, "access", lambda path, mode: Path(path) != locked)
    assert main(argv(prompts, locked / "o.jsonl")) == 1
    assert "is not writable" in capsys.readouterr().err


def test_stdout(reference, capsys):
    prompts, expected = reference
    assert main(argv(prompts, "-")) == 0
    captured = capsys.readouterr()
    assert rows(captured.out) == expected
    assert "prompts: 5" in captured.err and not Path("-").exists()


def test_symlink_written_through(reference, tmp_path):
    prompts, expected = reference
    real = tmp_path / "real.jsonl"
    link = tmp_path / "link.jsonl"
    link.symlink_to(real)
    assert main(argv(prompts, link)) == 0
    assert link.is_symlink() and rows(real) == expected


def test_status_before_the_first_result(reference, tmp_path, capsys, monkeypatch):
    """On a terminal: loading, compiling, then the first result's compile time and how many programs
    the compile cache gave."""
    prompts, expected = reference
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    assert main(argv(prompts, tmp_path / "o.jsonl")) == 0
    captured = capsys.readouterr()
    assert f"ddtree-generate: loading {TARGET} (float32) ...\nddtree-generate: loaded in " in captured.err
    assert "compiling the programs (the first result waits for them)" in captured.err
    assert "ddtree-generate: first result after " in captured.err
    assert "programs read from the compile cache)" in captured.err


def test_resume_appends_the_rest(reference, tmp_path, capsys):
    prompts, expected = reference
    out = tmp_path / "o.jsonl"
    assert main(argv(prompts, out)) == 0
    lines = out.read_text().splitlines(keepends=True)
    out.write_text("".join(lines[:2]) + lines[2][:10])  # two lines kept, the third cut short
    capsys.readouterr()
    assert main(argv(prompts, out, "--resume")) == 0
    assert rows(out) == expected
    captured = capsys.readouterr()
    assert "dropped an unfinished last line" in captured.err
    # the summary counts the prompts already done
    assert f"resumed: 2 samples were already in {out}; {len(expected) - 2} generated now" in captured.out
    assert main(argv(prompts, out, "--resume")) == 0
    assert "nothing to do" in capsys.readouterr().out and rows(out) == expected


def test_resume_refuses_other_settings(reference, tmp_path, capsys):
    prompts, expected = reference
    out = tmp_path / "o.jsonl"
    out.write_text(json.dumps(expected[0]) + "\n")
    assert main(argv(prompts, out, "--resume")) == 1
    assert "o.jsonl.settings.json is missing" in capsys.readouterr().err
    assert main(argv(prompts, out, "--overwrite")) == 0
    assert main(argv(prompts, out, "--resume", "--max-new-tokens", "7", "--temperature", "0.5")) == 1
    err = capsys.readouterr().err
    assert "--max-new-tokens 6 (now 7), --temperature 0.0 (now 0.5)" in err
    # batch size and mesh do not change outputs: resuming with others is allowed
    assert main(argv(prompts, out, "--resume", "--batch-size", "3")) == 0


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_interrupt_then_resume(tmp_path, sig):
    """A run sent SIGINT/SIGTERM once its first line is out keeps every finished line, exits
    128 + signal with one line, and --resume completes it to the uninterrupted run's output."""
    prompts = write_prompts(tmp_path / "p.jsonl", 40)
    out = tmp_path / "o.jsonl"
    cmd = [sys.executable, "-m", "ddtree_jax.cli", *argv(prompts, out, "--batch-size", "1")]
    env = dict(os.environ, XLA_FLAGS=xla_flags(1))
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 240
    while proc.poll() is None and time.monotonic() < deadline:
        if out.exists() and out.read_text().count("\n") >= 1:
            proc.send_signal(sig)
            break
        time.sleep(0.005)
    printed, err = proc.communicate(timeout=240)
    assert proc.returncode == 128 + sig, err
    last = err.strip().splitlines()[-1]
    assert last.startswith(f"ddtree-generate: interrupted by {sig.name} (") and "--resume continues" in last
    assert "Traceback" not in err
    partial = rows(out)  # every line whole
    assert 1 <= len(partial) < 40
    assert f"prompts: {len(partial)}   output tokens: " in printed  # the summary of what it wrote
    assert "ddtree-generate: loading" not in err  # status lines go to a terminal only
    assert "prompts (compiling):   0%" in err  # the bar's phase until the first result
    assert main(argv(prompts, out, "--resume")) == 0
    assert main(argv(prompts, tmp_path / "whole.jsonl")) == 0
    assert rows(out) == rows(tmp_path / "whole.jsonl")


def test_resume_refuses_settings_that_change_bfloat16_outputs(tmp_path, capsys):
    """In bfloat16 a row's numerics depend on the run's shapes, kernels and reduction orders: --resume
    refuses another --batch-size, --static-batches, --batch-invariant, --tp / --dp or --prefill-chunk
    (float32 outputs do not depend on them: test_resume_refuses_other_settings)."""
    prompts = write_prompts(tmp_path / "p.jsonl", 3)
    out = tmp_path / "o.jsonl"
    bf16 = argv(prompts, out, "--dtype", "bfloat16")  # (the later --dtype wins)
    assert main(bf16) == 0
    out.write_text(out.read_text().splitlines(keepends=True)[0])
    for flags, needle in (
        (["--batch-size", "3"], "--batch-size 2 (now 3)"),
        (["--static-batches"], "--static-batches False (now True)"),
        (["--batch-invariant"], "--batch-invariant False (now True)"),
        (["--tp", "2"], "--tp 1 (now 2)"),
        (["--dp", "2"], "--dp 1 (now 2)"),
        (["--prefill-chunk", "64"], "--prefill-chunk 256 (now 64)"),
    ):
        assert main([*bf16, "--resume", *flags]) == 1
        assert needle in capsys.readouterr().err
    assert len(rows(out)) == 1


def bundled_lines(n: int) -> list[str]:
    return (ROOT / "ddtree_jax" / "assets" / "default_pair" / "prompts.jsonl").read_text().splitlines()[:n]


def by_id(path: Path) -> dict:
    return {str(r["id"]): r for r in rows(path)}


@pytest.mark.parametrize("policy", [[], ["--static-batches"]])
def test_resume_reproduces_an_uninterrupted_bfloat16_run(tmp_path, policy):
    """The bundled pair in bfloat16 (ddtree-generate's defaults but the length): a file cut after its
    first k lines and resumed holds what the uninterrupted run wrote, line for line. The rows, prompt
    slots, cache capacity and order of the run come from the whole prompts file, and each prompt's
    prefill depends on it alone (continuous batching); static runs rerun a batch they cut."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(bundled_lines(10)) + "\n")
    flags = ["--prompts", str(prompts), "--max-new-tokens", "40", "--batch-size", "4", *policy]
    whole = tmp_path / "whole.jsonl"
    assert main([*flags, "--out", str(whole)]) == 0
    lines = whole.read_text().splitlines(keepends=True)
    for k in (3, 6):
        cut = tmp_path / f"cut{k}.jsonl"
        cut.write_text("".join(lines[:k]))
        (tmp_path / f"cut{k}.jsonl.settings.json").write_text(
            (tmp_path / "whole.jsonl.settings.json").read_text()
        )
        assert main([*flags, "--out", str(cut), "--resume"]) == 0
        assert by_id(cut) == by_id(whole), k


HOLD = """
import sys
from ddtree_jax.outfile import check_out
check_out(sys.argv[1], sys.argv[2], resume=False, overwrite=True)
print("locked", flush=True)
sys.stdin.readline()
"""


def test_second_writer_refused(reference, tmp_path, capsys, no_loading):
    """While another process writes --out, a run on the same file (here through a symlink) is refused
    with one line before any work, and neither the file nor its settings sidecar changes."""
    prompts, expected = reference
    out = tmp_path / "o.jsonl"
    out.write_text(json.dumps(expected[0]) + "\n")
    sidecar = tmp_path / "o.jsonl.settings.json"
    sidecar.write_text('{"first": "run"}\n')
    (tmp_path / "link.jsonl").symlink_to(out)
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(out), str(prompts)],
        cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert holder.stdout.readline() == "locked\n"
        for extra in (["--overwrite"], ["--resume"], []):
            assert main(argv(prompts, tmp_path / "link.jsonl", *extra)) == 1
            err = capsys.readouterr().err.strip().splitlines()
            assert len(err) == 1 and f"pid {holder.pid}) is writing it" in err[0], err
            assert str(out) in err[0]
        assert out.read_text() == json.dumps(expected[0]) + "\n"
        assert sidecar.read_text() == '{"first": "run"}\n'
    finally:
        holder.communicate("\n", timeout=60)
    assert not (tmp_path / "o.jsonl.lock").exists()  # the holder removed its lock on exit


def test_lock_released_after_run_and_after_a_kill(reference, tmp_path):
    """A finished run leaves no lock file; a killed holder's lock file does not block the next run."""
    prompts, expected = reference
    out = tmp_path / "o.jsonl"
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(out), str(prompts)], cwd=ROOT, stdin=subprocess.PIPE,
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert holder.stdout.readline() == "locked\n"
    holder.kill()
    holder.wait(timeout=60)
    assert (tmp_path / "o.jsonl.lock").exists()
    assert main(argv(prompts, out)) == 0
    assert rows(out) == expected and not (tmp_path / "o.jsonl.lock").exists()


def test_refused_resume_leaves_the_file_as_it_was(reference, tmp_path, capsys, no_loading):
    """A --resume refused (other settings) has not yet dropped the cut-short last line: the file is
    byte for byte what it was."""
    prompts, expected = reference
    out = tmp_path / "o.jsonl"
    (tmp_path / "o.jsonl.settings.json").write_text(json.dumps({"method": "ar", "max_new_tokens": 6}) + "\n")
    kept = "".join(json.dumps(r) + "\n" for r in expected[:2]) + json.dumps(expected[2])[:10]
    out.write_text(kept)
    assert main(argv(prompts, out, "--resume", "--max-new-tokens", "7")) == 1
    assert "was made with other settings" in capsys.readouterr().err
    assert out.read_text() == kept


def test_resume_refuses_changed_prompts(reference, tmp_path, capsys):
    """The sidecar keeps each prompt's digest: resuming after a prompt was edited is refused naming its
    id (its old output would stay); once its line is deleted from --out, --resume generates it anew."""
    prompts, expected = reference
    local = tmp_path / "p.jsonl"
    local.write_bytes(prompts.read_bytes())
    out = tmp_path / "o.jsonl"
    assert main(argv(local, out)) == 0
    digests = json.loads((tmp_path / "o.jsonl.settings.json").read_text())["prompt_sha256"]
    assert sorted(digests) == sorted(json.dumps(f"p{i}") for i in range(5))
    lines = local.read_text().splitlines()
    edited = json.loads(lines[1])
    edited["input_ids"] = edited["input_ids"][1:]  # p1 now asks something else
    local.write_text("\n".join([*lines[:1], json.dumps(edited), *lines[2:]]) + "\n")
    before = out.read_bytes()
    assert main(argv(local, out, "--resume")) == 1
    err = capsys.readouterr().err
    assert "1 prompts changed since their outputs" in err and '"p1"' in err and out.read_bytes() == before
    out.write_text(
        "".join(line + "\n" for line in out.read_text().splitlines() if json.loads(line)["id"] != "p1")
    )
    assert main(argv(local, out, "--resume")) == 0
    assert main(argv(local, tmp_path / "fresh.jsonl")) == 0
    regenerated = {r["id"]: r for r in rows(out)}
    assert regenerated == {r["id"]: r for r in rows(tmp_path / "fresh.jsonl")}
    assert regenerated["p1"] != expected[1]


def test_prompts_file_with_a_byte_order_mark(reference, tmp_path):
    """A UTF-8 byte-order mark at the start of the prompts file (Windows editors write one) is read past."""
    prompts, expected = reference
    local = tmp_path / "p.jsonl"
    local.write_bytes(codecs.BOM_UTF8 + prompts.read_bytes())
    assert main(argv(local, tmp_path / "o.jsonl")) == 0
    assert rows(tmp_path / "o.jsonl") == expected
