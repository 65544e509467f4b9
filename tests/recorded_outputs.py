"""Float32 outputs of `ddtree-generate` recorded once, and the modes that must reproduce them.

`python tests/recorded_outputs.py [--workdir DIR]` runs every case (a target/drafter pair and a
prompts file with greedy, seeded-sampling and own-limit lines) by every method in every mode below,
checks that all modes agree, and writes what they agree on (output ids, acceptance lengths, finish
reason per prompt) to tests/fixtures/recorded_outputs.json; --workdir keeps each run's outputs file
there and reuses a complete one, so a recording cut short goes on where it stopped.
tests/test_recorded_outputs.py runs the modes again against that file: a change to the engine, the
device programs or the host loop that moves a float32 output fails there. Record again only when a
change is meant to change outputs, and say so in its commit.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "fixtures"
BUNDLED = ROOT / "ddtree_jax" / "assets" / "default_pair"
RECORD = FIXTURES / "recorded_outputs.json"
METHODS = ("ar", "dflash", "ddtree")
SAMPLED = {"temperature": 0.8, "top_k": 20, "top_p": 0.9}


def _fixture_lines(name: str) -> list[dict]:
    """The golden prompts of a fixture (lengths 1 to 30) and three more lines: two seeded-sampling
    lines (one with its own limit) and a greedy line with its own limit."""
    import numpy as np

    golden = np.load(FIXTURES / name / "golden.npz")
    prompts = [golden[f"prompt_{i}"].tolist() for i in range(5)]
    lines = [{"id": f"g{i}", "input_ids": p} for i, p in enumerate(prompts)]
    lines += [
        {"id": "s0", "input_ids": prompts[3], **SAMPLED, "seed": 3},
        {"id": "s1", "input_ids": prompts[4][:9], **SAMPLED, "seed": 11, "max_new_tokens": 7},
        {"id": "n0", "input_ids": prompts[2][:6], "max_new_tokens": 5},
    ]
    return lines


def _bundled_lines() -> list[dict]:
    """The bundled pair's first four prompts cut to their first 160 characters (text, through its
    tokenizer and chat template), one of them sampled."""
    texts = [json.loads(line) for line in (BUNDLED / "prompts.jsonl").read_text().splitlines()[:4]]
    lines = [{"id": t["id"], "prompt": t["prompt"][:160]} for t in texts]
    lines[1] |= SAMPLED | {"seed": 5}
    return lines


# name -> (target, draft, prompt lines, flags of every run)
CASES = {
    "dense": (
        FIXTURES / "qwen3_gqa4_tp",
        FIXTURES / "dflash_qwen3_gqa4_tp",
        _fixture_lines("qwen3_gqa4_tp"),
        ["--max-new-tokens", "12", "--prefill-chunk", "16"],
    ),
    "moe": (
        FIXTURES / "qwen3_moe_tp",
        FIXTURES / "dflash_qwen3_moe_tp",
        _fixture_lines("qwen3_moe_tp"),
        ["--max-new-tokens", "10", "--prefill-chunk", "16"],
    ),
    "bundled": (
        BUNDLED / "target",
        BUNDLED / "draft",
        _bundled_lines(),
        ["--max-new-tokens", "16", "--prefill-chunk", "32"],
    ),
}
# mode -> extra flags (every mode runs --batch-size 2 over more prompts than rows: refills, batches)
MODES = {
    "continuous": [],
    "static": ["--static-batches"],
    "host-stepped": ["--host-stepped"],
    "mesh": ["--tp", "2", "--dp", "2"],
    "mesh-static": ["--tp", "2", "--dp", "2", "--static-batches"],
    "batch-invariant": ["--batch-invariant"],
}
PROCESSES = "processes"  # two processes of two devices each, --tp 2 --dp 2 (several hosts' recipe)


def modes(case: str) -> list[str]:
    """The modes a case is recorded in: all, several processes for the dense case only (each process
    compiles every program again)."""
    return [*MODES, *([PROCESSES] if case == "dense" else [])]


def argv(case: str, method: str, prompts: Path, out: Path) -> list[str]:
    """ddtree-generate's flags for one case and method (the mode's flags are added by the caller)."""
    target, draft, _, flags = CASES[case]
    args = ["--target", str(target), "--prompts", str(prompts), "--out", str(out), "--method", method]
    if method != "ar":
        args += ["--draft", str(draft)]
    if method == "ddtree":
        args += ["--budget", "7"]
    return args + ["--dtype", "float32", "--batch-size", "2", *flags]


def write_prompts(case: str, path: Path) -> Path:
    """The case's prompts file."""
    path.write_text("".join(json.dumps(line) + "\n" for line in CASES[case][2]))
    return path


