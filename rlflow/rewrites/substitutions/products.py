"""Algebra on products: MatMul associativity (the order with fewer FLOPs, constant chains folded), sums of products
factored, and transposed products."""
from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs

from rlflow.graph.core import Graph
from rlflow.rewrites.base import Match, NoMatch, Rule
from rlflow.rewrites.edits import combine, emit
from rlflow.rewrites.queries import (
    broadcast_shape,
    constant_input,
    input_producer,
    is_float,
    matmul_flops,
    matmul_result,
    matmul_shapes,
    perm_of,
    private_producer,
    standard_producer,
)


class MatMulAssoc(Rule):
    """Replaces `(A.B).C` with `A.(B.C)`, or the reverse, when the other order needs fewer FLOPs."""

    name = "matmul-assoc"
    root_ops = ("MatMul",)

    def check(self, graph: Graph, node: gs.Node) -> Match | NoMatch:
        found = False
        for side in (0, 1):
            inner = private_producer(graph, node, side, "MatMul")
            if inner is None:
                continue
            found = True
            if side == 0:
                shapes = [graph.shape(inner.inputs[0]), graph.shape(inner.inputs[1]), graph.shape(node.inputs[1])]
            else:
                shapes = [graph.shape(node.inputs[0]), graph.shape(inner.inputs[0]), graph.shape(inner.inputs[1])]
            if any(s is None or len(s) < 2 for s in shapes):
                continue
            a, b, c = shapes
            ab, bc = matmul_result(a, b), matmul_result(b, c)
            if ab is None or bc is None:
                continue
            left = matmul_flops(a, b) + matmul_flops(ab, c)
            right = matmul_flops(b, c) + matmul_flops(a, bc)
            if (right < left) if side == 0 else (left < right):
                return self.match([node, inner], side=side)
        if not found:
            return self.no(node, "no input is a private MatMul")
        return self.no(node, "the other order needs no fewer FLOPs (or shapes are unknown)")

    def rewrite(self, graph: Graph, match: Match, nodes: dict[str, gs.Node]) -> None:
        node, inner = nodes[match.nodes[0]], nodes[match.nodes[1]]
        if match.param("side") == 0:
            (a, b), c = inner.inputs, node.inputs[1]
            out = emit(graph, "MatMul", [a, emit(graph, "MatMul", [b, c])])
        else:
            a, (b, c) = node.inputs[0], inner.inputs
            out = emit(graph, "MatMul", [emit(graph, "MatMul", [a, b]), c])
        graph.replace_uses(node.outputs[0], out)


class MatMulConstChainFold(Rule):
    """Replaces `(X.B).C` with `X.(BC)` (and `C.(B.X)` with `(CB).X`) where B and C are constants."""

    name = "matmul-const-chain-fold"
    root_ops = ("MatMul",)

    def check(self, graph: Graph, node: gs.Node) -> Match | NoMatch:
        for side in (0, 1):
            inner = private_producer(graph, node, side, "MatMul")
            if inner is None or constant_input(node, 1 - side) is None or constant_input(inner, 1 - side) is None:
                continue
            b, c = constant_input(inner, 1 - side), constant_input(node, 1 - side)
            if b.ndim < 2 or c.ndim < 2 or b.dtype != c.dtype or not is_float(node.outputs[0]):
                return self.no(node, "the constants are not float matrices of one type")
            first, second = (b, c) if side == 0 else (c, b)
            if matmul_result(first.shape, second.shape) is None:
                return self.no(node, "the constants' shapes do not fit")
            if first.shape[-1] * (first.shape[-2] + second.shape[-1]) < first.shape[-2] * second.shape[-1]:
                return self.no(node, "folding a low-rank chain would add FLOPs")
            return self.match([node, inner], side=side)
        return self.no(node, "not a chain of a private MatMul and two constant operands")

    def rewrite(self, graph: Graph, match: Match, nodes: dict[str, gs.Node]) -> None:
        node, inner = nodes[match.nodes[0]], nodes[match.nodes[1]]
        side = match.param("side")
        b, c = inner.inputs[1 - side], node.inputs[1 - side]
        folded = combine(graph, "MatMul", *((b, c) if side == 0 else (c, b)), hint=f"{node.name}_W")
        inputs = [inner.inputs[side], folded] if side == 0 else [folded, inner.inputs[side]]
        graph.replace_uses(node.outputs[0], emit(graph, "MatMul", inputs))


