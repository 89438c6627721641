"""probe: a few updates of the real training loop per candidate setting."""

from __future__ import annotations

import argparse
import platform
from importlib import metadata
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from coopstudy import ui
from coopstudy.commit import ledger, receipts, require, sources
from coopstudy.config import COMPRESSED, NO_CANDIDATES, Config, ProbeCandidate, from_dict
from coopstudy.errors import UserError
from coopstudy.record import schema, writer
from coopstudy.run import launch, lock

HELP = "probe candidate settings (arm x microbatch x allocator) for a few updates each, keeping every receipt"
DESCRIPTION = f"""\
Runs each candidate of probe.candidates (arm, microbatch, allocator) for
probe.updates updates of the real training loop (`python -m coopstudy.run.worker
--probe`, no checkpoint), each in its own process or ranks, one after the
other, so a failure does not end the sweep. On CPU each process is held to
probe.device_capacity_mb: its peak resident memory is compared with it during
every backward and after every update, and a candidate above it fails as out
of memory, as one on a GPU does. A compressed candidate compresses at least
its last update (its dense phase cut to probe.updates - 1 where
powersgd.dense_updates is longer), so its memory holds PowerSGD's error
feedback and factors as a full run's does. Then reports, per arm and allocator, the
largest microbatch that completed and its median update seconds. The preset is
not changed: the plan (`plan`, or --plan here) records the choice.

Reads:  the gate receipt (`verify`) and the committed inputs (`prepare`).
Writes: an MLflow run probe-<preset> (stage {schema.STAGE_PROBE!r}) with {schema.ART_PROBE_RECEIPTS}
        and {schema.ART_PROBE_CHOICE}; under it one run per candidate (tag {schema.TAG_PROBE_SETTING}),
        FINISHED when it completed and FAILED otherwise, with {schema.ART_PROBE_RECEIPT}, tag
        {schema.TAG_PROBE_OUTCOME} (completed, out_of_memory, error), {schema.M_PROBE_MEDIAN_SECONDS},
        per-update metrics and memory; each receipt as <home>/probes/<key>/<arm>-mb<N>-<allocator>.json
        and a ledger entry (kind {ledger.PROBE!r}), which the plan hashes.
"""


RANK_LOGGED = (schema.M_PEAK_RSS_MB, schema.M_CUDA_MAX_ALLOCATED_MB, schema.M_CUDA_MAX_RESERVED_MB)
"""Memory metrics a training process that finishes logs itself."""


