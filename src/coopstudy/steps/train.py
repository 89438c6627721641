"""train: run the control, the compressed arm, or both in turn."""

from __future__ import annotations

import argparse
import contextlib
import shlex
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from coopstudy import errors, workspace
from coopstudy.commit import budget, candidates, require
from coopstudy.config import ARMS, BOTH, COMPRESSED, CONTROL, Config, arms_of, set_arguments
from coopstudy.errors import UserError
from coopstudy.record import outbox, schema, store, writer
from coopstudy.run import launch, lock

HELP = "train the control and/or the compressed arm (the same loop), timed from launch to exit"
DESCRIPTION = f"""\
Trains the seed model on the committed schedule. The control is one plain
process (`python -m coopstudy.run.worker`); the compressed arm is that command
started by the DeepSpeed launcher as two ranks (DDP with the PowerSGD hook),
on one host (its per-node launcher) or on two hosts (--hostfile: both hosts
need this checkout and environment at the same absolute paths, the same
prepared inputs and gate receipt,
passwordless ssh and pdsh, and a tracking server both reach). On CPU one
device is train.threads_per_device cores. `--arm both` trains the control, then
the compressed arm, never both at once; a lock refuses a second job
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
        {schema.M_TOKENS}, {schema.M_BYTES}, and where that update's seconds went:
        {schema.M_FORWARD_BACKWARD_SECONDS}, {schema.M_COMM_SECONDS}, {schema.M_OPTIMIZER_SECONDS},
        {schema.M_OTHER_SECONDS}, {schema.M_RECORD_SECONDS}; per run {schema.M_ACTIVE_SECONDS}, {schema.M_COMPLETE_SECONDS},
        {schema.M_CHECKPOINT_SECONDS}, {schema.M_DEVICE_SECONDS}, {schema.M_COST_USD} (spent), {schema.M_PROJECTED_COST_USD},
        {schema.M_PROJECTED_SECONDS}, {schema.M_SPENT_BEFORE_USD}, peak memory and
        bytes by phase; the final weights (safetensors + tokenizer, read back and
        verified) under <home>/checkpoints/<run id>/, as artifact {schema.ART_CHECKPOINT!r} and
        tags {schema.TAG_CHECKPOINT_SHA}, {schema.TAG_CHECKPOINT_PATH}; {schema.ART_TRAIN_SUMMARY}.
        A failure leaves the run FAILED with the error of every process that had one;
        Ctrl-C, SIGTERM or SIGHUP stops every process it launched (within
        {launch.STOP_GRACE_S:.0f} s) and leaves the run KILLED with the reason. A job that
        finds the lock of a job that died holding it (SIGKILL) says so, stops what
        that job left running, ends its runs KILLED and proceeds.

Two hosts without ssh (the compressed arm, one node per host, started by hand):
  node 0:  train --arm compressed --nodes 2 --node-rank 0 --master-addr ADDR0 --master-port PORT
           opens the arm's run and prints the command for node 1, with its --run-id;
  node 1:  train --arm compressed --nodes 2 --node-rank 1 --master-addr ADDR0 --master-port PORT --run-id RUN
           checks its own workspace (plan, gate, inputs) and joins that run; node 0
           ends it. Both use the same preset and --set overrides; node 1 must start
           within distributed.collective_timeout_s of node 0. --hostfile names the
           hosts (one `HOST slots=1` line each) and is optional here: without ssh
           the launcher only counts them.
"""


