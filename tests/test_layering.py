"""One engine: the layers import only what they may. Backends (`ftbench/sim/`, `ftbench/engine/`)
do not import each other; strategies import no backend, run loop or executor (timing a
candidate plan through the simulator, `ftbench.sim.simulator`, is allowed); membership
has one writer, the run loop; and the house has no import circles and no private name used
across modules, in any package."""
import ast
from pathlib import Path

import pytest

from ftbench.cluster import Cluster

ROOT = Path(__file__).resolve().parents[1]
# Where each installed package's files are in the checkout (pyproject.toml's package-dir).
PACKAGES = {"ftbench": "ftbench", "ftbench.strategies": "strategies", "ftbench.models": "models",
            "hydra_plugins": "hydra_plugins"}


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names |= {f"{node.module}.{a.name}" for a in node.names}
    return names


def _offending(folder: str, forbidden: tuple[str, ...]) -> list[str]:
    bad = []
    target = ROOT / folder
    for path in sorted(target.rglob("*.py")) if target.is_dir() else [target]:
        for name in _imports(path):
            if any(name == f or name.startswith(f + ".") for f in forbidden):
                bad.append(f"{path.relative_to(ROOT)} imports {name}")
    return bad


def test_backends_do_not_import_each_other():
    assert _offending("ftbench/engine", ("ftbench.sim",)) == []
    assert _offending("ftbench/sim", ("ftbench.engine",)) == []


def test_strategies_import_no_backend_loop_or_executor():
    forbidden = ("ftbench.engine", "ftbench.loop", "ftbench.run", "ftbench.sim.backend", "ftbench.sim.cache")
    assert _offending("strategies", forbidden) == []


def test_the_shared_loop_holds_no_backend_code():
    assert _offending("ftbench/loop.py", ("ftbench.engine", "ftbench.sim.backend", "torch")) == []


def test_strategies_see_membership_read_only():
    view = Cluster(4, 2, 1, 8, 1, 0.0).view()
    assert view.pp == 4 and view.is_alive(3) and view.node_of(5) == 5
    with pytest.raises(AttributeError, match="Recovery"):
        view.spares = 0
    with pytest.raises(AttributeError, match="run loop"):
        view.fail(3)
    with pytest.raises(AttributeError):
        view.alive.discard(3)


def _modules() -> dict[str, Path]:
    """Every module of the installed packages, by dotted name."""
    modules = {}
    for package, folder in PACKAGES.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = list(path.relative_to(ROOT / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join([package, *parts])] = path
    return modules


def _imported(name: str, path: Path, node: ast.ImportFrom | ast.Import, modules) -> list[tuple[str, str | None]]:
    """(module, name taken from it or None) for one import statement, function-level ones too."""
    if isinstance(node, ast.Import):
        return [(a.name, None) for a in node.names if a.name in modules]
    base = node.module or ""
    if node.level:  # relative: from the module's own package
        package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        base = ".".join(package[:len(package) - node.level + 1] + ([node.module] if node.module else []))
    found = []
    for alias in node.names:
        if f"{base}.{alias.name}" in modules:  # a submodule
            found.append((f"{base}.{alias.name}", None))
        elif base in modules:
            found.append((base, alias.name))
    return found


def _graph() -> tuple[dict[str, set[str]], list[str]]:
    modules = _modules()
    edges: dict[str, set[str]] = {name: set() for name in modules}
    private = []
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            for target, taken in _imported(name, path, node, modules):
                if target != name:
                    edges[name].add(target)
                if taken is not None and taken.startswith("_") and not taken.startswith("__") and target != name:
                    private.append(f"{path.relative_to(ROOT)} imports {target}.{taken}")
    return edges, private


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def test_the_graph_sees_every_kind_of_import():
    """The checks below would pass on a graph that missed imports: it must see a function-level
    import, a relative one, a strategy's (installed as ftbench.strategies) and a submodule."""
    edges, _ = _graph()
    assert "ftbench.distributed.launch" in edges["ftbench.run"]  # inside a function
    assert "ftbench.strategies.base" in edges["ftbench.strategies.recycle"]
    assert "ftbench.models.gpt" in edges["ftbench.distributed.worker"]
    assert any(name.startswith("ftbench.strategies.") for name in edges["ftbench.strategies"])
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_circles():
    assert _cycles(_graph()[0]) == []


def test_no_private_name_is_imported_across_modules():
    assert _graph()[1] == []
