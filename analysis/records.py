"""The record of one study, read back from MLflow into tidy tables.

Only reads: run search, metric histories, table artifacts and the manifest of
the prepare run whose inputs the train runs required. One study is the
set of runs that carry one plan sha (`--plan`) or, before a plan exists, one
config sha. Of the selection the newest FINISHED run counts; of each train
arm, the run whose weights the selection names (a selection that names none is
refused); of each evaluated model, the first FINISHED run under the
selection's plan. Every row of every table keeps the
run id it came from, so each number in the report traces back to its run.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

import pandas as pd

from analysis.screens import RETENTION_COLUMNS, evaluate_role, train_role
from coopstudy.commit import budget, ledger, sources
from coopstudy.config import ARMS, Config
from coopstudy.errors import RefusedError, UserError
from coopstudy.record import schema, store

MODELS = (schema.MODEL_NAME_SEED, *ARMS)
"""The models evaluate scores: the seed every arm starts from, and the two candidates."""

# Tidy column -> tracked metric name; the tables speak the analysis' names,
# the store speaks tracking's.
UPDATE_METRICS = {
    "loss": schema.M_LOSS,
    "grad_norm": schema.M_GRAD_NORM,
    "lr": schema.M_LR,
    "update_seconds": schema.M_UPDATE_SECONDS,
    "tokens": schema.M_TOKENS,
    "bytes": schema.M_BYTES,
    "forward_backward_seconds": schema.M_FORWARD_BACKWARD_SECONDS,
    "comm_seconds": schema.M_COMM_SECONDS,
    "comm_arithmetic_seconds": schema.M_COMM_ARITHMETIC_SECONDS,
    "optimizer_seconds": schema.M_OPTIMIZER_SECONDS,
    "other_seconds": schema.M_OTHER_SECONDS,
    "system_seconds": schema.M_SYSTEM_SECONDS,
    "new_memory_mb": schema.M_NEW_MEMORY_MB,
    "ready_memory_mb": schema.M_READY_MEMORY_MB,
    "record_seconds": schema.M_RECORD_SECONDS,
}
BREAKDOWN = ("forward_backward_seconds", "comm_seconds", "optimizer_seconds", "other_seconds", "record_seconds")
"""Where rank 0's seconds of an update went (update_seconds is the first four; recording is outside it)."""
BREAKDOWN_JSON = ("update_seconds", *BREAKDOWN, "comm_arithmetic_seconds", "system_seconds")
"""What report.json's breakdown holds per phase and arm: the update, its parts, the part of comm that is
PowerSGD's arithmetic, and the operating system's seconds across the parts. report.md's table leaves the
last two out: the run's description is report.md, and MLflow keeps at most 8,000 characters of it."""
RUN_METRICS = {
    "active_seconds": schema.M_ACTIVE_SECONDS,
    "complete_seconds": schema.M_COMPLETE_SECONDS,
    "rendezvous_seconds": schema.M_RENDEZVOUS_SECONDS,
    "checkpoint_seconds": schema.M_CHECKPOINT_SECONDS,
    "device_seconds": schema.M_DEVICE_SECONDS,
    "bytes_dense": schema.M_BYTES_DENSE,
    "bytes_compressed": schema.M_BYTES_COMPRESSED,
    "bytes_total": schema.M_BYTES_TOTAL,
    "bytes_setup": schema.M_BYTES_SETUP,
    "peak_rss_mb": schema.M_PEAK_RSS_MB,
    "cost_usd": schema.M_COST_USD,
    "others_cores": schema.M_OTHERS_CORES,
    "steal_seconds": schema.M_STEAL_SECONDS,
}
# The speed screens cannot be computed without these; the rest are reported
# beside the screens and may be absent (an arm that transmits nothing).
REQUIRED_RUN_METRICS = ("active_seconds", "complete_seconds")
CASE_COLUMNS = ("case_id", "family", "score")

_SHA = re.compile(r"^[0-9a-f]{64}$")
_SHORT_SHA = re.compile(r"^[0-9a-f]{12,63}$")


@dataclass(frozen=True)
class StudyKey:
    """The tag that groups one study's runs, and its value."""

    tag: str
    value: str

    @property
    def kind(self) -> str:
        return "plan" if self.tag == schema.TAG_PLAN else "config"

    @property
    def folder(self) -> str:
        """A short, stable folder name for this study's report."""
        return f"{self.kind}-{self.value[:12]}"

    def __str__(self) -> str:
        return f"{self.kind} sha {self.value}"


