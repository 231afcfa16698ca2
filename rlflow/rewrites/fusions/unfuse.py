"""Inverse rules for onnxruntime's contrib fusions: each rule roots at a com.microsoft operator (`domains`; or at
SimplifiedLayerNormalization, which onnxruntime registers in the default domain; rotary-unfuse at the standard
RotaryEmbedding too) and writes the standard form that the
matching fusion rule recognises again, so every fusion can be taken back and a search can pass through the unfused
graph (where other rules may merge) to reach a faster one."""
from __future__ import annotations

import math

import numpy as np
import onnx_graphsurgeon as gs
from onnx import helper

from rlflow.graph.core import Graph
from rlflow.rewrites.base import Match, NoMatch, Rule
from rlflow.rewrites.edits import emit, replace_typed
from rlflow.rewrites.queries import MS, has_input, is_float, normalize_axis, np_dtype, used_outputs

# ------------------------------------------------------------------------------------------ contrib operators
_UNFUSED_PARAMS = {"Relu": (), "Sigmoid": (), "Tanh": (), "LeakyRelu": ("alpha",), "HardSigmoid": ("alpha", "beta")}


def _decode(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _emit_activation(graph: Graph, op: str, x: gs.Tensor, params: list[float], dtype) -> gs.Tensor:
    """`op(x)` with its parameters (Clip's bounds as constant inputs, or attributes below opset 11)."""
    if op == "Clip":
        if graph.opset < 11:
            return emit(graph, "Clip", [x], {"min": float(params[0]), "max": float(params[1])})
        # Clip wants 0-d bounds, and graph.add_constant makes arrays at least 1-d
        bounds = [gs.Constant(graph.fresh_name("clip_bound"), np.array(p, dtype)) for p in params[:2]]
        return emit(graph, "Clip", [x, *bounds])
    return emit(graph, op, [x], dict(zip(_UNFUSED_PARAMS[op], (float(p) for p in params))))


class FusedConvUnfuse(Rule):
    """Replaces onnxruntime's `FusedConv(x, W, b, activation=act)` with `act(Conv(x, W, b))`."""

    name = "fused-conv-unfuse"
    root_ops = ("FusedConv",)
    domains = (MS,)

    def check(self, graph: Graph, node: gs.Node) -> Match | NoMatch:
        activation = _decode(node.attrs.get("activation", ""))
        params = list(node.attrs.get("activation_params", []) or [])
        needed = 2 if activation == "Clip" else len(_UNFUSED_PARAMS.get(activation, ()))
        if activation not in (*_UNFUSED_PARAMS, "Clip") or len(params) < needed:
            return self.no(node, f"activation {activation!r} has no standard form here")
        if has_input(node, 3) or len(used_outputs(graph, node)) != 1 or not is_float(node.inputs[0]):
            return self.no(node, "it adds a sum input (Z) or is not a float FusedConv")
        return self.match([node])

    def rewrite(self, graph: Graph, match: Match, nodes: dict[str, gs.Node]) -> None:
        node = nodes[match.root]
        attrs = {k: v for k, v in node.attrs.items() if k not in ("activation", "activation_params")}
        conv = emit(graph, "Conv", [t for t in node.inputs[:3] if t.name], attrs)
        out = _emit_activation(graph, _decode(node.attrs["activation"]), conv,
                               list(node.attrs.get("activation_params", []) or []), np.dtype(node.inputs[0].dtype))
        graph.replace_uses(node.outputs[0], out)


class FusedGemmUnfuse(Rule):
    """Replaces onnxruntime's `FusedGemm(A, B, C, activation=act)` with `act(Gemm(A, B, C))`."""

    name = "fused-gemm-unfuse"
    root_ops = ("FusedGemm",)
    domains = (MS,)

    def check(self, graph: Graph, node: gs.Node) -> Match | NoMatch:
        activation = _decode(node.attrs.get("activation", ""))
        if activation not in _UNFUSED_PARAMS:
            return self.no(node, f"activation {activation!r} has no standard form here")
        if not is_float(node.inputs[0]):
            return self.no(node, "not a float FusedGemm")
        return self.match([node])

    def rewrite(self, graph: Graph, match: Match, nodes: dict[str, gs.Node]) -> None:
        node = nodes[match.root]
        attrs = {k: v for k, v in node.attrs.items() if k in ("alpha", "beta", "transA", "transB")}
        gemm = emit(graph, "Gemm", list(node.inputs), attrs)
        activation = _decode(node.attrs["activation"])
        defaults = {"alpha": 0.01 if activation == "LeakyRelu" else 0.2, "beta": 0.5}
        params = [node.attrs.get(f"activation_{key}", defaults[key]) for key in _UNFUSED_PARAMS[activation]]
        graph.replace_uses(node.outputs[0], _emit_activation(graph, activation, gemm, params, None))


def _swap_last(rank: int) -> list[int]:
    return [*range(rank - 2), rank - 1, rank - 2]


class FusedMatMulUnfuse(Rule):
    """Replaces onnxruntime's `FusedMatMul(A, B, transA, transB, alpha)` with `alpha * MatMul(A^T, B^T)`."""

    name = "fused-matmul-unfuse"
    root_ops = ("FusedMatMul",)
    domains = (MS,)

    def check(self, graph: Graph, node: gs.Node) -> Match | NoMatch:
        if node.attrs.get("transBatchA", 0) or node.attrs.get("transBatchB", 0):
            return self.no(node, "transBatchA/transBatchB are set")
        shapes = [graph.shape(t) for t in node.inputs[:2]]
        if any(s is None or len(s) < 2 for s in shapes) or not is_float(node.inputs[0]):
            return self.no(node, "operands of unknown rank, rank below 2, or not float")
        return self.match([node])

    def rewrite(self, graph: Graph, match: Match, nodes: dict[str, gs.Node]) -> None:
        node = nodes[match.root]
        inputs = list(node.inputs[:2])
        for i, key in enumerate(("transA", "transB")):
            if node.attrs.get(key, 0):
                inputs[i] = emit(graph, "Transpose", [inputs[i]], {"perm": _swap_last(len(graph.shape(inputs[i])))})
        out = emit(graph, "MatMul", inputs)
        alpha = float(node.attrs.get("alpha", 1.0))
        if alpha != 1.0:
            out = emit(graph, "Mul", [out, _const(graph, alpha, node.inputs[0], "alpha")])
        graph.replace_uses(node.outputs[0], out)


def _const(graph: Graph, value: float, like: gs.Tensor, hint: str) -> gs.Constant:
    return graph.add_constant(np.array(value, np.dtype(like.dtype)), hint)


class _Unfuse(Rule):
    """A com.microsoft operator with one used output and a float input (onnx's shape inference does not know contrib
    operators, so their outputs may have no type: the input's type is the one to trust)."""

    domains = (MS,)

    def check(self, graph: Graph, node: gs.Node) -> Match | NoMatch:
        if len(used_outputs(graph, node)) != 1 or used_outputs(graph, node)[0] is not node.outputs[0]:
            return self.no(node, "an optional output is used")
        if not node.inputs or not is_float(node.inputs[0]):
            return self.no(node, "not a float operator")
        refusal = self.extra(graph, node)
        return refusal if refusal is not None else self.match([node])

    def extra(self, graph: Graph, node: gs.Node) -> NoMatch | None:
        """A further reason to refuse, or None."""
        return None


def _gelu_erf(graph: Graph, x: gs.Tensor) -> gs.Tensor:
    """`x * (1 + erf(x / sqrt(2))) * 0.5`, in the form `gelu-fusion` matches."""
    t = emit(graph, "Div", [x, _const(graph, math.sqrt(2), x, "sqrt2")])
    bracket = emit(graph, "Add", [emit(graph, "Erf", [t]), _const(graph, 1.0, x, "one")])
    return emit(graph, "Mul", [emit(graph, "Mul", [x, bracket]), _const(graph, 0.5, x, "half")])


class GeluUnfuse(_Unfuse):
    """Replaces onnxruntime's `Gelu(x)` with `0.5 * x * (1 + erf(x / sqrt(2)))`."""

    name = "gelu-unfuse"
    root_ops = ("Gelu",)

    def rewrite(self, graph: Graph, match: Match, nodes: dict[str, gs.Node]) -> None:
        node = nodes[match.root]
        graph.replace_uses(node.outputs[0], _gelu_erf(graph, node.inputs[0]))


class FastGeluUnfuse(_Unfuse):
    """Replaces onnxruntime's `FastGelu(x, b)` with `0.5 * y * (1 + tanh(sqrt(2/pi) * (y + 0.044715 * y^3)))`, y = x + b."""

    name = "fast-gelu-unfuse"
    root_ops = ("FastGelu",)

    def rewrite(self, graph: Graph, match: Match, nodes: dict[str, gs.Node]) -> None:
        node = nodes[match.root]
        x = y = node.inputs[0]
        if has_input(node, 1):
            y = emit(graph, "Add", [y, node.inputs[1]])
        cube = emit(graph, "Pow", [y, _const(graph, 3.0, x, "three")])
        inner = emit(graph, "Add", [y, emit(graph, "Mul", [_const(graph, 0.044715, x, "k"), cube])])
        t = emit(graph, "Tanh", [emit(graph, "Mul", [inner, _const(graph, math.sqrt(2 / math.pi), x, "s")])])
        bracket = emit(graph, "Add", [t, _const(graph, 1.0, x, "one")])
        out = emit(graph, "Mul", [emit(graph, "Mul", [y, _const(graph, 0.5, x, "half")]), bracket])
        graph.replace_uses(node.outputs[0], out)


class BiasGeluUnfuse(_Unfuse):
    """Replaces onnxruntime's `BiasGelu(x, b)` with onnxruntime's `Gelu(Add(x, b))`."""

    name = "bias-gelu-unfuse"
    root_ops = ("BiasGelu",)
    contrib = True

    def rewrite(self, graph: Graph, match: Match, nodes: dict[str, gs.Node]) -> None:
        node = nodes[match.root]
        added = emit(graph, "Add", list(node.inputs[:2]))
        replace_typed(graph, node.outputs[0], emit(graph, "Gelu", [added], domain=MS))


class SkipLayerNormUnfuse(_Unfuse):
    """Replaces onnxruntime's `SkipLayerNormalization(x, skip, gamma, beta, bias)` with `LayerNormalization(x + skip + bias)`."""

    name = "skip-layernorm-unfuse"
    root_ops = ("SkipLayerNormalization",)

    def check(self, graph: Graph, node: gs.Node) -> Match | NoMatch:
        if graph.opset < 17:
            return self.no(node, "LayerNormalization needs opset 17")
        used = used_outputs(graph, node)
        if any(t is u for t in node.outputs[1:3] for u in used):
            return self.no(node, "the mean or inverse deviation output is used")
        if not is_float(node.inputs[0]) or len(node.inputs) < 3:
            return self.no(node, "not a float operator")
        return self.match([node])

    def rewrite(self, graph: Graph, match: Match, nodes: dict[str, gs.Node]) -> None:
        node = nodes[match.root]
        total = emit(graph, "Add", list(node.inputs[:2]))
        if has_input(node, 4):
            total = emit(graph, "Add", [total, node.inputs[4]])
        inputs = [total, node.inputs[2]] + ([node.inputs[3]] if has_input(node, 3) else [])
        out = emit(graph, "LayerNormalization", inputs, {"axis": -1, "epsilon": float(node.attrs.get("epsilon", 1e-12))})
        graph.replace_uses(node.outputs[0], out)
        if len(node.outputs) > 3 and (node.outputs[3].outputs or graph.is_output(node.outputs[3])):
            graph.replace_uses(node.outputs[3], total)


class AttentionUnfuse(_Unfuse):
    """Replaces onnxruntime's `MultiHeadAttention(q, k, v)` with its heads, scaled scores, Softmax and MatMuls.

    An `attention_bias` (input 5, an additive mask) is added to the scaled scores."""

    name = "attention-unfuse"
    root_ops = ("MultiHeadAttention",)

    def extra(self, graph: Graph, node: gs.Node) -> NoMatch | None:
        present = [i for i, t in enumerate(node.inputs) if t.name]
        if present not in ([0, 1, 2], [0, 1, 2, 5]) or node.attrs.get("unidirectional", 0):
            return self.no(node, "it takes more than unpacked Q, K, V and an attention bias (bias, key padding mask, "
                                 "past state) or is causal")
        shapes = [graph.shape(t) for t in node.inputs[:3]]
        heads = int(node.attrs.get("num_heads", 0))
        if any(s is None or len(s) != 3 for s in shapes) or heads <= 0 or shapes[0][2] % heads or (
                shapes[2][2] != shapes[0][2]):
            return self.no(node, "Q, K, V are not [B, S, hidden] with hidden divisible by the heads")
        return None

    def rewrite(self, graph: Graph, match: Match, nodes: dict[str, gs.Node]) -> None:
        node = nodes[match.root]
        q, k, v = node.inputs[:3]
        heads, hidden = int(node.attrs["num_heads"]), graph.shape(q)[2]
        size = hidden // heads
        scale = float(node.attrs.get("scale", 0.0) or 1 / math.sqrt(size))
        split = graph.add_constant(np.array([0, 0, heads, size], np.int64), "heads")

        def heads_of(t, perm):
            return emit(graph, "Transpose", [emit(graph, "Reshape", [t, split])], {"perm": perm})

        scores = emit(graph, "MatMul", [heads_of(q, [0, 2, 1, 3]), heads_of(k, [0, 2, 3, 1])])
        scores = emit(graph, "Mul", [scores, _const(graph, scale, q, "scale")])
        if has_input(node, 5):
            scores = emit(graph, "Add", [scores, node.inputs[5]])
        probs = emit(graph, "Softmax", [scores], {"axis": -1})
        context = emit(graph, "Transpose", [emit(graph, "MatMul", [probs, heads_of(v, [0, 2, 1, 3])])],
                       {"perm": [0, 2, 1, 3]})
        merged = graph.add_constant(np.array([0, 0, hidden], np.int64), "hidden")
        graph.replace_uses(node.outputs[0], emit(graph, "Reshape", [context, merged]))


# ------------------------------------------------------------------------------------------------------ RMSNorm
class RMSNormUnfuse(Rule):
    """Replaces onnxruntime's `SimplifiedLayerNormalization(x, w)` with `w * x / sqrt(mean(x^2) + eps)`.

    As the dynamo exporter writes transformers' RMSNorm (`Sqrt -> Reciprocal`), in float32 between Casts for a float16
    x (`stash_type` 1), so that rmsnorm-fusion finds it again.  The operator sits in the default domain."""

    name = "rmsnorm-unfuse"
    root_ops = ("SimplifiedLayerNormalization",)

    def check(self, graph: Graph, node: gs.Node) -> Match | NoMatch:
        if any(t is not node.outputs[0] for t in used_outputs(graph, node)):
            return self.no(node, "the inverse deviation output is used")
        shape, dtype = graph.shape(node.inputs[0]), np_dtype(node.inputs[0])
        if shape is None or dtype is None or dtype.kind != "f" or not has_input(node, 1):
            return self.no(node, "a float input of known shape and a scale are needed")
        axis = normalize_axis(node.attrs.get("axis", -1), len(shape))
        return self.no(node, "the axis is out of range") if axis is None else self.match([node], axis=axis)

    def rewrite(self, graph: Graph, match: Match, nodes: dict[str, gs.Node]) -> None:
        node = nodes[match.root]
        x, dtype = node.inputs[0], np.dtype(node.inputs[0].dtype)
        compute = np.dtype(np.float32) if dtype.itemsize < 4 and node.attrs.get("stash_type", 1) == 1 else dtype
        code = int(helper.np_dtype_to_tensor_dtype(compute))
        xc = emit(graph, "Cast", [x], {"to": code}) if compute != dtype else x
        axes = list(range(match.param("axis"), len(graph.shape(x))))
        square = emit(graph, "Pow", [xc, graph.add_constant(np.array(2.0, compute), "two")])
        if graph.opset >= 18:
            mean = emit(graph, "ReduceMean", [square, graph.add_constant(np.array(axes, np.int64), "axes")], {"keepdims": 1})
        else:
            mean = emit(graph, "ReduceMean", [square], {"axes": axes, "keepdims": 1})
        eps = graph.add_constant(np.array(float(node.attrs.get("epsilon", 1e-5)), compute), "eps")
        inverse = emit(graph, "Reciprocal", [emit(graph, "Sqrt", [emit(graph, "Add", [mean, eps])])])
        normed = emit(graph, "Mul", [xc, inverse])
        if compute != dtype:
            normed = emit(graph, "Cast", [normed], {"to": int(helper.np_dtype_to_tensor_dtype(dtype))})
        graph.replace_uses(node.outputs[0], emit(graph, "Mul", [node.inputs[1], normed]))


class SkipRMSNormUnfuse(Rule):
    """Replaces onnxruntime's `SkipSimplifiedLayerNormalization(x, skip, w, bias)` with `SimplifiedLayerNormalization(x + skip + bias, w)`."""

    name = "skip-rmsnorm-unfuse"
    root_ops = ("SkipSimplifiedLayerNormalization",)
    domains = (MS,)
    contrib = True

    def check(self, graph: Graph, node: gs.Node) -> Match | NoMatch:
        used = used_outputs(graph, node)
        if any(t is u for t in node.outputs[1:3] for u in used):
            return self.no(node, "the mean or inverse deviation output is used")
        if not is_float(node.inputs[0]) or not has_input(node, 2):
            return self.no(node, "not a float operator with its weight")
        return self.match([node])

    def rewrite(self, graph: Graph, match: Match, nodes: dict[str, gs.Node]) -> None:
        node = nodes[match.root]
        total = emit(graph, "Add", list(node.inputs[:2]))
        if has_input(node, 3):
            total = emit(graph, "Add", [total, node.inputs[3]])
        attrs = {"axis": -1, "epsilon": float(node.attrs.get("epsilon", 1e-5)), "stash_type": 1}
        replace_typed(graph, node.outputs[0], emit(graph, "SimplifiedLayerNormalization", [total, node.inputs[2]], attrs))
        if len(node.outputs) > 3 and (node.outputs[3].outputs or graph.is_output(node.outputs[3])):
            graph.replace_uses(node.outputs[3], total)


# ------------------------------------------------------------------------------------------------------- RoPE
class RotaryUnfuse(Rule):
    """Replaces a `RotaryEmbedding` (onnxruntime's or the standard one) with `x * cos + rotate_half(x) * sin`, cos and sin gathered from its tables.

    As rotary-fusion finds it again: `Unsqueeze(Concat(Gather(table, position_ids) twice), 1)`, the table used as it
    is, on [batch, heads, sequence, head size] inputs (a partial rotation Slices the head and Concats the rest back)."""

    name = "rotary-unfuse"
    root_ops = ("RotaryEmbedding",)
    domains = ("", "ai.onnx", MS)

    def check(self, graph: Graph, node: gs.Node) -> Match | NoMatch:
        contrib = node.domain == MS
        positions = node.inputs[1] if contrib else node.inputs[3] if has_input(node, 3) else None
        shape = graph.shape(node.inputs[0])
        if positions is None or len(graph.shape(positions) or ()) != 2 or shape is None or len(shape) != 4:
            return self.no(node, "not a 4-D input with [batch, sequence] position ids")
        if node.attrs.get("interleaved", 0) or node.attrs.get("is_packed_batching", 0) or node.attrs.get("scale", 1.0) != 1:
            return self.no(node, "interleaved, packed or scaled")
        table = graph.shape(node.inputs[2] if contrib else node.inputs[1])
        size = int(node.attrs.get("rotary_embedding_dim", 0)) or shape[3]
        if np_dtype(node.inputs[0]) not in (np.float32, np.float16) or table is None or len(table) != 2 or 2 * table[1] != size or (
                size > shape[3]):
            return self.no(node, "not a float32 or float16 rotation by 2-D tables of half the rotated size")
        return self.match([node], contrib=contrib, size=size, head=shape[3])

    def rewrite(self, graph: Graph, match: Match, nodes: dict[str, gs.Node]) -> None:
        node = nodes[match.root]
        x, size, head = node.inputs[0], match.param("size"), match.param("head")
        positions, cos, sin = [node.inputs[i] for i in ((1, 2, 3) if match.param("contrib") else (3, 1, 2))]

        def cut(t: gs.Tensor, start: int, end: int) -> gs.Tensor:
            bounds = [graph.add_constant(np.array([v], np.int64), "bound") for v in (start, end, 3)]
            return emit(graph, "Slice", [t, *bounds])

        def full(table: gs.Tensor) -> gs.Tensor:
            rows = emit(graph, "Gather", [table, positions], {"axis": 0})
            both = emit(graph, "Concat", [rows, rows], {"axis": -1})
            return emit(graph, "Unsqueeze", [both, graph.add_constant(np.array([1], np.int64), "axes")])

        part = x if size == head else cut(x, 0, size)
        half = size // 2
        rotated = emit(graph, "Concat", [emit(graph, "Neg", [cut(part, half, size)]), cut(part, 0, half)], {"axis": -1})
        out = emit(graph, "Add", [emit(graph, "Mul", [part, full(cos)]), emit(graph, "Mul", [rotated, full(sin)])])
        if size != head:
            out = emit(graph, "Concat", [out, cut(x, size, head)], {"axis": -1})
        graph.replace_uses(node.outputs[0], out)


class QuickGeluUnfuse(_Unfuse):
    """Replaces onnxruntime's `QuickGelu(x)` with `x * sigmoid(alpha * x)` (`x * sigmoid(x)` for alpha 1)."""

    name = "quick-gelu-unfuse"
    root_ops = ("QuickGelu",)

    def rewrite(self, graph: Graph, match: Match, nodes: dict[str, gs.Node]) -> None:
        node = nodes[match.root]
        x, alpha = node.inputs[0], float(node.attrs.get("alpha", 1.702))
        scaled = x if alpha == 1.0 else emit(graph, "Mul", [x, _const(graph, alpha, x, "alpha")])
        graph.replace_uses(node.outputs[0], emit(graph, "Mul", [x, emit(graph, "Sigmoid", [scaled])]))
