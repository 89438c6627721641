"""The one training loop: control, compressed arm and probes.

Every training process runs `python -m coopstudy.run.worker` (`entry`, this
module's own, from the process's start to its exit, so that the plan binds
all it runs: commit.sources.WORKER): the control as one plain process, the
compressed arm as ranks the DeepSpeed launcher starts (coopstudy.run.launch).
What differs between them is only what `distributed.init` finds in the environment (one process, or RANK and
WORLD_SIZE) and the arm's microbatch size; the loop below is the same.

Rank 0 writes the record: per update, the loss, gradient norm, learning
rate, tokens, bytes, where the update's seconds went (forward and
backward, gradient communication, optimizer step, the rest, and recording:
update.UpdateTimes) and the memory new to the process; then the run's
summary (active and checkpoint seconds, peak memory, the time breakdown and
new memory of every rank, transmitted bytes by phase) and the verified
checkpoint. The per-update metrics wait in memory
and are written at most once every RECORD_EVERY_S seconds, and after the last
update outside the training window, so that a record call (tens of
milliseconds against a local SQLite store, more against a server) is not
paid, by both ranks, inside every update; what a write inside the window
cost is itself recorded (schema.M_RECORD_SECONDS), and what waits is written
before the process ends, on failure too. The stage that
launched the processes adds what only it can measure (complete seconds,
device-seconds, cost) and ends the run.

A probe (`--probe`) is this loop for a few updates without a checkpoint;
every rank also holds itself to the device's capacity (`--capacity-mb`) and
reports its update seconds and memory, whatever the outcome (coopstudy.run.capacity).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import os
import re
import signal
import socket
import sys
import time
import traceback
from typing import NoReturn

import torch

from coopstudy import errors, machine, ui, workspace
from coopstudy.commit import require
from coopstudy.config import ALLOCATORS, ARMS, COMPRESSED, TRAINING_ALLOCATOR, Config
from coopstudy.errors import Stopped, UserError
from coopstudy.inputs import data
from coopstudy.numerics import batching, distributed, flops, objective, update
from coopstudy.record import outbox, schema, store, writer
from coopstudy.run import capacity, checkpoint, launch

_PEER_LOST = re.compile(r"Connection (?:closed|reset) by peer|Broken pipe|Timed out waiting \d+ms for \w+ operation")
"""What gloo says in a collective when another rank has gone (killed, failed,
or out of reach) or stopped answering within distributed.collective_timeout_s.
(Read here, not in numerics.distributed: its words are no number of the gate's.)"""

RECORD_EVERY_S = 60.0
"""Per-update metrics wait at most this long before they are written inside the training window."""


class _Pending:
    """Rank 0's per-update metrics, buffered; see the module docstring."""

    def __init__(self, rec: writer.Recorder | None):
        self.rec = rec
        self.waiting: list[tuple[dict[str, float], int]] = []
        self.last_write = time.perf_counter()

    def add(self, metrics: dict[str, float], step: int) -> None:
        if self.rec is not None:
            self.waiting.append((metrics, step))

    def due(self) -> bool:
        return bool(self.waiting) and time.perf_counter() - self.last_write >= RECORD_EVERY_S

    def write(self) -> float:
        """Write what waits, in update order; the seconds it took."""
        start = time.perf_counter()
        while self.waiting:
            self.rec.log_metrics(*self.waiting[0])  # type: ignore[union-attr]
            # Only once written: a write cut short keeps the rest for the failure's last write.
            self.waiting.pop(0)
        self.last_write = time.perf_counter()
        return self.last_write - start

    def close(self) -> None:
        """The last write, of whatever waits."""
        if self.waiting:
            self.write()


def train(
    cfg: Config, arm: str, run_id: str, *, updates: int | None = None, save: bool = True, probing: capacity.RankProbe | None = None
) -> None:
    torch.set_num_threads(cfg.train.threads_per_device)
    try:
        # No inter-op pool wider than the device (nothing here uses one; it
        # would only add threads).
        torch.set_num_interop_threads(cfg.train.threads_per_device)
    except RuntimeError:
        pass  # already set, or parallel work already started: keep it
    shape = cfg.arm(arm)
    with distributed.session(cfg) as ctx:
        if ctx.world_size != shape.workers:
            raise UserError(f"arm {arm} has {shape.workers} workers but {ctx.world_size} processes were started")
        if probing is not None:
            probing.start(ctx.device)
        rec = writer.Recorder(run_id) if ctx.is_main else None

        # Checked again in every process: a rank may run on another host.
        prepared, seed = require.seeded_inputs(cfg)
        if rec is not None:
            # What the run reads, as its dataset inputs (before the timed updates).
            rec.log_inputs(data.dataset_files(prepared.folder, prepared.manifest, data.TRAINING_FILES), context="training")
        schedule = prepared.schedule if updates is None else prepared.schedule[:updates]
        documents = prepared.train

        from transformers import AutoModelForCausalLM, AutoTokenizer

        ui.hide_transformers_bars()

        precision = objective.Precision.of(cfg.train.precision)
        lm = precision.cast(AutoModelForCausalLM.from_pretrained(seed.path)).to(ctx.device)
        # DDP broadcasts rank 0's weights at construction, so every rank starts
        # from the same seed even if its own copy were different.
        net, counter = distributed.wrap_model(objective.WeightedNLL(lm), cfg, ctx)
        # The split between workers balances each document's executed FLOPs:
        # an update's forward and backward take time in proportion to them.
        model_shape = flops.ModelShape.of(seed.path)
        work = [model_shape.document_flops(d) for d in documents]
        if probing is not None:
            probing.watch(lm)
        optimizer = update.build_optimizer(lm.parameters(), cfg.train)
        scheduler = update.build_scheduler(optimizer, cfg.train.warmup_updates)

        first_start = last_end = 0.0
        phases: list[str | None] = []
        times: list[update.UpdateTimes] = []
        new_memory: list[float] = []
        # Machine-wide, so rank 0's reading stands for its host (None without procfs).
        ready_memory = [machine.ready_memory_mb()] if ctx.is_main else []
        computed = local_tokens = 0
        pending = _Pending(rec)
        # Seconds of the write inside the window just before the next update.
        record_seconds = 0.0
        saved = None
        try:
            with ui.progress(f"train {arm}", len(schedule), enabled=ctx.is_main, unit="update", each=True) as advance:
                for k, global_batch in enumerate(schedule, start=1):
                    start = time.perf_counter()
                    if k == 1:
                        first_start = start
                    peak_before = capacity.peak_rss_mb()
                    # Same global batch in every arm; this worker takes its share.
                    result = update.worker_update(
                        net, optimizer, scheduler, documents, global_batch, ctx,
                        microbatch=shape.microbatch, precision=precision, grad_clip=cfg.train.grad_clip, counter=counter,
                        work=work,
                    )  # fmt: skip
                    update.require_finite(result, k)
                    # The update ends by reading the loss off the device (after the
                    # optimizer step in stream order), so the clock stops when the
                    # device has finished the update, not when its kernels were queued.
                    last_end = time.perf_counter()
                    # `other` takes what the other parts do not hold, so the parts add up to
                    # the update's seconds: the call itself and the freeing of its tensors included.
                    t = result.times
                    t = dataclasses.replace(t, other=t.other + (last_end - start) - t.total)
                    # Memory the process touched for the first time: its allocator keeps
                    # what it frees (launch.set_malloc), so the peak grows only by new pages.
                    new_memory.append(capacity.peak_rss_mb() - peak_before)
                    if ctx.is_main:
                        ready_memory.append(machine.ready_memory_mb())
                    if probing is not None:
                        probing.updated(last_end - start)
                    phases.append(result.comm.phase if result.comm else None)
                    times.append(t)
                    computed += result.computed_tokens
                    local_tokens += result.local_tokens
                    if rec is not None:
                        metrics = {
                            schema.M_LOSS: result.loss,
                            schema.M_GRAD_NORM: result.grad_norm,
                            schema.M_LR: result.lr,
                            schema.M_UPDATE_SECONDS: last_end - start,
                            schema.M_TOKENS: result.tokens,
                            # One worker's collective payload; the control sends nothing.
                            schema.M_BYTES: result.comm.total if result.comm else 0,
                            schema.M_FORWARD_BACKWARD_SECONDS: t.forward_backward,
                            schema.M_COMM_SECONDS: t.communication,
                            schema.M_COMM_ARITHMETIC_SECONDS: t.communication_arithmetic,
                            schema.M_OPTIMIZER_SECONDS: t.optimizer,
                            schema.M_OTHER_SECONDS: t.other,
                            schema.M_SYSTEM_SECONDS: t.system,
                            schema.M_NEW_MEMORY_MB: new_memory[-1],
                            schema.M_RECORD_SECONDS: record_seconds,
                        }
                        if ready_memory[-1] is not None:
                            metrics[schema.M_READY_MEMORY_MB] = ready_memory[-1]
                        pending.add(metrics, k)
                        advance(loss=f"{result.loss:.4f}", **{"s/update": f"{last_end - start:.2f}"})
                        record_seconds = pending.write() if k < len(schedule) and pending.due() else 0.0
            # After the last update: outside the window.
            pending.close()
            if save and ctx.is_main:
                saved = checkpoint.save(lm, AutoTokenizer.from_pretrained(seed.path), workspace.checkpoint_folder(run_id, make=True))
            memory = _gather_peak_memory(ctx)
            times_by_rank = _gather_times(ctx, times)
            new_memory_by_rank = distributed.gather_floats(new_memory, ctx)
            cores_by_rank = _gather_cores(ctx, cfg.train.threads_per_device)
        except BaseException as err:
            _ending()
            # A failed run keeps what it measured; the failure matters more than its record.
            with contextlib.suppress(Exception):
                pending.close()
            if saved is not None:
                # Saved, then a rank failed or the job was stopped before the upload began:
                # no checkpoint on disk, as for a failure during training.
                checkpoint.withdraw(saved)
            # As on success (below), the DDP model goes before the process group;
            # the failure's frames hold it too.
            traceback.clear_frames(err.__traceback__)
            net = counter = None
            raise
        if rec is not None:
            summary = {
                "arm": arm,
                "workers": ctx.world_size,
                "backend": ctx.backend,
                "device": str(ctx.device),
                "host": socket.gethostname(),
                "threads_per_device": cfg.train.threads_per_device,
                # The CPU cores each rank was pinned to; null: left to the scheduler.
                "cores_by_rank": cores_by_rank,
                "allocator": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "default"),
                # The host's malloc (run.launch.set_malloc): 'tcmalloc', or glibc and its settings.
                "malloc": machine.malloc_in_use(),
                "precision": precision.name,
                "updates": len(schedule),
                "phases": phases,
                # Which documents each worker held for each update: the split is part of the record.
                "assignment": batching.assignment(schedule, work, ctx.world_size),
                "active_seconds": last_end - first_start,
                "rendezvous_seconds": ctx.rendezvous_seconds,
                "memory_by_rank": memory,
                # Every rank's per-update breakdown (rank 0's is also the per-update metrics).
                "times_by_rank": times_by_rank,
                # Every rank's peak resident set growth per update, MiB (schema.M_NEW_MEMORY_MB).
                "new_memory_mb_by_rank": new_memory_by_rank,
                # Whether rank 0's host takes back free memory, and what it had ready for first
                # touches before update 1 and after each update, MiB (schema.M_READY_MEMORY_MB).
                "free_page_reporting": machine.free_page_reporting(),
                "ready_memory_mb": ready_memory,
                # Real tokens / computed positions of rank 0's forwards: 1.0, packed.
                "padding_efficiency": local_tokens / computed if computed else 1.0,
                "inputs_sha256": prepared.digest,
                "seed_sha256": seed.sha256,
                "torch": torch.__version__,
            }
            try:
                _record_run(rec, summary, counter, saved, cuda=ctx.device.type == "cuda")
            except BaseException:
                _ending()
                # The run fails: its checkpoint goes, as for a failure during training,
                # unless its upload waits in the outbox, which needs the folder (kept
                # where the outbox cannot be read: its error is not the run's).
                if saved is not None:
                    try:
                        waits = rec.waits_to_upload(saved.folder)
                    except OSError:
                        waits = True
                    if not waits:
                        checkpoint.withdraw(saved)
                raise
        # The DDP model and its comm-hook state must go before the process
        # group does: gloo otherwise aborts now and then at interpreter exit.
        del net, counter