class TrainingFailed(UserError):
    """An arm's processes did not finish: the run is FAILED and says why."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--arm", choices=(*ARMS, BOTH), default=BOTH, help="which arm to train (default: both, control first)")
    parser.add_argument(
        "--hostfile",
        type=launch.hostfile_path,
        default=None,
        help="run the compressed arm's two ranks on two hosts: an MPI-style hostfile, one `HOST slots=1` line per host "
        "(default: none, every rank on this host)",
    )
    two = parser.add_argument_group("one node of a job started by hand on each host (no ssh)")
    two.add_argument("--nodes", type=int, default=None, help="how many hosts the compressed arm runs on (2: one rank each; default: 1, this host alone)")
    two.add_argument("--node-rank", type=int, default=None, help="this host's node: 0 opens the run, the others join it (required with --nodes)")
    two.add_argument("--master-addr", default=None, help="node 0's address, which every node reaches (required with --nodes)")
    two.add_argument("--master-port", type=int, default=None, help="the rendezvous port on node 0, the same on every node (required with --nodes)")
    two.add_argument("--run-id", default=None, help="on a node other than 0: the run node 0 opened (it prints the command; required there)")


def guard(rec: writer.Recorder, cfg: Config, sha: str, arms: tuple[str, ...]) -> None:
    """The budget and deadline guard; what it compared stays on the run
    whatever it decides."""
    from coopstudy.commit import plan

    p = budget.projected(cfg, sha, plan.document(cfg, sha), arms)
    rec.log_metrics(
        {schema.M_PROJECTED_SECONDS: p.seconds, schema.M_PROJECTED_COST_USD: p.cost_usd, schema.M_SPENT_BEFORE_USD: p.spent_usd}
    )
    budget.check_budget(cfg, sha, p)


def _arm_run(cfg: Config, arm: str, tags: dict[str, str] | None = None):
    return writer.stage_run(schema.STAGE_TRAIN, cfg, arm=arm, tags=tags)


@dataclass(frozen=True)
class Nodes:
    """One node of the compressed arm started by hand on each host."""

    count: int
    rank: int
    master_addr: str
    master_port: int
    hostfile: Path
    run_id: str | None
    """On a node other than 0: the run node 0 opened."""


def check_arguments(cfg: Config, args: argparse.Namespace) -> None:
    """What train refuses in its arguments, before any work (and under --dry-run)."""
    _checked_node_count(cfg, args)


def _checked_node_count(cfg: Config, args: argparse.Namespace) -> int | None:
    """Every refusal of train's arguments; then how many nodes, or None for a job this host runs whole."""
    count = _node_count(cfg, args)
    if args.hostfile is not None and count is None:
        if args.arm == CONTROL:
            raise UserError(f"--hostfile: only the compressed arm runs on several hosts (got --arm {args.arm})")
        launch.check_hostfile(args.hostfile, cfg.arms.compressed.workers)
    if args.arm != CONTROL:
        launch.check_backend(cfg, ranks_here=args.hostfile is None or count is not None)
    return count


