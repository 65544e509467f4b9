"""Timing on the device: the median of synced calls, the HBM read ceiling, the device's memory."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp


def read_ceiling_gbs(nbytes: int) -> float:
    """Read bandwidth of a large bf16 `jnp.sum`, GB/s (the floor's denominator)."""
    x = jnp.ones((nbytes // 2,), jnp.bfloat16)
    f = jax.jit(lambda a: jnp.sum(a, dtype=jnp.float32))
    return nbytes / median_seconds(lambda: f(x), 10) / 1e9


def median_seconds(fn: Callable[[], Any], reps: int) -> float:
    """Median wall time of `reps` synced calls of fn() after one warm-up call, in seconds."""
    jax.block_until_ready(fn())
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def device_memory() -> dict | None:
    """bytes_in_use and peak_bytes_in_use of the first device (None where the backend has no stats)."""
    stats = jax.devices()[0].memory_stats()
    return None if stats is None else {k: stats.get(k) for k in ("bytes_in_use", "peak_bytes_in_use")}
