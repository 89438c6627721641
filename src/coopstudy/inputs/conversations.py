"""Conversation documents for replay and retention probes, from a configurable
source (`data.replay_source`):

- 'chitchat' (the default): the PyPI package chitchat-dataset 0.9.0 (MIT; BYU's
  "Chit-Chat Challenge"), 7,168 human open-domain conversations shipped inside
  the wheel, read offline. The speaker of the first turn is the user, the other
  the assistant; each conversation keeps its leading turns up to CHUNK_CHARS
  characters, cut after an assistant turn; conversations with one speaker only
  have no assistant turn, and those that open with a user turn longer than
  OPENING_CHARS would crowd a small context: both are left out (counted).
  Each keeps its topic: the prompt the two people were shown.
- 'pydoc': real public text that ships with CPython, so nothing is fetched.
  First the documentation topics (`pydoc_data.topics`), cut at paragraph
  boundaries into parts, each a user request and an assistant answer; when a
  preset needs more documents than that, the docstrings of the standard
  library's public modules, classes and functions (read with `ast`, never
  imported) follow. The topic of a part is its documentation topic, of a
  docstring its module.
- a path to a JSONL or Parquet export of a chat dataset with a `messages`
  column of `{"role", "content"}` turns. Every row must be a conversation
  (user first, at least one assistant answer); a bad row is refused by number.

The pool comes in a fixed order without duplicates (by content); choosing
replay and retention documents from it is the caller's job (coopstudy.inputs.data),
with the content fingerprints here: a probe and a replay document may share
no topic, no word 13-gram and no whole message of 40 characters or more.
"""

from __future__ import annotations

import ast
import hashlib
import json
import platform
import re
import sysconfig
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from coopstudy import workspace
from coopstudy.errors import UserError

CHITCHAT = "chitchat"
PYDOC = "pydoc"
NAMED_SOURCES = (CHITCHAT, PYDOC)
"""The sources data.replay_source names; anything else is a path to an export."""
CHITCHAT_DISTRIBUTION = "chitchat-dataset"
CHITCHAT_VERSION = "0.9.0"
"""The version pyproject pins; another one is used, and its version and hash recorded."""
CHUNK_CHARS = 1000
"""Assistant text per pydoc document, and the turns kept of a chitchat
conversation (all messages together): a few hundred tokens."""
MIN_CHARS = 120
"""Shorter pydoc texts say too little to be worth a document."""
NGRAM = 13
"""Word n-gram length of the overlap check (the usual contamination n-gram)."""
MIN_SHARED_CHARS = 40
"""A whole message this long (normalised) shared by a probe and a replay
document counts as overlap; shorter ones are greetings ("hi", "how are you?")
that hundreds of conversations share."""
OPENING_CHARS = 300
"""A chitchat conversation whose opening user turn is longer is left out
(63 of 4,017, counted): its prompt alone would crowd a small context (at
most 189 SmolLM2 tokens with the template's system prompt at this limit)."""
NO_TOPIC = "(no prompt)"
"""The topic of the chitchat conversations that name no prompt (142): one group."""
ROLES = ("system", "user", "assistant")
# Standard-library folders that are tests, demos, GUI or vendored code.
_SKIP_DIRS = {"site-packages", "dist-packages", "idlelib", "tkinter", "turtledemo", "lib2to3", "ensurepip", "venv", "__pycache__"}


@dataclass(frozen=True)
class Conversation:
    doc_id: str
    messages: tuple[dict[str, str], ...]
    topic: str | None = None
    """What the source says the conversation is about (chitchat: its prompt;
    pydoc: the topic or module); None: unknown, the conversation is its own group."""

    @property
    def digest(self) -> str:
        return workspace.sha256_bytes(json.dumps(self.messages, sort_keys=True).encode())

    @property
    def group(self) -> str:
        """Probes and replay never share a group."""
        return f"topic:{self.topic}" if self.topic is not None else f"doc:{self.doc_id}"


@dataclass(frozen=True)
class Pool:
    conversations: list[Conversation]
    info: dict[str, Any]
    """What the pool was made from, for the manifest."""


def describe_source(source: str) -> str:
    return source if source in NAMED_SOURCES else f"file {source}"


def check_source(source: str) -> None:
    """A UserError where `source` is a path that cannot be an export: the
    checks that read nothing, which a dry run makes too."""
    if source in NAMED_SOURCES:
        return
    path = Path(source).expanduser()
    if path.suffix not in (".jsonl", ".parquet"):
        raise UserError(f"data.replay_source: {str(path)!r} is none of {', '.join(NAMED_SOURCES)} or a .jsonl or .parquet file")
    if path.is_dir():
        raise UserError(f"data.replay_source: {path} is a folder, not a file")
    if not path.is_file():
        raise UserError(f"data.replay_source: {path} does not exist")


