"""--compile-cache: JAX's persistent compilation cache behind every command, checked entries."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src import compilation_cache as jax_cache

from ddtree_jax import compile_cache
from ddtree_jax.errors import DDTreeError

SETTINGS = (
    "jax_compilation_cache_dir",
    "jax_enable_compilation_cache",
    "jax_persistent_cache_min_compile_time_secs",
)


@pytest.fixture(autouse=True)
def restore_jax_cache():
    """Each test leaves JAX's cache as the suite set it (conftest's directory)."""
    before = {name: getattr(jax.config, name) for name in SETTINGS}
    yield
    for name, value in before.items():
        jax.config.update(name, value)
    jax_cache.reset_cache()


@pytest.fixture
def events():
    """The names of JAX's monitoring events recorded during the test."""
    seen = []
    jax.monitoring.register_event_listener(lambda name, **kw: seen.append(name))
    yield seen
    jax.monitoring.clear_event_listeners()


def program(x):
    """A small program of its own (no other test compiles it): 8 rounds of a matmul."""
    for _ in range(8):
        x = jnp.tanh(x @ x.T) * 0.5 + 0.25
    return x


def compile_fresh(seed: float = 0.25) -> np.ndarray:
    """Compile `program` anew (the in-memory caches cleared, so JAX asks the persistent one) and run it."""
    jax.clear_caches()
    return np.asarray(jax.jit(program)(jnp.full((32, 32), seed, jnp.float32)))


def count(events: list[str], name: str) -> int:
    """How many '/jax/compilation_cache/<name>' events were recorded."""
    return events.count(f"/jax/compilation_cache/{name}")


def entries(directory) -> list:
    """The program entries in a cache directory (our checked files)."""
    return sorted(directory.glob("jit_program-*-ddtree"))


def enable(directory) -> object:
    """compile_cache.enable(directory) with every program written, however fast it compiles."""
    where = compile_cache.enable(str(directory))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    return where


def test_flag_on_every_command(capsys):
    """ddtree-generate, ddtree-bench and each ddtree-compare sub-command take --compile-cache."""
    from ddtree_jax import cli
    from ddtree_jax.bench import rounds as bench
    from ddtree_jax.compare import cli as compare_cli

    assert cli.build_parser().parse_args(["--out", "x", "--compile-cache", "off"]).compile_cache == "off"
    assert cli.build_parser().parse_args(["--out", "x"]).compile_cache is None
    sub = compare_cli.build_parser().parse_args(["lossless", "--report", "r", "--compile-cache", "/c"])
    assert sub.compile_cache == "/c"
    argv = ["--shape", "tiny", "--out", "x", "--compile-cache", "off"]
    assert bench.build_parser().parse_args(argv).compile_cache == "off"
    assert bench.main(["--help"]) == 0  # its --help lists the flag
    assert "--compile-cache DIR|off" in capsys.readouterr().out


def test_entries_written_then_hit(tmp_path, events):
    """A first compile writes checked entries under the version/platform/device subdirectory; a
    fresh compile of the same program reads them (a cache hit) and gives the same result."""
    where = enable(tmp_path)
    assert where == tmp_path / compile_cache.subdirectory()
    assert where.name == f"jax-{jax.__version__}-cpu-cpu"
    first = compile_fresh()
    assert count(events, "cache_misses") >= 1 and count(events, "cache_hits") == 0
    assert len(entries(where)) == 1
    raw = entries(where)[0].read_bytes()
    assert raw.startswith(compile_cache.MAGIC)
    events.clear()
    second = compile_fresh()
    assert count(events, "cache_hits") >= 1 and count(events, "cache_misses") == 0
    np.testing.assert_array_equal(first, second)


