"""Do a prompt's tokens depend on its batch layout? The bundled prompts in two layouts, bfloat16.

Layout A: batch 4 in input order; layout B: batch 3 in reverse order. For static batches, continuous
batching and batch-invariant continuous batching, the number of prompts whose output ids differ
between the two layouts (ddtree budget 15, the bundled pair, CPU or GPU):

    python scripts/batch_layouts.py --max-new-tokens 64 --out results/scheduling/bf16-layouts.json

A script, not a CLI sub-command: a one-off check of the bundled pair on real weights (its finding is
recorded in results/scheduling/), not a benchmark of random-weight shapes nor a comparison of decoders.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import jax.numpy as jnp

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from ddtree_jax import drafter, target  # noqa: E402
from ddtree_jax.bench.report import run_header  # noqa: E402
from ddtree_jax.engine import Plan  # noqa: E402
from ddtree_jax.prompts import Prompt  # noqa: E402
from ddtree_jax.scheduler import Generator, Schedule  # noqa: E402
from ddtree_jax.sharding import make_mesh, param_sharding  # noqa: E402
from ddtree_jax.text import TextCodec  # noqa: E402

PAIR = ROOT / "ddtree_jax" / "assets" / "default_pair"


def main(argv=None) -> int:
    """Count the prompts whose outputs change with the layout, per scheduling mode."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--prefill-chunk", type=int, default=64)
    p.add_argument("--attention", default="reference")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    place = param_sharding(make_mesh(1, 1))
    cfg, params = target.load(PAIR / "target", jnp.bfloat16, place)
    dcfg, dparams = drafter.load(PAIR / "draft", cfg, jnp.bfloat16, place)
    codec = TextCodec(PAIR / "target")
    texts = [json.loads(line)["prompt"] for line in (PAIR / "prompts.jsonl").read_text().splitlines()]
    prompts = [Prompt(i, i + 1, codec.encode(t, add_special_tokens=False), {}) for i, t in enumerate(texts)]

    def outputs(order, batch, mode):
        plan = Plan(
            cfg,
            dcfg,
            "ddtree",
            args.max_new_tokens,
            budget=15,
            branching=15,
            attention=args.attention,
        )
        policy = "static" if mode == "static" else "continuous"
        invariant = mode == "batch_invariant"
        schedule = Schedule(batch, policy, chunk=args.prefill_chunk, batch_invariant=invariant)
        gen = Generator(params, dparams, plan, cfg.eos_token_ids, schedule=schedule)
        results = list(gen.run([prompts[i] for i in order]))
        return {r.id: r.output_ids for r in results}

    n = len(prompts)
    command = ["python", "scripts/batch_layouts.py", *(sys.argv[1:] if argv is None else argv)]
    report = {"meta": run_header(command), "prompts": n}
    for mode in ("static", "continuous", "batch_invariant"):
        a, b = outputs(range(n), 4, mode), outputs(range(n - 1, -1, -1), 3, mode)
        report[f"{mode}_prompts_changed"] = sum(a[i] != b[i] for i in range(n))
        print(mode, report[f"{mode}_prompts_changed"], flush=True)
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
