"""Layer-norm fusions: the decomposed formula into the standard LayerNormalization, and a residual Add before it into
onnxruntime's SkipLayerNormalization."""
from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs

from rlflow.graph.core import Graph
from rlflow.graph.dynamic_axes import dynamic_axes
from rlflow.rewrites.base import Match, NoMatch, Rule
from rlflow.rewrites.edits import emit, replace_with_skip_norm
from rlflow.rewrites.queries import (
    bias_side,
    broadcast_shape,
    constant_input,
    has_input,
    input_producer,
    int_list,
    is_float,
    normalize_axis,
    other_operand,
    private,
    private_producer,
    scalar,
)


def _reduce_axes(node: gs.Node, rank: int) -> tuple[int, ...] | None:
    axes = node.attrs.get("axes") if "axes" in node.attrs else (int_list(constant_input(node, 1))
                                                                if has_input(node, 1) else None)
    if axes is None or not node.attrs.get("keepdims", 1):
        return None
    normal = [normalize_axis(a, rank) for a in axes]
    return None if None in normal else tuple(sorted(normal))


class LayerNormFusion(Rule):
    """Replaces the decomposed layer norm `(x - mean) / sqrt(var + eps) * gamma + beta` with `LayerNormalization`.

        +-------------------+
        |                   v
        x --> ReduceMean --> Sub --+--> Pow(., 2) --> ReduceMean --> Add(eps) --> Sqrt -+
                                   |    or Mul(., .)                                    v
                                   +--------------------------------------------------> Div -> Mul(gamma) -> Add(beta)

    torch.onnx.export (TorchScript) writes `nn.LayerNorm` this way below opset 17; from 17 on both exporters write
    LayerNormalization themselves, which onnxruntime's own fusions build on.  The means must reduce the same trailing
    axes, none of them dynamic, and gamma and beta may only vary along them.
    """

    name = "layernorm-fusion"
    root_ops = ("Add",)

    def _pattern(self, graph: Graph, node: gs.Node):
        """The pattern's nodes and values, or a reason string."""
        mul = next((p for i in (0, 1) if (p := private_producer(graph, node, i, "Mul")) is not None), None)
        if mul is None:
            return "not an Add of a Mul (the scale) and a bias"
        beta = other_operand(node, mul.outputs[0])
        div = next((p for i in (0, 1) if (p := private_producer(graph, mul, i, "Div")) is not None), None)
        if div is None or beta is None or beta[1] is None:
            return "not a scaled and shifted Div"
        gamma = other_operand(mul, div.outputs[0])
        sub, sqrt = input_producer(div, 0, "Sub"), private_producer(graph, div, 1, "Sqrt")
        if gamma is None or gamma[1] is None or sub is None or sqrt is None:
            return "the normalisation is not (x - mean) / sqrt(...)"
        add_eps = private_producer(graph, sqrt, 0, "Add")
        var = next((p for i in (0, 1) if add_eps is not None and
                    (p := private_producer(graph, add_eps, i, "ReduceMean")) is not None), None)
        if var is None:
            return "no variance + epsilon under the Sqrt"
        eps = scalar(other_operand(add_eps, var.outputs[0])[1])
        square = private_producer(graph, var, 0, ("Pow", "Mul"))
        mean = private_producer(graph, sub, 1, "ReduceMean")
        if eps is None or square is None or mean is None:
            return "the variance or mean is not of the expected form"
        x, d = sub.inputs[0], sub.outputs[0]
        is_square = (square.op == "Mul" and square.inputs[0] is d and square.inputs[1] is d) or (
            square.op == "Pow" and square.inputs[0] is d and scalar(constant_input(square, 1)) == 2.0)
        readers = {id(n) for n in d.outputs}
        if not is_square or mean.inputs[0] is not x or readers != {id(square), id(div)} or graph.is_output(d):
            return "the centred input is not squared and divided alone"
        shape = graph.shape(x)
        if shape is None or not is_float(x):
            return "input shape or type unknown"
        rank = len(shape)
        axes = _reduce_axes(mean, rank)
        if axes is None or axes != _reduce_axes(var, rank) or axes != tuple(range(rank - len(axes), rank)):
            return "the means do not reduce the same trailing axes"
        normalized = shape[rank - len(axes):]
        dynamic = dynamic_axes(graph, x)
        if dynamic is None or any(dynamic[rank - len(axes):]):
            return "a normalised axis is dynamic"
        for value in (gamma[1], beta[1]):
            if value.ndim > len(axes) or broadcast_shape(value.shape, normalized) != normalized:
                return "gamma or beta vary along leading axes"
        return [node, mul, div, sub, sqrt, add_eps, var, square, mean], rank - len(axes), eps, gamma[0], beta[0]

    def check(self, graph: Graph, node: gs.Node) -> Match | NoMatch:
        if graph.opset < 17:
            return self.no(node, "LayerNormalization needs opset 17")
        found = self._pattern(graph, node)
        if isinstance(found, str):
            return self.no(node, found)
        nodes, axis, eps, gamma, beta = found
        return self.match(nodes, axis=axis, epsilon=eps, gamma=self.locate(nodes, gamma),
                          beta=self.locate(nodes, beta))

    def rewrite(self, graph: Graph, match: Match, nodes: dict[str, gs.Node]) -> None:
        node = nodes[match.root]
        axis, eps = match.param("axis"), match.param("epsilon")
        gamma, beta = match.input("gamma", nodes), match.input("beta", nodes)
        x = nodes[match.nodes[3]].inputs[0]  # the Sub's
        normalized = graph.shape(x)[axis:]
        dtype = Graph.constant(gamma).dtype
        scale = graph.add_constant(np.broadcast_to(Graph.constant(gamma), normalized).astype(dtype), f"{node.name}_gamma")
        shift = graph.add_constant(np.broadcast_to(Graph.constant(beta), normalized).astype(dtype), f"{node.name}_beta")
        out = emit(graph, "LayerNormalization", [x, scale, shift], {"axis": axis, "epsilon": eps})
        graph.replace_uses(node.outputs[0], out)


