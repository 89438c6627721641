"""One job per device at a time.

The protocol runs control and compressed sequentially, never two training
jobs on one device: a second job sharing a device would slow both and spoil
every timing. `device_lock(devices, holder)` takes one lock file per device
under <home>/locks/ (fcntl.flock, so a crashed job's locks vanish with its
process) and refuses, naming the holder's pid, when any is taken. Jobs of
one process that compute on the device (evaluate, dev-split, the benches)
hold it too (`one_process_job`): their work would spoil a training job's
timings, and a training job theirs.

The holder writes itself into the file (pid, what it is, since when) and
adds, as it goes, the runs it writes and the process group of the
processes it launched (`Held.note`); a clean release empties the file. A
file that is free but not empty was left by a holder that died without
releasing it (SIGKILL, the out-of-memory killer, a lost host): the next job
says so, stops what the dead job launched if it still runs (its processes
were in their own process group, which the file names), ends the dead job's
runs that are still RUNNING as KILLED with the reason, in the tracking store
the file names, and proceeds. A store that does not answer (or whose disk is
full) gets that end in the run's outbox, as any record of an outage, and the
line says which `remote deliver` ends the run.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import sys
import time
from collections.abc import Iterator, Sequence
from typing import IO, Any

from coopstudy import errors, workspace
from coopstudy.errors import RefusedError
from coopstudy.run import launch

STALE_STOP_GRACE_S = 10.0
"""How long a dead job's leftover processes get to stop after SIGTERM before SIGKILL."""


def _info(fh: IO[str]) -> dict[str, Any] | None:
    fh.seek(0)
    try:
        text = fh.read()
    except UnicodeDecodeError:
        return {}  # not what a job wrote: a holder unknown, as for any other garbage
    if not text.strip():
        return None
    try:
        info = json.loads(text)
        return info if isinstance(info, dict) else {}
    except ValueError:
        return {}


def _describe(info: dict[str, Any] | None) -> str:
    try:
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(info["since"]))  # type: ignore[index]
        return f"pid {info['pid']} ({info['holder']}, since {since})"  # type: ignore[index]
    except (KeyError, TypeError, ValueError, OverflowError):
        # The holder took the lock a moment ago and has not written itself yet.
        return "a process that is starting"


def _holder_of(fh: IO[str]) -> str:
    return _describe(_info(fh))


class Held:
    """The devices one job holds; what it adds to the lock files stays there
    until it releases them, for whoever finds them after a crash."""

    def __init__(self, files: list[IO[str]], info: dict[str, Any]):
        self._files = files
        self.info = info

    def note(self, *, run_id: str | None = None, process_group: int | None = None) -> None:
        """Add a run this job writes, or the process group of what it launched
        (None: that launch ended)."""
        if run_id is not None and run_id not in self.info["runs"]:
            from coopstudy.record import store

            self.info["runs"].append(run_id)
            # Where this job's runs are: the next job ends them there if this one dies.
            self.info["tracking_uri"] = store.tracking_uri()
        if process_group is not None:
            try:
                started = _create_time(process_group)
            except Exception:  # noqa: BLE001 - it has exited already
                started = None
            self.info["group"] = {"pgid": process_group, "started": started}
        elif run_id is None:
            self.info.pop("group", None)
        self.write()

    def write(self) -> None:
        """Write the holder into every lock file it holds."""
        text = json.dumps(self.info)
        for fh in self._files:
            fh.seek(0)
            fh.truncate()
            fh.write(text)
            fh.flush()


def _create_time(pid: int) -> float:
    import psutil

    return psutil.Process(pid).create_time()


def _group_members(group: dict[str, Any]) -> list[Any]:
    """The live processes of the dead job's launch: its process group, when
    the group leader is the process it launched (not a reused pid) or gone."""
    import psutil

    pgid = group.get("pgid")
    if not isinstance(pgid, int) or pgid <= 1:
        return []
    try:
        leader = psutil.Process(pgid)
        if group.get("started") is not None and abs(leader.create_time() - group["started"]) > 1.0:
            return []  # the pid was reused by an unrelated process
    except psutil.NoSuchProcess:
        pass
    return launch.group_members(pgid)


def _stop_leftovers(group: dict[str, Any]) -> list[int]:
    """Stop what the dead job launched; the pids that were still running."""
    members = _group_members(group)
    launch.stop_processes(members, STALE_STOP_GRACE_S)
    return sorted(p.pid for p in members)


