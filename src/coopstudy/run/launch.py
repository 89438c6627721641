"""Starting one arm's processes and timing them from the outside.

The control is one plain process, `python -m coopstudy.run.worker`. The compressed
arm is the same command started by the DeepSpeed launcher, which only starts
ranks (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT): on one host
its per-node launcher directly (coopstudy.run.one_host_launcher), on two
hosts the `deepspeed` runner with an MPI-style hostfile (one slot per host).

Two hosts without ssh: each host starts its own node of the job
(`nodes`, `node_rank`, `master_addr`, `master_port`): the launcher with
`--no_ssh --node_rank K` and a hostfile of both nodes, whose ranks meet at
node 0's address (see coopstudy.steps.train).

Complete-process seconds run from the start of the first process (the
launcher, for the compressed arm) to the exit of the last (the launcher
exits after its ranks), so launcher start-up, imports, model loading and the
checkpoint all count, as the protocol's second speed screen requires.

How a launch ends: the launched processes run in their own process group
(recorded in the device lock, so a job that finds its predecessor dead can
stop what it left running). A SIGINT (Ctrl-C), SIGTERM or SIGHUP of the
stage stops every process it launched, asking first and killing after
STOP_GRACE_S, and ends the stage's run KILLED with the reason.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import zlib
from collections.abc import Iterator, Mapping, MutableMapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

from coopstudy import config as config_mod
from coopstudy import machine, workspace
from coopstudy.commit import sources
from coopstudy.config import COMPRESSED, TRAINING_ALLOCATOR, Config
from coopstudy.errors import INTERRUPTED, NCCL_WITHOUT_CUDA, UserError
from coopstudy.record import schema, store, writer
from coopstudy.run import one_host_launcher

EXPANDABLE = "expandable_segments:True"
# A process still alive this long after being asked to stop is killed.
STOP_GRACE_S = 30.0


@dataclass(frozen=True)
class Exit:
    returncode: int
    complete_seconds: float
    """First process start to last process exit."""
    others_cpu_seconds: float | None = None
    """CPU seconds that processes other than the launched ones (and this
    stage) took on this host meanwhile: a quiet machine's is near 0. None
    without procfs."""
    steal_seconds: float | None = None
    """CPU seconds the hypervisor gave other machines meanwhile."""


@dataclass(frozen=True)
class Command:
    """An arm's command line, as `command` chose its launcher."""

    argv: list[str]
    how: str
    """What it starts, in words: "1 process", "2 ranks via the DeepSpeed launcher", ..."""
    cores: int = 0
    """The cores its processes on this host ask for (ranks here x train.threads_per_device)."""
    over_ssh: bool = False
    """The DeepSpeed runner starts the ranks on a hostfile's hosts over ssh:
    they are no children of this process, nor perhaps on its host."""


def _visible_gpus() -> list[str]:
    """Physical GPU ids this job may use, in order."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").strip()
    if visible:
        return [d.strip() for d in visible.split(",") if d.strip()]
    import torch

    return [str(i) for i in range(torch.cuda.device_count())]


def local_devices(workers: int, *, hostfile: Path | None = None, nodes: int | None = None) -> list[str]:
    """The devices of this host that an arm of `workers` ranks occupies (what
    the device lock holds): on CPU, the host's cores as one 'cpu'."""
    if not machine.cuda_available():
        return ["cpu"]
    local = workers // nodes if nodes else 1 if hostfile is not None else workers
    return [f"cuda{d}" for d in _visible_gpus()[:local]]


TCMALLOC_SETTINGS = {"TCMALLOC_RELEASE_RATE": "0"}
"""The arms' malloc, where it is installed: gperftools' tcmalloc
(machine.TCMALLOC), preloaded, returning nothing it frees to the system.
glibc's heap fragments here: every packed row has a length of its own,
oneDNN compiles and caches primitives for each, and these small lasting
blocks land in the holes an update's large tensors left, so the next
update's tensors no longer fit and the heap grows into memory new to the
process (54 MiB an update on a compressed rank). tcmalloc keeps small
blocks in spans of their own and reuses the large ones. And on these VMs
memory new to a process is dear: the host takes back what the guest frees
(free page reporting), and faulting it in again as 2 MiB huge pages, which
glibc's `hugetlb=1` below asks for, cost 5-7 s a GiB against about 0.5 s a
GiB in 4 KiB pages, which tcmalloc uses (README, "What stays on CPU, and
why")."""

