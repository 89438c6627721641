"""Where the record lives and how it is read: the tracking URI, the
experiment, searches and downloads. Nothing here writes a run.

The study's store is resolved once per process, in this order: the user's
MLFLOW_TRACKING_URI; else the first URI line of the project's
mlruns_remote.txt; else MLflow's local default, `mlflow.db` in the project
folder. `mlflow run` hands the command it starts an MLFLOW_TRACKING_URI of
its own even when the user set none (its default, the same local SQLite
file); that value is not taken for the user's choice. The resolved URI is put
back into the environment, so every process a step starts (ranks, probes)
records in the same store; a SQLite file named relative to the folder a step
started in (or to mlruns_remote.txt's folder) goes back named from the root,
as the ranks start in the project folder.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import os
import re
import subprocess
import tempfile
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from coopstudy import config as config_mod
from coopstudy import errors, workspace
from coopstudy.errors import UserError

REMOTE_FILE = "mlruns_remote.txt"
"""In the project folder (workspace.project_root): names the study's tracking server."""
ENV_REMOTE_FILE = "COOPSTUDY_REMOTE_FILE"
"""Names a file to read instead of REMOTE_FILE (another checkout's, a test's)."""
DEFAULT_EXPERIMENT = "coopstudy"
EXPERIMENT_KIND_TAG = "mlflow.experimentKind"
EXPERIMENT_KIND = "custom_model_development"
"""MLflow 3's UI opens an experiment without this tag as a GenAI one (a traces overview)."""


@dataclass(frozen=True)
class Launcher:
    """What `mlflow run` handed the entry point it started: its run, the store
    (a relative SQLite file named from the root, as the study's store is) and
    the experiment it created that run in. Read once, at import, because
    starting a run removes MLFLOW_RUN_ID from the environment."""

    run_id: str
    tracking_uri: str
    experiment_id: str


def _anchored(uri: str, base: Path | None = None) -> str:
    """`uri`, its SQLite file named from the root where it was named from
    `base` (the working folder by default): the processes a step starts (ranks,
    probes) run in the project folder, and a relative name would open another
    file there."""
    named = re.fullmatch(r"(sqlite(?:\+\w+)?:///)([^?]*)(.*)", uri, re.DOTALL)
    if not named or named[2] in ("", ":memory:") or named[2].startswith("/"):
        return uri
    return f"{named[1]}{((base or Path.cwd()) / named[2]).resolve()}{named[3]}"


def _launcher() -> Launcher | None:
    run_id = os.environ.get("MLFLOW_RUN_ID")
    if not run_id:
        return None
    return Launcher(run_id, _anchored(os.environ.get("MLFLOW_TRACKING_URI", "")), os.environ.get("MLFLOW_EXPERIMENT_ID", "0"))


LAUNCHER = _launcher()

# Every process of the study talks to an http(s) server with these unless the
# user set them: MLflow's own defaults (7 retries, exponential backoff, 120 s
# per request) would stall a training loop for minutes per call during an
# outage, where the outbox is the better place for the record to wait.
_HTTP = {
    "MLFLOW_HTTP_REQUEST_TIMEOUT": ("10", 1, None),
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": ("2", 0, "_MLFLOW_HTTP_REQUEST_MAX_RETRIES_LIMIT"),
    "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": ("1", 0, "_MLFLOW_HTTP_REQUEST_MAX_BACKOFF_FACTOR_LIMIT"),
}
"""Each variable's default here, the least whole number MLflow takes for it, and the
mlflow.environment_variables limit of the most (it reads them as int, and refuses
others in a traceback at the first request)."""
HTTP_DEFAULTS = {name: default for name, (default, _, _) in _HTTP.items()}


def is_http(uri: str) -> bool:
    return urlsplit(uri).scheme in ("http", "https")


def use_http_defaults() -> None:
    """Short retries for this process and every process it starts (they inherit the environment;
    the DeepSpeed launcher forwards MLFLOW_* variables to other hosts); a value the user set
    that MLflow would refuse is refused here, in one line."""
    from mlflow import environment_variables

    for name, (value, least, limit) in _HTTP.items():
        given = os.environ.setdefault(name, value)
        most = getattr(environment_variables, limit).get() if limit else None
        try:
            number = int(given)
        except ValueError:
            number = None
        if number is None or number < least or (most is not None and number > most):
            takes = f"from {least} to {most}" if most is not None else f"at least {least}"
            raise UserError(f"{name}={given!r}: MLflow takes a whole number {takes}; unset it for the study's {value}")
    # urllib3 logs every retry of every call; an outage is said once, by the outbox.
    logging.getLogger("urllib3.connectionpool").setLevel(logging.ERROR)


