"""pyproject.toml: one JAX for the main install and the test extra; every dependency used."""

import ast
import re
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

ROOT = Path(__file__).parent.parent
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
# distribution name -> the module its users import
MODULES = {"orbax-checkpoint": "orbax.checkpoint", "jaxlib": "jax"}


def name(requirement: str) -> str:
    """The distribution name of a requirement string, normalised (PEP 503: ml_dtypes is ml-dtypes)."""
    return re.sub(r"[-_.]+", "-", re.split(r"[<>=!~\[; ]", requirement, maxsplit=1)[0]).lower()


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
        # the runner, its plugins (-n; the rerun of a crashed worker's test), the linter, the packaging
        # test's wheel builder
        if name(requirement) in ("pytest", "pytest-xdist", "pytest-rerunfailures", "ruff", "setuptools"):
            continue
        module = name(requirement).replace("-", "_")
        assert re.search(rf"^\s*(import|from) {module}\b", tests + package, re.M), requirement


def source_packages() -> set[str]:
    """Every package of the source tree: the folders under a top-level package that hold an __init__.py."""
    tops = [p.parent for p in ROOT.glob("*/__init__.py") if p.parent.name != "tests"]
    return {
        ".".join(init.parent.relative_to(ROOT).parts) for top in tops for init in top.rglob("__init__.py")
    }


def test_the_wheel_holds_every_package_and_asset(tmp_path):
    """A non-editable install gets what the source tree has: every package, every asset, every command's
    module (a hand-written package list once left ddtree_jax.models out of the wheel)."""
    tree = tmp_path / "src"
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info", "build", "dist")
    for top in {p.split(".")[0] for p in source_packages()}:
        shutil.copytree(ROOT / top, tree / top, ignore=ignore)
    for name_ in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name_, tree / name_)
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q",
         "-w", str(tmp_path / "dist"), str(tree)],
        capture_output=True, text=True,
    )  # fmt: skip
    assert built.returncode == 0, built.stderr
    (wheel,) = (tmp_path / "dist").glob("*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    packages = {".".join(n.split("/")[:-1]) for n in names if n.endswith("/__init__.py")}
    assert packages == source_packages()
    assets = {
        p.relative_to(ROOT).as_posix() for p in (ROOT / "ddtree_jax" / "assets").rglob("*") if p.is_file()
    }
    assert assets and assets <= set(names), sorted(assets - set(names))
    (entry_points,) = [n for n in names if n.endswith(".dist-info/entry_points.txt")]
    for line in zipfile.ZipFile(wheel).read(entry_points).decode().splitlines():
        if "=" in line:
            module = line.split("=")[1].split(":")[0].strip()
            assert module.replace(".", "/") + ".py" in names, line


def imported(path: Path) -> set[str]:
    """The top-level modules a file imports (absolute imports only)."""
    tree = ast.parse(path.read_text())
    names = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    names |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.level == 0}
    return {n.split(".")[0] for n in names}


def test_every_import_is_declared():
    """No third-party import the install does not bring: the main code imports only the main
    dependencies, ddtree-compare and training their extras, the tests the test extra (and compare's)."""
    extras = PROJECT["optional-dependencies"]
    declared = {
        "main": {name(r) for r in PROJECT["dependencies"]},
        "compare": {name(r) for r in PROJECT["dependencies"] + extras["compare"]},
        "train": {name(r) for r in PROJECT["dependencies"] + extras["train"]},
        "tests": {name(r) for r in PROJECT["dependencies"] + extras["test"] + extras["compare"]},
    }
    own = {p.split(".")[0] for p in source_packages()} | {p.stem for p in (ROOT / "tests").glob("*.py")}
    inverse = {module.split(".")[0]: dist for dist, module in MODULES.items()}
    for path in [*ROOT.glob("ddtree_jax/**/*.py"), *ROOT.glob("tests/*.py")]:
        part = path.relative_to(ROOT).parts
        kind = {"tests": "tests", "compare": "compare"}.get(part[0], part[1] if len(part) > 2 else "main")
        kind = "train" if path.stem == "train" else kind if kind in declared else "main"
        # ddtree-bench plot: matplotlib; torch-step: torch
        kind = "compare" if part[-2:] in {("bench", "plot.py"), ("bench", "torch_step.py")} else kind
        for module in imported(path) - set(sys.stdlib_module_names) - own:
            assert name(inverse.get(module, module)) in declared[kind], (path, module)
