"""The ledger: an append-only, hash-chained record of commitments.

Each line is one JSON entry holding the previous entry's hash, so an edited,
removed or reordered line breaks the chain and the whole ledger is refused.
Stages append what they commit to (inputs, gate receipt, probe receipts,
plan, candidates) and refuse to run when an entry they need is missing or no
longer matches.

A chain can be rewritten whole, every line re-hashed, and still verify. What
the file alone cannot prove, the record does: every commitment is also a tag
on the run that made it (`coopstudy.commitment.<kind>`; a candidate: the
select run's `coopstudy.candidate.<arm>`), and the gate receipt itself is an
artifact of its verify run. `Ledger.require`, the read every step's
prerequisites go through, first compares each commitment in force (the
newest of each kind and subject) with the record and refuses, naming the
first one that disagrees (`check_record`).

Appends are serialized by an exclusive lock on the file, and a check made
before an append can hold that lock too (`Ledger.locked()`), so two stages
committing at once keep one linear chain and a select made once stays once.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from coopstudy import workspace
from coopstudy.errors import RefusedError, UserError
from coopstudy.record import schema

GENESIS = "0" * 64

# Kinds of commitment, in the order the protocol makes them.
INPUTS = "inputs"
GATE = "gate"
PROBE = "probe"
PLAN = "plan"
CANDIDATE = "candidate"

# What to run to commit again, by kind (the preset comes from the entry where it has one).
_RECOMMIT = {
    INPUTS: "python -m coopstudy prepare",
    GATE: "python -m coopstudy verify",
    PROBE: "python -m coopstudy probe",
    PLAN: "python -m coopstudy plan",
}
_RESTORE = (
    "restore the ledger from a copy (every commitment is also tagged on its run: "
    f"{schema.TAG_COMMITMENT_PREFIX}*, {schema.TAG_CANDIDATE_PREFIX}*), "
    "or move it aside and commit again from `python -m coopstudy prepare` on"
)


class LedgerError(UserError):
    """The ledger's chain does not verify, or it disagrees with the record."""


@dataclass(frozen=True)
class Entry:
    seq: int
    time: float
    kind: str
    subject: str
    digest: str
    details: dict[str, Any]
    prev: str
    hash: str


def _entry_hash(body: dict[str, Any]) -> str:
    return workspace.sha256_json(body)


def in_force(entries: Sequence[Entry]) -> list[Entry]:
    """The newest entry of each kind and subject, in ledger order: what the
    steps rely on (an older one was replaced by committing again)."""
    newest = {(e.kind, e.subject): e for e in entries}
    return sorted(newest.values(), key=lambda e: e.seq)


