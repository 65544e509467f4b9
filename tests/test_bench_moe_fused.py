"""scripts/bench_moe_fused.py's control flow: the deadline and --skip-done decide which cases run, and a
failed or missing kernel check keeps the fused kernel out of the later phases. (The phases themselves
ran end to end on the CPU with --tiny: results/notes.md, issue 33.)"""

import importlib.util
import json
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parent.parent / "scripts" / "bench_moe_fused.py"


@pytest.fixture(scope="module")
def script():
    spec = importlib.util.spec_from_file_location("bench_moe_fused", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _check(path: Path, cases: list[dict]) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "check.json").write_text(json.dumps({"meta": {}, "cases": cases}))
    return path


def test_fused_kept_only_after_a_passing_bf16_check(script, tmp_path):
    bf16 = {"layer": "qwen3", "format": "bf16", "tokens": 1}
    assert not script.fused_is_wrong(_check(tmp_path / "a", [bf16 | {"ok": True}]) / "check.json")
    assert script.fused_is_wrong(_check(tmp_path / "b", [bf16 | {"ok": False}]) / "check.json")
    assert script.fused_is_wrong(_check(tmp_path / "c", [bf16 | {"error": "ValueError: ..."}]) / "check.json")
    assert script.fused_is_wrong(_check(tmp_path / "d", [bf16 | {"skipped": "deadline"}]) / "check.json")
    assert script.fused_is_wrong(tmp_path / "missing" / "check.json")
    int4_wrong = {"layer": "qwen3", "format": "int4", "tokens": 1, "ok": False}  # bf16 runs decide
    assert not script.fused_is_wrong(_check(tmp_path / "e", [bf16 | {"ok": True}, int4_wrong]) / "check.json")
    # a second call that skipped the check's cases goes by the first call's results
    skipped = _check(tmp_path / "f", [bf16 | {"skipped": "measured in the --skip-done run"}]) / "check.json"
    assert not script.fused_is_wrong(skipped, tmp_path / "a")
    assert script.fused_is_wrong(skipped, tmp_path / "b")


class _Phase:
    """The part of script.Phase that run_cases reads."""

    def __init__(self, left: float, done: list[dict]) -> None:
        self.left, self.done, self.cases = left, done, []

    def time_left(self) -> float:
        return self.left

    def add(self, case: dict) -> None:
        self.cases.append(case)


def test_cases_run_in_order_until_the_deadline(script):
    ran = []

    def run(i):
        def case():
            ran.append(i)
            if i == 1:
                raise ValueError("does not compile")
            return {"ms": float(i)}

        return case

    phase = _Phase(10.0, done=[{"tokens": 2, "ms": 5.0}])
    script.run_cases(phase, [({"tokens": i}, run(i)) for i in range(4)])
    assert ran == [0, 1, 3]  # 2 was measured by the earlier run
    assert phase.cases[1]["error"].startswith("ValueError") and "skipped" in phase.cases[2]
    late = _Phase(0.0, done=[])
    script.run_cases(late, [({"tokens": 0}, run(0))])
    assert late.cases == [{"tokens": 0, "skipped": "deadline"}] and ran == [0, 1, 3]


def test_phases_without_time_are_skipped(script, tmp_path, monkeypatch):
    """A deadline shorter than --min-phase-s skips every phase without starting a process."""
    monkeypatch.setattr(script.subprocess, "run", lambda *a, **k: pytest.fail("a phase started"))
    argv = [
        "bench_moe_fused.py",
        "--out-dir",
        str(tmp_path),
        "--deadline-s",
        "5",
        "--phases",
        "check,kimi2-rounds",
    ]
    monkeypatch.setattr(sys, "argv", argv)
    assert script.main() == 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert [p["phase"] for p in summary["phases"]] == ["check", "kimi2-rounds"]
    assert all(p["status"].startswith("skipped") for p in summary["phases"])
