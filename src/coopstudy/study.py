"""The whole study as one command, each step its own tracked run: the one
module that composes the steps (they never import each other).

A step is reused when a FINISHED run with the same step key exists and what
it left behind still verifies; the key hashes the resolved config, the step's
own source files and the keys of the steps it depends on, so changed code or
a rerun upstream step reruns it and everything after it. The steps made once
per plan are the plan's, whatever key their runs carry (Step.planned): each
arm's first finished train run under the plan in force, the plan's selection
and its first finished evaluation; where a train run's weights are lost, the
study stops. Their keys
hash no upstream key, and the steps after them run again when the plan in
force is not the one their run ran under: so a plan committed again reruns
them, and a change that leaves the plan as it was (one binding no number)
reruns none. A step
started by itself with the study's arguments carries the same key
(standalone_keys), so steps run one by one and a study make one record.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from types import ModuleType
from typing import Any

from coopstudy import steps as steps_pkg
from coopstudy import workspace
from coopstudy.commit import budget, candidates, require, sources
from coopstudy.config import ARMS, BOTH, Config, arms_of
from coopstudy.errors import UserError
from coopstudy.record import schema, store, writer

HELP = "run every step of the study in order, reusing unchanged finished steps"
DESCRIPTION = """\
Runs prepare -> verify -> probe -> plan -> train control -> train compressed -> select
-> evaluate -> report, each as its own MLflow run under one parent study run.
A finished step whose config, sources and upstream steps are unchanged is
reused (its run id is shown); otherwise it runs again. Training and select
are made once per plan: an arm's first finished run under the plan in force,
and the plan's selection, are reused whatever changed since.

Reads: the preset; what each step reads (see its own --help); the record's
finished runs of each step, to tell which can be reused.
Writes: what each step writes (its runs, artifacts and ledger entries), and
the study run above them with each step's key; ends by printing the report."""

@dataclass(frozen=True)
class Step:
    name: str
    stage: str
    after: tuple[str, ...] = ()
    argv: tuple[str, ...] = ()
    still_valid: Callable[["Checks", Any], str | None] | None = field(default=None, compare=False)
    """Raises a UserError when what the step's run left behind no longer verifies;
    may return a note on what it found, said beside the reuse."""
    planned: Callable[["Checks"], tuple[Any, str] | None] | None = field(default=None, compare=False)
    """A step whose run is the plan's, not its key's (None: its key's), since
    it is made once per plan whatever key its run carries: (that run, what it
    is, in words), or None while there is none. A train step's is the arm's
    first FINISHED run under the plan in force; select's, the run that
    committed the plan's candidates; evaluate's, the plan's first FINISHED
    evaluation."""


@dataclass
class Checks:
    """What the reuse checks share: the config, and the plan in force,
    verified once (re-hashing every source, receipt and input) until a step
    runs, since one that runs may commit another."""

    cfg: Config
    _plan: str | None = None

    def plan_in_force(self) -> str:
        if self._plan is None:
            self._plan = require.committed_plan(self.cfg)
        return self._plan

    def step_ran(self) -> None:
        self._plan = None


def _prepared_ok(checks: Checks, run: Any) -> None:
    require.inputs(checks.cfg)


def _gate_ok(checks: Checks, run: Any) -> None:
    passed = run.data.tags.get(schema.TAG_GATE)
    if require.gate_receipt(checks.cfg, bound=passed).digest != passed:
        raise UserError(f"the gate receipt of run {run.info.run_id} no longer applies")


def _probes_ok(checks: Checks, run: Any) -> None:
    require.probe_receipts_complete(checks.cfg)


def _plan_ok(checks: Checks, run: Any) -> None:
    checks.plan_in_force()


def _under_plan_ok(checks: Checks, run: Any) -> None:
    # A plan committed again since (a probe or the gate rerun) reruns every step
    # after it, though their keys, which hash the steps' inputs, not the runs, are the same.
    if run.data.tags.get(schema.TAG_PLAN) != checks.plan_in_force():
        raise UserError(f"run {run.info.run_id} ran under another plan than the one in force")


