"""Shared fixtures: small models built here (PyTorch exports and hand-made ONNX), one per test session."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper


@pytest.fixture(scope="session", autouse=True)
def private_rlflow_cache(tmp_path_factory):
    """The session's rlflow caches (cost tables, zoo builds) in a folder of its own, for the command-line runs too:
    the suite must not write its measurements, taken beside pytest's own load, into the cost table that real runs and
    trainings read (~/.cache/rlflow; one suite run added entries to it)."""
    import os

    before = os.environ.get("RLFLOW_CACHE")
    os.environ["RLFLOW_CACHE"] = str(tmp_path_factory.mktemp("rlflow-cache"))
    yield
    if before is None:
        os.environ.pop("RLFLOW_CACHE", None)
    else:
        os.environ["RLFLOW_CACHE"] = before


def save(model: onnx.ModelProto, path) -> str:
    """Saves with an IR version onnxruntime accepts."""
    model.ir_version = min(model.ir_version, 10)
    onnx.save(model, str(path))
    return str(path)


@pytest.fixture(scope="session")
def transformer_path(tmp_path_factory) -> str:
    """A small BERT-style encoder layer exported from PyTorch, with a dynamic batch dimension."""
    import torch
    from torch import nn

    class Block(nn.Module):
        def __init__(self, d=32, heads=4):
            super().__init__()
            self.heads, self.d = heads, d
            self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))
            self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
            self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

        def forward(self, x):
            b, s, d = x.shape
            split = lambda t: t.reshape(b, s, self.heads, d // self.heads).transpose(1, 2)  # noqa: E731
            q, k, v = split(self.q(x)), split(self.k(x)), split(self.v(x))
            att = torch.softmax(q @ k.transpose(-1, -2) / (d // self.heads) ** 0.5, dim=-1)
            x = self.ln1(x + self.o((att @ v).transpose(1, 2).reshape(b, s, d)))
            return self.ln2(x + self.mlp(x))

    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("models") / "transformer.onnx"
    torch.onnx.export(Block().eval(), (torch.randn(2, 16, 32),), str(path), dynamo=False, opset_version=17,
                      input_names=["x"], output_names=["y"], dynamic_axes={"x": {0: "batch"}, "y": {0: "batch"}})
    return save(onnx.load(str(path)), path)


@pytest.fixture(scope="session")
def cnn_opset9_ir3_path(tmp_path_factory) -> str:
    """A small CNN exported at opset 9 and stored as IR 3, with its initializers listed as graph inputs."""
    import torch
    from torch import nn

    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(2),
                          nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                          nn.Flatten(), nn.Linear(8 * 8 * 8, 10)).eval()
    for bn in (model[1], model[5]):
        bn.running_mean.uniform_(-0.5, 0.5)
        bn.running_var.uniform_(0.5, 2.0)
    path = tmp_path_factory.mktemp("models") / "cnn9.onnx"
    torch.onnx.export(model, (torch.randn(1, 3, 16, 16),), str(path), dynamo=False, opset_version=9,
                      do_constant_folding=False, keep_initializers_as_inputs=True,
                      training=torch.onnx.TrainingMode.PRESERVE, input_names=["image"], output_names=["logits"])
    proto = onnx.load(str(path))
    proto.ir_version = 3
    onnx.save(proto, str(path))
    return str(path)


def tiny_model(nodes, inputs, outputs, initializers=(), opset=17) -> onnx.ModelProto:
    """A model from onnx.helper parts, at an IR version onnxruntime accepts."""
    graph = helper.make_graph(list(nodes), "tiny", list(inputs), list(outputs), initializer=list(initializers))
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=8)


@pytest.fixture
def matmul_model() -> onnx.ModelProto:
    """y = relu(x @ W + b) with a dynamic batch dimension."""
    rng = np.random.default_rng(0)
    w = numpy_helper.from_array(rng.standard_normal((8, 4)).astype(np.float32), "W")
    b = numpy_helper.from_array(rng.standard_normal(4).astype(np.float32), "b")
    return tiny_model(
        [helper.make_node("MatMul", ["x", "W"], ["h"], name="mm"), helper.make_node("Add", ["h", "b"], ["a"]),
         helper.make_node("Relu", ["a"], ["y"])],
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4])],
        [w, b])


def with_op(model: onnx.ModelProto, op_type: str, domain: str = "") -> onnx.ModelProto:
    """`model` (`matmul_model`, or any whose third node is an activation) with that node's operator replaced; a `domain`
    is imported at version 1 (an unknown one makes a model onnxruntime cannot build)."""
    other = onnx.ModelProto()
    other.CopyFrom(model)
    other.graph.node[2].op_type, other.graph.node[2].domain = op_type, domain
    if domain:
        other.opset_import.append(helper.make_opsetid(domain, 1))
    return other


@pytest.fixture
def matmul_with_identity(matmul_model) -> onnx.ModelProto:
    """`matmul_model` with an Identity between its Add and its Relu: written otherwise, run the same (onnxruntime
    removes the Identity)."""
    other = onnx.ModelProto()
    other.CopyFrom(matmul_model)
    other.graph.node[2].input[0] = "a_copy"
    other.graph.node.insert(2, helper.make_node("Identity", ["a"], ["a_copy"], name="copy"))
    return other


@pytest.fixture
def mlp_and_cnn(tmp_path, matmul_model, cnn_opset9_ir3_path) -> list:
    """Two small models in a folder of their own: mlp.onnx and cnn.onnx (what the cluster tests bench)."""
    import shutil

    folder = tmp_path / "models"
    folder.mkdir()
    save(matmul_model, folder / "mlp.onnx")
    shutil.copy(cnn_opset9_ir3_path, folder / "cnn.onnx")
    return sorted(folder.glob("*.onnx"))