def _gather_peak_memory(ctx: distributed.DistContext) -> list[dict[str, float]]:
    """Every rank's peak memory (the figure that decides whether a setting fits a device)."""
    names = ("peak_rss_mb", "cuda_max_allocated_mb", "cuda_max_reserved_mb")
    return [dict(zip(names, values)) for values in distributed.gather_floats(_peak_memory_mb(ctx.device), ctx)]


def _gather_cores(ctx: distributed.DistContext, threads: int) -> list[list[int] | None]:
    mine = list(ctx.cores) if ctx.cores is not None else [-1] * threads
    return [[int(c) for c in cores] if cores[0] >= 0 else None for cores in distributed.gather_floats(mine, ctx)]


def _gather_times(ctx: distributed.DistContext, times: list[update.UpdateTimes]) -> list[dict[str, list[float]]]:
    """Every rank's per-update breakdown: the faster rank's communication
    seconds hold its wait for the slower."""
    parts = [f.name for f in dataclasses.fields(update.UpdateTimes)]
    n = len(times)
    mine = [getattr(t, part) for part in parts for t in times]
    return [{part: values[i * n : (i + 1) * n] for i, part in enumerate(parts)} for values in distributed.gather_floats(mine, ctx)]


def _record_run(rec: writer.Recorder, summary: dict, counter: distributed.ByteCounter | None, saved: checkpoint.Saved | None, *, cuda: bool) -> None:
    """Rank 0's part of the run record; the stage adds complete seconds and cost."""
    memory = summary["memory_by_rank"]
    totals = counter.totals() if counter else None
    summary["bytes"] = dataclasses.asdict(totals) | {"total": totals.total} if totals else None
    metrics = {
        schema.M_ACTIVE_SECONDS: summary["active_seconds"],
        schema.M_RENDEZVOUS_SECONDS: summary["rendezvous_seconds"],
        schema.M_PEAK_RSS_MB: max(m["peak_rss_mb"] for m in memory),
        schema.M_BYTES_DENSE: totals.dense if totals else 0,
        schema.M_BYTES_COMPRESSED: totals.compressed if totals else 0,
        schema.M_BYTES_TOTAL: totals.total if totals else 0,
        schema.M_BYTES_SETUP: totals.setup if totals else 0,
    }
    if cuda:
        metrics[schema.M_CUDA_MAX_ALLOCATED_MB] = max(m["cuda_max_allocated_mb"] for m in memory)
        metrics[schema.M_CUDA_MAX_RESERVED_MB] = max(m["cuda_max_reserved_mb"] for m in memory)
    if saved is not None:
        upload_start = time.perf_counter()
        rec.log_artifact(saved.folder, schema.ART_CHECKPOINT)
        # Writing, hashing, reading back and keeping it in the record.
        metrics[schema.M_CHECKPOINT_SECONDS] = saved.seconds + time.perf_counter() - upload_start
        rec.set_tags({schema.TAG_CHECKPOINT_SHA: saved.sha256, schema.TAG_CHECKPOINT_PATH: str(saved.folder)})
        summary["checkpoint"] = {"path": str(saved.folder), "sha256": saved.sha256, "seconds": metrics[schema.M_CHECKPOINT_SECONDS]}
    rec.log_metrics(metrics)
    rec.log_dict(summary, schema.ART_TRAIN_SUMMARY)


