"""Quantized matmuls on the GPU: INT4 (compressed-tensors words, and jnp.int4) and FP8 block-scaled
against bf16, through XLA (`ddtree_jax.quant.arrays`) and through the Pallas grouped kernel
(`ddtree_jax.kernels.quant_matmul` by `quant.arrays.pallas_ragged_matmul`, method "pallas"), for the
Kimi-K2 routed experts (384 x [7168 -> 2048], top-8) and a dense projection ([7168 -> 18432], Kimi-K2's
dense MLP), at 1, 16, 64 and 512 tokens.

    ddtree-bench quant --out bench_quant.json [--hlo-dir hlo/] [--quick] [--deadline-s 200]

Per case: the time of one call (`pipelined`: 20 calls queued, one sync, divided by 20; `synced`: the
median of 10 synced calls, dispatch included); the bytes it must read (experts: the distinct experts its
tokens chose, in the stored format, scales included; dense: the whole weight) over that time; that
rate against the read ceiling (a 4 GiB bf16 `jnp.sum` in the same run); and whether the optimized HLO
writes a float array at least one weight in size outside the dot (`materialised`: XLA did not fuse
the dequantisation into the matmul's operand).
"""

import argparse
import functools
import json
import re
import time
import traceback
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from ddtree_jax.bench import report
from ddtree_jax.bench.timing import median_seconds, read_ceiling_gbs
from ddtree_jax.quant import arrays

FORMATS = ("bf16", "int4", "int4-s4", "fp8")
ENTRY_LINE = re.compile(r"^\s*(?:ROOT\s+)?%\S+\s*=\s*(.*?)\s+([a-z][a-z0-9\-_.]*)\(")
FLOAT_SHAPE = re.compile(r"\b(bf16|f16|f32)\[([\d,]*)\]")


