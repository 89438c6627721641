"""Probes: a few updates of the real training loop per candidate setting,
each candidate in its own process(es), each leaving a receipt.

Two halves:
- inside a training process (`python -m coopstudy.train --probe`),
  `RankProbe` holds the process to the device's capacity and, however the
  process ends, writes what it measured to the candidate's run (through the
  tracking store, so a rank on a second host reports the same way);
- in the stage, `make_receipt` turns those rank reports and the launch's exit
  into the receipt (setting, outcome, update seconds, memory, versions,
  hashes), and `choose` reduces the receipts to the largest microbatch that
  completed per arm and allocator.

Capacity on CPU. One emulated device is one core and `capacity_mb` of host
memory. The process's peak resident set is compared with it during every
backward (after each parameter's gradient is accumulated) and after every
update; above it, the process raises `DeviceOutOfMemory`, which the receipt
records as out_of_memory, exactly as torch.cuda.OutOfMemoryError is on a GPU.
The peak is the kernel's high-water mark (VmHWM), so no short spike between
two checks is missed: a forward's activations count at the next check. Not
RLIMIT_AS: it bounds virtual address space, which torch, OpenMP and glibc's
arenas reserve far beyond what they touch, so it fails on reservations that
use no memory, at arbitrary places (imports included), and as anything from
MemoryError to a segfault. Not RLIMIT_RSS: Linux ignores it. Not a polling
thread: it misses peaks and competes for the device's one core.
On CUDA, the capacity (when the preset gives one) is set as the caching
allocator's per-process fraction, so the real allocator fails with its own
out-of-memory error; it lets a larger GPU stand in for the study's device.
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import re
import resource
import socket
import statistics
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from coopstudy import tracking

"""The ledger kind of a probe receipt (ledger.PROBE, once the ledger names it)."""

COMPLETED = "completed"
OUT_OF_MEMORY = "out_of_memory"
ERROR = "error"


class DeviceOutOfMemory(RuntimeError):
    """The emulated CPU device's capacity was exceeded."""


def setting_name(arm: str, microbatch: int, allocator: str) -> str:
    """The candidate's name: its runs' tag and its receipt's file name."""
    return f"{arm}-mb{microbatch}-{allocator}"


def peak_rss_mb() -> float:
    """This process's peak resident set, MiB.

    VmHWM from /proc/self/status, not getrusage's ru_maxrss: Linux carries
    ru_maxrss across exec, so a process started by a larger parent (the stage,
    with MLflow loaded) would report the parent's peak as its own.
    """
    try:
        status = Path("/proc/self/status").read_text()
    except OSError:
        # No procfs (not Linux): ru_maxrss, KiB on Linux-like systems.
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    found = re.search(r"^VmHWM:\s+(\d+) kB", status, re.MULTILINE)
    return int(found.group(1)) / 1024 if found else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _first_line(err: BaseException) -> str:
    return (str(err).strip().splitlines() or [""])[0]


def outcome_of(err: BaseException | None) -> str:
    if err is None:
        return COMPLETED
    import torch

    # MemoryError: the host itself ran out, which on CPU is the device.
    if isinstance(err, (DeviceOutOfMemory, torch.cuda.OutOfMemoryError, MemoryError)):
        return OUT_OF_MEMORY
    return ERROR


class RankProbe:
    """One training process's part of a probe: capacity, update seconds, report."""

    def __init__(self, run_id: str, rank: int, capacity_mb: int | None):
        self.run_id, self.rank, self.capacity_mb = run_id, rank, capacity_mb
        self.update_seconds: list[float] = []
        self.device: Any = None

    def start(self, device: Any) -> None:
        """Bind to the process's device, before anything is placed on it."""
        import torch

        self.device = device
        if device.type == "cuda" and self.capacity_mb:
            total = torch.cuda.get_device_properties(device).total_memory
            torch.cuda.set_per_process_memory_fraction(min(1.0, self.capacity_mb * 2**20 / total), device)

    def watch(self, model: Any) -> None:
        """Check the capacity during every backward, as each gradient lands:
        the moment a GPU would fail to allocate."""
        if self.device is None or self.device.type != "cpu" or not self.capacity_mb:
            return
        for param in model.parameters():
            if param.requires_grad:
                param.register_post_accumulate_grad_hook(lambda _: self.check())

    def check(self) -> None:
        if self.device is None or self.device.type != "cpu" or not self.capacity_mb:
            return
        peak = peak_rss_mb()
        if peak > self.capacity_mb:
            raise DeviceOutOfMemory(
                f"CPU out of memory: peak RSS {peak:.0f} MiB exceeds the device capacity {self.capacity_mb} MiB"
            )

    def updated(self, seconds: float) -> None:
        """After each update: the optimizer's first step allocates its state."""
        self.update_seconds.append(seconds)
        self.check()

    def memory(self) -> dict[str, float]:
        """Memory figures now; after a failure, at the failure (the failed
        frames still hold their tensors while the error is handled)."""
        figures: dict[str, float] = {"peak_rss_mb": peak_rss_mb()}
        if self.device is not None and self.device.type == "cuda":
            import torch

            stats = torch.cuda.memory_stats(self.device)
            allocated, reserved = torch.cuda.memory_allocated(self.device), torch.cuda.memory_reserved(self.device)
            figures |= {
                "cuda_max_allocated_mb": torch.cuda.max_memory_allocated(self.device) / 2**20,
                "cuda_max_reserved_mb": torch.cuda.max_memory_reserved(self.device) / 2**20,
                "cuda_allocated_mb": allocated / 2**20,
                "cuda_reserved_mb": reserved / 2**20,
                "cuda_reserved_unallocated_mb": (reserved - allocated) / 2**20,
                "cuda_alloc_retries": stats.get("num_alloc_retries", 0),
                "cuda_ooms": stats.get("num_ooms", 0),
                "cuda_total_mb": torch.cuda.get_device_properties(self.device).total_memory / 2**20,
            }
        return figures

    def finish(self, err: BaseException | None) -> None:
        """Write this rank's report to the candidate's run, whatever happened."""
        import torch

        device = self.device
        report = {
            "rank": self.rank,
            "outcome": outcome_of(err),
            "error": f"{type(err).__name__}: {_first_line(err)}" if err is not None else None,
            "update_seconds": self.update_seconds,
            "memory": self.memory(),
            "capacity_mb": self.capacity_mb,
            "device": str(device) if device is not None else None,
            "device_name": torch.cuda.get_device_name(device) if device is not None and device.type == "cuda" else platform.processor() or platform.machine(),
            "host": socket.gethostname(),
            "torch": torch.__version__,
        }
        tracking.Recorder(self.run_id).log_dict(report, f"{tracking.ART_PROBE_RANK_PREFIX}{self.rank}.json")


