"""The XLA flags a GPU run starts with: one place, applied by the command-line entry points before the
backend starts (no jax import here).

XLA reads XLA_FLAGS once, when the first backend is created, so `apply` must run before anything touches
a device. It adds the chosen preset's flags to XLA_FLAGS in front of the user's own: a flag the user
already sets is left out of ours, so the user's XLA_FLAGS always wins. The preset comes from the
environment variable DDTREE_XLA_PRESET (one of PRESETS' names), else DEFAULT_PRESET.

What the presets are about (issue 39, jax 0.11.2, read from its bundled XLA's flag table): XLA replays
runs of kernels as CUDA graphs ("command buffers"). Its default command types are FUSION, CUBLAS,
CUBLASLT, CUSTOM_CALL, CUDNN and DYNAMIC_SLICE_FUSION with a minimum graph of 5 commands; WHILE and
CONDITIONAL are not in it, so every while loop (the device loop of rounds, a scan) cuts the graph. The
flag jax#27988 named for Pallas Triton calls (`--legacy_command_buffer_custom_call_targets=
__gpu$xla.gpu.triton`) is gone from this XLA (a reserved field of DebugOptions): Triton custom calls are
recorded by default there (openxla/xla#30765), and the 2026-12-03 round profile indeed found the
tree-attention kernels inside command buffers (results/h200/2026-12-03/round-profile/README.md). What is
left to try is larger graphs: loops inside them (+WHILE, +CONDITIONAL), graphs of any size, loops of
known trip count unrolled into the graph. results/h200/recipes/launches.sh measures each preset.
"""

from __future__ import annotations

import os

PRESETS: dict[str, tuple[str, ...]] = {
    # XLA's own defaults (command buffers of fusions, GEMMs, custom calls incl. Triton, cuDNN)
    "xla": (),
    # no command buffers at all: every kernel launched by the host (the baseline the others beat)
    "off": ("--xla_gpu_enable_command_buffer=",),
    # while loops and conditionals recorded too (CUDA conditional nodes), graphs of any size
    "graphs": ("--xla_gpu_enable_command_buffer=+WHILE,+CONDITIONAL", "--xla_gpu_graph_min_graph_size=1"),
    # the same, loops of known trip count (a scan) unrolled into the graph
    "graphs-unrolled": (
        "--xla_gpu_enable_command_buffer=+WHILE,+CONDITIONAL",
        "--xla_gpu_graph_min_graph_size=1",
        "--xla_gpu_command_buffer_unroll_loops=true",
    ),
}
# 'graphs' since the job runs on the device (one H100, 2026-12-07, results/h100/2026-12-07/job-vs-torch-s3,
# the README's main job, second runs in one call): ar 79.1k tok/s against 70.4k under XLA's own at batch 16,
# ddtree 64.9k against 58.7k; at batch 64 ar 171k against 176k, ddtree 142k against 136k. The loop tests
# of the job (its while loop and the admission loop) stay on the device instead of returning to the host.
DEFAULT_PRESET = "graphs"
ENV = "DDTREE_XLA_PRESET"


def flag_name(flag: str) -> str:
    """'--xla_foo=1' -> 'xla_foo'."""
    return flag.lstrip("-").split("=", 1)[0]


def merged(user_flags: str, preset: str) -> str:
    """XLA_FLAGS with `preset`'s flags in front of `user_flags`, less those whose name the user sets."""
    if preset not in PRESETS:
        raise ValueError(f"{ENV} must be one of {sorted(PRESETS)}, got {preset!r}")
    own = {flag_name(f) for f in user_flags.split()}
    ours = [f for f in PRESETS[preset] if flag_name(f) not in own]
    return " ".join([*ours, *user_flags.split()])


def apply(environ: dict[str, str] | None = None) -> str:
    """Set XLA_FLAGS for this process from the preset (DDTREE_XLA_PRESET or DEFAULT_PRESET) and the
    user's XLA_FLAGS; returns the preset's name. Call before the first jax backend is created."""
    env = os.environ if environ is None else environ
    preset = env.get(ENV) or DEFAULT_PRESET
    flags = merged(env.get("XLA_FLAGS", ""), preset)
    if flags:
        env["XLA_FLAGS"] = flags
    return preset
