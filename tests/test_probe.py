"""probe on the tiny preset, through the real CLI: one run per candidate under a
parent, a receipt per candidate on disk and in the ledger, and a candidate
that exceeds the emulated device's capacity recorded as out of memory without
ending the sweep.

`probed_tiny_store` (prepare, verify, probe on tiny, once per session, in
fixtures.py) is also what test_plan.py and test_train.py start from.
"""

from __future__ import annotations

import json
import shlex
import statistics

import mlflow
import pytest
from fixtures import run_cli

from coopstudy import config
from coopstudy.commit import ledger, receipts, sources
from coopstudy.record import schema, store

pytestmark = pytest.mark.slow

GRID = {f"{c.arm}-mb{c.microbatch}-{c.allocator}" for c in config.load("tiny").probe.candidates}
PRESET_SETTINGS = ("control-mb4-default", "compressed-mb3-default")
"""The tiny preset's own settings, which complete; any other candidate of its grid stands for a failure."""
ONE_CANDIDATE_FAILS = "probe.device_capacity_mb=64"
"""Below what any training process needs just to load torch: certainly out of memory."""
TWO_CONTROL_CANDIDATES = 'probe.candidates=[{"arm":"control","microbatch":4},{"arm":"control","microbatch":2}]'


def _runs(filter_string: str) -> list:
    client = mlflow.MlflowClient()
    exp = client.get_experiment_by_name("coopstudy")
    return client.search_runs([exp.experiment_id], filter_string)


def _sweep(setting: str) -> tuple:
    """(parent, {setting: child}) of the newest sweep that probed `setting`."""
    child = _runs(f"tags.`{schema.TAG_PROBE_SETTING}` = '{setting}'")[0]
    parent = mlflow.MlflowClient().get_run(child.data.tags["mlflow.parentRunId"])
    children = _runs(f"tags.`mlflow.parentRunId` = '{parent.info.run_id}'")
    return parent, {run.data.tags[schema.TAG_PROBE_SETTING]: run for run in children}


