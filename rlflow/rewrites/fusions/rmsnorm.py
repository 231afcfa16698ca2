"""RMSNorm fusions (decoder LLMs: Llama, Qwen3 and the models that copy their norm): the decomposed root-mean-square norm into onnxruntime's
`SimplifiedLayerNormalization` (or, from opset 23, the standard `RMSNormalization`), and a residual Add before it into
onnxruntime's `SkipSimplifiedLayerNormalization`.

onnxruntime registers `SimplifiedLayerNormalization` in the default ONNX domain (since version 1, as it does its
opset-1 `LayerNormalization`), not in com.microsoft: only onnxruntime runs it, so its rule is `contrib`, and the onnx
checker, which knows no such standard operator, checks it as the contrib operator it is
(`rlflow.graph.model_file.ONNXRUNTIME_OPS_IN_ONNX_DOMAIN`).
"""
from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs
from onnx import helper

from rlflow.graph.core import Graph
from rlflow.graph.dynamic_axes import dynamic_axes
from rlflow.rewrites.base import Match, NoMatch, Rule
from rlflow.rewrites.edits import emit, replace_typed, replace_with_skip_norm
from rlflow.rewrites.queries import (
    broadcast_shape,
    has_input,
    input_producer,
    normalize_axis,
    np_dtype,
    private,
    reduce_axes,
    standard_producer,
    used_outputs,
)

_TYPES = (np.dtype(np.float32), np.dtype(np.float16), np.dtype(np.float64))
"""Element types onnxruntime's CPU kernels of SimplifiedLayerNormalization and RMSNormalization take (input, scale
and output of one type: bfloat16 has no CPU kernel)."""

_SKIP_TYPES = _TYPES[:2]
"""Element types of onnxruntime's SkipSimplifiedLayerNormalization kernels (CPU and CUDA)."""


_NOT_RMS = "not a Mul of a normalised value by a weight"


def _constant_scalar(tensor: gs.Tensor, rank: int) -> float | None:
    """The value of a one-element float or int constant that broadcasting cannot raise above `rank`, else None."""
    value = Graph.constant(tensor)
    if value is None or value.size != 1 or value.ndim > rank or value.dtype.kind not in "fiu":
        return None
    return float(value.reshape(-1)[0])


def _other(node: gs.Node, tensor: gs.Tensor) -> gs.Tensor | None:
    """The other operand of a binary node that reads `tensor`."""
    if len(node.inputs) != 2:
        return None
    return node.inputs[1] if node.inputs[0] is tensor else node.inputs[0] if node.inputs[1] is tensor else None


def _inverse_rms(graph: Graph, node: gs.Node, rank: int) -> tuple[list[gs.Node], gs.Node] | None:
    """For `1 / sqrt(a)` written as Reciprocal(Sqrt(a)), Div(1, Sqrt(a)) or Pow(a, -0.5): its nodes and the node
    writing `a` (the Add of the epsilon), else None."""
    if node.op == "Pow" and _constant_scalar(node.inputs[1], rank) == -0.5:
        chain = [node]
    elif node.op == "Reciprocal" or (node.op == "Div" and _constant_scalar(node.inputs[0], rank) == 1.0):
        sqrt = input_producer(node, len(node.inputs) - 1, "Sqrt")
        if sqrt is None:
            return None
        chain = [node, sqrt]
    else:
        return None
    add = input_producer(chain[-1], 0, "Add")
    return (chain, add) if add is not None else None


