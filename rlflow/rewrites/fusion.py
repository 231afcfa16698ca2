"""onnxruntime-aware rules: fusions into standard operators (Gemm, LayerNormalization) and into onnxruntime's contrib
operators (Gelu, FastGelu, BiasGelu, SkipLayerNormalization, FusedConv, FusedGemm, FusedMatMul), plus their inverses
where the unfused form lets other rules merge; attention has its own module (`attention.py`).  Rules with `contrib = True` emit com.microsoft operators (onnxruntime only).
"""
from __future__ import annotations

import math

import numpy as np
import onnx_graphsurgeon as gs

from rlflow.graph import Graph
from rlflow.rewrites.base import Match, NoMatch, Rule
from rlflow.rewrites.util import (MS, bias_side, broadcast_shape, constant_input, dynamic_axes, emit, has_input,
                                  input_producer, int_list, is_float, is_standard, normalize_axis, perm_of, private,
                                  operand_tree, private_producer, replace_typed, scalar, standard_producer)


class MatMulAddToGemm(Rule):
    """Replaces `Add(MatMul(A, B), C)` on 2-D operands with `Gemm(A, B, C)`."""

    name = "matmul-add-to-gemm"
    category = "fusion"
    root_ops = ("Add",)

    def check(self, graph: Graph, node: gs.Node) -> Match | NoMatch:
        for side in (0, 1):
            matmul = private_producer(graph, node, side, "MatMul")
            if matmul is None:
                continue
            a, b, c = (graph.shape(t) for t in (*matmul.inputs, node.inputs[1 - side]))
            if a is None or b is None or len(a) != 2 or len(b) != 2 or not is_float(node.outputs[0]):
                return self.no(node, "the MatMul is not a float product of 2-D operands")
            out = (a[0], b[1])
            if c is None or len(c) > 2 or broadcast_shape(out, c) != out:
                return self.no(node, "the addend does not broadcast into the product's shape")
            return self.match([node, matmul], side=side)
        return self.no(node, "no input is a private MatMul")

    def rewrite(self, graph: Graph, match: Match, nodes: dict[str, gs.Node]) -> None:
        node, matmul = nodes[match.nodes[0]], nodes[match.nodes[1]]
        addend = node.inputs[1 - match.param("side")]
        graph.replace_uses(node.outputs[0], emit(graph, "Gemm", [*matmul.inputs, addend]))


class GemmToMatMulAdd(Rule):
    """Replaces `Gemm(A, B, C)` with `Add(MatMul(A, B'), C')`, folding transB, alpha and beta into constants."""

    name = "gemm-to-matmul-add"
    category = "fusion"
    root_ops = ("Gemm",)

    def check(self, graph: Graph, node: gs.Node) -> Match | NoMatch:
        if node.attrs.get("transA", 0):
            return self.no(node, "transA is set")
        b_const = constant_input(node, 1) is not None
        if not b_const and (node.attrs.get("transB", 0) or float(node.attrs.get("alpha", 1.0)) != 1.0):
            return self.no(node, "B is not constant but transposed or scaled")
        if has_input(node, 2) and constant_input(node, 2) is None and float(node.attrs.get("beta", 1.0)) != 1.0:
            return self.no(node, "C is not constant but scaled")
        if not is_float(node.outputs[0]):
            return self.no(node, "not a float Gemm")
        return self.match([node])

    def rewrite(self, graph: Graph, match: Match, nodes: dict[str, gs.Node]) -> None:
        node = nodes[match.root]
        b = node.inputs[1]
        weight = constant_input(node, 1)
        if weight is not None:
            value = weight.T if node.attrs.get("transB", 0) else weight
            value = (value.astype(np.float64) * float(node.attrs.get("alpha", 1.0))).astype(weight.dtype)
            b = graph.add_constant(np.ascontiguousarray(value), f"{node.name}_B")
        out = emit(graph, "MatMul", [node.inputs[0], b])
        if has_input(node, 2):
            c = node.inputs[2]
            bias = constant_input(node, 2)
            if bias is not None:
                c = graph.add_constant((bias.astype(np.float64) * float(node.attrs.get("beta", 1.0))).astype(bias.dtype),
                                       f"{node.name}_C")
            out = emit(graph, "Add", [out, c])
        graph.replace_uses(node.outputs[0], out)


