"""The package's floors: no module imports a module above its own (read from the source, imports inside
functions included), so the kernels, the quantized arrays, the configs and the model families stand
on what is below them only."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).parent.parent / "ddtree_jax"
# Floors from the bottom; a module imports modules of its own floor or below. Modules not listed (the
# loaders, target, drafter, engine, generation, the CLIs, the benchmarks) are the top floor.
FLOORS = {
    "ddtree_jax.errors": 0,
    "ddtree_jax.kernels": 0,  # and every kernel module: jax only, and each other
    "ddtree_jax.weights": 1,
    "ddtree_jax.collectives": 1,
    "ddtree_jax.quant.formats": 1,
    "ddtree_jax.quant": 2,
    "ddtree_jax.quant.arrays": 2,
    "ddtree_jax.sharding": 2,
    "ddtree_jax.config": 2,
    "ddtree_jax.kv_cache": 3,
    "ddtree_jax.attention": 3,
    "ddtree_jax.models.*": 4,  # the family modules and their shared pieces
    "ddtree_jax.models": 5,  # the registry and the config loader
}
TOP = 10


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in PACKAGE.rglob("*.py")}


def floor(module: str) -> int:
    if module in FLOORS:
        return FLOORS[module]
    if module.startswith("ddtree_jax.kernels."):
        return FLOORS["ddtree_jax.kernels"]
    if module.startswith("ddtree_jax.models."):
        return FLOORS["ddtree_jax.models.*"]
    return TOP


def imports(path: Path) -> set[str]:
    """The package modules a source file imports (`from a import b` counts a.b when b is a module)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name in MODULES}
        elif isinstance(node, ast.ImportFrom) and node.module in MODULES:
            subs = {f"{node.module}.{a.name}" for a in node.names} & MODULES.keys()
            plain = [a for a in node.names if f"{node.module}.{a.name}" not in MODULES]
            found |= subs | ({node.module} if plain else set())
    return found


def test_no_module_imports_upward():
    upward = [
        f"{m} (floor {floor(m)}) imports {d} (floor {floor(d)})"
        for m, path in sorted(MODULES.items())
        for d in sorted(imports(path))
        if d != m and floor(d) > floor(m)
    ]
    assert not upward, upward


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import circles of `graph` (module -> modules it imports): each strongly connected component
    of more than one module, or a module importing itself (Tarjan's algorithm)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(m: str) -> None:
        index[m] = low[m] = len(index)
        stack.append(m)
        on_stack.add(m)
        for d in sorted(graph.get(m, ())):
            if d not in index:
                visit(d)
                low[m] = min(low[m], low[d])
            elif d in on_stack:
                low[m] = min(low[m], index[d])
        if low[m] == index[m]:
            component = []
            while True:
                d = stack.pop()
                on_stack.discard(d)
                component.append(d)
                if d == m:
                    break
            if len(component) > 1 or m in graph.get(m, ()):
                found.append(sorted(component))

    for m in sorted(graph):
        if m not in index:
            visit(m)
    return found


def test_no_import_circle():
    """No two modules import each other, directly or through others (imports inside functions
    included): a type both need lives below both (requests.py below prefill and programs)."""
    graph = {m: {d for d in imports(path) if d != "ddtree_jax"} for m, path in MODULES.items()}
    assert not cycles(graph), cycles(graph)


def test_the_check_sees_a_circle():
    """The checker itself: a circle of three modules and a module importing itself are reported, a
    chain is not."""
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"a"}}) == [["a"]]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": set()}) == []


def test_kernels_import_no_other_package_module():
    """Every kernel imports kernels only: the quantized weights reach them as plain arrays and scales
    (quant.arrays' `kernel_experts`, `expert_weight`)."""
    kernels = [m for m in MODULES if m.startswith("ddtree_jax.kernels")]
    assert "ddtree_jax.kernels.fused_experts" in kernels
    for m in kernels:
        assert floor(m) == FLOORS["ddtree_jax.kernels"], m
        assert all(d.startswith("ddtree_jax.kernels") for d in imports(MODULES[m])), (m, imports(MODULES[m]))


def test_the_check_sees_an_upward_import(tmp_path):
    """The checker itself: a lower module importing the models registry is reported."""
    source = tmp_path / "config.py"
    source.write_text("def f():\n    from ddtree_jax.models import family_of\n")
    assert imports(source) == {"ddtree_jax.models"}
    assert floor("ddtree_jax.models") > floor("ddtree_jax.config")


SCRIPTS = PACKAGE.parent / "scripts"


def test_scripts_are_only_what_no_cli_does():
    """Every script in scripts/ says in its docstring why it is not a CLI sub-command, and none is a
    kernel benchmark or plot that `ddtree-bench` runs."""
    from ddtree_jax.bench.cli import SUBCOMMANDS

    for path in sorted(SCRIPTS.glob("*.py")):
        doc = ast.get_docstring(ast.parse(path.read_text())) or ""
        assert "A script, not a" in doc, f"{path.name}: its docstring does not say why it is a script"
        stem = path.stem.removeprefix("bench_").removeprefix("plot_").replace("_", "-")
        assert stem not in SUBCOMMANDS, f"{path.name}: `ddtree-bench {stem}` does this"


def test_scripts_stay_small():
    """scripts/ holds under 1,000 lines (issue 44): what grows there belongs in a CLI."""
    lines = sum(len(p.read_text().splitlines()) for p in SCRIPTS.glob("*.py"))
    assert lines < 1000, f"scripts/ holds {lines} lines"
