"""The two predetermined final candidates: each arm's final checkpoint of the
planned run, committed once, by the sha256 of its weights.

`final_candidates` finds the first FINISHED train run of each arm under the
plan (the planned one: train refuses an arm that finished under it) and
re-hashes its checkpoint against the hash that run recorded; `commit` appends both to the ledger (kind candidate, subject
`<plan sha>/<arm>`); the select step mirrors them on its run in between, so
the record holds every selection the ledger does. Only FINISHED runs are
candidates: a run interrupted, stopped or killed (KILLED or FAILED), or one
whose stage died with it (left RUNNING), never is, whatever it left on disk.
`require.selection` gives the committed candidates back after re-hashing
the weights on disk. Weights gone from disk are brought back from their train
run's checkpoint artifact first (`weights_sha256`): the record keeps what a
full disk or a clean-up may take; weights that changed are refused.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from coopstudy import errors, workspace
from coopstudy.commit import ledger as ledger_mod
from coopstudy.config import ARMS, BOTH, Config
from coopstudy.errors import RefusedError
from coopstudy.record import schema, store


@dataclass(frozen=True)
class Candidate:
    arm: str
    sha256: str
    path: Path
    """The checkpoint directory (Hugging Face format)."""
    train_run_id: str


@dataclass(frozen=True)
class Selection:
    candidates: dict[str, Candidate]
    select_run_id: str


def subject(plan_sha: str, arm: str) -> str:
    return f"{plan_sha}/{arm}"


def when(seconds: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(seconds))


def weights_sha256(cand: Candidate, what: str) -> str:
    """The sha256 of the candidate's weights on disk, brought back first from
    its train run's checkpoint artifact where they are gone."""
    weights = cand.path / workspace.WEIGHTS_FILE
    if not weights.is_file():
        return _restore(cand, f"{what}: the checkpoint weights {weights} are missing")
    return workspace.sha256_file(weights)


def _restore(cand: Candidate, missing: str) -> str:
    """The train run's checkpoint artifact in place of `cand.path`, whole (a
    folder left without its weights goes), when its weights are the ones the
    candidate names: their sha256. Refused, saying `missing` first, otherwise."""
    artifact = f"the `{schema.ART_CHECKPOINT}` artifact of train run {cand.train_run_id}"
    # Said first: a large model's folder takes minutes to come from a server.
    print(f"{missing}: bringing the folder back from {artifact}", flush=True)
    try:
        cand.path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(prefix=".restoring-", dir=cand.path.parent) as tmp:
            try:
                got = store.download_artifact(cand.train_run_id, schema.ART_CHECKPOINT, tmp)
            except Exception as err:  # noqa: BLE001 - none there, or the store did not answer: the same refusal
                raise RefusedError(f"{missing}, and {artifact} could not be read ({errors.first_line(err)})") from None
            if not (got / workspace.WEIGHTS_FILE).is_file():
                raise RefusedError(f"{missing}, and {artifact} holds none")
            actual = workspace.sha256_file(got / workspace.WEIGHTS_FILE)
            if actual != cand.sha256:
                raise RefusedError(f"{missing}, and those of {artifact} hash to {actual[:12]}, not {cand.sha256[:12]}")
            if cand.path.exists():
                shutil.rmtree(cand.path)
            os.replace(got, cand.path)
    except OSError as err:
        if err.errno in errors.FULL_DISK:
            raise  # said as a full disk, in one line, by the CLI
        raise RefusedError(f"{missing}, and they cannot be written back there ({err.strerror or err})") from None
    return actual


def _train_runs(cfg: Config, plan_sha: str, arm: str) -> list:
    """The arm's train runs under the plan, newest first."""
    return store.search_runs(
        cfg.experiment,
        f"tags.`{schema.TAG_STAGE}` = '{schema.STAGE_TRAIN}' and tags.`{schema.TAG_ARM}` = '{arm}' "
        f"and tags.`{schema.TAG_PLAN}` = '{plan_sha}'",
    )


def first_finished(cfg: Config, plan_sha: str, arm: str):
    """The arm's first FINISHED train run under the plan, or None: the planned
    run, whose final weights are the arm's predetermined candidate. A run that
    finished after it was trained again once the first was known; it is an
    attempt on the report, never the candidate."""
    finished = [r for r in _train_runs(cfg, plan_sha, arm) if r.info.status == "FINISHED"]
    return finished[-1] if finished else None


def first_evaluation(cfg: Config, plan_sha: str):
    """The plan's first FINISHED evaluate run (the parent of a child per model
    it scored; coopstudy.scored_by.<model> names those an earlier one had), or
    None. Its scores are the ones the screens read: the scoring code is the
    plan's, so a later evaluation could only be a try for other numbers."""
    finished = [
        r
        for r in store.search_runs(
            cfg.experiment,
            f"tags.`{schema.TAG_STAGE}` = '{schema.STAGE_EVALUATE}' and tags.`{schema.TAG_PLAN}` = '{plan_sha}' "
            "and attributes.status = 'FINISHED'",
            order_by=("attributes.start_time ASC",),
        )
        if schema.TAG_MODEL not in r.data.tags
    ]
    return finished[0] if finished else None


