"""The default ddtree budget by rows per device and context, as measured on the H200 (plan_choice's cost
table where a job has no measurement of its own), and the default branching (no jax import: the CLI's
parser reads these tables)."""

from __future__ import annotations

from ddtree_jax import plan_choice

# The ddtree budget when --budget is not given, by (rows, context): the rows each data-parallel device
# runs (--batch-size / --dp) and the context a row reaches on average (the prompts' mean length plus
# their new tokens: a round's attention reads each row's own context, so the mean sets its cost). The
# entry of the largest rows <= the run's, then of the largest context <= the run's. At 1k context the
# entries come from plan_choice's shipped cost table (Qwen3-8B-shaped rounds on one H200 from 1 to 256
# rows: the 2026-12-03 batch sweep and the 2026-11-29 rows, ddtree_jax/assets/plan_costs.json) and the
# bundled pair's measured acceptance (plan_choice.BUNDLED_CURVE): at each of 1, 2, 4, ..., 256 rows the
# budget of 3, 7 and 15 with the highest projected tokens/ms (`plan_choice.default_budget_table`):
# 15 from 1 row, 7 from 16, 3 from 64 (at 128 and 256 rows ar itself projects higher than any tree, which
# a budget cannot say: plan_choice.PlanChooser can). Long contexts keep the earlier measurement (no sweep
# of rows there): at batch 16, 7 / 15 project 2.10x / 2.08x at 8k, 2.19x / 2.22x at 16k and 2.52x /
# 2.70x at 32k (31: 2.07x): a tree's extra nodes read no extra K/V, and reading K/V is most of a round
# there (results/notes.md, "The budget at long context"); taken for every row count from 16 on.
LONG_CONTEXT = 16384
_MEASURED = plan_choice.default_budget_table(plan_choice.load_costs(), plan_choice.BUNDLED_CURVE)
DEFAULT_BUDGETS = {(rows, 0): budget for rows, budget in _MEASURED.items()} | {
    (rows, LONG_CONTEXT): 15 for rows in _MEASURED if rows >= 16
}
# Mixture-of-experts targets: a tree's tokens select many more distinct experts than one token, so a
# verify reads far more weight bytes than an ar step. Qwen3-30B-A3B-shaped rounds on one H200 at batch
# 1 (results/h200/moe/moe_batch1.json, results/notes.md): ar 8.20 ms, ddtree 7 / 15 / 63 21.4 / 24.5 /
# 49.9 ms, projecting 1.18x / 1.15x / 0.65x with the bundled pair's curve; with the Pallas grouped
# dispatch (results/h200/moe-dispatch/batch.json, --rounds 4) a round costs 1.40x / 1.75x an ar step at
# budget 7 / 15 at batch 1 and 1.57x / 1.81x at batch 16: 7 at every batch size (1k context only).
MOE_DEFAULT_BUDGETS = {(1, 0): 7}


MAX_BRANCHING = plan_choice.MAX_BRANCHING  # ddtree's default candidates per depth: min(budget, MAX_BRANCHING)


def default_branching(method: str, budget: int) -> int:
    """Drafter candidates per depth: min(budget, 32) for ddtree, 1 for the chain methods."""
    return min(budget, MAX_BRANCHING) if method == "ddtree" else 1


def ddtree_branching(budget: int, vocab_size: int, given: int | None = None) -> int:
    """A ddtree plan's drafter candidates per depth: `given` (--branching) or the default for `budget`
    (default_branching), at most the vocabulary (`vocab_size`: the target's) and at least 1 (budget 0,
    root-only rounds, drafts nothing: engine.Plan's least branching). The one rule the settings, the
    budget check and a choosing job's programs apply."""
    return max(min(given or default_branching("ddtree", budget), vocab_size), 1)


def default_budget(batch_size: int, target_cfg=None, context: int = 0) -> int:
    """The ddtree budget used for `batch_size` rows reaching `context` tokens on average when --budget is
    not given (`target_cfg`: the target's config, whose family says whether it routes tokens to
    experts; None: dense)."""
    table = budget_table(target_cfg)
    rows = max(r for r, _ in table if r <= batch_size)
    return table[rows, max(c for r, c in table if r == rows and c <= context)]


def budget_table(target_cfg=None) -> dict[tuple[int, int], int]:
    """The (rows, context) -> budget table of the target's kind (dense when `target_cfg` is None)."""
    from ddtree_jax import models

    routed = target_cfg is not None and models.family(target_cfg).ROUTED_EXPERTS
    return MOE_DEFAULT_BUDGETS if routed else DEFAULT_BUDGETS


def describe(table: dict[tuple[int, int], int]) -> str:
    """The table in words, for --help: '15 from batch 1, 7 from batch 16 (15 from context 16384)'."""
    parts = []
    for rows in sorted({r for r, _ in table}):
        contexts = sorted(c for r, c in table if r == rows)
        longer = [f"{table[rows, c]} from context {c}" for c in contexts[1:]]
        parts.append(
            f"{table[rows, contexts[0]]} from batch {rows}" + (f" ({', '.join(longer)})" if longer else "")
        )
    return ", ".join(parts)


def rows_per_device(batch_size: int, dp: int) -> int:
    """The rows each data-parallel device runs: the batch the measured round times are of."""
    return -(-batch_size // dp)


def run_context(contexts: list[int]) -> int:
    """The context a run's rows reach on average: the mean of each prompt's length plus its new tokens."""
    return round(sum(contexts) / max(len(contexts), 1))
