"""`ddtree-bench scheduling`: continuous batching against static batches on a mixed workload; one JSON.

The workload: `--prompts` prompts whose lengths are log-uniform in [--min-len, --max-len] (cut from the
held-out code prompts for a real pair, random ids for random weights), `--max-new-tokens` each, and
one stop id chosen so that about `--stop-fraction` of the rows stop early: the token found in that
fraction of a calibration run's outputs (the first 32 prompts, static batches), or up to
`--stop-tokens` such tokens together (random weights). With `--min-new-tokens N` each prompt also
gets its own `max_new_tokens`, log-uniform in [N, --max-new-tokens] from the seed, so the spread of
output lengths does not depend on the outputs (random weights rarely hit a stop id, and a bf16 run's
outputs depend on the schedule; pass --stop-fraction 0 for lengths alone). Static batches run
`--batch-size` prompts at a time in input order until each batch's slowest row finishes (what
`ddtree-generate --static-batches` does); continuous batching is ddtree-generate's default. Both report
generation seconds without compilation; outputs are compared token for token.

    ddtree-bench scheduling --out results/scheduling/cpu.json --prompts 48 --max-len 512
    ddtree-bench scheduling --shape qwen3-8b --attention pallas --stop-tokens 8 --out $OUT/8b.json
    ddtree-bench scheduling --max-new-tokens 128 --min-new-tokens 8 --stop-fraction 0 --out ...

It runs continuous, then static, then batch-invariant batching; none starts past --deadline-s.
"""

from __future__ import annotations

import argparse
import collections
import json
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from ddtree_jax import drafter, target
from ddtree_jax.bench import report
from ddtree_jax.budgets import default_branching
from ddtree_jax.engine import Plan
from ddtree_jax.errors import DDTreeError
from ddtree_jax.prompts import Prompt
from ddtree_jax.scheduler import Generator, Schedule
from ddtree_jax.settings import BUNDLED as PAIR
from ddtree_jax.sharding import make_mesh, param_sharding

# the held-out code prompts of the repository (results/): a real pair's workload
HELDOUT = Path(__file__).resolve().parents[2] / "results" / "heldout-prompts-96.jsonl"


def load_models(args):
    """(target cfg, params, draft cfg, draft params, token stream for prompts or None)."""
    dtype = jnp.dtype(args.dtype)
    if args.shape:
        from ddtree_jax.bench.shapes import SHAPES, draft_shape
        from ddtree_jax.weights import random_params

        cfg = SHAPES[args.shape]
        dcfg = draft_shape(cfg, 5, 16)
        params = random_params(target.weight_specs(cfg), 0, dtype)
        dparams = random_params(drafter.weight_specs(dcfg), 1, dtype)
        return cfg, params, dcfg, dparams, None
    from ddtree_jax.text import TextCodec

    place = param_sharding(make_mesh(1, 1))
    cfg, params = target.load(PAIR / "target", dtype, place)
    dcfg, dparams = drafter.load(PAIR / "draft", cfg, dtype, place)
    codec = TextCodec(PAIR / "target")
    texts = [json.loads(line)["prompt"] for line in HELDOUT.read_text().splitlines()]
    stream = [t for text in texts for t in codec.encode(text, add_special_tokens=False)]
    return cfg, params, dcfg, dparams, stream


def workload(args, vocab: int, stream: list[int] | None) -> list[Prompt]:
    """Prompts of log-uniform lengths: windows of the token stream, or random ids."""
    rng = np.random.default_rng(args.seed)
    lengths = np.exp(rng.uniform(np.log(args.min_len), np.log(args.max_len), args.prompts)).astype(int)
    prompts = []
    for i, n in enumerate(lengths):
        if stream is None:
            ids = rng.integers(1, vocab - 1, n).tolist()
        else:
            start = int(rng.integers(0, len(stream) - n))
            ids = stream[start : start + n]
        prompts.append(Prompt(i, i + 1, ids, {}))
    if args.min_new_tokens is not None:  # own stream: the prompts are those of a run without limits
        draw = np.random.default_rng([args.seed, 1])
        low, high = np.log(args.min_new_tokens), np.log(args.max_new_tokens + 1)
        limits = np.minimum(np.exp(draw.uniform(low, high, args.prompts)).astype(int), args.max_new_tokens)
        for prompt, n in zip(prompts, limits, strict=True):
            prompt.options["max_new_tokens"] = int(n)
    return prompts


