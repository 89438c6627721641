"""The fault matrix: every committed thing tampered with, every way a run
ends, two jobs at once, and bad input, each through the real CLI on the tiny
preset, each asserting the exit code, the one line the user reads, and what
the record and the study folder hold afterwards.

Groups (README "Faults, tampering and bad input" holds the table, a row per
case, naming the test that holds it):
  1. tampering: `test_tampered_commitment_is_refused_naming_it` (13 cases)
  2. how a run ends: `test_a_stopped_train_stage_*` (SIGINT, SIGTERM),
     `test_a_killed_train_stage_*` (SIGKILL), `test_disk_full_*` (ENOSPC);
     a killed rank: tests/test_train.py::test_killed_rank_ends_both_within_the_collective_timeout_and_fails_the_run
  3. two jobs at once: `test_two_*_at_once_*`; concurrent ledger appends:
     tests/test_ledger.py::test_appends_from_many_processes_keep_one_chain
  4. bad input: `test_bad_input_is_one_line_and_exit_2` (held elsewhere:
     tests/test_replay_source.py, tests/test_remote.py)

The expensive states are made once per module from the session's probed
tiny store: planned (plan committed, and a long-running config prepared and
planned for the tests that stop a run midway), trained (both arms), selected.
Every case works on its own copy. Artifacts of copied stores are shared (the
runs' artifact folders are not copied), so a case that edits an artifact
first moves that run's artifacts into its own folder.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import pathlib
import shutil
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO
from urllib.parse import urlsplit
from urllib.request import url2pathname

import mlflow
import psutil
import pytest
import yaml
from fixtures import LONG, ROOT, Store, checkout_copy, fill_disk, run_cli, run_worker

from coopstudy import cli, config, workspace
from coopstudy.commit import ledger, plan, receipts, sources
from coopstudy.inputs import data
from coopstudy.inputs.seed import SEEDS
from coopstudy.record import schema
from coopstudy.record import store as mlflow_store
from coopstudy.run import launch

pytestmark = pytest.mark.slow

STAGE_START_S = 240
"""Time a stage may take to reach its first update on a loaded two-core machine."""


def _cli_env(store: Store, **extra: str) -> dict[str, str]:
    return {**store.env(), **extra}


# --- states ----------------------------------------------------------------


@pytest.fixture(scope="module")
def planned_store(planned_tiny_store, tmp_path_factory) -> Store:
    """Prepared, verified, probed and planned; plus a LONG config prepared and planned."""
    return planned_tiny_store.copy(tmp_path_factory.mktemp("faults-planned"))


@pytest.fixture(scope="module")
def trained_store(trained_tiny_store, tmp_path_factory) -> Store:
    return trained_tiny_store.copy(tmp_path_factory.mktemp("faults-trained"))


@pytest.fixture(scope="module")
def selected_store(trained_store, tmp_path_factory) -> Store:
    store = trained_store.copy(tmp_path_factory.mktemp("faults-selected"))
    done = run_cli("select", "--preset", "tiny", env=store.env())
    assert done.returncode == 0, done.stderr[-3000:]
    return store


# --- reading a store -------------------------------------------------------


def _client(store: Store) -> mlflow.MlflowClient:
    return mlflow.MlflowClient(store.tracking_uri)


def _runs(store: Store, filter_string: str = "") -> list:
    client = _client(store)
    exp = client.get_experiment_by_name("coopstudy")
    return list(client.search_runs([exp.experiment_id], filter_string, order_by=["attributes.start_time DESC"], max_results=1000))


def _entries(store: Store) -> list[ledger.Entry]:
    return ledger.Ledger(store.home / "ledger.jsonl").entries()


def _entry(store: Store, kind: str, subject: str | None = None) -> ledger.Entry:
    return [e for e in _entries(store) if e.kind == kind and (subject is None or e.subject == subject)][-1]


def _tiny_inputs(store: Store) -> ledger.Entry:
    return _entry(store, ledger.INPUTS, data.inputs_key(config.load("tiny")))


def _snapshot(store: Store) -> dict[str, str]:
    """sha256 of every file of the study folder (lock files, emptied on release, aside)."""
    skip = ("locks", "launch", "outbox")
    return {
        str(p.relative_to(store.home)): workspace.sha256_file(p)
        for p in sorted(store.home.rglob("*"))
        if p.is_file() and p.relative_to(store.home).parts[0] not in skip
    }


def _statuses(store: Store) -> dict[str, str]:
    return {r.info.run_id: r.info.status for r in _runs(store)}


def _flip(path: Path, offset: int | None = None) -> None:
    """Change one byte."""
    blob = bytearray(path.read_bytes())
    i = len(blob) // 2 if offset is None else offset
    blob[i] = ord("0") if blob[i] != ord("0") else ord("1")
    path.write_bytes(bytes(blob))


def _raw_lines(store: Store) -> list[dict]:
    return [json.loads(line) for line in (store.home / "ledger.jsonl").read_text().splitlines()]


def _write_lines(store: Store, raws: list[dict], *, rechain: bool) -> None:
    """The ledger as `raws`; with `rechain`, every line re-hashed as a forger would."""
    if rechain:
        prev = ledger.GENESIS
        for n, raw in enumerate(raws):
            raw["seq"], raw["prev"] = n, prev
            body = {k: raw[k] for k in ("seq", "time", "kind", "subject", "digest", "details", "prev")}
            raw["hash"] = prev = ledger._entry_hash(body)
    (store.home / "ledger.jsonl").write_text("".join(json.dumps(r, sort_keys=True) + "\n" for r in raws))


def _own_artifacts(store: Store, run_id: str, dst: Path) -> Path:
    """Move the run's artifacts, in this copy's record only, to a folder of its own."""
    with contextlib.closing(sqlite3.connect(store.db)) as db:
        (uri,) = db.execute("select artifact_uri from runs where run_uuid = ?", (run_id,)).fetchone()
        src = Path(url2pathname(urlsplit(uri).path)) if uri.startswith("file:") else Path(uri)
        shutil.copytree(src, dst)
        db.execute("update runs set artifact_uri = ? where run_uuid = ?", (str(dst), run_id))
        db.commit()
    return dst


# --- 1. tampering ----------------------------------------------------------


@dataclass(frozen=True)
class Tampered:
    """What the case did: the substrings the one line must hold, and what else it needs."""

    names: tuple[str, ...]
    """The thing, as the line must name it."""
    run: str
    """What to run (or do), as the line must say it."""
    env: dict[str, str] = field(default_factory=dict)
    restore: Callable[[], None] | None = None
    """Puts back what the case changed outside its copy (a selected checkpoint:
    the ledger names it by absolute path, so every copy of a store names the same one)."""


def _flip_shared(path: Path) -> Callable[[], None]:
    """Change the file's last byte; the function that puts it back."""
    original = path.read_bytes()
    _flip(path, offset=len(original) - 1)
    return lambda: path.write_bytes(original)


def _prepared_file(store: Store, tmp: Path) -> Tampered:
    folder = store.home / _tiny_inputs(store).details["folder"]
    _flip(folder / data.TRAIN)
    return Tampered((f"prepared inputs {folder}: {data.TRAIN} changed since it was committed",), "run prepare again")


def _manifest(store: Store, tmp: Path) -> Tampered:
    folder = store.home / _tiny_inputs(store).details["folder"]
    _flip(folder / schema.ART_MANIFEST)
    return Tampered((f"prepared inputs {folder}: {schema.ART_MANIFEST} changed since it was committed",), "run prepare again")


def _numerical_source(store: Store, tmp: Path) -> Tampered:
    project = checkout_copy(tmp / "checkout")
    source = project / "src" / "coopstudy" / "numerics" / "objective.py"
    source.write_bytes(source.read_bytes() + b"\n")
    return Tampered(
        ("numerical sources changed since the gate receipt: numerics/objective.py",),
        "`python -m coopstudy verify --preset tiny`",
        env={"PYTHONPATH": str(project / "src")},
    )


def _gate_receipt(store: Store, tmp: Path) -> Tampered:
    run_id = _entry(store, ledger.GATE).details["run_id"]
    folder = _own_artifacts(store, run_id, tmp / "verify-artifacts")
    path = folder / schema.ART_GATE_RECEIPT
    receipt = json.loads(path.read_text())
    receipt["max_rel_error"] = receipt["max_rel_error"] / 2
    path.write_text(json.dumps(receipt, indent=2, sort_keys=True))
    return Tampered((f"the gate receipt {schema.ART_GATE_RECEIPT} of verify run {run_id} hashes to", "it was edited"), "`python -m coopstudy verify`")


def _probe_receipt(store: Store, tmp: Path) -> Tampered:
    name = "control-mb4-default.json"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("COOPSTUDY_HOME", str(store.home))
        path = receipts.probe_dir(config.load("tiny")) / name
    path.write_bytes(path.read_bytes() + b"\n")
    return Tampered((f"probe receipt {name} (changed)",), "`python -m coopstudy study --preset tiny`")


def _plan(store: Store, tmp: Path) -> Tampered:
    entry = _entry(store, ledger.PLAN, plan.subject(config.load("tiny")))
    path = store.home / entry.details["file"]
    # A pre-registered threshold, lowered after the fact (whitespace would be no
    # change: the commitment is the document's canonical hash).
    doc = json.loads(path.read_text())
    doc["screens"]["min_speedup"] = 1.0
    path.write_text(json.dumps(doc, indent=2, sort_keys=True))
    return Tampered(
        (f"the plan file {path} was edited after it was committed",),
        "`python -m coopstudy plan --preset tiny`",
    )


def _plan_garbled(store: Store, tmp: Path) -> Tampered:
    path = store.home / _entry(store, ledger.PLAN, plan.subject(config.load("tiny"))).details["file"]
    path.write_bytes(b"\xff not a plan")
    return Tampered((f"the plan file {path} was edited after it was committed",), "`python -m coopstudy plan --preset tiny`")


def _checkpoint_before_select(store: Store, tmp: Path) -> Tampered:
    (run,) = _runs(store, "attributes.run_name = 'train-control-tiny' and attributes.status = 'FINISHED'")
    folder = Path(run.data.tags[schema.TAG_CHECKPOINT_PATH])  # in this copy's home (Store.copy)
    _flip(folder / workspace.WEIGHTS_FILE, offset=(folder / workspace.WEIGHTS_FILE).stat().st_size - 1)
    return Tampered(
        (f"arm control: the weights in {folder} hash to", f"train run {run.info.run_id} recorded"),
        f"delete {folder} to have it brought back from that run's `checkpoint` artifact (an arm trains once per plan",
    )


