"""Each quality screen FAILS a deliberately bad candidate, scored through the
real `select`, `evaluate` and `report` stages on the tiny preset, and passes
the candidate it should (a screen that cannot fail measures nothing; one that
cannot pass neither).

The tiny preset is a random-init model: on its mixed families nothing is ever
correct, so accuracy cannot fall. Here it learns one family whose answers a
model can get right without reasoning (letter_counting: "1" is right on about
a third of the cases) with a recipe that forgets: no replay, learning rate
1e-2 for 60 updates, so its NLL on the chitchat retention probes rises by
several nats. 160 test cases let non-inferiority pass on agreement (at 128 one
discordant case each way would already fail it).

Two studies, two plans of one config (the plans differ in budget only, so the
inputs and probe receipts are shared):
  A: control trained for real; the compressed candidate is that same forgetting
     run's checkpoint. Gain passes, non-inferiority passes, retention FAILS.
  B: control is A's trained checkpoint, the compressed candidate the seed's own
     weights. Retention passes, the gain screen FAILS (the seed against itself),
     non-inferiority FAILS (a damaged candidate against a trained control).
Candidates other than the real train run are recorded as `train` records a run
(checkpoint hash and path, plan, seed, inputs), with placeholder timings: the
speed screens are not what these tests are about.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import mlflow
import pytest
from fixtures import module_store, run_cli

from coopstudy import config, workspace
from coopstudy.commit import ledger, plan
from coopstudy.inputs import data
from coopstudy.inputs.seed import resolve_seed
from coopstudy.record import schema, store, writer

pytestmark = pytest.mark.slow

RECIPE = [
    "data.families=[letter_counting]",
    "data.tasks_per_family=48",
    "data.test_per_family=160",
    "data.replay_docs=0",
    "train.lr=1e-2",
    "train.updates=60",
    # Only the two settings the arms use (an override is one word: JSON is YAML).
    'probe.candidates=[{"arm":"control","microbatch":4},{"arm":"compressed","microbatch":3}]',
]
STUDY_B = [*RECIPE, "budget.allocation_usd=99"]


@pytest.fixture(scope="module", autouse=True)
def isolated_store(tmp_path_factory, probed_tiny_store):
    # Overrides conftest's per-test store: the two studies are made once, here.
    with module_store(tmp_path_factory, probed_tiny_store, "screens-fail") as shared:
        yield shared


def _ok(*args: str) -> str:
    done = run_cli(*args)
    assert done.returncode == 0, f"{args[0]}: {done.stderr[-3000:]}"
    return done.stdout


def _plan(overrides: list[str]) -> str:
    _ok("plan", "--preset", "tiny", "--set", *overrides)
    return ledger.Ledger().latest(ledger.PLAN, plan.subject(config.load("tiny", overrides))).digest


def _train_run(plan_sha: str, arm: str):
    (run,) = store.search_runs(
        "coopstudy",
        f"tags.`{schema.TAG_STAGE}` = 'train' and tags.`{schema.TAG_ARM}` = '{arm}' and tags.`{schema.TAG_PLAN}` = '{plan_sha}' "
        "and attributes.status = 'FINISHED'",
    )
    return run


def put_forward(overrides: list[str], plan_sha: str, arm: str, weights: Path) -> str:
    """A train run of `arm` under the plan whose final checkpoint is a copy of
    `weights`, recorded as `train` records one, so select takes it as the
    arm's candidate."""
    cfg = config.load("tiny", overrides)
    seed = resolve_seed(cfg)
    folder = workspace.subdir("checkpoints") / f"put-forward-{arm}-{plan_sha[:12]}"
    shutil.copytree(weights, folder)
    inputs = ledger.Ledger().latest(ledger.INPUTS, data.inputs_key(cfg)).digest
    tags = {
        schema.TAG_CHECKPOINT_SHA: workspace.sha256_file(folder / workspace.WEIGHTS_FILE),
        schema.TAG_CHECKPOINT_PATH: str(folder),
        schema.TAG_PLAN: plan_sha,
        schema.TAG_SEED_SHA: seed.sha256,
        schema.TAG_REQUIRES_PREFIX + ledger.INPUTS: inputs,
    }
    with writer.stage_run(schema.STAGE_TRAIN, cfg, arm=arm, tags=tags) as rec:
        for update in range(1, 3):
            rec.log_metrics({schema.M_LOSS: 0.0, schema.M_UPDATE_SECONDS: 1.0}, step=update)
        rec.log_metrics({schema.M_ACTIVE_SECONDS: 2.0, schema.M_COMPLETE_SECONDS: 3.0})
    return rec.run_id


