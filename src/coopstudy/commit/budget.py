"""The budget: each arm's projected seconds and cost from its probe receipt,
what the plan has spent so far, the guard `train` runs before an arm, and the
one `evaluate` runs before it scores."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from coopstudy.config import Config
from coopstudy.errors import RefusedError
from coopstudy.record import schema, store


SPENDING_STAGES = (schema.STAGE_TRAIN, schema.STAGE_EVALUATE)
"""The stages under a plan whose runs hold devices and log what they spent
(the probes' cost is the plan's own figure): what the guards stop at a bound."""


def cost_usd(device_seconds: float, hourly_price_usd: float) -> float:
    """What devices held this long cost: the one formula of every spent and
    projected cost the guard compares."""
    return device_seconds / 3600 * hourly_price_usd


def spent_metrics(cfg: Config, devices: int, seconds: float) -> dict[str, float]:
    """What a run that held `devices` for `seconds` logs as spent: its complete
    and device seconds and their cost."""
    return {
        schema.M_COMPLETE_SECONDS: seconds,
        schema.M_DEVICE_SECONDS: devices * seconds,
        schema.M_COST_USD: cost_usd(devices * seconds, cfg.budget.hourly_price_usd),
    }


def projection(cfg: Config, receipt: dict[str, Any]) -> dict[str, Any]:
    """One arm's projected complete seconds and cost, from its probe receipt."""
    seconds = receipt["update_seconds"]
    # What a probe spends outside its updates (start-up, model loading) a full
    # run spends too; the checkpoint it does not write is not in it.
    overhead = max(0.0, receipt["complete_seconds"] - sum(seconds))
    total = overhead + receipt["median_update_seconds"] * cfg.train.updates
    workers = receipt["setting"]["workers"]
    return {
        "median_update_seconds": receipt["median_update_seconds"],
        "overhead_seconds": overhead,
        "updates": cfg.train.updates,
        "seconds": total,
        "devices": workers,
        "cost_usd": cost_usd(workers * total, cfg.budget.hourly_price_usd),
    }


def stage_spent(experiment: str, sha: str, stage: str) -> tuple[float, int]:
    """(what the runs of `stage` under plan `sha` spent, how many logged a cost):
    failed and stopped runs included (they used their devices too); a refusal
    before launch logs none."""
    runs = store.search_runs(experiment, f"tags.`{schema.TAG_PLAN}` = '{sha}' and tags.`{schema.TAG_STAGE}` = '{stage}'")
    spent = [r.data.metrics[schema.M_COST_USD] for r in runs if schema.M_COST_USD in r.data.metrics]
    return sum(spent), len(spent)


def check_spent(cfg: Config, sha: str, doc: dict[str, Any], stage: str) -> None:
    """Refuse `stage`, work the plan projected no cost for (evaluate), once a
    bound is reached: its allocation spent (probes, train and evaluate runs)
    or its deadline passed, where any work passes it."""
    spent = doc["budget"]["probes_cost_usd"] + sum(stage_spent(cfg.experiment, sha, s)[0] for s in SPENDING_STAGES)
    allocation, when = cfg.budget.allocation_usd, cfg.budget.deadline
    again = "another plan (a larger budget.allocation_usd or a later budget.deadline) trains both arms again"
    if spent >= allocation:
        raise RefusedError(
            f"budget: plan {sha[:12]} has spent ${spent:.2f} of budget.allocation_usd ${allocation:.2f}, so {stage} would pass it; {again}"
        )
    if when is not None and datetime.now(timezone.utc) >= when:
        raise RefusedError(f"deadline: budget.deadline {when.isoformat()} of plan {sha[:12]} has passed, so {stage} would work after it; {again}")


def spent_usd(cfg: Config, sha: str, doc: dict[str, Any]) -> tuple[float, int]:
    """(what the plan has spent so far, how many train runs spent it): its
    probes' cost plus the cost every earlier train run of this plan logged."""
    train, runs = stage_spent(cfg.experiment, sha, schema.STAGE_TRAIN)
    return doc["budget"]["probes_cost_usd"] + train, runs


@dataclass(frozen=True)
class Projected:
    """What the guard compares before starting `arms`, one after the other."""

    arms: tuple[str, ...]
    seconds: float
    cost_usd: float
    spent_usd: float
    """Spent by the plan so far: its probes and its earlier train runs."""
    probes_cost_usd: float
    train_runs: int
    """Earlier train runs of the plan that logged a cost."""


def projected(cfg: Config, sha: str, doc: dict[str, Any], arms: Sequence[str]) -> Projected:
    spent, runs = spent_usd(cfg, sha, doc)
    return Projected(
        arms=tuple(arms),
        seconds=sum(doc["arms"][a]["projection"]["seconds"] for a in arms),
        cost_usd=sum(doc["arms"][a]["projection"]["cost_usd"] for a in arms),
        spent_usd=spent,
        probes_cost_usd=doc["budget"]["probes_cost_usd"],
        train_runs=runs,
    )


def check_budget(cfg: Config, sha: str, p: Projected, now: datetime | None = None) -> None:
    """Refuse when the projection would pass the allocation or the deadline."""
    what = " then ".join(p.arms)
    allocation = cfg.budget.allocation_usd
    if p.spent_usd + p.cost_usd > allocation:
        raise RefusedError(
            f"budget: training {what} would pass the allocation: spent ${p.spent_usd:.2f} (probes "
            f"${p.probes_cost_usd:.2f}, {p.train_runs} earlier train run(s) of plan {sha[:12]}) + projected "
            f"${p.cost_usd:.2f} = ${p.spent_usd + p.cost_usd:.2f} > budget.allocation_usd ${allocation:.2f}"
        )
    when = cfg.budget.deadline
    end = (now or datetime.now(timezone.utc)).timestamp() + p.seconds
    if when is not None and end > when.timestamp():
        ends = datetime.fromtimestamp(end, timezone.utc).isoformat(timespec="seconds")
        raise RefusedError(
            f"deadline: training {what} is projected to take {p.seconds:.0f} s and end at {ends}, "
            f"after budget.deadline {when.isoformat()}"
        )
