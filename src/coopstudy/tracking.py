"""The one MLflow writer, and the names that make up the study's record.

Every tag, param, metric and artifact name the project writes is a constant
here; analysis imports them instead of spelling them again. Stages open a run
with `stage_run(...)` and write through the `Recorder` it yields; a process
that joins an existing run (a rank of the compressed arm) uses
`Recorder(run_id)` directly.
"""

from __future__ import annotations

import contextlib
import contextvars
import hashlib
import json
import os
import subprocess
import tempfile
import time
import traceback
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from coopstudy import config as config_mod
from coopstudy.errors import UserError

PROJECT_ROOT = Path(__file__).resolve().parents[2]
REMOTE_FILE = PROJECT_ROOT / "mlruns_remote.txt"
ENV_REMOTE_FILE = "COOPSTUDY_REMOTE_FILE"
"""Names a file to read instead of REMOTE_FILE (another checkout's, a test's)."""
DEFAULT_EXPERIMENT = "coopstudy"
# The run id that `mlflow run` hands its entry point. mlflow.start_run()
# removes it from the environment, so it is read once, at import.
_PROJECT_RUN_ID = os.environ.get("MLFLOW_RUN_ID")
# A run id a parent process hands to the processes it starts (ranks, probes).
ENV_RUN_ID = "COOPSTUDY_RUN_ID"

# --- tags: every run -------------------------------------------------------
TAG_STAGE = "coopstudy.stage"
TAG_PRESET = "coopstudy.preset"
TAG_ARM = "coopstudy.arm"
TAG_GIT_COMMIT = "coopstudy.git_commit"
TAG_CONFIG_SHA = "coopstudy.config_sha256"
TAG_PLAN = "coopstudy.plan_sha256"
TAG_ERROR = "coopstudy.error"
TAG_ERROR_KIND = "coopstudy.error_kind"
TAG_COMMITMENT_PREFIX = "coopstudy.commitment."
"""+ ledger kind: the digest that the run committed to the ledger."""
TAG_REQUIRES_PREFIX = "coopstudy.requires."
"""+ ledger kind: the digest of a commitment the run checked before starting."""
TAG_PREFLIGHT = "coopstudy.preflight"
"""On the experiment: `<host> <UTC time>` of the last preflight that wrote to it (coopstudy.remote)."""

# --- stages ----------------------------------------------------------------
STAGE_PREPARE = "prepare"
STAGE_VERIFY = "verify"
STAGE_PROBE = "probe"
STAGE_PLAN = "plan"
STAGE_TRAIN = "train"
STAGE_SELECT = "select"
STAGE_EVALUATE = "evaluate"
STAGE_REPORT = "report"
STAGE_STUDY = "study"
STAGE_BENCH = "bench"

# --- study: step reuse -------------------------------------------------------
TAG_STEP_KEY = "coopstudy.step_key"
"""sha256 of a step's config, sources and upstream steps; equal key: reusable run."""
M_STUDY_SECONDS = "study/seconds"
ART_STEP_KEYS = "step_keys.json"

# --- artifacts: every run --------------------------------------------------
ART_CONFIG = "config.yaml"
ART_ERROR = "error.txt"

# --- prepare ---------------------------------------------------------------
TAG_INPUTS = "coopstudy.inputs_sha256"
"""On the prepare run: the sha256 of the manifest that names every prepared file."""
TAG_SEED_SHA = "coopstudy.seed_weights_sha256"
PARAM_SEED_PARAMETERS = "seed.parameters"
ART_MANIFEST = "manifest.json"
M_PREPARE_SECONDS = "prepare/seconds"
M_PREPARE_TRUNCATED = "prepare/truncated_documents"
M_PREPARE_TRUNCATED_TOKENS = "prepare/truncated_tokens"
M_SEED_PARAMETERS = "seed/parameters"
TAG_INPUTS_KEY = "coopstudy.inputs_key"
"""On the prepare run: the ledger subject of its inputs commitment (data.inputs_key)."""
M_PREPARE_SEED_SECONDS = "prepare/seed_seconds"
M_PREPARE_BUILD_SECONDS = "prepare/build_seconds"
M_PREPARE_TEST_DROPPED = "prepare/test_dropped"
M_PREPARE_TRAIN_TOKENS = "prepare/train_tokens"

