"""SqueezeNet 1.1 (Iandola et al., 2016; the v1.1 layout of the authors' repository).

Fire modules (1x1 squeeze, then parallel 1x1 and 3x3 expands concatenated), three ceil-mode max-pools, and a
1x1 convolution classifier followed by global average pooling.  No batch norm: the original has none.
"""

from __future__ import annotations

import torch
from torch import nn


class Fire(nn.Module):
    def __init__(self, cin: int, squeeze: int, expand: int) -> None:
        super().__init__()
        self.squeeze = nn.Conv2d(cin, squeeze, 1)
        self.expand1x1 = nn.Conv2d(squeeze, expand, 1)
        self.expand3x3 = nn.Conv2d(squeeze, expand, 3, padding=1)
        self.relu = nn.ReLU()

    def forward(self, x):
        s = self.relu(self.squeeze(x))
        return torch.cat([self.relu(self.expand1x1(s)), self.relu(self.expand3x3(s))], 1)


# (squeeze, expand) per Fire module; "M" is a 3x3/2 max-pool.
LAYOUT = ["M", (16, 64), (16, 64), "M", (32, 128), (32, 128), "M", (48, 192), (48, 192), (64, 256), (64, 256)]


class SqueezeNet(nn.Module):
    def __init__(self, width: float = 1.0, num_classes: int = 1000) -> None:
        super().__init__()
        stem = max(8, int(64 * width))
        layers: list[nn.Module] = [nn.Conv2d(3, stem, 3, 2), nn.ReLU()]
        cin = stem
        for item in LAYOUT:
            if item == "M":
                layers.append(nn.MaxPool2d(3, 2, ceil_mode=True))
            else:
                squeeze, expand = (max(4, int(c * width)) for c in item)
                layers.append(Fire(cin, squeeze, expand))
                cin = 2 * expand
        self.features = nn.Sequential(*layers)
        self.classifier = nn.Sequential(nn.Dropout(0.5), nn.Conv2d(cin, num_classes, 1), nn.ReLU(),
                                        nn.AdaptiveAvgPool2d(1))

    def forward(self, x):
        return self.classifier(self.features(x)).flatten(1)


def build(config: dict) -> nn.Module:
    return SqueezeNet(**config)
