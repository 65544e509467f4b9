"""The XLA flag presets: merged under the user's XLA_FLAGS, and every flag known to this jaxlib's XLA."""

import os
import subprocess
import sys

import pytest

from ddtree_jax import xla_flags


def test_user_flags_win_and_come_last():
    user = "--xla_gpu_graph_min_graph_size=7 --xla_force_host_platform_device_count=8"
    got = xla_flags.merged(user, "graphs").split()
    assert got == ["--xla_gpu_enable_command_buffer=+WHILE,+CONDITIONAL", *user.split()]
    assert xla_flags.merged("", "xla") == ""
    with pytest.raises(ValueError):
        xla_flags.merged("", "fast")


def test_apply_reads_the_preset_from_the_environment():
    env = {"DDTREE_XLA_PRESET": "off", "XLA_FLAGS": "--xla_dump_to=/tmp/x"}
    assert xla_flags.apply(env) == "off"
    assert env["XLA_FLAGS"] == "--xla_gpu_enable_command_buffer= --xla_dump_to=/tmp/x"
    env = {}
    assert xla_flags.apply(env) == xla_flags.DEFAULT_PRESET
    assert env.get("XLA_FLAGS", "") == " ".join(xla_flags.PRESETS[xla_flags.DEFAULT_PRESET])


def test_every_preset_flag_parses_in_this_xla():
    """XLA aborts a process on an unknown flag or a bad enum value in XLA_FLAGS (the flag jax#27988 named,
    --legacy_command_buffer_custom_call_targets, is one in jax 0.11.2): every preset's flags, all at once,
    must let a CPU process compile and run."""
    flags = " ".join(f for preset in xla_flags.PRESETS.values() for f in preset)
    env = {**os.environ, "XLA_FLAGS": flags, "JAX_PLATFORMS": "cpu"}
    code = "import jax; print(int(jax.jit(lambda x: x + 1)(1)))"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "2", out.stderr[-2000:]