def load_pool(source: str, needed: int) -> Pool:
    """At least `needed` distinct conversations from `source`, or a UserError."""
    if source == CHITCHAT:
        pool = _chitchat_pool()
    elif source == PYDOC:
        pool = _pydoc_pool(needed)
    else:
        check_source(source)
        pool = _file_pool(Path(source).expanduser())
    if len(pool.conversations) < needed:
        raise UserError(
            f"data.replay_source: {describe_source(source)} gives {len(pool.conversations)} distinct conversations; "
            f"data.replay_docs + data.retention_docs need {needed}"
        )
    return pool


def _unique(items: Iterable[Conversation]) -> tuple[list[Conversation], int]:
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


# --- content overlap ---------------------------------------------------------


def _normal(text: str) -> str:
    return " ".join(text.lower().split())


def ngrams(conv: Conversation, n: int = NGRAM) -> set[tuple[str, ...]]:
    """The word n-grams of every message (lower case, words as \\w+)."""
    out: set[tuple[str, ...]] = set()
    for m in conv.messages:
        words = re.findall(r"\w+", m["content"].lower())
        out.update(tuple(words[i : i + n]) for i in range(len(words) - n + 1))
    return out


def long_messages(conv: Conversation) -> set[str]:
    """Its messages of at least MIN_SHARED_CHARS characters, normalised (lower case, single spaces)."""
    return {t for m in conv.messages if len(t := _normal(m["content"])) >= MIN_SHARED_CHARS}


@dataclass(frozen=True)
class Fingerprints:
    """What a set of conversations may share with no other: topics, n-grams, long messages."""

    groups: frozenset[str]
    grams: frozenset[tuple[str, ...]]
    messages: frozenset[str]

    @classmethod
    def of(cls, convs: Iterable[Conversation]) -> "Fingerprints":
        convs = list(convs)
        return cls(
            frozenset(c.group for c in convs),
            frozenset(g for c in convs for g in ngrams(c)),
            frozenset(t for c in convs for t in long_messages(c)),
        )

    def shared_ngram(self, conv: Conversation) -> bool:
        return not self.grams.isdisjoint(ngrams(conv))

    def shared_message(self, conv: Conversation) -> bool:
        return not self.messages.isdisjoint(long_messages(conv))

    def overlaps(self, conv: Conversation) -> bool:
        return conv.group in self.groups or self.shared_ngram(conv) or self.shared_message(conv)


def overlap_checks(probes: list[Conversation], replay: list[Conversation]) -> dict[str, int]:
    """Counted after the split, for the manifest: every count must be 0."""
    seen = Fingerprints.of(probes)
    digests = {c.digest for c in probes}
    ids = {c.doc_id for c in probes}
    return {
        "retention_in_replay": sum(c.digest in digests for c in replay),
        "retention_ids_in_replay": sum(c.doc_id in ids for c in replay),
        "replay_sharing_topic_with_retention": sum(c.group in seen.groups for c in replay),
        f"replay_sharing_{NGRAM}gram_with_retention": sum(seen.shared_ngram(c) for c in replay),
        "replay_sharing_long_message_with_retention": sum(seen.shared_message(c) for c in replay),
    }


# --- chitchat ------------------------------------------------------------------


def _chitchat_messages(conv: dict[str, Any], max_chars: int = CHUNK_CHARS) -> list[dict[str, str]]:
    """One chitchat conversation as alternating user/assistant messages ending
    with an assistant turn ([] when none is left).

    A turn is a list of utterances of one sender; they are joined with newlines
    (separate chat lines of one person); empty utterances are dropped and turns
    of one speaker that then meet are merged, so roles alternate. Only the
    leading turns whose contents add up to at most `max_chars` are kept, cut
    after an assistant turn; the first user/assistant pair is always kept
    (truncation to data.max_context cuts a longer one)."""
    turns: list[tuple[str, str]] = []
    for turn in conv["messages"]:
        texts = [u["text"].strip() for u in turn if u["text"].strip()]
        if not texts:
            continue
        senders = {u["sender"] for u in turn}
        if len(senders) != 1:
            raise UserError(f"data.replay_source: chitchat has a turn with {len(senders)} senders; expected {CHITCHAT_VERSION}")
        sender, text = turn[0]["sender"], "\n".join(texts)
        if turns and turns[-1][0] == sender:
            turns[-1] = (sender, turns[-1][1] + "\n" + text)
        else:
            turns.append((sender, text))
    if len({s for s, _ in turns}) > 2:
        raise UserError(f"data.replay_source: chitchat has a conversation of more than two speakers; expected {CHITCHAT_VERSION}")
    if not turns:
        return []
    opener = turns[0][0]
    messages = [{"role": "user" if s == opener else "assistant", "content": t} for s, t in turns]
    total, keep = 0, 0
    for i, m in enumerate(messages):
        total += len(m["content"])
        if total > max_chars and keep:
            break
        if m["role"] == "assistant":
            keep = i + 1
    messages = messages[: max(keep, 2)]
    if messages[-1]["role"] == "user":
        messages.pop()
    return messages


