"""The ledger is append-only and hash-chained: any edit is refused."""

from __future__ import annotations

import json

import pytest

from coopstudy.commit.ledger import Ledger, LedgerError


@pytest.fixture
def ledger(tmp_path):
    led = Ledger(tmp_path / "ledger.jsonl")
    led.append("inputs", "a", "d1", {"folder": "x"})
    led.append("gate", "sources", "d2")
    led.append("inputs", "a", "d3")
    return led


def test_chain_verifies_and_latest_wins(ledger):
    entries = ledger.entries()
    assert [e.seq for e in entries] == [0, 1, 2]
    assert entries[1].prev == entries[0].hash
    assert ledger.latest("inputs", "a").digest == "d3"
    assert ledger.latest("gate", "other") is None


def _rewrite(path, fn):
    lines = path.read_text().splitlines()
    path.write_text("\n".join(fn(lines)) + "\n")


def test_edited_entry_refused(ledger):
    def edit(lines):
        raw = json.loads(lines[1])
        raw["digest"] = "forged"
        lines[1] = json.dumps(raw, sort_keys=True)
        return lines

    _rewrite(ledger.path, edit)
    with pytest.raises(LedgerError, match="line 2 .*altered"):
        ledger.entries()


def test_removed_entry_refused(ledger):
    _rewrite(ledger.path, lambda lines: [lines[0], lines[2]])
    with pytest.raises(LedgerError, match="removed or reordered"):
        ledger.latest("inputs", "a")


def test_garbage_refused(ledger):
    _rewrite(ledger.path, lambda lines: lines + ["not json"])
    with pytest.raises(LedgerError, match="line 4 is not a ledger entry"):
        ledger.entries()


def test_require_says_how_to_fix(tmp_path):
    from coopstudy.errors import RefusedError

    with pytest.raises(RefusedError, match="run prepare first"):
        Ledger(tmp_path / "l.jsonl").require("inputs", "x", hint="run prepare first")
