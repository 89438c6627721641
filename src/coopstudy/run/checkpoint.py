"""Final weights on disk: safetensors and tokenizer, hashed, then read back.

`save` writes a Hugging Face directory (`from_pretrained` loads it), takes the
sha256 of model.safetensors, and calls `verify` before returning: the file is
hashed again and every stored tensor is compared, bit for bit, with the
weights still in memory. A run is called finished only after that; any
difference raises `CheckpointMismatch`, which fails the run.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from coopstudy import workspace


class CheckpointMismatch(Exception):
    """What is on disk is not what was trained."""


@dataclass(frozen=True)
class Saved:
    folder: Path
    sha256: str
    """Of model.safetensors."""
    seconds: float
    """Writing, hashing and reading back."""


def save(model: nn.Module, tokenizer: Any, folder: str | Path) -> Saved:
    """Write `model` (a plain Hugging Face model, not DDP) and `tokenizer`, then verify."""
    start = time.perf_counter()
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    # One file, whatever the model size (transformers shards only above
    # max_shard_size): the study's record names one weights hash per model.
    model.save_pretrained(folder, max_shard_size="1000GB")
    tokenizer.save_pretrained(folder)
    path = folder / workspace.WEIGHTS_FILE
    if not path.is_file():
        raise CheckpointMismatch(f"{folder}: save_pretrained wrote no {workspace.WEIGHTS_FILE}")
    digest = workspace.sha256_file(path)
    verify(folder, model.state_dict(), digest)
    return Saved(folder=folder, sha256=digest, seconds=time.perf_counter() - start)


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
