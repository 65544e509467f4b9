"""Time `jax.lax.top_k` against `collectives.tiled_top_k` (same values and ids) on vocabulary rows.

python scripts/bench_topk.py --out topk.json
"""

import argparse
import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a source tree

from ddtree_jax.bench.report import Deadline, add_deadline, run_header, write_json  # noqa: E402
from ddtree_jax.bench.timing import median_seconds  # noqa: E402
from ddtree_jax.collectives import tiled_top_k  # noqa: E402


def median_us(fn, x, reps: int = 50) -> float:
    """Median time of fn(x) over `reps` calls, each synced (so a dispatch is included), in microseconds."""
    return 1e6 * median_seconds(lambda: fn(x), reps)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--cases", default="16:32,64:64,256:64,1024:64", help="rows:k pairs")
    add_deadline(ap)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    deadline = Deadline(args.deadline_s, prog="bench_topk.py")
    meta, rows = run_header(sys.argv), []
    for case in args.cases.split(","):
        if not deadline.allows(case):
            continue
        n, k = map(int, case.split(":"))
        x = jax.random.normal(jax.random.key(0), (n, args.vocab), jnp.float32)
        lax_fn = jax.jit(lambda a, k=k: jax.lax.top_k(a, k))
        tiled_fn = jax.jit(lambda a, k=k: tiled_top_k(a, k))
        ties = jax.random.randint(jax.random.key(1), x.shape, 0, 8).astype(jnp.float32)  # ids decide ties
        same = all(
            bool(jnp.all(a == b)) for y in (x, ties) for a, b in zip(lax_fn(y), tiled_fn(y), strict=True)
        )
        row = {"rows": n, "k": k, "vocab": args.vocab, "lax_top_k_us": median_us(lax_fn, x)}
        row |= {"tiled_top_k_us": median_us(tiled_fn, x), "identical": same}
        rows.append(row)
        print(json.dumps(row), flush=True)
        write_json(args.out, {"meta": meta, "rows": rows, "skipped": deadline.skipped})
    write_json(args.out, {"meta": meta, "rows": rows, "skipped": deadline.skipped})


if __name__ == "__main__":
    main()
