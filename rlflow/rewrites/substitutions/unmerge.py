"""Inverse rules for merged work: a Split of a merged MatMul, Gemm or Conv back into one operator per part, and a 2-D
Gemm between Reshapes back into the 3-D MatMul + Add it came from.  With them a search can pass through a slower graph
to reach a faster one (as TASO's does)."""
from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs

from rlflow.graph.core import Graph
from rlflow.graph.dynamic_axes import dynamic_axes
from rlflow.rewrites.base import Match, NoMatch, Rule
from rlflow.rewrites.edits import emit, gemm_bias, gemm_weight, replace_all
from rlflow.rewrites.queries import (
    broadcast_shape,
    constant_input,
    conv_params,
    has_input,
    input_producer,
    is_float,
    private,
    split_sizes,
)


# --------------------------------------------------------------------------------------------- merged operators
def _split_of(graph: Graph, node: gs.Node) -> tuple[int, tuple[int, ...]] | str:
    """(axis, sizes) of a Split into two or more static parts, or a reason."""
    info = split_sizes(graph, node)
    if info is None or len(info[1]) < 2:
        return "the Split's sizes are unknown or it has one part"
    moved = dynamic_axes(graph, node.inputs[0])
    if moved is None or moved[info[0]]:
        return "the split axis is dynamic"
    return info


def _slices(sizes) -> list[slice]:
    offsets = np.cumsum((0, *sizes))
    return [slice(int(a), int(b)) for a, b in zip(offsets[:-1], offsets[1:])]


def _part(array: np.ndarray, axis: int, piece: slice, full: int) -> np.ndarray:
    """`array[..., piece, ...]` along `axis` when that axis has the full length, else the array (it broadcasts)."""
    if array.ndim == 0 or array.shape[axis] != full:
        return array
    index = [slice(None)] * array.ndim
    index[axis] = piece
    return np.ascontiguousarray(array[tuple(index)])


class MatMulSplitUnmerge(Rule):
    """Replaces `Split(X.W (+ b))` along the last axis with one `X.W_i (+ b_i)` per part, W and b constants."""

    name = "matmul-split-unmerge"
    root_ops = ("Split",)

    def check(self, graph: Graph, node: gs.Node) -> Match | NoMatch:
        producer = input_producer(node, 0, ("MatMul", "Add"))
        if producer is None or not private(graph, node.inputs[0]):
            return self.no(node, "input is not a private MatMul (or Add of one)")
        nodes, side = [node], -1
        if producer.op == "Add":
            matmul = next((m for i in (0, 1) if (m := input_producer(producer, i, "MatMul")) is not None
                           and constant_input(producer, 1 - i) is not None), None)
            if matmul is None or not private(graph, matmul.outputs[0]):
                return self.no(node, "input is not a private MatMul (or Add of one)")
            side = 1 - list(producer.inputs).index(matmul.outputs[0])
            shape, bias = graph.shape(producer.outputs[0]), constant_input(producer, side)
            if shape is None or broadcast_shape(shape, bias.shape) != shape:
                return self.no(node, "the bias changes the product's shape")
            nodes.append(producer)
        else:
            matmul = producer
        weight = constant_input(matmul, 1)
        if weight is None or weight.ndim != 2 or not is_float(matmul.outputs[0]):
            return self.no(node, "the weights are not a constant float matrix")
        found = _split_of(graph, node)
        if isinstance(found, str):
            return self.no(node, found)
        axis, sizes = found
        if axis != len(graph.shape(node.inputs[0])) - 1:
            return self.no(node, "the Split is not along the last axis")
        return self.match([*nodes, matmul], side=side, sizes=sizes)

    def rewrite(self, graph: Graph, match: Match, nodes: dict[str, gs.Node]) -> None:
        split, matmul = nodes[match.root], nodes[match.nodes[-1]]
        weight, side = constant_input(matmul, 1), match.param("side")
        bias = constant_input(nodes[match.nodes[1]], side) if side >= 0 else None
        parts = []
        for k, piece in enumerate(_slices(match.param("sizes"))):
            w = graph.add_constant(np.ascontiguousarray(weight[:, piece]), f"{matmul.name}_W{k}")
            out = emit(graph, "MatMul", [matmul.inputs[0], w])
            if bias is not None:
                b = graph.add_constant(_part(bias, -1, piece, weight.shape[1]), f"{matmul.name}_b{k}")
                out = emit(graph, "Add", [out, b] if side == 1 else [b, out])
            parts.append(out)
        replace_all(graph, split.outputs, parts)