class CandidateFailed(Exception):
    """A candidate did not complete: its run ends FAILED, the sweep goes on."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--hostfile",
        type=launch.hostfile_path,
        default=None,
        help="probe the compressed arm's ranks on two hosts, as `train --hostfile` does",
    )
    parser.add_argument(
        "--plan", dest="then", action="store_const", const="plan", default=None,
        help="then commit the plan from the receipts (the `plan` step, run by the CLI after this one)",
    )


def _candidates(cfg: Config) -> list[tuple[ProbeCandidate, Config]]:
    """Each candidate with its config (the arm's microbatch set to the
    candidate's; a compressed one's dense phase cut to end before its last
    update), or the preset mistake that makes the sweep meaningless."""
    if not cfg.probe.candidates:
        raise UserError(NO_CANDIDATES)
    if cfg.probe.updates > cfg.train.updates:
        raise UserError(f"probe.updates: {cfg.probe.updates} exceeds train.updates={cfg.train.updates}")
    seen: set[str] = set()
    out = []
    for c in cfg.probe.candidates:
        name = receipts.setting_name(c.arm, c.microbatch, c.allocator)
        if name in seen:
            raise UserError(f"probe.candidates lists {name} twice")
        seen.add(name)
        raw = cfg.model_dump(mode="json")
        raw["arms"][c.arm]["microbatch"] = c.microbatch
        if c.arm == COMPRESSED:
            # A probe that never compresses would choose the microbatch without
            # PowerSGD's memory (a full fp32 copy of the gradient for its error
            # feedback, the factors), which a full run holds from its first
            # compressed update on, and time dense updates alone.
            raw["powersgd"]["dense_updates"] = min(cfg.powersgd.dense_updates, cfg.probe.updates - 1)
        # The config's own checks (a microbatch larger than the local batch).
        out.append((c, from_dict(raw)))
    return out


def _context(cfg: Config, req: dict[str, str]) -> dict[str, Any]:
    """What every receipt of the sweep shares: versions and hashes."""
    sources_sha, numerical = sources.numerical_sources_sha256()
    training = sources.probe_sources_sha256()
    versions = sources.library_versions()
    for name in ("deepspeed", "mlflow"):
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    versions["python"] = platform.python_version()
    return {
        "libraries": versions,
        "sources": {"numerical_sha256": sources_sha, "numerical": numerical, "training": training},
        "inputs": {
            "sha256": req[schema.TAG_REQUIRES_PREFIX + ledger.INPUTS],
            "seed_sha256": req[schema.TAG_SEED_SHA],
        },
        "gate_receipt": req[schema.TAG_REQUIRES_PREFIX + ledger.GATE],
        "probe_key": receipts.probe_key(cfg),
        "preset": cfg.preset,
    }


def _run_candidate(
    cfg: Config, cand: ProbeCandidate, cand_cfg: Config, req: dict[str, str], context: dict[str, Any], hostfile: Path | None, console: Console
) -> dict[str, Any]:
    name = receipts.setting_name(cand.arm, cand.microbatch, cand.allocator)
    workers = cand_cfg.arm(cand.arm).workers
    # A candidate's own capacity (ProbeCandidate.device_capacity_mb, where the
    # config has it) stands in for a smaller device than the preset's.
    capacity = cand.device_capacity_mb or cfg.probe.device_capacity_mb
    receipt: dict[str, Any] = {}
    try:
        with writer.stage_run(
            schema.STAGE_PROBE, cand_cfg, arm=cand.arm, run_name=f"probe-{name}-{cfg.preset}", tags=req | {schema.TAG_PROBE_SETTING: name}
        ) as rec:
            cmd = launch.command(
                cand_cfg, cand.arm, rec.run_id,
                hostfile=hostfile if cand.arm == COMPRESSED else None,
                allocator=cand.allocator, updates=cfg.probe.updates, checkpoint=False, probe=True, capacity_mb=capacity,
            )
            done = launch.run(cmd, launch.worker_environment(cand_cfg, rec.run_id, allocator=cand.allocator), label=f"probe {name}")
            launched = receipts.Launched(done.returncode, done.complete_seconds, launch.exit_reason(done.returncode, launcher=workers > 1))
            receipt = receipts.probe_receipt(
                arm=cand.arm, microbatch=cand.microbatch, allocator=cand.allocator, workers=workers,
                updates=cfg.probe.updates, capacity_mb=capacity, run_id=rec.run_id, launched=launched,
                ranks=receipts.read_rank_reports(rec.run_id), hourly_price_usd=cfg.budget.hourly_price_usd, context=context,
            )
            path, sha, _ = receipts.keep_receipt(cfg, receipt, rec)
            rec.log_dict(receipt, schema.ART_PROBE_RECEIPT)
            memory = receipts.memory_summary(receipt)
            if receipt["outcome"] == schema.OUTCOME_COMPLETED:
                # The process logged its own peaks with its summary.
                memory = {k: v for k, v in memory.items() if k not in RANK_LOGGED}
            metrics = memory | {
                schema.M_COMPLETE_SECONDS: receipt["complete_seconds"],
                schema.M_DEVICE_SECONDS: receipt["device_seconds"],
                schema.M_COST_USD: receipt["cost_usd"],
            } | launch.machine_metrics(done)
            if receipt["median_update_seconds"] is not None:
                metrics[schema.M_PROBE_MEDIAN_SECONDS] = receipt["median_update_seconds"]
            rec.log_metrics(metrics)
            shown = receipt["outcome"] if receipt["message"] is None else f"{receipt['outcome']}: {receipt['message']}"
            console.print(f"probe {name}: {shown} (receipt {path.name}, run {rec.run_id})", highlight=False)
            if receipt["outcome"] != schema.OUTCOME_COMPLETED:
                raise CandidateFailed(f"{name}: {shown}")
    except CandidateFailed:
        pass
    return receipt


def _receipts_table(swept: list[dict[str, Any]]) -> Table:
    table = Table(title="probe candidates")
    for col in ("arm", "microbatch", "allocator", "outcome", "median s/update", "updates", "memory", "message"):
        table.add_column(col, justify="right" if col in ("microbatch", "median s/update", "updates") else "left")
    for r in swept:
        s = r["setting"]
        colour = "green" if r["outcome"] == schema.OUTCOME_COMPLETED else "red"
        median = r["median_update_seconds"]
        table.add_row(
            s["arm"], str(s["microbatch"]), s["allocator"], f"[{colour}]{r['outcome']}[/{colour}]",
            f"{median:.3f}" if median is not None else "-", f"{r['updates_done']}/{s['updates']}",
            receipts.memory_text(r), (r["message"] or "")[:120],
        )
    return table


def _choice_table(choice: dict[str, dict[str, dict[str, Any]]], cfg: Config) -> Table:
    table = Table(title="largest microbatch that completed, per arm and allocator")
    for col in ("arm", "allocator", "microbatch", "median s/update", "failed", "preset"):
        table.add_column(col, justify="right" if col in ("microbatch", "median s/update") else "left")
    for arm, by_alloc in choice.items():
        for allocator, cell in by_alloc.items():
            mb, median = cell["largest_completed_microbatch"], cell["median_update_seconds"]
            table.add_row(
                arm, allocator, str(mb) if mb is not None else "[red]none[/red]",
                f"{median:.3f}" if median is not None else "-",
                ", ".join(map(str, cell["failed"])) or "-",
                f"arms.{arm}.microbatch={cfg.arm(arm).microbatch}",
            )
    return table


def check_arguments(cfg: Config, args: argparse.Namespace) -> None:
    """What probe refuses in its config and arguments, before any work (and under --dry-run)."""
    _checked_candidates(cfg, args)


def _checked_candidates(cfg: Config, args: argparse.Namespace) -> list[tuple[ProbeCandidate, Config]]:
    """Every refusal of probe's config and arguments; then the candidates, each with its config."""
    candidates = _candidates(cfg)
    arms = {c.arm for c, _ in candidates}
    if args.hostfile is not None:
        if COMPRESSED not in arms:
            raise UserError("--hostfile: only the compressed arm runs on several hosts, and this sweep has no compressed candidate")
        launch.check_hostfile(args.hostfile, cfg.arms.compressed.workers)
    if COMPRESSED in arms:
        launch.check_backend(cfg, ranks_here=args.hostfile is None)
    return candidates


