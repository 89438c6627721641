"""What one training update computes, in FLOPs: the count that the bench
sets against the matmul peak and that the split between workers balances
(an update's forward and backward take time in proportion to it, 40-48
GFLOP/s per rank on the CPU preset)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from coopstudy.numerics.batching import DocumentLike


@dataclass(frozen=True)
class ModelShape:
    """What the FLOP count needs of the seed model."""

    parameters: int
    """Distinct parameters (tied embeddings once)."""
    matmul_parameters: int
    """Parameters of the matrices every token passes through (all but the embedding and the output layer)."""
    output_parameters: int
    """The output layer's (vocab x hidden), computed at target tokens only."""
    layers: int
    attention_width: int
    """Query heads x head dimension."""

    @classmethod
    def of(cls, seed_path) -> "ModelShape":
        from transformers import AutoConfig, AutoModelForCausalLM

        config = AutoConfig.from_pretrained(seed_path)
        with torch.device("meta"):
            lm = AutoModelForCausalLM.from_config(config)
        total = sum(p.numel() for p in lm.parameters())
        embedding = lm.get_input_embeddings().weight.numel()
        output = lm.get_output_embeddings().weight.numel()
        tied = lm.get_output_embeddings().weight is lm.get_input_embeddings().weight
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        return cls(
            parameters=total,
            matmul_parameters=total - embedding - (0 if tied else output),
            output_parameters=output,
            layers=config.num_hidden_layers,
            attention_width=config.num_attention_heads * head_dim,
        )

    def attention_flops(self, n: int) -> int:
        """Causal attention within a document of n tokens, forward and backward."""
        return 6 * self.layers * self.attention_width * n * (n + 1)

    def document_flops(self, document: DocumentLike) -> int:
        """Executed FLOPs of one document's forward and backward (see training_flops)."""
        n = len(document.input_ids)
        targets = sum(1 for w in document.weights[1:] if w > 0)
        return 6 * (self.matmul_parameters * n + self.output_parameters * targets) + self.attention_flops(n)

    def training_flops(self, documents: Sequence[DocumentLike]) -> tuple[float, float]:
        """(executed, nominal) FLOPs of one training update on `documents`:
        executed = 6·matmul parameters·tokens + 6·output layer·target tokens +
        causal attention within each document, 6·layers·width·n(n+1) per
        document of n tokens (QKᵀ and AV over the lower triangle, forward and
        twice for the backward); nominal = 6·parameters·tokens + that attention."""
        tokens = sum(len(d.input_ids) for d in documents)
        attention = sum(self.attention_flops(len(d.input_ids)) for d in documents)
        executed = sum(self.document_flops(d) for d in documents)
        return float(executed), float(6 * self.parameters * tokens + attention)
