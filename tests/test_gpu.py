"""train on CUDA: the expandable-segments allocator and the CUDA memory figures
reach the record; the compressed arm runs over NCCL (two GPUs: NCCL refuses
two ranks on one device)."""

from __future__ import annotations

import json

import mlflow
import pytest
import torch
from fixtures import module_store, run_cli

from coopstudy.record import schema, store

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.fixture(scope="module", autouse=True)
def isolated_store(tmp_path_factory, prepared_tiny_store):
    with module_store(tmp_path_factory, prepared_tiny_store, "gpu-store") as shared, pytest.MonkeyPatch.context() as mp:
        mp.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
        done = run_cli("verify", "--preset", "tiny")
        assert done.returncode == 0, done.stderr[-3000:]
        yield shared


def _train(arm: str, tmp_path) -> tuple[mlflow.entities.Run, dict]:
    done = run_cli("train", "--preset", "tiny", "--arm", arm)
    assert done.returncode == 0, done.stderr[-3000:]
    client = mlflow.MlflowClient()
    exp = client.get_experiment_by_name("coopstudy")
    (run,) = client.search_runs([exp.experiment_id], f"attributes.run_name = 'train-{arm}-tiny'")
    summary = json.loads((store.download_artifact(run.info.run_id, schema.ART_TRAIN_SUMMARY, tmp_path)).read_text())
    return run, summary


def _check_cuda_record(run, summary) -> None:
    assert run.info.status == "FINISHED"
    assert summary["device"].startswith("cuda")
    assert summary["allocator"] == "expandable_segments:True"
    m = run.data.metrics
    assert m[schema.M_CUDA_MAX_ALLOCATED_MB] > 0
    assert m[schema.M_CUDA_MAX_RESERVED_MB] >= m[schema.M_CUDA_MAX_ALLOCATED_MB]
    assert all(rank["cuda_max_allocated_mb"] > 0 for rank in summary["memory_by_rank"])


def test_control_on_one_gpu_logs_cuda_memory(tmp_path):
    run, summary = _train("control", tmp_path)
    _check_cuda_record(run, summary)
    assert summary["backend"] is None


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL needs one GPU per rank")
def test_compressed_arm_over_nccl_logs_cuda_memory(tmp_path):
    run, summary = _train("compressed", tmp_path)
    _check_cuda_record(run, summary)
    assert summary["backend"] == "nccl" and summary["workers"] == 2
    assert run.data.metrics[schema.M_BYTES_COMPRESSED] > 0
