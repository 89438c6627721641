"""train on CUDA: the expandable-segments allocator and the CUDA memory figures
reach the record; the compressed arm runs over NCCL (two GPUs: NCCL refuses
two ranks on one device); the packed objective on CUDA. Without CUDA: the
GPU check (`make gpu-check`) skips cleanly after its CPU checks."""

from __future__ import annotations

import json
import subprocess
import sys

import mlflow
import pytest
import torch
from fixtures import ROOT, module_store, run_cli

from coopstudy.record import schema, store

needs_cuda = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _cuda(test):
    for mark in needs_cuda:
        test = mark(test)
    return test


@pytest.fixture(scope="module", autouse=True)
def isolated_store(tmp_path_factory, request):
    """One verified tiny store for the module (in place of each test's own):
    the CUDA tests train into it. Without CUDA nothing here touches a store."""
    if not torch.cuda.is_available():
        yield None
        return
    prepared_tiny_store = request.getfixturevalue("prepared_tiny_store")
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


@_cuda
def test_control_on_one_gpu_logs_cuda_memory(tmp_path):
    run, summary = _train("control", tmp_path)
    _check_cuda_record(run, summary)
    assert summary["backend"] is None


@_cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL needs one GPU per rank")
def test_compressed_arm_over_nccl_logs_cuda_memory(tmp_path):
    run, summary = _train("compressed", tmp_path)
    _check_cuda_record(run, summary)
    assert summary["backend"] == "nccl" and summary["workers"] == 2
    assert run.data.metrics[schema.M_BYTES_COMPRESSED] > 0


def _gpu_check():
    sys.path.insert(0, str(ROOT / "scripts"))
    import gpu_check

    return gpu_check


@_cuda
@pytest.mark.parametrize("precision, loss_bound, grad_bound", [("fp64", 1e-12, 1e-9), ("bf16", 2e-2, 0.1)])
def test_packed_microbatches_match_the_reference_on_cuda(precision, loss_bound, grad_bound):
    loss, grads = _gpu_check().packed_against_reference("cuda", precision)
    assert loss < loss_bound and grads < grad_bound


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CUDA path is the make target's")
def test_gpu_check_without_cuda_skips_cleanly_after_its_cpu_checks():
    done = subprocess.run([sys.executable, "scripts/gpu_check.py"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "no CUDA device here" in done.stdout and "skipped" in done.stdout
    assert "ok   packed vs per-document on CPU, float64" in done.stdout
