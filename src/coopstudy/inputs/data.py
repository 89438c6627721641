"""The prepared inputs of a study: what `prepare` writes and every later stage reads.

A folder `<home>/prepared/<content hash>/` holds
  train.jsonl      one document per line; line order is the schedule's index.
                   {"doc_id", "kind": "task"|"replay", "family", "input_ids", "weights"}
                   weights[i] weighs token i as a target predicted from tokens < i:
                   task answers data.answer_weight, replay assistant turns
                   data.replay_weight, prompts 0 (weights[0] is always 0).
  retention.jsonl  the same fields, kind "retention", assistant tokens weigh 1.
  test.jsonl       {"case_id", "family", "messages" (the prompt), "entry" (for the verifier)}
  schedule.json    {"updates": [[train index] * global_batch] * updates, ...}
  manifest.json    sha256 of every file, counts, token statistics, truncation,
                   dropped test questions, the seed model's sha256; where the
                   conversations came from, how replay and retention were split
                   and the overlap checks (each 0).
The sha256 of manifest.json is the inputs commitment. `prepare` appends it to
the ledger under `inputs_key(cfg)`; `coopstudy.commit.require.inputs(cfg)` finds it there and
re-hashes every file before handing the data out.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from coopstudy import workspace
from coopstudy.config import Config
from coopstudy.errors import RefusedError, UserError
from coopstudy.inputs import chat, conversations, tasks
from coopstudy.inputs.seed import Seed
from coopstudy.record import schema

TRAIN, RETENTION, TEST, SCHEDULE = "train.jsonl", "retention.jsonl", "test.jsonl", "schedule.json"
FORMAT = 1

RETENTION_MIN_GROUPS = 4
"""Topics the retention probes are drawn from, at least: one topic would make
the probes one conversation theme, not the seed's general conversation."""

T = TypeVar("T")
Track = Callable[[Sequence[T], str], Iterable[T]]
"""(items, description) -> the same items, maybe with a progress display."""


def _untracked(items: Sequence[T], description: str) -> Iterable[T]:
    return items


@dataclass(frozen=True)
class Document:
    doc_id: str
    kind: str
    """task, replay or retention."""
    family: str | None
    input_ids: tuple[int, ...]
    weights: tuple[float, ...]

    def to_json(self) -> dict[str, Any]:
        return {"doc_id": self.doc_id, "kind": self.kind, "family": self.family, "input_ids": list(self.input_ids), "weights": list(self.weights)}

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> "Document":
        return cls(raw["doc_id"], raw["kind"], raw["family"], tuple(raw["input_ids"]), tuple(float(w) for w in raw["weights"]))

    @property
    def prompt_tokens(self) -> int:
        """Tokens before the first target."""
        return next((i for i, w in enumerate(self.weights) if w), len(self.weights))

    @property
    def target_tokens(self) -> int:
        return sum(1 for w in self.weights if w)


@dataclass(frozen=True)
class Prepared:
    folder: Path
    digest: str
    """sha256 of manifest.json: the inputs commitment."""
    train: list[Document]
    retention: list[Document]
    test: list[dict[str, Any]]
    schedule: list[list[int]]
    manifest: dict[str, Any]


TRAINING_FILES = (TRAIN, SCHEDULE)
"""The prepared files a training run reads."""
EVALUATION_FILES = (TEST, RETENTION)
"""The prepared files an evaluation reads."""


def dataset_files(folder: Path, manifest: dict[str, Any], names: Sequence[str]) -> dict[str, tuple[str, str]]:
    """Prepared files as a run's dataset inputs: name -> (sha256, path)."""
    return {n: (manifest["files"][n]["sha256"], str(folder / n)) for n in names}


@dataclass(frozen=True)
class Built:
    """Everything prepare writes, in memory, before it touches the disk."""

    files: dict[str, bytes]
    manifest: dict[str, Any]

    @property
    def manifest_bytes(self) -> bytes:
        return (json.dumps(self.manifest, indent=2, sort_keys=True) + "\n").encode()

    @property
    def digest(self) -> str:
        return workspace.sha256_bytes(self.manifest_bytes)


