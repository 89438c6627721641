"""Fixtures for tests that need the tiny seed model or prepared tiny inputs.

Each is made once per session (making the tiny seed reads the SmolLM2
tokenizer out of a GGUF file, seconds); a test gets its own copy of the
workspace and tracking store, so it may change or break them freely.
Load them with `pytest_plugins = ["fixtures_prepare"]` (once, in conftest).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import run_cli

from coopstudy import config
from coopstudy.inputs.seed import Seed, resolve_seed

# Test modules that import these fixtures each get their own session-scoped
# copy of them; this keeps the work itself to once per session.
_made: dict[str, object] = {}


@dataclass(frozen=True)
class PreparedStore:
    home: Path
    """COOPSTUDY_HOME: seeds/, prepared/, ledger.jsonl."""
    db: Path
    """The MLflow SQLite store the prepare run was recorded in."""
    first_run: subprocess.CompletedProcess
    """What `prepare --preset tiny` printed when it wrote the inputs."""

    @property
    def tracking_uri(self) -> str:
        return f"sqlite:///{self.db}"


@pytest.fixture(scope="session")
def tiny_seed_home(tmp_path_factory) -> Path:
    """A workspace holding only the tiny preset's seed model."""
    if "seed" not in _made:
        home = tmp_path_factory.mktemp("tiny-seed") / "home"
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("COOPSTUDY_HOME", str(home))
            resolve_seed(config.load("tiny"))
        _made["seed"] = home
    return _made["seed"]  # type: ignore[return-value]


@pytest.fixture
def tiny_seed(tiny_seed_home) -> Seed:
    """The tiny seed, copied into this test's workspace."""
    shutil.copytree(tiny_seed_home / "seeds", Path(os.environ["COOPSTUDY_HOME"]) / "seeds", dirs_exist_ok=True)
    return resolve_seed(config.load("tiny"))


@pytest.fixture(scope="session")
def prepared_tiny_store(tiny_seed_home, tmp_path_factory) -> PreparedStore:
    """`python -m coopstudy prepare --preset tiny`, run once, as a user runs it."""
    if "prepared" not in _made:
        base = tmp_path_factory.mktemp("prepared-tiny")
        home, db = base / "home", base / "mlflow.db"
        shutil.copytree(tiny_seed_home, home)
        result = run_cli("prepare", "--preset", "tiny", env={"MLFLOW_TRACKING_URI": f"sqlite:///{db}", "COOPSTUDY_HOME": str(home)})
        assert result.returncode == 0, result.stderr
        _made["prepared"] = PreparedStore(home, db, result)
    return _made["prepared"]  # type: ignore[return-value]


@pytest.fixture
def prepared_tiny(prepared_tiny_store, tmp_path, monkeypatch) -> PreparedStore:
    """This test's own copy of the prepared tiny store, with the environment pointing at it."""
    home = tmp_path / "home"
    db = tmp_path / "mlflow.db"
    shutil.copytree(prepared_tiny_store.home, home)
    shutil.copy(prepared_tiny_store.db, db)
    store = PreparedStore(home, db, prepared_tiny_store.first_run)
    monkeypatch.setenv("COOPSTUDY_HOME", str(home))
    monkeypatch.setenv("MLFLOW_TRACKING_URI", store.tracking_uri)
    return store
