"""Issue 39 item 2: the job that chooses its budget (--budget auto) against fixed ar and ddtree 7 on the
README's main job (the bundled pair, results/heldout-prompts-96.jsonl x 128 new tokens, bf16) at batch 16
and 64 (64: the file repeated to 256 prompts). Each configuration: one LLM, a first run (compiles), then
two timed runs of the same programs in the process (the faster kept); the budgets auto ran and their share
of rounds (the last run's), its acceptance estimate against the fixed ddtree 7 run's observed mean
acceptance, and whether its output ids equal ddtree 7's (float32 would give equal ids; bf16 may not).
Stops starting new configurations after DEADLINE_S seconds (default 200; what it left out under
"skipped"; BATCHES=64 runs the rest in a second call).

    OUT=$OUT PYTHONPATH=$PWD python3 results/h200/recipes/auto_budget.py        (GPU, <= ~4 min)
    QUICK=1 OUT=/tmp/ab PYTHONPATH=$PWD python3 results/h200/recipes/auto_budget.py   (a CPU check)

Answers: tokens/s of auto / ar and auto / ddtree-7 at each batch (issue 39's goal: the default run >= 1.3x
ar at batch 16, never below 0.97x ar), and the estimate's error (auto's projected ddtree-7 tokens a round
against ddtree 7's observed mean acceptance).
"""

import json

from timed_llm import Recipe, timed

from ddtree_jax import plan_choice
from ddtree_jax.api import LLM

recipe = Recipe("auto-budget", "16,64")
report = recipe.report
for batch in recipe.batches:
    n = 8 if recipe.quick else (96 if batch <= 16 else 256)
    ids = {}
    for name, kw in (("ar", {"method": "ar"}), ("ddtree-7", {"budget": 7}), ("auto", {"budget": "auto"})):
        if recipe.late(f"{name} batch {batch}"):
            continue
        llm = LLM(batch_size=batch, max_new_tokens=recipe.new, attention=recipe.attention, **kw)
        gen, choosers = llm.generator, []
        if gen.schedule.auto_budgets:
            make = gen.make_chooser
            gen.make_chooser = lambda make=make, kept=choosers: kept.append(make()) or kept[-1]
        results, row = timed(llm, llm.prompts((recipe.texts * 3)[:n]), name, batch)
        accepted = [a for r in results for a in r.acceptance_lengths]
        row["mean_acceptance"] = round(sum(accepted) / len(accepted), 4)
        ids[name] = [r.output_ids for r in results]
        if choosers:
            c = choosers[-1]
            accept = c.counts.marginals(c.prior, c.prior_weight)
            estimate = {p: round(plan_choice.plan_tokens(p, accept), 4) for p in c.plans}
            row["estimated_tokens_per_round"] = estimate
            row["projected_tokens_per_ms"] = {p: round(v, 4) for p, v in c.projected(batch).items()}
            row["cost_table"] = f"{c.costs.device} / {c.costs.shape}"
        report["runs"].append(row)
        print(json.dumps(row), flush=True)
        recipe.save()
    fixed = next((r for r in report["runs"] if r["plan"] == "ddtree-7" and r["batch_size"] == batch), None)
    auto = next((r for r in report["runs"] if r["plan"] == "auto" and r["batch_size"] == batch), None)
    if fixed and auto:
        est = auto["estimated_tokens_per_round"]["ddtree-7"]
        auto["estimate_error_ddtree7"] = round(est / fixed["mean_acceptance"] - 1, 4)
        auto["ids_equal_ddtree7"] = ids["auto"] == ids["ddtree-7"]
        ar = next((r for r in report["runs"] if r["plan"] == "ar" and r["batch_size"] == batch), None)
        auto["vs_ddtree7"] = round(auto["tok_s"] / fixed["tok_s"], 3)
        if ar:
            auto["vs_ar"] = round(auto["tok_s"] / ar["tok_s"], 3)
        recipe.save()
recipe.done()
