"""Inverse rules: split a merged operator and undo fusions, so that a sequence can pass through a slower graph to reach
a faster one (as TASO's search does).

The rules that undo onnxruntime's contrib fusions root at com.microsoft operators (`domains`) and emit the standard
form that the matching fusion rule recognises again, so every fusion can be taken back.  Each rule's category is that
of what it undoes (merge, layout, fusion); the registry's `GROUPS["inverse"]` lists them together.
"""
from __future__ import annotations

import math

import numpy as np
import onnx_graphsurgeon as gs

from rlflow.graph import Graph
from rlflow.rewrites.base import Match, NoMatch, Rule
from rlflow.rewrites.util import (MS, broadcast_shape, constant_input, conv_params, dynamic_axes, emit, has_input,
                                  input_producer, is_float, private, replace_all, replace_typed, split_sizes,
                                  used_outputs)


# --------------------------------------------------------------------------------------------- merged operators
def _split_of(graph: Graph, node: gs.Node) -> tuple[int, tuple[int, ...]] | str:
    """(axis, sizes) of a Split into two or more static parts, or a reason."""
    info = split_sizes(graph, node)
    if info is None or len(info[1]) < 2:
        return "the Split's sizes are unknown or it has one part"
    moved = dynamic_axes(graph, node.inputs[0])
    if moved is None or moved[info[0]]:
        return "the split axis is dynamic"
    return info


def _slices(sizes) -> list[slice]:
    offsets = np.cumsum((0, *sizes))
    return [slice(int(a), int(b)) for a, b in zip(offsets[:-1], offsets[1:])]


def _part(array: np.ndarray, axis: int, piece: slice, full: int) -> np.ndarray:
    """`array[..., piece, ...]` along `axis` when that axis has the full length, else the array (it broadcasts)."""
    if array.ndim == 0 or array.shape[axis] != full:
        return array
    index = [slice(None)] * array.ndim
    index[axis] = piece
    return np.ascontiguousarray(array[tuple(index)])


class MatMulSplitUnmerge(Rule):
    """Replaces `Split(X.W (+ b))` along the last axis with one `X.W_i (+ b_i)` per part, W and b constants."""

    name = "matmul-split-unmerge"
    category = "merge"
    root_ops = ("Split",)

    def check(self, graph: Graph, node: gs.Node) -> Match | NoMatch:
        producer = input_producer(node, 0, ("MatMul", "Add"))
        if producer is None or not private(graph, node.inputs[0]):
            return self.no(node, "input is not a private MatMul (or Add of one)")
        nodes, side = [node], -1
        if producer.op == "Add":
            matmul = next((m for i in (0, 1) if (m := input_producer(producer, i, "MatMul")) is not None
                           and constant_input(producer, 1 - i) is not None), None)
            if matmul is None or not private(graph, matmul.outputs[0]):
                return self.no(node, "input is not a private MatMul (or Add of one)")
            side = 1 - list(producer.inputs).index(matmul.outputs[0])
            shape, bias = graph.shape(producer.outputs[0]), constant_input(producer, side)
            if shape is None or broadcast_shape(shape, bias.shape) != shape:
                return self.no(node, "the bias changes the product's shape")
            nodes.append(producer)
        else:
            matmul = producer
        weight = constant_input(matmul, 1)
        if weight is None or weight.ndim != 2 or not is_float(matmul.outputs[0]):
            return self.no(node, "the weights are not a constant float matrix")
        found = _split_of(graph, node)
        if isinstance(found, str):
            return self.no(node, found)
        axis, sizes = found
        if axis != len(graph.shape(node.inputs[0])) - 1:
            return self.no(node, "the Split is not along the last axis")
        return self.match([*nodes, matmul], side=side, sizes=sizes)

    def rewrite(self, graph: Graph, match: Match, nodes: dict[str, gs.Node]) -> None:
        split, matmul = nodes[match.root], nodes[match.nodes[-1]]
        weight, side = constant_input(matmul, 1), match.param("side")
        bias = constant_input(nodes[match.nodes[1]], side) if side >= 0 else None
        parts = []
        for k, piece in enumerate(_slices(match.param("sizes"))):
            w = graph.add_constant(np.ascontiguousarray(weight[:, piece]), f"{matmul.name}_W{k}")
            out = emit(graph, "MatMul", [matmul.inputs[0], w])
            if bias is not None:
                b = graph.add_constant(_part(bias, -1, piece, weight.shape[1]), f"{matmul.name}_b{k}")
                out = emit(graph, "Add", [out, b] if side == 1 else [b, out])
            parts.append(out)
        replace_all(graph, split.outputs, parts)


