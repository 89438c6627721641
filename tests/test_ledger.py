"""The ledger is append-only and hash-chained: any edit is refused."""

from __future__ import annotations

import json

import pytest

from coopstudy import config, workspace
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


def test_bytes_that_are_not_utf8_are_a_line_refused(ledger):
    with open(ledger.path, "ab") as fh:
        fh.write(b"\xff\xfe\n")
    with pytest.raises(LedgerError, match="line 4 is not a ledger entry"):
        ledger.entries()


def test_require_says_how_to_fix(tmp_path):
    from coopstudy.errors import RefusedError

    with pytest.raises(RefusedError, match="run prepare first"):
        Ledger(tmp_path / "l.jsonl").require("inputs", "x", hint="run prepare first")


APPENDER = """
import sys
from coopstudy.commit.ledger import Ledger
book = Ledger(sys.argv[1])
for i in range(int(sys.argv[3])):
    book.append("probe", f"{sys.argv[2]}/{i}", f"{sys.argv[2]}-{i}")
"""


def test_appends_from_many_processes_keep_one_chain(tmp_path):
    """Stages commit at once (a probe sweep, two prepares): the append lock keeps one linear chain."""
    import subprocess
    import sys

    path = tmp_path / "ledger.jsonl"
    procs = [subprocess.Popen([sys.executable, "-c", APPENDER, str(path), f"p{n}", "25"]) for n in range(4)]
    assert [p.wait(timeout=120) for p in procs] == [0, 0, 0, 0]
    entries = Ledger(path).entries()  # the chain verifies
    assert len(entries) == 100
    assert {e.subject for e in entries} == {f"p{n}/{i}" for n in range(4) for i in range(25)}


def test_a_failed_append_leaves_no_half_line(ledger, monkeypatch):
    import os as os_mod

    def no_space(fd):
        raise OSError(28, "No space left on device")

    with monkeypatch.context() as mp:
        mp.setattr(os_mod, "fsync", no_space)
        with pytest.raises(OSError, match="No space left"):
            ledger.append("plan", "c", "d4")
    assert [e.digest for e in ledger.entries()] == ["d1", "d2", "d3"]


