"""ddtree-bench rounds runs end to end at tiny sizes (a smoke test: no timing is asserted), called as
`ddtree-bench --shape ...` (no sub-command: rounds, as the recorded commands run it)."""

import json
import sys
from pathlib import Path

import pytest

from ddtree_jax.bench.cli import main

TINY = ["--shape", "tiny", "--draft-layers", "1", "--block-size", "4", "--contexts", "32", "--rounds", "2"]
TINY += ["--ceiling-bytes", "1048576"]


def test_bench_tiny_writes_every_configuration(tmp_path, capsys):
    out = tmp_path / "bench.json"
    argv = [*TINY, "--methods", "ar,ddtree", "--budgets", "3", "--batch-sizes", "2", "--stages"]
    # sampled (greedy, the default, runs in the tensor-parallel test below)
    argv += ["--sampling", "0.7:5:0.9", "--out", str(out)]
    assert main(argv) == 0
    err = capsys.readouterr().err  # progress: each configuration as it starts and ends
    assert "[1/2] ar batch 2 context 32 reference sampled ..." in err
    assert "[2/2] ddtree 3 batch 2 context 32 reference sampled: " in err and " ms per round (" in err
    data = json.loads(out.read_text())
    rows = data["rows"]
    assert [(r["method"], r["sampling"]) for r in rows] == [
        ("ar", {"temperature": 0.7, "top_k": 5, "top_p": 0.9, "seed": 0}),
        ("ddtree", {"temperature": 0.7, "top_k": 5, "top_p": 0.9, "seed": 0}),
    ]
    for r in rows:
        assert "error" not in r, r.get("error")
        assert r["round_ms"] > 0 and r["target_floor_ms"] > 0
        drafted = {"draft", "build"} if r["method"] == "ddtree" else set()
        assert set(r["stages_ms"]) == {"build", "verify", "walk", "commit"} | drafted  # engine.STAGES
        assert set(r["device_stages_ms"]) == {"verify", "walk", "commit"} | drafted
        assert all(r["device_stages_ms"][k] > 0 for k in {"verify"} | drafted)
    assert data["meta"]["read_ceiling_gbs"] > 0