class _MatMulFactor(Rule):
    """`Add(MatMul(., .), MatMul(., .))` sharing the operand at `shared`: one MatMul of the summed other operands."""

    shared: int = 0

    def check(self, graph: Graph, node: gs.Node) -> Match | NoMatch:
        left, right = (private_producer(graph, node, i, "MatMul") for i in (0, 1))
        if left is None or right is None or left is right:
            return self.no(node, "the Add's inputs are not two private MatMuls")
        if left.inputs[self.shared] is not right.inputs[self.shared]:
            return self.no(node, "the MatMuls share no operand on that side")
        other = 1 - self.shared
        shapes = [graph.shape(t) for t in (left.inputs[other], right.inputs[other], node.outputs[0],
                                           left.outputs[0], right.outputs[0])]
        if any(s is None for s in shapes) or shapes[0] != shapes[1] or not shapes[2] == shapes[3] == shapes[4]:
            return self.no(node, "the other operands (or the products) differ in shape")
        return self.match([node, left, right])

    def rewrite(self, graph: Graph, match: Match, nodes: dict[str, gs.Node]) -> None:
        node, left, right = (nodes[n] for n in match.nodes)
        other = 1 - self.shared
        total = combine(graph, "Add", left.inputs[other], right.inputs[other], hint=f"{node.name}_sum")
        inputs = [left.inputs[0], total] if self.shared == 0 else [total, left.inputs[1]]
        graph.replace_uses(node.outputs[0], emit(graph, "MatMul", inputs))


class MatMulFactorLhs(_MatMulFactor):
    """Replaces `X.W1 + X.W2` with `X.(W1 + W2)`."""

    name = "matmul-factor-lhs"
    root_ops = ("Add",)
    shared = 0


class MatMulFactorRhs(_MatMulFactor):
    """Replaces `A.W + B.W` with `(A + B).W`."""

    name = "matmul-factor-rhs"
    root_ops = ("Add",)
    shared = 1


class MulFactor(Rule):
    """Replaces `a*b + a*c` with `a*(b + c)`."""

    name = "mul-factor"
    root_ops = ("Add",)

    def check(self, graph: Graph, node: gs.Node) -> Match | NoMatch:
        left, right = (private_producer(graph, node, i, "Mul") for i in (0, 1))
        if left is None or right is None or left is right:
            return self.no(node, "the Add's inputs are not two private Muls")
        if not is_float(node.outputs[0]):
            return self.no(node, "not a float tensor")
        for i in (0, 1):
            for j in (0, 1):
                if left.inputs[i] is right.inputs[j]:
                    a, b, c = left.inputs[i], left.inputs[1 - i], right.inputs[1 - j]
                    shape = broadcast_shape(graph.shape(a), broadcast_shape(graph.shape(b), graph.shape(c)))
                    if shape is None or shape != graph.shape(node.outputs[0]):
                        return self.no(node, "the factored form broadcasts to another shape")
                    return self.match([node, left, right], left=i, right=j)
        return self.no(node, "the Muls share no operand")

    def rewrite(self, graph: Graph, match: Match, nodes: dict[str, gs.Node]) -> None:
        node, left, right = (nodes[n] for n in match.nodes)
        i, j = match.param("left"), match.param("right")
        total = combine(graph, "Add", left.inputs[1 - i], right.inputs[1 - j], hint=f"{node.name}_sum")
        graph.replace_uses(node.outputs[0], emit(graph, "Mul", [left.inputs[i], total]))


