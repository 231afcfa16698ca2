"""Real exported graphs shared by the rewrite tests: a small CNN and a small transformer exported from PyTorch with
both exporters (TorchScript and dynamo), and zoo "-tiny" models.  Built once per session (about 8 s)."""
from __future__ import annotations

import logging
import warnings

import onnx
import pytest

from rlflow.graph.core import Graph

ZOO_MODELS = ("bert-base-tiny", "resnet-18-tiny")


def _transformer():
    import torch
    from torch import nn

    class Block(nn.Module):
        """A BERT/ViT encoder layer as written in model code (separate Q, K, V; a constant attention scale)."""

        def __init__(self, d=32, heads=4):
            super().__init__()
            self.heads, self.size = heads, d // heads
            self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))
            self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
            self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

        def forward(self, x):
            b, s, d = x.shape
            split = lambda t: t.view(b, s, self.heads, self.size).transpose(1, 2)  # noqa: E731
            q, k, v = split(self.q(x)), split(self.k(x)), split(self.v(x))
            att = torch.softmax(q @ k.transpose(-1, -2) / self.size ** 0.5, dim=-1)
            x = self.ln1(x + self.o((att @ v).transpose(1, 2).reshape(b, s, d)))
            return self.ln2(x + self.mlp(x))

    return Block().eval(), torch.randn(2, 8, 32)


def _cnn():
    import torch
    from torch import nn

    class Net(nn.Module):
        """Conv/BN/ReLU, two branches on one input joined by Concat, a residual Add and a linear classifier."""

        def __init__(self):
            super().__init__()
            self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU())
            self.a, self.b = nn.Conv2d(8, 4, 1), nn.Conv2d(8, 4, 3, padding=1)
            self.head = nn.Linear(8, 10)

        def forward(self, x):
            x = self.stem(x)
            x = x + torch.cat([torch.relu(self.a(x)), torch.relu(self.b(x))], 1)
            return self.head(torch.flatten(nn.functional.adaptive_avg_pool2d(x, 1), 1))

    net = Net().eval()
    with torch.no_grad():
        net.stem[1].running_mean.uniform_(-0.5, 0.5)
        net.stem[1].running_var.uniform_(0.5, 2.0)
    return net, torch.randn(1, 3, 8, 8)


def _export(build, dynamo: bool, path) -> Graph:
    import torch

    torch.manual_seed(0)
    model, example = build()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if dynamo:
            torch.onnx.export(model, (example,), str(path), dynamo=True, optimize=False, opset_version=18,
                              input_names=["x"], output_names=["y"], verbose=False)
        else:
            torch.onnx.export(model, (example,), str(path), dynamo=False, opset_version=17, input_names=["x"],
                              output_names=["y"], training=torch.onnx.TrainingMode.PRESERVE,
                              dynamic_axes={"x": {0: "batch"}, "y": {0: "batch"}})
    proto = onnx.load(str(path))
    proto.ir_version = min(proto.ir_version, 10)
    return Graph.from_model(proto)


@pytest.fixture(scope="session")
def exports(tmp_path_factory):
    """name -> Graph for every real model of this test."""
    logging.getLogger("torch").setLevel(logging.ERROR)
    logging.getLogger("rlflow").setLevel(logging.ERROR)
    folder = tmp_path_factory.mktemp("exports")
    graphs = {}
    for family, build in (("cnn", _cnn), ("transformer", _transformer)):
        for exporter, dynamo in (("torchscript", False), ("dynamo", True)):
            graphs[f"{family}-{exporter}"] = _export(build, dynamo, folder / f"{family}-{exporter}.onnx")
    from rlflow import load, zoo

    for name in ZOO_MODELS:
        graphs[name] = load(zoo.build(name, folder).path)
    return graphs
