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


# ------------------------------------------------------------------------------------------ decoder LLM exports
DECODER = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128, vocab_size=128,
               max_position_embeddings=64)
"""A tiny Llama / Qwen3 (Qwen3's head size 16 set, so that its query and key norms run on [B, S, heads, 16])."""

DECODERS = ("llama-fp32", "llama-fp16", "qwen3-fp32", "qwen3-fp16")
DYNAMO_DECODERS = ("llama-fp32", "qwen3-fp16")
"""The decoders exported by the dynamo exporter: Qwen3 in float16 writes every form its float32 writes and Llama's
(the same norms, with Casts), and the two exports take half the time of four."""


def _decoder(name: str, layers: int, seed: int):
    """A transformers decoder LM from its configuration alone (random weights, norm weights around 1, not all 1)."""
    import torch
    import transformers

    family, dtype = name.split("-")
    torch.manual_seed(seed)
    if family == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(num_hidden_layers=layers, **DECODER))
    else:
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(num_hidden_layers=layers, head_dim=16, **DECODER))
    with torch.no_grad():
        for key, p in model.named_parameters():
            if "norm" in key:
                p.normal_(1.0, 0.1)
    model = model.eval()
    return model.half() if dtype == "fp16" else model


def _decoder_exports(folder) -> dict[str, onnx.ModelProto]:
    """`<name>-ts`: each decoder of DECODERS (2 layers) through torch.onnx.export(dynamo=False, opset 17) with
    input_ids and attention_mask (without a mask transformers 5 traces `torch.diff`, which TorchScript cannot export);
    `decoders-dynamo`: DYNAMO_DECODERS (1 layer each) as one module through the dynamo exporter (opset 18, its
    default optimisation), input_ids only: a dynamo export takes 10-20 s here, over 40 s for all four.  Parameters
    keep their module names (`llama_fp16.model.norm.weight`), which tell the decoders apart."""
    import torch

    class One(torch.nn.Module):
        def __init__(self, name):
            super().__init__()
            self.key = name.replace("-", "_")
            self.add_module(self.key, _decoder(name, 2, DECODERS.index(name)))

        def forward(self, input_ids, attention_mask):
            model = getattr(self, self.key)
            return model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits

    class All(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.decoders = torch.nn.ModuleDict({n.replace("-", "_"): _decoder(n, 1, DECODERS.index(n))
                                                 for n in DYNAMO_DECODERS})

        def forward(self, input_ids):
            return tuple(m(input_ids=input_ids, use_cache=False).logits for m in self.decoders.values())

    ids, mask = torch.randint(0, DECODER["vocab_size"], (2, 8)), torch.ones(2, 8, dtype=torch.int64)
    axes = {0: "batch", 1: "sequence"}
    protos = {}
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        for name in DECODERS:
            path = folder / f"{name}-ts.onnx"
            torch.onnx.export(One(name).eval(), (ids, mask), str(path), dynamo=False, opset_version=17,
                              input_names=["input_ids", "attention_mask"], output_names=["logits"],
                              dynamic_axes={"input_ids": axes, "attention_mask": axes, "logits": axes})
            protos[f"{name}-ts"] = onnx.load(str(path))
        dims = {0: torch.export.Dim("batch"), 1: torch.export.Dim("sequence")}
        protos["decoders-dynamo"] = torch.onnx.export(
            All().eval(), (ids,), dynamo=True, opset_version=18, input_names=["input_ids"],
            output_names=[f"logits_{n.replace('-', '_')}" for n in DYNAMO_DECODERS], dynamic_shapes=(dims,),
            verbose=False).model_proto
    for proto in protos.values():
        proto.ir_version = min(proto.ir_version, 10)  # onnxruntime 1.31 refuses the IR 14 that onnx 1.23 writes
    return protos


@pytest.fixture(scope="session")
def decoder_exports(tmp_path_factory):
    """name -> ModelProto of tiny transformers decoders (Llama, Qwen3; float32 and float16) as both torch exporters
    write them (`_decoder_exports`), built once per session (about 25 s, most of it the dynamo export)."""
    pytest.importorskip("transformers")
    logging.getLogger("torch").setLevel(logging.ERROR)
    logging.getLogger("rlflow").setLevel(logging.ERROR)
    return _decoder_exports(tmp_path_factory.mktemp("decoders"))
