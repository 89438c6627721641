"""The whole study on `tiny`, as a user runs it, in a copy of the checkout:
on a store where prepare, verify and probe were run by hand, `mlflow run .
-e train` reuses them and runs the rest of what train needs, `study`
finishes the rest, a second `study` reuses every step, touching a numerical
source reruns verify and what follows it, and `report` alone rebuilds the
same report.json from the tracking store. Prepare from scratch (the seed made
again) and both arms trained again under a plan committed again agree with
the first study to the byte. (The front door on an empty store, every step
run by `mlflow run . -e main`, is tests/test_remote.py's study; the steps
before the plan are the session's probed store here, made once for the
suite.)"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import urllib.parse
from dataclasses import dataclass
from pathlib import Path

import mlflow
import pytest
from fixtures import Server, checkout_copy, run_cli

from coopstudy import config, study
from coopstudy.commit import sources
from coopstudy.record import schema, store
from coopstudy.steps import report as report_step

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


class Copy:
    """A checkout copy with its own store; commands run from it, on its sources."""

    def __init__(self, root: Path, base: Path):
        self.root = root
        self.env = {
            **os.environ,
            "PYTHONPATH": f"{root / 'src'}{os.pathsep}{root}",
            "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
            "MLFLOW_TRACKING_URI": f"sqlite:///{base / 'mlflow.db'}",
            "COOPSTUDY_HOME": str(base / "home"),
        }
        self.env.pop("MLFLOW_RUN_ID", None)

    def run(self, *argv: str, timeout: float = 900) -> subprocess.CompletedProcess:
        return subprocess.run(argv, cwd=self.root, env=self.env, capture_output=True, text=True, timeout=timeout)

    def coopstudy(self, *args: str) -> subprocess.CompletedProcess:
        return run_cli(*args, env=self.env, cwd=self.root, timeout=900, inherit=False)

    def runs(self, stage: str) -> list:
        client = mlflow.MlflowClient(tracking_uri=self.env["MLFLOW_TRACKING_URI"])
        exp = client.get_experiment_by_name("coopstudy")
        return client.search_runs([exp.experiment_id], f"tags.`{schema.TAG_STAGE}` = '{stage}'")


def _steps(out: str, verb: str) -> list[str]:
    """The steps a study printed as `running` or as `reused`, in order."""
    marker = ": running" if verb == "running" else ": reused run "
    return [line.split(":")[1].strip() for line in out.splitlines() if line.startswith("study: ") and marker in line]


@pytest.fixture(scope="module")
def copy(tmp_path_factory, probed_tiny_store) -> Copy:
    base = tmp_path_factory.mktemp("study")
    root = checkout_copy(tmp_path_factory.mktemp("checkout"))
    probed_tiny_store.copy(base)
    return Copy(root, base)


def _prepared(home: Path) -> dict:
    """What prepare left in a workspace that must not depend on the run."""
    ledger = [json.loads(line) for line in (home / "ledger.jsonl").read_text().splitlines()]
    (inputs,) = [e for e in ledger if e["kind"] == "inputs"]
    (folder,) = (home / "prepared").iterdir()
    return {
        "inputs": inputs["digest"],
        "manifest": json.loads((folder / "manifest.json").read_text()),
        "seeds": sorted(p.name for p in (home / "seeds").iterdir()),
    }


def _outcome(home: Path) -> dict:
    """What a finished study left in its workspace that must not depend on the run."""
    (report_file,) = (home / "reports").glob("*/report.json")
    return _prepared(home) | {"report": json.loads(report_file.read_text())}


@dataclass(frozen=True)
class First:
    train: subprocess.CompletedProcess
    rest: subprocess.CompletedProcess
    outcome: dict
    """_outcome of the finished study, taken before any test changes it."""


@pytest.fixture(scope="module")
def first(copy) -> First:
    train = copy.run("mlflow", "run", ".", "-e", "train", "--env-manager", "local", "-P", "preset=tiny")
    assert train.returncode == 0, train.stdout[-3000:] + train.stderr[-3000:]
    rest = copy.coopstudy("study", "--preset", "tiny")
    assert rest.returncode == 0, rest.stdout[-3000:] + rest.stderr[-3000:]
    return First(train, rest, _outcome(Path(copy.env["COOPSTUDY_HOME"])))


def test_train_entry_point_runs_what_train_needs_first(first, copy):
    out = first.train.stdout
    assert _steps(out, "reused") == ["prepare", "verify", "probe"]
    assert _steps(out, "running") == ["plan", "train-control", "train-compressed"]
    arms = {r.data.tags[schema.TAG_ARM]: r for r in copy.runs("train")}
    assert set(arms) == {"control", "compressed"}
    assert all(r.info.status == "FINISHED" for r in arms.values())


def test_study_finishes_with_the_remaining_steps(first, copy):
    rest = first.rest
    assert _steps(rest.stdout, "reused") == ["prepare", "verify", "probe", "plan", "train-control", "train-compressed"]
    assert _steps(rest.stdout, "running") == ["select", "evaluate", "report"]
    assert "quality:" in rest.stdout and "speed:" in rest.stdout


def test_second_study_reuses_every_step(first, copy):
    before = len(copy.runs("train"))
    again = copy.coopstudy("study", "--preset", "tiny")
    assert again.returncode == 0, again.stderr[-3000:]
    assert _steps(again.stdout, "reused") == list(study.STEP_NAMES)
    assert _steps(again.stdout, "running") == []
    assert len(copy.runs("train")) == before


def test_a_change_that_binds_no_number_trains_and_selects_nothing_again(first, copy):
    # steps/plan.py binds no number, so the plan stays the one in force, but the plan
    # step's key changes with it. Before, the study then trained both arms again (and select
    # took the newest runs); train now refuses an arm finished under the plan, so the study
    # takes the plan's runs, whatever key they carry. Then evaluate and report ran again
    # on the same selection, their keys chaining from the plan's; the plan's steps now hash no upstream key.
    trained = {r.data.tags[schema.TAG_ARM]: r for r in copy.runs("train")}
    scored = len(copy.runs("evaluate"))
    source = copy.root / "src" / "coopstudy" / "steps" / "plan.py"
    original = source.read_text()
    source.write_text(original + "\n# touched\n")
    try:
        again = copy.coopstudy("study", "--preset", "tiny")
    finally:
        source.write_text(original)
    assert again.returncode == 0, again.stderr[-3000:]
    assert _steps(again.stdout, "running") == ["plan"]
    assert _steps(again.stdout, "reused") == [n for n in study.STEP_NAMES if n != "plan"]
    assert len(copy.runs("evaluate")) == scored
    plan = trained["control"].data.tags[schema.TAG_PLAN]
    for arm, run in trained.items():
        assert f"study: train-{arm}: reused run {run.info.run_id} (the arm's first finished run under plan {plan[:12]})" in again.stdout
    (selected,) = copy.runs("select")
    assert f"study: select: reused run {selected.info.run_id} (the selection of plan {plan[:12]})" in again.stdout
    assert {r.data.tags[schema.TAG_ARM]: r.info.run_id for r in copy.runs("train")} == {a: r.info.run_id for a, r in trained.items()}


def test_checkpoints_gone_after_select_train_nothing_again(first, copy, tmp_path):
    # A selection is made once per plan: training an arm again could replace
    # no candidate, so a study whose checkpoints were cleaned up reuses every step.
    trained = copy.runs("train")
    checkpoints = Path(copy.env["COOPSTUDY_HOME"]) / "checkpoints"
    shutil.move(checkpoints, tmp_path / "kept")
    try:
        again = copy.coopstudy("study", "--preset", "tiny")
    finally:
        shutil.rmtree(checkpoints, ignore_errors=True)
        shutil.move(tmp_path / "kept", checkpoints)
    assert again.returncode == 0, again.stderr[-3000:]
    assert _steps(again.stdout, "reused") == list(study.STEP_NAMES)
    for run in trained:
        said = f"reused run {run.info.run_id} (the arm's first finished run under plan {run.data.tags[schema.TAG_PLAN][:12]}; its checkpoint is gone from disk, and select already took it)"
        assert said in again.stdout, again.stdout[-3000:]
    assert len(copy.runs("train")) == len(trained)


def test_report_alone_rebuilds_the_same_json(first, copy):
    folder = Path(copy.env["COOPSTUDY_HOME"]) / "reports"
    [written] = folder.glob("*/report.json")
    original = written.read_bytes()
    shutil.rmtree(folder)
    alone = copy.coopstudy("report", "--preset", "tiny")
    assert alone.returncode == 0, alone.stderr[-3000:]
    [rebuilt] = folder.glob("*/report.json")
    assert rebuilt.read_bytes() == original
    assert json.loads(original)  # a real document, not an empty file


TIMED = ("active_speedup", "complete_speedup")
"""Screens whose estimate is a ratio of seconds."""


def _without_runs(value):
    """The value with every run id left out: runs are named by the store, not by the study."""
    if isinstance(value, dict):
        return {k: _without_runs(v) for k, v in value.items() if k not in ("run_id", "run_ids", "prepare_run")}
    if isinstance(value, list):
        return [_without_runs(v) for v in value]
    return value


def test_prepare_from_scratch_agrees_to_the_byte(first, tmp_path):
    # Reproducible on CPU: a fresh COOPSTUDY_HOME and SQLite store, the seed made
    # again, prepare started the other way (by itself, not by mlflow run). That
    # training again gives the same weights and screens is the plan committed again below.
    home = tmp_path / "home"
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_RUN_ID"}
    env |= {"COOPSTUDY_HOME": str(home), "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'mlflow.db'}"}
    done = subprocess.run([sys.executable, "-m", "coopstudy", "prepare", "--preset", "tiny"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    # The seed was made here: the libraries' lines while saving it (a progress
    # bar, DeepSpeed's warning that it found no GPU) stay out of the step's.
    assert "Writing model shards" not in done.stderr, done.stderr[-4000:]
    assert not [line for line in done.stdout.splitlines() if "[WARNING]" in line], done.stdout[:4000]
    one, two = first.outcome, _prepared(home)
    assert one["seeds"] == two["seeds"]
    assert one["inputs"] == two["inputs"]
    assert one["manifest"] == two["manifest"]  # every prepared file's sha256, the seed's included


def _same_study(a: dict, b: dict) -> None:
    """Two report.json of one config agree on everything but timings and run ids."""
    assert a["candidates"] == b["candidates"], "the final weights of both arms hash the same"
    screens_a = {s["name"]: s for s in a["screens"]}
    screens_b = {s["name"]: s for s in b["screens"]}
    assert screens_a.keys() == screens_b.keys()
    for name in screens_a:
        if name in TIMED:
            # Timings excepted: the rule is the same, the seconds are the machine's.
            keep = ("title", "threshold", "comparison", "decided_on", "unit")
            assert {k: screens_a[name][k] for k in keep} == {k: screens_b[name][k] for k in keep}
        else:
            assert _without_runs(screens_a[name]) == _without_runs(screens_b[name]), name
    assert a["verdicts"]["quality"] == b["verdicts"]["quality"]
    for section in ("accuracy", "retention_nll", "inputs", "thresholds"):
        assert _without_runs(a[section]) == _without_runs(b[section]), section
    for arm in ("control", "compressed"):
        for key in ("updates", "first_loss", "final_loss"):
            assert a["training"][arm][key] == b["training"][arm][key], (arm, key)
        for key in ("bytes_dense", "bytes_compressed", "bytes_total"):
            assert a["resources"]["arms"][arm][key] == b["resources"]["arms"][arm][key], (arm, key)


def test_upstream_change_changes_every_later_key_up_to_the_plans_steps():
    cfg = config.load("tiny")
    keys: dict[str, str] = {}
    for step in study.STEPS:
        keys[step.name] = study.step_key(step, cfg, keys)
    redone: dict[str, str] = {"prepare": keys["prepare"], "verify": "0" * 64}
    for step in study.STEPS[2:]:
        redone[step.name] = study.step_key(step, cfg, redone)
    # Up to the plan, a changed upstream key reruns a step; from the plan's own
    # steps on, the plan in force does (train and select are the plan's, and
    # evaluate and report rerun when it is not the plan they ran under).
    assert {n for n in study.STEP_NAMES[2:] if redone[n] != keys[n]} == {"probe", "plan"}
    after_plan = study.STEPS[study.STEP_NAMES.index("plan") + 1 :]
    assert all(s.planned or s.still_valid in (study._under_plan_ok, study._checkpoint_ok) for s in after_plan)


def test_every_module_belongs_to_a_step():
    # Derived from imports, so nothing the study runs can change without a step noticing.
    claimed = {rel for step in study.STEPS for rel in study.step_sources(step)}
    tools = set(sources.closure("coopstudy.cli", "coopstudy.bench", "coopstudy.bench.__main__", "coopstudy.devsplit", "coopstudy.study", "coopstudy.__main__"))
    root = sources.PACKAGE.parents[1]
    modules = {str(p.relative_to(root)) for p in sources.PACKAGE.rglob("*.py")}
    top = {"cli", "bench", "devsplit", "study", "__main__"}
    own = {m for m in modules for t in top if m == f"src/coopstudy/{t}.py" or m.startswith(f"src/coopstudy/{t}/")}
    assert modules - claimed - own == set()
    assert modules <= claimed | tools
    assert "src/coopstudy/run/worker.py" in study.step_sources(study.STEPS[study.STEP_NAMES.index("train-control")])
    assert {f"analysis/{m}.py" for m in ("records", "report", "screens", "stats")} <= set(study.step_sources(study.STEPS[-1]))


def test_the_record_is_native_in_mlflow(first, copy):
    client = mlflow.MlflowClient(tracking_uri=copy.env["MLFLOW_TRACKING_URI"])
    exp = client.get_experiment_by_name("coopstudy")
    assert exp.tags[store.EXPERIMENT_KIND_TAG] == store.EXPERIMENT_KIND
    report = copy.runs("report")[0]
    md = Path(mlflow.artifacts.download_artifacts(run_id=report.info.run_id, artifact_path=schema.ART_REPORT_MD,
                                                  tracking_uri=copy.env["MLFLOW_TRACKING_URI"]))  # fmt: skip
    # The run page shows the report itself: whole, or whole sections up to MLflow's longest tag, naming the others.
    note, whole = report.data.tags["mlflow.note.content"], md.read_text()
    head, _, tail = note.rpartition("\n\n... (")
    if note != whole:
        left = [line.removeprefix("## ") for line in whole[len(head):].splitlines() if line.startswith("## ")]
        assert len(note) <= 8000 and whole.startswith(head) and whole[len(head):].lstrip().startswith("## "), note[-300:]
        assert tail == f"{'; '.join(left)}: in {schema.ART_REPORT_MD} among this run's artifacts, {report_step.NOTE_CUT})"
    assert "## Screens (pre-registered)" in note
    figures = [f.path for f in client.list_artifacts(report.info.run_id, schema.ART_FIGURES)]
    assert figures and all(f.endswith(".png") for f in figures)
    # Three logged models, each with its evaluation metrics on the final test.
    models = client.search_logged_models(experiment_ids=[exp.experiment_id])
    assert sorted(m.name for m in models) == ["compressed", "control", "seed"]
    evaluations = [r for r in copy.runs("evaluate") if schema.TAG_MODEL in r.data.tags]
    scored_by = {r.info.run_id: r for r in evaluations}
    for m in models:
        linked = {x.key: x for x in m.metrics}
        assert schema.M_ACCURACY in linked and linked[schema.M_ACCURACY].dataset_name == "test.jsonl"
        assert linked[schema.M_RETENTION_NLL].dataset_name == "retention.jsonl"
        # What the README's schema says a logged model carries.
        run = scored_by[m.source_run_id]
        assert (m.model_type, m.tags[schema.TAG_MODEL], run.data.tags[schema.TAG_MODEL]) == (schema.MODEL_TYPE_CHECKPOINT, m.name, m.name)
        assert m.params[schema.MODEL_PARAM_WEIGHTS_SHA] == run.data.tags[schema.TAG_CHECKPOINT_SHA]
        assert Path(m.params[schema.MODEL_PARAM_WEIGHTS]).is_dir()
    assert all({i.dataset.name for i in r.inputs.dataset_inputs} == {"test.jsonl", "retention.jsonl"} for r in evaluations)


CHROMIUM = next((p for p in ("/usr/lib/chromium/chromium", "/usr/bin/chromium") if Path(p).exists()), None)
CHROMIUM_ARGS = [
    "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync", "--disable-dev-shm-usage",
]  # fmt: skip
SCREENSHOTS = ROOT / "build" / "browser"
"""Where the browser test keeps what it saw (ignored by git; CI keeps it as an artifact)."""
PAGE_TIMEOUT_MS = 90_000
"""The first page load compiles a large bundle on two cores."""


@pytest.mark.skipif(CHROMIUM is None, reason="needs Debian's chromium (apt-get install chromium); .ci/run installs it")
def test_the_study_in_a_real_browser(first, copy, tmp_path):
    from playwright.sync_api import TimeoutError as PlaywrightTimeoutError
    from playwright.sync_api import sync_playwright

    client = mlflow.MlflowClient(tracking_uri=copy.env["MLFLOW_TRACKING_URI"])
    exp = client.get_experiment_by_name("coopstudy").experiment_id
    parent = next(r for r in copy.runs("study") if r.info.run_name == "study-train-both-tiny")
    arms = {r.data.tags[schema.TAG_ARM]: r for r in copy.runs("train") if schema.TAG_ARM in r.data.tags}
    server = Server(tmp_path, backend=copy.env["MLFLOW_TRACKING_URI"])
    server.start()
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    try:
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
            page = browser.new_context(viewport={"width": 1920, "height": 1100}).new_page()
            page.set_default_timeout(PAGE_TIMEOUT_MS)

            def link(name: str):
                return page.locator("a").filter(has_text=re.compile(rf"^{re.escape(name)}$"))

            # The experiment as the README links it: on its training runs, not the traces overview.
            page.goto(f"{server.uri}/#/experiments/{exp}?workflowType=machine_learning")
            page.wait_for_url(f"**/experiments/{exp}/runs?**")
            link("study-train-both-tiny").wait_for()
            assert "overview" not in page.url
            page.screenshot(path=str(SCREENSHOTS / "experiment.png"))
            # The study's parent holds its steps.
            page.goto(f"{server.uri}/#/experiments/{exp}/runs/{parent.info.run_id}?workflowType=machine_learning")
            page.get_by_text("Child runs", exact=True).wait_for()
            for step in ("plan-tiny", "train-control-tiny", "train-compressed-tiny"):
                link(step).wait_for()
            # Both arms side by side, with their loss curves.
            runs = urllib.parse.quote(json.dumps([arms["control"].info.run_id, arms["compressed"].info.run_id]))
            page.goto(f"{server.uri}/#/compare-runs?runs={runs}&experiments={urllib.parse.quote(json.dumps([exp]))}")
            page.get_by_text("Comparing 2 Runs from 1 Experiment").wait_for()
            page.get_by_text("train-control-tiny", exact=True).wait_for()
            page.get_by_text("train-compressed-tiny", exact=True).wait_for()
            loss = page.locator(f'a[href*="#/metric?"][href*="{urllib.parse.quote(schema.M_LOSS, safe="")}"]').first
            metrics = page.locator('a[href*="#/metric?"]')
            metrics.first.wait_for()
            # The metrics table renders only the rows near the view (a train
            # run has over twenty metrics): scroll down it, as a user would,
            # until the loss's row is there.
            for _ in range(30):
                if loss.count():
                    break
                metrics.last.scroll_into_view_if_needed()
                page.mouse.wheel(0, 400)
                page.wait_for_timeout(300)
            loss.wait_for()
            page.screenshot(path=str(SCREENSHOTS / "compare.png"), full_page=True)
            # The compare page re-renders as the metric histories arrive; a click
            # on a link being replaced goes nowhere, so click again, as a user would.
            for attempt in range(3):
                loss.click()
                try:
                    page.wait_for_url("**/metric?**", timeout=PAGE_TIMEOUT_MS / 3)
                    break
                except PlaywrightTimeoutError:
                    if attempt == 2:
                        raise
            page.locator(".js-plotly-plot path.js-line").nth(1).wait_for(state="attached")
            page.screenshot(path=str(SCREENSHOTS / "train-loss.png"))
            browser.close()
    finally:
        server.stop()
    assert (SCREENSHOTS / "compare.png").stat().st_size > 10_000


def test_another_configs_gate_and_a_plan_committed_again(first, copy):
    """A study of another config passes its own gate; the first config's plan
    keeps the gate it binds. A plan committed again (probe rerun by hand)
    reruns every step after it, though their keys are the same, and training
    again in other processes gives the same weights, losses and screens."""
    client = mlflow.MlflowClient(tracking_uri=copy.env["MLFLOW_TRACKING_URI"])
    # Every plan run so far committed the one plan (an earlier test ran the step again, "unchanged").
    planned, *again_unchanged = copy.runs("plan")
    assert {r.data.tags[schema.TAG_PLAN] for r in again_unchanged} <= {planned.data.tags[schema.TAG_PLAN]}
    gate = planned.data.tags[schema.TAG_REQUIRES_PREFIX + "gate"]
    other = copy.coopstudy("study", "--preset", "tiny", "--through", "verify", "--set", "train.lr=2e-4")
    assert other.returncode == 0, other.stderr[-3000:]
    assert _steps(other.stdout, "running") == ["prepare", "verify"]
    newest = next(r for r in copy.runs("verify") if "mlflow.parentRunId" in r.data.tags)
    assert newest.data.tags[schema.TAG_GATE] != gate  # the gate of other optimizer settings
    # The first config's plan still holds: select refuses only because it selected once.
    select = copy.coopstudy("select", "--preset", "tiny")
    assert select.returncode == 2 and "were already selected" in select.stderr, select.stderr[-3000:]

    trained = {r.data.tags[schema.TAG_ARM]: r.info.run_id for r in copy.runs("train")}
    probe = copy.coopstudy("probe", "--preset", "tiny")
    assert probe.returncode == 0, probe.stderr[-3000:]
    said = f"note: plan {planned.data.tags[schema.TAG_PLAN][:12]} of this config binds other probe receipts than those now in "
    assert said in probe.stdout, probe.stdout[-3000:]
    again = copy.coopstudy("study", "--preset", "tiny")
    assert again.returncode == 0, again.stderr[-3000:]
    assert _steps(again.stdout, "reused") == ["prepare", "verify", "probe"]
    assert _steps(again.stdout, "running") == list(study.STEP_NAMES[3:])
    # Each step that runs again though a run holds its key says why that run is not reused.
    (replanned_line,) = [line for line in again.stdout.splitlines() if line.startswith("study: plan: running")]
    assert replanned_line.startswith("study: plan: running (not reused: changed since the plan "), replanned_line
    assert "python -m coopstudy" not in replanned_line  # the refusal's hint names the command running
    for arm, run_id in trained.items():
        assert f"study: train-{arm}: running (not reused: run {run_id} ran under another plan than the one in force)" in again.stdout
    replanned = copy.runs("plan")[0]
    assert replanned.data.tags[schema.TAG_PLAN] != planned.data.tags[schema.TAG_PLAN]
    assert replanned.data.tags[schema.TAG_REQUIRES_PREFIX + "gate"] == gate
    for stage in ("train", "select", "evaluate", "report"):
        assert copy.runs(stage)[0].data.tags[schema.TAG_PLAN] == replanned.data.tags[schema.TAG_PLAN], stage
    # Training records the plan's gate, not the newest one (the other config's).
    assert {r.data.tags[schema.TAG_REQUIRES_PREFIX + "gate"] for r in copy.runs("train")[:2]} == {gate}
    assert client.get_run(copy.runs("report")[0].info.run_id).info.status == "FINISHED"
    # Reproducible on CPU: the arms trained again, by `study`, not `mlflow run -e train`, agree to the byte.
    (written,) = (Path(copy.env["COOPSTUDY_HOME"]) / "reports").glob("*/report.json")  # the config's report, written again
    again_report = json.loads(written.read_text())
    assert again_report["study"]["plan_sha256"] == replanned.data.tags[schema.TAG_PLAN]
    assert again_report["inputs"]["sha256"] == first.outcome["inputs"]
    _same_study(first.outcome["report"], again_report)


def test_touching_a_numerical_source_reruns_verify_and_after(first, copy):
    source = copy.root / "src" / "coopstudy" / "numerics" / "objective.py"
    original = source.read_text()
    source.write_text(original + "\n# touched\n")
    try:
        touched = copy.coopstudy("study", "--preset", "tiny", "--through", "verify")
        assert touched.returncode == 0, touched.stderr[-3000:]
        assert _steps(touched.stdout, "reused") == ["prepare"]
        assert _steps(touched.stdout, "running") == ["verify"]
        # Every later step reruns too: probe and plan by their keys, which chain from verify's,
        # the rest by the plan in force (test_upstream_change_changes_every_later_key_up_to_the_plans_steps);
        # training refuses meanwhile, in one line naming the file.
        refused = copy.coopstudy("train", "--preset", "tiny", "--arm", "control")
    finally:
        source.write_text(original)
    (line,) = refused.stderr.strip().splitlines()
    assert refused.returncode == 2 and line.startswith("coopstudy train: error: ") and "src/coopstudy/numerics/objective.py" in line, line


def test_steps_started_one_by_one_are_reused_by_a_study(probed_tiny):
    """One record however a step is started: a study finds the runs of
    prepare, verify and probe started by hand, and runs none of them again."""
    done = run_cli("study", "--preset", "tiny", "--through", "probe", env=probed_tiny.env())
    assert done.returncode == 0, done.stderr[-3000:]
    client = mlflow.MlflowClient(tracking_uri=probed_tiny.tracking_uri)
    exp = client.get_experiment_by_name("coopstudy").experiment_id
    for stage in ("prepare", "verify", "probe"):
        runs = client.search_runs([exp], f"tags.`{schema.TAG_STAGE}` = '{stage}'")
        by_hand = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
        assert len(by_hand) == 1, [r.info.run_name for r in by_hand]
        assert f"study: {stage}: reused run {by_hand[0].info.run_id}" in done.stdout, done.stdout[-3000:]


def test_a_step_started_by_itself_takes_no_key_when_its_upstream_has_no_run_under_one(probed_tiny):
    """A key says "the study's step, after these runs": a prepare run without
    one (made before step keys were given by hand, say) leaves the plan made
    after it keyless, so a study plans again rather than reuse it blindly."""
    client = mlflow.MlflowClient(tracking_uri=probed_tiny.tracking_uri)
    exp = client.get_experiment_by_name("coopstudy").experiment_id
    (prepared,) = client.search_runs([exp], f"tags.`{schema.TAG_STAGE}` = 'prepare'")
    client.delete_tag(prepared.info.run_id, schema.TAG_STEP_KEY)
    done = run_cli("plan", "--preset", "tiny", env=probed_tiny.env())
    assert done.returncode == 0, done.stderr[-3000:]
    (planned,) = client.search_runs([exp], f"tags.`{schema.TAG_STAGE}` = 'plan'")
    assert schema.TAG_STEP_KEY not in planned.data.tags
    (verified,) = client.search_runs([exp], f"tags.`{schema.TAG_STAGE}` = 'verify'")
    assert schema.TAG_STEP_KEY in verified.data.tags  # no upstream: keyed as the study keys it


def test_a_deadline_already_passed_is_refused_before_any_step_runs():
    # Train would refuse it too, but only after prepare, verify, the probes and the plan.
    done = run_cli("study", "--preset", "tiny", "--set", "budget.deadline=2020-01-01T00:00:00Z", "--through", "train", "--arm", "control")
    assert done.returncode == 2, done.stderr[-3000:]
    assert done.stderr.strip().splitlines() == [
        "coopstudy study: error: budget.deadline 2020-01-01T00:00:00+00:00 has passed, and train-control would run after it; "
        "set a later deadline (--set budget.deadline=...) or none (--set budget.deadline=null)"
    ]
    assert "running" not in done.stdout
    client = mlflow.MlflowClient()
    assert not [r for e in client.search_experiments() for r in client.search_runs([e.experiment_id])]