def _reduce_axes(node: gs.Node, rank: int) -> tuple[int, ...] | None:
    axes = node.attrs.get("axes") if "axes" in node.attrs else (int_list(constant_input(node, 1))
                                                                if has_input(node, 1) else None)
    if axes is None or not node.attrs.get("keepdims", 1):
        return None
    normal = [normalize_axis(a, rank) for a in axes]
    return None if None in normal else tuple(sorted(normal))


def _operand(node: gs.Node, tensor: gs.Tensor) -> tuple[gs.Tensor, np.ndarray | None] | None:
    """For a binary node with `tensor` as one operand: (the other operand, its constant value or None)."""
    if len(node.inputs) != 2:
        return None
    if node.inputs[0] is tensor:
        other = node.inputs[1]
    elif node.inputs[1] is tensor:
        other = node.inputs[0]
    else:
        return None
    return other, Graph.constant(other)


class LayerNormFusion(Rule):
    """Replaces the decomposed layer norm `(x - mean) / sqrt(var + eps) * gamma + beta` with `LayerNormalization`."""

    name = "layernorm-fusion"
    category = "fusion"
    root_ops = ("Add",)

    def _pattern(self, graph: Graph, node: gs.Node):
        """The pattern's nodes and values, or a reason string."""
        mul = next((p for i in (0, 1) if (p := private_producer(graph, node, i, "Mul")) is not None), None)
        if mul is None:
            return "not an Add of a Mul (the scale) and a bias"
        beta = _operand(node, mul.outputs[0])
        div = next((p for i in (0, 1) if (p := private_producer(graph, mul, i, "Div")) is not None), None)
        if div is None or beta is None or beta[1] is None:
            return "not a scaled and shifted Div"
        gamma = _operand(mul, div.outputs[0])
        sub, sqrt = input_producer(div, 0, "Sub"), private_producer(graph, div, 1, "Sqrt")
        if gamma is None or gamma[1] is None or sub is None or sqrt is None:
            return "the normalisation is not (x - mean) / sqrt(...)"
        add_eps = private_producer(graph, sqrt, 0, "Add")
        var = next((p for i in (0, 1) if add_eps is not None and
                    (p := private_producer(graph, add_eps, i, "ReduceMean")) is not None), None)
        if var is None:
            return "no variance + epsilon under the Sqrt"
        eps = scalar(_operand(add_eps, var.outputs[0])[1])
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
        nodes, axis, eps, _, _ = found
        return self.match(nodes, axis=axis, epsilon=eps)

    def rewrite(self, graph: Graph, match: Match, nodes: dict[str, gs.Node]) -> None:
        node = nodes[match.root]
        found, axis, eps, gamma, beta = self._pattern(graph, node)
        x = found[3].inputs[0]
        normalized = graph.shape(x)[axis:]
        dtype = Graph.constant(gamma).dtype
        scale = graph.add_constant(np.broadcast_to(Graph.constant(gamma), normalized).astype(dtype), f"{node.name}_gamma")
        shift = graph.add_constant(np.broadcast_to(Graph.constant(beta), normalized).astype(dtype), f"{node.name}_beta")
        out = emit(graph, "LayerNormalization", [x, scale, shift], {"axis": axis, "epsilon": eps})
        graph.replace_uses(node.outputs[0], out)


