"""train: run the control, the compressed arm, or both in turn."""

from __future__ import annotations

import argparse
from pathlib import Path

from coopstudy.commit import require
from coopstudy.config import ARMS, Config
from coopstudy.errors import UserError
from coopstudy.record import schema, store, writer
from coopstudy.run import launch, lock

HELP = "train the control and/or the compressed arm (the same loop), timed from launch to exit"
DESCRIPTION = f"""\
Trains the seed model on the committed schedule. The control is one plain
process (`python -m coopstudy worker`); the compressed arm is that command
started by the DeepSpeed launcher as two ranks (DDP with the PowerSGD hook),
on one host (`deepspeed --num_gpus 2`) or on two hosts (--hostfile: both hosts
need this checkout and environment, the same prepared inputs and gate receipt,
passwordless ssh and pdsh, and a tracking server both reach). On CPU one
device is train.threads_per_device cores. `--arm both` trains the control, then
the compressed arm, never both at once; a lock refuses a second training job
on the same devices.

Reads:  the committed plan (`plan`), and through it the gate receipt (`verify`),
        the committed inputs (`prepare`) and the probe receipts (`probe`);
        refuses without them, or when a source file, an input file or a
        receipt the plan hashes has changed since, naming it. Refuses to start
        an arm whose projected cost, added to what the plan has spent (its
        probes and its earlier train runs, failed ones included), would pass
        budget.allocation_usd, or whose projected end is after budget.deadline.
Writes: per arm, an MLflow run (stage {schema.STAGE_TRAIN!r}, tags {schema.TAG_ARM} and
        {schema.TAG_PLAN}, name train-<arm>-<preset>; children of a train-both-<preset> run with --arm both):
        per update {schema.M_LOSS}, {schema.M_GRAD_NORM}, {schema.M_LR}, {schema.M_UPDATE_SECONDS},
        {schema.M_TOKENS}, {schema.M_BYTES}; per run {schema.M_ACTIVE_SECONDS}, {schema.M_COMPLETE_SECONDS},
        {schema.M_CHECKPOINT_SECONDS}, {schema.M_DEVICE_SECONDS}, {schema.M_COST_USD} (spent), {schema.M_PROJECTED_COST_USD},
        {schema.M_PROJECTED_SECONDS}, {schema.M_SPENT_BEFORE_USD}, peak memory and
        bytes by phase; the final weights (safetensors + tokenizer, read back and
        verified) under <home>/checkpoints/<run id>/, as artifact {schema.ART_CHECKPOINT!r} and
        tags {schema.TAG_CHECKPOINT_SHA}, {schema.TAG_CHECKPOINT_PATH}; {schema.ART_TRAIN_SUMMARY}.
        A failure leaves the run FAILED with the error of every process that had one.
"""