def _checkpoint_ok(checks: Checks, run: Any) -> str | None:
    _under_plan_ok(checks, run)
    folder = run.data.tags.get(schema.TAG_CHECKPOINT_PATH)
    weights = Path(folder or "/nonexistent") / workspace.WEIGHTS_FILE
    if weights.is_file() and workspace.sha256_file(weights) == run.data.tags.get(schema.TAG_CHECKPOINT_SHA):
        return None
    # An arm trains once per plan, and a selection is made once: what select
    # took, or can bring back, needs no folder here. Evaluate, the one step
    # still to read the weights, checks them itself.
    state = "changed" if weights.is_file() else "gone from disk"
    taken = require.selected_train_runs(checks.plan_in_force()).get(run.data.tags.get(schema.TAG_ARM, ""))
    if taken is not None:
        return f"its checkpoint is {state}, and select already took {'it' if taken == run.info.run_id else f'run {taken}'}"
    held = _holds_checkpoint(run.info.run_id)
    if not weights.is_file() and held:
        return "its checkpoint is gone from disk, and select brings it back from the run's artifact"
    if held:
        raise UserError(f"the checkpoint of run {run.info.run_id} is changed: delete {folder}, and select brings it back from the run's artifact")
    raise UserError(f"the checkpoint of run {run.info.run_id} is {state} and the run holds no copy: put {folder} back from one")


def _planned_train_run(arm: str) -> Callable[[Checks], tuple[Any, str] | None]:
    def planned(checks: Checks) -> tuple[Any, str] | None:
        plan = checks.plan_in_force()
        run = candidates.first_finished(checks.cfg, plan, arm)
        return None if run is None else (run, f"the arm's first finished run under plan {plan[:12]}")

    return planned


def _planned_select_run(checks: Checks) -> tuple[Any, str] | None:
    plan = checks.plan_in_force()
    run_id = require.selecting_run(plan)
    if run_id is None:
        return None
    try:
        run = store.client().get_run(run_id)
    except Exception:  # noqa: BLE001 - a selection whose run this record lacks: select says so itself
        return None
    return run, f"the selection of plan {plan[:12]}"


def _planned_evaluate_run(checks: Checks) -> tuple[Any, str] | None:
    plan = checks.plan_in_force()
    run = candidates.first_evaluation(checks.cfg, plan)
    return None if run is None else (run, f"the evaluation of plan {plan[:12]}")


def _holds_checkpoint(run_id: str) -> bool:
    try:
        return store.has_artifact(run_id, f"{schema.ART_CHECKPOINT}/{workspace.WEIGHTS_FILE}")
    except Exception:  # noqa: BLE001 - an artifact store that cannot be listed holds nothing the study can use
        return False


PREPARE, VERIFY, PROBE, PLAN = schema.STAGE_PREPARE, schema.STAGE_VERIFY, schema.STAGE_PROBE, schema.STAGE_PLAN
TRAIN, SELECT, EVALUATE, REPORT = schema.STAGE_TRAIN, schema.STAGE_SELECT, schema.STAGE_EVALUATE, schema.STAGE_REPORT


def train_step(arm: str) -> str:
    return f"{TRAIN}-{arm}"


STEPS: tuple[Step, ...] = (
    Step(PREPARE, PREPARE, still_valid=_prepared_ok),
    Step(VERIFY, VERIFY, still_valid=_gate_ok),
    Step(PROBE, PROBE, (PREPARE, VERIFY), still_valid=_probes_ok),
    Step(PLAN, PLAN, (PREPARE, VERIFY, PROBE), still_valid=_plan_ok),
    *(Step(train_step(arm), TRAIN, (PLAN,), ("--arm", arm), _checkpoint_ok, _planned_train_run(arm)) for arm in ARMS),
    Step(SELECT, SELECT, tuple(train_step(arm) for arm in ARMS), still_valid=_under_plan_ok, planned=_planned_select_run),
    Step(EVALUATE, EVALUATE, (SELECT,), still_valid=_under_plan_ok, planned=_planned_evaluate_run),
    Step(REPORT, REPORT, (EVALUATE,), still_valid=_under_plan_ok),
)
STEP_NAMES = tuple(s.name for s in STEPS)
MODULES: dict[str, ModuleType] = {stage: importlib.import_module(f"{steps_pkg.__name__}.{stage}") for stage in steps_pkg.ORDER}


def step_sources(step: Step) -> list[str]:
    """The files whose change reruns the step: its module and everything it
    imports (for training, the worker it starts too), derived, not listed."""
    roots = [MODULES[step.stage].__name__]
    if step.stage in (PROBE, TRAIN):
        roots.append(sources.WORKER)
    return sources.closure(*roots)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--through",
        choices=(*STEP_NAMES, TRAIN),
        default=STEP_NAMES[-1],
        help="stop after this step; `train` means the train steps of --arm (default: the whole study)",
    )
    parser.add_argument(
        "--arm",
        choices=(*ARMS, BOTH),
        default=BOTH,
        help="with --through train: which arm to train, the steps before it included (default: both)",
    )


