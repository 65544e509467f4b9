"""The default ddtree budget per batch size, as measured on the H200 (no jax import: the CLI's parser
reads these tables)."""

from __future__ import annotations

# The ddtree budget when --budget is not given, by the rows each data-parallel device runs
# (--batch-size / --dp; the entry of the largest key <= it): the budget with the highest projected
# tokens/s = acceptance(budget) x ar step / ddtree round, from the bundled pair's acceptance curve and
# Qwen3-8B-shaped round times on one H200 at 1k context (results/h200/README.md, "Default budget per
# batch size"): from 16 rows budget 7 beats 3, 5 and 15 (batch 16) and 15 (batch 32). At batch 1, 15,
# 31 and 63 project within 2% of each other (31 highest, by 0.8%); the smallest tree is kept.
DEFAULT_BUDGETS = {1: 15, 16: 7}
# Mixture-of-experts targets: a tree's tokens select many more distinct experts than one token, so a
# verify reads far more weight bytes than an ar step. Qwen3-30B-A3B-shaped rounds on one H200 at batch
# 1 (results/h200/moe/moe_batch1.json, results/notes.md): ar 8.20 ms, ddtree 7 / 15 / 63 21.4 / 24.5 /
# 49.9 ms, projecting 1.18x / 1.15x / 0.65x with the bundled pair's curve; with the Pallas grouped
# dispatch (results/h200/moe-dispatch/batch.json, --rounds 4) a round costs 1.40x / 1.75x an ar step at
# budget 7 / 15 at batch 1 and 1.57x / 1.81x at batch 16: 7 at every batch size.
MOE_DEFAULT_BUDGETS = {1: 7}


def default_budget(batch_size: int, target_cfg=None) -> int:
    """The ddtree budget used for `batch_size` rows when --budget is not given (`target_cfg`: the
    target's config, whose family says whether it routes tokens to experts; None: dense)."""
    from ddtree_jax import models

    routed = target_cfg is not None and models.family(target_cfg).ROUTED_EXPERTS
    table = MOE_DEFAULT_BUDGETS if routed else DEFAULT_BUDGETS
    return table[max(b for b in table if b <= batch_size)]
