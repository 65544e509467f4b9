"""Shared test set-up: 8 fake CPU devices, no persistent compilation cache, exact float32 matmuls,
fixture loading helpers; tests marked own_process run in a process of their own."""

import os

# XLA's CPU backend at optimisation level 0 (LLVM's cheapest code generation): the suite is bound by
# compiling programs, and at level 0 its 878 tests took 0.73x the CPU seconds of the default level on
# the 2-core development VM (2026-12-03, docs/job-cost.md "The test suite"); the tests' float32
# comparisons hold at either level.
XLA_OPTIMISATION = "--xla_backend_optimization_level=0"
os.environ.setdefault("XLA_FLAGS", f"--xla_force_host_platform_device_count=8 {XLA_OPTIMISATION}")
# JAX's persistent compilation cache is off in the suite and in the processes its tests start
# (JAX_ENABLE_COMPILATION_CACHE=false, which compile_cache.enable(None), so every command, honours;
# tests/test_compile_cache.py turns it on in its own directories). Measured over one full run with
# tests/compile_stats.py (docs/job-cost.md "The test suite", 2026-12-07): hits were rare, the programs
# they saved took less to compile than the run spent writing entries, and the workers crashed inside
# XLA deserialising entries (SIGSEGV, SIGABRT in get_executable_and_time) and serialising them
# (executable.serialize()). The directory it used to set was shared by both pytest-xdist workers of
# every run on the machine: the controller imports this file first, and the workers inherit its
# environment. A fresh cache per worker and per run was tried again (2026-12-07, 20:37 UTC, `.ci/run` in a
# fresh clone, same 2-core VM): 86% of the tests at 28 min, before other work shared the machine, against
# 28.7 min for the whole suite with the cache off, and three workers lost in executable.serialize(); so
# the stop-52/53 CI figures (1,053 s then 1,882 s) owe their difference to other changes, not to the
# cache. The compiled programs kept by executables.py are off too (DDTREE_EXECUTABLES;
# test_compile_cache turns them on). (Jax's Mosaic GPU interpreter's tests run in processes of their
# own: `own_process` below.)
os.environ.setdefault("JAX_ENABLE_COMPILATION_CACHE", "false")
os.environ.setdefault("DDTREE_EXECUTABLES", "off")

import functools  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")


# Tests marked `own_process` run in a fresh Python process of their own: jax 0.11.2's Mosaic GPU
# interpreter (plgpu.InterpretGPUParams: Python threads and io_callbacks inside an XLA CPU program) left
# a pytest-xdist worker to crash later in unrelated XLA calls (SIGSEGV in a compile right after
# test_moe_kernel's interpreted kernel, 2026-12-02), so what it does to a process ends with that process.
OWN_PROCESS = "DDTREE_TEST_OWN_PROCESS"  # set in the test's own process


def pytest_configure(config):
    config.addinivalue_line("markers", "own_process: run the test alone in a fresh Python process")


def pytest_collection_modifyitems(config, items):
    if os.environ.get(OWN_PROCESS):
        return
    for item in items:
        if item.get_closest_marker("own_process"):
            item.runtest = functools.partial(_run_in_own_process, item)


def _run_in_own_process(item) -> None:
    """Run `item` alone in a fresh process (the suite's settings and environment); a process killed by
    a signal runs once more, a failure is reported with the process's output, a skip as a skip."""
    config = item.config
    argv = [sys.executable, "-m", "pytest", str(config.rootpath / item.nodeid), "-q", "-rs"]
    argv += ["-p", "no:xdist", "-p", "no:cacheprovider"]
    argv += ["--rootdir", str(config.rootpath)] + (["-c", str(config.inipath)] if config.inipath else [])
    env = os.environ | {OWN_PROCESS: "1"}
    for _ in range(2):
        proc = subprocess.run(argv, env=env, cwd=config.invocation_params.dir, capture_output=True, text=True)
        if proc.returncode >= 0:
            break
    if proc.returncode != 0:
        signal = f" (killed by signal {-proc.returncode} twice)" if proc.returncode < 0 else ""
        output = f"{proc.stdout[-6000:]}\n{proc.stderr[-3000:]}"
        pytest.fail(f"in its own process{signal}:\n{output}", pytrace=False)
    skipped = [line for line in proc.stdout.splitlines() if line.startswith("SKIPPED")]
    if skipped:
        pytest.skip(f"in its own process: {skipped[0]}")


