"""Compiled device programs kept on disk, so that a second run loads each one without tracing, lowering
or compiling it (JAX's persistent cache, compile_cache.py, saves only XLA's compile).

    loaded = load_or_compile("rounds", key, lambda: jitted.lower(*args, **static))
    loaded.compiled(*dynamic_args)   # loaded.hit: read from the cache

An entry is keyed by the caller's `key` (what determines the program: its static settings and its
arguments' shapes, dtypes and shardings; `describe` turns it into text) and by the environment: this
format, a hash of the package's source files (any edit is a new program), the jax and jaxlib versions,
Python's, the backend's platform and version, the devices (kind, count, ids, processes), the host CPU's
features on a CPU backend, XLA_FLAGS and the jax settings that change tracing. A key that cannot be told
apart from another one's across processes (a closure, an object known only by its address) compiles
and is not kept.

Where: `<the compile cache's directory>/executables/`, so --compile-cache DIR|off holds for these too
(off: compile every time, nothing written). A file holds MAGIC, the SHA-256 of the rest, then a pickle
of (the key's full text, the ids of the program's devices, jax's serialised executable, its input and
output trees); it is loaded onto those devices only (jaxlib 0.11.2 aborts the process when it is handed
more devices than the program has). A program that calls back to Python is not kept. It is written to a
temporary name and renamed (two jobs writing one key leave one whole entry); one that does not verify
(damaged, truncated, another key's, refused by the runtime) is compiled anew and replaced, with one
warning line. A program is compiled past JAX's persistent cache (compile_cache.bypassed): on CPU an
executable JAX loaded from there serialises without its code. DDTREE_EXECUTABLES=off keeps none (the
test suite's setting: jaxlib's `executable.serialize()` crashed its workers a few times per thousand
programs, docs/job-cost.md).
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import hashlib
import os
import pickle
import re
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jaxlib
import numpy as np
from jax._src import config as jax_config  # the settings that change tracing (no public list)
from jax.experimental import serialize_executable

from ddtree_jax import compile_cache

FORMAT = "ddtree-executable-1"
MAGIC = FORMAT.encode() + b"\n"  # then the SHA-256 of the rest, then the pickled entry
_DIGEST = hashlib.sha256().digest_size
SUBDIRECTORY = "executables"


@dataclasses.dataclass(frozen=True)
class Loaded:
    """A program ready to call: `compiled`, whether it was read from the cache (`hit`), and the seconds
    spent here (reading it, or lowering, compiling and writing it)."""

    compiled: jax.stages.Compiled
    hit: bool
    seconds: float


class Uncacheable(Exception):
    """A key holds something whose text does not identify it across processes."""


def load_or_compile(name: str, key: Any, lower: Callable[[], jax.stages.Lowered]) -> Loaded:
    """Program `name` of `key` read from the cache directory, else `lower().compile()`d and written there
    (see the module's docstring); never fails for a missing, damaged or unwritable entry."""
    begin = time.perf_counter()
    where = directory()
    text = None
    if where is not None:
        try:
            text = describe((FORMAT, name, key, environment()))
        except Uncacheable as e:
            compile_cache._warn(f"executable cache: program {name} is not kept ({e})")
    if text is None:
        return Loaded(lower().compile(), False, time.perf_counter() - begin)
    path = where / f"{_slug(name)}-{hashlib.sha256(text.encode()).hexdigest()[:40]}.exe"
    compiled = _read(path, text)
    if compiled is not None:
        return Loaded(compiled, True, time.perf_counter() - begin)
    with compile_cache.bypassed():  # compiled anew: what JAX's cache loaded does not serialise whole
        compiled = lower().compile()
    _write(path, text, compiled)
    return Loaded(compiled, False, time.perf_counter() - begin)


ENV_OFF = "DDTREE_EXECUTABLES"  # "off": no executables kept or read (the test suite's default)


def directory() -> Path | None:
    """Where executables go: `executables/` in JAX's compilation cache directory as --compile-cache
    (compile_cache.enable) or JAX_COMPILATION_CACHE_DIR set it; None when the cache is off or remote,
    or DDTREE_EXECUTABLES=off."""
    if os.environ.get(ENV_OFF, "").strip().lower() == "off":
        return None
    if not jax.config.jax_enable_compilation_cache:
        return None
    base = jax.config.jax_compilation_cache_dir
    if not base or "://" in base:
        return None
    return Path(base).expanduser() / SUBDIRECTORY


def signature(*args: Any) -> str:
    """The text of arguments as a key sees them: their tree, and each leaf's shape, dtype and sharding."""
    return describe(args)


# -- the key as text ---------------------------------------------------------------------------------------


def describe(value: Any) -> str:
    """`value` as text that is equal across processes exactly when the programs it determines are:
    arrays by shape, dtype and sharding, dataclasses by field, functions by qualified name (a closure
    or an object known by its address raises Uncacheable)."""
    if value is None or isinstance(value, bool | int | float | str | bytes):
        return repr(value)
    if isinstance(value, enum.Enum):
        return f"{type(value).__qualname__}.{value.name}"
    if isinstance(value, tuple | list):
        return "(" + ",".join(describe(v) for v in value) + ")"
    if isinstance(value, dict):
        return "{" + ",".join(sorted(f"{describe(k)}:{describe(v)}" for k, v in value.items())) + "}"
    if isinstance(value, np.generic):  # a numpy scalar: its value
        return f"{value.dtype.name}:{value.item()!r}"
    if isinstance(value, jax.Array | np.ndarray | jax.ShapeDtypeStruct):  # an argument: its type
        sharding = None if isinstance(value, np.ndarray) else getattr(value, "sharding", None)
        weak = int(getattr(value, "weak_type", False))
        return f"array{tuple(value.shape)}:{np.dtype(value.dtype).name}:{weak}:{_sharding(sharding)}"
    if isinstance(value, np.dtype):
        return f"dtype:{value.name}"
    if isinstance(value, jax.sharding.Sharding):
        return _sharding(value)
    if isinstance(value, jax.tree_util.PyTreeDef):
        return _checked(str(value))
    if isinstance(value, functools.partial):
        return f"partial({describe(value.func)},{describe(value.args)},{describe(value.keywords)})"
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = ",".join(f"{f.name}={describe(getattr(value, f.name))}" for f in dataclasses.fields(value))
        return f"{_qualified(type(value))}({fields})"
    if isinstance(value, type) or callable(value):
        return _qualified(value)
    return _checked(f"{_qualified(type(value))}:{value!r}")


def _qualified(obj: Any) -> str:
    """module:qualname of a class or function defined at a module's top level."""
    qualname = getattr(obj, "__qualname__", None)
    if qualname is None or "<" in qualname:
        raise Uncacheable(f"{obj!r} is not a top-level function or class")
    return f"{getattr(obj, '__module__', '?')}:{qualname}"


def _checked(text: str) -> str:
    """`text` unless it names an object by its address (different in every process)."""
    if re.search(r" at 0x[0-9a-fA-F]+", text):
        raise Uncacheable(f"{text[:80]!r} names an object by its address")
    return text


def _sharding(sharding: Any) -> str:
    """A sharding as text: mesh axes, sizes, device ids and spec, or the device."""
    if sharding is None:
        return "none"
    if isinstance(sharding, jax.sharding.NamedSharding):
        mesh = sharding.mesh
        ids = np.asarray(mesh.device_ids).tolist() if hasattr(mesh, "device_ids") else ()
        axes = tuple(zip(mesh.axis_names, mesh.axis_sizes, map(str, mesh.axis_types), strict=True))
        return f"named({axes},{ids},{sharding.spec},{sharding.memory_kind})"
    if isinstance(sharding, jax.sharding.SingleDeviceSharding):
        (device,) = sharding.device_set
        return f"single({device.id},{sharding.memory_kind})"
    return _checked(repr(sharding))


def _slug(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_-]+", "_", name)[:40] or "program"


@functools.cache
def source_hash() -> str:
    """SHA-256 of the package's Python source files (their paths and bytes): the code version."""
    root = Path(__file__).parent
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


@functools.cache
def _cpu_features() -> str:
    """The host CPU's feature flags (XLA:CPU compiles for them), hashed; '' where unknown."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        return ""
    return hashlib.sha256(" ".join(sorted(flags.split(":", 1)[-1].split())).encode()).hexdigest()[:16]


def environment() -> tuple:
    """What besides the caller's key determines an executable (see the module's docstring)."""
    devices = jax.devices()
    backend = devices[0].client
    settings = tuple(
        (name, value)
        for name, value in zip(jax_config.trace_context_names(), jax_config.trace_context(), strict=True)
        if value is None or isinstance(value, bool | int | float | str | enum.Enum)
    )
    return (
        source_hash(),
        jax.__version__,
        jaxlib.__version__,
        sys.version_info[:2],
        backend.platform,
        backend.platform_version,
        tuple((d.id, d.device_kind, d.process_index) for d in devices),
        jax.process_index(),
        _cpu_features() if backend.platform == "cpu" else "",
        os.environ.get("XLA_FLAGS", ""),
        settings,
    )


# -- reading and writing entries -----------------------------------------------------------------------


def _read(path: Path, text: str) -> jax.stages.Compiled | None:
    """The executable in `path` if it verifies and is of key `text`, else None (a bad one warns)."""
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as e:
        compile_cache._warn(f"executable cache: cannot read {path} ({e.strerror}); compiling instead")
        return None
    body = verified(raw)
    if body is None:
        compile_cache._warn(
            f"executable cache: damaged entry {path.name} (checksum mismatch); compiling again"
        )
        return None
    try:
        stored, device_ids, payload, in_tree, out_tree = pickle.loads(body)
        if stored != text:
            compile_cache._warn(f"executable cache: entry {path.name} is another program's; compiling again")
            return None
        by_id = {d.id: d for d in jax.devices()}
        devices = [by_id[i] for i in device_ids]  # (jaxlib aborts when they are not the program's own)
        return serialize_executable.deserialize_and_load(
            payload, in_tree, out_tree, execution_devices=devices
        )
    except Exception as e:  # a foreign or stale entry that passed the checksum: the runtime refused it
        compile_cache._warn(
            f"executable cache: entry {path.name} does not load ({type(e).__name__}); compiling again"
        )
        return None


def verified(raw: bytes) -> bytes | None:
    """The pickled part of an entry's bytes if its MAGIC and SHA-256 check, else None."""
    body = raw[len(MAGIC) + _DIGEST :]
    if raw[: len(MAGIC)] == MAGIC and raw[len(MAGIC) : len(MAGIC) + _DIGEST] == hashlib.sha256(body).digest():
        return body
    return None


