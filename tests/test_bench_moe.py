"""`ddtree-bench moe` and `moe-fused` (formerly scripts/bench_moe.py and bench_moe_fused.py): the rows
and floors of a tiny dispatch run, the deadline and --skip-done deciding which cases run, a failed or
missing kernel check keeping the fused kernel out of the later phases, and the recorded files printing.
(The phases themselves ran end to end on the CPU with --tiny: results/notes.md, issue 33.)"""

import json
from pathlib import Path

import pytest

from ddtree_jax.bench import moe_fused
from ddtree_jax.bench.cli import main

RESULTS = Path(__file__).resolve().parent.parent / "results"
TINY_MOE = [
    "--layers",
    "2",
    "--experts",
    "4",
    "--experts-per-token",
    "2",
    "--hidden",
    "128",
    "--width",
    "128",
]
TINY_MOE += ["--reps", "1", "--ceiling-bytes", "1048576"]


def test_moe_tiny(tmp_path):
    """Two dispatches, two formats, two token counts: one row each in --dispatches order, the same outputs
    as the first dispatch, each floor the chosen experts' stored bytes over the read ceiling."""
    out = tmp_path / "moe.json"
    argv = ["moe", *TINY_MOE, "--tokens", "1,4", "--dispatches", "gather,sorted", "--formats", "plain,int4"]
    assert main([*argv, "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    rows, meta = data["rows"], data["meta"]
    assert meta["argv"][:2] == ["ddtree-bench", "moe"] and data["skipped"] == []
    assert [(r["dispatch"], r["format"], r["tokens"]) for r in rows] == [
        (d, f, n) for d in ("gather", "sorted") for f in ("plain", "int4") for n in (1, 4)
    ]
    # per expert: gate, up [128, 128] and down [128, 128]; bf16 2 bytes a value; INT4 half a byte a
    # value and a bf16 scale per 32 rows
    assert meta["expert_bytes"] == {"plain": 3 * 128 * 128 * 2, "int4": 3 * (128 * 128 // 2 + 4 * 128 * 2)}
    for r in rows:
        assert "error" not in r, r
        assert r["max_abs_diff_to"][0] == "gather" and r["max_abs_diff_to"][1] < 1e-2
        assert r["distinct_experts"] == 2 if r["tokens"] == 1 else 2 <= r["distinct_experts"] <= 4
        floor = (
            1e3 * r["distinct_experts"] * meta["expert_bytes"][r["format"]] / (meta["read_ceiling_gbs"] * 1e9)
        )
        assert r["floor_ms"] == pytest.approx(floor) and r["over_floor"] == pytest.approx(
            r["layer_ms"] / floor
        )
    assert set(data["dispatch_table"]) == {"plain", "int4"}
    assert all(table[-1][0] is None for table in data["dispatch_table"].values())  # any count ends it


def test_moe_past_its_deadline_lists_every_case(tmp_path):
    out = tmp_path / "moe.json"
    argv = ["moe", *TINY_MOE, "--tokens", "1,32", "--dispatches", "gather,sorted", "--gather-max", "16"]
    assert main([*argv, "--deadline-s", "1e-9", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["rows"] == []  # gather stops at --gather-max: not a case
    assert data["skipped"][1:] == [{"dispatch": "gather", "format": "plain", "tokens": 1}] + [
        {"dispatch": "sorted", "format": "plain", "tokens": n} for n in (1, 32)
    ]


@pytest.mark.parametrize("path", ["h200/moe/dispatch.json", "h200/moe-dispatch/dispatch.json"])
def test_recorded_moe_results_still_print(capsys, path):
    """--print reads the files scripts/bench_moe.py wrote (the oldest without "format": bf16)."""
    rows = json.loads((RESULTS / path).read_text())["rows"]
    assert main(["moe", "--print", str(RESULTS / path)]) == 0
    out = capsys.readouterr().out
    for n in sorted({r["tokens"] for r in rows}):
        best = min((r for r in rows if r["tokens"] == n), key=lambda r: r["layer_ms"])
        assert f"best plain at {n} tokens: {best['dispatch']} " in out
    assert "MOE_GPU_DISPATCH rows from this run:" in out


@pytest.mark.parametrize("path", ["h200/2026-12-02/moe-fused", "h200/2026-12-02/kernels-check/moe-fused"])
def test_recorded_moe_fused_results_still_print(capsys, path):
    """--print reads the out dirs scripts/bench_moe_fused.py wrote ("cases", "batch")."""
    assert main(["moe-fused", "--print", str(RESULTS / path)]) == 0
    out = capsys.readouterr().out
    assert "== check" in out and "qwen3  bf16    1  fused 2." in out
    if path.endswith("12-02/moe-fused"):
        assert "ddtree   15  16  grouped    12.28 ms" in out  # kimi2-rounds, its "batch" read


def _check(path: Path, rows: list[dict], key: str = "rows") -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "check.json").write_text(json.dumps({"meta": {}, key: rows}))
    return path


@pytest.mark.parametrize("key", ["rows", "cases"])  # cases: scripts/bench_moe_fused.py's files
def test_fused_kept_only_after_a_passing_bf16_check(tmp_path, key):
    bf16 = {"layer": "qwen3", "format": "bf16", "tokens": 1}
    wrong = moe_fused.fused_is_wrong
    assert not wrong(_check(tmp_path / "a", [bf16 | {"ok": True}], key) / "check.json")
    assert wrong(_check(tmp_path / "b", [bf16 | {"ok": False}], key) / "check.json")
    assert wrong(_check(tmp_path / "c", [bf16 | {"error": "ValueError: ..."}], key) / "check.json")
    assert wrong(_check(tmp_path / "d", [bf16 | {"skipped": "deadline"}], key) / "check.json")
    assert wrong(_check(tmp_path / "d2", [], key) / "check.json")
    assert wrong(tmp_path / "missing" / "check.json")
    int4_wrong = {"layer": "qwen3", "format": "int4", "tokens": 1, "ok": False}  # bf16 runs decide
    assert not wrong(_check(tmp_path / "e", [bf16 | {"ok": True}, int4_wrong], key) / "check.json")
    # a second call that skipped the check's cases goes by the first call's results
    skipped = _check(tmp_path / "f", [], key) / "check.json"
    assert not wrong(skipped, tmp_path / "a")
    assert wrong(skipped, tmp_path / "b")


class _Phase:
    """The part of moe_fused.Phase that run_cases reads."""

    def __init__(self, left: float, done: list[dict]) -> None:
        self.left, self.done, self.cases = left, done, []

    def time_left(self) -> float:
        return self.left

    def add(self, case: dict) -> None:
        self.cases.append(case)


def test_cases_run_in_order_until_the_deadline():
    ran = []

    def run(i):
        def case():
            ran.append(i)
            if i == 1:
                raise ValueError("does not compile")
            return {"ms": float(i)}

        return case

    phase = _Phase(10.0, done=[{"tokens": 2, "ms": 5.0}])
    moe_fused.run_cases(phase, [({"tokens": i}, run(i)) for i in range(4)])
    assert ran == [0, 1, 3]  # 2 was measured by the earlier run
    assert phase.cases[1]["error"].startswith("ValueError") and "skipped" in phase.cases[2]
    late = _Phase(0.0, done=[])
    moe_fused.run_cases(late, [({"tokens": 0}, run(0))])
    assert late.cases == [{"tokens": 0, "skipped": "deadline"}] and ran == [0, 1, 3]


def test_phases_without_time_are_skipped(tmp_path, monkeypatch):
    """A deadline shorter than --min-phase-s skips every phase without starting a process."""
    monkeypatch.setattr(moe_fused.subprocess, "run", lambda *a, **k: pytest.fail("a phase started"))
    argv = ["moe-fused", "--out-dir", str(tmp_path), "--deadline-s", "5", "--phases", "check,kimi2-rounds"]
    assert main(argv) == 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["argv"][:2] == ["ddtree-bench", "moe-fused"]
    assert [p["phase"] for p in summary["phases"]] == ["check", "kimi2-rounds"]
    assert all(p["status"].startswith("skipped") for p in summary["phases"])


def test_a_phase_and_its_skip_done_rerun(tmp_path):
    """One phase as its child process runs it (--tiny, in this process): a row per dispatch and token
    count, gather only up to its limit; a second call with --skip-done measures nothing again."""
    first, second = tmp_path / "first", tmp_path / "second"
    argv = ["moe-fused", "--phase", "qwen3-dispatch", "--tiny", "--no-fused"]
    assert main([*argv, "--out-dir", str(first)]) == 0
    data = json.loads((first / "qwen3-dispatch.json").read_text())
    assert data["meta"]["phase"] == "qwen3-dispatch" and data["skipped"] == []
    labels = [(r["tokens"], r["dispatch"]) for r in data["rows"]]
    assert labels == [
        (1, "gather"),
        (1, "grouped"),
        (8, "gather"),
        (8, "grouped"),
        (1, "sorted"),
        (16, "sorted"),
    ]
    assert all("error" not in r and r["over_floor"] > 0 for r in data["rows"])
    assert main([*argv, "--out-dir", str(second), "--skip-done", str(first)]) == 0
    again = json.loads((second / "qwen3-dispatch.json").read_text())
    assert again["rows"] == [] and len(again["skipped"]) == len(labels)
    assert {s["skipped"] for s in again["skipped"]} == {"measured in the --skip-done run"}
