"""One training job per device at a time.

The protocol runs control and compressed sequentially, never two training
jobs on one device: a second job sharing a device would slow both and spoil
every timing. `device_lock(devices, holder)` takes one lock file per device
under <home>/locks/ (fcntl.flock, so a crashed job's locks vanish with its
process) and refuses, naming the holder's pid, when any is taken.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import time
from collections.abc import Iterator, Sequence
from typing import IO

from coopstudy import workspace
from coopstudy.errors import RefusedError


def _holder_of(fh: IO[str]) -> str:
    fh.seek(0)
    try:
        info = json.loads(fh.read())
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(info["since"]))
        return f"pid {info['pid']} ({info['holder']}, since {since})"
    except (ValueError, KeyError, TypeError):
        # The holder took the lock a moment ago and has not written itself yet.
        return "a process that is starting"


@contextlib.contextmanager
def device_lock(devices: Sequence[str], holder: str) -> Iterator[None]:
    """Hold every device in `devices` (e.g. ["cpu"], ["cuda0", "cuda1"]) on this host.

    Locks are taken in sorted order, so two jobs asking for overlapping
    devices cannot each hold half of them.
    """
    folder = workspace.subdir("locks")
    host = socket.gethostname()
    held: list[IO[str]] = []
    try:
        for device in sorted(set(devices)):
            fh = open(folder / f"{host}-{device}.lock", "a+")
            try:
                fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                who = _holder_of(fh)
                fh.close()
                raise RefusedError(
                    f"device {device} on {host} is in use by training job {who}; "
                    "wait for it to finish (jobs never share a device)"
                ) from None
            fh.seek(0)
            fh.truncate()
            fh.write(json.dumps({"pid": os.getpid(), "holder": holder, "since": time.time()}))
            fh.flush()
            held.append(fh)
        yield
    finally:
        for fh in held:
            fh.truncate(0)
            fh.close()
