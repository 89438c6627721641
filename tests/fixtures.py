"""Every fixture and helper more than one test module uses; no test module
imports another.

The tiny study's expensive states are made once per session (once, not once
per xdist worker: made_once), as a user makes them, through the CLI: the tiny
seed, the prepared store, the verified store, the probed store, the planned
store, the trained store. A test gets its own
copy (`prepared_tiny`, `verified_tiny`, `probed_tiny`, or a module-wide one from
`module_store`), so it may change or break it freely.
Imported by conftest (`from fixtures import *`), which makes them every test's.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import mlflow
import pytest
import warm_cli
from filelock import FileLock

from coopstudy import config, workspace
from coopstudy.commit import plan, require, sources
from coopstudy.errors import UserError
from coopstudy.inputs.seed import Seed, resolve_seed
from coopstudy.record import schema, writer

ROOT = Path(__file__).resolve().parents[1]
PLAN = "ab" * 32
"""The plan sha the `planned` fixture stands in for."""


_REUSE = """
import resource, sys, torch
exec(sys.argv[1])
def faults_of_a_fresh_tensor(n):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    torch.empty(n).fill_(1.0)  # freed at once, as an update's logits are
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
faults_of_a_fresh_tensor(2**25)
print(faults_of_a_fresh_tensor(2**25 - 2**21))
"""


def faults_of_a_large_tensor_made_again(env: dict[str, str] | None = None, setup: str = "") -> int:
    """Page faults of a 120 MiB tensor made in a new process (after `setup`
    runs there) where a 128 MiB one was just freed: none where malloc kept
    the freed block, about 30,000 where glibc unmapped it. (Made again at the
    same size, the block would not fit: torch's 64-byte-aligned allocation
    asks glibc for more than it hands back.)"""
    done = subprocess.run([sys.executable, "-c", _REUSE, setup], env=env, capture_output=True, text=True, check=True)
    return int(done.stdout.split()[-1])


_WARM = warm_cli.Server()


def run_cli(
    *args: str, env: dict[str, str] | None = None, timeout: float = 600, cwd: Path = ROOT, inherit: bool = True
) -> subprocess.CompletedProcess:
    """`python -m coopstudy ARGS` as a user runs it, in the test's store (`env`
    over this process's; with `inherit=False`, `env` alone), from `cwd` (the
    project unless a test starts it elsewhere); forked from a warm interpreter
    where that is the same (tests/warm_cli.py)."""
    full = {**os.environ, **(env or {})} if inherit else dict(env or {})
    done = _WARM.run(list(args), full, cwd, timeout)
    if done is not None:
        return done
    return subprocess.run([sys.executable, "-m", "coopstudy", *args], cwd=cwd, env=full, capture_output=True, text=True, timeout=timeout)


def run_worker(*args: str, env: dict[str, str] | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    """A training process started by hand, as launch starts one: `python -m coopstudy.run.worker ARGS`."""
    full = {**os.environ, **(env or {})}
    return subprocess.run([sys.executable, "-m", sources.WORKER, *args], cwd=ROOT, env=full, capture_output=True, text=True, timeout=timeout)


@dataclass(frozen=True)
class Store:
    """A study folder and the MLflow SQLite store that records it."""

    home: Path
    """COOPSTUDY_HOME: seeds/, prepared/, ledger.jsonl, ..."""
    db: Path
    printed: subprocess.CompletedProcess | None = None
    """What the command that made this state printed."""

    @property
    def tracking_uri(self) -> str:
        return f"sqlite:///{self.db}"

    def env(self) -> dict[str, str]:
        return {"MLFLOW_TRACKING_URI": self.tracking_uri, "COOPSTUDY_HOME": str(self.home)}

    def copy(self, dst: Path) -> Store:
        """A copy under `dst` whose train runs name the checkpoints in its own
        home, as if trained there (a test may change them). The runs' artifacts
        stay where the first store's runs logged them: shared, to be read."""
        copied = Store(dst / "home", dst / "mlflow.db", self.printed)
        shutil.copytree(self.home, copied.home)
        shutil.copy(self.db, copied.db)
        with contextlib.closing(sqlite3.connect(copied.db)) as db:
            key = (schema.TAG_CHECKPOINT_PATH,)
            (paths,) = db.execute("select count(*) from tags where key = ?", key).fetchone()
            moved = db.execute(
                "update tags set value = replace(value, ?, ?) where key = ? and value like ?",
                (f"{self.home}/", f"{copied.home}/", *key, f"{self.home}/%"),
            ).rowcount
            assert moved == paths, f"{paths - moved} checkpoint paths of {self.db} lie outside {self.home}"
            db.commit()
        return copied

    def use(self, monkeypatch: pytest.MonkeyPatch) -> Store:
        """Point this process (and what it starts) at the store."""
        for key, value in self.env().items():
            monkeypatch.setenv(key, value)
        monkeypatch.delenv("MLFLOW_RUN_ID", raising=False)
        return self