class SkipLayerNormFusion(Rule):
    """Replaces `LayerNormalization(Add(a, b))` over the last axis with onnxruntime's `SkipLayerNormalization(a, b)`.

    The bias of a linear layer feeding either operand (`a = Add(MatMul(..), bias)`, as exporters write it) goes into the
    fused operator too.  Where the sum is read elsewhere as well (a pre-norm transformer's residual stream: DeiT,
    Whisper, GPT-2), those readers take it from the operator's fourth output."""

    name = "skip-layernorm-fusion"
    category = "fusion"
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
        if not match.param("shared"):
            replace_typed(graph, node.outputs[0], emit(graph, "SkipLayerNormalization", inputs, attrs, domain=MS))
            return
        out, _, _, total = graph.add_node("SkipLayerNormalization", inputs, [
            gs.Variable(graph.fresh_name("skip_ln")), gs.Variable.empty(), gs.Variable.empty(),
            gs.Variable(graph.fresh_name("skip_sum"))], attrs, domain=MS)
        replace_typed(graph, node.outputs[0], out)
        replace_typed(graph, add.outputs[0], total)


def _close(value: float | None, target: float) -> bool:
    return value is not None and math.isclose(value, target, rel_tol=1e-3)


class _GeluBase(Rule):
    """`0.5 * x * (1 + f(x))` as a tree of Muls: subclasses say what f must be."""

    category = "fusion"
    root_ops = ("Mul",)
    contrib = True
    fused_op = ""
    inner_op = ""

    def inner(self, graph: Graph, node: gs.Node, x: gs.Tensor) -> list[gs.Node] | None:
        """The nodes computing f(x) from the `inner_op` node, or None when it is not f."""
        raise NotImplementedError

    def _pattern(self, graph: Graph, node: gs.Node) -> tuple[list[gs.Node], gs.Tensor] | str:
        factors, muls = operand_tree(graph, node)
        if len(factors) != 3:
            return "not a product of three factors"
        half = [t for t in factors if _close(scalar(Graph.constant(t)), 0.5)]
        plus = [p for t in factors if (p := standard_producer(t)) is not None and p.op == "Add" and private(graph, t)]
        if len(half) != 1 or len(plus) != 1:
            return "not 0.5 * x * (1 + ...)"
        rest = [t for t in factors if t is not half[0] and standard_producer(t) is not plus[0]]
        x = rest[0] if len(rest) == 1 else None
        add = plus[0]
        core = next((p for i in (0, 1) if (p := private_producer(graph, add, i, self.inner_op)) is not None), None)
        if x is None or core is None or not _close(scalar(_operand(add, core.outputs[0])[1]), 1.0):
            return f"the bracket is not 1 + {self.inner_op}(...)"
        inner = self.inner(graph, core, x)
        if inner is None or not is_float(x):
            return f"the {self.inner_op} argument is not the expected function of x"
        return [*muls, add, core, *inner], x

    def check(self, graph: Graph, node: gs.Node) -> Match | NoMatch:
        found = self._pattern(graph, node)
        if isinstance(found, str):
            return self.no(node, found)
        return self.match(found[0])

    def rewrite(self, graph: Graph, match: Match, nodes: dict[str, gs.Node]) -> None:
        node = nodes[match.root]
        _, x = self._pattern(graph, node)
        replace_typed(graph, node.outputs[0], emit(graph, self.fused_op, [x], domain=MS))


def _scaled(graph: Graph, tensor: gs.Tensor, x: gs.Tensor, factor: float) -> gs.Node | None:
    """The private node computing `x * factor` (as Mul or Div) that produces `tensor`, or None."""
    producer = standard_producer(tensor)
    if producer is None or producer.op not in ("Mul", "Div") or not private(graph, tensor):
        return None
    if producer.op == "Div":
        return producer if producer.inputs[0] is x and _close(scalar(constant_input(producer, 1)), 1 / factor) else None
    other = _operand(producer, x)
    return producer if other is not None and _close(scalar(other[1]), factor) else None


class GeluFusion(_GeluBase):
    """Replaces `0.5 * x * (1 + erf(x / sqrt(2)))` with onnxruntime's `Gelu(x)`."""

    name = "gelu-fusion"
    fused_op = "Gelu"
    inner_op = "Erf"

    def inner(self, graph: Graph, node: gs.Node, x: gs.Tensor) -> list[gs.Node] | None:
        scaled = _scaled(graph, node.inputs[0], x, 1 / math.sqrt(2))
        return [scaled] if scaled is not None else None


