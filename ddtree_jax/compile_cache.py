"""JAX's persistent compilation cache for every command: a second identical run loads its programs.

Default: on, under `$XDG_CACHE_HOME/ddtree-jax/xla` (else `~/.cache/ddtree-jax/xla`); `--compile-cache
DIR` puts it elsewhere, `--compile-cache off` turns it off. A cache directory set in the environment
(`JAX_COMPILATION_CACHE_DIR`) wins over the default, not over the flag, and is left to JAX as it is;
`JAX_ENABLE_COMPILATION_CACHE=false` without the flag means off.

What keys an entry (jax/_src/cache_key.py, 0.11.2): the program's StableHLO, the jaxlib version, the
backend's platform and platform version (the CUDA version on GPU), the devices' topology fingerprint
(device kinds), the compile options and the XLA flags. Entries also go into one subdirectory per jax
version, platform and device kind, so that a cache shared by several machines (a home directory on
NFS) keeps theirs apart and an old version's entries can be deleted whole.

Damaged entries. JAX reads an entry, decompresses it and deserialises the executable. A damaged zlib
entry is refused by zlib's checksum and recompiled with a warning, but the damaged file stays (JAX never
overwrites an entry), so every later run warns and recompiles again; zstd (used when `zstandard` is
installed, or Python >= 3.14) writes no checksum, and an executable damaged past its header crashes the
process on load (SIGILL on CPU, seen with jax 0.11.2). So entries are written through `CheckedCache`:
each file carries a SHA-256 of its bytes, is written to a temporary name and renamed (a killed process
leaves no partial entry), and one that does not verify is deleted and recompiled. A directory that
cannot be written warns once and the run goes on without the cache.

Serialisation crashes. jaxlib's `executable.serialize()`, which JAX calls to write an entry, crashed
pytest-xdist workers of the suite a few times per thousand programs on CPU (SIGSEGV, SIGABRT:
docs/job-cost.md); no Python `except` catches that. Writing entries from forked children was tried
(2026-12-07) and withdrawn: the workers then crashed inside XLA's compiler instead.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import os
import re
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import jax
from jax._src import compilation_cache as jax_cache  # the cache JAX reads and writes (no public hook)
from jax._src.compilation_cache_interface import CacheInterface

from ddtree_jax.errors import DDTreeError

OFF = "off"
ENV_DIR = "JAX_COMPILATION_CACHE_DIR"
ENV_ENABLE = "JAX_ENABLE_COMPILATION_CACHE"
ENV_MIN_SECONDS = "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"
# Programs that compile faster than this are not written. JAX's default (1 s) leaves out most of a small
# model's programs on a GPU; below ~0.1 s a cache read costs about what it saves.
MIN_COMPILE_SECONDS = 0.1
MAGIC = b"ddtree-xla-cache-1\n"  # then the SHA-256 of the rest, then JAX's (compressed) entry
_DIGEST = hashlib.sha256().digest_size


# The --compile-cache flag, one definition for every command: (option strings, argparse keywords).
FLAG = (
    ("--compile-cache",),
    dict(
        metavar="DIR|off",
        help="keep compiled programs under DIR, so a second identical run loads them instead of "
        f"compiling (default: ${ENV_DIR} if set, else ~/.cache/ddtree-jax/xla); 'off': compile every time",
    ),
)


def add_flag(parser: argparse.ArgumentParser) -> None:
    """Give `parser` the --compile-cache flag (every command shares this definition)."""
    parser.add_argument(*FLAG[0], **FLAG[1])


def default_dir() -> Path:
    """The per-user cache directory: $XDG_CACHE_HOME/ddtree-jax/xla, else ~/.cache/ddtree-jax/xla."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "ddtree-jax" / "xla"


def subdirectory() -> str:
    """Where this process's entries go inside the cache: jax version, platform and device kind
    (initialises the backend: call after `jax.distributed.initialize`)."""
    device = jax.devices()[0]
    name = f"jax-{jax.__version__}-{device.platform}-{device.device_kind}"
    return re.sub(r"[^A-Za-z0-9._-]+", "_", name)


