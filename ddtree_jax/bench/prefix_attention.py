"""Time tree attention at T nodes as one Triton kernel against the prefix through cuDNN merged by
log-sum-exp (`tree_attention_merged`, an experiment not wired into the engine: it lives here, with
its benchmark), with the FLOP and byte floors of each shape (issue 22).

ddtree-bench prefix-attention --cases 16:8192,16:32768,1:1024 --out prefix.json   # GPU

Each timing: one jitted program of `--calls` dependent calls (the next call's queries depend on the
last output, so XLA cannot merge them), median of `--reps` runs, per call. At B = 1, S = 1k the K/V
(4 MB) stay in L2: optimistic for every variant alike. Before timing, the merged form with the jnp
prefix standing in for cuDNN is checked against `tree_attention_reference` on a small random tree
(the check runs on any backend: `--cases 1:64 --nodes 8` on a CPU).
"""

from __future__ import annotations

import argparse
import functools
import json
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

from ddtree_jax.bench import report
from ddtree_jax.bench.timing import median_seconds, read_ceiling_gbs
from ddtree_jax.kernels.flash import merge_by_lse
from ddtree_jax.kernels.tree_attention import tree_attention, tree_attention_reference

PEAK_TFLOPS = 790.0  # bf16 dense, measured (docs/design.md)


# -- The prefix and the tree apart, merged by log-sum-exp (issue 22) ----------------------------------
#
# Every tree node attends the whole committed prefix [0, len) unmasked; only the T x T in-flight part
# carries the ancestor mask. So the prefix part is plain (padded-length) attention, which a library
# kernel can run, and the small masked part can be merged in afterwards from each part's normalised
# output and log-sum-exp. Queries are packed as rows r = node * G + head per K/V head: [B, Hkv, T*G, D].


def _pack_queries(q: jax.Array, kv_heads: int) -> jax.Array:
    """q [B, T, Hq, D] -> [B, Hkv, T * G, D], row = node * G + head."""
    b, t, hq, d = q.shape
    g = hq // kv_heads
    return q.reshape(b, t, kv_heads, g, d).transpose(0, 2, 1, 3, 4).reshape(b, kv_heads, t * g, d)


def _unpack_rows(x: jax.Array, num_nodes: int) -> jax.Array:
    """[B, Hkv, T * G, D] -> [B, T, Hq, D] (the inverse of `_pack_queries`)."""
    b, hkv, r, d = x.shape
    g = r // num_nodes
    return x.reshape(b, hkv, num_nodes, g, d).transpose(0, 2, 1, 3, 4).reshape(b, num_nodes, hkv * g, d)


