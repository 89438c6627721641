"""Where the record goes, and what every run carries."""

from __future__ import annotations

import mlflow
import pytest

from coopstudy import config
from coopstudy.errors import UserError
from coopstudy.record import schema, store, writer


def test_uri_precedence(monkeypatch, tmp_path):
    remote = tmp_path / "mlruns_remote.txt"
    remote.write_text("# comment\n\nhttp://127.0.0.1:5999\n")
    monkeypatch.setattr(store, "REMOTE_FILE", remote)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "sqlite:///x.db")
    assert store.tracking_uri() == "sqlite:///x.db"
    monkeypatch.delenv("MLFLOW_TRACKING_URI")
    assert store._uri_from_file(remote) == "http://127.0.0.1:5999"


def test_blank_remote_file_means_mlflow_default(monkeypatch, tmp_path):
    remote = tmp_path / "mlruns_remote.txt"
    remote.write_text("# nothing here\n")
    monkeypatch.delenv("MLFLOW_TRACKING_URI")
    monkeypatch.setattr(store, "REMOTE_FILE", remote)
    assert store.tracking_uri() == f"sqlite:///{store.PROJECT_ROOT / 'mlflow.db'}"


def test_credentials_in_uri_refused(monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://alice:secret@example.org")
    with pytest.raises(UserError, match="MLFLOW_TRACKING_USERNAME"):
        store.tracking_uri()


def test_stage_run_records_config_and_tags():
    cfg = config.load("tiny")
    with writer.stage_run(schema.STAGE_PREPARE, cfg) as rec:
        rec.log_metrics({"x": 1.0}, step=3)
    run = mlflow.MlflowClient().get_run(rec.run_id)
    assert run.info.status == "FINISHED"
    assert run.data.tags[schema.TAG_STAGE] == "prepare"
    assert run.data.tags[schema.TAG_PRESET] == "tiny"
    assert run.data.params == config.flatten(cfg)
    assert run.data.tags[schema.TAG_CONFIG_SHA] == store.config_sha256(cfg)


def test_failed_stage_is_kept_with_its_error():
    cfg = config.load("tiny")
    with pytest.raises(UserError):
        with writer.stage_run(schema.STAGE_TRAIN, cfg, arm="control") as rec:
            raise UserError("bad input: nothing to train on")
    run = mlflow.MlflowClient().get_run(rec.run_id)
    assert run.info.status == "FAILED"
    assert run.data.tags[schema.TAG_ERROR] == "bad input: nothing to train on"
    assert run.data.tags[schema.TAG_ARM] == "control"


def test_nested_stage_is_a_child():
    cfg = config.load("tiny")
    with writer.stage_run(schema.STAGE_STUDY, cfg) as parent:
        with writer.stage_run(schema.STAGE_PREPARE, cfg) as child:
            pass
    run = mlflow.MlflowClient().get_run(child.run_id)
    assert run.data.tags["mlflow.parentRunId"] == parent.run_id


def test_readme_documents_every_name_of_the_record():
    readme = (store.PROJECT_ROOT / "README.md").read_text()
    names = {k: v for k, v in vars(schema).items() if k.split("_")[0] in ("TAG", "M", "ART", "PARAM") and isinstance(v, str)}
    assert names
    missing = sorted(k for k, v in names.items() if f"`{v}`" not in readme)
    assert missing == [], f"README's schema lacks {missing}"