def first_model_evaluation(cfg: Config, plan_sha: str, model: str, weights_sha256: str):
    """The first FINISHED evaluate child run that scored `model`'s weights under
    the plan, whatever became of its parent, or None: the one the report reads."""
    found = store.search_runs(
        cfg.experiment,
        f"tags.`{schema.TAG_STAGE}` = '{schema.STAGE_EVALUATE}' and tags.`{schema.TAG_PLAN}` = '{plan_sha}' "
        f"and tags.`{schema.TAG_MODEL}` = '{model}' and tags.`{schema.TAG_CHECKPOINT_SHA}` = '{weights_sha256}' "
        "and attributes.status = 'FINISHED'",
        order_by=("attributes.start_time ASC",),
    )
    return found[0] if found else None


def final_train_runs(cfg: Config, plan_sha: str) -> dict[str, Candidate]:
    """Each arm's first FINISHED train run under the plan, as a candidate;
    refuses, naming every arm, when one has not finished."""
    found: dict[str, Candidate] = {}
    problems = []
    todo = []  # arms with no finished run: those that can still train under the plan
    for arm in ARMS:
        run = first_finished(cfg, plan_sha, arm)
        if run is None:
            todo.append(arm)
            runs = _train_runs(cfg, plan_sha, arm)
            problems.append(
                f"arm {arm} has not finished (its newest train run {runs[0].info.run_id} is {runs[0].info.status})"
                if runs
                else f"arm {arm} has no train run"
            )
            continue
        sha, path = run.data.tags.get(schema.TAG_CHECKPOINT_SHA), run.data.tags.get(schema.TAG_CHECKPOINT_PATH)
        if not sha or not path:
            problems.append(f"arm {arm}: train run {run.info.run_id} records no final checkpoint")
            continue
        found[arm] = Candidate(arm, sha, Path(path), run.info.run_id)
    if problems:
        # An arm whose finished run recorded no checkpoint cannot train again under the plan.
        hint = f"train first: `python -m coopstudy train {cfg.arguments} --arm {todo[0] if len(todo) == 1 else BOTH}`" if todo else None
        raise RefusedError(f"{'; '.join(problems)} (plan {plan_sha[:12]})", hint=hint)
    return found


def committed(plan_sha: str, ledger: ledger_mod.Ledger) -> list[ledger_mod.Entry]:
    """Candidate entries of this plan, oldest first, after comparing the
    ledger's commitments with the record (ledger.Ledger.check_record)."""
    prefix = subject(plan_sha, "")
    entries = ledger.entries()
    ledger.check_record(entries)
    return [e for e in entries if e.kind == ledger_mod.CANDIDATE and e.subject.startswith(prefix)]


def _refuse_if_selected(plan_sha: str, ledger: ledger_mod.Ledger) -> None:
    earlier = committed(plan_sha, ledger)
    if earlier:
        first = earlier[0]
        raise RefusedError(
            f"the final candidates of plan {plan_sha[:12]} were already selected at {when(first.time)} "
            f"by select run {first.details.get('select_run_id')}; a selection is made once"
        )


def final_candidates(cfg: Config, plan_sha: str, ledger: ledger_mod.Ledger) -> dict[str, Candidate]:
    """Each arm's final checkpoint, its weights re-hashed against what its
    train run recorded; refused when this plan's candidates were already selected."""
    _refuse_if_selected(plan_sha, ledger)
    found = final_train_runs(cfg, plan_sha)
    for arm, cand in found.items():
        actual = weights_sha256(cand, f"arm {arm}")
        if actual != cand.sha256:
            raise RefusedError(
                f"arm {arm}: the weights in {cand.path} hash to {actual[:12]}, but train run {cand.train_run_id} "
                f"recorded {cand.sha256[:12]}: the checkpoint changed after training",
                hint=f"delete {cand.path} to have it brought back from that run's `{schema.ART_CHECKPOINT}` artifact "
                "(an arm trains once per plan: without it, this plan has no candidate for the arm)",
            )
    return found


def commit(cfg: Config, plan_sha: str, found: dict[str, Candidate], select_run_id: str, ledger: ledger_mod.Ledger) -> None:
    """Append both candidates in one write, unless another select committed
    this plan's first: the caller holds the ledger's lock (Ledger.locked) from
    its check on."""
    _refuse_if_selected(plan_sha, ledger)
    ledger.extend(
        [
            (
                ledger_mod.CANDIDATE,
                subject(plan_sha, arm),
                found[arm].sha256,
                {"arm": arm, "path": str(found[arm].path), "train_run_id": found[arm].train_run_id, "select_run_id": select_run_id, "preset": cfg.preset},
            )
            for arm in ARMS
        ]
    )
