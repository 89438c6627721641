"""The ledger: an append-only, hash-chained record of commitments.

Each line is one JSON entry holding the previous entry's hash, so an edited,
removed or reordered line breaks the chain and the whole ledger is refused.
Stages append what they commit to (inputs, gate receipt, plan, candidates) and
refuse to run when an entry they need is missing or no longer matches.
"""

from __future__ import annotations

import fcntl
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from coopstudy import workspace
from coopstudy.errors import RefusedError, UserError

GENESIS = "0" * 64

# Kinds of commitment, in the order the protocol makes them.
INPUTS = "inputs"
GATE = "gate"
PROBE = "probe"
PLAN = "plan"
CANDIDATE = "candidate"


class LedgerError(UserError):
    """The ledger's chain does not verify."""


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
    return workspace.sha256_bytes(json.dumps(body, sort_keys=True, separators=(",", ":")).encode())


class Ledger:
    def __init__(self, path: str | Path | None = None):
        self.path = Path(path) if path else workspace.home() / "ledger.jsonl"

    def entries(self) -> list[Entry]:
        """Every entry, after checking the whole chain."""
        if not self.path.exists():
            return []
        out: list[Entry] = []
        prev = GENESIS
        for n, line in enumerate(self.path.read_text().splitlines(), start=1):
            try:
                raw = json.loads(line)
                body = {k: raw[k] for k in ("seq", "time", "kind", "subject", "digest", "details", "prev")}
                stored = raw["hash"]
            except (ValueError, KeyError, TypeError):
                raise LedgerError(f"ledger {self.path}: line {n} is not a ledger entry; the record was edited") from None
            if body["prev"] != prev or body["seq"] != n - 1:
                raise LedgerError(f"ledger {self.path}: line {n} does not follow line {n - 1}; entries were removed or reordered")
            if _entry_hash(body) != stored:
                raise LedgerError(f"ledger {self.path}: line {n} ({body['kind']} {body['subject']}) was altered after it was written")
            out.append(Entry(**body, hash=stored))
            prev = stored
        return out

    def append(self, kind: str, subject: str, digest: str, details: dict[str, Any] | None = None) -> Entry:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a+") as fh:
            # Two stages may append at once (ranks, a parallel sweep): the lock
            # keeps the chain linear.
            fcntl.flock(fh, fcntl.LOCK_EX)
            existing = self.entries()
            body = {
                "seq": len(existing),
                "time": time.time(),
                "kind": kind,
                "subject": subject,
                "digest": digest,
                "details": details or {},
                "prev": existing[-1].hash if existing else GENESIS,
            }
            entry = Entry(**body, hash=_entry_hash(body))
            fh.write(json.dumps(body | {"hash": entry.hash}, sort_keys=True) + "\n")
            fh.flush()
        return entry

    def latest(self, kind: str, subject: str) -> Entry | None:
        found = [e for e in self.entries() if e.kind == kind and e.subject == subject]
        return found[-1] if found else None

    def require(self, kind: str, subject: str, *, hint: str) -> Entry:
        """The newest entry of this kind and subject, or a refusal that says how to make it."""
        entry = self.latest(kind, subject)
        if entry is None:
            raise RefusedError(f"no {kind} commitment for {subject} in {self.path}; {hint}")
        return entry
