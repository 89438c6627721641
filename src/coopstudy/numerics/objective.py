"""The weighted, globally normalized objective, and the per-document reference.

The loss of update k is

    L_k = Σ w·nll / W_k

summed over every target token of every document of the update's global
batch, where w is the token's target weight (answer tokens 8, replay
assistant tokens 1, prompt tokens 0), nll the negative log-likelihood of the
token given the tokens of its document before it, and W_k the total target
weight of the whole global batch (`batching.total_weight`). Every microbatch
on every worker divides its own weighted sum by the same W_k, so the
gradients of microbatches and of workers add up to the gradient of L_k,
whatever the microbatching or the number of workers.

The training forward (`WeightedNLL`) reads a packed microbatch: one row of
documents back to back (batching.pack). Two things make each document see
only itself, as if it were alone: position ids restart at 0 per document
(rotary embeddings), and attention runs per document (`document_attention`,
the attention function the forward selects for its own call only). Every
computed token is a real token.

`reference_backward` is the same objective written plainly (each document
alone, the LM's own attention and full logits, one process); it exists for
the gate and the benchmark.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import ContextManager

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from coopstudy.numerics.batching import DocumentLike, Microbatch

DOCUMENT_ATTENTION = "coopstudy_document_sdpa"
"""The name `document_attention` is registered under in transformers' AttentionInterface."""


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

    @contextlib.contextmanager
    def update(self, device_type: str) -> Iterator[Callable[[], ContextManager]]:
        """The context an update's microbatches run in; it yields the context
        each backward runs in.

        Under bf16 it holds autocast open across the microbatches, so each
        weight is cast to bf16 once per update: autocast caches the casts of
        leaf weights until its outermost context exits, and the weights do
        not change before the optimizer step (cast per microbatch, a 135M
        model reads 540 MB of fp32 weights per microbatch to make them). The
        backward runs with autocast off, as it would outside: the same
        operations, the same bits (tests/test_objective.py)."""
        if self.name != "bf16":
            yield contextlib.nullcontext
            return
        with torch.autocast(device_type=device_type, dtype=torch.bfloat16):
            yield lambda: torch.autocast(device_type=device_type, enabled=False)


def document_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    document_bounds: Sequence[int] | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Causal attention within each document of a packed row, never across.

    A transformers attention function: query [1, heads, N, d], key and value
    [1, kv heads, N, d]; returns [1, N, heads, d]. Each document
    [bounds[j], bounds[j+1]) is one scaled_dot_product_attention call, causal,
    the call the per-document reference makes (transformers' sdpa path on an
    unpadded single sequence: no mask, is_causal for more than one token,
    grouped-query heads by enable_gqa), with the kernels of
    `_document_kernels`. The cost is Σ n² per layer, not N² as a
    block-diagonal mask over the whole row would be.
    """
    if document_bounds is None:
        raise ValueError("document_attention needs the packed row's document_bounds")
    if query.shape[0] != 1:
        raise ValueError(f"a packed microbatch is one row, not {query.shape[0]}")
    gqa = {"enable_gqa": True} if getattr(module, "num_key_value_groups", 1) > 1 else {}
    lengths = [end - start for start, end in zip(document_bounds[:-1], document_bounds[1:])]
    # split, not slices: the backward of a slice fills a row-sized zero
    # tensor per document, the backward of a split is one concatenation.
    documents = zip(query.split(lengths, dim=2), key.split(lengths, dim=2), value.split(lengths, dim=2))
    with _document_kernels(query.device.type, backward=torch.is_grad_enabled()):
        parts = [
            F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, scale=scaling, is_causal=q.shape[2] > 1, **gqa)
            for q, k, v in documents
        ]
    out = parts[0] if len(parts) == 1 else torch.cat(parts, dim=2)
    return out.transpose(1, 2).contiguous(), None


def _document_kernels(device_type: str, *, backward: bool) -> ContextManager:
    """The context document_attention's SDPA calls run in.

    On CPU, for a forward that autograd records, the math kernel only: for
    documents of a few hundred tokens it is about twice as fast as the CPU
    flash kernel, whose backward was a fifth of the control's update (bf16,
    one thread, 4 documents of 60-170 tokens: 7.6 against 14.1 ms per layer,
    forward and backward). Without a backward (the retention probes,
    scoring), and elsewhere, SDPA chooses, unrestricted: the flash kernel's
    forward alone is the faster (fp32, two threads, the CPU preset's 128
    probes: 35.9 s against 39.4 s)."""
    if device_type == "cpu" and backward:
        return sdpa_kernel(SDPBackend.MATH)
    return contextlib.nullcontext()


def _register() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(DOCUMENT_ATTENTION, document_attention)


_register()


@contextlib.contextmanager
def _attention(lm: nn.Module, implementation: str) -> Iterator[None]:
    """The LM's attention implementation for one call, then its own again
    (the LM stays an ordinary model everywhere else: evaluation, saving)."""
    config = lm.config
    previous = config._attn_implementation
    config._attn_implementation = implementation
    try:
        yield
    finally:
        config._attn_implementation = previous


def packed_hidden(lm: nn.Module, input_ids: torch.Tensor, position_ids: torch.Tensor, bounds: Sequence[int]) -> torch.Tensor:
    """The decoder's last hidden state [1, N, hidden] of a packed row
    (batching.pack), each document seeing only itself: the training forward's,
    and the retention probes' (scoring)."""
    # No attention mask: document_attention gets the documents' bounds
    # instead, and an attention function transformers has no mask function
    # for gets no mask built. No cache (config.use_cache is True; a cache
    # would change the path).
    with _attention(lm, DOCUMENT_ATTENTION):
        return lm.get_decoder()(
            input_ids=input_ids, position_ids=position_ids, use_cache=False, document_bounds=tuple(bounds)
        ).last_hidden_state


class WeightedNLL(nn.Module):
    """A causal LM whose forward returns Σ w·nll of one packed microbatch.

    DDP wraps this module rather than the LM: DDP's gradient hooks are armed by
    its own forward, and this forward has to reach inside the LM to skip
    logits nobody needs.
    """

    def __init__(self, lm: nn.Module):
        super().__init__()
        self.lm = lm

    def forward(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor, weights: torch.Tensor, bounds: Sequence[int]
    ) -> torch.Tensor:
        hidden = packed_hidden(self.lm, input_ids, position_ids, bounds)
        # Token i is predicted from position i-1. Positions whose target weighs 0
        # (prompt tokens, every document's first token) add exactly 0 to the
        # sum, so their logits, the largest matmul of a small model, are never
        # computed; nor is any prediction across a document boundary.
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
    weighted_sum = net(mb.input_ids, mb.position_ids, mb.weights, mb.bounds)
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
