"""plan and what train requires of it, through the real CLI on tiny: the plan
hashes every commitment; train runs under it, tagged; train refuses without
it, after a source file, an input file or a probe receipt changes (naming
it), and when the projection would pass the allocation or the deadline.

The module shares one store: a copy of the probed tiny store with the plan
of the preset committed once. Tests that change a file put it back.
"""

from __future__ import annotations

import json
import shutil
from datetime import datetime, timedelta, timezone
from pathlib import Path

import mlflow
import pytest
from fixtures import ROOT, fake_train_run, module_store, run_cli

from coopstudy import config, workspace
from coopstudy.commit import budget, candidates, ledger, plan, receipts, require, sources
from coopstudy.errors import ConfigError, RefusedError
from coopstudy.inputs import data
from coopstudy.record import schema, store, writer

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module", autouse=True)
def isolated_store(tmp_path_factory, probed_tiny_store):
    # Overrides conftest's per-test store: this module's tests share one.
    with module_store(tmp_path_factory, probed_tiny_store, "plan-store") as shared:
        yield shared


@pytest.fixture(scope="module")
def planned() -> tuple[str, dict, object]:
    done = run_cli("plan", "--preset", "tiny")
    assert done.returncode == 0, done.stderr[-3000:]
    entry = ledger.Ledger().latest(ledger.PLAN, plan.subject(config.load("tiny")))
    return entry.digest, json.loads((workspace.home() / entry.details["file"]).read_text()), done


def _runs(filter_string: str) -> list:
    client = mlflow.MlflowClient()
    return client.search_runs([client.get_experiment_by_name("coopstudy").experiment_id], filter_string)


TRAIN_RUNS = f"tags.`{schema.TAG_STAGE}` = '{schema.STAGE_TRAIN}'"


def _train_run_ids() -> set[str]:
    """The train runs so far: the module's tests share one store."""
    return {r.info.run_id for r in _runs(TRAIN_RUNS)}


def _receipt(name: str) -> dict:
    return json.loads((receipts.probe_dir(config.load("tiny")) / name).read_text())


def test_the_plan_hashes_every_commitment_and_is_committed_once(planned, tmp_path):
    sha, doc, done = planned
    cfg = config.load("tiny")
    book = ledger.Ledger().entries()
    (gate_entry,) = [e for e in book if e.kind == ledger.GATE]
    (inputs_entry,) = [e for e in book if e.kind == ledger.INPUTS and e.subject == data.inputs_key(cfg)]
    # Every source that decides a number is bound, the gate's numerical sources among them.
    assert doc["sources"]["files"] == sources.deciding_sources_sha256()[1]
    assert {f"src/coopstudy/{name}": sha for name, sha in gate_entry.details["sources"].items()}.items() <= doc["sources"]["files"].items()
    assert {"src/coopstudy/run/worker.py", "src/coopstudy/inputs/data.py", "src/coopstudy/scoring.py", "analysis/screens.py"} <= set(doc["sources"]["files"])
    assert doc["gate_receipt"] == gate_entry.digest
    assert doc["inputs"]["sha256"] == inputs_entry.digest
    folder = receipts.probe_dir(cfg)
    assert doc["probe_receipts"] == {p.name: workspace.sha256_file(p) for p in folder.glob("*.json")}
    assert len(doc["probe_receipts"]) == len(cfg.probe.candidates)
    assert doc["config"] == cfg.model_dump(mode="json") and doc["screens"]["min_speedup"] == 1.10
    assert "paired t" in doc["methods"]["retention"]
    # Each arm: the preset's microbatch, the protocol's allocator, and the
    # projection from the probe receipt that stands for it.
    control = doc["arms"]["control"]
    assert (control["microbatch"], control["allocator"], control["receipt"]) == (4, "expandable", "control-mb4-default.json")
    receipt = _receipt("control-mb4-default.json")
    overhead = receipt["complete_seconds"] - sum(receipt["update_seconds"])
    assert control["projection"]["seconds"] == pytest.approx(overhead + receipt["median_update_seconds"] * cfg.train.updates)
    assert doc["arms"]["compressed"]["projection"]["devices"] == 2
    assert doc["choice"]["compressed"]["default"]["largest_completed_microbatch"] == 3
    # Shown, on record, and committed once.
    assert "plan: each arm's setting and projection" in done.stdout and f"plan {sha} committed" in done.stdout
    # The table's allocator and receipt differ; a line says why that stands (CPU).
    assert ("note: control runs with the expandable allocator; its receipt control-mb4-default.json stands for it: "
            "on CPU the allocator setting changes nothing (it configures CUDA's allocator only)") in done.stdout.splitlines()  # fmt: skip
    # Off a terminal no line is broken: the plan's path stays whole.
    (entry,) = [e for e in ledger.Ledger().entries() if e.kind == ledger.PLAN and e.digest == sha]
    assert f"plan {sha} committed (ledger entry {entry.seq}): {plan.file(entry)}" in done.stdout.splitlines()
    (run,) = _runs(f"attributes.run_name = 'plan-tiny' and tags.`{schema.TAG_PLAN}` = '{sha}'")
    assert json.loads(store.download_artifact(run.info.run_id, schema.ART_PLAN, tmp_path).read_text()) == doc
    written = plan.file(entry).stat()
    again = run_cli("plan", "--preset", "tiny")
    assert again.returncode == 0 and f"plan {sha} unchanged, already committed" in again.stdout
    # Not written again: a write cut short there would spoil a committed plan.
    assert plan.file(entry).stat().st_mtime_ns == written.st_mtime_ns
    assert [e.digest for e in ledger.Ledger().entries() if e.kind == ledger.PLAN and e.subject == plan.subject(cfg)] == [sha]