class Ledger:
    def __init__(self, path: str | Path | None = None):
        self.path = Path(path) if path else workspace.home() / "ledger.jsonl"
        self._held: IO[str] | None = None

    def entries(self) -> list[Entry]:
        """Every entry, after checking the whole chain."""
        if not self.path.exists():
            return []
        out: list[Entry] = []
        prev = GENESIS
        # Bytes that are not UTF-8 spoil only their line, which the check below refuses.
        for n, line in enumerate(self.path.read_text(errors="replace").splitlines(), start=1):
            try:
                raw = json.loads(line)
                body = {k: raw[k] for k in ("seq", "time", "kind", "subject", "digest", "details", "prev")}
                stored = raw["hash"]
            except (ValueError, KeyError, TypeError):
                raise LedgerError(f"ledger {self.path}: line {n} is not a ledger entry; the record was edited; {_RESTORE}") from None
            if body["prev"] != prev or body["seq"] != n - 1:
                raise LedgerError(
                    f"ledger {self.path}: line {n} does not follow line {n - 1}; entries were removed or reordered; {_RESTORE}"
                )
            if _entry_hash(body) != stored:
                raise LedgerError(
                    f"ledger {self.path}: line {n} ({body['kind']} {body['subject']}) was altered after it was written; {_RESTORE}"
                )
            out.append(Entry(**body, hash=stored))
            prev = stored
        return out

    @contextlib.contextmanager
    def locked(self) -> Iterator[Ledger]:
        """Hold the ledger's lock: no other process appends meanwhile, so a
        check of what is committed and the append that follows it are one step.
        Appends made inside reuse the lock."""
        if self._held is not None:
            yield self
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a+") as fh:
            fcntl.flock(fh, fcntl.LOCK_EX)
            self._held = fh
            try:
                yield self
            finally:
                self._held = None

    def commit(
        self, rec: Any, kind: str, subject: str, digest: str, details: dict[str, Any], *, tags: Mapping[str, Any] | None = None
    ) -> tuple[Entry, Entry | None]:
        """Commit `digest` for (kind, subject) as a step does: on its run
        `rec` first (the commitment's mirror and `tags`), then in the ledger,
        unless the subject's newest entry holds it already. A step stopped
        between the two leaves a run tagged with what no entry names, which
        refuses nothing; the other order left an entry without its mirror,
        which refuses every step after it (check_record), plan and probe
        themselves included.
        Returns the entry in force and the one it found (the same entry: already committed)."""
        rec.record_commitment(kind, digest, tags)
        with self.locked():
            previous = self.latest(kind, subject)
            if previous is not None and previous.digest == digest:
                return previous, previous
            return self.append(kind, subject, digest, details), previous

    def append(self, kind: str, subject: str, digest: str, details: dict[str, Any] | None = None) -> Entry:
        (entry,) = self.extend([(kind, subject, digest, details or {})])
        return entry

    def extend(self, items: Sequence[tuple[str, str, str, dict[str, Any]]]) -> list[Entry]:
        """Append (kind, subject, digest, details) entries in one write: all of
        them or, on a failure or an interrupt part-way, none (select's two
        candidates are one commitment; half of it would refuse both a second
        select and evaluate)."""
        with self.locked():
            fh = self._held
            assert fh is not None
            existing = self.entries()
            prev, now = (existing[-1].hash if existing else GENESIS), time.time()
            entries, lines = [], []
            for seq, (kind, subject, digest, details) in enumerate(items, start=len(existing)):
                body = {"seq": seq, "time": now, "kind": kind, "subject": subject, "digest": digest, "details": details, "prev": prev}
                entry = Entry(**body, hash=_entry_hash(body))
                entries.append(entry)
                lines.append(json.dumps(body | {"hash": entry.hash}, sort_keys=True) + "\n")
                prev = entry.hash
            fd = fh.fileno()
            size = os.fstat(fd).st_size
            # Written past the file object's buffer: a buffered write that fails
            # part-way keeps the rest to flush again on truncate and on close,
            # which on a full disk would leave the half line the truncate undoes.
            rest = "".join(lines).encode()
            try:
                # On disk before the commitment is reported anywhere.
                while rest:
                    rest = rest[os.write(fd, rest) :]
                os.fsync(fd)
            except BaseException:
                # A disk that filled up mid-line (or an interrupt) leaves no half
                # entry behind to break the chain for every later step.
                with contextlib.suppress(OSError):
                    os.ftruncate(fd, size)
                raise
        return entries

    def latest(self, kind: str, subject: str, entries: Sequence[Entry] | None = None) -> Entry | None:
        """The newest entry of this kind and subject, or None; of `entries` where given (read already)."""
        found = [e for e in (self.entries() if entries is None else entries) if e.kind == kind and e.subject == subject]
        return found[-1] if found else None

    def require(self, kind: str, subject: str, *, hint: str, entries: Sequence[Entry] | None = None) -> Entry:
        """The newest entry of this kind and subject, or a refusal that says how
        to make it; the ledger's commitments in force are first compared with
        the record (check_record). `entries`: the ledger as read already."""
        entries = self.entries() if entries is None else entries
        found = [e for e in entries if e.kind == kind and e.subject == subject]
        if not found:
            raise RefusedError(f"no {kind} commitment for {subject} in {self.path}", hint=hint)
        self.check_record(entries)
        return found[-1]

    def check_record(self, entries: Sequence[Entry] | None = None) -> None:
        """Refuse, in one line naming the first that disagrees, unless every
        commitment in force is on the record: mirrored on the run that made it,
        and for the gate, its receipt artifact hashing to the committed digest.
        A ledger rewritten whole with a valid chain fails here. Checked once
        per process for the same entries and store."""
        entries = self.entries() if entries is None else list(entries)
        force = [e for e in in_force(entries) if e.kind in (INPUTS, GATE, PROBE, PLAN, CANDIDATE)]
        if not force:
            return
        from coopstudy.record import store

        key = (str(self.path), store.tracking_uri(), tuple(e.hash for e in force))
        if key in _CONFIRMED:
            return
        record = _Record()
        for entry in force:
            problem = record.disagreement(entry)
            if problem:
                raise LedgerError(f"ledger {self.path} line {entry.seq + 1} ({_name(entry)}) disagrees with the record: {problem}")
        _CONFIRMED.add(key)


