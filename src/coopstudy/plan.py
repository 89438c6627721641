"""The frozen plan: one document that says what the study will do, committed
before any full training run.

It holds the resolved config of both arms, the screens' thresholds and
methods, and the hashes of everything the runs will depend on: the numerical
sources, every prepared input, the gate receipt and every probe receipt,
plus the probes' choice and each arm's cost and time projection.
`require_plan(cfg)` checks that nothing it hashes has changed and returns its
sha256, which every later run carries as tracking.TAG_PLAN; `check_budget`
is the guard `train` runs before starting an arm.

Probe receipts live under `probe_dir(cfg)`, one JSON file per candidate,
each also committed to the ledger (kind ledger.PROBE). They are kept
under `probe_key(cfg)`, which leaves out what cannot change what a probe
measures, so choosing a microbatch that completed, or changing the price,
keeps them.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from coopstudy import launch, ledger, probe, tracking, workspace
from coopstudy.config import Config
from coopstudy.errors import RefusedError

ARMS = ("control", "compressed")

METHODS = {
    "correct": "a test case is correct when its family's reasoning-gym verifier scores it 1.0",
    "accuracy_gain": "compressed - seed accuracy, paired by test case; passes on the point estimate; "
    "Tango's score interval (Newcombe's hybrid score beside it), two-sided at interval_level",
    "retention": "per document, compressed - seed mean NLL of assistant tokens; one-sided paired t upper "
    "bound at retention_level over documents (document-weighted); token-weighted ratio estimate with a "
    "document-clustered standard error beside it",
    "noninferiority": "lower limit of Tango's score interval for compressed - control accuracy, paired by "
    "test case, two-sided at interval_level, above noninferiority_margin",
    "speed": "control seconds / compressed seconds, active (first update start to last update end) and "
    "complete (launch of the first process to exit of the last), each at least min_speedup",
    "beside": "device-seconds, checkpoint seconds, transmitted bytes by phase and spent cost are reported, "
    "never folded into a screen; no dense-communication reduction is computed",
    "projection": "per arm, from its probe receipt: (complete seconds - sum of update seconds) + median update "
    "seconds x train.updates; cost = workers x projected seconds / 3600 x budget.hourly_price_usd",
}


def subject(cfg: Config) -> str:
    """Plans are kept per resolved config."""
    return tracking.config_sha256(cfg)


def probe_key(cfg: Config) -> str:
    """The config less what cannot change a probe's measurement: the arms'
    microbatch sizes (each candidate sets its own), train.updates (a probe runs
    probe.updates; the plan multiplies), budget, screens and evaluation."""
    raw = cfg.model_dump(mode="json")
    for name in ("budget", "screens", "evaluate"):
        raw.pop(name)
    raw["train"].pop("updates")
    for arm in raw["arms"].values():
        arm.pop("microbatch")
    return workspace.sha256_bytes(json.dumps(raw, sort_keys=True).encode())


def probe_dir(cfg: Config) -> Path:
    return workspace.subdir("probes", probe_key(cfg)[:16])


def _relative(path: Path) -> str:
    return str(path.relative_to(workspace.home()))


def keep_receipt(cfg: Config, receipt: dict[str, Any]) -> tuple[Path, str, ledger.Entry]:
    """Write a candidate's receipt (replacing that candidate's earlier one: the
    ledger and its run keep every attempt) and commit it to the ledger."""
    name = receipt["setting"]["name"]
    path = probe_dir(cfg) / f"{name}.json"
    path.write_text(json.dumps(receipt, indent=2, sort_keys=True))
    sha = workspace.sha256_file(path)
    entry = ledger.Ledger().append(
        ledger.PROBE,
        f"{probe_key(cfg)}/{name}",
        sha,
        {"file": _relative(path), "outcome": receipt["outcome"], "run_id": receipt["run_id"]},
    )
    return path, sha, entry


def receipt_hashes(cfg: Config) -> dict[str, str]:
    """Receipt file name -> sha256, for every receipt now in probe_dir(cfg)."""
    return {p.name: workspace.sha256_file(p) for p in sorted(probe_dir(cfg).glob("*.json"))}


def probe_receipts(cfg: Config) -> dict[str, dict[str, Any]]:
    """Receipt file name -> receipt, each checked against its ledger entry."""
    book = ledger.Ledger()
    key = probe_key(cfg)
    out: dict[str, dict[str, Any]] = {}
    for name, sha in receipt_hashes(cfg).items():
        entry = book.latest(ledger.PROBE, f"{key}/{name.removesuffix('.json')}")
        if entry is None or entry.digest != sha:
            raise RefusedError(
                f"probe receipt {probe_dir(cfg) / name} is not the one the probe committed to the ledger "
                f"(it was edited or copied in); run `python -m coopstudy probe --preset {cfg.preset}` again"
            )
        out[name] = json.loads((probe_dir(cfg) / name).read_text())
    return out


def probes_complete(cfg: Config) -> None:
    """Every candidate of probe.candidates has a committed receipt, or a refusal."""
    receipts = probe_receipts(cfg)
    missing = [
        probe.setting_name(c.arm, c.microbatch, c.allocator)
        for c in cfg.probe.candidates
        if f"{probe.setting_name(c.arm, c.microbatch, c.allocator)}.json" not in receipts
    ]
    if missing:
        raise RefusedError(f"no probe receipt for {', '.join(missing)}; run `python -m coopstudy probe --preset {cfg.preset}`")


def arm_setting(cfg: Config, arm: str) -> tuple[int, str]:
    """(microbatch, allocator) the arm's full run uses: the preset's microbatch
    and the protocol's allocator."""
    return getattr(cfg.arms, arm).microbatch, launch.TRAINING_ALLOCATOR