def _chitchat_pool() -> Pool:
    from importlib import metadata, resources

    try:
        blob = resources.files("chitchat_dataset").joinpath("dataset.json").read_bytes()
        version = metadata.version(CHITCHAT_DISTRIBUTION)
    except (ModuleNotFoundError, FileNotFoundError, metadata.PackageNotFoundError):
        raise UserError(
            f"data.replay_source: chitchat needs the package {CHITCHAT_DISTRIBUTION}=={CHITCHAT_VERSION} "
            "(`make env` installs it), or name another source"
        ) from None
    raw = json.loads(blob.decode("utf-8"))
    convs = []
    unanswered = long_opening = 0
    for cid in sorted(raw):
        messages = _chitchat_messages(raw[cid])
        if not messages:
            unanswered += 1
        elif len(messages[0]["content"]) > OPENING_CHARS:
            long_opening += 1
        else:
            convs.append(Conversation(f"chitchat/{cid}", tuple(messages), raw[cid].get("prompt") or NO_TOPIC))
    unique, duplicates = _unique(convs)
    info: dict[str, Any] = {
        "source": CHITCHAT,
        "package": f"{CHITCHAT_DISTRIBUTION} {version}",
        "sha256": hashlib.sha256(blob).hexdigest(),
        "conversations": len(raw),
        "skipped_unanswered": unanswered,
        "skipped_long_opening": long_opening,
        "duplicates_dropped": duplicates,
        "usable": len(unique),
        "topics": len({c.topic for c in unique}),
        "max_chars": CHUNK_CHARS,
    }
    return Pool(unique, info)


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
    info["usable"] = len(convs)
    info["topics"] = len({c.topic for c in convs})
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
            yield Conversation(
                f"pydoc/topic/{key}/{k}", ({"role": "user", "content": ask}, {"role": "assistant", "content": part}), f"topic/{key}"
            )


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
                    f"module/{module}",
                )


# --- a chat dataset export ---------------------------------------------------


def _turns(messages: Any) -> tuple[dict[str, str], ...] | str:
    """The turns as plain dicts, or what makes the row unusable."""
    if not isinstance(messages, (list, tuple)) or not messages:
        return "`messages` is not a non-empty list of turns"
    turns = []
    for k, m in enumerate(messages, start=1):
        if not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(m.get("content"), str):
            return f"turn {k} is not a {{role: system|user|assistant, content: text}} object"
        turns.append({"role": m["role"], "content": m["content"]})
    speakers = [t["role"] for t in turns if t["role"] != "system"]
    if not any(t["role"] == "assistant" and t["content"].strip() for t in turns):
        return "the conversation has no assistant turn"
    if speakers[0] != "user":
        return "the conversation opens with an assistant turn, not a user turn"
    return tuple(turns)


def _rows(path: Path) -> list[tuple[str, Any]]:
    """(where, the row's `messages`) for every row of the export."""
    if path.suffix == ".parquet":
        import pyarrow
        import pyarrow.parquet as pq

        try:
            schema = pq.read_schema(path)
        except (pyarrow.ArrowException, OSError) as err:
            raise UserError(f"data.replay_source: {path} is not a readable Parquet file ({type(err).__name__})") from None
        if "messages" not in schema.names:
            columns = ", ".join(schema.names) or "none"
            raise UserError(f"data.replay_source: {path} has no `messages` column (columns: {columns})")
        try:
            values = pq.read_table(path, columns=["messages"]).column("messages").to_pylist()
        except (pyarrow.ArrowException, OSError) as err:
            raise UserError(f"data.replay_source: {path}: the `messages` column cannot be read ({type(err).__name__})") from None
        return [(f"row {i}", v) for i, v in enumerate(values, start=1)]
    rows = []
    with open(path, encoding="utf-8") as fh:
        for n, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError:
                row = None
            if not isinstance(row, dict):
                raise UserError(f"data.replay_source: {path} line {n} is not a JSON object") from None
            if "messages" not in row:
                raise UserError(f"data.replay_source: {path} line {n} has no `messages` field")
            rows.append((f"line {n}", row["messages"]))
    return rows


def _file_pool(path: Path) -> Pool:
    try:
        rows = _rows(path)
    except UnicodeDecodeError:
        raise UserError(f"data.replay_source: {path} is not UTF-8 text") from None
    except PermissionError as err:
        raise UserError(f"data.replay_source: cannot read {path} ({err.strerror})") from None
    if not rows:
        raise UserError(f"data.replay_source: {path} holds no conversations")
    convs = []
    for i, (where, raw) in enumerate(rows):
        turns = _turns(raw)
        if isinstance(turns, str):
            raise UserError(f"data.replay_source: {path} {where}: {turns}; every row must be a conversation")
        convs.append(Conversation(f"{path.stem}/{i}", turns))
    unique, duplicates = _unique(convs)
    info = {
        "source": path.name,
        "sha256": workspace.sha256_file(path),
        "rows": len(rows),
        "duplicates_dropped": duplicates,
        "usable": len(unique),
    }
    return Pool(unique, info)
