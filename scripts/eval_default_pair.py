"""Acceptance lengths and tokens/s of a target + DFlash drafter pair on a prompts file (default: the
bundled pair and its held-out prompts), for ar, dflash and ddtree at several budgets.

    python scripts/eval_default_pair.py --budgets 8,16,32,64 --out results/default-pair-eval.json
    python scripts/eval_default_pair.py --temperature 0.7 --out results/default-pair-eval-t07.json

A script, not a CLI sub-command: the evaluation of the bundled pair's training (results/default-pair.md,
its JSONs under results/), kept as it made them; `ddtree-generate` writes the acceptance lengths per
prompt and `ddtree-bench` times random-weight shapes, neither a table per method and budget of a pair.

A DFlash2 drafter's dflash and ddtree use its selector (the chain, the edge-score tree); --marginal
drafts from its marginals alone, as a v1 drafter would.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a source tree

from ddtree_jax.bench.report import run_header  # noqa: E402
from ddtree_jax.pair import generator, load_pair, make_plan  # noqa: E402
from ddtree_jax.prompts import read_prompts  # noqa: E402
from ddtree_jax.scheduler import Schedule  # noqa: E402

ASSETS = Path(__file__).resolve().parent.parent / "ddtree_jax" / "assets" / "default_pair"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", type=Path, default=ASSETS / "target")
    ap.add_argument("--draft", type=Path, default=ASSETS / "draft")
    ap.add_argument("--prompts", type=Path, default=ASSETS / "prompts.jsonl")
    ap.add_argument("--methods", default="ar,dflash,ddtree")
    ap.add_argument("--budgets", default="8,16,32,64")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], default="float32")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--tempered-draft",
        action="store_true",
        help="tree scores from the drafter at the sampled temperature",
    )
    ap.add_argument(
        "--marginal",
        action="store_true",
        help="a DFlash2 drafter proposes from its marginals alone (the v1 chain and tree), not its selector",
    )
    ap.add_argument("--num-prompts", type=int, default=None)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()

    pair = load_pair(args.target, args.draft, args.dtype)
    if args.marginal:
        if pair.draft is None or pair.draft.dflash2 is None:
            ap.error("--marginal needs a DFlash2 drafter")
        marginal = dataclasses.replace(pair.draft.dflash2, selector=False)
        pair = dataclasses.replace(pair, draft=dataclasses.replace(pair.draft, dflash2=marginal))
    prompts = read_prompts(args.prompts, pair.codec, False, pair.target.vocab_size, args.max_new_tokens)[
        : args.num_prompts
    ]
    sampling = {"temperature": args.temperature, "seed": args.seed} if args.temperature else {}

    runs = []
    for method in args.methods.split(","):
        budgets = [int(b) for b in args.budgets.split(",")] if method == "ddtree" else [0]
        for budget in budgets:
            plan = make_plan(
                pair.target,
                pair.draft,
                method,
                batch_size=args.batch_size,
                max_new_tokens=args.max_new_tokens,
                budget=budget or None,
                tempered_draft=args.tempered_draft,
            )
            gen = generator(pair, plan, sampling, schedule=Schedule(args.batch_size, policy="static"))
            start = time.perf_counter()
            results = list(gen.run(prompts))
            wall = time.perf_counter() - start
            accepted = [a for r in results for a in r.acceptance_lengths]
            tokens = sum(len(r.output_ids) for r in results)
            rec = {
                "method": method,
                "budget": budget,
                "mean_acceptance": float(np.mean(accepted)) if accepted else None,
                # per prompt, in prompt order: how much of the mean is the prompts' spread
                "prompt_acceptance": [
                    round(float(np.mean(r.acceptance_lengths)), 3) if r.acceptance_lengths else None
                    for r in results
                ],
                "rounds": len(accepted),
                "output_tokens": tokens,
                "generate_seconds": round(gen.generate_seconds, 3),
                "compile_seconds": round(gen.compile_seconds, 2),
                "tokens_per_second": round(tokens / gen.generate_seconds, 1),
                "wall_seconds": round(wall, 2),
                "outputs": [r.output_ids for r in results],
            }
            runs.append(rec)
            print(json.dumps({k: v for k, v in rec.items() if k != "outputs"}), flush=True)
    ar = next((r["outputs"] for r in runs if r["method"] == "ar"), None)
    if ar is not None and args.temperature == 0:
        for r in runs:
            r["identical_to_ar"] = r["outputs"] == ar
    summary = {
        "meta": run_header(sys.argv) | {"args": {k: str(v) for k, v in vars(args).items()}},
        "num_prompts": len(prompts),
        "runs": [{k: v for k, v in r.items() if k != "outputs"} for r in runs],
    }
    print(json.dumps(summary["runs"]))
    if args.out:
        args.out.write_text(json.dumps(summary, indent=2) + "\n")


if __name__ == "__main__":
    main()
