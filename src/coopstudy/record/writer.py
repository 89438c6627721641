"""The one MLflow writer. Stages open a run with `stage_run(...)` and write
through the `Recorder` it yields; a process that joins an existing run (a
rank of the compressed arm) uses `Recorder(run_id)` directly."""

from __future__ import annotations

import contextlib
import contextvars
import functools
import json
import os
import sys
import time
import traceback
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from coopstudy import config as config_mod
from coopstudy import workspace
from coopstudy.errors import INTERRUPTED, UserError, os_error_said
from coopstudy.record import outbox, remote, schema, store

RUN_NAME_TAG = "mlflow.runName"
"""MLflow's tag of a run's name, set where the run was opened by another (`mlflow run`)."""
NOTE_TAG = "mlflow.note.content"
"""The run tag MLflow's UI shows as the run's description (markdown)."""

NOT_PARAMS = ("preset",)
"""Config keys not logged as params. The preset is the tag schema.TAG_PRESET;
`mlflow run -P preset=<file>` logs its entry point's own param `preset` as
typed, which a config param of the same name (the file's short name) would
contradict, and MLflow refuses a param that changes."""
# The run `mlflow run` created for this entry point, not yet taken up by a stage.
_launcher = store.LAUNCHER
# A run id a parent process hands to the processes it starts (ranks, probes).
ENV_RUN_ID = "COOPSTUDY_RUN_ID"
MAX_TAG_CHARS = 4000
"""An error kept in a tag is cut here: the message's head says what happened, the artifacts keep the rest."""


def dataset_digest(sha256: str) -> str:
    """A file's sha256 as an MLflow dataset digest (MLflow keeps at most 36 characters)."""
    return sha256[:36]