def check_plan_argument(plan: str) -> str:
    """`--plan` as hex digits, lower case; refused unless it is a sha256 or its first 12 or more digits."""
    plan = plan.strip().lower()
    # The value goes into a search filter: only hex digits may pass.
    if not (_SHA.match(plan) or _SHORT_SHA.match(plan)):
        raise UserError(f"--plan {plan!r}: expected the plan's sha256 (64 hex digits, or the first 12 or more)")
    return plan


def study_key(cfg: Config, plan: str | None) -> StudyKey:
    if plan is None:
        return StudyKey(schema.TAG_CONFIG_SHA, store.config_sha256(cfg))
    plan = check_plan_argument(plan)
    if _SHA.match(plan):
        return StudyKey(schema.TAG_PLAN, plan)
    # The 12 digits every step prints: the plan runs of the record say which sha they begin.
    runs = store.search_runs(cfg.experiment, f"tags.`{schema.TAG_PLAN}` LIKE '{plan}%' and tags.`{schema.TAG_STAGE}` = '{schema.STAGE_PLAN}'")
    found = sorted({r.data.tags[schema.TAG_PLAN] for r in runs})
    if len(found) != 1:
        where = f"in the record of experiment {cfg.experiment!r}"
        if found:
            raise UserError(f"--plan {plan}: {len(found)} plans ({', '.join(f[:16] for f in found)}) begin with it {where}; give more digits")
        raise UserError(f"--plan {plan}: no plan begins with it {where}; check the digits, and give the study's --preset and --set")
    return StudyKey(schema.TAG_PLAN, found[0])


@dataclass(frozen=True)
class Records:
    """One study's record as tidy tables."""

    key: StudyKey
    plan: str | None
    """The plan sha the runs carry, once a plan step has tagged them."""
    runs: dict[str, str]
    """Role ('train/control', 'select', 'evaluate/seed', ...) -> run id."""
    candidates: dict[str, str]
    """Arm -> sha256 of the final weights the select run committed."""
    updates: pd.DataFrame
    """One row per arm and update: arm, run_id, update, and UPDATE_METRICS' columns."""
    train: pd.DataFrame
    """One row per arm: arm, run_id, and RUN_METRICS' columns (NaN when not logged)."""
    cases: pd.DataFrame
    """One row per model and test case: model, run_id, case_id, family, score, correct."""
    retention: pd.DataFrame
    """One row per model and retention document: model, run_id, doc_id, tokens, nll_sum, mean_nll."""
    attempts: pd.DataFrame = field(default_factory=pd.DataFrame)
    """One row per train run under the study's plan (else its key), whatever
    its status, oldest first across the arms: arm, run_id, status, started and
    ended (ISO-8601 UTC; ended None while it runs), refused (FAILED by a
    RefusedError before it trained: the arm finished under the plan already, or
    the budget; a refusal before the plan is read tags no plan and is not
    here), active_seconds, complete_seconds, cost_usd (each NaN when not
    logged), timed (the run select took, whose seconds the screens use). Every
    attempt stays evidence: a speed screen is not rerun until it passes unseen."""
    elsewhere: pd.DataFrame = field(default_factory=pd.DataFrame)
    """One row per train run of the same preset outside the study (under another
    plan, else another config) that trained, finished or not (a refusal trained
    nothing and is left out), oldest first: arm, run_id,
    status, study (its plan sha, else its config sha), cost_usd (NaN when not
    logged). Never timed here, but named: a study that trained again under a new
    plan (a changed source or setting) does not hide the attempts before it."""
    evaluations: pd.DataFrame = field(default_factory=pd.DataFrame)
    """One row per evaluate run of a model under the study's plan (else its key),
    whatever its status, oldest first: model, run_id, status, weights (the
    sha256 it scored), accuracy (NaN when not logged), scored (the run whose
    tables the screens read)."""
    inputs: dict[str, Any] | None = None
    """What the prepare run that made the train runs' inputs says of them
    (INPUT_SECTIONS of its manifest, its run id and the inputs sha); None when
    the record holds no such run."""
    budget: dict[str, Any] | None = None
    """The budget the plan committed (price, allocation, deadline, the probes'
    cost, the projected cost of probes and both arms); None without a plan."""
    spent: dict[str, tuple[float, int]] = field(default_factory=dict)
    """Per stage of budget.SPENDING_STAGES, under the plan: (USD, runs that logged a
    cost), failed and stopped runs too (commit.budget.stage_spent, which the
    train guard sums as well); empty without a plan."""


