"""The equivalence gate: it passes on the real sources with real gloo ranks,
fails by name when the normalization is broken, and its receipt binds the
numerical sources and library versions."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from fixtures import ROOT
from mlflow import MlflowClient

from coopstudy import cli as cli_mod
from coopstudy import config
from coopstudy.commit import ledger, receipts, require, sources
from coopstudy.errors import RefusedError
from coopstudy.numerics import gate
from coopstudy.record import schema, store


def _gate_runs() -> list:
    client = MlflowClient(tracking_uri=store.tracking_uri())
    exp = client.get_experiment_by_name("coopstudy")
    return client.search_runs([exp.experiment_id], f"tags.`{schema.TAG_STAGE}` = '{schema.STAGE_VERIFY}'")


def test_verify_passes_and_its_receipt_binds_the_numerical_sources(verified_tiny, tmp_path):
    done = verified_tiny.printed  # `python -m coopstudy verify --preset tiny` on the prepared store
    assert done.returncode == 0, done.stderr
    assert "gate passed" in done.stdout
    for case in gate.gate_cases():
        assert case.name[:20] in done.stdout

    entry = ledger.Ledger().latest(ledger.GATE, sources.GATE_SUBJECT)
    sha, files = sources.numerical_sources_sha256()
    assert entry.details["sources_sha256"] == sha and entry.details["sources"] == files
    assert entry.details["max_rel_error"] <= gate.TOLERANCE

    (run,) = _gate_runs()
    assert run.info.status == "FINISHED"
    assert run.data.tags[schema.TAG_GATE] == entry.digest
    assert run.data.tags[schema.TAG_COMMITMENT_PREFIX + ledger.GATE] == entry.digest
    assert run.data.metrics[schema.M_GATE_MAX_REL_ERROR] <= gate.TOLERANCE
    receipt = json.loads(Path(store.download_artifact(run.info.run_id, schema.ART_GATE_RECEIPT, tmp_path)).read_text())
    assert receipts.gate_receipt_digest(receipt) == entry.digest
    assert receipt["passed"] and receipt["libraries"] == sources.library_versions()
    assert {row["case"] for row in receipt["rows"]} == {c.name for c in gate.gate_cases()}
    assert {row["update"] for row in receipt["rows"]} == {1, 2}

    assert require.gate_receipt() == entry
    # The same sources elsewhere still match; one edited byte in a copy does not.
    copy = tmp_path / "sources"
    (copy / sources.NUMERICS).mkdir(parents=True)
    for name in sources.numerical_sources():
        shutil.copy(sources.PACKAGE / name, copy / name)
    assert require.gate_receipt(directory=copy) == entry
    with open(copy / "numerics/objective.py", "a") as fh:
        fh.write("\n")
    with pytest.raises(RefusedError, match=r"numerical sources changed since the gate receipt: numerics/objective.py; run `python -m coopstudy verify`"):
        require.gate_receipt(directory=copy)


def _divide_by_microbatch_weight() -> None:
    """The classic mistake: each microbatch normalized by its own weight."""
    from coopstudy.numerics import objective

    def broken(net, mb, total_weight, world_size):
        weighted_sum = net(mb.input_ids, mb.position_ids, mb.weights, mb.bounds)
        share = weighted_sum / mb.weights.sum()
        return share * world_size, share.detach()

    objective.microbatch_loss = broken


def test_the_gate_fails_and_names_quantity_and_case_when_normalization_is_broken():
    result = gate.run_gate(config.load("tiny"), rank_setup=_divide_by_microbatch_weight)
    assert not result.passed
    failing_cases = {row.case for row in result.rows if not row.passed}
    assert failing_cases == {c.name for c in gate.gate_cases()}
    message = "\n".join(result.failures)
    assert "case 'weights-on-one-rank', update 1, rank 0: loss (batched" in message
    assert "case 'partial-final-microbatch', update 1, rank 1: grad_norm (batched" in message
    assert "exp_avg model." in message and "differs by" in message


def _drop_document_bounds() -> None:
    """Packing without its mask: the row's documents attend to each other as
    one causal sequence (positions still restart per document)."""
    import dataclasses

    from coopstudy.numerics import batching

    real_pack = batching.pack

    def broken(documents, **kwargs):
        mb = real_pack(documents, **kwargs)
        return dataclasses.replace(mb, bounds=(0, mb.tokens))

    batching.pack = broken


def test_the_gate_fails_when_attention_crosses_the_documents_of_a_packed_row():
    result = gate.run_gate(config.load("tiny"), rank_setup=_drop_document_bounds)
    assert not result.passed
    failing_cases = {row.case for row in result.rows if not row.passed}
    # Only the case whose microbatches hold one document each cannot tell.
    assert failing_cases == {c.name for c in gate.gate_cases()} - {"one-document-microbatch"}
    assert "case 'adjacent-one-token-documents', update 1, rank 0: param model." in "\n".join(result.failures)


def test_no_receipt_means_training_is_refused():
    with pytest.raises(RefusedError, match=r"no gate receipt for the numerical sources in .*; run `python -m coopstudy verify`"):
        require.gate_receipt()


def test_a_receipt_from_other_library_versions_is_refused():
    sha, files = sources.numerical_sources_sha256()
    libs = sources.library_versions() | {"torch": "0.0.1"}
    ledger.Ledger().append(ledger.GATE, sources.GATE_SUBJECT, "0" * 64, {"sources_sha256": sha, "sources": files, "libraries": libs})
    with pytest.raises(RefusedError, match=r"library versions changed since the gate receipt: torch 0.0.1 -> "):
        require.gate_receipt()


def test_a_failed_gate_is_recorded_and_commits_nothing(monkeypatch, capsys):
    bad = gate.Row("unequal-lengths", 1, 0, {"param": 0.0, "exp_avg": 0.0, "exp_avg_sq": 0.0, "loss": 0.5, "grad_norm": 0.0},
                   {"param": "", "exp_avg": "", "exp_avg_sq": "", "loss": "batched 2, reference 1", "grad_norm": ""})  # fmt: skip
    monkeypatch.setattr(gate, "run_gate", lambda cfg: gate.GateResult(rows=[bad], seconds=0.1, failures=gate._failure(bad)))
    assert cli_mod.main(["verify", "--preset", "tiny"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (
        "coopstudy verify: error: equivalence gate failed: case 'unequal-lengths', update 1, rank 0: "
        "loss (batched 2, reference 1) differs by 0.5 relative (tolerance 1e-09)"
    )
    assert ledger.Ledger().latest(ledger.GATE, sources.GATE_SUBJECT) is None
    (run,) = _gate_runs()
    assert run.info.status == "FAILED"
    assert run.data.metrics[schema.M_GATE_MAX_REL_ERROR] == 0.5


def test_a_learning_rate_that_diverges_is_said_as_such_not_as_a_failed_gate(cli):
    # Before: "equivalence gate failed: ... differs by inf relative", as if the numerics were broken.
    done = cli("verify", "--preset", "tiny", "--set", "train.lr=1e30")
    assert (done.returncode, done.stderr.strip().splitlines()) == (2, [
        "coopstudy verify: error: the gate's updates diverged (case 'unequal-lengths', update 2: grad_norm nan) "
        "at learning rate train.lr=1e+30; try a lower learning rate"
    ]), done.stderr[-3000:]
    assert ledger.Ledger().latest(ledger.GATE, sources.GATE_SUBJECT) is None


def test_verify_help_says_what_the_gate_checks():
    from coopstudy.steps import verify

    text = " ".join(verify.DESCRIPTION.split())
    assert f"relative error of {gate.TOLERANCE:.0e}" in text
    assert ", ".join(c.name for c in gate.gate_cases()) in text
    assert ", ".join(Path(name).name for name in sources.numerical_sources()) in text and repr(sources.GATE_SUBJECT) in text


def _gate_ranks(stage: subprocess.Popen) -> list[psutil.Process]:
    found = []
    for proc in psutil.Process(stage.pid).children():
        try:
            if "spawn_main" in " ".join(proc.cmdline()):
                found.append(proc)
        except psutil.Error:
            continue
    return found


def test_a_stopped_verify_leaves_no_gate_rank_computing(tmp_path):
    # A SIGTERM reaches the stage alone: its gate ranks computed on, their folder gone.
    log = tmp_path / "verify.log"
    with open(log, "w") as out:
        stage = subprocess.Popen([sys.executable, "-m", "coopstudy", "verify", "--preset", "tiny"], cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        ranks = _gate_ranks(stage)
        while len(ranks) < gate.WORLD_SIZE and time.monotonic() < deadline and stage.poll() is None:
            time.sleep(0.1)
            ranks = _gate_ranks(stage)
        assert len(ranks) == gate.WORLD_SIZE, log.read_text()[-3000:]
        time.sleep(2)  # inside the gate's wait for them
        stage.send_signal(signal.SIGTERM)
        stage.wait(timeout=60)
    finally:
        if stage.poll() is None:
            stage.kill()
            stage.wait()
    # Gone with the stage, not left to finish their cases on their own.
    _, alive = psutil.wait_procs(ranks, timeout=1)
    assert not alive, alive
    assert stage.returncode == 128 + signal.SIGTERM, log.read_text()[-3000:]
    assert log.read_text().strip().splitlines()[-1] == "coopstudy verify: stopped by SIGTERM"
