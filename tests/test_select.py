"""select commits each arm's final checkpoint once, by hash; evaluate refuses
to score without that selection or when the weights changed after it.

Train runs here are recorded as `train` records them (stage, arm, plan sha,
checkpoint sha256 and path) around a copy of the tiny seed, under a plan that
`planned` stands in for, so select is tested on its own through the CLI's
`main`; the slow test at the end runs the real steps in order.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from fixtures import PLAN, fake_train_run, run_cli

from coopstudy import cli, config, workspace
from coopstudy.commit import candidates, ledger, require
from coopstudy.config import ARMS
from coopstudy.errors import RefusedError
from coopstudy.record import schema, store, writer


def _tamper(folder: Path) -> None:
    weights = folder / workspace.WEIGHTS_FILE
    blob = bytearray(weights.read_bytes())
    blob[-1] ^= 0xFF  # one bit pattern in the last tensor's data
    weights.write_bytes(bytes(blob))


def _runs(stage: str, status: str | None = None) -> list:
    flt = f"tags.`{schema.TAG_STAGE}` = '{stage}'" + (f" and attributes.status = '{status}'" if status else "")
    return store.search_runs("coopstudy", flt)


@pytest.fixture
def cfg():
    return config.load("tiny")


@pytest.fixture
def trained(cfg, tiny_seed, planned):
    """Both arms finished; arm -> (train run id, checkpoint folder)."""
    return {arm: fake_train_run(cfg, arm, tiny_seed.path) for arm in ARMS}


def _candidate_entries() -> list[ledger.Entry]:
    return [e for e in ledger.Ledger().entries() if e.kind == ledger.CANDIDATE]


def test_select_commits_both_candidates_once(cfg, trained, capsys):
    assert cli.main(["select", "--preset", "tiny"]) == 0
    out = capsys.readouterr().out
    (select_run,) = _runs(schema.STAGE_SELECT, "FINISHED")
    assert select_run.data.tags[schema.TAG_PLAN] == PLAN
    entries = _candidate_entries()
    assert [e.subject for e in entries] == [f"{PLAN}/control", f"{PLAN}/compressed"]
    for e in entries:
        run_id, folder = trained[e.details["arm"]]
        sha = workspace.sha256_file(folder / workspace.WEIGHTS_FILE)
        assert e.digest == sha
        assert e.details["select_run_id"] == select_run.info.run_id and e.details["train_run_id"] == run_id
        assert select_run.data.tags[schema.TAG_CANDIDATE_PREFIX + e.details["arm"]] == sha
        assert select_run.data.tags[schema.TAG_CANDIDATE_RUN_PREFIX + e.details["arm"]] == run_id
        assert f"{e.details['arm']:<10} sha256 {sha}" in out

    assert cli.main(["select", "--preset", "tiny"]) == 2
    err = capsys.readouterr().err
    assert f"the final candidates of plan {PLAN[:12]} were already selected at" in err
    assert f"by select run {select_run.info.run_id}" in err
    assert len(_candidate_entries()) == 2  # the first selection stands
    (refused,) = _runs(schema.STAGE_SELECT, "FAILED")
    assert select_run.info.run_id in refused.data.tags[schema.TAG_ERROR]


def test_a_selection_the_disk_cuts_short_commits_no_candidate_and_select_runs_again(cfg, trained, monkeypatch, capsys):
    # Both candidates are one commitment. Before, each arm was a write of its
    # own: a disk full at the second left the control's alone, and then select
    # refused as "already selected" while evaluate asked for select.
    import os

    real_write = os.write

    def full_at_the_compressed_arm(fd, data):
        if b'"subject": "' + PLAN.encode() + b'/compressed"' in bytes(data):
            raise OSError(28, "No space left on device")
        return real_write(fd, data)

    with monkeypatch.context() as mp:
        mp.setattr(os, "write", full_at_the_compressed_arm)
        assert cli.main(["select", "--preset", "tiny"]) == 2
    assert "No space left on device" in capsys.readouterr().err
    assert not _candidate_entries()
    assert cli.main(["select", "--preset", "tiny"]) == 0
    (select_run,) = _runs(schema.STAGE_SELECT, "FINISHED")
    assert {e.details["arm"]: e.details["select_run_id"] for e in _candidate_entries()} == {arm: select_run.info.run_id for arm in ARMS}


def test_a_selection_whose_tags_wait_in_the_outbox_is_said_so_not_taken_for_a_forged_ledger(cfg, trained, monkeypatch, capsys):
    # select during an outage: the ledger has the selection, the select run's
    # tags wait on this host. Before, evaluate called the ledger rewritten.
    import requests

    from coopstudy.record import outbox

    deliver = outbox.apply

    def server_gone_for_the_selection(client, run_id, record):
        if any(k.startswith(schema.TAG_CANDIDATE_PREFIX) for k, _ in record.get("tags", [])):
            raise requests.exceptions.ConnectionError("connection refused")
        deliver(client, run_id, record)

    monkeypatch.setenv(outbox.ENV_GRACE, "0")
    with monkeypatch.context() as mp:
        mp.setattr(outbox, "apply", server_gone_for_the_selection)
        assert cli.main(["select", "--preset", "tiny"]) == 0
    (select_run,) = _runs(schema.STAGE_SELECT)
    waiting = outbox.outbox_dir() / f"{select_run.info.run_id}.jsonl"
    assert waiting.is_file() and len(_candidate_entries()) == 2
    capsys.readouterr()

    with pytest.raises(ledger.LedgerError) as said:
        require.selection(cfg, PLAN, ledger.Ledger())
    assert f"select run {select_run.info.run_id}'s tag {schema.TAG_CANDIDATE_PREFIX}control still waits in {waiting}; " in str(said.value)
    assert str(said.value).endswith("deliver it: `python -m coopstudy remote deliver`")
    done = run_cli("remote", "deliver")
    assert done.returncode == 0, done.stderr[-3000:]
    chosen = require.selection(cfg, PLAN, ledger.Ledger())
    assert {arm: c.train_run_id for arm, c in chosen.candidates.items()} == {arm: trained[arm][0] for arm in ARMS}


def test_select_refuses_an_arm_that_has_not_finished(cfg, tiny_seed, planned, capsys):
    fake_train_run(cfg, "control", tiny_seed.path)
    failed_id, _ = fake_train_run(cfg, "compressed", tiny_seed.path, status="FAILED")
    assert cli.main(["select", "--preset", "tiny"]) == 2
    err = capsys.readouterr().err
    assert f"arm compressed has not finished (its newest train run {failed_id} is FAILED)" in err
    assert "control" not in err and "--arm compressed`" in err
    assert not _candidate_entries()
    assert _runs(schema.STAGE_SELECT, "FAILED")


def test_select_refuses_weights_changed_since_training(cfg, trained, capsys):
    run_id, folder = trained["control"]
    _tamper(folder)
    assert cli.main(["select", "--preset", "tiny"]) == 2
    err = capsys.readouterr().err
    assert f"arm control: the weights in {folder} hash to" in err and f"train run {run_id} recorded" in err
    assert not _candidate_entries()


def test_weights_gone_from_disk_come_back_from_the_train_runs_artifact(cfg, trained, capsys):
    # The record keeps each train run's checkpoint folder as an artifact: select
    # and evaluate bring back what the disk lost, whole, and hash it as before.
    for run_id, folder in trained.values():
        store.client().log_artifacts(run_id, str(folder), schema.ART_CHECKPOINT)
    (control_id, control), (compressed_id, compressed) = trained["control"], trained["compressed"]
    shas = {arm: workspace.sha256_file(folder / workspace.WEIGHTS_FILE) for arm, (_, folder) in trained.items()}
    shutil.rmtree(control)
    assert cli.main(["select", "--preset", "tiny"]) == 0
    assert f"are missing: bringing the folder back from the `checkpoint` artifact of train run {control_id}" in capsys.readouterr().out
    assert {e.details["arm"]: e.digest for e in _candidate_entries()} == shas
    (compressed / workspace.WEIGHTS_FILE).unlink()  # a folder left without its weights: replaced whole
    chosen = require.selection(cfg, PLAN, ledger.Ledger())
    assert f"bringing the folder back from the `checkpoint` artifact of train run {compressed_id}" in capsys.readouterr().out
    assert {arm: workspace.sha256_file(c.path / workspace.WEIGHTS_FILE) for arm, c in chosen.candidates.items()} == shas
    assert sorted(p.name for p in compressed.iterdir()) == sorted(p.name for p in control.iterdir())


def test_weights_whose_artifact_differs_from_the_record_are_not_brought_back(cfg, trained, tmp_path, capsys):
    run_id, folder = trained["control"]
    other = tmp_path / "other"
    shutil.copytree(folder, other)
    _tamper(other)
    store.client().log_artifacts(run_id, str(other), schema.ART_CHECKPOINT)
    shutil.rmtree(folder)
    assert cli.main(["select", "--preset", "tiny"]) == 2
    said = f"arm control: the checkpoint weights {folder / workspace.WEIGHTS_FILE} are missing, and those of the `checkpoint` artifact of train run {run_id} hash to "
    assert said in capsys.readouterr().err
    assert not folder.exists() and not _candidate_entries()


def test_select_takes_the_first_finished_run_of_the_plan(cfg, tiny_seed):
    # The predetermined candidate: before, the newest finished run, so an arm trained
    # again until it was fast enough replaced the planned one (train now refuses that).
    fake_train_run(cfg, "control", tiny_seed.path, status="FAILED")  # older, but failed
    first_id, first = fake_train_run(cfg, "control", tiny_seed.path)
    fake_train_run(cfg, "control", tiny_seed.path)  # finished after it
    compressed_id, _ = fake_train_run(cfg, "compressed", tiny_seed.path)
    fake_train_run(cfg, "compressed", tiny_seed.path, plan_sha="cd" * 32)  # another plan
    found = candidates.final_train_runs(cfg, PLAN)
    assert (found["control"].train_run_id, found["control"].path) == (first_id, first)
    assert found["compressed"].train_run_id == compressed_id


def test_select_refuses_a_train_run_without_a_checkpoint(cfg, tiny_seed, planned):
    fake_train_run(cfg, "control", tiny_seed.path)
    with writer.stage_run(schema.STAGE_TRAIN, cfg, arm="compressed", log_config=False, tags={schema.TAG_PLAN: PLAN}) as rec:
        pass
    with pytest.raises(RefusedError, match=f"arm compressed: train run {rec.run_id} records no final checkpoint"):
        candidates.final_train_runs(cfg, PLAN)


def test_select_and_evaluate_refuse_without_a_plan():
    for step in ("select", "evaluate"):
        done = run_cli(step, "--preset", "tiny")
        assert done.returncode == 2
        assert f"coopstudy {step}: error: no plan commitment" in done.stderr
        assert "Traceback" not in done.stderr
        (failed,) = _runs(step, "FAILED")
        assert "no plan commitment" in failed.data.tags[schema.TAG_ERROR]


def test_evaluate_refuses_before_select(cfg, trained, capsys):
    assert cli.main(["evaluate", "--preset", "tiny"]) == 2
    err = capsys.readouterr().err
    assert f"no final candidates selected under plan {PLAN[:12]}" in err
    assert "run `python -m coopstudy select --preset tiny` first" in err
    (failed,) = _runs(schema.STAGE_EVALUATE, "FAILED")
    assert "no final candidates selected" in failed.data.tags[schema.TAG_ERROR]
    assert failed.data.tags[schema.TAG_PLAN] == PLAN


def test_evaluate_refuses_candidate_weights_changed_after_select(cfg, trained, capsys):
    assert cli.main(["select", "--preset", "tiny"]) == 0
    (select_run,) = _runs(schema.STAGE_SELECT, "FINISHED")
    _, folder = trained["compressed"]
    _tamper(folder)
    assert cli.main(["evaluate", "--preset", "tiny"]) == 2
    err = capsys.readouterr().err
    assert "the compressed candidate selected at" in err and f"by select run {select_run.info.run_id}" in err
    assert "they changed after selection, refusing to score them" in err
    shutil.rmtree(folder)
    assert cli.main(["evaluate", "--preset", "tiny"]) == 2
    err = capsys.readouterr().err
    assert f"the checkpoint weights {folder / workspace.WEIGHTS_FILE} are missing, and the `checkpoint` artifact of train run" in err
    assert "could not be read" in err
    assert len(_runs(schema.STAGE_EVALUATE, "FAILED")) == 2

@pytest.mark.parametrize("status", ["KILLED", "RUNNING"])
def test_a_train_run_that_did_not_finish_is_never_a_candidate_whatever_it_left(cfg, tiny_seed, planned, capsys, status):
    """Interrupted or stopped (KILLED), or its stage killed with it (left RUNNING):
    even with a verified checkpoint on record, select refuses it."""
    fake_train_run(cfg, "control", tiny_seed.path)
    run_id, _ = fake_train_run(cfg, "compressed", tiny_seed.path)
    client = store.client()
    if status == "RUNNING":
        client.update_run(run_id, status="RUNNING")
    else:
        client.set_terminated(run_id, status)
    assert cli.main(["select", "--preset", "tiny"]) == 2
    assert f"arm compressed has not finished (its newest train run {run_id} is {status})" in capsys.readouterr().err
    assert not _candidate_entries()


def test_the_selection_is_on_the_select_run_before_it_is_in_the_ledger(cfg, trained, monkeypatch, capsys):
    """Mirror first: a select that dies between the two leaves a tagged run and
    no ledger entry, never an entry the record does not hold."""
    from coopstudy.commit import candidates as candidates_mod

    def dies(*args, **kwargs):
        raise KeyboardInterrupt

    with monkeypatch.context() as mp:
        mp.setattr(candidates_mod, "commit", dies)
        assert cli.main(["select", "--preset", "tiny"]) == 130
    (run,) = _runs(schema.STAGE_SELECT, "KILLED")
    assert {arm: run.data.tags.get(schema.TAG_CANDIDATE_PREFIX + arm) for arm in ARMS} == {
        arm: workspace.sha256_file(trained[arm][1] / workspace.WEIGHTS_FILE) for arm in ARMS
    }
    assert not _candidate_entries()
    capsys.readouterr()
    assert cli.main(["select", "--preset", "tiny"]) == 0, capsys.readouterr().err
    assert len(_candidate_entries()) == 2