def _unloaded(compiled: jax.stages.Compiled) -> Any:
    """jax's record of a compiled program (pxla.UnloadedMeshExecutable: devices, host callbacks), what
    serialize_executable pickles; Uncacheable when there is none or the program calls back to Python."""
    unloaded = getattr(compiled._executable, "_unloaded_executable", None)
    if unloaded is None:
        raise Uncacheable("jax cannot serialise this compiled program")
    if unloaded.host_callbacks:  # Python callbacks live in this process only
        raise Uncacheable("the program calls back to Python")
    return unloaded


def _entry(text: str, compiled: jax.stages.Compiled) -> bytes:
    """An entry's bytes: MAGIC, SHA-256, pickle of (key, device ids, executable, its in and out trees)."""
    payload, in_tree, out_tree = serialize_executable.serialize(compiled)
    device_ids = [d.id for d in _unloaded(compiled).device_list]
    body = pickle.dumps((text, device_ids, payload, in_tree, out_tree), protocol=pickle.HIGHEST_PROTOCOL)
    return MAGIC + hashlib.sha256(body).digest() + body


def _write(path: Path, text: str, compiled: jax.stages.Compiled) -> None:
    """Write the entry of `compiled` to `path` (compile_cache.write_atomically); a failure warns once
    and drops the entry."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        compile_cache._warn(
            f"executable cache: cannot write to {path.parent} ({e.strerror}); programs are not kept"
        )
        return

    def write() -> None:
        compile_cache.write_atomically(path, _entry(text, compiled))

    try:
        _unloaded(compiled)
        write()  # (in this process, as JAX writes its own entries: docs/job-cost.md)
    except Exception as e:  # a program that cannot be serialised still runs
        compile_cache._warn(f"executable cache: {path.name} is not kept ({type(e).__name__}: {e})")
