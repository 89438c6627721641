"""Starting one arm's processes and timing them from the outside.

The control is one plain process, `python -m coopstudy worker`. The compressed
arm is the same command started by the DeepSpeed launcher, which only starts
ranks (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT): one host with
`--num_gpus`, or two hosts from an MPI-style hostfile (one slot per host).

Complete-process seconds run from the start of the first process (the
launcher, for the compressed arm) to the exit of the last (the launcher
exits after its ranks), so launcher start-up, imports, model loading and the
checkpoint all count, as the protocol's second speed screen requires.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import zlib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import psutil

from coopstudy import config as config_mod
from coopstudy import workspace
from coopstudy.config import TRAINING_ALLOCATOR, Config
from coopstudy.errors import UserError
from coopstudy.record import writer

EXPANDABLE = "expandable_segments:True"
# A process still alive this long after being asked to stop is killed.
STOP_GRACE_S = 30.0


@dataclass(frozen=True)
class Exit:
    returncode: int
    complete_seconds: float
    """First process start to last process exit."""
    workers: int


def cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def _visible_gpus() -> list[str]:
    """Physical GPU ids this job may use, in order."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").strip()
    if visible:
        return [d.strip() for d in visible.split(",") if d.strip()]
    import torch

    return [str(i) for i in range(torch.cuda.device_count())]


def local_devices(workers: int, *, hostfile: Path | None = None) -> list[str]:
    """The devices of this host that an arm of `workers` ranks occupies (what
    the device lock holds): on CPU, the host's cores as one 'cpu'."""
    if not cuda_available():
        return ["cpu"]
    local = 1 if hostfile is not None else workers
    return [f"cuda{d}" for d in _visible_gpus()[:local]]


def worker_environment(cfg: Config, run_id: str, *, allocator: str = TRAINING_ALLOCATOR) -> dict[str, str]:
    """What every process of the arm, launcher included, runs under."""
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_RUN_ID"}
    threads = str(cfg.train.threads_per_device)
    # One device is `threads_per_device` cores on CPU: OpenMP and MKL pools
    # are sized before torch can be told, so the environment says it first.
    env.update(OMP_NUM_THREADS=threads, MKL_NUM_THREADS=threads, TOKENIZERS_PARALLELISM="false")
    env[writer.ENV_RUN_ID] = run_id
    if not cuda_available():
        # Tells DeepSpeed (the launcher, and transformers' checks for it) what
        # it would otherwise detect with a warning in every process.
        env.setdefault("DS_ACCELERATOR", "cpu")
    if allocator == "expandable":
        env["PYTORCH_CUDA_ALLOC_CONF"] = EXPANDABLE
    else:
        env.pop("PYTORCH_CUDA_ALLOC_CONF", None)
    return env


def encode_config(cfg: Config) -> str:
    """The resolved config as one short shell-safe word: ranks on another
    host get exactly this config, with no shared file."""
    return base64.urlsafe_b64encode(zlib.compress(json.dumps(cfg.model_dump(mode="json")).encode(), 9)).decode()


def decode_config(word: str) -> Config:
    return config_mod.from_dict(json.loads(zlib.decompress(base64.urlsafe_b64decode(word))))


def _deepspeed() -> str:
    beside = Path(sys.executable).with_name("deepspeed")
    found = str(beside) if beside.is_file() else shutil.which("deepspeed")
    if not found:
        raise UserError("the compressed arm needs the DeepSpeed launcher `deepspeed`; install deepspeed in this environment")
    return found