def _swaps_last_two(perm: tuple[int, ...] | None) -> bool:
    return perm is not None and len(perm) >= 2 and perm == (*range(len(perm) - 2), len(perm) - 1, len(perm) - 2)


def _transposed(graph: Graph, tensor: gs.Tensor) -> gs.Tensor:
    """`tensor` with its last two axes swapped: a new constant when it is one, else a Transpose node."""
    value = Graph.constant(tensor)
    rank = len(graph.shape(tensor))
    perm = [*range(rank - 2), rank - 1, rank - 2]
    if value is not None:
        return graph.add_constant(np.ascontiguousarray(np.transpose(value, perm)), f"{tensor.name}_T")
    producer = standard_producer(tensor)
    if producer is not None and producer.op == "Transpose" and perm_of(producer, rank) == tuple(perm):
        return producer.inputs[0]
    return emit(graph, "Transpose", [tensor], {"perm": perm})


class TransposeMatMul(Rule):
    """Replaces `Transpose(A.B)` (last two axes swapped) with `B^T.A^T`.

    Only where a constant or transposed operand absorbs its transpose.
    """

    name = "transpose-matmul"
    root_ops = ("Transpose",)

    def check(self, graph: Graph, node: gs.Node) -> Match | NoMatch:
        matmul = private_producer(graph, node, 0, "MatMul")
        if matmul is None:
            return self.no(node, "input is not a private MatMul")
        shapes = matmul_shapes(graph, matmul)
        out = graph.shape(node.outputs[0])
        if shapes is None or out is None or not len(shapes[0]) == len(shapes[1]) == len(out):
            return self.no(node, "operands of different or unknown ranks")
        if not _swaps_last_two(perm_of(node, len(out))):
            return self.no(node, "the Transpose does not swap the last two axes only")
        absorbs = [Graph.constant(t) is not None or (input_producer(matmul, i, "Transpose") is not None and _swaps_last_two(
            perm_of(input_producer(matmul, i), len(out)))) for i, t in enumerate(matmul.inputs)]
        if not any(absorbs):
            return self.no(node, "neither operand is a constant or a transpose (the rewrite would add a Transpose)")
        return self.match([node, matmul])

    def rewrite(self, graph: Graph, match: Match, nodes: dict[str, gs.Node]) -> None:
        node, matmul = nodes[match.nodes[0]], nodes[match.nodes[1]]
        a, b = matmul.inputs
        graph.replace_uses(node.outputs[0], emit(graph, "MatMul", [_transposed(graph, b), _transposed(graph, a)]))


class MatMulTransposeFactor(Rule):
    """Replaces `A^T.B^T` (last two axes swapped) with `Transpose(B.A)`."""

    name = "matmul-transpose-factor"
    root_ops = ("MatMul",)

    def check(self, graph: Graph, node: gs.Node) -> Match | NoMatch:
        shapes = matmul_shapes(graph, node)
        if shapes is None or len(shapes[0]) != len(shapes[1]):
            return self.no(node, "operands of different or unknown ranks")
        rank = len(shapes[0])
        ts = [private_producer(graph, node, i, "Transpose") for i in (0, 1)]
        if any(t is None or not _swaps_last_two(perm_of(t, rank)) for t in ts) or ts[0] is ts[1]:
            return self.no(node, "the operands are not both private transposes of their last two axes")
        return self.match([node, *ts])

    def rewrite(self, graph: Graph, match: Match, nodes: dict[str, gs.Node]) -> None:
        node, ta, tb = (nodes[n] for n in match.nodes)
        rank = len(graph.shape(node.outputs[0]))
        product = emit(graph, "MatMul", [tb.inputs[0], ta.inputs[0]])
        graph.replace_uses(node.outputs[0], emit(graph, "Transpose", [product],
                                                 {"perm": [*range(rank - 2), rank - 1, rank - 2]}))
