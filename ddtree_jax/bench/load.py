"""`ddtree-bench load`: load times of a random-weight target, HF safetensors against the params cache.

Writes random bfloat16 weights once as a sharded HF directory (~4 GB files and their index, as published
checkpoints come; kept with --keep and reused while its config matches), then times `target.load` from
the safetensors files (the first load apart: it compiles the on-device transposes), the first
`--params-cache` load (safetensors read plus the orbax save) and the cached restores, each until every
array is on its devices. "cold" runs first drop the files from the page cache: as root through
/proc/sys/vm/drop_caches (every clean page of the machine), else posix_fadvise(DONTNEED) on each file
(no root needed; a file system may ignore it); "warm" runs read them again at once. One JSON file out,
rewritten after every timing, with GB/s of safetensors bytes; and, warm, the two checks every load makes
(checkpoint_checks: the headers against the config, the weights' finiteness, the first time with its
compilation where it compiles), which the load times include. No timing starts past --deadline-s.

    ddtree-bench load --shape qwen3-8b --dir /tmp/load --out $OUT/load_times.json
    ddtree-bench load --shape qwen3-8b --num-layers 2 --vocab-size 32768 --out /tmp/l.json
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import math
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from ddtree_jax import checkpoint_checks, models, target, train
from ddtree_jax.bench import report
from ddtree_jax.bench.shapes import SHAPES
from ddtree_jax.checkpoint import params_cache, write_safetensors
from ddtree_jax.errors import DDTreeError
from ddtree_jax.sharding import make_mesh, param_sharding


def drop_caches() -> bool:
    """Drop the whole page cache (root only); False when not allowed here."""
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def evict(directory: Path, how: str) -> str:
    """Drop the files under `directory` from the page cache; returns how ("drop_caches" or "fadvise")."""
    if how == "auto" and drop_caches():
        return "drop_caches"
    for path in directory.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
    return "fadvise"


def du(directory: Path) -> int:
    """Bytes of the files under `directory`."""
    return sum(p.stat().st_size for p in directory.rglob("*") if p.is_file())


def timed_load(checkpoint: Path, cache: Path | None, tp: int) -> float:
    """Seconds to load the target onto a tp-device mesh, until every array is on its devices."""
    gc.collect()
    start = time.perf_counter()
    with params_cache(cache):
        _, params = target.load(checkpoint, jnp.bfloat16, param_sharding(make_mesh(tp)))
    jax.block_until_ready(params)
    seconds = time.perf_counter() - start
    del params
    gc.collect()
    return seconds


SHARD_BYTES = 4 << 30  # HF's sharded checkpoints hold up to ~5 GB per file (Qwen3-8B: 5 files)


def random_bf16(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    """Finite bfloat16 values like a weight's: random sign and mantissa, exponents 2^-9 .. 2^-6 (about
    as compressible as real weights); made from random bytes, fast enough for 16 GB."""
    bits = np.frombuffer(rng.bytes(2 * math.prod(shape)), np.uint16)
    exponent = (118 + ((bits >> 7) & 3)).astype(np.uint16) << 7
    return ((bits & 0x807F) | exponent).view(ml_dtypes.bfloat16).reshape(shape)


def write_checkpoint(cfg, checkpoint: Path, keep: bool) -> float:
    """Random bf16 weights of `cfg` as a sharded HF directory (model-0000i-of-0000n.safetensors and
    the index; reused when --keep finds the same config); returns the seconds spent (0 when reused)."""
    config = train.target_hf_config(cfg)
    stamp = checkpoint / "config.json"
    if keep and stamp.exists() and json.loads(stamp.read_text()) == json.loads(json.dumps(config)):
        return 0.0
    shutil.rmtree(checkpoint, ignore_errors=True)
    checkpoint.mkdir(parents=True)
    start = time.perf_counter()
    shards, size = [[]], 0
    for spec in target.weight_specs(cfg):
        for piece in spec.pieces():
            nbytes = 2 * math.prod(piece.hf_shape)
            if size and size + nbytes > SHARD_BYTES:
                shards, size = [*shards, []], 0
            shards[-1].append(piece)
            size += nbytes
    rng = np.random.default_rng(0)
    weight_map = {}
    for i, pieces in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        write_safetensors(checkpoint / name, {p.hf_name: random_bf16(rng, p.hf_shape) for p in pieces})
        weight_map |= {p.hf_name: name for p in pieces}
    (checkpoint / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}) + "\n")
    stamp.write_text(json.dumps(config, indent=2) + "\n")
    return time.perf_counter() - start


def timed_checks(checkpoint: Path, tp: int) -> dict[str, float]:
    """Seconds of the load's checks on their own: headers against the config, weights finite (the
    first time compiling its reductions where it compiles, then compiled)."""
    cfg, params = target.load(checkpoint, jnp.bfloat16, param_sharding(make_mesh(tp)))
    specs = target.weight_specs(cfg)
    seconds = {}
    start = time.perf_counter()
    checkpoint_checks.check_against_config(checkpoint, specs, models.family(cfg).ignored_tensors(cfg))
    seconds["check_headers"] = time.perf_counter() - start
    for name in ("check_finite_compiling", "check_finite"):
        if name == "check_finite_compiling":
            checkpoint_checks._device_finite.cache_clear()
            jax.clear_caches()
        start = time.perf_counter()
        checkpoint_checks.check_finite(checkpoint, params, specs)
        seconds[name] = time.perf_counter() - start
    return seconds


def build_parser() -> argparse.ArgumentParser:
    """ddtree-bench load's flags (their defaults shown by --help)."""
    p = report.parser("load", __doc__)
    p.add_argument(
        "--shape",
        choices=sorted(SHAPES),
        default="qwen3-8b",
        help="the checkpoint's shape (random weights, written to --dir)",
    )
    p.add_argument("--num-layers", type=int, help="the shape cut to this many layers (default: all)")
    p.add_argument("--vocab-size", type=int, help="the shape's vocabulary replaced (default: its own)")
    p.add_argument("--dir", default="/tmp/ddtree_load", help="scratch directory")
    p.add_argument("--keep", action="store_true", help="reuse --dir's checkpoint and keep it afterwards")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel devices the weights are split over")
    p.add_argument("--reps", type=int, default=2, help="cold and warm loads of each kind")
    report.add_deprecated(p, "--repeats", "--reps", type=int)
    p.add_argument(
        "--evict",
        choices=["auto", "fadvise"],
        default="auto",
        help="cold runs: auto = drop_caches when root may, else fadvise; fadvise = these files only",
    )
    p.add_argument("--no-orbax", action="store_true", help="time the safetensors loads only")
    p.add_argument("--out", required=True, help="the JSON written (rewritten after every timing)")
    report.add_deadline(p)
    return p


