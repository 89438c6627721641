"""The report step on a fake but complete study record in the test's store."""

from __future__ import annotations

import html
import json
import math
import os
import re
import signal
import statistics
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import mlflow
import pytest
from fixtures import ROOT, fill_disk

from analysis import records
from analysis import report as rep
from analysis import screens as sc
from coopstudy import cli as cli_main
from coopstudy import config
from coopstudy.config import ARMS
from coopstudy.commit import sources
from coopstudy.errors import RefusedError, UserError
from coopstudy.record import schema, store, writer
from coopstudy.steps import report as report_step

PLAN = "ab" * 32
CANDIDATE = {"control": "c0" * 32, "compressed": "c1" * 32}
FAMILIES = ("gcd", "products", "letter_counting", "chain_sum")


SEED = "5e" * 32


def _train(cfg, arm: str, *, active: float, complete: float, plan: str | None) -> str:
    devices = cfg.arm(arm).workers
    tags = {schema.TAG_CHECKPOINT_SHA: CANDIDATE[arm], schema.TAG_SEED_SHA: SEED, schema.TAG_REQUIRES_PREFIX + "inputs": INPUTS}
    tags |= {schema.TAG_PLAN: plan} if plan else {}
    with writer.stage_run(schema.STAGE_TRAIN, cfg, arm=arm, tags=tags) as rec:
        for update in range(1, cfg.train.updates + 1):
            dense = arm == "compressed" and update <= cfg.powersgd.dense_updates
            rec.log_metrics(
                {
                    schema.M_LOSS: 3.0 / update + (0.01 if arm == "compressed" else 0.0),
                    schema.M_GRAD_NORM: 1.0 / update,
                    schema.M_LR: 1e-3,
                    schema.M_UPDATE_SECONDS: active / cfg.train.updates * (1 + 0.1 * (update % 2)),
                    schema.M_TOKENS: 1000.0 + update,
                    schema.M_BYTES: 0.0 if arm == "control" else (40_000.0 if dense else 5_000.0),
                    schema.M_FORWARD_BACKWARD_SECONDS: 0.5 + update,
                    schema.M_COMM_SECONDS: 0.0 if arm == "control" else (0.2 if dense else 0.4),
                    schema.M_COMM_ARITHMETIC_SECONDS: 0.3 if arm == "compressed" and not dense else 0.0,
                    schema.M_OPTIMIZER_SECONDS: 0.1,
                    schema.M_OTHER_SECONDS: 0.01,
                    schema.M_SYSTEM_SECONDS: 2.0 if update == 1 else (0.05 if arm == "control" else 0.02),
                    schema.M_NEW_MEMORY_MB: 300.0 if update == 1 else (0.0 if arm == "control" else 10.0),
                    # The compressed arm's ranks use up what the machine had ready; the control's one does not.
                    schema.M_READY_MEMORY_MB: 5000.0 - 300.0 * update if arm == "compressed" else 6000.0 + update,
                    schema.M_RECORD_SECONDS: 0.0,
                },
                step=update,
            )
        dense_bytes = 0.0 if arm == "control" else 40_000.0 * cfg.powersgd.dense_updates
        compressed_bytes = 0.0 if arm == "control" else 5_000.0 * (cfg.train.updates - cfg.powersgd.dense_updates)
        setup_bytes = 0.0 if arm == "control" else 30_000.0
        rec.log_metrics(
            {
                schema.M_ACTIVE_SECONDS: active,
                schema.M_COMPLETE_SECONDS: complete,
                schema.M_CHECKPOINT_SECONDS: 1.25,
                schema.M_DEVICE_SECONDS: devices * complete,
                schema.M_BYTES_DENSE: dense_bytes,
                schema.M_BYTES_COMPRESSED: compressed_bytes,
                schema.M_BYTES_TOTAL: dense_bytes + compressed_bytes + setup_bytes,
                schema.M_BYTES_SETUP: setup_bytes,
                schema.M_PEAK_RSS_MB: 800.0,
                schema.M_COST_USD: devices * complete / 1000,
                schema.M_OTHERS_CORES: 0.5 if arm == "compressed" else 0.0,
                schema.M_STEAL_SECONDS: 0.0,
            }
        )
        return rec.run_id


def _case_rows(correct: list[float]) -> list[dict]:
    return [
        {"case_id": f"case-{i:04d}", "family": FAMILIES[i % 4], "prompt": "q", "completion": "a", "score": s, "correct": s >= 1.0}
        for i, s in enumerate(correct)
    ]


def _retention_rows(shift: float) -> list[dict]:
    # One document has no target tokens left (cut at max_context): no evidence.
    rows = [{"doc_id": "doc-empty", "kind": "replay", "tokens": 0, "nll_sum": 0.0, "mean_nll": None}]
    for i in range(8):
        tokens = 20 + 5 * i
        # A tiny, document-dependent change keeps the paired spread non-zero.
        mean = 2.0 + 0.05 * i + shift * (1 + 0.1 * (i % 3))
        rows.append({"doc_id": f"doc-{i}", "kind": "replay", "tokens": tokens, "nll_sum": mean * tokens, "mean_nll": mean})
    return rows


def _plan_run(cfg, plan: str, files: dict[str, str] | None = None) -> str:
    """The plan run as `plan` records it: the plan document binds the sources as they are now (or `files`)."""
    _, now = sources.deciding_sources_sha256()
    with writer.stage_run(schema.STAGE_PLAN, cfg, tags={schema.TAG_PLAN: plan}) as rec:
        rec.log_dict({"sources": {"files": files if files is not None else now}, "budget": PLANNED_BUDGET}, schema.ART_PLAN)
    return rec.run_id


PLANNED_BUDGET = {
    "hourly_price_usd": 3.6, "allocation_usd": 100.0, "deadline": None,
    "probes_cost_usd": 0.05, "projected_cost_usd": 0.3, "projected_seconds": 80.0,
}  # fmt: skip
"""The budget part of the plan document `plan` writes."""


MANIFEST = {
    "conversations": {"source": "chitchat", "package": "chitchat-dataset 0.9.0", "sha256": "d2" * 32, "usable": 3948},
    "split": {
        "source": "chitchat", "retention": 8, "replay": 16, "retention_topics": ["What's your favorite smell?"],
        "retention_groups": 4, "held_out_unused": 502, "replay_topics": 13, "replay_skipped_for_overlap": 2,
        "overlap_rule": "no shared topic, no shared word 13-gram",
    },
    "checks": {"test_questions_in_training": 0, "retention_in_replay": 0, "replay_sharing_topic_with_retention": 0,
               "replay_sharing_13gram_with_retention": 0},
    "counts": {"train": 64, "tasks": 48, "replay": 16, "retention": 9, "test": 200},
}
INPUTS = "1e" * 32


def _prepare_run(cfg, manifest: dict | None = None) -> str:
    with writer.stage_run(schema.STAGE_PREPARE, cfg, tags={schema.TAG_INPUTS: INPUTS}) as rec:
        rec.log_dict(manifest or MANIFEST, schema.ART_MANIFEST)
    return rec.run_id