def test_a_committed_file_whose_rewrite_is_cut_short_stays_as_it_was(planned, monkeypatch):
    import os

    path = plan.file(ledger.Ledger().latest(ledger.PLAN, plan.subject(config.load("tiny"))))
    before = path.read_bytes()

    def no_space(fd):
        raise OSError(28, "No space left on device")

    with monkeypatch.context() as mp:
        mp.setattr(os, "fsync", no_space)
        with pytest.raises(OSError, match="No space left"):
            workspace.write_text(path, "{}")
    assert path.read_bytes() == before
    assert sorted(p.name for p in path.parent.iterdir() if p.name.startswith(".")) == []
    # A probe receipt written again (a candidate probed again) the same way.
    cfg = config.load("tiny")
    (kept, *_) = sorted(receipts.probe_dir(cfg).glob("*.json"))
    before, entries = kept.read_bytes(), len(ledger.Ledger().entries())
    again = json.loads(before) | {"run_id": "f" * 32}
    with writer.stage_run(schema.STAGE_PROBE, cfg, log_config=False) as rec, monkeypatch.context() as mp:
        mp.setattr(os, "fsync", no_space)
        with pytest.raises(OSError, match="No space left"):
            receipts.keep_receipt(cfg, again, rec)
    assert kept.read_bytes() == before and len(ledger.Ledger().entries()) == entries
    assert sorted(p.name for p in kept.parent.iterdir() if p.name.startswith(".")) == []


def test_a_plan_file_gone_or_edited_after_the_first_check_is_refused_when_read_again(planned):
    # `train --arm both` reads the plan again before its second arm, hours after its first check: it was a traceback.
    sha, doc, _ = planned
    cfg = config.load("tiny")
    path = plan.file(ledger.Ledger().latest(ledger.PLAN, plan.subject(cfg)))
    before = path.read_bytes()
    try:
        path.unlink()
        with pytest.raises(RefusedError, match=f"the committed plan {sha[:12]} is missing from {path}"):
            plan.document(cfg, sha)
        path.write_text("{}")
        with pytest.raises(RefusedError, match=f"the plan file {path} was edited after it was committed"):
            plan.document(cfg, sha)
    finally:
        path.write_bytes(before)
    assert plan.document(cfg, sha) == doc