def _arm_receipt(cfg: Config, arm: str, receipts: dict[str, dict[str, Any]]) -> tuple[str, dict[str, Any]]:
    """The completed receipt that stands for the arm's setting, or a refusal
    saying what the probes found."""
    microbatch, allocator = arm_setting(cfg, arm)
    wanted = f"{probe.setting_name(arm, microbatch, allocator)}.json"

    def stands_for(name: str, body: dict[str, Any]) -> bool:
        s = body["setting"]
        # On CPU the allocator setting changes nothing (PYTORCH_CUDA_ALLOC_CONF
        # configures CUDA's caching allocator only), so a CPU receipt of the
        # arm and microbatch under the other setting measured the same run.
        return name == wanted or ((s["arm"], s["microbatch"]) == (arm, microbatch) and body.get("device_type") == "cpu")

    # The exact setting first.
    found = sorted(((n, b) for n, b in receipts.items() if stands_for(n, b)), key=lambda item: item[0] != wanted)
    for name, body in found:
        if body["outcome"] == probe.COMPLETED:
            return name, body
    hint = f"arms.{arm}.microbatch {microbatch} with the {allocator} allocator"
    completed = sorted({b["setting"]["microbatch"] for b in receipts.values() if b["setting"]["arm"] == arm and b["outcome"] == probe.COMPLETED})
    choose = (
        f"choose one that completed (microbatch {', '.join(map(str, completed))}: --set arms.{arm}.microbatch=N)"
        if completed
        else "no candidate of this arm completed"
    )
    if found:
        name, body = found[0]
        raise RefusedError(f"{hint} failed its probe ({name}: {body['outcome']}: {body['message']}); {choose}")
    raise RefusedError(f"{hint} has no probe receipt; add it to probe.candidates and run probe, or {choose}")


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
        "cost_usd": workers * total / 3600 * cfg.budget.hourly_price_usd,
    }


def deadline(cfg: Config) -> datetime | None:
    """The stop deadline; the config refuses one without a time zone."""
    return cfg.budget.deadline


