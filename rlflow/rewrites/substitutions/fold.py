"""Folding rules: constants (batch-norm statistics, per-channel scales and biases) absorbed into weights."""
from __future__ import annotations

import logging

import numpy as np
import onnx_graphsurgeon as gs

from rlflow.graph.core import Graph
from rlflow.graph.dynamic_axes import dynamic_axes
from rlflow.rewrites.base import Match, NoMatch, Rule
from rlflow.rewrites.edits import combine, emit, replace_all
from rlflow.rewrites.queries import (
    DETERMINISTIC_OPS,
    broadcast_shape,
    constant_input,
    conv_weights,
    has_input,
    input_producer,
    is_float,
    per_channel,
    private,
)
from rlflow.rewrites.substitutions.constant_eval import evaluate, evaluation_failure

log = logging.getLogger("rlflow")

FOLD_LIMIT = 1 << 24
"""Largest constant (elements) that constant folding creates."""


class ConvBatchNorm(Rule):
    """Replaces `BatchNormalization(Conv(x, W, b))` with `Conv(x, W', b')` whose weights absorb the normalisation."""

    name = "conv-bn-fold"
    root_ops = ("BatchNormalization",)

    def check(self, graph: Graph, node: gs.Node) -> Match | NoMatch:
        conv = input_producer(node, 0, "Conv")
        if conv is None:
            return self.no(node, "input is not produced by a Conv")
        if not private(graph, conv.outputs[0]):
            return self.no(node, "the Conv output is read elsewhere too")
        if len(node.outputs) > 1 or node.attrs.get("training_mode", 0):
            return self.no(node, "batch norm in training mode")
        if constant_input(conv, 1) is None or (len(conv.inputs) > 2 and constant_input(conv, 2) is None):
            return self.no(node, "Conv weights or bias are not constant")
        if any(constant_input(node, i) is None for i in range(1, 5)):
            return self.no(node, "batch-norm parameters are not constant")
        return self.match([node, conv])

    def rewrite(self, graph: Graph, match: Match, nodes: dict[str, gs.Node]) -> None:
        bn, conv = nodes[match.nodes[0]], nodes[match.nodes[1]]
        factor, shift = _bn_affine(bn)
        weight, bias = conv_weights(conv)
        _replace_conv(graph, conv, bn.outputs[0], weight * factor.reshape(-1, *([1] * (weight.ndim - 1))),
                      bias * factor + shift)


def _bn_affine(bn: gs.Node) -> tuple[np.ndarray, np.ndarray]:
    """BatchNormalization as y = x * factor + shift (float64 vectors)."""
    scale, beta, mean, var = (constant_input(bn, i).astype(np.float64) for i in range(1, 5))
    factor = scale / np.sqrt(var + float(bn.attrs.get("epsilon", 1e-5)))
    return factor, beta - mean * factor


def _replace_conv(graph: Graph, conv: gs.Node, old: gs.Tensor, weight: np.ndarray, bias: np.ndarray) -> None:
    """Makes readers of `old` read a copy of `conv` with new constant weight and bias (in the weight's type)."""
    dtype = constant_input(conv, 1).dtype
    (out,) = graph.add_node(
        "Conv",
        [conv.inputs[0], graph.add_constant(weight.astype(dtype), f"{conv.name}_W"),
         graph.add_constant(bias.astype(dtype), f"{conv.name}_B")],
        attrs=dict(conv.attrs),
        hint=conv.name,
    )
    graph.replace_uses(old, out)


def _conv_channel_constant(graph: Graph, node: gs.Node) -> tuple[gs.Node, int, np.ndarray] | NoMatch:
    """For `op(Conv(x), c)`: the Conv, the side of c and c as a per-output-channel vector; or why not."""
    for side in (1, 0):
        conv = input_producer(node, 1 - side, "Conv")
        value = constant_input(node, side)
        if conv is None or value is None:
            continue
        if not private(graph, conv.outputs[0]):
            return NoMatch("", node.name, "the Conv output is read elsewhere too")
        if conv_weights(conv) is None or not is_float(conv.outputs[0]):
            return NoMatch("", node.name, "Conv weights or bias are not float constants")
        out = graph.shape(conv.outputs[0])
        vector = per_channel(value, out, 1) if out is not None and len(out) >= 3 else None
        if vector is None or graph.shape(node.outputs[0]) != out:
            return NoMatch("", node.name, "the constant is not one value per output channel")
        return conv, side, vector.astype(np.float64)
    return NoMatch("", node.name, "not a Conv combined with a constant")


def _channel_vector(graph: Graph, node: gs.Node, conv: gs.Node, side: int) -> np.ndarray:
    """The constant at `side` of a matched `op(Conv(x), c)` as the per-output-channel vector it is (float64)."""
    return per_channel(constant_input(node, side), graph.shape(conv.outputs[0]), 1).astype(np.float64)


