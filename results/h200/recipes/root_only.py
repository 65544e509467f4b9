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
import os
import time
from pathlib import Path

import jax

from ddtree_jax import plan_choice, settings
from ddtree_jax.api import LLM

OUT = Path(os.environ.get("OUT", "/tmp/root-only"))
OUT.mkdir(parents=True, exist_ok=True)
PROMPTS = Path(__file__).resolve().parents[3] / "results" / "heldout-prompts-96.jsonl"
QUICK = os.environ.get("QUICK")  # 8 prompts x 8 tokens, reference attention, batch 4
DEADLINE_S = float(os.environ.get("DEADLINE_S", "200"))
texts = [json.loads(x)["prompt"] for x in PROMPTS.open()]
new, attention = (8, "reference") if QUICK else (128, "auto")
batches = (4,) if QUICK else tuple(int(b) for b in os.environ.get("BATCHES", "16,1").split(","))
report: dict = {"device": jax.devices()[0].device_kind, "date": time.strftime("%Y-%m-%d"), "runs": []}
report["skipped"] = []
begin = time.perf_counter()
SHIPPED = settings.AUTO_BUDGETS
CONFIGS = (
    ("ar", {"method": "ar"}, SHIPPED),
    ("root-only", {"budget": "auto"}, (0,)),
    ("ddtree-7", {"budget": 7}, SHIPPED),
    ("auto", {"budget": "auto"}, SHIPPED),
)


def save():
    (OUT / "root_only.json").write_text(json.dumps(report, indent=1))


for batch in batches:
    n = 8 if QUICK else 96
    ids = {}
    for name, kw, budgets in CONFIGS:
        if time.perf_counter() - begin > DEADLINE_S:
            report["skipped"].append(f"{name} batch {batch}")
            continue
        settings.AUTO_BUDGETS = budgets  # (read when the LLM's settings are made)
        llm = LLM(batch_size=batch, max_new_tokens=new, attention=attention, **kw)
        settings.AUTO_BUDGETS = SHIPPED
        gen = llm.generator
        prompts = llm.prompts(texts[:n])
        list(llm.run(prompts))  # compiles, warms
        times = []
        for _ in range(2):
            gen.generate_seconds = 0.0
            results = sorted(llm.run(prompts), key=lambda r: (r.id, r.index))
            times.append(gen.generate_seconds)
        tokens = sum(len(r.output_ids) for r in results)
        row = {
            "plan": name, "batch_size": batch, "prompts": n, "tokens": tokens,
            "generate_s": [round(t, 4) for t in times], "tok_s": round(tokens / min(times), 1),
            "compile_s": round(gen.compile_seconds, 2), "plan_rounds": dict(gen.plan_rounds),
        }  # fmt: skip
        if name == "root-only":
            p = gen.programs.params
            size = float(sum(x.size for x in jax.tree.leaves(p)))
            row["projection_share"] = round(
                plan_choice.projection_share(gen.plan.target, gen.plan.draft, size), 5
            )
        ids[name] = [r.output_ids for r in results]
        report["runs"].append(row)
        print(json.dumps(row), flush=True)
        save()
    got = {r["plan"]: r for r in report["runs"] if r["batch_size"] == batch}
    if "ar" in got:
        for name in ("root-only", "auto"):
            if name in got:
                got["ar"][f"{name.replace('-', '_')}_vs_ar"] = round(
                    got[name]["tok_s"] / got["ar"]["tok_s"], 3
                )
                got["ar"][f"{name.replace('-', '_')}_ids_equal_ar"] = ids[name] == ids["ar"]
    save()
print(json.dumps({k: v for k, v in report.items() if k != "runs"}))
save()
