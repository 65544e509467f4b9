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
