"""Half-precision rules: one node computed in float16 or bfloat16, its float32 neighbours reached through Casts.

A node is the unit of choice, as `MatMul` is for the integer rules (`precision.py`): `rlflow optimize --precision
fp16` decides, node by node, which may compute in half precision (`rlflow.search.half`). Converting a node casts its
float32 activations in, stores its float32 constants in half, and casts its outputs back, so the graph's interface and
every node not chosen stay float32. Where two chosen nodes meet, the Cast pair between them (half to float32 to half,
the identity) is skipped as each is converted, in either order, so a converted region carries no Casts inside.

Only operators whose float inputs and outputs all share one type are offered (`HALF_OPS`); the reductions behind
unfused norms and softmax, and everything with a float32-only operand, stay float32. The fused norms' own kernels
accumulate in float32 whatever their input type, which is why the fused forms are offered and the unfused are not.
The tensor work (values clamped to the half range) is onnxruntime's float16 converter's.
"""
from __future__ import annotations

from typing import ClassVar

import numpy as np
import onnx_graphsurgeon as gs
from onnx import TensorProto

from rlflow.graph.core import Graph
from rlflow.rewrites.base import Match, NoMatch
from rlflow.rewrites.edits import clone_node, emit, replace_typed
from rlflow.rewrites.precision import PrecisionRule
from rlflow.rewrites.queries import MS

HALF_OPS: dict[str, frozenset[str]] = {
    "": frozenset({
        "MatMul", "Gemm", "Conv", "Add", "Sub", "Mul", "Div", "Relu", "Sigmoid", "Tanh", "Erf", "Neg", "Sqrt", "Gelu",
        "Transpose", "Reshape", "Squeeze", "Unsqueeze", "Flatten", "Concat", "Split", "Slice", "Gather", "Expand",
        "Where", "MaxPool", "AveragePool", "GlobalAveragePool", "BatchNormalization", "LayerNormalization",
        "SimplifiedLayerNormalization"}),
    MS: frozenset({
        "FusedMatMul", "Gelu", "FastGelu", "QuickGelu", "BiasGelu", "BiasAdd", "SkipLayerNormalization",
        "SkipSimplifiedLayerNormalization", "MultiHeadAttention", "GroupQueryAttention", "RotaryEmbedding",
        "FusedConv"}),
}
"""Operators whose float inputs and outputs are all of one type T, so computing in half is casting every one."""

FLOAT32_OUTPUTS = {"LayerNormalization": (1, 2), "SimplifiedLayerNormalization": (1,), "SkipLayerNormalization": (1, 2),
                   "SkipSimplifiedLayerNormalization": (1, 2), "BatchNormalization": (1, 2)}
"""Outputs a norm writes in float32 whatever its input type (the statistics): such a node is offered only where
they are unused."""