def build(cfg: Config) -> dict[str, Any]:
    """The plan document for `cfg` from the commitments on disk now."""
    from coopstudy import data, gate

    sources_sha, sources = gate.numerical_sources_sha256()
    prepared = data.load_prepared(cfg)
    gate_entry = gate.require_gate_receipt()
    receipts = probe_receipts(cfg)
    if not receipts:
        raise RefusedError(f"no probe receipts in {probe_dir(cfg)}; run `python -m coopstudy probe --preset {cfg.preset}` first")
    when = deadline(cfg)
    arms: dict[str, Any] = {}
    for arm in ARMS:
        name, receipt = _arm_receipt(cfg, arm, receipts)
        microbatch, allocator = arm_setting(cfg, arm)
        arms[arm] = {
            "workers": getattr(cfg.arms, arm).workers,
            "microbatch": microbatch,
            "allocator": allocator,
            "receipt": name,
            "projection": projection(cfg, receipt),
        }
    probes_cost = sum(r["cost_usd"] for r in receipts.values())
    return {
        "preset": cfg.preset,
        "config_sha256": subject(cfg),
        "config": cfg.model_dump(mode="json"),
        "arms": arms,
        "choice": probe.choose(list(receipts.values())),
        "screens": cfg.screens.model_dump(mode="json"),
        "methods": METHODS,
        "sources": {"sha256": sources_sha, "files": sources},
        "inputs": {"sha256": prepared.digest, "seed_sha256": prepared.manifest["seed_model"]["sha256"]},
        "gate_receipt": gate_entry.digest,
        "probe_key": probe_key(cfg),
        "probe_receipts": receipt_hashes(cfg),
        "budget": {
            "hourly_price_usd": cfg.budget.hourly_price_usd,
            "allocation_usd": cfg.budget.allocation_usd,
            "deadline": when.isoformat() if when else None,
            "probes_cost_usd": probes_cost,
            "projected_cost_usd": probes_cost + sum(a["projection"]["cost_usd"] for a in arms.values()),
            "projected_seconds": sum(a["projection"]["seconds"] for a in arms.values()),
        },
    }


def digest(doc: dict[str, Any]) -> str:
    return workspace.sha256_bytes(json.dumps(doc, sort_keys=True).encode())


def _changed(old: dict[str, str], new: dict[str, str]) -> list[str]:
    return [
        f"{name} ({'removed' if name not in new else 'new' if name not in old else 'changed'})"
        for name in sorted(set(old) | set(new))
        if old.get(name) != new.get(name)
    ]