TRAINING_MALLOC = "glibc.malloc.hugetlb=1:glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=1099511627776"
"""glibc's malloc settings for the arms' processes where tcmalloc is not
installed. glibc serves every block above 32 MiB from a fresh mmap and
unmaps it when freed, so each update's large tensors (the logits at target
tokens, the embedding's bf16 copy and dense gradient, 50-120 MiB each at
microbatch 16) fault their pages in again: 0.3-1.6 s of a control update's
3-8 s. mmap_max=0 serves them from the heap, and a trim threshold of 1 TiB
keeps the heap's freed top, so an update reuses the pages of the one before
and faults only where its peak grows; hugetlb=1 asks for transparent huge
pages where memory is new (THP "madvise"): a fresh 538 MB copy cost a
quarter of its time so when measured (2026-12-02), and far more where the
host has taken the memory back (above)."""


def worker_environment(cfg: Config, run_id: str, *, allocator: str = TRAINING_ALLOCATOR) -> dict[str, str]:
    """What every process of the arm, launcher included, runs under."""
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_RUN_ID"}
    threads = str(cfg.train.threads_per_device)
    # One device is `threads_per_device` cores on CPU: OpenMP and MKL pools
    # are sized before torch can be told, so the environment says it first.
    env.update(OMP_NUM_THREADS=threads, MKL_NUM_THREADS=threads)
    set_malloc(env)
    env[writer.ENV_RUN_ID] = run_id
    machine.name_the_accelerator(env)
    set_allocator(env, allocator)
    return env


def set_malloc(env: MutableMapping[str, str]) -> None:
    """tcmalloc preloaded where it is installed, else glibc's settings."""
    library = machine.tcmalloc_library()
    if library is None:
        env.setdefault("GLIBC_TUNABLES", TRAINING_MALLOC)
        return
    preload = env.get("LD_PRELOAD", "").replace(":", " ").split()
    env["LD_PRELOAD"] = " ".join([library, *(p for p in preload if p != library)])
    env.update(TCMALLOC_SETTINGS)


def set_allocator(env: MutableMapping[str, str], allocator: str) -> None:
    """CUDA's caching allocator as the setting names it (read at the first allocation)."""
    if allocator == "expandable":
        env["PYTORCH_CUDA_ALLOC_CONF"] = EXPANDABLE
    else:
        env.pop("PYTORCH_CUDA_ALLOC_CONF", None)


def encode_config(cfg: Config) -> str:
    """The resolved config as one short shell-safe word: ranks on another
    host get exactly this config, with no shared file."""
    return base64.urlsafe_b64encode(zlib.compress(json.dumps(cfg.model_dump(mode="json")).encode(), 9)).decode()


def decode_config(word: str) -> Config:
    try:
        raw = json.loads(zlib.decompress(base64.urlsafe_b64decode(word)))
    except (ValueError, zlib.error):
        raise UserError("--config: not a config encode_config made (the worker is started by train, probe and bench arms)") from None
    return config_mod.from_dict(raw)


NO_DEEPSPEED = "the compressed arm needs the DeepSpeed launcher; install deepspeed in this environment"


