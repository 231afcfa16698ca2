"""DenseNet-121 (Huang et al., 2017): dense blocks of pre-activation BN-ReLU-Conv layers with bottlenecks.

Each layer's new features are concatenated onto the block's running feature map (one Concat per layer, which is
the same computation as concatenating all earlier outputs at every layer).
"""

from __future__ import annotations

import torch
from torch import nn


class DenseLayer(nn.Module):
    def __init__(self, cin: int, growth: int, bottleneck: int) -> None:
        super().__init__()
        self.layers = nn.Sequential(
            nn.BatchNorm2d(cin), nn.ReLU(), nn.Conv2d(cin, bottleneck * growth, 1, bias=False),
            nn.BatchNorm2d(bottleneck * growth), nn.ReLU(), nn.Conv2d(bottleneck * growth, growth, 3, padding=1, bias=False),
        )

    def forward(self, x):
        return torch.cat([x, self.layers(x)], 1)


def transition(cin: int, cout: int) -> nn.Sequential:
    return nn.Sequential(nn.BatchNorm2d(cin), nn.ReLU(), nn.Conv2d(cin, cout, 1, bias=False), nn.AvgPool2d(2, 2))


class DenseNet(nn.Module):
    def __init__(self, blocks: list[int], growth: int = 32, init_features: int = 64, bottleneck: int = 4,
                 num_classes: int = 1000) -> None:
        super().__init__()
        layers: list[nn.Module] = [
            nn.Conv2d(3, init_features, 7, 2, 3, bias=False), nn.BatchNorm2d(init_features), nn.ReLU(),
            nn.MaxPool2d(3, 2, 1),
        ]
        channels = init_features
        for i, n in enumerate(blocks):
            for _ in range(n):
                layers.append(DenseLayer(channels, growth, bottleneck))
                channels += growth
            if i != len(blocks) - 1:
                layers.append(transition(channels, channels // 2))
                channels //= 2
        layers += [nn.BatchNorm2d(channels), nn.ReLU(), nn.AdaptiveAvgPool2d(1)]
        self.features = nn.Sequential(*layers)
        self.classifier = nn.Linear(channels, num_classes)

    def forward(self, x):
        return self.classifier(self.features(x).flatten(1))


def build(config: dict) -> nn.Module:
    return DenseNet(**config)
