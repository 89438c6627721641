"""`prepare --preset tiny` end to end: what it records, reuse, and refusals of
changed inputs or a changed ledger."""

from __future__ import annotations

import json
import re

import mlflow
import pytest

from coopstudy import cli, config, ui
from coopstudy.commit import ledger, require
from coopstudy.errors import RefusedError
from coopstudy.inputs import data
from coopstudy.record import schema, writer

# The shared seed and prepared-store fixtures (made once per session).

pytestmark = pytest.mark.slow


def _prepare_runs(uri: str) -> list:
    client = mlflow.MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name("coopstudy")
    return client.search_runs([exp.experiment_id], f"tags.`{schema.TAG_STAGE}` = 'prepare'", order_by=["attributes.start_time ASC"])


def test_prepare_records_inputs_config_and_commitment(prepared_tiny, tmp_path):
    assert " written " in prepared_tiny.printed.stdout
    (run,) = _prepare_runs(prepared_tiny.tracking_uri)
    assert run.info.status == "FINISHED"
    cfg = config.load("tiny")
    logged = {k: v for k, v in config.flatten(cfg).items() if k not in writer.NOT_PARAMS}
    assert logged.items() <= run.data.params.items() and run.data.tags[schema.TAG_PRESET] == "tiny"
    # Where replay and retention come from, the split and the overlap checks are on record and printed.
    assert "replay 16 and retention 8 conversations from chitchat (chitchat-dataset 0.9.0" in prepared_tiny.printed.stdout
    assert "overlap with replay: 0" in prepared_tiny.printed.stdout
    # Off a terminal, progress is a log line per twentieth of the work and one at the end, not one per item.
    lines = [ln for ln in prepared_tiny.printed.stderr.splitlines() if ln.startswith("tokenizing tasks: ")]
    total = cfg.data.tasks_per_family * len(cfg.data.families)
    assert total > 2 * ui.LOG_LINES and len(lines) <= ui.LOG_LINES + 1
    assert re.fullmatch(rf"tokenizing tasks: {total}/{total} in \d+\.\d s", lines[-1]), lines[-1]

    (entry,) = ledger.Ledger(prepared_tiny.home / "ledger.jsonl").entries()
    assert (entry.kind, entry.subject) == (ledger.INPUTS, data.inputs_key(cfg))
    tags = run.data.tags
    assert tags[schema.TAG_INPUTS] == tags[schema.TAG_COMMITMENT_PREFIX + ledger.INPUTS] == entry.digest
    assert entry.digest in prepared_tiny.printed.stdout

    client = mlflow.MlflowClient(tracking_uri=prepared_tiny.tracking_uri)
    manifest_path = client.download_artifacts(run.info.run_id, schema.ART_MANIFEST, str(tmp_path))
    raw = open(manifest_path, "rb").read()
    assert data.workspace.sha256_bytes(raw) == entry.digest
    manifest = json.loads(raw)
    assert manifest["conversations"]["source"] == "chitchat" and manifest["split"]["retention_groups"] >= 4
    assert set(manifest["checks"].values()) == {0}
    assert tags[schema.TAG_SEED_SHA] == manifest["seed_model"]["sha256"]
    assert run.data.params[schema.PARAM_SEED_PARAMETERS] == str(manifest["seed_model"]["parameters"])

    inputs = {d.dataset.name: d for d in run.inputs.dataset_inputs}
    assert set(inputs) == set(manifest["files"]) == {data.TRAIN, data.RETENTION, data.TEST, data.SCHEDULE}
    for name, d in inputs.items():
        assert d.dataset.digest == manifest["files"][name]["sha256"][:36]
        assert json.loads(d.dataset.source)["sha256"] == manifest["files"][name]["sha256"]

    metrics = run.data.metrics
    assert metrics[schema.M_PREPARE_TRUNCATED] == manifest["truncation"]["documents"] > 0
    assert metrics[schema.M_PREPARE_TRUNCATED_TOKENS] == manifest["truncation"]["tokens"]
    assert metrics[schema.M_PREPARE_SECONDS] > 0

    prepared = require.inputs(cfg)
    assert prepared.digest == entry.digest
    assert (len(prepared.train), len(prepared.retention), len(prepared.test)) == (64, 8, 16)
    assert len(prepared.schedule) == cfg.train.updates and {len(b) for b in prepared.schedule} == {cfg.train.global_batch}


def test_a_second_run_reproduces_the_hashes_and_reuses_the_folder(prepared_tiny, capsys):
    assert cli.main(["prepare", "--preset", "tiny"]) == 0
    out = capsys.readouterr().out
    first, second = _prepare_runs(prepared_tiny.tracking_uri)
    assert first.data.tags[schema.TAG_INPUTS] == second.data.tags[schema.TAG_INPUTS]
    assert f"inputs sha256 {second.data.tags[schema.TAG_INPUTS]}: reused" in out
    assert "already committed" in out
    assert len(ledger.Ledger().entries()) == 1


def test_a_changed_prepared_file_is_refused_by_name(prepared_tiny):
    (folder,) = (prepared_tiny.home / "prepared").iterdir()
    lines = (folder / data.TRAIN).read_text().splitlines()
    doc = json.loads(lines[3])
    doc["weights"][-2] = 100.0
    lines[3] = json.dumps(doc)
    (folder / data.TRAIN).write_text("\n".join(lines) + "\n")
    with pytest.raises(RefusedError, match=r"train\.jsonl changed since it was committed"):
        require.inputs(config.load("tiny"))


def test_inputs_that_were_never_prepared_are_refused():
    with pytest.raises(RefusedError, match="no inputs commitment .* run `python -m coopstudy prepare --preset tiny`"):
        require.inputs(config.load("tiny"))


def test_a_changed_ledger_is_refused_in_one_line(prepared_tiny, capsys):
    path = prepared_tiny.home / "ledger.jsonl"
    entry = json.loads(path.read_text())
    entry["details"]["folder"] = "prepared/elsewhere"
    path.write_text(json.dumps(entry) + "\n")
    assert cli.main(["prepare", "--preset", "tiny"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert "ledger" in err and "was altered after it was written" in err


def test_a_context_below_the_longest_prompt_is_refused(prepared_tiny, capsys):
    assert cli.main(["prepare", "--preset", "tiny", "--set", "data.max_context=40"]) == 2
    err = capsys.readouterr().err
    # Progress lines come first; the refusal is one line, without a traceback.
    assert "Traceback" not in err
    assert err.strip().splitlines()[-1].startswith(
        "coopstudy prepare: error: data.max_context: 40 is a context below the longest prompt ("
    )


def test_quick_work_off_a_terminal_says_only_its_last_line(capsys):
    with ui.progress("tokenizing tasks", 48) as advance:
        for _ in range(48):
            advance()
    assert re.fullmatch(r"tokenizing tasks: 48/48 in 0\.\d s\n", capsys.readouterr().err)
