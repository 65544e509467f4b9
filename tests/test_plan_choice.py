"""The plan choice (plan_choice.py): the expected accepted length against exact enumeration through the
engine's own tree build and walk, the acceptance counts, the cost table, and the choice itself."""

import itertools

import numpy as np
import pytest

from ddtree_jax import plan_choice as pc


def random_accept(rng, d, k, inside=0.9):
    """accept [d, k]: sorted descending per depth, each depth's mass `inside` (the rest: not in the top-k)."""
    x = -np.sort(-rng.dirichlet(np.ones(k), d), axis=1)
    return x * inside


@pytest.mark.parametrize("seed", [0, 1])
def test_expected_length_equals_exact_enumeration_through_the_engine_tree(seed):
    """Every target outcome of a 3-deep, 3-wide lattice (each depth: one of the 3 ranks or none of them)
    walked on the engine's tree (tree.lattice_tree, tree.walk) and weighted by its probability: the mean
    accepted length equals expected_length at every budget, up to the whole lattice (39 nodes)."""
    from ddtree_jax.tree import lattice_tree, walk

    d, k = 3, 3
    accept = random_accept(np.random.default_rng(seed), d, k)
    outcomes = list(itertools.product(range(k + 1), repeat=d))  # rank k: the target's token is none
    prob = np.array(
        [np.prod([accept[i, r] if r < k else 1 - accept[i].sum() for i, r in enumerate(o)]) for o in outcomes]
    )
    assert prob.sum() == pytest.approx(1.0)
    b = len(outcomes)
    logp = np.broadcast_to(np.log(accept), (b, d, k)).astype(np.float32)
    tok = np.broadcast_to(np.arange(k, dtype=np.int32), (b, d, k))  # token id = rank; id k: none
    for budget in (1, 2, 3, 5, 8, 13, 39):
        tree = lattice_tree(np.zeros(b, np.int32), logp, tok, budget)
        depth = np.asarray(tree.depth)
        # the target's token after node i is its token at depth depth[i] + 1
        targets = np.array(outcomes)
        choice = np.take_along_axis(
            np.concatenate([targets, np.zeros((b, 1), int)], 1), np.minimum(depth, d), 1
        )
        length = np.asarray(walk(tree, choice.astype(np.int32), d).length)
        assert float(prob @ length) == pytest.approx(pc.expected_length(accept, budget), rel=1e-6), budget


def test_chain_and_ar_lengths():
    accept = random_accept(np.random.default_rng(2), 5, 4)
    assert pc.chain_length(accept) == pytest.approx(pc.expected_length(accept[:, :1], 5))
    assert pc.plan_tokens("ar", accept) == 1.0
    assert pc.plan_tokens("dflash", accept) == pc.chain_length(accept)
    lengths = [pc.plan_tokens(f"ddtree-{n}", accept) for n in (1, 3, 7, 15)]
    assert lengths == sorted(lengths) and lengths[0] == pytest.approx(1 + accept[0, 0])


def test_sampled_rounds_accept_as_expected():
    """The model's sampler (the simulation's rounds): the mean accepted length is expected_length's."""
    rng = np.random.default_rng(4)
    accept = pc.curve_marginals("bundled-pair")[:6]
    tree = pc.tree_paths("ddtree-7", accept)
    ranks, lengths = pc.sample_round(accept, tree, 4000, rng)
    # observed depths = accepted depth + 1, capped at D: the mean accepted length is lengths' mean where
    # the cap did not bite (the walk reached depth D rarely here)
    accepted = np.array([len([1 for d in range(6) if tuple(ranks[r, : d + 1]) in tree]) for r in range(4000)])
    assert np.all(lengths == np.minimum(accepted + 1, 6))
    want = pc.expected_length(accept[:, :7], 7)
    assert accepted.mean() + 1 == pytest.approx(want, abs=4 * accepted.std() / np.sqrt(4000))


def test_counts_see_only_the_ranks_a_plan_can_see():
    counts = pc.AcceptanceCounts.empty(depth=3, width=4)
    # row 0: ranks 0, 2 accepted then rank 1 at depth 3 (the bonus); row 1: rank 5 (outside) at depth 1
    counts.observe(np.array([[0, 2, 1], [5, 0, 0]]), np.array([3, 1]), width=3)
    np.testing.assert_array_equal(counts.seen, [[2, 2, 2, 0], [1, 1, 1, 0], [1, 1, 1, 0]])
    np.testing.assert_array_equal(counts.hits, [[1, 0, 0, 0], [0, 0, 1, 0], [0, 1, 0, 0]])
    prior = np.full((3, 4), 0.1)
    accept = counts.marginals(prior, weight=2.0)
    assert accept[0, 0] == pytest.approx((1 + 0.2) / 4) and accept[0, 3] == pytest.approx(0.1)


