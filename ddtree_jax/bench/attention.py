"""The Pallas tree-attention kernel against its jnp reference and JAX's bundled decode kernel.

    ddtree-bench attention --deadline-s 240 --out results/bench_attention.json     # H200, <= ~4 min
    ddtree-bench attention --quick --out /tmp/bench_attention.json                 # CPU smoke (interpret)
    ddtree-bench attention --nodes 1 --batch-sizes 1,4,16 --contexts 1024,8192,32768 \
        --tunings "k=64;waves=8;merge=xla" --no-reference --profile --out x.json  # T = 1 vs bundled
    ddtree-bench attention --print results/h200/bench_attention.json              # a recorded file's tables

--tunings (';'-separated specs of ','-separated key=value; keys q k s w st merge waves mb, "default"
= the defaults) replaces the built-in sweep: each spec runs on every shape of the grid. --profile
traces the default kernel and the bundled one on each shape (jax.profiler) and records the device
time per call by kernel (the split kernel, the merge, XLA fusions) and the launches per call.

For each shape: correctness of the kernel against the reference (on the device), then the time of
one call of (a) the kernel, (b) the reference under jit, (c) at T = 1 the bundled
`jax.experimental.pallas.ops.gpu.decode_attention.mqa`, and the achieved K/V read bandwidth (bytes of
the visible cache over the time) as a fraction of a measured read ceiling (a large `jnp.sum`).

Timing: `reps` runs of one jitted program that makes `k` independent calls, each on its OWN copy
of the cache (with one shared cache XLA fuses the reference's k calls into one pass over K/V, and
small caches stay in L2), each run closed by `block_until_ready`; time per call = median run / k,
so host dispatch is amortised over k calls. k is cut so that the copies fit COPY_BUDGET bytes.
Every configuration is guarded: a failure is
recorded as an error string and the run goes on. `--deadline-s` bounds the wall time: what does not
fit is listed under "skipped" (rows of files recorded before 2026-12-07 say `skipped: deadline`).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import time
import traceback
import warnings

import jax
import jax.numpy as jnp
import numpy as np

from ddtree_jax.bench import report
from ddtree_jax.errors import DDTreeError
from ddtree_jax.kernels.tree_attention import tree_attention, tree_attention_reference
from ddtree_jax.kernels.tuning import resolve_tree_tuning

warnings.filterwarnings("ignore", category=DeprecationWarning)

START = time.perf_counter()


def elapsed() -> float:
    return time.perf_counter() - START


def short_error(e: BaseException) -> str:
    text = f"{type(e).__name__}: {e}"
    return text if len(text) < 600 else text[:300] + " ... " + text[-300:]


COPY_BUDGET = 12 << 30


TARGET_S = 0.25  # seconds of timed runs per configuration (--target-s)


def device_profile(fn, args, runs: int, calls: int) -> dict:
    """Device time per call by kernel name, from a jax.profiler trace of `runs` runs of `fn`.

    Sums the kernel events of the GPU planes' stream lines (CUPTI); per call = sum / (runs * calls).
    """
    import tempfile

    from ddtree_jax.bench.profile import trace_calls

    with tempfile.TemporaryDirectory(prefix="bench_attention_trace_") as tmp:
        data, _ = trace_calls(lambda: fn(*args), runs, tmp)
        by_name: dict[str, list] = {}
        for plane in data.planes:
            if not plane.name.startswith("/device:GPU"):
                continue
            lines = [line for line in plane.lines if line.name.startswith("Stream")] or list(plane.lines)
            for line in lines:
                if "memcpy" in line.name.lower():
                    continue
                for ev in line.events:
                    entry = by_name.setdefault(ev.name, [0.0, 0])
                    entry[0] += ev.duration_ns
                    entry[1] += 1
    n = runs * calls
    kernels = {
        name: dict(us=total / 1e3 / n, per_call=count / n)
        for name, (total, count) in sorted(by_name.items(), key=lambda kv: -kv[1][0])
    }
    return dict(
        device_us=sum(v["us"] for v in kernels.values()),
        launches=sum(v["per_call"] for v in kernels.values()),
        kernels=dict(list(kernels.items())[:8]),
    )


def time_per_call(
    make_fn, args, *, k: int, target_s: float | None = None, max_reps: int = 30, profile: bool = False
):
    """Median seconds per call of `make_fn(k)(*args)` (k calls per program), plus compile time.

    `args` = (q, k_cache, v_cache, ...): call i gets the i-th of k distinct cache copies.
    Returns (timings, output of the first call, i.e. at the unmodified lengths); with `profile` the
    timings carry `device_profile` of three runs (or the error that stopped it).
    """
    target_s = TARGET_S if target_s is None else target_s
    q, kc, vc, *rest = args
    k = max(1, min(k, COPY_BUDGET // (kc.nbytes + vc.nbytes)))
    kcs = (kc,) + tuple(kc + 0 for _ in range(k - 1))
    vcs = (vc,) + tuple(vc + 0 for _ in range(k - 1))
    args = (q, kcs, vcs, *rest)
    fn = jax.jit(make_fn(k))
    t0 = time.perf_counter()
    first_out = jax.block_until_ready(fn(*args))[0]  # compile + first run
    compile_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    first = time.perf_counter() - t0
    reps = int(min(max_reps, max(3, target_s / max(first, 1e-6))))
    runs = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        runs.append(time.perf_counter() - t0)
    timing = dict(s=statistics.median(runs) / k, min_s=min(runs) / k, reps=reps, calls=k, compile_s=compile_s)
    if profile:
        try:
            timing["profile"] = device_profile(fn, args, runs=3, calls=k)
        except Exception as e:  # noqa: BLE001
            timing["profile_error"] = short_error(e)
    return timing, first_out


def read_ceiling(nbytes: int) -> dict:
    """Bytes/s of a large bf16 sum: what streaming reads can reach on this device."""
    x = jax.random.normal(jax.random.key(0), (nbytes // 2,), jnp.bfloat16)
    fn = jax.jit(lambda x: jnp.sum(x, dtype=jnp.float32))
    jax.block_until_ready(fn(x))
    runs = []
    for _ in range(10):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(x))
        runs.append(time.perf_counter() - t0)
    del x
    s = statistics.median(runs)
    return dict(bytes=nbytes, s=s, bytes_per_s=nbytes / s)


def random_tree_mask(rng: np.random.Generator, b: int, t: int) -> np.ndarray:
    """Ancestor-or-self masks of random trees (parent[i] < i), one per sequence: [B, T, T] int8."""
    out = np.zeros((b, t, t), np.int8)
    for bi in range(b):
        parent = [-1] + [int(rng.integers(max(0, i - 8), i)) for i in range(1, t)]
        for i in range(t):
            j = i
            while j >= 0:
                out[bi, i, j] = 1
                j = parent[j]
    return out


def rel_errors(out, ref) -> dict:
    out = np.asarray(jnp.asarray(out, jnp.float32))
    ref = np.asarray(jnp.asarray(ref, jnp.float32))
    if not np.isfinite(out).all():
        return dict(rel_l2=float("nan"), max_rel=float("nan"), finite=False)
    return dict(
        rel_l2=float(np.linalg.norm(out - ref) / max(np.linalg.norm(ref), 1e-30)),
        max_rel=float(np.max(np.abs(out - ref)) / max(np.max(np.abs(ref)), 1e-30)),
        finite=True,
    )


def kernel_calls(tuning: dict, interpret: bool):
    def make(k):
        def run(q, kcs, vcs, lengths, kn, vn, mask):
            return [
                tree_attention(q, kcs[i], vcs[i], lengths - i, kn, vn, mask, interpret=interpret, **tuning)
                for i in range(k)
            ]

        return run

    return make


def reference_calls(k):
    def run(q, kcs, vcs, lengths, kn, vn, mask):
        return [tree_attention_reference(q, kcs[i], vcs[i], lengths - i, kn, vn, mask) for i in range(k)]

    return run


def bundled_decode_calls(interpret: bool, k_splits: int):
    """JAX's T = 1 decode kernel: (q [B*Hkv, G, D], k/v [B*Hkv, S, D]); no transposes needed."""
    from jax.experimental.pallas.ops.gpu import decode_attention

    def one(q, kc, vc, lengths):
        b, _, hq, d = q.shape
        hkv, s = kc.shape[1], kc.shape[2]
        out = decode_attention.mqa(
            q.reshape(b * hkv, hq // hkv, d),
            kc.reshape(b * hkv, s, d),
            vc.reshape(b * hkv, s, d),
            kv_seq_len=jnp.repeat(lengths, hkv),
            k_splits=k_splits,
            interpret=interpret,
        )
        return out.reshape(b, 1, hq, d)

    def make(k):
        def run(q, kcs, vcs, lengths, kn, vn, mask):
            del kn, vn, mask
            return [one(q, kcs[i], vcs[i], lengths - i) for i in range(k)]

        return run

    return make, one


def explicit_tuning(q_shape, cache_shape, tuning: dict) -> dict:
    """The resolved tuning as `tree_attention` keywords (the rule knobs waves / mb resolved away)."""
    tun = resolve_tree_tuning(q_shape, cache_shape, **tuning)
    return {key: tun[key] for key in ("tile_q", "tile_k", "splits", "num_warps", "num_stages", "merge")}


TUNING_KEYS = dict(
    q="tile_q", k="tile_k", s="splits", w="num_warps", st="num_stages", merge="merge", waves="waves",
    mb="min_tiles_per_split",
)  # fmt: skip


def parse_tunings(text: str) -> list[dict]:
    """Specs to tunings: 'k=64,s=16;merge=xla;default' -> [{tile_k: 64, splits: 16}, {merge: xla}, {}]."""
    out = []
    for spec in text.split(";"):
        spec = spec.strip()
        tun = {}
        for item in spec.split(",") if spec and spec != "default" else []:
            key, value = item.split("=")
            name = TUNING_KEYS.get(key.strip(), key.strip())
            if name not in TUNING_KEYS.values():
                raise ValueError(f"unknown tuning key {key!r} (keys: {', '.join(TUNING_KEYS)})")
            tun[name] = value.strip() if name == "merge" else int(value)
        out.append(tun)
    return out


def bench_shape(
    args,
    *,
    b,
    s,
    t,
    hkv,
    g,
    d,
    ceiling,
    interpret,
    k,
    deadline,
    ref_max_bytes,
    decode_splits,
    tuning=None,
    with_reference=True,
    profile=False,
) -> dict:
    """One configuration: correctness, then timings. Never raises."""
    row = dict(B=b, S=s, T=t, Hkv=hkv, G=g, D=d)
    tuning = dict(tuning or {})
    try:
        row["tuning"] = resolve_tree_tuning((b, t, hkv * g, d), (b, hkv, s, d), **tuning)
        tuning = explicit_tuning((b, t, hkv * g, d), (b, hkv, s, d), tuning)
    except Exception as e:  # noqa: BLE001
        row["error"] = short_error(e)
        return row
    q, kc, vc, lengths, kn, vn, mask = args
    visible = int(np.asarray(lengths).sum())  # lengths - i differ by at most k tokens: ignored
    kv_bytes = visible * hkv * d * 2 * kc.dtype.itemsize
    row["kv_bytes"] = kv_bytes
    scores_bytes = b * hkv * g * t * s * 4
    do_ref = scores_bytes <= ref_max_bytes and with_reference

    if deadline.left() < 0:
        row["skipped"] = "deadline"
        return row
    out = ref = None
    try:
        r, out = time_per_call(kernel_calls(tuning, interpret), args, k=k, profile=profile)
        row["kernel"] = r
        row["kernel_frac_ceiling"] = kv_bytes / r["s"] / ceiling
    except Exception as e:  # noqa: BLE001
        row["kernel_error"] = short_error(e)

    if do_ref and deadline.left() > 0:
        try:
            kr = k if scores_bytes * 4 * k <= ref_max_bytes else 1
            r, ref = time_per_call(reference_calls, args, k=kr)
            row["reference"] = r
            row["reference_frac_ceiling"] = kv_bytes / r["s"] / ceiling
        except Exception as e:  # noqa: BLE001
            row["reference_error"] = short_error(e)
    else:
        row["reference_skipped"] = (
            "not asked" if not with_reference else "scores too large" if not do_ref else "deadline"
        )

    # Correctness on the device: the kernel against the reference (first sequence if huge).
    if out is not None:
        try:
            if ref is None:
                ref = jax.jit(tree_attention_reference)(*(a[:1] for a in args))
            row["check"] = rel_errors(out[: ref.shape[0]], ref)
        except Exception as e:  # noqa: BLE001
            row["check_error"] = short_error(e)
    del out, ref

    if t == 1 and deadline.left() > 0:
        try:
            make, one = bundled_decode_calls(interpret, decode_splits)
            r, out = time_per_call(make, args, k=k, profile=profile)
            row["bundled_decode"] = r
            row["bundled_frac_ceiling"] = kv_bytes / r["s"] / ceiling
            # The bundled kernel has no in-flight token: compare with cache-only attention.
            no_new = jnp.zeros_like(mask)
            ref = jax.jit(tree_attention_reference)(q, kc, vc, lengths, kn, vn, no_new)
            row["bundled_check"] = rel_errors(out, ref)
            del out, ref
        except Exception as e:  # noqa: BLE001
            row["bundled_decode_error"] = short_error(e)
    if "kernel" in row and "reference" in row:
        row["speedup_vs_reference"] = row["reference"]["s"] / row["kernel"]["s"]
    if "kernel" in row and "bundled_decode" in row:
        row["speedup_vs_bundled"] = row["bundled_decode"]["s"] / row["kernel"]["s"]
    return row


def make_cache(key, b, hkv, s, d, dtype):
    k1, k2 = jax.random.split(key)
    kc = jax.random.normal(k1, (b, hkv, s, d), jnp.float32).astype(dtype)
    vc = jax.random.normal(k2, (b, hkv, s, d), jnp.float32).astype(dtype)
    return kc, vc


def make_tree_inputs(key, rng, b, t, hkv, g, d, dtype):
    k1, k2, k3 = jax.random.split(key, 3)
    q = jax.random.normal(k1, (b, t, hkv * g, d), jnp.float32).astype(dtype)
    kn = jax.random.normal(k2, (b, t, hkv, d), jnp.float32).astype(dtype)
    vn = jax.random.normal(k3, (b, t, hkv, d), jnp.float32).astype(dtype)
    mask = jnp.asarray(random_tree_mask(rng, b, t))
    return q, kn, vn, mask


def fmt_us(r):
    return f"{r['s'] * 1e6:9.1f}" if r else "        -"


def fmt_frac(x):
    return f"{x * 100:5.1f}%" if x is not None else "    -"


def device_of(results: dict) -> str:
    """The device kind of a results JSON: its run header's, or (files before the header) its own field."""
    return results["meta"]["device_kind"] if "meta" in results else results["device"]


# results written before the kernels' tiles were named tiles (results/h200/bench_attention*.json, decode/)
OLD_TUNING_KEYS = {"block_q": "tile_q", "block_k": "tile_k", "min_blocks_per_split": "min_tiles_per_split"}


def row_tuning(row: dict) -> dict:
    """A row's tuning with the old key names (block_q, block_k) read as today's (tile_q, tile_k)."""
    return {OLD_TUNING_KEYS.get(k, k): v for k, v in (row.get("tuning") or {}).items()}  # None: skipped


def print_table(results):
    print(f"\nread ceiling: {results['ceiling']['bytes_per_s'] / 1e9:.0f} GB/s  device: {device_of(results)}")
    print(
        f"{'B':>3} {'S':>6} {'T':>4} | {'kernel us':>9} {'%ceil':>6} | {'ref us':>9} {'%ceil':>6} | "
        f"{'bundled':>9} {'%ceil':>6} | {'x ref':>6} {'x bund':>6} | {'rel err':>8} | tuning / errors"
    )
    for row in results["rows"]:
        check = row.get("check", {})
        err = f"{check.get('rel_l2', float('nan')):8.1e}" if check else "       -"
        tun = row_tuning(row)
        note = (
            f"q{tun.get('tile_q')} k{tun.get('tile_k')} s{tun.get('splits')} "
            f"w{tun.get('num_warps')} st{tun.get('num_stages')} {tun.get('merge', '')}"
        )
        errors = [f"{key}: {row[key][:80]}" for key in row if key.endswith("error") or key == "skipped"]
        if errors:
            note += "  " + " | ".join(errors)
        sp_ref = row.get("speedup_vs_reference")
        sp_bund = row.get("speedup_vs_bundled")
        print(
            f"{row['B']:>3} {row['S']:>6} {row['T']:>4} | {fmt_us(row.get('kernel'))} "
            f"{fmt_frac(row.get('kernel_frac_ceiling'))} | {fmt_us(row.get('reference'))} "
            f"{fmt_frac(row.get('reference_frac_ceiling'))} | {fmt_us(row.get('bundled_decode'))} "
            f"{fmt_frac(row.get('bundled_frac_ceiling'))} | "
            f"{(f'{sp_ref:6.1f}' if sp_ref else '     -')} {(f'{sp_bund:6.2f}' if sp_bund else '     -')} | "
            f"{err} | {note}"
        )
    if results["tuning_sweep"]:
        print("\ntuning sweep (kernel only):")
        print(
            f"{'B':>3} {'S':>6} {'T':>4} | {'q':>4} {'k':>4} {'spl':>4} {'w':>2} {'st':>2} {'merge':>6} | "
            f"{'us':>9} {'%ceil':>6}"
        )
        best = {}
        for row in results["tuning_sweep"]:
            tun = row_tuning(row)
            r = row.get("kernel")
            key = (row["B"], row["S"], row["T"])
            if r and (key not in best or r["s"] < best[key]["kernel"]["s"]):
                best[key] = row
            print(
                f"{row['B']:>3} {row['S']:>6} {row['T']:>4} | {tun.get('tile_q', '-'):>4} "
                f"{tun.get('tile_k', '-'):>4} {tun.get('splits', '-'):>4} {tun.get('num_warps', '-'):>2} "
                f"{tun.get('num_stages', '-'):>2} {tun.get('merge', '-'):>6} | {fmt_us(r)} "
                f"{fmt_frac(row.get('kernel_frac_ceiling'))}"
                + "".join(f"  {k}: {row[k][:80]}" for k in row if k.endswith("error") or k == "skipped")
            )
        for key, row in best.items():
            print(f"best for B={key[0]} S={key[1]} T={key[2]}: {row['tuning']} {fmt_us(row['kernel'])} us")


def spec_name(spec: dict) -> str:
    """A tuning spec back in --tunings form ("default" when empty; old key names read as today's)."""
    short = {v: k for k, v in TUNING_KEYS.items()}
    return ",".join(f"{short[OLD_TUNING_KEYS.get(k, k)]}={v}" for k, v in spec.items()) or "default"


def print_decode_table(results):
    """T = 1: the default kernel and every swept spec against the bundled kernel, per (B, S)."""
    ceiling = results["ceiling"]["bytes_per_s"]
    swept = {}
    for row in results["tuning_sweep"]:
        if row["T"] == 1 and row.get("kernel"):
            swept.setdefault((row["B"], row["S"]), {})[spec_name(row.get("spec", {}))] = row
    specs = [spec_name(sp) for sp in results.get("tunings", [])]
    print("\nT = 1, us per call and ours / bundled (floor = K/V bytes / read ceiling;")
    print("device = summed kernel time per call from the profile, with launches per call):")
    head = f"{'B':>3} {'S':>6} | {'floor':>6} | {'bundled':>8} | {'default':>15}"
    print(head + "".join(f" | {sp[:15]:>15}" for sp in specs) + " | device: default / bundled")
    for row in results["rows"]:
        if row["T"] != 1:
            continue
        kern, bund = row.get("kernel"), row.get("bundled_decode")

        def cell(r, bund=bund):
            if not r:
                return f"{'-':>15}"
            ratio = f"{r['s'] / bund['s']:.2f}x" if bund else "-"
            return f"{r['s'] * 1e6:8.1f} {ratio:>6}"

        def prof(r):
            p = (r or {}).get("profile")
            return f"{p['device_us']:.1f} us ({p['launches']:.1f})" if p else "-"

        floor = row.get("kv_bytes", 0) / ceiling * 1e6
        here = swept.get((row["B"], row["S"]), {})
        line = f"{row['B']:>3} {row['S']:>6} | {floor:6.1f} | {fmt_us(bund)[1:]} | {cell(kern)}"
        line += "".join(f" | {cell(here.get(sp, {}).get('kernel'))}" for sp in specs)
        print(line + f" | {prof(kern)} / {prof(bund)}")
        tun = row_tuning(row)
        keys = ("tile_k", "splits", "num_warps", "num_stages", "merge")
        print(f"{'':>12}default = {spec_name({k: tun[k] for k in keys if k in tun})}")
        for name, r in (("default", kern), ("bundled", bund)):
            p = (r or {}).get("profile")
            if p and p["kernels"]:
                top = ", ".join(
                    f"{k[:40]} {v['us']:.1f} us x{v['per_call']:.1f}" for k, v in p["kernels"].items()
                )
                print(f"{'':>12}{name} kernels: {top}")


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The sub-command's flags (besides --deadline-s)."""
    p.add_argument("--out", help="JSON output path (required unless --print)")
    p.add_argument("--quick", action="store_true", help="tiny sizes (CPU smoke test)")
    p.add_argument("--no-sweep", action="store_true", help="skip the tuning sweep")
    p.add_argument("--batch-sizes", help="comma-separated batch sizes (replaces the built-in grid's)")
    report.add_deprecated(p, "--batches", "--batch-sizes")
    p.add_argument("--contexts", help="comma-separated cache lengths S")
    p.add_argument("--nodes", help="comma-separated query counts T")
    p.add_argument("--tunings", help="';'-separated tuning specs swept on every grid shape")
    p.add_argument("--no-reference", action="store_true", help="skip timing the jnp reference")
    p.add_argument("--profile", action="store_true", help="device time by kernel (jax.profiler)")
    p.add_argument("--target-s", type=float, default=TARGET_S, help="timed seconds per config")
    p.add_argument("--print", dest="print_json", help="only print the tables of a results JSON")


def main(argv: list[str] | None = None) -> int:
    """`ddtree-bench attention`; the exit status."""
    p = report.parser("attention", __doc__)
    add_arguments(p)
    report.add_deadline(p)
    return report.run_subcommand("attention", p, argv, run)


def run(opts: argparse.Namespace, command: list[str], deadline: report.Deadline) -> int:
    """Every row of the grid, then the tuning sweep, while `deadline` allows; the JSON after each row."""
    if opts.print_json:
        with open(opts.print_json) as f:
            results = json.load(f)
        print_table(results)
        print_decode_table(results)
        return 0
    if opts.out is None:
        raise DDTreeError("--out is required (or --print FILE)")
    globals()["TARGET_S"] = opts.target_s

    device = jax.devices()[0]
    on_gpu = device.platform == "gpu"
    interpret = not on_gpu
    dtype = jnp.bfloat16
    if opts.quick:
        batches, lengths_s, nodes = [1, 2], [128, 256], [1, 16]
        hkv, g, d = 2, 2, 64
        ceiling_bytes = 64 << 20
        k = 2
        decode_splits = 4
        sweep_shapes = [(1, 256, 16)]
        sweep = [dict(tile_k=bk, num_warps=w, num_stages=st) for bk in (16, 32) for w in (4,) for st in (2,)]
    else:
        batches, lengths_s, nodes = [1, 4, 16], [1024, 8192, 32768], [1, 16, 64, 128]
        hkv, g, d = 8, 4, 128
        ceiling_bytes = 4 << 30
        k = 8
        decode_splits = 16
        sweep_shapes = [(1, 32768, 64), (8, 32768, 64)]
        sweep = [
            dict(tile_k=bk, num_warps=w, num_stages=st)
            for bk in (32, 64, 128)
            for w in (4, 8)
            for st in (2, 3, 4)
        ]
        sweep += [dict(tile_q=bq, num_warps=w) for bq in (32, 128) for w in (4, 8)]
    ref_max_bytes = 16 << 30

    def ints(text):
        return [int(x) for x in text.split(",")]

    batches = ints(opts.batch_sizes) if opts.batch_sizes else batches
    lengths_s = ints(opts.contexts) if opts.contexts else lengths_s
    nodes = ints(opts.nodes) if opts.nodes else nodes
    tunings = parse_tunings(opts.tunings) if opts.tunings else None

    meta = report.run_header(command) | dict(
        platform=device.platform,
        interpret=interpret,
        quick=opts.quick,
        dtype=str(jnp.dtype(dtype)),
        timing="median over reps of one jitted program of k independent calls / k",
    )
    results = dict(
        meta=meta,
        rows=[],
        tuning_sweep=[],
        tunings=tunings or [],
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
    common = dict(hkv=hkv, g=g, d=d, ceiling=ceiling, interpret=interpret, deadline=deadline)
    common.update(ref_max_bytes=ref_max_bytes, decode_splits=decode_splits)
    extras = dict(with_reference=not opts.no_reference, profile=opts.profile)

    def run_grid(shapes, tunings, sink, with_extras):
        by_cache = {}
        for b, s, t in shapes:
            by_cache.setdefault((b, s), []).append(t)
        for (b, s), ts in by_cache.items():
            if not deadline.allows(f"B={b} S={s} T={','.join(map(str, ts))} {len(tunings)} tuning(s)"):
                continue
            try:
                kc, vc = make_cache(jax.random.fold_in(key, b * 100003 + s), b, hkv, s, d, dtype)
                lengths = jnp.full((b,), s, jnp.int32)
            except Exception as e:  # noqa: BLE001
                for t in ts:
                    sink.append(dict(B=b, S=s, T=t, error="cache: " + short_error(e)))
                continue
            for t in ts:
                try:
                    q, kn, vn, mask = make_tree_inputs(
                        jax.random.fold_in(key, t), rng, b, t, hkv, g, d, dtype
                    )
                except Exception as e:  # noqa: BLE001
                    sink.append(dict(B=b, S=s, T=t, error="inputs: " + short_error(e)))
                    continue
                args = (q, kc, vc, lengths, kn, vn, mask)
                for tun in tunings:
                    if with_extras:
                        row = bench_shape(args, b=b, s=s, t=t, k=k, **common, **extras)
                    else:
                        row = bench_kernel_only(args, b=b, s=s, t=t, k=k, tuning=tun, **common)
                    sink.append(row)
                    kern = row.get("kernel")
                    print(
                        f"[{elapsed():5.0f}s] B={b} S={s} T={t} {tun or ''}: kernel "
                        f"{kern['s'] * 1e6 if kern else float('nan'):.1f} us "
                        f"ref {row['reference']['s'] * 1e6 if 'reference' in row else float('nan'):.1f} us"
                        + "".join(f" {k2}={row[k2][:120]}" for k2 in row if k2.endswith("error")),
                        flush=True,
                    )
                    save()
                del q, kn, vn, mask, args
            del kc, vc
            gc.collect()

    grid = [(b, s, t) for b in batches for s in lengths_s for t in nodes]
    run_grid(grid, [None], results["rows"], with_extras=True)
    if tunings is not None:
        run_grid(grid, tunings, results["tuning_sweep"], with_extras=False)
    elif not opts.no_sweep:
        run_grid(sweep_shapes, sweep, results["tuning_sweep"], with_extras=False)
        if not opts.quick:  # splits matter most when B x Hkv alone cannot fill the GPU
            splits_sweep = [dict(splits=sp) for sp in (1, 4, 8, 16, 32, 64)]
            run_grid([(1, 32768, 64), (1, 8192, 1)], splits_sweep, results["tuning_sweep"], False)
    save()
    print_table(results)
    if 1 in nodes:
        print_decode_table(results)
    print(f"\nwrote {opts.out} ({elapsed():.0f}s)")
    return 0


def bench_kernel_only(args, *, b, s, t, hkv, g, d, ceiling, interpret, k, deadline, tuning, **_):
    row = dict(B=b, S=s, T=t, Hkv=hkv, G=g, D=d)
    if deadline.left() < 0:
        row["tuning"] = tuning
        row["skipped"] = "deadline"
        return row
    try:
        row["spec"] = dict(tuning)
        row["tuning"] = resolve_tree_tuning((b, t, hkv * g, d), (b, hkv, s, d), **tuning)
        tuning = explicit_tuning((b, t, hkv * g, d), (b, hkv, s, d), tuning)
        lengths = args[3]
        kv_bytes = int(np.asarray(lengths).sum()) * hkv * d * 2 * args[1].dtype.itemsize
        r, out = time_per_call(kernel_calls(tuning, interpret), args, k=k)
        row["kernel"] = r
        row["kernel_frac_ceiling"] = kv_bytes / r["s"] / ceiling
        ref = jax.jit(tree_attention_reference)(*(a[:1] for a in args))
        row["check"] = rel_errors(out[:1], ref)
        del out, ref
    except Exception as e:  # noqa: BLE001
        row["kernel_error"] = short_error(e)
        if os.environ.get("BENCH_TRACEBACK"):
            traceback.print_exc()
    return row
