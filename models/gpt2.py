"""A GPT-2-small-style decoder (Radford et al., 2019): 12 pre-LN causal layers, hidden 768, 12 heads, vocab 50257.

Kept as in the original: one fused ``c_attn`` Linear (768 -> 3 x 768) split into Q, K, V (so this model offers
the already-merged form, while BERT and ViT offer separate Q/K/V); GELU with the tanh approximation; learned
positions; a final LayerNorm; and logits from the token embedding (tied weights).  The tied head is computed as
``MatMul(wte, h^T)`` followed by a Transpose so that the ONNX graph keeps one copy of the 50257 x 768 table
(``h @ wte^T`` would make the exporter fold a transposed duplicate).  Input ``input_ids`` [1, seq].
"""

from __future__ import annotations

import torch
from torch import nn

from .transformer import Layer


class GPT2(nn.Module):
    def __init__(self, seq: int = 128, vocab: int = 50257, hidden: int = 768, layers: int = 12, heads: int = 12,
                 max_positions: int = 1024) -> None:
        super().__init__()
        self.seq = seq
        self.wte = nn.Embedding(vocab, hidden)
        self.wpe = nn.Embedding(max_positions, hidden)
        self.layers = nn.Sequential(*(Layer(hidden, heads, 4 * hidden, seq, 1e-5, pre_norm=True, causal=True,
                                            fused_qkv=True, gelu="tanh") for _ in range(layers)))
        self.norm = nn.LayerNorm(hidden, eps=1e-5)

    def forward(self, input_ids):
        x = self.wte(input_ids) + self.wpe.weight[: self.seq]
        h = self.norm(self.layers(x))
        return torch.matmul(self.wte.weight, h.transpose(1, 2)).transpose(1, 2)


def build(config: dict) -> nn.Module:
    return GPT2(**config)