@contextlib.contextmanager
def module_store(tmp_path_factory: pytest.TempPathFactory, source: Store, name: str) -> Iterator[Store]:
    """A copy of `source` that every test of a module shares, in use for the module's duration."""
    # An earlier module's in-process stage left MLflow's global URI on its own store.
    mlflow.set_tracking_uri(None)
    with pytest.MonkeyPatch.context() as mp:
        yield source.copy(tmp_path_factory.mktemp(name)).use(mp)


def made_once(tmp_path_factory: pytest.TempPathFactory, name: str, make: Callable[[Path], None]) -> Path:
    """The folder `name` that `make(folder)` fills once per test session,
    however many xdist workers ask for it: the first makes it under a lock,
    the others wait for it and take it (each would otherwise make its own, on
    the same two cores)."""
    shared = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        shared = shared.parent  # the session's, above each worker's own
    folder = shared / name
    with FileLock(f"{folder}.lock"):
        if not (folder / _MADE).is_file():
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir()
            make(folder)
            (folder / _MADE).touch()
    return folder


_MADE = ".made"
"""In a made_once folder: `make` finished."""
_PRINTED = "printed.json"
"""In a made_once folder of a Store: what the command that made it printed."""


def _made_store(tmp_path_factory: pytest.TempPathFactory, name: str, make: Callable[[Store], subprocess.CompletedProcess]) -> Store:
    """A Store made once per session by `make(store)`, which returns what its last command printed."""

    def fill(folder: Path) -> None:
        done = make(Store(folder / "home", folder / "mlflow.db"))
        printed = {"args": done.args, "returncode": done.returncode, "stdout": done.stdout, "stderr": done.stderr}
        (folder / _PRINTED).write_text(json.dumps(printed))

    folder = made_once(tmp_path_factory, name, fill)
    printed = subprocess.CompletedProcess(**json.loads((folder / _PRINTED).read_text()))
    return Store(folder / "home", folder / "mlflow.db", printed)


@pytest.fixture
def small_disk(tmp_path) -> Iterator[Path]:
    """A 4 MiB filesystem of its own (tmpfs, mounted as root), filled up by the test."""
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(disk)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a small filesystem here: {mounted.stderr.decode().strip()[:200]}")
    try:
        yield disk
    finally:
        # Lazily: this process may still hold the database open (MLflow keeps its engine).
        subprocess.run(["umount", "--lazy", str(disk)], check=True)


def store_locked(*args, **kwargs) -> None:
    """Raise what MLflow raises once SQLite's 20-s wait for another process's lock is over."""
    from mlflow.exceptions import MlflowException

    try:
        raise sqlite3.OperationalError("database is locked")
    except sqlite3.OperationalError as err:
        raise MlflowException("(sqlite3.OperationalError) database is locked") from err


def fill_disk(disk: Path, leave_pages: int = 0) -> None:
    """Fill `disk` up, then free `leave_pages` pages of it."""
    fd = os.open(disk / "filler", os.O_WRONLY | os.O_CREAT)
    try:
        while True:
            os.write(fd, bytes(4096))  # unbuffered: a buffered file would fail again as it closes
    except OSError as err:
        if err.errno != errno.ENOSPC:
            raise
    os.ftruncate(fd, os.fstat(fd).st_size - leave_pages * 4096)
    os.close(fd)


@pytest.fixture(scope="session")
def tiny_seed_home(tmp_path_factory) -> Path:
    """A workspace holding only the tiny preset's seed model."""

    def make(folder: Path) -> None:
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("COOPSTUDY_HOME", str(folder / "home"))
            resolve_seed(config.load("tiny"))

    return made_once(tmp_path_factory, "tiny-seed", make) / "home"