def test_train_refuses_without_a_plan():
    # A different config is a different plan: none is committed for it.
    done = run_cli("train", "--preset", "tiny", "--arm", "control", "--set", "budget.allocation_usd=99")
    assert done.returncode == 2
    # The hint's command is of this config: its overrides included.
    assert "no plan commitment" in done.stderr and "`python -m coopstudy plan --preset tiny --set budget.allocation_usd=99` first" in done.stderr


def _edit(path: Path) -> bytes:
    original = path.read_bytes()
    path.write_bytes(original + b"\n")
    return original


@pytest.mark.parametrize("what", ["receipt", "input"])
def test_train_refuses_after_a_hashed_file_changes_naming_it(planned, what):
    cfg = config.load("tiny")
    if what == "receipt":
        path = receipts.probe_dir(cfg) / "control-mb4-default.json"
        named = f"changed since the plan {planned[0][:12]} was committed: probe receipt control-mb4-default.json (changed)"
    else:
        path = require.inputs(cfg).folder / "train.jsonl"
        named = f"prepared inputs {path.parent}: train.jsonl changed since it was committed"
    original = _edit(path)
    try:
        done = run_cli("train", "--preset", "tiny", "--arm", "control")
    finally:
        path.write_bytes(original)
    assert done.returncode == 2
    assert named in done.stderr, done.stderr
    failed = _runs("attributes.run_name = 'train-control-tiny'")[0]
    assert failed.info.status == "FAILED" and named in failed.data.tags[schema.TAG_ERROR]