def inputs_key(cfg: Config) -> str:
    """Names the prepared inputs of a config in the ledger: a hash of every
    setting they depend on (data.*, model.*, the schedule's shape), and of
    nothing else, so arms and training settings share one set of inputs."""
    sections = {
        "data": cfg.data.model_dump(mode="json"),
        "model": cfg.model.model_dump(mode="json"),
        "train": {"updates": cfg.train.updates, "global_batch": cfg.train.global_batch},
    }
    return workspace.sha256_bytes(json.dumps(sections, sort_keys=True).encode())


def permutation(n: int, *key: object) -> list[int]:
    """A seeded permutation of range(n): order by the hash of (key, index).
    Unlike a library RNG stream, this cannot change with a library version."""
    prefix = "/".join(str(k) for k in key)
    return sorted(range(n), key=lambda i: workspace.sha256_bytes(f"{prefix}/{i}".encode()))


def make_schedule(documents: int, updates: int, global_batch: int, seed: int) -> list[list[int]]:
    """Which training documents form each update's global batch: consecutive
    passes over the documents, pass p in the order of permutation seed + p.
    It depends on nothing an arm sets, so both arms see the same batches."""
    slots = updates * global_batch
    order: list[int] = []
    passes = -(-slots // documents)
    for p in range(passes):
        order += permutation(documents, "schedule", seed + p)
    return [order[k * global_batch : (k + 1) * global_batch] for k in range(updates)]


def split_conversations(
    pool: conversations.Pool, retention_docs: int, replay_docs: int, seed: int
) -> tuple[list[conversations.Conversation], list[conversations.Conversation], dict[str, Any]]:
    """(retention probes, replay documents, what the split did, for the manifest).

    Probes come first, so changing replay_docs leaves them as they are: whole
    topics are held out, in seeded order, until they hold retention_docs
    conversations and number at least RETENTION_MIN_GROUPS, and the probes are
    drawn from those. Replay comes from the other topics only, in seeded order,
    skipping any conversation that shares a word 13-gram or a long message
    with a probe: probes measure what the training never shows, not siblings
    of what it trains on."""
    convs = pool.conversations
    groups: dict[str, list[int]] = {}
    for i, conv in enumerate(convs):
        groups.setdefault(conv.group, []).append(i)
    names = sorted(groups)
    held: list[int] = []
    held_topics: list[str] = []
    for k in permutation(len(names), "retention-topics", seed):
        if len(held) >= retention_docs and len(held_topics) >= RETENTION_MIN_GROUPS:
            break
        held_topics.append(names[k])
        held += groups[names[k]]
    probes = [convs[held[k]] for k in permutation(len(held), "retention", seed)[:retention_docs]]
    held_set = set(held)
    rest = [i for i in range(len(convs)) if i not in held_set]
    seen = conversations.Fingerprints.of(probes)
    replay: list[conversations.Conversation] = []
    skipped = 0
    for k in permutation(len(rest), "replay", seed):
        if len(replay) == replay_docs:
            break
        conv = convs[rest[k]]
        if seen.overlaps(conv):
            skipped += 1
            continue
        replay.append(conv)
    if len(replay) < replay_docs:
        raise UserError(
            f"data.replay_docs: {replay_docs} replay conversations do not fit: {len(convs)} distinct conversations, "
            f"{len(held)} held out with the retention probes' topics, {skipped} sharing text with a probe; "
            f"lower data.replay_docs or data.retention_docs"
        )
    topics = [t.removeprefix("topic:") for t in held_topics if t.startswith("topic:")]
    return probes, replay, {
        "source": pool.info["source"],
        "retention": len(probes),
        "replay": len(replay),
        "retention_topics": topics,
        "retention_groups": len(held_topics),
        "held_out_unused": len(held) - len(probes),
        "replay_topics": len({c.group for c in replay}),
        "replay_skipped_for_overlap": skipped,
        "overlap_rule": (
            f"no shared topic, no shared word {conversations.NGRAM}-gram, no shared message of "
            f"{conversations.MIN_SHARED_CHARS}+ characters (lower case, spaces collapsed), no shared id or conversation"
        ),
    }


def describe_split(manifest: dict[str, Any]) -> str:
    """One line: where replay and retention come from, how many, and the overlap check."""
    info, split, checks = manifest["conversations"], manifest["split"], manifest["checks"]
    source = info.get("package") or info["source"]
    shared = sum(v for k, v in checks.items() if k != "test_questions_in_training")
    return (
        f"replay {split['replay']} and retention {split['retention']} conversations from {info['source']} ({source}, "
        f"{info['usable']} usable); retention from {split['retention_groups']} held-out topics; "
        f"overlap with replay: {shared} ({split['replay_skipped_for_overlap']} replay candidates skipped for shared text)"
    )


def truncate(doc: Document, max_context: int) -> tuple[Document, int]:
    """The document cut to max_context tokens, and how many tokens were cut."""
    cut = len(doc.input_ids) - max_context
    if cut <= 0:
        return doc, 0
    return Document(doc.doc_id, doc.kind, doc.family, doc.input_ids[:max_context], doc.weights[:max_context]), cut


def _encode(tokenizer: Any, doc_id: str, kind: str, family: str | None, messages: Sequence[dict[str, str]], weight: float) -> Document:
    ids, weights = chat.encode(tokenizer, messages, weight)
    return Document(doc_id, kind, family, tuple(ids), tuple(weights))


def _mean(values: Sequence[float]) -> float:
    return round(sum(values) / len(values), 3) if values else 0.0


def _kind_stats(docs: Sequence[Document]) -> dict[str, Any]:
    lengths = [len(d.input_ids) for d in docs]
    return {
        "documents": len(docs),
        "tokens": sum(lengths),
        "mean_tokens": _mean(lengths),
        "max_tokens": max(lengths, default=0),
        "prompt_tokens_mean": _mean([d.prompt_tokens for d in docs]),
        "target_tokens": sum(d.target_tokens for d in docs),
        "weight_sum": sum(sum(d.weights) for d in docs),
    }


def _jsonl(rows: Iterable[dict[str, Any]]) -> bytes:
    return "".join(json.dumps(r, separators=(",", ":"), ensure_ascii=False) + "\n" for r in rows).encode()


def _check_prompts(cfg: Config, docs: Sequence[Document], test_prompts: dict[str, int]) -> None:
    longest_doc = max(docs, key=lambda d: d.prompt_tokens)
    longest = max([(longest_doc.prompt_tokens, longest_doc.doc_id), *((n, cid) for cid, n in test_prompts.items())])
    # A prompt that fills the context leaves its document without a target;
    # test prompts are held to the same bound as the training prompts they mirror.
    if longest[0] >= cfg.data.max_context:
        raise UserError(
            f"data.max_context: {cfg.data.max_context} is a context below the longest prompt "
            f"({longest[0]} tokens, {longest[1]}); raise data.max_context above {longest[0]}"
        )


def conversation_pool(cfg: Config) -> conversations.Pool:
    """The conversations data.replay_source gives, enough for replay and retention, or a UserError."""
    return conversations.load_pool(cfg.data.replay_source, cfg.data.replay_docs + cfg.data.retention_docs)


def _draw(cfg: Config, withheld: frozenset[str] = frozenset()) -> tuple[list[tasks.Task], set[str], tasks.FinalDraw]:
    """The training tasks of `cfg`, their questions, and the final test drawn
    without them (nor `withheld`): what build tokenizes, and nothing else."""
    d = cfg.data
    train_tasks = tasks.generate_training(d.families, d.tasks_per_family, d.generation_seed, d.family_options)
    training_questions = {t.question for t in train_tasks}
    final = tasks.generate_final(d.families, d.test_per_family, d.test_seed, training_questions | withheld, d.family_options)
    return train_tasks, training_questions, final


def final_test_questions(cfg: Config) -> frozenset[str]:
    """The questions of the final test `prepare` makes of `cfg` (nothing tokenized)."""
    return frozenset(t.question for t in _draw(cfg)[2].tasks)


def build(
    cfg: Config, tokenizer: Any, seed: Seed, track: Track = _untracked, pool: conversations.Pool | None = None,
    withheld: frozenset[str] = frozenset(),
) -> Built:
    """Generate, tokenize, weigh, truncate and schedule; nothing is written.
    `pool`: conversation_pool(cfg), when the caller has loaded it already.
    `withheld`: questions the test must not hold besides training's (a
    development split's: the study's final test, which seed ranges apart do
    not keep out of a family with few distinct questions)."""
    d = cfg.data
    tasks.check_seed_ranges(d.families, d.generation_seed, d.tasks_per_family, d.test_seed, d.test_per_family)
    train_tasks, training_questions, final = _draw(cfg, withheld)

    pool = pool or conversation_pool(cfg)
    retention_convs, replay_convs, split = split_conversations(pool, d.retention_docs, d.replay_docs, d.replay_seed)

    task_docs = [
        _encode(tokenizer, t.task_id, "task", t.family, tasks.training_messages(t), d.answer_weight)
        for t in track(train_tasks, "tokenizing tasks")
    ]
    replay_docs = [_encode(tokenizer, c.doc_id, "replay", None, c.messages, d.replay_weight) for c in track(replay_convs, "tokenizing replay")]
    retention_docs = [_encode(tokenizer, c.doc_id, "retention", None, c.messages, 1.0) for c in track(retention_convs, "tokenizing retention")]
    test_cases = [tasks.test_case(t) for t in final.tasks]
    test_prompts = {c["case_id"]: len(chat.prompt_ids(tokenizer, c["messages"])) for c in track(test_cases, "tokenizing test prompts")}
    _check_prompts(cfg, task_docs + replay_docs + retention_docs, test_prompts)

    # Checked, not assumed: disjointness holds by construction, a failure here is a bug.
    shared_questions = training_questions & {t.question for t in final.tasks}
    overlap = conversations.overlap_checks(retention_convs, replay_convs)
    if shared_questions or any(overlap.values()):
        found = ", ".join(f"{k} {v}" for k, v in overlap.items() if v)
        raise RuntimeError(f"prepare: {len(shared_questions)} test questions in training; retention against replay: {found or 'none'}")

    truncated: dict[str, dict[str, int]] = {}
    train: list[Document] = []
    retention: list[Document] = []
    for docs, out in ((task_docs, train), (replay_docs, train), (retention_docs, retention)):
        for doc in docs:
            doc, cut = truncate(doc, d.max_context)
            out.append(doc)
            if cut:
                t = truncated.setdefault(doc.kind, {"documents": 0, "tokens": 0})
                t["documents"] += 1
                t["tokens"] += cut

    schedule = make_schedule(len(train), cfg.train.updates, cfg.train.global_batch, d.schedule_seed)
    files = {
        TRAIN: _jsonl(doc.to_json() for doc in train),
        RETENTION: _jsonl(doc.to_json() for doc in retention),
        TEST: _jsonl(test_cases),
        SCHEDULE: json.dumps(
            {
                "updates": schedule,
                "global_batch": cfg.train.global_batch,
                "documents": len(train),
                "passes": -(-cfg.train.updates * cfg.train.global_batch // len(train)),
                "seed": d.schedule_seed,
            },
            separators=(",", ":"),
        ).encode(),
    }
    per_family = {
        fam: {
            "train": sum(1 for t in train_tasks if t.family == fam),
            "test": sum(1 for t in final.tasks if t.family == fam),
            "train_distinct_questions": len({t.question for t in train_tasks if t.family == fam}),
            "test_dropped_seen_in_training": final.seen_in_training[fam],
            "test_dropped_repeated": final.repeated_in_test[fam],
            "prompt_tokens_mean": _mean([doc.prompt_tokens for doc in train if doc.family == fam]),
            "answer_tokens_mean": _mean([doc.target_tokens for doc in train if doc.family == fam]),
            "train_seeds": [tasks.family_seed(d.generation_seed, pos), tasks.family_seed(d.generation_seed, pos) + d.tasks_per_family - 1],
            "test_seed": tasks.family_seed(d.test_seed, pos),
        }
        for pos, fam in enumerate(d.families)
    }
    manifest = {
        "format": FORMAT,
        "inputs_key": inputs_key(cfg),
        "seed_model": {"source": cfg.model.source, "sha256": seed.sha256, "parameters": seed.parameters},
        "files": {name: {"sha256": workspace.sha256_bytes(blob), "bytes": len(blob)} for name, blob in files.items()},
        "counts": {
            "train": len(train),
            "tasks": len(task_docs),
            "replay": len(replay_docs),
            "retention": len(retention),
            "test": len(test_cases),
            "schedule_slots": cfg.train.updates * cfg.train.global_batch,
        },
        "families": per_family,
        "tokens": {
            "task": _kind_stats([doc for doc in train if doc.kind == "task"]),
            "replay": _kind_stats([doc for doc in train if doc.kind == "replay"]),
            "retention": _kind_stats(retention),
            "test_prompt_mean": _mean(list(test_prompts.values())),
            "test_prompt_max": max(test_prompts.values()),
        },
        "truncation": {
            "max_context": d.max_context,
            "documents": sum(t["documents"] for t in truncated.values()),
            "tokens": sum(t["tokens"] for t in truncated.values()),
            "by_kind": truncated,
        },
        "test_dropped": final.dropped,
        "checks": {"test_questions_in_training": len(shared_questions), **overlap},
        "conversations": pool.info,
        "split": split,
    }
    return Built(files=files, manifest=manifest)


def verify_folder(folder: Path, digest: str) -> dict[str, Any]:
    """The manifest, after checking it and every file it names against `digest`."""
    manifest_path = folder / schema.ART_MANIFEST
    if not manifest_path.is_file():
        raise RefusedError(f"prepared inputs {folder}: {schema.ART_MANIFEST} is missing; run prepare again")
    if workspace.sha256_file(manifest_path) != digest:
        raise RefusedError(f"prepared inputs {folder}: {schema.ART_MANIFEST} changed since it was committed; run prepare again")
    manifest = json.loads(manifest_path.read_text())
    for name, info in manifest["files"].items():
        path = folder / name
        if not path.is_file():
            raise RefusedError(f"prepared inputs {folder}: {name} is missing; run prepare again")
        actual = workspace.sha256_file(path)
        if actual != info["sha256"]:
            raise RefusedError(
                f"prepared inputs {folder}: {name} changed since it was committed "
                f"(sha256 {actual[:12]}, committed {info['sha256'][:12]}); run prepare again"
            )
    return manifest


def folder_for(digest: str) -> Path:
    return workspace.subdir("prepared") / digest[:16]


def write_prepared(built: Built) -> tuple[Path, str]:
    """Write the folder unless an intact one with the same content exists.
    Returns the folder and what happened: written, reused, or rewritten (the
    folder existed but its files no longer matched)."""
    digest = built.digest
    folder = folder_for(digest)
    status = "written"
    if folder.exists():
        if _intact(folder, digest):
            return folder, "reused"
        status = "rewritten"
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=folder.parent))
    try:
        for name, blob in [*built.files.items(), (schema.ART_MANIFEST, built.manifest_bytes)]:
            try:
                (tmp / name).write_bytes(blob)
            except OSError as err:
                # A write's error names no file (an open's does): named as the folder will name it.
                err.filename = err.filename or str(folder / name)
                raise
        tmp.chmod(0o755)
        if folder.exists() and not _intact(folder, digest):
            shutil.rmtree(folder)
        try:
            os.replace(tmp, folder)  # onto nothing, or an empty folder
        except OSError as err:
            # Another prepare put the same content there meanwhile (two at
            # once): its folder stays, never removed from under it.
            if err.errno not in (errno.ENOTEMPTY, errno.EEXIST) or not _intact(folder, digest):
                raise
            return folder, "reused"
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder, status


def _intact(folder: Path, digest: str) -> bool:
    try:
        verify_folder(folder, digest)
    except RefusedError:
        return False
    return True


def _read_jsonl(path: Path) -> Iterator[dict[str, Any]]:
    with open(path, encoding="utf-8") as fh:
        for line in fh:
            yield json.loads(line)


def load_folder(folder: Path, digest: str) -> Prepared:
    """The prepared inputs in `folder`, re-hashed against the manifest digest
    `digest` (the ledger's, checked by coopstudy.commit.require.inputs)."""
    manifest = verify_folder(folder, digest)
    schedule = json.loads((folder / SCHEDULE).read_text())["updates"]
    return Prepared(
        folder=folder,
        digest=digest,
        train=[Document.from_json(r) for r in _read_jsonl(folder / TRAIN)],
        retention=[Document.from_json(r) for r in _read_jsonl(folder / RETENTION)],
        test=list(_read_jsonl(folder / TEST)),
        schedule=schedule,
        manifest=manifest,
    )