FIXTURES = Path(__file__).parent / "fixtures"
TARGETS = [
    "qwen3_gqa1",
    "qwen3_gqa2_tied",
    "qwen3_gqa4_tp",
    "llama_gqa2",
    "llama3_scaled",
    "qwen3_moe_norm",
    "qwen3_moe_tp",
]
# Three prompts beside the golden five (8 rows: one per device at dp 8), without HF outputs.
EXTRA_PROMPTS = [
    [7, 9, 11],
    [200, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21],
    [42] * 9,
]


def xla_flags(devices: int, *more: str) -> str:
    """XLA_FLAGS for a process a test starts: `devices` fake CPU devices at the suite's optimisation
    level, and `more`."""
    return " ".join([f"--xla_force_host_platform_device_count={devices}", XLA_OPTIMISATION, *more])


def fixture_id(name: str) -> str:
    """A test id for a fixture name or path that is the same in every pytest-xdist worker (a copy under
    a temporary directory, e.g. test_families.py's, is named by its folder)."""
    return name if "/" not in name else "copy-" + Path(name).name


DRAFTERS = {
    "dflash_qwen3_gqa4_tp": "qwen3_gqa4_tp",
    "dflash_qwen3_gqa1": "qwen3_gqa1",
    "dflash_qwen3_moe_tp": "qwen3_moe_tp",
}


TIMINGS = ("e2e_latency",)  # the output fields that are wall times, different in every run


def timeless(record: dict) -> dict:
    """An output line's record without its wall times (TIMINGS), for comparing two runs' outputs."""
    return {k: v for k, v in record.items() if k not in TIMINGS}


@functools.cache
def golden(name: str) -> dict[str, np.ndarray]:
    """The HF reference outputs recorded by tests/make_fixtures.py."""
    return dict(np.load(FIXTURES / name / "golden.npz"))


@functools.cache
def load_target(
    name: str,
    dtype: str = "float32",
    tp: int = 1,
    dp: int = 1,
    moe_sharding: str = "ep",
    scan_layers: bool = False,
):
    """(config, params) of a fixture target placed on a tp x dp mesh (default: one device);
    `moe_sharding`: how a Qwen3-MoE target's experts split (ignored by dense targets); `scan_layers`:
    its layers stacked for a scan (dense targets)."""
    from ddtree_jax import target
    from ddtree_jax.sharding import make_mesh, param_sharding

    placement = param_sharding(make_mesh(tp, dp))
    options = {"scan_layers": True} if scan_layers else {}
    return target.load(FIXTURES / name, jnp.dtype(dtype), placement, moe_sharding=moe_sharding, **options)


@functools.cache
def load_drafter(name: str, dtype: str = "float32", tp: int = 1, dp: int = 1):
    """(config, params) of a fixture drafter placed on a tp x dp mesh (default: one device)."""
    from ddtree_jax import drafter
    from ddtree_jax.sharding import make_mesh, param_sharding

    cfg, _ = load_target(DRAFTERS[name], dtype)
    return drafter.load(FIXTURES / name, cfg, jnp.dtype(dtype), param_sharding(make_mesh(tp, dp)))


def golden_prompts(name: str) -> list[list[int]]:
    """The five golden prompts (lengths 1, 5, 12, 17, 30)."""
    g = golden(name)
    return [g[f"prompt_{i}"].tolist() for i in range(5)]


