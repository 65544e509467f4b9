"""The Pallas MLA (latent-cache) attention kernel against its jnp reference, with floors.

    ddtree-bench mla-attention --deadline-s 210 --out results/h200/bench_mla_attention.json  # H200, <= 4 min
    ddtree-bench mla-attention --quick --out /tmp/mla.json                  # CPU smoke (interpret)

Kimi-K2 shapes (latent 512 + RoPE key 64, bf16): H = 64 heads (TP1) and 8 (one TP8 shard; the
latent cache is the same on every device), T = 1 (ar) and 64 (a budget-63 verify, random ancestor
masks), S = 1k, 4k, 8k, 32k (all visible), B = 1 and 16. Per row: the kernel and the reference under
jit, the kernel's error against the reference on the device, and two floors: bytes (latent cache +
queries + output) over the read ceiling measured in the same run (a large `jnp.sum`), and FLOPs
(2 x rows x keys x (512 + 64 + 512)) over 790 TFLOP/s (bf16 matmul on the H200, docs/design.md). Then,
while --deadline-s allows, a tuning sweep of the kernel alone on the shapes that decide the
defaults. Timing as in `ddtree-bench attention`: k independent calls per jitted program, each on its own
copy of the cache, median over runs / k. Every configuration is guarded: failures are recorded as
error strings and the run goes on; what does not fit `--deadline-s` is listed under "skipped" (rows of
files recorded before 2026-12-07 say `skipped: deadline`).
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np

from ddtree_jax.bench import report
from ddtree_jax.bench.attention import random_tree_mask, read_ceiling, rel_errors, short_error
from ddtree_jax.kernels.mla_attention import mla_attention, mla_attention_reference
from ddtree_jax.kernels.tuning import resolve_mla_tuning

warnings.filterwarnings("ignore", category=DeprecationWarning)

START = time.perf_counter()
PEAK_FLOPS = 790e12  # bf16 matmul on the H200 (docs/design.md)
COPY_BUDGET = 12 << 30  # bytes of cache copies per timed program
REF_MAX_BYTES = 16 << 30  # float32 scores of one reference call, beyond which it is skipped
SOFTMAX_SCALE = 192**-0.5


def ints(text: str) -> list[int]:
    """'1,16' -> [1, 16]."""
    return [int(x) for x in text.split(",") if x]


def elapsed() -> float:
    """Seconds since the script started."""
    return time.perf_counter() - START


def time_per_call(make_fn, args, *, k: int, target_s: float = 0.25, max_reps: int = 30):
    """Median seconds per call of `make_fn(k)(*args)` (k calls per program, each on its own cache copy).

    args = (q_latent, q_rope, latent_cache, rope_cache, ...). Returns (timing dict, first output).
    """
    ql, qr, lc, rc, *rest = args
    k = max(1, min(k, COPY_BUDGET // (lc.nbytes + rc.nbytes)))
    lcs = (lc,) + tuple(lc + 0 for _ in range(k - 1))
    rcs = (rc,) + tuple(rc + 0 for _ in range(k - 1))
    fn = jax.jit(make_fn(k))
    call_args = (ql, qr, lcs, rcs, *rest)
    t0 = time.perf_counter()
    first_out = jax.block_until_ready(fn(*call_args))[0]
    compile_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*call_args))
    reps = int(min(max_reps, max(3, target_s / max(time.perf_counter() - t0, 1e-6))))
    runs = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*call_args))
        runs.append(time.perf_counter() - t0)
    timing = dict(s=statistics.median(runs) / k, min_s=min(runs) / k, reps=reps, calls=k, compile_s=compile_s)
    return timing, first_out


def calls(fn, **kwargs):
    """make(k): a function running `fn` k times, call i on cache copy i with lengths - i."""

    def make(k):
        def run(ql, qr, lcs, rcs, lengths, ln, rn, mask):
            return [
                fn(ql, qr, lcs[i], rcs[i], lengths - i, ln, rn, mask, softmax_scale=SOFTMAX_SCALE, **kwargs)
                for i in range(k)
            ]

        return run

    return make


def floors(b: int, s: int, t: int, h: int, c: int, r: int, itemsize: int, ceiling: float) -> dict:
    """Bytes and FLOPs of one call with every cache entry visible, and the floors they set (seconds)."""
    cache_bytes = b * s * (c + r) * itemsize
    io_bytes = b * t * h * (c + r + c) * itemsize  # queries read, output written
    flops = 2 * b * t * h * (s + t) * (c + r + c)
    return dict(
        cache_bytes=cache_bytes,
        bytes=cache_bytes + io_bytes,
        flops=flops,
        byte_floor_s=(cache_bytes + io_bytes) / ceiling,
        flop_floor_s=flops / PEAK_FLOPS,
    )


def make_inputs(key, rng, *, b, s, t, h, c, r, dtype):
    """Random inputs with every cache entry visible and random ancestor masks."""
    ks = jax.random.split(key, 6)
    shapes = [(b, t, h, c), (b, t, h, r), (b, s, c), (b, s, r), (b, t, c), (b, t, r)]
    ql, qr, lc, rc, ln, rn = (
        jax.random.normal(kk, shape, jnp.float32).astype(dtype) for kk, shape in zip(ks, shapes, strict=True)
    )
    mask = jnp.asarray(random_tree_mask(rng, b, t))
    return ql, qr, lc, rc, jnp.full((b,), s, jnp.int32), ln, rn, mask


def reference_output(args) -> jax.Array:
    """The jnp reference's output for `args` (compiled once per shape by jit's cache)."""
    return jax.jit(reference_fn)(*args)


def reference_fn(*args) -> jax.Array:
    """mla_attention_reference at the bench's softmax scale."""
    return mla_attention_reference(*args, softmax_scale=SOFTMAX_SCALE)


