"""fp32 matrix products through oneDNN on CPU.

torch sends fp32 matrix products on CPU to MKL, whose sgemm runs AVX2 code on
AMD CPUs: 89 GFLOP/s on one thread of the avx512_bf16 EPYC, where oneDNN's
fp32 product reaches 201. oneDNN's linear layer (`torch.ops.mkldnn._linear_pointwise`,
the op torch's own compiled CPU graphs call) takes plain tensors, so the
study's fp32 products can use it where that pays: PowerSGD's P = AQ and
Q = AᵀP (numerics.distributed) and every linear layer of a model scored in
fp32 (scoring). Another kernel rounds differently, about 1e-6 relative in
fp32; on an Intel CPU, where MKL runs its AVX-512 code, the two are about
as fast.
"""

from __future__ import annotations

import torch
from torch import nn


def applies(tensor: torch.Tensor) -> bool:
    """Whether a product of fp32 `tensor` on CPU can go through oneDNN in this torch."""
    onednn = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    return onednn and tensor.device.type == "cpu" and tensor.dtype == torch.float32


def x_times_w_transposed(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ wᵀ (+ bias) by oneDNN's linear layer; x may have leading batch dimensions."""
    return torch.ops.mkldnn._linear_pointwise(x, w, bias, "none", [], "")


class Linear(nn.Linear):
    """nn.Linear whose product is oneDNN's; the same parameters and state dict."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x_times_w_transposed(x, self.weight, self.bias)


def route_linears(model: nn.Module) -> int:
    """Every nn.Linear of `model` whose weight is fp32 on CPU computes through
    oneDNN from now on (its class becomes `Linear`; parameters, tied weights
    and hooks stay as they are). Returns how many were routed."""
    routed = 0
    for module in model.modules():
        if type(module) is nn.Linear and applies(module.weight):
            module.__class__ = Linear
            routed += 1
    return routed