class FastGeluFusion(_GeluBase):
    """Replaces `0.5 * x * (1 + tanh(sqrt(2/pi) * (x + 0.044715 * x^3)))` with onnxruntime's `FastGelu(x)`.

    x^3 is `Pow(x, 3)` (Hugging Face's `gelu_new`) or `x * x * x` (models that write the cube as products)."""

    name = "fast-gelu-fusion"
    fused_op = "FastGelu"
    inner_op = "Tanh"

    def inner(self, graph: Graph, node: gs.Node, x: gs.Tensor) -> list[gs.Node] | None:
        outer = standard_producer(node.inputs[0])
        if outer is None or outer.op != "Mul" or not private(graph, node.inputs[0]):
            return None
        for i in (0, 1):
            add = private_producer(graph, outer, i, "Add")
            if add is None or not _close(scalar(constant_input(outer, 1 - i)), math.sqrt(2 / math.pi)):
                continue
            rest = _operand(add, x)
            cubic = _cubic_term(graph, rest[0], x) if rest is not None else None
            return [outer, add, *cubic] if cubic is not None else None
        return None


def _cubic_term(graph: Graph, tensor: gs.Tensor, x: gs.Tensor) -> list[gs.Node] | None:
    """The private nodes computing `0.044715 * x^3` that produce `tensor`, x^3 as `Pow(x, 3)` or as `x * x * x`; or
    None."""
    cubic = standard_producer(tensor)
    if cubic is None or cubic.op != "Mul" or not private(graph, tensor):
        return None
    factors, tree = operand_tree(graph, cubic, depth=3)
    coefficient = [t for t in factors if _close(scalar(Graph.constant(t)), 0.044715)]
    rest = [t for t in factors if all(t is not c for c in coefficient)]
    if len(coefficient) != 1:
        return None
    if len(rest) == 3 and all(t is x for t in rest):
        return tree
    power = standard_producer(rest[0]) if len(rest) == 1 else None
    if (power is not None and power.op == "Pow" and private(graph, rest[0]) and power.inputs[0] is x
            and _close(scalar(constant_input(power, 1)), 3.0)):
        return [*tree, power]
    return None


_ACTIVATIONS = {"Relu": (), "Sigmoid": (), "Tanh": (), "LeakyRelu": (("alpha", 0.01),),
                "HardSigmoid": (("alpha", 0.2), ("beta", 0.5))}


def _activation_params(node: gs.Node) -> list[float] | None:
    """FusedConv's activation_params for an activation node (Clip needs constant bounds), or None if unsupported."""
    if node.op == "Clip":
        low, high = constant_input(node, 1), constant_input(node, 2)
        if (len(node.inputs) > 1 and node.inputs[1].name and low is None) or (
                len(node.inputs) > 2 and node.inputs[2].name and high is None):
            return None
        if any(bound is not None and bound.size != 1 for bound in (low, high)):
            return None
        low, high = (bound.reshape(-1)[0] if bound is not None else None for bound in (low, high))
        return [float(low) if low is not None else -3.4028234663852886e38,
                float(high) if high is not None else 3.4028234663852886e38]
    if node.op not in _ACTIVATIONS:
        return None
    return [float(node.attrs.get(key, default)) for key, default in _ACTIVATIONS[node.op]]