def test_each_candidate_is_a_child_run_with_a_receipt_on_disk_and_in_the_ledger(probed_tiny, tmp_path):
    cfg = config.load("tiny")
    parent, children = _sweep("control-mb4-default")
    assert parent.info.status == "FINISHED" and parent.info.run_name == "probe-tiny"
    assert parent.data.tags[schema.TAG_STAGE] == schema.STAGE_PROBE
    assert set(children) == GRID
    kept = receipts.probe_receipts(cfg)
    assert sorted(kept) == sorted(f"{name}.json" for name in GRID)
    entries = {e.subject.rsplit("/", 1)[1]: e for e in ledger.Ledger().entries() if e.kind == ledger.PROBE}
    (gate_entry,) = [e for e in ledger.Ledger().entries() if e.kind == ledger.GATE]
    for name in PRESET_SETTINGS:
        run, receipt = children[name], kept[f"{name}.json"]
        assert run.info.status == "FINISHED" and run.data.tags[schema.TAG_PROBE_OUTCOME] == "completed"
        assert receipt["outcome"] == "completed" and receipt["message"] is None
        assert receipt["run_id"] == run.info.run_id
        assert run.data.params[f"arms.{receipt['setting']['arm']}.microbatch"] == str(receipt["setting"]["microbatch"])
        # The real loop ran probe.updates updates, timed one by one.
        seconds = receipt["update_seconds"]
        assert len(seconds) == cfg.probe.updates and all(s > 0 for s in seconds)
        assert receipt["median_update_seconds"] == statistics.median(seconds)
        assert run.data.metrics[schema.M_PROBE_MEDIAN_SECONDS] == pytest.approx(receipt["median_update_seconds"])
        assert {schema.M_OTHERS_CORES, schema.M_STEAL_SECONDS} <= run.data.metrics.keys()  # how quiet the host was
        assert len(mlflow.MlflowClient().get_metric_history(run.info.run_id, schema.M_LOSS)) == cfg.probe.updates
        assert receipt["complete_seconds"] > sum(seconds)
        # The training worker stopped early, and kept no weights (below: none on disk either).
        summary = json.loads(store.download_artifact(run.info.run_id, schema.ART_TRAIN_SUMMARY, tmp_path / name).read_text())
        assert summary["updates"] == cfg.probe.updates < cfg.train.updates
        assert schema.TAG_CHECKPOINT_SHA not in run.data.tags and schema.M_CHECKPOINT_SECONDS not in run.data.metrics
        # A compressed probe compresses its last update: its memory holds PowerSGD's too
        # (before, every probe update was dense; a full run compresses from update dense_updates + 1).
        compressed = receipt["setting"]["arm"] == "compressed"
        dense = min(cfg.powersgd.dense_updates, cfg.probe.updates - 1) if compressed else cfg.powersgd.dense_updates
        assert run.data.params["powersgd.dense_updates"] == str(dense)
        assert (run.data.metrics[schema.M_BYTES_COMPRESSED] > 0) == compressed
        # Memory of every rank, under the preset's capacity; CPU figures only.
        ranks = receipt["memory_by_rank"]
        assert len(ranks) == receipt["setting"]["workers"]
        assert all(100 < r["peak_rss_mb"] < cfg.probe.device_capacity_mb for r in ranks.values())
        assert all("cuda_max_allocated_mb" not in r for r in ranks.values())
        assert receipt["device_type"] == "cpu"
        # What it ran on and with.
        assert receipt["libraries"]["torch"] == sources.library_versions()["torch"]
        assert receipt["sources"]["numerical_sha256"] == gate_entry.details["sources_sha256"]
        # The code that ran and timed it, derived (a hand list missed the record's writer and the checkpoint).
        training = receipt["sources"]["training"]
        assert {"src/coopstudy/run/worker.py", "src/coopstudy/steps/probe.py", "src/coopstudy/record/writer.py", "src/coopstudy/run/checkpoint.py"} <= set(training)
        assert training == sources.probe_sources_sha256()
        assert receipt["gate_receipt"] == gate_entry.digest
        assert receipt["inputs"]["sha256"] == run.data.tags[schema.TAG_REQUIRES_PREFIX + ledger.INPUTS]
        # Kept: on disk, hashed in the ledger and on the run.
        assert entries[name].digest == run.data.tags[schema.TAG_PROBE_RECEIPT]
        stored = json.loads(store.download_artifact(run.info.run_id, schema.ART_PROBE_RECEIPT, tmp_path / name).read_text())
        assert stored == receipt
    for name in GRID - set(PRESET_SETTINGS):
        assert children[name].info.status == "FAILED" and kept[f"{name}.json"]["outcome"] == "out_of_memory"
    # No checkpoint: probes keep no weights.
    assert not (probed_tiny.home / "checkpoints").exists()


@pytest.mark.parametrize(
    "preset, overrides, dense",
    [("tiny", (), 2), ("smollm2-135m-cpu", (), 2), ("smollm2-1.7b", (), 2), ("tiny", ("probe.updates=5",), 2), ("smollm2-1.7b", ("probe.updates=5",), 4)],
)
def test_a_compressed_probe_compresses_at_least_its_last_update(preset, overrides, dense):
    # Its dense phase cut to end before its last update, never lengthened (tiny's 2 dense updates of 5).
    from coopstudy.steps import probe

    cfg = config.load(preset, list(overrides))
    for candidate, own in probe._candidates(cfg):
        assert own.powersgd.dense_updates == (dense if candidate.arm == "compressed" else cfg.powersgd.dense_updates), candidate


def test_the_choice_is_a_table_and_an_artifact_and_the_preset_is_unchanged(probed_tiny, tmp_path):
    out = probed_tiny.printed.stdout
    assert "probe: 3 candidates, 3 updates each (a compressed one: 2 dense, then compressed), device capacity 4096 MiB" in out
    assert "largest microbatch that completed, per arm and allocator" in out
    assert "control-mb4-default: completed" in out and "compressed-mb3-default: completed" in out
    parent, _ = _sweep("control-mb4-default")
    choice = json.loads(store.download_artifact(parent.info.run_id, schema.ART_PROBE_CHOICE, tmp_path).read_text())
    assert choice["control"]["default"]["largest_completed_microbatch"] == 4
    assert choice["compressed"]["default"]["largest_completed_microbatch"] == 3
    assert choice["control"]["default"]["failed"] == []
    assert parent.data.metrics[schema.M_PROBE_COMPLETED] == 2
    assert parent.data.metrics[schema.M_PROBE_FAILED] == len(GRID) - 2
    # Nothing was written back into the preset.
    assert config.load("tiny").arms.control.microbatch == 4