@pytest.fixture
def tiny_seed(tiny_seed_home) -> Seed:
    """The tiny seed, copied into this test's workspace."""
    shutil.copytree(tiny_seed_home / "seeds", Path(os.environ["COOPSTUDY_HOME"]) / "seeds", dirs_exist_ok=True)
    return resolve_seed(config.load("tiny"))


@pytest.fixture(scope="session")
def prepared_tiny_store(tiny_seed_home, tmp_path_factory) -> Store:
    """`python -m coopstudy prepare --preset tiny`, run once, as a user runs it."""

    def make(store: Store) -> subprocess.CompletedProcess:
        shutil.copytree(tiny_seed_home, store.home)
        done = run_cli("prepare", "--preset", "tiny", env=store.env())
        assert done.returncode == 0, done.stderr
        return done

    return _made_store(tmp_path_factory, "prepared-tiny", make)


@pytest.fixture
def prepared_tiny(prepared_tiny_store, tmp_path, monkeypatch) -> Store:
    """This test's own copy of the prepared tiny store, in use."""
    return prepared_tiny_store.copy(tmp_path).use(monkeypatch)


def _made_after(tmp_path_factory: pytest.TempPathFactory, name: str, base: Store, *commands: tuple[str, ...]) -> Store:
    """A copy of `base` after `python -m coopstudy COMMAND --preset tiny` of each command, made once per session."""

    def make(store: Store) -> subprocess.CompletedProcess:
        base.copy(store.home.parent)
        for command in commands:
            done = run_cli(command[0], "--preset", "tiny", *command[1:], env=store.env())
            assert done.returncode == 0, (command, done.stderr[-3000:])
        return done

    return _made_store(tmp_path_factory, name, make)


@pytest.fixture(scope="session")
def verified_tiny_store(prepared_tiny_store, tmp_path_factory) -> Store:
    """The prepared tiny store, verified: `python -m coopstudy verify --preset tiny`."""
    return _made_after(tmp_path_factory, "verified-tiny", prepared_tiny_store, ("verify",))


@pytest.fixture
def verified_tiny(verified_tiny_store, tmp_path, monkeypatch) -> Store:
    """This test's own copy of the verified tiny store, in use."""
    return verified_tiny_store.copy(tmp_path).use(monkeypatch)


@pytest.fixture(scope="session")
def probed_tiny_store(verified_tiny_store, tmp_path_factory) -> Store:
    """The verified tiny store, probed with the preset's grid."""
    return _made_after(tmp_path_factory, "probed-tiny", verified_tiny_store, ("probe",))


@pytest.fixture
def probed_tiny(probed_tiny_store, tmp_path, monkeypatch) -> Store:
    """This test's own copy of the probed tiny store, in use."""
    return probed_tiny_store.copy(tmp_path).use(monkeypatch)


LONG = 1000
"""Updates of a config whose runs are stopped midway: they never finish on their own in a test's time."""


@pytest.fixture(scope="session")
def planned_tiny_store(probed_tiny_store, tmp_path_factory) -> Store:
    """The probed tiny store, planned; and a LONG config prepared and planned."""
    long = ("--set", f"train.updates={LONG}")
    return _made_after(tmp_path_factory, "planned-tiny", probed_tiny_store, ("plan",), ("prepare", *long), ("plan", *long))


PROJECT_RUN_TAG = "test.project_run"
"""On the run trained_tiny_store made as `mlflow run` makes its own, before the stage took it over."""