def _node_count(cfg: Config, args: argparse.Namespace) -> int | None:
    """The --nodes options, checked: how many nodes, or None for a job this host runs whole."""
    given = [f"--{n.replace('_', '-')}" for n in ("node_rank", "master_addr", "master_port", "run_id") if getattr(args, n, None) is not None]
    count = getattr(args, "nodes", None)
    if count is None or count == 1:
        if given:
            nodes = "give --nodes too" if count is None else "--nodes 1 is a job on this host alone, which takes none of them"
            what = "options" if len(given) > 1 else "an option"
            raise UserError(f"{', '.join(given)}: {what} of one node of a job on several hosts; {nodes}")
        return None
    workers = cfg.arms.compressed.workers
    if count < 1:
        raise UserError(f"--nodes {count}: a job runs on at least 1 host")
    if args.arm != COMPRESSED:
        raise UserError(f"--nodes {count}: only the compressed arm runs on several hosts (got --arm {args.arm})")
    if workers % count:
        raise UserError(f"--nodes {count}: the compressed arm's {workers} workers do not split over {count} hosts")
    missing = [o for o in ("--node-rank", "--master-addr", "--master-port") if getattr(args, o[2:].replace("-", "_")) is None]
    if missing:
        raise UserError(f"--nodes {count} needs {', '.join(missing)} (the same address and port on every node)")
    if not args.master_addr.strip():
        raise UserError("--master-addr: an empty address; give node 0's, which every node reaches")
    if not 0 <= args.node_rank < count:
        raise UserError(f"--node-rank {args.node_rank}: a job of {count} nodes has nodes 0 to {count - 1}")
    if not 0 < args.master_port < 65536:
        raise UserError(f"--master-port {args.master_port} is not a TCP port")
    if args.node_rank == 0 and args.run_id is not None:
        raise UserError("--run-id is for the other nodes: node 0 opens the run and prints the command that joins it")
    if args.node_rank > 0 and args.run_id is None:
        raise UserError(f"node {args.node_rank} joins the run node 0 opened: give its --run-id (node 0 prints the command)")
    if args.hostfile is not None:
        launch.check_hostfile(args.hostfile, count, workers // count)
    return count


def _nodes(cfg: Config, args: argparse.Namespace, count: int | None) -> Nodes | None:
    """The --nodes options, checked (`count` nodes), or None for a job this host runs whole."""
    if count is None:
        return None
    per_node = cfg.arms.compressed.workers // count
    hostfile = args.hostfile if args.hostfile is not None else launch.node_hostfile(count, per_node)
    return Nodes(count, args.node_rank, args.master_addr, args.master_port, hostfile, args.run_id)


def _join_command(args: argparse.Namespace, nodes: Nodes, run_id: str, rank: int) -> str:
    words = ["python", "-m", "coopstudy", "train", "--preset", str(args.preset), "--arm", COMPRESSED]
    words += set_arguments(args.overrides)
    if args.hostfile is not None:
        words += ["--hostfile", str(args.hostfile)]
    words += ["--nodes", str(nodes.count), "--node-rank", str(rank), "--master-addr", nodes.master_addr]
    words += ["--master-port", str(nodes.master_port), "--run-id", run_id]
    return shlex.join(words)


def train_arm(
    rec: writer.Recorder, cfg: Config, arm: str, hostfile: Path | None, held: lock.Held | None = None, nodes: Nodes | None = None
) -> None:
    """Launch the arm's processes into run `rec`, time them from outside, and
    confirm they left a verified checkpoint."""
    workers = cfg.arm(arm).workers
    if nodes is not None:
        cmd = launch.command(
            cfg, arm, rec.run_id, hostfile=nodes.hostfile, nodes=nodes.count, node_rank=0,
            master_addr=nodes.master_addr, master_port=nodes.master_port,
        )  # fmt: skip
    else:
        cmd = launch.command(cfg, arm, rec.run_id, hostfile=hostfile if arm == COMPRESSED else None)
    print(f"train {arm}: {cmd.how}, {cfg.train.updates} updates, run {rec.run_id}", flush=True)
    start = time.perf_counter()
    try:
        done = launch.run(cmd, launch.worker_environment(cfg, rec.run_id), label=f"train {arm}", held=held)
    except BaseException:
        # A stopped attempt spent its devices until the stop: the budget guard
        # counts it. A failure to record it must not take the stop's place.
        with contextlib.suppress(Exception):
            _log_spent(rec, cfg, workers, time.perf_counter() - start)
        raise
    # A failed attempt spent its device time too: recorded either way.
    _log_spent(rec, cfg, workers, done.complete_seconds, launch.machine_metrics(done))
    if done.returncode != 0:
        raise TrainingFailed(launch.failure(rec.run_id, arm, workers, done.returncode, here=workers // nodes.count if nodes else None))

    try:
        record = store.client().get_run(rec.run_id).data
    except Exception as err:
        if not outbox.is_outage(err):
            raise
        # Exit 0: rank 0 recorded its checkpoint, delivered or kept in the outbox; the
        # folder it verified stands for the record here (where rank 0 ran on this host).
        kept = workspace.checkpoint_folder(rec.run_id)
        if not kept.is_dir():
            raise TrainingFailed(
                f"{arm} arm: the processes exited cleanly, but no checkpoint is at {kept}, and the tracking server, "
                f"which would say where rank 0 left it, stopped answering ({outbox.reason(err)})"
            ) from err
        print(
            f"train {arm}: finished, complete {done.complete_seconds:.1f} s; checkpoint {kept}; the tracking server stopped "
            f"answering ({outbox.reason(err)}), so the run is not read back here; it ends FINISHED as soon as the server takes its records",
            flush=True,
        )
        return
    if schema.TAG_CHECKPOINT_SHA not in record.tags:
        raise TrainingFailed(f"{arm} arm: the processes exited cleanly but left no verified checkpoint on run {rec.run_id}")
    print(
        f"train {arm}: finished; active {record.metrics[schema.M_ACTIVE_SECONDS]:.1f} s, "
        f"complete {done.complete_seconds:.1f} s; checkpoint {record.tags[schema.TAG_CHECKPOINT_PATH]} "
        f"(sha256 {record.tags[schema.TAG_CHECKPOINT_SHA][:12]})",
        flush=True,
    )


def _log_spent(rec: writer.Recorder, cfg: Config, workers: int, seconds: float, machine: dict[str, float] | None = None) -> None:
    rec.log_metrics(budget.spent_metrics(cfg, workers, seconds) | (machine or {}))


def run(cfg: Config, args: argparse.Namespace) -> int:
    arms = arms_of(args.arm)
    nodes = _nodes(cfg, args, _checked_node_count(cfg, args))
    if args.hostfile is not None and nodes is None:
        launch.check_ssh_hostfile(args.hostfile, cfg.arms.compressed.workers)
    devices = launch.devices_of(cfg, arms, args.hostfile, nodes=nodes.count if nodes else None)
    holder = f"coopstudy train --arm {args.arm} --preset {cfg.preset_argument}"
    # A SIGTERM or SIGHUP anywhere in the stage ends it as Ctrl-C does: the
    # launched processes stopped, the lock released, the run KILLED with the reason.
    with launch.stopping():
        if nodes is not None and nodes.rank > 0:
            return join_node(cfg, nodes, devices, f"{holder} --node-rank {nodes.rank}")
        if len(arms) == 1:
            # The arm's run is the stage's run: the lock and the prerequisites are
            # checked inside it, so a refusal stays on record as a FAILED attempt.
            with _arm_run(cfg, arms[0]) as rec, _checked(rec, cfg, arms, devices, holder, args.hostfile) as (held, _, _):
                if nodes is not None:
                    for k in range(1, nodes.count):
                        print(f"train compressed: on node {k} run: {_join_command(args, nodes, rec.run_id, k)}", flush=True)
                train_arm(rec, cfg, arms[0], args.hostfile, held, nodes)
            return 0
        # One lock over both arms: no other job slips in between them. Both arms
        # must fit before the first starts; each is checked again at its start,
        # against what the first really spent.
        parent_run = writer.stage_run(schema.STAGE_TRAIN, cfg, run_name=f"train-{BOTH}-{cfg.preset}")
        with parent_run as parent, _checked(parent, cfg, arms, devices, holder, args.hostfile) as (held, sha, req):
            for arm in arms:
                with _arm_run(cfg, arm, req) as rec:
                    held.note(run_id=rec.run_id)
                    guard(rec, cfg, sha, (arm,))
                    train_arm(rec, cfg, arm, args.hostfile, held)
    return 0


@contextlib.contextmanager
def _checked(
    rec: writer.Recorder, cfg: Config, arms: tuple[str, ...], devices: list[str], holder: str, hostfile: Path | None
) -> Iterator[tuple[lock.Held, str, dict[str, str]]]:
    """The devices locked for `rec`, then the prerequisites and the budget of
    `arms` checked and recorded on it: (the lock, the plan's sha256, the tags)."""
    with lock.device_lock(devices, holder) as held:
        held.note(run_id=rec.run_id)
        sha, req = require.training(cfg)
        rec.set_tags(req)
        # Before the budget: a finished arm is refused whatever the allocation holds.
        _refuse_finished(cfg, sha, arms, hostfile)
        guard(rec, cfg, sha, arms)
        yield held, sha, req


def _refuse_finished(cfg: Config, sha: str, arms: tuple[str, ...], hostfile: Path | None) -> None:
    """An arm trains once per plan: its first finished run's weights are its
    predetermined candidate, so a run trained again, once the first one's
    numbers are known, could only be a try for better ones."""
    done = {arm: run for arm in ARMS if (run := candidates.first_finished(cfg, sha, arm)) is not None}
    again = [arm for arm in arms if arm in done]
    if not again:
        return
    said = "; ".join(f"arm {arm} finished under plan {sha[:12]} (train run {done[arm].info.run_id})" for arm in again)
    todo = [arm for arm in ARMS if arm not in done]
    step = "evaluate" if require.selected_train_runs(sha) else "select"
    hosts = f" --hostfile {shlex.quote(str(hostfile))}" if hostfile is not None and todo == [COMPRESSED] else ""
    nxt = f"train {cfg.arguments} --arm {todo[0]}{hosts}" if len(todo) == 1 else f"{step} {cfg.arguments}"
    raise errors.RefusedError(
        f"{said}: an arm trains once per plan, its final weights being its predetermined candidate; "
        f"go on: `python -m coopstudy {nxt}`"
    )


def join_node(cfg: Config, nodes: Nodes, devices: list[str], holder: str) -> int:
    """Node K > 0: check this host's commitments, then run its ranks into the
    run node 0 opened. Node 0's stage measures, checks the checkpoint and ends
    the run; a refusal here is kept on that run as its ranks' errors, which
    node 0's failure then names."""

    run_id = nodes.run_id
    assert run_id is not None
    workers = cfg.arms.compressed.workers
    per_node = workers // nodes.count
    ranks = range(nodes.rank * per_node, (nodes.rank + 1) * per_node)
    client = store.client()
    launched = False
    try:
        run = client.get_run(run_id)
    except Exception as err:  # noqa: BLE001 - not in this record
        if outbox.is_outage(err):
            raise
        raise UserError(f"--run-id {run_id}: no such run in the record {store.tracking_uri()}; copy the id node 0 printed") from None
    try:
        tags = run.data.tags
        if (tags.get(schema.TAG_STAGE), tags.get(schema.TAG_ARM)) != (schema.STAGE_TRAIN, COMPRESSED):
            raise UserError(f"--run-id {run_id} is not a train run of the compressed arm")
        if run.info.status == "FINISHED":
            raise UserError(f"--run-id {run_id} is FINISHED: the arm has trained under its plan (an arm trains once per plan); nothing to join")
        if run.info.status != "RUNNING":
            raise UserError(f"--run-id {run_id} is {run.info.status}, not RUNNING: start node 0 again and join the run it prints")
        if tags.get(schema.TAG_CONFIG_SHA) != store.config_sha256(cfg):
            raise UserError(
                f"--run-id {run_id} runs another config (sha256 {tags.get(schema.TAG_CONFIG_SHA, '?')[:12]}, this one "
                f"{store.config_sha256(cfg)[:12]}): give node {nodes.rank} the same --preset and --set overrides as node 0"
            )
        with lock.device_lock(devices, holder) as held:
            sha, _ = require.training(cfg)
            if tags.get(schema.TAG_PLAN) != sha:
                raise UserError(f"node {nodes.rank}'s plan is {sha[:12]}, run {run_id} trains under {tags.get(schema.TAG_PLAN, '?')[:12]}")
            cmd = launch.command(
                cfg, COMPRESSED, run_id, hostfile=nodes.hostfile, nodes=nodes.count, node_rank=nodes.rank,
                master_addr=nodes.master_addr, master_port=nodes.master_port,
            )  # fmt: skip
            print(f"train compressed: {cmd.how}, run {run_id}", flush=True)
            launched = True
            done = launch.run(cmd, launch.worker_environment(cfg, run_id), label=f"train compressed, node {nodes.rank}", held=held)
        if done.returncode != 0:
            raise TrainingFailed(
                f"compressed arm, node {nodes.rank} failed ({launch.exit_reason(done.returncode, launcher=True)}); "
                f"node 0 ends run {run_id} with the ranks' errors"
            )
    except (UserError, KeyboardInterrupt) as err:
        if launched:
            raise  # the ranks recorded their own errors on the run
        # A refusal before any rank started: on the shared run, as its ranks'
        # errors would be, so node 0's failure names it.
        with contextlib.suppress(Exception):
            writer.Recorder(run_id).set_tags(
                {f"{schema.TAG_WORKER_ERROR_PREFIX}{r}": errors.labelled(err, f"node {nodes.rank}")[: writer.MAX_TAG_CHARS] for r in ranks}
            )
        raise
    print(f"train compressed: node {nodes.rank} finished; node 0 ends run {run_id}", flush=True)
    return 0
