"""Layout rules: transposes, reshapes, concatenations and splits that can cancel or move."""
from __future__ import annotations

import onnx_graphsurgeon as gs

from rlflow.graph import Graph
from rlflow.rewrites.base import Match, NoMatch, Rule
from rlflow.rewrites.util import input_producer


def _perm(node: gs.Node, rank: int | None) -> tuple[int, ...] | None:
    perm = node.attrs.get("perm")
    if perm is not None:
        return tuple(int(p) for p in perm)
    return tuple(reversed(range(rank))) if rank is not None else None


class TransposeTranspose(Rule):
    """Replaces `Transpose(Transpose(x, p), q)` with one `Transpose(x, p.q)`, or with `x` when they cancel."""

    name = "transpose-transpose"
    category = "layout"
    root_ops = ("Transpose",)

    def check(self, graph: Graph, node: gs.Node) -> Match | NoMatch:
        inner = input_producer(node, 0, "Transpose")
        if inner is None:
            return self.no(node, "input is not produced by a Transpose")
        shape = graph.shape(inner.inputs[0])
        p, q = _perm(inner, len(shape) if shape else None), _perm(node, len(shape) if shape else None)
        if p is None or q is None:
            return self.no(node, "permutation unknown (no perm and no static rank)")
        return self.match([node, inner], perm=tuple(p[i] for i in q))

    def rewrite(self, graph: Graph, match: Match, nodes: dict[str, gs.Node]) -> None:
        outer, inner = nodes[match.nodes[0]], nodes[match.nodes[1]]
        perm = match.param("perm")
        source = inner.inputs[0]
        if perm == tuple(range(len(perm))):
            graph.replace_uses(outer.outputs[0], source)
        else:
            (out,) = graph.add_node("Transpose", [source], attrs={"perm": list(perm)})
            graph.replace_uses(outer.outputs[0], out)