class HalfPrecisionRule(PrecisionRule):
    """A node of HALF_OPS whose float tensors are float32, computed in `half` with Casts at its float32 edges."""

    root_ops = tuple(sorted(set().union(*HALF_OPS.values())))
    half: ClassVar[int] = TensorProto.FLOAT16
    """The element type it computes in (an onnx TensorProto type)."""

    def check(self, graph: Graph, node: gs.Node) -> Match | NoMatch:
        domain = node.domain or ""
        if node.op not in HALF_OPS.get("" if domain == "ai.onnx" else domain, ()):
            return self.no(node, f"{node.op} ({domain or 'onnx'}) is not offered in half precision")
        for index in FLOAT32_OUTPUTS.get(node.op, ()):
            if index < len(node.outputs) and (node.outputs[index].outputs or graph.is_output(node.outputs[index])):
                return self.no(node, f"its float32 statistics output {index} is read")
        floats = 0
        for tensor in [*node.inputs, *node.outputs]:
            if not tensor.name:
                continue
            if tensor.dtype is None:
                return self.no(node, f"the element type of {tensor.name} is unknown")
            if _type_name(tensor) == "float32":
                floats += 1
            elif _type_name(tensor) in ("float16", "bfloat16", "float64"):
                return self.no(node, f"{tensor.name} is {_type_name(tensor)}, not float32")
        if not floats:
            return self.no(node, "it has no float32 tensor")
        return self.match([node])

    def rewrite(self, graph: Graph, match: Match, nodes: dict[str, gs.Node]) -> None:
        node = nodes[match.root]
        known = graph.gs.tensors()
        inputs = [self._half_input(graph, t, known) if t.name and _type_name(t) == "float32" else t
                  for t in node.inputs]
        statistics = FLOAT32_OUTPUTS.get(node.op, ())  # unread (`check`): dropped, as they cannot be half
        outputs = [gs.Variable.empty() if not t.name or k in statistics else
                   gs.Variable(graph.fresh_name(f"{t.name}_{self.precision}"),
                               self._dtype() if _type_name(t) == "float32" else t.dtype, t.shape)
                   for k, t in enumerate(node.outputs)]
        clone_node(graph, node, inputs, outputs)
        for old, new in zip(node.outputs, outputs):
            if not old.name or not new.name:
                continue
            if _type_name(old) != "float32":
                replace_typed(graph, old, new)
                continue
            back = emit(graph, "Cast", [new], {"to": TensorProto.FLOAT}, hint=f"{old.name}_float")
            back.dtype, back.shape = np.float32, old.shape
            replace_typed(graph, old, back)
            for reader in list(back.outputs):  # a converted reader's Cast back to half: the identity, skipped
                if reader.op == "Cast" and reader.attrs.get("to") == self.half:
                    graph.replace_uses(reader.outputs[0], new)

    def _half_input(self, graph: Graph, tensor: gs.Tensor, known: dict[str, gs.Tensor]) -> gs.Tensor:
        """`tensor` (float32) in half: a constant converted (once, where several converted nodes read it), the source
        of a Cast from half, or a Cast of it."""
        if isinstance(tensor, gs.Constant):
            name, values = f"{tensor.name}_{self.precision}", self.convert(tensor.values)
            made = known.get(name)
            if (isinstance(made, gs.Constant) and made.values.dtype == values.dtype
                    and made.values.shape == values.shape and np.array_equal(made.values, values)):
                return made
            name = name if name not in known else graph.fresh_name(name)
            known[name] = gs.Constant(name, values)
            return known[name]
        producer = tensor.inputs[0] if len(tensor.inputs) == 1 else None
        if (producer is not None and producer.op == "Cast" and producer.inputs[0].dtype is not None
                and self._is_half(producer.inputs[0])):
            return producer.inputs[0]
        for reader in tensor.outputs:
            if reader.op == "Cast" and reader.attrs.get("to") == self.half:
                return reader.outputs[0]
        out = emit(graph, "Cast", [tensor], {"to": self.half}, hint=f"{tensor.name}_{self.precision}")
        out.dtype, out.shape = self._dtype(), tensor.shape
        return out

    def _dtype(self):
        return np.float16

    def _is_half(self, tensor: gs.Tensor) -> bool:
        return _type_name(tensor) == "float16"

    def convert(self, values: np.ndarray) -> np.ndarray:
        """The float32 array in half, values past the half range clamped to it (onnxruntime's converter)."""
        from onnxruntime.transformers.float16 import convert_np_to_float16

        return convert_np_to_float16(np.atleast_1d(np.asarray(values, dtype=np.float32))).reshape(np.shape(values))


class NodeFloat16(HalfPrecisionRule):
    """Replaces a float32 node with the same node in float16, with Casts where it meets float32 tensors."""

    name = "node-fp16"
    precision = "fp16"
    tolerance = 2e-3


class NodeBfloat16(HalfPrecisionRule):
    """Replaces a float32 node with the same node in bfloat16, with Casts where it meets float32 tensors."""

    name = "node-bf16"
    precision = "bf16"
    tolerance = 1.6e-2
    half = TensorProto.BFLOAT16

    def _dtype(self):
        import ml_dtypes

        return ml_dtypes.bfloat16

    def _is_half(self, tensor: gs.Tensor) -> bool:
        return _type_name(tensor) == "bfloat16"

    def convert(self, values: np.ndarray) -> np.ndarray:
        """The float32 array rounded to bfloat16 (its range is float32's, so nothing is clamped)."""
        import ml_dtypes

        return np.asarray(values, dtype=np.float32).astype(ml_dtypes.bfloat16)


def _type_name(tensor: gs.Tensor) -> str:
    """The tensor's element type by name (`float16`, `bfloat16`, ...; an onnx type number where numpy has none)."""
    try:
        return np.dtype(tensor.dtype).name
    except TypeError:
        return str(tensor.dtype)
