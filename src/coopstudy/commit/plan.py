"""The frozen plan: one document that says what the study will do, committed
before any full training run.

It holds the resolved config of both arms, the screens' thresholds and
methods, and the hashes of everything the runs will depend on: every source
file that decides a number (`sources.deciding_sources()`: the training
worker, data preparation, evaluation and analysis, with the numerical sources
among them), every prepared input, the gate receipt and every probe receipt,
plus the probes' choice and each arm's cost and time projection.
`require.committed_plan(cfg)` checks that nothing it hashes has changed and returns
its sha256, which every later run carries as schema.TAG_PLAN.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from coopstudy import workspace
from coopstudy.commit import budget, ledger, receipts, sources
from coopstudy.config import ARMS, NO_CANDIDATES, TRAINING_ALLOCATOR, Config
from coopstudy.errors import RefusedError, UserError
from coopstudy.inputs import data
from coopstudy.record import schema, store, writer

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
    return store.config_sha256(cfg)


def arm_setting(cfg: Config, arm: str) -> tuple[int, str]:
    """(microbatch, allocator) the arm's full run uses: the preset's microbatch
    and the protocol's allocator."""
    return cfg.arm(arm).microbatch, TRAINING_ALLOCATOR


def _arm_receipt(cfg: Config, arm: str, kept: dict[str, dict[str, Any]]) -> tuple[str, dict[str, Any]]:
    """The completed receipt that stands for the arm's setting, or a refusal
    saying what the probes found."""
    microbatch, allocator = arm_setting(cfg, arm)
    wanted = receipts.receipt_file(receipts.setting_name(arm, microbatch, allocator))

    def stands_for(name: str, body: dict[str, Any]) -> bool:
        s = body["setting"]
        # On CPU the allocator setting changes nothing (PYTORCH_CUDA_ALLOC_CONF
        # configures CUDA's caching allocator only), so a CPU receipt of the
        # arm and microbatch under the other setting measured the same run.
        return name == wanted or ((s["arm"], s["microbatch"]) == (arm, microbatch) and body.get("device_type") == "cpu")

    # The exact setting first.
    found = sorted(((n, b) for n, b in kept.items() if stands_for(n, b)), key=lambda item: item[0] != wanted)
    for name, body in found:
        if body["outcome"] == schema.OUTCOME_COMPLETED:
            return name, body
    what = f"arms.{arm}.microbatch {microbatch} with the {allocator} allocator"
    completed = sorted({b["setting"]["microbatch"] for b in kept.values() if b["setting"]["arm"] == arm and b["outcome"] == schema.OUTCOME_COMPLETED})
    choose = (
        f"choose one that completed (microbatch {', '.join(map(str, completed))}: --set arms.{arm}.microbatch=N)"
        if completed
        else "no candidate of this arm completed"
    )
    if found:
        name, body = found[0]
        raise RefusedError(f"{what} failed its probe ({name}: {body['outcome']}: {body['message']}); {choose}")
    raise RefusedError(f"{what} has no probe receipt; add it to probe.candidates and run probe, or {choose}")


