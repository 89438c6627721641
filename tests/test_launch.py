"""train refuses before starting anything: no gate receipt, no inputs, devices in use.

Each refusal is one line, exit 2, and a FAILED train run on record.
"""

from __future__ import annotations

import os
from pathlib import Path

import mlflow

from coopstudy import config
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
    assert f"in use by training job pid {os.getpid()} (a training job in this test" in lines[0]
    (run,) = _train_runs()
    assert run.info.status == "FAILED" and run.info.run_name == "train-both-tiny"
    assert f"pid {os.getpid()}" in run.data.tags[schema.TAG_ERROR]


def test_the_lock_is_free_again_after_the_holder_ends():
    with lock.device_lock(["cpu"], "first"):
        pass
    with lock.device_lock(["cpu"], "second"):
        pass


def test_compressed_arm_command_one_host_and_two_hosts(tmp_path: Path, monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    cfg = config.load("tiny")
    one_host = launch.command(cfg, "compressed", "RUN")
    assert Path(one_host[0]).name == "deepspeed"
    assert one_host[one_host.index("--num_gpus") + 1] == "2"
    assert one_host[one_host.index("--module") + 1 :][:2] == ["coopstudy", "worker"]
    assert one_host[one_host.index("--run-id") + 1] == "RUN"
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("host-a slots=1\nhost-b slots=1\n")
    two_hosts = launch.command(cfg, "compressed", "RUN", hostfile=hostfile)
    assert two_hosts[two_hosts.index("--hostfile") + 1] == str(hostfile)
    assert two_hosts[two_hosts.index("--num_nodes") + 1] == "2"
    assert two_hosts[two_hosts.index("--num_gpus") + 1] == "1"
    control = launch.command(cfg, "control", "RUN")
    assert control[1:4] == ["-m", "coopstudy", "worker"] and "deepspeed" not in " ".join(control)


def test_worker_environment_sets_threads_allocator_and_run_id(monkeypatch):
    monkeypatch.setenv("MLFLOW_RUN_ID", "the-project-run")
    cfg = config.load("tiny", ["train.threads_per_device=3"])
    env = launch.worker_environment(cfg, "RUN")
    assert env["OMP_NUM_THREADS"] == "3" and env["MKL_NUM_THREADS"] == "3"
    assert env["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    assert env[writer.ENV_RUN_ID] == "RUN"
    # The project run's id must not leak into the ranks.
    assert "MLFLOW_RUN_ID" not in env
