"""The update both arms share: optimizer, schedule, and one function per update.

AdamW with the preset's hyperparameters (train.lr, adam_beta1/2, adam_eps,
weight_decay on every parameter). The learning rate warms up linearly over
train.warmup_updates and then stays constant: update k (from 1) uses
lr · min(1, k / warmup_updates). The protocol fixes only the warmup; no decay
follows it.

Training steps with torch's fused AdamW (one pass over each parameter, its
gradient and both moments, no temporaries: about 0.2 s a step for the 135M
model on one CPU thread, against about 0.9 s for torch's per-tensor loop,
which is its CPU default). The reference update keeps that per-tensor loop,
so the gate checks the fused step against it.

`worker_update` is the training update of both arms (the worker, the gate,
the benchmark and the tests all call it): this worker's share of the global
batch, cut into microbatches and packed (batching), then `run_update`.
`reference_update` applies the same optimizer step to the per-document
reference objective, for the gate and the benchmark.

Every update reports where its seconds went (`UpdateTimes`); see there for
what each part holds and how it is measured.
"""

from __future__ import annotations

import contextlib
import math
import resource
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from coopstudy.config import TrainConfig
from coopstudy.errors import UserError
from coopstudy.numerics import batching, distributed, objective
from coopstudy.numerics.batching import DocumentLike, Microbatch
from coopstudy.numerics.distributed import ByteCounter, DistContext, UpdateBytes
from coopstudy.numerics.objective import Precision

FUSED = "fused"
"""build_optimizer's implementation for training: torch's fused AdamW."""
PER_TENSOR = "per-tensor"
"""build_optimizer's implementation for the reference: torch's plain per-tensor loop."""


@dataclass(frozen=True)
class UpdateTimes:
    """Where one worker's update seconds went; the parts add up to the update's seconds.

    Measured with time.perf_counter on the worker's main thread. On CUDA the
    device is synchronized at each boundary, so each part holds its kernels.
    """

    forward_backward: float
    """Forwards and backwards of every microbatch, less `communication`."""
    communication: float
    """The gradient communication: the DDP comm hook, from its call (inside the
    last backward) to the completion of the future it returns (dense
    all-reduce, or PowerSGD's compression, three all-reduces, decompression
    and error feedback); it includes any wait for a slower worker. 0 with one
    worker. See distributed.ByteCounter."""
    optimizer: float
    """Zeroing the gradients, their norm and clipping, the AdamW step and the schedule's step."""
    other: float
    """Packing the microbatches and the end of the update: the loss read off
    the device and the scalar sums (loss, tokens) across the workers. The
    training loop (run.worker) widens it to the rest of the update's wall
    time (the call, freeing the update's tensors), so the parts add up."""
    communication_arithmetic: float = 0.0
    """Of `communication`, not beside it: PowerSGD's own arithmetic on this
    worker (distributed.UpdateBytes.arithmetic_seconds); the rest of
    `communication` is collectives and waits."""
    system: float = 0.0
    """Across the parts, not beside them: the CPU seconds the operating system
    spent on this worker's process (all its threads; `sys` in time(1)) from
    zeroing the gradients to the end of the update. On CPU it is mostly page
    faults of memory new to the process: its first updates, and any later one
    whose tensors do not fit the holes its heap has (README, "What stays on
    CPU, and why"); a virtual machine may have to back such memory with host
    memory first."""

    @property
    def total(self) -> float:
        return self.forward_backward + self.communication + self.optimizer + self.other


@dataclass(frozen=True)
class UpdateResult:
    loss: float
    """L_k, the global loss (summed over workers): the same number in every arm for the same weights."""
    grad_norm: float
    """L2 norm of the gradient the optimizer applies, before clipping: the
    global gradient in the control arm and the dense phase; in the compressed
    phase PowerSGD's approximation of it, error feedback included, which is a
    different quantity (on a small model, 2.19 against 3.65 at the first
    compressed update)."""
    lr: float
    """The learning rate this update used."""
    tokens: int
    """Real tokens of the global batch."""
    seconds: float
    comm: UpdateBytes | None
    """This worker's collective payload; None with one worker."""
    times: UpdateTimes | None = None
    """This worker's breakdown of `seconds` (None from reference_update)."""
    local_tokens: int = 0
    """Real tokens this worker computed."""
    computed_tokens: int = 0
    """Positions this worker's forwards computed (packed: equal to local_tokens)."""


def require_finite(result: UpdateResult, k: int) -> None:
    """Stop at the first update whose loss is not finite: the weights are lost
    from there on, and every later number of the run would be NaN."""
    if not math.isfinite(result.loss):
        raise UserError(f"training diverged at update {k} (loss {result.loss}, learning rate {result.lr:.3g}); try a lower learning rate")


