"""NASNet-A mobile, "4 @ 1056" (Zoph et al., 2018): 224x224, 4 normal cells per stack, 44 base filters.

Layout: 3x3/2 convolution stem (32 filters, no padding), two reduction cells as further stem (11 and 22
filters), then three stacks of 4 normal cells (44, 88, 176 filters) separated by reduction cells.  A normal cell
outputs 6 x filters channels and a reduction cell 4 x filters; the last stack ends at 6 x 176 = 1056.

Cells are described by data (the NASNet-A search result, Figure 4 of the paper): each of the five blocks adds two
operations, each applied to a hidden state: 0 = the previous cell's output after a ReLU-1x1-BN, 1 = the output
of the cell before that (made to match in size and width first), 2.. = earlier blocks.  A cell outputs the
concatenation of the states no block consumed.  Separable convolutions are applied twice (ReLU, depthwise,
pointwise, BN each), pooling keeps the 'SAME' padding and excludes padded cells from averages.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

#  (operation, input state) pairs for the five blocks, and which states are concatenated into the output.
NORMAL = dict(
    ops=[("sep5", 0), ("sep3", 1), ("sep5", 1), ("sep3", 1), ("avg", 0), ("none", 1), ("avg", 1), ("avg", 1),
         ("sep3", 0), ("none", 0)],
    outputs=[1, 2, 3, 4, 5, 6],
)
REDUCTION = dict(
    ops=[("sep5", 0), ("sep7", 1), ("max", 0), ("sep7", 1), ("avg", 0), ("sep5", 1), ("none", 3), ("avg", 2),
         ("sep3", 2), ("max", 0)],
    outputs=[3, 4, 5, 6],
)


def bn(channels: int) -> nn.BatchNorm2d:
    return nn.BatchNorm2d(channels, eps=1e-3)


def relu_conv_bn(cin: int, cout: int, stride: int = 1) -> nn.Sequential:
    return nn.Sequential(nn.ReLU(), nn.Conv2d(cin, cout, 1, stride, bias=False), bn(cout))


class SeparableStack(nn.Module):
    """Two (ReLU, depthwise kxk, pointwise 1x1, BN) layers; the first carries the stride and the width change."""

    def __init__(self, cin: int, cout: int, kernel: int, stride: int) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        for i, c in enumerate((cin, cout)):
            layers += [nn.ReLU(), nn.Conv2d(c, c, kernel, stride if i == 0 else 1, kernel // 2, groups=c, bias=False),
                       nn.Conv2d(c, cout, 1, bias=False), bn(cout)]
        self.layers = nn.Sequential(*layers)

    def forward(self, x):
        return self.layers(x)


class Pool(nn.Module):
    """3x3 pooling, followed by a 1x1 convolution and BN when the width must change."""

    def __init__(self, kind: str, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.pool = (nn.AvgPool2d(3, stride, 1, count_include_pad=False) if kind == "avg"
                     else nn.MaxPool2d(3, stride, 1))
        self.project = nn.Sequential(nn.Conv2d(cin, cout, 1, bias=False), bn(cout)) if cin != cout else nn.Identity()

    def forward(self, x):
        return self.project(self.pool(x))


def operation(name: str, cin: int, cout: int, stride: int) -> nn.Module:
    if name.startswith("sep"):
        return SeparableStack(cin, cout, int(name[3:]), stride)
    if name in ("avg", "max"):
        return Pool(name, cin, cout, stride)
    return relu_conv_bn(cin, cout, stride) if stride > 1 or cin != cout else nn.Identity()


class FactorizedReduction(nn.Module):
    """Halves the resolution of the older input without losing pixels: two 1x1/2 paths, one shifted by a pixel."""

    def __init__(self, cin: int, cout: int) -> None:
        super().__init__()
        self.path1 = nn.Conv2d(cin, cout // 2, 1, bias=False)
        self.path2 = nn.Conv2d(cin, cout - cout // 2, 1, bias=False)
        self.bn = bn(cout)

    def forward(self, x):
        x = F.relu(x)
        shifted = F.pad(x, (0, 1, 0, 1))[:, :, 1:, 1:]
        return self.bn(torch.cat([self.path1(F.avg_pool2d(x, 1, 2)), self.path2(F.avg_pool2d(shifted, 1, 2))], 1))


class Cell(nn.Module):
    def __init__(self, spec: dict, cur: tuple[int, int], prev: tuple[int, int] | None, filters: int) -> None:
        """``cur``/``prev``: (channels, size) of the two inputs; ``prev`` None means the cell has one input."""
        super().__init__()
        self.reduction = spec is REDUCTION
        self.base = relu_conv_bn(cur[0], filters)
        if prev is None:  # the first stem cell: the raw input doubles as the older state
            self.adjust, prev_channels = None, cur[0]
        elif prev[1] != cur[1]:
            self.adjust, prev_channels = FactorizedReduction(prev[0], filters), filters
        else:
            self.adjust = relu_conv_bn(prev[0], filters) if prev[0] != filters else nn.Identity()
            prev_channels = filters
        channels = [filters, prev_channels] + [filters] * 5
        self.inputs = [i for _, i in spec["ops"]]
        self.ops = nn.ModuleList(
            operation(name, channels[i], filters, 2 if self.reduction and i < 2 else 1) for name, i in spec["ops"]
        )
        self.outputs = spec["outputs"]
        self.out_channels = filters * len(self.outputs)

    def forward(self, x, prev):
        states = [self.base(x), x if self.adjust is None else self.adjust(prev)]
        for b in range(5):
            left, right = 2 * b, 2 * b + 1
            states.append(self.ops[left](states[self.inputs[left]]) + self.ops[right](states[self.inputs[right]]))
        return torch.cat([states[i] for i in self.outputs], 1)


class NASNetA(nn.Module):
    def __init__(self, cells_per_stack: int = 4, filters: int = 44, stem_filters: int = 32, image_size: int = 224,
                 num_classes: int = 1000) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, stem_filters, 3, 2, bias=False), bn(stem_filters))
        size = (image_size - 3) // 2 + 1
        cells: list[Cell] = []
        prev, cur = None, (stem_filters, size)
        # (spec, filters) in order: two stem reductions at 1/4 and 1/2 of the base width, then the three stacks.
        plan = [(REDUCTION, filters // 4), (REDUCTION, filters // 2)]
        for stack in range(3):
            if stack > 0:
                plan.append((REDUCTION, filters * 2**stack))
            plan += [(NORMAL, filters * 2**stack)] * cells_per_stack
        for spec, f in plan:
            cells.append(Cell(spec, cur, prev, f))
            size = (size + 1) // 2 if spec is REDUCTION else size
            prev, cur = cur, (cells[-1].out_channels, size)
        self.cells = nn.ModuleList(cells)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.dropout = nn.Dropout(0.5)
        self.fc = nn.Linear(cur[0], num_classes)

    def forward(self, x):
        prev, x = None, self.stem(x)
        for cell in self.cells:
            prev, x = x, cell(x, prev)
        return self.fc(self.dropout(self.pool(F.relu(x)).flatten(1)))


def build(config: dict) -> nn.Module:
    return NASNetA(**config)