def bench_row(
    args, *, shape: dict, ceiling: float, interpret: bool, k: int, tuning: dict, with_reference: bool
):
    """One configuration: kernel time, reference time (if `with_reference`) and the kernel's error
    against the reference. Never raises."""
    b, s, t, h = shape["B"], shape["S"], shape["T"], shape["H"]
    c, r = args[0].shape[-1], args[1].shape[-1]
    row = dict(shape, tuning=dict(tuning))
    row.update(floors(b, s, t, h, c, r, args[0].dtype.itemsize, ceiling))
    floor_s = max(row["byte_floor_s"], row["flop_floor_s"])
    out = ref = None
    try:
        row["tuning"] = resolve_mla_tuning((b, t, h, c), s, **tuning)
        timing, out = time_per_call(calls(mla_attention, interpret=interpret, **tuning), args, k=k)
        row["kernel"] = timing
        row["kernel_x_floor"] = timing["s"] / floor_s
    except Exception as e:  # noqa: BLE001
        row["kernel_error"] = short_error(e)
    scores_bytes = b * t * h * (s + t) * 4
    if with_reference and scores_bytes <= REF_MAX_BYTES:
        try:
            kr = k if scores_bytes * 4 * k <= REF_MAX_BYTES else 1
            timing, ref = time_per_call(calls(mla_attention_reference), args, k=kr)
            row["reference"] = timing
            row["reference_x_floor"] = timing["s"] / floor_s
        except Exception as e:  # noqa: BLE001
            row["reference_error"] = short_error(e)
    elif with_reference:
        row["reference_skipped"] = "scores too large"
    if out is not None:
        try:
            if ref is None:
                ref = reference_output(args)
            row["check"] = rel_errors(out, ref)
        except Exception as e:  # noqa: BLE001
            row["check_error"] = short_error(e)
    if "kernel" in row and "reference" in row:
        row["speedup_vs_reference"] = row["reference"]["s"] / row["kernel"]["s"]
    return row


def fmt_us(timing) -> str:
    """Microseconds, or a dash."""
    return f"{timing['s'] * 1e6:9.1f}" if timing else "        -"


def print_table(results: dict) -> None:
    """The rows and the sweep as text."""
    print(
        f"\nread ceiling {results['ceiling']['bytes_per_s'] / 1e9:.0f} GB/s, {PEAK_FLOPS / 1e12:.0f} TFLOP/s"
    )
    head = f"{'H':>3} {'B':>3} {'S':>6} {'T':>3} | {'bytes us':>8} {'flops us':>8}"
    print(head + f" | {'kernel':>9} {'x floor':>7} | {'ref':>9} {'x ref':>6} | {'rel err':>8} | tuning")
    for row in results["rows"] + results["tuning_sweep"]:
        tun = row.get("tuning", {})
        check = row.get("check")
        notes = " ".join(f"{key}: {str(row[key])[:80]}" for key in row if "error" in key or "skipped" in key)
        speedup = row.get("speedup_vs_reference")
        byte_us, flop_us = (row.get(f"{x}_floor_s", float("nan")) * 1e6 for x in ("byte", "flop"))
        print(
            f"{row['H']:>3} {row['B']:>3} {row['S']:>6} {row['T']:>3} | "
            f"{byte_us:8.1f} {flop_us:8.1f} | {fmt_us(row.get('kernel'))} "
            f"{row.get('kernel_x_floor', float('nan')):7.2f} | {fmt_us(row.get('reference'))} "
            f"{(f'{speedup:6.1f}' if speedup else '     -')} | "
            f"{(f'{check["rel_l2"]:8.1e}' if check else '       -')} | "
            f"q{tun.get('tile_q')} v{tun.get('value_splits')} k{tun.get('tile_k')} s{tun.get('splits')} "
            f"w{tun.get('num_warps')} "
            f"st{tun.get('num_stages')} {notes}"
        )