def build(cfg: Config, prepared: data.Prepared, gate_entry: ledger.Entry) -> dict[str, Any]:
    """The plan document for `cfg` from the commitments on disk now: the
    checked inputs and gate receipt (coopstudy.commit.require), the probe
    receipts, the deciding sources."""
    sources_sha, files = sources.deciding_sources_sha256()
    kept = receipts.probe_receipts(cfg)
    if not cfg.probe.candidates:
        raise UserError(NO_CANDIDATES)
    if not kept:
        raise RefusedError(f"no probe receipts in {receipts.probe_dir(cfg)}", hint=f"run `python -m coopstudy probe {cfg.arguments}` first")
    when = cfg.budget.deadline
    arms: dict[str, Any] = {}
    for arm in ARMS:
        name, receipt = _arm_receipt(cfg, arm, kept)
        microbatch, allocator = arm_setting(cfg, arm)
        arms[arm] = {
            "workers": cfg.arm(arm).workers,
            "microbatch": microbatch,
            "allocator": allocator,
            "receipt": name,
            "projection": budget.projection(cfg, receipt),
        }
    probes_cost = sum(r["cost_usd"] for r in kept.values())
    return {
        "preset": cfg.preset,
        "config_sha256": subject(cfg),
        "config": cfg.model_dump(mode="json"),
        "arms": arms,
        "choice": receipts.choose(list(kept.values())),
        "screens": cfg.screens.model_dump(mode="json"),
        "methods": METHODS,
        "sources": {"sha256": sources_sha, "files": files},
        "inputs": {"sha256": prepared.digest, "seed_sha256": prepared.manifest["seed_model"]["sha256"]},
        "gate_receipt": gate_entry.digest,
        "probe_key": receipts.probe_key(cfg),
        "probe_receipts": receipts.receipt_hashes(cfg),
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


def differences(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    out = []
    for key in sorted(set(old) | set(new)):
        if old.get(key) == new.get(key):
            continue
        if key == "sources":
            out.append("source " + ", ".join(sources.changed(old[key]["files"], new[key]["files"])))
        elif key == "probe_receipts":
            out.append("probe receipt " + ", ".join(sources.changed(old[key], new[key])))
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


def commit(cfg: Config, prepared: data.Prepared, gate_entry: ledger.Entry, rec: writer.Recorder) -> Committed:
    """Build the plan, write its file and commit it on plan run `rec` and in the ledger."""
    doc = build(cfg, prepared, gate_entry)
    sha = digest(doc)
    path = workspace.subdir("plans") / f"{sha}.json"
    # Named by its digest: a plan committed again finds its file as written.
    workspace.write_text(path, json.dumps(doc, indent=2, sort_keys=True))
    tags = {
        schema.TAG_PLAN: sha,
        schema.TAG_REQUIRES_PREFIX + ledger.GATE: doc["gate_receipt"],
        schema.TAG_REQUIRES_PREFIX + ledger.INPUTS: doc["inputs"]["sha256"],
    }
    entry, previous = ledger.Ledger().commit(
        rec, ledger.PLAN, subject(cfg), sha, {"file": workspace.relative(path), "preset": cfg.preset}, tags=tags
    )
    return Committed(sha, doc, path, entry, new=entry is not previous)


def file(entry: ledger.Entry) -> Path:
    """Where the plan committed as `entry` is written."""
    return workspace.home() / entry.details["file"]


def stored(entry: ledger.Entry) -> Any:
    """The document in the file of the plan committed as `entry`, parsed; None
    when it holds no JSON (edited). OSError when it cannot be read."""
    try:
        return json.loads(file(entry).read_text())
    except ValueError:  # not JSON, or not UTF-8
        return None


def intact(cfg: Config, entry: ledger.Entry, doc: Any) -> dict[str, Any]:
    """`doc`, read from the file of the plan committed as `entry` (stored), or a
    refusal where that file is gone or holds another document."""
    path = file(entry)
    if not path.is_file():
        raise RefusedError(
            f"the committed plan {entry.digest[:12]} is missing from {path}", hint=f"commit it again with `python -m coopstudy plan {cfg.arguments}`"
        )
    if isinstance(doc, OSError):
        raise doc
    if not isinstance(doc, dict) or digest(doc) != entry.digest:
        # The plan is derived: writing it again gives back the committed document, or commits a new one.
        raise RefusedError(
            f"the plan file {path} was edited after it was committed", hint=f"write it again: `python -m coopstudy plan {cfg.arguments}`"
        )
    return doc


def document(cfg: Config, sha: str) -> dict[str, Any]:
    """The committed plan `sha` of `cfg`, checked again: a stage that reads it
    later than require.committed_plan (train's second arm, hours on) may find
    the file gone or edited meanwhile."""
    entry = ledger.Ledger().require(ledger.PLAN, subject(cfg), hint=hint(cfg))
    if entry.digest != sha:
        raise RefusedError(f"plan {sha[:12]} is not the committed plan of this config (that is {entry.digest[:12]})")
    try:
        doc = stored(entry)
    except FileNotFoundError:
        doc = None  # said as gone by intact
    return intact(cfg, entry, doc)


def hint(cfg: Config) -> str:
    if receipts.receipt_hashes(cfg):
        return f"run `python -m coopstudy plan {cfg.arguments}` first"
    # Probe may need verify and prepare before it: one command that runs
    # whatever of them is missing, rather than one refusal per step.
    return f"run `python -m coopstudy study {cfg.arguments} --through plan` first (it runs what is missing of prepare, verify, probe and plan)"
