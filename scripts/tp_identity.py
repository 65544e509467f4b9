"""Outputs on a tensor-parallel mesh against one device: the same tokens and acceptance lengths.

For the bundled pair (loaded from its checkpoints, as `ddtree-generate` loads them) and for a
random-weight model of a real shape (`--shape`, e.g. qwen3-8b with a 5-layer drafter), every method
runs at each `--tp` on the same prompts; each tp's outputs are compared with tp = 1's.

    python scripts/tp_identity.py --tp 1,2 --shape qwen3-8b --out results/h200/tp/identity.json

A script, not a CLI sub-command: a check run once per mesh change on a multi-GPU machine (the CPU tests
check the same identity on fake devices: tests/test_sharding.py); no command's user needs it.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a source tree

from ddtree_jax import drafter, models, target  # noqa: E402
from ddtree_jax.bench.report import run_header  # noqa: E402
from ddtree_jax.bench.shapes import SHAPES, draft_shape  # noqa: E402
from ddtree_jax.pair import Pair, generator, load_pair, make_plan  # noqa: E402
from ddtree_jax.prompts import Prompt, read_prompts  # noqa: E402
from ddtree_jax.sampling import GREEDY  # noqa: E402
from ddtree_jax.scheduler import Schedule  # noqa: E402
from ddtree_jax.sharding import make_mesh, param_sharding  # noqa: E402
from ddtree_jax.weights import random_params  # noqa: E402

ASSETS = Path(__file__).resolve().parent.parent / "ddtree_jax" / "assets" / "default_pair"


def bundled_pair(tp: int, dtype, num_prompts: int) -> tuple[Pair, list[Prompt]]:
    """The bundled pair on a tp mesh (loaded as ddtree-generate loads it) and its first prompts."""
    pair = load_pair(ASSETS / "target", ASSETS / "draft", jnp.dtype(dtype).name, tp)
    prompts = read_prompts(ASSETS / "prompts.jsonl", pair.codec, False, pair.target.vocab_size)
    return pair, prompts[:num_prompts]


def random_model(
    shape: str, draft_layers: int, tp: int, dtype, num_prompts: int
) -> tuple[Pair, list[Prompt]]:
    """The same, for random weights of a real shape (identical values at every tp) and random prompts."""
    tcfg = SHAPES[shape]
    dcfg = draft_shape(tcfg, draft_layers, 16)
    models.family(tcfg).check_divisible(tcfg, tp)
    place = None if tp == 1 else param_sharding(make_mesh(tp)).place
    tparams = random_params(target.weight_specs(tcfg), 0, dtype, place=place)
    dparams = random_params(drafter.weight_specs(dcfg), 1, dtype, place=place)
    rng = np.random.default_rng(0)
    prompts = [
        Prompt(i, i, rng.integers(0, tcfg.vocab_size, size=int(rng.integers(5, 16))).tolist(), {})
        for i in range(num_prompts)
    ]
    return Pair(tcfg, tparams, dcfg, dparams, None, tcfg.eos_token_ids), prompts


def run_all(model, tp: int, args, sampling: dict) -> list[dict]:
    """Every method and budget on the model's prompts, one batch each."""
    pair, prompts = model
    runs = []
    for method in args.methods.split(","):
        for budget in [int(b) for b in args.budgets.split(",")] if method == "ddtree" else [0]:
            plan = make_plan(
                pair.target,
                pair.draft,
                method,
                batch_size=len(prompts),
                max_new_tokens=args.max_new_tokens,
                budget=budget or None,
                attention=args.attention,
                tp=tp,
            )
            gen = generator(pair, plan, sampling, schedule=Schedule(len(prompts), policy="static"))
            results = list(gen.run(prompts))
            runs.append(
                {
                    "method": method,
                    "budget": budget,
                    "outputs": [r.output_ids for r in results],
                    "acceptance": [r.acceptance_lengths for r in results],
                    "compile_seconds": round(gen.compile_seconds, 2),
                    "generate_seconds": round(gen.generate_seconds, 3),
                }
            )
            print(f"tp {tp} {method} {budget}: {gen.generate_seconds:.2f} s", flush=True)
    return runs


def compare(reference: list[dict], runs: list[dict]) -> list[dict]:
    """Per configuration: identical tokens and acceptance, and where the first difference is."""
    rows = []
    for ref, run in zip(reference, runs, strict=True):
        same = ref["outputs"] == run["outputs"]
        first = None
        if not same:
            i = next(i for i, (a, b) in enumerate(zip(ref["outputs"], run["outputs"], strict=True)) if a != b)
            a, b = ref["outputs"][i], run["outputs"][i]
            first = {
                "row": i,
                "token": next(
                    (j for j, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))
                ),
            }
        acc = [x for row in run["acceptance"] for x in row]
        rows.append(
            {
                "method": run["method"],
                "budget": run["budget"],
                "identical_tokens": same,
                "identical_acceptance": ref["acceptance"] == run["acceptance"],
                "first_difference": first,
                "mean_acceptance": float(np.mean(acc)) if acc else None,
                "output_tokens": sum(len(o) for o in run["outputs"]),
            }
        )
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tp", default="1,2", help="comma list; the first is the reference (1)")
    ap.add_argument("--models", default="pair,shape", help="pair (bundled), shape (random, --shape)")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-8b")
    ap.add_argument("--draft-layers", type=int, default=5)
    ap.add_argument("--methods", default="ar,dflash,ddtree")
    ap.add_argument("--budgets", default="15,63")
    ap.add_argument("--num-prompts", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument("--attention", default="reference", choices=["reference", "pallas"])
    ap.add_argument(
        "--temperature", type=float, default=0.0, help="> 0: sampled (seed 0, top-k 20, top-p 0.9)"
    )
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()

    if args.dtype == "float32":
        jax.config.update("jax_default_matmul_precision", "highest")
    dtype = jnp.dtype(args.dtype)
    tps = [int(t) for t in args.tp.split(",")]
    if tps[0] != 1:
        ap.error(f"--tp {args.tp}: the first entry is the reference and must be 1")
    sampling = dict(GREEDY)
    if args.temperature:
        sampling |= {"temperature": args.temperature, "top_k": 20, "top_p": 0.9, "seed": 0}
    report = {"meta": run_header(sys.argv), "models": {}}
    for name in args.models.split(","):
        reference = None
        report["models"][name] = {}
        for tp in tps:
            start = time.perf_counter()
            if name == "pair":
                model = bundled_pair(tp, dtype, args.num_prompts)
            else:
                model = random_model(args.shape, args.draft_layers, tp, dtype, args.num_prompts)
            runs = run_all(model, tp, args, sampling)
            del model
            reference = reference or runs
            report["models"][name][f"tp{tp}"] = {
                "seconds": round(time.perf_counter() - start, 1),
                "vs_tp1": compare(reference, runs),
            }
            args.out.write_text(json.dumps(report, indent=1) + "\n")  # after each, in case of a cut
    failed = [
        (name, tp, r["method"], r["budget"])
        for name, by_tp in report["models"].items()
        for tp, rec in by_tp.items()
        for r in rec["vs_tp1"]
        if not (r["identical_tokens"] and r["identical_acceptance"])
    ]
    print("identical everywhere" if not failed else f"DIFFERENT: {failed}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