class ConvMulFold(Rule):
    """Replaces `Mul(Conv(x, W, b), c)` with a per-channel constant c by `Conv(x, W*c, b*c)`."""

    name = "conv-mul-fold"
    root_ops = ("Mul",)

    def check(self, graph: Graph, node: gs.Node) -> Match | NoMatch:
        found = _conv_channel_constant(graph, node)
        return self.no(node, found.reason) if isinstance(found, NoMatch) else self.match([node, found[0]], side=found[1])

    def rewrite(self, graph: Graph, match: Match, nodes: dict[str, gs.Node]) -> None:
        node, conv = nodes[match.nodes[0]], nodes[match.nodes[1]]
        scale = _channel_vector(graph, node, conv, match.param("side"))
        weight, bias = conv_weights(conv)
        _replace_conv(graph, conv, node.outputs[0], weight * scale.reshape(-1, *([1] * (weight.ndim - 1))), bias * scale)


class ConvAddFold(Rule):
    """Replaces `Add(Conv(x, W, b), c)` with a per-channel constant c by `Conv(x, W, b + c)`."""

    name = "conv-add-fold"
    root_ops = ("Add",)

    def check(self, graph: Graph, node: gs.Node) -> Match | NoMatch:
        found = _conv_channel_constant(graph, node)
        return self.no(node, found.reason) if isinstance(found, NoMatch) else self.match([node, found[0]], side=found[1])

    def rewrite(self, graph: Graph, match: Match, nodes: dict[str, gs.Node]) -> None:
        node, conv = nodes[match.nodes[0]], nodes[match.nodes[1]]
        shift = _channel_vector(graph, node, conv, match.param("side"))
        weight, bias = conv_weights(conv)
        _replace_conv(graph, conv, node.outputs[0], weight, bias + shift)


def _gemm_like(graph: Graph, node: gs.Node, index: int = 0) -> gs.Node | None:
    """A private MatMul (constant 2-D right operand) or Gemm (constant B, constant or absent C) feeding `node`."""
    producer = input_producer(node, index, ("MatMul", "Gemm"))
    if producer is None or not private(graph, producer.outputs[0]):
        return None
    weight = constant_input(producer, 1)
    if weight is None or weight.ndim != 2 or not is_float(producer.outputs[0]):
        return None
    if producer.op == "Gemm" and has_input(producer, 2) and constant_input(producer, 2) is None:
        return None
    return producer


def _gemm_parts(graph: Graph, node: gs.Node) -> tuple[np.ndarray, np.ndarray, float]:
    """(W as [K, N] in float64, bias broadcastable to [.., N] in float64, alpha) of a MatMul or Gemm: y = alpha*x.W + bias."""
    weight = constant_input(node, 1).astype(np.float64)
    if node.op == "MatMul":
        return weight, np.zeros(weight.shape[1]), 1.0
    if node.attrs.get("transB", 0):
        weight = weight.T
    bias = constant_input(node, 2).astype(np.float64) if has_input(node, 2) else np.zeros(weight.shape[1])
    return weight, bias * float(node.attrs.get("beta", 1.0)), float(node.attrs.get("alpha", 1.0))


def _replace_gemm(graph: Graph, producer: gs.Node, old: gs.Tensor, weight: np.ndarray, bias: np.ndarray | None,
                  alpha: float) -> None:
    """Makes readers of `old` read `alpha * x.W + bias` on the producer's input: a Gemm for 2-D x, else MatMul(+Add)."""
    dtype = constant_input(producer, 1).dtype
    x = producer.inputs[0]
    w = graph.add_constant(weight.astype(dtype), f"{producer.name}_W")
    if producer.op == "Gemm" or len(graph.shape(x) or ()) == 2:
        attrs = {"alpha": alpha, "transA": int(producer.attrs.get("transA", 0))} if producer.op == "Gemm" else {}
        inputs = [x, w] + ([graph.add_constant(bias.astype(dtype), f"{producer.name}_B")] if bias is not None else [])
        graph.replace_uses(old, emit(graph, "Gemm", inputs, attrs))
        return
    out = emit(graph, "MatMul", [x, w])
    if bias is not None:
        out = emit(graph, "Add", [out, graph.add_constant(bias.astype(dtype), f"{producer.name}_B")])
    graph.replace_uses(old, out)