@pytest.fixture(scope="session")
def trained_tiny_store(planned_tiny_store, tmp_path_factory) -> Store:
    """The planned tiny store with both arms trained, as `mlflow run . -e train
    -P arm=both` trains them: a project run is made first and handed over in
    MLFLOW_RUN_ID (it becomes the parent of both arms, `train-both-tiny`), and
    the stage is started by a shell whose environment holds the run, the store
    and the experiment (the stage reads the user's own environment off its
    parent, coopstudy.record.store). `printed` is what the stage printed."""

    def make(store: Store) -> subprocess.CompletedProcess:
        planned_tiny_store.copy(store.home.parent)
        client = mlflow.MlflowClient(store.tracking_uri)
        experiment = client.get_experiment_by_name("coopstudy").experiment_id
        project = client.create_run(experiment, tags={PROJECT_RUN_TAG: "1"}).info.run_id
        done = subprocess.run(
            ["/bin/sh", "-c", '"$0" -m coopstudy train --preset tiny --arm both; exit $?', sys.executable],
            cwd=ROOT, env={**os.environ, **store.env(), "MLFLOW_RUN_ID": project, "MLFLOW_EXPERIMENT_ID": experiment},
            capture_output=True, text=True, timeout=600,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr[-3000:]
        return done

    return _made_store(tmp_path_factory, "trained-tiny", make)


@pytest.fixture
def planned(monkeypatch) -> str:
    """A committed, unchanged plan (making a real one takes prepare, verify and
    probe), whose probes spent nothing (what evaluate's budget guard reads of it)."""
    monkeypatch.setattr(require, "committed_plan", lambda cfg: PLAN)
    monkeypatch.setattr(plan, "document", lambda cfg, sha: {"budget": {"probes_cost_usd": 0.0}})
    return PLAN


def fake_train_run(
    cfg: config.Config, arm: str, seed_dir: Path, *, plan_sha: str = PLAN, status: str = "FINISHED", corrupt: bool = False
) -> tuple[str, Path]:
    """A train run of `arm` under `plan_sha`, recorded as `train` records it,
    whose final checkpoint is a copy of `seed_dir`: (run id, checkpoint folder)."""
    folder = workspace.subdir("checkpoints") / f"{arm}-{len(list(workspace.subdir('checkpoints').iterdir()))}"
    shutil.copytree(seed_dir, folder)
    if corrupt:
        (folder / workspace.WEIGHTS_FILE).write_bytes(b"not a safetensors file")
    tags = {
        schema.TAG_CHECKPOINT_SHA: workspace.sha256_file(folder / workspace.WEIGHTS_FILE),
        schema.TAG_CHECKPOINT_PATH: str(folder),
        schema.TAG_PLAN: plan_sha,
    }
    try:
        with writer.stage_run(schema.STAGE_TRAIN, cfg, arm=arm, tags=tags, log_config=False) as rec:
            if status != "FINISHED":
                raise UserError("training failed")
    except UserError:
        pass
    return rec.run_id, folder


def checkout_copy(dst: Path) -> Path:
    """The checkout as a fresh clone would have it (tracked and untracked, not ignored, files), under `dst`."""
    files = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    for rel in files:
        if (ROOT / rel).is_file():
            (dst / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / rel, dst / rel)
    return dst


SERVER_START_S = 120.0
"""Start-up of an `mlflow server` on a loaded two-core machine takes 10-30 s."""


class Server:
    """`mlflow server` on 127.0.0.1, stopped and started again on the same port and stores."""

    def __init__(self, root: Path, backend: str | None = None):
        self.root = root
        self.backend = backend or f"sqlite:///{root / 'server.db'}"
        """The store the server serves (a study's own SQLite file, or a new one)."""
        self.port = workspace.free_port()
        self.proc: subprocess.Popen | None = None
        self.starts = 0

    @property
    def uri(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def artifacts(self) -> Path:
        return self.root / "artifacts"

    def start(self) -> None:
        self.starts += 1
        log = open(self.root / f"server-{self.starts}.log", "w")
        self.proc = subprocess.Popen(
            [
                str(Path(sys.executable).with_name("mlflow")), "server",
                "--backend-store-uri", self.backend,
                "--artifacts-destination", str(self.artifacts),
                "--host", "127.0.0.1", "--port", str(self.port), "--workers", "1",
            ],
            cwd=self.root,
            stdout=log,
            stderr=subprocess.STDOUT,
            # Its own process group: stop() ends the server and its workers, nothing else.
            start_new_session=True,
            # The job runner starts a dozen consumer processes the tests never use.
            env={**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"},
        )
        log.close()
        deadline = time.monotonic() + SERVER_START_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                break
            try:
                with urllib.request.urlopen(f"{self.uri}/health", timeout=2) as answer:
                    if answer.status == 200:
                        return
            except OSError:
                time.sleep(0.3)
        self.stop()
        pytest.fail(f"mlflow server did not come up: {(self.root / f'server-{self.starts}.log').read_text()[-3000:]}")

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, sig)
            self.proc.wait(timeout=20)
        except ProcessLookupError:
            pass
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self.proc = None

    def client(self) -> mlflow.MlflowClient:
        return mlflow.MlflowClient(tracking_uri=self.uri)


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[Server]:
    """A loopback `mlflow server` with proxied artifacts, shared by a module's tests."""
    srv = Server(tmp_path_factory.mktemp("mlflow-server"))
    try:
        srv.start()
        yield srv
    finally:
        srv.stop()