SELECT_ROLE = "select"


def _finished(experiment: str, tags: dict[str, str], order: str = "DESC") -> list:
    """The FINISHED runs carrying `tags`, newest first (oldest first with order ASC)."""
    flt = " and ".join([f"tags.`{k}` = '{v}'" for k, v in tags.items()] + ["attributes.status = 'FINISHED'"])
    return store.search_runs(experiment, flt, order_by=(f"attributes.start_time {order}",))


def _newest_finished(experiment: str, tags: dict[str, str]):
    found = _finished(experiment, tags)
    return found[0] if found else None


def _selected_train_run(client, select_run, arm: str, key: StudyKey):
    """The train run select took for `arm`: FINISHED, under the study's key,
    and the one whose weights select committed, or a refusal."""
    tags = select_run.data.tags
    run_id = tags.get(schema.TAG_CANDIDATE_RUN_PREFIX + arm)
    if not run_id:
        raise RefusedError(
            f"select run {select_run.info.run_id} names no train run for arm {arm} (no {schema.TAG_CANDIDATE_RUN_PREFIX + arm} tag): "
            "the record disagrees with the selection, which is made once per plan; run the study under a new plan"
        )
    run = client.get_run(run_id)
    if run.info.status != "FINISHED" or run.data.tags.get(key.tag) != key.value:
        raise RefusedError(f"the select run names train run {run_id} for arm {arm}, but it is {run.info.status}, not a FINISHED run under {key}")
    stage, trained_arm = run.data.tags.get(schema.TAG_STAGE), run.data.tags.get(schema.TAG_ARM)
    if (stage, trained_arm) != (schema.STAGE_TRAIN, arm):
        # Arms swapped in select's tags, weights and all, would invert both speed screens.
        raise RefusedError(
            f"the select run names run {run_id} for arm {arm}, but it is a {stage} run of arm {trained_arm}: "
            "the record disagrees with the selection, which is made once per plan; run the study under a new plan"
        )
    trained, committed = run.data.tags.get(schema.TAG_CHECKPOINT_SHA), tags.get(schema.TAG_CANDIDATE_PREFIX + arm)
    if trained != committed:
        raise RefusedError(
            f"train run {run_id} of arm {arm} left weights {str(trained)[:12]}, but select run {select_run.info.run_id} "
            f"committed {str(committed)[:12]}: the record disagrees with the selection, which is made once per plan; "
            "run the study under a new plan"
        )
    return run


def _find_runs(client, experiment: str, key: StudyKey) -> tuple[dict[str, Any], dict[str, str]]:
    """The run of each role and the committed weights of each model (arm ->
    candidate, and the seed both arms started from), or a refusal naming
    every missing run."""
    base = {key.tag: key.value}
    runs: dict[str, Any] = {}
    missing: list[str] = []

    def take(role: str, run, what: str) -> None:
        if run is None:
            missing.append(f"no FINISHED {what}")
        else:
            runs[role] = run

    take(SELECT_ROLE, _newest_finished(experiment, base | {schema.TAG_STAGE: schema.STAGE_SELECT}), "select run")
    weights: dict[str, str] = {}
    plan: str | None = None
    if SELECT_ROLE in runs:
        select = runs[SELECT_ROLE]
        # The train run whose weights were selected, and so evaluated, is the
        # one to time: a later rerun of that arm is evidence, not the result.
        for arm in ARMS:
            sha = select.data.tags.get(schema.TAG_CANDIDATE_PREFIX + arm)
            if not sha:
                raise RefusedError(f"select run {select.info.run_id} commits no candidate for arm {arm}")
            weights[arm] = sha
            runs[train_role(arm)] = _selected_train_run(client, select, arm, key)
        weights[schema.MODEL_NAME_SEED] = _one_seed([runs[train_role(arm)] for arm in ARMS])
        plan = select.data.tags.get(schema.TAG_PLAN)
    # Each model's first finished evaluation of its committed weights under the
    # selection's plan (or, before plans, under none) is the result, as each
    # arm's first finished training is its candidate: the code that scores is
    # the plan's, so a later run could only be a try for other numbers (scoring
    # that is not repeatable); it is evidence, listed, as is a run of other weights.
    # Without a selection there are no committed weights to look for, nor a plan to look under.
    for model in MODELS if SELECT_ROLE in runs else ():
        tags = base | {schema.TAG_STAGE: schema.STAGE_EVALUATE, schema.TAG_MODEL: model}
        what = f"evaluate run for model {model}"
        if model in weights:
            tags[schema.TAG_CHECKPOINT_SHA] = weights[model]
            what += f" of its committed weights {weights[model][:12]}"
        found = _finished(experiment, tags, "ASC")
        take(evaluate_role(model), next((r for r in found if r.data.tags.get(schema.TAG_PLAN) == plan), None), what)
    if missing:
        raise RefusedError(f"under {key} in experiment {experiment!r}: {'; '.join(missing)}; run those steps first")
    return runs, weights


