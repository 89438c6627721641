"""The tree is the architecture: the import graph has no cycle, steps never
import each other, and each layer imports only the layers below it."""

from __future__ import annotations

import ast
from pathlib import Path

from coopstudy.commit import sources

ROOT = sources.PACKAGE.parents[1]
# Lowest first. A module may import its own layer and any layer before it.
LAYERS = (
    ("coopstudy.errors", "coopstudy.workspace", "coopstudy.machine", "coopstudy.config", "coopstudy.ui"),
    ("coopstudy.record",),
    ("coopstudy.numerics", "coopstudy.inputs"),
    ("coopstudy.commit",),
    ("coopstudy.run", "coopstudy.scoring"),
    ("analysis",),
    ("coopstudy.steps",),
    ("coopstudy.study", "coopstudy.bench", "coopstudy.devsplit", "coopstudy.cli", "coopstudy.__main__"),
)


def _module_name(path: Path) -> str:
    rel = path.relative_to(ROOT / "src" if path.is_relative_to(ROOT / "src") else ROOT).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


def _graph() -> dict[str, set[str]]:
    files = [*sources.PACKAGE.rglob("*.py"), *(ROOT / "analysis").glob("*.py")]
    names = {_module_name(p): p for p in files}
    graph: dict[str, set[str]] = {}
    for name, path in names.items():
        edges: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                submodules = [f"{node.module}.{a.name}" for a in node.names if f"{node.module}.{a.name}" in names]
                # `from package import module` imports the module, not the package's names.
                targets = submodules if len(submodules) == len(node.names) else [node.module, *submodules]
            edges.update(t for t in targets if t in names and t != name)
        graph[name] = edges
    return graph


def _layer(module: str) -> int:
    for i, prefixes in enumerate(LAYERS):
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return i
    raise AssertionError(f"{module} belongs to no layer; add it to LAYERS")


def test_no_import_cycle():
    graph = _graph()
    state: dict[str, int] = {}

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                raise AssertionError("import cycle: " + " -> ".join([*path[path.index(nxt):], nxt]))
            if nxt not in state:
                visit(nxt, [*path, nxt])
        state[node] = 2

    for start in sorted(graph):
        if start not in state:
            visit(start, [start])


def test_no_step_imports_another_step():
    graph = _graph()
    crossing = sorted(
        f"{a} imports {b}" for a, edges in graph.items() if a.startswith("coopstudy.steps.") for b in edges if b.startswith("coopstudy.steps.")
    )
    assert crossing == []


def test_each_layer_imports_only_layers_below_it():
    graph = _graph()
    upward = sorted(f"{a} imports {b}" for a, edges in graph.items() for b in edges if _layer(b) > _layer(a))
    assert upward == []