def _deepspeed() -> str:
    """The `deepspeed` runner, which starts the ranks of more than one host."""
    beside = Path(sys.executable).with_name("deepspeed")
    found = str(beside) if beside.is_file() else shutil.which("deepspeed")
    if not found:
        raise UserError(NO_DEEPSPEED)
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
    nodes: int | None = None,
    node_rank: int = 0,
    master_addr: str | None = None,
    master_port: int | None = None,
) -> Command:
    """The arm's command line. With `nodes` (and a hostfile naming them, the
    master's address and port): node `node_rank` of a job started by hand
    on each host, without ssh."""
    workers = cfg.arm(arm).workers
    threads = cfg.train.threads_per_device
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
        return Command([sys.executable, "-m", sources.WORKER, *worker_args], "1 process", threads)
    check_backend(cfg, ranks_here=hostfile is None or nodes is not None)
    # --no_local_rank: LOCAL_RANK is in every rank's environment; the argument would come before the command.
    if nodes is not None:
        if hostfile is None or master_addr is None or master_port is None:
            raise UserError("one node of a multi-node job needs a hostfile, the master's address and its port")
        launcher = [
            _deepspeed(), "--no_ssh", "--node_rank", str(node_rank), "--master_addr", master_addr,
            "--master_port", str(master_port), "--hostfile", str(hostfile), "--num_nodes", str(nodes),
            "--num_gpus", str(workers // nodes), "--log_level", "warning", "--no_local_rank",
        ]  # fmt: skip
        per_node = workers // nodes
        first, last = node_rank * per_node, (node_rank + 1) * per_node - 1
        how = f"node {node_rank} of {nodes} (ranks {first}-{last} of {workers}), rendezvous {master_addr}:{master_port}"
        return Command([*launcher, "--module", sources.WORKER, *worker_args], how, per_node * threads)
    port = str(workspace.free_port())
    if hostfile is not None:
        # One rank per host, as many hosts as workers, from the hostfile
        # (`host slots=1` lines); DeepSpeed reaches them with pdsh over ssh.
        launcher = [_deepspeed(), "--master_port", port, "--log_level", "warning", "--no_local_rank"]
        launcher += ["--hostfile", str(hostfile), "--num_nodes", str(workers), "--num_gpus", "1"]
        how = f"{workers} ranks on the hostfile's hosts via the DeepSpeed runner over ssh"
        return Command([*launcher, "--module", sources.WORKER, *worker_args], how, over_ssh=True)
    # The devices this job was given (CUDA_VISIBLE_DEVICES kept), as the
    # runner's --include would name them; on CPU, device ids 0..n-1.
    devices = _visible_gpus()[:workers] if machine.cuda_available() else [str(i) for i in range(workers)]
    if importlib.util.find_spec("deepspeed") is None:
        raise UserError(NO_DEEPSPEED)
    # Started by name; imported above all the same, so that the steps and the
    # plan, which bind the sources a module imports, bind it with this one.
    launcher = [
        sys.executable, "-u", "-m", one_host_launcher.__name__, f"--world_info={_world_info(devices)}",
        "--master_addr=127.0.0.1", f"--master_port={port}", "--no_local_rank", "--log_level=warning",
    ]  # fmt: skip
    return Command([*launcher, "--module", sources.WORKER, *worker_args], f"{workers} ranks via the DeepSpeed launcher", workers * threads)


def check_backend(cfg: Config, *, ranks_here: bool) -> None:
    """Refuse nccl for ranks that would start on this host, which has no CUDA:
    said before they start, not by each rank through the launcher. (Ranks the
    runner starts over ssh run on other hosts, which may have it.)"""
    if ranks_here and cfg.distributed.backend == "nccl" and not machine.cuda_available():
        raise UserError(NCCL_WITHOUT_CUDA)


def _world_info(devices: list[str]) -> str:
    """The per-node launcher's --world_info: this host's device ids, as the
    DeepSpeed runner encodes them (JSON, URL-safe base64). The launcher only
    joins them into its ranks' CUDA_VISIBLE_DEVICES, so a GPU named by UUID
    passes as it is (the runner's --include takes indices only)."""
    ids = [int(d) if d.isdigit() else d for d in devices]
    return base64.urlsafe_b64encode(json.dumps({"localhost": ids}).encode()).decode()


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


def failure(run_id: str, arm: str, workers: int, code: int, here: int | None = None) -> str:
    """One line: what the launch ended with and what each process recorded.
    `here`: how many of the ranks (the first) this host ran, when the others
    are other nodes' (which may never have started)."""
    here = workers if here is None else here
    tags = store.client().get_run(run_id).data.tags
    said = {r: tags.get(f"{schema.TAG_WORKER_ERROR_PREFIX}{r}") for r in range(workers)}
    parts = [f"{arm} arm failed ({exit_reason(code, launcher=workers > 1)})"]
    parts += [f"rank {r}: {e}" for r, e in said.items() if e]
    silent = [r for r, e in said.items() if not e]
    for ranks, why in (
        ([r for r in silent if r < here], "killed from outside, or out of host memory"),
        ([r for r in silent if r >= here], "another node's, which may never have started"),
    ):
        if ranks:
            parts.append(f"rank {', '.join(map(str, ranks))} recorded no error ({why})")
    return "; ".join(parts)


class Terminated(KeyboardInterrupt):
    """The stage process was asked to stop (SIGTERM, SIGHUP): handled as an
    interrupt, so the run ends KILLED rather than FAILED; `signum` says by
    which signal (the CLI exits 128 + it, as a shell tells a signal's end)."""

    def __init__(self, message: str, signum: int):
        super().__init__(message)
        self.signum = signum


class Interrupted(KeyboardInterrupt):
    """Ctrl-C (SIGINT) while the stage's processes ran; they were stopped."""


ALREADY_STOPPING = "coopstudy: already stopping: its processes, then its record; `kill -9 {pid}` ends it now and leaves its run RUNNING\n"
"""Said at each Ctrl-C after the first, which the stopping lets pass."""


STOPPING = "coopstudy: stopping the processes it launched (SIGTERM, then SIGKILL after {grace:g} s)"
"""Said when a stop begins, before the wait for the launched processes."""


class _Stop:
    depth = 0
    """stopping() contexts open: the handlers are this module's while above 0."""
    raised = False
    """A stop signal has raised already: those after it are let pass."""
    starting = False
    """A launch is starting (run): a stop signal waits until it can be stopped."""
    waiting: int | None = None
    """The stop signal that came while a launch started, if one did."""


def _on_stop_signal(signum: int, frame: object) -> None:
    # Only the first: `mlflow run` answers a Ctrl-C with a SIGTERM of its own
    # a moment later, which would otherwise cut short the stopping of the
    # ranks that the first set off (they trained on into a KILLED run).
    if _Stop.raised:
        if signum == signal.SIGINT:  # Ctrl-C again: say why nothing happens, and what would
            # os.write, not print: the main thread may be inside a print to stderr.
            os.write(2, ALREADY_STOPPING.format(pid=os.getpid()).encode())
        return
    if _Stop.starting:
        _Stop.waiting = _Stop.waiting or signum
        return
    _Stop.raised = True
    if signum == signal.SIGINT:
        raise KeyboardInterrupt
    name = _signal_name(signum) or f"signal {signum}"
    raise Terminated(f"stopped by {name}; every process it launched was stopped too", signum)


_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


@contextlib.contextmanager
def stopping() -> Iterator[None]:
    """While inside: a SIGTERM or SIGHUP of this process raises Terminated
    (a KeyboardInterrupt), so whatever is open ends as after Ctrl-C: launched
    processes stopped, locks released, the run KILLED with the reason. Only
    the first stop signal (Ctrl-C included) raises; later ones cannot
    interrupt that ending (SIGKILL still ends a stop that hangs)."""
    if threading.current_thread() is not threading.main_thread():
        # Signals reach the main thread only; there the handlers are set.
        yield
        return
    # A signal ignored from the start stays ignored: Ctrl-C in a background
    # job, a hangup under nohup.
    caught = [s for s in _STOP_SIGNALS if signal.getsignal(s) is not signal.SIG_IGN]
    previous = {s: signal.signal(s, _on_stop_signal) for s in caught}
    _Stop.depth += 1
    try:
        yield
    finally:
        # The handlers first: a late signal between the two would find the
        # latch open and raise out of this finally.
        for s, handler in previous.items():
            signal.signal(s, handler)
        _Stop.depth -= 1
        if _Stop.depth == 0:
            _Stop.raised = _Stop.starting = False
            _Stop.waiting = None


def group_members(pgid: int) -> list[psutil.Process]:
    """The live processes of process group `pgid`, this process excepted."""
    members = []
    for p in psutil.process_iter():
        with contextlib.suppress(psutil.Error, ProcessLookupError, PermissionError):
            if p.pid != os.getpid() and os.getpgid(p.pid) == pgid:
                members.append(p)
    return members


def stop_processes(processes: list[psutil.Process], grace_s: float) -> None:
    """Ask the processes to stop (SIGTERM), then insist (SIGKILL) after `grace_s`."""
    for p in processes:
        with contextlib.suppress(psutil.Error):
            p.terminate()
    _, alive = psutil.wait_procs(processes, timeout=grace_s)
    for p in alive:
        with contextlib.suppress(psutil.Error):
            p.kill()
    psutil.wait_procs(alive, timeout=grace_s)


def _tree(proc: subprocess.Popen) -> list[psutil.Process]:
    """The launched process, its descendants and the rest of its process group."""
    found: dict[int, psutil.Process] = {}
    with contextlib.suppress(psutil.NoSuchProcess):
        root = psutil.Process(proc.pid)
        found[root.pid] = root
        for p in root.children(recursive=True):
            found[p.pid] = p
    for p in group_members(proc.pid):
        found.setdefault(p.pid, p)
    return list(found.values())


def _stop(proc: subprocess.Popen) -> None:
    """Stop the process and everything it started (the `deepspeed` runner
    does not pass a SIGTERM on to its ranks): ask, then insist."""
    stop_processes(_tree(proc), STOP_GRACE_S)
    proc.wait()


def _raise_waiting() -> None:
    """End a launch's start (_Stop.starting): raise the stop signal that came
    meanwhile, if one did."""
    _Stop.starting = False
    signum, _Stop.waiting = _Stop.waiting, None
    if signum is not None:
        _on_stop_signal(signum, None)


def run(cmd: Command, env: Mapping[str, str], *, label: str, held: Any = None) -> Exit:
    """Start `cmd`, wait for it, and time it from the outside; warn, as
    `label`, when its processes ask for more cores than the host gives, or
    other processes kept the host busy meanwhile (not measured for ranks
    started over ssh). `held` (a run.lock.Held) records the
    launch's process group while it runs."""
    have = len(machine.usable_cores())
    if cmd.cores > have:
        print(
            f"warning: {label}: its processes ask for {cmd.cores} cores (ranks x train.threads_per_device), and this host "
            f"gives the job {have}: they share cores, and its timings are an oversubscribed machine's",
            file=sys.stderr, flush=True,
        )  # fmt: skip
    with stopping():
        cpu_at_start = machine.CpuTimes.now()
        start = time.perf_counter()
        # Its own process group: a terminal's Ctrl-C reaches the stage only,
        # which stops the processes in order; and the group outlives the stage
        # should the stage be killed, for the next job to find.
        # A stop signal waits from here until the `try` below can stop `proc`:
        # raised within Popen, after its fork, it would leave the new process
        # running with nothing to stop it.
        _Stop.starting = True
        try:
            proc = subprocess.Popen(cmd.argv, env=dict(env), cwd=workspace.project_root(), start_new_session=True)
        except BaseException:
            _raise_waiting()
            raise
        try:
            _raise_waiting()
            if held is not None:
                held.note(process_group=proc.pid)
            returncode = proc.wait()
        except BaseException as err:
            # Interrupted or stopped ourselves: no rank may outlive the stage. A
            # rank blocked in a rendezvous may answer only the SIGKILL: say why it waits.
            print(STOPPING.format(grace=STOP_GRACE_S), file=sys.stderr, flush=True)
            _stop(proc)
            if type(err) is KeyboardInterrupt:
                raise Interrupted(f"{INTERRUPTED}; every process it launched was stopped") from None
            raise
        finally:
            if held is not None and proc.poll() is not None:
                held.note()
        complete = time.perf_counter() - start
        cpu = machine.CpuTimes.now()
        others, steal = cpu.others_since(cpu_at_start) if cpu and cpu_at_start and not cmd.over_ssh else (None, None)
    done = Exit(returncode, complete, others, steal)
    loaded = _loaded_said(label, done)
    if loaded:
        print(f"warning: {loaded}", file=sys.stderr, flush=True)
    return done


LOADED_CORES = 0.25
"""Other processes keeping this many cores busy on average while an arm ran
make its timings a loaded machine's, and the stage says so."""


def machine_metrics(done: Exit) -> dict[str, float]:
    """What the record keeps of how quiet the host was while `done` ran."""
    if done.others_cpu_seconds is None or done.steal_seconds is None:
        return {}
    return {schema.M_OTHERS_CORES: done.others_cpu_seconds / done.complete_seconds, schema.M_STEAL_SECONDS: done.steal_seconds}


def _loaded_said(label: str, done: Exit) -> str | None:
    """A line for a launch that ran on a loaded host, or None."""
    metrics = machine_metrics(done)
    cores = metrics.get(schema.M_OTHERS_CORES, 0.0)
    if cores < LOADED_CORES:
        return None
    return (
        f"{label}: other processes kept {cores:.2f} cores busy on average while it ran "
        f"({schema.M_OTHERS_CORES}): its timings are a loaded machine's"
    )


def devices_of(cfg: Config, arms: tuple[str, ...], hostfile: Path | None, *, nodes: int | None = None) -> list[str]:
    found: set[str] = set()
    for arm in arms:
        multi = arm == COMPRESSED
        found.update(local_devices(cfg.arm(arm).workers, hostfile=hostfile if multi else None, nodes=nodes if multi else None))
    return sorted(found)


def hostfile_path(text: str) -> Path:
    """`--hostfile`'s type: a path, never an empty one (Path('') is the folder
    the command started in, which would be refused as a folder)."""
    if not text.strip():
        raise argparse.ArgumentTypeError("an empty path; name the hostfile")
    return Path(text)


def check_hostfile(path: Path, needed: int, per_host: int = 1) -> list[str]:
    """The hosts of an MPI-style hostfile (`HOST slots=N` lines, # comments),
    or a one-line refusal naming the line that is not one."""
    if path.is_dir():
        raise UserError(f"--hostfile {path}: a folder, not a file")
    if path.exists() and not path.is_file():
        # A FIFO would block the read for ever (under --dry-run too).
        raise UserError(f"--hostfile {path}: {workspace.NOT_A_REGULAR_FILE}")
    try:
        text = path.read_text(errors="replace")
    except FileNotFoundError:
        raise UserError(f"--hostfile {path}: no such file") from None
    except OSError as err:
        raise UserError(f"--hostfile {path}: cannot read it ({err.strerror})") from None
    hosts = []
    for n, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        m = re.fullmatch(r"(\S+)\s+slots=([1-9][0-9]*)", line)
        if m is None:
            raise UserError(f"--hostfile {path} line {n}: {raw.strip()!r} is not `HOST slots=N`")
        if m.group(1) in hosts:
            raise UserError(f"--hostfile {path} line {n}: host {m.group(1)} is listed twice")
        hosts.append(m.group(1))
    if len(hosts) != needed:
        each = "one rank" if per_host == 1 else f"{per_host} ranks"
        raise UserError(f"--hostfile {path} names {len(hosts)} host(s); the compressed arm needs {needed}, {each} each")
    return hosts


SSH_TIMEOUT_S = 10
"""How long `check_ssh_hostfile` waits for a host to accept ssh."""


def check_ssh_hostfile(path: Path, needed: int) -> list[str]:
    """check_hostfile, and refuse hosts DeepSpeed could not start a rank on,
    before any run opens: it reaches them with pdsh over passwordless ssh, and
    says it with a traceback after the stage has started."""
    hosts = check_hostfile(path, needed)
    for host in hosts:
        try:
            done = subprocess.run(
                ["ssh", "-o", "BatchMode=yes", "-o", f"ConnectTimeout={SSH_TIMEOUT_S}", host, "true"],
                capture_output=True, text=True, timeout=3 * SSH_TIMEOUT_S, stdin=subprocess.DEVNULL,
            )  # fmt: skip
        except FileNotFoundError:
            raise UserError(f"--hostfile {path}: DeepSpeed reaches its hosts over ssh, and there is no ssh here") from None
        except subprocess.TimeoutExpired:
            raise UserError(f"--hostfile {path}: host {host} did not answer ssh within {3 * SSH_TIMEOUT_S} s") from None
        if done.returncode != 0:
            why = (done.stderr.strip().splitlines() or [f"exit {done.returncode}"])[-1]
            raise UserError(f"--hostfile {path}: host {host} does not answer passwordless ssh ({why}); DeepSpeed starts a rank there over ssh")
    if shutil.which("pdsh") is None:
        raise UserError(f"--hostfile {path}: DeepSpeed starts the ranks with pdsh, which is not installed here (Debian: apt-get install pdsh)")
    return hosts


def node_hostfile(nodes: int, per_node: int) -> Path:
    """A hostfile naming `nodes` nodes (node0, node1, ...) of `per_node` slots:
    without ssh the launcher reads only how many nodes and slots there are."""
    path = workspace.subdir("launch") / f"nodes-{nodes}x{per_node}"
    text = "".join(f"node{n} slots={per_node}\n" for n in range(nodes))
    workspace.write_text(path, text)
    return path