class ConvActivationFusion(Rule):
    """Replaces `act(Conv(x, W, b))` with onnxruntime's `FusedConv(x, W, b, activation=act)`."""

    name = "conv-activation-fusion"
    category = "fusion"
    root_ops = ("Relu", "Sigmoid", "Tanh", "LeakyRelu", "HardSigmoid", "Clip")
    contrib = True

    def check(self, graph: Graph, node: gs.Node) -> Match | NoMatch:
        conv = private_producer(graph, node, 0, "Conv")
        if conv is None:
            return self.no(node, "input is not a private Conv")
        if _activation_params(node) is None or not is_float(node.outputs[0]) or np.dtype(node.outputs[0].dtype) != np.float32:
            return self.no(node, "a float32 activation with constant parameters is needed")
        return self.match([node, conv])

    def rewrite(self, graph: Graph, match: Match, nodes: dict[str, gs.Node]) -> None:
        node, conv = nodes[match.nodes[0]], nodes[match.nodes[1]]
        attrs = {**conv.attrs, "activation": node.op}
        params = _activation_params(node)
        if params:
            attrs["activation_params"] = params
        replace_typed(graph, node.outputs[0], emit(graph, "FusedConv", list(conv.inputs), attrs, domain=MS))


class GemmActivationFusion(Rule):
    """Replaces `act(Gemm(A, B, C))` with onnxruntime's `FusedGemm(A, B, C, activation=act)`."""

    name = "gemm-activation-fusion"
    cuda = False  # onnxruntime has FusedGemm on the CPU only (docs/OperatorKernels.md)
    category = "fusion"
    root_ops = ("Relu", "Sigmoid", "Tanh", "LeakyRelu", "HardSigmoid")
    contrib = True

    def check(self, graph: Graph, node: gs.Node) -> Match | NoMatch:
        gemm = private_producer(graph, node, 0, "Gemm")
        if gemm is None:
            return self.no(node, "input is not a private Gemm")
        if not is_float(node.outputs[0]) or np.dtype(node.outputs[0].dtype) != np.float32:
            return self.no(node, "not a float32 Gemm")
        return self.match([node, gemm])

    def rewrite(self, graph: Graph, match: Match, nodes: dict[str, gs.Node]) -> None:
        node, gemm = nodes[match.nodes[0]], nodes[match.nodes[1]]
        attrs = {**gemm.attrs, "activation": node.op}
        for (key, _), value in zip(_ACTIVATIONS[node.op], _activation_params(node)):
            attrs[f"activation_{key}"] = value
        replace_typed(graph, node.outputs[0], emit(graph, "FusedGemm", list(gemm.inputs), attrs, domain=MS))


class MatMulTransposeFusion(Rule):
    """Replaces `MatMul(Transpose(A), B)` (last two axes swapped, either operand) with `FusedMatMul(A, B, transA)`."""

    name = "matmul-transpose-fusion"
    category = "fusion"
    root_ops = ("MatMul",)
    contrib = True

    def check(self, graph: Graph, node: gs.Node) -> Match | NoMatch:
        shapes = [graph.shape(t) for t in node.inputs]
        if any(s is None or len(s) < 2 for s in shapes) or not is_float(node.outputs[0]):
            return self.no(node, "operands of unknown rank, rank below 2, or not float")
        flags, parts = [], []
        for i in (0, 1):
            t = private_producer(graph, node, i, "Transpose")
            rank = len(shapes[i])
            swaps = t is not None and perm_of(t, rank) == (*range(rank - 2), rank - 1, rank - 2) and len(
                graph.shape(t.inputs[0]) or ()) == rank
            flags.append(int(swaps))
            if swaps:
                parts.append(t)
        if not parts:
            return self.no(node, "no operand is a private Transpose of its last two axes")
        return self.match([node, *parts], trans_a=flags[0], trans_b=flags[1])

    def rewrite(self, graph: Graph, match: Match, nodes: dict[str, gs.Node]) -> None:
        node = nodes[match.root]
        flags = (match.param("trans_a"), match.param("trans_b"))
        inputs = [standard_producer(t).inputs[0] if flag else t for t, flag in zip(node.inputs, flags)]
        out = emit(graph, "FusedMatMul", inputs, {"transA": flags[0], "transB": flags[1], "alpha": 1.0}, domain=MS)
        replace_typed(graph, node.outputs[0], out)