def read_rank_reports(run_id: str) -> dict[int, dict[str, Any]]:
    """Every rank report the candidate's processes left on its run."""
    folder = tracking.ART_PROBE_RANK_PREFIX.rsplit("/", 1)[0]
    # MLflow's download bar would cut into the sweep's own lines.
    quiet = "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR"
    before = os.environ.get(quiet)
    os.environ[quiet] = "false"
    try:
        with tempfile.TemporaryDirectory(prefix="coopstudy-probe-") as tmp:
            try:
                local = tracking.download_artifact(run_id, folder, tmp)
            except Exception:  # noqa: BLE001 - no process got as far as reporting
                return {}
            reports = [json.loads(p.read_text()) for p in sorted(Path(local).glob("rank*.json"))]
    finally:
        if before is None:
            os.environ.pop(quiet)
        else:
            os.environ[quiet] = before
    return {r["rank"]: r for r in reports}


@dataclasses.dataclass(frozen=True)
class Launched:
    """What the stage saw of one candidate's launch."""

    returncode: int
    complete_seconds: float
    exit_reason: str
    """The exit as words (exit code, or the signal that ended it)."""


def make_receipt(
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
        "median_update_seconds": statistics.median(seconds) if seconds and outcome == COMPLETED else None,
        "updates_done": len(seconds),
        "complete_seconds": launched.complete_seconds,
        "device_seconds": device_seconds,
        "cost_usd": device_seconds / 3600 * hourly_price_usd,
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
    oom = [r for r in sorted(ranks) if ranks[r]["outcome"] == OUT_OF_MEMORY]
    if oom:
        # Other ranks are stopped once one fails; the out-of-memory is the cause.
        return OUT_OF_MEMORY, f"rank {oom[0]}: {ranks[oom[0]]['error']}"
    if launched.returncode == 0 and len(ranks) == workers and all(r["outcome"] == COMPLETED for r in ranks.values()):
        return COMPLETED, None
    errors = [f"rank {r}: {ranks[r]['error']}" for r in sorted(ranks) if ranks[r]["error"]]
    silent = [str(r) for r in range(workers) if r not in ranks]
    parts = [f"{launched.exit_reason}", *errors]
    if silent:
        parts.append(f"rank {', '.join(silent)} left no report (killed from outside, or out of host memory)")
    return ERROR, "; ".join(parts)


def memory_summary(receipt: Mapping[str, Any]) -> dict[str, float]:
    """The receipt's memory as run metrics: the largest figure over ranks."""
    ranks = list(receipt["memory_by_rank"].values())
    if not ranks:
        return {}
    names = {
        "peak_rss_mb": tracking.M_PEAK_RSS_MB,
        "cuda_max_allocated_mb": tracking.M_CUDA_MAX_ALLOCATED_MB,
        "cuda_max_reserved_mb": tracking.M_CUDA_MAX_RESERVED_MB,
        "cuda_alloc_retries": tracking.M_CUDA_ALLOC_RETRIES,
    }
    out = {metric: max(r[key] for r in ranks) for key, metric in names.items() if key in ranks[0]}
    if receipt["outcome"] != COMPLETED and "cuda_reserved_unallocated_mb" in ranks[0]:
        out[tracking.M_CUDA_RESERVED_UNALLOCATED_MB] = max(r["cuda_reserved_unallocated_mb"] for r in ranks)
    return out


def memory_text(receipt: Mapping[str, Any]) -> str:
    """One short cell: the figure that decides whether the setting fits."""
    m = memory_summary(receipt)
    cap = receipt["setting"]["device_capacity_mb"]
    of = f" / {cap}" if cap else ""
    if tracking.M_CUDA_MAX_RESERVED_MB in m:
        text = f"alloc {m[tracking.M_CUDA_MAX_ALLOCATED_MB]:.0f}, resv {m[tracking.M_CUDA_MAX_RESERVED_MB]:.0f}{of} MiB"
        if tracking.M_CUDA_RESERVED_UNALLOCATED_MB in m:
            text += f", unalloc {m[tracking.M_CUDA_RESERVED_UNALLOCATED_MB]:.0f}"
        return text + f", retries {m[tracking.M_CUDA_ALLOC_RETRIES]:.0f}"
    if tracking.M_PEAK_RSS_MB in m:
        return f"RSS {m[tracking.M_PEAK_RSS_MB]:.0f}{of} MiB"
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
        if r["outcome"] != COMPLETED:
            cell["failed"] = sorted({*cell["failed"], s["microbatch"]})
        elif cell["largest_completed_microbatch"] is None or s["microbatch"] > cell["largest_completed_microbatch"]:
            cell.update(largest_completed_microbatch=s["microbatch"], median_update_seconds=r["median_update_seconds"], receipt=s["name"])
    return out
