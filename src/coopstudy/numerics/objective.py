"""The weighted, globally normalized objective, and the per-document reference.

The loss of update k is

    L_k = Σ w·nll / W_k

summed over every token of every document of the update's global batch, where
w is the token's target weight (answer tokens 8, replay assistant tokens 1,
prompt tokens and padding 0), nll the negative log-likelihood of the token
given the tokens before it, and W_k the total weight of the whole global batch
(`batching.total_weight`). Every microbatch on every worker divides its own
weighted sum by the same W_k, so the gradients of microbatches and of workers
add up to the gradient of L_k, whatever the microbatching or the number of
workers.

`reference_backward` is the same objective written plainly (each document
alone, full logits, one process); it exists for the gate and the benchmark.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ContextManager

import torch
import torch.nn.functional as F
from torch import nn

from coopstudy.numerics.batching import DocumentLike, Microbatch


@dataclass(frozen=True)
class Precision:
    """train.precision, interpreted here and nowhere else.

    bf16: fp32 weights, gradients, optimizer state and token weights, with the
    forward (and so the backward) autocast to bf16 matmuls; PowerSGD's error
    feedback therefore works in fp32. fp32: no autocast. fp64: everything in
    float64, no autocast (the gate)."""

    name: str

    @classmethod
    def of(cls, name: str) -> "Precision":
        if name not in ("bf16", "fp32", "fp64"):
            raise ValueError(f"precision {name!r}: one of bf16, fp32, fp64")
        return cls(name)

    @property
    def param_dtype(self) -> torch.dtype:
        """Weights, gradients, optimizer state and token weights."""
        return torch.float64 if self.name == "fp64" else torch.float32

    def cast(self, lm: nn.Module) -> nn.Module:
        """The model as it trains: its parameters in param_dtype."""
        return lm.to(self.param_dtype)

    def forward(self, device_type: str) -> ContextManager:
        """The context every forward of the objective runs in."""
        if self.name == "bf16":
            return torch.autocast(device_type=device_type, dtype=torch.bfloat16)
        return contextlib.nullcontext()


class WeightedNLL(nn.Module):
    """A causal LM whose forward returns Σ w·nll of one padded microbatch.

    DDP wraps this module rather than the LM: DDP's gradient hooks are armed by
    its own forward, and this forward has to reach inside the LM to skip
    logits nobody needs.
    """

    def __init__(self, lm: nn.Module):
        super().__init__()
        self.lm = lm

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        hidden = self.lm.get_decoder()(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).last_hidden_state
        # Token i is predicted from position i-1. Positions whose target weighs 0
        # (prompt, padding, position 0) add exactly 0 to the sum, so their
        # logits, the largest matmul of a small model, are never computed.
        targets = weights[:, 1:] > 0
        logits = self.lm.get_output_embeddings()(hidden[:, :-1][targets])
        # Under bf16 autocast the logits come out in bf16; the softmax and the
        # weighted sum run in the parameters' dtype (fp32, fp64 in the gate).
        nll = F.cross_entropy(logits.to(weights.dtype), input_ids[:, 1:][targets], reduction="none")
        return (weights[:, 1:][targets] * nll).sum()


def microbatch_loss(net: nn.Module, mb: Microbatch, total_weight: float, world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward one microbatch: (the loss to call backward on, its share of L_k).

    `net` is a WeightedNLL, or DDP around one.
    """
    weighted_sum = net(mb.input_ids, mb.attention_mask, mb.weights)
    # Global normalization: W_k belongs to the whole global batch, not to this
    # microbatch or this worker, so the shares of all microbatches of all
    # workers sum to L_k and so do their gradients.
    share = weighted_sum / total_weight
    # DDP averages gradients over the workers (its all-reduce divides by
    # world_size, and so does PowerSGD's hook). L_k needs their sum, so the
    # loss each worker backpropagates is scaled by world_size: here, and
    # nowhere else. With one worker the factor is 1.
    return share * world_size, share.detach()


def reference_backward(
    lm: nn.Module,
    documents: Sequence[DocumentLike],
    total_weight: float,
    *,
    precision: Precision,
    device: torch.device | str = "cpu",
) -> float:
    """The established objective, written plainly; gradients accumulate into `lm`.

    Each document alone (a batch of one, no padding, no attention mask), the
    LM's full logits, the same token weights and the same W_k. Returns L_k.
    """
    device = torch.device(device)
    dtype = precision.param_dtype
    loss = 0.0
    for doc in documents:
        ids = torch.tensor([list(doc.input_ids)], dtype=torch.long, device=device)
        weights = torch.tensor(list(doc.weights)[1:], dtype=dtype, device=device)
        with precision.forward(device.type):
            logits = lm(input_ids=ids, use_cache=False).logits[0, :-1]
        nll = F.cross_entropy(logits.to(dtype), ids[0, 1:], reduction="none")
        term = (weights * nll).sum() / total_weight
        term.backward()
        loss += term.item()
    return loss
