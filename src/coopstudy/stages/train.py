"""train: run the control, the compressed arm, or both in turn."""

from __future__ import annotations

import argparse
from pathlib import Path

from coopstudy import launch, ledger as ledger_mod, lock, tracking
from coopstudy.config import Config
from coopstudy.errors import UserError

ARMS = ("control", "compressed")

HELP = "train the control and/or the compressed arm (the same loop), timed from launch to exit"
DESCRIPTION = f"""\
Trains the seed model on the committed schedule. The control is one plain
process (`python -m coopstudy.train`); the compressed arm is that module
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
Writes: per arm, an MLflow run (stage {tracking.STAGE_TRAIN!r}, tags {tracking.TAG_ARM} and
        {tracking.TAG_PLAN}, name train-<arm>-<preset>; children of a train-both-<preset> run with --arm both):
        per update {tracking.M_LOSS}, {tracking.M_GRAD_NORM}, {tracking.M_LR}, {tracking.M_UPDATE_SECONDS},
        {tracking.M_TOKENS}, {tracking.M_BYTES}; per run {tracking.M_ACTIVE_SECONDS}, {tracking.M_COMPLETE_SECONDS},
        {tracking.M_CHECKPOINT_SECONDS}, {tracking.M_DEVICE_SECONDS}, {tracking.M_COST_USD} (spent), {tracking.M_PROJECTED_COST_USD},
        {tracking.M_PROJECTED_SECONDS}, {tracking.M_SPENT_BEFORE_USD}, peak memory and
        bytes by phase; the final weights (safetensors + tokenizer, read back and
        verified) under <home>/checkpoints/<run id>/, as artifact {tracking.ART_CHECKPOINT!r} and
        tags {tracking.TAG_CHECKPOINT_SHA}, {tracking.TAG_CHECKPOINT_PATH}; {tracking.ART_TRAIN_SUMMARY}.
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


def committed(cfg: Config) -> dict[str, str]:
    """Tags naming the gate receipt and the inputs any training process (a
    probe too) depends on, or a refusal that says which is missing."""
    from coopstudy import gate, train

    receipt = gate.require_gate_receipt()
    prepared, seed = train.committed_inputs(cfg)
    return {
        tracking.TAG_REQUIRES_PREFIX + ledger_mod.GATE: receipt.digest,
        tracking.TAG_REQUIRES_PREFIX + ledger_mod.INPUTS: prepared.digest,
        tracking.TAG_SEED_SHA: seed.sha256,
    }


def prerequisites(cfg: Config) -> tuple[str, dict[str, str]]:
    """(the plan's sha256, the tags naming every commitment the training
    depends on), or a refusal naming what is missing or changed."""
    from coopstudy import plan

    # In protocol order: a changed source is first a stale gate receipt, a
    # changed input file first an input that no longer verifies; each names it.
    tags = committed(cfg)
    sha = plan.require_plan(cfg)
    return sha, tags | {tracking.TAG_PLAN: sha, tracking.TAG_REQUIRES_PREFIX + ledger_mod.PLAN: sha}


def guard(rec: tracking.Recorder, cfg: Config, sha: str, arms: tuple[str, ...]) -> None:
    """The budget and deadline guard; what it compared stays on the run
    whatever it decides."""
    from coopstudy import plan

    p = plan.projected(cfg, sha, plan.document(cfg, sha), arms)
    rec.log_metrics(
        {tracking.M_PROJECTED_SECONDS: p.seconds, tracking.M_PROJECTED_COST_USD: p.cost_usd, tracking.M_SPENT_BEFORE_USD: p.spent_usd}
    )
    plan.check_budget(cfg, sha, p)


def devices_of(cfg: Config, arms: tuple[str, ...], hostfile: Path | None) -> list[str]:
    found: set[str] = set()
    for arm in arms:
        found.update(launch.local_devices(getattr(cfg.arms, arm).workers, hostfile=hostfile if arm == "compressed" else None))
    return sorted(found)


def _failure(run_id: str, arm: str, workers: int, code: int) -> str:
    """One line: what the launch ended with and what each process recorded."""
    from mlflow import MlflowClient

    tags = MlflowClient(tracking.tracking_uri()).get_run(run_id).data.tags
    said = {r: tags.get(f"{tracking.TAG_WORKER_ERROR_PREFIX}{r}") for r in range(workers)}
    parts = [f"{arm} arm failed ({launch.exit_reason(code, launcher=workers > 1)})"]
    parts += [f"rank {r}: {e}" for r, e in said.items() if e]
    silent = [str(r) for r, e in said.items() if not e]
    if silent:
        parts.append(f"rank {', '.join(silent)} recorded no error (killed from outside, or out of host memory)")
    return "; ".join(parts)


def _arm_run(cfg: Config, arm: str, tags: dict[str, str] | None = None):
    return tracking.stage_run(tracking.STAGE_TRAIN, cfg, arm=arm, run_name=f"train-{arm}-{cfg.preset}", tags=tags)


def train_arm(rec: tracking.Recorder, cfg: Config, arm: str, hostfile: Path | None) -> None:
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
            tracking.M_COMPLETE_SECONDS: done.complete_seconds,
            tracking.M_DEVICE_SECONDS: device_seconds,
            tracking.M_COST_USD: device_seconds / 3600 * cfg.budget.hourly_price_usd,
        }
    )
    if done.returncode != 0:
        raise TrainingFailed(_failure(rec.run_id, arm, workers, done.returncode))
    from mlflow import MlflowClient

    record = MlflowClient(tracking.tracking_uri()).get_run(rec.run_id).data
    if tracking.TAG_CHECKPOINT_SHA not in record.tags:
        raise TrainingFailed(f"{arm} arm: the processes exited cleanly but left no verified checkpoint on run {rec.run_id}")
    print(
        f"train {arm}: finished; active {record.metrics[tracking.M_ACTIVE_SECONDS]:.1f} s, "
        f"complete {done.complete_seconds:.1f} s; checkpoint {record.tags[tracking.TAG_CHECKPOINT_PATH]} "
        f"(sha256 {record.tags[tracking.TAG_CHECKPOINT_SHA][:12]})",
        flush=True,
    )


def run(cfg: Config, args: argparse.Namespace) -> int:
    arms = ARMS if args.arm == "both" else (args.arm,)
    if args.hostfile is not None and not args.hostfile.is_file():
        raise UserError(f"--hostfile {args.hostfile}: no such file")
    devices = devices_of(cfg, arms, args.hostfile)
    holder = f"coopstudy train --arm {args.arm} --preset {cfg.preset}"
    if len(arms) == 1:
        # The arm's run is the stage's run: the lock and the prerequisites are
        # checked inside it, so a refusal stays on record as a FAILED attempt.
        with _arm_run(cfg, arms[0]) as rec:
            with lock.device_lock(devices, holder):
                sha, req = prerequisites(cfg)
                rec.set_tags(req)
                guard(rec, cfg, sha, arms)
                train_arm(rec, cfg, arms[0], args.hostfile)
        return 0
    with tracking.stage_run(tracking.STAGE_TRAIN, cfg, run_name=f"train-both-{cfg.preset}") as parent:
        # One lock over both arms: no other job slips in between them.
        with lock.device_lock(devices, holder):
            sha, req = prerequisites(cfg)
            parent.set_tags(req)
            # Both arms must fit before the first starts; each is checked
            # again at its start, against what the first really spent.
            guard(parent, cfg, sha, arms)
            for arm in arms:
                with _arm_run(cfg, arm, req) as rec:
                    guard(rec, cfg, sha, (arm,))
                    train_arm(rec, cfg, arm, args.hostfile)
    return 0
