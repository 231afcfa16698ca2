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
from rlflow.rewrites.fusions.layernorm import mean_of
from rlflow.rewrites.pattern import Found, PatternRule, const, constant, op, var
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


X = var("x")
_SUM = op.Add(mean_of((op.Pow(X, const(2.0)) | op.Mul(X, X)).otherwise("the mean is not of the normalised input squared"))
              .bind("mean"), constant("eps").otherwise("the epsilon is not a constant scalar"))
_SQRT = op.Sqrt(_SUM)
_NORMED = op.Div(X, _SQRT) | op.Mul(X, op.Reciprocal(_SQRT) | op.Div(const(1.0), _SQRT) | op.Pow(_SUM, const(-0.5)))
_RMS = op.Mul(var("weight"), op.Cast(_NORMED).bind("back") | _NORMED)  # the class's `op` names what it emits


def _is_centred(x: gs.Tensor) -> bool:
    """True for `x - ReduceMean(x')` of the same x': a decomposed layer norm, for layernorm-fusion."""
    sub = standard_producer(x)
    mean = input_producer(sub, 1, "ReduceMean") if sub is not None and sub.op == "Sub" else None
    return mean is not None and mean.inputs[0] is sub.inputs[0]


class RMSNormFusion(PatternRule):
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
    contrib = True
    op = "SimplifiedLayerNormalization"
    pattern = _RMS
    inner_reads = "a value inside the norm (the mean square, the normalised x) is read elsewhere"

    def _derived(self, graph: Graph, found: Found):
        """(the nodes consumed beyond the pattern's, axis, epsilon, the tensor normalised, the output's type where a
        Cast stays after the norm), or why the match may not be rewritten."""
        node, x, weight, back = found.nodes[0], found["x"], found["weight"], found.get("back")
        back = Graph.producer(back) if back is not None else None
        value = Graph.constant(weight)
        if value is None:
            return "the weight is not a constant"
        if _is_centred(x):
            return "x is centred: a layer norm (layernorm-fusion)"
        shape = graph.shape(x)
        if shape is None or graph.shape(node.outputs[0]) != shape:
            return "input shape unknown, or the weight changes it"
        rank = len(shape)
        epsilon = Graph.constant(found["eps"])
        if epsilon.size != 1 or epsilon.ndim > rank or epsilon.dtype.kind not in "fiu" or not np.isfinite(epsilon).all():
            return "the epsilon is not a constant scalar"
        axes = reduce_axes(Graph.producer(found["mean"]), rank)
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
        extra = [cast_in] if source is not x else []
        return extra, rank - len(axes), float(epsilon.reshape(-1)[0]), source, None if dtype == out else str(out)

    def check(self, graph: Graph, node: gs.Node) -> Match | NoMatch:
        found = self.found(graph, node)  # the first structural match decides, as it did by hand
        derived = found if isinstance(found, str) else self._derived(graph, found)
        if isinstance(derived, str):
            return self.no(node, derived)
        extra, axis, epsilon, x, cast = derived
        nodes = [*found.nodes, *extra]
        return self.match(nodes, axis=axis, epsilon=epsilon, x=self.locate(nodes, x),
                          weight=self.locate(nodes, found["weight"]), cast=cast)

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