def run(
    target_name,
    prompts,
    *,
    method="ar",
    draft_name=None,
    budget=0,
    batch_size=None,
    max_new_tokens=24,
    stop_ids=(),
    block_size=None,
    host_stepped=False,
    branching=None,
    sampling=None,
    options=None,
    tp=1,
    dp=1,
    tempered_draft=False,
    moe_sharding="ep",
    logprobs=0,
    logprobs_mode="raw",
    draft_stage=None,
    scan_layers=False,
):
    """Generate with the engine in float32, static batches of `batch_size` (default: every prompt in
    one) as `ddtree-generate --static-batches` runs them; returns the Result list in prompt order.

    sampling: default settings {temperature, top_k, top_p, seed} (unset: greedy); options: one dict
    per prompt overriding them, like the JSONL fields. tp, dp: the mesh (batch_size a multiple of dp).
    draft_stage: the round's draft stage in place of the drafter (Plan.draft_stage, e.g. oracle_draft).
    scan_layers: the target's layers as a scan (TargetConfig.scan_layers; dense targets).
    """
    import dataclasses

    from ddtree_jax.pair import make_plan
    from ddtree_jax.prompts import Prompt
    from ddtree_jax.scheduler import Generator, Schedule

    cfg, params = load_target(target_name, tp=tp, dp=dp, moe_sharding=moe_sharding, scan_layers=scan_layers)
    dcfg = dparams = None
    if draft_name is not None:
        dcfg, dparams = load_drafter(draft_name, tp=tp, dp=dp)
    batch_size = batch_size or len(prompts)
    plan = make_plan(  # ddtree-generate's plan (branching, block size)
        cfg,
        dcfg,
        method,
        batch_size=batch_size,
        max_new_tokens=max_new_tokens,
        budget=budget or None,
        branching=branching,
        block_size=block_size,
        attention="reference",
        tp=tp,
        dp=dp,
        tempered_draft=tempered_draft,
        logprobs=logprobs,
        logprobs_mode=logprobs_mode,
    )
    plan = dataclasses.replace(plan, draft_stage=draft_stage)
    dparams = dparams if method != "ar" else None
    schedule = Schedule(batch_size, policy="static", host_stepped=host_stepped)
    gen = Generator(params, dparams, plan, tuple(stop_ids), defaults=sampling, schedule=schedule)
    options = options or [{}] * len(prompts)
    items = [Prompt(i, i + 1, p, dict(o)) for i, (p, o) in enumerate(zip(prompts, options, strict=True))]
    return list(gen.run(items))


def oracle_draft(reference: list[list[int]], corrupt: int | None = None):
    """A draft stage (Plan.draft_stage) that proposes each row's reference continuation, so that the
    target accepts long paths: at every depth rank 0 is the reference's next token and ranks 1..k-1 the
    ids after it; `corrupt`: the depth whose rank 0 is wrong and rank 1 right. reference[i] is row i's
    prompt followed by the tokens it should emit (on a mesh each device reads its own rows)."""
    from ddtree_jax.sharding import DATA

    width = max(len(r) for r in reference) + 16
    table = np.zeros((len(reference), width), np.int32)
    for i, r in enumerate(reference):
        table[i, : len(r)] = r

    def stage(params, draft_params, state, plan):
        """-> logp, tok [B, D, k] (the engine's draft signature)."""
        b = state.bonus.shape[0]  # this device's rows
        first = jax.lax.axis_index(DATA) * b if plan.tp * plan.dp > 1 else 0
        rows = jax.lax.dynamic_slice_in_dim(jnp.asarray(np.pad(table, ((0, b), (0, 0)))), first, b)
        d, k, v = plan.depth, plan.branching, plan.target.vocab_size
        pos = state.cache.lengths[:, None] + 1 + jnp.arange(d)[None, :]
        right = jnp.take_along_axis(rows, jnp.minimum(pos, width - 1), axis=1)  # [B, D]
        tok = (right[:, :, None] + jnp.arange(k)[None, None, :]) % v
        if corrupt is not None:
            tok = tok.at[:, corrupt, 0].set((right[:, corrupt] + 1) % v)
            tok = tok.at[:, corrupt, 1].set(right[:, corrupt])
        logp = -jnp.broadcast_to(jnp.arange(k, dtype=jnp.float32), tok.shape)
        return logp, tok.astype(jnp.int32)

    return stage


def forget_programs(monkeypatch) -> None:
    """Compile every program anew from here on in this test: JAX's in-memory caches, the programs this
    process compiled (programs._COMPILED) and the executables kept on disk (off for the test), for a
    test that changes a traced function under the programs (monkeypatch)."""
    import jax

    from ddtree_jax import executables, programs

    jax.clear_caches()
    programs._COMPILED.clear()
    monkeypatch.setattr(executables, "directory", lambda: None)