def main(argv: list[str] | None = None) -> int:
    """`ddtree-bench load ARGS`: write the checkpoint, time each way of loading it, write the JSON; the
    exit status."""
    return report.run_subcommand("load", build_parser(), argv, run)


def run(args: argparse.Namespace, command: list[str], deadline: report.Deadline) -> int:
    """Write the checkpoint, then each timing in order (none past the deadline), the JSON after each."""
    if not 1 <= args.tp <= jax.device_count():
        raise DDTreeError(f"--tp {args.tp}: between 1 and the {jax.device_count()} devices here")
    work = Path(args.dir)
    checkpoint, cache = work / "hf", work / "cache"
    cfg = SHAPES[args.shape]
    if args.num_layers:
        cfg = dataclasses.replace(cfg, num_layers=args.num_layers)
    if args.vocab_size:
        cfg = dataclasses.replace(cfg, vocab_size=args.vocab_size)
    write_s = write_checkpoint(cfg, checkpoint, args.keep)
    shutil.rmtree(cache, ignore_errors=True)
    size = du(checkpoint)
    how = f"written in {write_s:.1f} s" if write_s else "kept"
    print(f"{size / 1e9:.2f} GB of safetensors ({how})", flush=True)

    times: dict[str, list[float]] = {}
    result = {
        "meta": report.run_header(command),
        "shape": args.shape,
        "num_layers": cfg.num_layers,
        "vocab_size": cfg.vocab_size,
        "tp": args.tp,
        "cpus": os.cpu_count(),
        "safetensors_bytes": size,
        "write_seconds": round(write_s, 3),
        "seconds": times,
        "gb_per_s": {},
        "skipped": deadline.skipped,
    }

    def record(name: str, timing: Callable[[], float]) -> None:
        """Run one timing unless the deadline has passed, keep it, rewrite the JSON (a run cut short
        keeps what it measured)."""
        if not deadline.allows(name):
            report.write_json(args.out, result)
            return
        seconds = timing()
        times.setdefault(name, []).append(round(seconds, 3))
        result["gb_per_s"][name] = round(size / 1e9 / min(times[name]), 3)
        result["orbax_bytes"] = du(cache) if cache.exists() else 0
        report.write_json(args.out, result)
        print(f"{name}: {seconds:.2f} s ({size / 1e9 / seconds:.2f} GB/s)", flush=True)

    def cold(directory: Path, cached: Path | None) -> float:
        result["evicted_by"] = evict(directory, args.evict)
        return timed_load(checkpoint, cached, args.tp)

    # the first load also compiles the loader's on-device transposes (once per process and shape)
    record("safetensors_first", lambda: timed_load(checkpoint, None, args.tp))
    for _ in range(args.reps):
        record("safetensors_cold", lambda: cold(checkpoint, None))
        record("safetensors_warm", lambda: timed_load(checkpoint, None, args.tp))
    if deadline.allows("checks"):
        for name, seconds in timed_checks(checkpoint, args.tp).items():
            record(name, lambda s=seconds: s)
    if not args.no_orbax:
        record("convert_cold", lambda: cold(checkpoint, cache))  # read + orbax save
        for _ in range(args.reps):
            record("orbax_cold", lambda: cold(cache, cache))
            record("orbax_warm", lambda: timed_load(checkpoint, cache, args.tp))
    shutil.rmtree(cache, ignore_errors=True)
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)
    return 0