def _one_seed(train_runs: list[Any]) -> str:
    """The seed weights both selected train runs started from (the seed model's committed weights)."""
    seeds = {run.info.run_id: run.data.tags.get(schema.TAG_SEED_SHA) for run in train_runs}
    if len(set(seeds.values())) != 1 or None in seeds.values():
        said = ", ".join(f"{run_id} {str(sha)[:12]}" for run_id, sha in seeds.items())
        raise RefusedError(f"the selected train runs did not start from one recorded seed ({said}); the arms are not comparable")
    return next(iter(seeds.values()))


def _check_one_study(runs: dict[str, Any], cfg: Config) -> None:
    """The screens' thresholds come from the report's config, so it must be the study's."""
    own = store.config_sha256(cfg)
    for role, run in runs.items():
        sha = run.data.tags.get(schema.TAG_CONFIG_SHA)
        if sha != own:
            preset = run.data.tags.get(schema.TAG_PRESET)
            raise RefusedError(
                f"{role} run {run.info.run_id} was made with config sha {sha[:12] if sha else None} (preset {preset}), "
                f"this report's config is {own[:12]} (preset {cfg.preset}); call report with the study's preset and overrides"
            )


def _plan_of(runs: dict[str, Any], key: StudyKey) -> str | None:
    plans = sorted({p for run in runs.values() if (p := run.data.tags.get(schema.TAG_PLAN))})
    if len(plans) > 1:
        raise RefusedError(f"under {key} the runs read belong to {len(plans)} plans ({', '.join(plans)}); choose one with --plan")
    return plans[0] if plans else None


def _update_table(client, arm: str, run_id: str) -> pd.DataFrame:
    columns: dict[str, dict[int, float]] = {}
    for column, metric in UPDATE_METRICS.items():
        # Were a step logged twice, the value MLflow itself calls latest wins
        # (newest timestamp, then largest value), whatever order the store returns.
        history = sorted(client.get_metric_history(run_id, metric), key=lambda m: (m.timestamp, m.value))
        columns[column] = {m.step: m.value for m in history}
    frame = pd.DataFrame(columns).rename_axis("update").sort_index().reset_index()
    if frame.empty:
        raise RefusedError(f"train run {run_id} (arm {arm}) has no per-update metrics ({schema.M_LOSS})")
    frame.insert(0, "run_id", run_id)
    frame.insert(0, "arm", arm)
    return frame


def _study_runs(experiment: str, key: StudyKey, plan_sha: str | None, stage: str, by: str, values: tuple[str, ...]) -> Iterator[tuple[str, Any]]:
    """(value, run) for every run of `stage` under the study's plan (else under
    `key`) whose tag `by` holds each of `values`, oldest first: a config's
    earlier plans are other studies."""
    tag, value = (schema.TAG_PLAN, plan_sha) if plan_sha else (key.tag, key.value)
    for wanted in values:
        flt = f"tags.`{tag}` = '{value}' and tags.`{schema.TAG_STAGE}` = '{stage}' and tags.`{by}` = '{wanted}'"
        for run in store.search_runs(experiment, flt, order_by=("attributes.start_time ASC",)):
            yield wanted, run


