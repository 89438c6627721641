"""The one MLflow writer. Stages open a run with `stage_run(...)` and write
through the `Recorder` it yields; a process that joins an existing run (a
rank of the compressed arm) uses `Recorder(run_id)` directly."""

from __future__ import annotations

import contextlib
import contextvars
import json
import os
import time
import traceback
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from coopstudy import config as config_mod
from coopstudy.errors import UserError
from coopstudy.record import outbox, schema, store

# The run id that `mlflow run` hands its entry point. mlflow.start_run()
# removes it from the environment, so it is read once, at import.
_PROJECT_RUN_ID = os.environ.get("MLFLOW_RUN_ID")
# A run id a parent process hands to the processes it starts (ranks, probes).
ENV_RUN_ID = "COOPSTUDY_RUN_ID"


class Recorder:
    """Writes to one run by id; safe to use from any process.

    Tags, params, metrics, text artifacts, uploads and the run's end go through
    the run's outbox (coopstudy.outbox.Outbox): while the server does not
    answer they wait on disk, in order, and the work goes on."""

    def __init__(self, run_id: str):
        self.run_id = run_id
        self._client = store.client()
        self._outbox = outbox.Outbox(run_id, store.tracking_uri(), self._client)

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
        self.set_tags({schema.TAG_COMMITMENT_PREFIX + kind: digest})


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
    tags = {schema.TAG_STAGE: stage}
    if cfg is not None:
        tags[schema.TAG_PRESET] = cfg.preset
        tags[schema.TAG_CONFIG_SHA] = store.config_sha256(cfg)
    if arm:
        tags[schema.TAG_ARM] = arm
    commit = store.git_commit()
    if commit:
        tags[schema.TAG_GIT_COMMIT] = commit
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

    global _PROJECT_RUN_ID
    uri = store.tracking_uri()
    exp_name = cfg.experiment if cfg is not None else store.DEFAULT_EXPERIMENT
    if store.is_http(uri):
        # Before any work: a dead server, refused credentials or an experiment we
        # may not write stop the stage here, in seconds, with one line.
        outbox.preflight(uri, exp_name)
    mlflow.set_tracking_uri(uri)
    exp_id = store.experiment_id(exp_name)
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
            rec.log_text(config_mod.to_yaml(cfg), schema.ART_CONFIG)
        yield rec
    except BaseException as err:
        _record_failure(rec, err)
        status = "KILLED" if isinstance(err, KeyboardInterrupt) else "FAILED"
        delivered = _end(rec, status)
        if outbox.is_outage(err):
            waits = "" if delivered else f"; what it could not record waits in {outbox.outbox_dir()} (`python -m coopstudy remote deliver` sends it)"
            raise UserError(f"the tracking server {uri} stopped answering ({outbox.reason(err)}); run {rec.run_id} ended {status}{waits}") from err
        raise
    else:
        _end(rec, "FINISHED")


def _end(rec: Recorder, status: str) -> bool:
    """End the stage's run; True when nothing of it waits for the server."""
    import mlflow

    try:
        # end_run takes the run off MLflow's stack of active runs before it calls
        # the server, so an outage here leaves a parent's next child correctly nested.
        mlflow.end_run(status)
    except Exception as err:
        if not outbox.is_outage(err):
            raise
        rec.terminate(status)
    return rec.finish()


def _record_failure(rec: Recorder, err: BaseException) -> None:
    try:
        rec.set_tags({schema.TAG_ERROR: str(err)[:4000] or type(err).__name__, schema.TAG_ERROR_KIND: type(err).__name__})
        rec.log_text("".join(traceback.format_exception(err)), schema.ART_ERROR)
    except Exception:  # noqa: BLE001 - the original error matters more than the record of it
        pass
