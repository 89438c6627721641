"""train refuses before starting anything: no gate receipt, no inputs, devices in use.

Each refusal is one line, exit 2, and a FAILED train run on record.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import mlflow
import pytest
from fixtures import faults_of_a_large_tensor_made_again

from coopstudy import config, machine, workspace
from coopstudy.errors import UserError
from coopstudy.record import schema, writer
from coopstudy.run import launch, lock


def _train_runs() -> list:
    exp = mlflow.MlflowClient().get_experiment_by_name("coopstudy")
    assert exp is not None, "no run was recorded"
    return mlflow.MlflowClient().search_runs([exp.experiment_id], f"tags.`{schema.TAG_STAGE}` = '{schema.STAGE_TRAIN}'")


def test_train_refuses_without_a_gate_receipt(cli):
    result = cli("train", "--preset", "tiny", "--arm", "control")
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "no gate receipt" in lines[0] and "coopstudy verify" in lines[0], result.stderr
    (run,) = _train_runs()
    assert run.info.status == "FAILED"
    assert run.info.run_name == "train-control-tiny"
    assert run.data.tags[schema.TAG_ARM] == "control"
    assert "no gate receipt" in run.data.tags[schema.TAG_ERROR]
    # The attempted configuration stays on record.
    assert run.data.params["arms.control.microbatch"] == "4"


def test_a_second_training_job_on_the_same_devices_is_refused(cli):
    cfg = config.load("tiny")
    devices = launch.local_devices(cfg.arms.compressed.workers)
    with lock.device_lock(devices, "a training job in this test"):
        result = cli("train", "--preset", "tiny", "--arm", "both")
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert f"in use by job pid {os.getpid()} (a training job in this test" in lines[0]
    (run,) = _train_runs()
    assert run.info.status == "FAILED" and run.info.run_name == "train-both-tiny"
    assert f"pid {os.getpid()}" in run.data.tags[schema.TAG_ERROR]


@pytest.mark.parametrize("argv", [("evaluate",), ("dev-split",), ("verify",), ("bench", "objective"), ("bench", "generate")], ids=" ".join)
def test_a_job_that_computes_in_one_process_shares_no_device_with_training(cli, argv):
    # Its work would spoil the training job's timings, and the training job its own.
    with lock.device_lock(launch.local_devices(1), "a training job in this test"):
        result = cli(*argv, "--preset", "tiny")
    assert result.returncode == 2, result.stderr
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith(f"coopstudy {' '.join(argv)}: error: device ") and f"in use by job pid {os.getpid()} (a training job in this test" in line


def test_a_launch_says_how_busy_other_processes_kept_the_host(capsys):
    # The launched process sleeps; a busy loop it did not start takes about a core.
    sleep = launch.Command([sys.executable, "-c", "import time; time.sleep(3)"], "1 process")
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        done = launch.run(sleep, os.environ, label="train control")
        over_ssh = launch.run(dataclasses.replace(sleep, over_ssh=True), os.environ, label="train compressed")
    finally:
        busy.kill()
        busy.wait()
    assert done.returncode == 0
    assert launch.machine_metrics(done)[schema.M_OTHERS_CORES] > 0.4
    # Ranks started over ssh may run elsewhere: what this host did meanwhile says nothing of them.
    assert launch.machine_metrics(over_ssh) == {}
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("warning: train control: other processes kept ") and f"({schema.M_OTHERS_CORES})" in line


def test_a_launch_that_asks_for_more_cores_than_the_host_gives_says_so(capsys):
    cfg = config.load("tiny", ["train.threads_per_device=1024"])
    cmd = launch.command(cfg, "compressed", "RUN")
    assert cmd.cores == 2 * 1024
    quick = dataclasses.replace(cmd, argv=[sys.executable, "-c", "pass"])
    assert launch.run(quick, os.environ, label="train compressed").returncode == 0
    # (A launch this short may also be said to run on a loaded host: other lines are not this test's.)
    (line,) = [x for x in capsys.readouterr().err.splitlines() if "cores (ranks x" in x]
    assert line.startswith("warning: train compressed: its processes ask for 2048 cores (ranks x train.threads_per_device), and this host gives the job ")
    assert launch.run(dataclasses.replace(quick, cores=1), os.environ, label="train control").returncode == 0
    assert "cores (ranks x" not in capsys.readouterr().err


def test_the_lock_is_free_again_after_the_holder_ends(capsys):
    with lock.device_lock(["cpu"], "first"):
        pass
    # Nobody is named in it, so another process takes it without a word (this one would take its own pid silently).
    assert [p.read_text() for p in (workspace.home() / "locks").glob("*.lock")] == [""]
    taken = subprocess.run(
        [sys.executable, "-c", "from coopstudy.run import lock\nwith lock.device_lock(['cpu'], 'second'):\n    print('held')"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert (taken.returncode, taken.stdout, taken.stderr) == (0, "held\n", ""), taken.stderr[-3000:]


def _world_info(cmd: list[str]) -> dict:
    """The per-node launcher's --world_info in `cmd`, decoded as it decodes it."""
    (word,) = [a.split("=", 1)[1] for a in cmd if a.startswith("--world_info=")]
    return json.loads(base64.urlsafe_b64decode(word))