class MatMulBatchNorm(Rule):
    """Replaces `BatchNormalization(MatMul(x, W))` (or of a Gemm) on 2-D features with one Gemm on folded weights."""

    name = "matmul-bn-fold"
    root_ops = ("BatchNormalization",)

    def check(self, graph: Graph, node: gs.Node) -> Match | NoMatch:
        producer = _gemm_like(graph, node)
        if producer is None:
            return self.no(node, "input is not a private MatMul or Gemm with constant weights")
        if len(node.outputs) > 1 or node.attrs.get("training_mode", 0):
            return self.no(node, "batch norm in training mode")
        if any(constant_input(node, i) is None for i in range(1, 5)):
            return self.no(node, "batch-norm parameters are not constant")
        if graph.shape(node.outputs[0]) is None or len(graph.shape(node.outputs[0])) != 2:
            return self.no(node, "the features are not 2-D (batch norm would normalise another axis)")
        return self.match([node, producer])

    def rewrite(self, graph: Graph, match: Match, nodes: dict[str, gs.Node]) -> None:
        bn, producer = nodes[match.nodes[0]], nodes[match.nodes[1]]
        factor, shift = _bn_affine(bn)
        weight, bias, alpha = _gemm_parts(graph, producer)
        _replace_gemm(graph, producer, bn.outputs[0], weight * factor, bias * factor + shift, alpha)


class MatMulScaleFold(Rule):
    """Replaces `Mul(MatMul(x, W), s)` (or `Div`, or of a Gemm) with s a constant per output column by `x.(W*s)`."""

    name = "matmul-scale-fold"
    root_ops = ("Mul", "Div")

    def check(self, graph: Graph, node: gs.Node) -> Match | NoMatch:
        for side in ((1, 0) if node.op == "Mul" else (1,)):
            producer = _gemm_like(graph, node, 1 - side)
            value = constant_input(node, side)
            if producer is None or value is None:
                continue
            out = graph.shape(node.outputs[0])
            if out is None or out != graph.shape(producer.outputs[0]) or per_channel(value, out, len(out) - 1) is None:
                return self.no(node, "the constant is not one value per output column")
            return self.match([node, producer], side=side)
        return self.no(node, "not a private MatMul or Gemm (constant weights) scaled by a constant")

    def rewrite(self, graph: Graph, match: Match, nodes: dict[str, gs.Node]) -> None:
        node, producer = nodes[match.nodes[0]], nodes[match.nodes[1]]
        out = graph.shape(node.outputs[0])
        scale = per_channel(constant_input(node, match.param("side")), out, len(out) - 1).astype(np.float64)
        if node.op == "Div":
            scale = 1.0 / scale
        weight, bias, alpha = _gemm_parts(graph, producer)
        keep_bias = producer.op == "Gemm" and has_input(producer, 2)
        _replace_gemm(graph, producer, node.outputs[0], weight * scale, bias * scale if keep_bias else None, alpha)


class GemmBiasFold(Rule):
    """Replaces `Add(Gemm(a, b, c), d)` with a constant d by `Gemm(a, b, beta*c + d)`."""

    name = "gemm-bias-fold"
    root_ops = ("Add",)

    def check(self, graph: Graph, node: gs.Node) -> Match | NoMatch:
        for side in (1, 0):
            gemm = input_producer(node, 1 - side, "Gemm")
            value = constant_input(node, side)
            if gemm is None or value is None:
                continue
            if not private(graph, gemm.outputs[0]):
                return self.no(node, "the Gemm output is read elsewhere too")
            if has_input(gemm, 2) and constant_input(gemm, 2) is None:
                return self.no(node, "the Gemm bias is not constant")
            out = graph.shape(gemm.outputs[0])
            if out is None or value.ndim > 2 or broadcast_shape(out, value.shape) != out or not is_float(node.outputs[0]):
                return self.no(node, "the constant broadcasts the product to a larger shape")
            return self.match([node, gemm], side=side)
        return self.no(node, "not a Gemm plus a constant")

    def rewrite(self, graph: Graph, match: Match, nodes: dict[str, gs.Node]) -> None:
        node, gemm = nodes[match.nodes[0]], nodes[match.nodes[1]]
        extra = constant_input(node, match.param("side")).astype(np.float64)
        bias = extra
        if has_input(gemm, 2):
            bias = constant_input(gemm, 2).astype(np.float64) * float(gemm.attrs.get("beta", 1.0)) + extra
        dtype = constant_input(gemm, 1).dtype if constant_input(gemm, 1) is not None else np.float32
        attrs = {**gemm.attrs, "beta": 1.0}
        inputs = [gemm.inputs[0], gemm.inputs[1], graph.add_constant(bias.astype(dtype), f"{gemm.name}_C")]
        graph.replace_uses(node.outputs[0], emit(graph, "Gemm", inputs, attrs))


