"""From the schedule to padded microbatches, the same way in both arms.

The schedule fixes which documents form the global batch of update k. A
worker's local batch is a contiguous slice of it (worker r takes
global[r*L:(r+1)*L], L = global batch / workers), so the split is a pure
function of (schedule, workers) and `assignment` records it. Within a local
batch, documents are sorted by length, shortest first, and cut into
microbatches of the arm's size; the last one may be partial. A microbatch is
padded to its own longest document only.

Only the attributes `input_ids` and `weights` of a document are used, so any
object that has them (coopstudy.data.Document, a test's stand-in) works.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch


class DocumentLike(Protocol):
    input_ids: Sequence[int]
    weights: Sequence[float]


@dataclass(frozen=True)
class UpdatePlan:
    """What one worker computes for one update."""

    local: list[int]
    """Indices into the training documents: this worker's local batch, in schedule order."""
    microbatches: list[list[int]]
    """The local batch sorted by length and cut; indices into the training documents."""
    total_weight: float
    """W_k: the summed token weight of the whole global batch, the one denominator
    of the update in every arm and on every worker."""


@dataclass(frozen=True)
class Microbatch:
    """Tensors of one padded microbatch, on the device that computes it."""

    input_ids: torch.Tensor
    """[B, T] token ids; T is the longest document of this microbatch."""
    attention_mask: torch.Tensor
    """[B, T] 1 for real tokens, 0 for padding (padding is on the right)."""
    weights: torch.Tensor
    """[B, T] target weight of each token (0 for prompt tokens, padding and position 0)."""
    tokens: int
    """Real (unpadded) tokens."""


@dataclass(frozen=True)
class PaddingEfficiency:
    real_tokens: int
    computed_tokens: int

    @property
    def ratio(self) -> float:
        return self.real_tokens / self.computed_tokens if self.computed_tokens else 1.0


def local_slice(global_batch: Sequence[int], rank: int, world_size: int) -> list[int]:
    """Worker `rank`'s contiguous share of one global batch."""
    if len(global_batch) % world_size:
        raise ValueError(f"a global batch of {len(global_batch)} documents does not split over {world_size} workers")
    size = len(global_batch) // world_size
    return list(global_batch[rank * size : (rank + 1) * size])


def assignment(schedule: Sequence[Sequence[int]], world_size: int) -> list[list[list[int]]]:
    """The recorded split: [update][worker] -> training indices."""
    return [[local_slice(row, r, world_size) for r in range(world_size)] for row in schedule]


def sort_and_cut(
    local: Sequence[int], lengths: Mapping[int, int] | Sequence[int], microbatch: int, *, sort: bool = True
) -> list[list[int]]:
    """Cut a local batch into microbatches of `microbatch` documents.

    Shortest first: the partial last microbatch then holds the longest
    documents, so the fewest rows are padded to the greatest length (longest
    first would pad a full microbatch to the longest document and leave the
    short remainder alone). Python's sort is stable, so documents of equal
    length keep schedule order and the cut is deterministic.
    """
    order = sorted(local, key=lambda i: lengths[i]) if sort else list(local)
    return [order[i : i + microbatch] for i in range(0, len(order), microbatch)]


def total_weight(documents: Sequence[DocumentLike], global_batch: Sequence[int]) -> float:
    """W_k = Σ w over every token of every document of the global batch.

    math.fsum: the denominator must not depend on summation order, so that
    every arm and every worker derives the identical float.
    """
    return math.fsum(math.fsum(documents[i].weights) for i in global_batch)


def plan_update(
    documents: Sequence[DocumentLike],
    global_batch: Sequence[int],
    rank: int,
    world_size: int,
    microbatch: int,
) -> UpdatePlan:
    local = local_slice(global_batch, rank, world_size)
    lengths = {i: len(documents[i].input_ids) for i in local}
    return UpdatePlan(
        local=local,
        microbatches=sort_and_cut(local, lengths, microbatch),
        total_weight=total_weight(documents, global_batch),
    )


def collate(
    documents: Sequence[DocumentLike],
    *,
    device: torch.device | str = "cpu",
    weight_dtype: torch.dtype = torch.float32,
    pad_id: int = 0,
) -> Microbatch:
    """Right-pad to the longest document of this microbatch.

    Padded positions get weight 0 and attention mask 0; with right padding and
    a causal model no real token ever attends to them, so `pad_id` cannot
    change any weighted term.
    """
    width = max(len(d.input_ids) for d in documents)
    ids = torch.full((len(documents), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(documents), width), dtype=torch.long)
    weights = torch.zeros((len(documents), width), dtype=weight_dtype)
    for row, doc in enumerate(documents):
        n = len(doc.input_ids)
        if len(doc.weights) != n:
            raise ValueError(f"document has {n} tokens but {len(doc.weights)} weights")
        ids[row, :n] = torch.tensor(doc.input_ids, dtype=torch.long)
        mask[row, :n] = 1
        weights[row, :n] = torch.tensor(doc.weights, dtype=weight_dtype)
    return Microbatch(
        input_ids=ids.to(device),
        attention_mask=mask.to(device),
        weights=weights.to(device),
        tokens=sum(len(d.input_ids) for d in documents),
    )


def padding_efficiency(
    lengths: Sequence[int],
    schedule: Sequence[Sequence[int]],
    world_size: int,
    microbatch: int,
    *,
    sort: bool = True,
) -> PaddingEfficiency:
    """Real tokens / computed tokens over a whole schedule for one arm's shape."""
    real = computed = 0
    for row in schedule:
        for rank in range(world_size):
            for mb in sort_and_cut(local_slice(row, rank, world_size), lengths, microbatch, sort=sort):
                sizes = [lengths[i] for i in mb]
                real += sum(sizes)
                computed += len(sizes) * max(sizes)
    return PaddingEfficiency(real, computed)
