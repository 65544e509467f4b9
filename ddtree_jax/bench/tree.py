"""Time the build step (`tree.lattice_tree`: beams, selection, ancestor mask) alone, jitted, per batch
size, budget and build variant, on random sorted drafter log-probs.

    ddtree-bench tree --cases 1:63,16:7,16:15,1:255 --variants paths,climb --out tree.json
"""

import argparse
import itertools
import json
import time

import jax.numpy as jnp
import numpy as np

from ddtree_jax.bench import report
from ddtree_jax.bench.timing import median_seconds
from ddtree_jax.tree import BUILD_VARIANTS, lattice_tree


def main(argv: list[str] | None = None) -> int:
    """`ddtree-bench tree`; the exit status."""
    ap = report.parser("tree", __doc__)
    ap.add_argument("--cases", default="1:63,16:7,16:15,1:255", help="batch:budget pairs")
    ap.add_argument("--depth", type=int, default=15, help="drafter depths D (block size - 1)")
    ap.add_argument("--branching", type=int, default=32, help="drafter candidates per depth")
    ap.add_argument("--variants", default="paths", help=f"comma-separated, of {BUILD_VARIANTS}")
    ap.add_argument("--reps", type=int, default=200, help="timed calls per case")
    report.add_deadline(ap)
    ap.add_argument("--out", required=True, help="JSON output path")
    return report.run_subcommand("tree", ap, argv, run)


def run(args: argparse.Namespace, command: list[str], deadline: report.Deadline) -> int:
    """Every (case, variant) while `deadline` allows: compile and median call time; the JSON after each."""
    meta, rows = report.run_header(command), []
    pairs = [tuple(map(int, case.split(":"))) for case in args.cases.split(",")]
    for (batch, budget), variant in itertools.product(pairs, args.variants.split(",")):
        if not deadline.allows(f"{batch}:{budget} {variant}"):
            continue
        rng = np.random.default_rng(0)
        logp = -np.sort(rng.exponential(2.0, (batch, args.depth, args.branching)), axis=-1)
        tok = np.broadcast_to(np.arange(args.branching, dtype=np.int32), logp.shape)
        inputs = (jnp.zeros((batch,), jnp.int32), jnp.asarray(logp, jnp.float32), jnp.asarray(tok))
        start = time.perf_counter()
        build = lattice_tree.lower(*inputs, budget=budget, variant=variant).compile()
        compile_s = time.perf_counter() - start
        row = {"batch_size": batch, "budget": budget, "variant": variant, "compile_s": round(compile_s, 2)}
        row["median_us"] = round(1e6 * median_seconds(lambda b=build, x=inputs: b(*x), args.reps), 1)
        print(json.dumps(row), flush=True)
        rows.append(row)
        report.write_json(args.out, {"meta": meta, "rows": rows, "skipped": deadline.skipped})
    report.write_json(args.out, {"meta": meta, "rows": rows, "skipped": deadline.skipped})
    return 0
