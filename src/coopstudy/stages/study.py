"""The whole study as one command, each step its own tracked run.

A step is reused when a FINISHED run with the same step key exists and what
it left behind still verifies; the key hashes the resolved config, the step's
own source files and the keys of the steps it depends on, so changed code or
a rerun upstream step reruns it and everything after it.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from coopstudy import tracking, workspace
from coopstudy.config import Config
from coopstudy.errors import UserError

HELP = "run every step of the study in order, reusing unchanged finished steps"
DESCRIPTION = """\
Runs prepare -> verify -> probe -> plan -> train control -> train compressed -> select
-> evaluate -> report, each as its own MLflow run under one parent study run.
A finished step whose config, sources and upstream steps are unchanged is
reused (its run id is shown); otherwise it runs again.

Reads: the preset. Writes: every step's runs and artifacts; ends by printing
the report."""

PACKAGE = Path(__file__).resolve().parents[1]
ANALYSIS = PACKAGE.parents[1] / "analysis"


@dataclass(frozen=True)
class Step:
    name: str
    stage: str
    sources: tuple[str, ...]
    """Files, relative to the package (or `analysis/...`), whose change reruns the step."""
    after: tuple[str, ...] = ()
    argv: tuple[str, ...] = ()
    still_valid: Callable[[Config, Any], None] | None = field(default=None, compare=False)
    """Raises a UserError when what the step's run left behind no longer verifies."""


def _prepared_ok(cfg: Config, run: Any) -> None:
    from coopstudy import data

    data.load_prepared(cfg)


def _gate_ok(cfg: Config, run: Any) -> None:
    from coopstudy import gate

    gate.require_gate_receipt()


def _probes_ok(cfg: Config, run: Any) -> None:
    from coopstudy import plan

    plan.probes_complete(cfg)


def _plan_ok(cfg: Config, run: Any) -> None:
    from coopstudy import plan

    plan.require_plan(cfg)


def _checkpoint_ok(cfg: Config, run: Any) -> None:
    folder = run.data.tags.get(tracking.TAG_CHECKPOINT_PATH)
    weights = Path(folder or "/nonexistent") / "model.safetensors"
    if not weights.is_file() or workspace.sha256_file(weights) != run.data.tags.get(tracking.TAG_CHECKPOINT_SHA):
        raise UserError(f"the checkpoint of run {run.info.run_id} is missing or changed")


COMMON = ("config.py", "tracking.py", "ledger.py", "workspace.py", "errors.py")
NUMERICAL = ("batching.py", "objective.py", "update.py", "distributed.py", "gate.py")
TRAINING = NUMERICAL + ("train.py", "launch.py", "checkpoint.py", "lock.py", "probe.py", "plan.py", "stages/train.py")

STEPS: tuple[Step, ...] = (
    Step("prepare", "prepare", COMMON + ("data.py", "seed.py", "chat.py", "tasks.py", "conversations.py", "stages/prepare.py"), still_valid=_prepared_ok),
    Step("verify", "verify", COMMON + NUMERICAL + ("stages/verify.py",), still_valid=_gate_ok),
    Step("probe", "probe", COMMON + TRAINING + ("stages/probe.py",), ("prepare", "verify"), still_valid=_probes_ok),
    Step("plan", "plan", COMMON + ("plan.py", "probe.py", "stages/plan.py"), ("prepare", "verify", "probe"), still_valid=_plan_ok),
    Step("train-control", "train", COMMON + TRAINING, ("plan",), ("--arm", "control"), _checkpoint_ok),
    Step("train-compressed", "train", COMMON + TRAINING, ("plan",), ("--arm", "compressed"), _checkpoint_ok),
    Step("select", "select", COMMON + ("candidates.py", "plan.py", "stages/select.py"), ("train-control", "train-compressed")),
    Step(
        "evaluate",
        "evaluate",
        COMMON + ("evaluate.py", "candidates.py", "plan.py", "tasks.py", "chat.py", "data.py", "seed.py", "stages/evaluate.py"),
        ("select",),
    ),
    Step("report", "report", COMMON + ("stages/report.py", "analysis/"), ("evaluate",)),
)
STEP_NAMES = tuple(s.name for s in STEPS)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--through",
        choices=(*STEP_NAMES, "train"),
        default=STEP_NAMES[-1],
        help="stop after this step; `train` means the train steps of --arm (default: the whole study)",
    )
    parser.add_argument(
        "--arm",
        choices=("control", "compressed", "both"),
        default="both",
        help="which training arms to run when stopping at a train step (default: both)",
    )


def _source_files(step: Step) -> list[Path]:
    files: list[Path] = []
    for rel in step.sources:
        if rel.startswith("analysis/"):
            files.extend(sorted(ANALYSIS.glob("*.py")))
        else:
            files.append(PACKAGE / rel)
    return files


def sources_digest(step: Step) -> dict[str, str]:
    out = {}
    for path in _source_files(step):
        if not path.is_file():
            raise UserError(f"step {step.name}: source {path} is missing; the checkout is incomplete")
        out[str(path.relative_to(PACKAGE.parents[1]))] = workspace.sha256_file(path)
    return out


def step_key(step: Step, cfg: Config, upstream: dict[str, str]) -> str:
    body = {
        "step": step.name,
        "argv": step.argv,
        "config": tracking.config_sha256(cfg),
        "sources": sources_digest(step),
        "after": {name: upstream[name] for name in step.after},
    }
    return workspace.sha256_bytes(json.dumps(body, sort_keys=True).encode())


def _reusable_run(step: Step, cfg: Config, key: str) -> str | None:
    runs = tracking.search_runs(
        cfg.experiment,
        f"tags.`{tracking.TAG_STEP_KEY}` = '{key}' and attributes.status = 'FINISHED'",
    )
    if not runs:
        return None
    if step.still_valid is not None:
        try:
            step.still_valid(cfg, runs[0])
        except UserError:
            return None
    return runs[0].info.run_id


def selected_steps(through: str, arm: str) -> list[Step]:
    """The steps up to `through`; stopping at training runs only --arm's arms."""
    if through != "train":
        return list(STEPS[: STEP_NAMES.index(through) + 1])
    chosen = STEPS[: STEP_NAMES.index("train-compressed") + 1]
    return [s for s in chosen if arm == "both" or not s.name.startswith("train-") or s.name == f"train-{arm}"]


def run(cfg: Config, args: argparse.Namespace) -> int:
    from coopstudy import cli

    steps = selected_steps(args.through, args.arm)
    keys: dict[str, str] = {}
    t0 = time.perf_counter()
    name = f"train-{args.arm}-{cfg.preset}" if args.through == "train" else f"study-{cfg.preset}"
    with tracking.stage_run(tracking.STAGE_STUDY, cfg, run_name=name) as rec:
        for step in steps:
            key = step_key(step, cfg, keys)
            keys[step.name] = key
            reused = _reusable_run(step, cfg, key)
            if reused:
                print(f"study: {step.name}: reused run {reused} (config, sources and upstream unchanged)", flush=True)
                continue
            print(f"study: {step.name}: running", flush=True)
            step_args = cli.build_parser(step.stage).parse_args([step.stage, "--preset", cfg.preset, *step.argv])
            with tracking.tags_for_next_run({tracking.TAG_STEP_KEY: key}):
                step_args._module.run(cfg, step_args)
        rec.log_metrics({tracking.M_STUDY_SECONDS: time.perf_counter() - t0})
        rec.log_dict(keys, tracking.ART_STEP_KEYS)
    return 0