def outputs(path: Path) -> dict[str, dict]:
    """What the record keeps of an outputs file: per id, the ids, acceptance lengths, finish reason."""
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    keep = ("output_ids", "acceptance_lengths", "finish_reason")
    return {str(r["id"]): {k: r[k] for k in keep} for r in sorted(rows, key=lambda r: str(r["id"]))}


def free_port() -> int:
    """A TCP port nobody listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_mode(case: str, method: str, mode: str, workdir: Path, reuse: bool = False) -> dict[str, dict]:
    """Run one case, method and mode through ddtree-generate; its outputs as `outputs` keeps them
    (`reuse`: a complete outputs file of an earlier run in `workdir` instead)."""
    from ddtree_jax.cli import main

    prompts = write_prompts(case, workdir / f"{case}.jsonl")
    out = workdir / f"{case}-{method}-{mode}.jsonl"
    if reuse and out.exists() and len(out.read_text().splitlines()) == len(CASES[case][2]):
        return outputs(out)
    out.unlink(missing_ok=True)
    base = argv(case, method, prompts, out)
    if mode == PROCESSES:
        run_processes(base + ["--tp", "2", "--dp", "2"])
    else:
        status = main([*base, *MODES[mode]])
        if status != 0:
            raise RuntimeError(f"{case} {method} {mode}: ddtree-generate exited {status}")
    return outputs(out)


def run_processes(args: list[str]) -> None:
    """ddtree-generate in two processes of two CPU devices each, joined by jax.distributed."""
    port = free_port()
    others = [f for f in os.environ.get("XLA_FLAGS", "").split() if "host_platform_device_count" not in f]
    env = dict(os.environ, XLA_FLAGS=" ".join(["--xla_force_host_platform_device_count=2", *others]))
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "ddtree_jax.cli", *args]
            + ["--coordinator", f"127.0.0.1:{port}", "--num-processes", "2", "--process-id", str(i)],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(2)
    ]
    results = [p.communicate(timeout=600) for p in procs]
    # every failed process's stderr: the first to die is the cause, the other's Gloo timeout its echo
    failed = [
        f"process {i} exited {p.returncode}: {err[-3000:]}"
        for i, (p, (_, err)) in enumerate(zip(procs, results, strict=True))
        if p.returncode
    ]
    if failed:
        raise RuntimeError("\n".join(failed))


def _commit() -> str:
    """The commit the recording ran on (and whether its tree had changes)."""
    run = lambda *a: subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True).stdout.strip()  # noqa: E731
    return run("rev-parse", "--short", "HEAD") + (" with changes" if run("status", "--porcelain") else "")


def main(argv: list[str] | None = None) -> int:
    """Run every case, method and mode; write the record when all modes agree."""
    import argparse
    import tempfile

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workdir", help="keep (and reuse) each run's outputs here (default: a temporary one)")
    args = p.parse_args(argv)
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    sys.path.insert(0, str(ROOT))
    record = {
        "command": " ".join(["python tests/recorded_outputs.py", *(sys.argv[1:] if argv is None else argv)]),
        "code": _commit(),
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "cases": {},
    }
    disagree = []
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(args.workdir or tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        for case in CASES:
            record["cases"][case] = {}
            for method in METHODS:
                got = {}
                for mode in modes(case):
                    got[mode] = run_mode(case, method, mode, workdir, reuse=args.workdir is not None)
                    print(case, method, mode, "done", file=sys.stderr, flush=True)
                first = got["continuous"]
                disagree += [(case, method, m) for m, o in got.items() if o != first]
                record["cases"][case][method] = first
    if disagree:
        print(f"modes disagree: {disagree}", file=sys.stderr)
        return 1
    RECORD.write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {RECORD}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
