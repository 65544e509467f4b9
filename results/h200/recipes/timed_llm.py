"""What the LLM recipes (auto_budget.py, root_only.py) share: their settings from the environment, and
one configuration's LLM run once (compiles, warms) then timed twice in the process (the faster kept)."""

import json
import os
import time
from pathlib import Path

import jax

PROMPTS = Path(__file__).resolve().parents[3] / "results" / "heldout-prompts-96.jsonl"


class Recipe:
    """OUT, QUICK (8 prompts x 8 tokens, reference attention, batch 4: a CPU check), DEADLINE_S (no new
    configuration started past it; default 200) and BATCHES from the environment; the report as it grows."""

    def __init__(self, name: str, batches: str):
        self.path = Path(os.environ.get("OUT", f"/tmp/{name}")) / f"{name.replace('-', '_')}.json"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.quick = bool(os.environ.get("QUICK"))
        self.deadline_s = float(os.environ.get("DEADLINE_S", "200"))
        self.texts = [json.loads(x)["prompt"] for x in PROMPTS.open()]
        self.new, self.attention = (8, "reference") if self.quick else (128, "auto")
        sizes = os.environ.get("BATCHES", batches)
        self.batches = (4,) if self.quick else tuple(int(b) for b in sizes.split(","))
        self.report: dict = {"device": jax.devices()[0].device_kind, "date": time.strftime("%Y-%m-%d"),
                             "runs": [], "skipped": []}  # fmt: skip
        self.begin = time.perf_counter()

    def late(self, what: str) -> bool:
        """Past the deadline: `what` is recorded as skipped."""
        if time.perf_counter() - self.begin > self.deadline_s:
            self.report["skipped"].append(what)
            return True
        return False

    def save(self) -> None:
        self.path.write_text(json.dumps(self.report, indent=1))

    def done(self) -> None:
        print(json.dumps({k: v for k, v in self.report.items() if k != "runs"}))
        self.save()


def timed(llm, prompts, name: str, batch: int) -> tuple[list, dict]:
    """The prompts run once (compiles, warms), then twice timed: the last run's results (by id and
    index) and the row every recipe records (tokens/s of the faster run)."""
    gen = llm.generator
    list(llm.run(prompts))
    times = []
    for _ in range(2):
        gen.generate_seconds = 0.0
        results = sorted(llm.run(prompts), key=lambda r: (r.id, r.index))
        times.append(gen.generate_seconds)
    tokens = sum(len(r.output_ids) for r in results)
    row = {
        "plan": name, "batch_size": batch, "prompts": len(prompts), "tokens": tokens,
        "generate_s": [round(t, 4) for t in times], "tok_s": round(tokens / min(times), 1),
        "compile_s": round(gen.compile_seconds, 2), "plan_rounds": dict(gen.plan_rounds),
    }  # fmt: skip
    return results, row
