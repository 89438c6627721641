"""What this machine computes on: whether it has a CUDA device, whether its
training device runs bf16 natively, which cores a CPU rank takes, which
malloc a process runs and how glibc's is told to keep the memory it frees,
and how much free memory a first touch gets without waiting for a VM's host.
Imports nothing of the project's: every layer may use it. torch is imported
only where the answer needs it."""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import resource
from collections.abc import MutableMapping
from dataclasses import dataclass
from pathlib import Path

BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16")
"""CPU flags (/proc/cpuinfo) of native bf16 matmuls. Without them bf16 is
emulated: about 1 GFLOP/s against 60-100 in fp32 on the AVX2 EPYCs measured."""


LIBRARY_DEFAULTS = {"TOKENIZERS_PARALLELISM": "false", "MLFLOW_DISABLE_TELEMETRY": "true"}
"""Set, where the user did not, by every process's entry (coopstudy.cli's,
a training rank's: a rank on a second host gets only some variables): one
device is `threads_per_device` cores, and tokenizers' pool would take more;
MLflow 3 fetches a telemetry config and posts usage from a thread of every
process, and a study sends nothing anywhere but its own record unless asked to."""


def set_library_defaults() -> None:
    for name, value in LIBRARY_DEFAULTS.items():
        os.environ.setdefault(name, value)


def cuda_available() -> bool:
    # Without a GPU driver's device node there is no CUDA (or ROCm) device to
    # find; asking torch would cost every command that takes the lock seconds.
    if not any(Path(node).exists() for node in ("/dev/nvidiactl", "/dev/kfd")):
        return False
    import torch

    return torch.cuda.is_available()


def name_the_accelerator(env: MutableMapping[str, str]) -> None:
    """Tell DeepSpeed there is no GPU where there is none: it detects its
    accelerator when imported, with a warning on stdout in every process that
    finds only the CPU. transformers imports it too, in `save_pretrained`
    (accelerate's unwrap looks for its engine)."""
    if not cuda_available():
        env.setdefault("DS_ACCELERATOR", "cpu")


def native_bf16() -> bool:
    """Whether this machine's training device computes bf16 natively: a CUDA
    device that supports it, else a CPU with one of BF16_CPU_FLAGS."""
    if cuda_available():
        import torch

        return torch.cuda.is_bf16_supported()
    try:
        flags = set(Path("/proc/cpuinfo").read_text().split())
    except OSError:
        return False
    return any(flag in flags for flag in BF16_CPU_FLAGS)


def usable_cores() -> list[int]:
    """The cores this process may run on."""
    return sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))


def pin_rank(local_rank: int, local_ranks: int, threads: int) -> tuple[int, ...] | None:
    """Gives a CPU rank cores of its own, for the rest of this process: the
    `threads` cores at local_rank × threads among those the process may run
    on, when each of the host's `local_ranks` ranks can have as many. Every
    thread the process has is pinned (torch and the launcher's imports start
    some), and threads started later (gloo's, the recorder's) inherit the
    cores. Left to the scheduler, the two ranks of the compressed arm on two
    cores took 4.74 s per compressed update against 4.53 s pinned (means of
    7 and 8 runs; README, "What stays on CPU, and why"). Returns the cores,
    or None where they are too few or the platform cannot pin (nothing
    changed)."""
    if not hasattr(os, "sched_setaffinity") or local_ranks < 1:
        return None
    allowed = usable_cores()
    if local_ranks * threads > len(allowed):
        return None
    cores = tuple(allowed[local_rank * threads : (local_rank + 1) * threads])
    try:
        threads_now = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        threads_now = [0]
    for thread in threads_now:
        try:
            os.sched_setaffinity(thread, cores)
        except ProcessLookupError:
            pass  # it ended meanwhile
    return cores


M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4
"""glibc's mallopt parameters (malloc.h)."""


def keep_freed_memory() -> bool:
    """Tells glibc's malloc, for the rest of this process, to serve large
    blocks from its heap and keep what is freed (mmap_max 0, a 2 GiB trim
    threshold). By default every block over 32 MiB is a fresh mmap, unmapped
    when freed, so a model's activations fault their pages in again at every
    layer of every batch: scoring the 128 retention documents took 69 s with
    32 s of it system time, 26 s with this and oneDNN's products (README,
    "What stays on CPU, and why"). The arms, started afresh, preload
    tcmalloc where it is installed, or set the same through GLIBC_TUNABLES
    (run.launch.set_malloc). False where the C library is not glibc."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    return bool(mallopt(M_MMAP_MAX, 0)) and bool(mallopt(M_TRIM_THRESHOLD, 2**31 - 1))


TCMALLOC = "tcmalloc_minimal"
"""gperftools' malloc (Debian's libtcmalloc-minimal4; `make env` installs it
where it can), the arms' malloc where it is installed (run.launch)."""


