"""Conversation documents for replay and retention probes, from a configurable
source (`data.replay_source`):

- 'pydoc': real public text that ships with CPython, so nothing is fetched.
  First the documentation topics (`pydoc_data.topics`), cut at paragraph
  boundaries into parts, each a user request and an assistant answer; when a
  preset needs more documents than that, the docstrings of the standard
  library's public modules, classes and functions (read with `ast`, never
  imported) follow.
- a path to a JSONL or Parquet export of a chat dataset with a `messages`
  column of `{"role", "content"}` turns.

The pool comes in a fixed order without duplicates (by content); choosing
replay and retention documents from it is the caller's job.
"""

from __future__ import annotations

import ast
import json
import platform
import re
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from coopstudy import workspace
from coopstudy.errors import UserError

PYDOC = "pydoc"
CHUNK_CHARS = 1000
"""Assistant text per pydoc document: a few hundred tokens."""
MIN_CHARS = 120
"""Shorter pydoc texts say too little to be worth a document."""
ROLES = ("system", "user", "assistant")
# Standard-library folders that are tests, demos, GUI or vendored code.
_SKIP_DIRS = {"site-packages", "dist-packages", "idlelib", "tkinter", "turtledemo", "lib2to3", "ensurepip", "venv", "__pycache__"}


@dataclass(frozen=True)
class Conversation:
    doc_id: str
    messages: tuple[dict[str, str], ...]

    @property
    def digest(self) -> str:
        return workspace.sha256_bytes(json.dumps(self.messages, sort_keys=True).encode())


@dataclass(frozen=True)
class Pool:
    conversations: list[Conversation]
    info: dict[str, Any]
    """What the pool was made from, for the manifest."""


def load_pool(source: str, needed: int) -> Pool:
    """At least `needed` distinct conversations from `source`, or a UserError."""
    if source == PYDOC:
        pool = _pydoc_pool(needed)
    else:
        pool = _file_pool(Path(source).expanduser())
    if len(pool.conversations) < needed:
        raise UserError(
            f"data.replay_source: {source} gives {len(pool.conversations)} distinct conversations; "
            f"data.replay_docs + data.retention_docs need {needed}"
        )
    return pool


def _unique(items: Iterator[Conversation]) -> tuple[list[Conversation], int]:
    seen: set[str] = set()
    out: list[Conversation] = []
    duplicates = 0
    for conv in items:
        if conv.digest in seen:
            duplicates += 1
            continue
        seen.add(conv.digest)
        out.append(conv)
    return out, duplicates


# --- pydoc -----------------------------------------------------------------


def _pydoc_pool(needed: int) -> Pool:
    topics, dup_topics = _unique(_topic_documents())
    info: dict[str, Any] = {"source": PYDOC, "python": platform.python_version(), "topic_parts": len(topics)}
    convs = topics
    duplicates = dup_topics
    if len(convs) < needed:
        # Parsing the standard library takes seconds; only presets that need
        # more than the topics pay for it.
        docs, dup_docs = _unique(_docstring_documents())
        known = {c.digest for c in convs}
        extra = [c for c in docs if c.digest not in known]
        duplicates += dup_docs + len(docs) - len(extra)
        convs = convs + extra
        info["docstrings"] = len(extra)
    info["duplicates_dropped"] = duplicates
    return Pool(convs, info)


def _chunks(text: str, budget: int = CHUNK_CHARS) -> list[str]:
    """Paragraphs packed into pieces of at most `budget` characters; a longer
    paragraph is cut at a word boundary."""
    pieces: list[str] = []
    current = ""
    for para in re.split(r"\n\s*\n", text.strip()):
        para = para.rstrip()
        while len(para) > budget:
            cut = para.rfind(" ", 0, budget)
            cut = cut if cut > budget // 2 else budget
            if current:
                pieces.append(current)
                current = ""
            pieces.append(para[:cut].rstrip())
            para = para[cut:].lstrip()
        if current and len(current) + 2 + len(para) > budget:
            pieces.append(current)
            current = ""
        current = f"{current}\n\n{para}" if current else para
    if current:
        pieces.append(current)
    return [p for p in pieces if len(p) >= MIN_CHARS]


def _split_title(text: str) -> tuple[str, str]:
    # Topics open with a title underlined by asterisks.
    lines = text.strip().splitlines()
    if len(lines) > 1 and set(lines[1].strip()) == {"*"}:
        return lines[0].strip(), "\n".join(lines[2:])
    return "", text


