"""The only module that touches torch.distributed.

A rank learns its place from the launcher's environment (RANK, LOCAL_RANK,
WORLD_SIZE, MASTER_ADDR, MASTER_PORT); without WORLD_SIZE > 1 the process is
the single device of the control arm and no process group exists. The train
loop sees a `DistContext`, a model from `wrap_model`, `no_sync`, the scalar
reductions.

PowerSGD (torch's `powerSGD_hook`) runs dense all-reduce while
`state.iter < state.start_powerSGD_iter` and compresses after. `state.iter`
grows by one per *hook call on the last bucket*, and DDP calls the hook only
on a backward that synchronizes: under `no_sync` no hook runs. With gradient
accumulation (no_sync on all but the last microbatch) `iter` therefore counts
optimizer updates, and start_powerSGD_iter = powersgd.dense_updates makes
updates 1..D dense and D+1.. compressed (tests/test_distributed.py checks it).

Bytes: a `ByteCounter` counts the payload of the collectives a worker issues:
each update's gradient all-reduces (by phase, dense or compressed) and its
scalar sums, and the parameter broadcast when DDP is built (setup). Not
counted: barriers and DDP's one-off shape check at construction. Payload means
the bytes of the tensor a worker hands to the collective, not wire traffic (a
ring all-reduce moves about 2(n-1)/n times that per worker).

Seconds: the counter also times the comm hook of each update, from the
hook's call (DDP calls it inside the last backward, once the bucket's
gradients are all computed: with one bucket, at the end of the backward) to
the completion of the future it returns, by a last callback on that future.
On gloo the collectives and PowerSGD's callbacks (compression, QR,
decompression, error feedback) run on gloo's threads while the main thread
waits for that future at the end of the backward, so this is the wall time
the update spends on gradient communication, waits for the other worker
included. On NCCL the future completes when the work is queued on the
stream, so it is the host's share only. Of those seconds, the counter also
keeps the part spent in PowerSGD's own arithmetic (the stretches between the
hook's collectives): what a worker computes in full whatever the number of
workers, beside what is transfer and waiting.

PowerSGD: `powersgd_hook` is torch's `powerSGD_hook` (torch 2.13) step for
step, with one change: error feedback works in place in its kept error
buffer, where torch copies the bucket into a new tensor and makes the new
error as another (two 538 MB allocations per update for the 135M model, each
paying for its pages again, and one more pass over the bucket). The numbers
are the same bit for bit (tests/test_distributed.py trains with both).

Its two large products, P = AQ and Q = AᵀP, go through oneDNN on CPU in
fp32 (`_low_rank_products`, numerics.onednn): over the 135M model's
gradients, on one thread of the avx512_bf16 EPYC, they took 146 and 135 ms
through MKL against 59 and 74 through oneDNN. They round differently
(about 1e-6 relative); with `BMM` the hook is torch's bit for bit, and the
test holds it to that too.
"""

# No `from __future__ import annotations` here: DDP's register_comm_hook
# compares the hook's annotations with the real classes, not with strings.
import contextlib
import math
import os
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import ContextManager

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as torch_powersgd
from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState
from torch.nn.parallel import DistributedDataParallel as DDP

from coopstudy import machine
from coopstudy.config import Config
from coopstudy.errors import NCCL_WITHOUT_CUDA, UserError
from coopstudy.numerics import onednn
from coopstudy.record import schema

MIN_COMPRESSION_RATE = 1.0
"""A matrix is compressed when its rank-r factors, (n+m)·r elements, are
fewer than its n·m elements: every weight matrix that compression makes
smaller is compressed, as the protocol's "rank 32" reads. (torch's default, 2,
would silently send some matrices dense at small sizes.) Vectors (norms) never
qualify and go dense."""


