"""Packed-QKV attention: MultiHeadAttention on three projections of one input into onnxruntime's Attention, which
computes Q, K and V with one matrix product."""
from __future__ import annotations

from typing import NamedTuple

import numpy as np
import onnx_graphsurgeon as gs

from rlflow.graph.core import Graph
from rlflow.rewrites.base import Match, NoMatch, Rule
from rlflow.rewrites.edits import emit, replace_typed
from rlflow.rewrites.queries import MS, bias_side, constant_input, is_float, private_producer, standard_producer


class _Projection(NamedTuple):
    """`Add(MatMul(x, W), b)` or `MatMul(x, W)`."""

    x: gs.Tensor
    weights: np.ndarray
    bias: np.ndarray | None
    nodes: list[gs.Node]  # the Add (when there is a bias) and the MatMul
    side: int | None  # the Add's input holding b


def _projection(graph: Graph, tensor: gs.Tensor) -> _Projection | None:
    """`Add(MatMul(x, W), b)` or `MatMul(x, W)` writing `tensor`, private, with W a constant float32 matrix and b a
    constant vector over its columns."""
    producer = standard_producer(tensor)
    if producer is None or graph.is_output(tensor) or len(tensor.outputs) != 1:
        return None
    nodes, bias, side = [], None, None
    if producer.op == "Add":
        side = bias_side(graph, producer)
        matmul = None if side is None else private_producer(graph, producer, 1 - side, "MatMul")
        if matmul is None:
            return None
        nodes, bias, producer = [producer], constant_input(producer, side), matmul
    if producer.op != "MatMul":
        return None
    weights = constant_input(producer, 1)
    if weights is None or weights.ndim != 2 or weights.dtype != np.float32:
        return None
    return _Projection(producer.inputs[0], weights, bias, [*nodes, producer], side)


def _projections(match: Match, nodes: dict[str, gs.Node]) -> list[tuple[gs.Tensor, np.ndarray, np.ndarray | None]]:
    """(x, W, b or None) of the Q, K and V projections of a match, from its nodes (an Add before a MatMul where the
    match's `biases` give the side of b)."""
    found, at = [], 1
    for side in match.param("biases"):
        add = nodes[match.nodes[at]] if side is not None else None
        at += add is not None
        matmul = nodes[match.nodes[at]]
        at += 1
        bias = constant_input(add, side) if add is not None else None
        found.append((matmul.inputs[0], constant_input(matmul, 1), bias))
    return found


class AttentionPackQkv(Rule):
    """Replaces `MultiHeadAttention(x.Wq + bq, x.Wk + bk, x.Wv + bv)` with onnxruntime's packed `Attention(x, W, b)`.

        x --+--> MatMul(., Wq) --> [Add(., bq)] --+
            +--> MatMul(., Wk) --> [Add(., bk)] --+--> MultiHeadAttention(q, k, v, [attention_bias])
            +--> MatMul(., Wv) --> [Add(., bv)] --+

    No exporter writes MultiHeadAttention: this is `attention-fusion`'s output on self-attention, where Q, K and V are
    projections of one input (both torch exporters write each `nn.Linear` on a 3-D input as MatMul + Add).  One matrix
    product then computes Q, K and V, and the biases go into the fused operator; an `attention_bias` (the additive
    mask) carries over."""

    name = "attention-pack-qkv"
    root_ops = ("MultiHeadAttention",)
    contrib = True
    domains = (MS,)

    def _pattern(self, graph: Graph, node: gs.Node):
        present = [i for i, t in enumerate(node.inputs) if t.name]
        if present not in ([0, 1, 2], [0, 1, 2, 5]) or node.attrs.get("unidirectional", 0):
            return "it takes more than Q, K, V and an attention bias (a bias, key padding mask or past state)"
        projections = [_projection(graph, t) for t in node.inputs[:3]]
        if any(p is None for p in projections):
            return "Q, K or V is not a private MatMul (+ bias) of constant weights"
        x = projections[0][0]
        if any(p[0] is not x for p in projections) or len({p[1].shape for p in projections}) != 1:
            return "Q, K and V are not projections of one input to one width"
        if not is_float(x) or np.dtype(x.dtype) != np.float32 or (graph.shape(x) or (0,))[-1] != projections[0][1].shape[0]:
            return "the input is not float32 [.., hidden]"
        return projections

    def check(self, graph: Graph, node: gs.Node) -> Match | NoMatch:
        found = self._pattern(graph, node)
        if isinstance(found, str):
            return self.no(node, found)
        return self.match([node, *(n for p in found for n in p.nodes)], biases=tuple(p.side for p in found))

    def rewrite(self, graph: Graph, match: Match, nodes: dict[str, gs.Node]) -> None:
        node = nodes[match.root]
        projections = _projections(match, nodes)
        width = projections[0][1].shape[1]
        weights = np.concatenate([p[1] for p in projections], axis=1)
        bias = np.concatenate([p[2] if p[2] is not None else np.zeros(width, np.float32) for p in projections])
        inputs = [projections[0][0], graph.add_constant(weights, "qkv_weight"), graph.add_constant(bias, "qkv_bias")]
        if len(node.inputs) > 5 and node.inputs[5].name:
            inputs += [gs.Variable.empty(), gs.Variable.empty(), node.inputs[5]]
        attrs = {"num_heads": int(node.attrs["num_heads"])}
        if node.attrs.get("scale"):
            attrs["scale"] = float(node.attrs["scale"])
        replace_typed(graph, node.outputs[0], emit(graph, "Attention", inputs, attrs, domain=MS))