def sources_digest(step: Step) -> dict[str, str]:
    return {rel: workspace.sha256_file(sources.project_dir() / rel) for rel in step_sources(step)}


def step_key(step: Step, cfg: Config, upstream: dict[str, str]) -> str:
    body = {
        "step": step.name,
        "argv": step.argv,
        "config": store.config_sha256(cfg),
        "sources": sources_digest(step),
        # The plan's steps hash no upstream key: the plan in force, not a key, says
        # which run is theirs, and every step after the plan checks it. Else a
        # change upstream that binds no number (the plan step's own sources, say)
        # would rerun evaluate and report after the same training and selection.
        "after": {} if step.planned else {name: upstream[name] for name in step.after},
    }
    return workspace.sha256_bytes(json.dumps(body, sort_keys=True).encode())


def _finished_under(cfg: Config, key: str) -> list[Any]:
    """The FINISHED runs that carry step key `key`, newest first."""
    return store.search_runs(cfg.experiment, f"tags.`{schema.TAG_STEP_KEY}` = '{key}' and attributes.status = 'FINISHED'")


def _reusable_run(step: Step, checks: Checks, key: str) -> tuple[str | None, str | None]:
    """(the run a study reuses, why), or (None, why the newest finished run
    under the key is not reused; None where there is none)."""
    if step.planned is not None:
        return _planned_run(step, checks, key)
    runs = _finished_under(checks.cfg, key)
    if not runs:
        return None, None
    try:
        note = step.still_valid(checks, runs[0]) if step.still_valid else None
    except UserError as err:
        # Not its hint: the study is running the command it names.
        return None, err.reason
    return runs[0].info.run_id, "config, sources and upstream unchanged" + (f"; {note}" if note else "")


def _planned_run(step: Step, checks: Checks, key: str) -> tuple[str | None, str | None]:
    """A train step's reuse: the plan's run of the arm, or a refusal when its
    weights are lost, since train would not run the arm again under the plan."""
    try:
        checks.plan_in_force()  # no plan in force: the arm has no run to reuse, said as why
    except UserError as err:
        return None, err.reason
    found = step.planned(checks)
    if found is None:
        keyed = _finished_under(checks.cfg, key)
        return None, f"run {keyed[0].info.run_id} ran under another plan than the one in force" if keyed else None
    run, what = found
    try:
        note = step.still_valid(checks, run) if step.still_valid else None
    except UserError as err:
        # Running the step again could not replace it: the study stops.
        raise UserError(f"{step.name}: {err.reason} ({what}, made once per plan)") from None
    return run.info.run_id, what + (f"; {note}" if note else "")


def standalone_keys(cfg: Config, stage: str, args: argparse.Namespace) -> dict[str | None, str]:
    """The step keys of `coopstudy STAGE` started by itself, by the arm of the
    run that carries each (None: a stage of no arm), where it does what the
    study's steps do: the same arguments (`--plan` aside, which runs the plan
    step after it), or `train --arm both` for both train steps. Its runs then
    carry the keys, so a study reuses them: one record, however a step is
    started. Empty for anything else."""
    keys: dict[str, str] = {}
    found: dict[str | None, str] = {}
    checks = Checks(cfg)
    for step in STEPS:
        if step.stage != stage and found:
            break  # a stage's steps are consecutive; the later steps' sources need no hashing
        keys[step.name] = step_key(step, cfg, keys)
        if step.stage != stage:
            continue
        # A key says "the study's step, after these runs": not so when an
        # upstream step has no run a study would reuse under its key.
        if not all(_reused_quietly(STEPS[STEP_NAMES.index(up)], checks, keys[up]) for up in step.after):
            continue
        own = {k: v for k, v in vars(_step_args(step, args)).items() if k != "then"}
        differ = {k for k, v in own.items() if getattr(args, k, None) != v}
        if not differ or (differ == {"arm"} and args.arm == BOTH):
            found[own.get("arm")] = keys[step.name]
    return found


def _reused_quietly(step: Step, checks: Checks, key: str) -> bool:
    """Whether a study would reuse a run for `step`; a step that would stop the study is not reused."""
    try:
        return _reusable_run(step, checks, key)[0] is not None
    except UserError:
        return False


