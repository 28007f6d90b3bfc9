"""One engine: the layers import only what they may. Backends (`ftbench/sim/`, `ftbench/engine/`)
do not import each other; strategies import no backend, run loop or executor (timing a
candidate plan through the simulator, `ftbench.sim.simulator`, is allowed); and membership
has one writer, the run loop."""
import ast
from pathlib import Path

import pytest

from ftbench.cluster import Cluster

ROOT = Path(__file__).resolve().parents[1]


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
