"""Tree attention and MLA on Mosaic GPU against the Triton kernels, cuDNN-merged and the bundled decode
kernel, with floors (issue 31 item 4), in one H200 call.

    ddtree-bench mosaic-attention --out $OUT/mosaic_attention.json --deadline-s 300   # H200
    ddtree-bench mosaic-attention --quick --out /tmp/mosaic_attention.json            # CPU

Phases, in this order, each row and each kernel guarded (an error is recorded as a string and the run
goes on), the JSON rewritten (atomically) after every row, nothing new started past --deadline-s:
1. Ceilings: the read ceiling (a 4 GiB bf16 `jnp.sum`) and a bf16 matmul ceiling (8192^3 `jnp.dot`).
2. Correctness on the device: at lengths that differ per sequence (partial blocks, a short and an
   empty row), window, trees; every Mosaic form (P from registers, the "smem" form the CPU
   interpreter checks, one split, no ping-pong) and the Triton kernel against the jnp reference
   (max abs error, relative L2, max error relative to max |ref|), and Mosaic against Triton.
3. The GQA table (Qwen3-8B: Hq 32, Hkv 8, D 128, every cache entry visible, random ancestor masks):
   T = 1 / 16 / 64, B = 1 / 16, S = 1k / 8k / 32k; Triton, Mosaic, cuDNN-merged (`tree_attention_merged`
   of `ddtree-bench prefix-attention`), and at T = 1 JAX's bundled decode kernel (no in-flight token).
   Each against max(byte floor, FLOP floor): bytes (visible K/V + queries + output + in-flight K/V)
   over the measured read ceiling, FLOPs (4 x B x Hq x T x (S + T) x D) over 790 TFLOP/s (the figure
   the notes' ratios use) and over the measured matmul ceiling. Most informative rows first (the goal
   rows: T = 64 and 16 at B = 16, 8k and 32k; MLA T = 64; T = 1 against the bundled kernel; 1k).
4. MLA (Kimi-K2: latent 512 + rope 64): T = 1 / 64 at 32k, 64 and 8 heads, B = 1; Triton, Mosaic.
5. While time is left: a small sweep of the Mosaic kernels' tunings on the goal rows.

Timing: a jitted program makes k calls, each on its own copy of the cache (k cut to fit 12 GB), median
of runs / k (as `ddtree-bench attention`). A watchdog ends the process (exit 124) if one compile or
call hangs for --hang-s seconds, writing the JSON with the hung step named first; `--skip` names
kernels or forms to leave out on a rerun (e.g. `--skip mosaic`).
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import os
import statistics
import threading
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np

from ddtree_jax.bench import report
from ddtree_jax.bench.attention import random_tree_mask, read_ceiling, short_error
from ddtree_jax.bench.prefix_attention import tree_attention_merged
from ddtree_jax.errors import DDTreeError
from ddtree_jax.kernels import tree_attention as triton_gqa
from ddtree_jax.kernels.mla_attention import mla_attention, mla_attention_reference
from ddtree_jax.kernels.mla_attention_mgpu import mla_attention_mgpu
from ddtree_jax.kernels.tree_attention_mgpu import tree_attention_mgpu

warnings.filterwarnings("ignore", category=DeprecationWarning)

START = time.perf_counter()
NOMINAL_FLOPS = 790e12  # bf16 matmul on the H200 (docs/design.md); the notes' "x floor" figures use it
COPY_BUDGET = 12 << 30
MLA_SCALE = 192**-0.5


def elapsed() -> float:
    return time.perf_counter() - START


class Watchdog:
    """Ends the process if one guarded step runs past `limit_s`, after saving the results."""

    def __init__(self, limit_s: float, on_hang):
        self.limit_s, self.on_hang = limit_s, on_hang
        self.label, self.since = None, 0.0
        threading.Thread(target=self._watch, daemon=True).start()

    def _watch(self):
        while True:
            time.sleep(1.0)
            if self.label is not None and time.perf_counter() - self.since > self.limit_s:
                self.on_hang(self.label)
                os._exit(124)

    def guard(self, label: str):
        watchdog = self

        class _Guard:
            def __enter__(self):
                watchdog.label, watchdog.since = label, time.perf_counter()

            def __exit__(self, *exc):
                watchdog.label = None

        return _Guard()


def errors(out, ref) -> dict:
    """Max abs error, relative L2 and max error relative to max |ref| (float32 on the host)."""
    out = np.asarray(jnp.asarray(out, jnp.float32))
    ref = np.asarray(jnp.asarray(ref, jnp.float32))
    if not np.isfinite(out).all():
        return dict(finite=False, max_abs=float("nan"))
    diff = np.abs(out - ref)
    return dict(
        finite=True,
        max_abs=float(diff.max()),
        rel_l2=float(np.linalg.norm(out - ref) / max(np.linalg.norm(ref), 1e-30)),
        max_rel=float(diff.max() / max(np.abs(ref).max(), 1e-30)),
    )


def matmul_ceiling(n: int) -> dict:
    """FLOP/s of a bf16 n^3 `jnp.dot` (float32 accumulation), median of 10 runs."""
    a = jax.random.normal(jax.random.key(1), (n, n), jnp.bfloat16)
    fn = jax.jit(lambda a: jnp.dot(a, a, preferred_element_type=jnp.float32).astype(jnp.bfloat16))
    jax.block_until_ready(fn(a))
    runs = []
    for _ in range(10):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(a))
        runs.append(time.perf_counter() - t0)
    s = statistics.median(runs)
    return dict(n=n, s=s, flops_per_s=2 * n**3 / s)


# ---- Inputs ----------------------------------------------------------------------------------------


def gqa_inputs(seed, b, t, hkv, g, d, s, lengths, copies=1, dtype=jnp.bfloat16):
    """(q, [k_cache] * copies, [v_cache] * copies, lengths, k_new, v_new, mask): random, tree masks."""
    keys = jax.random.split(jax.random.key(seed), 5)
    q = jax.random.normal(keys[0], (b, t, hkv * g, d), jnp.float32).astype(dtype)
    kc = jax.random.normal(keys[1], (b, hkv, s, d), jnp.float32).astype(dtype)
    vc = jax.random.normal(keys[2], (b, hkv, s, d), jnp.float32).astype(dtype)
    kn = jax.random.normal(keys[3], (b, t, hkv, d), jnp.float32).astype(dtype)
    vn = jax.random.normal(keys[4], (b, t, hkv, d), jnp.float32).astype(dtype)
    mask = jnp.asarray(random_tree_mask(np.random.default_rng(seed), b, t))
    kcs = [kc] + [kc + 0 for _ in range(copies - 1)]
    vcs = [vc] + [vc + 0 for _ in range(copies - 1)]
    return q, kcs, vcs, jnp.asarray(lengths, jnp.int32), kn, vn, mask


def mla_inputs(seed, b, t, h, s, lengths, copies=1, c=512, r=64, dtype=jnp.bfloat16):
    """(q_latent, q_rope, [latent] * copies, [rope] * copies, lengths, latent_new, rope_new, mask)."""
    keys = jax.random.split(jax.random.key(seed), 6)
    shapes = [(b, t, h, c), (b, t, h, r), (b, s, c), (b, s, r), (b, t, c), (b, t, r)]
    ql, qr, lc, rc, ln, rn = (
        jax.random.normal(kk, shape, jnp.float32).astype(dtype)
        for kk, shape in zip(keys, shapes, strict=True)
    )
    mask = jnp.asarray(random_tree_mask(np.random.default_rng(seed), b, t))
    lcs = [lc] + [lc + 0 for _ in range(copies - 1)]
    rcs = [rc] + [rc + 0 for _ in range(copies - 1)]
    return ql, qr, lcs, rcs, jnp.asarray(lengths, jnp.int32), ln, rn, mask


def gqa_args(inputs, i=0):
    q, kcs, vcs, lengths, kn, vn, mask = inputs
    return q, kcs[i], vcs[i], lengths, kn, vn, mask


def mla_args(inputs, i=0):
    ql, qr, lcs, rcs, lengths, ln, rn, mask = inputs
    return ql, qr, lcs[i], rcs[i], lengths, ln, rn, mask


def num_copies(cache_bytes: int, want: int) -> int:
    return max(1, min(want, COPY_BUDGET // max(cache_bytes, 1)))


# ---- Kernels: name -> function of the contract's positional arguments --------------------------------


def gqa_kernels(interpret: bool, skip: set[str], t: int) -> dict:
    """The GQA kernels of a table row (same signature as tree_attention_reference)."""
    out = {
        "triton": lambda *a: triton_gqa.tree_attention(*a, interpret=interpret),
        "mosaic": lambda *a: tree_attention_mgpu(*a, interpret=interpret),
    }
    if not interpret and t > 1:
        out["cudnn-merged"] = lambda *a: tree_attention_merged(*a, prefix="cudnn")
    if t == 1 and not interpret:
        out["bundled-decode"] = bundled_decode
    return {k: v for k, v in out.items() if k not in skip and k.split("-")[0] not in skip}


def bundled_decode(q, kc, vc, lengths, kn, vn, mask):
    """JAX's bundled T = 1 decode kernel over the cache only (no in-flight token), 16 splits."""
    from jax.experimental.pallas.ops.gpu import decode_attention

    del kn, vn, mask
    b, _, hq, d = q.shape
    hkv, s = kc.shape[1], kc.shape[2]
    out = decode_attention.mqa(
        q.reshape(b * hkv, hq // hkv, d),
        kc.reshape(b * hkv, s, d),
        vc.reshape(b * hkv, s, d),
        kv_seq_len=jnp.repeat(lengths, hkv),
        k_splits=16,
    )
    return out.reshape(b, 1, hq, d)


def mla_kernels(interpret: bool, skip: set[str]) -> dict:
    out = {
        "triton": lambda *a: mla_attention(*a, softmax_scale=MLA_SCALE, interpret=interpret),
        "mosaic": lambda *a: mla_attention_mgpu(*a, softmax_scale=MLA_SCALE, interpret=interpret),
    }
    return {k: v for k, v in out.items() if k not in skip}


# ---- Timing ----------------------------------------------------------------------------------------


def time_calls(
    fn, inputs, pick, copies: int, target_s: float, min_reps: int = 3, max_reps: int = 30
) -> tuple[dict, jax.Array]:
    """Median seconds per call of one jitted program making `copies` calls of fn, call i on copy i."""
    program = jax.jit(lambda inp: [fn(*pick(inp, i)) for i in range(copies)])
    t0 = time.perf_counter()
    first = jax.block_until_ready(program(inputs))[0]
    compile_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    jax.block_until_ready(program(inputs))
    reps = int(min(max_reps, max(min_reps, target_s / max(time.perf_counter() - t0, 1e-6))))
    runs = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(program(inputs))
        runs.append(time.perf_counter() - t0)
    return dict(s=statistics.median(runs) / copies, min_s=min(runs) / copies, reps=reps, calls=copies,
                compile_s=compile_s), first  # fmt: skip


def gqa_floors(b, t, hkv, g, d, s, itemsize, ceilings) -> dict:
    """Bytes and FLOPs of one call with every cache entry visible; floors in seconds."""
    kv = 2 * b * hkv * s * d * itemsize
    io = b * t * hkv * g * d * itemsize * 2 + 2 * b * t * hkv * d * itemsize
    flops = 4 * b * hkv * g * t * (s + t) * d
    return floor_dict(kv + io, flops, ceilings)


def mla_floors(b, t, h, s, c, r, itemsize, ceilings) -> dict:
    """As scripts/bench_mla_attention.py: latent cache + queries + output; 2 x rows x keys x (C+R+C)."""
    nbytes = b * s * (c + r) * itemsize + b * t * h * (c + r + c) * itemsize
    flops = 2 * b * t * h * (s + t) * (c + r + c)
    return floor_dict(nbytes, flops, ceilings)


def floor_dict(nbytes, flops, ceilings) -> dict:
    read = ceilings["read"]["bytes_per_s"]
    matmul = ceilings.get("matmul", {}).get("flops_per_s", NOMINAL_FLOPS)
    return dict(
        bytes=nbytes,
        flops=flops,
        byte_floor_s=nbytes / read,
        flop_floor_s=flops / NOMINAL_FLOPS,
        flop_floor_measured_s=flops / matmul,
        floor_s=max(nbytes / read, flops / NOMINAL_FLOPS),
    )


# ---- The run ---------------------------------------------------------------------------------------


class Run:
    """The results JSON, the deadline, the watchdog."""

    def __init__(self, opts, command: list[str], deadline: report.Deadline):
        self.opts, self.deadline = opts, deadline
        meta = report.run_header(command) | dict(
            platform=jax.devices()[0].platform,
            quick=opts.quick,
            deadline_s=opts.deadline_s,
            skip=sorted(opts.skip),
            timing="median over runs of one jitted program of k calls on k cache copies / k",
        )
        self.results = dict(
            meta=meta,
            ceilings={},
            checks=[],
            rows=[],
            sweep=[],
            skipped=deadline.skipped,
        )
        self.watchdog = Watchdog(opts.hang_s, self.on_hang)

    def left(self) -> float:
        return self.deadline.left()

    def save(self):
        self.results["meta"]["wall_s"] = elapsed()
        report.write_json(self.opts.out, self.results)

    def on_hang(self, label: str):
        self.results["hang"] = f"{label}: no progress for {self.opts.hang_s:.0f} s (process ended)"
        print(f"HANG in {label}; rerun with --skip naming it", flush=True)
        self.save()

    def safely(self, label: str, fn, *args, **kwargs):
        """fn(*args) for its effects; an exception is recorded under `errors` and the run goes on."""
        _, err = self.guarded(label, fn, *args, **kwargs)
        if err is not None:
            self.results.setdefault("errors", []).append(f"{label}: {err}")
            print(f"[{elapsed():5.0f}s] {label}: ERROR {err[:200]}", flush=True)
            self.save()

    def guarded(self, label: str, fn, *args, **kwargs):
        """fn(*args) under the watchdog; returns (value, None) or (None, error string)."""
        try:
            with self.watchdog.guard(label):
                return fn(*args, **kwargs), None
        except Exception as e:  # noqa: BLE001
            return None, short_error(e)


def check_gqa(run: Run, interpret: bool, shape: dict, forms: dict):
    """One correctness case: every form and the Triton kernel against the reference."""
    b, t, hkv, g, d, s = (shape[k] for k in ("B", "T", "Hkv", "G", "D", "S"))
    entry = dict(kind="gqa", **shape, variants={})
    inputs = gqa_inputs(11, b, t, hkv, g, d, s, shape["lengths"])
    args = gqa_args(inputs)
    window = shape.get("window")
    ref, err = run.guarded("check reference", lambda: jax.jit(functools.partial(
        triton_gqa.tree_attention_reference, window=window))(*args))  # fmt: skip
    if err is not None:
        entry["error"] = "reference: " + err
        run.results["checks"].append(entry)
        return
    outs = {}
    for name, kw in forms.items():
        if run.left() < 5 or name in run.opts.skip or name.split("-")[0] in run.opts.skip:
            entry["variants"][name] = dict(skipped="deadline or --skip")
            continue
        fn = (
            (lambda *a: triton_gqa.tree_attention(*a, window=window, interpret=interpret))
            if name == "triton"
            else (lambda *a, kw=kw: tree_attention_mgpu(*a, window=window, interpret=interpret, **kw))
        )
        out, err = run.guarded(
            f"check gqa {shape} {name}", lambda fn=fn: jax.block_until_ready(jax.jit(fn)(*args))
        )
        entry["variants"][name] = errors(out, ref) if err is None else dict(error=err)
        if err is None:
            outs[name] = out
    if "triton" in outs:
        entry["mosaic_vs_triton"] = {k: errors(v, outs["triton"]) for k, v in outs.items() if k != "triton"}
    run.results["checks"].append(entry)
    run.save()
    print(f"[{elapsed():5.0f}s] check {entry['kind']} {shape}: " + summary(entry), flush=True)


def check_mla(run: Run, interpret: bool, shape: dict, forms: dict):
    b, t, h, s = (shape[k] for k in ("B", "T", "H", "S"))
    c, r = shape.get("C", 512), shape.get("R", 64)
    entry = dict(kind="mla", **shape, variants={})
    inputs = mla_inputs(12, b, t, h, s, shape["lengths"], c=c, r=r)
    args = mla_args(inputs)
    window = shape.get("window")
    ref, err = run.guarded("check reference", lambda: jax.jit(functools.partial(
        mla_attention_reference, softmax_scale=MLA_SCALE, window=window))(*args))  # fmt: skip
    if err is not None:
        entry["error"] = "reference: " + err
        run.results["checks"].append(entry)
        return
    outs = {}
    for name, kw in forms.items():
        if run.left() < 5 or name in run.opts.skip or name.split("-")[0] in run.opts.skip:
            entry["variants"][name] = dict(skipped="deadline or --skip")
            continue
        if name == "triton":

            def fn(*a):
                return mla_attention(*a, softmax_scale=MLA_SCALE, window=window, interpret=interpret)
        else:

            def fn(*a, kw=kw):
                return mla_attention_mgpu(
                    *a, softmax_scale=MLA_SCALE, window=window, interpret=interpret, **kw
                )

        out, err = run.guarded(
            f"check mla {shape} {name}", lambda fn=fn: jax.block_until_ready(jax.jit(fn)(*args))
        )
        entry["variants"][name] = errors(out, ref) if err is None else dict(error=err)
        if err is None:
            outs[name] = out
    if "triton" in outs:
        entry["mosaic_vs_triton"] = {k: errors(v, outs["triton"]) for k, v in outs.items() if k != "triton"}
    run.results["checks"].append(entry)
    run.save()
    print(f"[{elapsed():5.0f}s] check {entry['kind']} {shape}: " + summary(entry), flush=True)


def summary(entry: dict) -> str:
    parts = []
    for name, v in entry["variants"].items():
        if "error" in v:
            parts.append(f"{name} ERROR {v['error'][:100]}")
        elif "skipped" in v:
            parts.append(f"{name} skipped")
        else:
            parts.append(f"{name} max_abs {v['max_abs']:.2e} rel {v.get('rel_l2', float('nan')):.1e}")
    return "; ".join(parts)


def time_row(run: Run, row: dict, kernels: dict, inputs, pick, reference_name: str = "triton", sink=None):
    """Time every kernel of a row on the same inputs; each against the row's floor and the first
    output of `reference_name` (max abs difference)."""
    sink = run.results["rows"] if sink is None else sink
    row["kernels"] = {}
    first = {}
    for name, fn in kernels.items():
        if run.left() < run.opts.min_left_s:
            row["kernels"][name] = dict(skipped="deadline")
            continue
        label = f"{row['kind']} B={row['B']} T={row['T']} S={row['S']} {name}"
        timing, err = run.guarded(
            label,
            time_calls,
            fn,
            inputs,
            pick,
            row["calls"],
            run.opts.target_s,
            min_reps=1 if run.opts.quick else 3,
        )
        if err is not None:
            row["kernels"][name] = dict(error=err)
            continue
        timing, out = timing
        timing["x_floor"] = timing["s"] / row["floor_s"]
        timing["x_flop_floor_measured"] = timing["s"] / row["flop_floor_measured_s"]
        row["kernels"][name] = timing
        first[name] = out
    if reference_name in first:
        for name, out in first.items():
            if name != reference_name and name != "bundled-decode":
                row["kernels"][name]["max_abs_vs_" + reference_name] = errors(out, first[reference_name])[
                    "max_abs"
                ]
    # Time ratios the goals are stated in: each kernel against Triton and, at T = 1, the bundled kernel.
    times = {k: v["s"] for k, v in row["kernels"].items() if "s" in v}
    for base in ("triton", "bundled-decode"):
        if base in times:
            row[f"x_{base}"] = {k: t / times[base] for k, t in times.items() if k != base}
    sink.append(row)
    run.save()
    cells = []
    for name, v in row["kernels"].items():
        cells.append(
            f"{name} {v['s'] * 1e6:.1f} us ({v['x_floor']:.2f}x)"
            if "s" in v
            else f"{name} {next(iter(v.values()))[:80]}"
        )
    print(f"[{elapsed():5.0f}s] {row['kind']} B={row['B']} T={row['T']} S={row['S']} "
          f"{'H=' + str(row['H']) + ' ' if 'H' in row else ''}floor {row['floor_s'] * 1e6:.1f} us: "
          + "; ".join(cells), flush=True)  # fmt: skip


def gqa_row(run: Run, interpret: bool, b, t, s, dims, copies_want: int, kernels=None, sink=None, label=None):
    hkv, g, d = dims
    kv_bytes = 2 * b * hkv * s * d * 2
    copies = num_copies(kv_bytes, copies_want)
    row = dict(kind="gqa", B=b, T=t, S=s, Hkv=hkv, G=g, D=d, calls=copies)
    if label:
        row["variant"] = label
    row.update(gqa_floors(b, t, hkv, g, d, s, 2, run.results["ceilings"]))
    if run.left() < run.opts.min_left_s:
        run.deadline.skipped.append(f"gqa B={b} T={t} S={s} {label or ''}".strip())
        return
    inputs, err = run.guarded("inputs", gqa_inputs, 7, b, t, hkv, g, d, s, [s] * b, copies)
    if err is not None:
        row["error"] = "inputs: " + err
        run.results["rows"].append(row)
        return
    kernels = kernels if kernels is not None else gqa_kernels(interpret, run.opts.skip, t)
    time_row(run, row, kernels, inputs, gqa_args, sink=sink)
    del inputs
    gc.collect()


def mla_row(
    run: Run, interpret: bool, b, t, h, s, copies_want: int, kernels=None, sink=None, label=None, c=512
):
    r = 64
    copies = num_copies(b * s * (c + r) * 2, copies_want)
    row = dict(kind="mla", B=b, T=t, S=s, H=h, C=c, R=r, calls=copies)
    if label:
        row["variant"] = label
    row.update(mla_floors(b, t, h, s, c, r, 2, run.results["ceilings"]))
    if run.left() < run.opts.min_left_s:
        run.deadline.skipped.append(f"mla B={b} T={t} H={h} S={s} {label or ''}".strip())
        return
    inputs, err = run.guarded("inputs", mla_inputs, 8, b, t, h, s, [s] * b, copies, c)
    if err is not None:
        row["error"] = "inputs: " + err
        run.results["rows"].append(row)
        return
    kernels = kernels if kernels is not None else mla_kernels(interpret, run.opts.skip)
    time_row(run, row, kernels, inputs, mla_args, sink=sink)
    del inputs
    gc.collect()


def plan(quick: bool) -> dict:
    """Shapes of every phase, most informative first."""
    if quick:  # CPU smoke: tiny shapes through both interpreters
        return dict(
            dims=(1, 4, 64),
            gqa_checks=[(dict(B=2, T=16, Hkv=1, G=4, D=64, S=320, lengths=[300, 0]), ALL_FORMS)],
            mla_checks=[(dict(B=2, T=1, H=8, S=128, C=128, lengths=[100, 3]), ALL_FORMS)],
            gqa_rows=[(1, 1, 256), "mla-goal", (1, 16, 256)],
            mla_rows=[(1, 1, 8, 128)],
            gqa_sweep=[],
            mla_sweep=[],
            copies=1,
            mla_c=128,
        )
    s1, s8, s32 = 1024, 8192, 32768
    return dict(
        dims=(8, 4, 128),
        # (shape, forms): every form where it differs (the T = 64 check has two compute warpgroups).
        gqa_checks=[
            (dict(B=3, T=64, Hkv=8, G=4, D=128, S=4096, lengths=[4000, 1234, 64]), ALL_FORMS),
            (
                dict(B=3, T=1, Hkv=8, G=4, D=128, S=1000, lengths=[1000, 517, 1]),
                ("mosaic-smem", "mosaic", "triton"),
            ),
            (
                # S a multiple of 8 (Mosaic GPU's TMA reads 8-row tiles; 1500 went to an AssertionError
                # in its layout inference) but not of 128: the last block is read shifted back.
                dict(B=2, T=16, Hkv=8, G=4, D=128, S=1528, lengths=[1528, 1100], window=300),
                ("mosaic", "mosaic-1split", "triton"),
            ),
        ],
        mla_checks=[
            (dict(B=3, T=1, H=64, S=4000, lengths=[4000, 1500, 0]), ("mosaic-smem", "mosaic", "triton")),
            (
                dict(B=2, T=64, H=8, S=2048, lengths=[2048, 333], window=1500),
                ("mosaic", "mosaic-1split", "triton"),
            ),
        ],
        # (B, T, S): the goal rows first.
        gqa_rows=[
            (16, 64, s32),
            (16, 64, s8),
            (16, 16, s32),
            (16, 16, s8),
            "mla-goal",
            (1, 1, s8),
            (1, 1, s32),
            (1, 1, s1),
            (1, 16, s1),
            (1, 64, s1),
            (16, 1, s1),
            (16, 16, s1),
            (16, 64, s1),
            "mla-rest",
            (1, 64, s32),
            (1, 16, s32),
            (16, 1, s32),
            (1, 64, s8),
            (1, 16, s8),
            (16, 1, s8),
        ],  # fmt: skip
        mla_rows=[(1, 64, 64, s32), (1, 1, 64, s32), (1, 1, 8, s32), (1, 64, 8, s32)],
        gqa_sweep=[
            (
                (16, 64, s32),
                [
                    dict(tile_k=64, stages=3),
                    dict(tile_k=64, stages=4),
                    dict(pingpong=False),
                    dict(splits=2),
                    dict(mma_form="smem"),
                ],
            ),
            ((1, 1, s32), [dict(splits=8), dict(splits=32), dict(splits=64), dict(tile_k=64, stages=4)]),
            # T = 1, B = 1 trailed the bundled decode kernel most at 8k (55.5 vs 38.8 us); the default is
            # 16 splits (128 programs of 4 blocks): fewer, more, and 64-row blocks (more programs).
            ((1, 1, s8), [dict(splits=4), dict(splits=8), dict(splits=32), dict(tile_k=64, splits=32)]),
            ((1, 64, s1), [dict(splits=1), dict(splits=2), dict(splits=4)]),
        ],  # fmt: skip
        mla_sweep=[
            ((1, 64, 64, s32), [dict(splits=1), dict(splits=4)]),
            ((1, 1, 64, s32), [dict(splits=64)]),
        ],
        copies=8,
        mla_c=512,
    )


# The Mosaic forms of the checks: the interpreter-checked "smem" form first (if the register form
# hangs, the watchdog names it), the default, one split (no partials), no ping-pong (GQA only).
FORMS = {
    "mosaic-smem": dict(mma_form="smem"),
    "mosaic": {},
    "mosaic-1split": dict(splits=1),
    "mosaic-nopingpong": dict(pingpong=False),
    "triton": None,
}
ALL_FORMS = tuple(FORMS)


def print_table(results: dict) -> None:
    """Checks (max abs error against the reference), then us per call and x floor per row."""
    ceilings = ", ".join(
        f"{k} {v.get('bytes_per_s', v.get('flops_per_s', 0)) / 1e12:.2f} T/s"
        for k, v in results["ceilings"].items()
    )
    meta = results.get("meta", results)  # files before the header key kept its fields at the top level
    print(f"\n{meta.get('device_kind')} jax {meta.get('jax')}; ceilings: {ceilings}")
    for entry in results["checks"]:
        shape = {k: v for k, v in entry.items() if k not in ("variants", "mosaic_vs_triton", "kind")}
        print(f"check {entry['kind']} {shape}: {entry.get('error') or summary(entry)}")
    for title, rows in (("rows", results["rows"]), ("sweep", results["sweep"])):
        if rows:
            print(f"\n{title}: kind B T S (H) | floor us (bytes / flops) | kernel us (x floor) ...")
        for row in rows:
            head = f"{row['kind']} B={row['B']} T={row['T']} S={row['S']}" + (
                f" H={row['H']}" if "H" in row else ""
            )
            us = {k: row[k] * 1e6 for k in ("floor_s", "byte_floor_s", "flop_floor_s")}
            floors = f"{us['floor_s']:.1f} ({us['byte_floor_s']:.1f} / {us['flop_floor_s']:.1f})"
            cells = [
                f"{k} {v['s'] * 1e6:.1f} ({v['x_floor']:.2f}x)"
                if "s" in v
                else f"{k} {next(iter(v.values()))[:60]}"
                for k, v in row.get("kernels", {}).items()
            ]
            for base in ("triton", "bundled-decode"):
                if f"x_{base}" in row:
                    cells.append(f"/{base}: " + " ".join(f"{k} {x:.2f}" for k, x in row[f"x_{base}"].items()))
            print(f"{head} | {floors} | " + " | ".join(cells or [row.get("skipped") or row.get("error", "")]))
    if "hang" in results:
        print("HANG:", results["hang"])
    for err in results.get("errors", []):
        print("ERROR:", err[:300])


def main(argv: list[str] | None = None) -> int:
    """`ddtree-bench mosaic-attention`; the exit status."""
    p = report.parser("mosaic-attention", __doc__)
    p.add_argument("--print", dest="print_json", help="only print the tables of a results JSON")
    p.add_argument("--out", help="JSON path (rewritten after every row; required unless --print)")
    report.add_deadline(p)
    p.add_argument("--quick", action="store_true", help="tiny shapes through the interpreters (CPU)")
    p.add_argument("--skip", default="", help="comma list of kernels/forms to leave out (e.g. mosaic)")
    p.add_argument("--target-s", type=float, default=0.15, help="timed seconds per kernel and row")
    p.add_argument("--min-left-s", type=float, default=12.0, help="skip a kernel with less time left")
    p.add_argument("--hang-s", type=float, default=90.0, help="watchdog: end the run after a step this long")
    p.add_argument("--phases", default="checks,gqa,mla,sweep", help="comma list of phases to run")
    return report.run_subcommand("mosaic-attention", p, argv, run_all)


def run_all(opts: argparse.Namespace, command: list[str], deadline: report.Deadline) -> int:
    """Ceilings, checks, the GQA and MLA rows and the sweep while `deadline` allows."""
    if opts.print_json:
        with open(opts.print_json) as f:
            print_table(json.load(f))
        return 0
    if not opts.out:
        raise DDTreeError("--out is required (or --print FILE)")
    opts.skip = {x for x in opts.skip.split(",") if x}
    phases = set(opts.phases.split(","))
    run = Run(opts, command, deadline)
    interpret = jax.devices()[0].platform != "gpu"
    shapes = plan(opts.quick)
    ceilings = run.results["ceilings"]
    if not deadline.allows("ceilings"):  # nothing else runs either
        run.save()
        return 0
    ceilings["read"], err = run.guarded("read ceiling", read_ceiling, (64 << 20) if opts.quick else (4 << 30))
    if err is not None:
        ceilings["read"] = dict(error=err, bytes_per_s=3.6e12)
    ceilings["matmul"], err = run.guarded("matmul ceiling", matmul_ceiling, 256 if opts.quick else 8192)
    if err is not None:
        ceilings["matmul"] = dict(error=err, flops_per_s=NOMINAL_FLOPS)
    print(f"[{elapsed():5.0f}s] ceilings: read {ceilings['read']['bytes_per_s'] / 1e9:.0f} GB/s, matmul "
          f"{ceilings['matmul']['flops_per_s'] / 1e12:.0f} TFLOP/s", flush=True)  # fmt: skip
    run.save()

    if "checks" in phases:
        for shape, names in shapes["gqa_checks"]:
            two_warpgroups = shape["T"] * shape["G"] > 64  # else ping-pong is off anyway
            forms = {k: FORMS[k] for k in names if two_warpgroups or k != "mosaic-nopingpong"}
            if deadline.allows(f"check gqa {shape}"):
                run.safely(f"check gqa {shape}", check_gqa, run, interpret, shape, forms)
        for shape, names in shapes["mla_checks"]:
            forms = {k: FORMS[k] for k in names if k != "mosaic-nopingpong"}  # MLA has no ping-pong
            if deadline.allows(f"check mla {shape}"):
                run.safely(f"check mla {shape}", check_mla, run, interpret, shape, forms)

    def mla_rows(which):
        rows = shapes["mla_rows"][:1] if which == "mla-goal" else shapes["mla_rows"][1:]
        if "mla" not in phases:
            return
        for b, t, h, s in rows:
            run.safely(
                f"mla {b, t, h, s}", mla_row, run, interpret, b, t, h, s, shapes["copies"], c=shapes["mla_c"]
            )

    for item in shapes["gqa_rows"]:
        if isinstance(item, str):
            mla_rows(item)
        elif "gqa" in phases:
            run.safely(f"gqa {item}", gqa_row, run, interpret, *item, shapes["dims"], shapes["copies"])

    if "sweep" in phases:
        sweep = run.results["sweep"]
        for (b, t, s), tunings in shapes["gqa_sweep"]:
            kernels = {
                "mosaic " + ",".join(f"{k}={v}" for k, v in tun.items()): (
                    lambda *a, tun=tun: tree_attention_mgpu(*a, interpret=interpret, **tun)
                )
                for tun in tunings
            }
            run.safely(
                f"sweep gqa {b, t, s}", gqa_row, run, interpret, b, t, s, shapes["dims"], shapes["copies"],
                kernels=kernels, sink=sweep,
            )  # fmt: skip
        for (b, t, h, s), tunings in shapes["mla_sweep"]:
            kernels = {
                "mosaic " + ",".join(f"{k}={v}" for k, v in tun.items()): (
                    lambda *a, tun=tun: mla_attention_mgpu(
                        *a, softmax_scale=MLA_SCALE, interpret=interpret, **tun
                    )
                )
                for tun in tunings
            }
            mla_row(
                run, interpret, b, t, h, s, shapes["copies"], kernels=kernels, sink=sweep, c=shapes["mla_c"]
            )
    run.save()
    print_table(run.results)
    print(f"wrote {opts.out} ({elapsed():.0f} s)", flush=True)
    return 0
