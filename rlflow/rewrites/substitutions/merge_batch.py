"""Batching rules: the same operator with the same weights applied to several inputs becomes one operator on their
concatenation, then a Split (fewer, larger kernels: what a GPU prefers)."""
from __future__ import annotations

import onnx_graphsurgeon as gs

from rlflow.graph.core import Graph
from rlflow.graph.dynamic_axes import dynamic_axes
from rlflow.rewrites.base import Match, NoMatch, Rule
from rlflow.rewrites.edits import emit
from rlflow.rewrites.substitutions.merge import lead, same_shapes, siblings, split_into


class _BatchSharedWeight(Rule):
    """The same operator with the same weights on several inputs of one shape: one operator on their concatenation
    along `axis` (from the end for MatMul rows, batch for Conv), then a Split."""

    def axis(self, rank: int) -> int:
        raise NotImplementedError

    def _fits(self, node: gs.Node, ref: gs.Node) -> bool:
        return (node.op == ref.op and len(node.inputs) == len(ref.inputs) and node.attrs == ref.attrs
                and all(a is b for a, b in zip(node.inputs[1:], ref.inputs[1:])))

    def check(self, graph: Graph, node: gs.Node) -> Match | NoMatch:
        if len(node.inputs) < 2 or Graph.constant(node.inputs[1]) is None:
            return self.no(node, "the weights are not constant")
        shape = graph.shape(node.inputs[0])
        if shape is None or len(shape) < 2:
            return self.no(node, "input rank unknown or below 2")
        axis = self.axis(len(shape))
        group = siblings(node.inputs[1], lambda n: self._fits(n, node) and n.inputs[1] is node.inputs[1]
                          and same_shapes(graph, [n.inputs[0], node.inputs[0]], except_axis=axis))
        if len(group) < 2 or len({id(n.inputs[0]) for n in group}) != len(group):
            return self.no(node, "no other node applies the same weights to another input of the same shape")
        if not lead(node, group):
            return self.no(node, "another node leads this group")
        if _chained(group):
            return self.no(node, "one node's input is computed from another's output (weights shared by layers "
                                 "in sequence): their concatenation would be a cycle")
        if any(dynamic is None or dynamic[axis] for dynamic in (dynamic_axes(graph, n.inputs[0]) for n in group)):
            return self.no(node, "the batching axis is dynamic")
        return self.match(group)

    def rewrite(self, graph: Graph, match: Match, nodes: dict[str, gs.Node]) -> None:
        group = [nodes[n] for n in match.nodes]
        shape = graph.shape(group[0].inputs[0])
        axis = self.axis(len(shape))
        joined = emit(graph, "Concat", [n.inputs[0] for n in group], {"axis": axis})
        (merged,) = graph.add_node(group[0].op, [joined, *group[0].inputs[1:]], attrs=dict(group[0].attrs))
        out_axis = self.axis(len(graph.shape(group[0].outputs[0])))
        split_into(graph, merged, group, out_axis, [graph.shape(n.outputs[0])[out_axis] for n in group])


def _chained(group: list[gs.Node]) -> bool:
    """Whether some node of `group` reads, through any path, what another computes (ALBERT's layers apply one set of
    weights in sequence).  One walk up from all their inputs: a graph has no cycle, so a node met is another's."""
    members = {id(n) for n in group}
    seen: set[int] = set()
    stack = [n.inputs[0] for n in group]
    while stack:
        tensor = stack.pop()
        if id(tensor) in seen:
            continue
        seen.add(id(tensor))
        for producer in tensor.inputs:  # gs: a tensor's inputs are the node that makes it
            if id(producer) in members:
                return True
            stack.extend(producer.inputs)
    return False


class MatMulBatchSharedWeight(_BatchSharedWeight):
    """Replaces `a.W, b.W, ...` with `Split(Concat(a, b, ...).W)` along rows."""

    name = "matmul-batch-shared-weight"
    root_ops = ("MatMul",)

    def axis(self, rank: int) -> int:
        return rank - 2


class ConvBatchSharedWeight(_BatchSharedWeight):
    """Replaces `Conv(a, W), Conv(b, W), ...` with `Split(Conv(Concat(a, b, ...), W))` along the batch axis."""

    name = "conv-batch-shared-weight"
    root_ops = ("Conv",)

    def axis(self, rank: int) -> int:
        return 0
