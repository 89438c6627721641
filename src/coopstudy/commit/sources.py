"""The source files whose bytes a commitment binds, derived from the tree.

The numerical sources are every module of `coopstudy/numerics/`: the
protocol's objective, batching, update and distributed step, the gate that
checks them, and what they compute with (flops, onednn); a file added there
is bound without a list to edit.
Names are relative to the package, e.g. `numerics/objective.py`. The gate
receipt binds them.

The deciding sources are every file that decides a number of the study: the
import closure of the training worker and the stages that launch it, data
preparation, evaluation and the report, and every module of
`coopstudy/inputs/`, `coopstudy/numerics/` and `analysis/` (DECIDING_ROOTS,
DECIDING_FOLDERS). Names are relative to the project, e.g.
`src/coopstudy/run/worker.py`, `analysis/screens.py`. The plan binds them;
every stage after it refuses when one changed (`coopstudy.commit.require`,
`analysis.records`). One list, derived: `deciding_sources()`.
"""

from __future__ import annotations

import ast
from importlib import metadata
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
    return _hashed(root, numerical_sources(root))


def _hashed(root: Path, names: list[str]) -> tuple[str, dict[str, str]]:
    """(combined sha256, {file: sha256}) of the files `names` under `root`."""
    files = {name: workspace.sha256_file(root / name) for name in names}
    combined = workspace.sha256_bytes("".join(f"{name}\t{sha}\n" for name, sha in sorted(files.items())).encode())
    return combined, files


WORKER = "coopstudy.run.worker"
"""The module every training process runs, from its start to its exit
(`python -m coopstudy.run.worker`, started by coopstudy.run.launch, never
imported by a stage): so the plan binds what a rank runs inside its timed
seconds, and not the command line's help texts (coopstudy.cli)."""

DECIDING_ROOTS = (
    WORKER,
    "coopstudy.steps.prepare",
    "coopstudy.steps.train",
    "coopstudy.steps.evaluate",
    "coopstudy.steps.report",
    "coopstudy.scoring",
)
"""Modules whose import closure decides the study's numbers: the training
process (started by command, so named here, not imported), the stages that
prepare inputs, launch and time training, score models and report."""
DECIDING_FOLDERS = ("src/coopstudy/inputs", "src/coopstudy/numerics", "analysis")
"""Folders (relative to the project) every module of which decides numbers,
imported or not: a module added there is bound without a list to edit."""


PROBE_ROOTS = (WORKER, "coopstudy.steps.probe")
"""What runs and times a probe: the training process and the stage that
launches it (their import closure is the `training` sources of a receipt)."""


def project_dir() -> Path:
    """The checkout this package was imported from: the folder above `src/`."""
    return PACKAGE.parents[1]


def _folder_modules(folder: str) -> list[str]:
    base = project_dir() / folder
    prefix = folder.removeprefix("src/").replace("/", ".")
    return [f"{prefix}.{p.stem}" if p.stem != "__init__" else prefix for p in sorted(base.glob("*.py"))]


def deciding_sources() -> list[str]:
    """Every source file that decides a number of the study, relative to the project, sorted."""
    modules = [*DECIDING_ROOTS, *(m for folder in DECIDING_FOLDERS for m in _folder_modules(folder))]
    return closure(*modules)


def deciding_sources_sha256() -> tuple[str, dict[str, str]]:
    """(combined sha256, {file: sha256}) of deciding_sources()."""
    return _hashed(project_dir(), deciding_sources())


def probe_sources_sha256() -> dict[str, str]:
    """{file: sha256} of the import closure of PROBE_ROOTS."""
    return _hashed(project_dir(), closure(*PROBE_ROOTS))[1]


def changed(old: dict[str, str], new: dict[str, str]) -> list[str]:
    """The names whose sha256 differs between `old` and `new` ({name: sha256}),
    each with what happened to it: `name (changed|new|removed)`, sorted."""
    return [
        f"{name} ({'removed' if name not in new else 'new' if name not in old else 'changed'})"
        for name in sorted(set(old) | set(new))
        if old.get(name) != new.get(name)
    ]


def changed_sources(committed: dict[str, str]) -> list[str]:
    """The deciding sources that differ from `committed` ({file: sha256}), as `changed` words them."""
    return changed(committed, deciding_sources_sha256()[1])


def library_versions() -> dict[str, str]:
    # From the installed distributions' metadata: importing them to ask would
    # cost every refusal seconds (torch.__version__ is the same string).
    return {name: metadata.version(name) for name in ("torch", "transformers")}


_PARSED: dict[Path, tuple[str, frozenset[str]]] = {}
"""Source file -> (its text, _imports of it). A stage derives the same
closures many times (every step key, every check of the plan re-derives
them): parsed once while its text is unchanged, the keys of a standalone
`evaluate` took 0.1 s instead of 1.7 s."""


def _imports(path: Path) -> frozenset[str]:
    """The project modules `path` imports, at the top or inside a function."""
    text = path.read_text()
    parsed = _PARSED.get(path)
    if parsed is not None and parsed[0] == text:
        return parsed[1]
    found: set[str] = set()
    for node in ast.walk(ast.parse(text, str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            # `from coopstudy.commit import ledger`: the names may be modules.
            found.update(f"{node.module}.{a.name}" for a in node.names)
    kept = frozenset(m for m in found if m.split(".")[0] in ("coopstudy", "analysis"))
    _PARSED[path] = (text, kept)
    return kept


def module_file(module: str) -> Path | None:
    """The source file of a project module, or None for a name that is not a module."""
    root = PACKAGE.parent if module.startswith("coopstudy") else project_dir()
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
    root = project_dir()
    return sorted({str(p.relative_to(root)) for p in seen.values()})