@dataclass(frozen=True)
class DistContext:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str | None
    """None: one process, no process group."""
    cores: tuple[int, ...] | None = None
    """The CPU cores this rank is pinned to (machine.pin_rank); None when it
    is left to the scheduler: one process, a CUDA rank, distributed.pin_cores
    false, or ranks of the job on other hosts (init)."""
    rendezvous_seconds: float = 0.0
    """Seconds this rank waited in init_process_group for every rank to join."""

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def _env_int(name: str) -> int:
    raw = os.environ.get(name)
    if raw is None:
        raise UserError(f"{name} is not set but WORLD_SIZE={os.environ['WORLD_SIZE']}; start ranks with a launcher (deepspeed, torchrun)")
    try:
        return int(raw)
    except ValueError:
        raise UserError(f"{name}={raw!r} is not an integer") from None


def env_rank() -> int:
    """The rank the launcher's environment gives this process, 0 where it gives none."""
    return _env_int("RANK") if "RANK" in os.environ else 0


def init(cfg: Config) -> DistContext:
    """Join the process group the environment describes, or stay alone.

    Backend auto: nccl (device cuda:LOCAL_RANK) with CUDA, else gloo (CPU).
    """
    world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    cuda = torch.cuda.is_available()
    if world <= 1:
        return DistContext(0, 1, 0, torch.device("cuda", 0) if cuda else torch.device("cpu"), None)
    rank = _env_int("RANK")
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    for name in ("MASTER_ADDR", "MASTER_PORT"):
        if not os.environ.get(name):
            raise UserError(f"{name} is not set but WORLD_SIZE={world}; start ranks with a launcher (deepspeed, torchrun)")
    backend = cfg.distributed.backend
    if backend == "auto":
        backend = "nccl" if cuda else "gloo"
    if backend == "nccl" and not cuda:
        raise UserError(NCCL_WITHOUT_CUDA)
    # gloo ranks compute on CPU (the CPU presets, the gate) even where CUDA exists.
    device = torch.device("cuda", local_rank) if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    cores = None
    # Only when every rank runs on this host (the launchers say how many do):
    # ranks of a job started node by node may share one host under the same
    # local ranks, and would then be pinned onto the same cores.
    if device.type == "cpu" and cfg.distributed.pin_cores and _local_ranks() == world:
        cores = machine.pin_rank(local_rank, world, cfg.train.threads_per_device)
    met = time.perf_counter()
    if not dist.is_initialized():
        # The timeout ends every rank when one stops answering, instead of
        # leaving the others blocked in a collective for ever.
        try:
            dist.init_process_group(
                backend,
                init_method="env://",
                rank=rank,
                world_size=world,
                timeout=timedelta(seconds=cfg.distributed.collective_timeout_s),
            )
        except dist.DistError as err:
            # A node never started, a port in use, an interface no rank reaches: one line, not torch's traceback.
            meet = f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}"
            if isinstance(err, dist.DistStoreError):
                raise UserError(
                    f"the {world} ranks did not all meet at {meet} within distributed.collective_timeout_s "
                    f"({cfg.distributed.collective_timeout_s:g} s; {type(err).__name__}): on several hosts, start every node's command"
                ) from err
            said = (str(err).strip().splitlines() or [""])[0][:200]
            raise UserError(f"rank {rank} could not join the ranks at {meet}: {type(err).__name__}: {said}") from err
    return DistContext(rank, world, local_rank, device, backend, cores, time.perf_counter() - met)


def _local_ranks() -> int:
    """Ranks on this host as the launcher says (torchrun: LOCAL_WORLD_SIZE,
    DeepSpeed: LOCAL_SIZE); 0 when it does not say."""
    for name in ("LOCAL_WORLD_SIZE", "LOCAL_SIZE"):
        raw = os.environ.get(name, "")
        if raw.isdigit():
            return int(raw)
    return 0


def shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


@contextlib.contextmanager
def session(cfg: Config) -> Iterator[DistContext]:
    """init, then shutdown on success and on failure alike.

    Drop the DDP model and its ByteCounter before the block ends: they hold
    the process group, and a gloo group that outlives destroy_process_group
    keeps its worker threads into interpreter exit, where a rank then aborted
    ("terminate called ... Resource deadlock avoided") in about 1 run in 20 of
    a PowerSGD test; with the model dropped first, none in 20.
    """
    ctx = init(cfg)
    try:
        yield ctx
    finally:
        shutdown()