def make_generator(
    args, cfg, params, dcfg, dparams, stop_ids, policy="continuous", batch_invariant=False
) -> Generator:
    """A Generator of the benchmark's plan under `policy`."""
    plan = Plan(
        target=cfg,
        draft=dcfg if args.method != "ar" else None,
        method=args.method,
        max_new_tokens=args.max_new_tokens,
        budget=args.budget if args.method == "ddtree" else 0,
        branching=default_branching(args.method, args.budget),
        attention=args.attention,
    )
    schedule = Schedule(
        args.batch_size,
        policy,
        chunk=args.prefill_chunk,
        refill_at=args.refill_at,
        prefill_slots=args.prefill_slots,
        stride=args.stride,
        device_loop=not args.host_loop,
        batch_invariant=batch_invariant,
        prefill_attention=args.prefill_attention,
    )
    return Generator(params, dparams if args.method != "ar" else None, plan, stop_ids, schedule=schedule)


def static(gen: Generator, prompts: list[Prompt]):
    """Static batches in input order (`gen`'s policy), each run until its longest row finishes (each
    row at its own limit or stop id)."""
    return list(gen.run(prompts))


def choose_stop(args, gen: Generator, prompts) -> tuple[int, ...]:
    """Up to --stop-tokens tokens whose rows together make about --stop-fraction of a calibration
    run's outputs (static batches of the first 32 prompts, on `gen`, whose compiled programs the static
    run reuses), added greedily while the covered fraction gets closer. Random weights need several:
    their rows repeat few tokens of their own (one token was in 2 of 64 rows on the H200)."""
    if args.stop_fraction <= 0:
        return ()
    calib = static(gen, prompts[:32])
    seen = [set(r.output_ids[1:]) for r in calib]
    rows = collections.Counter(t for s in seen for t in s)
    chosen: list[int] = []
    covered: set[int] = set()

    def miss(extra: set[int]) -> float:
        return abs(len(covered | extra) / len(calib) - args.stop_fraction)

    while len(chosen) < args.stop_tokens:
        best = min(rows, key=lambda t: (miss({i for i, s in enumerate(seen) if t in s}), t))
        gain = {i for i, s in enumerate(seen) if best in s}
        if chosen and miss(gain) >= miss(set()):
            break
        chosen.append(int(best))
        covered |= gain
        del rows[best]
    return tuple(chosen)


def summary(results, gen: Generator, wall: float) -> dict:
    """Tokens, seconds and tokens/s of one run."""
    tokens = sum(len(r.output_ids) for r in results)
    out = {
        "tokens": tokens,
        "generate_s": round(gen.generate_seconds, 3),
        "compile_s": round(gen.compile_seconds, 3),
        "wall_s": round(wall, 3),
        "tokens_per_s": round(tokens / gen.generate_seconds, 2),
        "stopped": sum(r.finish_reason == "stop" for r in results),
        "rounds_per_prompt": [r.rounds for r in results],
    }
    if gen.compile_log:
        out["compiled"] = [[name, seconds] for name, seconds in gen.compile_log]
    if gen.occupancy.host_returns:
        occ = gen.occupancy
        out |= {
            "rounds": occ.rounds,
            "row_rounds": occ.row_rounds,
            "busy": round(occ.busy / occ.row_rounds, 4),
            "busy_while_waiting": round(occ.waiting_fraction(), 4),
            "refills": occ.refills,
            "prefilled": occ.prefilled,
            "prefill_steps": occ.prefill_steps,
            "host_returns": occ.host_returns,
            "loop": gen.loop,
        }
    return out


def timed(fn):
    """(fn(), its wall seconds)."""
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start


def build_parser() -> argparse.ArgumentParser:
    """ddtree-bench scheduling's flags (their defaults shown by --help)."""
    p = report.parser("scheduling", __doc__)
    p.add_argument(
        "--shape", help="random weights of a ddtree-bench shape (e.g. qwen3-8b); default: the bundled pair"
    )
    p.add_argument("--prompts", type=int, default=48, help="prompts in the workload")
    p.add_argument("--min-len", type=int, default=16, help="shortest prompt (tokens; lengths log-uniform)")
    p.add_argument("--max-len", type=int, default=512, help="longest prompt (tokens)")
    p.add_argument("--max-new-tokens", type=int, default=64, help="new tokens a prompt (at most)")
    p.add_argument(
        "--min-new-tokens",
        type=int,
        help="each prompt's own max_new_tokens, log-uniform in [this, --max-new-tokens]",
    )
    p.add_argument("--batch-size", type=int, default=8, help="rows (both policies)")
    p.add_argument("--method", default="ddtree", choices=("ar", "dflash", "ddtree"), help="decoding method")
    p.add_argument("--budget", type=int, default=15, help="ddtree: tree nodes besides the root")
    p.add_argument("--prefill-chunk", type=int, default=256, help="prefill chunk (tokens)")
    p.add_argument("--prefill-slots", type=int, help="continuous: prompts a prefill pass (by backend)")
    p.add_argument("--refill-at", type=int, default=1, help="continuous: refill once this many rows are free")
    p.add_argument("--host-loop", action="store_true", help="continuous batching driven from the host")
    p.add_argument("--stride", type=int, help="continuous: rounds between harvests (default by backend)")
    p.add_argument("--reps", type=int, default=1, help="continuous runs (the fastest reported)")
    report.add_deprecated(p, "--repeats", "--reps", type=int)
    p.add_argument(
        "--stop-fraction", type=float, default=0.3, help="share of rows a chosen stop id ends early (0: none)"
    )
    p.add_argument(
        "--stop-tokens", type=int, default=1, help="at most this many stop ids (random weights: 8)"
    )
    p.add_argument(
        "--prefill-attention",
        default="same",
        help="the prefill chunks' attention: same (the decode attention), cudnn, or an implementation name",
    )
    p.add_argument("--dtype", default="float32", help="weights' and caches' dtype (e.g. bfloat16)")
    p.add_argument("--attention", default="reference", help="decode attention implementation (e.g. pallas)")
    p.add_argument("--batch-invariant", action="store_true", help="also time the batch-invariant schedule")
    p.add_argument("--skip-static", action="store_true", help="time continuous batching only")
    p.add_argument("--seed", type=int, default=0, help="the workload's seed (prompts, their limits)")
    p.add_argument("--out", required=True, help="the JSON written (rewritten after every run)")
    report.add_deadline(p)
    return p


