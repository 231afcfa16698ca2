"""Inception-v3 (Szegedy et al., 2016) at 299x299, without the auxiliary classifier (it only runs in training).

Every convolution is Conv (no bias) + BatchNorm (eps 1e-3) + ReLU.  Block widths follow the paper's
Figures 5-7 and Table 1 as implemented by the reference models: three 35x35 "A" blocks, one grid reduction,
four 17x17 "C" blocks with factorised 7x7 convolutions, a second grid reduction and two 8x8 "E" blocks with
expanded filter banks.  ``width`` scales every channel count (tiny variants).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F


class ConvBN(nn.Sequential):
    def __init__(self, cin: int, cout: int, kernel, stride: int = 1, padding=0) -> None:
        super().__init__(nn.Conv2d(cin, cout, kernel, stride, padding, bias=False), nn.BatchNorm2d(cout, eps=1e-3),
                         nn.ReLU())
        self.out_channels = cout


def avg_pool(x):
    return F.avg_pool2d(x, 3, 1, 1)


class BlockA(nn.Module):
    """35x35: 1x1 | 1x1-5x5 | 1x1-3x3-3x3 | avgpool-1x1."""

    def __init__(self, cin: int, pool: int, c) -> None:
        super().__init__()
        self.b1 = ConvBN(cin, c(64), 1)
        self.b5 = nn.Sequential(ConvBN(cin, c(48), 1), ConvBN(c(48), c(64), 5, padding=2))
        self.b3 = nn.Sequential(ConvBN(cin, c(64), 1), ConvBN(c(64), c(96), 3, padding=1),
                                ConvBN(c(96), c(96), 3, padding=1))
        self.bp = ConvBN(cin, pool, 1)
        self.out_channels = c(64) + c(64) + c(96) + pool

    def forward(self, x):
        return torch.cat([self.b1(x), self.b5(x), self.b3(x), self.bp(avg_pool(x))], 1)


class ReductionB(nn.Module):
    """35x35 -> 17x17: 3x3/2 | 1x1-3x3-3x3/2 | maxpool/2."""

    def __init__(self, cin: int, c) -> None:
        super().__init__()
        self.b3 = ConvBN(cin, c(384), 3, 2)
        self.b3d = nn.Sequential(ConvBN(cin, c(64), 1), ConvBN(c(64), c(96), 3, padding=1), ConvBN(c(96), c(96), 3, 2))
        self.out_channels = c(384) + c(96) + cin

    def forward(self, x):
        return torch.cat([self.b3(x), self.b3d(x), F.max_pool2d(x, 3, 2)], 1)


class BlockC(nn.Module):
    """17x17 with 7x7 convolutions factorised into 1x7 and 7x1."""

    def __init__(self, cin: int, c7: int, c) -> None:
        super().__init__()
        row, col = dict(kernel=(1, 7), padding=(0, 3)), dict(kernel=(7, 1), padding=(3, 0))
        self.b1 = ConvBN(cin, c(192), 1)
        self.b7 = nn.Sequential(ConvBN(cin, c7, 1), ConvBN(c7, c7, **row), ConvBN(c7, c(192), **col))
        self.b7d = nn.Sequential(ConvBN(cin, c7, 1), ConvBN(c7, c7, **col), ConvBN(c7, c7, **row),
                                 ConvBN(c7, c7, **col), ConvBN(c7, c(192), **row))
        self.bp = ConvBN(cin, c(192), 1)
        self.out_channels = 4 * c(192)

    def forward(self, x):
        return torch.cat([self.b1(x), self.b7(x), self.b7d(x), self.bp(avg_pool(x))], 1)


class ReductionD(nn.Module):
    """17x17 -> 8x8: 1x1-3x3/2 | 1x1-1x7-7x1-3x3/2 | maxpool/2."""

    def __init__(self, cin: int, c) -> None:
        super().__init__()
        self.b3 = nn.Sequential(ConvBN(cin, c(192), 1), ConvBN(c(192), c(320), 3, 2))
        self.b7 = nn.Sequential(ConvBN(cin, c(192), 1), ConvBN(c(192), c(192), (1, 7), padding=(0, 3)),
                                ConvBN(c(192), c(192), (7, 1), padding=(3, 0)), ConvBN(c(192), c(192), 3, 2))
        self.out_channels = c(320) + c(192) + cin

    def forward(self, x):
        return torch.cat([self.b3(x), self.b7(x), F.max_pool2d(x, 3, 2)], 1)


class BlockE(nn.Module):
    """8x8 with expanded filter banks: 1x3 and 3x1 applied side by side and concatenated."""

    def __init__(self, cin: int, c) -> None:
        super().__init__()
        self.b1 = ConvBN(cin, c(320), 1)
        self.b3 = ConvBN(cin, c(384), 1)
        self.b3a, self.b3b = ConvBN(c(384), c(384), (1, 3), padding=(0, 1)), ConvBN(c(384), c(384), (3, 1), padding=(1, 0))
        self.b3d = nn.Sequential(ConvBN(cin, c(448), 1), ConvBN(c(448), c(384), 3, padding=1))
        self.b3da, self.b3db = ConvBN(c(384), c(384), (1, 3), padding=(0, 1)), ConvBN(c(384), c(384), (3, 1), padding=(1, 0))
        self.bp = ConvBN(cin, c(192), 1)
        self.out_channels = c(320) + 4 * c(384) + c(192)

    def forward(self, x):
        y3, yd = self.b3(x), self.b3d(x)
        return torch.cat([self.b1(x), self.b3a(y3), self.b3b(y3), self.b3da(yd), self.b3db(yd), self.bp(avg_pool(x))], 1)


class InceptionV3(nn.Module):
    def __init__(self, width: float = 1.0, blocks: tuple[int, int, int] = (3, 4, 2), num_classes: int = 1000) -> None:
        super().__init__()

        def c(channels: int) -> int:
            return max(4, int(channels * width))

        self.stem = nn.Sequential(
            ConvBN(3, c(32), 3, 2), ConvBN(c(32), c(32), 3), ConvBN(c(32), c(64), 3, padding=1), nn.MaxPool2d(3, 2),
            ConvBN(c(64), c(80), 1), ConvBN(c(80), c(192), 3), nn.MaxPool2d(3, 2),
        )
        layers: list[nn.Module] = []
        cin = c(192)
        for i in range(blocks[0]):
            layers.append(BlockA(cin, c(32) if i == 0 else c(64), c))
            cin = layers[-1].out_channels
        layers.append(ReductionB(cin, c))
        cin = layers[-1].out_channels
        for i in range(blocks[1]):
            layers.append(BlockC(cin, c((128, 160, 160, 192)[i % 4]), c))
            cin = layers[-1].out_channels
        layers.append(ReductionD(cin, c))
        cin = layers[-1].out_channels
        for _ in range(blocks[2]):
            layers.append(BlockE(cin, c))
            cin = layers[-1].out_channels
        self.blocks = nn.Sequential(*layers)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.dropout = nn.Dropout(0.5)
        self.fc = nn.Linear(cin, num_classes)

    def forward(self, x):
        return self.fc(self.dropout(self.pool(self.blocks(self.stem(x))).flatten(1)))


def build(config: dict) -> nn.Module:
    return InceptionV3(**config)
