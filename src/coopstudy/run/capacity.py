"""A probe's half inside a training process (`python -m coopstudy.run.worker
--probe`): `RankProbe` holds the process to the device's capacity and,
however the process ends, writes what it measured to the candidate's run
(through the tracking store, so a rank on a second host reports the same
way). The stage's half, the receipt made of those reports, is
coopstudy.commit.receipts.

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

import platform
import re
import resource
import socket
from pathlib import Path
from typing import Any

from coopstudy import errors
from coopstudy.record import schema, writer


class DeviceOutOfMemory(RuntimeError):
    """The emulated CPU device's capacity was exceeded."""


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


def outcome_of(err: BaseException | None) -> str:
    if err is None:
        return schema.OUTCOME_COMPLETED
    import torch

    # MemoryError: the host itself ran out, which on CPU is the device.
    if isinstance(err, (DeviceOutOfMemory, torch.cuda.OutOfMemoryError, MemoryError)):
        return schema.OUTCOME_OUT_OF_MEMORY
    return schema.OUTCOME_ERROR


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
            "error": errors.labelled(err) if err is not None else None,
            "update_seconds": self.update_seconds,
            "memory": self.memory(),
            "capacity_mb": self.capacity_mb,
            "device": str(device) if device is not None else None,
            "device_name": torch.cuda.get_device_name(device) if device is not None and device.type == "cuda" else platform.processor() or platform.machine(),
            "host": socket.gethostname(),
            "torch": torch.__version__,
        }
        writer.Recorder(self.run_id).log_dict(report, f"{schema.ART_PROBE_RANK_PREFIX}{self.rank}.json")


