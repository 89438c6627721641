"""The update both arms share: optimizer, schedule, and one function per update.

AdamW with the preset's hyperparameters (train.lr, adam_beta1/2, adam_eps,
weight_decay on every parameter). The learning rate warms up linearly over
train.warmup_updates and then stays constant: update k (from 1) uses
lr · min(1, k / warmup_updates). The protocol fixes only the warmup; no decay
follows it.

`worker_update` is the training update of both arms (the worker, the gate,
the benchmark and the tests all call it): this worker's share of the global
batch, cut into microbatches and collated (batching), then `run_update`.
`reference_update` applies the same optimizer step to the per-document
reference objective, for the gate and the benchmark.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from coopstudy.config import TrainConfig
from coopstudy.numerics import batching, distributed, objective
from coopstudy.numerics.batching import DocumentLike, Microbatch
from coopstudy.numerics.distributed import ByteCounter, DistContext, UpdateBytes
from coopstudy.numerics.objective import Precision


@dataclass(frozen=True)
class UpdateResult:
    loss: float
    """L_k, the global loss (summed over workers): the same number in every arm for the same weights."""
    grad_norm: float
    """L2 norm of the global gradient, before clipping."""
    lr: float
    """The learning rate this update used."""
    tokens: int
    """Real tokens of the global batch."""
    seconds: float
    comm: UpdateBytes | None
    """This worker's collective payload; None with one worker."""


def build_optimizer(params: Iterable[nn.Parameter], train: TrainConfig) -> torch.optim.AdamW:
    return torch.optim.AdamW(
        params,
        lr=train.lr,
        betas=(train.adam_beta1, train.adam_beta2),
        eps=train.adam_eps,
        weight_decay=train.weight_decay,
    )


def warmup_factor(step: int, warmup_updates: int) -> float:
    """Multiplier of lr for the update after `step` completed updates."""
    if warmup_updates <= 0:
        return 1.0
    return min(1.0, (step + 1) / warmup_updates)


def build_scheduler(optimizer: torch.optim.Optimizer, warmup_updates: int) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warmup over `warmup_updates`, then constant; step() once per update."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: warmup_factor(step, warmup_updates))


def _parameters(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]


def run_update(
    net: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    microbatches: Sequence[Microbatch],
    total_weight: float,
    ctx: DistContext,
    *,
    precision: Precision,
    grad_clip: float | None = None,
    counter: ByteCounter | None = None,
) -> UpdateResult:
    """One optimizer update from this worker's microbatches.

    `net` is an objective.WeightedNLL, or DDP around one (distributed.wrap_model);
    `total_weight` is W_k of the whole global batch (batching.plan_update).
    """
    if total_weight <= 0:
        raise ValueError("the global batch has no weighted token (W_k = 0); the objective is undefined")
    start = time.perf_counter()
    # In place, not set_to_none: under DDP the gradients are views into its
    # buckets (gradient_as_bucket_view); zeroing keeps them resident.
    optimizer.zero_grad(set_to_none=False)

    shares: list[torch.Tensor] = []
    local_tokens = 0
    last = len(microbatches) - 1
    for i, mb in enumerate(microbatches):
        # Gradients accumulate locally; only the last microbatch's backward
        # synchronizes them (all-reduce, or PowerSGD), once per update.
        sync = contextlib.nullcontext() if i == last else distributed.no_sync(net)
        with sync:
            with precision.forward(ctx.device.type):
                loss, share = objective.microbatch_loss(net, mb, total_weight, ctx.world_size)
            loss.backward()
        shares.append(share)
        local_tokens += mb.tokens

    # After the synchronizing backward every worker holds the same global
    # gradient, so norm and clipping are computed identically everywhere,
    # and identically to the control arm.
    params = _parameters(optimizer)
    grads = [p.grad for p in params if p.grad is not None]
    grad_norm = torch.nn.utils.get_total_norm(grads, norm_type=2.0)
    if grad_clip is not None:
        torch.nn.utils.clip_grads_with_norm_(params, grad_clip, grad_norm)

    lr = optimizer.param_groups[0]["lr"]
    optimizer.step()
    scheduler.step()

    # The logged loss is L_k itself: each worker's shares summed over workers.
    # One read of the device at the end, not one per microbatch.
    local_loss = float(torch.stack(shares).double().sum())
    loss_sum, tokens = distributed.all_reduce_sums([local_loss, local_tokens], counter)
    comm = counter.end_update() if counter is not None else None
    return UpdateResult(
        loss=loss_sum,
        grad_norm=float(grad_norm),
        lr=lr,
        tokens=int(tokens),
        seconds=time.perf_counter() - start,
        comm=comm,
    )


def worker_update(
    net: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    documents: Sequence[DocumentLike],
    global_batch: Sequence[int],
    ctx: DistContext,
    *,
    microbatch: int,
    precision: Precision,
    grad_clip: float | None = None,
    counter: ByteCounter | None = None,
) -> UpdateResult:
    """One update of this worker on `global_batch` (indices into `documents`,
    the same in every arm): its contiguous share, sorted by length and cut
    into microbatches of `microbatch`, collated on its device, then run_update."""
    plan = batching.plan_update(documents, global_batch, ctx.rank, ctx.world_size, microbatch)
    microbatches = [
        batching.collate([documents[i] for i in mb], device=ctx.device, weight_dtype=precision.param_dtype) for mb in plan.microbatches
    ]
    return run_update(
        net, optimizer, scheduler, microbatches, plan.total_weight, ctx, precision=precision, grad_clip=grad_clip, counter=counter
    )


def reference_update(
    lm: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    documents: Sequence[DocumentLike],
    total_weight: float,
    *,
    precision: Precision,
    grad_clip: float | None = None,
    device: torch.device | str = "cpu",
) -> UpdateResult:
    """The same update from the per-document reference objective, one process.

    Norm and clipping are written out here rather than shared with
    run_update, so the gate checks them too (clip coefficient as torch's:
    min(1, clip / (norm + 1e-6))).
    """
    start = time.perf_counter()
    optimizer.zero_grad(set_to_none=True)
    loss = objective.reference_backward(lm, documents, total_weight, precision=precision, device=device)
    grads = [p.grad for p in _parameters(optimizer) if p.grad is not None]
    grad_norm = math.sqrt(math.fsum(float(g.double().pow(2).sum()) for g in grads))
    if grad_clip is not None:
        coef = min(1.0, grad_clip / (grad_norm + 1e-6))
        for g in grads:
            g.mul_(coef)
    lr = optimizer.param_groups[0]["lr"]
    optimizer.step()
    scheduler.step()
    return UpdateResult(
        loss=loss,
        grad_norm=grad_norm,
        lr=lr,
        tokens=sum(len(d.input_ids) for d in documents),
        seconds=time.perf_counter() - start,
        comm=None,
    )
