"""The whole study on `tiny`, as a user runs it, in a copy of the checkout:
`mlflow run . -e train` on a fresh store runs the steps train needs first,
`study` finishes the rest, a second `study` reuses every step, touching a
numerical source reruns verify and what follows it, and `report` alone
rebuilds the same report.json from the tracking store."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import mlflow
import pytest

from coopstudy import config, study
from coopstudy.commit import sources
from coopstudy.record import schema

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


def _checkout_copy(dst: Path) -> Path:
    files = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    for rel in files:
        if (ROOT / rel).is_file():
            (dst / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / rel, dst / rel)
    return dst


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
        return self.run(sys.executable, "-m", "coopstudy", *args)

    def runs(self, stage: str) -> list:
        client = mlflow.MlflowClient(tracking_uri=self.env["MLFLOW_TRACKING_URI"])
        exp = client.get_experiment_by_name("coopstudy")
        return client.search_runs([exp.experiment_id], f"tags.`{schema.TAG_STAGE}` = '{stage}'")


def _steps(out: str, verb: str) -> list[str]:
    """The steps a study printed as `running` or as `reused`, in order."""
    marker = ": running" if verb == "running" else ": reused run "
    return [line.split(":")[1].strip() for line in out.splitlines() if line.startswith("study: ") and marker in line]


@pytest.fixture(scope="module")
def copy(tmp_path_factory, tiny_seed_home) -> Copy:
    base = tmp_path_factory.mktemp("study")
    root = _checkout_copy(tmp_path_factory.mktemp("checkout"))
    # The tiny seed is made once per session; a fresh clone would make it in prepare.
    shutil.copytree(tiny_seed_home, base / "home")
    return Copy(root, base)


@pytest.fixture(scope="module")
def first(copy):
    train = copy.run("mlflow", "run", ".", "-e", "train", "--env-manager", "local", "-P", "preset=tiny")
    assert train.returncode == 0, train.stdout[-3000:] + train.stderr[-3000:]
    rest = copy.coopstudy("study", "--preset", "tiny")
    assert rest.returncode == 0, rest.stdout[-3000:] + rest.stderr[-3000:]
    return train, rest


def test_train_entry_point_runs_what_train_needs_first(first, copy):
    train, _ = first
    out = train.stdout
    assert _steps(out, "running") == ["prepare", "verify", "probe", "plan", "train-control", "train-compressed"]
    arms = {r.data.tags[schema.TAG_ARM]: r for r in copy.runs("train")}
    assert set(arms) == {"control", "compressed"}
    assert all(r.info.status == "FINISHED" for r in arms.values())


def test_study_finishes_with_the_remaining_steps(first, copy):
    _, rest = first
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


def test_touching_a_numerical_source_reruns_verify_and_after(first, copy):
    source = copy.root / "src" / "coopstudy" / "numerics" / "objective.py"
    source.write_text(source.read_text() + "\n# touched\n")
    touched = copy.coopstudy("study", "--preset", "tiny", "--through", "verify")
    assert touched.returncode == 0, touched.stderr[-3000:]
    assert _steps(touched.stdout, "reused") == ["prepare"]
    assert _steps(touched.stdout, "running") == ["verify"]
    # Every later step's key chains from verify's, so all of them rerun too
    # (test_upstream_change_changes_every_later_key); training refuses meanwhile.
    refused = copy.coopstudy("train", "--preset", "tiny", "--arm", "control")
    assert refused.returncode == 2
    assert "objective.py" in refused.stderr


def test_upstream_change_changes_every_later_key():
    cfg = config.load("tiny")
    keys: dict[str, str] = {}
    for step in study.STEPS:
        keys[step.name] = study.step_key(step, cfg, keys)
    changed = dict(keys, verify="0" * 64)
    after_verify = {s.name for s in study.STEPS[study.STEP_NAMES.index("verify") + 1 :]}
    redone: dict[str, str] = {"prepare": keys["prepare"], "verify": changed["verify"]}
    for step in study.STEPS[2:]:
        redone[step.name] = study.step_key(step, cfg, redone)
    assert {n for n in after_verify if redone[n] != keys[n]} == after_verify


def test_every_module_belongs_to_a_step():
    # Derived from imports, so nothing the study runs can change without a step noticing.
    claimed = {rel for step in study.STEPS for rel in study.step_sources(step)}
    tools = set(sources.closure("coopstudy.cli", "coopstudy.bench", "coopstudy.study", "coopstudy.__main__"))
    root = sources.PACKAGE.parents[1]
    modules = {str(p.relative_to(root)) for p in sources.PACKAGE.rglob("*.py")}
    assert modules - claimed - {"src/coopstudy/cli.py", "src/coopstudy/bench.py", "src/coopstudy/study.py", "src/coopstudy/__main__.py"} == set()
    assert modules <= claimed | tools
    assert "src/coopstudy/run/worker.py" in study.step_sources(study.STEPS[study.STEP_NAMES.index("train-control")])
    assert {f"analysis/{m}.py" for m in ("records", "report", "screens", "stats")} <= set(study.step_sources(study.STEPS[-1]))