def prefix_attention_reference(
    qp: jax.Array, k_cache: jax.Array, v_cache: jax.Array, lengths: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """Packed rows qp [B, Hkv, R, D] over cache [0, len): output [B, Hkv, R, D] f32, lse [B, Hkv, R] f32.

    lse is the natural log-sum-exp of the scaled scores (-inf on an empty prefix, output 0 there).
    """
    d, s = qp.shape[-1], k_cache.shape[2]
    scores = jnp.einsum("bhrd,bhsd->bhrs", qp.astype(jnp.float32) * d**-0.5, k_cache.astype(jnp.float32))
    valid = (jnp.arange(s)[None, :] < lengths[:, None])[:, None, None, :]
    scores = jnp.where(valid, scores, -jnp.inf)
    lse = jax.nn.logsumexp(scores, axis=-1)  # -inf where nothing is valid
    p = jnp.where(valid, jnp.exp(scores - jnp.where(jnp.isfinite(lse), lse, 0.0)[..., None]), 0.0)
    return jnp.einsum("bhrs,bhsd->bhrd", p, v_cache.astype(jnp.float32)), lse


def prefix_attention_cudnn(
    qp: jax.Array, k_cache: jax.Array, v_cache: jax.Array, lengths: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """`prefix_attention_reference` through cuDNN's fused flash attention (GPU only; wgmma on Hopper).

    jax 0.11.2's public `jax.nn.dot_product_attention` does not return the log-sum-exp; its backend
    `jax._src.cudnn.fused_attention_stablehlo.dot_product_attention` does (`return_residual=True`),
    takes the cache's own [B, N, S, H] layout (`qkv_layout="BNTH"`), bfloat16, and per-row key
    lengths (`kv_seqlen` with a padding mask). A private module: pinned to this jax version.
    """
    from jax._src.cudnn import fused_attention_stablehlo as cudnn_attention

    b, _, r, d = qp.shape
    out, lse = cudnn_attention.dot_product_attention(
        qp,
        k_cache,
        v_cache,
        q_seqlen=jnp.full((b,), r, jnp.int32),
        kv_seqlen=lengths.astype(jnp.int32),
        scale=d**-0.5,
        mask_type=cudnn_attention.MaskType.PADDING,
        qkv_layout="BNTH",
        return_residual=True,
    )
    empty = (lengths <= 0)[:, None, None]
    lse = jnp.where(empty, -jnp.inf, lse.reshape(qp.shape[:3]).astype(jnp.float32))
    return jnp.where(empty[..., None], 0.0, out.astype(jnp.float32)), lse


def _tree_part(qp: jax.Array, k_new: jax.Array, v_new: jax.Array, mask: jax.Array, group: int):
    """The in-flight part: rows qp [B, Hkv, T*G, D] over k_new/v_new [B, T, Hkv, D] under mask
    [B, T, T] -> output [B, Hkv, T*G, D] f32, lse [B, Hkv, T*G] f32 (-inf on a row that sees none)."""
    d = qp.shape[-1]
    scores = jnp.einsum("bhrd,bjhd->bhrj", qp.astype(jnp.float32) * d**-0.5, k_new.astype(jnp.float32))
    seen = jnp.repeat(mask.astype(bool), group, axis=1)[:, None]  # [B, 1, T*G, T]
    scores = jnp.where(seen, scores, -jnp.inf)
    lse = jax.nn.logsumexp(scores, axis=-1)
    p = jnp.where(seen, jnp.exp(scores - jnp.where(jnp.isfinite(lse), lse, 0.0)[..., None]), 0.0)
    return jnp.einsum("bhrj,bjhd->bhrd", p, v_new.astype(jnp.float32)), lse


PREFIX_KERNELS = {"reference": prefix_attention_reference, "cudnn": prefix_attention_cudnn}


@functools.partial(jax.jit, static_argnames=("prefix",))
def tree_attention_merged(
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    lengths: jax.Array,
    k_new: jax.Array,
    v_new: jax.Array,
    mask: jax.Array,
    *,
    prefix: str = "cudnn",
) -> jax.Array:
    """Tree attention (contract of `tree_attention_reference`, no window) as an unmasked prefix
    part (`PREFIX_KERNELS[prefix]`) and the masked in-flight part, merged by log-sum-exp."""
    hkv = k_cache.shape[1]
    qp = _pack_queries(q, hkv)
    out = merge_by_lse(
        [
            PREFIX_KERNELS[prefix](qp, k_cache, v_cache, lengths),
            _tree_part(qp, k_new, v_new, mask, q.shape[2] // hkv),
        ]
    )
    return _unpack_rows(out, q.shape[1]).astype(q.dtype)


def check_merged() -> float:
    """Max error of the merged form (jnp prefix) against `tree_attention_reference` in float32, on a
    small random tree with an empty, a partial and a full cache row; raises above 1e-5."""
    keys = jax.random.split(jax.random.key(1), 5)
    b, t, hkv, g, d, s = 3, 9, 2, 4, 32, 40
    q = jax.random.normal(keys[0], (b, t, hkv * g, d))
    kc, vc = (jax.random.normal(k, (b, hkv, s, d)) for k in keys[1:3])
    kn, vn = (jax.random.normal(k, (b, t, hkv, d)) for k in keys[3:5])
    parent = np.random.default_rng(1).integers(0, np.maximum(np.arange(t), 1))
    mask = np.eye(t, dtype=bool)
    for i in range(1, t):  # ancestor-or-self of a random tree (parent[i] < i)
        mask[i] |= mask[parent[i]]
    args = (
        q,
        kc,
        vc,
        jnp.array([s, 0, 17], jnp.int32),
        kn,
        vn,
        jnp.broadcast_to(jnp.asarray(mask), (b, t, t)),
    )
    err = float(
        jnp.max(jnp.abs(tree_attention_merged(*args, prefix="reference") - tree_attention_reference(*args)))
    )
    if err > 1e-5:
        raise SystemExit(f"tree_attention_merged differs from tree_attention_reference by {err}")
    return err


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


def main(argv: list[str] | None = None) -> int:
    """`ddtree-bench prefix-attention`; the exit status."""
    ap = report.parser("prefix-attention", __doc__)
    ap.add_argument("--cases", default="16:8192,16:32768,1:1024", help="batch_size:context pairs")
    report.add_deprecated(ap, "--shapes", "--cases")
    ap.add_argument("--nodes", type=int, default=64, help="T")
    ap.add_argument("--calls", type=int, default=10, help="dependent calls in one timed program")
    ap.add_argument("--reps", type=int, default=5, help="timed runs of the program (the median reported)")
    report.add_deadline(ap)
    ap.add_argument("--out", required=True, help="JSON output path")
    return report.run_subcommand("prefix-attention", ap, argv, run)


def run(args: argparse.Namespace, command: list[str], deadline: report.Deadline) -> int:
    """The merged form checked, then every shape while `deadline` allows; the JSON after each."""
    hkv, g, d, t = 8, 4, 128, args.nodes
    check_err = check_merged() if deadline.allows("merged check") else None
    # the Triton kernel interpreted off the GPU (a toy run on a CPU checks the script, not the speed)
    triton = functools.partial(tree_attention, interpret=jax.default_backend() != "gpu")
    ceiling = read_ceiling_gbs(4 << 30) if deadline.allows("read ceiling") else None  # None: no row runs

    def prefix_only(q, kc, vc, lengths, *_):  # the cuDNN part alone (no tree part, no merge)
        return _unpack_rows(prefix_attention_cudnn(_pack_queries(q, hkv), kc, vc, lengths)[0], t)

    variants = {
        "triton": triton,
        "merged_cudnn": tree_attention_merged,
        "prefix_cudnn_only": prefix_only,
    }
    meta = report.run_header(command) | {"read_ceiling_gbs": ceiling, "merged_reference_check_err": check_err}
    rows = []
    for shape in args.cases.split(","):
        if not deadline.allows(shape):
            continue
        b, s = map(int, shape.split(":"))
        x = inputs(b, s, t, hkv, g, d)
        visible = s - t
        kv_bytes = 2 * b * hkv * visible * d * 2
        flops = 4 * b * hkv * (t * g) * (visible + t) * d
        row = {"batch_size": b, "context": s, "nodes": t, "visible": visible}
        row["byte_floor_us"] = round(1e6 * kv_bytes / (ceiling * 1e9), 1)
        row["flop_floor_us"] = round(1e6 * flops / (PEAK_TFLOPS * 1e12), 1)
        floor = max(row["byte_floor_us"], row["flop_floor_us"])
        want = jax.jit(triton)(*x).astype(jnp.float32)
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
        report.write_json(args.out, {"meta": meta, "rows": rows, "skipped": deadline.skipped})
        del x
    report.write_json(args.out, {"meta": meta, "rows": rows, "skipped": deadline.skipped})
    print(f"{ceiling} GB/s read ceiling")
    return 0