@contextlib.contextmanager
def environment(values: Mapping[str, str]) -> Iterator[None]:
    """These environment variables while inside; as they were after."""
    saved = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, old in saved.items():
            if old is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = old


def remote_file() -> Path:
    """The file that names the tracking server: COOPSTUDY_REMOTE_FILE, else the project's."""
    named = os.environ.get(ENV_REMOTE_FILE)
    if named and Path(named).is_dir():
        raise UserError(f"{ENV_REMOTE_FILE}={named}: a folder, not a file")
    if named and not Path(named).is_file():
        what = workspace.NOT_A_REGULAR_FILE if Path(named).exists() else "no such file"
        raise UserError(f"{ENV_REMOTE_FILE}={named}: {what}")
    return Path(named) if named else workspace.project_root() / REMOTE_FILE


def _uri_from_file(path: Path | None = None) -> str | None:
    path = path or remote_file()
    if not path.is_file():
        return None
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as err:
        why = "not UTF-8 text" if isinstance(err, UnicodeDecodeError) else err.strerror
        raise UserError(f"tracking URI file {path}: cannot read it ({why})") from None
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            return line
    return None


def local_default() -> str:
    """MLflow's local default store, pinned to the project folder: one record
    whatever directory a step starts from."""
    return f"sqlite:///{workspace.project_root() / 'mlflow.db'}"


def _mlflow_defaults() -> set[str]:
    """The URIs `mlflow run` hands its command when the user set none."""
    out = set()
    for folder in {Path.cwd().resolve(), workspace.project_root()}:
        out |= {f"sqlite:///{folder / 'mlflow.db'}", f"file://{folder / 'mlruns'}"}
    return out


def _launcher_environment() -> dict[str, str] | None:
    """The environment the `mlflow run` process itself started with (the user's),
    where the system shows it: MLproject commands are one simple command, so
    bash execs it and the parent of this process is `mlflow run`."""
    try:
        argv = Path(f"/proc/{os.getppid()}/cmdline").read_bytes().decode(errors="replace").split("\0")
        raw = Path(f"/proc/{os.getppid()}/environ").read_bytes()
    except OSError:
        return None
    # Only `mlflow run` itself: another parent may have changed its environment since it started.
    if not (any(Path(a).name == "mlflow" for a in argv[:2]) and "run" in argv):
        return None
    return dict(item.split("=", 1) for item in raw.decode(errors="replace").split("\0") if "=" in item)


def _users_uri() -> str | None:
    uri = os.environ.get("MLFLOW_TRACKING_URI") or None
    if uri is None or LAUNCHER is None or _anchored(uri) != LAUNCHER.tracking_uri:
        return uri
    users = _launcher_environment()
    if users is not None and "MLFLOW_RUN_ID" not in users:
        return users.get("MLFLOW_TRACKING_URI") or None
    # Elsewhere: mlflow run's own default is a local file of the folder it ran in.
    return None if uri in _mlflow_defaults() else uri


_ORIGIN: dict[str, str] = {}


def origin(uri: str) -> str:
    """Where the study's tracking URI `uri` came from, in words."""
    return _ORIGIN.get(uri, "MLFLOW_TRACKING_URI")


def tracking_uri() -> str:
    """The study's store (see the module's docstring for the order). For a
    server, this process and those it starts get short HTTP retries."""
    users, named = _users_uri(), None
    if users is None:
        named = _uri_from_file()
    uri = _anchored(users or named or local_default(), None if users else remote_file().parent)
    # Said once, at the first resolution: the write-back below makes every later one the environment's.
    _ORIGIN.setdefault(uri, "MLFLOW_TRACKING_URI" if users else str(remote_file()) if named else "the local default")
    os.environ["MLFLOW_TRACKING_URI"] = uri
    if uri:
        try:
            parts = urlsplit(uri)
        except ValueError as err:
            raise UserError(f"tracking URI {uri!r} (from {origin(uri)}) is not a URI: {err}") from None
        if parts.username or parts.password:
            raise UserError(
                "tracking URI carries credentials; remove them and set MLFLOW_TRACKING_USERNAME "
                "and MLFLOW_TRACKING_PASSWORD (or MLFLOW_TRACKING_TOKEN) in the environment"
            )
        if parts.scheme in ("http", "https"):
            # Said here, not as the server refusing ("Invalid url") or as an unknown host.
            try:
                parts.port
            except ValueError as err:
                raise UserError(f"tracking URI {uri!r} (from {origin(uri)}) is not a URL: {err}") from None
            if not parts.hostname:
                raise UserError(f"tracking URI {uri!r} (from {origin(uri)}) is not a URL: it names no host")
            use_http_defaults()
        elif parts.scheme == "sqlite":
            _quiet_sqlite()
    return uri