def test_counts_estimate_converges_to_the_truth():
    rng = np.random.default_rng(5)
    truth = pc.curve_marginals("strong-synthetic")
    counts = pc.AcceptanceCounts.empty()
    tree = pc.tree_paths("ddtree-15", truth)
    for _ in range(40):
        counts.observe(*pc.sample_round(truth, tree, 16, rng), width=15)
    est = counts.marginals(pc.curve_marginals("bundled-pair"), weight=64.0)
    assert np.abs(est[:3, :3] - truth[:3, :3]).max() < 0.03


def test_cost_table_interpolates_in_log_rows():
    costs = pc.load_costs("NVIDIA H200")
    assert costs.shape == "qwen3-8b" and costs.ms("ddtree-7", 16) == 10.026
    assert costs.ms("ddtree-7", 4) == pytest.approx((6.539 + 10.026) / 2)  # log2 4 halfway from 1 to 16
    assert costs.ms("ddtree-3", 8) is None  # below its first measured rows
    assert costs.ms("ar", 512) == pytest.approx(17.628 + 256 * (17.628 - 11.8) / 128)
    assert pc.load_costs("NVIDIA H100 80GB HBM3").device == "NVIDIA H200"  # no table of its own
    assert pc.load_costs("NVIDIA H200", target_params=7e6).shape == "default-pair"


def test_default_budget_table_from_the_measurements():
    """The bundled pair's curve over Qwen3-8B-shaped costs: budget 15 at 1-8 rows, 7 at 16-32, 3 from 64."""
    table = pc.default_budget_table(pc.load_costs(), pc.BUNDLED_CURVE)
    assert table == {1: 15, 16: 7, 64: 3}


def feed(chooser, rows_seq, seed=0):
    rng = np.random.default_rng(seed)
    accept = pc.curve_marginals("strong-synthetic")
    out = []
    for rows in rows_seq:
        plan = chooser.next_plan(rows)
        out.append(plan)
        chooser.observe(*pc.sample_round(accept, pc.tree_paths(plan, accept), min(rows, 4), rng))
    return out


def test_choice_is_a_deterministic_function_of_its_inputs():
    plans = ("ar", "ddtree-3", "ddtree-7", "ddtree-15")
    rows = [1] * 30 + [64] * 30 + [256] * 30 + [16] * 30
    make = lambda: pc.PlanChooser(pc.load_costs(), plans, pc.curve_marginals("bundled-pair"))  # noqa: E731
    first, second = make(), make()
    assert feed(first, rows) == feed(second, rows)
    np.testing.assert_array_equal(first.counts.hits, second.counts.hits)
    assert first.used == second.used and sum(first.used.values()) == len(rows)


def test_hysteresis_keeps_a_plan_within_the_margin():
    """Two plans 2% apart (inside the 3% margin): the chooser stays where it started; 10% apart: it moves,
    but only after min_rounds rounds in its plan."""
    costs = pc.CostTable("x", "y", {"ar": {1: 1.0}, "ddtree-3": {1: 3.0}})
    prior = pc.geometric_marginals(0.9, 0.9, 0.3)
    tokens = pc.plan_tokens("ddtree-3", prior)
    near = pc.PlanChooser(
        costs,
        ("ar", "ddtree-3"),
        prior,
        current="ar",
        rounds_in_plan=100,
        probe_every=10**9,
        calibrate_rounds=0,
    )
    near.costs = pc.CostTable("x", "y", {"ar": {1: 1.0}, "ddtree-3": {1: tokens / 1.02}})
    assert {near.next_plan(1) for _ in range(50)} == {"ar"}
    far = pc.PlanChooser(
        costs,
        ("ar", "ddtree-3"),
        prior,
        current="ar",
        rounds_in_plan=0,
        probe_every=10**9,
        calibrate_rounds=0,
    )
    far.costs = pc.CostTable("x", "y", {"ar": {1: 1.0}, "ddtree-3": {1: tokens / 1.10}})
    seq = [far.next_plan(1) for _ in range(20)]
    assert seq[:16] == ["ar"] * 16 and seq[16:] == ["ddtree-3"] * 4  # 16 rounds in ar, then the switch


