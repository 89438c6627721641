"""The benchmarks on the tiny preset: `bench arms` runs both arms' real loops
and logs the per-phase table; `bench objective` computes only real tokens;
`bench generate` draws the development split, not the final test. Each logs a
run that covers its measurement. Speed figures are not checked (benchmarks,
not timed tests)."""

from __future__ import annotations

import json
import math
import os
import re
import statistics
from dataclasses import dataclass
from pathlib import Path

import mlflow
import pytest
import torch
from rich.console import Console

from coopstudy import config, machine
from coopstudy.bench import arms, generate, objective
from coopstudy.errors import RefusedError
from coopstudy.inputs import seed, tasks
from coopstudy.numerics import flops, update
from coopstudy.record import schema, store
from coopstudy.run import launch, lock


def _runs(filter_string: str) -> list:
    client = mlflow.MlflowClient(tracking_uri=store.tracking_uri())
    exp = client.get_experiment_by_name("coopstudy")
    return client.search_runs([exp.experiment_id], filter_string)


def test_bench_arms_runs_both_loops_through_both_phases_and_logs_the_breakdown(prepared_tiny, cli, tmp_path):
    cfg = config.load("tiny")
    dense = cfg.powersgd.dense_updates
    updates = dense + 1
    done = cli("bench", "arms", "--preset", "tiny", "--updates", str(updates))
    assert done.returncode == 0, done.stderr[-3000:]
    for text in ("dense, updates 1-2", "compressed, updates 3-3", "ratio control / compressed", "compute-only ideal ratio",
                 "ratio if forward/backward split exactly", "compressed arm by rank", "fraction of the fp32 peak", "matmul peak",
                 "memory new to each process (first touch)", "memory the machine had ready for first touch"):  # fmt: skip
        assert text in done.stdout, text

    (parent,) = _runs("attributes.run_name = 'bench-arms-tiny'")
    assert parent.info.status == "FINISHED" and parent.data.tags[schema.TAG_STAGE] == schema.STAGE_BENCH
    m = parent.data.metrics
    for phase in ("dense", "compressed"):
        assert m[f"{schema.M_BENCH_ARMS_RATIO_PREFIX}{phase}"] > 0
        assert m[f"{schema.M_BENCH_ARMS_IDEAL_PREFIX}{phase}"] > 0
        for arm in ("control", "compressed"):
            assert m[f"{schema.M_BENCH_ARMS_PREFIX}{phase}/{arm}/update"] > 0
    assert m[f"{schema.M_BENCH_ARMS_PREFIX}compressed/control/comm"] == 0
    assert m[f"{schema.M_BENCH_ARMS_PREFIX}compressed/compressed/comm"] > 0
    assert m[f"{schema.M_BENCH_MATMUL_PEAK_PREFIX}fp32"] > 0 and m[f"{schema.M_BENCH_MATMUL_PEAK_PREFIX}bf16/after"] > 0
    assert 0 < m[f"{schema.M_BENCH_PEAK_FRACTION_PREFIX}control"] < 1

    client = mlflow.MlflowClient(tracking_uri=store.tracking_uri())
    summaries, children = {}, {}
    for arm in ("control", "compressed"):
        (child,) = _runs(f"attributes.run_name = 'bench-arms-{arm}-tiny'")
        children[arm] = child
        assert child.info.status == "FINISHED" and child.data.tags[schema.TAG_ARM] == arm
        assert child.data.tags["mlflow.parentRunId"] == parent.info.run_id
        assert {schema.M_OTHERS_CORES, schema.M_STEAL_SECONDS} <= child.data.metrics.keys()  # how quiet the host was
        # The train loop's per-update record: every part of the breakdown, at every update.
        for key in (schema.M_UPDATE_SECONDS, schema.M_FORWARD_BACKWARD_SECONDS, schema.M_COMM_SECONDS, schema.M_COMM_ARITHMETIC_SECONDS,
                    schema.M_OPTIMIZER_SECONDS, schema.M_OTHER_SECONDS, schema.M_SYSTEM_SECONDS, schema.M_NEW_MEMORY_MB,
                    schema.M_RECORD_SECONDS):  # fmt: skip
            assert [p.step for p in client.get_metric_history(child.info.run_id, key)] == list(range(1, updates + 1)), key
        assert all(p.value >= 0 for p in client.get_metric_history(child.info.run_id, schema.M_SYSTEM_SECONDS))
        parts = {
            key: {p.step: p.value for p in client.get_metric_history(child.info.run_id, key)}
            for key in (schema.M_FORWARD_BACKWARD_SECONDS, schema.M_COMM_SECONDS, schema.M_OPTIMIZER_SECONDS, schema.M_OTHER_SECONDS)
        }
        seconds = {p.step: p.value for p in client.get_metric_history(child.info.run_id, schema.M_UPDATE_SECONDS)}
        for k in seconds:
            # `other` holds what the rest do not, so the parts add up by construction; a part
            # timed twice (or a clock read out of order) shows as a negative `other`.
            assert all(part[k] >= 0 for part in parts.values()), {key: part[k] for key, part in parts.items()}
            assert sum(part[k] for part in parts.values()) == pytest.approx(seconds[k], abs=1e-9)
        summary = summaries[arm] = json.loads(store.download_artifact(child.info.run_id, schema.ART_TRAIN_SUMMARY, tmp_path / arm).read_text())
        assert summary["padding_efficiency"] == 1.0
        # The malloc the arms ran under (it moves their seconds), as launched.
        assert summary["malloc"] == ("tcmalloc" if machine.tcmalloc_library() else f"glibc ({launch.TRAINING_MALLOC})")
        assert len(summary["times_by_rank"]) == (2 if arm == "compressed" else 1)
        # The compressed arm's ranks each on a core of their own; the control left to the scheduler.
        cores = sorted(os.sched_getaffinity(0))
        own = [[cores[0]], [cores[1]]] if len(cores) >= 2 else [None, None]
        assert summary["cores_by_rank"] == (own if arm == "compressed" else [None])
        assert all(len(r["forward_backward"]) == updates == len(r["system"]) for r in summary["times_by_rank"])
        # Memory new to each process, per update: rank 0's is the per-update metric, and the
        # parent's figure is every rank's over the window.
        grown = summary["new_memory_mb_by_rank"]
        assert len(grown) == len(summary["times_by_rank"]) and all(len(r) == updates and min(r) >= 0 for r in grown)
        history = client.get_metric_history(child.info.run_id, schema.M_NEW_MEMORY_MB)
        assert [p.value for p in sorted(history, key=lambda p: p.step)] == pytest.approx(grown[0])
        assert m[f"{schema.M_BENCH_NEW_MEMORY_PREFIX}{arm}"] == pytest.approx(sum(map(sum, grown)))
        assert m[f"{schema.M_BENCH_SYSTEM_PREFIX}{arm}"] == pytest.approx(sum(sum(r["system"]) for r in summary["times_by_rank"]))
        # What the machine had ready for first touches: before update 1, then after each update
        # (the per-update metric); the parent keeps the first and the lowest after an update.
        ready = summary["ready_memory_mb"]
        assert len(ready) == updates + 1 and all(mb > 0 for mb in ready)
        history = client.get_metric_history(child.info.run_id, schema.M_READY_MEMORY_MB)
        assert [p.value for p in sorted(history, key=lambda p: p.step)] == pytest.approx(ready[1:])
        assert m[f"{schema.M_BENCH_READY_MEMORY_PREFIX}{arm}"] == pytest.approx(ready[0])
        assert m[f"{schema.M_BENCH_READY_MEMORY_LOW_PREFIX}{arm}"] == pytest.approx(min(ready[1:]))
        assert summary["free_page_reporting"] is machine.free_page_reporting()
    assert children["compressed"].data.metrics[schema.M_BYTES_COMPRESSED] > 0

    # The split ratio, recomputed from the children's records: the control's
    # forward and backward halved, the hook of the rank that waited least,
    # rank 0's optimizer and rest.
    control_id = children["control"].info.run_id
    halves = {p.step: p.value / cfg.arm("compressed").workers for p in client.get_metric_history(control_id, schema.M_FORWARD_BACKWARD_SECONDS)}
    ranks = summaries["compressed"]["times_by_rank"]
    for phase, steps in {"dense": range(1, dense + 1), "compressed": range(dense + 1, updates + 1)}.items():
        split = [halves[k] + min(r["communication"][k - 1] for r in ranks) + ranks[0]["optimizer"][k - 1] + ranks[0]["other"][k - 1] for k in steps]
        expected = m[f"{schema.M_BENCH_ARMS_PREFIX}{phase}/control/update"] / statistics.median(split)
        assert m[f"{schema.M_BENCH_ARMS_SPLIT_PREFIX}{phase}"] == pytest.approx(expected, rel=1e-9)