def test_a_candidate_over_the_capacity_fails_as_out_of_memory_and_the_sweep_goes_on(probed_tiny):
    overrides = ("--set", ONE_CANDIDATE_FAILS, TWO_CONTROL_CANDIDATES)
    done = run_cli("probe", "--preset", "tiny", *overrides)
    assert done.returncode == 0, done.stderr[-3000:]
    parent, children = _sweep("control-mb2-default")
    # Both candidates were tried: the first failure did not end the sweep.
    assert set(children) == {"control-mb4-default", "control-mb2-default"}, done.stdout
    cfg = config.load("tiny", overrides[1:])
    kept = receipts.probe_receipts(cfg)
    for name, run in children.items():
        assert run.info.status == "FAILED"
        assert run.data.tags[schema.TAG_PROBE_OUTCOME] == "out_of_memory"
        receipt = kept[f"{name}.json"]
        assert receipt["outcome"] == "out_of_memory"
        assert "exceeds the device capacity 64 MiB" in receipt["message"]
        assert "DeviceOutOfMemory" in run.data.tags[f"{schema.TAG_WORKER_ERROR_PREFIX}0"]
        assert receipt["median_update_seconds"] is None and receipt["update_seconds"] == []
        assert receipt["memory_by_rank"]["0"]["peak_rss_mb"] > 64
    assert "out_of_memory" in done.stdout and "none" in done.stdout
    assert parent.info.status == "FINISHED" and parent.data.metrics[schema.M_PROBE_FAILED] == 2
    # The next step it names is of the same config: the overrides go with it, quoted for a shell.
    (hint,) = [line for line in done.stdout.splitlines() if line.startswith("next: `")]
    assert shlex.split(hint.split("`")[1]) == ["python", "-m", "coopstudy", "plan", "--preset", "tiny", *overrides[:2], "--set", overrides[2]]
    # The plan will not pretend: the preset's setting failed its probe.
    refused = run_cli("plan", "--preset", "tiny", *overrides)
    assert refused.returncode == 2
    assert "arms.control.microbatch 4 with the expandable allocator failed its probe (control-mb4-default.json: out_of_memory" in refused.stderr


def test_receipts_of_two_sweeps_on_other_code_are_refused_together(probed_tiny, capsys):
    """A sweep stopped after its first candidate, on code changed since the last
    whole sweep, leaves receipts of both: plan refuses them, and a study probes again."""
    from coopstudy import cli as cli_mod
    from coopstudy.commit import require
    from coopstudy.errors import RefusedError
    from coopstudy.record import writer

    cfg = config.load("tiny")
    first, *rest = sorted(receipts.probe_dir(cfg).glob("*.json"))
    assert rest
    receipt = json.loads(first.read_text())
    # Probed again on the same code and inputs: taken with the rest.
    with writer.stage_run(schema.STAGE_PROBE, cfg, log_config=False) as rec:
        receipts.keep_receipt(cfg, receipt | {"run_id": rec.run_id}, rec)
    require.probe_receipts_complete(cfg)
    receipt["sources"]["training"] = dict.fromkeys(receipt["sources"]["training"], "0" * 64)
    with writer.stage_run(schema.STAGE_PROBE, cfg, log_config=False) as rec:
        receipts.keep_receipt(cfg, receipt | {"run_id": rec.run_id}, rec)
    assert cli_mod.main(["plan", "--preset", "tiny"]) == 2
    assert capsys.readouterr().err.strip() == (
        f"coopstudy plan: error: probe receipts {first.name} and {rest[0].name} in {receipts.probe_dir(cfg)} were measured on "
        "different sources (a sweep stopped before it probed every candidate again); run `python -m coopstudy probe --preset tiny` again"
    )
    with pytest.raises(RefusedError, match="were measured on different sources"):
        require.probe_receipts_complete(cfg)


def test_probe_refuses_without_a_gate_receipt(prepared_tiny):
    done = run_cli("probe", "--preset", "tiny")
    assert done.returncode == 2
    assert "no gate receipt" in done.stderr and "verify" in done.stderr
    (failed,) = _runs("attributes.run_name = 'probe-tiny'")
    assert failed.info.status == "FAILED"


