"""What this machine computes on: whether it has a CUDA device, and whether
its training device runs bf16 natively. Imports nothing of the project's:
every layer may use it. torch is imported only where the answer needs it."""

from __future__ import annotations

from pathlib import Path

BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16")
"""CPU flags (/proc/cpuinfo) of native bf16 matmuls. Without them bf16 is
emulated: about 1 GFLOP/s against 60-100 in fp32 on the AVX2 EPYCs measured."""


def cuda_available() -> bool:
    # Without a GPU driver's device node there is no CUDA (or ROCm) device to
    # find; asking torch would cost every command that takes the lock seconds.
    if not any(Path(node).exists() for node in ("/dev/nvidiactl", "/dev/kfd")):
        return False
    import torch

    return torch.cuda.is_available()


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
