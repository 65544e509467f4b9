"""Load times of a random-weight model of a real shape: HF safetensors against the orbax params cache.

Writes random bfloat16 weights once as an HF directory (`checkpoint.save_hf`), then times
`target.load` from the safetensors files, the first `--params-cache` load (safetensors read plus
the orbax save) and the cached restores; and, warm, the two checks every load makes (checkpoint_checks:
the headers against the config, the weights' finiteness, with and without compiling its reductions),
which the load times include. "cold" runs first evict the files from the page cache
(posix_fadvise DONTNEED, no root needed); "warm" runs read them again at once. One JSON file out.

    python3 scripts/bench_load.py --shape qwen3-8b --dir /tmp/load --out $OUT/load_times.json
"""

import argparse
import gc
import json
import os
import platform
import shutil
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from ddtree_jax import checkpoint_checks, models, target, train  # noqa: E402
from ddtree_jax.bench import SHAPES  # noqa: E402
from ddtree_jax.checkpoint import params_cache, save_hf  # noqa: E402
from ddtree_jax.sharding import make_mesh, param_sharding  # noqa: E402
from ddtree_jax.weights import random_params  # noqa: E402


def evict(directory: Path) -> None:
    """Drop every file under `directory` from the page cache (written back first: only clean pages go)."""
    for path in directory.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


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


def timed_checks(checkpoint: Path, tp: int) -> dict[str, float]:
    """Seconds of the load's checks on their own: headers against the config, weights finite (the
    first time compiling its reductions, then compiled)."""
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


def main() -> int:
    """Write the checkpoint, time each way of loading it, write the JSON."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-8b")
    p.add_argument("--dir", default="/tmp/ddtree_load", help="scratch directory (emptied first)")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--repeats", type=int, default=2, help="cold and warm loads of each kind")
    p.add_argument("--out", required=True)
    args = p.parse_args()

    work = Path(args.dir)
    shutil.rmtree(work, ignore_errors=True)
    checkpoint, cache = work / "hf", work / "cache"
    cfg = SHAPES[args.shape]
    specs = target.weight_specs(cfg)
    start = time.perf_counter()
    save_hf(random_params(specs, 0, jnp.bfloat16), specs, checkpoint, train.target_hf_config(cfg))
    write_s = time.perf_counter() - start
    print(f"wrote {du(checkpoint) / 1e9:.2f} GB of safetensors in {write_s:.1f} s", flush=True)

    times: dict[str, list[float]] = {}
    result = {
        "shape": args.shape,
        "tp": args.tp,
        "safetensors_bytes": du(checkpoint),
        "write_seconds": round(write_s, 3),
        "seconds": times,
        "devices": [d.device_kind for d in jax.devices()[: args.tp]],
        "jax": jax.__version__,
        "host": platform.node(),
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
    }

    def record(name: str, seconds: float) -> None:
        """Keep one timing and rewrite the JSON (a run cut short keeps what it measured)."""
        times.setdefault(name, []).append(round(seconds, 3))
        result["orbax_bytes"] = du(cache) if cache.exists() else 0
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
        print(f"{name}: {seconds:.2f} s", flush=True)

    for _ in range(args.repeats):
        evict(checkpoint)
        record("safetensors_cold", timed_load(checkpoint, None, args.tp))
        record("safetensors_warm", timed_load(checkpoint, None, args.tp))
    for name, seconds in timed_checks(checkpoint, args.tp).items():
        record(name, seconds)
    evict(checkpoint)
    record("convert_cold", timed_load(checkpoint, cache, args.tp))  # read + orbax save
    for _ in range(args.repeats):
        evict(cache)
        record("orbax_cold", timed_load(checkpoint, cache, args.tp))
        record("orbax_warm", timed_load(checkpoint, cache, args.tp))
    shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
