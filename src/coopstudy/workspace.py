"""Where the study keeps its files: prepared inputs, seed checkpoints, final
weights, the ledger and locks. One folder, `.coopstudy/` in the project the
command runs in (beside MLflow's local default store, `mlflow.db`); the
environment variable COOPSTUDY_HOME moves it. Imports only the project's
errors: every layer may use it."""

from __future__ import annotations

import hashlib
import json
import os
import socket
from pathlib import Path
from typing import Any

from coopstudy import errors
from coopstudy.errors import UserError

HOME_VARIABLE = "COOPSTUDY_HOME"
WEIGHTS_FILE = "model.safetensors"
"""The weights file of every checkpoint the study writes or reads (HF format)."""
CHECKPOINTS = "checkpoints"
"""`<home>/checkpoints/<run id>/`: each train run's final checkpoint."""


def project_root() -> Path:
    """The project a command runs in: the nearest folder at or above the
    working directory that holds an MLproject file, else the working directory.
    Its configs/, mlruns_remote.txt, mlflow.db and .coopstudy/ are the ones used,
    whichever checkout the installed package came from."""
    here = Path.cwd().resolve()
    return next((d for d in (here, *here.parents) if (d / "MLproject").is_file()), here)


def home() -> Path:
    root = Path(os.environ.get(HOME_VARIABLE) or project_root() / ".coopstudy")
    if not root.is_absolute():
        # Named from the folder the step started in. The processes it starts
        # (ranks, probes) run in the project folder and inherit the
        # environment: they must find the same home, not make another there.
        root = Path.cwd() / root
        os.environ[HOME_VARIABLE] = str(root)
    try:
        root.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        if root.is_symlink() and not root.exists():
            # A link to nothing (or a loop of links): its parent is no file, as the line below would say.
            raise UserError(f"the study's home {root}: a symbolic link that leads to no folder (set {HOME_VARIABLE} to move it)") from None
        blocking = next(p for p in (root, *root.parents) if p.exists())
        raise UserError(f"the study's home {root}: {blocking} is a file, not a folder (set {HOME_VARIABLE} to move it)") from None
    except PermissionError:
        raise UserError(f"the study's home {root}: permission denied (set {HOME_VARIABLE} to move it)") from None
    except OSError as err:
        raise UserError(f"the study's home {root}: cannot be made ({err.strerror}; set {HOME_VARIABLE} to move it)") from None
    return root


NOT_A_REGULAR_FILE = "not a regular file (a pipe, socket or device)"
"""What a path the study reads as a file is, when it is there but no file: a FIFO would block the read for ever."""


def subdir(*parts: str) -> Path:
    root = home()
    path = root.joinpath(*parts)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        if err.errno in errors.FULL_DISK:
            raise  # a full disk is said as one (cli.main)
        raise UserError(f"the study's home {root}: cannot make {path} ({err.strerror}); set {HOME_VARIABLE} to a folder it can write") from None
    return path


def checkpoint_folder(run_id: str, *, make: bool = False) -> Path:
    """`<home>/checkpoints/<run id>/`, where train run `run_id`'s rank 0 keeps its
    final checkpoint (made when `make`, as the rank that saves it does)."""
    return subdir(CHECKPOINTS, run_id) if make else home() / CHECKPOINTS / run_id


def write_text(path: Path, text: str) -> None:
    """`text` as the whole of `path`, or the file as it was: written under a
    temporary name and renamed over it, so a full disk or an interrupt never
    leaves a committed file half written (which every later step would refuse
    as edited). A file that already holds `text` is left alone."""
    data = text.encode()
    if path.is_file() and path.read_bytes() == data:
        return
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    try:
        with open(tmp, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def sha256_file(path: str | Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256_json(value: Any) -> str:
    """sha256 of `value` as canonical JSON (sorted keys, no spaces): the digest of
    a ledger entry and of a gate receipt."""
    return sha256_bytes(json.dumps(value, sort_keys=True, separators=(",", ":")).encode())


def relative(path: Path) -> str:
    """`path` as the study folder's ledger entries name it."""
    return str(Path(path).relative_to(home()))


def free_port() -> int:
    """A TCP port free on loopback now: a rendezvous port, a test's server."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
