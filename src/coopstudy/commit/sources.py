"""The source files whose bytes a commitment binds, derived from the tree.

The numerical sources (the protocol's: objective, batching, update, the
distributed step and the gate that checks them) are every module of
`coopstudy/numerics/`: a file added there is bound without a list to edit.
Names are relative to the package, e.g. `numerics/objective.py`.
"""

from __future__ import annotations

import ast
from pathlib import Path

from coopstudy import workspace

PACKAGE = Path(__file__).resolve().parents[1]
NUMERICS = "numerics"
GATE_SUBJECT = "numerical-sources"
"""The ledger subject of every gate receipt: one receipt serves every preset."""


def numerical_sources(directory: Path | None = None) -> list[str]:
    """The numerical source files of the package at `directory` (default: this one)."""
    root = Path(directory) if directory is not None else PACKAGE
    return sorted(str(p.relative_to(root)) for p in (root / NUMERICS).glob("*.py") if p.name != "__init__.py")


def numerical_sources_sha256(directory: Path | None = None) -> tuple[str, dict[str, str]]:
    """(combined sha256, {file: sha256}) of the numerical sources of the package at
    `directory` (default: this one)."""
    root = Path(directory) if directory is not None else PACKAGE
    files = {name: workspace.sha256_file(root / name) for name in numerical_sources(root)}
    combined = workspace.sha256_bytes("".join(f"{name}\t{sha}\n" for name, sha in sorted(files.items())).encode())
    return combined, files


def library_versions() -> dict[str, str]:
    import torch
    import transformers

    return {"torch": torch.__version__, "transformers": transformers.__version__}


def _imports(path: Path) -> set[str]:
    """The project modules `path` imports, at the top or inside a function."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            # `from coopstudy.commit import ledger`: the names may be modules.
            found.update(f"{node.module}.{a.name}" for a in node.names)
    return {m for m in found if m.split(".")[0] in ("coopstudy", "analysis")}


def module_file(module: str) -> Path | None:
    """The source file of a project module, or None for a name that is not a module."""
    root = PACKAGE.parent if module.startswith("coopstudy") else PACKAGE.parents[1]
    base = root.joinpath(*module.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def closure(*modules: str) -> list[str]:
    """Every project source file the modules import, directly or through each
    other, themselves included: relative to the project root, sorted."""
    seen: dict[str, Path] = {}
    todo = list(modules)
    while todo:
        name = todo.pop()
        path = module_file(name)
        if path is None or name in seen:
            continue
        seen[name] = path
        todo.extend(_imports(path))
        # A package's __init__ runs before any of its modules.
        parent = name.rpartition(".")[0]
        if parent:
            todo.append(parent)
    root = PACKAGE.parents[1]
    return sorted({str(p.relative_to(root)) for p in seen.values()})