def build_optimizer(params: Iterable[nn.Parameter], train: TrainConfig, *, implementation: str = FUSED) -> torch.optim.AdamW:
    if implementation not in (FUSED, PER_TENSOR):
        raise ValueError(f"implementation {implementation!r}: {FUSED} or {PER_TENSOR}")
    return torch.optim.AdamW(
        params,
        lr=train.lr,
        betas=(train.adam_beta1, train.adam_beta2),
        eps=train.adam_eps,
        weight_decay=train.weight_decay,
        **({"fused": True} if implementation == FUSED else {"foreach": False, "fused": False}),
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


def _system_seconds() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_stime


def _synchronize(device: torch.device) -> None:
    """Wait for the device's queued work, so the clock times it (no-op on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


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
    prepare_seconds: float = 0.0,
) -> UpdateResult:
    """One optimizer update from this worker's microbatches.

    `net` is an objective.WeightedNLL, or DDP around one (distributed.wrap_model);
    `total_weight` is W_k of the whole global batch (batching.plan_update);
    `prepare_seconds`, what the caller spent making the microbatches, is
    counted in the update's seconds (as `other`).
    """
    if total_weight <= 0:
        raise ValueError("the global batch has no weighted token (W_k = 0); the objective is undefined")
    start = time.perf_counter()
    system_start = _system_seconds()
    # In place, not set_to_none: under DDP the gradients are views into its
    # buckets (gradient_as_bucket_view); zeroing keeps them resident.
    optimizer.zero_grad(set_to_none=False)
    _synchronize(ctx.device)
    compute_start = time.perf_counter()

    shares: list[torch.Tensor] = []
    local_tokens = computed = 0
    last = len(microbatches) - 1
    with precision.update(ctx.device.type) as backward:
        for i, mb in enumerate(microbatches):
            # Gradients accumulate locally; only the last microbatch's backward
            # synchronizes them (all-reduce, or PowerSGD), once per update.
            sync = contextlib.nullcontext() if i == last else distributed.no_sync(net)
            with sync:
                with precision.forward(ctx.device.type):
                    loss, share = objective.microbatch_loss(net, mb, total_weight, ctx.world_size)
                with backward():
                    loss.backward()
            shares.append(share)
            local_tokens += mb.tokens
            computed += mb.input_ids.numel()
    _synchronize(ctx.device)
    step_start = time.perf_counter()

    # After the synchronizing backward every worker holds the same gradient
    # (the global one, or in the compressed phase PowerSGD's approximation of
    # it), so norm and clipping are computed identically on every rank, as the
    # control arm computes them on the global gradient.
    params = _parameters(optimizer)
    grads = [p.grad for p in params if p.grad is not None]
    grad_norm = torch.nn.utils.get_total_norm(grads, norm_type=2.0)
    if grad_clip is not None:
        torch.nn.utils.clip_grads_with_norm_(params, grad_clip, grad_norm)

    lr = optimizer.param_groups[0]["lr"]
    optimizer.step()
    scheduler.step()
    _synchronize(ctx.device)
    step_end = time.perf_counter()

    # The logged loss is L_k itself: each worker's shares summed over workers.
    # One read of the device at the end, not one per microbatch.
    local_loss = float(torch.stack(shares).double().sum())
    loss_sum, tokens = distributed.all_reduce_sums([local_loss, local_tokens], counter)
    comm = counter.end_update() if counter is not None else None
    end = time.perf_counter()
    system = _system_seconds() - system_start
    hook = comm.hook_seconds if comm is not None else 0.0
    times = UpdateTimes(
        forward_backward=step_start - compute_start - hook,
        communication=hook,
        communication_arithmetic=comm.arithmetic_seconds if comm is not None else 0.0,
        optimizer=(compute_start - start) + (step_end - step_start),
        other=prepare_seconds + (end - step_end),
        system=system,
    )
    return UpdateResult(
        loss=loss_sum,
        grad_norm=float(grad_norm),
        lr=lr,
        tokens=int(tokens),
        seconds=prepare_seconds + end - start,
        comm=comm,
        times=times,
        local_tokens=local_tokens,
        computed_tokens=computed,
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
    work: Sequence[float] | None = None,
) -> UpdateResult:
    """One update of this worker on `global_batch` (indices into `documents`,
    the same in every arm): its share (batching.shares, balancing `work`, each
    document's cost; tokens when None), sorted by length and cut into
    microbatches of `microbatch`, packed on its device, then run_update."""
    start = time.perf_counter()
    plan = batching.plan_update(documents, global_batch, ctx.rank, ctx.world_size, microbatch, work)
    microbatches = [
        batching.pack([documents[i] for i in mb], device=ctx.device, weight_dtype=precision.param_dtype) for mb in plan.microbatches
    ]
    return run_update(
        net, optimizer, scheduler, microbatches, plan.total_weight, ctx,
        precision=precision, grad_clip=grad_clip, counter=counter, prepare_seconds=time.perf_counter() - start,
    )  # fmt: skip


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
    min(1, clip / (norm + 1e-6))). `optimizer` is meant to be
    build_optimizer(..., implementation=PER_TENSOR).
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