def test_ready_memory_counts_free_blocks_under_the_reported_order():
    # /proc/buddyinfo's form: per zone, free blocks of 2^0, 2^1, ... pages.
    buddyinfo = (
        "Node 0, zone      DMA      0      0      0      0      0      0      0      0      1      1      3 \n"
        "Node 0, zone    DMA32      4      2      0      0      0      0      0      0      0      7      9 \n"
        "Node 0, zone   Normal    256    128      1      0      0      0      0      0      2      5      1 \n"
    )
    # Blocks under 2^9 pages: DMA 1·2^8; DMA32 4 + 2·2; Normal 256 + 128·2 + 1·2^2 + 2·2^8.
    pages = 2**8 + (4 + 2 * 2) + (256 + 128 * 2 + 2**2 + 2 * 2**8)
    assert machine.free_blocks_mb(buddyinfo, 9, 4096) == pages * 4096 / 2**20
    assert machine.free_blocks_mb(buddyinfo, 1, 4096) == (4 + 256) * 4096 / 2**20
    assert machine.free_blocks_mb("", 9, 4096) == 0.0


def test_bench_arms_takes_the_matmul_peaks_under_its_device_lock(prepared_tiny, monkeypatch):
    cfg = config.load("tiny")
    devices = launch.devices_of(cfg, ("control",), None)
    seen = []

    def peak(dtype, device, **_):
        # A second bench asking for the same devices now must be refused.
        try:
            with lock.device_lock(devices, "a second bench"):
                seen.append("free")
        except RefusedError as err:
            seen.append(str(err))
        raise RuntimeError("stopped at the first peak")

    monkeypatch.setattr(arms, "matmul_peak_gflops", peak)
    with pytest.raises(RuntimeError, match="stopped at the first peak"):
        arms.measure(cfg, updates=1, arms=("control",), console=Console(width=140))
    assert len(seen) == 1 and "in use by job" in seen[0] and "coopstudy bench arms --preset tiny" in seen[0]
    (parent,) = _runs("attributes.run_name = 'bench-arms-tiny'")
    assert parent.info.status == "FAILED"