def check_args(args: argparse.Namespace) -> None:
    """The checks that need no device work, before any (one line naming the first bad flag)."""
    if args.shape is not None:
        from ddtree_jax.bench.shapes import SHAPES

        if args.shape not in SHAPES:
            raise DDTreeError(f"--shape {args.shape}: not one of {', '.join(sorted(SHAPES))}")
    if args.min_new_tokens is not None and not 1 <= args.min_new_tokens <= args.max_new_tokens:
        raise DDTreeError(f"--min-new-tokens {args.min_new_tokens}: must be in [1, --max-new-tokens]")


def main(argv: list[str] | None = None) -> int:
    """`ddtree-bench scheduling ARGS`: run the workload both ways and write the figures; the exit status."""
    return report.run_subcommand("scheduling", build_parser(), argv, run)


def run(args: argparse.Namespace, command: list[str], deadline: report.Deadline) -> int:
    """The workload continuous, static and batch-invariant (as asked, none past the deadline)."""
    check_args(args)
    if args.dtype == "float32":
        jax.config.update("jax_default_matmul_precision", "highest")

    cfg, params, dcfg, dparams, stream = load_models(args)
    prompts = workload(args, cfg.vocab_size, stream)
    base_gen = make_generator(args, cfg, params, dcfg, dparams, (), policy="static")
    stop = choose_stop(args, base_gen, prompts)
    base_gen.stop_ids, base_gen.generate_seconds = stop, 0.0  # compile_seconds: calibration's included
    out = {
        "meta": report.run_header(command),
        "settings": vars(args)
        | {"stop_ids": list(stop), "prompt_lengths": [len(q.input_ids) for q in prompts]}
        | {
            "max_new_tokens_per_prompt": [
                q.options.get("max_new_tokens", args.max_new_tokens) for q in prompts
            ]
        },
        "skipped": deadline.skipped,
    }

    def save():
        report.write_json(args.out, out)

    if deadline.allows("continuous"):
        runs = []
        for _ in range(max(args.reps, 1)):  # (the programs compile once, in the first)
            gen = make_generator(args, cfg, params, dcfg, dparams, stop)
            cont, wall = timed(lambda gen=gen: sorted(gen.run(prompts), key=lambda r: r.id))
            runs.append(summary(cont, gen, wall))
        out["continuous"] = min(runs, key=lambda x: x["generate_s"])
        out["continuous"]["generate_s_runs"] = [x["generate_s"] for x in runs]
    save()
    if not args.skip_static and deadline.allows("static"):
        base, wall = timed(lambda: static(base_gen, prompts))
        out["static"] = summary(base, base_gen, wall)
        batches = range(0, len(base), args.batch_size)
        out["static"]["rounds"] = sum(max(r.rounds for r in base[i : i + args.batch_size]) for i in batches)
        if "continuous" in out:
            out["speedup"] = round(out["continuous"]["tokens_per_s"] / out["static"]["tokens_per_s"], 3)
            out["identical_outputs"] = [r.output_ids for r in base] == [r.output_ids for r in cont]
        save()
    if args.batch_invariant and deadline.allows("batch_invariant"):
        gen = make_generator(args, cfg, params, dcfg, dparams, stop, batch_invariant=True)
        inv, wall = timed(lambda: sorted(gen.run(prompts), key=lambda r: r.id))
        out["batch_invariant"] = summary(inv, gen, wall)
        if "continuous" in out:
            out["batch_invariant"]["speed_vs_continuous"] = round(
                out["batch_invariant"]["tokens_per_s"] / out["continuous"]["tokens_per_s"], 3
            )
    save()
    print(json.dumps({k: v for k, v in out.items() if k != "settings"}, indent=1))
    return 0