def _rms_chain(graph: Graph, normed: gs.Tensor):
    """The RMSNorm that writes `normed`: (its nodes from the normalising Mul or Div back to the square, x, epsilon,
    the ReduceMean), or a reason string."""
    norm = standard_producer(normed)
    if norm is None or norm.op not in ("Mul", "Div") or len(norm.inputs) != 2:
        return _NOT_RMS
    rank = len(graph.shape(normed) or ())
    found = None
    if norm.op == "Div":  # x / sqrt(a)
        sqrt = input_producer(norm, 1, "Sqrt")
        add = input_producer(sqrt, 0, "Add") if sqrt is not None else None
        found = ([norm, sqrt], add, norm.inputs[0]) if add is not None else None
    else:  # x * (1 / sqrt(a)), either order
        for side in (0, 1):
            inverse = standard_producer(norm.inputs[side])
            chain = _inverse_rms(graph, inverse, rank) if inverse is not None else None
            if chain is not None:
                found = ([norm, *chain[0]], chain[1], norm.inputs[1 - side])
                break
    if found is None:
        return _NOT_RMS
    nodes, add, x = found
    mean = next((p for i in (0, 1) if (p := input_producer(add, i, "ReduceMean")) is not None), None)
    square = input_producer(mean, 0, ("Pow", "Mul")) if mean is not None else None
    if square is None:
        return "no mean square + epsilon under the square root"
    if not ((square.op == "Mul" and square.inputs[0] is x and square.inputs[1] is x) or (
            square.op == "Pow" and square.inputs[0] is x and _constant_scalar(square.inputs[1], rank) == 2.0)):
        return "the mean is not of the normalised input squared"
    epsilon = _constant_scalar(_other(add, mean.outputs[0]), rank)
    if epsilon is None or not np.isfinite(epsilon):
        return "the epsilon is not a constant scalar"
    return [*nodes, add, mean, square], x, epsilon, mean


def _is_centred(x: gs.Tensor) -> bool:
    """True for `x - ReduceMean(x')` of the same x': a decomposed layer norm, for layernorm-fusion."""
    sub = standard_producer(x)
    mean = input_producer(sub, 1, "ReduceMean") if sub is not None and sub.op == "Sub" else None
    return mean is not None and mean.inputs[0] is sub.inputs[0]