def _sqlite_says(err: BaseException, words: str) -> bool:
    """True when sqlite3's error, anywhere down `err`'s chain, says `words`
    (MLflow raises it wrapped twice: sqlite3's error in SQLAlchemy's, that in its own)."""
    import sqlite3

    return any(isinstance(seen, sqlite3.OperationalError) and words in str(seen) for seen in errors.chain(err))


def on_full_disk(err: BaseException) -> bool:
    """True when `err` comes from a SQLite store whose disk is full."""
    return _sqlite_says(err, "disk is full")


def on_locked(err: BaseException) -> bool:
    """True when `err` comes from a SQLite store that another process kept
    locked past SQLite's wait (a long write: another step's, a shell's open
    transaction, `mlflow gc`)."""
    return _sqlite_says(err, "database is locked")


def locked_said() -> str:
    """A tracking store kept locked (on_locked), in the words every process that meets it says."""
    return f"the tracking store {tracking_uri()} is locked by another process (database is locked)"


def full_disk_said(uri: str | None = None) -> str:
    """A tracking store (this process's, or `uri`) whose disk is full, in the
    words every process that meets it says (cli.main, a training rank, remote deliver)."""
    return f"the disk of the tracking store {uri or tracking_uri()} is full (database or disk is full)"


class _QuietStore(logging.Filter):
    """What MLflow logs of a SQLite store that a step says itself, or need not:
    the tables it makes in a new store (two INFO lines before a refusal's one),
    and a SQLite error's whole traceback before it raises it (a full disk is
    said in one line, cli.main and on_full_disk)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno <= logging.INFO:
            return False
        return not (record.exc_info and record.exc_info[1] is not None and on_full_disk(record.exc_info[1]))


_QUIET_STORE = _QuietStore()


def _quiet_sqlite() -> None:
    """MLflow's SQLite store says no more than _QuietStore lets through (adding it twice is adding it once)."""
    logging.getLogger("mlflow.store.db.utils").addFilter(_QUIET_STORE)


SQLITE_HEADER = b"SQLite format 3\0"
"""The first bytes of every SQLite database file."""


def _sqlite_database(uri: str) -> str | None:
    """The database of a sqlite: URI, "" for one of no file (`sqlite://`,
    `sqlite:///`, `sqlite:///:memory:`); None for any other store."""
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError

    if not uri.startswith("sqlite:"):
        return None
    try:
        url = make_url(uri)
    except (ArgumentError, ValueError):
        return None  # client() says what is wrong with it
    if url.get_backend_name() != "sqlite":
        return None
    return "" if url.database in (None, ":memory:") else url.database


def _sqlite_file(uri: str) -> Path | None:
    """The database file of a sqlite: URI; None for any other store, or none."""
    database = _sqlite_database(uri)
    return Path(database) if database else None


ARTIFACTS_BESIDE_DATABASE = "mlruns"
"""The folder, beside a SQLite store's file, that holds the artifacts of the
experiments coopstudy creates in it (one subfolder per experiment id)."""


def _check_sqlite(uri: str, where: str) -> None:
    """Refuse a sqlite: URI whose path is a folder, a file that is no
    database, or a file that cannot be made: MLflow would retry the first and
    the last with backoff for minutes and let SQLAlchemy's traceback out of
    the second."""
    database = _sqlite_database(uri)
    said = f"tracking URI {uri!r} (from {where})"
    if database is None:
        return
    if not database:
        raise UserError(f"{said}: an in-memory database, whose records would vanish when the step ends; name a file: sqlite:///PATH")
    path = Path(database)
    if path.is_dir():
        raise UserError(f"{said}: {path} is a folder, not a database file")
    if not path.exists():
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.touch()  # MLflow makes its tables in the empty file
        except FileExistsError:  # from mkdir: a file where a folder must be
            raise UserError(f"{said}: cannot make {path} (a file is in its folder's path)") from None
        except OSError as err:
            raise UserError(f"{said}: cannot make {path} ({err.strerror})") from None
        return
    try:
        with path.open("rb") as f:
            head = f.read(len(SQLITE_HEADER))
    except OSError as err:
        raise UserError(f"{said}: cannot read {path} ({err.strerror})") from None
    if head and head != SQLITE_HEADER:
        raise UserError(f"{said}: {path} is not an SQLite database")


