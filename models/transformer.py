"""Transformer building blocks shared by BERT, ViT, GPT-2 and the demo block.

Written for export at a fixed sequence length: head splitting reshapes with the configured sizes, so the ONNX
graph holds constant shapes instead of Shape/Gather chains.  Queries, keys and values come from three separate
Linear layers (as in BERT and ViT) unless ``fused_qkv`` asks for one Linear and a Split (as GPT-2's ``c_attn``).
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F


class Attention(nn.Module):
    def __init__(self, hidden: int, heads: int, seq: int, causal: bool = False, fused_qkv: bool = False) -> None:
        super().__init__()
        self.heads, self.head_dim, self.seq, self.hidden = heads, hidden // heads, seq, hidden
        if fused_qkv:
            self.qkv = nn.Linear(hidden, 3 * hidden)
        else:
            self.query, self.key, self.value = (nn.Linear(hidden, hidden) for _ in range(3))
        self.fused = fused_qkv
        self.out = nn.Linear(hidden, hidden)
        if causal:
            self.register_buffer("mask", torch.ones(seq, seq, dtype=torch.bool).triu(1), persistent=False)
        else:
            self.mask = None

    def forward(self, x):
        if self.fused:
            q, k, v = self.qkv(x).split(self.hidden, dim=-1)
        else:
            q, k, v = self.query(x), self.key(x), self.value(x)
        shape = (-1, self.seq, self.heads, self.head_dim)
        q = q.reshape(shape).transpose(1, 2)  # [B, H, S, D]
        k = k.reshape(shape).permute(0, 2, 3, 1)  # [B, H, D, S]
        v = v.reshape(shape).transpose(1, 2)
        scores = torch.matmul(q, k) / math.sqrt(self.head_dim)
        if self.mask is not None:
            scores = scores.masked_fill(self.mask, torch.finfo(scores.dtype).min)
        context = torch.matmul(scores.softmax(-1), v)  # [B, H, S, D]
        return self.out(context.transpose(1, 2).reshape(-1, self.seq, self.hidden))


class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, gelu: str = "none") -> None:
        super().__init__()
        self.up = nn.Linear(hidden, intermediate)
        self.down = nn.Linear(intermediate, hidden)
        self.gelu = gelu  # "none": exact erf GELU (BERT, ViT); "tanh": GPT-2's approximation

    def forward(self, x):
        return self.down(F.gelu(self.up(x), approximate=self.gelu))


class Layer(nn.Module):
    """One encoder/decoder layer: post-LN (BERT, ``pre_norm=False``) or pre-LN (ViT, GPT-2)."""

    def __init__(self, hidden: int, heads: int, intermediate: int, seq: int, eps: float, pre_norm: bool,
                 causal: bool = False, fused_qkv: bool = False, gelu: str = "none") -> None:
        super().__init__()
        self.attention = Attention(hidden, heads, seq, causal, fused_qkv)
        self.norm1 = nn.LayerNorm(hidden, eps=eps)
        self.mlp = MLP(hidden, intermediate, gelu)
        self.norm2 = nn.LayerNorm(hidden, eps=eps)
        self.pre_norm = pre_norm

    def forward(self, x):
        if self.pre_norm:
            x = x + self.attention(self.norm1(x))
            return x + self.mlp(self.norm2(x))
        x = self.norm1(x + self.attention(x))
        return self.norm2(x + self.mlp(x))


class Encoder(nn.Module):
    """A stack of post-LN layers on an input of embeddings: the demo block (and BERT's body)."""

    def __init__(self, layers: int, hidden: int, heads: int, seq: int, intermediate: int | None = None,
                 eps: float = 1e-12) -> None:
        super().__init__()
        self.layers = nn.Sequential(*(Layer(hidden, heads, intermediate or 4 * hidden, seq, eps, pre_norm=False)
                                      for _ in range(layers)))

    def forward(self, x):
        return self.layers(x)


def build(config: dict) -> nn.Module:
    return Encoder(**config)
