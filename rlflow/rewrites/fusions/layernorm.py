"""Layer-norm fusions: the decomposed formula into the standard LayerNormalization, and a residual Add before it into
onnxruntime's SkipLayerNormalization."""
from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs

from rlflow.graph.core import Graph
from rlflow.graph.dynamic_axes import dynamic_axes
from rlflow.rewrites.base import Match, NoMatch, Rule
from rlflow.rewrites.edits import emit, replace_with_skip_norm
from rlflow.rewrites.pattern import ANY, Found, Pattern, PatternRule, const, constant, op, var
from rlflow.rewrites.queries import (
    bias_side,
    broadcast_shape,
    has_input,
    input_producer,
    is_float,
    is_standard,
    normalize_axis,
    private,
    private_producer,
    reduce_axes,
    scalar,
)


def mean_of(t: Pattern) -> Pattern:
    """`ReduceMean(t)`, its axes an attribute (below opset 18) or an input (the RMSNorm's mean square too)."""
    return op.ReduceMean(t) | op.ReduceMean(t, ANY)


X, CENTRED, MEAN = var("x"), var("centred"), var("mean")
_CENTRED = op.Sub(X, mean_of(X).bind("mean")).bind("centred")
_VARIANCE = mean_of(op.Pow(CENTRED | op.Sub(X, MEAN), const(2.0)) | op.Mul(CENTRED, CENTRED)).bind("variance")
_STD = op.Sqrt(op.Add(_VARIANCE, constant("eps")))
_NORMALISED = op.Div(_CENTRED, _STD) | op.Mul(_CENTRED, op.Reciprocal(_STD))


class LayerNormFusion(PatternRule):
    """Replaces the decomposed layer norm `(x - mean) / sqrt(var + eps) * gamma + beta` with `LayerNormalization`.

        +-------------------+
        |                   v
        x --> ReduceMean --> Sub --+--> Pow(., 2) --> ReduceMean --> Add(eps) --> Sqrt -+
                                   |    or Mul(., .)                                    v
                                   +--------------------------------------------------> Div -> Mul(gamma) -> Add(beta)

    torch.onnx.export (TorchScript) writes `nn.LayerNorm` this way below opset 17; from 17 on both exporters write
    LayerNormalization themselves, which onnxruntime's own fusions build on.  A bias-free norm written with rsqrt,
    `(x - mean) * rsqrt(var + eps) * gamma` (Cohere's, whose variance centres x a second time), is taken too.  The
    means must reduce the same trailing axes, none of them dynamic, and gamma and beta may only vary along them.
    """

    name = "layernorm-fusion"
    pattern = op.Add(op.Mul(_NORMALISED, constant("gamma")), constant("beta")) | op.Mul(_NORMALISED, constant("gamma"))
    variables = ("x", "gamma", "beta")

    def check(self, graph: Graph, node: gs.Node) -> Match | NoMatch:
        if graph.opset < 17:
            return self.no(node, "LayerNormalization needs opset 17")
        return super().check(graph, node)

    def condition(self, graph: Graph, found: Found) -> str | None:
        readers = found.nodes[0].outputs[0].outputs
        if found.get("beta") is None and len(readers) == 1 and readers[0].op == "Add" and is_standard(readers[0]) \
                and any(Graph.constant(t) is not None for t in readers[0].inputs):
            return "the shift Add after it roots the match"
        x, shape = found["x"], graph.shape(found["x"])
        if shape is None or not is_float(x):
            return "input shape or type unknown"
        rank = len(shape)
        axes = reduce_axes(Graph.producer(found["mean"]), rank)
        if axes is None or axes != reduce_axes(Graph.producer(found["variance"]), rank) or \
                axes != tuple(range(rank - len(axes), rank)):
            return "the means do not reduce the same trailing axes"
        if scalar(Graph.constant(found["eps"])) is None:
            return "epsilon is not a scalar"
        dynamic = dynamic_axes(graph, x)
        if dynamic is None or any(dynamic[rank - len(axes):]):
            return "a normalised axis is dynamic"
        normalized = shape[rank - len(axes):]
        for value in (Graph.constant(t) for t in (found["gamma"], found.get("beta")) if t is not None):
            if value.ndim > len(axes) or broadcast_shape(value.shape, normalized) != normalized:
                return "gamma or beta vary along leading axes"
        return None

    def params(self, graph: Graph, found: Found) -> dict:
        rank = len(graph.shape(found["x"]))
        return {"axis": rank - len(reduce_axes(Graph.producer(found["mean"]), rank)),
                "epsilon": scalar(Graph.constant(found["eps"]))}

    def replacement(self, graph: Graph, tensors: dict[str, gs.Tensor], match: Match) -> gs.Tensor:
        axis, gamma = match.param("axis"), Graph.constant(tensors["gamma"])
        normalized = graph.shape(tensors["x"])[axis:]
        beta = Graph.constant(tensors["beta"]) if tensors["beta"] is not None else np.zeros((), gamma.dtype)
        scale, shift = (graph.add_constant(np.broadcast_to(v, normalized).astype(gamma.dtype), f"{match.root}_{name}")
                        for v, name in ((gamma, "gamma"), (beta, "beta")))
        attrs = {"axis": axis, "epsilon": match.param("epsilon")}
        return emit(graph, "LayerNormalization", [tensors["x"], scale, shift], attrs)


class SkipLayerNormFusion(Rule):
    """Replaces `LayerNormalization(Add(a, b))` over the last axis with onnxruntime's `SkipLayerNormalization(a, b)`.

        x --> MatMul(., W) --> Add(., bias) --+          (the bias Add is optional, on either operand)
                                              v
                                      b --> Add --> LayerNormalization(gamma, beta, axis=-1)
                                             |
                                             +--> other readers (a pre-norm residual stream), if any

    Both torch exporters write a transformer's residual connection and its `nn.LayerNorm` this way from opset 17 on,
    a `nn.Linear` on a 3-D input as MatMul then the bias Add.  The bias goes into the fused operator too.  Where the
    sum is read elsewhere as well (a pre-norm transformer's residual stream: DeiT, Whisper, GPT-2), or is a graph
    output (older Hugging Face exports return it), those readers, and the output, take it from the operator's fourth
    output."""

    name = "skip-layernorm-fusion"
    root_ops = ("LayerNormalization",)
    contrib = True

    def check(self, graph: Graph, node: gs.Node) -> Match | NoMatch:
        add = input_producer(node, 0, "Add")
        if add is None:
            return self.no(node, "input is not an Add")
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
    which on the CPU is slower than Add and LayerNormalization at the small widths of batch-1 encoders.  With the residual added first, onnxruntime 1.31 fuses neither; the graph
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