def _report(overrides: list[str], out: Path) -> dict:
    _ok("select", "--preset", "tiny", "--set", *overrides)
    _ok("evaluate", "--preset", "tiny", "--set", *overrides)
    printed = _ok("report", "--preset", "tiny", "--set", *overrides, "--out", str(out))
    assert "Pre-registered screens" in printed
    return json.loads((out / schema.ART_REPORT_JSON).read_text())


@pytest.fixture(scope="module")
def studies(tmp_path_factory) -> dict[str, dict]:
    out = tmp_path_factory.mktemp("screens-fail-reports")
    _ok("prepare", "--preset", "tiny", "--set", *RECIPE)
    _ok("probe", "--preset", "tiny", "--set", *RECIPE)

    a = _plan(RECIPE)
    _ok("train", "--preset", "tiny", "--arm", "control", "--set", *RECIPE)
    trained = Path(_train_run(a, "control").data.tags[schema.TAG_CHECKPOINT_PATH])
    put_forward(RECIPE, a, "compressed", trained)
    report_a = _report(RECIPE, out / "a")

    b = _plan(STUDY_B)
    assert b != a
    put_forward(STUDY_B, b, "control", trained)
    put_forward(STUDY_B, b, "compressed", resolve_seed(config.load("tiny", STUDY_B)).path)
    report_b = _report(STUDY_B, out / "b")
    return {"A": report_a, "B": report_b}


def _screen(report: dict, name: str) -> dict:
    return next(s for s in report["screens"] if s["name"] == name)


def _accuracy(report: dict, model: str) -> float:
    return report["accuracy"][model]["families"]["all"]["accuracy"]


def test_the_recipe_learns_and_forgets(studies):
    a = studies["A"]
    # The trained model gets the "1" cases; the random-init seed gets none.
    assert _accuracy(a, "seed") == 0.0 and _accuracy(a, "control") > 0.2
    nll = a["retention_nll"]
    assert nll["control"]["mean_over_documents"] > nll["seed"]["mean_over_documents"] + 1.0
    assert a["inputs"]["counts"]["replay"] == 0 and a["inputs"]["counts"]["test"] == 160


def test_a_run_that_forgets_fails_retention(studies):
    forgot = _screen(studies["A"], "retention")
    assert forgot["verdict"] == "fail" and forgot["verdict_reads"] == "FAIL"
    assert forgot["estimate"] > 1.0 and forgot["bound"] > forgot["threshold"]
    # ... and the same screen passes a candidate that did not change.
    kept = _screen(studies["B"], "retention")
    assert kept["verdict"] == "pass" and kept["estimate"] == 0.0 and kept["powered"] is True


def test_the_seed_against_itself_fails_the_gain_screen(studies):
    itself = _screen(studies["B"], "accuracy_gain")
    assert itself["verdict"] == "fail" and itself["estimate"] == 0.0
    assert itself["details"]["paired_table"]["only_compressed"] == itself["details"]["paired_table"]["only_seed"] == 0
    trained = _screen(studies["A"], "accuracy_gain")
    assert trained["verdict"] == "pass" and trained["estimate"] > 0.2 and trained["powered"] is True


def test_a_damaged_candidate_fails_noninferiority_against_a_trained_control(studies):
    damaged = _screen(studies["B"], "noninferiority")
    assert damaged["verdict"] == "fail"
    assert damaged["estimate"] == pytest.approx(-_accuracy(studies["B"], "control"))
    assert damaged["bound"] < damaged["threshold"]
    # The screen could pass at this size: the same trained weights on both arms do,
    # and with real disagreement too (up to breakpoint_k - 1 discordant cases each way).
    same = _screen(studies["A"], "noninferiority")
    assert same["verdict"] == "pass" and same["powered"] is True
    assert same["sensitivity"]["breakpoint_k"] >= 2 and same["details"]["cases"] == 160


def test_the_failures_are_on_record_as_verdicts(studies):
    client = mlflow.MlflowClient()
    exp = client.get_experiment_by_name("coopstudy")
    reports = client.search_runs([exp.experiment_id], f"tags.`{schema.TAG_STAGE}` = 'report' and attributes.status = 'FINISHED'")
    verdicts = {(r.data.tags[schema.TAG_VERDICT_PREFIX + "retention"], r.data.tags[schema.TAG_VERDICT_PREFIX + "noninferiority"]) for r in reports}
    assert verdicts == {("fail", "pass"), ("pass", "fail")}
