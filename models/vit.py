"""ViT-B/16 (Dosovitskiy et al., 2021): 16x16 patches of a 224x224 image, 12 pre-LN layers, hidden 768, 12 heads.

A class token and learned position embeddings (197 positions), exact GELU, LayerNorm eps 1e-6, and a linear
classifier on the final class token.  Q, K, V are separate Linear layers.
"""

from __future__ import annotations

import torch
from torch import nn

from .transformer import Layer


class ViT(nn.Module):
    def __init__(self, image_size: int = 224, patch: int = 16, hidden: int = 768, layers: int = 12, heads: int = 12,
                 intermediate: int = 3072, num_classes: int = 1000) -> None:
        super().__init__()
        self.hidden, self.patches = hidden, (image_size // patch) ** 2
        seq = self.patches + 1
        self.patch_embed = nn.Conv2d(3, hidden, patch, patch)
        self.cls = nn.Parameter(torch.zeros(1, 1, hidden))
        self.position = nn.Parameter(torch.zeros(1, seq, hidden))
        self.layers = nn.Sequential(*(Layer(hidden, heads, intermediate, seq, 1e-6, pre_norm=True)
                                      for _ in range(layers)))
        self.norm = nn.LayerNorm(hidden, eps=1e-6)
        self.head = nn.Linear(hidden, num_classes)

    def forward(self, x):
        x = self.patch_embed(x).reshape(-1, self.hidden, self.patches).transpose(1, 2)
        x = torch.cat([self.cls, x], 1) + self.position  # batch 1: the class token needs no expand
        return self.head(self.norm(self.layers(x))[:, 0])


def build(config: dict) -> nn.Module:
    return ViT(**config)
