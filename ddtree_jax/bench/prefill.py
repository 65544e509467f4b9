"""`ddtree-bench prefill`: chunked prefill of one long prompt: time, peak device memory, the FLOP floor.

Random weights of a ddtree-bench shape (bf16), one row, the prompt run chunk by chunk through the cache
path (programs.start: each chunk attends to the cache written so far and to itself, causal), the
drafter's context K/V with it. `--runs LENGTH:CHUNK,...` in order; the device's peak memory is the
process's so far, so order the runs by growing footprint (a smaller run after a larger one shows the
larger one's peak). One row a run in --out's "rows", the JSON rewritten after each; none starts past
--deadline-s:

    ddtree-bench prefill --runs 1024:1024,32768:1024,32768:4096 --out $OUT/prefill.json
    ddtree-bench prefill --runs 1024:1024,32768:1024 --prefill-attention causal-cudnn --out ...
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from ddtree_jax import drafter, target
from ddtree_jax.bench import report
from ddtree_jax.bench.shapes import SHAPES, draft_shape
from ddtree_jax.engine import MAX_STOP_IDS, Plan
from ddtree_jax.errors import DDTreeError
from ddtree_jax.programs import Programs, Requests, Shape, prompt_slots
from ddtree_jax.weights import random_params

PEAK_TFLOPS = 790.0  # bf16 matmul on the H200 (docs/design.md)


def prefill_flops(cfg, length: int) -> float:
    """Matmul FLOPs of a causal prefill: weights (embedding and head excluded) and attention."""
    d = cfg.dims
    per_token = 2 * (
        d.hidden_size * (d.num_heads + 2 * d.num_kv_heads) * d.head_dim
        + d.num_heads * d.head_dim * d.hidden_size
        + 3 * d.hidden_size * d.intermediate_size
    )
    attention = 2 * 2 * d.num_heads * d.head_dim * length * (length + 1) / 2  # QK and PV, causal
    return cfg.num_layers * (per_token * length + attention)


def one_run(args, cfg, dcfg, params, dparams, length: int, chunk: int) -> dict:
    """Time the prefill of one random prompt of `length` tokens in chunks of `chunk`."""
    slots = prompt_slots(length)
    plan = Plan(
        cfg,
        dcfg if args.method != "ar" else None,
        args.method,
        64,
        budget=15,
        branching=15,
        attention=args.attention,
    )
    shape = Shape.of(plan, 1, slots)
    rng = np.random.default_rng(0)
    tokens = np.zeros((1, slots), np.int32)
    tokens[0, :length] = rng.integers(1, cfg.vocab_size - 1, length)
    one = jnp.asarray([length], jnp.int32)
    req = Requests(jnp.asarray(tokens), one, jnp.zeros((1,), jnp.int32), None, jnp.full((1,), 64, jnp.int32))
    stop = jnp.full((MAX_STOP_IDS,), -1, jnp.int32)

    impl = args.attention if args.prefill_attention == "same" else args.prefill_attention
    programs = Programs(params, dparams, plan, chunk, impl)

    def once():
        return jax.block_until_ready(programs.start(req, stop, shape))

    start = time.perf_counter()
    once()
    compile_s = time.perf_counter() - start
    times = []
    for _ in range(args.reps):
        start = time.perf_counter()
        state = once()
        times.append(time.perf_counter() - start)
    # a fingerprint of the prefill's numerics, to compare attention implementations: the last layer's
    # cached keys (they depend on every earlier layer's attention) and the first token
    keys = jax.tree.leaves(state.cache.layers[-1])[0][0, :, :length].astype(jnp.float32)
    fingerprint = float(jnp.mean(jnp.abs(keys)))
    stats = jax.devices()[0].memory_stats() or {}
    seconds = float(np.median(times))
    flops = prefill_flops(cfg, length)
    weights = sum(x.nbytes for x in jax.tree.leaves(params)) + sum(x.nbytes for x in jax.tree.leaves(dparams))
    row = {
        "shape": args.shape,
        "length": length,
        "prefill_chunk": chunk,
        "attention": args.attention,
        "prefill_attention": impl or args.attention,
        "first_token": int(state.bonus[0]),
        "last_layer_mean_abs_k": round(fingerprint, 6),
        "method": args.method,
        "capacity": shape.capacity,
        "seconds": round(seconds, 4),
        "first_call_s": round(compile_s, 2),
        "tflop": round(flops / 1e12, 2),
        "floor_s": round(flops / (PEAK_TFLOPS * 1e12), 4),
        "x_floor": round(seconds / (flops / (PEAK_TFLOPS * 1e12)), 2),
        "peak_gb_so_far": round(stats.get("peak_bytes_in_use", 0) / 1e9, 2),
        "weights_gb": round(weights / 1e9, 2),
    }
    return row


def build_parser() -> argparse.ArgumentParser:
    """ddtree-bench prefill's flags (their defaults shown by --help)."""
    p = report.parser("prefill", __doc__)
    p.add_argument(
        "--shape", choices=sorted(SHAPES), default="qwen3-8b", help="the target's shape (random weights)"
    )
    p.add_argument("--runs", default="1024:1024,32768:1024", help="LENGTH:CHUNK pairs, in order")
    p.add_argument("--attention", default="pallas", help="the plan's attention: reference, pallas or mosaic")
    p.add_argument("--method", default="ddtree", help="ar: no drafter context")
    p.add_argument(
        "--prefill-attention",
        default="same",
        help="the chunks' attention: same (as --attention), causal-cudnn, causal-xla, pallas, reference",
    )
    p.add_argument("--reps", type=int, default=3, help="timed prefills of each run (after one that compiles)")
    p.add_argument("--out", required=True, help="the JSON written (rewritten after every run)")
    report.add_deadline(p)
    return p


def parse_runs(text: str) -> list[tuple[int, int]]:
    """--runs: LENGTH:CHUNK pairs (length >= 1, chunk a power of two >= 16), or a one-line error."""
    runs = []
    for item in text.split(","):
        parts = item.split(":")
        if len(parts) != 2 or not all(x.strip().isdigit() and int(x) >= 1 for x in parts):
            raise DDTreeError(f"--runs {text}: {item!r} is not LENGTH:CHUNK (integers >= 1)")
        length, chunk = int(parts[0]), int(parts[1])
        if chunk < 16 or chunk & (chunk - 1):  # as programs.Programs takes it
            raise DDTreeError(f"--runs {text}: chunk {chunk} is not a power of two >= 16")
        runs.append((length, chunk))
    return runs


def main(argv: list[str] | None = None) -> int:
    """`ddtree-bench prefill ARGS`: time each prefill run and write the JSON; the exit status."""
    return report.run_subcommand("prefill", build_parser(), argv, run)


def run(args: argparse.Namespace, command: list[str], deadline: report.Deadline) -> int:
    """Each LENGTH:CHUNK run of --runs in order (none past the deadline), the JSON after each."""
    runs = parse_runs(args.runs)
    cfg = SHAPES[args.shape]
    dcfg = draft_shape(cfg, 5, 16)
    params = random_params(target.weight_specs(cfg), 0, jnp.bfloat16)
    dparams = random_params(drafter.weight_specs(dcfg), 1, jnp.bfloat16) if args.method != "ar" else None
    out = {
        "meta": report.run_header(command),
        "rows": [],
        "skipped": deadline.skipped,
    }
    for length, chunk in runs:
        if deadline.allows(f"{length}:{chunk}"):
            row = one_run(args, cfg, dcfg, params, dparams, length, chunk)
            print(json.dumps(row), flush=True)
            out["rows"].append(row)
        report.write_json(args.out, out)
    return 0
