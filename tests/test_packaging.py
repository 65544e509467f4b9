"""pyproject.toml: one JAX for the main install and the test extra; every dependency used."""

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).parent.parent
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
# distribution name -> the module its users import
MODULES = {"orbax-checkpoint": "orbax.checkpoint", "jaxlib": "jax"}


def name(requirement: str) -> str:
    """The distribution name of a requirement string."""
    return re.split(r"[<>=!~\[; ]", requirement, maxsplit=1)[0]


def sources(*folders: str) -> str:
    """All Python source under the folders, as one text."""
    return "\n".join(p.read_text() for f in folders for p in (ROOT / f).rglob("*.py"))


def test_one_jax_everywhere():
    """The main install pins the JAX that CI tests; no extra asks for another."""
    pins = {name(r): r for r in PROJECT["dependencies"] if name(r) in ("jax", "jaxlib")}
    assert pins == {"jax": "jax==0.11.2", "jaxlib": "jaxlib==0.11.2"}
    for extra in PROJECT["optional-dependencies"].values():
        assert not [r for r in extra if name(r) in ("jax", "jaxlib")], extra


def test_every_dependency_is_imported():
    package = sources("ddtree_jax")
    for requirement in PROJECT["dependencies"]:
        module = MODULES.get(name(requirement), name(requirement).replace("-", "_"))
        assert re.search(rf"^\s*(import|from) {re.escape(module)}\b", package, re.M), requirement
    tests = sources("tests")
    for requirement in PROJECT["optional-dependencies"]["test"]:
        if name(requirement) in ("pytest", "pytest-xdist", "ruff"):  # the runner, its -n plugin, the linter
            continue
        module = name(requirement).replace("-", "_")
        assert re.search(rf"^\s*(import|from) {module}\b", tests + package, re.M), requirement