class RMSNormFusion(Rule):
    """Replaces the decomposed RMSNorm `x / sqrt(mean(x^2) + eps) * w` with onnxruntime's `SimplifiedLayerNormalization`.

        x --> Cast(float32) --+--> Pow(., 2) --> ReduceMean(-1) --> Add(eps) --> Sqrt --> Reciprocal --+
        (Cast only in fp16)   |    or Mul(., .)                                   or Div(1, .)          |
                              |                         or Pow(., -0.5) in place of both                v
                              +-------------------------------------------------------------------> Mul(., .)
                                                                       (or Div(x, Sqrt) in one step)    |
                                                                                                        v
                                                           Mul(w, .) <-- Cast(back to x's type) <-------+
                                                                         (fp16 only)

    Hugging Face's RMSNorm modules (`LlamaRMSNorm`, `Qwen3RMSNorm` and their copies) through either torch exporter:
    TorchScript (opset 17) writes `Div(1, Sqrt)` and Casts even in float32 (no-ops then), the dynamo exporter
    `Sqrt -> Reciprocal` and Casts only in half precision.  Qwen3's query and key norms are the same pattern on the
    4-D [batch, sequence, heads, head size] projections.  The reduction must be over trailing axes, none dynamic, and
    the weight a constant varying along them alone.  A no-op Cast of x is seen through.  In a float16 export the Cast
    of x to float32 and the Cast back before the weight are absorbed: the operator reads x in float16 and computes in
    float32 (`stash_type` 1), and onnxruntime's CPU kernel gives the same bits as the decomposed form.  Where a
    float32 x is normalised and cast to float16 before a float16 weight (TorchScript's float16 export keeps the
    residual stream after attention in float32), the norm is fused in float32 with the weight widened (exactly) and
    the Cast kept after it; the export rounds the normalised value before the weight and the fused form does not, a
    difference within float16's rounding.  Any other Cast of the normalised value is refused.
    """

    name = "rmsnorm-fusion"
    root_ops = ("Mul",)
    contrib = True
    op = "SimplifiedLayerNormalization"

    def _pattern(self, graph: Graph, node: gs.Node):
        """The pattern's nodes and values, or a reason string."""
        reasons = []
        for side in (0, 1):
            normed, back = node.inputs[1 - side], None
            cast = standard_producer(normed)
            if cast is not None and cast.op == "Cast":
                normed, back = cast.inputs[0], cast
            found = _rms_chain(graph, normed)
            if not isinstance(found, str):
                return self._checked(graph, node, node.inputs[side], back, *found)
            reasons.append(found)
        return max(reasons, key=lambda r: r != _NOT_RMS)  # the reason of the side that looked like a norm

    def _checked(self, graph: Graph, node: gs.Node, weight: gs.Tensor, back: gs.Node | None, chain: list[gs.Node],
                 x: gs.Tensor, epsilon: float, mean: gs.Node):
        nodes = [node, *([back] if back is not None else []), *chain]
        value = Graph.constant(weight)
        if value is None:
            return "the weight is not a constant"
        if any(not private(graph, n.outputs[0]) for n in nodes[1:]):
            return "a value inside the norm (the mean square, the normalised x) is read elsewhere"
        if _is_centred(x):
            return "x is centred: a layer norm (layernorm-fusion)"
        shape = graph.shape(x)
        if shape is None or graph.shape(node.outputs[0]) != shape:
            return "input shape unknown, or the weight changes it"
        rank = len(shape)
        axes = reduce_axes(mean, rank)
        if axes is None or axes != tuple(range(rank - len(axes), rank)):
            return "the mean is not over the last axis (or trailing axes, keeping them)"
        normalized = shape[rank - len(axes):]
        dynamic = dynamic_axes(graph, x)
        if dynamic is None or any(dynamic[rank - len(axes):]):
            return "a normalised axis is dynamic"
        if value.ndim > len(axes) or broadcast_shape(value.shape, normalized) != normalized:
            return "the weight varies along leading axes"
        source, cast_in, f32 = x, standard_producer(x), np.dtype(np.float32)
        widened = np_dtype(cast_in.inputs[0]) if cast_in is not None and cast_in.op == "Cast" else None
        if widened is not None and widened == np_dtype(x):
            source = cast_in.inputs[0]  # a no-op Cast (TorchScript's float32 `.to(torch.float32)`)
        out = np_dtype(node.outputs[0])
        if back is not None and np_dtype(back.outputs[0]) != np_dtype(back.inputs[0]):
            if widened is not None and widened == out and np_dtype(x) == f32:
                source = cast_in.inputs[0]  # computed in float32 from x in half precision, and cast back
            elif not (np_dtype(source) == f32 and out == np.float16):
                return "the normalised value is cast to another type than x's"
        dtype = np_dtype(source)
        if dtype not in _TYPES or value.dtype != out or not np.array_equal(value.astype(dtype).astype(out), value):
            return "x, the weight and the output are not of float types onnxruntime normalises"
        if source is not x:
            nodes.append(cast_in)
        return nodes, rank - len(axes), epsilon, source, weight, None if dtype == out else str(out)

    def check(self, graph: Graph, node: gs.Node) -> Match | NoMatch:
        found = self._pattern(graph, node)
        if isinstance(found, str):
            return self.no(node, found)
        nodes, axis, epsilon, x, weight, cast = found
        return self.match(nodes, axis=axis, epsilon=epsilon, x=self.locate(nodes, x), weight=self.locate(nodes, weight),
                          cast=cast)

    def rewrite(self, graph: Graph, match: Match, nodes: dict[str, gs.Node]) -> None:
        node = nodes[match.root]
        x, axis = match.input("x", nodes), match.param("axis")
        value, cast = Graph.constant(match.input("weight", nodes)), match.param("cast")
        dtype = np.dtype(x.dtype)  # the weight widened exactly where the output is cast back to half precision
        scale = graph.add_constant(np.broadcast_to(value, graph.shape(x)[axis:]).astype(dtype), f"{node.name}_scale")
        out = emit(graph, self.op, [x, scale], {"axis": axis, "epsilon": match.param("epsilon"), "stash_type": 1})
        if cast is not None:
            out = emit(graph, "Cast", [out], {"to": int(helper.np_dtype_to_tensor_dtype(np.dtype(cast)))})
        replace_typed(graph, node.outputs[0], out)