def _topic_documents() -> Iterator[Conversation]:
    from pydoc_data.topics import topics

    for key in sorted(topics):
        title, body = _split_title(topics[key])
        title = title or key
        parts = _chunks(body)
        for k, part in enumerate(parts, start=1):
            if k == 1:
                ask = f"Explain the Python topic: {title}."
            else:
                ask = f"Continue explaining the Python topic: {title} (part {k} of {len(parts)})."
            yield Conversation(f"pydoc/topic/{key}/{k}", ({"role": "user", "content": ask}, {"role": "assistant", "content": part}))


def _stdlib_files() -> Iterator[tuple[str, Path]]:
    root = Path(sysconfig.get_paths()["stdlib"])
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root).parts
        if any(p in _SKIP_DIRS or p.startswith("test") for p in parts[:-1]) or parts[-1].startswith("test"):
            continue
        module = ".".join(parts).removesuffix(".py").removesuffix(".__init__")
        if any(p.startswith("_") for p in module.split(".")):
            continue
        yield module, path


def _documented(node: ast.AST, prefix: str) -> Iterator[tuple[str, str, str]]:
    """(kind, dotted name, docstring) of the public classes and functions
    defined in `node`'s body, methods included, nested functions not."""
    for child in getattr(node, "body", []):
        if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and not child.name.startswith("_"):
            name = f"{prefix}.{child.name}"
            doc = ast.get_docstring(child)
            kind = "class" if isinstance(child, ast.ClassDef) else "function"
            if doc:
                yield kind, name, doc
            if isinstance(child, ast.ClassDef):
                yield from _documented(child, name)


def _docstring_documents() -> Iterator[Conversation]:
    asks = {
        "module": "What is the Python module `{}` for?",
        "class": "Describe the Python class `{}`.",
        "function": "What does the Python function `{}` do?",
    }
    for module, path in _stdlib_files():
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        found = [("module", module, ast.get_docstring(tree) or "")]
        found += list(_documented(tree, module))
        for kind, name, doc in found:
            parts = _chunks(doc)
            if parts:
                # One document per docstring: its opening part.
                yield Conversation(
                    f"pydoc/doc/{name}",
                    ({"role": "user", "content": asks[kind].format(name)}, {"role": "assistant", "content": parts[0]}),
                )


# --- a chat dataset export ---------------------------------------------------


def _valid(messages: Any) -> tuple[dict[str, str], ...] | None:
    """The turns as plain dicts, or None for a row that is not a usable
    conversation: unknown roles, no assistant answer, or opening with one."""
    if not isinstance(messages, (list, tuple)) or not messages:
        return None
    turns = []
    for m in messages:
        if not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(m.get("content"), str):
            return None
        turns.append({"role": m["role"], "content": m["content"]})
    speakers = [t["role"] for t in turns if t["role"] != "system"]
    if not speakers or speakers[0] != "user" or not any(t["role"] == "assistant" and t["content"].strip() for t in turns):
        return None
    return tuple(turns)


def _rows(path: Path) -> list[Any]:
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        try:
            return pq.read_table(path, columns=["messages"]).column("messages").to_pylist()
        except (KeyError, ValueError) as err:
            raise UserError(f"data.replay_source: {path} has no usable `messages` column ({err})") from None
    rows = []
    with open(path, encoding="utf-8") as fh:
        for n, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line).get("messages"))
            except (ValueError, AttributeError):
                raise UserError(f"data.replay_source: {path} line {n} is not a JSON object") from None
    return rows


def _file_pool(path: Path) -> Pool:
    if not path.is_file() or path.suffix not in (".jsonl", ".parquet"):
        raise UserError(f"data.replay_source: {str(path)!r} is neither 'pydoc' nor a .jsonl or .parquet file")
    rows = _rows(path)
    valid = [(i, turns) for i, raw in enumerate(rows) if (turns := _valid(raw)) is not None]
    convs, duplicates = _unique(Conversation(f"{path.stem}/{i}", turns) for i, turns in valid)
    info = {
        "source": path.name,
        "sha256": workspace.sha256_file(path),
        "rows": len(rows),
        "skipped": len(rows) - len(valid),
        "duplicates_dropped": duplicates,
    }
    return Pool(convs, info)
