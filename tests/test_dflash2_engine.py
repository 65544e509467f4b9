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


@pytest.mark.parametrize("method,budget", [("dflash", 0), ("ddtree", 7), ("ddtree", 15)])
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
    for sampling in (None, SAMPLED + SAMPLED[:3]):
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