def command(
    cfg: Config,
    arm: str,
    run_id: str,
    *,
    hostfile: Path | None = None,
    allocator: str = TRAINING_ALLOCATOR,
    updates: int | None = None,
    checkpoint: bool = True,
    probe: bool = False,
    capacity_mb: int | None = None,
) -> list[str]:
    workers = getattr(cfg.arms, arm).workers
    # Everything a rank needs travels as arguments: DeepSpeed forwards only
    # some environment variables to a second host.
    worker_args = ["--arm", arm, "--run-id", run_id, "--config", encode_config(cfg), "--allocator", allocator]
    if updates is not None:
        worker_args += ["--updates", str(updates)]
    if not checkpoint:
        worker_args.append("--no-checkpoint")
    if probe:
        worker_args.append("--probe")
        if capacity_mb is not None:
            worker_args += ["--capacity-mb", str(capacity_mb)]
    if workers == 1:
        return [sys.executable, "-m", "coopstudy", "worker", *worker_args]
    # --no_local_rank: LOCAL_RANK is in every rank's environment; the argument would come before the command.
    launcher = [_deepspeed(), "--master_port", str(workspace.free_port()), "--log_level", "warning", "--no_local_rank"]
    if hostfile is not None:
        # One rank per host, as many hosts as workers, from the hostfile
        # (`host slots=1` lines); DeepSpeed reaches them with pdsh over ssh.
        launcher += ["--hostfile", str(hostfile), "--num_nodes", str(workers), "--num_gpus", "1"]
    elif cuda_available() and os.environ.get("CUDA_VISIBLE_DEVICES", "").strip():
        # --num_gpus would make DeepSpeed drop CUDA_VISIBLE_DEVICES and take
        # GPUs 0..n-1; --include keeps the devices this job was given.
        launcher += ["--include", "localhost:" + ",".join(_visible_gpus()[:workers])]
    else:
        launcher += ["--num_gpus", str(workers)]
    return [*launcher, "--module", "coopstudy", "worker", *worker_args]


def _signal_name(number: int) -> str | None:
    try:
        return signal.Signals(number).name
    except ValueError:
        return None


def exit_reason(code: int, launcher: bool) -> str:
    """How a launch ended, in words."""
    if code < 0:
        return f"killed by {_signal_name(-code) or f'signal {-code}'}"
    # The DeepSpeed launcher exits with its failed rank's return code; a rank
    # ended by signal N returns -N, which leaves the launcher as 256 - N.
    if launcher and code > 128 and _signal_name(256 - code):
        return f"a rank was killed by {_signal_name(256 - code)}"
    return f"exit code {code}"


class Terminated(KeyboardInterrupt):
    """The stage process was asked to stop (SIGTERM): handled as an interrupt,
    so the run ends KILLED rather than FAILED."""


def _on_sigterm(signum: int, frame: object) -> None:
    raise Terminated("train was stopped by SIGTERM; its processes were stopped too")


def _stop(proc: subprocess.Popen) -> None:
    """Stop the process and everything it started (the DeepSpeed runner does
    not pass a SIGTERM on to its ranks on one host): ask, then insist."""
    try:
        tree = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return
    for p in tree:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.terminate()
    _, alive = psutil.wait_procs(tree, timeout=STOP_GRACE_S)
    for p in alive:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.kill()
    proc.wait()


def run(cmd: list[str], env: Mapping[str, str], workers: int) -> Exit:
    """Start `cmd`, wait for it, and time it from the outside."""
    previous = signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        start = time.perf_counter()
        proc = subprocess.Popen(cmd, env=dict(env), cwd=workspace.project_root())
        try:
            returncode = proc.wait()
        except BaseException:
            # Interrupted or stopped ourselves: no rank may outlive the stage.
            _stop(proc)
            raise
        return Exit(returncode=returncode, complete_seconds=time.perf_counter() - start, workers=workers)
    finally:
        signal.signal(signal.SIGTERM, previous)


def devices_of(cfg: Config, arms: tuple[str, ...], hostfile: Path | None) -> list[str]:
    found: set[str] = set()
    for arm in arms:
        found.update(local_devices(getattr(cfg.arms, arm).workers, hostfile=hostfile if arm == "compressed" else None))
    return sorted(found)