def run(cfg: Config, args: argparse.Namespace) -> int:
    candidates = _checked_candidates(cfg, args)
    arms = tuple(sorted({c.arm for c, _ in candidates}))
    if args.hostfile is not None:
        launch.check_ssh_hostfile(args.hostfile, cfg.arms.compressed.workers)
    console = ui.console(140)
    devices = launch.devices_of(cfg, arms, args.hostfile)
    with writer.stage_run(schema.STAGE_PROBE, cfg) as parent:
        # Probes are training jobs: none shares a device with another.
        with lock.device_lock(devices, f"coopstudy probe --preset {cfg.preset_argument}"):
            # The gate of this config's plan, if it has one, as training will record it.
            req = require.training_inputs(cfg, require.planned_gate(cfg))
            parent.set_tags(req)
            context = _context(cfg, req)
            limit = f", device capacity {cfg.probe.device_capacity_mb} MiB" if cfg.probe.device_capacity_mb else ""
            dense = {cc.powersgd.dense_updates for c, cc in candidates if c.arm == COMPRESSED}
            phases = f" (a compressed one: {dense.pop()} dense, then compressed)" if dense else ""
            console.print(f"probe: {len(candidates)} candidates, {cfg.probe.updates} updates each{phases}{limit}; run {parent.run_id}", highlight=False)
            swept = [_run_candidate(cfg, c, cc, req, context, args.hostfile, console) for c, cc in candidates]
        choice = receipts.choose(swept)
        parent.log_dict(swept, schema.ART_PROBE_RECEIPTS)
        parent.log_dict(choice, schema.ART_PROBE_CHOICE)
        completed = sum(r["outcome"] == schema.OUTCOME_COMPLETED for r in swept)
        parent.log_metrics({schema.M_PROBE_COMPLETED: completed, schema.M_PROBE_FAILED: len(swept) - completed})
    console.print(_receipts_table(swept))
    console.print(_choice_table(choice, cfg))
    console.print(f"receipts: {receipts.probe_dir(cfg)}", highlight=False)
    if args.then is None:
        replaced = _plan_replaced(cfg)
        if replaced:
            console.print(
                f"note: plan {replaced[:12]} of this config binds other probe receipts than those now in "
                f"{receipts.probe_dir(cfg)}: train and every step after it refuse until the plan is committed again; "
                "after that they run again",
                highlight=False,
            )
        # The plan is of this config: without the same overrides it would be another's.
        console.print(f"next: `python -m coopstudy plan {cfg.arguments}` records the choice in the plan", highlight=False, soft_wrap=True)
    return 0


def _plan_replaced(cfg: Config) -> str | None:
    """The committed plan of `cfg`, where the probe receipts it binds are no longer the ones on disk."""
    planned = require.planned_probe_receipts(cfg)
    if planned is None or planned[1] == receipts.receipt_hashes(cfg):
        return None
    return planned[0]
