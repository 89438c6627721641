"""Receipts: what the gate and each probe candidate measured, as documents
that later commitments hash.

The gate's receipt binds the numerical sources and library versions it ran
on. A probe receipt holds one candidate's setting, outcome, update seconds,
memory and the hashes of everything it ran on; receipts live under
`probe_dir(cfg)`, one JSON file per candidate, each committed to the ledger
(kind ledger.PROBE), under `probe_key(cfg)`, which leaves out what cannot
change what a probe measures, so choosing a microbatch that completed, or
changing the price, keeps them. `choose` reduces them to the largest
microbatch that completed per arm and allocator.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from coopstudy import workspace
from coopstudy.commit import budget, ledger, sources
from coopstudy.config import Config
from coopstudy.errors import RefusedError
from coopstudy.record import schema, store, writer

if TYPE_CHECKING:
    from coopstudy.numerics import gate


def setting_name(arm: str, microbatch: int, allocator: str) -> str:
    """The candidate's name: its runs' tag and its receipt's file name (receipt_file)."""
    return f"{arm}-mb{microbatch}-{allocator}"


RECEIPT_SUFFIX = ".json"


def receipt_file(name: str) -> str:
    """The file name of the receipt of the candidate `name` in probe_dir."""
    return f"{name}{RECEIPT_SUFFIX}"


def read_rank_reports(run_id: str) -> dict[int, dict[str, Any]]:
    """Every rank report the candidate's processes left on its run."""
    folder = schema.ART_PROBE_RANK_PREFIX.rsplit("/", 1)[0]
    with tempfile.TemporaryDirectory(prefix="coopstudy-probe-") as tmp:
        try:
            local = store.download_artifact(run_id, folder, tmp)
        except Exception:  # noqa: BLE001 - no process got as far as reporting
            return {}
        reports = [json.loads(p.read_text()) for p in sorted(Path(local).glob("rank*.json"))]
    return {r["rank"]: r for r in reports}


@dataclasses.dataclass(frozen=True)
class Launched:
    """What the stage saw of one candidate's launch."""

    returncode: int
    complete_seconds: float
    exit_reason: str
    """The exit as words (exit code, or the signal that ended it)."""


def probe_receipt(
    *,
    arm: str,
    microbatch: int,
    allocator: str,
    workers: int,
    updates: int,
    capacity_mb: int | None,
    run_id: str,
    launched: Launched,
    ranks: Mapping[int, Mapping[str, Any]],
    hourly_price_usd: float,
    context: Mapping[str, Any],
) -> dict[str, Any]:
    """The receipt of one candidate. `context` holds what the stage knows of
    the whole sweep: versions, input and source hashes, config digests."""
    outcome, message = _outcome(workers, launched, ranks)
    main = ranks.get(0, {})
    seconds = list(main.get("update_seconds", []))
    memory = {str(r): dict(ranks[r]["memory"]) for r in sorted(ranks)}
    device_seconds = workers * launched.complete_seconds
    return {
        "setting": {
            "name": setting_name(arm, microbatch, allocator),
            "arm": arm,
            "microbatch": microbatch,
            "allocator": allocator,
            "workers": workers,
            "updates": updates,
            "device_capacity_mb": capacity_mb,
        },
        "outcome": outcome,
        "message": message,
        "update_seconds": seconds,
        "median_update_seconds": statistics.median(seconds) if seconds and outcome == schema.OUTCOME_COMPLETED else None,
        "updates_done": len(seconds),
        "complete_seconds": launched.complete_seconds,
        "device_seconds": device_seconds,
        "cost_usd": budget.cost_usd(device_seconds, hourly_price_usd),
        "returncode": launched.returncode,
        "memory_by_rank": memory,
        "devices": sorted({f"{r['host']}:{r['device']} ({r['device_name']})" for r in ranks.values()}),
        "device_type": _device_type(ranks),
        "run_id": run_id,
        "time": time.time(),
        **context,
    }


def _device_type(ranks: Mapping[int, Mapping[str, Any]]) -> str | None:
    types = {str(r["device"]).split(":")[0] for r in ranks.values() if r["device"]}
    return types.pop() if len(types) == 1 else None