def test_train_refuses_after_a_numerical_source_changes_naming_it(planned, tmp_path):
    # The checkout as a user would have it after editing update.py.
    project = tmp_path / "checkout"
    shutil.copytree(ROOT / "src" / "coopstudy", project / "src" / "coopstudy", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(ROOT / "configs", project / "configs")
    _edit(project / "src" / "coopstudy" / "numerics" / "update.py")
    done = run_cli("train", "--preset", "tiny", "--arm", "control", env={"PYTHONPATH": str(project / "src")})
    assert done.returncode == 2
    # The gate receipt, which the plan hashes, no longer covers the sources.
    line = done.stderr.strip().splitlines()[-1]
    assert "numerical sources changed since the gate receipt:" in line and "update.py" in line, done.stderr


@pytest.mark.parametrize(
    "edited,stage",
    [("src/coopstudy/run/worker.py", "train"), ("src/coopstudy/inputs/data.py", "select"), ("analysis/screens.py", "report")],
)
def test_the_next_stage_refuses_after_a_deciding_source_changes_naming_it(planned, tmp_path, edited, stage):
    # The checkout as a user would have it after editing one file that decides
    # a number but is no numerical source: the gate still holds, the plan does not.
    sha = planned[0]
    project = tmp_path / "checkout"
    shutil.copytree(ROOT / "src" / "coopstudy", project / "src" / "coopstudy", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(ROOT / "analysis", project / "analysis", ignore=shutil.ignore_patterns("__pycache__"))
    _edit(project / edited)
    args = {"train": ("--arm", "control"), "select": (), "report": ("--plan", sha)}[stage]
    done = run_cli(stage, "--preset", "tiny", *args, env={"PYTHONPATH": f"{project / 'src'}:{project}"})
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    line = done.stderr.strip().splitlines()[-1]
    assert line.startswith(f"coopstudy {stage}: error: changed since the plan {sha[:12]} was committed: source {edited} (changed)"), done.stderr
    assert "," not in line.split("source ", 1)[1].split(";")[0]  # that file alone
    failed = _runs(f"tags.`{schema.TAG_STAGE}` = '{stage}' and attributes.status = 'FAILED'")[0]
    assert f"source {edited} (changed)" in failed.data.tags[schema.TAG_ERROR]


def test_train_runs_under_the_plan_and_the_budget_guard_counts_what_it_spent(planned):
    cfg = config.load("tiny")
    # $1 a second: the projection in dollars is the projection in seconds. An
    # allocation of 1.2 control projections lets the control run start, and
    # refuses the compressed arm (two devices) after it, counting what control spent.
    projected = budget.projection(cfg, _receipt("control-mb4-default.json"))["seconds"]
    priced = ("--set", "budget.hourly_price_usd=3600", f"budget.allocation_usd={1.2 * projected:.3f}")
    committed = run_cli("plan", "--preset", "tiny", *priced)
    assert committed.returncode == 0, committed.stderr[-3000:]
    sha = ledger.Ledger().latest(ledger.PLAN, plan.subject(config.load("tiny", priced[1:]))).digest

    first = run_cli("train", "--preset", "tiny", "--arm", "control", *priced)
    assert first.returncode == 0, first.stderr[-3000:]
    (ran,) = _runs(f"attributes.run_name = 'train-control-tiny' and attributes.status = 'FINISHED' and tags.`{schema.TAG_PLAN}` = '{sha}'")
    m = ran.data.metrics
    assert ran.data.tags[schema.TAG_REQUIRES_PREFIX + ledger.PLAN] == sha
    assert m[schema.M_PROJECTED_SECONDS] == pytest.approx(projected) and m[schema.M_SPENT_BEFORE_USD] == 0
    assert m[schema.M_COST_USD] == pytest.approx(m[schema.M_DEVICE_SECONDS])

    second = run_cli("train", "--preset", "tiny", "--arm", "compressed", *priced)
    assert second.returncode == 2
    assert "budget: training compressed would pass the allocation" in second.stderr
    assert f"spent ${m[schema.M_COST_USD]:.2f} (probes $0.00, 1 earlier train run(s) of plan {sha[:12]})" in second.stderr, second.stderr
    refused = _runs(f"attributes.run_name = 'train-compressed-tiny' and attributes.status = 'FAILED' and tags.`{schema.TAG_PLAN}` = '{sha}'")[0]
    assert refused.data.metrics[schema.M_SPENT_BEFORE_USD] == pytest.approx(m[schema.M_COST_USD])
    assert schema.M_COMPLETE_SECONDS not in refused.data.metrics  # nothing was launched


def test_evaluate_refuses_once_the_plan_has_spent_its_allocation_or_passed_its_deadline(planned):
    # The protocol refuses work that would pass either bound; before, only train was guarded,
    # and evaluate scored on past an allocation its training had used up.
    priced = ("budget.hourly_price_usd=3600", "budget.allocation_usd=1")
    cfg = config.load("tiny", priced)
    assert run_cli("plan", "--preset", "tiny", "--set", *priced).returncode == 0
    sha = ledger.Ledger().latest(ledger.PLAN, plan.subject(cfg)).digest
    with writer.stage_run(schema.STAGE_TRAIN, cfg, arm="control", tags={schema.TAG_PLAN: sha}) as rec:
        rec.log_metrics({schema.M_COST_USD: 1.25})
    done = run_cli("evaluate", "--preset", "tiny", "--set", *priced)
    said = (f"budget: plan {sha[:12]} has spent $1.25 of budget.allocation_usd $1.00, so evaluate would pass it; "
            "another plan (a larger budget.allocation_usd or a later budget.deadline) trains both arms again")  # fmt: skip
    assert (done.returncode, done.stderr.strip().splitlines()) == (2, [f"coopstudy evaluate: error: {said}"]), done.stderr[-3000:]
    refused = _runs(f"tags.`{schema.TAG_STAGE}` = 'evaluate' and tags.`{schema.TAG_PLAN}` = '{sha}'")[0]
    assert refused.info.status == "FAILED" and refused.data.tags[schema.TAG_ERROR] == said
    # Under the allocation, the deadline: past it, evaluate would work after it.
    doc = plan.document(config.load("tiny"), planned[0])
    budget.check_spent(config.load("tiny"), planned[0], doc, schema.STAGE_EVALUATE)  # no deadline, nothing spent: goes on
    late = config.load("tiny", ["budget.deadline=2020-01-01T00:00:00Z"])
    with pytest.raises(RefusedError, match=r"deadline: budget.deadline 2020-01-01T00:00:00\+00:00 of plan \w+ has passed, so evaluate would work after it"):
        budget.check_spent(late, planned[0], doc, schema.STAGE_EVALUATE)


def test_an_arm_finished_under_the_plan_is_not_trained_again(planned, tiny_seed):
    # Before, it trained again and select took the newest finished run: an arm could be
    # trained until its speed screen passed, and the first run's weights were no candidate.
    cfg = config.load("tiny")
    first, _ = fake_train_run(cfg, "control", tiny_seed.path, plan_sha=planned[0])
    before = _train_run_ids()
    done = run_cli("train", "--preset", "tiny", "--arm", "both")
    said = (f"arm control finished under plan {planned[0][:12]} (train run {first}): an arm trains once per plan, its final "
            "weights being its predetermined candidate; go on: `python -m coopstudy train --preset tiny --arm compressed`")  # fmt: skip
    assert (done.returncode, done.stderr.strip().splitlines()) == (2, [f"coopstudy train: error: {said}"])
    (refused,) = [r for r in _runs(TRAIN_RUNS) if r.info.run_id not in before]  # no arm run was opened
    assert refused.info.run_name == "train-both-tiny" and refused.info.status == "FAILED" and refused.data.tags[schema.TAG_ERROR] == said
    # The arm alone: its own run, refused under the plan, which the report lists as the arm's `FAILED (refused)` attempt.
    before = _train_run_ids()
    done = run_cli("train", "--preset", "tiny", "--arm", "control")
    assert done.returncode == 2 and said in done.stderr, done.stderr[-3000:]
    (refused,) = [r for r in _runs(TRAIN_RUNS) if r.info.run_id not in before]
    tags = refused.data.tags
    assert (refused.info.status, tags[schema.TAG_ARM], tags[schema.TAG_PLAN], tags[schema.TAG_ERROR_KIND]) == (
        "FAILED", "control", planned[0], "RefusedError"
    )
    assert schema.M_COST_USD not in refused.data.metrics  # it spent nothing
    assert candidates.first_finished(cfg, planned[0], "control").info.run_id == first


def test_the_deadline_guard_refuses_both_arms_before_the_first_starts(planned):
    past = ("--set", 'budget.deadline="2000-01-01T00:00:00+00:00"')
    committed = run_cli("plan", "--preset", "tiny", *past)
    assert committed.returncode == 0, committed.stderr[-3000:]
    before = _train_run_ids()
    done = run_cli("train", "--preset", "tiny", "--arm", "both", *past)
    assert done.returncode == 2
    assert "deadline: training control then compressed is projected to take" in done.stderr
    assert "after budget.deadline 2000-01-01T00:00:00+00:00" in done.stderr
    (parent,) = [r for r in _runs(TRAIN_RUNS) if r.info.run_id not in before]  # no arm run was opened
    assert parent.info.run_name == "train-both-tiny" and parent.info.status == "FAILED" and parent.data.tags[schema.TAG_PLAN]


def test_the_deadline_is_the_projected_end(planned):
    sha, doc, _ = planned
    now = datetime(2030, 1, 1, tzinfo=timezone.utc)
    seconds = doc["arms"]["control"]["projection"]["seconds"]
    for margin, refused in ((-1, True), (1, False)):
        cfg = config.load("tiny", [f'budget.deadline="{(now + timedelta(seconds=seconds + margin)).isoformat()}"'])
        projected = budget.projected(cfg, sha, doc, ("control",))
        if refused:
            with pytest.raises(RefusedError, match="deadline: training control is projected"):
                budget.check_budget(cfg, sha, projected, now=now)
        else:
            budget.check_budget(cfg, sha, projected, now=now)
    with pytest.raises(ConfigError, match="budget.deadline: Input should have timezone info"):
        config.load("tiny", ['budget.deadline="2030-01-01T00:00:00"'])