def _checkpoint_after_select(store: Store, tmp: Path) -> Tampered:
    entry = next(e for e in _entries(store) if e.kind == ledger.CANDIDATE and e.details["arm"] == "control")
    folder = Path(entry.details["path"])
    return Tampered(
        (
            "the control candidate selected at", f"by select run {entry.details['select_run_id']}: the weights in {folder} hash to",
            f"not the selected {entry.digest[:12]}; they changed after selection, refusing to score them",
        ),
        f"delete {folder} to have it brought back from the `checkpoint` artifact of train run {entry.details['train_run_id']}",
        restore=_flip_shared(folder / workspace.WEIGHTS_FILE),
    )


def _seed_after_select(store: Store, tmp: Path) -> Tampered:
    # Before, evaluate scored whatever seed was on disk, its hash the tag; the report then found
    # no evaluation of the seed the arms trained from, after every model's minutes.
    (weights,) = (store.home / SEEDS).glob(f"*/{workspace.WEIGHTS_FILE}")  # the copy's own
    _flip(weights)
    return Tampered((f"seed weights {weights.parent} hash to", "the prepared inputs were made from"), f"delete {weights.parent} to have the seed made again")


def _selection(store: Store, tmp: Path) -> Tampered:
    raws = _raw_lines(store)
    control = next(r for r in raws if r["kind"] == ledger.CANDIDATE and r["details"]["arm"] == "control")
    compressed = next(r for r in raws if r["kind"] == ledger.CANDIDATE and r["details"]["arm"] == "compressed")
    honest = control["digest"]
    # The compressed arm's weights named as the control's, the chain made whole again.
    control["digest"], control["details"]["path"] = compressed["digest"], compressed["details"]["path"]
    _write_lines(store, raws, rechain=True)
    select_run = control["details"]["select_run_id"]
    return Tampered(
        (
            f"line {control['seq'] + 1} (candidate ",
            f"disagrees with the record: select run {select_run} selected {honest[:12]} for the control arm, "
            f"the ledger says {compressed['digest'][:12]}",
        ),
        "restore it from a copy (a selection is made once)",
    )


def _ledger_edited(store: Store, tmp: Path) -> Tampered:
    raws = _raw_lines(store)
    n = next(i for i, r in enumerate(raws) if r["kind"] == ledger.GATE)
    raws[n]["digest"] = "f" * 64
    _write_lines(store, raws, rechain=False)
    return Tampered((f"line {n + 1} (gate {raws[n]['subject']}) was altered after it was written",), "restore the ledger from a copy")


def _ledger_deleted(store: Store, tmp: Path) -> Tampered:
    raws = _raw_lines(store)
    del raws[1]
    _write_lines(store, raws, rechain=False)
    return Tampered(("line 2 does not follow line 1; entries were removed or reordered",), "restore the ledger from a copy")


def _ledger_reordered(store: Store, tmp: Path) -> Tampered:
    raws = _raw_lines(store)
    raws[1], raws[2] = raws[2], raws[1]
    _write_lines(store, raws, rechain=False)
    return Tampered(("line 2 does not follow line 1; entries were removed or reordered",), "restore the ledger from a copy")


def _ledger_rewritten(store: Store, tmp: Path) -> Tampered:
    """A forger's whole job: train.jsonl changed, the manifest re-hashed to
    match, the inputs commitment replaced, every line re-hashed."""
    entry = _tiny_inputs(store)
    folder = store.home / entry.details["folder"]
    _flip(folder / data.TRAIN)
    manifest = json.loads((folder / schema.ART_MANIFEST).read_text())
    manifest["files"][data.TRAIN]["sha256"] = workspace.sha256_file(folder / data.TRAIN)
    (folder / schema.ART_MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True))
    forged = workspace.sha256_file(folder / schema.ART_MANIFEST)
    raws = _raw_lines(store)
    raws[entry.seq]["digest"] = forged
    _write_lines(store, raws, rechain=True)
    assert _entries(store)[entry.seq].digest == forged  # the chain verifies
    return Tampered(
        (
            f"line {entry.seq + 1} (inputs ",
            f"disagrees with the record: no run of the record committed {forged[:12]} "
            f"(the prepare runs of these settings committed {entry.digest[:12]})",
        ),
        "`python -m coopstudy prepare --preset tiny`",
    )


TRAIN_CONTROL = ("train", "--preset", "tiny", "--arm", "control")
TAMPER = {
    # case: (state, the next stage that depends on it, tamper)
    "prepared file (one byte)": ("planned", TRAIN_CONTROL, _prepared_file),
    "manifest (one byte)": ("planned", TRAIN_CONTROL, _manifest),
    "numerical source file": ("planned", TRAIN_CONTROL, _numerical_source),
    "gate receipt (the verify run's artifact)": ("planned", TRAIN_CONTROL, _gate_receipt),
    "probe receipt (one byte)": ("planned", TRAIN_CONTROL, _probe_receipt),
    "plan file (a threshold lowered)": ("planned", TRAIN_CONTROL, _plan),
    "plan file (bytes that are no JSON, nor UTF-8)": ("planned", TRAIN_CONTROL, _plan_garbled),
    "checkpoint before select (one byte)": ("trained", ("select", "--preset", "tiny"), _checkpoint_before_select),
    "checkpoint after select (one byte)": ("selected", ("evaluate", "--preset", "tiny"), _checkpoint_after_select),
    "candidate selection (rewritten, valid chain)": ("selected", ("evaluate", "--preset", "tiny"), _selection),
    "seed weights after select (one byte)": ("selected", ("evaluate", "--preset", "tiny"), _seed_after_select),
    "ledger line edited": ("planned", TRAIN_CONTROL, _ledger_edited),
    "ledger line deleted": ("planned", TRAIN_CONTROL, _ledger_deleted),
    "ledger lines reordered": ("planned", TRAIN_CONTROL, _ledger_reordered),
    "whole ledger rewritten with a valid chain": ("planned", TRAIN_CONTROL, _ledger_rewritten),
}


@pytest.mark.parametrize("case", list(TAMPER))
def test_tampered_commitment_is_refused_naming_it(case, request, tmp_path):
    state, argv, tamper = TAMPER[case]
    store = request.getfixturevalue(f"{state}_store").copy(tmp_path / "store")
    done_by = tamper(store, tmp_path)
    try:
        files, statuses = _snapshot(store), _statuses(store)
        done = run_cli(*argv, env=_cli_env(store, **done_by.env))
    finally:
        if done_by.restore is not None:
            done_by.restore()

    stage = argv[0]
    assert done.returncode == 2, done.stderr[-3000:]
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr[-3000:]
    (line,) = lines
    prefix = f"coopstudy {stage}: error: "
    assert line.startswith(prefix), line
    for name in done_by.names:
        assert name in line, line
    # A FAILED run of the stage, new, carrying the error.
    failed = [r for r in _runs(store, f"tags.`{schema.TAG_STAGE}` = '{stage}'") if r.info.run_id not in statuses]
    assert failed and failed[0].info.status == "FAILED", [r.info.status for r in failed]
    assert failed[0].data.tags[schema.TAG_ERROR] == line.removeprefix(prefix)
    # Nothing deleted or overwritten: every file of the study folder as it was
    # (the tampered one too, where it lies there), every earlier run as it ended.
    after = _snapshot(store)
    assert {k: after.get(k) for k in files} == files
    assert {k: v for k, v in _statuses(store).items() if k in statuses} == statuses
    assert done_by.run in line, line


def test_plan_of_a_config_with_nothing_to_probe_says_so_not_to_probe(planned_store, tmp_path):
    # Before, it sent the user to `probe ... --set 'probe.candidates=[]'`, which refuses this.
    store = planned_store.copy(tmp_path / "store")
    done = run_cli("plan", "--preset", "tiny", "--set", "probe.candidates=[]", env=store.env())
    assert (done.returncode, done.stderr.strip().splitlines()) == (2, [f"coopstudy plan: error: {config.NO_CANDIDATES}"]), done.stderr[-3000:]


def test_bench_objective_refuses_prepared_inputs_that_fail_their_check(planned_store, tmp_path):
    # Before, `--documents auto` took any refusal for "no prepared inputs",
    # timed synthetic documents under that note, and exited 0.
    store = planned_store.copy(tmp_path / "store")
    tampered = _prepared_file(store, tmp_path)
    done = run_cli("bench", "objective", "--preset", "tiny", "--updates", "1", env=_cli_env(store))
    assert done.returncode == 2, done.stderr[-3000:]
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith("coopstudy bench objective: error: ") and tampered.names[0] in line, line
    assert "synthetic" not in done.stdout


# --- 2. how a run ends -----------------------------------------------------


@pytest.fixture(scope="module")
def ends_store(planned_store, tmp_path_factory) -> Store:
    """One store for the run-end cases: each reads only its own runs."""
    return planned_store.copy(tmp_path_factory.mktemp("faults-ends"))


def _where(pid: int) -> str:
    """Where a process and each of its threads wait, as the kernel says (for a stage that hangs)."""
    proc = Path(f"/proc/{pid}")
    status = {k: v.strip() for k, _, v in (line.partition(":") for line in (proc / "status").read_text().splitlines())}
    threads = {t.name: (t / "wchan").read_text() for t in sorted((proc / "task").iterdir())}
    return f"signals {({k: status.get(k) for k in ('SigPnd', 'ShdPnd', 'SigBlk', 'SigIgn', 'SigCgt')})}, threads waiting in {threads}"


def _as_foreground() -> None:
    # A suite started in the background (`make test &`, nohup) ignores SIGINT,
    # and an ignored signal stays ignored across exec: Python then installs no
    # KeyboardInterrupt, and the Ctrl-C this test sends would never arrive.
    # A terminal's foreground job has the default disposition.
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _start_stage(store: Store, log: Path, *args: str, **env: str) -> subprocess.Popen:
    """A stage started as from a terminal: its own process group (a terminal's
    Ctrl-C reaches that group), Ctrl-C not ignored, its output in `log` (a
    pipe would fill up)."""
    out = open(log, "w")
    try:
        return subprocess.Popen(
            [sys.executable, "-m", "coopstudy", *args],
            cwd=ROOT, env={**os.environ, **store.env(), **env}, stdout=out, stderr=subprocess.STDOUT, text=True,
            start_new_session=True, preexec_fn=_as_foreground,
        )  # fmt: skip
    finally:
        out.close()


def _wait_for_update(stage: subprocess.Popen, log: Path, arm: str) -> None:
    """Until the arm's first update is done (rank 0's progress line): every
    rank is then inside the training loop."""
    deadline = time.monotonic() + STAGE_START_S
    while time.monotonic() < deadline:
        if f"train {arm}: update 1/" in log.read_text():
            return
        assert stage.poll() is None, log.read_text()[-3000:]
        time.sleep(0.2)
    raise AssertionError(f"no update in {STAGE_START_S} s: {log.read_text()[-3000:]}")