# --- byte accounting ---------------------------------------------------------


@dataclass(frozen=True)
class UpdateBytes:
    """Collective payload of one worker in one update."""

    phase: str | None
    """dense, compressed, or None when no gradient was communicated (one worker)."""
    gradient_bytes: int
    scalar_bytes: int
    """The update's scalar reductions (loss, tokens)."""
    hook_seconds: float = 0.0
    """Wall seconds of the update's gradient comm hook, its call to its future's completion."""
    arithmetic_seconds: float = 0.0
    """The part of hook_seconds this worker spent in PowerSGD's own arithmetic
    (error feedback, the P and Q products, orthogonalizations,
    decompression); the rest is the collectives and waits for the other
    workers. 0 for dense updates."""

    @property
    def total(self) -> int:
        return self.gradient_bytes + self.scalar_bytes


@dataclass(frozen=True)
class ByteTotals:
    dense: int
    """Gradient payload of the dense updates."""
    compressed: int
    """Gradient payload of the compressed updates."""
    scalar: int
    setup: int
    """The one parameter-and-buffer broadcast from rank 0 when DDP is built."""

    @property
    def total(self) -> int:
        return self.dense + self.compressed + self.scalar + self.setup


@dataclass
class ByteCounter:
    """Counts every collective payload one worker issues; read after each update.

    It is also the state DDP hands to the comm hook, so it owns the
    PowerSGDState (None when DDP runs plain dense all-reduce, as in the gate).
    """

    setup_bytes: int
    powersgd: PowerSGDState | None
    updates: list[UpdateBytes] = field(default_factory=list)
    _phase: str | None = None
    _gradient: int = 0
    _scalar: int = 0
    _hook_seconds: float = 0.0
    _arithmetic_seconds: float = 0.0

    def add_hook_seconds(self, seconds: float) -> None:
        self._hook_seconds += seconds

    def add_arithmetic_seconds(self, seconds: float) -> None:
        self._arithmetic_seconds += seconds

    def add_gradient(self, phase: str, nbytes: int) -> None:
        self._phase = phase
        self._gradient += nbytes

    def add_scalar(self, nbytes: int) -> None:
        self._scalar += nbytes

    def end_update(self) -> UpdateBytes:
        """Close the current update's count and return it."""
        done = UpdateBytes(self._phase, self._gradient, self._scalar, self._hook_seconds, self._arithmetic_seconds)
        self.updates.append(done)
        self._phase, self._gradient, self._scalar = None, 0, 0
        self._hook_seconds = self._arithmetic_seconds = 0.0
        return done

    def totals(self) -> ByteTotals:
        by_phase = {schema.PHASE_DENSE: 0, schema.PHASE_COMPRESSED: 0}
        for u in self.updates:
            if u.phase is not None:
                by_phase[u.phase] += u.gradient_bytes
        scalars = sum(u.scalar_bytes for u in self.updates)
        return ByteTotals(by_phase[schema.PHASE_DENSE], by_phase[schema.PHASE_COMPRESSED], scalars, self.setup_bytes)


@dataclass(frozen=True)
class MatrixPlan:
    shape: tuple[int, ...]
    compressed: bool
    elements: int
    """Elements sent per compressed update: (n+m)·r when compressed, n·m otherwise."""


def compression_plan(shapes: Iterable[Sequence[int]], rank: int, min_rate: float = MIN_COMPRESSION_RATE) -> list[MatrixPlan]:
    """Which gradients powerSGD_hook compresses, by its own rule.

    The hook views each gradient as (shape[0], rest), takes r = min(n, m, rank)
    and compresses when (n+m)·r·min_rate < n·m (powerSGD_hook.py,
    `_should_compress`); compressed matrices send P (n·r) and Q (m·r).
    """
    plans = []
    for shape in shapes:
        n = int(shape[0])
        m = math.prod(int(s) for s in shape[1:])
        r = min(n, m, rank)
        low_rank = (n + m) * r
        compressed = low_rank * min_rate < n * m
        plans.append(MatrixPlan(tuple(int(s) for s in shape), compressed, low_rank if compressed else n * m))
    return plans


