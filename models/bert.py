"""BERT-base (Devlin et al., 2019): 12 post-LN layers, hidden 768, 12 heads, FFN 3072, exact GELU.

Input ``input_ids`` [1, seq]; outputs the last hidden state and the pooled (tanh) first token.  Token types are
all 0 and there is no padding mask (a single full sequence), so position and token-type embeddings fold into one
constant at export.  Q, K, V are separate Linear layers.
"""

from __future__ import annotations

import torch
from torch import nn

from .transformer import Layer


class Bert(nn.Module):
    def __init__(self, seq: int = 128, vocab: int = 30522, hidden: int = 768, layers: int = 12, heads: int = 12,
                 intermediate: int = 3072, max_positions: int = 512, type_vocab: int = 2) -> None:
        super().__init__()
        self.seq = seq
        self.word = nn.Embedding(vocab, hidden)
        self.position = nn.Embedding(max_positions, hidden)
        self.token_type = nn.Embedding(type_vocab, hidden)
        self.norm = nn.LayerNorm(hidden, eps=1e-12)
        self.layers = nn.Sequential(*(Layer(hidden, heads, intermediate, seq, 1e-12, pre_norm=False)
                                      for _ in range(layers)))
        self.pooler = nn.Linear(hidden, hidden)

    def forward(self, input_ids):
        x = self.word(input_ids) + self.position.weight[: self.seq] + self.token_type.weight[0]
        x = self.layers(self.norm(x))
        return x, torch.tanh(self.pooler(x[:, 0]))


def build(config: dict) -> nn.Module:
    return Bert(**config)
