"""MobileNet-v2 (Sandler et al., 2018): inverted residual blocks with linear bottlenecks and ReLU6."""

from __future__ import annotations

from torch import nn

# (expansion t, output channels c, repeats n, first stride s), Table 2 of the paper.
SETTINGS = [(1, 16, 1, 1), (6, 24, 2, 2), (6, 32, 3, 2), (6, 64, 4, 2), (6, 96, 3, 1), (6, 160, 3, 2), (6, 320, 1, 1)]


def divisible(value: float, divisor: int = 8) -> int:
    """Rounds channel counts to a multiple of 8 without losing more than 10%, as the reference models do."""
    rounded = max(divisor, int(value + divisor / 2) // divisor * divisor)
    return rounded + divisor if rounded < 0.9 * value else rounded


def conv_bn_relu6(cin: int, cout: int, kernel: int, stride: int = 1, groups: int = 1) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(cin, cout, kernel, stride, kernel // 2, groups=groups, bias=False),
                         nn.BatchNorm2d(cout), nn.ReLU6())


class InvertedResidual(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int, expansion: int) -> None:
        super().__init__()
        hidden = cin * expansion
        layers = [conv_bn_relu6(cin, hidden, 1)] if expansion != 1 else []
        layers += [conv_bn_relu6(hidden, hidden, 3, stride, groups=hidden),
                   nn.Conv2d(hidden, cout, 1, bias=False), nn.BatchNorm2d(cout)]
        self.block = nn.Sequential(*layers)
        self.residual = stride == 1 and cin == cout

    def forward(self, x):
        return x + self.block(x) if self.residual else self.block(x)


class MobileNetV2(nn.Module):
    def __init__(self, width: float = 1.0, repeats: float = 1.0, num_classes: int = 1000) -> None:
        super().__init__()
        cin = divisible(32 * width)
        last = divisible(1280 * max(1.0, width))
        layers: list[nn.Module] = [conv_bn_relu6(3, cin, 3, 2)]
        for t, c, n, s in SETTINGS:
            cout = divisible(c * width)
            for i in range(max(1, round(n * repeats))):
                layers.append(InvertedResidual(cin, cout, s if i == 0 else 1, t))
                cin = cout
        layers.append(conv_bn_relu6(cin, last, 1))
        self.features = nn.Sequential(*layers)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.classifier = nn.Sequential(nn.Dropout(0.2), nn.Linear(last, num_classes))

    def forward(self, x):
        return self.classifier(self.pool(self.features(x)).flatten(1))


def build(config: dict) -> nn.Module:
    return MobileNetV2(**config)
