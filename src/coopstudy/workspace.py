"""Where the study keeps its files: prepared inputs, seed checkpoints, final
weights, the ledger and locks. One folder, beside the local tracking store by
default; COOPSTUDY_HOME moves it. Imports nothing of the project's: every
layer may use it."""

from __future__ import annotations

import hashlib
import os
import socket
from pathlib import Path

PROJECT_ROOT = Path(__file__).resolve().parents[2]
WEIGHTS_FILE = "model.safetensors"
"""The weights file of every checkpoint the study writes or reads (HF format)."""


def home() -> Path:
    root = Path(os.environ.get("COOPSTUDY_HOME") or PROJECT_ROOT / ".coopstudy")
    root.mkdir(parents=True, exist_ok=True)
    return root


def subdir(*parts: str) -> Path:
    path = home().joinpath(*parts)
    path.mkdir(parents=True, exist_ok=True)
    return path


def sha256_file(path: str | Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def relative(path: Path) -> str:
    """`path` as the study folder's ledger entries name it."""
    return str(Path(path).relative_to(home()))


def free_port() -> int:
    """A TCP port free on loopback now: a rendezvous port, a test's server."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
