"""From the schedule to packed microbatches, the same way in both arms.

The schedule fixes which documents form the global batch of update k. The
split between workers balances work: `shares` gives each worker at least one
document and makes the workers' summed work (training passes each
document's executed FLOPs, numerics.flops; tokens where no model is at hand)
as even as it can, because an update of a DDP arm lasts as long as its
slowest worker. Counts may differ: a rank with one document more computes
the same as one with fewer, longer ones. The split is a pure function of
(schedule, work, workers) and `assignment` records it. Which worker holds a
document changes no number that matters: every worker divides by the global
batch's W_k and DDP sums. Within a local batch, documents are sorted by
length, shortest first, and cut into microbatches of the arm's size; the
last one may be partial.

A microbatch is *packed*: its documents are concatenated into one row (batch
dimension 1) with no padding, so every computed token is a real token.
`position_ids` restart at 0 for every document (rotary positions as if each
were alone) and `bounds` says where each document starts and ends, so that
attention never crosses a document (objective.WeightedNLL). The first token
of every document weighs 0 in the row: position 0 is never a target (nothing
precedes it), and in a packed row it would otherwise be predicted from the
previous document's last token.

Only the attributes `input_ids` and `weights` of a document are used, so any
object that has them (coopstudy.inputs.data.Document, a test's stand-in) works.
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
    """W_k: the summed target weight of the whole global batch, the one denominator
    of the update in every arm and on every worker."""


@dataclass(frozen=True)
class Microbatch:
    """Tensors of one packed microbatch, on the device that computes it: its
    documents back to back in one row of N = `tokens` positions, no padding."""

    input_ids: torch.Tensor
    """[1, N] the documents' tokens, one after the other."""
    position_ids: torch.Tensor
    """[1, N] each token's position within its own document: 0..n-1 per document."""
    weights: torch.Tensor
    """[1, N] target weight of each token; 0 at every document's first token."""
    bounds: tuple[int, ...]
    """Where the documents start, and N at the end: document j is [bounds[j], bounds[j+1])."""
    tokens: int
    """Real tokens; also the positions computed (N)."""

    @property
    def documents(self) -> int:
        return len(self.bounds) - 1


@dataclass(frozen=True)
class PaddingEfficiency:
    real_tokens: int
    computed_tokens: int

    @property
    def ratio(self) -> float:
        return self.real_tokens / self.computed_tokens if self.computed_tokens else 1.0


def shares(global_batch: Sequence[int], work: Mapping[int, float] | Sequence[float], world_size: int) -> list[list[int]]:
    """Every worker's local batch of one global batch, in schedule order, with
    the work (`work[i]` of document i) as even as a greedy fill and local
    moves make it; every worker holds at least one document.

    The largest documents first, one to each worker, then each to the worker
    with the least work (ties: the lower rank); then, while moving one
    document from the busiest of two workers to the other, or swapping one
    for one, narrows their gap, the move that narrows it most is made (ties:
    the earliest in schedule order). Deterministic: it reads only positions
    and work, so every rank derives the same split.
    """
    if len(global_batch) < world_size:
        raise ValueError(f"a global batch of {len(global_batch)} documents does not split over {world_size} workers")
    w = [work[i] for i in global_batch]
    parts: list[list[int]] = [[] for _ in range(world_size)]
    load = [0.0] * world_size
    for k, j in enumerate(sorted(range(len(global_batch)), key=lambda j: (-w[j], j))):
        r = k if k < world_size else min(range(world_size), key=lambda r: (load[r], r))
        parts[r].append(j)
        load[r] += w[j]
    improved = True
    while improved:
        improved = False
        for p in range(world_size):
            for q in range(world_size):
                gap = load[p] - load[q]
                if gap <= 0:
                    continue
                best: tuple[float, int, int | None] | None = None
                for a in sorted(parts[p]):
                    # Moving a alone (p keeps at least one), or swapping it for b.
                    options = ([None] if len(parts[p]) > 1 else []) + sorted(parts[q])
                    for b in options:
                        narrowed = abs(gap - 2 * (w[a] - (0.0 if b is None else w[b])))
                        if narrowed < gap and (best is None or narrowed < best[0]):
                            best = (narrowed, a, b)
                if best is not None:
                    _, a, b = best
                    parts[p].remove(a)
                    parts[q].append(a)
                    moved = w[a]
                    if b is not None:
                        parts[q].remove(b)
                        parts[p].append(b)
                        moved -= w[b]
                    load[p] -= moved
                    load[q] += moved
                    improved = True
    return [[global_batch[j] for j in sorted(part)] for part in parts]