def test_bench_tiny_on_a_tensor_parallel_mesh(tmp_path):
    """--tp 4 over fake devices (2 K/V heads: one per device, repeated): every method and stage runs."""
    out = tmp_path / "bench.json"
    argv = [
        *TINY,
        "--methods",
        "ar,dflash,ddtree",
        "--budgets",
        "3",
        "--batch-sizes",
        "1",
        "--stages",
        "--tp",
        "4",
    ]
    assert main([*argv, "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["meta"]["tp"] == 4
    assert [(r["method"], r["batch_size"], r["rows"]) for r in data["rows"]] == [
        ("ar", 1, 2),  # one ar row runs as two, as ddtree-generate runs it
        ("dflash", 1, 1),
        ("ddtree", 1, 1),
    ]
    for r in data["rows"]:
        assert "error" not in r, r.get("error")
        assert r["tp"] == 4 and r["round_ms"] > 0
        assert r["device_stages_ms"]["verify"] > 0


def test_padding_rows_are_inactive_as_generation_pads():
    """A one-row ar plan runs two rows; the bench's second row is padding: done, one cached token."""
    import jax.numpy as jnp
    import numpy as np

    from ddtree_jax.bench.programs import synthetic_state
    from ddtree_jax.bench.shapes import SHAPES
    from ddtree_jax.engine import Plan
    from ddtree_jax.pair import batch_shape

    cfg = SHAPES["tiny"]
    plan = Plan(cfg, None, "ar", 64)
    shape = batch_shape(plan, 1, 32)
    assert shape.rows == 2
    state = synthetic_state(plan, shape, 32, 0, jnp.float32, active=1)
    np.testing.assert_array_equal(state.cache.lengths, [32, 1])
    np.testing.assert_array_equal(state.done, [False, True])
    full = synthetic_state(plan, shape, 32, 0, jnp.float32)
    np.testing.assert_array_equal(full.cache.lengths, [32, 32])
    assert not full.done.any()


def _all_reduces(lowered) -> int:
    """The all-reduce ops of a lowered program (StableHLO text)."""
    return lowered.as_text().count("all_reduce")


def test_dropped_all_reduce_is_the_layers_and_for_its_run_alone(tmp_path):
    """--drop-layer-all-reduce (timing only): the round traced inside `without_layer_all_reduce()` has
    exactly two all-reduces a target layer fewer (o_proj, down_proj) than the same round traced outside,
    the switch is off again after the run, and the flag is refused without a mesh."""
    import jax.numpy as jnp

    from ddtree_jax import target
    from ddtree_jax.bench.programs import round_program, synthetic_state
    from ddtree_jax.bench.shapes import SHAPES, draft_shape
    from ddtree_jax.models import common
    from ddtree_jax.pair import batch_shape, make_plan
    from ddtree_jax.sharding import make_mesh, param_sharding
    from ddtree_jax.weights import random_params

    cfg = SHAPES["tiny"]
    dcfg = draft_shape(cfg, 1, 4)
    place = param_sharding(make_mesh(2)).place
    params = random_params(target.weight_specs(cfg), 0, jnp.float32, place=place)
    plan = make_plan(cfg, dcfg, "ar", batch_size=2, max_new_tokens=8, tp=2)
    state = synthetic_state(plan, batch_shape(plan, 2, 32), 32, 0, jnp.float32)

    def lowered():  # a fresh jit each time: traced under the switch as it is now
        return round_program(plan, 2).lower(params, None, state)

    kept = _all_reduces(lowered())
    with common.without_layer_all_reduce():
        dropped = _all_reduces(lowered())
    with common.without_layer_all_reduce(False):
        assert _all_reduces(lowered()) == kept
    assert kept - dropped == 2 * cfg.num_layers and dropped > 0  # the embedding's and the head's stay

    out = tmp_path / "bench.json"
    argv = [*TINY, "--methods", "ar", "--batch-sizes", "2", "--out", str(out)]
    assert main([*argv, "--tp", "2", "--drop-layer-all-reduce"]) == 0
    assert _all_reduces(lowered()) == kept  # the switch held for the run alone
    data = json.loads(out.read_text())
    assert data["meta"]["layer_all_reduce"] is False
    row = data["rows"][0]
    assert "error" not in row and row["tp"] == 2
    assert main([*argv, "--drop-layer-all-reduce"]) == 1


def test_stage_loops_keep_every_pass_inside_the_loop():
    """The device-loop stage timers: XLA hoists nothing of a pass but constants and settings (no
    matmul, sort, top-k, and nothing computed from positions or seeds) out of the timed loop."""
    import re

    import jax.numpy as jnp

    from ddtree_jax import drafter, engine, target
    from ddtree_jax.bench.programs import stage_programs, synthetic_state
    from ddtree_jax.bench.shapes import SHAPES, draft_shape
    from ddtree_jax.engine import Plan
    from ddtree_jax.programs import Shape
    from ddtree_jax.weights import random_params

    cfg = SHAPES["tiny"]
    dcfg = draft_shape(cfg, 1, 4)
    params = random_params(target.weight_specs(cfg), 0, jnp.float32)
    dparams = random_params(drafter.weight_specs(dcfg), 1, jnp.float32)
    plan = Plan(cfg, dcfg, "ddtree", 64, 7, 7, "reference")
    sampled = {"temperature": 0.7, "top_k": 5, "top_p": 0.9, "seed": 0}
    state = synthetic_state(plan, Shape.of(plan, 2, 32), 32, 0, jnp.float32, sampled)
    logp, tok = engine.draft(params, dparams, state, plan)
    tree = engine.build(state, logp, tok, plan)
    choice = engine.verify(params, state, tree, plan)[0]
    programs = stage_programs(plan, 4)
    loops = {
        "draft": programs["draft"].lower(params, dparams, state),
        "build": programs["build"].lower(state, logp, tok),
        "verify": programs["verify"].lower(params, state, tree),
        "walk": programs["walk"].lower(tree, choice),
    }
    for name, lowered in loops.items():
        hlo = lowered.compile().as_text()
        entry = hlo[hlo.index("ENTRY") :]
        assert entry.count(" while(") == 1, name
        assert not re.search(r" (dot|sort|custom-call|convolution)\(", entry), name
        assert not re.search(r"fusion\([^)]*(seed|lengths)", entry), name


def test_bench_moe_shape_and_its_floor(tmp_path):
    """A MoE shape runs on one device and on an expert-parallel mesh; its floor counts the experts its
    tokens are expected to select, so a larger tree's floor reads more expert bytes; the floor of the
    experts the router chose sits beside it (tests/test_chosen_floor.py checks its count)."""
    from ddtree_jax.bench.shapes import SHAPES
    from ddtree_jax.models import moe

    moe_tiny = [a if a != "tiny" else "tiny-moe" for a in TINY]
    # the floor of the experts chosen compiles each round twice: on the expert-parallel mesh only (the
    # experts split by columns, --moe-sharding tp, run in tests/test_families.py's MoE meshes)
    for extra in (["--no-chosen-floor"], ["--tp", "4", "--moe-sharding", "ep"]):
        out = tmp_path / "bench.json"
        argv = [*moe_tiny, "--methods", "ar,ddtree", "--budgets", "3,15", "--batch-sizes", "1", *extra]
        assert main([*argv, "--out", str(out)]) == 0
        rows = json.loads(out.read_text())["rows"]
        assert all("error" not in r for r in rows), rows
        ar, small, big = rows
        assert (ar["floor_tokens"], small["floor_tokens"], big["floor_tokens"]) == (1, 4, 16)
        assert ar["target_floor_ms"] < small["target_floor_ms"] < big["target_floor_ms"]
        for r in rows:  # beside it, unless refused, the floor of the experts chosen: round_over_floor's
            if "--no-chosen-floor" in extra:
                assert "chosen_floor_ms" not in r
                continue
            assert r["round_over_floor"] == pytest.approx(r["round_ms"] / r["chosen_floor_ms"])
            assert r["round_over_uniform_floor"] == pytest.approx(r["round_ms"] / r["target_floor_ms"])
            assert 1 <= r["chosen_distinct_experts"] <= 8
    cfg = SHAPES["qwen3-30b-a3b"]
    assert moe.expected_distinct(cfg.num_experts, cfg.experts_per_token, 1) == 8
    assert round(moe.expected_distinct(cfg.num_experts, cfg.experts_per_token, 8)) == 52


@pytest.mark.parametrize(
    "flags,needle",
    [
        (["--budgets", "0"], "--budgets 0: '0' is not an integer >= 1"),
        (["--budgets", "15,-3"], "--budgets 15,-3: '-3' is not an integer >= 1"),
        (["--batch-sizes", "0"], "--batch-sizes 0: '0' is not an integer >= 1"),
        (["--contexts", "1k"], "--contexts 1k: '1k' is not an integer >= 1"),
        (["--rounds", "0"], "--rounds 0: must be >= 1"),
        (["--attention", "foo"], "--attention foo: 'foo' is not one of reference, pallas, pallas-invariant"),
        (
            ["--attention", "reference,pallas"],
            "--attention pallas: the Pallas kernels need a GPU (backend: cpu)",
        ),
        (["--methods", "ar,beam"], "--methods ar,beam: 'beam' is not one of ar, dflash, ddtree"),
        (["--sampling", "greedy,0.7:x:1"], "--sampling '0.7:x:1': not greedy or T:top_k:top_p"),
        (
            ["--sampling", "0.7:0:2"],
            "--sampling '0.7:0:2': needs temperature >= 0, top_k >= 0, 0 < top_p <= 1",
        ),
        (
            ["--block-size", "2", "--budgets", "40"],
            "--budgets: 40 exceeds the drafter's lattice (1 depths of 32)",
        ),
        (["--tp", "9"], "--tp 9: between 1 and the 8 devices here"),
        (["--shape", "qwen3-8b", "--quantize", "fp8"], "--quantize fp8 needs a shape whose family reads it"),
        (["--out", "MISSING/b.json"], "directory"),
        (["--out", "DIR"], "is a directory"),
        (["--shape", "gpt-5"], "argument --shape: invalid choice: 'gpt-5'"),
    ],
)
def test_flags_refused_before_any_work(tmp_path, capsys, monkeypatch, flags, needle):
    """A bad flag or --out: one line naming it, exit 1, before any weight is made or file written."""
    from ddtree_jax.bench import rounds

    monkeypatch.setattr(rounds, "random_params", lambda *a, **k: pytest.fail("weights made"))
    flags = [
        str(tmp_path / f[4:]) if f.startswith("MISSING") else str(tmp_path) if f == "DIR" else f
        for f in flags
    ]
    argv = [*TINY, "--out", str(tmp_path / "b.json"), *flags]
    assert main(argv) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("ddtree-bench rounds: error: ") and needle in err[0], err
    assert not (tmp_path / "b.json").exists()


def test_shape_required_and_help_shows_defaults(capsys):
    assert main(["--out", "x.json"]) == 1
    assert "the following arguments are required: --shape" in capsys.readouterr().err
    assert main(["rounds", "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "(default: 15,63)" in text and "(default: reference)" in text and "exit status" in text


def test_a_failed_configuration_exits_1(tmp_path, capsys, monkeypatch):
    """A configuration that fails keeps its error in its row, the others run, and the exit status says so."""
    from ddtree_jax.bench import rounds

    real = rounds.bench_one

    def failing(params, dparams, plan, *args):
        if plan.method == "ar":
            raise RuntimeError("out of memory")
        return real(params, dparams, plan, *args)

    monkeypatch.setattr(rounds, "bench_one", failing)
    out = tmp_path / "b.json"
    assert main([*TINY, "--methods", "ar,dflash", "--out", str(out)]) == 1
    rows = json.loads(out.read_text())["rows"]
    assert rows[0]["error"] == "RuntimeError: out of memory" and rows[1]["round_ms"] > 0
    assert "1 of 2 configurations failed" in capsys.readouterr().err


def test_default_pair_shape_is_the_bundled_target():
    """ddtree-bench's `default-pair` shape is the bundled target's config (its stop ids aside)."""
    import dataclasses

    from ddtree_jax.bench.shapes import SHAPES
    from ddtree_jax.cli import BUNDLED
    from ddtree_jax.models import load_target_config

    bundled = load_target_config(BUNDLED / "target")
    assert dataclasses.replace(bundled, eos_token_ids=()) == SHAPES["default-pair"]


# The kernel micro-benchmarks (formerly scripts/bench_*.py) and the plots, as sub-commands.

RESULTS = Path(__file__).resolve().parent.parent / "results"


def test_topk_tiny(tmp_path):
    """`ddtree-bench topk`: one row per case, both top-k's timed, the same values and ids."""
    out = tmp_path / "topk.json"
    assert main(["topk", "--vocab-size", "512", "--cases", "4:8,2:16", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert [(r["rows"], r["k"], r["vocab_size"], r["identical"]) for r in data["rows"]] == [
        (4, 8, 512, True),
        (2, 16, 512, True),
    ]
    assert all(r["lax_top_k_us"] > 0 and r["tiled_top_k_us"] > 0 for r in data["rows"])
    assert data["skipped"] == [] and data["meta"]["argv"][:2] == ["ddtree-bench", "topk"]


def test_tree_tiny(tmp_path):
    """`ddtree-bench tree`: one row per (case, variant), compiled and timed."""
    out = tmp_path / "tree.json"
    argv = ["tree", "--cases", "1:7", "--depth", "3", "--branching", "4", "--reps", "2"]
    assert main([*argv, "--variants", "paths,climb", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["batch_size"], r["budget"], r["variant"]) for r in rows] == [(1, 7, "paths"), (1, 7, "climb")]
    assert all(r["median_us"] > 0 and r["compile_s"] >= 0 for r in rows)


@pytest.mark.parametrize(
    "name, path",
    [
        ("attention", "h200/bench_attention.json"),  # the first kernel run (2026-11), before the header
        ("attention", "h200/decode/decode.json"),  # tiles named blocks
        ("mosaic-attention", "h200/2026-12-02/mosaic-table/mosaic_attention.json"),
    ],
)
def test_recorded_kernel_results_still_print(capsys, name, path):
    """--print reads the kernel JSONs recorded by the scripts these sub-commands were (results/)."""
    if not (RESULTS / path).exists():
        pytest.skip(f"results/{path} not in this checkout")
    assert main([name, "--print", str(RESULTS / path)]) == 0
    out = capsys.readouterr().out
    assert "read ceiling" in out or "ceilings" in out.lower()


def test_plot_reproduces_the_recorded_default_budgets():
    """`ddtree-bench plot`'s choice of budget per batch size from the recorded sweeps (the command in
    results/h200/README.md) is the recorded default_budgets.json (no matplotlib needed for the numbers)."""
    from ddtree_jax.bench.plot import acceptance_curve, default_budgets, load_rows, round_ms_at

    sweep = RESULTS / "h200" / "sweep"
    names = ["budgets", "batches", "small_budgets", "batch32_budget7", "ar_rows", "ar_rows_inactive"]
    rows = load_rows([sweep / f"{n}.json" for n in names])
    ar, by_batch = round_ms_at(rows, 1024)
    choice = default_budgets(ar, by_batch, acceptance_curve(RESULTS / "default-pair-eval-greedy.json"))
    recorded = json.loads((RESULTS / "h200" / "plots" / "default_budgets.json").read_text())
    assert {str(b): c["budget"] for b, c in choice.items()} == {b: c["budget"] for b, c in recorded.items()}
    for b, c in choice.items():
        assert c["projected_speedup"] == pytest.approx(recorded[str(b)]["projected_speedup"], rel=1e-12)


def test_plot_errors_are_one_line(tmp_path, capsys):
    missing = tmp_path / "none.json"
    assert main(["plot", "--bench", str(missing), "--out", str(tmp_path / "plots")]) == 1
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(f"ddtree-bench plot: error: {missing}: cannot read a benchmark JSON")


def test_plot_draws_the_recorded_sweeps(tmp_path):
    """`ddtree-bench plot` on the recorded sweeps (results/h200/README.md's command): the three figures
    and the recorded default budgets."""
    pytest.importorskip("matplotlib")
    sweep = RESULTS / "h200" / "sweep"
    names = ["budgets", "batches", "small_budgets", "batch32_budget7", "ar_rows", "ar_rows_inactive"]
    argv = ["plot", "--bench", *(str(sweep / f"{n}.json") for n in names)]
    argv += ["--stage-bench", str(sweep / "stages.json"), "--context-bench", str(sweep / "contexts.json")]
    argv += ["--acceptance", str(RESULTS / "default-pair-eval-greedy.json"), "--out", str(tmp_path)]
    assert main(argv) == 0
    assert {p.name for p in tmp_path.iterdir()} == {
        "budget.png",
        "context.png",
        "stages.png",
        "default_budgets.json",
    }
    recorded = json.loads((RESULTS / "h200" / "plots" / "default_budgets.json").read_text())
    assert json.loads((tmp_path / "default_budgets.json").read_text()) == recorded


def test_torch_step_without_torch_is_one_line(tmp_path, capsys, monkeypatch):
    """`ddtree-bench torch-step` needs torch (the compare extra): without it, one line saying so."""
    monkeypatch.setitem(sys.modules, "torch", None)  # import torch raises ImportError
    assert main(["torch-step", "--shapes", "tiny", "--out", str(tmp_path / "t.json")]) == 1
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line == "ddtree-bench torch-step: error: needs torch: pip install 'ddtree-jax[compare]'"


def test_torch_step_tiny_on_the_cpu(tmp_path):
    """Without CUDA only the eager step runs (float32): one row per (batch size, T), the header's device
    the CPU; the old --repeats still runs."""
    pytest.importorskip("torch")
    out = tmp_path / "torch.json"
    argv = ["torch-step", "--shapes", "tiny", "--batch-sizes", "1,2", "--tokens", "1", "--context", "16"]
    assert main([*argv, "--steps", "2", "--repeats", "1", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert [(r["batch_size"], r["tokens"]) for r in data["rows"]] == [(1, 1), (2, 1)]
    assert all(set(r["ms"]) == {"eager"} and r["ms"]["eager"] > 0 for r in data["rows"])
    assert data["meta"]["device_count"] == 1 and data["meta"]["dtype"] == "torch.float32"
