"""Time the MoE expert dispatches (models/moe.py) at several token counts against the floor of the
distinct experts the tokens select: one stack of layers of Qwen3-30B-A3B's expert shape, bf16.

The floor of a layer is the bytes of the experts its tokens chose (counted from the routing of the
timed inputs) over the read ceiling of a `jnp.sum` in the same run. Each layer has its own weights and
feeds the next, so nothing is read from cache or hoisted. Cases run in an order that puts the
undecided ones first: per token count the Pallas `grouped` kernel, `grouped_split` (more K splits;
up to --split-max tokens) and `gather` (up to --gather-max tokens; it materialises k expert matrices
per token), then `sorted` (ragged_dot, measured before) for every count; no case starts after
--deadline-s seconds (those left are written as skipped).

python scripts/bench_moe.py --out moe_dispatch.json
"""

import argparse
import json
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a source tree

from ddtree_jax.bench.report import run_header  # noqa: E402
from ddtree_jax.bench.timing import median_seconds, read_ceiling_gbs  # noqa: E402
from ddtree_jax.models import moe  # noqa: E402
from ddtree_jax.models.common import rms_norm  # noqa: E402


def make_layers(key, layers: int, experts: int, hidden: int, width: int, dtype) -> list[dict]:
    """Random router and stacked experts per layer (scale 0.02, as ddtree-bench's random weights)."""
    out = []
    for k in jax.random.split(key, layers):
        kr, kg, ku, kd = jax.random.split(k, 4)
        out.append(
            {
                "router": (0.02 * jax.random.normal(kr, (hidden, experts))).astype(dtype),
                "experts_gate": (0.02 * jax.random.normal(kg, (experts, hidden, width))).astype(dtype),
                "experts_up": (0.02 * jax.random.normal(ku, (experts, hidden, width))).astype(dtype),
                "experts_down": (0.02 * jax.random.normal(kd, (experts, width, hidden))).astype(dtype),
            }
        )
    return out


def stack(layers: list[dict], x: jax.Array, per_token: int, dispatch: str) -> tuple[jax.Array, jax.Array]:
    """x [N, H] through every layer (residual + norm); also each layer's chosen experts [L, N, k]."""
    chosen = []
    for p in layers:
        chosen.append(moe.route(p["router"], x, per_token, True).experts)
        y = moe.experts_ffn(p, x, per_token, True, dispatch=dispatch)
        x = rms_norm(x + y, jnp.ones((), x.dtype), 1e-6)
    return x, jnp.stack(chosen)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", default="1,8,16,64,512")
    ap.add_argument("--dispatches", default="grouped,grouped_split,gather,sorted")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--experts-per-token", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--width", type=int, default=768, help="each expert's intermediate size")
    ap.add_argument("--gather-max", type=int, default=16, help="largest token count timed for gather")
    ap.add_argument("--split-max", type=int, default=8, help="largest token count timed for grouped_split")
    ap.add_argument("--deadline-s", type=float, default=None, help="start no case after this many seconds")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--ceiling-bytes", type=int, default=4 << 30)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    dtype = jnp.bfloat16
    ceiling = read_ceiling_gbs(args.ceiling_bytes)
    layers = make_layers(jax.random.key(0), args.layers, args.experts, args.hidden, args.width, dtype)
    expert_bytes = 3 * args.hidden * args.width * jnp.dtype(dtype).itemsize
    meta = run_header(sys.argv)
    meta |= {"read_ceiling_gbs": ceiling, "expert_bytes": expert_bytes}
    rows = []
    tokens = [int(t) for t in args.tokens.split(",")]
    names = args.dispatches.split(",")
    limit = {"gather": args.gather_max, "grouped_split": args.split_max}
    cases = [(n, d) for n in tokens for d in names if d != "sorted" and n <= limit.get(d, n)]
    cases += [(n, "sorted") for n in tokens if "sorted" in names]
    inputs = {n: jax.random.normal(jax.random.key(n), (n, args.hidden), dtype) for n in tokens}
    reference = {}
    start = time.monotonic()
    for n, dispatch in cases:
        x = inputs[n]
        row = {"tokens": n, "dispatch": dispatch}
        if args.deadline_s is not None and time.monotonic() - start > args.deadline_s:
            row["skipped"] = f"deadline {args.deadline_s} s"
            rows.append(row)
            continue
        # the weights are an argument, not constants folded into the program
        fn = jax.jit(lambda w, x, d=dispatch: stack(w, x, args.experts_per_token, d))
        try:
            t0 = time.monotonic()
            out, chosen = jax.block_until_ready(fn(layers, x))
            row["compile_s"] = time.monotonic() - t0
            distinct = np.mean([len(np.unique(c)) for c in np.asarray(chosen)])
            floor_ms = 1e3 * distinct * expert_bytes / (ceiling * 1e9)
            layer_ms = 1e3 * median_seconds(lambda fn=fn, x=x: fn(layers, x), args.reps) / args.layers
            first = reference.setdefault(n, (dispatch, out))
            err = float(jnp.max(jnp.abs(out.astype(jnp.float32) - first[1].astype(jnp.float32))))
            row |= {"layer_ms": layer_ms, "distinct_experts": distinct, "floor_ms": floor_ms}
            row |= {"over_floor": layer_ms / floor_ms, "max_abs_diff_to": [first[0], err]}
        except Exception as e:  # e.g. a kernel that does not lower: keep the others
            row["error"] = f"{type(e).__name__}: {e}"[:300]
        rows.append(row)
        print(json.dumps(row), flush=True)
        args.out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    args.out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    print(f"{'tokens':>7}{'dispatch':>13}{'ms/layer':>10}{'floor':>8}{'x floor':>9}")
    for r in rows:
        if "layer_ms" in r:
            print(
                f"{r['tokens']:7}{r['dispatch']:>13}{r['layer_ms']:10.3f}{r['floor_ms']:8.3f}{r['over_floor']:9.2f}"
            )
    for n in sorted({r["tokens"] for r in rows}):
        timed = [r for r in rows if r["tokens"] == n and "layer_ms" in r]
        if timed:
            best = min(timed, key=lambda r: r["layer_ms"])
            print(f"best at {n} tokens: {best['dispatch']} ({best['over_floor']:.2f}x the floor)")


if __name__ == "__main__":
    main()