BMM = "bmm"
"""P = AQ and Q = AᵀP by torch.bmm, as torch's hook computes them."""
ONEDNN = "onednn"
"""P = AQ and Q = AᵀP by oneDNN's fp32 matrix product (CPU only)."""


def _low_rank_products(tensor: torch.Tensor) -> str:
    """ONEDNN where oneDNN applies to the tensor (fp32 on CPU), else BMM."""
    return ONEDNN if onednn.applies(tensor) else BMM


def _project(a: torch.Tensor, q: torch.Tensor, out: torch.Tensor, products: str) -> None:
    """out = a q, for batches of one: (1, n, m) @ (1, m, r) -> (1, n, r)."""
    if products == ONEDNN:
        out[0].copy_(onednn.x_times_w_transposed(a[0], q[0].t()))
    else:
        torch.bmm(a, q, out=out)


def _project_back(a: torch.Tensor, p: torch.Tensor, out: torch.Tensor, products: str) -> None:
    """out = aᵀ p, for batches of one: (1, n, m), (1, n, r) -> (1, m, r).
    Through oneDNN as (pᵀ a)ᵀ, with pᵀ made contiguous: its fastest form here."""
    if products == ONEDNN:
        out[0].copy_(onednn.x_times_w_transposed(p[0].t().contiguous(), a[0].t()).t())
    else:
        torch.bmm(a.transpose(1, 2), p, out=out)


