"""Reproducible to the byte on CPU: the tiny study run twice from scratch (a
fresh COOPSTUDY_HOME and a fresh SQLite store each, the seed made again) gives
the same prepared inputs, the same final weights for both arms and the same
quality screens in report.json. Only timings may differ: the speed screens and
the seconds beside them are measurements of the machine, not of the study.

Two whole studies, one after the other (the compressed arm needs both cores).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from fixtures import ROOT

pytestmark = pytest.mark.slow

TIMED = ("active_speedup", "complete_speedup")
"""Screens whose estimate is a ratio of seconds."""


def _study(base: Path) -> dict:
    home, db = base / "home", base / "mlflow.db"
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_RUN_ID"}
    env |= {"COOPSTUDY_HOME": str(home), "MLFLOW_TRACKING_URI": f"sqlite:///{db}"}
    done = subprocess.run(
        [sys.executable, "-m", "coopstudy", "study", "--preset", "tiny"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    (report_file,) = (home / "reports").glob("*/report.json")
    ledger = [json.loads(line) for line in (home / "ledger.jsonl").read_text().splitlines()]
    (inputs,) = [e for e in ledger if e["kind"] == "inputs"]
    (folder,) = (home / "prepared").iterdir()
    return {
        "inputs": inputs["digest"],
        "manifest": json.loads((folder / "manifest.json").read_text()),
        "seeds": sorted(p.name for p in (home / "seeds").iterdir()),
        "report": json.loads(report_file.read_text()),
    }


def _without_runs(value):
    """The value with every run id left out: runs are named by the store, not by the study."""
    if isinstance(value, dict):
        return {k: _without_runs(v) for k, v in value.items() if k not in ("run_id", "run_ids", "prepare_run")}
    if isinstance(value, list):
        return [_without_runs(v) for v in value]
    return value


def test_two_tiny_studies_from_scratch_agree_on_every_digest_and_screen(tmp_path):
    first, second = _study(tmp_path / "one"), _study(tmp_path / "two")

    assert first["seeds"] == second["seeds"]
    assert first["inputs"] == second["inputs"]
    assert first["manifest"] == second["manifest"]  # every prepared file's sha256, the seed's included
    a, b = first["report"], second["report"]
    assert a["candidates"] == b["candidates"], "the final weights of both arms hash the same"
    assert a["inputs"]["sha256"] == b["inputs"]["sha256"] == first["inputs"]

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
