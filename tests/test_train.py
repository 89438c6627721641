"""train on the tiny preset, through the real CLI: both arms side by side, the
checkpoint on record, and a killed rank that ends the whole arm as FAILED.

The module shares one store, a copy of the session's with both arms trained
as `mlflow run . -e train -P arm=both` trains them (fixtures.trained_tiny_store);
the tests read those runs, and train, kill and stop runs of their own.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import time

import mlflow
import psutil
import pytest
from fixtures import LONG, PROJECT_RUN_TAG, ROOT, module_store, store_locked

from coopstudy import config, errors, study, workspace
from coopstudy.commit import sources
from coopstudy.errors import RefusedError
from coopstudy.record import outbox, remote, schema, store, writer
from coopstudy.run import checkpoint, launch, lock, worker

pytestmark = pytest.mark.slow

@pytest.fixture(scope="module", autouse=True)
def isolated_store(tmp_path_factory, trained_tiny_store):
    # Overrides conftest's per-test store: this module's tests share one, a
    # copy of the session's tiny store with both arms trained through the
    # front door (`both`), and a LONG config planned for a run to kill.
    with module_store(tmp_path_factory, trained_tiny_store, "train-store") as shared:
        yield shared


def _client() -> mlflow.MlflowClient:
    return store.client()


def _runs(filter_string: str) -> list:
    exp = _client().get_experiment_by_name("coopstudy")
    return _client().search_runs([exp.experiment_id], filter_string)


def _history(run, name: str) -> list[float]:
    return [m.value for m in sorted(_client().get_metric_history(run.info.run_id, name), key=lambda m: m.step)]


@pytest.fixture(scope="module")
def both(trained_tiny_store):
    """`train --arm both` as `mlflow run . -e train -P arm=both` starts it
    (fixtures.trained_tiny_store): the project run, its arms, what it printed."""
    (parent,) = _runs(f"tags.`{PROJECT_RUN_TAG}` = '1'")  # the run handed over in MLFLOW_RUN_ID
    children = _runs(f"tags.`mlflow.parentRunId` = '{parent.info.run_id}'")
    return parent, {run.data.tags[schema.TAG_ARM]: run for run in children}, trained_tiny_store.printed


def test_both_arms_sit_side_by_side_under_one_parent(both):
    parent, arms, done = both
    assert parent.info.status == "FINISHED" and parent.info.run_name == "train-both-tiny"
    assert set(arms) == {"control", "compressed"}
    for arm, run in arms.items():
        assert run.info.status == "FINISHED"
        assert run.info.run_name == f"train-{arm}-tiny"
        assert run.data.tags[schema.TAG_STAGE] == schema.STAGE_TRAIN
        assert run.data.params["train.updates"] == "6"
    # Control first, then compressed: never two training jobs at once.
    assert arms["control"].info.end_time <= arms["compressed"].info.start_time
    # Each arm run carries the key of the study's step that trains that arm, so a study reuses it.
    keys: dict[str, str] = {}
    for step in study.STEPS:
        keys[step.name] = study.step_key(step, config.load("tiny"), keys)
    assert {arm: run.data.tags.get(schema.TAG_STEP_KEY) for arm, run in arms.items()} == {a: keys[f"train-{a}"] for a in arms}
    assert schema.TAG_STEP_KEY not in parent.data.tags
    # Not a terminal: plain progress lines, one per update.
    assert "train control: update 6/6 loss" in done.stderr


def test_same_per_update_metrics_in_both_arms(both):
    _, arms, _ = both
    per_update = (schema.M_LOSS, schema.M_GRAD_NORM, schema.M_LR, schema.M_UPDATE_SECONDS, schema.M_TOKENS, schema.M_BYTES)
    for run in arms.values():
        for name in per_update:
            steps = [m.step for m in _client().get_metric_history(run.info.run_id, name)]
            assert sorted(steps) == [1, 2, 3, 4, 5, 6], (run.info.run_name, name)
    assert _history(arms["control"], schema.M_TOKENS) == _history(arms["compressed"], schema.M_TOKENS)
    assert _history(arms["control"], schema.M_LR) == _history(arms["compressed"], schema.M_LR)


def test_update_one_loss_is_the_same_in_both_arms_and_dense_updates_stay_close(both):
    _, arms, _ = both
    control, compressed = _history(arms["control"], schema.M_LOSS), _history(arms["compressed"], schema.M_LOSS)
    # Same seed weights, same global batch, fp32: only the summation order of
    # microbatches and workers differs.
    assert compressed[0] == pytest.approx(control[0], rel=1e-6)
    dense = config.load("tiny").powersgd.dense_updates
    for k in range(dense):
        assert compressed[k] == pytest.approx(control[k], rel=1e-5), f"update {k + 1}"
    grad_control, grad_compressed = _history(arms["control"], schema.M_GRAD_NORM), _history(arms["compressed"], schema.M_GRAD_NORM)
    assert grad_compressed[0] == pytest.approx(grad_control[0], rel=1e-5)


def test_run_level_timing_memory_bytes_and_cost(both):
    _, arms, _ = both
    for arm, run in arms.items():
        m = run.data.metrics
        assert 0 < m[schema.M_ACTIVE_SECONDS] < m[schema.M_COMPLETE_SECONDS]
        assert 0 < m[schema.M_CHECKPOINT_SECONDS] < m[schema.M_COMPLETE_SECONDS]
        assert m[schema.M_ACTIVE_SECONDS] >= sum(_history(run, schema.M_UPDATE_SECONDS)) * 0.999
        workers = 2 if arm == "compressed" else 1
        assert m[schema.M_DEVICE_SECONDS] == pytest.approx(workers * m[schema.M_COMPLETE_SECONDS])
        assert m[schema.M_COST_USD] == 0.0  # tiny: hourly_price_usd 0
        assert m[schema.M_PEAK_RSS_MB] > 100
        # How quiet the host was (what they measure: tests/test_launch.py's busy loop).
        assert {schema.M_OTHERS_CORES, schema.M_STEAL_SECONDS} <= m.keys()
    control, compressed = arms["control"].data.metrics, arms["compressed"].data.metrics
    # One process meets nobody; two ranks on one host wait only for each other's start-up.
    assert control[schema.M_RENDEZVOUS_SECONDS] == 0 and 0 < compressed[schema.M_RENDEZVOUS_SECONDS] < compressed[schema.M_COMPLETE_SECONDS]
    assert control[schema.M_BYTES_TOTAL] == 0 and set(_history(arms["control"], schema.M_BYTES)) == {0.0}
    assert compressed[schema.M_BYTES_DENSE] > 0 and compressed[schema.M_BYTES_COMPRESSED] > 0
    assert compressed[schema.M_BYTES_TOTAL] > compressed[schema.M_BYTES_DENSE] + compressed[schema.M_BYTES_COMPRESSED]
    # The setup broadcast is the fp32 parameters (a dense update's gradient payload) and the buffers, in the total.
    setup, dense_updates = compressed[schema.M_BYTES_SETUP], int(arms["compressed"].data.params["powersgd.dense_updates"])
    assert control[schema.M_BYTES_SETUP] == 0 and setup == pytest.approx(compressed[schema.M_BYTES_DENSE] / dense_updates, rel=0.05)
    assert setup < compressed[schema.M_BYTES_TOTAL] - compressed[schema.M_BYTES_DENSE] - compressed[schema.M_BYTES_COMPRESSED]
    # Compressed updates send less than dense ones.
    sent = _history(arms["compressed"], schema.M_BYTES)
    assert max(sent[2:]) < min(sent[:2])


def test_final_checkpoint_is_verified_kept_and_loadable(both, tmp_path):
    _, arms, _ = both
    from transformers import AutoModelForCausalLM

    for run in arms.values():
        tags = run.data.tags
        folder = workspace.home() / "checkpoints" / run.info.run_id
        assert tags[schema.TAG_CHECKPOINT_PATH] == str(folder)
        assert tags[schema.TAG_CHECKPOINT_SHA] == workspace.sha256_file(folder / "model.safetensors")
        logged = store.download_artifact(run.info.run_id, schema.ART_CHECKPOINT, tmp_path / run.info.run_id)
        assert workspace.sha256_file(logged / "model.safetensors") == tags[schema.TAG_CHECKPOINT_SHA]
        AutoModelForCausalLM.from_pretrained(folder)
    # Trained weights, not the seed: the two arms end apart (PowerSGD is lossy).
    assert arms["control"].data.tags[schema.TAG_CHECKPOINT_SHA] != arms["compressed"].data.tags[schema.TAG_CHECKPOINT_SHA]
    seed_sha = arms["control"].data.tags[schema.TAG_SEED_SHA]
    assert seed_sha not in {run.data.tags[schema.TAG_CHECKPOINT_SHA] for run in arms.values()}


def _rank_processes(parent: psutil.Process) -> dict[int, psutil.Process]:
    ranks = {}
    for proc in parent.children(recursive=True):
        try:
            cmd = proc.cmdline()
            # A rank is `python -u -m coopstudy.run.worker ...`; the launcher's own
            # command line names the module too, after --module.
            if "-m" in cmd and cmd[cmd.index("-m") + 1] == sources.WORKER:
                ranks[int(proc.environ()["LOCAL_RANK"])] = proc
        except (psutil.Error, KeyError):
            continue
    return ranks


def test_killed_rank_ends_both_within_the_collective_timeout_and_fails_the_run(tmp_path):
    """The fault matrix's "a rank killed" row (tests/test_faults.py holds the others)."""
    timeout = config.load("tiny").distributed.collective_timeout_s
    log = tmp_path / "stage.log"
    with open(log, "w") as out:
        # Output to a file: a pipe nobody reads fills up and stalls the stage.
        stage = subprocess.Popen(
            [sys.executable, "-m", "coopstudy", "train", "--preset", "tiny", "--arm", "compressed", "--set", f"train.updates={LONG}"],
            cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip
    try:
        # Wait until rank 0 has finished an update (its progress line; the
        # per-update metrics may wait in memory): both ranks are then inside
        # the training loop, synchronizing every update.
        deadline = time.monotonic() + 240
        run = None
        while time.monotonic() < deadline and stage.poll() is None:
            if "train compressed: update 1/" in log.read_text():
                found = _runs("attributes.run_name = 'train-compressed-tiny' and attributes.status = 'RUNNING'")
                run = found[0] if found else None
                break
            time.sleep(0.2)
        assert run is not None, f"no update was done: {log.read_text()[-3000:]}"

        # While it trains, the job holds the devices: a second job is refused, naming it.
        with pytest.raises(RefusedError, match=f"pid {stage.pid} "):
            with lock.device_lock(launch.local_devices(2), "second job"):
                pass

        ranks = _rank_processes(psutil.Process(stage.pid))
        assert set(ranks) == {0, 1}
        killed_at = time.monotonic()
        ranks[1].kill()
        gone, alive = psutil.wait_procs([ranks[0]], timeout=timeout)
        assert not alive, f"rank 0 still running {timeout} s after rank 1 was killed"
        stage.wait(timeout=60)
        ended_in = time.monotonic() - killed_at
    finally:
        if stage.poll() is None:
            stage.kill()
            stage.wait()
    stderr = log.read_text()

    assert stage.returncode == 2, stderr[-3000:]
    assert ended_in < timeout + 30
    last_line = stderr.strip().splitlines()[-1]
    assert last_line.startswith("coopstudy train: error: compressed arm failed"), stderr[-3000:]
    # Rank 0 says its side in one line, not gloo's traceback (that is on the run):
    # the peer it lost, or, where the launcher's SIGTERM to the ranks left (sent
    # once it sees one gone) reaches it before its next collective, that stop.
    assert "Traceback" not in stderr, stderr[-3000:]
    lost = r"a collective failed, another rank having gone \((Connection (closed|reset) by peer|Broken pipe)\)"
    stopped = r"stopped by SIGTERM \(sent to every rank once one has failed, or when the job is stopped\)"
    assert re.search(rf"coopstudy worker \(compressed, rank 0\): ({lost}|{stopped})", stderr), stderr[-3000:]
    failed = _client().get_run(run.info.run_id)
    assert failed.info.status == "FAILED"
    error = failed.data.tags[schema.TAG_ERROR]
    assert "compressed arm failed (a rank was killed by SIGKILL)" in error, error
    assert "rank 1 recorded no error" in error, error
    assert re.search(rf"; rank 0: (RuntimeError: {lost}|Stopped: {stopped})", error), error
    assert last_line == f"coopstudy train: error: {error}", last_line  # the line and the run say the same
    assert f"{schema.TAG_WORKER_ERROR_PREFIX}0" in failed.data.tags, "rank 0 left no error"
    assert f"{schema.ART_WORKER_ERROR_PREFIX}0.txt" in {a.path for a in _client().list_artifacts(run.info.run_id, schema.ART_WORKER_ERROR_PREFIX.rpartition("/")[0])}  # its traceback
    assert failed.data.metrics[schema.M_COMPLETE_SECONDS] > 0  # the failed attempt's time is on record
    # What rank 0 measured before it failed (update 1 at least) reached the run.
    assert 1 <= len(_history(failed, schema.M_LOSS)) < LONG
    assert schema.TAG_CHECKPOINT_SHA not in failed.data.tags
    # Nothing keeps the devices once the job is gone, and it left nothing to
    # recover: its lock files are empty (a holder left in one would be taken
    # as stale, with only a line on stderr).
    locks = list((workspace.home() / "locks").glob("*.lock"))
    assert locks and all(p.read_text() == "" for p in locks), {p.name: p.read_text() for p in locks}
    with lock.device_lock(launch.local_devices(2), "after"):
        pass
    assert not (workspace.home() / "checkpoints" / run.info.run_id).exists()


def test_a_sigterm_while_a_rank_records_its_error_does_not_cut_the_record_short(monkeypatch):
    # Once one rank has failed, the launcher sends SIGTERM to the others, which
    # may be recording their own error at that moment.
    client = store.client()
    run = client.create_run(client.create_experiment("sigterm"))
    sent = writer.Recorder.set_tags

    def sigterm_then_set_tags(self, tags):
        os.kill(os.getpid(), signal.SIGTERM)
        sent(self, tags)

    monkeypatch.setattr(writer.Recorder, "set_tags", sigterm_then_set_tags)
    before = signal.signal(signal.SIGTERM, worker._on_sigterm)  # as the worker's main installs it
    try:
        worker._record_error(run.info.run_id, 0, RuntimeError("Connection closed by peer"))
    finally:
        signal.signal(signal.SIGTERM, before)
    said = client.get_run(run.info.run_id).data.tags.get(f"{schema.TAG_WORKER_ERROR_PREFIX}0", "")
    assert said.startswith("RuntimeError: Connection closed by peer"), said


def _worker_main(arm: str) -> tuple:
    """A rank's main, in this process, on a fresh run of its own (its `train` patched by the caller): the run and the exit code."""
    client = store.client()
    run = client.create_run(client.create_experiment(f"worker-main-{time.monotonic_ns()}"))
    args = argparse.Namespace(
        run_id=run.info.run_id, arm=arm, config=launch.encode_config(config.load("tiny")), allocator=worker.TRAINING_ALLOCATOR,
        updates=None, no_checkpoint=False, probe=False, capacity_mb=None,
    )  # fmt: skip
    before = signal.getsignal(signal.SIGTERM)  # the worker's main installs its own
    try:
        return run, worker.main(args)
    finally:
        signal.signal(signal.SIGTERM, before)


def test_a_stop_that_lands_inside_mlflows_write_is_one_line_not_mlflows_traceback(monkeypatch, capsys):
    # A SIGTERM inside the SQL store's session comes out as MlflowException raised from it.
    from mlflow.exceptions import MlflowException

    def stopped_while_writing(*args, **kwargs):
        try:
            worker._on_sigterm(signal.SIGTERM, None)
        except worker.Stopped as err:
            raise MlflowException(str(err)) from err

    monkeypatch.setattr(worker, "train", stopped_while_writing)
    run, code = _worker_main("control")
    assert code == 128 + signal.SIGTERM
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("coopstudy worker (control, rank 0): stopped by SIGTERM"), line
    said = store.client().get_run(run.info.run_id).data.tags[f"{schema.TAG_WORKER_ERROR_PREFIX}0"]
    assert said.startswith("Stopped: stopped by SIGTERM"), said


def _saves(monkeypatch) -> list:
    """The checkpoints this process's worker saves, as it saves them."""
    saved = []
    save = checkpoint.save
    monkeypatch.setattr(checkpoint, "save", lambda *args: saved.append(save(*args)) or saved[-1])
    return saved


def test_a_stop_after_the_checkpoint_was_saved_leaves_none_on_disk(monkeypatch, capsys):
    # Rank 0 has saved and verified the checkpoint; SIGTERM lands before its upload (as the
    # gathers wait for the other ranks, or a rank that failed then stops them all).
    saved = _saves(monkeypatch)
    monkeypatch.setattr(worker, "_gather_peak_memory", lambda ctx: worker._on_sigterm(signal.SIGTERM, None))
    run, code = _worker_main("control")
    assert code == 128 + signal.SIGTERM, capsys.readouterr().err[-3000:]
    (kept,) = saved
    assert kept.folder == workspace.home() / "checkpoints" / run.info.run_id
    assert not kept.folder.exists() and not list(kept.folder.parent.glob(".tmp-*"))
    assert schema.TAG_CHECKPOINT_PATH not in store.client().get_run(run.info.run_id).data.tags


@pytest.mark.parametrize("upload", ["refused", "stopped"])
def test_a_checkpoint_whose_upload_fails_goes_unless_the_upload_waits_for_it(monkeypatch, capsys, upload):
    # Refused by the store: the run fails, and its checkpoint goes as for a failure
    # during training. Stopped midway: the upload waits in the outbox, which needs the folder.
    from mlflow.exceptions import MlflowException

    saved = _saves(monkeypatch)
    apply = outbox.apply

    def upload_fails(client, run_id, record):
        if record["op"] != "artifact":
            return apply(client, run_id, record)
        if upload == "refused":
            raise MlflowException("INVALID_PARAMETER_VALUE: the artifact store refused the upload")
        worker._on_sigterm(signal.SIGTERM, None)

    monkeypatch.setattr(outbox, "apply", upload_fails)
    if upload == "refused":
        with pytest.raises(MlflowException, match="the artifact store refused the upload"):
            _worker_main("control")
        (kept,) = saved
        assert not kept.folder.exists() and not list(kept.folder.parent.glob(".tmp-*"))
        return
    run, code = _worker_main("control")
    assert code == 128 + signal.SIGTERM, capsys.readouterr().err[-3000:]
    (kept,) = saved
    rec = writer.Recorder(run.info.run_id)
    assert kept.folder.is_dir() and rec.waits_to_upload(kept.folder)
    monkeypatch.setattr(outbox, "apply", apply)
    remote.deliver_all([run.info.run_id])
    assert not rec.waits_to_upload(kept.folder)
    assert store.client().list_artifacts(run.info.run_id, schema.ART_CHECKPOINT)


def test_a_write_of_waiting_metrics_cut_short_keeps_the_rest_for_the_last_write():
    written = []

    class Cut:
        def log_metrics(self, metrics, step=0):
            written.append(step)
            if len(written) == 2:
                raise errors.Stopped("stopped by SIGTERM")

    pending = worker._Pending(Cut())
    for step in (1, 2, 3):
        pending.add({schema.M_LOSS: 1.0}, step)
    with pytest.raises(errors.Stopped):
        pending.close()
    pending.close()  # the failure's last write
    assert written == [1, 2, 2, 3] and not pending.waiting


def _no_server(*args, **kwargs):
    """MLflow's error where the server does not answer: its own, from requests' (not its cause)."""
    import requests
    from mlflow.exceptions import MlflowException

    try:
        raise requests.exceptions.ConnectionError("HTTPConnectionPool(host='127.0.0.1'): Max retries exceeded (Connection refused)")
    except requests.exceptions.ConnectionError:
        raise MlflowException("API request to http://127.0.0.1:1/api/2.0/mlflow/runs/search failed") from None


def test_a_server_outage_as_a_rank_starts_is_one_line(monkeypatch, capsys):
    # Before training a rank reads the record (the ledger's runs): MLflow raises its own error then.
    from mlflow.exceptions import MlflowException

    monkeypatch.setattr(worker, "train", _no_server)
    _, code = _worker_main("compressed")
    assert code == 2
    assert capsys.readouterr().err.splitlines() == ["coopstudy worker (compressed, rank 0): the tracking server stopped answering (connection refused)"]
    # A stage's error that wraps it is said the same way.
    try:
        try:
            _no_server()
        except MlflowException as err:
            raise RefusedError("compressed arm failed") from err
    except RefusedError as wrapped:
        assert outbox.reason(wrapped) == "connection refused"


@pytest.mark.parametrize("left_one", [True, False], ids=["a checkpoint here", "none"])
def test_a_server_outage_as_the_ranks_exit_leaves_the_finished_arm_finished(capsys, left_one):
    # Rank 0 recorded its checkpoint and exited 0, then the server stopped answering
    # before the stage read the run back. Before, the stage failed the finished arm.
    from mlflow import MlflowClient

    from coopstudy.steps import train

    cfg = config.load("tiny", ["experiment=outage-as-the-ranks-exit"])
    with writer.stage_run(schema.STAGE_TRAIN, cfg, arm="control") as rec, pytest.MonkeyPatch.context() as mp:
        kept = workspace.checkpoint_folder(rec.run_id)

        def ranks_finished(cmd, env, *, label, held=None):
            if left_one:
                kept.mkdir(parents=True)
                rec.set_tags({schema.TAG_CHECKPOINT_SHA: "c" * 64, schema.TAG_CHECKPOINT_PATH: str(kept)})
            mp.setattr(MlflowClient, "get_run", _no_server)
            return launch.Exit(0, 1.5)

        mp.setattr(launch, "run", ranks_finished)
        if not left_one:
            # Where the ranks left no checkpoint here, nothing stands for the record.
            with pytest.raises(train.TrainingFailed, match=f"exited cleanly, but no checkpoint is at {kept}, and the tracking server"):
                train.train_arm(rec, cfg, "control", None)
            return
        train.train_arm(rec, cfg, "control", None)
    assert capsys.readouterr().out.splitlines()[-1] == (
        f"train control: finished, complete 1.5 s; checkpoint {kept}; the tracking server stopped answering (connection refused), "
        "so the run is not read back here; it ends FINISHED as soon as the server takes its records"
    )
    run = _client().get_run(rec.run_id)
    assert run.info.status == "FINISHED" and run.data.tags[schema.TAG_CHECKPOINT_SHA] == "c" * 64


def test_a_store_locked_under_a_rank_is_one_line(monkeypatch, capsys):
    monkeypatch.setattr(worker, "train", store_locked)
    _, code = _worker_main("control")
    assert (code, capsys.readouterr().err.splitlines()) == (2, [f"coopstudy worker (control, rank 0): {store.locked_said()}"])


def test_a_stop_inside_the_comm_hooks_callback_is_told_as_the_stop(monkeypatch):
    # torch re-raised a SIGTERM that landed in the PowerSGD hook's future callback as
    # "RuntimeError: Got the following error when running the callback: Stopped: ...",
    # with no cause; the rank recorded that, not its stop (seen once in CI).
    monkeypatch.setattr(worker, "_STOPS", [])
    try:
        worker._on_sigterm(signal.SIGTERM, None)
    except errors.Stopped as stop:
        wrapped = RuntimeError(f"Got the following error when running the callback: {stop}")
        wrapped.__context__ = None
    assert worker._known_cause(wrapped) is worker._STOPS[0]
    assert str(worker._known_cause(wrapped)).startswith("stopped by SIGTERM")
    monkeypatch.setattr(worker, "_STOPS", [])
    assert worker._known_cause(RuntimeError("a bug")) is None