def test_bench_arms_refuses_without_prepared_inputs(cli):
    done = cli("bench", "arms", "--preset", "tiny", "--updates", "2")
    assert done.returncode == 2
    assert "prepare --preset tiny" in done.stderr


def test_bench_objective_computes_real_tokens_only(tiny_seed, capsys):
    result = objective.measure(config.load("tiny"), updates=1, source="synthetic", console=Console(width=140))
    # Packed: every computed token a real one; padded, the same schedule would compute more.
    assert result[f"{schema.M_BENCH_PADDING_PREFIX}measured"] == 1.0
    for arm in ("control", "compressed"):
        sorted_, unsorted = (result[f"{schema.M_BENCH_PADDING_PREFIX}padded_{order}/{arm}"] for order in ("sorted", "unsorted"))
        assert sorted_ < 1.0 and unsorted < 1.0
    assert result[schema.M_BENCH_LOSS_REL_GAP] < 1e-4
    out = capsys.readouterr().out
    assert "padding efficiency, measured (real / computed tokens)" in out and "1.000" in out
    assert "M parameters, fp32, 1 thread(s)" in out
    # One line per update, warm-up included, with its tokens: together every token measured.
    lines = re.findall(
        r"update (\d)(?: \(warm-up\))?: ([\d,]+) tokens; batched [\d.]+ s \([\d.]+ s of it the kernel's\),"
        r" per-document [\d.]+ s: [\d.]+x",
        out,
    )
    assert [n for n, _ in lines] == ["1", "2"]
    real = re.search(r"padding efficiency, measured \(real / computed tokens\).*?1\.000 \(([\d,]+) / ", out, re.S)
    assert sum(int(t.replace(",", "")) for _, t in lines) == int(real.group(1).replace(",", ""))

    # The run was open for the whole measurement: its timed updates (the
    # warm-up besides) fit inside it.
    (run,) = _runs("attributes.run_name = 'bench-objective-tiny'")
    assert run.info.status == "FINISHED" and run.data.tags[schema.TAG_STAGE] == schema.STAGE_BENCH
    m = run.data.metrics
    assert m[schema.M_BENCH_BATCHED_MS] == result[schema.M_BENCH_BATCHED_MS] > 0
    assert (run.info.end_time - run.info.start_time) >= m[schema.M_BENCH_BATCHED_MS] + m[schema.M_BENCH_REFERENCE_MS]


