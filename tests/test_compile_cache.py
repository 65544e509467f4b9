"""--compile-cache: JAX's persistent compilation cache behind every command, checked entries."""

import os
import re

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
    """Each test leaves JAX's cache as the suite set it (off: conftest)."""
    before = {name: getattr(jax.config, name) for name in SETTINGS}
    yield
    for name, value in before.items():
        jax.config.update(name, value)
    jax_cache.reset_cache()


@pytest.fixture(autouse=True)
def executables_on(monkeypatch):
    """The compiled programs kept on disk are on in these tests (conftest turns them off elsewhere)."""
    monkeypatch.delenv("DDTREE_EXECUTABLES", raising=False)


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
    """JAX_COMPILATION_CACHE_DIR (a directory of the test's, here) is used as is when no flag is given; the
    flag's directory wins over it; the environment's minimum compile time is kept."""
    monkeypatch.delenv(compile_cache.ENV_ENABLE, raising=False)  # (conftest turns the cache off)
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
    monkeypatch.delenv(compile_cache.ENV_ENABLE, raising=False)
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


def test_generate_keeps_its_programs_in_the_flag_directory(tmp_path, capsys):
    """ddtree-generate with --compile-cache DIR writes its programs there (executables.py: compiled past
    JAX's own entries); run again in the same process with the compiled programs dropped, it reads them
    instead of compiling (the summary says so) and writes the same tokens."""
    import json

    from conftest import FIXTURES, golden_prompts

    from ddtree_jax import programs
    from ddtree_jax.cli import main

    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"id": 0, "input_ids": golden_prompts("qwen3_gqa1")[2]}) + "\n")
    outputs = []
    summaries = []
    for run in ("first", "second"):
        programs._COMPILED.clear()  # the programs this process has compiled (programs.Programs)
        jax.clear_caches()
        out = tmp_path / f"{run}.jsonl"
        argv = ["--target", str(FIXTURES / "qwen3_gqa1"), "--prompts", str(prompts), "--out", str(out)]
        assert main([*argv, "--max-new-tokens", "5", "--compile-cache", str(tmp_path / "cc")]) == 0
        outputs.append(json.loads(out.read_text())["output_ids"])
        summaries.append(capsys.readouterr().out)
        if run == "first":
            (where,) = (tmp_path / "cc").iterdir()
            assert where.name == compile_cache.subdirectory()
            assert len(list((where / "executables").glob("*.exe"))) >= 2  # the job's start and the job
    assert "read from the compile cache" not in summaries[0]
    assert re.search(r"programs compiled: (\d+) .*, \1 read from the compile cache", summaries[1])
    assert outputs[0] == outputs[1]


def test_environment_can_turn_it_off(tmp_path, monkeypatch, events):
    """JAX_ENABLE_COMPILATION_CACHE=false and no flag: off, as JAX would have it; the flag still wins."""
    monkeypatch.setenv(compile_cache.ENV_ENABLE, "false")
    assert compile_cache.enable(None) is None
    compile_fresh()
    assert count(events, "compile_requests_use_cache") == 0
    assert compile_cache.enable(str(tmp_path)) == tmp_path / compile_cache.subdirectory()


# -- executables.py: whole compiled programs, loaded without tracing, lowering or compiling ---------------

EXE_SHAPE = (16, 16)  # executables' own program shape (no other test compiles it)


def scaled(x, *, scale):
    """`program` times a static scale: the program of the executables tests."""
    return program(x) * scale


SCALED = jax.jit(scaled, static_argnames=("scale",))


