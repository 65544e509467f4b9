"""Time the MoE expert dispatches (models/moe.py) at several token counts against the floor of the
distinct experts the tokens select: one stack of layers of Qwen3-30B-A3B's expert shape, with its
experts in bf16 ("plain"), FP8 (128 x 128 block scales) or INT4 (int32 words, bf16 scales of 32 rows).

    ddtree-bench moe --out moe_dispatch.json [--deadline-s 180]
    ddtree-bench moe --print results/h200/moe-dispatch/dispatch.json     # a recorded file's table

The floor of a layer is the stored bytes (values and scales) of the experts its tokens chose (counted
from the routing of the timed inputs) over the read ceiling of a `jnp.sum` in the same run. Each layer
has its own weights and feeds the next, so nothing is read from cache or hoisted. Cases run in the
order of --dispatches (every format and token count of the first, then of the second, ...), so the
undecided ones go first: `gather` only up to --gather-max tokens (it materialises k expert matrices
per token), `grouped_split` up to --split-max, `sorted_mgpu` on bf16 only, `few` and `few_mgpu` up
to moe.FEW_MAX_TOKENS (above it they run `grouped`); no case starts after --deadline-s (those left are
listed under "skipped"). Each output is compared with the first dispatch's at its format and count.
A dispatch name with `_interpret` appended runs its Pallas kernel interpreted (on the CPU).

The JSON's "dispatch_table" holds, per format, the rows of kernels.tuning.MOE_GPU_DISPATCH that the
fastest dispatch at each measured count gives (`tuning.dispatch_table_rows`), printed at the end too.
(Formerly scripts/bench_moe.py: its files, rows without "format" being bf16, print the same.)
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from ddtree_jax.bench import report
from ddtree_jax.bench.timing import median_seconds, read_ceiling_gbs
from ddtree_jax.errors import DDTreeError
from ddtree_jax.kernels.tuning import dispatch_table_rows
from ddtree_jax.models import moe
from ddtree_jax.models.common import rms_norm
from ddtree_jax.quant.arrays import Fp8Weight, Int4Weight, stored_bytes

FORMATS = ("plain", "fp8", "int4")
EXPERT_WEIGHTS = ("experts_gate", "experts_up", "experts_down")


def make_layers(key: jax.Array, layers: int, experts: int, hidden: int, width: int, dtype) -> list[dict]:
    """Random router [hidden, E] and stacked experts [E, hidden, width] / [E, width, hidden] per layer
    (scale 0.02, as ddtree-bench's random weights)."""
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


def quantized(w: jax.Array, fmt: str, key: jax.Array) -> object:
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


def dispatch_tables(rows: list[dict]) -> dict[str, list]:
    """Per format, the dispatch table rows of the fastest dispatch at each measured token count."""
    best: dict[str, dict[int, tuple[float, str]]] = {}
    for r in rows:
        if "layer_ms" in r:
            at = best.setdefault(r.get("format", "plain"), {})
            if r["tokens"] not in at or r["layer_ms"] < at[r["tokens"]][0]:
                at[r["tokens"]] = (r["layer_ms"], r["dispatch"])
    return {fmt: dispatch_table_rows({n: d for n, (_, d) in at.items()}) for fmt, at in best.items()}


def print_table(rows: list[dict]) -> None:
    """One line per timed row, the fastest dispatch per format and count, and the dispatch table rows."""
    timed = [r for r in rows if "layer_ms" in r]
    print(f"{'format':>7}{'tokens':>7}{'dispatch':>13}{'ms/layer':>10}{'floor':>8}{'x floor':>9}")
    for r in timed:
        print(
            f"{r.get('format', 'plain'):>7}{r['tokens']:7}{r['dispatch']:>13}{r['layer_ms']:10.3f}"
            f"{r['floor_ms']:8.3f}{r['over_floor']:9.2f}"
        )
    best: dict[tuple[str, int], dict] = {}
    for r in timed:
        at = (r.get("format", "plain"), r["tokens"])
        if at not in best or r["layer_ms"] < best[at]["layer_ms"]:
            best[at] = r
    for (fmt, n), r in best.items():
        print(f"best {fmt} at {n} tokens: {r['dispatch']} ({r['over_floor']:.2f}x the floor)")
    print("kernels.tuning.MOE_GPU_DISPATCH rows from this run:", json.dumps(dispatch_tables(rows)))


def main(argv: list[str] | None = None) -> int:
    """`ddtree-bench moe`; the exit status."""
    ap = report.parser("moe", __doc__)
    ap.add_argument("--tokens", default="1,8,16,64,512", help="token counts (comma list)")
    default = "few,few_mgpu,grouped,gather,fused,grouped_split,sorted_mgpu,sorted"
    ap.add_argument("--dispatches", default=default, help="comma list, in the order to run them")
    ap.add_argument("--formats", default="plain", help=f"comma list of {', '.join(FORMATS)}")
    ap.add_argument("--layers", type=int, default=8, help="expert layers stacked (ms are per layer)")
    ap.add_argument("--experts", type=int, default=128, help="routed experts per layer")
    ap.add_argument(
        "--experts-per-token", type=int, default=8, help="experts each token is routed to (top-k)"
    )
    ap.add_argument("--hidden", type=int, default=2048, help="the model's hidden size")
    ap.add_argument("--width", type=int, default=768, help="each expert's intermediate size")
    ap.add_argument("--gather-max", type=int, default=16, help="largest token count timed for gather")
    ap.add_argument("--split-max", type=int, default=8, help="largest token count timed for grouped_split")
    ap.add_argument("--reps", type=int, default=5, help="timed repetitions")
    ap.add_argument("--ceiling-bytes", type=int, default=4 << 30, help="bytes the read ceiling's sum reads")
    report.add_deadline(ap)
    ap.add_argument("--out", help="JSON output path (required unless --print)")
    ap.add_argument("--print", dest="print_json", help="only print the table of a results JSON")
    return report.run_subcommand("moe", ap, argv, run)


def cases(args: argparse.Namespace) -> list[tuple[str, str, int]]:
    """(dispatch, format, tokens) in the order they run, within each dispatch's token limit."""
    limit = {"gather": args.gather_max, "grouped_split": args.split_max}
    limit |= {"few": moe.FEW_MAX_TOKENS, "few_mgpu": moe.FEW_MAX_TOKENS}
    for fmt in args.formats.split(","):
        if fmt not in FORMATS:
            raise DDTreeError(f"--formats: unknown {fmt!r} (one of {', '.join(FORMATS)})")
    tokens = [int(t) for t in args.tokens.split(",")]
    out = []
    for d in args.dispatches.split(","):
        base = d.removesuffix("_interpret")
        for fmt in args.formats.split(","):
            out += [
                (d, fmt, n)
                for n in tokens
                if n <= limit.get(base, n) and (base != "sorted_mgpu" or fmt == "plain")
            ]
    return out


def run(args: argparse.Namespace, command: list[str], deadline: report.Deadline) -> int:
    """Every case while `deadline` allows; the JSON after each; the table at the end."""
    if args.print_json:
        try:
            with open(args.print_json) as f:
                print_table(json.load(f)["rows"])
        except (OSError, ValueError, KeyError) as e:
            raise DDTreeError(f"{args.print_json}: cannot read a moe benchmark JSON ({e})") from e
        return 0
    if args.out is None:
        raise DDTreeError("--out is required (or --print FILE)")
    todo = cases(args)
    meta, rows = report.run_header(command), []

    def save() -> None:
        data = {
            "meta": meta,
            "rows": rows,
            "dispatch_table": dispatch_tables(rows),
            "skipped": deadline.skipped,
        }
        report.write_json(args.out, data)

    if not deadline.allows("weights and read ceiling"):  # no case runs either
        deadline.skipped += [{"dispatch": d, "format": f, "tokens": n} for d, f, n in todo]
        save()
        return 0
    dtype = jnp.bfloat16
    ceiling = read_ceiling_gbs(args.ceiling_bytes)
    base = make_layers(jax.random.key(0), args.layers, args.experts, args.hidden, args.width, dtype)
    formats = sorted({f for _, f, _ in todo}, key=FORMATS.index)
    stacks = {fmt: in_format(base, fmt) for fmt in formats}
    expert_bytes = {
        fmt: sum(stored_bytes(stacks[fmt][0][n]) for n in EXPERT_WEIGHTS) / args.experts for fmt in formats
    }
    meta |= {"read_ceiling_gbs": ceiling, "expert_bytes": expert_bytes}
    inputs = {n: jax.random.normal(jax.random.key(n), (n, args.hidden), dtype) for _, _, n in todo}
    reference = {}
    for dispatch, fmt, n in todo:
        row = {"tokens": n, "format": fmt, "dispatch": dispatch}
        if not deadline.allows(row):
            continue
        x, layers = inputs[n], stacks[fmt]
        # the weights are an argument, not constants folded into the program
        fn = jax.jit(lambda w, x, d=dispatch: stack(w, x, args.experts_per_token, d))
        try:
            t0 = time.monotonic()
            out, chosen = jax.block_until_ready(fn(layers, x))
            row["compile_s"] = time.monotonic() - t0
            distinct = float(np.mean([len(np.unique(c)) for c in np.asarray(chosen)]))
            floor_ms = 1e3 * distinct * expert_bytes[fmt] / (ceiling * 1e9)
            layer_ms = 1e3 * median_seconds(lambda fn=fn, x=x, w=layers: fn(w, x), args.reps) / args.layers
            first = reference.setdefault((fmt, n), (dispatch, out))
            err = float(jnp.max(jnp.abs(out.astype(jnp.float32) - first[1].astype(jnp.float32))))
            row |= {"layer_ms": layer_ms, "distinct_experts": distinct, "floor_ms": floor_ms}
            row |= {"over_floor": layer_ms / floor_ms, "max_abs_diff_to": [first[0], err]}
        except Exception as e:  # noqa: BLE001 - a kernel that does not lower: keep the others
            row["error"] = f"{type(e).__name__}: {e}"[:300]
        rows.append(row)
        print(json.dumps(row), flush=True)
        save()
    save()
    print_table(rows)
    return 0