def test_bench_objective_interrupted_mid_measurement_leaves_a_killed_run(tiny_seed, monkeypatch, capsys):
    reference_update = update.reference_update
    calls = []

    def interrupted(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return reference_update(*args, **kwargs)

    monkeypatch.setattr(update, "reference_update", interrupted)
    with pytest.raises(KeyboardInterrupt):
        objective.measure(config.load("tiny"), updates=1, source="synthetic", console=Console(width=140))
    assert "update 1 (warm-up)" in capsys.readouterr().out
    (run,) = _runs("attributes.run_name = 'bench-objective-tiny'")
    assert run.info.status == "KILLED" and run.data.tags[schema.TAG_ERROR_KIND] == "KeyboardInterrupt"


@dataclass(frozen=True)
class Doc:
    input_ids: tuple[int, ...]
    weights: tuple[float, ...]


def test_training_flops_count_every_token_the_output_layer_at_targets_and_attention_in_documents():
    shape = flops.ModelShape(parameters=1000, matmul_parameters=600, output_parameters=300, layers=2, attention_width=8)
    docs = [Doc((1, 2, 3), (0.0, 0.0, 8.0)), Doc((4, 5), (0.0, 1.0))]
    executed, nominal = shape.training_flops(docs)
    attention = 6 * 2 * 8 * (3 * 4 + 2 * 3)
    assert executed == 6 * 600 * 5 + 6 * 300 * 2 + attention
    assert nominal == 6 * 1000 * 5 + attention
    assert [shape.document_flops(d) for d in docs] == [6 * (600 * 3 + 300 + 2 * 8 * 12), 6 * (600 * 2 + 300 + 2 * 8 * 6)]


def test_the_matmul_peak_is_measured_in_bounded_time():
    torch.set_num_threads(1)
    gflops = arms.matmul_peak_gflops(torch.float32, torch.device("cpu"), seconds=0.05)
    assert gflops > 0 and math.isfinite(gflops)


def test_bench_generate_spreads_development_cases_over_every_family_and_logs_a_run(tiny_seed, cli):
    done = cli("bench", "generate", "--preset", "tiny", "--items", "5")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "5 cases of the development split (test seed 5,000,000: gcd 2, products 1, letter_counting 1, chain_sum 1)" in done.stdout
    assert "identical outputs: 5/5" in done.stdout

    (run,) = _runs("attributes.run_name = 'bench-generate-tiny'")
    assert run.info.status == "FINISHED" and run.data.tags[schema.TAG_STAGE] == schema.STAGE_BENCH
    m = run.data.metrics
    assert m[schema.M_BENCH_GENERATE_CASES] == 5 and m[schema.M_BENCH_GENERATE_IDENTICAL] == 5
    for mode in ("one_at_a_time", "batched"):
        assert m[schema.M_BENCH_GENERATE_RATE_PREFIX + mode] == pytest.approx(5 / m[schema.M_BENCH_GENERATE_SECONDS_PREFIX + mode])
    assert m[schema.M_BENCH_SPEEDUP] == pytest.approx(m[schema.M_BENCH_GENERATE_SECONDS_PREFIX + "one_at_a_time"] / m[schema.M_BENCH_GENERATE_SECONDS_PREFIX + "batched"])
    # Both generations happened inside the run.
    assert run.info.end_time - run.info.start_time >= 1000 * sum(m[schema.M_BENCH_GENERATE_SECONDS_PREFIX + mode] for mode in ("one_at_a_time", "batched"))


def test_bench_generate_cases_are_none_of_the_final_tests_and_follow_the_family_options():
    cfg = config.load("tiny")
    d = cfg.data
    final = tasks.generate_final(d.families, d.test_per_family, d.test_seed, set(), d.family_options)
    cases = generate.generation_cases(cfg, 2 * len(d.families))
    assert [c["family"] for c in cases] == [f for f in d.families for _ in range(2)]
    assert not {c["entry"]["question"] for c in cases} & {t.question for t in final.tasks}

    shaped = generate.generation_cases(config.load("tiny", ["data.family_options={gcd: {min_numbers: 3, max_numbers: 3}}"]), 2 * len(d.families))
    changed = {c["family"] for c, s in zip(cases, shaped) if c["entry"]["question"] != s["entry"]["question"]}
    assert changed == {"gcd"}


def test_bench_objective_on_prepared_documents_refuses_before_it_makes_the_seed(cli):
    # Before, the seed was made first (on a GGUF preset, minutes of conversion), then refused.
    done = cli("bench", "objective", "--preset", "tiny", "--documents", "prepared")
    assert done.returncode == 2
    assert "no inputs commitment" in done.stderr and "run `python -m coopstudy prepare --preset tiny` first" in done.stderr, done.stderr
    assert not (Path(os.environ["COOPSTUDY_HOME"]) / seed.SEEDS).exists()