def _workers(stage_pid: int) -> list[psutil.Process]:
    """The training processes (`python -m coopstudy.run.worker`) the stage started, in any process group."""
    found = []
    for proc in psutil.process_iter():
        with contextlib.suppress(psutil.Error, ValueError):
            cmd = proc.cmdline()
            i = cmd.index("-m")
            if cmd[i + 1] == sources.WORKER and str(stage_pid) in {str(p.pid) for p in proc.parents()}:
                found.append(proc)
    return found


def _orphans(run_id: str) -> list[psutil.Process]:
    """Training processes writing `run_id`, whoever their parent now is."""
    found = []
    for proc in psutil.process_iter():
        with contextlib.suppress(psutil.Error, ValueError):
            cmd = proc.cmdline()
            i = cmd.index("-m")
            if cmd[i + 1] == sources.WORKER and run_id in cmd:
                found.append(proc)
    return found


def _newest(store: Store, name: str):
    return _runs(store, f"attributes.run_name = '{name}'")[0]


def _locks_free(store: Store) -> None:
    # Released: the holder emptied its files; a new holder takes them without a word.
    locks = list((store.home / "locks").glob("*.lock"))
    assert locks and all(path.read_text() == "" for path in locks), {str(p): p.read_text() for p in locks}


def _select_refuses(store: Store, arm: str, run_id: str, status: str) -> None:
    done = run_cli("select", "--preset", "tiny", "--set", f"train.updates={LONG}", env=store.env())
    assert done.returncode == 2, done.stderr[-3000:]
    assert f"arm {arm} has not finished (its newest train run {run_id} is {status})" in done.stderr, done.stderr


MLFLOW_RUNS_CTRL_C = "SIGINT, then SIGTERM"
"""Ctrl-C under `mlflow run`: the terminal's SIGINT reaches both, and `mlflow
run` then sends the stage a SIGTERM of its own while it stops its ranks."""


CTRL_C_TWICE = "SIGINT, then SIGINT"


@pytest.mark.parametrize(
    "sig",
    [signal.SIGINT, signal.SIGTERM, MLFLOW_RUNS_CTRL_C, CTRL_C_TWICE],
    ids=["SIGINT (Ctrl-C)", "SIGTERM", "Ctrl-C under mlflow run", "Ctrl-C twice"],
)
def test_a_stopped_train_stage_stops_both_ranks_and_ends_killed(ends_store, sig, tmp_path):
    log = tmp_path / "train.log"
    stage = _start_stage(ends_store, log, "train", "--preset", "tiny", "--arm", "compressed", "--set", f"train.updates={LONG}")
    try:
        _wait_for_update(stage, log, "compressed")
        ranks = _workers(stage.pid)
        assert len(ranks) == 2, ranks
        run = _newest(ends_store, "train-compressed-tiny")
        assert run.info.status == "RUNNING"
        sent = time.monotonic()
        if sig == signal.SIGTERM:
            stage.send_signal(signal.SIGTERM)  # what `kill PID` does
        else:
            os.killpg(stage.pid, signal.SIGINT)  # what a terminal's Ctrl-C does
        if sig in (MLFLOW_RUNS_CTRL_C, CTRL_C_TWICE):
            time.sleep(0.5)  # the stage is stopping its ranks
            assert stage.poll() is None, "the stage ended before the second signal: the case would be the plain one"
            stage.send_signal(signal.SIGTERM if sig == MLFLOW_RUNS_CTRL_C else signal.SIGINT)
        try:
            stage.wait(timeout=launch.STOP_GRACE_S + 60)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"the stage outlived its stop: {_where(stage.pid)}\n{log.read_text()[-2000:]}") from None
        took = time.monotonic() - sent
        _, alive = psutil.wait_procs(ranks, timeout=1)
    finally:
        if stage.poll() is None:
            os.killpg(stage.pid, signal.SIGKILL)
            stage.wait()
    out = log.read_text()
    assert not alive, f"ranks {[p.pid for p in alive]} outlived the stage"
    assert took < launch.STOP_GRACE_S, took
    # Told apart: a Ctrl-C is 130, a SIGTERM (`kill PID`, a scheduler) 143.
    assert stage.returncode == 128 + (signal.SIGTERM if sig == signal.SIGTERM else signal.SIGINT), out[-3000:]
    said = "stopped by SIGTERM" if sig == signal.SIGTERM else "interrupted"
    assert out.strip().splitlines()[-1] == f"coopstudy train: {said}", out[-3000:]
    assert launch.STOPPING.format(grace=launch.STOP_GRACE_S) in out, out[-3000:]
    told = launch.ALREADY_STOPPING.format(pid=stage.pid) in out
    assert told == (sig == CTRL_C_TWICE), out[-3000:]
    ended = _client(ends_store).get_run(run.info.run_id)
    assert ended.info.status == "KILLED"
    reason = "stopped by SIGTERM" if sig == signal.SIGTERM else "interrupted (SIGINT)"
    assert reason in ended.data.tags[schema.TAG_ERROR], ended.data.tags[schema.TAG_ERROR]
    assert "every process it launched was stopped" in ended.data.tags[schema.TAG_ERROR]
    # The ranks were asked to stop; what they said of it on the run says so.
    said = [ended.data.tags[k] for k in ended.data.tags if k.startswith(schema.TAG_WORKER_ERROR_PREFIX)]
    assert said and all(s.startswith("Stopped: stopped by SIGTERM") for s in said), said
    # What rank 0 measured before the stop (update 1 at least) reached the run.
    assert _client(ends_store).get_metric_history(run.info.run_id, schema.M_LOSS)
    # And what it spent, which the budget guard counts: two devices until the stop.
    spent = ended.data.metrics
    assert spent[schema.M_DEVICE_SECONDS] == pytest.approx(2 * spent[schema.M_COMPLETE_SECONDS]) and spent[schema.M_COMPLETE_SECONDS] > 1
    assert schema.M_COST_USD in spent
    # No checkpoint taken for final: none recorded, none on disk, and select refuses the run.
    assert schema.TAG_CHECKPOINT_SHA not in ended.data.tags
    assert not (ends_store.home / "checkpoints" / run.info.run_id).exists()
    assert not list((ends_store.home / "checkpoints").glob(".tmp-*"))
    _locks_free(ends_store)
    _select_refuses(ends_store, "compressed", run.info.run_id, "KILLED")


def test_a_killed_train_stage_leaves_a_stale_lock_the_next_train_takes_saying_so(ends_store, tmp_path):
    log = tmp_path / "killed.log"
    stage = _start_stage(ends_store, log, "train", "--preset", "tiny", "--arm", "control", "--set", f"train.updates={LONG}")
    left: list[psutil.Process] = []
    try:
        _wait_for_update(stage, log, "control")
        dead = _newest(ends_store, "train-control-tiny")
        stage.send_signal(signal.SIGKILL)
        stage.wait()
        # SIGKILL is not caught: the worker goes on, alone.
        left = _orphans(dead.info.run_id)
        assert len(left) == 1, left
        (lock_file,) = [p for p in (ends_store.home / "locks").glob("*.lock")]
        assert json.loads(lock_file.read_text())["pid"] == stage.pid  # the dead job's name is still on it

        done = run_cli("train", "--preset", "tiny", "--arm", "control", env=ends_store.env())
    finally:
        if stage.poll() is None:
            stage.kill()
            stage.wait()
        for p in left:
            with contextlib.suppress(psutil.Error):
                p.kill()
    assert done.returncode == 0, done.stderr[-3000:]
    said = [line for line in done.stderr.splitlines() if "is stale" in line]
    assert len(said) == 1, done.stderr[-3000:]
    assert f"the lock of pid {stage.pid} (coopstudy train --arm control --preset tiny, since" in said[0]
    assert f"its process is gone; stopped its leftover processes {left[0].pid}" in said[0]
    assert f"ended its run {dead.info.run_id} as KILLED; taking the device" in said[0]
    assert not psutil.pid_exists(left[0].pid) or left[0].status() == psutil.STATUS_ZOMBIE
    ended = _client(ends_store).get_run(dead.info.run_id)
    assert ended.info.status == "KILLED"
    assert f"the job pid {stage.pid}" in ended.data.tags[schema.TAG_ERROR]
    assert "died without releasing device" in ended.data.tags[schema.TAG_ERROR]
    assert ended.data.tags[schema.TAG_ERROR_KIND] == schema.ERROR_KIND_STALE_LOCK
    error_txt = Path(_client(ends_store).download_artifacts(dead.info.run_id, schema.ART_ERROR, str(tmp_path)))
    assert error_txt.read_text() == ended.data.tags[schema.TAG_ERROR]  # no traceback: the process is gone
    assert _newest(ends_store, "train-control-tiny").info.status == "FINISHED"
    _locks_free(ends_store)
    _select_refuses(ends_store, "control", dead.info.run_id, "KILLED")


SITE = '''\
"""Test shim (tests/test_faults.py): the disk fills up while the checkpoint's weights are written."""
import errno
import os

if os.environ.get("COOPSTUDY_TEST_FAULT") == "enospc-checkpoint":
    import safetensors.torch as _st
    from safetensors import SafetensorError

    _real = _st.save_file

    def save_file(tensors, filename, metadata=None):
        _real(tensors, filename, metadata=metadata)
        with open(filename, "r+b") as fh:  # half of it reached the disk
            fh.truncate(os.path.getsize(filename) // 2)
        # As safetensors says it (tests/test_checkpoint.py fills a real disk): its own error, not an OSError.
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    _st.save_file = save_file

if os.environ.get("COOPSTUDY_TEST_FAULT") == "fill-store-disk":
    # The tracking store's disk fills up while training ends: after the
    # per-update metrics were written, before the rank records its run.
    import safetensors.torch as _st

    _real = _st.save_file

    def save_file(tensors, filename, metadata=None):
        # Unbuffered: a buffered file would raise ENOSPC again as it closes.
        fd = os.open(os.environ["COOPSTUDY_TEST_FILLER"], os.O_WRONLY | os.O_CREAT)
        try:
            while True:
                os.write(fd, bytes(65536))
        except OSError as err:
            if err.errno != errno.ENOSPC:
                raise
        finally:
            os.close(fd)
        _real(tensors, filename, metadata=metadata)

    _st.save_file = save_file
'''