@contextlib.contextmanager
def alone(stage: str, cfg: Config, args: argparse.Namespace) -> Iterator[None]:
    """While inside: the runs of `coopstudy STAGE` started by itself carry
    the study's step keys (standalone_keys)."""
    keys = standalone_keys(cfg, stage, args)
    with writer.tags_for_next_runs({arm: {schema.TAG_STEP_KEY: key} for arm, key in keys.items()}):
        yield


def selected_steps(through: str, arm: str) -> list[Step]:
    """The steps up to `through`; stopping at training runs only --arm's arms."""
    if through != TRAIN:
        return list(STEPS[: STEP_NAMES.index(through) + 1])
    chosen = STEPS[: STEP_NAMES.index(train_step(ARMS[-1])) + 1]
    return [s for s in chosen if s.stage != TRAIN or s.name in map(train_step, arms_of(arm))]


def _step_args(step: Step, study: argparse.Namespace) -> argparse.Namespace:
    """The arguments the step would get from `coopstudy STEP --preset P --set
    OVERRIDES ARGV`, from the step's own declaration of them."""
    module = MODULES[step.stage]
    parser = argparse.ArgumentParser(prog=f"coopstudy {step.stage}")
    if hasattr(module, "add_arguments"):
        module.add_arguments(parser)
    args = parser.parse_args(list(step.argv))
    args.preset, args.overrides = study.preset, list(study.overrides)
    return args


def _refuse_a_passed_deadline(cfg: Config, steps: list[Step], keys: dict[str, str], checks: Checks) -> None:
    """Before any step: train and evaluate refuse to start after
    budget.deadline, so a study that would run either then refuses now, not
    after the probes' minutes."""
    when = cfg.budget.deadline
    if when is None or when > datetime.now(timezone.utc):
        return
    # An arm finished under the plan in force is reused; where the plan is
    # committed again meanwhile (a probe rerun), train still refuses. Lost
    # weights stop the study whatever the deadline, and are said as such.
    to_run = [s.name for s in steps if s.stage in budget.SPENDING_STAGES and _reusable_run(s, checks, keys[s.name])[0] is None]
    if to_run:
        raise UserError(
            f"budget.deadline {when.isoformat()} has passed, and {' and '.join(to_run)} would run after it; "
            "set a later deadline (--set budget.deadline=...) or none (--set budget.deadline=null)"
        )


def check_arguments(cfg: Config, args: argparse.Namespace) -> None:
    """What study refuses in its arguments, and what each step it would run
    refuses in the config and the arguments the study gives it, before any
    work (and under --dry-run): a setting probe or train refuses (the nccl
    backend without CUDA, a probe longer than the training) ended the study
    only after prepare and verify had run."""
    if args.arm != BOTH and args.through != TRAIN:
        # Every later step needs both arms trained; running both quietly would not be what was asked.
        raise UserError(f"--arm {args.arm}: it applies only with --through train (got --through {args.through})")
    for step in selected_steps(args.through, args.arm):
        module = MODULES[step.stage]
        if hasattr(module, "check_arguments"):
            module.check_arguments(cfg, _step_args(step, args))


def run(cfg: Config, args: argparse.Namespace) -> int:
    check_arguments(cfg, args)
    steps = selected_steps(args.through, args.arm)
    keys: dict[str, str] = {}
    for step in steps:
        keys[step.name] = step_key(step, cfg, keys)
    checks = Checks(cfg)
    _refuse_a_passed_deadline(cfg, steps, keys, checks)
    t0 = time.perf_counter()
    # Not train-<arm>-<preset>: that is the name of the arm run it starts.
    name = f"study-{TRAIN}-{args.arm}-{cfg.preset}" if args.through == TRAIN else f"study-{cfg.preset}"
    with writer.stage_run(schema.STAGE_STUDY, cfg, run_name=name) as rec:
        for n, step in enumerate(steps):
            key = keys[step.name]
            reused, said = _reusable_run(step, checks, key)
            if reused:
                print(f"study: {step.name}: reused run {reused} ({said})", flush=True)
                continue
            print(f"study: {step.name}: running{f' (not reused: {said})' if said else ''}", flush=True)
            step_args = _step_args(step, args)
            if hasattr(step_args, "then"):
                # The study runs what follows: a "next:" hint would tell the user to.
                step_args.then = steps[n + 1].stage if n + 1 < len(steps) else None
            checks.step_ran()
            with writer.tags_for_next_run({schema.TAG_STEP_KEY: key}):
                MODULES[step.stage].run(cfg, step_args)
        rec.log_metrics({schema.M_STUDY_SECONDS: time.perf_counter() - t0})
        rec.log_dict(keys, schema.ART_STEP_KEYS)
    return 0