def _attempts(experiment: str, key: StudyKey, plan_sha: str | None, timed: dict[str, str]) -> pd.DataFrame:
    """Every train run of each arm under the study (see Records.attempts)."""
    rows = [
        {"arm": arm, "run_id": run.info.run_id, "status": run.info.status, "started": _utc(run.info.start_time)}
        | {"ended": _utc(run.info.end_time) if run.info.end_time else None}
        | {"refused": run.info.status == "FAILED" and run.data.tags.get(schema.TAG_ERROR_KIND) == RefusedError.__name__}
        | {c: run.data.metrics.get(RUN_METRICS[c], float("nan")) for c in (*REQUIRED_RUN_METRICS, "cost_usd")}
        | {"timed": run.info.run_id == timed[arm]}
        for arm, run in _study_runs(experiment, key, plan_sha, schema.STAGE_TRAIN, schema.TAG_ARM, ARMS)
    ]
    # Oldest first across the arms (a stable sort: runs begun in one millisecond keep the arms' order),
    # so the table shows the order the arms trained in.
    rows.sort(key=lambda r: r["started"])
    return pd.DataFrame(rows, columns=["arm", "run_id", "status", "started", "ended", "refused", *REQUIRED_RUN_METRICS, "cost_usd", "timed"])


def _elsewhere(experiment: str, preset: str, key: StudyKey, plan_sha: str | None) -> pd.DataFrame:
    """Every train run of `preset` outside the study that trained (see Records.elsewhere)."""
    tag, value = (schema.TAG_PLAN, plan_sha) if plan_sha else (key.tag, key.value)
    # A run without the tag is left out by `!=`: a train run names its plan once it has read it, so one
    # without a plan was refused before (the device lock, a changed commitment) and trained nothing.
    # The preset is read from the tags, not put in the filter: it is a file's name.
    flt = f"tags.`{schema.TAG_STAGE}` = '{schema.STAGE_TRAIN}' and tags.`{tag}` != '{value}'"
    found = store.search_runs(experiment, flt, order_by=("attributes.start_time ASC",))
    rows = [
        {
            "arm": run.data.tags.get(schema.TAG_ARM), "run_id": run.info.run_id, "status": run.info.status,
            "study": run.data.tags.get(schema.TAG_PLAN) or run.data.tags.get(schema.TAG_CONFIG_SHA),
            "cost_usd": run.data.metrics.get(schema.M_COST_USD, float("nan")),
        }
        for run in found
        if run.data.tags.get(schema.TAG_PRESET) == preset and run.data.tags.get(schema.TAG_ARM) in ARMS
        and run.data.tags.get(schema.TAG_ERROR_KIND) != RefusedError.__name__  # refused under its plan: trained nothing
    ]  # fmt: skip
    return pd.DataFrame(rows, columns=["arm", "run_id", "status", "study", "cost_usd"])


def _utc(ms: int) -> str:
    """A run's start or end (MLflow's milliseconds) as ISO-8601 UTC to the millisecond, which sorts as it reads."""
    return datetime.fromtimestamp(ms / 1000, timezone.utc).isoformat(timespec="milliseconds")


def _evaluations(experiment: str, key: StudyKey, plan_sha: str | None, scored: dict[str, str]) -> pd.DataFrame:
    """Every evaluate run of each model under the study (see Records.evaluations)."""
    rows = [
        {
            "model": model, "run_id": run.info.run_id, "status": run.info.status,
            "weights": run.data.tags.get(schema.TAG_CHECKPOINT_SHA, ""),
            "accuracy": run.data.metrics.get(schema.M_ACCURACY, float("nan")), "scored": run.info.run_id == scored[model],
        }  # fmt: skip
        for model, run in _study_runs(experiment, key, plan_sha, schema.STAGE_EVALUATE, schema.TAG_MODEL, MODELS)
    ]
    return pd.DataFrame(rows, columns=["model", "run_id", "status", "weights", "accuracy", "scored"])


def _train_row(arm: str, run) -> dict[str, Any]:
    metrics = run.data.metrics
    missing = [RUN_METRICS[c] for c in REQUIRED_RUN_METRICS if RUN_METRICS[c] not in metrics]
    if missing:
        raise RefusedError(f"train run {run.info.run_id} (arm {arm}) lacks {', '.join(missing)}")
    return {"arm": arm, "run_id": run.info.run_id} | {c: metrics.get(m, float("nan")) for c, m in RUN_METRICS.items()}


def _read_table(run_id: str, artifact: str, columns: tuple[str, ...], what: str) -> pd.DataFrame:
    try:
        raw = store.artifact_json(run_id, artifact)
    except Exception as err:  # noqa: BLE001 - any store error means the same thing here
        raise RefusedError(f"{what} run {run_id} has no artifact {artifact} ({type(err).__name__})") from None
    # MLflow tables are {"columns": [...], "data": [[...], ...]}.
    frame = pd.DataFrame(raw["data"], columns=raw["columns"])
    absent = [c for c in columns if c not in frame.columns]
    if absent:
        raise RefusedError(f"{what} run {run_id}: {artifact} lacks column(s) {', '.join(absent)}")
    return frame