def test_probe_refuses_a_grid_listing_a_setting_twice(prepared_tiny):
    done = run_cli("probe", "--preset", "tiny", "--set", 'probe.candidates=[{"arm":"control","microbatch":4},{"arm":"control","microbatch":4}]')
    assert done.returncode == 2
    assert "probe.candidates lists control-mb4-default twice" in done.stderr


def _rank(outcome: str, error: str | None = None, seconds: tuple[float, ...] = (), device: str = "cpu", rank: int = 0) -> dict:
    return {
        "rank": rank, "outcome": outcome, "error": error, "update_seconds": list(seconds),
        "memory": {"peak_rss_mb": 500.0}, "device": device, "device_name": "x", "host": "h",
    }


def _receipt(ranks: dict, returncode: int, workers: int = 2) -> dict:
    launched = receipts.Launched(returncode, 10.0, "exit code 1" if returncode else "exit code 0")
    return receipts.probe_receipt(
        arm="compressed", microbatch=8, allocator="default", workers=workers, updates=3, capacity_mb=None,
        run_id="r", launched=launched, ranks=ranks, hourly_price_usd=1.0, context={},
    )


def test_outcome_out_of_memory_wins_over_the_rank_the_launcher_stopped():
    r = _receipt({0: _rank("error", "Stopped: stopped by SIGTERM"), 1: _rank("out_of_memory", "OutOfMemoryError: CUDA out of memory", rank=1)}, 1)
    assert r["outcome"] == "out_of_memory" and r["message"] == "rank 1: OutOfMemoryError: CUDA out of memory"


def test_outcome_error_names_a_rank_that_left_no_report_and_costs_its_devices():
    r = _receipt({0: _rank("error", "ValueError: bad")}, 1)
    assert r["outcome"] == "error"
    assert r["message"] == "exit code 1; rank 0: ValueError: bad; rank 1 left no report (killed from outside, or out of host memory)"
    assert r["cost_usd"] == pytest.approx(2 * 10.0 / 3600)
    done = _receipt({0: _rank("completed", seconds=(3.0, 1.0, 2.0)), 1: _rank("completed", seconds=(3.0, 1.0, 2.0), rank=1)}, 0)
    assert done["outcome"] == "completed" and done["median_update_seconds"] == 2.0


def test_choose_takes_the_largest_completed_microbatch_per_arm_and_allocator():
    def rec(mb: int, alloc: str, outcome: str, median: float | None) -> dict:
        return {"setting": {"arm": "control", "microbatch": mb, "allocator": alloc, "name": f"control-mb{mb}-{alloc}"},
                "outcome": outcome, "median_update_seconds": median}

    choice = receipts.choose([rec(16, "default", "out_of_memory", None), rec(8, "default", "completed", 2.0),
                           rec(16, "expandable", "completed", 3.0), rec(12, "expandable", "completed", 2.5)])
    assert choice["control"]["default"] == {"largest_completed_microbatch": 8, "median_update_seconds": 2.0,
                                            "receipt": "control-mb8-default", "failed": [16]}
    assert choice["control"]["expandable"]["largest_completed_microbatch"] == 16
    assert choice["control"]["expandable"]["median_update_seconds"] == 3.0


@pytest.mark.gpu
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs CUDA")
def test_on_cuda_the_capacity_is_the_allocators_and_its_figures_are_kept(prepared_tiny):
    assert run_cli("verify", "--preset", "tiny").returncode == 0
    grid = 'probe.candidates=[{"arm":"control","microbatch":4,"allocator":"expandable"}]'
    for capacity, outcome in ((8, "out_of_memory"), (4096, "completed")):
        done = run_cli("probe", "--preset", "tiny", "--set", grid, f"probe.device_capacity_mb={capacity}")
        assert done.returncode == 0, done.stderr[-3000:]
        (receipt,) = receipts.probe_receipts(config.load("tiny", [grid, f"probe.device_capacity_mb={capacity}"])).values()
        assert receipt["outcome"] == outcome, receipt["message"]
        memory = receipt["memory_by_rank"]["0"]
        assert {"cuda_max_allocated_mb", "cuda_max_reserved_mb", "cuda_reserved_unallocated_mb", "cuda_alloc_retries"} <= set(memory)
        assert memory["cuda_max_reserved_mb"] <= capacity