def _peak_memory_mb(device: torch.device) -> list[float]:
    """[peak RSS, CUDA max allocated, CUDA max reserved] of this process, MiB."""
    rss = capacity.peak_rss_mb()
    if device.type != "cuda":
        return [rss, 0.0, 0.0]
    return [rss, torch.cuda.max_memory_allocated(device) / 2**20, torch.cuda.max_memory_reserved(device) / 2**20]


def _record_error(run_id: str, rank: int, err: BaseException, said: str | None = None) -> bool:
    """Keep this process's error on the run (its tag `said` where given);
    the stage's own error tag says what it saw from outside (exit codes), this
    says why. False where it could not be kept."""
    _ending()
    try:
        rec = writer.Recorder(run_id)
        tag = f"{type(err).__name__}: {said}" if said else errors.labelled(err)
        rec.set_tags({f"{schema.TAG_WORKER_ERROR_PREFIX}{rank}": tag[: writer.MAX_TAG_CHARS]})
        rec.log_text("".join(traceback.format_exception(err)), f"{schema.ART_WORKER_ERROR_PREFIX}{rank}.txt")
    except Exception:  # noqa: BLE001 - the original error matters more than the record of it
        return False
    return True


def _ending() -> None:
    """From here on the process only records its failure and exits: SIGTERM
    is ignored. Once one rank has failed the launcher sends the others SIGTERM
    within a tenth of a second (run.one_host_launcher), often while they write
    what they measured or why they failed, and `_on_sigterm`'s exception would
    cut that record short."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


def _on_sigterm(signum: int, frame: object) -> None:
    stop = Stopped(f"stopped by {signal.Signals(signum).name} (sent to every rank once one has failed, or when the job is stopped)")
    _STOPS.append(stop)
    raise stop


_STOPS: list[Stopped] = []
"""The stops this process was sent (main clears it): torch re-raises an
exception from a future's callback (the comm hook's) as a RuntimeError that
keeps only its text, so the chain alone may not show the stop behind an error."""


def _positive(raw: str) -> int:
    value = int(raw)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{raw} is not a positive number")
    return value


HELP = "one training process of an arm (started by `train`, `probe` and `bench arms`, not by hand)"


class _Parser(argparse.ArgumentParser):
    """A bad argument in one line, as the command line says its own."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"coopstudy worker: error: {message}\n")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--arm", choices=ARMS, required=True)
    parser.add_argument("--config", required=True, help="the resolved config (launch.encode_config)")
    parser.add_argument("--run-id", default=os.environ.get(writer.ENV_RUN_ID), help="the MLflow run this process writes to")
    parser.add_argument("--allocator", choices=ALLOCATORS, default=TRAINING_ALLOCATOR)
    parser.add_argument("--updates", type=_positive, default=None, help="stop after this many updates (probes)")
    parser.add_argument("--no-checkpoint", action="store_true", help="keep no final weights (probes)")
    parser.add_argument("--probe", action="store_true", help="report update seconds and memory to the run, whatever the outcome")
    parser.add_argument("--capacity-mb", type=_positive, default=None, help="with --probe: the device's capacity, MiB")