def assignment(schedule: Sequence[Sequence[int]], work: Mapping[int, float] | Sequence[float], world_size: int) -> list[list[list[int]]]:
    """The recorded split: [update][worker] -> training indices."""
    return [shares(row, work, world_size) for row in schedule]


def sort_and_cut(
    local: Sequence[int], lengths: Mapping[int, int] | Sequence[int], microbatch: int, *, sort: bool = True
) -> list[list[int]]:
    """Cut a local batch into microbatches of `microbatch` documents.

    Shortest first, as the protocol fixes (with padding it put the partial
    last microbatch on the longest documents, so the fewest rows were padded
    to the greatest length; packed microbatches compute the same tokens
    whatever the order). Python's sort is stable, so documents of equal
    length keep schedule order and the cut is deterministic.
    """
    order = sorted(local, key=lambda i: lengths[i]) if sort else list(local)
    return [order[i : i + microbatch] for i in range(0, len(order), microbatch)]


def target_weight(document: DocumentLike) -> float:
    """Σ w over the document's targets: every token but the first, which
    nothing predicts (the objective never reads weights[0])."""
    return math.fsum(document.weights[1:])


def total_weight(documents: Sequence[DocumentLike], global_batch: Sequence[int]) -> float:
    """W_k = Σ w over every target token of every document of the global batch.

    Position 0 is not a target, so its weight (0 in every prepared document)
    never counts, in the numerator or here. math.fsum: the denominator must
    not depend on summation order, so that every arm and every worker derives
    the identical float.
    """
    return math.fsum(target_weight(documents[i]) for i in global_batch)


def plan_update(
    documents: Sequence[DocumentLike],
    global_batch: Sequence[int],
    rank: int,
    world_size: int,
    microbatch: int,
    work: Mapping[int, float] | Sequence[float] | None = None,
) -> UpdatePlan:
    """`work`: each document's cost to the split (tokens when None)."""
    lengths = {i: len(documents[i].input_ids) for i in global_batch}
    local = shares(global_batch, lengths if work is None else work, world_size)[rank]
    return UpdatePlan(
        local=local,
        microbatches=sort_and_cut(local, lengths, microbatch),
        total_weight=total_weight(documents, global_batch),
    )


def pack(
    documents: Sequence[DocumentLike],
    *,
    device: torch.device | str = "cpu",
    weight_dtype: torch.dtype = torch.float32,
) -> Microbatch:
    """Concatenate the documents of one microbatch into one row, in the given order.

    Order does not change any number that matters (attention never crosses a
    document and the loss is a sum), so the order of `documents` is kept.
    """
    if not documents:
        raise ValueError("a microbatch needs at least one document")
    ids: list[int] = []
    positions: list[int] = []
    weights: list[float] = []
    bounds = [0]
    for doc in documents:
        n = len(doc.input_ids)
        if n == 0:
            raise ValueError("an empty document cannot be packed")
        if len(doc.weights) != n:
            raise ValueError(f"document has {n} tokens but {len(doc.weights)} weights")
        ids.extend(doc.input_ids)
        positions.extend(range(n))
        # Position 0 is never a target; in the row it would be predicted from
        # the previous document's last token.
        weights.append(0.0)
        weights.extend(doc.weights[1:])
        bounds.append(bounds[-1] + n)
    return Microbatch(
        input_ids=torch.tensor([ids], dtype=torch.long).to(device),
        position_ids=torch.tensor([positions], dtype=torch.long).to(device),
        weights=torch.tensor([weights], dtype=weight_dtype).to(device),
        bounds=tuple(bounds),
        tokens=bounds[-1],
    )


def padding_efficiency(
    lengths: Sequence[int],
    schedule: Sequence[Sequence[int]],
    world_size: int,
    microbatch: int,
    *,
    sort: bool = True,
) -> PaddingEfficiency:
    """Real tokens / computed tokens over a whole schedule for one arm's shape,
    were each microbatch right-padded to its longest document (workers' shares
    balanced by tokens): what packing saves. Training packs, and computes
    real tokens only."""
    real = computed = 0
    for row in schedule:
        for local in shares(row, lengths, world_size):
            for mb in sort_and_cut(local, lengths, microbatch, sort=sort):
                sizes = [lengths[i] for i in mb]
                real += sum(sizes)
                computed += len(sizes) * max(sizes)
    return PaddingEfficiency(real, computed)
