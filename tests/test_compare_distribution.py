"""ddtree-compare distribution: ddtree's samples pass the G-test against the exact target distribution;
a sampler biased at one output position is flagged at that position; greedy is refused."""

import json

import jax
import pytest
from conftest import FIXTURES, forget_programs

from ddtree_jax import engine
from ddtree_jax.compare.cli import main

TP, DRAFT = "qwen3_gqa4_tp", "dflash_qwen3_gqa4_tp"
PROMPT = "golden-2"  # 12 tokens: output position 1 is absolute position 13
BIASED_OUTPUT, BIASED_ABSOLUTE = 1, 13


@pytest.fixture
def prompts(tmp_path):
    lines = [json.loads(s) for s in (FIXTURES / "prompts.jsonl").read_text().splitlines()]
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in lines if r["id"] == PROMPT))
    return path


def argv(prompts, report, *flags):
    return [
        "distribution",
        "--target",
        str(FIXTURES / TP),
        "--draft",
        str(FIXTURES / DRAFT),
        "--prompts",
        str(prompts),
        "--dtype",
        "float32",
        "--budget",
        "7",
        "--temperature",
        "1.0",
        "--top-k",
        "3",
        "--samples",
        "1500",
        "--batch-size",
        "1500",
        "--positions",
        "2",
        "--report",
        str(report),
        *flags,
    ]


def biased_choose(real):
    """A sampler at a hotter temperature (x3) at one absolute position, exact everywhere else."""

    def choose(logits, sampling=None, position=None, model_axis=None):
        hot = (position == BIASED_ABSOLUTE)[..., None]
        return real(jax.numpy.where(hot, logits / 3.0, logits), sampling, position, model_axis)

    return choose


def test_passes_then_flags_biased_position(tmp_path, prompts, monkeypatch, capsys):
    assert main(argv(prompts, tmp_path / "ok")) == 0
    rep = json.loads((tmp_path / "ok" / "report.json").read_text())
    (c,) = rep["comparisons"]
    assert rep["verdict"] == "agree" and c["identical"] == 1 and not c["divergences"]
    tests = c["tests"][PROMPT]["positions"]
    assert [t["position"] for t in tests] == [0, 1] and all(t["dof"] >= 2 for t in tests)
    assert capsys.readouterr().out.startswith("distribution: agree: 1/1 prompts")

    forget_programs(monkeypatch)
    monkeypatch.setattr(engine, "choose", biased_choose(engine.choose))
    assert main(argv(prompts, tmp_path / "bias")) == 0
    rep = json.loads((tmp_path / "bias" / "report.json").read_text())
    (c,) = rep["comparisons"]
    (d,) = c["divergences"]
    assert rep["verdict"] == "differ" and (d["id"], d["position"]) == (PROMPT, BIASED_OUTPUT)
    first, second = c["tests"][PROMPT]["positions"]
    assert first["p_value"] > 1e-3 and second["p_value"] < 1e-6  # only the biased position fails
    forget_programs(monkeypatch)


def test_greedy_is_refused(tmp_path, prompts, capsys):
    assert main(argv(prompts, tmp_path / "r", "--temperature", "0")) == 1
    assert "distribution needs --temperature > 0" in capsys.readouterr().err
    assert not (tmp_path / "r").exists()
