"""The package's imports point down its layers and never run in a circle (docs/architecture.md, "Layers").

Every import counts, including the ones inside functions (an import deferred to call time is still a
dependency); only ``if TYPE_CHECKING:`` blocks, which never run, are left out. Parsed, not imported, so
the test costs milliseconds.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "lightning_3d"

# Lowest first. A module may import from its own layer or any layer below; inside one layer the
# module graph must still be acyclic (checked below with the others).
LAYERS: list[set[str]] = [
    {"core"},
    {"testing"},
    {"tensor_parallel", "pipeline", "context_parallel", "zero", "moe", "transforms"},
    {"models", "data", "checkpoint", "monitoring", "planner"},
    {"parallel", "resilience"},
    {"plugins"},
    {"apps"},
]
LAYER_OF = {folder: index for index, folders in enumerate(LAYERS) for folder in folders}


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def runtime_imports(tree: ast.Module) -> list[ast.AST]:
    """Import statements that execute: everything but the bodies of ``if TYPE_CHECKING:``."""
    skipped: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            skipped.update(id(child) for stmt in node.body for child in ast.walk(stmt))
    return [n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom)) and id(n) not in skipped]


def import_graph() -> dict[str, set[str]]:
    paths = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {name: set() for name in paths}
    for name, path in paths.items():
        for node in runtime_imports(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                if node.level or not node.module:
                    raise AssertionError(f"{name}: relative import; the package uses absolute imports")
                targets = [f"{node.module}.{alias.name}" for alias in node.names] + [node.module]
            else:
                targets = [alias.name for alias in node.names]
            for target in targets:
                while target not in paths and "." in target:
                    target = target.rsplit(".", 1)[0]
                if target in paths and target != name and target.startswith("lightning_3d"):
                    graph[name].add(target)
                    break
    return graph


def layer(module: str) -> int:
    parts = module.split(".")
    if len(parts) == 1:
        return len(LAYERS)  # the package root (public API) sits above everything
    if parts[1] not in LAYER_OF:
        raise AssertionError(f"lightning_3d/{parts[1]} is in no layer: add it to LAYERS and to docs/architecture.md")
    return LAYER_OF[parts[1]]


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_every_folder_has_a_layer():
    folders = {p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert folders - {"conf"} == set(LAYER_OF), "a package folder without a layer (or a layer without a folder)"
    loose = sorted(p.name for p in PACKAGE.glob("*.py") if p.name != "__init__.py")
    assert not loose, f"modules loose at the top level: {loose}; each belongs in a layer's folder"


def test_no_import_runs_up_the_layers():
    graph = import_graph()
    upward = sorted(f"{a} -> {b}" for a, targets in graph.items() for b in targets if layer(b) > layer(a))
    assert not upward, "imports that run up the layers:\n" + "\n".join(upward)


def test_no_import_circle():
    assert not cycles(import_graph()), cycles(import_graph())


def test_the_checker_sees_circles_and_upward_imports():
    graph = {"lightning_3d.core.a": {"lightning_3d.core.b"}, "lightning_3d.core.b": {"lightning_3d.core.a"}, "lightning_3d.core.c": set()}
    assert cycles(graph) == [["lightning_3d.core.a", "lightning_3d.core.b"]]
    assert layer("lightning_3d.apps.cli") > layer("lightning_3d.plugins.strategy") > layer("lightning_3d.core.topology")
    tree = ast.parse("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import x\ndef f():\n    import y\n")
    assert [n.names[0].name for n in runtime_imports(tree) if isinstance(n, ast.Import)] == ["y"]


def test_the_strategy_is_wiring_and_the_dry_run_reads_none_of_its_privates():
    """The strategy module connects Lightning's hooks (under 350 lines, no check of its own: those are
    core.config's and plugins/checks.py's); the dry run shares its set-up through setup_parallel and
    touches no private name of it."""
    source = (PACKAGE / "plugins" / "strategy.py").read_text()
    assert len(source.splitlines()) < 350
    refusals = ("ValueError", "TypeError", "NotImplementedError", "LayoutRefused", "PermissionError")
    raised = [ast.unparse(n.exc) for n in ast.walk(ast.parse(source)) if isinstance(n, ast.Raise) and n.exc is not None]
    assert not [r for r in raised if r.startswith(refusals)], "the strategy validates input itself"
    for path in (PACKAGE / "apps" / "dry_run").rglob("*.py"):
        tree = ast.parse(path.read_text())
        assert not any(isinstance(n, ast.ImportFrom) and n.module == "lightning_3d.plugins.strategy" for n in ast.walk(tree))
        private = [n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute) and n.attr.startswith("_") and not n.attr.startswith("__")
                   and isinstance(n.value, ast.Name) and "strategy" in n.value.id]
        assert not private, f"{path.name} reads the strategy's {private}"