def client(uri: str | None = None, where: str | None = None):
    """A client of the study's store, or of `uri` (named by `where`, in
    words), refusing in one line a URI it cannot open."""
    from mlflow import MlflowClient
    from mlflow.exceptions import MlflowException

    uri = uri or tracking_uri()
    where = where or origin(uri)
    _check_sqlite(uri, where)
    if uri.startswith("sqlite"):  # `remote deliver`'s own URI, too
        _quiet_sqlite()
    try:
        return MlflowClient(tracking_uri=uri)
    except MlflowException as err:
        # An unknown scheme is a typo in the user's URI; MLflow's message lists
        # the schemes it knows, which is the useful part of it.
        known = re.search(r"Supported URI schemes are: \[[^]]*\]", err.message)
        why = known.group(0) if known else " ".join(err.message.split())
        if "filesystem tracking backend" in err.message:
            # A path or a word with no scheme (a typo, often): MLflow's migration notice does not say so.
            why = (
                "It names a folder (no scheme, or file:), which MLflow opens only with MLFLOW_ALLOW_FILE_STORE=true; "
                "a local store is sqlite:///PATH, a server http(s)://HOST:PORT"
            )
        raise UserError(f"tracking URI {uri!r} (from {where}) cannot be opened. {why}") from None
    except ModuleNotFoundError as err:
        # A database store (postgresql://, mysql://, ...) whose driver is not installed.
        raise UserError(
            f"tracking URI {uri!r} (from {where}) needs the Python module {err.name!r}, which is not installed; "
            "install its driver, or use sqlite:///FILE or a server's http(s):// URI"
        ) from None


def experiment_id(name: str = DEFAULT_EXPERIMENT) -> str:
    """The experiment's id in the study's store, created (and tagged as a
    training experiment for MLflow's UI) when it does not exist yet."""
    mlflow_client = client()
    exp = mlflow_client.get_experiment_by_name(name)
    if exp is None:
        why = ""
        try:
            _create_experiment(mlflow_client, name)
        except Exception as err:  # noqa: BLE001 - another process created it first? looked up again below
            if on_full_disk(err):
                raise  # said as a full disk (cli.main)
            why = f": {' '.join(str(err).split())[:300]}"
        exp = mlflow_client.get_experiment_by_name(name)
        if exp is None:
            raise UserError(f"experiment {name!r} could not be created in {tracking_uri()}{why}")
    if exp.lifecycle_stage == "deleted":
        raise UserError(
            f"experiment {name!r} is deleted in {tracking_uri()}; restore it "
            f"(`mlflow experiments restore --experiment-id {exp.experiment_id}`) or name another with --set experiment=NAME"
        )
    if exp.tags.get(EXPERIMENT_KIND_TAG) != EXPERIMENT_KIND:
        mlflow_client.set_experiment_tag(exp.experiment_id, EXPERIMENT_KIND_TAG, EXPERIMENT_KIND)
    return exp.experiment_id


def _create_experiment(mlflow_client, name: str) -> None:
    tags = {EXPERIMENT_KIND_TAG: EXPERIMENT_KIND}
    database = _sqlite_file(tracking_uri())
    if database is None:  # a server, or another database: its own artifact root decides
        mlflow_client.create_experiment(name, tags=tags)
        return
    # MLflow's default for a local database is ./mlruns of whatever folder the
    # command started in: one store's checkpoints would scatter over working
    # folders, and stores started in one folder would share one. A store made
    # with an artifact root keeps MLflow's own layout (<root>/<experiment id>).
    from mlflow.entities import ExperimentTag
    from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore

    root = database.resolve().parent / ARTIFACTS_BESIDE_DATABASE
    SqlAlchemyStore(tracking_uri(), str(root)).create_experiment(name, tags=[ExperimentTag(k, v) for k, v in tags.items()])


_NOT_THERE = ("RESOURCE_DOES_NOT_EXIST", "INVALID_PARAMETER_VALUE")
"""MLflow's error codes of an answer that a run or experiment is not there (an
outage or a refusal answers otherwise, and is the preflight's to say)."""


@functools.cache
def check_launcher() -> None:
    """Refuse an MLFLOW_RUN_ID or MLFLOW_EXPERIMENT_ID that names nothing in
    its store: a leftover in the user's shell, not `mlflow run` starting this
    step (MLflow would raise its own traceback, and leave a run behind)."""
    if LAUNCHER is None:
        return
    from mlflow.exceptions import MlflowException

    uri = LAUNCHER.tracking_uri or tracking_uri()
    if is_http(uri):
        use_http_defaults()
    mlflow_client = client(uri, "MLFLOW_TRACKING_URI")
    hint = "`mlflow run` sets it for the command it starts; unset it to run a step by hand"
    named = (
        ("MLFLOW_RUN_ID", LAUNCHER.run_id, "run", mlflow_client.get_run),
        ("MLFLOW_EXPERIMENT_ID", LAUNCHER.experiment_id, "experiment", mlflow_client.get_experiment),
    )
    for variable, value, what, get in named:
        try:
            get(value)
        except MlflowException as err:
            # Only an answer that it is not there: an outage is the preflight's to say.
            if err.error_code in _NOT_THERE:
                raise UserError(f"{variable}={value}: no such {what} in {uri}; {hint}") from None


