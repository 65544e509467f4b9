"""Time `jax.lax.top_k` against `collectives.tiled_top_k` (same values and ids) on vocabulary rows.

ddtree-bench topk --out topk.json
"""

import argparse
import json

import jax
import jax.numpy as jnp

from ddtree_jax.bench import report
from ddtree_jax.bench.timing import median_seconds
from ddtree_jax.collectives import tiled_top_k


def median_us(fn, x, reps: int = 50) -> float:
    """Median time of fn(x) over `reps` calls, each synced (so a dispatch is included), in microseconds."""
    return 1e6 * median_seconds(lambda: fn(x), reps)


def main(argv: list[str] | None = None) -> int:
    """`ddtree-bench topk`; the exit status."""
    ap = report.parser("topk", __doc__)
    ap.add_argument("--vocab-size", type=int, default=151936, help="the rows' width")
    report.add_deprecated(ap, "--vocab", "--vocab-size", type=int)
    ap.add_argument("--cases", default="16:32,64:64,256:64,1024:64", help="rows:k pairs (k: candidates kept)")
    report.add_deadline(ap)
    ap.add_argument("--out", required=True, help="JSON output path")
    return report.run_subcommand("topk", ap, argv, run)


def run(args: argparse.Namespace, command: list[str], deadline: report.Deadline) -> int:
    """Every case while `deadline` allows: both top-k's times and whether they agree; the JSON after each."""
    meta, rows = report.run_header(command), []
    for case in args.cases.split(","):
        if not deadline.allows(case):
            continue
        n, k = map(int, case.split(":"))
        x = jax.random.normal(jax.random.key(0), (n, args.vocab_size), jnp.float32)
        lax_fn = jax.jit(lambda a, k=k: jax.lax.top_k(a, k))
        tiled_fn = jax.jit(lambda a, k=k: tiled_top_k(a, k))
        ties = jax.random.randint(jax.random.key(1), x.shape, 0, 8).astype(jnp.float32)  # ids decide ties
        same = all(
            bool(jnp.all(a == b)) for y in (x, ties) for a, b in zip(lax_fn(y), tiled_fn(y), strict=True)
        )
        row = {"rows": n, "k": k, "vocab_size": args.vocab_size, "lax_top_k_us": median_us(lax_fn, x)}
        row |= {"tiled_top_k_us": median_us(tiled_fn, x), "identical": same}
        rows.append(row)
        print(json.dumps(row), flush=True)
        report.write_json(args.out, {"meta": meta, "rows": rows, "skipped": deadline.skipped})
    report.write_json(args.out, {"meta": meta, "rows": rows, "skipped": deadline.skipped})
    return 0
