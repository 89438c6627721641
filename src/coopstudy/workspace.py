"""Where the study keeps its files: prepared inputs, seed checkpoints, final
weights, the ledger and locks. One folder, beside the local tracking store by
default; COOPSTUDY_HOME moves it."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from coopstudy.tracking import PROJECT_ROOT


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
