"""Algebra on elementwise operators: commuted with Concat and Split, and scalar scales moved through layout operators
and MatMuls toward the weights that can absorb them."""
from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs

from rlflow.graph.core import Graph
from rlflow.graph.dynamic_axes import dynamic_axes
from rlflow.rewrites.base import Match, NoMatch, Rule
from rlflow.rewrites.edits import clone_node, combine, emit
from rlflow.rewrites.queries import (
    BINARY_ELEMENTWISE,
    UNARY_ELEMENTWISE,
    broadcast_shape,
    constant_input,
    is_float,
    is_standard,
    private,
    private_producer,
    same_op,
    split_sizes,
    to_rank,
)

_LAYOUT = ("Transpose", "Reshape", "Squeeze", "Unsqueeze", "Flatten")


def _concat_producers(graph: Graph, node: gs.Node, ops) -> list[gs.Node] | None:
    """The private producers of every input of a Concat of two or more, when all are among `ops`."""
    producers = [private_producer(graph, node, i, tuple(ops)) for i in range(len(node.inputs))]
    return producers if len(producers) >= 2 and all(p is not None for p in producers) else None


class ConcatUnaryCommute(Rule):
    """Replaces `Concat(f(a), f(b), ...)` with `f(Concat(a, b, ...))` for an elementwise f."""

    name = "concat-unary-commute"
    root_ops = ("Concat",)

    def check(self, graph: Graph, node: gs.Node) -> Match | NoMatch:
        producers = _concat_producers(graph, node, UNARY_ELEMENTWISE)
        if producers is None:
            return self.no(node, "not every input is a private elementwise operator")
        if not all(same_op(p, producers[0]) and len(p.inputs) == 1 for p in producers):
            return self.no(node, "the inputs come from different operators or attributes")
        return self.match([node, *producers])

    def rewrite(self, graph: Graph, match: Match, nodes: dict[str, gs.Node]) -> None:
        node, *producers = (nodes[n] for n in match.nodes)
        joined = emit(graph, "Concat", [p.inputs[0] for p in producers], dict(node.attrs))
        graph.replace_uses(node.outputs[0], clone_node(graph, producers[0], [joined])[0])


class ConcatBinaryCommute(Rule):
    """Replaces `Concat(f(a1, b1), f(a2, b2))` with `f(Concat(a1, a2), Concat(b1, b2))` for an elementwise f.

    Only where no operand broadcasts.
    """

    name = "concat-binary-commute"
    root_ops = ("Concat",)

    def check(self, graph: Graph, node: gs.Node) -> Match | NoMatch:
        producers = _concat_producers(graph, node, BINARY_ELEMENTWISE)
        if producers is None:
            return self.no(node, "not every input is a private elementwise binary operator")
        if not all(same_op(p, producers[0]) for p in producers):
            return self.no(node, "the inputs come from different operators")
        for p in producers:
            out = graph.shape(p.outputs[0])
            if out is None or any(graph.shape(t) != out for t in p.inputs):
                return self.no(node, "an operator broadcasts (operand shapes differ from its result)")
        return self.match([node, *producers])

    def rewrite(self, graph: Graph, match: Match, nodes: dict[str, gs.Node]) -> None:
        node, *producers = (nodes[n] for n in match.nodes)
        sides = [emit(graph, "Concat", [p.inputs[k] for p in producers], dict(node.attrs)) for k in (0, 1)]
        graph.replace_uses(node.outputs[0], clone_node(graph, producers[0], sides)[0])


def _split_readers(graph: Graph, node: gs.Node, ops) -> list[gs.Node] | None:
    readers = []
    for out in node.outputs:
        if not private(graph, out) or out.outputs[0].op not in ops or not is_standard(out.outputs[0]):
            return None
        readers.append(out.outputs[0])
    return readers


class SplitUnaryHoist(Rule):
    """Replaces `f(p1), ..., f(pn)` on every part of `Split(x)` with the parts of `Split(f(x))`."""

    name = "split-unary-hoist"
    root_ops = ("Split",)

    def check(self, graph: Graph, node: gs.Node) -> Match | NoMatch:
        readers = _split_readers(graph, node, UNARY_ELEMENTWISE)
        if readers is None or len(readers) < 2:
            return self.no(node, "not every part is read by one elementwise operator alone")
        if not all(same_op(r, readers[0]) and len(r.inputs) == 1 for r in readers):
            return self.no(node, "the parts are read by different operators or attributes")
        return self.match([node, *readers])

    def rewrite(self, graph: Graph, match: Match, nodes: dict[str, gs.Node]) -> None:
        split, *readers = (nodes[n] for n in match.nodes)
        (whole,) = clone_node(graph, readers[0], [split.inputs[0]])
        parts = clone_node(graph, split, [whole, *split.inputs[1:]], len(split.outputs))
        for reader, part in zip(readers, parts):
            graph.replace_uses(reader.outputs[0], part)