class TrainingFailed(UserError):
    """An arm's processes did not finish: the run is FAILED and says why."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--arm", choices=(*ARMS, "both"), default="both", help="which arm to train (default: both, control first)")
    parser.add_argument(
        "--hostfile",
        type=Path,
        default=None,
        help="run the compressed arm's two ranks on two hosts: an MPI-style hostfile, one `HOST slots=1` line per host",
    )


def guard(rec: writer.Recorder, cfg: Config, sha: str, arms: tuple[str, ...]) -> None:
    """The budget and deadline guard; what it compared stays on the run
    whatever it decides."""
    from coopstudy.commit import budget, plan

    p = budget.projected(cfg, sha, plan.document(cfg, sha), arms)
    rec.log_metrics(
        {schema.M_PROJECTED_SECONDS: p.seconds, schema.M_PROJECTED_COST_USD: p.cost_usd, schema.M_SPENT_BEFORE_USD: p.spent_usd}
    )
    budget.check_budget(cfg, sha, p)


def _failure(run_id: str, arm: str, workers: int, code: int) -> str:
    """One line: what the launch ended with and what each process recorded."""
    from mlflow import MlflowClient

    tags = MlflowClient(store.tracking_uri()).get_run(run_id).data.tags
    said = {r: tags.get(f"{schema.TAG_WORKER_ERROR_PREFIX}{r}") for r in range(workers)}
    parts = [f"{arm} arm failed ({launch.exit_reason(code, launcher=workers > 1)})"]
    parts += [f"rank {r}: {e}" for r, e in said.items() if e]
    silent = [str(r) for r, e in said.items() if not e]
    if silent:
        parts.append(f"rank {', '.join(silent)} recorded no error (killed from outside, or out of host memory)")
    return "; ".join(parts)


def _arm_run(cfg: Config, arm: str, tags: dict[str, str] | None = None):
    return writer.stage_run(schema.STAGE_TRAIN, cfg, arm=arm, run_name=f"train-{arm}-{cfg.preset}", tags=tags)


def train_arm(rec: writer.Recorder, cfg: Config, arm: str, hostfile: Path | None) -> None:
    """Launch the arm's processes into run `rec`, time them from outside, and
    confirm they left a verified checkpoint."""
    workers = getattr(cfg.arms, arm).workers
    cmd = launch.command(cfg, arm, rec.run_id, hostfile=hostfile if arm == "compressed" else None)
    how = "1 process" if workers == 1 else f"{workers} ranks via the DeepSpeed launcher"
    print(f"train {arm}: {how}, {cfg.train.updates} updates, run {rec.run_id}", flush=True)
    done = launch.run(cmd, launch.worker_environment(cfg, rec.run_id), workers)
    device_seconds = workers * done.complete_seconds
    # A failed attempt spent its device time too: recorded either way.
    rec.log_metrics(
        {
            schema.M_COMPLETE_SECONDS: done.complete_seconds,
            schema.M_DEVICE_SECONDS: device_seconds,
            schema.M_COST_USD: device_seconds / 3600 * cfg.budget.hourly_price_usd,
        }
    )
    if done.returncode != 0:
        raise TrainingFailed(_failure(rec.run_id, arm, workers, done.returncode))
    from mlflow import MlflowClient

    record = MlflowClient(store.tracking_uri()).get_run(rec.run_id).data
    if schema.TAG_CHECKPOINT_SHA not in record.tags:
        raise TrainingFailed(f"{arm} arm: the processes exited cleanly but left no verified checkpoint on run {rec.run_id}")
    print(
        f"train {arm}: finished; active {record.metrics[schema.M_ACTIVE_SECONDS]:.1f} s, "
        f"complete {done.complete_seconds:.1f} s; checkpoint {record.tags[schema.TAG_CHECKPOINT_PATH]} "
        f"(sha256 {record.tags[schema.TAG_CHECKPOINT_SHA][:12]})",
        flush=True,
    )


def run(cfg: Config, args: argparse.Namespace) -> int:
    arms = ARMS if args.arm == "both" else (args.arm,)
    if args.hostfile is not None and not args.hostfile.is_file():
        raise UserError(f"--hostfile {args.hostfile}: no such file")
    devices = launch.devices_of(cfg, arms, args.hostfile)
    holder = f"coopstudy train --arm {args.arm} --preset {cfg.preset}"
    if len(arms) == 1:
        # The arm's run is the stage's run: the lock and the prerequisites are
        # checked inside it, so a refusal stays on record as a FAILED attempt.
        with _arm_run(cfg, arms[0]) as rec:
            with lock.device_lock(devices, holder):
                sha, req = require.training(cfg)
                rec.set_tags(req)
                guard(rec, cfg, sha, arms)
                train_arm(rec, cfg, arms[0], args.hostfile)
        return 0
    with writer.stage_run(schema.STAGE_TRAIN, cfg, run_name=f"train-both-{cfg.preset}") as parent:
        # One lock over both arms: no other job slips in between them.
        with lock.device_lock(devices, holder):
            sha, req = require.training(cfg)
            parent.set_tags(req)
            # Both arms must fit before the first starts; each is checked
            # again at its start, against what the first really spent.
            guard(parent, cfg, sha, arms)
            for arm in arms:
                with _arm_run(cfg, arm, req) as rec:
                    guard(rec, cfg, sha, (arm,))
                    train_arm(rec, cfg, arm, args.hostfile)
    return 0