def _outcome(workers: int, launched: Launched, ranks: Mapping[int, Mapping[str, Any]]) -> tuple[str, str | None]:
    oom = [r for r in sorted(ranks) if ranks[r]["outcome"] == schema.OUTCOME_OUT_OF_MEMORY]
    if oom:
        # Other ranks are stopped once one fails; the out-of-memory is the cause.
        return schema.OUTCOME_OUT_OF_MEMORY, f"rank {oom[0]}: {ranks[oom[0]]['error']}"
    if launched.returncode == 0 and len(ranks) == workers and all(r["outcome"] == schema.OUTCOME_COMPLETED for r in ranks.values()):
        return schema.OUTCOME_COMPLETED, None
    errors = [f"rank {r}: {ranks[r]['error']}" for r in sorted(ranks) if ranks[r]["error"]]
    silent = [str(r) for r in range(workers) if r not in ranks]
    parts = [f"{launched.exit_reason}", *errors]
    if silent:
        parts.append(f"rank {', '.join(silent)} left no report (killed from outside, or out of host memory)")
    return schema.OUTCOME_ERROR, "; ".join(parts)


def memory_summary(receipt: Mapping[str, Any]) -> dict[str, float]:
    """The receipt's memory as run metrics: the largest figure over ranks."""
    ranks = list(receipt["memory_by_rank"].values())
    if not ranks:
        return {}
    names = {
        "peak_rss_mb": schema.M_PEAK_RSS_MB,
        "cuda_max_allocated_mb": schema.M_CUDA_MAX_ALLOCATED_MB,
        "cuda_max_reserved_mb": schema.M_CUDA_MAX_RESERVED_MB,
        "cuda_alloc_retries": schema.M_CUDA_ALLOC_RETRIES,
    }
    out = {metric: max(r[key] for r in ranks) for key, metric in names.items() if key in ranks[0]}
    if receipt["outcome"] != schema.OUTCOME_COMPLETED and "cuda_reserved_unallocated_mb" in ranks[0]:
        out[schema.M_CUDA_RESERVED_UNALLOCATED_MB] = max(r["cuda_reserved_unallocated_mb"] for r in ranks)
    return out


def memory_text(receipt: Mapping[str, Any]) -> str:
    """One short cell: the figure that decides whether the setting fits."""
    m = memory_summary(receipt)
    cap = receipt["setting"]["device_capacity_mb"]
    of = f" / {cap}" if cap else ""
    if schema.M_CUDA_MAX_RESERVED_MB in m:
        text = f"alloc {m[schema.M_CUDA_MAX_ALLOCATED_MB]:.0f}, resv {m[schema.M_CUDA_MAX_RESERVED_MB]:.0f}{of} MiB"
        if schema.M_CUDA_RESERVED_UNALLOCATED_MB in m:
            text += f", unalloc {m[schema.M_CUDA_RESERVED_UNALLOCATED_MB]:.0f}"
        return text + f", retries {m[schema.M_CUDA_ALLOC_RETRIES]:.0f}"
    if schema.M_PEAK_RSS_MB in m:
        return f"RSS {m[schema.M_PEAK_RSS_MB]:.0f}{of} MiB"
    return "-"


def choose(receipts: Sequence[Mapping[str, Any]]) -> dict[str, dict[str, dict[str, Any]]]:
    """Per arm and allocator: the largest microbatch that completed (None when
    none did), its median update seconds, and the microbatches that failed."""
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for r in receipts:
        s = r["setting"]
        cell = out.setdefault(s["arm"], {}).setdefault(
            s["allocator"], {"largest_completed_microbatch": None, "median_update_seconds": None, "receipt": None, "failed": []}
        )
        if r["outcome"] != schema.OUTCOME_COMPLETED:
            cell["failed"] = sorted({*cell["failed"], s["microbatch"]})
        elif cell["largest_completed_microbatch"] is None or s["microbatch"] > cell["largest_completed_microbatch"]:
            cell.update(largest_completed_microbatch=s["microbatch"], median_update_seconds=r["median_update_seconds"], receipt=s["name"])
    return out


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


def probe_dir(cfg: Config, *, make: bool = False) -> Path:
    """Where the receipts of `cfg`'s probe lie; made only to write one (a
    refusal that reads it leaves the study's folder as it was)."""
    parts = ("probes", probe_key(cfg)[:16])
    return workspace.subdir(*parts) if make else workspace.home().joinpath(*parts)


def _relative(path: Path) -> str:
    return str(path.relative_to(workspace.home()))