class SplitBinaryHoist(Rule):
    """Replaces `f(p_i, c_i)` on every part p_i of `Split(x)` (c_i constants) with the parts of `Split(f(x, C))`.

    C joins the c_i along the split axis: the bias or scale after merged Q/K/V projections.
    """

    name = "split-binary-hoist"
    root_ops = ("Split",)

    def check(self, graph: Graph, node: gs.Node) -> Match | NoMatch:
        readers = _split_readers(graph, node, ("Add", "Sub", "Mul", "Div"))
        info = split_sizes(graph, node)
        if readers is None or len(readers) < 2 or info is None:
            return self.no(node, "not every part is read by one elementwise binary operator alone")
        if not all(same_op(r, readers[0]) for r in readers):
            return self.no(node, "the parts are read by different operators")
        sides = set()
        for part, reader in zip(node.outputs, readers):
            side = 0 if reader.inputs[0] is part else 1
            sides.add(side)
            value = constant_input(reader, 1 - side)
            if value is None or reader.inputs[side] is not part:
                return self.no(node, "a part's other operand is not a constant")
            if graph.shape(reader.outputs[0]) != graph.shape(part) or value.ndim > len(graph.shape(part)):
                return self.no(node, "a constant broadcasts a part to a larger shape")
        if len(sides) != 1:
            return self.no(node, "the parts sit on different sides of the operators")
        (side,), axis = sides, info[0]
        values = [to_rank(constant_input(r, 1 - side), len(graph.shape(node.inputs[0]))) for r in readers]
        if any(v.dtype != values[0].dtype for v in values):
            return self.no(node, "the constants differ in type")
        uniform = all(v.shape[axis] == 1 and v.shape == values[0].shape and np.array_equal(v, values[0]) for v in values)
        dynamic = dynamic_axes(graph, node.inputs[0])
        if not uniform and (dynamic is None or dynamic[axis]):
            return self.no(node, "the split axis is dynamic")
        return self.match([node, *readers], side=side, uniform=uniform)

    def rewrite(self, graph: Graph, match: Match, nodes: dict[str, gs.Node]) -> None:
        split, *readers = (nodes[n] for n in match.nodes)
        side = match.param("side")
        axis, sizes = split_sizes(graph, split)
        rank = len(graph.shape(split.inputs[0]))
        values = [to_rank(constant_input(r, 1 - side), rank) for r in readers]
        if match.param("uniform"):
            joined = values[0]
        else:
            pieces = []
            for value, size in zip(values, sizes):
                shape = [max(v.shape[d] for v in values) if d != axis else size for d in range(rank)]
                pieces.append(np.broadcast_to(value, shape))
            joined = np.concatenate(pieces, axis=axis)
        constant = graph.add_constant(np.ascontiguousarray(joined), f"{split.name}_{readers[0].op.lower()}")
        operands = [split.inputs[0], constant] if side == 0 else [constant, split.inputs[0]]
        (whole,) = clone_node(graph, readers[0], operands)
        parts = clone_node(graph, split, [whole, *split.inputs[1:]], len(split.outputs))
        for reader, part in zip(readers, parts):
            graph.replace_uses(reader.outputs[0], part)


def _scalar_operand(graph: Graph, node: gs.Node, side: int) -> np.ndarray | None:
    """The constant operand at `side` when it has one element and leaves the other operand's shape unchanged."""
    value = constant_input(node, side)
    if value is None or value.size != 1 or not is_float(node.outputs[0]):
        return None
    if graph.shape(node.outputs[0]) is None or graph.shape(node.outputs[0]) != graph.shape(node.inputs[1 - side]):
        return None
    return value


