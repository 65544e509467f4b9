"""DFlash2 drafters in the round: `--method dflash` (the selector's chain) and `--method ddtree` (the
edge-score tree, tree_edges.py) emit exactly the ar tokens, greedy and sampled (seed-exact), on one
device and on a mesh; the marginal-only tree of the same drafter too."""

import dataclasses

import conftest
import pytest
from conftest import golden, golden_prompts, run

TP = "qwen3_gqa4_tp"
DRAFT = "dflash2/qwen3_gqa4_tp"  # tests/fixtures/dflash2/qwen3_gqa4_tp (make_dflash2.py)
PROMPTS = golden_prompts(TP) + [[7, 9, 11], [200, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13], [42] * 9]
GREEDY5 = [golden(TP)[f"greedy_{i}"].tolist() for i in range(5)]
SAMPLED = [
    {"temperature": 0.7, "top_k": 20, "seed": 1},
    {"temperature": 1.0, "top_p": 0.9, "seed": 2},
    {"temperature": 0.0, "seed": 3},
    {"temperature": 1.0, "seed": 5},
    {"temperature": 0.7, "seed": 2**32 - 1},
]


@pytest.fixture(autouse=True, scope="module")
def _dflash2_fixture():
    conftest.DRAFTERS[DRAFT] = TP  # load_drafter's target for this drafter
    yield
    del conftest.DRAFTERS[DRAFT]


def ids(results):
    return [r.output_ids for r in results]


@pytest.mark.parametrize("method,budget", [("dflash", 0), ("ddtree", 15)])
def test_greedy_equals_ar(method, budget):
    results = run(TP, PROMPTS[:5], method=method, draft_name=DRAFT, budget=budget)
    assert ids(results) == GREEDY5
    for r in results:
        assert sum(r.acceptance_lengths) + 1 == len(r.output_ids) == 24


@pytest.fixture(scope="module")
def ar_sampled():
    return ids(run(TP, PROMPTS[:5], options=SAMPLED))


@pytest.mark.parametrize(
    "method,budget,tempered", [("dflash", 0, False), ("ddtree", 7, False), ("ddtree", 7, True)]
)
def test_sampled_seed_exact_against_ar(ar_sampled, method, budget, tempered):
    """tempered: the edge scores divided by each row's temperature change the tree, not the output."""
    results = run(
        TP,
        PROMPTS[:5],
        method=method,
        draft_name=DRAFT,
        budget=budget,
        options=SAMPLED,
        tempered_draft=tempered,
    )
    assert ids(results) == ar_sampled
    assert ar_sampled[2] == GREEDY5[2]


def test_identical_on_a_mesh():
    """Sampled rows and a greedy one (SAMPLED[2]), on one device and on a 2 x 2 mesh."""
    sampling = SAMPLED + SAMPLED[:3]
    one = ids(run(TP, PROMPTS, method="ddtree", draft_name=DRAFT, budget=7, options=sampling))
    two = ids(run(TP, PROMPTS, method="ddtree", draft_name=DRAFT, budget=7, options=sampling, tp=2, dp=2))
    assert one == two


def test_marginal_tree_of_the_same_drafter_equals_ar():
    """selector off: the drafter's marginals alone through tree.lattice_tree (the comparison's baseline)."""
    from conftest import load_drafter, load_target

    from ddtree_jax.engine import Plan
    from ddtree_jax.prompts import Prompt
    from ddtree_jax.scheduler import Generator, Schedule

    cfg, params = load_target(TP)
    dcfg, dparams = load_drafter(DRAFT)
    dcfg = dataclasses.replace(dcfg, dflash2=dataclasses.replace(dcfg.dflash2, selector=False))
    for method, budget in (("dflash", 0), ("ddtree", 7)):
        plan = Plan(cfg, dcfg, method, max_new_tokens=24, budget=budget, branching=7 if budget else 1)
        prompts = [Prompt(i, i + 1, p, {}) for i, p in enumerate(PROMPTS[:5])]
        results = Generator(params, dparams, plan, (), schedule=Schedule(5, "static")).run(prompts)
        assert ids(results) == GREEDY5


def test_bench_rounds_with_a_dflash2_drafter(tmp_path):
    """`ddtree-bench rounds --dflash2` times the DFlash2 round and its stages (the edge-score build
    included) at a tiny size."""
    import json

    from ddtree_jax.bench.cli import main

    out = tmp_path / "r.json"
    argv = ["rounds", "--shape", "tiny", "--draft-layers", "1", "--block-size", "4", "--contexts", "32"]
    argv += ["--dflash2", "--methods", "ddtree", "--budgets", "7", "--rounds", "1", "--stages"]
    assert main([*argv, "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["method"] for r in rows] == ["ddtree"]
    assert all("error" not in r for r in rows)


def test_compare_distribution_accepts_the_dflash2_sampler(tmp_path):
    """`ddtree-compare distribution` with the DFlash2 drafter (ddtree over edge scores): its samples pass
    the G-test against the target's exact distribution."""
    import json

    from conftest import FIXTURES

    from ddtree_jax.compare.cli import main

    lines = [json.loads(s) for s in (FIXTURES / "prompts.jsonl").read_text().splitlines()]
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in lines if r["id"] == "golden-2"))
    argv = ["distribution", "--target", str(FIXTURES / TP), "--draft", str(FIXTURES / DRAFT)]
    argv += ["--prompts", str(prompts), "--dtype", "float32", "--budget", "7", "--temperature", "1.0"]
    argv += ["--samples", "400", "--batch-size", "400", "--positions", "2", "--report", str(tmp_path / "r")]
    assert main(argv) == 0
    rep = json.loads((tmp_path / "r" / "report.json").read_text())
    assert rep["verdict"] == "agree" and rep["comparisons"][0]["identical"] == 1
