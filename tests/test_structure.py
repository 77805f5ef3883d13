"""The package's structure: no import circle between fsdp_compose's modules, and the step path's modules import
only the ones below them (docs/design.md's order), so calls go down.

The import graph is read from the source with ``ast``: every ``import`` / ``from ... import`` statement, at module
level, inside functions and under ``if TYPE_CHECKING:`` alike (a circle a newcomer has to follow is one, whether or
not Python resolves it lazily). ``python -m tests.test_structure`` prints the graph's circles and every class's size.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "fsdp_compose"
# The step path, bottom to top (docs/design.md, "Files"): each imports only modules before it in this list.
STEP_PATH = [
    "sharding",
    "flat",
    "full_params",
    "grads",
    "unit",
    "state",
    "program",
    "agreement",
    "backward",
    "checks",
    "step",
    "hooks",
    "api",
    "init",
]


def _module_names() -> dict[str, Path]:
    names = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return names


def _typing_only(tree: ast.Module) -> set[int]:
    """ids of the nodes under ``if TYPE_CHECKING:``: annotations, which call nothing and import nothing at run time."""
    found: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            found.update(id(inner) for statement in node.body for inner in ast.walk(statement))
    return found


def import_graph() -> dict[str, set[str]]:
    """fsdp_compose module -> the fsdp_compose modules it imports at run time (``from . import api`` imports
    ``api``, not the package; ``from .api import x`` imports ``api``; imports for annotations only do not count)."""
    modules = _module_names()
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        deps: set[str] = set()
        tree = ast.parse(path.read_text(), str(path))
        typing_only = _typing_only(tree)
        for node in ast.walk(tree):
            if id(node) in typing_only:
                continue
            if isinstance(node, ast.Import):
                deps.update(alias.name for alias in node.names if alias.name in modules)
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                for alias in node.names:
                    if f"{target}.{alias.name}" in modules:
                        deps.add(f"{target}.{alias.name}")
                    elif target in modules:
                        deps.add(target)
        graph[name] = deps - {name}
    return graph


def circles(graph: dict[str, set[str]]) -> list[frozenset[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[frozenset[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(frozenset(component))
    return found


def test_the_graph_sees_the_imports_it_should() -> None:
    """The parser itself: relative imports, submodules imported by name, imports inside functions."""
    graph = import_graph()
    assert "fsdp_compose.collectives" in graph["fsdp_compose.unit"]
    assert "fsdp_compose.api" in graph["fsdp_compose.integrations.fsdp2"]  # from . import api
    assert "fsdp_compose" not in graph["fsdp_compose.integrations.fsdp2"]
    assert "fsdp_compose.recorder" in graph["fsdp_compose.plan.step"]  # from fsdp_compose.recorder import ...
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [frozenset("abc")]
    assert circles({"a": {"b"}, "b": set()}) == []


def test_no_import_circle_at_all() -> None:
    # The step engine's old circle (checks -> state -> step -> checks) is gone: the hooks (hooks.py) sit above the step
    # they drive and make it at lazy init; a unit's state (state.py) holds it for the hooks and never calls it.
    graph = import_graph()
    assert circles(graph) == []
    assert "fsdp_compose.step" in graph["fsdp_compose.hooks"]
    step_layer = {"fsdp_compose.hooks", "fsdp_compose.step", "fsdp_compose.backward", "fsdp_compose.program"}
    assert not graph["fsdp_compose.state"] & step_layer


def _torch_imports(path: Path) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            found.add(node.module)
    return found


def test_the_engine_has_no_planner_or_fake_tensor_case() -> None:
    """The planner drives the engine from outside (plan/simulate.py): nothing outside ``plan/`` imports it or torch's
    fake tensors, so no code path of a real step exists only for the simulation."""
    graph = import_graph()
    for name, path in _module_names().items():
        if name.startswith("fsdp_compose.plan"):
            continue
        assert not {dep for dep in graph[name] if dep.startswith("fsdp_compose.plan")}, name
        assert not {m for m in _torch_imports(path) if "fake" in m}, name


def test_the_step_path_imports_only_downwards() -> None:
    graph = import_graph()
    for index, name in enumerate(STEP_PATH):
        above = {f"fsdp_compose.{higher}" for higher in STEP_PATH[index + 1 :]}
        assert not graph[f"fsdp_compose.{name}"] & above, f"{name} imports a module above it: {sorted(above)}"


if __name__ == "__main__":
    lines = ["import circle: " + " <-> ".join(sorted(circle)) for circle in circles(import_graph())]
    sys.stdout.write("\n".join(lines) + "\n")