def enable(setting: str | None) -> Path | None:
    """Apply --compile-cache before the first compile: DIR, `off` or None (the environment's directory,
    else the default). Returns the directory entries go to (None: no cache, or the environment's,
    which JAX handles as it is)."""
    if setting is not None and not setting.strip():
        raise DDTreeError("--compile-cache: give a directory or 'off'")
    jax_cache.reset_cache()  # forget a cache set up before (JAX sets one up at its first compile)
    if setting is None and os.environ.get(ENV_ENABLE, "").strip().lower() in ("0", "false"):
        setting = OFF  # the user turned JAX's cache off in the environment
    if setting is not None and setting.strip().lower() == OFF:
        jax.config.update("jax_enable_compilation_cache", False)
        return None
    jax.config.update("jax_enable_compilation_cache", True)
    if ENV_MIN_SECONDS not in os.environ:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", MIN_COMPILE_SECONDS)
    if setting is None and os.environ.get(ENV_DIR):
        # the user's (or the test suite's) own directory: JAX's plain entries, as they asked
        jax.config.update("jax_compilation_cache_dir", os.environ[ENV_DIR])
        return None
    directory = Path(setting).expanduser() if setting is not None else default_dir()
    directory = directory / subdirectory()
    why = _unwritable(directory)
    if why is not None:
        _warn(f"compile cache: {directory} is not writable ({why}); compiling without a cache")
        jax.config.update("jax_enable_compilation_cache", False)
        return None
    install(directory)
    return directory


@contextlib.contextmanager
def bypassed() -> Iterator[None]:
    """Inside, JAX's persistent cache is neither read nor written (executables.py compiles through it:
    on CPU an executable that JAX loaded from its cache serialises without its code, jaxlib 0.11.2,
    and such an entry fails when run: `NOT_FOUND: Function ... not found`)."""
    with jax_cache._cache_initialized_mutex:
        saved = jax_cache._cache_checked, jax_cache._cache_used
        jax_cache._cache_checked, jax_cache._cache_used = True, False
    try:
        yield
    finally:
        with jax_cache._cache_initialized_mutex:
            jax_cache._cache_checked, jax_cache._cache_used = saved


def write_atomically(path: Path, data: bytes) -> None:
    """`data` into a temporary file beside `path`, then renamed to it: a reader sees no file, the old
    one or the whole new one, and two writers leave one whole file."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def install(directory: Path) -> None:
    """Make JAX read and write `directory` through a `CheckedCache` from its next compile on."""
    jax.config.update("jax_compilation_cache_dir", str(directory))
    jax_cache.reset_cache()
    with jax_cache._cache_initialized_mutex:
        jax_cache._cache = CheckedCache(directory)
        jax_cache._cache_initialized = True


def _unwritable(directory: Path) -> str | None:
    """Why files cannot be created in `directory` (created if absent), or None when they can."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=directory, prefix=".probe-"):
            pass
    except OSError as e:
        return e.strerror or str(e)
    return None


_warned: set[str] = set()
PREFIX = "ddtree-jax: "


def _warn(message: str) -> None:
    """One line on stderr, once per kind of message per process."""
    kind = message.split("(")[0]
    if kind not in _warned:
        _warned.add(kind)
        print(f"{PREFIX}{message}", file=sys.stderr, flush=True)


class CheckedCache(CacheInterface):
    """JAX's cache interface over one directory: one file per key holding MAGIC, the SHA-256 of the
    entry and the entry; written by rename, verified on read (a bad one is deleted: a miss)."""

    def __init__(self, directory: Path):
        self._path = Path(directory)

    def _file(self, key: str) -> Path:
        if not key or "/" in key:
            raise ValueError(f"bad compilation cache key {key!r}")
        return self._path / f"{key}-ddtree"

    def get(self, key: str) -> bytes | None:
        """The entry of `key`, or None when absent or damaged (then deleted so it is written anew)."""
        path = self._file(key)
        try:
            raw = path.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as e:
            _warn(f"compile cache: cannot read {path} ({e.strerror}); compiling instead")
            return None
        head, value = raw[: len(MAGIC) + _DIGEST], raw[len(MAGIC) + _DIGEST :]
        if head[: len(MAGIC)] == MAGIC and head[len(MAGIC) :] == hashlib.sha256(value).digest():
            return value
        _warn(f"compile cache: damaged entry {path.name} (checksum mismatch); deleted, compiling again")
        path.unlink(missing_ok=True)
        return None

    def put(self, key: str, value: bytes) -> None:
        """Write the entry of `key` unless present; a failed write warns once and is dropped."""
        path = self._file(key)
        if path.exists():
            return
        try:
            write_atomically(path, MAGIC + hashlib.sha256(value).digest() + value)
        except OSError as e:
            _warn(f"compile cache: cannot write to {self._path} ({e.strerror}); programs are not kept")

    def clear(self) -> None:
        """Delete every entry."""
        for path in self._path.glob("*-ddtree"):
            path.unlink(missing_ok=True)
