"""A pytest plugin that writes each test's compile figures as a JSON line, to see where the suite's
time goes and whether JAX's persistent compilation cache pays:

    PYTHONPATH=tests COMPILE_STATS_OUT=stats/ python -m pytest tests -n 2 -p compile_stats \
        -p no:rerunfailures

(with JAX_ENABLE_COMPILATION_CACHE=true JAX_COMPILATION_CACHE_DIR=... to measure the cache, which
conftest.py turns off). A line: the test id, its wall seconds, and the sums of JAX's monitoring events
during it: counts (`/jax/compilation_cache/cache_hits`, `.../cache_misses`, ...) and seconds (names
ending in `:s`: `/jax/core/compile/backend_compile_duration:s`, `.../compile_time_saved_sec:s`), and
`get`/`put` (count) and `get:s`/`put:s` (seconds): the cache's reads and writes, timed here. One file
per process under COMPILE_STATS_OUT. (tests/test_compile_cache.py's `events` fixture clears JAX's
listeners: in a worker after it, only `get`/`put` and the wall are counted.)"""

import json
import os
import time
from pathlib import Path

import pytest
from jax._src import compilation_cache, monitoring

_STATS: dict = {}


def _count(event: str, **_) -> None:
    _STATS[event] = _STATS.get(event, 0) + 1


def _seconds(event: str, secs: float, **_) -> None:
    _STATS[event + ":s"] = _STATS.get(event + ":s", 0.0) + secs


def _timed(fn, name: str):
    def timed(*args, **kwargs):
        start = time.monotonic()
        try:
            return fn(*args, **kwargs)
        finally:
            _seconds(name, time.monotonic() - start)
            _count(name)

    return timed


monitoring.register_event_listener(_count)
monitoring.register_event_duration_secs_listener(_seconds)
compilation_cache.put_executable_and_time = _timed(compilation_cache.put_executable_and_time, "put")
compilation_cache.get_executable_and_time = _timed(compilation_cache.get_executable_and_time, "get")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    _STATS.clear()
    start = time.monotonic()
    yield
    folder = Path(os.environ.get("COMPILE_STATS_OUT", "compile_stats"))
    folder.mkdir(parents=True, exist_ok=True)
    name = f"{os.environ.get('PYTEST_XDIST_WORKER', 'main')}-{os.getpid()}.jsonl"
    with open(folder / name, "a") as f:
        f.write(json.dumps({"test": item.nodeid, "wall": time.monotonic() - start, **_STATS}) + "\n")
