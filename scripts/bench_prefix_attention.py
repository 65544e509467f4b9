"""Time tree attention at T nodes as one Triton kernel against the prefix through cuDNN merged by
log-sum-exp (`tree_attention_merged`), with the FLOP and byte floors of each shape (issue 22).

python scripts/bench_prefix_attention.py --shapes 16:8192,16:32768,1:1024 --out prefix.json   # GPU

Each timing: one jitted program of `--calls` dependent calls (the next call's queries depend on the
last output, so XLA cannot merge them), median of `--reps` runs, per call. At B = 1, S = 1k the K/V
(4 MB) stay in L2: optimistic for every variant alike.
"""

import argparse
import json
import platform
import sys
import time
import traceback
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a source tree

from ddtree_jax.bench import median_seconds, read_ceiling_gbs  # noqa: E402
from ddtree_jax.kernels.tree_attention import (  # noqa: E402
    _pack_queries,
    _unpack_rows,
    prefix_attention_cudnn,
    tree_attention,
    tree_attention_merged,
    tree_attention_reference,
)

PEAK_TFLOPS = 790.0  # bf16 dense, measured (DESIGN.md)


def inputs(b: int, s: int, t: int, hkv: int, g: int, d: int):
    """Random bf16 tree-attention inputs; every row's cache holds s - t entries."""
    keys = jax.random.split(jax.random.key(0), 5)
    bf = jnp.bfloat16
    q = jax.random.normal(keys[0], (b, t, hkv * g, d), bf)
    kc = jax.random.normal(keys[1], (b, hkv, s, d), bf)
    vc = jax.random.normal(keys[2], (b, hkv, s, d), bf)
    kn = jax.random.normal(keys[3], (b, t, hkv, d), bf)
    vn = jax.random.normal(keys[4], (b, t, hkv, d), bf)
    mask = jnp.broadcast_to(jnp.tril(jnp.ones((t, t), bool)), (b, t, t))  # a chain: depth = index
    return q, kc, vc, jnp.full((b,), s - t, jnp.int32), kn, vn, mask


def per_call_us(fn, args, calls: int, reps: int) -> float:
    """Median microseconds per call of fn(*args) over `calls` dependent calls in one program."""

    @jax.jit
    def many(q, *rest):
        def body(_, q):
            return q + (fn(q, *rest) * 0).astype(q.dtype)

        return jax.lax.fori_loop(0, calls, body, q)

    return 1e6 * median_seconds(lambda: many(*args), reps) / calls


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="16:8192,16:32768,1:1024", help="batch:cache pairs")
    ap.add_argument("--nodes", type=int, default=64, help="T")
    ap.add_argument("--calls", type=int, default=10)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    hkv, g, d, t = 8, 4, 128, args.nodes
    ceiling = read_ceiling_gbs(4 << 30)

    def prefix_only(q, kc, vc, lengths, *_):  # the cuDNN part alone (no tree part, no merge)
        return _unpack_rows(prefix_attention_cudnn(_pack_queries(q, hkv), kc, vc, lengths)[0], t)

    variants = {
        "triton": tree_attention,
        "merged_cudnn": tree_attention_merged,
        "prefix_cudnn_only": prefix_only,
    }
    rows = []
    for shape in args.shapes.split(","):
        b, s = map(int, shape.split(":"))
        x = inputs(b, s, t, hkv, g, d)
        visible = s - t
        kv_bytes = 2 * b * hkv * visible * d * 2
        flops = 4 * b * hkv * (t * g) * (visible + t) * d
        row = {"batch": b, "cache": s, "nodes": t, "visible": visible}
        row["byte_floor_us"] = round(1e6 * kv_bytes / (ceiling * 1e9), 1)
        row["flop_floor_us"] = round(1e6 * flops / (PEAK_TFLOPS * 1e12), 1)
        floor = max(row["byte_floor_us"], row["flop_floor_us"])
        want = jax.jit(tree_attention)(*x).astype(jnp.float32)
        if b * s <= 1 << 16:
            ref = jax.jit(tree_attention_reference)(*x).astype(jnp.float32)
            row["triton_err_vs_reference"] = float(jnp.max(jnp.abs(want - ref)))
        for name, fn in variants.items():
            start = time.perf_counter()
            try:
                if name == "merged_cudnn":
                    got = jax.jit(fn)(*x).astype(jnp.float32)
                    row["merged_err_vs_triton"] = float(jnp.max(jnp.abs(got - want)))
                us = per_call_us(fn, x, args.calls, args.reps)
                row[f"{name}_us"] = round(us, 1)
                row[f"{name}_over_floor"] = round(us / floor, 2)
            except Exception as e:  # noqa: BLE001 (recorded, the run goes on)
                row[f"{name}_error"] = f"{type(e).__name__}: {e}"[:600]
                traceback.print_exc()
            row[f"{name}_wall_s"] = round(time.perf_counter() - start, 1)
        print(json.dumps(row), flush=True)
        rows.append(row)
        del x
    machine = {"backend": jax.default_backend(), "device": str(jax.devices()[0]), "host": platform.node()}
    meta = {"args": vars(args) | {"out": str(args.out)}, "machine": machine, "read_ceiling_gbs": ceiling}
    args.out.write_text(json.dumps(meta | {"rows": rows}, indent=1))
    print(np.round(ceiling, 1), "GB/s read ceiling")


if __name__ == "__main__":
    main()