def sweep_tunings(quick: bool) -> list[tuple[dict, list[dict]]]:
    """(shape, tunings) for the kernel-only sweep, each list's most telling first (the sweep runs the
    first FIRST_PASS of every shape before the rest). Defaults are timed in the main rows; every list
    starts with the first H200 run's default for that shape (16-row tiles at T = 1, 3 or 17 splits
    at T = 64), so the sweep also says what the new defaults gained."""
    if quick:
        return [(dict(H=4, B=1, S=256, T=4), [dict(tile_k=16), dict(tile_q=32, splits=2, value_splits=2)])]
    # TP1 decode: default one 64-row tile (all heads), 8 warps, 128 splits of 8 blocks.
    ar = [dict(tile_q=16, num_warps=4, splits=33), dict(tile_k=64), dict(value_splits=2)]
    ar += [dict(splits=64), dict(tile_k=64, num_stages=1)]
    ar += [dict(value_splits=2, num_warps=4), dict(value_splits=4, num_warps=4), dict(num_stages=3)]
    ar += [dict(tile_k=16, num_stages=3), dict(tile_q=32, num_warps=4)]
    # TP8 shard decode (8 heads, memory bound): default one 16-row tile, 4 warps, 256 splits of 4.
    shard_ar = [dict(splits=128), dict(tile_k=64, splits=128), dict(splits=64), dict(num_stages=3)]
    shard_ar += [dict(value_splits=2), dict(tile_k=16, num_stages=3), dict(value_splits=4)]
    # TP1 verify (compute bound): default 64-row tiles, 8 warps, 2 splits (one wave of 128).
    verify = [dict(splits=3), dict(tile_k=64), dict(tile_q=128, value_splits=2), dict(num_stages=3)]
    verify += [
        dict(tile_q=32, num_warps=4),
        dict(value_splits=2, num_warps=4),
        dict(tile_k=64, num_stages=1),
    ]
    verify += [
        dict(tile_q=32, num_warps=8),
        dict(tile_k=16, num_stages=3),
        dict(splits=4),
        dict(num_warps=4),
    ]
    # TP8 shard verify: default 64-row tiles, 8 warps, 15 splits.
    shard_verify = [dict(splits=17), dict(tile_k=64), dict(tile_q=128, value_splits=2)]
    shard_verify += [dict(num_stages=3), dict(tile_q=32, num_warps=4), dict(splits=8)]
    return [
        (dict(H=64, B=1, S=32768, T=1), ar),
        (dict(H=8, B=1, S=32768, T=1), shard_ar),
        (dict(H=64, B=1, S=32768, T=64), verify),
        (dict(H=8, B=1, S=32768, T=64), shard_verify),
    ]


FIRST_PASS = 5


def main(argv: list[str] | None = None) -> int:
    """`ddtree-bench mla-attention`; the exit status."""
    parser = report.parser("mla-attention", __doc__)
    parser.add_argument("--out", required=True, help="JSON output path")
    parser.add_argument("--quick", action="store_true", help="tiny sizes (CPU smoke test, interpret mode)")
    report.add_deadline(parser)
    parser.add_argument("--no-sweep", action="store_true", help="skip the tuning sweep")
    parser.add_argument(
        "--sweep", choices=["none", "first", "full"], default="full",
        help="tuning sweep: none, the first FIRST_PASS tunings of every shape, or all",
    )  # fmt: skip
    parser.add_argument("--sweep-first", action="store_true", help="run the sweep before the main rows")
    parser.add_argument("--heads", default=None, help="main rows' H, comma list (default 64,8)")
    parser.add_argument("--batch-sizes", default=None, help="main rows' B (default 1,16)")
    report.add_deprecated(parser, "--batches", "--batch-sizes")
    parser.add_argument("--contexts", default=None, help="main rows' S (default 1024,4096,8192,32768)")
    parser.add_argument("--nodes", default=None, help="main rows' T (default 1,64)")
    parser.add_argument(
        "--dry-run", action="store_true", help="print the planned rows and tunings, run nothing"
    )
    return report.run_subcommand("mla-attention", parser, argv, run_all)


