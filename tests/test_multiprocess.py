"""Two processes of four CPU devices each, joined by jax.distributed, run the same continuous job on the
device and generate what one process of eight devices generates (docs/devices.md's multi-host recipe, on
one machine)."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

from conftest import FIXTURES, golden_prompts, timeless, xla_flags

from ddtree_jax.cli import main

ROOT = Path(__file__).parent.parent


def free_port() -> int:
    """A TCP port nobody listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait(proc: subprocess.Popen, procs: list[subprocess.Popen], timeout: float = 600) -> tuple[str, str]:
    """`proc`'s (stdout, stderr); on a timeout every process is killed and each one's stderr shown."""
    try:
        return proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        tails = [f"process {i}:\n{p.communicate()[1][-2000:]}" for i, p in enumerate(procs)]
        raise AssertionError("the two processes did not finish:\n" + "\n".join(tails)) from None


def test_two_processes_match_one(tmp_path):
    prompts = tmp_path / "p.jsonl"
    short = [p for p in golden_prompts("qwen3_gqa4_tp") if len(p) <= 16]  # one length bucket: one compile
    lines = [json.dumps({"id": i, "input_ids": p}) for i, p in enumerate(short)]
    prompts.write_text("\n".join(lines) + "\n")
    base = ["--target", str(FIXTURES / "qwen3_gqa4_tp"), "--draft", str(FIXTURES / "dflash_qwen3_gqa4_tp")]
    base += ["--prompts", str(prompts), "--dtype", "float32", "--max-new-tokens", "12", "--budget", "7"]
    base += ["--batch-size", "4", "--tp", "4", "--dp", "2"]
    assert main([*base, "--out", str(tmp_path / "one.jsonl")]) == 0  # this process: 8 devices

    port = free_port()
    # Each program's first run waits for both processes to have compiled it (programs._all_processes_compiled:
    # Gloo's context gives up after 30 s, not configurable in jax 0.11.2); past that, a loaded CI machine can
    # still hold one process back at a collective for longer than XLA's CPU defaults (40 s for the devices
    # of one process to meet at a collective call).
    timeouts = ["--xla_cpu_collective_timeout_seconds=900"]
    timeouts += ["--xla_cpu_collective_call_terminate_timeout_seconds=900"]
    env = dict(os.environ, XLA_FLAGS=xla_flags(4, *timeouts))
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "ddtree_jax.cli", *base, "--out", str(tmp_path / "two.jsonl")]
            + ["--coordinator", f"127.0.0.1:{port}", "--num-processes", "2", "--process-id", str(i)],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(2)
    ]
    outputs = [wait(p, procs) for p in procs]
    # every failed process's stderr: the one that died first is the cause, the other one's error (Gloo's
    # context timing out after 30 s while it waits for the dead one) only its echo
    failed = [
        f"process {i} exited {p.returncode}:\n{err[-3000:]}"
        for i, (p, (_, err)) in enumerate(zip(procs, outputs, strict=True))
        if p.returncode
    ]
    assert not failed, "\n".join(failed)
    assert f"prompts: {len(short)}" in outputs[0][0] and "prompts:" not in outputs[1][0]  # process 0 reports
    assert "loop: device" in outputs[0][0]  # the continuous job on the device, across the processes
    one = (tmp_path / "one.jsonl").read_text().splitlines()
    two = (tmp_path / "two.jsonl").read_text().splitlines()
    by_id = lambda lines: sorted(map(timeless, map(json.loads, lines)), key=lambda r: str(r["id"]))  # noqa: E731
    assert by_id(two) == by_id(one)  # both run continuous batching (lines in finishing order)
