"""plan: commit the frozen plan before any full training run."""

from __future__ import annotations

import argparse
from datetime import datetime, timezone

from rich.table import Table

from coopstudy import ui
from coopstudy.commit import ledger, plan, receipts, require
from coopstudy.config import Config
from coopstudy.record import schema, writer

HELP = "commit the frozen plan: config, screens, methods, and the hashes of sources, inputs, gate and probe receipts"
DESCRIPTION = f"""\
Builds one document from what is on disk now and commits its sha256 to the
ledger: the resolved config of both arms; each arm's setting (the preset's
microbatch, the protocol's allocator) and the completed probe receipt that
stands for it, with the projected seconds and cost of its full run (probe
start-up + median update seconds x train.updates); the probes' choice (the
largest microbatch that completed per arm and allocator; the preset is not
changed); the screens' thresholds and statistical methods; the sha256 of the
numerical sources, of the prepared inputs, of the gate receipt and of every
probe receipt; the budget (price, allocation, deadline, the probes' cost).
Refuses when an arm's setting has no completed probe receipt. `train`, and
every stage after it, requires this plan and refuses once anything it hashes
changes; `train` also refuses an arm whose projection passes the budget or
the deadline.

Reads:  the gate receipt, the committed inputs, the probe receipts (`probe`).
Writes: <home>/plans/<sha>.json; a `{ledger.PLAN}` ledger entry (subject: the config's
        sha256); an MLflow run plan-<preset> (stage {schema.STAGE_PLAN!r}) with {schema.ART_PLAN},
        tag {schema.TAG_PLAN}, and {schema.M_PLAN_SECONDS_PREFIX}<arm>, {schema.M_PLAN_COST_PREFIX}<arm>.
"""


def _table(doc: dict) -> Table:
    table = Table(title="plan: each arm's setting and projection")
    for col in ("arm", "workers", "microbatch", "allocator", "probe receipt", "median s/update", "projected s", "projected $"):
        table.add_column(col, justify="left" if col in ("arm", "allocator", "probe receipt") else "right")
    for arm, a in doc["arms"].items():
        p = a["projection"]
        table.add_row(
            arm, str(a["workers"]), str(a["microbatch"]), a["allocator"], a["receipt"],
            f"{p['median_update_seconds']:.3f}", f"{p['seconds']:.1f}", f"{p['cost_usd']:.2f}",
        )
    return table


def _notes(doc: dict) -> list[str]:
    """Where the preset's setting is not the probes' largest completed
    microbatch, and where an arm's receipt is of the other allocator."""
    notes = []
    for arm, a in doc["arms"].items():
        if a["receipt"] != receipts.receipt_file(receipts.setting_name(arm, a["microbatch"], a["allocator"])):
            notes.append(
                f"note: {arm} runs with the {a['allocator']} allocator; its receipt {a['receipt']} stands for it: "
                "on CPU the allocator setting changes nothing (it configures CUDA's allocator only)"
            )
        cell = doc["choice"].get(arm, {}).get(a["allocator"], {})
        largest = cell.get("largest_completed_microbatch")
        if largest is not None and largest != a["microbatch"]:
            notes.append(
                f"note: {arm} completed microbatch {largest} under the {a['allocator']} allocator; the preset's "
                f"{a['microbatch']} is kept (to use {largest}: --set arms.{arm}.microbatch={largest}, then plan again)"
            )
    return notes


def run(cfg: Config, args: argparse.Namespace) -> int:
    console = ui.console(140)
    with writer.stage_run(schema.STAGE_PLAN, cfg) as rec:
        # The gate the config's plan binds, while it holds: a gate passed since for another config changes nothing here.
        done = plan.commit(cfg, require.inputs(cfg), require.gate_receipt(cfg, bound=require.planned_gate(cfg)), rec)
        doc = done.document
        rec.log_dict(doc, schema.ART_PLAN)
        metrics = {}
        for arm, a in doc["arms"].items():
            metrics[schema.M_PLAN_SECONDS_PREFIX + arm] = a["projection"]["seconds"]
            metrics[schema.M_PLAN_COST_PREFIX + arm] = a["projection"]["cost_usd"]
        rec.log_metrics(metrics)
    console.print(_table(doc))
    for note in _notes(doc):
        console.print(note, highlight=False)
    b = doc["budget"]
    ends = datetime.fromtimestamp(datetime.now(timezone.utc).timestamp() + b["projected_seconds"], timezone.utc)
    console.print(
        f"budget: probes spent ${b['probes_cost_usd']:.2f}; probes + both arms projected ${b['projected_cost_usd']:.2f} "
        f"of ${b['allocation_usd']:.2f} (at ${b['hourly_price_usd']:.2f} per device-hour); both arms started now would end "
        f"{ends.isoformat(timespec='seconds')} (deadline: {b['deadline'] or 'none'})",
        highlight=False,
    )
    if b["projected_cost_usd"] > b["allocation_usd"]:
        console.print("[red]the projection passes the allocation: train will refuse[/red]")
    state = "committed" if done.new else "unchanged, already committed"
    console.print(f"plan {done.sha256} {state} (ledger entry {done.entry.seq}): {done.path}", highlight=False)
    return 0