_CONFIRMED: set[tuple[str, str, tuple[str, ...]]] = set()
"""Ledger states this process has found in agreement with the record."""


def _name(entry: Entry) -> str:
    subject = entry.subject if len(entry.subject) <= 40 else entry.subject[:12] + "…" + entry.subject[-24:]
    return f"{entry.kind} {subject}, {entry.digest[:12]}"


def _recommit(entry: Entry) -> str:
    """What to do about an entry the record contradicts."""
    restore = "the ledger was rewritten or comes from another record: restore it from a copy"
    if entry.kind == CANDIDATE:
        return f"{restore} (a selection is made once)"
    from coopstudy.config import preset_argument

    preset = entry.details.get("preset")
    return f"{restore}, or commit again: `{_RECOMMIT[entry.kind]}{f' --preset {preset_argument(preset)}' if preset else ''}`"


class _Record:
    """The commitments the record's runs carry, read once per kind."""

    def __init__(self) -> None:
        from coopstudy.record import store

        self._client = store.client()
        self._mirrored: dict[str, dict[str, list[Any]]] = {}
        self._experiments: list[str] | None = None

    def _experiment_ids(self) -> list[str]:
        if self._experiments is None:
            from mlflow.entities import ViewType

            self._experiments = [e.experiment_id for e in self._client.search_experiments(view_type=ViewType.ALL)]
        return self._experiments

    def _search(self, filter_string: str) -> list[Any]:
        from mlflow.entities import ViewType

        ids = self._experiment_ids()
        runs: list[Any] = []
        token = None
        while ids:
            page = self._client.search_runs(ids, filter_string, run_view_type=ViewType.ALL, max_results=1000, page_token=token)
            runs.extend(page)
            token = page.token
            if not token:
                break
        return runs

    def mirrored(self, kind: str) -> dict[str, list[Any]]:
        """digest -> the runs tagged as having committed it."""
        if kind not in self._mirrored:
            from coopstudy.record import schema

            tag = schema.TAG_COMMITMENT_PREFIX + kind
            found: dict[str, list[Any]] = {}
            for run in self._search(f"tags.`{tag}` LIKE '%'"):
                found.setdefault(run.data.tags[tag], []).append(run)
            self._mirrored[kind] = found
        return self._mirrored[kind]

    def disagreement(self, entry: Entry) -> str | None:
        """What about `entry` the record contradicts, in words, or None."""
        from coopstudy.record import schema

        if entry.kind == CANDIDATE:
            return self._candidate(entry)
        runs = self.mirrored(entry.kind).get(entry.digest)
        if not runs:
            held = self._held_instead(entry)
            waiting = _waiting_in_outbox(entry.digest)
            if waiting:
                return _still_waits("its run's", schema.TAG_COMMITMENT_PREFIX + entry.kind, waiting)
            return f"no run of the record committed {entry.digest[:12]}{held}; {_recommit(entry)}"
        if entry.kind == GATE:
            return self._gate_receipt(entry)
        return None

    def _held_instead(self, entry: Entry) -> str:
        """What the record holds for the same thing, if it can be found."""
        from coopstudy.record import schema

        if entry.kind == INPUTS:
            tag, what = schema.TAG_INPUTS_KEY, "prepare runs of these settings"
        elif entry.kind == PLAN:
            tag, what = schema.TAG_CONFIG_SHA, "plan runs of this config"
        else:
            run_id = entry.details.get("run_id")
            if not run_id:
                return ""
            try:
                run = self._client.get_run(run_id)
            except Exception:  # noqa: BLE001 - a run id that is not in the record
                return f" (its run {run_id} is not in the record)"
            held = run.data.tags.get(schema.TAG_COMMITMENT_PREFIX + entry.kind)
            return f" (its run {run_id} committed {held[:12]})" if held else f" (its run {run_id} committed nothing)"
        digests = sorted({d for d, runs in self.mirrored(entry.kind).items() if any(r.data.tags.get(tag) == entry.subject for r in runs)})
        if not digests:
            return f" (the record holds no {what})"
        return f" (the {what} committed {', '.join(d[:12] for d in digests)})"

    def _gate_receipt(self, entry: Entry) -> str | None:
        """The receipt on the verify run hashes to the entry's digest and says
        what the entry says of the sources and libraries."""
        from coopstudy.record import schema, store

        run_id = entry.details.get("run_id")
        if not run_id:
            return None
        rerun = "run `python -m coopstudy verify`"
        try:
            receipt = store.artifact_json(run_id, schema.ART_GATE_RECEIPT)
        except Exception as err:  # noqa: BLE001 - missing or unreadable: the same refusal
            from coopstudy.record import outbox

            if outbox.is_outage(err):
                raise
            return f"the gate receipt {schema.ART_GATE_RECEIPT} of verify run {run_id} cannot be read ({type(err).__name__}); {rerun}"
        actual = workspace.sha256_json(receipt)
        if actual != entry.digest:
            return (
                f"the gate receipt {schema.ART_GATE_RECEIPT} of verify run {run_id} hashes to {actual[:12]}, "
                f"not the committed {entry.digest[:12]}: it was edited; {rerun}"
            )
        for field in ("sources", "libraries"):
            if receipt.get(field) != entry.details.get(field):
                return f"its {field} differ from those of the gate receipt of verify run {run_id}; {_recommit(entry)}"
        return None

    def _candidate(self, entry: Entry) -> str | None:
        from coopstudy.record import schema

        arm, run_id = entry.details.get("arm"), entry.details.get("select_run_id")
        if not arm or not run_id:
            return f"it names no arm or select run; {_recommit(entry)}"
        try:
            tags = self._client.get_run(run_id).data.tags
        except Exception as err:  # noqa: BLE001
            from coopstudy.record import outbox

            if outbox.is_outage(err):
                raise  # the server did not answer: said as an outage, not as a ledger from elsewhere
            return f"its select run {run_id} is not in the record; {_recommit(entry)}"
        held = tags.get(schema.TAG_CANDIDATE_PREFIX + arm)
        if held != entry.digest:
            # A select during an outage: its run's tags wait on this host.
            waiting = _waiting_in_outbox(entry.digest, run_id)
            if waiting:
                return _still_waits(f"select run {run_id}'s", schema.TAG_CANDIDATE_PREFIX + arm, waiting)
            said = f"selected {held[:12]}" if held else "selected nothing"
            return f"select run {run_id} {said} for the {arm} arm, the ledger says {entry.digest[:12]}; {_recommit(entry)}"
        return None


def _still_waits(whose: str, tag: str, outbox_file: str) -> str:
    """A commitment's mirror that has not reached the record yet: it waits in this host's outbox."""
    return f"{whose} tag {tag} still waits in {outbox_file}; deliver it: `python -m coopstudy remote deliver`"


def _waiting_in_outbox(digest: str, run_id: str | None = None) -> str | None:
    """The outbox file of this host (of run `run_id`'s alone, where given)
    that still holds a record naming `digest`."""
    from coopstudy.record import outbox

    folder = outbox.outbox_dir()
    if not folder.is_dir():
        return None
    for path in sorted(folder.glob(outbox.outbox_file(run_id or "*").name)):
        with contextlib.suppress(OSError):
            if digest in path.read_text():
                return str(path)
    return None
