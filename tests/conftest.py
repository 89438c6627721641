"""Every test runs against its own tracking store and workspace, so tests
never see each other's runs or the user's record."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

# The shared fixtures and helpers live in fixtures.py (the store isolation of
# every test is below); importing them here is what makes them fixtures of every test (pytest's own plugin named "fixtures"
# shadows a `pytest_plugins` entry of that name).
from fixtures import *  # noqa: F401,F403,E402
from fixtures import run_cli


@pytest.fixture(scope="session")
def _migrated_db(tmp_path_factory) -> Path:
    # Creating an MLflow SQLite store runs its schema migrations (seconds);
    # do it once and give each test a copy.
    import mlflow

    path = tmp_path_factory.mktemp("template") / "mlflow.db"
    mlflow.MlflowClient(tracking_uri=f"sqlite:///{path}").search_experiments()
    return path


@pytest.fixture(autouse=True)
def isolated_store(tmp_path_factory, monkeypatch, _migrated_db):
    import mlflow

    # A stage run in-process leaves MLflow's global tracking URI on the last
    # test's store; forget it so this test's environment decides.
    mlflow.set_tracking_uri(None)
    base = tmp_path_factory.mktemp("store")
    shutil.copy(_migrated_db, base / "mlflow.db")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{base / 'mlflow.db'}")
    monkeypatch.setenv("COOPSTUDY_HOME", str(base / "home"))
    monkeypatch.delenv("MLFLOW_RUN_ID", raising=False)
    # The runs whose end an in-process stage kept are this test's to name, not an earlier one's.
    from coopstudy.record import writer

    monkeypatch.setattr(writer, "_ENDS_KEPT", [])
    return base


@pytest.fixture
def cli():
    return run_cli


ENV_ONLY_GPU_SKIPS = "COOPSTUDY_ONLY_GPU_SKIPS"
"""Set by .ci/run, which installs what the other tests need (Chromium, iproute2):
there a test that skips for any reason but a missing GPU fails, so a failed
install or a machine that cannot mount or join namespaces cannot pass CI unseen."""


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if not (report.skipped and os.environ.get(ENV_ONLY_GPU_SKIPS)) or hasattr(report, "wasxfail"):
        return
    reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
    if "CUDA" not in reason and "GPU" not in reason:
        report.outcome = "failed"
        report.longrepr = f"skipped where only a missing GPU may skip a test ({ENV_ONLY_GPU_SKIPS} is set): {reason}"