@pytest.mark.parametrize(("key", "said"), [("test", "final test: the models were scored on 200 items"), ("retention", "retention probes: the models were scored on 9 items")])
def test_tables_that_score_part_of_what_prepare_made_are_refused(tiny, key, said):
    # Before, tables cut short alike paired with each other: the screens judged a part of the set.
    make_study(tiny, prepared=False)
    made = _prepare_run(tiny, MANIFEST | {"counts": MANIFEST["counts"] | {key: MANIFEST["counts"][key] + 56}})
    with pytest.raises(RefusedError, match=f"{said}, but prepare run {made} made {MANIFEST['counts'][key] + 56}: the screens would judge a part"):
        records.load(tiny)


def make_study(
    cfg,
    *,
    plan: str | None = None,
    models: tuple[str, ...] = ("seed", "control", "compressed"),
    compressed_active: float = 40.0,
    compressed_shift: float = 0.002,
    prepared: bool = True,
    trained: tuple[str, ...] = ("control", "compressed"),
) -> dict[str, str]:
    """A complete study record: the prepare run (unless not `prepared`), the plan
    run (with `plan`), both train runs, select, evaluate with one child per model.

    200 test cases; seed right on 40, control and compressed on the same 120
    (+40 points, no discordant pairs); retention NLL barely moves; the
    compressed arm is 1.5x faster (by default) in active and 1.33x in complete time.
    """
    if prepared:
        _prepare_run(cfg)
    if plan:
        _plan_run(cfg, plan)
    seconds = {"control": (60.0, 80.0), "compressed": (compressed_active, 60.0)}
    ids = {f"train/{arm}": _train(cfg, arm, active=seconds[arm][0], complete=seconds[arm][1], plan=plan) for arm in trained}
    tags = {schema.TAG_CANDIDATE_PREFIX + arm: sha for arm, sha in CANDIDATE.items()}
    tags |= {schema.TAG_CANDIDATE_RUN_PREFIX + arm: ids[f"train/{arm}"] for arm in CANDIDATE}
    with writer.stage_run(schema.STAGE_SELECT, cfg, tags=tags | ({schema.TAG_PLAN: plan} if plan else {})) as rec:
        ids["select"] = rec.run_id
    outcomes = {
        "seed": [1.0] * 40 + [0.5] * 20 + [0.0] * 140,
        "control": [1.0] * 120 + [0.0] * 80,
        "compressed": [1.0] * 120 + [0.0] * 80,
    }
    shifts = {"seed": 0.0, "control": 0.001, "compressed": compressed_shift}
    plan_tags = {schema.TAG_PLAN: plan} if plan else {}
    with writer.stage_run(schema.STAGE_EVALUATE, cfg, tags=plan_tags):
        for model in models:
            weights = {schema.TAG_CHECKPOINT_SHA: CANDIDATE.get(model, SEED)}
            with writer.stage_run(schema.STAGE_EVALUATE, cfg, tags={schema.TAG_MODEL: model} | weights | plan_tags) as rec:
                rec.log_table(_case_rows(outcomes[model]), schema.ART_TEST_TABLE)
                rec.log_table(_retention_rows(shifts[model]), schema.ART_RETENTION_TABLE)
                rec.log_metrics({schema.M_ACCURACY: sum(s >= 1.0 for s in outcomes[model]) / 200})
                ids[f"evaluate/{model}"] = rec.run_id
    return ids


@pytest.fixture
def tiny():
    return config.load("tiny")


def _report(capsys, *args: str) -> tuple[int, str, str]:
    """The report step in this process (cheaper than a subprocess), as the CLI runs it."""
    rc = cli_main.main(["report", "--preset", "tiny", *args])
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


def _report_runs() -> list:
    return store.search_runs("coopstudy", f"tags.`{schema.TAG_STAGE}` = '{schema.STAGE_REPORT}'")


def _files(folder: Path) -> dict[Path, tuple[int, bytes]]:
    return {p.relative_to(folder): (p.stat().st_mtime_ns, p.read_bytes()) for p in folder.rglob("*") if p.is_file()}


def _interrupt_on(patched: pytest.MonkeyPatch, name: str, when: Callable[[Path], bool]) -> None:
    """Ctrl-C at the first call of report's `name` whose path `when` picks (its first argument)."""
    real = getattr(report_step, name)

    def interrupted(path: Path, *args):
        if when(path):
            os.kill(os.getpid(), signal.SIGINT)
        return real(path, *args)

    patched.setattr(report_step, name, interrupted)