def _differences(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    out = []
    for key in sorted(set(old) | set(new)):
        if old.get(key) == new.get(key):
            continue
        if key == "sources":
            out.append("numerical source " + ", ".join(_changed(old[key]["files"], new[key]["files"])))
        elif key == "probe_receipts":
            out.append("probe receipt " + ", ".join(_changed(old[key], new[key])))
        elif key == "inputs":
            out.append(f"prepared inputs ({old[key]['sha256'][:12]} -> {new[key]['sha256'][:12]})")
        elif key == "gate_receipt":
            out.append(f"gate receipt ({old[key][:12]} -> {new[key][:12]})")
        else:
            out.append(key.replace("_", " "))
    return out


@dataclass(frozen=True)
class Committed:
    sha256: str
    document: dict[str, Any]
    path: Path
    entry: ledger.Entry
    new: bool
    """False: the same plan was already the committed one."""


def commit(cfg: Config) -> Committed:
    doc = build(cfg)
    sha = digest(doc)
    path = workspace.subdir("plans") / f"{sha}.json"
    # Named by its digest: rewriting it writes the same document.
    path.write_text(json.dumps(doc, indent=2, sort_keys=True))
    book = ledger.Ledger()
    latest = book.latest(ledger.PLAN, subject(cfg))
    if latest is not None and latest.digest == sha:
        return Committed(sha, doc, path, latest, new=False)
    entry = book.append(ledger.PLAN, subject(cfg), sha, {"file": _relative(path), "preset": cfg.preset})
    return Committed(sha, doc, path, entry, new=True)


def document(cfg: Config, sha: str) -> dict[str, Any]:
    """The committed plan `sha` of `cfg` (require_plan has checked it)."""
    entry = ledger.Ledger().require(ledger.PLAN, subject(cfg), hint=_hint(cfg))
    if entry.digest != sha:
        raise RefusedError(f"plan {sha[:12]} is not the committed plan of this config (that is {entry.digest[:12]})")
    return json.loads((workspace.home() / entry.details["file"]).read_text())


def _hint(cfg: Config) -> str:
    steps = f"`python -m coopstudy plan --preset {cfg.preset}`"
    if not receipt_hashes(cfg):
        steps = f"`python -m coopstudy probe --preset {cfg.preset}` and {steps}"
    return f"run {steps} first, with the same --set overrides"


def require_plan(cfg: Config) -> str:
    """The committed plan's sha256, after checking that nothing it hashes has
    changed; a refusal names what did. Later stages tag their runs with it
    (tracking.TAG_PLAN)."""
    from coopstudy import gate

    entry = ledger.Ledger().require(ledger.PLAN, subject(cfg), hint=_hint(cfg))
    short = entry.digest[:12]
    stored = workspace.home() / entry.details["file"]
    if not stored.is_file():
        raise RefusedError(f"the committed plan {short} is missing from {stored}; commit it again with `python -m coopstudy plan`")
    old = json.loads(stored.read_text())
    if digest(old) != entry.digest:
        raise RefusedError(f"the plan file {stored} was edited after it was committed")
    rerun = f"rerun the steps after it and commit the plan again (`python -m coopstudy study --preset {cfg.preset}`)"
    # The cheap checks first, each naming the files that changed.
    _, sources = gate.numerical_sources_sha256()
    if sources != old["sources"]["files"]:
        raise RefusedError(f"changed since the plan {short} was committed: numerical source {', '.join(_changed(old['sources']['files'], sources))}; {rerun}")
    receipts = receipt_hashes(cfg)
    if receipts != old["probe_receipts"]:
        raise RefusedError(f"changed since the plan {short} was committed: probe receipt {', '.join(_changed(old['probe_receipts'], receipts))}; {rerun}")
    try:
        new = build(cfg)
    except RefusedError as err:
        # Inputs that no longer verify, a gate receipt that no longer matches:
        # the message names the file.
        raise RefusedError(f"changed since the plan {short} was committed: {err}") from None
    if digest(new) != entry.digest:
        raise RefusedError(f"changed since the plan {short} was committed: {'; '.join(_differences(old, new))}; {rerun}")
    return entry.digest


# --- budget and deadline -------------------------------------------------------


def spent_usd(cfg: Config, sha: str, doc: dict[str, Any]) -> tuple[float, int]:
    """(what the plan has spent so far, how many train runs spent it): its
    probes' cost plus the cost every earlier train run of this plan logged,
    failed attempts included (they used their devices too)."""
    runs = tracking.search_runs(
        cfg.experiment, f"tags.`{tracking.TAG_PLAN}` = '{sha}' and tags.`{tracking.TAG_STAGE}` = '{tracking.STAGE_TRAIN}'"
    )
    spent = [r.data.metrics[tracking.M_COST_USD] for r in runs if tracking.M_COST_USD in r.data.metrics]
    return doc["budget"]["probes_cost_usd"] + sum(spent), len(spent)


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
    when = deadline(cfg)
    end = (now or datetime.now(timezone.utc)).timestamp() + p.seconds
    if when is not None and end > when.timestamp():
        ends = datetime.fromtimestamp(end, timezone.utc).isoformat(timespec="seconds")
        raise RefusedError(
            f"deadline: training {what} is projected to take {p.seconds:.0f} s and end at {ends}, "
            f"after budget.deadline {when.isoformat()}"
        )
