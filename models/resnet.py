"""ResNet-18/50 (He et al., 2016) and ResNeXt-50 32x4d (Xie et al., 2017).

The ImageNet layout: 7x7/2 stem, 3x3/2 max-pool, four stages, global average pool, classifier.  Down-sampling
sits on the 3x3 convolution of the bottleneck (the "v1.5" variant that torchvision's published figures describe)
and shortcuts that change shape are 1x1 convolutions followed by batch norm.
"""

from __future__ import annotations

from torch import nn


def conv_bn(cin: int, cout: int, kernel: int, stride: int = 1, groups: int = 1) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(cin, cout, kernel, stride, padding=kernel // 2, groups=groups, bias=False), nn.BatchNorm2d(cout)
    )


class BasicBlock(nn.Module):
    expansion = 1

    def __init__(self, cin: int, planes: int, stride: int, groups: int, base_width: int) -> None:
        super().__init__()
        self.conv1 = conv_bn(cin, planes, 3, stride)
        self.conv2 = conv_bn(planes, planes, 3)
        self.relu = nn.ReLU()
        self.shortcut = conv_bn(cin, planes, 1, stride) if stride != 1 or cin != planes else nn.Identity()

    def forward(self, x):
        y = self.conv2(self.relu(self.conv1(x)))
        return self.relu(y + self.shortcut(x))


class Bottleneck(nn.Module):
    expansion = 4

    def __init__(self, cin: int, planes: int, stride: int, groups: int, base_width: int) -> None:
        super().__init__()
        width = planes * base_width // 64 * groups
        cout = planes * self.expansion
        self.conv1 = conv_bn(cin, width, 1)
        self.conv2 = conv_bn(width, width, 3, stride, groups)
        self.conv3 = conv_bn(width, cout, 1)
        self.relu = nn.ReLU()
        self.shortcut = conv_bn(cin, cout, 1, stride) if stride != 1 or cin != cout else nn.Identity()

    def forward(self, x):
        y = self.relu(self.conv1(x))
        y = self.relu(self.conv2(y))
        return self.relu(self.conv3(y) + self.shortcut(x))


class ResNet(nn.Module):
    def __init__(self, block: str, layers: list[int], width: int = 64, groups: int = 1, base_width: int = 64,
                 num_classes: int = 1000) -> None:
        super().__init__()
        block_cls = {"basic": BasicBlock, "bottleneck": Bottleneck}[block]
        self.stem = nn.Sequential(conv_bn(3, width, 7, 2), nn.ReLU(), nn.MaxPool2d(3, 2, 1))
        stages, cin = [], width
        for i, n in enumerate(layers):
            planes = width * 2**i
            for j in range(n):
                stages.append(block_cls(cin, planes, 2 if (i > 0 and j == 0) else 1, groups, base_width))
                cin = planes * block_cls.expansion
        self.stages = nn.Sequential(*stages)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(cin, num_classes)

    def forward(self, x):
        return self.fc(self.pool(self.stages(self.stem(x))).flatten(1))


def build(config: dict) -> nn.Module:
    return ResNet(**config)