def test_disk_full_while_writing_the_checkpoint_is_one_line_and_keeps_nothing(planned_store, tmp_path):
    store = planned_store.copy(tmp_path / "store")
    shim = tmp_path / "shim"
    shim.mkdir()
    (shim / "sitecustomize.py").write_text(SITE)
    path = os.pathsep.join(p for p in (str(shim), os.environ.get("PYTHONPATH", "")) if p)
    done = run_cli(*TRAIN_CONTROL, env=_cli_env(store, PYTHONPATH=path, COOPSTUDY_TEST_FAULT="enospc-checkpoint"))
    assert done.returncode == 2, done.stderr[-3000:]
    line = done.stderr.strip().splitlines()[-1]
    assert line.startswith("coopstudy train: error: control arm failed (exit code 2); rank 0: CheckpointWriteFailed: cannot write the checkpoint")
    assert "No space left on device (ENOSPC); nothing of it was kept" in line, line
    assert "Traceback" not in done.stderr
    run = _newest(store, "train-control-tiny")
    assert run.info.status == "FAILED" and "No space left on device" in run.data.tags[schema.TAG_ERROR]
    assert schema.TAG_CHECKPOINT_SHA not in run.data.tags
    # Nothing half-written where a checkpoint would be, or beside it.
    assert not (store.home / "checkpoints" / run.info.run_id).exists()
    assert not list((store.home / "checkpoints").glob(".tmp-*"))


def _full_disk_for_prepared_inputs(monkeypatch: pytest.MonkeyPatch) -> None:
    """Writes into a prepared folder that is being made fail with ENOSPC, half written."""
    real = pathlib.Path.write_bytes

    def write_bytes(self, data_: bytes):
        if self.parent.name.startswith(".tmp-") and self.parent.parent.name == "prepared":
            real(self, data_[: len(data_) // 2])
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))  # as a write says it: naming no file
        return real(self, data_)

    monkeypatch.setattr(pathlib.Path, "write_bytes", write_bytes)


def test_disk_full_while_writing_prepared_inputs_keeps_nothing_half_written(tiny_seed, monkeypatch, capsys):
    with monkeypatch.context() as full:
        _full_disk_for_prepared_inputs(full)
        code = cli.main(["prepare", "--preset", "tiny"])
    assert code == 2
    # Progress lines come first; the error is the last line.
    line = capsys.readouterr().err.strip().splitlines()[-1]
    home = workspace.home()
    assert line.startswith(f"coopstudy prepare: error: No space left on device writing {home / 'prepared'}/") and line.endswith("; free some space and run it again"), line
    assert [p.name for p in (home / "prepared").iterdir()] == []  # no folder, no temporary one
    assert not ledger.Ledger().entries()
    client = mlflow.MlflowClient()
    (run,) = client.search_runs([client.get_experiment_by_name("coopstudy").experiment_id], f"tags.`{schema.TAG_STAGE}` = 'prepare'")
    assert run.info.status == "FAILED" and "No space left on device" in run.data.tags[schema.TAG_ERROR]
    # With space again, prepare writes the whole folder, and it verifies.
    capsys.readouterr()
    assert cli.main(["prepare", "--preset", "tiny"]) == 0
    (entry,) = ledger.Ledger().entries()
    data.verify_folder(home / entry.details["folder"], entry.digest)


def test_disk_full_while_writing_prepared_inputs_is_one_line_exit_2(tiny_seed, monkeypatch, capsys):
    _full_disk_for_prepared_inputs(monkeypatch)
    assert cli.main(["prepare", "--preset", "tiny"]) == 2
    # Progress lines come before it (stderr is no terminal here); the error is the last, and alone.
    err = capsys.readouterr().err
    line = err.strip().splitlines()[-1]
    assert line.startswith("coopstudy prepare: error: ") and "No space left on device" in line, err[-3000:]
    assert err.count("error:") == 1 and "Traceback" not in err


def test_a_tracking_store_another_process_keeps_locked_is_one_line_exit_2(_migrated_db, tmp_path):
    # It was SQLAlchemy's 100-line traceback, exit 1.
    store = Store(tmp_path / "home", tmp_path / "mlflow.db")
    shutil.copy(_migrated_db, store.db)
    held = sqlite3.connect(store.db, isolation_level=None)
    held.execute("BEGIN EXCLUSIVE")  # as a shell's open transaction holds it
    try:
        done = run_cli("plan", "--preset", "tiny", env=store.env())
    finally:
        held.close()
    said = f"coopstudy plan: error: the tracking store {store.tracking_uri} is locked by another process (database is locked); run it again once that process is done"
    assert (done.returncode, done.stderr.strip().splitlines()) == (2, [said]), done.stderr[-3000:]


def test_a_tracking_store_on_a_full_disk_is_one_line_exit_2(tiny_seed_home, _migrated_db, small_disk, tmp_path):
    store = Store(tmp_path / "home", small_disk / "mlflow.db")
    shutil.copytree(tiny_seed_home, store.home)
    shutil.copy(_migrated_db, store.db)
    # A study's store: the experiment is there, the step's first write is its run (MLflow logs
    # that SQLite error's traceback itself, before it raises).
    _client(store).create_experiment("coopstudy")
    fill_disk(small_disk)
    done = run_cli("prepare", "--preset", "tiny", env=store.env())
    assert done.returncode == 2, done.stderr[-3000:]
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    (line,) = [line for line in done.stderr.splitlines() if "error" in line.lower()]
    assert line == (f"coopstudy prepare: error: the disk of the tracking store {store.tracking_uri} is full (database or disk is full); "
                    "free some space and run it again (a run this step had opened stays RUNNING)")  # fmt: skip
    assert not (store.home / "ledger.jsonl").exists()


def test_a_training_rank_whose_tracking_store_fills_up_says_so_in_one_line(planned_store, small_disk, tmp_path):
    copied = planned_store.copy(tmp_path / "store")
    store = Store(copied.home, small_disk / "mlflow.db")
    shutil.move(copied.db, store.db)
    shim = tmp_path / "shim"
    shim.mkdir()
    (shim / "sitecustomize.py").write_text(SITE)
    path = os.pathsep.join(p for p in (str(shim), os.environ.get("PYTHONPATH", "")) if p)
    env = _cli_env(store, PYTHONPATH=path, COOPSTUDY_TEST_FAULT="fill-store-disk", COOPSTUDY_TEST_FILLER=str(small_disk / "filler"))
    done = run_cli(*TRAIN_CONTROL, env=env)
    assert done.returncode == 2, done.stderr[-3000:]
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    full = f"the disk of the tracking store {store.tracking_uri} is full (database or disk is full)"
    said = [line for line in done.stderr.splitlines() if "error" in line.lower() or full in line]
    assert said == [
        f"coopstudy worker (control, rank 0): {full}",
        f"coopstudy train: error: {full}; free some space and run it again "
        f"(run {_newest(store, 'train-control-tiny').info.run_id} stays RUNNING until `python -m coopstudy remote deliver` ends it)",
    ], done.stderr[-3000:]
    # What rank 0 measured before the disk filled up is on the run.
    run = _newest(store, "train-control-tiny")
    assert run.info.status == "RUNNING"
    assert _client(store).get_metric_history(run.info.run_id, schema.M_LOSS)
    # Its end waits on this host, for space: a delivery before keeps it waiting,
    # one after ends the run as it ended.
    early = run_cli("remote", "deliver", env=store.env())
    assert early.returncode == 2, early.stderr[-3000:]
    assert early.stderr.strip().splitlines() == [f"coopstudy remote deliver: error: the records of 1 run still wait in {store.home / 'outbox'}: {full} (run this again later)"]
    (small_disk / "filler").unlink()
    delivered = run_cli("remote", "deliver", env=store.env())
    assert delivered.returncode == 0, delivered.stderr[-3000:]
    assert _client(store).get_run(run.info.run_id).info.status == "FAILED", done.stderr


# --- 3. two jobs at once ---------------------------------------------------


def _together(
    store: Store, tmp: Path, *argv: str, meanwhile: Callable[[list[subprocess.Popen], list[Path]], None] | None = None
) -> list[tuple[int, str]]:
    """The same command twice, started together; (exit code, output) of each.
    `meanwhile(jobs, logs)` runs once both have started."""
    logs = [tmp / f"job{n}.log" for n in (0, 1)]
    jobs = [_start_stage(store, log, *argv) for log in logs]
    try:
        if meanwhile is not None:
            meanwhile(jobs, logs)
        codes = [job.wait(timeout=600) for job in jobs]
    finally:
        for job in jobs:
            if job.poll() is None:
                os.killpg(job.pid, signal.SIGKILL)
                job.wait()
    return [(code, log.read_text()) for code, log in zip(codes, logs)]


def test_node_0_whose_other_node_never_joins_fails_in_one_line_naming_the_rendezvous(planned_store, tmp_path):
    store = planned_store.copy(tmp_path / "store")
    port = workspace.free_port()
    done = run_cli("train", "--preset", "tiny", "--arm", "compressed", "--nodes", "2", "--node-rank", "0",
                   "--master-addr", "127.0.0.1", "--master-port", str(port), env=store.env())  # fmt: skip
    assert done.returncode == 2, done.stderr[-3000:]
    last = done.stderr.strip().splitlines()[-1]
    timeout = config.load("tiny").distributed.collective_timeout_s
    assert last.startswith(
        f"coopstudy train: error: compressed arm failed (exit code 2); rank 0: UserError: the 2 ranks did not all meet at 127.0.0.1:{port} "
        f"within distributed.collective_timeout_s ({timeout:g} s; "
    ), last
    # Rank 1 is node 1's: it never started, which is not being killed from outside.
    assert last.endswith("rank 1 recorded no error (another node's, which may never have started)"), last
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    (run,) = _runs(store, "attributes.run_name = 'train-compressed-tiny'")
    assert run.info.status == "FAILED"