def run_all(opts: argparse.Namespace, command: list[str], deadline: report.Deadline) -> int:
    """The main rows and the sweep while `deadline` allows; the JSON after each row."""
    if opts.no_sweep:
        opts.sweep = "none"

    device = jax.devices()[0]
    interpret = device.platform != "gpu"
    dtype = jnp.bfloat16
    if opts.quick:
        heads, batches, lengths_s, nodes = [4], [1, 2], [64, 256], [1, 4]
        c, r, k, ceiling_bytes = 64, 16, 2, 64 << 20
    else:
        heads, batches, lengths_s, nodes = [64, 8], [1, 16], [1024, 4096, 8192, 32768], [1, 64]
        c, r, k, ceiling_bytes = 512, 64, 8, 4 << 30
    heads, batches, lengths_s, nodes = (
        ints(text) if text else default
        for text, default in (
            (opts.heads, heads),
            (opts.batch_sizes, batches),
            (opts.contexts, lengths_s),
            (opts.nodes, nodes),
        )
    )
    main_shapes = [dict(H=h, B=b, S=s, T=t) for h in heads for b in batches for s in lengths_s for t in nodes]
    sweep = [] if opts.sweep == "none" else sweep_tunings(opts.quick)
    parts = (
        (slice(0, FIRST_PASS),) if opts.sweep == "first" else (slice(0, FIRST_PASS), slice(FIRST_PASS, None))
    )
    sweep_runs = [(shape, tunings[part]) for part in parts for shape, tunings in sweep if tunings[part]]
    if opts.dry_run:
        plan = [("row", shape, {}) for shape in main_shapes]
        plan += [("sweep", shape, tun) for shape, tunings in sweep_runs for tun in tunings]
        for kind, shape, tun in plan:
            print(kind, shape, resolve_mla_tuning((shape["B"], shape["T"], shape["H"], c), shape["S"], **tun))
        print(f"{len(main_shapes)} rows, {len(plan) - len(main_shapes)} sweep points")
        return 0

    meta = report.run_header(command) | dict(
        platform=device.platform,
        interpret=interpret,
        dtype=str(jnp.dtype(dtype)),
        latent_dim=c,
        rope_dim=r,
        softmax_scale=SOFTMAX_SCALE,
        peak_flops=PEAK_FLOPS,
        timing="median over reps of one jitted program of k independent calls / k",
    )
    results = dict(
        meta=meta,
        rows=[],
        tuning_sweep=[],
    )
    try:
        if not deadline.allows("read ceiling"):  # no row runs either
            raise TimeoutError("--deadline-s passed")
        results["ceiling"] = read_ceiling(ceiling_bytes)
    except Exception as e:  # noqa: BLE001
        results["ceiling"] = dict(error=short_error(e), bytes_per_s=4.52e12)
    ceiling = results["ceiling"]["bytes_per_s"]
    print(f"read ceiling {ceiling / 1e9:.0f} GB/s ({elapsed():.0f}s)", flush=True)

    def save():
        results["meta"]["wall_s"] = elapsed()
        report.write_json(opts.out, results | {"skipped": deadline.skipped})

    key = jax.random.key(0)
    rng = np.random.default_rng(0)

    def run(shape: dict, tunings: list[dict], sink: list, with_reference: bool) -> None:
        """Rows of one shape (inputs made once), guarded, saved after each."""
        if not deadline.allows(f"{shape} {len(tunings)} tuning(s)"):
            return
        try:
            dims = dict(b=shape["B"], s=shape["S"], t=shape["T"], h=shape["H"], c=c, r=r, dtype=dtype)
            args = make_inputs(jax.random.fold_in(key, len(sink)), rng, **dims)
        except Exception as e:  # noqa: BLE001
            sink.append(dict(shape, error="inputs: " + short_error(e)))
            return
        for tun in tunings:
            if not deadline.allows(f"{shape} {tun or 'default'}"):
                continue
            row = bench_row(
                args, shape=shape, ceiling=ceiling, interpret=interpret, k=k, tuning=tun,
                with_reference=with_reference,
            )  # fmt: skip
            sink.append(row)
            kern, ref = row.get("kernel"), row.get("reference")
            print(
                f"[{elapsed():5.0f}s] {shape} {tun or ''}: kernel {fmt_us(kern)} us "
                f"({row.get('kernel_x_floor', float('nan')):.2f}x floor), ref {fmt_us(ref)} us"
                + "".join(f" {key2}={str(row[key2])[:120]}" for key2 in row if "error" in key2),
                flush=True,
            )
            save()
        del args
        gc.collect()

    def main_rows() -> None:
        for shape in main_shapes:
            run(shape, [{}], results["rows"], with_reference=True)

    def sweep_rows() -> None:
        for shape, tunings in sweep_runs:
            run(shape, tunings, results["tuning_sweep"], with_reference=False)

    for part in (sweep_rows, main_rows) if opts.sweep_first else (main_rows, sweep_rows):
        part()
    save()
    print_table(results)
    print(f"\nwrote {opts.out} ({elapsed():.0f}s)")
    return 0
