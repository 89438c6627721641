"""Where the record lives and how it is read: the tracking URI, the
experiment, searches and downloads. Nothing here writes a run."""

from __future__ import annotations

import hashlib
import logging
import os
import subprocess
import tempfile
from pathlib import Path
from urllib.parse import urlsplit

from coopstudy import config as config_mod
from coopstudy import workspace
from coopstudy.errors import UserError

REMOTE_FILE = "mlruns_remote.txt"
"""In the project folder (workspace.project_root): names the study's tracking server."""
ENV_REMOTE_FILE = "COOPSTUDY_REMOTE_FILE"
"""Names a file to read instead of REMOTE_FILE (another checkout's, a test's)."""
DEFAULT_EXPERIMENT = "coopstudy"

# Every process of the study talks to an http(s) server with these unless the
# user set them: MLflow's own defaults (7 retries, exponential backoff, 120 s
# per request) would stall a training loop for minutes per call during an
# outage, where the outbox is the better place for the record to wait.
HTTP_DEFAULTS = {
    "MLFLOW_HTTP_REQUEST_TIMEOUT": "10",
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2",
    "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
}


def is_http(uri: str) -> bool:
    return urlsplit(uri).scheme in ("http", "https")


def use_http_defaults() -> None:
    """Short retries for this process and every process it starts (they inherit the environment;
    the DeepSpeed launcher forwards MLFLOW_* variables to other hosts)."""
    for name, value in HTTP_DEFAULTS.items():
        os.environ.setdefault(name, value)
    # urllib3 logs every retry of every call; an outage is said once, by the outbox.
    logging.getLogger("urllib3.connectionpool").setLevel(logging.ERROR)


def remote_file() -> Path:
    """The file that names the tracking server: COOPSTUDY_REMOTE_FILE, else the project's."""
    named = os.environ.get(ENV_REMOTE_FILE)
    if named and not Path(named).is_file():
        raise UserError(f"{ENV_REMOTE_FILE}={named}: no such file")
    return Path(named) if named else workspace.project_root() / REMOTE_FILE


def _uri_from_file(path: Path | None = None) -> str | None:
    path = path or remote_file()
    if not path.is_file():
        return None
    for line in path.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            return line
    return None


def tracking_uri() -> str:
    """MLFLOW_TRACKING_URI, else mlruns_remote.txt (or the file COOPSTUDY_REMOTE_FILE
    names), else MLflow's local default (an SQLite file, mlflow.db, in the project folder).
    For a server, this process and those it starts get short HTTP retries."""
    uri = os.environ.get("MLFLOW_TRACKING_URI") or _uri_from_file()
    if uri:
        parts = urlsplit(uri)
        if parts.username or parts.password:
            raise UserError(
                "tracking URI carries credentials; remove them and set MLFLOW_TRACKING_USERNAME "
                "and MLFLOW_TRACKING_PASSWORD (or MLFLOW_TRACKING_TOKEN) in the environment"
            )
        if parts.scheme in ("http", "https"):
            use_http_defaults()
        return uri
    # MLflow's own default is SQLite in the working directory; pinning it to the
    # project folder keeps one record whatever directory a step starts from.
    return f"sqlite:///{workspace.project_root() / 'mlflow.db'}"


def client():
    from mlflow import MlflowClient

    return MlflowClient(tracking_uri=tracking_uri())


def experiment_id(name: str = DEFAULT_EXPERIMENT) -> str:
    mlflow_client = client()
    exp = mlflow_client.get_experiment_by_name(name)
    if exp is not None:
        return exp.experiment_id
    try:
        return mlflow_client.create_experiment(name)
    except Exception:
        # Another process created it first.
        exp = mlflow_client.get_experiment_by_name(name)
        if exp is None:
            raise
        return exp.experiment_id


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


def download_artifact(run_id: str, artifact_path: str, dst: str | Path | None = None) -> Path:
    from mlflow.artifacts import download_artifacts

    dst = dst or tempfile.mkdtemp(prefix="coopstudy-")
    return Path(download_artifacts(run_id=run_id, artifact_path=artifact_path, dst_path=str(dst), tracking_uri=tracking_uri()))