def tcmalloc_library() -> str | None:
    """The file name of the installed tcmalloc, as LD_PRELOAD takes it."""
    return ctypes.util.find_library(TCMALLOC)


def malloc_in_use() -> str:
    """Which malloc this process runs: 'tcmalloc' when it was preloaded, else
    'glibc' with the tunables it was started with. The train record keeps it,
    since it moves an update's seconds by a tenth and more on these VMs."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        maps = ""
    if f"lib{TCMALLOC}" in maps:
        return "tcmalloc"
    tunables = os.environ.get("GLIBC_TUNABLES")
    return f"glibc ({tunables})" if tunables else "glibc"


REPORTED_ORDER = 9
"""Free blocks of 2^9 pages (2 MiB with 4 KiB pages, a huge page) and up
are what a balloon with free page reporting hands back to its host: Linux's
page_reporting_order, whose default (and the value it falls back to when
the kernel's command line asks for more than it allows) is this."""
_REPORTING_ORDER = Path("/sys/module/page_reporting/parameters/page_reporting_order")
VIRTIO_BALLOON = "0x0005"
"""The virtio device id of a memory balloon (/sys/bus/virtio/devices/*/device)."""
BALLOON_F_REPORTING = 5
"""The balloon's feature bit for free page reporting (VIRTIO_BALLOON_F_REPORTING)."""


def free_page_reporting() -> bool:
    """Whether this machine is a VM whose balloon reports free pages to its
    host, which then takes their memory back (the Firecracker VMs this
    project has run on do, the EPYC's and the AMX Xeon's). There, memory a
    process touches for the first time costs what `ready_memory_mb` says."""
    for device in Path("/sys/bus/virtio/devices").glob("*"):
        try:
            features = (device / "features").read_text()
            if (device / "device").read_text().strip() == VIRTIO_BALLOON and features[BALLOON_F_REPORTING] == "1":
                return True
        except (OSError, IndexError):
            continue
    return False


def ready_memory_mb() -> float | None:
    """Free memory of this machine in blocks smaller than the ones a free
    page reporting balloon hands to its host, MiB (/proc/buddyinfo); None
    without procfs.

    The kernel serves a page fault from the smallest free block it has, so
    where the host takes back the larger blocks (`free_page_reporting`) this
    is the memory processes can touch for the first time at the guest's own
    cost: 0.5-0.6 s per GiB on the avx512_bf16 EPYC's VM. Past it, each first
    touch splits a block the host took and waits for the host to give a page
    again: 3-10 s per GiB there (README, "What stays on CPU, and why").
    Elsewhere it is only fragmented free memory."""
    try:
        buddyinfo = Path("/proc/buddyinfo").read_text()
    except OSError:
        return None
    try:
        order = int(_REPORTING_ORDER.read_text())
    except (OSError, ValueError):
        order = REPORTED_ORDER
    return free_blocks_mb(buddyinfo, order, os.sysconf("SC_PAGE_SIZE"))


def free_blocks_mb(buddyinfo: str, below_order: int, page_bytes: int) -> float:
    """The free memory /proc/buddyinfo's text lists in blocks of fewer than
    2^below_order pages, MiB: each line is `Node N, zone NAME` and the number
    of free blocks of 2^0, 2^1, ... pages."""
    pages = 0
    for line in buddyinfo.splitlines():
        counts = line.split()[4:]
        pages += sum(int(count) << order for order, count in enumerate(counts[:below_order]))
    return pages * page_bytes / 2**20


@dataclass(frozen=True)
class CpuTimes:
    """CPU seconds since boot: the machine's (every core, /proc/stat), and this
    process's own and its waited-for descendants' (getrusage)."""

    busy: float
    """user, nice and system: every process's work, a VM guest's included. Not the
    interrupts' time, which no process is charged (a rank's own loopback traffic
    would count as another's)."""
    steal: float
    """What the hypervisor gave other machines while this one wanted to run."""
    ours: float

    @staticmethod
    def now() -> CpuTimes | None:
        """None without procfs."""
        try:
            fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()
        except OSError:
            return None
        ticks = [int(v) / os.sysconf("SC_CLK_TCK") for v in fields[1:]]
        user, nice, system, _idle, _iowait, _irq, _softirq, steal = (ticks + [0.0] * 8)[:8]
        ours = sum(
            sum(resource.getrusage(who)[:2]) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)
        )
        return CpuTimes(user + nice + system, steal, ours)

    def others_since(self, start: CpuTimes) -> tuple[float, float]:
        """(CPU seconds other processes took, seconds stolen) between `start` and
        this: only what this process and the children it waited for (with theirs)
        did not take. A child still running is counted as another's."""
        return max(0.0, (self.busy - start.busy) - (self.ours - start.ours)), self.steal - start.steal
