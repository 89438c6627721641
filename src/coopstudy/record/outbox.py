"""The outbox: what keeps an outage of the tracking server during a run from
losing the run.

A Recorder sends each record (a batch of metrics, params or tags; a text
artifact; a file to upload; the run's end) through its run's outbox: when the
server does not answer, the record is appended to `<home>/outbox/<run id>.jsonl`,
one warning goes to stderr, and work goes on. Later records queue behind it, so
the order is kept; every record after a retry interval first tries to deliver
the queue. At the end of the run (the stage's end, or the exit of a training
process) the queue gets a grace period to drain; what is still undeliverable is
reported, naming the file and the command that delivers it
(`python -m coopstudy remote deliver`, coopstudy.record.remote).
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import json
import math
import os
import socket
import sys
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import IO, Any

from coopstudy import errors, workspace
from coopstudy.errors import UserError
from coopstudy.record import schema, store

ENV_GRACE = "COOPSTUDY_OUTBOX_GRACE_S"
DEFAULT_GRACE_S = 30.0
"""How long the end of a run waits for a queue to drain (a server restart takes seconds)."""
RETRY_FIRST_S = 2.0
RETRY_MAX_S = 60.0
"""While the server is away, delivery is tried again after this interval, doubling up to the
maximum: the records in between go straight to the file and cost the loop nothing."""

def is_outage(err: BaseException, outer: BaseException | None = None) -> bool:
    """True when the server could not be reached or did not answer in time (the request may be
    repeated later); False for an answer that refused the request (it would be refused again).
    `outer`: the error being handled where `err` was raised (an outage then is not this one's)."""
    import requests

    lost = (requests.exceptions.ConnectionError, requests.exceptions.Timeout, requests.exceptions.RetryError)
    return any(isinstance(seen, lost) for seen in errors.chain(err, outer))


def _on_full_disk(err: BaseException) -> bool:
    """A local store (SQLite, or a file artifact store) that had no space for the record."""
    return store.on_full_disk(err) or any(isinstance(seen, OSError) and seen.errno in errors.FULL_DISK for seen in errors.chain(err))


def _interruption(err: BaseException, outer: BaseException | None = None) -> BaseException | None:
    """The stop behind `err` when the process was stopped while it sent (MLflow
    may wrap it): the record was not refused, and the process must stop, not go on.
    `outer`: the error its caller was handling, which did not interrupt the send."""
    stops = (errors.Stopped, KeyboardInterrupt, SystemExit)
    return next((seen for seen in errors.chain(err, outer) if isinstance(seen, stops)), None)


def _raise_as_stop(err: BaseException, stop: BaseException) -> None:
    # With the stop as its cause: a rank tells a stop in one line by its causes.
    if stop is err:
        raise err
    raise err from stop


def reason(err: BaseException) -> str:
    """The error in a few words (MLflow's own message repeats the whole URL chain),
    read down its chain."""
    chain = errors.chain(err)
    for seen in chain:
        text = str(seen)
        for marker, words in (
            ("Connection refused", "connection refused"),
            ("Name or service not known", "unknown host"),
            ("nodename nor servname", "unknown host"),
            ("timed out", "timed out"),
            ("Read timed out", "timed out"),
            ("too many 5", "the server kept answering with errors"),
            ("Max retries exceeded", "no connection"),
        ):
            if marker in text:
                return words
    return type(chain[-1]).__name__


def outbox_dir() -> Path:
    return workspace.home() / "outbox"


def outbox_file(run_id: str = "*") -> Path:
    """Where run `run_id`'s records wait (with "*", the pattern of every run's)."""
    return outbox_dir() / f"{run_id}.jsonl"


def apply(client: Any, run_id: str, record: Mapping[str, Any]) -> None:
    """Write one record to the run."""
    from mlflow.entities import Metric, Param, RunTag

    op = record["op"]
    if op == "batch":
        client.log_batch(
            run_id,
            metrics=[Metric(k, v, ts, step) for k, v, ts, step in record.get("metrics", ())],
            params=[Param(k, v) for k, v in record.get("params", ())],
            tags=[RunTag(k, v) for k, v in record.get("tags", ())],
        )
    elif op == "text":
        client.log_text(run_id, record["text"], record["artifact_file"])
    elif op == "artifact":
        path = Path(record["path"])
        if path.is_dir():
            client.log_artifacts(run_id, str(path), record.get("artifact_path"))
        else:
            client.log_artifact(run_id, str(path), record.get("artifact_path"))
    elif op == "terminate":
        client.set_terminated(run_id, record["status"], end_time=record["end_time"])
    elif op == "table":
        _apply_table(client, run_id, record)
    elif op == "inputs":
        _log_inputs(client, run_id, [_dataset_input(d) for d in record["datasets"]])
    elif op == "model":
        _apply_model(client, run_id, record)
    elif op == "end_dead":
        end_dead_run(client, run_id, record)
    else:
        raise ValueError(f"unknown outbox record {op!r}")


def dead_run_end(reason: str, reason_tag: str) -> dict[str, Any]:
    """The record that ends a run whose process died (a stale lock found it):
    KILLED, `reason_tag` (the reason cut to a tag's length) as its error, the
    whole reason as its error artifact."""
    tags = [[schema.TAG_ERROR, reason_tag], [schema.TAG_ERROR_KIND, schema.ERROR_KIND_STALE_LOCK]]
    return {"op": "end_dead", "tags": tags, "status": "KILLED", "end_time": int(time.time() * 1000),
            "text": reason, "artifact_file": schema.ART_ERROR}  # fmt: skip


def end_dead_run(client: Any, run_id: str, record: Mapping[str, Any]) -> bool:
    """End the run as `record` (dead_run_end) says, if it is still RUNNING; True when it did.
    Delivered late, the record must not undo an end that reached the store meanwhile."""
    from mlflow.entities import RunTag

    if client.get_run(run_id).info.status != "RUNNING":
        return False
    client.log_batch(run_id, tags=[RunTag(k, v) for k, v in record["tags"]])
    client.set_terminated(run_id, record["status"], end_time=record["end_time"])
    # No traceback, the process that ran it being gone; an artifact store that
    # does not take it must not keep the run RUNNING or hold its other records.
    with contextlib.suppress(Exception):
        client.log_text(run_id, record["text"], record["artifact_file"])
    return True


LOGGED_ARTIFACTS_TAG = "mlflow.loggedArtifacts"
"""The run tag with which MLflow's UI finds a run's tables (its evaluation view)."""


def _apply_table(client: Any, run_id: str, record: Mapping[str, Any]) -> None:
    # MLflow's own log_table appends to an existing artifact, so a record
    # delivered twice would double its rows; written whole, it is the same file.
    body = {"columns": record["columns"], "data": record["data"]}
    client.log_text(run_id, json.dumps(body, default=str), record["artifact_file"])
    logged = json.loads(client.get_run(run_id).data.tags.get(LOGGED_ARTIFACTS_TAG, "[]"))
    entry = {"path": record["artifact_file"], "type": "table"}
    if entry not in logged:
        client.set_tag(run_id, LOGGED_ARTIFACTS_TAG, json.dumps([*logged, entry]))


DUPLICATE_ROW = ("UNIQUE constraint failed", "duplicate key value violates unique constraint", "Duplicate entry")
"""How SQLite, PostgreSQL and MySQL refuse a second row with the same unique key."""
INPUTS_ATTEMPTS = 3


def _log_inputs(client: Any, run_id: str, datasets: list[Any]) -> None:
    # MLflow looks for an experiment's dataset row, then inserts it if missing: two
    # runs logging the same file at once (two prepares) can both miss it, and the
    # later insert is refused. Its transaction rolls back whole, and the next try
    # finds the row the other run wrote.
    for attempt in range(1, INPUTS_ATTEMPTS + 1):
        try:
            client.log_inputs(run_id, datasets=datasets)
            return
        except Exception as err:
            if attempt == INPUTS_ATTEMPTS or not any(m in str(err) for m in DUPLICATE_ROW):
                raise


def _dataset_input(d: Mapping[str, Any]) -> Any:
    from mlflow.entities import Dataset, DatasetInput, InputTag

    return DatasetInput(
        dataset=Dataset(name=d["name"], digest=d["digest"], source_type=d["source_type"], source=d["source"]),
        tags=[InputTag(key=k, value=v) for k, v in d["tags"].items()],
    )


def _apply_model(client: Any, run_id: str, record: Mapping[str, Any]) -> None:
    """A logged model of the run (weights named by their hash, not copied again),
    with its evaluation metrics linked to it and to the dataset they were measured on."""
    from mlflow.entities import LoggedModelOutput, LoggedModelStatus, Metric

    experiment_id = client.get_run(run_id).info.experiment_id
    # Delivered twice, the record must not make a second model.
    found = [
        m for m in client.search_logged_models(experiment_ids=[experiment_id], filter_string=f"source_run_id = '{run_id}'")
        if m.name == record["name"]
    ]
    model = found[0] if found else client.create_logged_model(
        experiment_id=experiment_id, name=record["name"], source_run_id=run_id,
        params=record["params"], tags=record["tags"], model_type=record["model_type"],
    )  # fmt: skip
    # A delivery cut short after the model was made left it unfinished: finish it now.
    if model.status != LoggedModelStatus.READY:
        client.finalize_logged_model(model.model_id, LoggedModelStatus.READY)
        client.log_outputs(run_id, [LoggedModelOutput(model.model_id, 0)])
    # A record kept by an older version links every metric to its one dataset.
    datasets = record["datasets"] if "datasets" in record else {k: record["dataset"] for k, *_ in record["metrics"]}
    metrics = []
    for k, v, ts, step in record["metrics"]:
        name, digest = datasets.get(k, (None, None))
        metrics.append(Metric(k, v, ts, step, model_id=model.model_id, dataset_name=name, dataset_digest=digest))
    client.log_batch(run_id, metrics=metrics)


def describe(records: list[dict[str, Any]]) -> str:
    """What the records hold, in a few words: metric steps by key, counts of the rest."""
    steps: dict[str, list[int]] = {}
    other: dict[str, int] = {}
    for rec in records:
        for key, _value, _ts, step in rec.get("metrics", ()):
            steps.setdefault(key, []).append(step)
        for field in ("params", "tags"):
            if rec.get(field):
                other[field] = other.get(field, 0) + len(rec[field])
        if rec["op"] != "batch":
            other[rec["op"]] = other.get(rec["op"], 0) + 1
    parts = [f"{key} steps {min(s)}-{max(s)} ({len(s)})" for key, s in list(steps.items())[:3]]
    if len(steps) > 3:
        parts.append(f"{len(steps) - 3} more metric keys")
    names = {"params": "params", "tags": "tags", "text": "text artifacts", "artifact": "uploads", "table": "tables",
             "inputs": "dataset inputs", "model": "logged models", "terminate": "the run's end",
             "end_dead": "the dead run's end"}
    parts += [f"{n} {names[k]}" if k not in ("terminate", "end_dead") else names[k] for k, n in other.items()]
    return ", ".join(parts) or "nothing"


def grace_s() -> float:
    """The grace of a run's end: ENV_GRACE, else DEFAULT_GRACE_S. A stage
    reads it before it opens its run (writer.stage_run), so that a value that
    is no number of seconds is refused before the run and its work, not after."""
    given = os.environ.get(ENV_GRACE)
    if given is None:
        return DEFAULT_GRACE_S
    try:
        seconds = float(given)
    except ValueError:
        seconds = math.nan
    if not (math.isfinite(seconds) and seconds >= 0):
        raise UserError(f"{ENV_GRACE}={given!r}: not a number of seconds (0 or more); unset it for the default {DEFAULT_GRACE_S:g} s")
    return seconds


def _parsed(text: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """An outbox file's records, and its lines that are none (a process killed while writing one)."""
    records, broken = [], []
    for n, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError:
            record = None
        if isinstance(record, dict) and isinstance(record.get("op"), str):
            records.append(record)
        else:
            broken.append({"line": n, "text": line, "error": "not a record"})
    return records, broken


class Outbox:
    """One run's records that await the server, in order, in one JSONL file."""

    _warned: set[Path] = set()
    _reported: set[Path] = set()

    def __init__(self, run_id: str, uri: str, client: Any):
        self.run_id, self.uri, self.client = run_id, uri, client
        self.path = outbox_file(run_id)
        # Kept aside: records the server refused, and lines that are no record.
        self.rejected = self.path.with_suffix(".rejected")
        self.refused = 0
        """Waiting records the server refused (kept aside) since this outbox was opened."""
        self.waits_for: str | None = None
        """Why records still wait after the last delivery that left some."""
        self._retry_at = 0.0
        self._interval = RETRY_FIRST_S
        self._exit_hook = False

    def send(self, record: dict[str, Any]) -> None:
        """Write the record now, or keep it behind the ones already waiting."""
        if self.path.exists() and not (time.monotonic() >= self._retry_at and self.deliver()):
            self.keep(record)
            return
        outer = sys.exception()
        try:
            apply(self.client, self.run_id, record)
            return
        except Exception as err:
            stop = _interruption(err, outer)
            if stop is not None:
                # Kept, as `deliver` keeps the one it cut short: it may not have
                # landed, and every record may be delivered twice.
                with contextlib.suppress(OSError):
                    self.keep(record)
                _raise_as_stop(err, stop)
            if not is_outage(err, outer):
                raise
            lost = err
        # Kept outside the handler: a failure to keep it (a full disk) is not the outage.
        self._went_away(lost)
        self.keep(record)

    @contextlib.contextmanager
    def _locked(self) -> Iterator[IO[str]]:
        # Several processes may hold records of one run (the stage, rank 0): the lock
        # keeps the file whole; a file emptied and removed meanwhile is opened again.
        self.path.parent.mkdir(parents=True, exist_ok=True)
        while True:
            fh = open(self.path, "a+", errors="replace")
            fcntl.flock(fh, fcntl.LOCK_EX)
            try:
                same = os.fstat(fh.fileno()).st_ino == os.stat(self.path).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            fh.close()
        try:
            yield fh
        finally:
            fh.close()

    def keep(self, record: dict[str, Any], *, for_deliver: bool = False) -> None:
        """Put the record behind the ones waiting, without asking the server.
        `for_deliver`: what waits is for `remote deliver`, which the process
        said; its exit does not try the store again."""
        with self._locked() as fh:
            size = os.fstat(fh.fileno()).st_size
            if size and os.pread(fh.fileno(), 1, size - 1) != b"\n":
                # A process killed mid-line left it open: this record must not join it.
                fh.write("\n")
            fh.write(json.dumps(record | {"run_id": self.run_id, "uri": self.uri}) + "\n")
            fh.flush()
        if for_deliver:
            Outbox._reported.add(self.path)
        elif not self._exit_hook:
            # A training process has no stage around it: its exit is its run's end.
            atexit.register(self._finish_at_exit)
            self._exit_hook = True

    def holds(self, fields: Mapping[str, Any]) -> bool:
        """Whether a waiting record has these fields. Read only: neither made
        (as _locked would) nor sorted (as _read puts broken lines aside)."""
        try:
            with open(self.path, errors="replace") as fh:
                fcntl.flock(fh, fcntl.LOCK_SH)
                records, _ = _parsed(fh.read())
        except FileNotFoundError:
            return False
        return any(all(record.get(k) == v for k, v in fields.items()) for record in records)

    def _went_away(self, err: BaseException) -> None:
        self._retry_at = time.monotonic() + self._interval
        self._interval = min(self._interval * 2, RETRY_MAX_S)
        if self.path not in Outbox._warned:
            Outbox._warned.add(self.path)
            print(
                f"coopstudy: tracking server {self.uri} unreachable ({reason(err)}); run {self.run_id} goes on, "
                f"its records wait in {self.path} on {socket.gethostname()} and are delivered when the server answers",
                file=sys.stderr,
                flush=True,
            )

    def _read(self, fh: IO[str]) -> list[dict[str, Any]]:
        """The waiting records; a line that is none (a process killed while
        writing it) is put aside with the refused ones, not a stop for the rest."""
        fh.seek(0)
        records, broken = _parsed(fh.read())
        if broken:
            with open(self.rejected, "a") as aside:
                aside.writelines(json.dumps(b) + "\n" for b in broken)
            print(f"coopstudy: line {', '.join(str(b['line']) for b in broken)} of {self.path} is not a record (a process killed while writing it?); "
                  f"kept in {self.rejected}", file=sys.stderr, flush=True)  # fmt: skip
        return records

    def deliver(self, *, full_waits: bool = False) -> bool:
        """Send every waiting record in order; True when none is left (else
        `waits_for` says why). `full_waits` (remote deliver): a store whose
        disk is full keeps the records waiting, as an outage does; a step's
        own sends raise it, to end in one line."""
        if not self.path.exists():
            return True
        outer = sys.exception()
        refused_at: set[int] = set()
        with self._locked() as fh:
            records = self._read(fh)
            for sent, record in enumerate(records):
                try:
                    apply(self.client, self.run_id, record)
                except BaseException as err:
                    stop = _interruption(err, outer)
                    lost = is_outage(err, outer)
                    # A store whose disk is full did not refuse the record: it waits for space.
                    full = full_waits and isinstance(err, Exception) and _on_full_disk(err)
                    if isinstance(err, Exception) and stop is None and not lost and not full:
                        self._reject(record, err)
                        refused_at.add(sent)
                        continue
                    # Only the undelivered rest stays, so nothing is sent twice; a stop
                    # keeps the one it cut short too, as it may not have reached the server.
                    self._rewrite(records[sent:])
                    if stop is not None:
                        _raise_as_stop(err, stop)
                    if full:
                        self.waits_for = store.full_disk_said(self.uri)
                        return False
                    if not lost:
                        raise
                    self.waits_for = f"the server {self.uri} does not answer ({reason(err)})"
                    self._went_away(err)
                    return False
            os.unlink(self.path)
        self._interval = RETRY_FIRST_S
        delivered = [r for i, r in enumerate(records) if i not in refused_at]
        if delivered:
            print(f"coopstudy: delivered {len(delivered)} waiting records of run {self.run_id} ({describe(delivered)}) to {self.uri}", file=sys.stderr, flush=True)
        return True

    def _rewrite(self, records: list[dict[str, Any]]) -> None:
        # Whole or not at all: a stop between emptying the file and writing it again
        # would lose every record. Waiting processes see the new file (`_locked`).
        fresh = self.path.with_suffix(".new")
        try:
            with open(fresh, "w") as fh:
                fh.writelines(json.dumps(r) + "\n" for r in records)
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(fresh, self.path)
        except BaseException:
            fresh.unlink(missing_ok=True)
            raise

    def _reject(self, record: dict[str, Any], err: BaseException) -> None:
        # The server answered and refused it: sending it again would be refused again,
        # and holding it would block every record behind it. It is kept aside, said once.
        with open(self.rejected, "a") as fh:
            fh.write(json.dumps(record | {"error": str(err)[:2000]}) + "\n")
        self.refused += 1
        print(f"coopstudy: the server refused a waiting record of run {self.run_id} ({describe([record])}): "
              f"{(str(err).splitlines() or [''])[0][:300]}; kept in {self.rejected}", file=sys.stderr, flush=True)

    def settle(self) -> bool:
        """At the run's end: deliver, retrying for up to the grace (grace_s); True when nothing waits."""
        deadline = time.monotonic() + grace_s()
        while not self.deliver():
            if time.monotonic() >= deadline:
                return False
            time.sleep(min(self._interval, max(0.0, deadline - time.monotonic())))
        return True

    def finish(self) -> bool:
        """The run's end: settle, and say plainly what is still waiting and how to send it
        (once per process: the exit of a process whose stage already said it stays quiet).
        True when nothing waits. A stop meanwhile is said the same way, then goes on."""
        if self.path in Outbox._reported:
            return False
        outer = sys.exception()
        try:
            if self.settle():
                return True
        except BaseException as err:
            stop = _interruption(err, outer)
            if stop is None:
                raise
            # Ctrl-C's KeyboardInterrupt says nothing; a stage's SIGTERM (launch.Terminated) says which.
            words = errors.first_line(stop) if str(stop).strip() else errors.INTERRUPTED
            self._incomplete(f"stopped while its records were delivered ({words})")
            raise
        self._incomplete("the server did not come back")
        return False

    def _finish_at_exit(self) -> None:
        # A training process's exit is its run's end. A stop during this last drain
        # has nothing left to stop, and `finish` said what it left waiting.
        try:
            self.finish()
        except BaseException as err:
            if _interruption(err) is None:
                raise

    def _incomplete(self, why: str) -> None:
        Outbox._reported.add(self.path)
        with self._locked() as fh:
            records = self._read(fh)
        print(
            f"coopstudy: run {self.run_id} is INCOMPLETE on {self.uri}: {why}; "
            f"{len(records)} records ({describe(records)}) are kept in {self.path} on {socket.gethostname()}. "
            f"Deliver them when it answers: python -m coopstudy remote deliver {self.run_id}",
            file=sys.stderr,
            flush=True,
        )
