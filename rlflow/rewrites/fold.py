"""Folding rules: constants (batch-norm statistics, per-channel scales and biases) absorbed into weights."""
from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs

from rlflow.graph import Graph
from rlflow.rewrites.base import Match, NoMatch, Rule
from rlflow.rewrites.util import constant_input, input_producer, private


class ConvBatchNorm(Rule):
    """Replaces `BatchNormalization(Conv(x, W, b))` with `Conv(x, W', b')` whose weights absorb the normalisation."""

    name = "conv-bn-fold"
    category = "fold"
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
        scale, beta, mean, var = (constant_input(bn, i).astype(np.float64) for i in range(1, 5))
        eps = float(bn.attrs.get("epsilon", 1e-5))
        weight = constant_input(conv, 1)
        bias = constant_input(conv, 2) if len(conv.inputs) > 2 else np.zeros(weight.shape[0], weight.dtype)
        factor = scale / np.sqrt(var + eps)
        new_weight = (weight * factor.reshape(-1, *([1] * (weight.ndim - 1)))).astype(weight.dtype)
        new_bias = ((bias - mean) * factor + beta).astype(weight.dtype)
        (out,) = graph.add_node(
            "Conv",
            [conv.inputs[0], graph.add_constant(new_weight, f"{conv.name}_W"), graph.add_constant(new_bias, f"{conv.name}_B")],
            attrs=dict(conv.attrs),
            hint=conv.name,
        )
        graph.replace_uses(bn.outputs[0], out)