def chosen_experiment() -> str | None:
    """An experiment the user named outside the config: MLFLOW_EXPERIMENT_NAME,
    MLFLOW_EXPERIMENT_ID set by hand (as MLflow takes them, the name first), or
    `mlflow run --experiment-name/--experiment-id` (the experiment `mlflow run`
    created its run in, when that is not MLflow's Default). None otherwise."""
    named = os.environ.get("MLFLOW_EXPERIMENT_NAME")
    if named:
        try:
            return config_mod.check_experiment(named)
        except ValueError as err:
            raise UserError(f"MLFLOW_EXPERIMENT_NAME={named!r}: {err}") from None
    check_launcher()
    if LAUNCHER is None:
        return _experiment_by_id(os.environ.get("MLFLOW_EXPERIMENT_ID", ""))
    if LAUNCHER.experiment_id in ("", "0"):
        return None
    from mlflow import MlflowClient

    exp = MlflowClient(tracking_uri=LAUNCHER.tracking_uri).get_experiment(LAUNCHER.experiment_id)
    return exp.name


def _experiment_by_id(value: str) -> str | None:
    """The experiment an MLFLOW_EXPERIMENT_ID set by hand names (before, it was
    ignored, one that names nothing too), or None where it is not set."""
    if not value:
        return None
    from mlflow.exceptions import MlflowException

    uri = tracking_uri()
    try:
        exp = client(uri, "MLFLOW_TRACKING_URI").get_experiment(value)
    except MlflowException as err:
        if err.error_code in _NOT_THERE:
            raise UserError(
                f"MLFLOW_EXPERIMENT_ID={value}: no such experiment in {uri}; unset it, or name the study's experiment "
                "(MLFLOW_EXPERIMENT_NAME, or a step's --set experiment=NAME)"
            ) from None
        # A server that does not answer, or wants credentials: the step's preflight says so in one line.
        return None
    try:
        return config_mod.check_experiment(exp.name)
    except ValueError as err:
        raise UserError(f"MLFLOW_EXPERIMENT_ID={value} (experiment {exp.name!r}): {err}") from None


def git_commit() -> str | None:
    try:
        out = subprocess.run(
            ["git", "-C", str(workspace.project_root()), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def config_sha256(cfg: config_mod.Config) -> str:
    return hashlib.sha256(config_mod.to_yaml(cfg).encode()).hexdigest()


def search_runs(experiment: str, filter_string: str, order_by: tuple[str, ...] = ("attributes.start_time DESC",)) -> list:
    """Runs of the experiment matching an MLflow filter, newest first (read only)."""
    mlflow_client = client()
    exp = mlflow_client.get_experiment_by_name(experiment)
    if exp is None:
        return []
    return list(mlflow_client.search_runs([exp.experiment_id], filter_string, order_by=list(order_by), max_results=1000))


PROGRESS_BAR_VARIABLE = "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR"


def download_artifact(run_id: str, artifact_path: str, dst: str | Path | None = None) -> Path:
    """A run's artifact, downloaded. MLflow's download bar stays off: these are
    the study's own reads, and a bar would cut into a step's lines."""
    from mlflow.artifacts import download_artifacts

    dst = dst or tempfile.mkdtemp(prefix="coopstudy-")
    with environment({PROGRESS_BAR_VARIABLE: "false"}):
        return Path(download_artifacts(run_id=run_id, artifact_path=artifact_path, dst_path=str(dst), tracking_uri=tracking_uri()))


def has_artifact(run_id: str, artifact_path: str) -> bool:
    """Whether the run holds the file `artifact_path` among its artifacts."""
    folder = artifact_path.rpartition("/")[0] or None
    return any(f.path == artifact_path for f in client().list_artifacts(run_id, folder))


def artifact_json(run_id: str, artifact_path: str) -> Any:
    """A run's JSON artifact, parsed."""
    with tempfile.TemporaryDirectory(prefix="coopstudy-") as tmp:
        return json.loads(download_artifact(run_id, artifact_path, tmp).read_text())
