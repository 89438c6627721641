"""Final weights on disk: safetensors and tokenizer, hashed, then read back.

`save` writes a Hugging Face directory (`from_pretrained` loads it), takes the
sha256 of model.safetensors, and calls `verify` before returning: the file is
hashed again and every stored tensor is compared, bit for bit, with the
weights still in memory. A run is called finished only after that; any
difference raises `CheckpointMismatch`, which fails the run.

Nothing half-written ever sits at the checkpoint's name: the files are
written into a temporary folder beside it, verified there, flushed to disk,
and only then renamed into place. A full disk (or any other write error)
raises `CheckpointWriteFailed`, one line, and leaves nothing behind; an
interrupt does the same. An existing checkpoint is never overwritten.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from torch import nn

from coopstudy import workspace
from coopstudy.errors import UserError


_OS_ERROR = re.compile(r"\(os error (\d+)\)")
"""How safetensors says a failed write (`I/O error: No space left on device
(os error 28)`): its own error, not an OSError."""


class CheckpointMismatch(Exception):
    """What is on disk is not what was trained."""


class CheckpointWriteFailed(UserError):
    """The checkpoint could not be written (a full disk, a lost mount); nothing of it was kept."""


@dataclass(frozen=True)
class Saved:
    folder: Path
    sha256: str
    """Of model.safetensors."""
    seconds: float
    """Writing, hashing and reading back."""


def save(model: nn.Module, tokenizer: Any, folder: str | Path) -> Saved:
    """Write `model` (a plain Hugging Face model, not DDP) and `tokenizer`,
    verify them, then put them at `folder` (which may exist, empty)."""
    start = time.perf_counter()
    folder = Path(folder)
    if folder.is_dir() and any(folder.iterdir()):
        raise CheckpointWriteFailed(f"{folder} already holds files; a checkpoint is never written over another")
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = folder.parent / f".tmp-{folder.name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir()
        # One file, whatever the model size (transformers shards only above
        # max_shard_size): the study's record names one weights hash per model.
        model.save_pretrained(tmp, max_shard_size="1000GB")
        tokenizer.save_pretrained(tmp)
        path = tmp / workspace.WEIGHTS_FILE
        if not path.is_file():
            raise CheckpointMismatch(f"{folder}: save_pretrained wrote no {workspace.WEIGHTS_FILE}")
        _flush(tmp)
        digest = workspace.sha256_file(path)
        verify(tmp, model.state_dict(), digest)
        os.replace(tmp, folder)
        _fsync(folder.parent)
    except (OSError, SafetensorError) as err:
        _discard(tmp, folder)
        said = _write_error(err)
        if said is None:  # safetensors' own, not the disk's: a defect, with its traceback
            raise
        raise CheckpointWriteFailed(f"cannot write the checkpoint {folder}: {said}; nothing of it was kept") from err
    except BaseException:
        _discard(tmp, folder)
        raise
    return Saved(folder=folder, sha256=digest, seconds=time.perf_counter() - start)


def _write_error(err: OSError | SafetensorError) -> str | None:
    """`No space left on device (ENOSPC)`: a failed write, as an OSError says
    it or as safetensors does; None for a safetensors error of another kind."""
    if isinstance(err, OSError):
        return f"{err.strerror or err} ({errno.errorcode.get(err.errno or 0, type(err).__name__)})"
    found = _OS_ERROR.search(str(err))
    if found is None:
        return None
    number = int(found[1])
    return f"{os.strerror(number)} ({errno.errorcode.get(number, found[0])})"


def withdraw(saved: Saved) -> None:
    """Remove a saved checkpoint whose run then failed."""
    _remove(saved.folder)


def _remove(folder: Path) -> None:
    """Nothing at `folder`'s name, even if the removal is cut short (it is
    renamed aside first)."""
    aside = folder.parent / f".tmp-{folder.name}-{os.getpid()}"
    shutil.rmtree(aside, ignore_errors=True)
    try:
        os.replace(folder, aside)
    except OSError:
        aside = folder
    shutil.rmtree(aside, ignore_errors=True)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _flush(folder: Path) -> None:
    """Every file of `folder` on disk, before its name says it is complete."""
    for path in folder.rglob("*"):
        if path.is_file():
            _fsync(path)
    _fsync(folder)


def _discard(tmp: Path, folder: Path) -> None:
    shutil.rmtree(tmp, ignore_errors=True)
    # Files at the checkpoint's name are this save's (`save` refuses a folder
    # that holds any), renamed there before the failure: no run will record them.
    if folder.is_dir() and any(folder.iterdir()):
        _remove(folder)
        return
    # The caller's empty folder goes too: nothing at the checkpoint's name.
    with contextlib.suppress(OSError):
        folder.rmdir()


def verify(folder: str | Path, expected: Mapping[str, torch.Tensor], sha256: str) -> None:
    """Raise CheckpointMismatch unless `folder`'s weights hash to `sha256` and
    hold exactly the tensors of `expected` (a state dict)."""
    path = Path(folder) / workspace.WEIGHTS_FILE
    actual = workspace.sha256_file(path)
    if actual != sha256:
        raise CheckpointMismatch(f"{path}: sha256 {actual} on disk, {sha256} when written")

    from safetensors import safe_open

    try:
        reader = safe_open(str(path), framework="pt", device="cpu")
    except Exception as err:  # noqa: BLE001 - any unreadable file is the same failure
        raise CheckpointMismatch(f"{path}: cannot be read back ({type(err).__name__}: {err})") from None
    stored: set[str] = set()
    with reader:
        # One tensor at a time: the read-back never holds a second copy of the model.
        for name in reader.keys():
            ref = expected.get(name)
            if ref is None:
                raise CheckpointMismatch(f"{path}: holds {name}, which the trained model does not have")
            try:
                got = reader.get_tensor(name)
            except Exception as err:  # noqa: BLE001
                raise CheckpointMismatch(f"{path}: tensor {name} cannot be read back ({type(err).__name__}: {err})") from None
            ref = ref.detach().cpu()
            if got.dtype != ref.dtype or got.shape != ref.shape:
                raise CheckpointMismatch(f"{path}: {name} is {got.dtype} {tuple(got.shape)} on disk, {ref.dtype} {tuple(ref.shape)} in memory")
            # torch.equal is exact; NaN never equals itself, and trained weights hold none.
            if not torch.equal(got, ref):
                raise CheckpointMismatch(f"{path}: {name} differs from the trained weights")
            stored.add(name)
    # save_pretrained writes a tied tensor (SmolLM2's lm_head = embed_tokens)
    # once; a missing name is fine only when it shares storage with a stored one.
    stored_storage = {expected[n].untyped_storage().data_ptr() for n in stored}
    missing = [n for n in expected if n not in stored and expected[n].untyped_storage().data_ptr() not in stored_storage]
    if missing:
        raise CheckpointMismatch(f"{path}: lacks {len(missing)} trained tensors, e.g. {missing[0]}")