class RMSNormStandardFusion(RMSNormFusion):
    """Replaces the decomposed RMSNorm `x / sqrt(mean(x^2) + eps) * w` with the standard `RMSNormalization` (opset 23).

    The pattern and its limits are rmsnorm-fusion's; the output stays in the default ONNX domain (`--ops standard`),
    for models of opset 23 or later (onnxruntime 1.31 has CPU and CUDA kernels for it)."""

    name = "rmsnorm-standard-fusion"
    contrib = False
    op = "RMSNormalization"

    def check(self, graph: Graph, node: gs.Node) -> Match | NoMatch:
        if graph.opset < 23:
            return self.no(node, "RMSNormalization needs opset 23")
        return super().check(graph, node)


class SkipRMSNormFusion(Rule):
    """Replaces `SimplifiedLayerNormalization(Add(a, b))` over the last axis with onnxruntime's `SkipSimplifiedLayerNormalization(a, b)`.

        b --> Add --> SimplifiedLayerNormalization(w, axis=-1)      (or the standard RMSNormalization)
        a ----^ |
                +--> other readers (the decoder's residual stream), if any

    A pre-norm decoder (Llama, Qwen3) adds each block's output to the residual stream and normalises the sum for the
    next block, as both torch exporters write it; once rmsnorm-fusion has fused the norm, this takes the Add in too.
    Where the sum is read elsewhere as well (it is, but for the last norm) or is a graph output, those readers take it
    from the operator's fourth output.  a and b must be of one shape, 2-D or 3-D (the kernel's), and w a vector over the last axis."""

    name = "skip-rmsnorm-fusion"
    root_ops = ("SimplifiedLayerNormalization", "RMSNormalization")
    contrib = True

    def check(self, graph: Graph, node: gs.Node) -> Match | NoMatch:
        add = input_producer(node, 0, "Add")
        if add is None:
            return self.no(node, "input is not an Add")
        shapes = [graph.shape(t) for t in (*add.inputs, node.inputs[0])]
        if any(s is None for s in shapes) or not shapes[0] == shapes[1] == shapes[2] or len(shapes[0]) not in (2, 3) or (
                dynamic_axes(graph, add.inputs[0]) != dynamic_axes(graph, add.inputs[1])):
            return self.no(node, "the Add's operands are not two 2-D or 3-D tensors of one shape (at every size)")
        if normalize_axis(node.attrs.get("axis", -1), len(shapes[0])) != len(shapes[0]) - 1:
            return self.no(node, "the normalisation is not over the last axis alone")
        if any(t is not node.outputs[0] for t in used_outputs(graph, node)):
            return self.no(node, "the inverse deviation output is used")
        dtype = np_dtype(node.inputs[0])
        if not has_input(node, 1) or graph.shape(node.inputs[1]) != (shapes[0][-1],) or dtype not in _SKIP_TYPES or (
                np_dtype(node.inputs[1]) != dtype or np_dtype(add.inputs[0]) != dtype or int(node.attrs.get("stash_type", 1)) != 1):
            return self.no(node, "not a float32 or float16 norm, computed in float32, with a weight over the last axis")
        return self.match([node, add], shared=not private(graph, add.outputs[0]))

    def rewrite(self, graph: Graph, match: Match, nodes: dict[str, gs.Node]) -> None:
        node, add = nodes[match.nodes[0]], nodes[match.nodes[1]]
        inputs = [*add.inputs, node.inputs[1]]
        attrs = {"epsilon": float(node.attrs.get("epsilon", 1e-5))}
        replace_with_skip_norm(graph, "SkipSimplifiedLayerNormalization", inputs, attrs, node.outputs[0],
                               add.outputs[0] if match.param("shared") else None, "skip_rms")