def exe_input(seed: float = 0.25) -> jax.Array:
    """The program's input, its rows split over two devices (the sharding is part of the program)."""
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("data",))
    x = jnp.full(EXE_SHAPE, seed, jnp.float32)
    return jax.device_put(x, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data")))


def exe_load(scale: float = 2.0, x=None):
    """executables.load_or_compile of `scaled` at `scale` on `x`; -> (Loaded, how many times it lowered)."""
    from ddtree_jax import executables

    x = exe_input() if x is None else x
    lowered = []

    def lower():
        lowered.append(1)
        return SCALED.lower(x, scale=scale)

    loaded = executables.load_or_compile("scaled", ({"scale": scale}, executables.signature(x)), lower)
    return loaded, len(lowered)


def exe_files(tmp_path) -> list:
    """The executable entries under a compile-cache directory made by `enable`."""
    return sorted(tmp_path.rglob("executables/scaled-*.exe"))


def test_executable_hit_skips_lowering_and_equals(tmp_path):
    """A second load of the same program and key reads the entry (no tracing or lowering) and computes
    what the compiled program computes; another static setting or argument sharding is another entry."""
    from ddtree_jax import executables

    enable(tmp_path)
    first, lowered = exe_load()
    assert (first.hit, lowered) == (False, 1)
    (entry,) = exe_files(tmp_path)
    assert entry.parent == tmp_path / compile_cache.subdirectory() / executables.SUBDIRECTORY
    second, lowered = exe_load()
    assert (second.hit, lowered) == (True, 0)
    x = exe_input()
    want = np.asarray(program(np.full(EXE_SHAPE, 0.25, np.float32))) * 2.0
    np.testing.assert_allclose(np.asarray(second.compiled(x)), want, rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(second.compiled(x)), np.asarray(first.compiled(x)))
    assert second.compiled.input_shardings == first.compiled.input_shardings
    assert not exe_load(scale=3.0)[0].hit  # another static setting
    assert not exe_load(x=jnp.full(EXE_SHAPE, 0.25, jnp.float32))[0].hit  # another sharding
    assert len(exe_files(tmp_path)) == 3


def test_executable_compiled_past_jax_cache(tmp_path, events):
    """With the program already in JAX's persistent cache, load_or_compile still compiles it anew (an
    executable JAX loaded from its cache serialises without its code on CPU: the entry then failed when
    run, NOT_FOUND), and its entry, loaded, runs and equals."""
    enable(tmp_path)
    x = exe_input()
    want = np.asarray(SCALED(x, scale=5.0))  # JAX's cache now holds the program
    jax.clear_caches()
    events.clear()
    loaded, lowered = exe_load(scale=5.0, x=x)
    assert (loaded.hit, lowered) == (False, 1) and count(events, "cache_hits") == 0
    hit, _ = exe_load(scale=5.0, x=x)
    assert hit.hit
    np.testing.assert_array_equal(np.asarray(hit.compiled(x)), want)


@pytest.mark.parametrize("damage", ["truncate", "flip_payload", "empty", "other_key"])
def test_executable_bad_entry_recompiled(tmp_path, capsys, damage):
    """A damaged, truncated, empty or another key's entry is compiled again (never loaded), replaced by a
    valid one, with one warning line."""
    from ddtree_jax import executables

    enable(tmp_path)
    exe_load(scale=2.0)
    (two,) = exe_files(tmp_path)
    exe_load(scale=3.0)
    (three,) = set(exe_files(tmp_path)) - {two}
    raw = bytearray(two.read_bytes())
    if damage == "truncate":
        raw = raw[: len(raw) // 2]
    elif damage == "flip_payload":
        raw[int(len(raw) * 0.9)] ^= 0xFF
    elif damage == "empty":
        raw = bytearray()
    else:  # scale 3's valid entry under scale 2's name
        raw = bytearray(three.read_bytes())
    two.write_bytes(bytes(raw))
    compile_cache._warned.clear()
    loaded, lowered = exe_load(scale=2.0)
    assert (loaded.hit, lowered) == (False, 1)
    err = capsys.readouterr().err
    assert ("another program's" if damage == "other_key" else "damaged entry") in err
    x = exe_input()
    np.testing.assert_array_equal(np.asarray(loaded.compiled(x)), np.asarray(SCALED(x, scale=2.0)))
    assert executables.verified(two.read_bytes()) is not None  # written anew
    assert exe_load(scale=2.0)[0].hit


def test_executable_cache_off_and_uncacheable_key(tmp_path, capsys):
    """--compile-cache off: compiled, nothing written; a key holding a closure (not the same program in
    another process) compiles and is not kept, with a warning."""
    from ddtree_jax import executables

    compile_cache.enable("off")
    assert executables.directory() is None
    assert exe_load()[0].hit is False and exe_load()[0].hit is False
    enable(tmp_path)
    compile_cache._warned.clear()
    x = exe_input()
    loaded = executables.load_or_compile("scaled", (lambda: 2.0,), lambda: SCALED.lower(x, scale=2.0))
    assert not loaded.hit and not exe_files(tmp_path)
    assert "not kept" in capsys.readouterr().err
    with pytest.raises(executables.Uncacheable):
        executables.describe(object())  # known only by its address
    assert executables.describe(np.float32(2)) != executables.describe(np.float32(3))


WRITER = """
import os, sys, time
from ddtree_jax import compile_cache, executables
import test_compile_cache as t
where = compile_cache.enable(sys.argv[2])
role = sys.argv[1]
if role == "writer":  # write the same key's entry 12 times, each through a fresh serialisation
    loaded, _ = t.exe_load()  # the entry made (or read: the other writer may have made it)
    x = t.exe_input()
    # what load_or_compile writes: a program compiled in this process, never one read back (a CPU
    # executable read from an entry and serialised again can lack its kernels: "Function
    # wrapped_transpose not found" when a third process ran it, 1 run in 3, 2026-12-07)
    with compile_cache.bypassed():
        compiled = t.SCALED.lower(x, scale=2.0).compile()
    path = next(where.rglob("scaled-*.exe"))
    text = executables.describe((executables.FORMAT, "scaled", ({"scale": 2.0}, executables.signature(x)),
                                 executables.environment()))
    for _ in range(12):
        executables._write(path, text, compiled)
elif role == "reader":  # every read of the entry while they write must verify
    bad = reads = 0
    done, end = sys.argv[3], time.time() + 240
    while not os.path.exists(done) and time.time() < end:
        for path in where.rglob("scaled-*.exe"):
            reads += 1
            bad += executables.verified(path.read_bytes()) is None
        time.sleep(0.002)
    print("reads", reads, "bad", bad)
else:  # a fresh process: a hit, its outputs
    loaded, lowered = t.exe_load()
    import numpy as np
    np.save(sys.argv[3], np.asarray(loaded.compiled(t.exe_input())))
    print("hit", loaded.hit, lowered)
"""


def test_executable_concurrent_writers(tmp_path):
    """Two processes writing the same key at once, a third reading it all along: every read verifies,
    no temporary file is left, and a fresh process then loads the entry and computes what this one does."""
    import subprocess
    import sys

    from conftest import xla_flags

    env = os.environ | {
        "PYTHONPATH": os.pathsep.join([os.path.dirname(__file__), *sys.path]),
        "XLA_FLAGS": xla_flags(2),
    }
    cache = str(tmp_path / "cc")

    def start(*argv):
        return subprocess.Popen(
            [sys.executable, "-c", WRITER, *argv], env=env, stdout=subprocess.PIPE, text=True
        )

    done = tmp_path / "writers-done"
    procs = [start("reader", cache, str(done)), start("writer", cache), start("writer", cache)]
    outs = [p.communicate(timeout=300)[0] for p in procs[1:]]
    done.touch()
    outs.append(procs[0].communicate(timeout=60)[0])
    assert [p.returncode for p in procs] == [0, 0, 0], outs
    reads, bad = (int(w) for w in outs[2].split()[1::2])
    assert bad == 0 and reads > 0, outs[2]
    assert not list((tmp_path / "cc").rglob(".tmp-*"))
    proc = subprocess.run(
        [sys.executable, "-c", WRITER, "check", cache, str(tmp_path / "out.npy")],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0 and "hit True 0" in proc.stdout, proc.stdout + proc.stderr
    x = exe_input()
    np.testing.assert_array_equal(np.load(tmp_path / "out.npy"), np.asarray(SCALED(x, scale=2.0)))


def crash(*args, **kwargs):
    """A native crash where serialisation would be (what jaxlib's executable.serialize() did)."""
    import faulthandler
    import signal

    faulthandler.disable()  # (no traceback of this intended crash in the test's output)
    os.kill(os.getpid(), signal.SIGSEGV)