def make_weight(fmt: str, lead: tuple[int, ...], n_in: int, n_out: int, key: jax.Array) -> arrays.Weight:
    """A random weight [*lead, in, out] in `fmt`, made on the device."""
    k1, k2 = jax.random.split(key)
    if fmt == "bf16":
        return (0.02 * jax.random.normal(k1, (*lead, n_in, n_out), jnp.float32)).astype(jnp.bfloat16)
    if fmt.startswith("int4"):
        words = jax.random.bits(k1, (*lead, n_in // 8, n_out), jnp.uint32).view(jnp.int32)
        scale = (0.003 * (1 + jax.random.uniform(k2, (*lead, n_in // 32, n_out)))).astype(jnp.bfloat16)
        w = arrays.Int4Weight(words, scale, 32)
        return arrays.as_int4(w) if fmt == "int4-s4" else w
    fp8 = jax.random.normal(k1, (*lead, n_in, n_out), jnp.float32).astype(jnp.float8_e4m3fn)
    scale = 0.01 * (1 + jax.random.uniform(k2, (*lead, n_in // 128, n_out // 128)))
    return arrays.Fp8Weight(fp8, scale, (n_in, n_out), (128, 128))


def materialised(hlo: str, elements: int) -> int:
    """The largest float array (elements) the ENTRY computation writes outside fusions' insides, if at
    least `elements` (one weight); 0 otherwise."""
    entry = hlo[hlo.index("\nENTRY") :]
    largest = 0
    for line in entry.splitlines()[1:]:
        m = ENTRY_LINE.match(line)
        if not m or m.group(2) == "parameter":
            continue
        for _, dims in FLOAT_SHAPE.findall(m.group(1)):
            largest = max(largest, int(np.prod([int(d) for d in dims.split(",") if d] or [1])))
    return largest if largest >= elements else 0


def in_use() -> int:
    """Bytes in use on the first device (0 where the backend does not say)."""
    stats = jax.devices()[0].memory_stats() or {}
    return int(stats.get("bytes_in_use", 0))


def time_us(fn, args, reps: int = 20) -> tuple[float, float]:
    """(pipelined, synced median) microseconds per call."""
    jax.block_until_ready(fn(*args))
    start = time.perf_counter()
    outs = [fn(*args) for _ in range(reps)]
    jax.block_until_ready(outs)
    pipelined = (time.perf_counter() - start) / reps
    return 1e6 * pipelined, 1e6 * median_seconds(lambda: fn(*args), 10)


def expert_ids(tokens: int, experts: int, per_token: int, seed: int) -> np.ndarray:
    """[tokens * per_token] expert ids: `per_token` distinct experts per token, uniformly at random."""
    rng = np.random.default_rng(seed)
    ids = [rng.choice(experts, per_token, replace=False) for _ in range(tokens)]
    return np.concatenate(ids).astype(np.int32)


def run_case(row: dict, fn, args, per_expert_bytes: float, elements: int, hlo_dir) -> dict:
    """Time one case, add its figures to `row`."""
    compiled = jax.jit(fn).lower(*args).compile()
    hlo = compiled.as_text()
    if hlo_dir is not None and row["tokens"] == 16:
        name = f"{row['kind']}_{row['format']}_{row['method']}_t16.hlo.txt"
        (hlo_dir / name).write_text(hlo)
    pipelined, synced = time_us(compiled, args)
    floor = row.get("distinct_experts", 1) * per_expert_bytes
    row |= {
        "us_pipelined": round(pipelined, 1),
        "us_synced": round(synced, 1),
        "floor_bytes": int(floor),
        "eff_gbs": round(floor / pipelined / 1e3, 1),
        "materialised_elements": materialised(hlo, elements),
    }
    return row


def dense_pallas(x: jax.Array, w: arrays.Weight, interpret: bool = False) -> jax.Array:
    """x [T, in] @ W [in, out] through the grouped kernel with one expert."""
    sizes = jnp.array([x.shape[0]], jnp.int32)
    return arrays.pallas_ragged_matmul(x, arrays.with_expert_axis(w), sizes, interpret=interpret)


def cases(args, shapes, weights, per_expert):
    """(row, fn, call args, weight elements) in the order they run: token counts outer, formats inner."""
    hidden, width, experts, experts_per_token, dense_out = shapes
    for t in (int(s) for s in args.tokens.split(",")):
        x = jax.random.normal(jax.random.key(t), (t * experts_per_token, hidden), jnp.float32)
        x = x.astype(jnp.bfloat16)
        ids = expert_ids(t, experts, experts_per_token, seed=t)
        distinct = int(len(np.unique(ids)))
        for fmt in FORMATS:
            w_exp, w_dense = weights[fmt]
            methods = {"sorted": arrays.sorted_matmul}
            if fmt != "int4-s4":
                kernel = functools.partial(arrays.pallas_ragged_matmul, interpret=args.quick)
                methods["pallas"] = functools.partial(arrays.sorted_matmul, grouped=kernel)
            if t <= args.gather_max_tokens:
                methods["gather"] = arrays.gather_matmul
            if t == 1:
                methods["gather_reduce"] = arrays.reduce_matmul
            for method, fn in methods.items():
                row = {"kind": "experts", "format": fmt, "method": method, "tokens": t}
                row["rows"] = t * experts_per_token
                row |= {"distinct_experts": distinct, "per_expert_bytes": per_expert[fmt]}
                yield row, fn, (x, w_exp, jnp.asarray(ids)), hidden * width
            dense = {"matmul": arrays.matmul} | ({"reduce": arrays.reduce_matmul} if t == 1 else {})
            if fmt != "int4-s4":
                dense["pallas"] = functools.partial(dense_pallas, interpret=args.quick)
            for method, fn in dense.items():
                row = {"kind": "dense", "format": fmt, "method": method, "tokens": t, "rows": t}
                row["per_expert_bytes"] = arrays.stored_bytes(w_dense)
                yield row, fn, (x[:t], w_dense), hidden * dense_out


def main(argv: list[str] | None = None) -> int:
    """`ddtree-bench quant`; the exit status."""
    ap = report.parser("quant", __doc__)
    ap.add_argument("--out", required=True, help="JSON output path")
    ap.add_argument(
        "--hlo-dir", type=Path, default=None, help="write the optimized HLO of the 16-token cases"
    )
    ap.add_argument("--tokens", default="1,16,64,512", help="token counts of the cases")
    ap.add_argument(
        "--gather-max-tokens", type=int, default=64, help="the gather variant up to this many tokens"
    )
    report.add_deadline(ap)
    ap.add_argument("--quick", action="store_true", help="tiny shapes (a CPU smoke run)")
    report.add_deprecated(ap, "--small", "--quick", flag=True)
    return report.run_subcommand("quant", ap, argv, run)


def run(args: argparse.Namespace, command: list[str], deadline: report.Deadline) -> int:
    """Every case while `deadline` allows; the JSON after each."""
    begin = time.perf_counter()
    if args.hlo_dir is not None:
        args.hlo_dir = Path(args.hlo_dir)
    shapes = (256, 128, 16, 4, 384) if args.quick else (7168, 2048, 384, 8, 18432)
    hidden, width, experts, experts_per_token, dense_out = shapes
    if args.hlo_dir is not None:
        args.hlo_dir.mkdir(parents=True, exist_ok=True)
    if not deadline.allows("weights and read ceiling"):  # no case runs either
        meta = report.run_header(command)
        report.write_json(args.out, {"meta": meta, "rows": [], "skipped": deadline.skipped})
        return 0
    ceiling = read_ceiling_gbs((1 << 24) if args.quick else (4 << 30))
    weights, measured = {}, {}
    for fmt in FORMATS:
        before = in_use()
        weights[fmt] = (
            jax.block_until_ready(make_weight(fmt, (experts,), hidden, width, jax.random.key(1))),
            jax.block_until_ready(make_weight(fmt, (), hidden, dense_out, jax.random.key(2))),
        )
        measured[fmt] = in_use() - before
    per_expert = {fmt: arrays.stored_bytes(w[0]) / experts for fmt, w in weights.items()}
    meta = report.run_header(command) | {
        "read_ceiling_gbs": round(ceiling, 1),
        "shapes": {
            "hidden": hidden,
            "expert_width": width,
            "experts": experts,
            "experts_per_token": experts_per_token,
            "dense_out": dense_out,
        },
        "device_bytes_in_use_delta": measured,
        "device_bytes": {
            fmt: {"experts": arrays.stored_bytes(w[0]), "dense": arrays.stored_bytes(w[1])}
            for fmt, w in weights.items()
        },
    }
    rows = []
    for row, fn, call, elements in cases(args, shapes, weights, per_expert):
        if not deadline.allows({k: v for k, v in row.items() if k != "per_expert_bytes"}):
            continue
        try:
            run_case(row, fn, call, row.pop("per_expert_bytes"), elements, args.hlo_dir)
            row["frac_ceiling"] = round(row["eff_gbs"] / ceiling, 3)
        except Exception as e:  # noqa: BLE001 - one failing case must not lose the others
            row |= {"error": f"{type(e).__name__}: {str(e)[:400]}"}
            traceback.print_exc()
        rows.append(row)
        print(json.dumps(row), flush=True)
        report.write_json(args.out, {"meta": meta, "rows": rows, "skipped": deadline.skipped})
    meta["wall_s"] = round(time.perf_counter() - begin, 1)
    report.write_json(args.out, {"meta": meta, "rows": rows, "skipped": deadline.skipped})
    print(json.dumps(meta))
    return 0
