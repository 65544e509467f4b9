"""The acceptance estimate of --budget auto against the acceptance observed (issue 39 item 2): the bundled
pair in float32 on the CPU, 16 held-out prompts x 64 new tokens at batch 8, the job's program at budget
3, 7 and 15 in turn (each run counting the ranks as a choosing job does, its budget held fixed), and from
each run's counts the chooser's estimate of every budget's tokens a round (PlanChooser's marginals: the
counts shrunk towards the bundled pair's curve by 64 pseudo-observations) against each fixed run's
observed mean acceptance length. Every run's output ids are also compared with budget 3's (DTYPE=bfloat16:
the same in bfloat16, where a tree's size may change a row's arithmetic).

    PYTHONPATH=$PWD python3 results/plan-choice/estimate_cpu.py > results/plan-choice/estimate_cpu.json
    DTYPE=bfloat16 PYTHONPATH=$PWD python3 results/plan-choice/estimate_cpu.py \
        > results/plan-choice/estimate_cpu_bf16.json
"""

import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import jax

from ddtree_jax import plan_choice
from ddtree_jax.api import LLM

ROOT = Path(__file__).resolve().parents[2]
texts = [json.loads(x)["prompt"] for x in (ROOT / "results" / "heldout-prompts-96.jsonl").open()][:16]
BUDGETS = (3, 7, 15)


class Held:
    """A chooser that holds one budget and keeps the counts of a PlanChooser."""

    def __init__(self, budget, chooser):
        self.plan, self.chooser, self.used = plan_choice.plan_name("ddtree", budget), chooser, {}

    def next_plan(self, rows, rounds=1):
        return self.plan

    def observe_counts(self, hits, exposure, plan=None):
        self.chooser.observe_counts(hits, exposure, plan)


DTYPE = os.environ.get("DTYPE", "float32")
llm = LLM(budget="auto", dtype=DTYPE, batch_size=8, max_new_tokens=64)
prompts = llm.prompts(texts)
gen = llm.generator
report = {
    "command": f"DTYPE={DTYPE} PYTHONPATH=$PWD python3 results/plan-choice/estimate_cpu.py",
    "dtype": DTYPE,
    "machine": f"{platform.machine()}, {jax.devices()[0].device_kind}, 2 cores shared with other work",
    "date": time.strftime("%Y-%m-%d"),
    "commit": subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip(),
    "runs": [],
}
ids = {}
for n in BUDGETS:
    chooser = gen._chooser()
    gen.make_chooser = lambda n=n, c=chooser: Held(n, c)
    results = sorted(llm.run(prompts), key=lambda r: r.id)
    accepted = [a for r in results for a in r.acceptance_lengths]
    accept = chooser.counts.marginals(chooser.prior, chooser.prior_weight)
    ids[n] = [r.output_ids for r in results]
    report["runs"].append({
        "budget": n,
        "rounds": sum(gen.plan_rounds.values()),
        "observed_mean_acceptance": round(sum(accepted) / len(accepted), 4),
        "estimated_tokens_per_round": {
            p: round(plan_choice.plan_tokens(p, accept), 4) for p in chooser.plans
        },
        "depth_0_rank_0_rate": round(float(accept[0, 0]), 4),
    })  # fmt: skip
    print(json.dumps(report["runs"][-1]), file=sys.stderr, flush=True)
observed = {r["budget"]: r["observed_mean_acceptance"] for r in report["runs"]}
report["relative_error"] = {
    f"counted at {r['budget']}": {
        p: round(v / observed[plan_choice.parse_plan(p)[1]] - 1, 4)
        for p, v in r["estimated_tokens_per_round"].items()
    }
    for r in report["runs"]
}
report["output_ids_equal_across_budgets"] = all(ids[n] == ids[BUDGETS[0]] for n in BUDGETS)
report["prompts_with_budget_3s_ids"] = {
    n: sum(a == b for a, b in zip(ids[n], ids[3], strict=True)) for n in BUDGETS
}
report["prompts"] = len(prompts)
print(json.dumps(report, indent=1))