class _SplitUnmerge(Rule):
    """`Split(op(x, W, b))` along op's output channels, W and b constants: one op per part on slices of W and b."""

    category = "merge"
    root_ops = ("Split",)
    op = ""
    axis_name = ""

    def refuse(self, graph: Graph, producer: gs.Node) -> str | None:
        """A reason the producer cannot be split, or None."""
        return None

    def weight_axis(self, producer: gs.Node) -> int:
        """The axis of W that holds the output channels."""
        return 0

    def check(self, graph: Graph, node: gs.Node) -> Match | NoMatch:
        producer = input_producer(node, 0, self.op)
        if producer is None or not private(graph, node.inputs[0]):
            return self.no(node, f"input is not a private {self.op}")
        if constant_input(producer, 1) is None or (has_input(producer, 2) and constant_input(producer, 2) is None):
            return self.no(node, f"the {self.op}'s weights or bias are not constant")
        reason = self.refuse(graph, producer)
        found = _split_of(graph, node) if reason is None else reason
        if isinstance(found, str):
            return self.no(node, found)
        if found[0] != 1:
            return self.no(node, f"the Split is not along the {self.axis_name}")
        return self.match([node, producer], sizes=found[1])

    def rewrite(self, graph: Graph, match: Match, nodes: dict[str, gs.Node]) -> None:
        split, producer = nodes[match.nodes[0]], nodes[match.nodes[1]]
        weight = constant_input(producer, 1)
        bias = constant_input(producer, 2) if has_input(producer, 2) else None
        channels = sum(match.param("sizes"))
        parts = []
        for k, piece in enumerate(_slices(match.param("sizes"))):
            w = _part(weight, self.weight_axis(producer), piece, channels)
            inputs = [producer.inputs[0], graph.add_constant(w, f"{producer.name}_W{k}")]
            if bias is not None:
                inputs.append(graph.add_constant(_part(bias, -1, piece, channels), f"{producer.name}_B{k}"))
            parts.append(emit(graph, self.op, inputs, dict(producer.attrs)))
        replace_all(graph, split.outputs, parts)


class GemmSplitUnmerge(_SplitUnmerge):
    """Replaces `Split(Gemm(A, B, C))` along the columns with one `Gemm(A, B_i, C_i)` per part, B and C constants."""

    name = "gemm-split-unmerge"
    op = "Gemm"
    axis_name = "columns"

    def weight_axis(self, producer: gs.Node) -> int:
        return 0 if producer.attrs.get("transB", 0) else 1


class ConvSplitUnmerge(_SplitUnmerge):
    """Replaces `Split(Conv(x, W, b))` along the channels with one `Conv(x, W_i, b_i)` per part, W and b constants."""

    name = "conv-split-unmerge"
    op = "Conv"
    axis_name = "channels"

    def refuse(self, graph: Graph, producer: gs.Node) -> str | None:
        params = conv_params(graph, producer)
        return "the Conv is grouped or its geometry unknown" if params is None or params["group"] != 1 else None


class GemmReshapeToMatMul(Rule):
    """Replaces `Reshape(Gemm(Reshape(X, [-1, K]), W, b), [..., N])` with `Add(MatMul(X, W), b)` for X of rank 3+."""

    name = "gemm-reshape-to-matmul"
    category = "layout"
    root_ops = ("Reshape",)

    def check(self, graph: Graph, node: gs.Node) -> Match | NoMatch:
        gemm = input_producer(node, 0, "Gemm")
        if gemm is None or not private(graph, node.inputs[0]):
            return self.no(node, "input is not a private Gemm")
        rows = input_producer(gemm, 0, "Reshape")
        if rows is None or not private(graph, gemm.inputs[0]):
            return self.no(node, "the Gemm's A is not a private Reshape")
        bias = constant_input(gemm, 2) if has_input(gemm, 2) else np.zeros(1, np.float32)
        if gemm.attrs.get("transA", 0) or constant_input(gemm, 1) is None or bias is None or (
                bias.ndim == 2 and bias.shape[0] != 1):
            return self.no(node, "transA is set, B is not constant, or C is not a constant row vector")
        x, out = rows.inputs[0], node.outputs[0]
        shapes = [graph.shape(t) for t in (x, gemm.inputs[0], gemm.outputs[0], out)]
        if any(s is None for s in shapes) or len(shapes[0]) < 3 or not is_float(out):
            return self.no(node, "shapes unknown, not float, or X below rank 3")
        x_shape, a_shape, y_shape, out_shape = shapes
        if a_shape[1] != x_shape[-1] or out_shape != (*x_shape[:-1], y_shape[1]):
            return self.no(node, "the Reshapes do not flatten X's leading dimensions and restore them")
        moved_x, moved_out = dynamic_axes(graph, x), dynamic_axes(graph, out)
        if moved_x is None or moved_x[-1] or moved_out != (*moved_x[:-1], False):
            return self.no(node, "the output does not follow X's dynamic dimensions")
        return self.match([node, gemm, rows])

    def rewrite(self, graph: Graph, match: Match, nodes: dict[str, gs.Node]) -> None:
        node, gemm, rows = (nodes[n] for n in match.nodes)
        weight = constant_input(gemm, 1)
        value = weight.T if gemm.attrs.get("transB", 0) else weight
        value = (value.astype(np.float64) * float(gemm.attrs.get("alpha", 1.0))).astype(weight.dtype)
        out = emit(graph, "MatMul", [rows.inputs[0], graph.add_constant(np.ascontiguousarray(value), f"{gemm.name}_W")])
        if has_input(gemm, 2):
            bias = constant_input(gemm, 2)
            bias = (bias.astype(np.float64) * float(gemm.attrs.get("beta", 1.0))).astype(bias.dtype)
            out = emit(graph, "Add", [out, graph.add_constant(bias.reshape(-1), f"{gemm.name}_b")])
        graph.replace_uses(node.outputs[0], out)


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
    category = "fusion"
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
    category = "fusion"
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
    category = "fusion"
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

    category = "fusion"
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


RULES = (MatMulSplitUnmerge(), GemmSplitUnmerge(), ConvSplitUnmerge(), GemmReshapeToMatMul(), FusedConvUnfuse(),
         FusedGemmUnfuse(), FusedMatMulUnfuse(), GeluUnfuse(), FastGeluUnfuse(), BiasGeluUnfuse(), SkipLayerNormUnfuse(),
         AttentionUnfuse())
"""The inverse rules, in registry order."""