def test_a_disk_that_fills_up_mid_line_leaves_no_half_line(ledger, monkeypatch):
    import os as os_mod

    real_write = os_mod.write
    calls = []

    def half_then_full(fd, data):
        # What a filling disk does: a short write, then ENOSPC for the rest.
        calls.append(len(data))
        if len(calls) == 1:
            return real_write(fd, data[: len(data) // 2])
        raise OSError(28, "No space left on device")

    with monkeypatch.context() as mp:
        mp.setattr(os_mod, "write", half_then_full)
        with pytest.raises(OSError, match="No space left"):
            ledger.append("plan", "c", "d4")
    assert len(calls) == 2
    assert ledger.path.read_bytes().endswith(b"\n")
    assert [e.digest for e in ledger.entries()] == ["d1", "d2", "d3"]
    ledger.append("plan", "c", "d4")
    assert [e.digest for e in ledger.entries()] == ["d1", "d2", "d3", "d4"]


# --- the ledger against the record ------------------------------------------


def _mirrored(kind: str, digest: str) -> str:
    """A run that committed `digest`, as the step that commits `kind` records it."""
    from coopstudy.record import writer

    with writer.stage_run(kind, None, log_config=False) as rec:
        rec.record_commitment(kind, digest)
    return rec.run_id


def _rechained(path, edit) -> None:
    """The ledger rewritten whole, as a forger would: every line re-hashed."""
    from coopstudy.commit import ledger as ledger_mod

    raws = [json.loads(line) for line in path.read_text().splitlines()]
    edit(raws)
    prev = ledger_mod.GENESIS
    for n, raw in enumerate(raws):
        raw["seq"], raw["prev"] = n, prev
        raw["hash"] = prev = ledger_mod._entry_hash({k: raw[k] for k in ("seq", "time", "kind", "subject", "digest", "details", "prev")})
    path.write_text("".join(json.dumps(r, sort_keys=True) + "\n" for r in raws))


@pytest.mark.parametrize("outside", [False, True], ids=["preset", "preset file"])
def test_a_chain_rewritten_whole_is_refused_naming_the_first_commitment_the_record_disagrees_with(tmp_path, outside):
    preset, again = "tiny", "tiny"
    if outside:
        # A preset file outside configs/ is named again by its path: its name alone cannot load.
        mine = tmp_path / "mine.yaml"
        mine.write_text((workspace.project_root() / "configs" / "tiny.yaml").read_text() + "preset: exp1\n")
        preset, again = config.load(str(mine)).preset, str(mine)
    book = Ledger()
    _mirrored("inputs", "i" * 64)
    _mirrored("plan", "p" * 64)
    book.append("inputs", "key", "i" * 64, {"preset": preset})
    book.append("plan", "config", "p" * 64, {"preset": preset})
    assert book.require("plan", "config", hint="-").digest == "p" * 64

    def forge(raws):
        raws[0]["digest"] = "f" * 64
        raws[1]["digest"] = "e" * 64

    _rechained(book.path, forge)
    assert [e.digest for e in book.entries()] == ["f" * 64, "e" * 64]  # the chain alone verifies
    with pytest.raises(LedgerError) as refused:
        book.require("plan", "config", hint="-")
    line = str(refused.value)
    assert "\n" not in line
    assert f"line 1 (inputs key, {'f' * 12}) disagrees with the record: no run of the record committed {'f' * 12}" in line
    assert f"commit again: `python -m coopstudy prepare --preset {again}`" in line


@pytest.mark.parametrize("stopped_in", ["record_commitment", "extend"], ids=["tagging its run", "appending"])
def test_a_plan_stopped_while_it_commits_leaves_nothing_that_refuses_the_next(probed_tiny, capsys, stopped_in):
    """The run's tag first, then the ledger: stopped in between, plan runs
    again. Before, the entry came first, and one whose run never took its tag
    refused every step after it, plan itself included."""
    from coopstudy import cli as cli_mod
    from coopstudy.commit import plan
    from coopstudy.record import writer

    def stop(*args, **kwargs):
        raise KeyboardInterrupt

    owner = writer.Recorder if stopped_in == "record_commitment" else Ledger
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(owner, stopped_in, stop)
        assert cli_mod.main(["plan", "--preset", "tiny"]) == 130
    subject = plan.subject(config.load("tiny"))
    assert Ledger().latest("plan", subject) is None
    capsys.readouterr()
    assert cli_mod.main(["plan", "--preset", "tiny"]) == 0, capsys.readouterr().err
    assert " committed (ledger entry " in capsys.readouterr().out
    Ledger().require("plan", subject, hint="-")


def test_only_the_commitments_in_force_are_compared():
    """An entry replaced by a newer one of the same subject (a ledger
    restored from an older copy, then committed again) is not the record's business."""
    book = Ledger()
    book.append("gate", "numerical-sources", "a" * 64)  # its run never said so
    book.append("inputs", "key", "i" * 64)
    _mirrored("inputs", "i" * 64)
    with pytest.raises(LedgerError, match="line 1 .gate numerical-sources.*no run of the record committed aaaaaaaaaaaa"):
        book.require("inputs", "key", hint="-")
    _mirrored("gate", "b" * 64)
    book.append("gate", "numerical-sources", "b" * 64)
    assert book.require("inputs", "key", hint="-").digest == "i" * 64


def test_a_candidate_must_be_what_its_select_run_selected():
    from coopstudy.record import schema, writer

    with writer.stage_run(schema.STAGE_SELECT, None, log_config=False) as rec:
        rec.set_tags({schema.TAG_CANDIDATE_PREFIX + "control": "c" * 64})
    book = Ledger()
    book.append("candidate", "plan/control", "c" * 64, {"arm": "control", "select_run_id": rec.run_id})
    book.check_record()

    def forge(raws):
        raws[0]["digest"] = "d" * 64

    _rechained(book.path, forge)
    with pytest.raises(LedgerError, match=f"select run {rec.run_id} selected cccccccccccc for the control arm, the ledger says dddddddddddd"):
        book.check_record()