def _case_table(model: str, run_id: str) -> pd.DataFrame:
    what = f"evaluate (model {model})"
    frame = _read_table(run_id, schema.ART_TEST_TABLE, CASE_COLUMNS, what)
    # The pre-registered rule: correct means the verifier gave full credit.
    # Partial credit (0.5) is not correct, whatever else the table says.
    scores = pd.to_numeric(frame["score"], errors="coerce").astype(float)
    unscored = ~scores.between(0.0, 1.0)  # NaN, a missing score or one out of range: a verifier that failed
    if unscored.any():
        # Counted as wrong, a broken verifier of the seed would read as the arms' gain.
        first = frame[unscored].iloc[0]
        raise RefusedError(f"{what} run {run_id}: {int(unscored.sum())} case(s) have no score in [0, 1] (first: {first['case_id']}, "
                           f"family {first['family']}, score {first['score']!r}): a verifier failed; mend it, then run the study under a new plan (the first finished evaluation of the weights is the one read)")  # fmt: skip
    correct = scores >= 1.0
    if "correct" in frame.columns and not (frame["correct"].astype(bool) == correct).all():
        bad = int((frame["correct"].astype(bool) != correct).sum())
        raise RefusedError(f"{what} run {run_id}: {bad} case(s) marked correct without a score of 1.0, or the reverse")
    if frame["case_id"].duplicated().any():
        raise RefusedError(f"{what} run {run_id}: {schema.ART_TEST_TABLE} repeats case ids")
    out = frame[list(CASE_COLUMNS)].assign(correct=correct)
    out.insert(0, "run_id", run_id)
    out.insert(0, "model", model)
    return out


def _retention_table(model: str, run_id: str) -> pd.DataFrame:
    what = f"evaluate (model {model})"
    frame = _read_table(run_id, schema.ART_RETENTION_TABLE, RETENTION_COLUMNS, what)
    if frame["doc_id"].duplicated().any():
        raise RefusedError(f"{what} run {run_id}: {schema.ART_RETENTION_TABLE} repeats document ids")
    out = frame[list(RETENTION_COLUMNS)].copy()
    out.insert(0, "run_id", run_id)
    out.insert(0, "model", model)
    return out


def _check_paired(frame: pd.DataFrame, id_column: str, what: str) -> None:
    """Pairing needs every model scored on the same items (and, for NLL, the same tokens)."""
    ids = {model: set(group[id_column]) for model, group in frame.groupby("model")}
    reference = ids[MODELS[0]]
    for model, found in ids.items():
        if found != reference:
            raise RefusedError(
                f"{what}: model {model} was scored on {len(found)} items, seed on {len(reference)}, "
                f"{len(found ^ reference)} not shared; the models must be scored on the same set"
            )
    if id_column == "doc_id":
        tokens = frame.pivot(index="doc_id", columns="model", values="tokens")
        if not tokens.eq(tokens[MODELS[0]], axis=0).all().all():
            raise RefusedError(f"{what}: the models were scored on different token counts for the same documents")


INPUT_SECTIONS = ("conversations", "split", "checks", "counts")
"""The parts of the prepare run's manifest the report states: where replay and
retention come from, how they were split, the overlap checks, the counts."""


def _check_complete(cases: pd.DataFrame, retention: pd.DataFrame, inputs: dict[str, Any] | None) -> None:
    """Every test case and retention document prepare made is scored: tables cut
    short alike pair with each other, and the screens would judge a subset."""
    counts = (inputs or {}).get("counts") or {}
    for frame, what, key in ((cases, "final test", "test"), (retention, "retention probes", "retention")):
        made = counts.get(key)
        scored = int(frame.groupby("model").size().iloc[0])  # the same for every model, once paired
        if made is not None and scored != made:
            raise RefusedError(
                f"{what}: the models were scored on {scored} items, but prepare run {inputs['prepare_run']} made {made}: "
                "the screens would judge a part of the set; evaluate again under a new plan"
            )