def main(args: argparse.Namespace) -> int:
    if not args.run_id:
        raise UserError(f"--run-id or {writer.ENV_RUN_ID} is required")
    # The launcher's environment says the same on this host; a rank on a
    # second host gets only what DeepSpeed forwards, so the process sets it
    # itself, before CUDA's allocator reads it on the first allocation.
    launch.set_allocator(os.environ, args.allocator)
    _STOPS.clear()
    signal.signal(signal.SIGTERM, _on_sigterm)
    rank = distributed.env_rank()
    probing = capacity.RankProbe(args.run_id, rank, args.capacity_mb) if args.probe else None
    # The worker of train, probe and bench arms alike: named by its arm.
    who = f"coopstudy worker ({args.arm}, rank {rank})"
    try:
        cfg = launch.decode_config(args.config)
        train(cfg, args.arm, args.run_id, updates=args.updates, save=not args.no_checkpoint, probing=probing)
    except BaseException as raised:
        err = _known_cause(raised) or raised
        # A stop's or a user's error is said as itself: a stopped rank's peer is often gone first.
        known = isinstance(err, (UserError, Stopped)) or outbox.is_outage(err)
        lost = _peer_lost(err) if args.arm == COMPRESSED and not known else None
        # gloo's own words nest the hook's error three times over: said plainly, on the run too.
        said = f"a collective failed, another rank having gone ({lost})" if lost else None
        recorded = _record_error(args.run_id, rank, err, said)
        _report(probing, err)
        if isinstance(err, (UserError, Stopped)):
            # Known causes need no traceback: one line, and the record.
            print(f"{who}: {err}", file=sys.stderr)
            return 2 if isinstance(err, UserError) else 128 + signal.SIGTERM
        if outbox.is_outage(err):
            # Before training the ranks read the record (the ledger's runs); an outage then is one line too.
            print(f"{who}: the tracking server stopped answering ({outbox.reason(err)})", file=sys.stderr)
            return 2
        if store.on_full_disk(err):
            # Its error could not be recorded either; the stage says the same when it ends the run.
            print(f"{who}: {store.full_disk_said()}", file=sys.stderr)
            return 2
        if store.on_locked(err):
            # Past SQLite's wait; the stage, which writes the run's end, meets the same lock or finds it gone.
            print(f"{who}: {store.locked_said()}", file=sys.stderr)
            return 2
        if probing is not None and capacity.outcome_of(err) == schema.OUTCOME_OUT_OF_MEMORY:
            # What a probe is for: one line here, the traceback on the run.
            print(f"{who}: {err}", file=sys.stderr)
            return 1
        if said is not None:
            # Another rank's failure, which the stage names: one line here, the traceback on the run.
            print(f"{who}: {said}{'; the traceback is on the run' if recorded else ''}", file=sys.stderr)
            return 1
        raise
    if probing is not None:
        probing.finish(None)
    return 0