def test_node_1_refuses_a_run_it_cannot_join_in_one_line_and_says_so_on_that_run(planned_store, tmp_path):
    store = planned_store.copy(tmp_path / "store")
    client = _client(store)
    experiment = client.get_experiment_by_name("coopstudy").experiment_id
    tiny = mlflow_store.config_sha256(config.load("tiny"))

    def node_1(run_id: str) -> str:
        done = run_cli("train", "--preset", "tiny", "--arm", "compressed", "--nodes", "2", "--node-rank", "1", "--master-addr",
                       "127.0.0.1", "--master-port", "29500", "--run-id", run_id, env=store.env())  # fmt: skip
        assert done.returncode == 2, done.stderr[-3000:]
        (line,) = done.stderr.strip().splitlines()
        return line

    def train_run(status: str, config_sha: str) -> str:
        tags = {schema.TAG_STAGE: schema.STAGE_TRAIN, schema.TAG_ARM: "compressed", schema.TAG_CONFIG_SHA: config_sha}
        run_id = client.create_run(experiment, tags=tags).info.run_id
        if status != "RUNNING":
            client.set_terminated(run_id, status)
        return run_id

    missing = "0" * 32
    assert node_1(missing) == (f"coopstudy train: error: --run-id {missing}: no such run in the record {store.tracking_uri}; "
                               "copy the id node 0 printed")  # fmt: skip
    killed = train_run("KILLED", tiny)
    assert node_1(killed) == f"coopstudy train: error: --run-id {killed} is KILLED, not RUNNING: start node 0 again and join the run it prints"
    finished = train_run("FINISHED", tiny)
    # Not "start node 0 again": node 0 refuses an arm that finished under its plan.
    said = f"--run-id {finished} is FINISHED: the arm has trained under its plan (an arm trains once per plan); nothing to join"
    assert node_1(finished) == f"coopstudy train: error: {said}"
    # Kept on the run as node 1's ranks' errors, where node 0's failure reads them.
    assert client.get_run(finished).data.tags[f"{schema.TAG_WORKER_ERROR_PREFIX}1"] == f"UserError: node 1: {said}"
    other = train_run("RUNNING", "ab" * 32)
    assert node_1(other).startswith(f"coopstudy train: error: --run-id {other} runs another config (sha256 abababababab, this one {tiny[:12]}): "
                                    "give node 1 the same --preset and --set overrides as node 0")  # fmt: skip
    assert client.get_run(other).data.tags[f"{schema.TAG_WORKER_ERROR_PREFIX}1"].startswith("UserError: node 1: ")
    assert [r.info.run_id for r in _runs(store, "attributes.run_name = 'train-compressed-tiny'")] == []


def test_two_trains_at_once_one_proceeds_the_other_refuses_in_one_line(planned_store, tmp_path):
    store = planned_store.copy(tmp_path / "store")
    book = (store.home / "ledger.jsonl").read_bytes()
    results = sorted(_together(store, tmp_path, *TRAIN_CONTROL))
    (ok, _), (refused, said) = results
    assert (ok, refused) == (0, 2), said[-3000:]
    (line,) = said.strip().splitlines()
    assert line.startswith("coopstudy train: error: device cpu on ") and "is in use by job pid " in line, said[-3000:]
    assert "(coopstudy train --arm control --preset tiny, since" in line and "jobs never share a device" in line
    runs = _runs(store, "attributes.run_name = 'train-control-tiny'")
    assert sorted(r.info.status for r in runs) == ["FAILED", "FINISHED"]
    assert (store.home / "ledger.jsonl").read_bytes() == book
    entry = _tiny_inputs(store)
    data.verify_folder(store.home / entry.details["folder"], entry.digest)


