"""The study against a real `mlflow server`: every stage logs there, artifacts
go through its proxy, the report reads it back alone, a dead server stops a
stage before any work, and an outage during training loses nothing.

One server (SQLite backend store, proxied artifacts in a temporary folder)
serves the whole module; the tiny study runs against it once, as the README
says to: `mlflow run . -e main` in a fresh copy of the project whose
mlruns_remote.txt names the server, with no MLflow variables set. The other
tests read what it left (their commands name that file in
COOPSTUDY_REMOTE_FILE). The outage test stops and restarts that server, so it
comes last.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import mlflow
import pytest
from fixtures import ROOT, checkout_copy, run_cli
from mlflow.entities import ViewType

from coopstudy import config, workspace
from coopstudy.commit import ledger
from coopstudy.errors import UserError
from coopstudy.record import outbox, schema, store, writer

pytestmark = pytest.mark.slow

OUTAGE_UPDATES = 30


def _remote_env(remote_file: Path, home: Path, **extra: str) -> dict[str, str]:
    """The environment of a user whose record is the server named in the remote file."""
    env = {k: v for k, v in os.environ.items() if k not in ("MLFLOW_TRACKING_URI", "MLFLOW_RUN_ID")}
    return env | {store.ENV_REMOTE_FILE: str(remote_file), "COOPSTUDY_HOME": str(home)} | extra


def _coopstudy(*args: str, env: dict[str, str], timeout: float = 600) -> subprocess.CompletedProcess:
    # The user's environment, whole: this process's store is not theirs.
    return run_cli(*args, env=env, timeout=timeout, inherit=False)


@dataclass(frozen=True)
class Study:
    project: Path
    """The copy of the project the study ran in."""
    printed: subprocess.CompletedProcess
    """What `mlflow run . -e main` printed."""

    @property
    def home(self) -> Path:
        return self.project / ".coopstudy"

    @property
    def remote_file(self) -> Path:
        return self.project / store.REMOTE_FILE

    def env(self, **extra: str) -> dict[str, str]:
        return _remote_env(self.remote_file, self.home, **extra)


@pytest.fixture(scope="module")
def study(server, tiny_seed_home, tmp_path_factory) -> Study:
    project = checkout_copy(tmp_path_factory.mktemp("remote-project"))
    (project / store.REMOTE_FILE).write_text(f"# the study's shared record\n{server.uri}\n")
    # A fresh clone makes the tiny seed in its first prepare; this copies it in.
    shutil.copytree(tiny_seed_home, project / ".coopstudy")
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_") and k != "COOPSTUDY_HOME"}
    env |= {"PYTHONPATH": f"{project / 'src'}{os.pathsep}{project}", "PATH": f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"}
    done = subprocess.run(["mlflow", "run", ".", "-e", "main", "--env-manager", "local", "-P", "preset=tiny"],
                          cwd=project, env=env, capture_output=True, text=True, timeout=1800)  # fmt: skip
    assert done.returncode == 0, (done.stdout[-2000:], done.stderr[-3000:])
    return Study(project, done)


@pytest.fixture
def http_defaults(monkeypatch):
    """In-process calls to a server set the short HTTP retries in os.environ; undone after the test."""
    for name, value in store.HTTP_DEFAULTS.items():
        monkeypatch.setenv(name, value)


def _runs(client: mlflow.MlflowClient, filter_string: str = "") -> list:
    exp = client.get_experiment_by_name("coopstudy")
    return client.search_runs([exp.experiment_id], filter_string, max_results=1000)


def test_every_stage_logs_to_the_server_with_its_artifacts(server, study):
    client = server.client()
    runs = _runs(client)
    stages = {r.data.tags.get(schema.TAG_STAGE) for r in runs}
    assert stages >= {"prepare", "verify", "probe", "plan", "train", "select", "evaluate", "report", "study"}, stages
    # The tiny probe grid holds one setting that must run out of memory; it stays on record.
    unfinished = [r for r in runs if r.info.status != "FINISHED"]
    assert len(unfinished) == 1 and all(r.data.tags.get(schema.TAG_PROBE_OUTCOME) == "out_of_memory" for r in unfinished), unfinished
    # Proxied: the record names the server's artifact store, never a path on the logging machine.
    assert all(r.info.artifact_uri.startswith("mlflow-artifacts:/") for r in runs)
    exp = client.get_experiment_by_name("coopstudy")
    assert schema.TAG_PREFLIGHT in exp.tags
    for arm in ("control", "compressed"):
        (run,) = _runs(client, f"tags.`{schema.TAG_STAGE}` = 'train' and tags.`{schema.TAG_ARM}` = '{arm}'")
        steps = sorted(m.step for m in client.get_metric_history(run.info.run_id, schema.M_LOSS))
        assert steps == list(range(1, 7)), (arm, steps)
        names = {a.path for a in client.list_artifacts(run.info.run_id, schema.ART_CHECKPOINT)}
        assert f"{schema.ART_CHECKPOINT}/model.safetensors" in names
    # Every rank of the compressed arm writes into the one run its stage opened: a probe
    # has each rank report itself there, and no rank opened a run of its own.
    (probe,) = _runs(client, f"tags.`{schema.TAG_PROBE_SETTING}` LIKE 'compressed-%'")
    reports = {a.path for a in client.list_artifacts(probe.info.run_id, "probe_ranks")}
    assert reports == {f"{schema.ART_PROBE_RANK_PREFIX}{r}.json" for r in (0, 1)}
    assert len(_runs(client, f"tags.`{schema.TAG_STAGE}` = 'train'")) == 2
    stored = list(server.artifacts.rglob("model.safetensors"))
    assert len(stored) == 2, stored


def test_mlflow_run_leaves_only_a_pointer_in_the_local_store(server, study):
    runs = _runs(server.client())
    (parent,) = [r for r in runs if r.data.tags[schema.TAG_STAGE] == "study"]
    steps = {r.data.tags[schema.TAG_STAGE] for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id}
    assert steps == {"prepare", "verify", "probe", "plan", "train", "select", "evaluate", "report"}, steps
    # The study runs the plan itself: probe does not tell the user to.
    assert "study: probe: running" in study.printed.stdout and "next: `" not in study.printed.stdout
    # What `mlflow run` opened in its own default store names the study's run on the server, nothing more.
    local = mlflow.MlflowClient(tracking_uri=f"sqlite:///{study.project / 'mlflow.db'}")
    pointers = [r for e in local.search_experiments() for r in local.search_runs([e.experiment_id])]
    assert [(r.data.tags[schema.TAG_RECORD_URI], r.data.tags[schema.TAG_RECORD_RUN]) for r in pointers] == [(server.uri, parent.info.run_id)]
    assert pointers[0].info.status == "FINISHED" and not pointers[0].data.metrics


def test_candidate_checkpoint_comes_back_from_the_server_as_committed(server, study, tmp_path, monkeypatch, http_defaults):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", server.uri)
    monkeypatch.setenv("COOPSTUDY_HOME", str(study.home))
    entries = [e for e in ledger.Ledger().entries() if e.kind == ledger.CANDIDATE]
    assert {e.details["arm"] for e in entries} == {"control", "compressed"}
    for entry in entries:
        got = store.download_artifact(entry.details["train_run_id"], f"{schema.ART_CHECKPOINT}/model.safetensors", tmp_path / entry.details["arm"])
        assert workspace.sha256_file(got) == entry.digest, entry.details["arm"]


def test_report_from_the_server_record_alone(server, study, tmp_path):
    # An empty workspace: nothing but the server's record to read.
    done = _coopstudy("report", "--preset", "tiny", "--out", str(tmp_path / "out"), env=_remote_env(study.remote_file, tmp_path / "empty-home"))
    assert done.returncode == 0, done.stderr[-3000:]
    again = json.loads((tmp_path / "out" / schema.ART_REPORT_JSON).read_text())
    (first,) = study.home.glob(f"reports/*/{schema.ART_REPORT_JSON}")
    original = json.loads(first.read_text())
    assert again["verdicts"] == original["verdicts"] and again["screens"] == original["screens"]
    assert again["candidates"] == original["candidates"]


def test_a_dead_server_stops_a_stage_before_any_work(tmp_path):
    remote_file = tmp_path / "mlruns_remote.txt"
    remote_file.write_text(f"http://127.0.0.1:{workspace.free_port()}\n")
    start = time.monotonic()
    done = _coopstudy("prepare", "--preset", "tiny", env=_remote_env(remote_file, tmp_path / "home"))
    seconds = time.monotonic() - start
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1, done.stderr[-3000:]
    assert "does not answer (connection refused)" in lines[0] and str(remote_file) in lines[0]
    assert seconds < 30, seconds
    assert not (tmp_path / "home" / "prepared").exists()


@pytest.mark.parametrize(
    "name, value, step",
    [
        ("MLFLOW_HTTP_REQUEST_TIMEOUT", "abc", "plan"),
        ("MLFLOW_HTTP_REQUEST_TIMEOUT", "0", "remote check"),
        ("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "-1", "plan"),
        ("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "11", "plan"),  # over MLflow's limit of 10
        ("MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR", "-1", "plan"),
    ],
)
def test_http_settings_mlflow_would_refuse_are_one_line_before_any_request(tmp_path, name, value, step):
    # Before, every step ended in MLflow's traceback at its first request (exit 1), while `remote check` passed.
    remote_file = tmp_path / "mlruns_remote.txt"
    remote_file.write_text(f"http://127.0.0.1:{workspace.free_port()}\n")
    command = ("plan", "--preset", "tiny") if step == "plan" else step.split()
    done = _coopstudy(*command, env=_remote_env(remote_file, tmp_path / "home", **{name: value}))
    from mlflow import environment_variables

    most = {
        "MLFLOW_HTTP_REQUEST_MAX_RETRIES": 10,
        "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": environment_variables._MLFLOW_HTTP_REQUEST_MAX_BACKOFF_FACTOR_LIMIT.get(),
    }
    takes = "at least 1" if name == "MLFLOW_HTTP_REQUEST_TIMEOUT" else f"from 0 to {most[name]}"
    said = f"coopstudy {step}: error: {name}={value!r}: MLflow takes a whole number {takes}; unset it for the study's {store.HTTP_DEFAULTS[name]}"
    assert (done.returncode, done.stderr.strip().splitlines()) == (2, [said]), done.stderr[-3000:]


@pytest.mark.parametrize("value", ["abc", "-5", "inf"])
def test_an_outbox_grace_that_is_no_number_of_seconds_is_one_line_before_the_work(server, tmp_path, value):
    # Before, it was read at the run's end: a traceback after the step's work.
    remote_file = tmp_path / "mlruns_remote.txt"
    remote_file.write_text(server.uri + "\n")
    experiment = f"grace {value}"
    env = _remote_env(remote_file, tmp_path / "home", **{outbox.ENV_GRACE: value, "MLFLOW_EXPERIMENT_NAME": experiment})
    done = _coopstudy("prepare", "--preset", "tiny", env=env)
    said = f"coopstudy prepare: error: {outbox.ENV_GRACE}={value!r}: not a number of seconds (0 or more); unset it for the default 30 s"
    assert (done.returncode, done.stderr.strip().splitlines()) == (2, [said]), done.stderr[-3000:]
    assert not (tmp_path / "home" / "prepared").exists()
    # Refused before its run opened: no run left behind (MLflow's exit ended one FINISHED).
    made = mlflow.MlflowClient(server.uri).get_experiment_by_name(experiment)
    assert made is None or not mlflow.MlflowClient(server.uri).search_runs([made.experiment_id]), made


def test_credentials_in_the_remote_file_are_refused(server, tmp_path):
    remote_file = tmp_path / "mlruns_remote.txt"
    remote_file.write_text(f"http://alice:s3cret@127.0.0.1:{server.port}\n")
    done = _coopstudy("prepare", "--preset", "tiny", env=_remote_env(remote_file, tmp_path / "home"))
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1, done.stderr[-3000:]
    assert "MLFLOW_TRACKING_USERNAME" in lines[0] and "s3cret" not in done.stderr + done.stdout


def test_remote_check_checks_the_experiment_a_step_would_write_to(server, tmp_path):
    remote_file = tmp_path / "mlruns_remote.txt"
    remote_file.write_text(server.uri + "\n")
    env = _remote_env(remote_file, tmp_path / "home", MLFLOW_EXPERIMENT_NAME="checked-by-name")
    done = _coopstudy("remote", "check", env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"tracking server {server.uri} answers; experiment 'checked-by-name' (id " in done.stdout
    # A name no step would take is refused before the server is touched.
    bad = _coopstudy("remote", "check", "--experiment", " x ", env=env)
    assert (bad.returncode, bad.stderr.strip()) == (2, "coopstudy remote check: error: --experiment ' x ': a name with spaces at its ends")
    assert server.client().get_experiment_by_name(" x ") is None and server.client().get_experiment_by_name("x") is None


def test_a_deleted_experiment_is_refused_before_any_work(server, tmp_path):
    client = server.client()
    retired = client.create_experiment("retired")
    client.delete_experiment(retired)
    remote_file = tmp_path / "mlruns_remote.txt"
    remote_file.write_text(server.uri + "\n")
    done = _coopstudy("prepare", "--preset", "tiny", "--set", "experiment=retired", env=_remote_env(remote_file, tmp_path / "home"))
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1, done.stderr[-3000:]
    assert "experiment 'retired' is deleted" in lines[0]
    assert not client.search_runs([retired], run_view_type=ViewType.ALL)


def test_records_of_an_unreachable_server_are_reported_then_delivered(server, tmp_path, monkeypatch, capsys, http_defaults):
    client = server.client()
    # An experiment of its own: the test runs alone too, before any stage made the study's.
    run_id = client.create_run(client.create_experiment(f"unreachable-{time.monotonic_ns()}")).info.run_id
    monkeypatch.setenv("COOPSTUDY_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("COOPSTUDY_OUTBOX_GRACE_S", "0")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://127.0.0.1:{workspace.free_port()}")
    rec = writer.Recorder(run_id)
    for step in range(1, 6):
        rec.log_metrics({schema.M_LOSS: 1.0 / step}, step=step)
    rec.set_tags({"kept": "yes"})
    rec.terminate("FINISHED")
    assert rec.finish() is False
    err = capsys.readouterr().err
    outbox = tmp_path / "home" / "outbox" / f"{run_id}.jsonl"
    assert err.count(" unreachable (") == 1, err
    assert f"{schema.M_LOSS} steps 1-5 (5)" in err and str(outbox) in err
    assert f"python -m coopstudy remote deliver {run_id}" in err
    assert outbox.is_file()

    done = run_cli("remote", "deliver", "--tracking-uri", server.uri, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    run = client.get_run(run_id)
    assert sorted(m.step for m in client.get_metric_history(run_id, schema.M_LOSS)) == [1, 2, 3, 4, 5]
    assert run.data.tags["kept"] == "yes" and run.info.status == "FINISHED"
    assert not outbox.exists()


def test_a_stage_whose_server_stops_answering_ends_in_one_line_and_its_end_waits(server, tmp_path, monkeypatch, http_defaults):
    # Step 4 of the README's outage: a stage needs an answer (here a search) while the server is down.
    monkeypatch.setenv("COOPSTUDY_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("COOPSTUDY_OUTBOX_GRACE_S", "0")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", server.uri)
    try:
        with pytest.raises(UserError) as stopped:
            with writer.stage_run(schema.STAGE_SELECT, config.load("tiny")) as rec:
                server.stop(signal.SIGKILL)
                store.search_runs("coopstudy", f"tags.`{schema.TAG_STAGE}` = 'train'")
    finally:
        server.start()
    waiting = tmp_path / "home" / "outbox"
    assert str(stopped.value) == (
        f"the tracking server {server.uri} stopped answering (connection refused); run {rec.run_id} ended FAILED; "
        f"what it could not record waits in {waiting} (`python -m coopstudy remote deliver` sends it)"
    )
    assert (waiting / f"{rec.run_id}.jsonl").is_file()
    done = run_cli("remote", "deliver", rec.run_id, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    run = server.client().get_run(rec.run_id)
    assert run.info.status == "FAILED"
    assert run.data.tags[schema.TAG_ERROR] == "the tracking server stopped answering (connection refused)"


def test_training_goes_on_through_a_server_outage_and_keeps_every_update(server, study, tmp_path):
    # Last in the module: it stops and restarts the module's server.
    env = study.env(COOPSTUDY_OUTBOX_GRACE_S="180")
    longer = ("--preset", "tiny", "--set", f"train.updates={OUTAGE_UPDATES}")
    for step in ("prepare", "plan"):
        done = _coopstudy(step, *longer, env=env)
        assert done.returncode == 0, done.stderr[-3000:]
    # stdout goes to a file: the thread below is the only reader of the pipe.
    out = tmp_path / "stdout"
    with out.open("w") as sink:
        proc = subprocess.Popen(
            [sys.executable, "-m", "coopstudy", "train", "--arm", "control", *longer],
            cwd=ROOT, env=env, stdout=sink, stderr=subprocess.PIPE, text=True, start_new_session=True,
        )
    lines: list[str] = []
    arrived = threading.Event()

    def read() -> None:
        for line in proc.stderr:
            lines.append(line)
            if f"update 3/{OUTAGE_UPDATES}" in line:
                arrived.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        assert arrived.wait(300), "".join(lines)[-3000:]
        # A crash, not a shutdown: the server is gone between one update and the next.
        server.stop(signal.SIGKILL)
        time.sleep(3)
        server.start()
        proc.wait(timeout=400)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    reader.join(10)
    stderr, stdout = "".join(lines), out.read_text()
    assert proc.returncode == 0, (stdout[-2000:], stderr[-4000:])
    assert stderr.count(" unreachable (") == 1 and "delivered" in stderr, stderr[-4000:]
    client = server.client()
    (run,) = _runs(client, f"tags.`{schema.TAG_STAGE}` = 'train' and params.`train.updates` = '{OUTAGE_UPDATES}'")
    steps = sorted(m.step for m in client.get_metric_history(run.info.run_id, schema.M_LOSS))
    assert steps == list(range(1, OUTAGE_UPDATES + 1))
    assert run.info.status == "FINISHED" and schema.TAG_CHECKPOINT_SHA in run.data.tags
    assert not list((study.home / "outbox").glob("*.jsonl"))
