"""Issue 39, ar among --budget auto's choices: what a root-only ddtree round (engine.Plan.root_only: no
draft, the root verified alone, the drafter's context K/V still projected) costs against an ar step, on the
README's main job (the bundled pair, results/heldout-prompts-96.jsonl x 128 new tokens, bf16) at batch 1
and 16. Each configuration: one LLM, a first run (compiles), then two timed runs (the faster kept): ar
(--method ar), root-only held throughout (--budget auto over budget 0 alone), ddtree 7, and --budget auto
over its shipped choices (ar, 3, 7, 15). Stops starting new configurations after DEADLINE_S seconds
(default 200; what it left out under "skipped").

    OUT=$OUT PYTHONPATH=$PWD python3 results/h200/recipes/root_only.py        (GPU, <= ~4 min)
    QUICK=1 OUT=/tmp/ro PYTHONPATH=$PWD python3 results/h200/recipes/root_only.py   (a CPU check)

Answers: "root_only_vs_ar" at each batch, the root-only job's tokens/s over ar's (the projection's price
is 1 - that; plan_choice.with_projection prices it at the target-weight share, "projection_share": 4.7%
for the bundled pair), and whether root-only's ids equal ar's (float32 would; bf16 runs other shapes);
"auto_vs_ar" with the rounds auto gave each plan.
"""

import json

import jax
from timed_llm import Recipe, timed

from ddtree_jax import plan_choice, settings
from ddtree_jax.api import LLM

recipe = Recipe("root-only", "16,1")
report = recipe.report
SHIPPED = settings.AUTO_BUDGETS
CONFIGS = (
    ("ar", {"method": "ar"}, SHIPPED),
    ("root-only", {"budget": "auto"}, (0,)),
    ("ddtree-7", {"budget": 7}, SHIPPED),
    ("auto", {"budget": "auto"}, SHIPPED),
)
for batch in recipe.batches:
    n = 8 if recipe.quick else 96
    ids = {}
    for name, kw, budgets in CONFIGS:
        if recipe.late(f"{name} batch {batch}"):
            continue
        settings.AUTO_BUDGETS = budgets  # (read when the LLM's settings are made)
        llm = LLM(batch_size=batch, max_new_tokens=recipe.new, attention=recipe.attention, **kw)
        settings.AUTO_BUDGETS = SHIPPED
        gen = llm.generator
        results, row = timed(llm, llm.prompts(recipe.texts[:n]), name, batch)
        if name == "root-only":
            size = float(sum(x.size for x in jax.tree.leaves(gen.programs.params)))
            row["projection_share"] = round(
                plan_choice.projection_share(gen.plan.target, gen.plan.draft, size), 5
            )
        ids[name] = [r.output_ids for r in results]
        report["runs"].append(row)
        print(json.dumps(row), flush=True)
        recipe.save()
    got = {r["plan"]: r for r in report["runs"] if r["batch_size"] == batch}
    if "ar" in got:
        for name in ("root-only", "auto"):
            if name in got:
                got["ar"][f"{name.replace('-', '_')}_vs_ar"] = round(
                    got[name]["tok_s"] / got["ar"]["tok_s"], 3
                )
                got["ar"][f"{name.replace('-', '_')}_ids_equal_ar"] = ids[name] == ids["ar"]
    recipe.save()
recipe.done()