def test_off_compiles_without_cache(tmp_path, events):
    """`off`: JAX consults no cache and writes nothing."""
    assert compile_cache.enable("off") is None
    compile_fresh()
    assert count(events, "compile_requests_use_cache") == 0
    assert count(events, "task_disabled_cache") == 1
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("damage", ["truncate", "flip_payload", "empty", "flip_magic"])
def test_damaged_entry_recompiled_and_replaced(tmp_path, events, capsys, damage):
    """A damaged entry is a miss: deleted, compiled again, written anew; one warning line. (Flipping
    bytes of the executable past the compressed stream's checks crashed a plain JAX cache on load.)"""
    where = enable(tmp_path)
    first = compile_fresh()
    (entry,) = entries(where)
    raw = bytearray(entry.read_bytes())
    if damage == "truncate":
        raw = raw[: len(raw) // 2]
    elif damage == "flip_payload":
        raw[int(len(raw) * 0.9)] ^= 0xFF
    elif damage == "empty":
        raw = bytearray()
    else:
        raw[0] ^= 0xFF
    entry.write_bytes(bytes(raw))
    compile_cache._warned.clear()
    events.clear()
    second = compile_fresh()
    np.testing.assert_array_equal(first, second)
    assert count(events, "cache_misses") == 1  # the damaged program's (jnp.full's programs hit)
    assert "damaged entry" in capsys.readouterr().err
    assert entry.read_bytes().startswith(compile_cache.MAGIC)  # written anew, and valid:
    events.clear()
    compile_fresh()
    assert count(events, "cache_hits") >= 1


def test_unwritable_directory_warns_once_and_runs(tmp_path, events, capsys):
    """A directory that cannot be made: one warning, the run goes on without a cache."""
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    compile_cache._warned.clear()
    assert compile_cache.enable(str(blocker / "cache")) is None
    assert compile_cache.enable(str(blocker / "cache")) is None
    result = compile_fresh()
    assert np.isfinite(result).all()
    err = capsys.readouterr().err
    assert err.count("not writable") == 1, err
    assert count(events, "compile_requests_use_cache") == 0


def test_write_failure_is_dropped(tmp_path, events, capsys):
    """The directory vanishing under a run: programs compile, a warning, nothing fails."""
    where = enable(tmp_path / "c")
    where.rename(tmp_path / "gone")
    compile_cache._warned.clear()
    assert np.isfinite(compile_fresh()).all()
    assert "cannot write" in capsys.readouterr().err


def test_environment_directory_wins_over_default_not_flag(tmp_path, monkeypatch):
    """JAX_COMPILATION_CACHE_DIR (the suite's own, here) is used as is when no flag is given; the
    flag's directory wins over it; the environment's minimum compile time is kept."""
    monkeypatch.setenv(compile_cache.ENV_DIR, str(tmp_path / "env"))
    monkeypatch.setenv(compile_cache.ENV_MIN_SECONDS, "0.7")
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.7)
    assert compile_cache.enable(None) is None
    assert jax.config.jax_compilation_cache_dir == str(tmp_path / "env")
    assert jax.config.jax_persistent_cache_min_compile_time_secs == 0.7
    where = compile_cache.enable(str(tmp_path / "flag"))
    assert where.parent == tmp_path / "flag"
    assert jax.config.jax_compilation_cache_dir == str(where)


def test_default_directory_and_minimum(tmp_path, monkeypatch):
    """No flag, no environment: $XDG_CACHE_HOME/ddtree-jax/xla, programs over 0.1 s kept."""
    monkeypatch.delenv(compile_cache.ENV_DIR, raising=False)
    monkeypatch.delenv(compile_cache.ENV_MIN_SECONDS, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert compile_cache.default_dir() == tmp_path / "ddtree-jax" / "xla"
    where = compile_cache.enable(None)
    assert where == tmp_path / "ddtree-jax" / "xla" / compile_cache.subdirectory()
    assert jax.config.jax_persistent_cache_min_compile_time_secs == compile_cache.MIN_COMPILE_SECONDS
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert compile_cache.default_dir() == type(tmp_path)(os.path.expanduser("~/.cache/ddtree-jax/xla"))


def test_empty_flag_refused():
    with pytest.raises(DDTreeError, match="--compile-cache"):
        compile_cache.enable(" ")


def test_generate_keeps_its_programs_in_the_flag_directory(tmp_path, events):
    """ddtree-generate with --compile-cache DIR writes its programs there (the checked entries); run
    again in the same process with JAX's in-memory caches dropped, it reads them instead of compiling
    and writes the same tokens."""
    import json

    from conftest import FIXTURES, golden_prompts

    from ddtree_jax import programs
    from ddtree_jax.cli import main

    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"id": 0, "input_ids": golden_prompts("qwen3_gqa1")[2]}) + "\n")
    outputs = []
    for run in ("first", "second"):
        programs._COMPILED.clear()  # the programs this process has compiled (programs.Programs)
        jax.clear_caches()
        events.clear()
        out = tmp_path / f"{run}.jsonl"
        argv = ["--target", str(FIXTURES / "qwen3_gqa1"), "--prompts", str(prompts), "--out", str(out)]
        assert main([*argv, "--max-new-tokens", "5", "--compile-cache", str(tmp_path / "cc")]) == 0
        outputs.append(json.loads(out.read_text())["output_ids"])
        if run == "first":
            (where,) = (tmp_path / "cc").iterdir()
            assert where.name == compile_cache.subdirectory()
            assert len(list(where.glob("*-ddtree"))) >= 2  # at least the start (prefill) and the rounds
            assert count(events, "cache_misses") >= 2
    assert count(events, "cache_hits") >= 2  # (a program near the 0.2 s floor may be written only now)
    assert outputs[0] == outputs[1]


def test_environment_can_turn_it_off(tmp_path, monkeypatch, events):
    """JAX_ENABLE_COMPILATION_CACHE=false and no flag: off, as JAX would have it; the flag still wins."""
    monkeypatch.setenv(compile_cache.ENV_ENABLE, "false")
    assert compile_cache.enable(None) is None
    compile_fresh()
    assert count(events, "compile_requests_use_cache") == 0
    assert compile_cache.enable(str(tmp_path)) == tmp_path / compile_cache.subdirectory()
