"""NasRNN: the recurrent cell found by neural architecture search (Zoph & Le, 2017), in the form TASO optimises.

TASO's benchmark (``examples/nasrnn.py`` of TASO) unrolls 5 time steps of hidden size 512 at batch 1.  Each step
forms eight pre-activations ``x @ W_i + h @ U_i`` and combines them through a fixed tree of ReLU, sigmoid and
tanh, adds and products.  As in TASO, every step has its own weights (the graph is an unrolled benchmark, not a
weight-shared RNN), the initial state is a learned vector, and the step inputs arrive as separate tensors: 16
independent MatMuls per step that share an input, which is what parallel-MatMul merging rules look for.
"""

from __future__ import annotations

import torch
from torch import nn


class NasStep(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.wx = nn.ModuleList(nn.Linear(hidden, hidden, bias=False) for _ in range(8))
        self.wh = nn.ModuleList(nn.Linear(hidden, hidden, bias=False) for _ in range(8))

    def forward(self, x, h):
        t = [wx(x) + wh(h) for wx, wh in zip(self.wx, self.wh)]
        a = torch.relu(t[0]) + torch.sigmoid(t[3])
        b = torch.sigmoid(t[1]) + torch.tanh(t[2])
        c = torch.sigmoid(t[4]) * torch.tanh(t[5])
        d = torch.sigmoid(t[6]) * torch.relu(t[7])
        e = torch.sigmoid(b) + torch.tanh(c)
        f = torch.tanh(a) * torch.tanh(d)
        return torch.tanh(torch.tanh(e) * torch.tanh(f))


class NasRNN(nn.Module):
    def __init__(self, hidden: int = 512, steps: int = 5) -> None:
        super().__init__()
        self.state = nn.Parameter(torch.zeros(1, hidden))
        self.steps = nn.ModuleList(NasStep(hidden) for _ in range(steps))

    def forward(self, *xs):
        h = self.state
        for step, x in zip(self.steps, xs):
            h = step(x, h)
        return h


def build(config: dict) -> nn.Module:
    return NasRNN(**config)
