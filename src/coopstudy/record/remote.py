"""The tracking server, when the study's store is one: the preflight every
step runs before any work, and `python -m coopstudy remote` (check it alone;
deliver what the outbox kept during an outage).

`preflight(uri, experiment)` runs once per process before a stage does any
work (writer.stage_run calls it for http(s) URIs): the server must answer
within seconds, accept the credentials, hold the experiment active (or let us
create it), store its artifacts through the server (proxied), and let us
write to it. Anything else stops the stage with one line.

    python -m coopstudy remote deliver [RUN_ID ...] [--tracking-uri URI]
    python -m coopstudy remote check [--experiment NAME]
"""

from __future__ import annotations

import argparse
import json
import socket
from datetime import datetime, timezone
from pathlib import Path
from urllib.parse import urlsplit

from coopstudy import config as config_mod
from coopstudy import errors
from coopstudy.errors import UserError
from coopstudy.record import schema, store
from coopstudy.record.outbox import Outbox, is_outage, outbox_dir, outbox_file, reason

# The preflight's own, whatever the user set: a dead server is reported in
# seconds; a healthy one answers these small requests in milliseconds.
PREFLIGHT_HTTP = {
    "MLFLOW_HTTP_REQUEST_TIMEOUT": "5",
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "1",
    "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
}
_checked: dict[tuple[str, str], str] = {}


def explain(err: BaseException, uri: str, experiment: str) -> str:
    """One line for a preflight failure: what is wrong and what to do."""
    from mlflow.exceptions import MlflowException

    if is_outage(err):
        return (
            f"the tracking server {uri} does not answer ({reason(err)}); start it, or correct the URI "
            f"(from {store.origin(uri)}); nothing was run"
        )
    status = err.get_http_status_code() if isinstance(err, MlflowException) else None
    if status == 401:
        return (
            f"the tracking server {uri} wants credentials: set MLFLOW_TRACKING_USERNAME and "
            "MLFLOW_TRACKING_PASSWORD (or MLFLOW_TRACKING_TOKEN) in the environment; nothing was run"
        )
    if status == 403:
        return f"the tracking server {uri} does not let this user write to experiment {experiment!r}; nothing was run"
    first = errors.first_line(err)[:300]
    return f"the tracking server {uri} refused experiment {experiment!r}: {first}; nothing was run"


def preflight(uri: str, experiment: str) -> str:
    """The experiment's id, once the server answered and accepted a write to it; a UserError
    naming the problem otherwise. Checked once per process and (uri, experiment)."""
    key = (uri, experiment)
    if key in _checked:
        return _checked[key]
    from mlflow import MlflowClient

    with store.environment(PREFLIGHT_HTTP):
        client = MlflowClient(tracking_uri=uri)
        try:
            exp = client.get_experiment_by_name(experiment)
            if exp is None:
                client.create_experiment(experiment)
                exp = client.get_experiment_by_name(experiment)
            if exp.lifecycle_stage != "active":
                raise UserError(
                    f"experiment {experiment!r} is deleted on the tracking server {uri}; restore it "
                    f"(`mlflow experiments restore --experiment-id {exp.experiment_id}`) or choose another with "
                    "--set experiment=NAME; nothing was run"
                )
            scheme = urlsplit(exp.artifact_location).scheme
            if scheme in ("", "file"):
                # A plain path is taken on whichever machine logs: checkpoints would land
                # on the training host's disk, not with the record.
                raise UserError(
                    f"experiment {experiment!r} on {uri} keeps artifacts at {exp.artifact_location}, a path on "
                    "each logging machine; serve artifacts through the server (`mlflow server "
                    "--artifacts-destination DIR`) and use a new experiment; nothing was run"
                )
            # Creating a run needs the same permission as this tag (update on the
            # experiment); the tag also says who last checked, from where.
            client.set_experiment_tag(
                exp.experiment_id,
                schema.TAG_PREFLIGHT,
                f"{socket.gethostname()} {datetime.now(timezone.utc).isoformat(timespec='seconds')}",
            )
        except UserError:
            raise
        except Exception as err:  # noqa: BLE001 - every failure becomes one line that says what to do
            raise UserError(explain(err, uri, experiment)) from None
    _checked[key] = exp.experiment_id
    return exp.experiment_id