RULES = (MatMulAddToGemm(), GemmToMatMulAdd(), LayerNormFusion(), SkipLayerNormFusion(), GeluFusion(), FastGeluFusion(),
         ConvActivationFusion(), GemmActivationFusion(), MatMulTransposeFusion())


class _BiasActivationFusion(Rule):
    """`f(Add(x, b))` with b a constant vector over the last axis, for an onnxruntime activation f taking a bias; f is
    onnxruntime's operator, the standard `Gelu` of opset 20 (with the matching `approximate`) or its decomposition."""

    category = "fusion"
    contrib = True
    domains = ("", "ai.onnx", MS)
    fused_op = ""
    approximate = ""
    decomposed: _GeluBase

    def _activation(self, graph: Graph, node: gs.Node) -> tuple[list[gs.Node], gs.Tensor] | str:
        """(the activation's nodes, its argument) rooted at `node`, or why not."""
        if node.op == "Mul":
            if not is_standard(node):
                return "not a standard Mul"
            found = self.decomposed._pattern(graph, node)
            if isinstance(found, str):
                return found
            nodes, x = found
            inside = {n.name for n in nodes}
            if graph.is_output(x) or any(n.name not in inside for n in x.outputs):
                return "the activation's argument is read elsewhere too"
            return nodes, x
        if is_standard(node) and node.attrs.get("approximate", "none") != self.approximate:
            return f"a standard Gelu whose approximation is not '{self.approximate}'"
        if len(node.inputs) > 1 and node.inputs[1].name:
            return "it already has a bias"
        return [node], node.inputs[0]

    def check(self, graph: Graph, node: gs.Node) -> Match | NoMatch:
        found = self._activation(graph, node)
        if isinstance(found, str):
            return self.no(node, found)
        nodes, x = found
        add = standard_producer(x)
        if add is None or add.op != "Add" or (len(nodes) == 1 and not private(graph, x)):
            return self.no(node, "input is not a private Add")
        side = bias_side(graph, add)
        if side is None:
            return self.no(node, "the Add is not of a float32 constant vector over the last axis")
        return self.match([*nodes, add], side=side)

    def rewrite(self, graph: Graph, match: Match, nodes: dict[str, gs.Node]) -> None:
        node, add = nodes[match.nodes[0]], nodes[match.nodes[-1]]
        side = match.param("side")
        out = emit(graph, self.fused_op, [add.inputs[1 - side], add.inputs[side]], domain=MS)
        replace_typed(graph, node.outputs[0], out)


class BiasGeluFusion(_BiasActivationFusion):
    """Replaces `Gelu(Add(x, b))` with onnxruntime's `BiasGelu(x, b)` for a constant vector b over the last axis.

    Gelu is onnxruntime's, opset 20's, or its formula `0.5 * y * (1 + erf(y / sqrt(2)))` as exporters write it."""

    name = "bias-gelu-fusion"
    root_ops = ("Gelu", "Mul")
    fused_op = "BiasGelu"
    approximate = "none"
    decomposed = GeluFusion()


class BiasFastGeluFusion(_BiasActivationFusion):
    """Replaces `FastGelu(Add(x, b))` with onnxruntime's `FastGelu(x, b)` for a constant vector b over the last axis.

    FastGelu is onnxruntime's, opset 20's `Gelu` with approximate='tanh', or its tanh formula."""

    name = "bias-fast-gelu-fusion"
    root_ops = ("FastGelu", "Gelu", "Mul")
    fused_op = "FastGelu"
    approximate = "tanh"
    decomposed = FastGeluFusion()

    def check(self, graph: Graph, node: gs.Node) -> Match | NoMatch:
        if node.op == "Gelu" and not is_standard(node):
            return self.no(node, "onnxruntime's Gelu is exact, not the tanh approximation")
        if node.op == "FastGelu" and is_standard(node):
            return self.no(node, "not onnxruntime's FastGelu")
        return super().check(graph, node)


NEW_RULES = (BiasGeluFusion(), BiasFastGeluFusion())
"""Fusion rules added later (appended at the end of the registry)."""