def keep_receipt(cfg: Config, receipt: dict[str, Any], rec: writer.Recorder) -> tuple[Path, str, ledger.Entry]:
    """Write a candidate's receipt (replacing that candidate's earlier one: the
    ledger and its run keep every attempt) and commit it on its probe run `rec` and in the ledger."""
    name = receipt["setting"]["name"]
    path = probe_dir(cfg, make=True) / receipt_file(name)
    workspace.write_text(path, json.dumps(receipt, indent=2, sort_keys=True))
    sha = workspace.sha256_file(path)
    entry, _ = ledger.Ledger().commit(
        rec,
        ledger.PROBE,
        f"{probe_key(cfg)}/{name}",
        sha,
        {"file": _relative(path), "outcome": receipt["outcome"], "run_id": receipt["run_id"]},
        tags={schema.TAG_PROBE_OUTCOME: receipt["outcome"], schema.TAG_PROBE_RECEIPT: sha},
    )
    return path, sha, entry


def receipt_hashes(cfg: Config) -> dict[str, str]:
    """Receipt file name -> sha256, for every receipt now in probe_dir(cfg)."""
    return {p.name: workspace.sha256_file(p) for p in sorted(probe_dir(cfg).glob(f"*{RECEIPT_SUFFIX}"))}


SWEEP_CONTEXT = ("sources", "libraries", "inputs")
"""What every receipt of one sweep shares (steps/probe.py's context): receipts
that differ in one were measured on other code or inputs."""


def probe_receipts(cfg: Config) -> dict[str, dict[str, Any]]:
    """Receipt file name -> receipt, each checked against its ledger entry,
    all of them measured on the same code and inputs."""
    book = ledger.Ledger()
    key = probe_key(cfg)
    out: dict[str, dict[str, Any]] = {}
    for name, sha in receipt_hashes(cfg).items():
        entry = book.latest(ledger.PROBE, f"{key}/{name.removesuffix(RECEIPT_SUFFIX)}")
        if entry is None or entry.digest != sha:
            raise RefusedError(
                f"probe receipt {probe_dir(cfg) / name} is not the one the probe committed to the ledger "
                "(it was edited or copied in, or the probe was stopped while it committed it)",
                hint=f"run `python -m coopstudy probe {cfg.arguments}` again",
            )
        out[name] = json.loads((probe_dir(cfg) / name).read_text())
    # A sweep stopped part-way leaves the candidates it did not reach as an earlier sweep
    # probed them: where that one ran other code or inputs, together they measure nothing.
    names = list(out)
    for name in names[1:]:
        moved = [field for field in SWEEP_CONTEXT if out[name].get(field) != out[names[0]].get(field)]
        if moved:
            raise RefusedError(
                f"probe receipts {names[0]} and {name} in {probe_dir(cfg)} were measured on different {' and '.join(moved)} "
                "(a sweep stopped before it probed every candidate again)",
                hint=f"run `python -m coopstudy probe {cfg.arguments}` again",
            )
    return out


def gate_receipt_digest(receipt: dict[str, Any]) -> str:
    return workspace.sha256_json(receipt)


def gate_receipt(result: gate.GateResult, cfg: Config) -> dict[str, Any]:
    # Imported here: the gate needs torch, and every command that only checks receipts starts without it.
    from coopstudy.numerics import gate

    sha, files = sources.numerical_sources_sha256()
    gate_cfg = gate.gate_config(cfg)
    return {
        "subject": sources.GATE_SUBJECT,
        "passed": result.passed,
        "sources_sha256": sha,
        "sources": files,
        "libraries": sources.library_versions(),
        "tolerance": gate.TOLERANCE,
        "relative_error": "max|batched - reference| / max|reference|, per tensor",
        "max_rel_error": result.max_rel_error,
        "dtype": "float64",
        "world_size": gate.WORLD_SIZE,
        "backend": "gloo",
        "model": gate.GATE_MODEL,
        "preset": cfg.preset,
        "optimizer": gate_cfg.train.model_dump(
            mode="json", include={"lr", "adam_beta1", "adam_beta2", "adam_eps", "weight_decay", "warmup_updates", "grad_clip"}
        ),
        "rows": [asdict(row) for row in result.rows],
        "failures": result.failures,
        "seconds": round(result.seconds, 3),
        "time": time.time(),
    }
