"""A bad `data.replay_source` is refused by the real `prepare` CLI: one line
naming the file and what is wrong with it, exit 2, no traceback, before any
other work (the seed is not even resolved)."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from fixtures import run_cli

from coopstudy.record import schema, store

GOOD = {"messages": [{"role": "user", "content": "Hi, how are you?"}, {"role": "assistant", "content": "Fine, thanks."}]}


def _jsonl(path, *rows: object, raw: str | None = None):
    path.write_text(raw if raw is not None else "".join(json.dumps(r) + "\n" for r in rows))
    return path


def _no_messages_parquet(path):
    pq.write_table(pa.table({"text": ["hello", "there"]}), path)
    return path


CASES = {
    "missing": (lambda tmp: tmp / "nowhere.jsonl", "does not exist"),
    "empty": (lambda tmp: _jsonl(tmp / "empty.jsonl", raw="\n\n"), "holds no conversations"),
    "malformed jsonl": (lambda tmp: _jsonl(tmp / "bad.jsonl", raw=json.dumps(GOOD) + "\n{not json\n"), "line 2 is not a JSON object"),
    "parquet without messages": (lambda tmp: _no_messages_parquet(tmp / "chats.parquet"), "has no `messages` column (columns: text)"),
    "no assistant turn": (
        lambda tmp: _jsonl(tmp / "chats.jsonl", GOOD, GOOD, {"messages": [{"role": "user", "content": "anyone?"}]}),
        "line 3: the conversation has no assistant turn",
    ),
    "opens with the assistant": (
        lambda tmp: _jsonl(tmp / "chats.jsonl", {"messages": [{"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Hi"}]}),
        "line 1: the conversation opens with an assistant turn",
    ),
    "a turn without a role": (
        lambda tmp: _jsonl(tmp / "chats.jsonl", {"messages": [{"content": "Hi"}, {"role": "assistant", "content": "Hello"}]}),
        "line 1: turn 1 is not a {role: system|user|assistant, content: text} object",
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_bad_replay_source_is_refused_in_one_line(case, tmp_path):
    make, expected = CASES[case]
    path = make(tmp_path)
    done = run_cli("prepare", "--preset", "tiny", "--set", f"data.replay_source={path}")
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith(f"coopstudy prepare: error: data.replay_source: {path}")
    assert expected in line, line
    # The refusal is on record, and nothing else was done.
    (run,) = store.search_runs("coopstudy", f"tags.`{schema.TAG_STAGE}` = '{schema.STAGE_PREPARE}'")
    assert run.info.status == "FAILED" and expected in run.data.tags[schema.TAG_ERROR]
    assert schema.TAG_SEED_SHA not in run.data.tags


@pytest.mark.parametrize("source", ["chitchatt", "chats.csv"])
def test_a_source_that_is_no_source_is_refused_as_config(source):
    done = run_cli("prepare", "--preset", "tiny", "--set", f"data.replay_source={source}")
    assert done.returncode == 2
    (line,) = done.stderr.strip().splitlines()
    assert f"data.replay_source: {source!r} is none of chitchat, pydoc or a path to a .jsonl or .parquet file" in line