def test_a_report_folder_removed_while_the_record_is_read_is_made_again(capsys, tiny, tmp_path):
    # Made, then the record read (minutes from a remote server) and the figures drawn: it was a traceback.
    import shutil

    make_study(tiny)
    out = tmp_path / "out"
    figures = rep.figures

    def removed_meanwhile(*args, **kwargs):
        shutil.rmtree(out)
        return figures(*args, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(rep, "figures", removed_meanwhile)
        rc, _, err = _report(capsys, "--out", str(out))
    assert rc == 0, err
    assert {schema.ART_REPORT_JSON, schema.ART_REPORT_MD, schema.ART_REPORT_HTML} <= {p.name for p in out.iterdir()}


@pytest.mark.parametrize("cut", ["full disk", "Ctrl-C"])
def test_a_report_cut_short_leaves_the_last_report_whole(capsys, tiny, tmp_path, request, cut):
    make_study(tiny)
    out = (request.getfixturevalue("small_disk") if cut == "full disk" else tmp_path) / "report"
    rc, _, err = _report(capsys, "--out", str(out))
    assert rc == 0, err
    (out / schema.ART_FIGURES / "mine.png").write_bytes(b"a figure of the user's own")
    last = _files(out)
    patched = pytest.MonkeyPatch()
    if cut == "full disk":
        # Room for the small files of a report again, not for its page of figures.
        room = sum(-(-(out / name).stat().st_size // 4096) for name in (schema.ART_REPORT_JSON, schema.ART_REPORT_MD)) + 1
        assert (out / schema.ART_REPORT_HTML).stat().st_size > (room + 2) * 4096
        fill_disk(out.parent, leave_pages=room)
        said = "coopstudy report: error: No space left on device"
    else:
        _interrupt_on(patched, "_write_synced", lambda path: path.suffix == ".png")  # as the figures are written
        said = "coopstudy report: interrupted"
    try:
        rc, _, err = _report(capsys, "--out", str(out))
    finally:
        patched.undo()
    assert rc == (2 if cut == "full disk" else 130) and said in err and "Traceback" not in err, err
    assert _files(out) == last
    assert sorted(p.name for p in out.iterdir()) == sorted({p.parts[0] for p in last})  # nothing half-written beside it
    (out.parent / "filler").unlink(missing_ok=True)
    rc, _, err = _report(capsys, "--out", str(out))
    assert rc == 0, err
    now = _files(out)
    assert now[Path(schema.ART_FIGURES, "mine.png")] == last[Path(schema.ART_FIGURES, "mine.png")]
    assert all(now[name][0] > mtime for name, (mtime, _) in last.items() if name.name not in (report_step.WRITING_LOCK, "mine.png"))


def test_a_stop_as_a_report_is_moved_in_waits_until_all_of_it_is(capsys, tiny, tmp_path):
    make_study(tiny)
    out = tmp_path / "report"
    rc, _, err = _report(capsys, "--out", str(out))
    assert rc == 0, err
    last = _files(out)
    with pytest.MonkeyPatch.context() as patched:
        _interrupt_on(patched, "_move", lambda path: path.name == schema.ART_REPORT_JSON)  # the first file moved in
        rc, _, err = _report(capsys, "--out", str(out))
    assert rc == 130 and "coopstudy report: interrupted" in err, err
    now = _files(out)
    assert now.keys() == last.keys() and not (out / report_step.WRITING).exists()
    assert all(now[name][0] > mtime for name, (mtime, _) in last.items() if name.name != report_step.WRITING_LOCK)


def test_a_second_report_into_a_folder_waits_for_the_first(tmp_path):
    import threading

    def second_report() -> None:
        with report_step._folder_held(tmp_path):
            report_step._write_whole(tmp_path, {schema.ART_REPORT_JSON: "{}"}, {"a.png": b"png"})

    with report_step._folder_held(tmp_path):  # as a report writing this folder holds it
        second = threading.Thread(target=second_report)
        second.start()
        second.join(timeout=1.0)
        assert second.is_alive() and not (tmp_path / report_step.WRITING).exists()
    second.join(timeout=10)
    assert not second.is_alive()
    assert (tmp_path / schema.ART_REPORT_JSON).read_text() == "{}" and (tmp_path / schema.ART_FIGURES / "a.png").read_bytes() == b"png"
    assert not (tmp_path / report_step.WRITING).exists()


def test_report_from_the_store_alone_is_deterministic(capsys, tiny, tmp_path):
    ids = make_study(tiny)
    rc, first_out, err = _report(capsys, "--out", str(tmp_path / "a"))
    assert rc == 0, err
    assert "Pre-registered screens" in first_out and "quality: PASS" in first_out

    report = json.loads((tmp_path / "a" / schema.ART_REPORT_JSON).read_text())
    assert report["verdicts"] == {"quality": "pass", "speed": "pass"}
    assert report["runs"] == dict(sorted(ids.items()))
    assert report["candidates"] == CANDIDATE
    assert report["study"]["grouped_by"] == "config"
    assert report["study"]["differs_from_preset"] == {}
    assert [(e["model"], e["scored"]) for e in report["evaluate_attempts"]] == [(m, True) for m in records.MODELS]
    assert report["study"]["key"] == store.config_sha256(tiny)
    by_name = {s["name"]: s for s in report["screens"]}
    assert by_name["accuracy_gain"]["estimate"] == pytest.approx(0.40)
    assert by_name["accuracy_gain"]["run_ids"] == {"evaluate/compressed": ids["evaluate/compressed"], "evaluate/seed": ids["evaluate/seed"]}
    assert by_name["noninferiority"]["estimate"] == 0.0
    assert by_name["active_speedup"]["estimate"] == pytest.approx(1.5)
    assert by_name["complete_speedup"]["estimate"] == pytest.approx(80 / 60)
    for s in report["screens"]:
        assert {"estimate", "bound", "interval", "threshold", "verdict", "method", "run_ids"} <= s.keys()
    assert report["resources"]["device_seconds_ratio"] == pytest.approx(120 / 80)
    assert report["resources"]["arms"]["compressed"]["others_cores"] == 0.5
    assert report["accuracy"]["seed"]["families"]["all"]["correct"] == 40  # partial credit is not correct

    # Rebuilt by a fresh process from the tracking store alone, as a user runs
    # it in the project, into another folder: the same bytes.
    second = subprocess.run(
        [sys.executable, "-m", "coopstudy", "report", "--preset", "tiny", "--out", str(tmp_path / "b")],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )
    assert second.returncode == 0, second.stderr
    assert (tmp_path / "a" / "report.json").read_bytes() == (tmp_path / "b" / "report.json").read_bytes()

    runs = _report_runs()
    assert len(runs) == 2 and all(r.info.status == "FINISHED" for r in runs)
    run = runs[0]
    assert run.data.tags[schema.TAG_VERDICT_PREFIX + "quality"] == "pass"
    assert run.data.tags[schema.TAG_VERDICT_PREFIX + "speed"] == "pass"
    assert run.data.metrics[f"{schema.M_SCREEN_PREFIX}active_speedup/estimate"] == pytest.approx(1.5)
    logged = store.download_artifact(run.info.run_id, schema.ART_REPORT_JSON, tmp_path / "dl")
    assert logged.read_bytes() == (tmp_path / "b" / "report.json").read_bytes()
    artifacts = {a.path for a in mlflow.MlflowClient().list_artifacts(run.info.run_id)}
    assert {schema.ART_REPORT_JSON, schema.ART_REPORT_MD, schema.ART_REPORT_HTML} <= artifacts

    # The cost figures sit beside; no dense-communication claim anywhere.
    md = (tmp_path / "a" / schema.ART_REPORT_MD).read_text()
    page = (tmp_path / "a" / schema.ART_REPORT_HTML).read_text()
    assert page.count("data:image/png;base64,") == 6
    # Each verdict names its screens by their rows' numbers in the table under it.
    numbered = {line.split(" | ")[1]: line.split(" | ")[0].strip("| ") for line in md.splitlines() if line.startswith("| ")}
    titles = {s["name"]: s["title"] for s in report["screens"]}
    assert "The quality verdict needs screens {}, {}, {}; the speed verdict needs screens {}, {}.".format(
        *(numbered[titles[name]] for name in ("accuracy_gain", "retention", "noninferiority", "active_speedup", "complete_speedup"))
    ) in md
    # Where the seconds went, per phase and arm: medians of the per-update metrics.
    dense, later = report["breakdown"]["dense"], report["breakdown"]["compressed"]
    assert dense["updates"] == [1, tiny.powersgd.dense_updates] and later["updates"][1] == tiny.train.updates
    steps = range(tiny.powersgd.dense_updates + 1, tiny.train.updates + 1)
    assert later["compressed"]["forward_backward_seconds"] == pytest.approx(statistics.median(0.5 + k for k in steps))
    assert later["compressed"]["comm_seconds"] == 0.4 and dense["compressed"]["comm_seconds"] == 0.2
    assert dense["control"]["comm_seconds"] == 0.0
    assert later["compressed"]["comm_arithmetic_seconds"] == 0.3 and dense["compressed"]["comm_arithmetic_seconds"] == 0.0
    assert later["control"]["system_seconds"] == 0.05 and later["compressed"]["system_seconds"] == 0.02
    # First touch over the whole window, rank 0's: the memory new to its process and the system seconds.
    later_updates = tiny.train.updates - 1
    assert report["training"]["control"]["new_memory_mb"] == 300.0
    assert report["training"]["compressed"]["new_memory_mb"] == pytest.approx(300.0 + 10.0 * later_updates)
    assert report["training"]["compressed"]["system_seconds"] == pytest.approx(2.0 + 0.02 * later_updates)
    assert report["training"]["compressed"]["ready_memory_low_mb"] == 5000.0 - 300.0 * tiny.train.updates
    assert report["training"]["control"]["ready_memory_low_mb"] == 6001.0
    assert "## Where an update's seconds went" in md and "| forward backward |" in md
    assert "Where an update's seconds went" in first_out
    text = re.sub(r"base64,[A-Za-z0-9+/=]+", "", page)
    for body in (md, text, json.dumps(report), first_out):
        assert not re.search(r"reduc|saving|saved|less communication", body, re.I)
    assert "device-seconds" in md and "bytes sent per worker (rank 0), dense phase" in md
    # Bytes as what they are: one worker's, and all workers' beside.
    compressed = report["resources"]["arms"]["compressed"]
    setup = compressed["bytes_setup"]
    assert setup > 0 and compressed["bytes_total_all_workers"] == 2 * (compressed["bytes_total"] - setup) + setup
    assert compressed["workers"] == 2
    assert "bytes sent, all workers, total" in md and "rank 0's collective payload" in md
    # What the per-worker total holds is in the table: the phases and the setup broadcast beside it.
    assert f"| bytes sent by rank 0, DDP's setup broadcast | 0 | {setup:,.0f} |" in md
    parts = ("bytes_dense", "bytes_compressed", "bytes_setup", "bytes_scalar_sums")
    assert sum(compressed[p] for p in parts) == compressed["bytes_total"] and compressed["bytes_scalar_sums"] >= 0
    # Each source, the counts and the overlap check are stated.
    assert report["inputs"]["split"] == MANIFEST["split"] and report["inputs"]["sha256"] == INPUTS
    assert "Replay: 16 conversations from chitchat (chitchat-dataset 0.9.0" in md
    assert "Retention probes: 8 conversations from chitchat, drawn from 4 held-out topics (What's your favorite smell?)" in md
    assert "shared ids" not in md and "replay documents sharing a word 13-gram 0; 2 replay candidates skipped for shared text" in md
    assert "identical conversations 0, shared topics 0, replay documents sharing a word 13-gram 0" in md
    assert "final test 200 cases, 0 of them in training" in md
    # Sensitivity beside every verdict; at 200 cases non-inferiority fails from 3 discordant cases each way.
    by_name = {s["name"]: s for s in report["screens"]}
    assert by_name["noninferiority"]["sensitivity"]["breakpoint_k"] == 3 and by_name["noninferiority"]["powered"] is True
    assert by_name["retention"]["sensitivity"]["margin"] == pytest.approx(by_name["retention"]["bound"] - by_name["retention"]["estimate"])
    assert "| sensitivity at this size | power | verdict |" in md
    assert "fails at 3 discordant each way (n=200; observed 0+0)" in md and "power" in first_out


def test_failed_screens_are_a_result_not_an_error(capsys, tiny, tmp_path):
    ids = make_study(tiny, compressed_active=58.0)
    # Later runs of the compressed arm, one FAILED and one FINISHED but never
    # selected, are evidence: the screens time the run whose weights were selected.
    _train(tiny, "compressed", active=10.0, complete=12.0, plan=None)
    with pytest.raises(RuntimeError):
        with writer.stage_run(schema.STAGE_TRAIN, tiny, arm="compressed") as rec:
            rec.log_metrics({schema.M_ACTIVE_SECONDS: 1.0, schema.M_COMPLETE_SECONDS: 1.0})
            raise RuntimeError("out of memory")
    rc, out, err = _report(capsys, "--out", str(tmp_path))
    assert rc == 0, err
    report = json.loads((tmp_path / "report.json").read_text())
    by_name = {s["name"]: s for s in report["screens"]}
    assert by_name["active_speedup"]["estimate"] == pytest.approx(60 / 58)
    assert by_name["active_speedup"]["verdict"] == "fail"
    assert by_name["active_speedup"]["run_ids"]["train/compressed"] == ids["train/compressed"]
    assert report["verdicts"] == {"quality": "pass", "speed": "fail"}
    assert "speed: FAIL" in out


def test_a_study_with_settings_of_its_own_says_which_beside_the_presets_name(capsys, tmp_path):
    # Before, a report titled "preset P" showed only a config sha: a microbatch or an update
    # count of the study's own (`--set`) was nowhere on it.
    changed = ["arms.control.microbatch=2", "train.lr=0.002", "data.families=[products, gcd, letter_counting, chain_sum]"]
    make_study(config.load("tiny", changed))
    rc, out, err = _report(capsys, "--out", str(tmp_path), *config.set_arguments(changed))
    assert rc == 0, err
    report = json.loads((tmp_path / "report.json").read_text())
    tiny = config.flatten(config.load("tiny"))
    assert report["study"]["differs_from_preset"] == {
        "arms.control.microbatch": {"preset": tiny["arms.control.microbatch"], "study": "2"},
        "train.lr": {"preset": tiny["train.lr"], "study": "0.002"},
        "data.families": {"preset": tiny["data.families"], "study": "[products, gcd, letter_counting, chain_sum]"},
    }
    said = (f"Settings that differ from preset tiny's file (--set): arms.control.microbatch {tiny['arms.control.microbatch']} -> 2; "
            f"data.families {tiny['data.families']} -> [products, gcd, letter_counting, chain_sum]; train.lr {tiny['train.lr']} -> 0.002.")
    md = (tmp_path / schema.ART_REPORT_MD).read_text()
    assert md.startswith("# Study report: preset tiny with 3 settings of its own, config sha ") and said in md
    assert html.escape(said) in (tmp_path / schema.ART_REPORT_HTML).read_text()
    assert said in " ".join(out.split())


def test_a_preset_given_as_a_file_is_compared_with_that_file(capsys, tmp_path):
    # Before, the report looked the preset's name up in configs/ and refused ("unknown preset").
    path = tmp_path / "mytiny.yaml"
    path.write_text((ROOT / "configs" / "tiny.yaml").read_text().replace("tasks_per_family: 12", "tasks_per_family: 10"))
    make_study(config.load(str(path)))
    rc = cli_main.main(["report", "--preset", str(path), "--out", str(tmp_path / "out")])
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert json.loads((tmp_path / "out" / "report.json").read_text())["study"]["differs_from_preset"] == {}
    assert "Every setting is preset mytiny's own. Every screen's threshold is the protocol's (STUDY.md)." in " ".join(out.split())


def test_a_preset_with_thresholds_of_its_own_says_which_beside_the_verdicts(capsys, tmp_path):
    # Before, a preset file that eased a screen said only "Every setting is preset P's own".
    path = tmp_path / "easy.yaml"
    path.write_text((ROOT / "configs" / "tiny.yaml").read_text() + "screens:\n  min_speedup: 1.0\n  retention_level: 0.9\n")
    make_study(config.load(str(path)))
    rc = cli_main.main(["report", "--preset", str(path), "--out", str(tmp_path / "out")])
    out, err = capsys.readouterr()
    assert rc == 0, err
    study = json.loads((tmp_path / "out" / "report.json").read_text())["study"]
    assert study["differs_from_preset"] == {}
    assert study["thresholds_off_protocol"] == {
        "screens.min_speedup": {"protocol": 1.1, "study": 1.0}, "screens.retention_level": {"protocol": 0.99, "study": 0.9},
    }
    said = ("Every setting is preset easy's own. Screen thresholds other than the protocol's, as the plan committed them: "
            "screens.min_speedup 1 (the protocol's 1.1); screens.retention_level 0.9 (the protocol's 0.99); the verdicts are judged by these.")
    assert said in " ".join(out.split()) and said in (tmp_path / "out" / schema.ART_REPORT_MD).read_text()


def test_missing_role_is_refused_by_name(capsys, tiny):
    make_study(tiny, models=("seed", "control"))
    rc, _, err = _report(capsys)
    assert rc == 2
    sha = store.config_sha256(tiny)
    assert "no FINISHED evaluate run for model compressed" in err
    assert f"config sha {sha}" in err
    assert len(err.strip().splitlines()) == 1
    # The refusal is on record as a FAILED report run.
    (run,) = _report_runs()
    assert run.info.status == "FAILED"


def test_plan_groups_the_study(tiny):
    ids = make_study(tiny, plan=PLAN)
    recs = records.load(tiny, PLAN)
    assert recs.key.kind == "plan" and recs.plan == PLAN
    assert recs.runs == ids
    assert set(recs.updates["arm"]) == {"control", "compressed"}
    assert len(recs.updates) == 2 * tiny.train.updates
    assert recs.train.set_index("arm").loc["compressed", "run_id"] == ids["train/compressed"]
    assert math.isclose(recs.train.set_index("arm").loc["control", "device_seconds"], 80.0)
    # Another plan: none on record, so none of its sources can be checked.
    with pytest.raises(RefusedError, match="plan cdcdcdcdcdcd: no FINISHED plan run in experiment 'coopstudy' holds it"):
        records.load(tiny, "cd" * 32)
    _plan_run(tiny, "cd" * 32)
    with pytest.raises(RefusedError, match="no FINISHED select run"):
        records.load(tiny, "cd" * 32)


def test_report_config_must_be_the_studys(tiny):
    # The thresholds come from the report's config: a changed one finds no
    # study under its own sha, and under the study's plan it is refused.
    make_study(tiny, plan=PLAN)
    other = config.load("tiny", ["screens.min_speedup=1.0"])
    with pytest.raises(RefusedError, match=f"config sha {store.config_sha256(other)}"):
        records.load(other)
    with pytest.raises(RefusedError, match=r"\(preset tiny\), this report's config is .* \(preset tiny\); call report with the study's preset"):
        records.load(other, PLAN)


@pytest.mark.parametrize("model, weights", [("compressed", "ee" * 32), ("seed", None)], ids=["other weights", "no weights named"])
def test_the_screens_read_an_evaluation_of_the_committed_weights_alone(tiny, model, weights):
    # Before, the newest finished evaluate run was read, and refused when it
    # scored other weights (or named none, which had passed as the committed ones).
    make_study(tiny, models=tuple(m for m in ("seed", "control", "compressed") if m != model))
    tags = {schema.TAG_MODEL: model} | ({schema.TAG_CHECKPOINT_SHA: weights} if weights else {})
    with writer.stage_run(schema.STAGE_EVALUATE, tiny, tags=tags) as rec:
        other = rec.run_id
    committed = CANDIDATE.get(model, SEED)
    with pytest.raises(RefusedError, match=f"no FINISHED evaluate run for model {model} of its committed weights {committed[:12]}; run those steps first"):
        records.load(tiny)
    # One that scored them, though newer, is the one read; the other is listed, not read.
    with writer.stage_run(schema.STAGE_EVALUATE, tiny, tags={schema.TAG_MODEL: model, schema.TAG_CHECKPOINT_SHA: committed}) as rec:
        rec.log_table(_case_rows([1.0] * 120 + [0.0] * 80), schema.ART_TEST_TABLE)
        rec.log_table(_retention_rows(0.0), schema.ART_RETENTION_TABLE)
        scored = rec.run_id
    rec_ = records.load(tiny)
    assert rec_.runs[f"evaluate/{model}"] == scored
    listed = rec_.evaluations.set_index("run_id")
    assert not listed.loc[other, "scored"] and listed.loc[scored, "scored"]


def _newer_select(cfg, ids: dict[str, str], **changed: str | None) -> None:
    """A select run made after the study's, its tags those of make_study's changed as given (None drops one)."""
    tags = {schema.TAG_CANDIDATE_PREFIX + arm: sha for arm, sha in CANDIDATE.items()}
    tags |= {schema.TAG_CANDIDATE_RUN_PREFIX + arm: ids[f"train/{arm}"] for arm in CANDIDATE}
    for tag, value in changed.items():
        tags.pop(tag) if value is None else tags.update({tag: value})
    with writer.stage_run(schema.STAGE_SELECT, cfg, tags=tags):
        pass


def test_the_timed_train_runs_are_the_ones_select_committed(tiny):
    # Before, a select run without the tag had the newest train run of the arm
    # timed, whatever weights it left; and a train run's weights were never
    # compared with the ones select committed.
    ids = make_study(tiny)
    _newer_select(tiny, ids, **{schema.TAG_CANDIDATE_RUN_PREFIX + "control": None})
    with pytest.raises(RefusedError, match=r"select run \w+ names no train run for arm control \(no coopstudy.candidate_run.control tag\): the record disagrees with the selection"):
        records.load(tiny)
    # Before, the arms swapped, weights and all, were taken: each speed screen inverted.
    swapped = {schema.TAG_CANDIDATE_RUN_PREFIX + "control": ids["train/compressed"], schema.TAG_CANDIDATE_RUN_PREFIX + "compressed": ids["train/control"]}
    _newer_select(tiny, ids, **swapped, **{schema.TAG_CANDIDATE_PREFIX + arm: CANDIDATE[other] for arm, other in zip(ARMS, ARMS[::-1])})
    with pytest.raises(RefusedError, match=f"the select run names run {ids['train/compressed']} for arm control, but it is a train run of arm compressed: "):
        records.load(tiny)
    with writer.stage_run(schema.STAGE_TRAIN, tiny, arm="compressed", tags={schema.TAG_CHECKPOINT_SHA: "c9" * 32}) as rec:
        pass
    _newer_select(tiny, ids, **{schema.TAG_CANDIDATE_RUN_PREFIX + "compressed": rec.run_id})
    with pytest.raises(RefusedError, match=f"train run {rec.run_id} of arm compressed left weights c9c9c9c9c9c9, but select run \\w+ committed "):
        records.load(tiny)


def test_train_runs_from_two_seeds_are_refused(tiny):
    # Before, the seed's evaluate run was then not checked against any seed.
    ids = make_study(tiny)
    tags = {schema.TAG_CHECKPOINT_SHA: CANDIDATE["compressed"], schema.TAG_SEED_SHA: "5f" * 32}
    with writer.stage_run(schema.STAGE_TRAIN, tiny, arm="compressed", tags=tags) as rec:
        other = rec.run_id
    _newer_select(tiny, ids, **{schema.TAG_CANDIDATE_RUN_PREFIX + "compressed": other})
    with pytest.raises(RefusedError, match=f"did not start from one recorded seed \\({ids['train/control']} 5e5e5e5e5e5e, {other} 5f5f5f5f5f5f\\)"):
        records.load(tiny)


@pytest.mark.parametrize("score", [None, float("nan"), 1.5, "right"])
def test_a_case_without_a_score_in_0_1_is_refused_not_counted_wrong(tiny, score):
    # Before, NaN >= 1.0 read as wrong: a verifier that failed on the seed's answers made the arms' gain.
    make_study(tiny, models=("control", "compressed"))
    rows = _case_rows([1.0] * 40 + [0.0] * 160)
    rows[7] |= {"score": score, "correct": False}
    with writer.stage_run(schema.STAGE_EVALUATE, tiny, tags={schema.TAG_MODEL: "seed", schema.TAG_CHECKPOINT_SHA: SEED}) as rec:
        rec.log_table(rows, schema.ART_TEST_TABLE)
        rec.log_table(_retention_rows(0.0), schema.ART_RETENTION_TABLE)
    with pytest.raises(
        RefusedError,
        match=f"evaluate \\(model seed\\) run {rec.run_id}: 1 case\\(s\\) have no score in \\[0, 1\\] \\(first: case-0007, family \\w+, "
        "score .*\\): a verifier failed; mend it, then run the study under a new plan",
    ):
        records.load(tiny)


def test_every_train_attempt_under_the_study_is_reported_beside_the_timed_one(capsys, tiny, tmp_path):
    # Before, a compressed arm trained again until it was fast enough showed
    # only the run select took: the slower and failed attempts were nowhere.
    ids = make_study(tiny)
    faster = _train(tiny, "compressed", active=20.0, complete=30.0, plan=None)
    with pytest.raises(RuntimeError), writer.stage_run(schema.STAGE_TRAIN, tiny, arm="compressed"):
        raise RuntimeError("rank 1 died")
    # A refusal trains nothing: listed, and counted apart from the runs that trained.
    with pytest.raises(RefusedError), writer.stage_run(schema.STAGE_TRAIN, tiny, arm="control"):
        raise RefusedError("arm control finished under plan P: an arm trains once per plan")
    rc, out, err = _report(capsys, "--out", str(tmp_path))
    assert rc == 0, err
    report = json.loads((tmp_path / schema.ART_REPORT_JSON).read_text())
    attempts = [(a["arm"], a["run_id"] == ids[f"train/{a['arm']}"], a["status"], a["active_seconds"], a["timed"]) for a in report["train_attempts"]]
    assert attempts == [
        ("control", True, "FINISHED", 60.0, True),
        ("compressed", True, "FINISHED", 40.0, True),
        ("compressed", False, "FINISHED", 20.0, False),
        ("compressed", False, "FAILED", None, False),
        ("control", False, "FAILED", None, False),
    ]
    assert [a["refused"] for a in report["train_attempts"]] == [False, False, False, False, True]
    assert faster in [a["run_id"] for a in report["train_attempts"]]
    # The screens still time the run select took.
    assert sc.ACTIVE_SPEEDUP in {s["name"] for s in report["screens"] if ids["train/compressed"] in s["run_ids"].values()}
    said = (
        "Train runs under this study: control 1, compressed 3. The speed screens time only the run select took; "
        "every other attempt, finished or not, is listed here as evidence. Refused before training (counted apart): "
        "control 1. The timed runs kept the protocol's order: control, then compressed."
    )
    assert said in " ".join(out.split())
    md = (tmp_path / "report.md").read_text()
    started = next(a["started"] for a in report["train_attempts"] if a["run_id"] == faster)
    assert said in md and f"| compressed | {faster} | FINISHED | {started[:10]} {started[11:19]} | 20.0 | 30.0 |  |" in md
    refused = report["train_attempts"][-1]
    assert f"| control | {refused['run_id']} | FAILED (refused) | {refused['started'][:10]} {refused['started'][11:19]} | n/a | n/a |  |" in md


@pytest.mark.parametrize(
    ("trained", "said"),
    [
        (("control", "compressed"), "Each arm trained once under this study; the speed screens time those runs. "
         "The timed runs kept the protocol's order: control, then compressed."),
        (("compressed", "control"), "The timed runs trained out of the protocol's order: compressed before control."),
    ],
)  # fmt: skip
def test_the_report_says_whether_the_arms_trained_in_the_protocols_order(capsys, tiny, tmp_path, trained, said):
    # Before, nothing said which arm trained first: the protocol trains the control, then the compressed arm.
    make_study(tiny, trained=trained)
    rc, out, err = _report(capsys, "--out", str(tmp_path))
    assert rc == 0, err
    assert said in " ".join(out.split()) and said in (tmp_path / "report.md").read_text()


def test_the_report_says_when_the_timed_runs_overlapped(capsys, tiny, tmp_path):
    ids = make_study(tiny)
    client = mlflow.MlflowClient()
    # The control ended a second after the compressed arm began: two training jobs at once.
    begun = client.get_run(ids["train/compressed"]).info.start_time
    client.set_terminated(ids["train/control"], "FINISHED", end_time=begun + 1000)
    rc, out, err = _report(capsys, "--out", str(tmp_path))
    assert rc == 0, err
    assert "The timed runs overlapped: compressed started before control ended." in " ".join(out.split())


def test_every_evaluate_run_is_reported_and_runs_of_the_same_weights_that_disagree_are_said(capsys, tiny, tmp_path):
    # Before, the newest finished evaluate run of each model was read and every other was nowhere:
    # weights evaluated again until the screens passed showed one run, and scoring that does not repeat went unseen.
    # The first finished run is read, as each arm's first finished training is its candidate.
    ids = make_study(tiny)
    tags = {schema.TAG_MODEL: "compressed", schema.TAG_CHECKPOINT_SHA: CANDIDATE["compressed"]}
    with writer.stage_run(schema.STAGE_EVALUATE, tiny, tags=tags) as rec:
        rec.log_table(_case_rows([1.0] * 122 + [0.0] * 78), schema.ART_TEST_TABLE)
        rec.log_table(_retention_rows(0.002), schema.ART_RETENTION_TABLE)
        rec.log_metrics({schema.M_ACCURACY: 0.61})
    again = rec.run_id
    with pytest.raises(RuntimeError), writer.stage_run(schema.STAGE_EVALUATE, tiny, tags=tags):
        raise RuntimeError("out of memory")
    rc, out, err = _report(capsys, "--out", str(tmp_path))
    assert rc == 0, err
    report = json.loads((tmp_path / schema.ART_REPORT_JSON).read_text())
    rows = [(e["model"], e["run_id"] in (ids[f"evaluate/{e['model']}"], again), e["status"], e["accuracy"], e["scored"]) for e in report["evaluate_attempts"]]
    assert rows == [
        ("seed", True, "FINISHED", 0.2, True),
        ("control", True, "FINISHED", 0.6, True),
        ("compressed", True, "FINISHED", 0.6, True),
        ("compressed", True, "FINISHED", 0.61, False),
        ("compressed", False, "FAILED", None, False),
    ]
    assert report["runs"]["evaluate/compressed"] == ids["evaluate/compressed"] != again
    said = ("Evaluate runs under this study: seed 1, control 1, compressed 3. The screens read only the first finished run of "
            "each model's committed weights; every other is listed here. Finished evaluate runs of the same weights disagree "
            "on accuracy (compressed weights c1c1c1c1c1c1: 0.600, 0.610): scoring is not repeatable.")  # fmt: skip
    assert said in " ".join(out.split())
    md = (tmp_path / "report.md").read_text()
    assert said in md and f"| compressed | {again} | FINISHED | c1c1c1c1c1c1 | 0.610 |  |" in md
    assert f"| compressed | {ids['evaluate/compressed']} | FINISHED | c1c1c1c1c1c1 | 0.600 | yes |" in md
    assert html.escape(said) in (tmp_path / schema.ART_REPORT_HTML).read_text()


def test_the_report_sets_what_the_study_spent_against_the_plans_allocation(capsys, tiny, tmp_path):
    # Before, the report showed each timed run's cost alone: not the probes, the other attempts, nor the allocation.
    make_study(tiny, plan=PLAN)
    with pytest.raises(RuntimeError), writer.stage_run(schema.STAGE_TRAIN, tiny, arm="compressed", tags={schema.TAG_PLAN: PLAN}) as rec:
        rec.log_metrics({schema.M_COST_USD: 0.02})
        raise RuntimeError("rank 1 died")
    # A refusal spent nothing, and an evaluate run held the device for a minute.
    with pytest.raises(RefusedError), writer.stage_run(schema.STAGE_TRAIN, tiny, arm="control", tags={schema.TAG_PLAN: PLAN}):
        raise RefusedError("arm control finished under plan P")
    with writer.stage_run(schema.STAGE_EVALUATE, tiny, tags={schema.TAG_PLAN: PLAN}) as rec:
        rec.log_metrics({schema.M_COST_USD: 0.06})
    rc, out, err = _report(capsys, "--plan", PLAN, "--out", str(tmp_path))
    assert rc == 0, err
    report = json.loads((tmp_path / schema.ART_REPORT_JSON).read_text())
    # Probes 0.05; control 1 x 80 s and compressed 2 x 60 s at 1/1000 each; the failed run 0.02; evaluate 0.06.
    planned = {k: v for k, v in PLANNED_BUDGET.items() if k != "projected_seconds"}
    assert report["budget"] == planned | {
        "train_cost_usd": pytest.approx(0.22), "train_runs": 3, "evaluate_cost_usd": 0.06, "evaluate_runs": 1,
        "spent_usd": pytest.approx(0.33),
    }  # fmt: skip
    said = (
        "Budget: spent $0.33 of the plan's allocation $100.00, no deadline, at $3.60 per device-hour: probes $0.05, "
        "3 train and 1 evaluate run(s) that logged a cost $0.22 and $0.06. "
        "The plan projected $0.30 for the probes and one run of each arm."
    )
    assert said in " ".join(out.split()) and said in (tmp_path / "report.md").read_text()
    # Past the allocation, the line says by how much.
    with writer.stage_run(schema.STAGE_EVALUATE, tiny, tags={schema.TAG_PLAN: PLAN}) as rec:
        rec.log_metrics({schema.M_COST_USD: 100.0})
    rc, out, err = _report(capsys, "--plan", PLAN, "--out", str(tmp_path / "over"))
    assert rc == 0, err
    assert "Budget: spent $100.33 of the plan's allocation $100.00 (over by $0.33), no deadline," in " ".join(out.split())
    make_study(tiny)
    rc, out, err = _report(capsys, "--out", str(tmp_path / "no-plan"))
    assert rc == 0, err
    assert "Budget: no plan in this study's record" in out


def test_train_runs_of_another_plan_are_not_this_studys_attempts_but_are_named(capsys, tiny, tmp_path):
    # Before, a study that trained again under a new plan (a comment edited in a
    # bound source is enough) showed nothing of the plan before it: its slower
    # runs and what they spent were nowhere in the report.
    ids = make_study(tiny, plan=PLAN)
    rc, out, _ = _report(capsys, "--out", str(tmp_path / "alone"))
    assert rc == 0 and "No other study of preset tiny trained an arm in this experiment." in " ".join(out.split())
    other = _train(tiny, "compressed", active=10.0, complete=20.0, plan="cd" * 32)
    with pytest.raises(RuntimeError), writer.stage_run(schema.STAGE_TRAIN, tiny, arm="control", tags={schema.TAG_PLAN: "ef" * 32}):
        raise RuntimeError("rank 0 died")
    # Refusals trained nothing: one under another plan, one before any plan was read (this study's config).
    with pytest.raises(RefusedError), writer.stage_run(schema.STAGE_TRAIN, tiny, arm="control", tags={schema.TAG_PLAN: "ef" * 32}):
        raise RefusedError("arm control finished under plan efefefefefef: an arm trains once per plan")
    with pytest.raises(UserError), writer.stage_run(schema.STAGE_TRAIN, tiny, arm="control"):
        raise UserError("the device is held by another job")
    recs = records.load(tiny)
    assert recs.plan == PLAN and other not in set(recs.attempts["run_id"])
    assert sorted(recs.attempts["run_id"]) == sorted([ids["train/control"], ids["train/compressed"]])
    assert list(recs.elsewhere["arm"]) == ["compressed", "control"] and recs.elsewhere["run_id"].iloc[0] == other
    assert list(recs.elsewhere["study"]) == ["cd" * 32, "ef" * 32] and list(recs.elsewhere["status"]) == ["FINISHED", "FAILED"]
    rc, out, err = _report(capsys, "--out", str(tmp_path / "beside"))
    assert rc == 0, err
    said = (
        "Outside this study, 2 other studies of preset tiny trained 2 runs (control 1, compressed 1; 1 finished), "
        "spending $0.04: not timed here, listed in report.json (train_runs_elsewhere)."
    )
    assert said in " ".join(out.split())
    report = json.loads(next((tmp_path / "beside").rglob(schema.ART_REPORT_JSON)).read_text())
    assert [r["run_id"] for r in report["train_runs_elsewhere"]][0] == other
    assert said in next((tmp_path / "beside").rglob("report.md")).read_text()


def test_plan_argument_must_be_a_sha(tiny):
    with pytest.raises(UserError, match="--plan"):
        records.study_key(tiny, "x' or 1=1")


def test_plan_argument_takes_the_twelve_digits_every_step_prints(tiny):
    make_study(tiny, plan=PLAN)
    assert records.study_key(tiny, PLAN[:12].upper()).value == PLAN
    with pytest.raises(UserError, match=r"--plan 0123456789ab: no plan begins with it in the record of experiment 'coopstudy'; check the digits"):
        records.study_key(tiny, "0123456789ab")
    with pytest.raises(UserError, match=r"expected the plan's sha256 \(64 hex digits, or the first 12 or more\)"):
        records.study_key(tiny, PLAN[:11])
    # Two plans that share the digits given: more are asked for.
    _plan_run(tiny, PLAN[:12] + "f" * 52)
    with pytest.raises(UserError, match=f"--plan {PLAN[:12]}: 2 plans .* begin with it in the record of experiment 'coopstudy'; give more digits"):
        records.study_key(tiny, PLAN[:12])


def _at_threshold(name: str, unit: str, value: float, threshold: float, comparison: str, details: dict) -> dict:
    bound = value if name == sc.RETENTION else None
    return sc.Screen(name=name, title=name, unit=unit, estimate=value, threshold=threshold, comparison=comparison,
                     decided_on="upper bound" if bound is not None else "estimate", passed=sc.decide(value, comparison, threshold),
                     method="", run_ids={}, bound=bound, details=details).to_dict()  # fmt: skip


def test_a_figure_at_its_threshold_is_printed_as_it_stands_to_it():
    # Before, 102 of 1,024 cases printed "+10.0 pts" under "estimate >= +10.0 pts" and FAIL;
    # a speedup of 1.0996 "1.100x" and FAIL; an upper bound of 0.019996 "+0.0200 nats" under "< +0.0200" and PASS.
    tango = {"tango_lower_clears_threshold": False, "newcombe_interval": [0.07, 0.13]}
    secs = {"control_seconds": 10.996, "compressed_seconds": 10.0}
    nll = {"token_weighted_estimate": 0.01, "token_weighted_se": 0.001, "token_weighted_upper": 0.012}
    screens = [
        _at_threshold(sc.ACCURACY_GAIN, sc.POINTS, 102 / 1024, 0.10, ">=", tango),
        _at_threshold(sc.ACTIVE_SPEEDUP, sc.RATIO, 1.0996, 1.10, ">=", secs),
        _at_threshold(sc.RETENTION, sc.NATS, 0.019996, 0.02, "<", nll),
        _at_threshold(sc.ACCURACY_GAIN, sc.POINTS, 0.125, 0.10, ">=", tango),
    ]
    _, rows = rep.screen_rows({"screens": screens})
    shown = [(row[2], row[4], row[-1]) for row in rows]
    assert shown == [
        ("+9.96 pts", "estimate >= +10.00 pts", "FAIL"),
        ("1.0996x", "estimate >= 1.1000x", "FAIL"),
        ("+0.019996 nats", "upper bound < +0.020000 nats", "PASS"),
        ("+12.5 pts", "estimate >= +10.0 pts", "PASS"),  # far from it: the usual digits
    ]
    assert "paired t upper bound +0.019996 nats" in rows[2][3]


def test_a_pass_without_power_reads_as_such(capsys, tiny, tmp_path):
    # The compressed model's retention NLL falls by about 1.1 nats, spread
    # widely over 8 documents: the bound passes, but sits further above the
    # mean than the +0.02 allowed, so only a falling mean could have passed.
    make_study(tiny, compressed_shift=-1.0)
    rc, out, err = _report(capsys, "--out", str(tmp_path))
    assert rc == 0, err
    report = json.loads((tmp_path / "report.json").read_text())
    for s in report["screens"]:
        assert s["sensitivity"]["note"]
        assert s["unpowered_pass"] == (s["verdict"] == "pass" and s["powered"] is False)
        assert s["verdict_reads"] == (f"PASS (no power: {s['power_note']})" if s["unpowered_pass"] else s["verdict"].upper())
    unpowered = [s["name"] for s in report["screens"] if s["unpowered_pass"]]
    assert unpowered == [sc.RETENTION], unpowered
    retention = next(s for s in report["screens"] if s["name"] == sc.RETENTION)
    assert retention["verdict_reads"].startswith("PASS (no power: the bound sits ")
    said = f"Screen 2 ({retention['title']}) passed without power: {retention['power_note']}."
    md, page = (tmp_path / "report.md").read_text(), (tmp_path / "report.html").read_text()
    assert said in md and html.escape(said) in page
    row = next(line for line in md.splitlines() if line.startswith("| 2 |"))
    assert row.endswith(f"| no: {retention['power_note']} | PASS |")


def test_no_prepare_run_on_record_is_said(capsys, tiny, tmp_path):
    make_study(tiny, prepared=False)
    rc, _, err = _report(capsys, "--out", str(tmp_path))
    assert rc == 0, err
    assert json.loads((tmp_path / "report.json").read_text())["inputs"] is None
    assert "The record holds no prepare run with the manifest of these inputs" in (tmp_path / "report.md").read_text()


def test_report_refuses_when_a_source_the_plan_binds_changed(capsys, tiny):
    make_study(tiny, plan=PLAN)
    _, now = sources.deciding_sources_sha256()
    # The plan bound another analysis/screens.py than the one here now.
    _plan_run(tiny, PLAN, now | {"analysis/screens.py": "00" * 32})
    rc, _, err = _report(capsys, "--plan", PLAN)
    assert rc == 2
    (line,) = err.strip().splitlines()
    assert f"changed since the plan {PLAN[:12]} was committed: source analysis/screens.py (changed)" in line
    # Without --plan the runs name the plan, and the same check holds.
    rc, _, err = _report(capsys)
    assert rc == 2 and "source analysis/screens.py (changed)" in err


def test_the_report_runs_description_is_whole_sections_up_to_mlflows_limit():
    from coopstudy.steps import report as step

    tail = f"in {schema.ART_REPORT_MD} among this run's artifacts, {step.NOTE_CUT})"
    whole = "# T\n\n## A\n\n" + "a" * (step.NOTE_LIMIT - len("# T\n\n## A\n\n"))
    assert len(whole) == step.NOTE_LIMIT and step._note(whole) == whole
    # The longest head of whole sections that fits, and the names of the rest.
    md = "# T\n\n## A\n\n" + "a" * 5000 + "\n\n## B\n\n" + "b" * 2500 + "\n\n## C\n\nc\n\n## D\n\n" + "d" * 3000
    note = step._note(md)
    assert note == md[: md.index("\n\n## D")] + f"\n\n... (D: {tail}" and len(note) <= step.NOTE_LIMIT
    longer = md.replace("## C\n\nc", "## C\n\n" + "c" * 400)
    assert step._note(longer) == md[: md.index("\n\n## C")] + f"\n\n... (C; D: {tail}"
    # No section fits whole: cut between paragraphs, never inside one.
    note = step._note("# T\n\n## A\n\n" + "p" * 3000 + "\n\n" + "q" * 6000)
    assert note == "# T\n\n## A\n\n" + "p" * 3000 + f"\n\n... (the rest is {tail}"