def test_two_prepares_at_once_leave_one_intact_folder_and_a_whole_ledger(tiny_seed_home, _migrated_db, tmp_path):
    store = Store(tmp_path / "home", tmp_path / "mlflow.db")
    shutil.copytree(tiny_seed_home, store.home)
    # An existing store: two processes creating one SQLite store at once race in MLflow's migrations.
    shutil.copy(_migrated_db, store.db)
    book = store.home / "ledger.jsonl"
    # The test holds the ledger's lock until both prepares wait for it, their
    # folders written: they overlap for certain.
    with open(book, "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        results = _together(store, tmp_path, "prepare", "--preset", "tiny", meanwhile=_release_once_both_wait(book, held, "prepare"))
    # Both proceed: the second finds the same content committed by the first, and commits it once.
    assert [code for code, _ in results] == [0, 0], [said[-3000:] for _, said in results]
    assert all("Traceback" not in said for _, said in results)
    entries = _entries(store)  # the chain verifies
    (inputs,) = [e for e in entries if e.kind == ledger.INPUTS]
    data.verify_folder(store.home / inputs.details["folder"], inputs.digest)
    assert [p.name for p in (store.home / "prepared").iterdir()] == [inputs.digest[:16]]


def _waiting_for_the_lock(path: Path) -> int:
    """How many processes wait for the flock of `path` (Linux's /proc/locks names a file by device and inode)."""
    st = path.stat()
    file = f" {os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino} "
    return sum(1 for line in Path("/proc/locks").read_text().splitlines() if "->" in line and file in line)


def _release_once_both_wait(book: Path, held: IO[str], step: str) -> Callable[[list[subprocess.Popen], list[Path]], None]:
    """What `_together` does meanwhile: release the ledger's lock the test
    holds (`held`) once both jobs wait for it, each past its own checks
    (started together, the second often started after the first had finished)."""

    def release(jobs: list[subprocess.Popen], logs: list[Path]) -> None:
        deadline = time.monotonic() + 180
        while _waiting_for_the_lock(book) < 2:
            assert all(job.poll() is None for job in jobs), [log.read_text()[-2000:] for log in logs]
            assert time.monotonic() < deadline, f"the two {step} jobs never both waited for the ledger"
            time.sleep(0.2)
        fcntl.flock(held, fcntl.LOCK_UN)

    return release


def test_two_selects_at_once_commit_one_selection(trained_store, tmp_path):
    store = trained_store.copy(tmp_path / "store")
    book = store.home / "ledger.jsonl"
    with open(book, "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        (ok, _), (refused, said) = sorted(_together(store, tmp_path, "select", "--preset", "tiny", meanwhile=_release_once_both_wait(book, held, "select")))
    assert (ok, refused) == (0, 2), said[-3000:]
    assert said.strip().splitlines()[-1].startswith("coopstudy select: error: the final candidates of plan "), said[-3000:]
    assert "were already selected at" in said and "a selection is made once" in said and "Traceback" not in said
    chosen = [e for e in _entries(store) if e.kind == ledger.CANDIDATE]
    assert sorted(e.details["arm"] for e in chosen) == ["compressed", "control"]
    (winner,) = {e.details["select_run_id"] for e in chosen}
    statuses = {r.info.run_id: r.info.status for r in _runs(store, f"tags.`{schema.TAG_STAGE}` = 'select'")}
    assert statuses.pop(winner) == "FINISHED" and list(statuses.values()) == ["FAILED"]


def test_checkpoints_deleted_before_select_come_back_from_the_record(trained_store, tmp_path):
    # Each train run holds its checkpoint folder as an artifact: a study reuses
    # the runs, and select brings the folders back and hashes them as trained.
    store = trained_store.copy(tmp_path / "store")
    arms = _runs(store, f"tags.`{schema.TAG_CHECKPOINT_PATH}` != '' and attributes.status = 'FINISHED'")
    trained = {r.data.tags[schema.TAG_ARM]: r for r in arms}
    assert sorted(trained) == sorted(config.ARMS) and len(arms) == 2
    folders = {arm: Path(r.data.tags[schema.TAG_CHECKPOINT_PATH]) for arm, r in trained.items()}  # in this copy's home
    for folder in folders.values():
        shutil.rmtree(folder)
    done = run_cli("study", "--preset", "tiny", "--through", "select", env=store.env())
    back = {arm: workspace.sha256_file(folder / workspace.WEIGHTS_FILE) for arm, folder in folders.items() if folder.is_dir()}
    assert done.returncode == 0, done.stderr[-3000:]
    for arm, run in trained.items():
        said = f"study: train-{arm}: reused run {run.info.run_id} (the arm's first finished run under plan {run.data.tags[schema.TAG_PLAN][:12]}; its checkpoint is gone from disk, and select brings it back from the run's artifact)"
        assert said in done.stdout, done.stdout[-3000:]
    assert "study: select: running" in done.stdout
    assert back == {arm: r.data.tags[schema.TAG_CHECKPOINT_SHA] for arm, r in trained.items()}
    assert {e.details["arm"]: e.digest for e in _entries(store) if e.kind == ledger.CANDIDATE} == back


def test_a_checkpoint_changed_before_select_stops_the_study_naming_the_way_back(trained_store, tmp_path):
    # Training the arm again could not replace its candidate (an arm trains once per plan):
    # the study stops and says how the planned weights come back, not "running" train.
    store = trained_store.copy(tmp_path / "store")
    (run,) = _runs(store, "attributes.run_name = 'train-control-tiny' and attributes.status = 'FINISHED'")
    folder = Path(run.data.tags[schema.TAG_CHECKPOINT_PATH])  # in this copy's home
    _flip(folder / workspace.WEIGHTS_FILE)
    done = run_cli("study", "--preset", "tiny", "--through", "select", env=store.env())
    plan = run.data.tags[schema.TAG_PLAN]
    said = (f"coopstudy study: error: train-control: the checkpoint of run {run.info.run_id} is changed: delete {folder}, and "
            f"select brings it back from the run's artifact (the arm's first finished run under plan {plan[:12]}, made once per plan)")  # fmt: skip
    assert (done.returncode, done.stderr.strip().splitlines()) == (2, [said]), done.stderr[-3000:]
    assert len(_runs(store, "attributes.run_name = 'train-control-tiny'")) == 1  # nothing trained again


# --- 4. bad input ----------------------------------------------------------


def _hostfile(tmp: Path, text: str) -> str:
    (tmp / "hostfile").write_text(text)
    return str(tmp / "hostfile")


def _preset(tmp: Path, edit: Callable[[str], str]) -> str:
    path = tmp / "preset.yaml"
    path.write_text(edit((ROOT / "configs" / "tiny.yaml").read_text()))
    return str(path)


def _a_pipe(tmp: Path, name: str) -> str:
    os.mkfifo(tmp / name)
    return str(tmp / name)


def _a_file(tmp: Path) -> Path:
    (tmp / "a-file").write_text("")
    return tmp / "a-file"


def _a_folder(tmp: Path, name: str) -> Path:
    (tmp / name).mkdir()
    return tmp / name


def _a_fifo(tmp: Path, name: str) -> Path:
    os.mkfifo(tmp / name)
    return tmp / name


def _model_spoilt(tmp: Path, name: str, spoilt: bytes) -> str:
    """A copy of the tiny seed's folder whose file `name` holds `spoilt`."""
    (seed,) = (workspace.home() / "seeds").iterdir()
    shutil.copytree(seed, tmp / "model")
    (tmp / "model" / name).write_bytes(spoilt)
    return str(tmp / "model")


def _model_cut_short(tmp: Path) -> str:
    """The tiny seed's folder with its weights file cut to 20 bytes, as a
    failed download or a Git LFS pointer leaves it."""
    return _model_spoilt(tmp, workspace.WEIGHTS_FILE, b"version https://git-")


def _spoil_seed_config(remove: bool = False) -> None:
    (folder,) = (workspace.home() / "seeds").glob("random-*")
    if remove:
        (folder / "config.json").unlink()
    else:
        (folder / "config.json").write_text("{bad")


BAD_INPUT: dict[str, tuple[Callable[[Path], tuple[str, ...]], str]] = {
    # case: (argv from a scratch folder, what the one line must say)
    "preset that is a list": (lambda tmp: ("prepare", "--preset", _preset(tmp, lambda t: "- model\n- data\n")), "expected a mapping of sections"),
    "an unknown flag": (lambda tmp: ("prepare", "--preset", "tiny", "--nosuch", "1"), "unrecognized arguments: --nosuch 1 (see `python -m coopstudy prepare --help`)"),
    "a choice not among an option's": (
        lambda tmp: ("train", "--preset", "tiny", "--arm", "nosuch"),
        "argument --arm: invalid choice: 'nosuch' (choose from 'control', 'compressed', 'both') (see `python -m coopstudy train --help`)",
    ),
    # torch would segfault, and overflow a C int of milliseconds.
    "more threads than any machine": (lambda tmp: ("prepare", "--preset", "tiny", "--set", "train.threads_per_device=100000"), "train.threads_per_device: Input should be less than or equal to 1024"),
    "a timeout of 1e300 s": (lambda tmp: ("prepare", "--preset", "tiny", "--set", "distributed.collective_timeout_s=1e300"), "distributed.collective_timeout_s: Input should be less than or equal to 604800"),
    # Screens that could not fail (or not pass) are refused before they are planned.
    "a speedup threshold every run passes": (lambda tmp: ("prepare", "--preset", "tiny", "--set", "screens.min_speedup=-5"), "screens.min_speedup: Input should be greater than 0"),
    "a non-inferiority margin above 0": (
        lambda tmp: ("prepare", "--preset", "tiny", "--set", "screens.noninferiority_margin=5"),
        "screens.noninferiority_margin: Input should be less than or equal to 0",
    ),
    "an accuracy gain every run passes": (
        lambda tmp: ("prepare", "--preset", "tiny", "--set", "screens.min_accuracy_gain=-1"),
        "screens.min_accuracy_gain: Input should be greater than -1",
    ),
    # Before, each was planned: the first two let the retention screen pass a
    # model whose NLL rose by 7 nats per token, the third shrank Tango's
    # interval onto the estimate.
    "a retention threshold every run passes": (
        lambda tmp: ("prepare", "--preset", "tiny", "--set", "screens.retention_max_nll_increase=1e9"),
        "screens.retention_max_nll_increase: Input should be less than or equal to 1",
    ),
    "a one-sided level whose bound falls below the mean": (
        lambda tmp: ("prepare", "--preset", "tiny", "--set", "screens.retention_level=0.01"),
        "screens.retention_level: Input should be greater than or equal to 0.5",
    ),
    "an interval level that shrinks the interval onto the estimate": (
        lambda tmp: ("prepare", "--preset", "tiny", "--set", "screens.interval_level=0.001"),
        "screens.interval_level: Input should be greater than or equal to 0.5",
    ),
    "--nodes 0": (lambda tmp: ("train", "--preset", "tiny", "--arm", "compressed", "--nodes", "0"), "--nodes 0: a job runs on at least 1 host"),
    # Path('') is the current folder: it was refused as "--hostfile .: a folder, not a file".
    "an empty --hostfile": (lambda tmp: ("train", "--preset", "tiny", "--arm", "compressed", "--hostfile", ""), "argument --hostfile: an empty path; name the hostfile"),
    # It said only "(OSError)", and not how to mend it.
    "a cached seed whose config.json is no JSON": (
        lambda tmp: _spoil_seed_config() or ("prepare", "--preset", "tiny"),
        "config.json' is not a valid JSON file.); delete ",
    ),
    # Prepare passed, and a bench or a training rank ended in a traceback.
    "a cached seed without config.json": (
        lambda tmp: _spoil_seed_config(remove=True) or ("prepare", "--preset", "tiny"),
        ": no config.json; delete ",
    ),
    # It said "package 'os' is not installed".
    "a GGUF package that is a module": (
        lambda tmp: ("prepare", "--preset", "tiny", "--set", "model.source=gguf-package", "model.gguf_package=os"),
        "model.gguf_package: 'os' is a module, not a package that ships a GGUF file",
    ),
    "an empty --master-addr": (
        lambda tmp: ("train", "--preset", "tiny", "--arm", "compressed", "--nodes", "2", "--node-rank", "0", "--master-addr", "", "--master-port", "29600"),
        "--master-addr: an empty address",
    ),
    # More items than a family's seed range holds: the counts, not the seeds, are to change.
    "more tasks than a family's seeds": (
        lambda tmp: ("prepare", "--preset", "tiny", "--set", "data.tasks_per_family=1000000000"),
        "data.tasks_per_family: 1,000,000,000 is more than the 1,000,000 seeds each family's range holds",
    ),
    "--set of infinity": (lambda tmp: ("prepare", "--preset", "tiny", "--set", "distributed.collective_timeout_s=inf"), "Input should be a finite number"),
    "bench generate --items 0": (lambda tmp: ("bench", "generate", "--preset", "tiny", "--items", "0"), "--items: from 1 to 100,000 (got 0)"),
    "bench generate --items 10**20": (
        lambda tmp: ("bench", "generate", "--preset", "tiny", "--items", str(10**20)),
        "--items: from 1 to 100,000 (got 100,000,000,000,000,000,000)",
    ),
    "--set of a huge integer": (lambda tmp: ("prepare", "--preset", "tiny", "--set", f"train.updates={10**30}"), "train.updates: at most 4,294,967,295 in size"),
    "a schedule too long to write": (
        lambda tmp: ("prepare", "--preset", "tiny", "--set", "train.updates=1000000"),
        "train.updates: 1,000,000 updates of 8 documents are 8,000,000 schedule slots; at most 1,048,576",
    ),
    "a family option reasoning-gym refuses": (
        lambda tmp: ("prepare", "--preset", "tiny", "--set", "data.family_options={gcd: {min_value: -5}}"),
        "data.family_options: reasoning-gym cannot make 'gcd': min_value must be positive",
    ),
    "options for a family not studied": (
        lambda tmp: ("prepare", "--preset", "tiny", "--set", "data.family_options={gdc: {min_value: 5}}"),
        "data.family_options: gdc: not among data.families (gcd, ",
    ),
    "a family listed twice": (lambda tmp: ("prepare", "--preset", "tiny", "--set", "data.families=[gcd, gcd]"), "data.families: gcd listed twice"),
    # reasoning-gym would seed with the absolute value, into the training's range.
    "a negative test seed": (lambda tmp: ("prepare", "--preset", "tiny", "--set", "data.test_seed=-1011"), "data.test_seed: Input should be greater than or equal to 0"),
    "an experiment name of spaces": (lambda tmp: ("prepare", "--preset", "tiny", "--set", "experiment=' '"), "experiment: an empty name"),
    "study --arm without --through train": (
        lambda tmp: ("study", "--preset", "tiny", "--arm", "control"),
        "--arm control: it applies only with --through train (got --through report)",
    ),
    "pretrained weights cut short": (
        lambda tmp: ("prepare", "--preset", "tiny", "--set", "model.source=pretrained", f"model.name_or_path={_model_cut_short(tmp)}"),
        "/model/model.safetensors is not a safetensors file (a Git LFS pointer, or cut short?)",
    ),
    "pretrained tokenizer spoilt": (
        lambda tmp: ("prepare", "--preset", "tiny", "--set", "model.source=pretrained", f"model.name_or_path={_model_spoilt(tmp, 'tokenizer.json', b'{bad')}"),
        "seed model: the tokenizer in ",
    ),
    "replay source that is a folder": (
        lambda tmp: ("prepare", "--preset", "tiny", "--set", f"data.replay_source={_a_folder(tmp, 'chats.jsonl')}"),
        "/chats.jsonl is a folder, not a file",
    ),
    "report --out at a file": (
        lambda tmp: ("report", "--preset", "tiny", "--out", str(_a_file(tmp))),
        "/a-file: cannot make it (a file is there, not a folder)",
    ),
    "report --out below a file": (
        lambda tmp: ("report", "--preset", "tiny", "--out", str(_a_file(tmp) / "report")),
        "/a-file/report: cannot make it (Not a directory)",
    ),
    "preset with a YAML syntax error": (
        lambda tmp: ("prepare", "--preset", _preset(tmp, lambda t: t.replace("model:", "model: [", 1))),
        "/preset.yaml: not valid YAML at line 5, column 14: expected ',' or ']', but got ':' (ParserError)",
    ),
    # YAML keeps the last silently: the preset ran at the second learning rate.
    "preset with a key given twice": (
        lambda tmp: ("prepare", "--preset", _preset(tmp, lambda t: t.replace("  lr: 1.0e-3\n", "  lr: 1.0e-3\n  lr: 0.5\n", 1))),
        "/preset.yaml: not valid YAML at line 27, column 3: 'lr' is given twice (ConstructorError)",
    ),
    "--set mapping with a key given twice": (
        lambda tmp: ("prepare", "--preset", "tiny", "--set", "data.family_options={gcd: {min_value: 1, min_value: 2}}"),
        "override 'data.family_options={gcd: {min_value: 1, min_value: 2}}': 'min_value' is given twice",
    ),
    # It was said as missing.
    "preset that is a pipe": (lambda tmp: ("prepare", "--preset", _a_pipe(tmp, "preset.yaml")), "/preset.yaml: not a regular file (a pipe, socket or device)"),
    "preset with a misspelt key": (
        lambda tmp: ("prepare", "--preset", _preset(tmp, lambda t: t.replace("  lr: ", "  lrr: ", 1))),
        "train.lrr: unknown key; did you mean train.lr?",
    ),
    "preset with a wrong type": (
        lambda tmp: ("prepare", "--preset", _preset(tmp, lambda t: t.replace("updates: 6", "updates: six", 1))),
        "train.updates: Input should be a valid integer",
    ),
    "--set with a wrong type": (lambda tmp: ("prepare", "--preset", "tiny", "--set", "train.lr=fast"), "train.lr: Input should be a valid number"),
    "unknown family name": (
        lambda tmp: ("prepare", "--preset", "tiny", "--set", "data.families=[gcd,no_such_family]"),
        "data.families: reasoning-gym has no family 'no_such_family'; it knows ",
    ),
    "a family name misspelt": (lambda tmp: ("prepare", "--preset", "tiny", "--set", "data.families=[gcdd]"), "data.families: reasoning-gym has no family 'gcdd'; did you mean gcd?"),
    "--set with no =": (lambda tmp: ("prepare", "--preset", "tiny", "--set", "train.lr"), "override 'train.lr': expected key=value"),
    # Before, `--set` with nothing after it ran the step on the preset alone.
    "--set with nothing after it": (lambda tmp: ("prepare", "--preset", "tiny", "--set"), "argument --set: expected at least one argument"),
    "--set followed by an option": (lambda tmp: ("prepare", "--preset", "tiny", "--set", "--dry-run"), "argument --set: expected at least one argument"),
    "--set with an empty key part": (lambda tmp: ("prepare", "--preset", "tiny", "--set", "train..lr=1"), "override 'train..lr=1': expected key=value"),
    "report --out ''": (lambda tmp: ("report", "--preset", "tiny", "--out", ""), "--out: an empty path"),
    # The hint names the preset as it was given: a file outside configs/ by its path.
    "plan before prepare, a preset file": (
        lambda tmp: ("plan", "--preset", _preset(tmp, lambda t: t)),
        "/preset.yaml` first",
    ),
    # ... and with the overrides given: without them it would act on another config.
    "plan before prepare, with overrides": (
        lambda tmp: ("plan", "--preset", "tiny", "--set", "train.lr=2e-4", "--set", "data.families=[gcd, chain_sum]"),
        "run `python -m coopstudy prepare --preset tiny --set train.lr=2e-4 --set 'data.families=[gcd, chain_sum]'` first",
    ),
    # Not one refusal per missing step (select, then probe, verify, prepare): one command for all of them.
    "select before anything": (
        lambda tmp: ("select", "--preset", "tiny", "--set", "train.lr=2e-4"),
        "run `python -m coopstudy study --preset tiny --set train.lr=2e-4 --through plan` first (it runs what is missing of prepare, verify, probe and plan)",
    ),
    "preset that is a folder": (lambda tmp: ("prepare", "--preset", str(_a_folder(tmp, "presets"))), "a preset is a name from configs/ or a path to a .yaml file"),
    "unknown preset": (lambda tmp: ("prepare", "--preset", "no-such-preset"), "unknown preset 'no-such-preset'"),
    "hostfile: a line that is no host": (
        lambda tmp: ("train", "--preset", "tiny", "--arm", "compressed", "--hostfile", _hostfile(tmp, "host-a slots=1\nhost-b two\n")),
        "line 2: 'host-b two' is not `HOST slots=N`",
    ),
    "hostfile: one host for two ranks": (
        lambda tmp: ("train", "--preset", "tiny", "--arm", "compressed", "--hostfile", _hostfile(tmp, "# one\nhost-a slots=1\n")),
        "names 1 host(s); the compressed arm needs 2",
    ),
    "hostfile: three hosts for two ranks": (
        lambda tmp: ("train", "--preset", "tiny", "--arm", "compressed", "--hostfile", _hostfile(tmp, "a slots=1\nb slots=1\nc slots=1\n")),
        "names 3 host(s); the compressed arm needs 2, one rank each",
    ),
    "hostfile: the control arm": (
        lambda tmp: ("train", "--preset", "tiny", "--arm", "control", "--hostfile", _hostfile(tmp, "a slots=1\nb slots=1\n")),
        "--hostfile: only the compressed arm runs on several hosts (got --arm control)",
    ),
    # No passwordless ssh to this machine here (and no pdsh): DeepSpeed would say it in a traceback, once started.
    "hostfile: a host ssh cannot reach": (
        lambda tmp: ("train", "--preset", "tiny", "--arm", "compressed", "--hostfile", _hostfile(tmp, "localhost slots=1\n127.0.0.1 slots=1\n")),
        "host localhost does not answer passwordless ssh (",
    ),
    "--nodes 1 with node options": (
        lambda tmp: ("train", "--preset", "tiny", "--arm", "compressed", "--nodes", "1", "--node-rank", "0", "--master-addr", "127.0.0.1", "--master-port", "29600"),
        "--node-rank, --master-addr, --master-port: options of one node of a job on several hosts; --nodes 1 is a job on this host alone",
    ),
    "--run-id without --nodes": (
        lambda tmp: ("train", "--preset", "tiny", "--arm", "compressed", "--run-id", "0" * 32),
        "--run-id: an option of one node of a job on several hosts; give --nodes too",
    ),
    "probe --hostfile without a compressed candidate": (
        lambda tmp: ("probe", "--preset", "tiny", "--set", "probe.candidates=[{arm: control, microbatch: 4}]", "--hostfile", _hostfile(tmp, "a slots=1\nb slots=1\n")),
        "--hostfile: only the compressed arm runs on several hosts, and this sweep has no compressed candidate",
    ),
    "the experiment Default": (
        lambda tmp: ("prepare", "--preset", "tiny", "--set", "experiment=Default"),
        "Default is MLflow's own experiment, where `mlflow run` puts its pointer runs; name the study's own",
    ),
    "hostfile: missing": (lambda tmp: ("train", "--preset", "tiny", "--arm", "compressed", "--hostfile", str(tmp / "nope")), "no such file"),
    "hostfile: a folder": (lambda tmp: ("train", "--preset", "tiny", "--arm", "compressed", "--hostfile", str(_a_folder(tmp, "hosts"))), "/hosts: a folder, not a file"),
    # Its read blocked for ever, under --dry-run too.
    "hostfile: a named pipe": (
        lambda tmp: ("train", "--preset", "tiny", "--arm", "compressed", "--dry-run", "--hostfile", str(_a_fifo(tmp, "hosts"))),
        "/hosts: not a regular file (a pipe, socket or device)",
    ),
    "probe's hostfile: a line that is no host": (
        lambda tmp: ("probe", "--preset", "tiny", "--hostfile", _hostfile(tmp, "host-a slots=1\nhost-b two\n")),
        "line 2: 'host-b two' is not `HOST slots=N`",
    ),
    "--nodes without the rendezvous": (
        lambda tmp: ("train", "--preset", "tiny", "--arm", "compressed", "--nodes", "2", "--node-rank", "1"),
        "--nodes 2 needs --master-addr, --master-port",
    ),
    "--node-rank 1 without --run-id": (
        lambda tmp: ("train", "--preset", "tiny", "--arm", "compressed", "--nodes", "2", "--node-rank", "1",
                     "--master-addr", "10.0.0.1", "--master-port", "29600"),
        "node 1 joins the run node 0 opened: give its --run-id",
    ),
    "--nodes with the control arm": (
        lambda tmp: ("train", "--preset", "tiny", "--arm", "control", "--nodes", "2", "--node-rank", "0",
                     "--master-addr", "10.0.0.1", "--master-port", "29600"),
        "only the compressed arm runs on several hosts",
    ),
    "--run-id of no run": (
        lambda tmp: ("train", "--preset", "tiny", "--arm", "compressed", "--nodes", "2", "--node-rank", "1",
                     "--master-addr", "10.0.0.1", "--master-port", "29600", "--run-id", "0" * 32),
        f"--run-id {'0' * 32}: no such run in the record",
    ),
}


@pytest.mark.parametrize("case", list(BAD_INPUT))
def test_bad_input_is_one_line_and_exit_2(case, tiny_seed, tmp_path):
    make, expected = BAD_INPUT[case]
    argv = make(tmp_path)
    done = run_cli(*argv)
    assert done.returncode == 2, done.stderr[-3000:]
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr[-3000:]
    typed = " ".join(argv[:2] if argv[0] in ("bench", "remote") else argv[:1])
    assert lines[0].startswith(f"coopstudy {typed}: error: ") and expected in lines[0], lines[0]
    # Refused before anything was started: the study folder holds the seed and,
    # for --nodes, the hostfile written as the options are read (no prepared
    # inputs, plan, lock, checkpoint or ledger); a run on record is the refused
    # step's own, FAILED.
    home = workspace.home()
    derived = {"launch"} if "--nodes" in argv else set()
    assert {p.name for p in home.iterdir()} - derived == {"seeds"}, sorted(home.iterdir())
    client = mlflow.MlflowClient()
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert all(r.info.status == "FAILED" and r.data.tags[schema.TAG_STAGE] == argv[0] for r in runs), runs
    if case.startswith("report --out"):
        # A file is refused before the report run opens; below a file, with it open.
        assert bool(runs) == (case == "report --out below a file"), runs
    if case == "hostfile: a host ssh cannot reach":
        assert not runs, runs  # checked before any run opens


def test_a_refusal_on_a_store_it_makes_is_still_one_line(tiny_seed, tmp_path):
    # A mistake seen only once the store is open, on a store that is not there
    # yet: MLflow would say, before the refusal, that it makes its tables.
    db = tmp_path / "new" / "mlflow.db"
    done = run_cli("train", "--preset", "tiny", "--arm", "compressed", "--nodes", "2", "--node-rank", "1",
                   env={"MLFLOW_TRACKING_URI": f"sqlite:///{db}"})  # fmt: skip
    assert done.returncode == 2, done.stderr[-3000:]
    assert done.stderr.strip().splitlines() == ["coopstudy train: error: --nodes 2 needs --master-addr, --master-port "
                                                "(the same address and port on every node)"], done.stderr[-3000:]  # fmt: skip
    assert db.is_file()


@pytest.mark.parametrize(
    "variable, value, said",
    [
        ("MLFLOW_TRACKING_URI", "foo://bar", "tracking URI 'foo://bar' (from MLFLOW_TRACKING_URI) cannot be opened. Supported URI schemes are: ["),
        ("COOPSTUDY_HOME", "{file}/home", "{file} is a file, not a folder (set COOPSTUDY_HOME to move it)"),
        # MLflow would let SQLAlchemy's traceback out of the first, and retry the second for minutes.
        ("MLFLOW_TRACKING_URI", "sqlite:///{text}", "tracking URI 'sqlite:///{text}' (from MLFLOW_TRACKING_URI): {text} is not an SQLite database"),
        ("MLFLOW_TRACKING_URI", "sqlite:///{folder}", "{folder} is a folder, not a database file"),
        ("MLFLOW_TRACKING_URI", "sqlite:///{file}/m.db", "cannot make {file}/m.db (a file is in its folder's path)"),
        ("MLFLOW_TRACKING_URI", "https://[::1", "tracking URI 'https://[::1' (from MLFLOW_TRACKING_URI) is not a URI: Invalid IPv6 URL"),
        # A leftover of `mlflow run` in the shell: MLflow would start a run, then fail with a traceback.
        ("MLFLOW_RUN_ID", "garbage", "MLFLOW_RUN_ID=garbage: no such run in "),
        ("COOPSTUDY_REMOTE_FILE", "{binary}", "tracking URI file {binary}: cannot read it (not UTF-8 text)"),
        # MLflow would take it, and the step's records would vanish at its end.
        ("MLFLOW_TRACKING_URI", "sqlite://", "tracking URI 'sqlite://' (from MLFLOW_TRACKING_URI): an in-memory database"),
        ("MLFLOW_TRACKING_URI", "sqlite:///", "tracking URI 'sqlite:///' (from MLFLOW_TRACKING_URI): an in-memory database"),
        ("MLFLOW_TRACKING_URI", "sqlite:///:memory:", "tracking URI 'sqlite:///:memory:' (from MLFLOW_TRACKING_URI): an in-memory database"),
        # A database store whose driver is not installed: MLflow's ModuleNotFoundError.
        ("MLFLOW_TRACKING_URI", "postgresql://nohost/db", "(from MLFLOW_TRACKING_URI) needs the Python module '"),
        # A home whose sub-folders cannot be made (procfs here; read-only alike).
        ("COOPSTUDY_HOME", "/proc/1", "the study's home /proc/1: cannot make /proc/1/"),
        # A home that cannot be made at all.
        ("COOPSTUDY_HOME", "/proc/nosuch/home", "the study's home /proc/nosuch/home: cannot be made (No such file or directory"),
        # Said before as no such file.
        ("COOPSTUDY_REMOTE_FILE", "/dev/null", "COOPSTUDY_REMOTE_FILE=/dev/null: not a regular file (a pipe, socket or device)"),
        ("COOPSTUDY_REMOTE_FILE", "{folder}", "COOPSTUDY_REMOTE_FILE={folder}: a folder, not a file"),
        # A link to nothing: said before as its parent folder being a file.
        ("COOPSTUDY_HOME", "{dangling}", "the study's home {dangling}: a symbolic link that leads to no folder"),
        # A word with no scheme is a folder store to MLflow, which refuses it with a migration notice.
        ("MLFLOW_TRACKING_URI", "nonsense", "tracking URI 'nonsense' (from MLFLOW_TRACKING_URI) cannot be opened. It names a folder (no scheme, or file:)"),
        # Named as the user set it, not as the config key it becomes.
        ("MLFLOW_EXPERIMENT_NAME", " x ", "MLFLOW_EXPERIMENT_NAME=' x ': a name with spaces at its ends"),
        # Said as the server refusing ("Invalid url"), or as an unknown host.
        ("MLFLOW_TRACKING_URI", "http://127.0.0.1:99999", "tracking URI 'http://127.0.0.1:99999' (from MLFLOW_TRACKING_URI) is not a URL: Port out of range"),
        ("MLFLOW_TRACKING_URI", "http://", "tracking URI 'http://' (from MLFLOW_TRACKING_URI) is not a URL: it names no host"),
        # Set by hand (no MLFLOW_RUN_ID beside it), it names the experiment as for MLflow; before, it was ignored.
        ("MLFLOW_EXPERIMENT_ID", "abc", "MLFLOW_EXPERIMENT_ID=abc: no such experiment in "),
        # MLflow's own experiment: in a local store, its artifacts went to ./mlruns/0 of the folder the step ran in.
        ("MLFLOW_EXPERIMENT_ID", "0", "MLFLOW_EXPERIMENT_ID=0 (experiment 'Default'): Default is MLflow's own experiment"),
    ],
)
def test_a_bad_environment_is_one_line_and_exit_2(variable, value, said, tmp_path):
    paths = {"file": _a_file(tmp_path), "folder": tmp_path, "text": tmp_path / "notes.txt", "binary": tmp_path / "remote.txt"}
    paths["dangling"] = tmp_path / "home-link"
    paths["dangling"].symlink_to(tmp_path / "nowhere")
    paths["text"].write_text("not a database\n")
    paths["binary"].write_bytes(b"http://tracking\xff\n")
    env = {variable: value.format(**paths)}
    if variable == "COOPSTUDY_REMOTE_FILE":
        env["MLFLOW_TRACKING_URI"] = ""  # the user's URI would be taken first
    done = run_cli("prepare", "--preset", "tiny", env=env, timeout=60)
    assert done.returncode == 2, done.stderr[-3000:]
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith("coopstudy prepare: error: ") and said.format(**paths) in line, line
    assert paths["text"].read_text() == "not a database\n"


def test_a_worker_whose_launcher_gave_a_rank_that_is_no_number_says_so_in_one_line():
    # Read before anything else, to name the rank in every later line: it was a traceback.
    done = run_worker("--arm", "control", "--config", "e30=", "--run-id", "0" * 32, env={"RANK": "x"}, timeout=60)
    assert done.returncode == 2, done.stderr[-3000:]
    assert done.stderr.strip().splitlines() == ["coopstudy worker: error: RANK='x' is not an integer"]


@pytest.mark.parametrize("step", ["verify", "report"])
def test_a_home_that_is_a_file_is_refused_before_a_run_opens(step, tmp_path):
    done = run_cli(step, "--preset", "tiny", env={"COOPSTUDY_HOME": str(_a_file(tmp_path))})
    assert done.returncode == 2 and "is a file, not a folder" in done.stderr, done.stderr[-3000:]
    # Not an empty run left FINISHED: the run's records would wait in that home.
    client = mlflow.MlflowClient()
    assert not [r for e in client.search_experiments() for r in client.search_runs([e.experiment_id])]


@pytest.mark.parametrize("step", ["plan", "verify"])
def test_a_folder_where_the_ledger_belongs_is_one_line_before_any_work(step, tmp_path):
    home = tmp_path / "home"
    (home / "ledger.jsonl").mkdir(parents=True)
    done = run_cli(step, "--preset", "tiny", env={"COOPSTUDY_HOME": str(home)})
    assert done.returncode == 2, done.stderr[-3000:]
    assert done.stderr.strip().splitlines() == [f"coopstudy {step}: error: {home / 'ledger.jsonl'}: Is a directory"], done.stderr[-3000:]
    assert "gate passed" not in done.stdout and "pass" not in done.stdout  # verify refused before its gate ran
    client = mlflow.MlflowClient()
    (run,) = client.search_runs([client.get_experiment_by_name("coopstudy").experiment_id])
    assert run.data.tags[schema.TAG_ERROR] == f"{home / 'ledger.jsonl'}: Is a directory"  # as the line says it, not `[Errno 21] …`


@pytest.mark.parametrize("code", [errno.EIO, errno.ESTALE], ids=["EIO", "ESTALE"])
def test_a_disk_that_fails_under_a_read_is_one_line(code, monkeypatch, capsys, tmp_path):
    from coopstudy import cli as cli_mod
    from coopstudy.commit import ledger

    def failed(self, *args, **kwargs):
        raise OSError(code, os.strerror(code), str(self.path))

    monkeypatch.setattr(ledger.Ledger, "entries", failed)
    assert cli_mod.main(["plan", "--preset", "tiny"]) == 2
    said = f"{ledger.Ledger().path}: {os.strerror(code)} (the disk or the network filesystem under it failed; check it, then run it again)"
    assert capsys.readouterr().err.splitlines() == [f"coopstudy plan: error: {said}"]
    client = mlflow.MlflowClient()
    (run,) = client.search_runs([client.get_experiment_by_name("coopstudy").experiment_id])
    assert (run.info.status, run.data.tags[schema.TAG_ERROR]) == ("FAILED", said)
    traceback = mlflow_store.download_artifact(run.info.run_id, schema.ART_ERROR, tmp_path).read_text()
    assert traceback.startswith("Traceback") and "def failed" not in traceback and "in failed" in traceback


def test_a_deleted_experiment_is_one_line_and_exit_2():
    client = mlflow.MlflowClient()
    client.delete_experiment(client.create_experiment("retired"))
    done = run_cli("plan", "--preset", "tiny", "--set", "experiment=retired")
    assert done.returncode == 2, done.stderr[-3000:]
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith("coopstudy plan: error: experiment 'retired' is deleted in ") and "mlflow experiments restore" in line, line
    assert line.endswith("or name another with --set experiment=NAME"), line


@pytest.mark.parametrize("name", ["123", "null", "runs # 2", "étude 🙂"])
def test_an_experiment_named_in_the_environment_is_taken_as_written(name):
    """MLFLOW_EXPERIMENT_NAME is a name, not YAML: `123` is no number, `# 2` no
    comment; and not ASCII (an emoji ended in MLflow's traceback, exit 1)."""
    done = run_cli("plan", "--preset", "tiny", env={"MLFLOW_EXPERIMENT_NAME": name})
    assert done.returncode == 2 and "no inputs commitment" in done.stderr, done.stderr[-3000:]
    client = mlflow.MlflowClient()
    exp = client.get_experiment_by_name(name)
    assert exp is not None, [e.name for e in client.search_experiments()]
    (run,) = client.search_runs([exp.experiment_id])
    # Params are logged as overrides are written (YAML), so `123` the name is '123'.
    assert yaml.safe_load(run.data.params["experiment"]) == name and run.info.status == "FAILED"


def test_an_experiment_id_set_by_hand_names_the_studys_experiment():
    # As MLflow takes it; before, it was ignored and the runs went to `coopstudy`.
    client = mlflow.MlflowClient()
    exp = client.create_experiment("by-id")
    done = run_cli("plan", "--preset", "tiny", env={"MLFLOW_EXPERIMENT_ID": exp})
    assert done.returncode == 2 and "no inputs commitment" in done.stderr, done.stderr[-3000:]
    (run,) = client.search_runs([exp])
    assert run.data.params["experiment"] == "by-id" and run.data.tags[schema.TAG_STAGE] == "plan"


@pytest.fixture
def password_protected_server():
    """A tracking server that answers every request as a server behind basic
    auth does to a client without credentials: 401."""
    import http.server
    import threading

    class Refuse(http.server.BaseHTTPRequestHandler):
        def _refuse(self) -> None:
            body = json.dumps({"error_code": "UNAUTHENTICATED", "message": "You are not authenticated."}).encode()
            self.send_response(401)
            self.send_header("WWW-Authenticate", 'Basic realm="mlflow"')
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        do_GET = do_POST = do_PATCH = do_DELETE = _refuse

        def log_message(self, *args) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Refuse)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def test_a_password_protected_tracking_server_is_one_line_and_exit_2(password_protected_server, tmp_path):
    """Without credentials in the environment (an unreachable server, and
    credentials in the URI: tests/test_remote.py)."""
    env = {"MLFLOW_TRACKING_URI": password_protected_server, "COOPSTUDY_HOME": str(tmp_path / "home")}
    env |= {k: "" for k in ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD", "MLFLOW_TRACKING_TOKEN")}
    done = run_cli("prepare", "--preset", "tiny", env=env)
    assert done.returncode == 2, done.stderr[-3000:]
    (line,) = done.stderr.strip().splitlines()
    assert line == (
        f"coopstudy prepare: error: the tracking server {password_protected_server} wants credentials: set "
        "MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD (or MLFLOW_TRACKING_TOKEN) in the environment; nothing was run"
    )
    assert not (tmp_path / "home" / "prepared").exists()