class ScalarMulHoist(Rule):
    """Replaces `Mul(A.B, s)` (or `Div`) for a scalar s with `(A*s).B` or `A.(B*s)`.

    The smaller operand is scaled: the attention scale applied to Q rather than to the scores.
    """

    name = "scalar-mul-hoist"
    root_ops = ("Mul", "Div")

    def check(self, graph: Graph, node: gs.Node) -> Match | NoMatch:
        for side in ((1, 0) if node.op == "Mul" else (1,)):
            matmul = private_producer(graph, node, 1 - side, "MatMul")
            if matmul is None or _scalar_operand(graph, node, side) is None:
                continue
            sizes = [graph.shape(t) for t in matmul.inputs]
            if any(s is None for s in sizes):
                return self.no(node, "operand shapes unknown")
            counts = [int(np.prod(s)) for s in sizes]
            target = int(np.argmin(counts))
            if counts[target] >= int(np.prod(graph.shape(node.outputs[0]))):
                return self.no(node, "scaling an operand costs no less than scaling the product")
            return self.match([node, matmul], side=side, target=target)
        return self.no(node, "not a private MatMul scaled by a scalar constant")

    def rewrite(self, graph: Graph, match: Match, nodes: dict[str, gs.Node]) -> None:
        node, matmul = nodes[match.nodes[0]], nodes[match.nodes[1]]
        target = match.param("target")
        value = constant_input(node, match.param("side")).reshape(())
        operands = list(matmul.inputs)
        scale = graph.add_constant(value.copy(), f"{node.name}_scale")
        operands[target] = combine(graph, node.op, operands[target], scale, hint=f"{matmul.name}_scaled")
        graph.replace_uses(node.outputs[0], emit(graph, "MatMul", operands))


class ScalarMulThroughLayout(Rule):
    """Replaces `Mul(L(x), s)` (or `Div`) for a scalar s and a layout operator L with `L(Mul(x, s))`.

    L is a Transpose, Reshape, Squeeze, Unsqueeze or Flatten; the scale moves toward weights that can absorb it.
    """

    name = "scalar-mul-through-layout"
    root_ops = ("Mul", "Div")

    def check(self, graph: Graph, node: gs.Node) -> Match | NoMatch:
        for side in ((1, 0) if node.op == "Mul" else (1,)):
            layout = private_producer(graph, node, 1 - side, _LAYOUT)
            if layout is not None and _scalar_operand(graph, node, side) is not None:
                return self.match([node, layout], side=side)
        return self.no(node, "not a private layout operator scaled by a scalar constant")

    def rewrite(self, graph: Graph, match: Match, nodes: dict[str, gs.Node]) -> None:
        node, layout = nodes[match.nodes[0]], nodes[match.nodes[1]]
        side = match.param("side")
        scale = graph.add_constant(constant_input(node, side).reshape(()).copy(), f"{node.name}_scale")
        operands = [layout.inputs[0], scale] if side == 1 else [scale, layout.inputs[0]]
        scaled = emit(graph, node.op, operands)
        graph.replace_uses(node.outputs[0], clone_node(graph, layout, [scaled, *layout.inputs[1:]])[0])


class MulAddDistribute(Rule):
    """Replaces `Mul(Add(x, b), s)` (or `Div`) with b and s constants by `Add(Mul(x, s), b*s)`."""

    name = "mul-add-distribute"
    root_ops = ("Mul", "Div")

    def check(self, graph: Graph, node: gs.Node) -> Match | NoMatch:
        for side in ((1, 0) if node.op == "Mul" else (1,)):
            add = private_producer(graph, node, 1 - side, "Add")
            if add is None or constant_input(node, side) is None:
                continue
            if not is_float(node.outputs[0]):
                return self.no(node, "not a float tensor")
            for bias in (1, 0):
                if constant_input(add, bias) is not None and constant_input(add, 1 - bias) is None:
                    x, s = graph.shape(add.inputs[1 - bias]), constant_input(node, side).shape
                    if broadcast_shape(x, s) is None:
                        return self.no(node, "shapes unknown")
                    return self.match([node, add], side=side, bias=bias)
            return self.no(node, "the Add has no constant operand")
        return self.no(node, "not a private Add scaled by a constant")

    def rewrite(self, graph: Graph, match: Match, nodes: dict[str, gs.Node]) -> None:
        node, add = nodes[match.nodes[0]], nodes[match.nodes[1]]
        side, bias = match.param("side"), match.param("bias")
        scale, x, b = node.inputs[side], add.inputs[1 - bias], add.inputs[bias]
        pair = (lambda u, v: [u, v]) if side == 1 else (lambda u, v: [v, u])
        scaled = emit(graph, node.op, pair(x, scale))
        new_bias = combine(graph, node.op, *pair(b, scale), hint=f"{add.name}_bias")
        graph.replace_uses(node.outputs[0], emit(graph, "Add", [scaled, new_bias]))