class _SplitUnmerge(Rule):
    """`Split(op(x, W, b))` along op's output channels, W and b constants: one op per part on slices of W and b."""

    root_ops = ("Split",)
    op = ""
    axis_name = ""

    def refuse(self, graph: Graph, producer: gs.Node) -> str | None:
        """A reason the producer cannot be split, or None."""
        return None

    def weight_axis(self, producer: gs.Node) -> int:
        """The axis of W that holds the output channels."""
        return 0

    def check(self, graph: Graph, node: gs.Node) -> Match | NoMatch:
        producer = input_producer(node, 0, self.op)
        if producer is None or not private(graph, node.inputs[0]):
            return self.no(node, f"input is not a private {self.op}")
        if constant_input(producer, 1) is None or (has_input(producer, 2) and constant_input(producer, 2) is None):
            return self.no(node, f"the {self.op}'s weights or bias are not constant")
        reason = self.refuse(graph, producer)
        found = _split_of(graph, node) if reason is None else reason
        if isinstance(found, str):
            return self.no(node, found)
        if found[0] != 1:
            return self.no(node, f"the Split is not along the {self.axis_name}")
        return self.match([node, producer], sizes=found[1])

    def rewrite(self, graph: Graph, match: Match, nodes: dict[str, gs.Node]) -> None:
        split, producer = nodes[match.nodes[0]], nodes[match.nodes[1]]
        weight = constant_input(producer, 1)
        bias = constant_input(producer, 2) if has_input(producer, 2) else None
        channels = sum(match.param("sizes"))
        parts = []
        for k, piece in enumerate(_slices(match.param("sizes"))):
            w = _part(weight, self.weight_axis(producer), piece, channels)
            inputs = [producer.inputs[0], graph.add_constant(w, f"{producer.name}_W{k}")]
            if bias is not None:
                inputs.append(graph.add_constant(_part(bias, -1, piece, channels), f"{producer.name}_B{k}"))
            parts.append(emit(graph, self.op, inputs, dict(producer.attrs)))
        replace_all(graph, split.outputs, parts)


class GemmSplitUnmerge(_SplitUnmerge):
    """Replaces `Split(Gemm(A, B, C))` along the columns with one `Gemm(A, B_i, C_i)` per part, B and C constants."""

    name = "gemm-split-unmerge"
    op = "Gemm"
    axis_name = "columns"

    def weight_axis(self, producer: gs.Node) -> int:
        return 0 if producer.attrs.get("transB", 0) else 1


class ConvSplitUnmerge(_SplitUnmerge):
    """Replaces `Split(Conv(x, W, b))` along the channels with one `Conv(x, W_i, b_i)` per part, W and b constants."""

    name = "conv-split-unmerge"
    op = "Conv"
    axis_name = "channels"

    def refuse(self, graph: Graph, producer: gs.Node) -> str | None:
        params = conv_params(graph, producer)
        return "the Conv is grouped or its geometry unknown" if params is None or params["group"] != 1 else None


class GemmReshapeToMatMul(Rule):
    """Replaces `Reshape(Gemm(Reshape(X, [-1, K]), W, b), [..., N])` with `Add(MatMul(X, W), b)` for X of rank 3+."""

    name = "gemm-reshape-to-matmul"
    root_ops = ("Reshape",)

    def check(self, graph: Graph, node: gs.Node) -> Match | NoMatch:
        gemm = input_producer(node, 0, "Gemm")
        if gemm is None or not private(graph, node.inputs[0]):
            return self.no(node, "input is not a private Gemm")
        rows = input_producer(gemm, 0, "Reshape")
        if rows is None or not private(graph, gemm.inputs[0]):
            return self.no(node, "the Gemm's A is not a private Reshape")
        bias = constant_input(gemm, 2) if has_input(gemm, 2) else np.zeros(1, np.float32)
        if gemm.attrs.get("transA", 0) or constant_input(gemm, 1) is None or bias is None or (
                bias.ndim == 2 and bias.shape[0] != 1):
            return self.no(node, "transA is set, B is not constant, or C is not a constant row vector")
        x, out = rows.inputs[0], node.outputs[0]
        shapes = [graph.shape(t) for t in (x, gemm.inputs[0], gemm.outputs[0], out)]
        if any(s is None for s in shapes) or len(shapes[0]) < 3 or not is_float(out):
            return self.no(node, "shapes unknown, not float, or X below rank 3")
        x_shape, a_shape, y_shape, out_shape = shapes
        if a_shape[1] != x_shape[-1] or out_shape != (*x_shape[:-1], y_shape[1]):
            return self.no(node, "the Reshapes do not flatten X's leading dimensions and restore them")
        moved_x, moved_out = dynamic_axes(graph, x), dynamic_axes(graph, out)
        if moved_x is None or moved_x[-1] or moved_out != (*moved_x[:-1], False):
            return self.no(node, "the output does not follow X's dynamic dimensions")
        return self.match([node, gemm, rows])

    def rewrite(self, graph: Graph, match: Match, nodes: dict[str, gs.Node]) -> None:
        node, gemm, rows = (nodes[n] for n in match.nodes)
        out = emit(graph, "MatMul", [rows.inputs[0], gemm_weight(graph, gemm)])
        if has_input(gemm, 2):
            bias = constant_input(gemm, 2)
            out = emit(graph, "Add", [out, gemm_bias(graph, gemm, (bias.size,))])
        graph.replace_uses(node.outputs[0], out)