def _peer_lost(err: BaseException) -> str | None:
    """Why a collective failed, where another rank went away (`Connection
    reset by peer`); None for any other error. torch re-raises the comm hook's
    error as a RuntimeError holding only its text, so the text is what is read."""
    found = next((m for seen in errors.chain(err) if (m := _PEER_LOST.search(str(seen)))), None)
    return found[0] if found else None


def _known_cause(err: BaseException) -> UserError | Stopped | None:
    """A stop or a user's mistake behind `err`: a SIGTERM that lands inside
    MLflow's write of the record comes out as MLflow's exception raised from
    it. Only causes: an error raised while handling another is its own. An
    error after this process was stopped is the stop's (_STOPS)."""
    seen: BaseException | None = err
    while seen is not None:
        if isinstance(seen, (UserError, Stopped)):
            return seen
        seen = seen.__cause__
    return _STOPS[0] if _STOPS else None


def _report(probing: capacity.RankProbe | None, err: BaseException) -> None:
    """The probe's report of a failed process; the failure matters more than its report."""
    if probing is None:
        return
    try:
        probing.finish(err)
    except Exception:  # noqa: BLE001
        pass


def entry(argv: list[str] | None = None) -> NoReturn:
    """`python -m coopstudy.run.worker ARGS`: one training process, from its
    arguments to its exit code, as coopstudy.cli.entry runs a command."""
    machine.set_library_defaults()
    parser = _Parser(prog="coopstudy worker", description=HELP, allow_abbrev=False)
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        code = main(args)
    except UserError as err:  # before training: its run id or rank
        print(f"coopstudy worker: error: {err}", file=sys.stderr)
        code = 2
    except KeyboardInterrupt:
        print("coopstudy worker: interrupted", file=sys.stderr)
        code = 128 + signal.SIGINT
    except OSError as err:
        said = errors.os_error_said(err)
        if said is None:
            raise
        print(f"coopstudy worker: error: {said}", file=sys.stderr)
        code = 2
    # As coopstudy.cli.entry: exit without Python's search of torch's objects for cycles (about 1 s).
    gc.freeze()
    sys.exit(code)


if __name__ == "__main__":
    entry()