# --- verify (the equivalence gate) ------------------------------------------
ART_GATE_RECEIPT = "gate_receipt.json"
TAG_GATE = "coopstudy.gate_sha256"
M_GATE_MAX_REL_ERROR = "gate/max_rel_error"

# --- probe (a parent run per sweep, a child run per candidate) ----------------
TAG_PROBE_SETTING = "coopstudy.probe.setting"
"""On a candidate run: <arm>-mb<microbatch>-<allocator>, also its receipt's file name."""
TAG_PROBE_OUTCOME = "coopstudy.probe.outcome"
"""completed, out_of_memory or error."""
TAG_PROBE_RECEIPT = "coopstudy.probe.receipt_sha256"
ART_PROBE_RECEIPT = "probe_receipt.json"
ART_PROBE_RANK_PREFIX = "probe_ranks/rank"
"""+ rank + .json: what one training process of a candidate measured, written by that process."""
ART_PROBE_RECEIPTS = "probe_receipts.json"
"""On the parent: every candidate's receipt, in sweep order."""
ART_PROBE_CHOICE = "probe_choice.json"
"""On the parent: per arm and allocator, the largest microbatch that completed and its median."""
M_PROBE_MEDIAN_SECONDS = "probe/median_update_seconds"
M_PROBE_COMPLETED = "probe/completed"
M_PROBE_FAILED = "probe/failed"
M_CUDA_ALLOC_RETRIES = "memory/cuda_alloc_retries"
M_CUDA_RESERVED_UNALLOCATED_MB = "memory/cuda_reserved_unallocated_mb"
"""Reserved by the caching allocator but not allocated, when the candidate failed."""

# --- plan ---------------------------------------------------------------------
ART_PLAN = "plan.json"
M_PLAN_SECONDS_PREFIX = "plan/projected_seconds/"
"""+ arm: the plan's projection of that arm's complete seconds."""
M_PLAN_COST_PREFIX = "plan/projected_cost_usd/"
"""+ arm."""
M_PROJECTED_SECONDS = "time/projected_seconds"
"""On a train arm run: the plan's projection for this arm."""
M_PROJECTED_COST_USD = "cost/projected_usd"
M_SPENT_BEFORE_USD = "cost/spent_before_usd"
"""On a train arm run: what the plan had spent (probes and earlier train runs) when it started."""

# --- bench objective (python -m coopstudy.bench objective) -------------------
M_BENCH_BATCHED_MS = "bench/batched_ms_per_update"
M_BENCH_REFERENCE_MS = "bench/reference_ms_per_update"
M_BENCH_SPEEDUP = "bench/speedup"
"""Per-document ms / batched ms."""
M_BENCH_LOSS_REL_GAP = "bench/loss_max_rel_gap"
M_BENCH_PADDING_PREFIX = "bench/padding_efficiency/"
"""+ sorted|unsorted + / + arm: real tokens / computed tokens over the whole schedule."""
TAG_BENCH_DOCUMENTS = "coopstudy.bench_documents"
ART_BENCH_TABLE = "bench_objective.json"

# --- train: per update (step = update number, from 1) -----------------------
M_LOSS = "train/loss"
M_GRAD_NORM = "train/grad_norm"
M_LR = "train/lr"
M_UPDATE_SECONDS = "train/update_seconds"
M_TOKENS = "train/tokens"
M_BYTES = "train/bytes"
# --- train: per run ---------------------------------------------------------
M_ACTIVE_SECONDS = "time/active_seconds"
M_COMPLETE_SECONDS = "time/complete_seconds"
M_CHECKPOINT_SECONDS = "time/checkpoint_seconds"
M_DEVICE_SECONDS = "time/device_seconds"
M_BYTES_DENSE = "bytes/dense_total"
M_BYTES_COMPRESSED = "bytes/compressed_total"
M_BYTES_TOTAL = "bytes/total"
M_PEAK_RSS_MB = "memory/peak_rss_mb"
M_CUDA_MAX_ALLOCATED_MB = "memory/cuda_max_allocated_mb"
M_CUDA_MAX_RESERVED_MB = "memory/cuda_max_reserved_mb"
M_COST_USD = "cost/spent_usd"
TAG_CHECKPOINT_SHA = "coopstudy.checkpoint_sha256"
TAG_CHECKPOINT_PATH = "coopstudy.checkpoint_path"
"""The final checkpoint's directory on local disk (HF format); select re-hashes it."""
ART_CHECKPOINT = "checkpoint"
ART_TRAIN_SUMMARY = "train_summary.json"
TAG_WORKER_ERROR_PREFIX = "coopstudy.worker_error.rank"
"""+ rank: the error a training process hit (the run's own error tag says what the stage saw)."""
ART_WORKER_ERROR_PREFIX = "worker_errors/rank"
"""+ rank + .txt: that process's traceback."""