def test_compressed_arm_command_one_host_and_two_hosts(tmp_path: Path, monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    cfg = config.load("tiny")
    one_host = launch.command(cfg, "compressed", "RUN").argv
    # DeepSpeed's per-node launcher, given this host's two devices as the runner would.
    assert one_host[1:4] == ["-u", "-m", "coopstudy.run.one_host_launcher"]
    assert _world_info(one_host) == {"localhost": [0, 1]}
    assert one_host[one_host.index("--module") + 1] == "coopstudy.run.worker"
    assert one_host[one_host.index("--run-id") + 1] == "RUN"
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("host-a slots=1\nhost-b slots=1\n")
    over_ssh = launch.command(cfg, "compressed", "RUN", hostfile=hostfile)
    assert over_ssh.over_ssh and not launch.command(cfg, "compressed", "RUN").over_ssh
    two_hosts = over_ssh.argv
    assert two_hosts[two_hosts.index("--hostfile") + 1] == str(hostfile)
    assert two_hosts[two_hosts.index("--num_nodes") + 1] == "2"
    assert two_hosts[two_hosts.index("--num_gpus") + 1] == "1"
    control = launch.command(cfg, "control", "RUN").argv
    assert control[1:3] == ["-m", "coopstudy.run.worker"] and "deepspeed" not in " ".join(control)


def test_nccl_without_cuda_is_refused_before_any_rank_starts(tmp_path, monkeypatch):
    # Otherwise each rank says it through the launcher, among the launcher's own lines.
    monkeypatch.setattr(launch.machine, "cuda_available", lambda: False)
    cfg = config.load("tiny", ["distributed.backend=nccl"])
    with pytest.raises(UserError, match="^distributed.backend: nccl needs CUDA, and this machine has none"):
        launch.command(cfg, "compressed", "RUN")
    assert launch.command(cfg, "control", "RUN").how == "1 process"  # one process: no collectives
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("host-a slots=1\nhost-b slots=1\n")
    assert launch.command(cfg, "compressed", "RUN", hostfile=hostfile).over_ssh  # the hosts' own CUDA decides


def test_the_compressed_arm_keeps_the_gpus_this_job_was_given(monkeypatch):
    monkeypatch.setattr(launch.machine, "cuda_available", lambda: True)
    cfg = config.load("tiny")
    for visible, given in [("3,1,0", [3, 1]), ("GPU-5f1c,GPU-77ab,GPU-0e2d", ["GPU-5f1c", "GPU-77ab"])]:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
        assert _world_info(launch.command(cfg, "compressed", "RUN").argv) == {"localhost": given}


def test_worker_environment_sets_threads_allocator_and_run_id(monkeypatch):
    monkeypatch.setenv("MLFLOW_RUN_ID", "the-project-run")
    cfg = config.load("tiny", ["train.threads_per_device=3"])
    env = launch.worker_environment(cfg, "RUN")
    assert env["OMP_NUM_THREADS"] == "3" and env["MKL_NUM_THREADS"] == "3"
    assert env["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    assert env[writer.ENV_RUN_ID] == "RUN"
    # The project run's id must not leak into the ranks.
    assert "MLFLOW_RUN_ID" not in env


def test_the_arms_reuse_the_memory_of_the_update_before(monkeypatch):
    # In the arms' environment a large tensor freed serves the next one that
    # fits, pages and all (tcmalloc where installed, else glibc's settings);
    # glibc's default would unmap it and fault all again.
    for key in ("GLIBC_TUNABLES", "LD_PRELOAD", *launch.TCMALLOC_SETTINGS):
        monkeypatch.delenv(key, raising=False)
    env = launch.worker_environment(config.load("tiny"), "RUN")
    assert ("LD_PRELOAD" in env) == (machine.tcmalloc_library() is not None) != ("GLIBC_TUNABLES" in env)
    arms = faults_of_a_large_tensor_made_again(env)
    default = faults_of_a_large_tensor_made_again({k: v for k, v in env.items() if k not in ("GLIBC_TUNABLES", "LD_PRELOAD")})
    assert arms < 100 < default, (arms, default)
    glibc = {k: v for k, v in env.items() if k != "LD_PRELOAD"}
    glibc.setdefault("GLIBC_TUNABLES", launch.TRAINING_MALLOC)
    assert faults_of_a_large_tensor_made_again(glibc) < 100


def test_one_node_of_a_job_started_by_hand_on_each_host(tmp_path: Path, monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    cfg = config.load("tiny")
    hostfile = launch.node_hostfile(2, 1)
    assert hostfile.read_text() == "node0 slots=1\nnode1 slots=1\n"
    node = launch.command(cfg, "compressed", "RUN", hostfile=hostfile, nodes=2, node_rank=1, master_addr="10.0.0.1", master_port=29600)
    assert not node.over_ssh and node.how == "node 1 of 2 (ranks 1-1 of 2), rendezvous 10.0.0.1:29600"
    cmd = node.argv
    assert Path(cmd[0]).name == "deepspeed" and "--no_ssh" in cmd
    flags = {cmd[i]: cmd[i + 1] for i in range(len(cmd) - 1) if cmd[i].startswith("--") and not cmd[i + 1].startswith("--")}
    assert (flags["--node_rank"], flags["--master_addr"], flags["--master_port"]) == ("1", "10.0.0.1", "29600")
    assert (flags["--hostfile"], flags["--num_nodes"], flags["--num_gpus"]) == (str(hostfile), "2", "1")
    assert cmd[cmd.index("--module") + 1] == "coopstudy.run.worker" and flags["--run-id"] == "RUN"


STALE_HOLDER = """
import os, signal, subprocess, sys
from coopstudy.run import lock
with lock.device_lock(["testdev"], "a job that will be killed") as held:
    held.note(run_id=sys.argv[1])
    child = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    held.note(process_group=child.pid)
    print(child.pid, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_lock_left_by_a_killed_job_is_taken_saying_so(tmp_path, capsys, _migrated_db):
    """SIGKILL frees the flock but leaves the holder's name in the file: the
    next job says so, stops what the dead job left running, ends its run, in
    the store the dead job wrote it to (not the next job's: before, it was
    looked for there, not found, and left RUNNING without a word)."""
    import shutil

    import psutil

    from coopstudy.record import store

    shutil.copy(_migrated_db, tmp_path / "theirs.db")
    theirs = f"sqlite:///{tmp_path / 'theirs.db'}"
    client = store.client(theirs)
    run_id = client.create_run(client.create_experiment("coopstudy")).info.run_id
    env = {**os.environ, "MLFLOW_TRACKING_URI": theirs}
    holder = subprocess.run([sys.executable, "-c", STALE_HOLDER, run_id], capture_output=True, text=True, timeout=120, env=env)
    assert holder.returncode == -9, holder.stderr
    left = int(holder.stdout.split()[0])
    assert psutil.pid_exists(left)
    with lock.device_lock(["testdev"], "the next job"):
        pass
    said = capsys.readouterr().err.strip().splitlines()
    assert len(said) == 1, said
    assert "device testdev on " in said[0] and "(a job that will be killed, since" in said[0]
    assert f"is stale, its process is gone; stopped its leftover processes {left}; ended its run {run_id} as KILLED; taking the device" in said[0]
    assert not psutil.pid_exists(left) or psutil.Process(left).status() == psutil.STATUS_ZOMBIE
    run = client.get_run(run_id)
    assert run.info.status == "KILLED" and "died without releasing device testdev" in run.data.tags[schema.TAG_ERROR]
    assert run.data.tags[schema.TAG_ERROR_KIND] == schema.ERROR_KIND_STALE_LOCK
    # Released cleanly this time: the holder emptied the file (this process's
    # own pid in it would be taken without a word, emptied or not).
    assert [p.read_text() for p in (workspace.home() / "locks").glob("*testdev.lock")] == [""]
    with lock.device_lock(["testdev"], "and the next"):
        pass
    assert capsys.readouterr().err == ""


def test_a_dead_jobs_run_on_a_server_that_does_not_answer_is_ended_by_remote_deliver(capsys):
    # Before, a store that did not answer skipped the run without a word: it stayed RUNNING for ever.
    import socket

    from coopstudy.record import outbox, store

    client = store.client()
    exp = store.experiment_id("coopstudy")
    dead, ended, queued = (client.create_run(exp).info.run_id for _ in range(3))
    away = f"http://127.0.0.1:{workspace.free_port()}"
    # The dead job's own records of one run wait for the server: its end must go behind them.
    box = outbox.Outbox(queued, away, client)
    box.keep({"op": "batch", "metrics": [["loss", 1.5, 0, 1]]}, for_deliver=True)
    path = workspace.subdir("locks") / f"{socket.gethostname()}-away.lock"
    info = {"pid": 2**22 + 1, "holder": "a job killed", "since": 0.0, "runs": [dead, ended, queued], "tracking_uri": away}
    path.write_text(json.dumps(info))
    with lock.device_lock(["away"], "the next job"):
        pass
    (said,) = capsys.readouterr().err.strip().splitlines()
    assert said.endswith(
        f"its runs {dead}, {ended} stay RUNNING until python -m coopstudy remote deliver {dead} {ended} sends their end "
        f"(the server {away} does not answer (connection refused)); its run {queued} stays RUNNING until python -m coopstudy "
        f"remote deliver {queued} sends its end (its records wait in {box.path}); taking the device"
    ), said
    assert path.read_text() == ""
    # The server comes back (here: the store the runs are in); one of the runs ended meanwhile.
    client.set_terminated(ended, "FINISHED")
    done = subprocess.run([sys.executable, "-m", "coopstudy", "remote", "deliver", dead, ended, queued, "--tracking-uri", store.tracking_uri()],
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "the dead run's end" in done.stderr
    for run_id in (dead, queued):
        run = client.get_run(run_id)
        assert run.info.status == "KILLED" and "died without releasing device away" in run.data.tags[schema.TAG_ERROR]
    assert [m.value for m in client.get_metric_history(queued, "loss")] == [1.5]
    assert client.get_run(ended).info.status == "FINISHED"
    assert not list(outbox.outbox_dir().glob("*.jsonl"))


def test_a_stop_while_a_dead_jobs_lock_is_recovered_leaves_its_name_for_the_next_job(monkeypatch, capsys):
    # Before, the release emptied the file: the dead job's runs stayed RUNNING
    # and its leftover processes went on, with nothing left to name them.
    import socket

    path = workspace.subdir("locks") / f"{socket.gethostname()}-stopped.lock"
    dead = {"pid": 2**22 + 1, "holder": "a job killed", "since": 0.0, "runs": ["0" * 32]}
    path.write_text(json.dumps(dead))

    def stopped(*args, **kwargs):
        raise KeyboardInterrupt

    with monkeypatch.context() as mp:
        mp.setattr(lock, "_recover", stopped)
        with pytest.raises(KeyboardInterrupt), lock.device_lock(["stopped"], "the next job"):
            pass
    assert json.loads(path.read_text()) == dead
    with lock.device_lock(["stopped"], "and the next"):
        pass
    assert "is stale, its process is gone" in capsys.readouterr().err
    assert path.read_text() == ""


def test_a_lock_file_of_bytes_no_job_wrote_is_taken(capsys):
    """Not UTF-8, not JSON: no holder to name or stop, and the device is free."""
    import socket

    from coopstudy import workspace

    (workspace.subdir("locks") / f"{socket.gethostname()}-garbled.lock").write_bytes(b"garbage\xff")
    with lock.device_lock(["garbled"], "the next job"):
        pass
    (said,) = capsys.readouterr().err.strip().splitlines()
    assert said.startswith("coopstudy: device garbled on ") and said.endswith("taking the device"), said


def test_a_second_job_is_refused_while_the_first_holds_the_lock_in_another_process():
    import pytest

    from coopstudy.errors import RefusedError

    holding = subprocess.Popen(
        [sys.executable, "-c", "import sys, time\nfrom coopstudy.run import lock\nwith lock.device_lock(['testdev'], 'holder'):\n"
         "    print('held', flush=True); time.sleep(60)"],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert holding.stdout.readline().strip() == "held"
        with pytest.raises(RefusedError, match=f"device testdev on .* is in use by job pid {holding.pid} \\(holder, since"):
            with lock.device_lock(["testdev"], "second"):
                pass
    finally:
        holding.kill()
        holding.wait()


def test_a_sighup_of_a_stage_stops_it_as_a_sigterm_does():
    # A closed terminal (SIGHUP) ends a stage as `kill PID` does; the CLI runs of that are test_faults'.
    # Under nohup SIGHUP is ignored, and `stopping` leaves it so: here it is not.
    before = signal.signal(signal.SIGHUP, signal.SIG_DFL)
    try:
        with pytest.raises(launch.Terminated, match="^stopped by SIGHUP; every process it launched was stopped too$") as stopped:
            with launch.stopping():
                os.kill(os.getpid(), signal.SIGHUP)
                time.sleep(5)
        assert stopped.value.signum == signal.SIGHUP  # the CLI's exit 129
        assert signal.getsignal(signal.SIGHUP) is signal.SIG_DFL
    finally:
        signal.signal(signal.SIGHUP, before)


def test_a_stop_that_comes_while_the_launch_starts_stops_what_it_started(monkeypatch):
    # Raised inside Popen after its fork, a stop would leave the new process
    # running with nothing holding it; it waits until the launch can stop it.
    started: list[subprocess.Popen] = []
    real_popen = subprocess.Popen

    def popen_then_signalled(*args, **kwargs):
        started.append(real_popen(*args, **kwargs))
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.5)  # the handler runs in here: inside Popen, as far as the launch can tell
        return started[-1]

    monkeypatch.setattr(launch.subprocess, "Popen", popen_then_signalled)
    try:
        with pytest.raises(launch.Terminated, match="^stopped by SIGTERM"):
            launch.run(launch.Command([sys.executable, "-c", "import time; time.sleep(60)"], "1 process"), os.environ, label="a sleep")
        (proc,) = started
        assert proc.poll() is not None, "the launched process outlived the stop"
    finally:
        for proc in started:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