def _inputs(train_runs: dict[str, Any], experiment: str) -> dict[str, Any] | None:
    """The manifest sections of the prepare run that committed the inputs both
    train runs required, or None when the record does not hold it."""
    shas = {run.data.tags.get(schema.TAG_REQUIRES_PREFIX + ledger.INPUTS) for run in train_runs.values()}
    if len(shas) != 1 or None in shas:
        return None
    sha = shas.pop()
    if not _SHA.match(sha):
        return None
    run = _newest_finished(experiment, {schema.TAG_STAGE: schema.STAGE_PREPARE, schema.TAG_INPUTS: sha})
    if run is None:
        return None
    try:
        manifest = store.artifact_json(run.info.run_id, schema.ART_MANIFEST)
    except Exception:  # noqa: BLE001 - a prepare run without its manifest says nothing
        return None
    return {"sha256": sha, "prepare_run": run.info.run_id} | {k: manifest.get(k) for k in INPUT_SECTIONS}


def plan_document(experiment: str, plan_sha: str) -> dict[str, Any]:
    """The plan's document, from its plan run; refused, naming the files, when
    a source the plan binds (every file that decides a number, analysis/
    included) differs from the committed one: the screens are computed by the
    code the plan fixed before scoring."""
    run = _newest_finished(experiment, {schema.TAG_STAGE: schema.STAGE_PLAN, schema.TAG_PLAN: plan_sha})
    if run is None:
        raise RefusedError(f"plan {plan_sha[:12]}: no FINISHED plan run in experiment {experiment!r} holds it; the sources it binds cannot be checked")
    try:
        doc = store.artifact_json(run.info.run_id, schema.ART_PLAN)
    except Exception as err:  # noqa: BLE001 - any store error means the same thing here
        raise RefusedError(f"plan run {run.info.run_id} has no artifact {schema.ART_PLAN} ({type(err).__name__})") from None
    changed = sources.changed_sources(doc.get("sources", {}).get("files", {}))
    if changed:
        raise RefusedError(
            f"changed since the plan {plan_sha[:12]} was committed: source {', '.join(changed)}; "
            "the screens are computed by the planned code: restore it, or rerun the study and commit a new plan"
        )
    return doc


def load(cfg: Config, plan: str | None = None) -> Records:
    """The study's record; refuses when a role's run is missing or inconsistent,
    or a source the study's plan binds has changed."""
    key = study_key(cfg, plan)
    planned = plan_document(cfg.experiment, key.value) if key.kind == "plan" else None
    client = store.client()
    runs, weights = _find_runs(client, cfg.experiment, key)
    _check_one_study(runs, cfg)
    plan_sha = _plan_of(runs, key)
    if plan_sha and key.kind != "plan":
        planned = plan_document(cfg.experiment, plan_sha)

    candidates = {arm: weights[arm] for arm in ARMS}

    train_runs = {arm: runs[train_role(arm)] for arm in ARMS}
    updates = pd.concat([_update_table(client, arm, run.info.run_id) for arm, run in train_runs.items()], ignore_index=True)
    train = pd.DataFrame([_train_row(arm, run) for arm, run in train_runs.items()])
    attempts = _attempts(cfg.experiment, key, plan_sha, {arm: run.info.run_id for arm, run in train_runs.items()})

    eval_ids = {model: runs[evaluate_role(model)].info.run_id for model in MODELS}
    evaluations = _evaluations(cfg.experiment, key, plan_sha, eval_ids)
    cases = pd.concat([_case_table(m, rid) for m, rid in eval_ids.items()], ignore_index=True)
    retention = pd.concat([_retention_table(m, rid) for m, rid in eval_ids.items()], ignore_index=True)
    _check_paired(cases, "case_id", "final test")
    _check_paired(retention, "doc_id", "retention probes")
    inputs = _inputs(train_runs, cfg.experiment)
    _check_complete(cases, retention, inputs)

    return Records(
        key=key,
        plan=plan_sha,
        runs={role: run.info.run_id for role, run in runs.items()},
        candidates=candidates,
        updates=updates,
        train=train,
        attempts=attempts,
        elsewhere=_elsewhere(cfg.experiment, cfg.preset, key, plan_sha),
        evaluations=evaluations,
        cases=cases,
        retention=retention,
        inputs=inputs,
        budget=planned.get("budget") if planned else None,
        spent={stage: budget.stage_spent(cfg.experiment, plan_sha, stage) for stage in budget.SPENDING_STAGES} if plan_sha else {},
    )