# --- select / evaluate ------------------------------------------------------
TAG_CANDIDATE_PREFIX = "coopstudy.candidate."
"""+ arm: the sha256 of that arm's selected final weights."""
TAG_MODEL = "coopstudy.model"
"""On an evaluation run: seed, control or compressed."""
M_ACCURACY = "eval/accuracy"
M_ACCURACY_PREFIX = "eval/accuracy/"
"""+ family."""
M_RETENTION_NLL = "eval/retention_nll"
ART_TEST_TABLE = "test_cases.json"
ART_RETENTION_TABLE = "retention.json"
TAG_CANDIDATE_RUN_PREFIX = "coopstudy.candidate_run."
"""+ arm: the train run whose final checkpoint is that arm's candidate."""
TAG_SELECT_RUN = "coopstudy.select_run_id"
"""On an evaluate run: the select run that committed the candidates it scored."""
M_TEST_CASES = "eval/test_cases"
M_GENERATE_SECONDS = "eval/generate_seconds"
M_GENERATE_ITEMS_PER_SECOND = "eval/generate_items_per_second"
M_EVAL_THREADS = "eval/threads"

# --- report -----------------------------------------------------------------
ART_REPORT_JSON = "report.json"
ART_REPORT_MD = "report.md"
ART_REPORT_HTML = "report.html"
TAG_VERDICT_PREFIX = "coopstudy.verdict."
"""+ quality, speed or a screen's name: pass or fail."""
M_SCREEN_PREFIX = "screen/"
"""+ screen name + /estimate, /bound (the limit the verdict used, if any) or /passed (1 or 0)."""


def remote_file() -> Path:
    """The file that names the tracking server: COOPSTUDY_REMOTE_FILE, else the project's."""
    named = os.environ.get(ENV_REMOTE_FILE)
    if named and not Path(named).is_file():
        raise UserError(f"{ENV_REMOTE_FILE}={named}: no such file")
    return Path(named) if named else REMOTE_FILE


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
            from coopstudy import remote

            remote.use_http_defaults()
        return uri
    # MLflow's own default is SQLite in the working directory; pinning it to the
    # project folder keeps one record whatever directory a step starts from.
    return f"sqlite:///{PROJECT_ROOT / 'mlflow.db'}"


def _client():
    from mlflow import MlflowClient

    return MlflowClient(tracking_uri=tracking_uri())


def experiment_id(name: str = DEFAULT_EXPERIMENT) -> str:
    client = _client()
    exp = client.get_experiment_by_name(name)
    if exp is not None:
        return exp.experiment_id
    try:
        return client.create_experiment(name)
    except Exception:
        # Another process created it first.
        exp = client.get_experiment_by_name(name)
        if exp is None:
            raise
        return exp.experiment_id