def deliver_all(run_ids: list[str], uri: str | None = None) -> dict[str, tuple[str | None, int]]:
    """Deliver waiting outboxes (all of them without run ids) to the server each record was
    written for, or to `uri`; run id -> (why records still wait, None when none does;
    how many records the server refused)."""
    # One client for --tracking-uri, made first: a URI no store opens is refused whether or not records wait.
    given = store.client(uri, "--tracking-uri") if uri else None
    paths = [outbox_file(r) for r in run_ids] if run_ids else sorted(outbox_dir().glob(outbox_file().name))
    done: dict[str, tuple[str | None, int]] = {}
    for path in paths:
        if not path.is_file():
            if not run_ids:
                continue  # delivered by its own run's process since the folder was read
            raise UserError(f"no outbox {path}: nothing waits for that run on this host")
        target = uri or _written_for(path)
        if target is None:  # no record in it: removed under the lock, as any delivered outbox
            Outbox(path.stem, "", None).deliver()
            done[path.stem] = (None, 0)
            continue
        # This command says itself whether the server answered.
        Outbox._warned.add(path)
        box = Outbox(path.stem, target, given or store.client(target, f"the records in {path}"))
        done[path.stem] = (None if box.deliver(full_waits=True) else box.waits_for, box.refused)
    return done


def _written_for(path: Path) -> str | None:
    """The server the first record of an outbox was written for (None: no record,
    or none left: its run's own process delivered them and removed the file)."""
    try:
        lines = path.read_text(errors="replace").splitlines()
    except FileNotFoundError:
        return None
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and isinstance(record.get("uri"), str):
            return record["uri"]
    if any(line.strip() for line in lines):
        raise UserError(f"outbox {path}: no record in it names its server; give --tracking-uri")
    return None


HELP = "the tracking server: check that it answers, deliver records kept during an outage"
DESCRIPTION = """\
When the study's store is a tracking server (MLFLOW_TRACKING_URI or the
project's mlruns_remote.txt names an http(s) URI), every step first checks
that it answers and takes writes, and stops with one line if not. If the
server stops answering during a run, the run goes on: what could not be
written waits in <home>/outbox/<run id>.jsonl, in order, and is sent when
the server answers again; what is still waiting at the run's end is named,
with the command that delivers it.

  check    run that preflight alone, without starting a step
  deliver  send the records that wait in the outbox, once the server is back
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    d = sub.add_parser(
        "deliver", help="send records kept during an outage (<home>/outbox/*.jsonl) to the server",
        description=(
            "Send the records a step kept while the tracking server did not answer (<home>/outbox/RUN_ID.jsonl) to "
            "the server they were written for (or --tracking-uri), in order, the runs' ends included. A record "
            "delivered before is not doubled. Exit 2 when the server still does not answer (or a local store's disk is still full); what waits stays."
        ),
    )  # fmt: skip
    d.add_argument("run_ids", nargs="*", metavar="RUN_ID", help="only these runs' outboxes (default: all)")
    d.add_argument("--tracking-uri", default=None, help="deliver here instead of the server the records were written for (default: that server)")
    c = sub.add_parser(
        "check", help="the preflight alone: does the tracking server answer and take writes?",
        description=(
            "What every step checks before any work, alone: the tracking server (MLFLOW_TRACKING_URI, or the "
            "project's mlruns_remote.txt) answers, the experiment exists or can be made, keeps its artifacts on the "
            "server, and takes a write (a tag naming this host). One line; exit 2 with what to do when not."
        ),
    )  # fmt: skip
    c.add_argument("--experiment", default=None,
                   help=("the experiment that must take writes, created if missing as a step would (default: the one a step "
                         f"would write to: MLFLOW_EXPERIMENT_NAME, then MLFLOW_EXPERIMENT_ID, or {store.DEFAULT_EXPERIMENT})"))  # fmt: skip


def main(args: argparse.Namespace) -> int:
    if args.command == "check":
        experiment = args.experiment if args.experiment is not None else store.chosen_experiment() or store.DEFAULT_EXPERIMENT
        try:
            config_mod.check_experiment(experiment)
        except ValueError as err:
            raise UserError(f"--experiment {experiment!r}: {err}") from None
        uri = store.tracking_uri()
        if not store.is_http(uri):
            print(f"tracking URI {uri} is not a server; nothing to check")
            return 0
        exp_id = preflight(uri, experiment)
        print(f"tracking server {uri} answers; experiment {experiment!r} (id {exp_id}) takes writes")
        return 0
    store.use_http_defaults()
    done = deliver_all(args.run_ids, args.tracking_uri)
    left = {run: why for run, (why, _) in done.items() if why is not None}
    if left:
        runs = f"{len(left)} run{'s' if len(left) != 1 else ''}"
        why = "; ".join(sorted(set(left.values())))
        raise UserError(f"the records of {runs} still wait in {outbox_dir()}: {why} (run this again later)")
    refused = sum(n for _, n in done.values())
    if not done:
        print(f"no records wait in {outbox_dir()}")
    elif refused:
        print(f"no records wait any more in {outbox_dir()}; the server refused {refused} of them (kept aside, as said above)")
    else:
        print(f"delivered the waiting records of {len(done)} runs")
    return 0