class Recorder:
    """Writes to one run by id; safe to use from any process.

    Tags, params, metrics, text artifacts, uploads and the run's end go through
    the run's outbox (coopstudy.record.outbox.Outbox): while the server does not
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
        self._outbox.send(_upload(path) | {"artifact_path": artifact_path})

    def waits_to_upload(self, path: str | Path) -> bool:
        """Whether an upload of `path` (log_artifact) waits in the outbox, which needs it there."""
        return self._outbox.holds(_upload(path))

    def log_text(self, text: str, artifact_file: str) -> None:
        self._outbox.send({"op": "text", "text": text, "artifact_file": artifact_file})

    def terminate(self, status: str, *, for_deliver: bool = False) -> None:
        """The run's end; `for_deliver`: kept in the outbox without asking the
        server, for `remote deliver` only (Outbox.keep)."""
        record = {"op": "terminate", "status": status, "end_time": int(time.time() * 1000)}
        if for_deliver:
            self._outbox.keep(record, for_deliver=True)
        else:
            self._outbox.send(record)

    def finish(self) -> bool:
        """Give what waits a grace period to reach the server; report what cannot.
        True when nothing waits."""
        return self._outbox.finish()

    def log_dict(self, data: Any, artifact_file: str) -> None:
        self.log_text(json.dumps(data, indent=2, sort_keys=True, default=str), artifact_file)

    def log_table(self, rows: list[dict[str, Any]], artifact_file: str) -> None:
        """Rows as an MLflow table (JSON, columns and data; shown in the UI's evaluation view)."""
        columns = list(dict.fromkeys(key for row in rows for key in row))
        data = [[row.get(key) for key in columns] for row in rows]
        # Through JSON now, so what waits in the outbox is what the server gets.
        self._outbox.send(json.loads(json.dumps({"op": "table", "artifact_file": artifact_file, "columns": columns, "data": data}, default=str)))

    def log_inputs(self, files: Mapping[str, tuple[str, str]], context: str = "training") -> None:
        """Prepared files as MLflow dataset inputs: name -> (sha256 digest, source path)."""
        datasets = [
            {
                "name": name, "digest": dataset_digest(digest), "source_type": "local",
                "source": json.dumps({"uri": src, "sha256": digest}), "tags": {"mlflow.data.context": context},
            }
            for name, (digest, src) in files.items()
        ]  # fmt: skip
        self._outbox.send({"op": "inputs", "datasets": datasets})

    def log_model(
        self, name: str, metrics: Mapping[str, float], measured_on: Mapping[str, tuple[str, str]], *,
        params: Mapping[str, str], tags: Mapping[str, str],
    ) -> None:
        """An MLflow logged model of this run (the Models view compares them), with
        `metrics` linked to it, each to the dataset `measured_on` names for it
        (name, sha256 of the file), if any. They are the run's metrics too: sent
        to the run first, at the same instant, so that a store refusing the model
        still holds them, and a store taking both keeps one point of each."""
        now = int(time.time() * 1000)
        points = [[k, float(v), now, 0] for k, v in metrics.items()]
        self._outbox.send({"op": "batch", "metrics": points})
        self._outbox.send(
            {
                "op": "model", "name": name, "model_type": schema.MODEL_TYPE_CHECKPOINT,
                "params": {k: str(v) for k, v in params.items()}, "tags": {k: str(v) for k, v in tags.items()},
                "metrics": points,
                "datasets": {k: [file, dataset_digest(sha)] for k, (file, sha) in measured_on.items()},
            }
        )  # fmt: skip

    def record_commitment(self, kind: str, digest: str, tags: Mapping[str, Any] | None = None) -> None:
        """The run's mirror of a ledger commitment, with `tags` that go with it, in one call."""
        self.set_tags(dict(tags or {}) | {schema.TAG_COMMITMENT_PREFIX + kind: digest})


def _upload(path: str | Path) -> dict[str, str]:
    """An upload as the outbox keeps it: by the absolute path where it waits."""
    return {"op": "artifact", "path": str(Path(path).resolve())}


# Tags for the next run a stage opens, set by a caller that wraps the stage
# (the study sets the step key this way without every stage knowing of it).
_pending_tags: contextvars.ContextVar[dict[str | None, dict[str, str]]] = contextvars.ContextVar("pending_tags", default={})


@contextlib.contextmanager
def tags_for_next_run(tags: Mapping[str, str]) -> Iterator[None]:
    with tags_for_next_runs({None: tags}):
        yield


@contextlib.contextmanager
def tags_for_next_runs(by_arm: Mapping[str | None, Mapping[str, str]]) -> Iterator[None]:
    """Tags for the next run of each arm a stage opens; under None, for the
    next run that no arm of `by_arm` claims."""
    token = _pending_tags.set({arm: dict(tags) for arm, tags in by_arm.items()})
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
    """One tracked run of one stage, in the study's store and experiment.

    A child of the open run when there is one (in the parent's experiment);
    otherwise the run that `mlflow run` created for this entry point when that
    run is in the study's store and experiment, and a new top-level run
    elsewhere: then `mlflow run`'s run is left as a pointer to this one (tags
    and a note naming its store and id, ended with the same status). It ends
    FINISHED on success, KILLED on an interrupt and FAILED on any other
    exception, with the error kept as a tag and an artifact.
    """
    import mlflow

    global _launcher
    uri = store.tracking_uri()
    exp_name = cfg.experiment if cfg is not None else store.DEFAULT_EXPERIMENT
    if store.is_http(uri):
        # Before any work: a dead server, refused credentials or an experiment we
        # may not write stop the stage here, in seconds, with one line.
        remote.preflight(uri, exp_name)
    mlflow.set_tracking_uri(uri)
    # The run's records wait in the home's outbox: a home that cannot be used, or
    # a grace to wait for them that is no number, is refused before the run
    # opens, rather than leave an empty run behind.
    workspace.home()
    outbox.grace_s()
    parent = mlflow.active_run()
    exp_id = parent.info.experiment_id if parent is not None else store.experiment_id(exp_name)
    launched, _launcher = (_launcher if parent is None else None), (None if parent is None else _launcher)
    if launched is not None:
        store.check_launcher()
    adopt = launched is not None and launched.tracking_uri == uri and launched.experiment_id == exp_id
    # start_run(run_id=...) leaves MLFLOW_RUN_ID set, and every later
    # start_run() would resume the project run instead of opening a child.
    os.environ.pop("MLFLOW_RUN_ID", None)
    name = run_name or "-".join(p for p in (stage, arm, cfg.preset if cfg else None) if p)
    active = mlflow.start_run(
        run_id=launched.run_id if adopt else None,
        experiment_id=None if adopt else exp_id,
        run_name=None if adopt else name,
        nested=parent is not None,
    )
    rec = Recorder(active.info.run_id)
    pointer = None
    try:
        if launched is not None and not adopt:
            pointer = _Pointer(launched, uri, rec.run_id, name)
        pending = _pending_tags.get()
        claim = arm if arm in pending else None
        all_tags = _base_tags(stage, cfg, arm) | pending.get(claim, {}) | {k: str(v) for k, v in (tags or {}).items()}
        _pending_tags.set({a: t for a, t in pending.items() if a != claim})
        if adopt:
            all_tags[RUN_NAME_TAG] = name
        rec.set_tags(all_tags)
        if cfg is not None and log_config:
            rec.log_params({k: v for k, v in config_mod.flatten(cfg).items() if k not in NOT_PARAMS})
            rec.log_text(config_mod.to_yaml(cfg), schema.ART_CONFIG)
        yield rec
    except BaseException as err:
        _record_failure(rec, err)
        status = "KILLED" if isinstance(err, KeyboardInterrupt) else "FAILED"
        delivered = _end(rec, status)
        if pointer is not None:
            pointer.end(status)
        if outbox.is_outage(err):
            waits = "" if delivered else f"; what it could not record waits in {outbox.outbox_dir()} (`python -m coopstudy remote deliver` sends it)"
            raise UserError(f"the tracking server {uri} stopped answering ({outbox.reason(err)}); run {rec.run_id} ended {status}{waits}") from err
        raise
    else:
        _end(rec, "FINISHED")
        if pointer is not None:
            pointer.end("FINISHED")


class _Pointer:
    """`mlflow run`'s run when the study records elsewhere (another store or
    experiment): a short run that names the real one, so nothing of the study
    is silently split between two records."""

    def __init__(self, launched: store.Launcher, uri: str, run_id: str, name: str):
        from mlflow import MlflowClient

        self.client, self.launched = MlflowClient(tracking_uri=launched.tracking_uri), launched
        _label(
            self.client, launched.run_id, f"{name} (pointer)",
            f"This run only points to the study's record: run `{run_id}` in the store `{uri}`. "
            "Every param, metric and artifact of this step is there.",
            {schema.TAG_RECORD_URI: uri, schema.TAG_RECORD_RUN: run_id},
        )  # fmt: skip

    def end(self, status: str) -> None:
        self.client.set_terminated(self.launched.run_id, status)


@functools.cache  # one question to the store per process: a refusal may ask twice
def _launching_run() -> tuple[Any, Any] | None:
    """A client and `mlflow run`'s run that started this process, while that
    run is RUNNING. None otherwise: an MLFLOW_RUN_ID left in a shell names
    somebody's old run, which is not to be touched or taken for a launcher."""
    if _launcher is None or not _launcher.tracking_uri:
        return None
    from mlflow import MlflowClient

    if store.is_http(_launcher.tracking_uri):
        store.use_http_defaults()  # a server that does not answer costs seconds, not minutes
    try:
        client = MlflowClient(tracking_uri=_launcher.tracking_uri)
        run = client.get_run(_launcher.run_id)
    except Exception:  # noqa: BLE001 - the store may be what was refused; the message matters more
        return None
    return (client, run) if run.info.status == "RUNNING" else None


def launching_entry_point() -> str | None:
    """The MLproject entry point `mlflow run` started this process as, or None."""
    launching = _launching_run()
    if launching is None:
        return None
    from mlflow.utils.mlflow_tags import MLFLOW_PROJECT_ENTRY_POINT

    return launching[1].data.tags.get(MLFLOW_PROJECT_ENTRY_POINT)


def mark_refused(name: str, err: BaseException) -> None:
    """`mlflow run`'s run, when the command refused before any stage run took
    it over: named `<name> (refused)` with the reason, so the record says what
    became of it (`mlflow run` ends it FAILED)."""
    launching = _launching_run()
    if launching is None:
        return
    client, run = launching
    why = str(err)[:MAX_TAG_CHARS] or type(err).__name__
    try:
        _label(
            client, run.info.run_id, f"{name} (refused)", f"The command refused before it opened a run of its own: {why}",
            {schema.TAG_ERROR: why, schema.TAG_ERROR_KIND: type(err).__name__},
        )  # fmt: skip
    except Exception:  # noqa: BLE001 - the store may be what was refused; the message matters more
        pass


def _label(client: Any, run_id: str, name: str, note: str, tags: Mapping[str, str]) -> None:
    """Name and annotate `mlflow run`'s run, which the study did not take as its record."""
    from mlflow.entities import RunTag

    tags = {**tags, RUN_NAME_TAG: name, NOTE_TAG: note}
    client.log_batch(run_id, tags=[RunTag(k, v) for k, v in tags.items()])


def _end(rec: Recorder, status: str) -> bool:
    """End the stage's run; True when nothing of it waits for the server."""
    import mlflow

    try:
        # end_run takes the run off MLflow's stack of active runs before it calls
        # the server, so an outage here leaves a parent's next child correctly nested.
        mlflow.end_run(status)
    except Exception as err:
        if store.on_full_disk(err) or store.on_locked(err):
            # The store cannot take the end now; once it has space (or the
            # process that holds it is done), `remote deliver` can.
            _keep_end(rec, status)
            raise
        if not outbox.is_outage(err):
            raise
        rec.terminate(status)
    except BaseException:
        # A stop while the server was asked: MLflow no longer holds the run, which
        # may still be RUNNING there; its end waits for `remote deliver` (not
        # for this process's exit, which the stop asked to come now).
        if _keep_end(rec, status):
            print(f"coopstudy: run {rec.run_id} may still be RUNNING; `python -m coopstudy remote deliver {rec.run_id}` ends it", file=sys.stderr)
        raise
    return rec.finish()


_ENDS_KEPT: list[str] = []
"""Runs whose end this process kept for `remote deliver` (ends_kept)."""


def _keep_end(rec: Recorder, status: str) -> bool:
    """The run's end kept in its outbox for `remote deliver`; False where the
    home's disk would not take it either (nothing then waits)."""
    try:
        rec.terminate(status, for_deliver=True)
    except OSError:
        return False
    _ENDS_KEPT.append(rec.run_id)
    return True


def ends_kept() -> list[str]:
    """The runs whose end waits for `remote deliver`, kept by this process."""
    return list(_ENDS_KEPT)


def _record_failure(rec: Recorder, err: BaseException) -> None:
    # Ctrl-C raises a KeyboardInterrupt that says nothing: said as the stages that launch processes say it.
    why = str(err) or (INTERRUPTED if isinstance(err, KeyboardInterrupt) else type(err).__name__)
    if outbox.is_outage(err):
        # As the stage's line says it, not MLflow's request chain (the traceback keeps that).
        why = f"the tracking server stopped answering ({outbox.reason(err)})"
    elif isinstance(err, OSError):
        why = os_error_said(err) or why  # as the line says it, not as `[Errno N] …`
    try:
        rec.set_tags({schema.TAG_ERROR: why[:MAX_TAG_CHARS], schema.TAG_ERROR_KIND: type(err).__name__})
        rec.log_text("".join(traceback.format_exception(err)), schema.ART_ERROR)
    except BaseException:  # noqa: BLE001 - the original error matters more than the record of it; a stop meanwhile must not skip the run's end
        pass
