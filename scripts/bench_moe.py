"""Time the MoE expert dispatches (models/moe.py) at several token counts against the floor of the
distinct experts the tokens select: one stack of layers of Qwen3-30B-A3B's expert shape, with its
experts in bf16 ("plain"), FP8 (128 x 128 block scales) or INT4 (int32 words, bf16 scales of 32 rows).

The floor of a layer is the stored bytes (values and scales) of the experts its tokens chose (counted
from the routing of the timed inputs) over the read ceiling of a `jnp.sum` in the same run. Each layer
has its own weights and feeds the next, so nothing is read from cache or hoisted. Cases run in the
order of --dispatches (every format and token count of the first, then of the second, ...), so the
undecided ones go first: `gather` only up to --gather-max tokens (it materialises k expert matrices
per token), `grouped_split` up to --split-max, `sorted_mgpu` on bf16 only, `few` and `few_mgpu` up
to moe.FEW_MAX_TOKENS (above it they run `grouped`); no case starts after --deadline-s seconds (those left
are written as skipped). Each output is compared with the first dispatch's at its format and count.

The JSON's "dispatch_table" holds, per format, the rows of kernels.tuning.MOE_GPU_DISPATCH that the
fastest dispatch at each measured count gives (`tuning.dispatch_table_rows`), printed at the end too.

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
from ddtree_jax.kernels.tuning import dispatch_table_rows  # noqa: E402
from ddtree_jax.models import moe  # noqa: E402
from ddtree_jax.models.common import rms_norm  # noqa: E402
from ddtree_jax.quant.arrays import Fp8Weight, Int4Weight, stored_bytes  # noqa: E402

FORMATS = ("plain", "fp8", "int4")


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


def quantized(w: jax.Array, fmt: str, key) -> object:
    """A random expert weight [E, K, N] of w's shape in `fmt`: bf16 as is; FP8 e4m3 values with
    float32 scales of 128 x 128 blocks; INT4 random int32 words with bf16 scales of 32 rows (values
    near w's 0.02 scale; what is timed is the bytes)."""
    e, k, n = w.shape
    if fmt == "fp8":
        values = (w / 0.02).astype(jnp.float8_e4m3fn)
        return Fp8Weight(values, jnp.full((e, k // 128, n // 128), 0.02, jnp.float32), (k, n), (128, 128))
    if fmt == "int4":
        words = jax.lax.bitcast_convert_type(jax.random.bits(key, (e, k // 8, n), jnp.uint32), jnp.int32)
        return Int4Weight(words, jnp.full((e, k // 32, n), 0.005, jnp.bfloat16), 32)
    return w


def in_format(layers: list[dict], fmt: str) -> list[dict]:
    """The layers with their experts in `fmt` (the router stays bf16)."""
    keys = iter(jax.random.split(jax.random.key(1), 3 * len(layers)))
    return [{k: v if k == "router" else quantized(v, fmt, next(keys)) for k, v in p.items()} for p in layers]


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
    default = "few,few_mgpu,grouped,gather,fused,grouped_split,sorted_mgpu,sorted"
    ap.add_argument("--dispatches", default=default, help="comma list, in the order to run them")
    ap.add_argument("--formats", default="plain", help=f"comma list of {', '.join(FORMATS)}")
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
    base = make_layers(jax.random.key(0), args.layers, args.experts, args.hidden, args.width, dtype)
    formats = args.formats.split(",")
    stacks = {fmt: in_format(base, fmt) for fmt in formats}
    names = ("experts_gate", "experts_up", "experts_down")
    expert_bytes = {
        fmt: sum(stored_bytes(stacks[fmt][0][n]) for n in names) / args.experts for fmt in formats
    }
    meta = run_header(sys.argv)
    meta |= {"read_ceiling_gbs": ceiling, "expert_bytes": expert_bytes}
    rows = []
    tokens = [int(t) for t in args.tokens.split(",")]
    few = moe.FEW_MAX_TOKENS
    limit = {"gather": args.gather_max, "grouped_split": args.split_max, "few": few, "few_mgpu": few}
    cases = [
        (d, fmt, n)
        for d in args.dispatches.split(",")
        for fmt in formats
        for n in tokens
        if n <= limit.get(d, n) and (d != "sorted_mgpu" or fmt == "plain")
    ]
    inputs = {n: jax.random.normal(jax.random.key(n), (n, args.hidden), dtype) for n in tokens}
    reference = {}
    start = time.monotonic()

    def save():
        table = dispatch_tables(rows)
        args.out.write_text(
            json.dumps({"meta": meta, "rows": rows, "dispatch_table": table}, indent=1) + "\n"
        )
        return table

    for dispatch, fmt, n in cases:
        x = inputs[n]
        row = {"tokens": n, "format": fmt, "dispatch": dispatch}
        if args.deadline_s is not None and time.monotonic() - start > args.deadline_s:
            row["skipped"] = f"deadline {args.deadline_s} s"
            rows.append(row)
            continue
        # the weights are an argument, not constants folded into the program
        fn = jax.jit(lambda w, x, d=dispatch: stack(w, x, args.experts_per_token, d))
        layers = stacks[fmt]
        try:
            t0 = time.monotonic()
            out, chosen = jax.block_until_ready(fn(layers, x))
            row["compile_s"] = time.monotonic() - t0
            distinct = np.mean([len(np.unique(c)) for c in np.asarray(chosen)])
            floor_ms = 1e3 * distinct * expert_bytes[fmt] / (ceiling * 1e9)
            layer_ms = 1e3 * median_seconds(lambda fn=fn, x=x, w=layers: fn(w, x), args.reps) / args.layers
            first = reference.setdefault((fmt, n), (dispatch, out))
            err = float(jnp.max(jnp.abs(out.astype(jnp.float32) - first[1].astype(jnp.float32))))
            row |= {"layer_ms": layer_ms, "distinct_experts": distinct, "floor_ms": floor_ms}
            row |= {"over_floor": layer_ms / floor_ms, "max_abs_diff_to": [first[0], err]}
        except Exception as e:  # e.g. a kernel that does not lower: keep the others
            row["error"] = f"{type(e).__name__}: {e}"[:300]
        rows.append(row)
        print(json.dumps(row), flush=True)
        save()
    table = save()
    print(f"{'format':>7}{'tokens':>7}{'dispatch':>13}{'ms/layer':>10}{'floor':>8}{'x floor':>9}")
    for r in rows:
        if "layer_ms" in r:
            print(
                f"{r['format']:>7}{r['tokens']:7}{r['dispatch']:>13}{r['layer_ms']:10.3f}{r['floor_ms']:8.3f}"
                f"{r['over_floor']:9.2f}"
            )
    for fmt in formats:
        for n in tokens:
            timed = [r for r in rows if r["tokens"] == n and r["format"] == fmt and "layer_ms" in r]
            if timed:
                best = min(timed, key=lambda r: r["layer_ms"])
                print(f"best {fmt} at {n} tokens: {best['dispatch']} ({best['over_floor']:.2f}x the floor)")
    print("kernels.tuning.MOE_GPU_DISPATCH rows from this run:", json.dumps(table))


def dispatch_tables(rows: list[dict]) -> dict[str, list]:
    """Per format, the dispatch table rows of the fastest dispatch at each measured token count."""
    best: dict[str, dict[int, tuple[float, str]]] = {}
    for r in rows:
        if "layer_ms" in r:
            at = best.setdefault(r["format"], {})
            if r["tokens"] not in at or r["layer_ms"] < at[r["tokens"]][0]:
                at[r["tokens"]] = (r["layer_ms"], r["dispatch"])
    return {fmt: dispatch_table_rows({n: d for n, (_, d) in at.items()}) for fmt, at in best.items()}


if __name__ == "__main__":
    main()
