"""A pytest plugin that writes each test's CPU seconds (this process and its finished children, from
`resource.getrusage`) and wall seconds to a TSV, for measuring what the suite costs on a busy machine:

    PYTHONPATH=tests CPU_SECONDS_OUT=cpu.tsv python -m pytest tests -n 2 -p cpu_seconds

Lines: test id, CPU seconds, wall seconds, pytest-xdist worker (appended by every worker)."""

import os
import resource
import time

import pytest


def _cpu_seconds() -> float:
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    cpu, wall = _cpu_seconds(), time.time()
    yield
    line = [item.nodeid, f"{_cpu_seconds() - cpu:.1f}", f"{time.time() - wall:.1f}"]
    with open(os.environ.get("CPU_SECONDS_OUT", "cpu_seconds.tsv"), "a") as f:
        f.write("\t".join([*line, os.environ.get("PYTEST_XDIST_WORKER", "")]) + "\n")