def git_commit() -> str | None:
    try:
        out = subprocess.run(
            ["git", "-C", str(PROJECT_ROOT), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def config_sha256(cfg: config_mod.Config) -> str:
    return hashlib.sha256(config_mod.to_yaml(cfg).encode()).hexdigest()


def search_runs(experiment: str, filter_string: str, order_by: tuple[str, ...] = ("attributes.start_time DESC",)) -> list:
    """Runs of the experiment matching an MLflow filter, newest first (read only)."""
    client = _client()
    exp = client.get_experiment_by_name(experiment)
    if exp is None:
        return []
    return list(client.search_runs([exp.experiment_id], filter_string, order_by=list(order_by), max_results=1000))


class Recorder:
    """Writes to one run by id; safe to use from any process.

    Tags, params, metrics, text artifacts, uploads and the run's end go through
    the run's outbox (coopstudy.remote.Outbox): while the server does not
    answer they wait on disk, in order, and the work goes on."""

    def __init__(self, run_id: str):
        from coopstudy import remote

        self.run_id = run_id
        self._client = _client()
        self._outbox = remote.Outbox(run_id, tracking_uri(), self._client)

    def set_tags(self, tags: Mapping[str, Any]) -> None:
        if tags:
            self._outbox.send({"op": "batch", "tags": [[k, str(v)] for k, v in tags.items()]})

    def log_params(self, params: Mapping[str, Any]) -> None:
        items = [[k, str(v)] for k, v in params.items()]
        # MLflow takes at most 100 params per batch.
        for i in range(0, len(items), 100):
            self._outbox.send({"op": "batch", "params": items[i : i + 100]})

    def log_metrics(self, metrics: Mapping[str, float], step: int = 0) -> None:
        """One batched call, however many metrics."""
        now = int(time.time() * 1000)
        batch = [[k, float(v), now, step] for k, v in metrics.items()]
        if batch:
            self._outbox.send({"op": "batch", "metrics": batch})

    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None:
        """A file or a folder; during an outage its path waits, so it must stay where it is."""
        self._outbox.send({"op": "artifact", "path": str(Path(path).resolve()), "artifact_path": artifact_path})

    def log_text(self, text: str, artifact_file: str) -> None:
        self._outbox.send({"op": "text", "text": text, "artifact_file": artifact_file})

    def terminate(self, status: str) -> None:
        self._outbox.send({"op": "terminate", "status": status, "end_time": int(time.time() * 1000)})

    def finish(self) -> bool:
        """Give what waits a grace period to reach the server; report what cannot.
        True when nothing waits."""
        return self._outbox.finish()

    def log_dict(self, data: Any, artifact_file: str) -> None:
        self.log_text(json.dumps(data, indent=2, sort_keys=True, default=str), artifact_file)

    def log_table(self, rows: list[dict[str, Any]], artifact_file: str) -> None:
        """Rows as an MLflow table (shown in the UI's evaluation view)."""
        columns: dict[str, list[Any]] = {}
        for row in rows:
            for key in row:
                columns.setdefault(key, [])
        for row in rows:
            for key, col in columns.items():
                col.append(row.get(key))
        self._client.log_table(self.run_id, data=columns, artifact_file=artifact_file)

    def log_inputs(self, files: Mapping[str, tuple[str, str]], context: str = "training") -> None:
        """Prepared files as MLflow dataset inputs: name -> (sha256 digest, source path)."""
        from mlflow.entities import Dataset, DatasetInput, InputTag

        inputs = [
            DatasetInput(
                dataset=Dataset(name=name, digest=digest[:36], source_type="local", source=json.dumps({"uri": src, "sha256": digest})),
                tags=[InputTag(key="mlflow.data.context", value=context)],
            )
            for name, (digest, src) in files.items()
        ]
        self._client.log_inputs(self.run_id, datasets=inputs)

    def record_commitment(self, kind: str, digest: str) -> None:
        self.set_tags({TAG_COMMITMENT_PREFIX + kind: digest})


# Tags for the next run a stage opens, set by a caller that wraps the stage
# (the study sets the step key this way without every stage knowing of it).
_pending_tags: contextvars.ContextVar[dict[str, str]] = contextvars.ContextVar("pending_tags", default={})


@contextlib.contextmanager
def tags_for_next_run(tags: Mapping[str, str]) -> Iterator[None]:
    token = _pending_tags.set(dict(tags))
    try:
        yield
    finally:
        _pending_tags.reset(token)


def _base_tags(stage: str, cfg: config_mod.Config | None, arm: str | None) -> dict[str, str]:
    tags = {TAG_STAGE: stage}
    if cfg is not None:
        tags[TAG_PRESET] = cfg.preset
        tags[TAG_CONFIG_SHA] = config_sha256(cfg)
    if arm:
        tags[TAG_ARM] = arm
    commit = git_commit()
    if commit:
        tags[TAG_GIT_COMMIT] = commit
    return tags


@contextlib.contextmanager
def stage_run(
    stage: str,
    cfg: config_mod.Config | None,
    *,
    run_name: str | None = None,
    arm: str | None = None,
    tags: Mapping[str, Any] | None = None,
    log_config: bool = True,
) -> Iterator[Recorder]:
    """One tracked run of one stage.

    It becomes the run that `mlflow run` created for this entry point when there
    is one and nothing else is open, a child of the open run otherwise, and a
    new top-level run elsewhere. It ends FINISHED on success and FAILED on any
    exception, with the error kept as a tag and an artifact.
    """
    import mlflow

    from coopstudy import remote

    global _PROJECT_RUN_ID
    uri = tracking_uri()
    exp_name = cfg.experiment if cfg is not None else DEFAULT_EXPERIMENT
    if remote.is_http(uri):
        # Before any work: a dead server, refused credentials or an experiment we
        # may not write stop the stage here, in seconds, with one line.
        remote.preflight(uri, exp_name)
    mlflow.set_tracking_uri(uri)
    exp_id = experiment_id(exp_name)
    parent = mlflow.active_run()
    adopt = _PROJECT_RUN_ID if parent is None else None
    _PROJECT_RUN_ID = None
    # start_run(run_id=...) leaves MLFLOW_RUN_ID set, and every later
    # start_run() would resume the project run instead of opening a child.
    os.environ.pop("MLFLOW_RUN_ID", None)
    name = run_name or "-".join(p for p in (stage, arm, cfg.preset if cfg else None) if p)
    active = mlflow.start_run(
        run_id=adopt,
        experiment_id=None if adopt else exp_id,
        run_name=None if adopt else name,
        nested=parent is not None,
    )
    rec = Recorder(active.info.run_id)
    try:
        all_tags = _base_tags(stage, cfg, arm) | _pending_tags.get() | {k: str(v) for k, v in (tags or {}).items()}
        _pending_tags.set({})
        if adopt:
            all_tags["mlflow.runName"] = name
        rec.set_tags(all_tags)
        if cfg is not None and log_config:
            rec.log_params(config_mod.flatten(cfg))
            rec.log_text(config_mod.to_yaml(cfg), ART_CONFIG)
        yield rec
    except BaseException as err:
        _record_failure(rec, err)
        status = "KILLED" if isinstance(err, KeyboardInterrupt) else "FAILED"
        delivered = _end(rec, status)
        if remote.is_outage(err):
            waits = "" if delivered else f"; what it could not record waits in {remote.outbox_dir()} (`python -m coopstudy.remote deliver` sends it)"
            raise UserError(f"the tracking server {uri} stopped answering ({remote.reason(err)}); run {rec.run_id} ended {status}{waits}") from err
        raise
    else:
        _end(rec, "FINISHED")


def _end(rec: Recorder, status: str) -> bool:
    """End the stage's run; True when nothing of it waits for the server."""
    import mlflow

    from coopstudy import remote

    try:
        # end_run takes the run off MLflow's stack of active runs before it calls
        # the server, so an outage here leaves a parent's next child correctly nested.
        mlflow.end_run(status)
    except Exception as err:
        if not remote.is_outage(err):
            raise
        rec.terminate(status)
    return rec.finish()


def _record_failure(rec: Recorder, err: BaseException) -> None:
    try:
        rec.set_tags({TAG_ERROR: str(err)[:4000] or type(err).__name__, TAG_ERROR_KIND: type(err).__name__})
        rec.log_text("".join(traceback.format_exception(err)), ART_ERROR)
    except Exception:  # noqa: BLE001 - the original error matters more than the record of it
        pass


def end_run_failed(run_id: str, err: BaseException | str) -> None:
    """Mark a run that another process owned as FAILED, keeping the error."""
    rec = Recorder(run_id)
    if isinstance(err, BaseException):
        _record_failure(rec, err)
    else:
        rec.set_tags({TAG_ERROR: err[:4000]})
    rec.terminate("FAILED")


def download_artifact(run_id: str, artifact_path: str, dst: str | Path | None = None) -> Path:
    from mlflow.artifacts import download_artifacts

    dst = dst or tempfile.mkdtemp(prefix="coopstudy-")
    return Path(download_artifacts(run_id=run_id, artifact_path=artifact_path, dst_path=str(dst), tracking_uri=tracking_uri()))