@pytest.mark.parametrize("curve", ["bundled-pair", "strong-synthetic"])
@pytest.mark.parametrize("rows", [1, 16, 256])
def test_choice_within_5_percent_of_the_best_fixed_plan(curve, rows):
    """Qwen3-8B-shaped costs on the H200 (the recorded sweep), a job whose drafter accepts as `curve`,
    starting from the bundled pair's prior: the chosen plans' tokens/ms within 5% of the best fixed plan's
    (the full table: results/plan-choice/table.md)."""
    plans = ("ar", "ddtree-3", "ddtree-7", "ddtree-15")
    out = pc.simulate(
        pc.load_costs(),
        plans,
        pc.curve_marginals(curve),
        pc.curve_marginals("bundled-pair"),
        rows,
        rounds=200,
    )
    assert out["ratio"] >= 0.95, out


def test_counts_summed_between_syncs_equal_counts_per_round():
    """A loop deciding at host syncs (next_plan(rows, rounds), observe_counts of the summed rounds) keeps the
    counts a loop deciding every round keeps."""
    rng = np.random.default_rng(6)
    accept = pc.curve_marginals("bundled-pair")
    plans = ("ar", "ddtree-7")
    each, synced = (pc.PlanChooser(pc.load_costs(), plans, accept, calibrate_rounds=0) for _ in range(2))
    rounds = [pc.sample_round(accept, pc.tree_paths("ddtree-7", accept), 4, rng) for _ in range(5)]
    assert synced.next_plan(16, rounds=5) == "ddtree-7" and synced.used == {"ddtree-7": 5}
    total = pc.AcceptanceCounts.empty()
    for ranks, seen in rounds:
        assert each.next_plan(16) == "ddtree-7"
        each.observe(ranks, seen)
        total.observe(ranks, seen, width=7)
    synced.observe_counts(total.hits, total.seen)
    np.testing.assert_array_equal(each.counts.hits, synced.counts.hits)
    np.testing.assert_array_equal(each.counts.seen, synced.counts.seen)
    assert each.used == synced.used and each.rounds_in_plan == synced.rounds_in_plan == 5


def test_root_only_is_its_own_plan_and_probes_as_ar_does():
    """ddtree at budget 0 is 'root-only' (not 'ar': one name per plan), priced as the ar row times 1 + the
    projection share; a chooser held in it probes the best drafting plan every probe_every rounds, as in
    ar, and then chooses freely again."""
    assert pc.plan_name("ddtree", 0) == "root-only" and pc.plan_name("ar") == "ar"
    assert pc.branching("root-only") == 0
    assert pc.plan_tokens("root-only", pc.curve_marginals("bundled-pair")) == 1
    costs = pc.with_projection(pc.CostTable("x", "y", {"ar": {1: 1.0}, "ddtree-3": {1: 100.0}}), 0.5)
    assert costs.ms("root-only", 1) == 1.5 and costs.ms("ar", 1) == 1.0
    chooser = pc.PlanChooser(costs, ("root-only", "ddtree-3"), pc.geometric_marginals(0.9, 0.9, 0.3),
                             calibrate_rounds=0, probe_every=5)  # fmt: skip
    seq = [chooser.next_plan(1) for _ in range(7)]
    assert seq == ["root-only"] * 5 + ["ddtree-3", "root-only"], seq
    assert chooser.used == {"root-only": 6, "ddtree-3": 1}


def test_priced_budgets_are_those_the_table_has_at_or_below_the_rows():
    """The budgets a job of `rows` rows per device can be priced at: a plan's first measured rows at most
    `rows` (the H200 Qwen3-8B table: budget 3 from 16 rows, the others from 1); a plan of one measured row
    count is priced there only."""
    costs = pc.with_projection(pc.load_costs("NVIDIA H200"), 0.01)
    budgets = (0, 3, 7, 15)
    assert pc.priced_budgets(costs, budgets, 1) == pc.priced_budgets(costs, budgets, 15) == (0, 7, 15)
    assert pc.priced_budgets(costs, budgets, 16) == pc.priced_budgets(costs, budgets, 512) == budgets
    for rows in (1, 15, 16, 512):  # the rule is CostTable.ms's: priced at the rows themselves
        assert pc.priced_budgets(costs, budgets, rows) == tuple(
            n for n in budgets if costs.ms(pc.plan_name("ddtree", n), rows) is not None
        )
    one = pc.CostTable("x", "y", {"ddtree-5": {8: 1.0}})
    assert pc.priced_budgets(one, (5, 9), 4) == () and pc.priced_budgets(one, (5, 9), 8) == (5,)
    assert pc.priced_budgets(pc.load_costs("NVIDIA H200"), (0,), 4) == ()  # (no root-only row yet)