def _end_dead_runs(info: dict[str, Any], reason: str) -> list[str]:
    """End the dead job's runs that are still RUNNING (KILLED, with the reason),
    in the store it wrote them to; the words of what was done and what waits."""
    from coopstudy.record import outbox, store, writer

    runs = [r for r in info.get("runs", []) if isinstance(r, str)]
    if not runs:
        return []
    uri = info.get("tracking_uri") if isinstance(info.get("tracking_uri"), str) else None
    record = outbox.dead_run_end(reason, reason[: writer.MAX_TAG_CHARS])
    ended: list[str] = []
    waiting: dict[str, list[str]] = {}
    """Why -> the runs whose end waits in their outbox for that."""
    said: list[str] = []
    away: str | None = None
    """Why the store did not take the first end: the rest wait without asking it again."""
    try:
        client = store.client(uri, where="the dead job's lock") if uri else store.client()
        uri = uri or store.tracking_uri()
        if store.is_http(uri):
            store.use_http_defaults()
    except Exception as err:  # noqa: BLE001 - the record's trouble must not keep the devices
        return [f"could not end its runs {', '.join(runs)}: {errors.first_line(err)[:300]}"]
    for run_id in runs:
        box = outbox.Outbox(run_id, uri, client)
        # Its own records waiting for the store: the end goes behind them, in order.
        why = f"its records wait in {box.path}" if box.path.exists() else away
        if why is None:
            try:
                if outbox.end_dead_run(client, run_id, record):
                    ended.append(run_id)
                continue
            except Exception as err:  # noqa: BLE001 - said, and the next run is tried
                if outbox.is_outage(err):
                    why = away = f"the server {uri} does not answer ({outbox.reason(err)})"
                elif store.on_full_disk(err):
                    why = away = store.full_disk_said(uri)
                else:
                    said.append(f"could not end its run {run_id} in {uri}: {errors.first_line(err)[:300]}")
                    continue
        try:
            box.keep(record, for_deliver=True)
        except OSError as err:
            said.append(f"could not keep the end of its run {run_id} in {box.path} ({err.strerror or err}): it stays RUNNING ({why})")
            continue
        waiting.setdefault(why, []).append(run_id)
    if ended:
        said.insert(0, f"ended its run{'s' if len(ended) > 1 else ''} {', '.join(ended)} as KILLED")
    for why, ids in waiting.items():
        many = len(ids) > 1
        said.append(f"its run{'s' if many else ''} {', '.join(ids)} stay{'' if many else 's'} RUNNING until python -m coopstudy "
                    f"remote deliver {' '.join(ids)} sends {'their' if many else 'its'} end ({why})")  # fmt: skip
    return said


def _recover(device: str, host: str, info: dict[str, Any], holder: str) -> None:
    """The lock was free but not empty: its holder died holding it."""
    import psutil

    who = _describe(info)
    pid = info.get("pid")
    gone = "is gone" if not (isinstance(pid, int) and psutil.pid_exists(pid)) else "no longer holds it"
    stopped = _stop_leftovers(info["group"]) if isinstance(info.get("group"), dict) else []
    reason = f"the job {who} died without releasing device {device} on {host} (killed?); found by {holder} (pid {os.getpid()})"
    if stopped:
        reason += f", which stopped its leftover processes {', '.join(map(str, stopped))}"
    parts = [f"device {device} on {host}: the lock of {who} is stale, its process {gone}"]
    if stopped:
        parts.append(f"stopped its leftover processes {', '.join(map(str, stopped))}")
    parts += _end_dead_runs(info, reason)
    print(f"coopstudy: {'; '.join(parts)}; taking the device", file=sys.stderr, flush=True)


@contextlib.contextmanager
def device_lock(devices: Sequence[str], holder: str) -> Iterator[Held]:
    """Hold every device in `devices` (e.g. ["cpu"], ["cuda0", "cuda1"]) on this host.

    Locks are taken in sorted order, so two jobs asking for overlapping
    devices cannot each hold half of them.
    """
    folder = workspace.subdir("locks")
    host = socket.gethostname()
    held: list[IO[str]] = []
    settled: list[IO[str]] = []
    """Held files whose dead job (if any) was recovered: safe to empty."""
    written = False
    info: dict[str, Any] = {"pid": os.getpid(), "holder": holder, "since": time.time(), "runs": []}
    recovered: list[dict[str, Any]] = []
    try:
        for device in sorted(set(devices)):
            fh = open(folder / f"{host}-{device}.lock", "a+")
            try:
                fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                who = _holder_of(fh)
                fh.close()
                raise RefusedError(
                    f"device {device} on {host} is in use by job {who}; "
                    "wait for it to finish (jobs never share a device)"
                ) from None
            left = _info(fh)
            held.append(fh)
            if left is not None and left.get("pid") != os.getpid():
                # One dead job held every device it asked for: recover it once.
                if not any(left == r for r in recovered):
                    _recover(device, host, left, holder)
                    recovered.append(left)
            settled.append(fh)
        lock = Held(held, info)
        lock.write()
        written = True
        yield lock
    finally:
        for fh in held:
            # A dead job's name stays until its recovery is done: a stop during
            # it leaves its runs and processes for the next job to end.
            if written or fh in settled:
                fh.truncate(0)
            fh.close()


@contextlib.contextmanager
def one_process_job(holder: str, devices: Sequence[str] | None = None) -> Iterator[Held]:
    """The device a job of this one process computes on (the first one a
    training job would take, unless `devices` says), held as training holds it."""
    with device_lock(devices or launch.local_devices(1), holder) as held:
        yield held
