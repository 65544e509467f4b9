"""The default budget table (budgets.DEFAULT_BUDGETS) is plan_choice's measurement, not a fitted table."""

from ddtree_jax import budgets, plan_choice


def test_default_budgets_come_from_the_shipped_cost_table():
    measured = plan_choice.default_budget_table(plan_choice.load_costs(), plan_choice.BUNDLED_CURVE)
    assert {r: b for (r, c), b in budgets.DEFAULT_BUDGETS.items() if c == 0} == measured
    long = {r: b for (r, c), b in budgets.DEFAULT_BUDGETS.items() if c == budgets.LONG_CONTEXT}
    assert long == {r: 15 for r in measured if r >= 16}
    assert budgets.MAX_BRANCHING == plan_choice.MAX_BRANCHING == 32
    # at each power of two from 1 to 256 rows: the budget of 3, 7 and 15 projecting the most tokens/ms
    costs = plan_choice.load_costs()
    for rows in (1, 2, 4, 8, 16, 32, 64, 128, 256):
        tokens = {plan_choice.plan_name("ddtree", n): plan_choice.BUNDLED_CURVE[n] for n in (3, 7, 15)}
        values = plan_choice.tokens_per_ms(costs, rows, tokens)
        best = plan_choice.parse_plan(plan_choice.best_plan(values))[1]
        assert budgets.default_budget(rows) == best, rows


def test_ddtree_branching_is_one_rule_for_settings_and_the_budget_check():
    """budgets.ddtree_branching: --branching or min(budget, 32), at most the vocabulary, at least 1; the
    settings (a fixed --budget 0 too) and the budget check resolve a plan's branching by it."""
    import dataclasses
    from types import SimpleNamespace

    import pytest

    from ddtree_jax.api import check_budget
    from ddtree_jax.cli import build_parser
    from ddtree_jax.errors import DDTreeError
    from ddtree_jax.settings import Settings

    assert [budgets.ddtree_branching(n, 256) for n in (0, 1, 7, 32, 100)] == [1, 1, 7, 32, 32]
    assert budgets.ddtree_branching(100, 16) == 16 and budgets.ddtree_branching(7, 256, given=3) == 3
    assert budgets.ddtree_branching(7, 16, given=300) == 16

    def flags(*given):
        return Settings.from_flags(build_parser().parse_args(["--prompts", "p", "--out", "o", *given]))

    def resolved(*given, vocab=256):
        return flags(*given).with_budget(SimpleNamespace(vocab_size=vocab), [])

    assert resolved("--budget", "40", vocab=16).branching == 16
    assert resolved("--budget", "40", "--branching", "5").branching == 5
    assert resolved("--budget", "40").branching == 32
    # --budget auto checks each budget at the branching its programs run (the vocabulary's 2 here): 2
    # depths of 2 candidates hold 6 nodes, fewer than budget 7's
    auto = dataclasses.replace(flags("--budget", "auto"), block_size=3)
    with pytest.raises(DDTreeError, match=r"--budget 7 exceeds the 6 nodes .* \(2 depths of 2 candidates"):
        check_budget(auto, SimpleNamespace(block_size=8, vocab_size=2))
    check_budget(auto, SimpleNamespace(block_size=8, vocab_size=4))