class _ConstChainFold(Rule):
    """`op(op(x, c1), c2)` for an associative, commutative op: `op(x, op(c1, c2))`."""

    def check(self, graph: Graph, node: gs.Node) -> Match | NoMatch:
        for side in (1, 0):
            inner = input_producer(node, 1 - side, node.op)
            if inner is None or constant_input(node, side) is None:
                continue
            if not private(graph, inner.outputs[0]):
                return self.no(node, f"the inner {node.op} is read elsewhere too")
            for inner_side in (1, 0):
                if constant_input(inner, inner_side) is not None and constant_input(inner, 1 - inner_side) is None:
                    if not is_float(node.outputs[0]) or constant_input(inner, inner_side).dtype != constant_input(
                            node, side).dtype:
                        return self.no(node, "the constants are not floats of one type")
                    return self.match([node, inner], side=side, inner_side=inner_side)
            return self.no(node, f"the inner {node.op} has no constant operand")
        return self.no(node, f"not a {node.op} of a {node.op} and a constant")

    def rewrite(self, graph: Graph, match: Match, nodes: dict[str, gs.Node]) -> None:
        node, inner = nodes[match.nodes[0]], nodes[match.nodes[1]]
        side, inner_side = match.param("side"), match.param("inner_side")
        folded = combine(graph, node.op, inner.inputs[inner_side], node.inputs[side], hint=f"{node.name}_const")
        graph.replace_uses(node.outputs[0], emit(graph, node.op, [inner.inputs[1 - inner_side], folded]))


class AddConstChainFold(_ConstChainFold):
    """Replaces `Add(Add(x, c1), c2)` with `Add(x, c1 + c2)` for constants c1, c2."""

    name = "add-const-chain-fold"
    root_ops = ("Add",)


class MulConstChainFold(_ConstChainFold):
    """Replaces `Mul(Mul(x, c1), c2)` with `Mul(x, c1 * c2)` for constants c1, c2."""

    name = "mul-const-chain-fold"
    root_ops = ("Mul",)


class ConstantFold(Rule):
    """Replaces a node whose inputs are all constants with constants holding its outputs."""

    name = "constant-fold"
    root_ops = DETERMINISTIC_OPS

    def check(self, graph: Graph, node: gs.Node) -> Match | NoMatch:
        if (node.domain or "") not in ("", "ai.onnx"):
            return self.no(node, "not a standard operator")
        present = [t for t in node.inputs if t.name != ""]
        if not present or any(Graph.constant(t) is None for t in present):
            return self.no(node, "not every input is a constant")
        if any(isinstance(v, gs.Graph) for v in node.attrs.values()):
            return self.no(node, "the node has a subgraph")
        for out in node.outputs:
            shape = graph.shape(out)
            if (out.outputs or graph.is_output(out)) and (shape is None or int(np.prod(shape)) > FOLD_LIMIT):
                return self.no(node, "an output is too large (or of unknown size) to store as a constant")
        failure = evaluation_failure(graph, node)
        if failure is not None:
            return self.no(node, failure)
        return self.match([node])

    def rewrite(self, graph: Graph, match: Match, nodes: dict[str, gs.Node]) -> None:
        node = nodes[match.root]
        values = evaluate(graph, node)
        replace_all(graph, node.outputs, [graph.add_constant(v, f"{t.name}_folded") for t, v in zip(node.outputs, values)])


class ShapeDimFold(Rule):
    """Replaces `Gather(Shape(x), i)` with a constant where the dimensions of x it reads are fixed.

    Fixed: the same at every size of the model's dynamic dimensions (TorchScript reads a head's rotary width as
    `Shape(cos)[-1]`)."""

    name = "shape-dim-fold"
    root_ops = ("Gather",)

    def check(self, graph: Graph, node: gs.Node) -> Match | NoMatch:
        of_shape = input_producer(node, 0, "Shape")
        indices = constant_input(node, 1)
        if of_shape is None or indices is None or indices.dtype.kind not in "iu" or node.attrs.get("axis", 0) != 0:
            return self.no(node, "not a Gather of a Shape at constant indices")
        x = of_shape.inputs[0]
        shape, dynamic = graph.shape(x), dynamic_axes(graph, x)
        if shape is None or dynamic is None:
            return self.no(node, "the shape of the tensor it reads is unknown")
        axes = list(range(len(shape)))[of_shape.attrs.get("start", 0):of_shape.attrs.get("end", len(shape))]
        if any(not -len(axes) <= i < len(axes) for i in indices.reshape(-1)):
            return self.no(node, "an index lies outside the shape")
        read = [axes[i] for i in indices.reshape(-1)]
        if any(dynamic[a] for a in read):
            return self.no(node, "a dimension it reads follows the model's dynamic dimensions")
        return self.match([node], dims=tuple(int(shape[a]) for a in read), scalar=indices.ndim == 0)

    def rewrite(self, graph: Graph, match: Match, nodes: dict[str, gs.Node]) -> None:
        node = nodes[match.root]
        dims = np.asarray(match.param("dims"), np.int64)
        constant = graph.add_constant(dims.reshape(()) if match.param("scalar") else dims, f"{node.name}_dims")
        replace_all(graph, node.outputs, [constant])