def powersgd_hook(
    state: PowerSGDState,
    bucket: dist.GradBucket,
    arithmetic: Callable[[float], None] | None = None,
    products: str | None = None,
) -> torch.futures.Future[torch.Tensor]:
    """torch's powerSGD_hook (torch/distributed/algorithms/ddp_comm_hooks/powerSGD_hook.py,
    torch 2.13, `batch_tensors_with_same_shape` off as the study's state has
    it), the same arithmetic in the same order, with error feedback kept in
    place (see the module docstring).

    Dense all-reduce while state.iter < start_powerSGD_iter. Then, per update,
    with M the bucket's gradients and e the kept error: A = M + e; per matrix
    P = AQ (Q warm-started from the previous update, orthogonalized); the
    uncompressed tensors of A and all Ps all-reduced; P orthogonalized;
    Q = AᵀP; all Qs all-reduced; the bucket becomes M' = PQᵀ (and the
    all-reduced uncompressed tensors); e = A - M'.

    torch computes A in the bucket, copies it (a new bucket-sized tensor) and
    ends with e = copy - M' (another). Here A is computed into e itself
    (e + M, the same sums as M + e), compression reads A from e, M' is written
    into the bucket, and e - M' is subtracted in place: one pass over the
    bucket and two bucket-sized allocations fewer per update, the same bits.

    `arithmetic`, when given, is handed the seconds of each stretch of the
    hook's own computation (each ends where a collective is issued), so the
    record can tell computation from collectives and waits. `products`
    (BMM or ONEDNN) computes P = AQ and Q = AᵀP; by default ONEDNN where it
    applies (module docstring). M' = PQᵀ stays torch.bmm: through oneDNN it
    was faster alone but not in the running arm, where its fresh
    bucket-sized result is made on gloo's thread (README, "What stays on
    CPU, and why").
    """
    process_group = state.process_group
    group_to_use = process_group if process_group is not None else dist.group.WORLD
    world_size = group_to_use.size()
    input_tensor = bucket.buffer()

    if state.iter < state.start_powerSGD_iter:
        state.maybe_increase_iter(bucket)
        return default_hooks._allreduce_fut(group_to_use, input_tensor)

    started = time.perf_counter()
    clock = arithmetic or (lambda seconds: None)
    device, dtype = input_tensor.device, input_tensor.dtype
    products = products or _low_rank_products(input_tensor)
    bucket_index = bucket.index()
    tensors = bucket.gradients()
    # Where each gradient lies in the bucket, to read the same tensor of A.
    offsets = [(t.data_ptr() - input_tensor.data_ptr()) // t.element_size() for t in tensors]
    if sum(t.numel() for t in tensors) != input_tensor.numel():
        raise ValueError("powersgd_hook needs a bucket made of its gradients only")
    if state.use_error_feedback:
        error = state.error_dict.get(bucket_index)
        if error is None:
            # torch's first compressed update: e = 0 is created and not added, so A = M.
            error = state.error_dict[bucket_index] = input_tensor.detach().clone()
        else:
            error.add_(input_tensor)
        source = error
    else:
        source = input_tensor
    sources = [source[o : o + t.numel()].view_as(t) for o, t in zip(offsets, tensors)]

    tensors_to_compress, sources_to_compress, uncompressed_tensors, uncompressed_sources = [], [], [], []
    total_Ps_size = 0
    total_Qs_size = 0
    for tensor, src in zip(tensors, sources):
        matrix = tensor.view(tensor.shape[0], -1)
        n, m = matrix.shape
        matrix_approximation_rank = min(n, m, state.matrix_approximation_rank)
        compress_test = torch_powersgd._should_compress(n, m, matrix_approximation_rank, state.min_compression_rate)
        state.total_numel_before_compression += compress_test[1]
        if compress_test[0]:
            tensors_to_compress.append(matrix)
            sources_to_compress.append(src.view(n, m))
            total_Ps_size += n * matrix_approximation_rank
            total_Qs_size += m * matrix_approximation_rank
            state.total_numel_after_compression += compress_test[2]
        else:
            uncompressed_tensors.append(tensor)
            uncompressed_sources.append(src)
            state.total_numel_after_compression += compress_test[1]

    torch_powersgd._report_compression_stats(bucket, state)

    uncompressed_tensors_memory = (
        torch.cat([src.view(-1) for src in uncompressed_sources])
        if uncompressed_sources
        else torch.tensor([], device=device, dtype=dtype)
    )

    need_randomize_qs = False
    if not state.warm_start or bucket_index not in state.p_memory_dict:
        need_randomize_qs = True
        state.p_memory_dict[bucket_index] = torch.empty(total_Ps_size, device=device, dtype=dtype)
        state.q_memory_dict[bucket_index] = torch.empty(total_Qs_size, device=device, dtype=dtype)

    if state.batch_tensors_with_same_shape:
        raise ValueError("powersgd_hook follows torch's hook with batch_tensors_with_same_shape=False only")
    # torch's order: the matrices grouped by shape, in order of first appearance.
    by_shape: dict[torch.Size, list[int]] = defaultdict(list)
    for i, matrix in enumerate(tensors_to_compress):
        by_shape[matrix.shape].append(i)
    order = [i for group in by_shape.values() for i in group]
    targets = [tensors_to_compress[i].unsqueeze(0) for i in order]
    matrices = [sources_to_compress[i].unsqueeze(0) for i in order]

    ps = []
    qs = []
    p_idx = 0
    q_idx = 0
    for tensor in matrices:
        batch_size, n, m = tensor.shape
        matrix_approximation_rank = min(n, m, state.matrix_approximation_rank)
        ps.append(
            state.p_memory_dict[bucket_index][p_idx : p_idx + batch_size * n * matrix_approximation_rank].view(
                batch_size, n, matrix_approximation_rank
            )
        )
        qs.append(
            state.q_memory_dict[bucket_index][q_idx : q_idx + batch_size * m * matrix_approximation_rank].view(
                batch_size, m, matrix_approximation_rank
            )
        )
        p_idx += batch_size * n * matrix_approximation_rank
        q_idx += batch_size * m * matrix_approximation_rank

    if not need_randomize_qs:
        for q in qs:
            torch_powersgd._orthogonalize(q, state.orthogonalization_epsilon)
    else:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(state.rng.randint(1_000_000_000))
            for q in qs:
                q.copy_(torch.randn(*q.shape, device="cpu", dtype=dtype))
                torch_powersgd._orthogonalize(q, state.orthogonalization_epsilon)

    for tensor, q, p in zip(matrices, qs, ps):
        _project(tensor, q, p, products)
    clock(time.perf_counter() - started)

    allreduce_contiguous_uncompressed_tensors_fut = dist.all_reduce(
        uncompressed_tensors_memory, group=group_to_use, async_op=True
    ).get_future()

    def unpack_uncompressed_tensors_and_allreduce_ps(fut):
        start = time.perf_counter()
        uncompressed_tensors_memory = fut.value()[0].div_(world_size)
        idx = 0
        for tensor in uncompressed_tensors:
            tensor.copy_(uncompressed_tensors_memory[idx : idx + tensor.numel()].view_as(tensor))
            idx += tensor.numel()
        clock(time.perf_counter() - start)
        return dist.all_reduce(state.p_memory_dict[bucket_index], group=group_to_use, async_op=True).get_future().wait()[0]

    def compute_qs(fut):
        start = time.perf_counter()
        state.p_memory_dict[bucket_index] = fut.value()
        for p in ps:
            torch_powersgd._orthogonalize(p, state.orthogonalization_epsilon)
        for tensor, p, q in zip(matrices, ps, qs):
            _project_back(tensor, p, q, products)
        clock(time.perf_counter() - start)
        return dist.all_reduce(state.q_memory_dict[bucket_index], group=group_to_use, async_op=True).get_future().wait()[0]

    def decompress(fut):
        start = time.perf_counter()
        state.q_memory_dict[bucket_index] = fut.value().div_(world_size)
        for p, q, tensor in zip(ps, qs, targets):
            torch.bmm(p, q.transpose(1, 2), out=tensor)
        if torch.cuda.is_available():
            torch.cuda.synchronize(device)
        if state.use_error_feedback:
            # e = A - M', in place (torch: copy - M', a new tensor).
            error.sub_(input_tensor)
        if not state.warm_start:
            state.p_memory_dict.clear()
            state.q_memory_dict.clear()
        state.maybe_increase_iter(bucket)
        clock(time.perf_counter() - start)
        return input_tensor

    return (
        allreduce_contiguous_uncompressed_tensors_fut.then(unpack_uncompressed_tensors_and_allreduce_ps)
        .then(compute_qs)
        .then(decompress)
    )


def _counting_hook(counter: ByteCounter, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Count the bucket's payload, hand it to the real hook unchanged, and
    time the hook to its future's completion."""
    start = time.perf_counter()
    buffer = bucket.buffer()
    state = counter.powersgd
    if state is None:
        counter.add_gradient(schema.PHASE_DENSE, buffer.numel() * buffer.element_size())
        fut = default_hooks.allreduce_hook(None, bucket)
    else:
        # The same test powersgd_hook makes before it decides (and before it
        # increments state.iter): dense while iter < start_powerSGD_iter.
        if state.iter < state.start_powerSGD_iter:
            counter.add_gradient(schema.PHASE_DENSE, buffer.numel() * buffer.element_size())
        else:
            plan = compression_plan((g.shape for g in bucket.gradients()), state.matrix_approximation_rank, state.min_compression_rate)
            # Three all-reduces: the uncompressed tensors together, all Ps, all Qs.
            counter.add_gradient(schema.PHASE_COMPRESSED, sum(p.elements for p in plan) * buffer.element_size())
        fut = powersgd_hook(state, bucket, counter.add_arithmetic_seconds)

    def timed(done: torch.futures.Future) -> torch.Tensor:
        # Runs when the hook's work is complete (on gloo, on the thread that
        # completed it), before DDP's wait at the end of the backward returns.
        counter.add_hook_seconds(time.perf_counter() - start)
        return done.value()

    return fut.then(timed)


# --- DDP ---------------------------------------------------------------------


def wrap_model(net: nn.Module, cfg: Config, ctx: DistContext, *, powersgd: bool = True) -> tuple[nn.Module, ByteCounter | None]:
    """DDP around `net` with the counting PowerSGD hook; `net` itself with one worker.

    powersgd=False keeps DDP's dense all-reduce for every update (the gate:
    PowerSGD is lossy by design and is not what the gate checks).
    """
    if not ctx.distributed:
        return net, None
    param_bytes = sum(p.numel() * p.element_size() for p in net.parameters())
    bucket_cap_mb = None
    if ctx.backend == "gloo":
        # One bucket for the whole model. With several buckets, powerSGD_hook
        # chains each bucket's all-reduces through future callbacks that gloo
        # runs on its own threads, so the buckets' collectives can interleave
        # in a different order on each rank and fail as a collective mismatch.
        # One bucket keeps a single ordered chain per update. On CPU the
        # overlap of communication with backward that several buckets would
        # buy is nil anyway (one core per device). NCCL orders collectives on
        # its stream and keeps DDP's default buckets.
        bucket_cap_mb = math.ceil(param_bytes / 2**20) + 1
    model = DDP(
        net,
        device_ids=[ctx.local_rank] if ctx.device.type == "cuda" else None,
        bucket_cap_mb=bucket_cap_mb,
        # The protocol's resident gradient buffers: gradients are views into
        # DDP's buckets, zeroed in place (update.run_update), never reallocated.
        gradient_as_bucket_view=True,
        # No buffer changes in training (Llama's only buffer is the rotary
        # table), so no per-forward broadcast: the only collectives of an
        # update are the gradient reduction and the loss/token sums.
        forward_sync_buffers=False,
    )
    state = None
    if powersgd:
        state = PowerSGDState(
            process_group=None,
            matrix_approximation_rank=cfg.powersgd.rank,
            start_powerSGD_iter=cfg.powersgd.dense_updates,
            min_compression_rate=MIN_COMPRESSION_RATE,
            # Error feedback lives in the dtype of the gradient bucket. Parameters
            # and gradients stay fp32 under bf16 autocast (objective.Precision),
            # so the error is kept in fp32, as the protocol requires.
            use_error_feedback=True,
            warm_start=cfg.powersgd.warm_start,
            random_seed=cfg.train.seed,
        )
    # DDP broadcasts parameters and buffers from rank 0 once, at construction.
    setup = param_bytes + sum(b.numel() * b.element_size() for b in net.buffers())
    counter = ByteCounter(setup_bytes=setup, powersgd=state)
    model.register_comm_hook(counter, _counting_hook)
    return model, counter


def no_sync(model: nn.Module) -> ContextManager:
    """DDP's no_sync: this forward and backward accumulate without communication."""
    return model.no_sync() if isinstance(model, DDP) else contextlib.nullcontext()


# --- scalar reductions -------------------------------------------------------


def gather_floats(values: Sequence[float], ctx: DistContext) -> list[list[float]]:
    """Every rank's `values` (the same count on each), by rank: one sum in
    which each rank fills only its own slots."""
    n = len(values)
    slots = [0.0] * (n * ctx.world_size)
    slots[ctx.rank * n : (ctx.rank + 1) * n] = values
    gathered = all_reduce_sums(slots)
    return [gathered[r * n : (r + 1) * n] for r in range(ctx.world_size)]


def all_reduce_sums(values: Sequence[float], counter: ByteCounter | None = None) -> list[float]:
    """Sum each value over the workers, in one collective; identity with one worker."""
    if not dist.is_initialized():
        return [float(v) for v in values]
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    # float64: token counts stay exact integers and the loss keeps every digit
    # it was accumulated with.
    tensor = torch.tensor([float(v) for v in values], dtype=torch.float64, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    if counter is not None:
        counter.add_scalar(tensor.numel() * tensor.element_size())
    return tensor.tolist()