class SkipLayerNormFusion(Rule):
    """Replaces `LayerNormalization(Add(a, b))` over the last axis with onnxruntime's `SkipLayerNormalization(a, b)`.

        x --> MatMul(., W) --> Add(., bias) --+          (the bias Add is optional, on either operand)
                                              v
                                      b --> Add --> LayerNormalization(gamma, beta, axis=-1)
                                             |
                                             +--> other readers (a pre-norm residual stream), if any

    Both torch exporters write a transformer's residual connection and its `nn.LayerNorm` this way from opset 17 on,
    a `nn.Linear` on a 3-D input as MatMul then the bias Add.  The bias goes into the fused operator too.  Where the
    sum is read elsewhere as well (a pre-norm transformer's residual stream: DeiT, Whisper, GPT-2), those readers take
    it from the operator's fourth output."""

    name = "skip-layernorm-fusion"
    root_ops = ("LayerNormalization",)
    contrib = True

    def check(self, graph: Graph, node: gs.Node) -> Match | NoMatch:
        add = input_producer(node, 0, "Add")
        if add is None or graph.is_output(add.outputs[0]):
            return self.no(node, "input is not an Add (that is not a graph output)")
        shapes = [graph.shape(t) for t in (*add.inputs, node.inputs[0])]
        if any(s is None for s in shapes) or not shapes[0] == shapes[1] == shapes[2] or len(shapes[0]) not in (2, 3):
            return self.no(node, "the Add's operands are not two 2-D or 3-D tensors of one shape")
        if normalize_axis(node.attrs.get("axis", -1), len(shapes[0])) != len(shapes[0]) - 1 or len(node.outputs) > 1:
            return self.no(node, "the normalisation is not over the last axis alone")
        hidden = shapes[0][-1]
        if any(graph.shape(t) != (hidden,) for t in node.inputs[1:] if t.name) or not is_float(node.outputs[0]):
            return self.no(node, "gamma or beta are not vectors over the last axis")
        shared = not private(graph, add.outputs[0])
        for operand in (0, 1):  # the bias of the linear layer on either side
            biased = private_producer(graph, add, operand, "Add")
            side = None if biased is None else bias_side(graph, biased)
            if side is not None:
                return self.match([node, add, biased], operand=operand, side=side, shared=shared)
        return self.match([node, add], shared=shared)

    def rewrite(self, graph: Graph, match: Match, nodes: dict[str, gs.Node]) -> None:
        node, add = nodes[match.nodes[0]], nodes[match.nodes[1]]
        inputs, bias = list(add.inputs), []
        if len(match.nodes) == 3:
            biased, side = nodes[match.nodes[2]], match.param("side")
            inputs[match.param("operand")] = biased.inputs[1 - side]
            bias = [biased.inputs[side]]
        gamma = node.inputs[1]
        beta = node.inputs[2] if has_input(node, 2) else None
        if bias and beta is None:  # the bias is input 4: beta (input 3) must be present
            beta = graph.add_constant(np.zeros(graph.shape(gamma), np.float32), "beta")
        inputs += [gamma, *([beta] if beta is not None else []), *bias]
        attrs = {"epsilon": float(node.attrs.get("epsilon", 1e-5))}
        replace_with_skip_norm(graph, "SkipLayerNormalization", inputs, attrs, node.outputs[0],
                               add.outputs[0] if match.param("shared") else None, "skip_ln")


class ResidualBiasReorder(Rule):
    """Replaces `LayerNormalization(Add(Add(y, bias), r))` with `LayerNormalization(Add(Add(y, r), bias))`.

    The exporters add a linear layer's bias before the residual; onnxruntime's CPU optimizer then folds the bias into
    a Gemm (with a Reshape on each side of a 3-D input) and the residual Add into its SkipLayerNormalization kernel,
    which on the CPU is slower than Add and LayerNormalization at the small widths of batch-1 encoders
    (docs/results/residual-order/).  With the residual added first, onnxruntime 1.31 fuses neither; the graph
    `skip-layernorm-fusion` then `skip-layernorm-unfuse` writes, in one step.  A reassociation of a float sum: equal
    up to rounding."""

    name = "residual-bias-reorder"
    root_ops = ("LayerNormalization",)
    cuda = False  # for the CPU optimizer's fusions; not offered on CUDA, whose SkipLayerNormalization is not measured slower

    def check(self, graph: Graph, node: gs.Node) -> Match | NoMatch:
        outer = input_producer(node, 0, "Add")
        if outer is None:
            return self.no(node, "input is not an Add")
        shape = graph.shape(outer.outputs[0])
        for operand in (0, 1):
            inner = private_producer(graph, outer, operand, "Add")
            side = None if inner is None else bias_side(graph, inner)
            if side is None:
                continue
            residual = outer.inputs[1 - operand]
            if Graph.constant(residual) is not None or graph.shape(residual) != shape:
                return self.no(node, "the residual is a constant or broadcasts")
            return self.match([node, outer, inner], operand=operand, side=side)
        return self.no(node, "no operand of the Add is a private bias Add")

    def rewrite(self, graph: Graph, match: Match, nodes: dict[str, gs.Node]) -> None:
        outer, inner = nodes[match.nodes[1]], nodes[match.nodes[2]]
        operand, side = match.param("operand"), match.param("side")
        bias, residual = inner.inputs[side], outer.inputs[1 - operand]
        inner.inputs[side] = residual
        outer.inputs[1 - operand] = bias
