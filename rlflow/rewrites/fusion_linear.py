"""Fusions around the linear operators: a bias into Gemm (and back), an activation into onnxruntime's FusedConv and
FusedGemm, a transposed operand into FusedMatMul."""
from __future__ import annotations

import math

import numpy as np
import onnx_graphsurgeon as gs

from rlflow.graph.core import Graph
from rlflow.rewrites.base import Match, NoMatch, Rule
from rlflow.rewrites.edits import emit, gemm_bias, gemm_weight, replace_typed
from rlflow.rewrites.queries import (
    MS,
    broadcast_shape,
    constant_input,
    has_input,
    is_float,
    perm_of,
    private_producer,
    standard_producer,
)


class MatMulAddToGemm(Rule):
    """Replaces `Add(MatMul(A, B), C)` on 2-D operands with `Gemm(A, B, C)`.

        A --> MatMul(., B) --> Add(., C)      (A and B 2-D, C broadcast into the product's shape)

    Both torch exporters already write `nn.Linear` on a 2-D input as one Gemm; the pattern comes from `x @ W + b`
    written out in a model, and from other rules (`gemm-to-matmul-add`, the unfusing inverses) taking a Gemm apart.
    """

    name = "matmul-add-to-gemm"
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
        out = emit(graph, "MatMul", [node.inputs[0], gemm_weight(graph, node)])
        if has_input(node, 2):
            out = emit(graph, "Add", [out, gemm_bias(graph, node)])
        graph.replace_uses(node.outputs[0], out)


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
    """Replaces `act(Conv(x, W, b))` with onnxruntime's `FusedConv(x, W, b, activation=act)`.

        x --> Conv(., W, b) --> act      (Relu, Sigmoid, Tanh, LeakyRelu, HardSigmoid; Clip with constant bounds)

    Exporters write a convolution and its activation as two nodes (ReLU6 as Clip(0, 6)); where a BatchNormalization
    sits between them, as torch.onnx.export leaves it with training=PRESERVE, `conv-bn-fold` removes it first.
    """

    name = "conv-activation-fusion"
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
    """Replaces `act(Gemm(A, B, C))` with onnxruntime's `FusedGemm(A, B, C, activation=act)`.

        A --> Gemm(., B, C) --> act      (Relu, Sigmoid, Tanh, LeakyRelu, HardSigmoid)

    Both torch exporters write a 2-D `nn.Linear` and its activation this way: BERT's pooler is `Tanh(Gemm(..))`.
    """

    name = "gemm-activation-fusion"
    cuda = False  # onnxruntime has FusedGemm on the CPU only (docs/OperatorKernels.md)
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


FUSED_CONSTANT_MIN_ROWS = 32
"""Rows of A from which `matmul-transpose-fusion` fuses a transposed constant B: between the 1 where it lost and the
128 where it paid; rows in between are not measured."""


class MatMulTransposeFusion(Rule):
    """Replaces `MatMul(Transpose(A), B)` (last two axes swapped, either operand) with `FusedMatMul(A, B, transA)`.

        A --> Transpose(perm=[.., -1, -2]) --> MatMul(., B)      (or B transposed, or both)

    A model that multiplies by a transposed tensor writes this, through either exporter: the zoo's GPT-2
    (TorchScript) computes its tied language-model head as `wte @ h^T`, to keep one copy of the embedding table.
    A transposed constant B is fused only for products of at least FUSED_CONSTANT_MIN_ROWS rows: onnxruntime folds
    that Transpose when it loads the model, and on the CPU FusedMatMul over the table ran slower than the MatMul over
    the folded one for the one row of a decode step, faster for the 128 of a prefill (Qwen3's tied head:
    docs/results/fuse-variants/qwen3-decode/).  A transposed constant A is left alone.
    """

    name = "matmul-transpose-fusion"
    root_ops = ("MatMul",)
    contrib = True

    def check(self, graph: Graph, node: gs.Node) -> Match | NoMatch:
        shapes = [graph.shape(t) for t in node.inputs]
        if any(s is None or len(s) < 2 for s in shapes) or not is_float(node.outputs[0]):
            return self.no(node, "operands of unknown rank, rank below 2, or not float")
        flags, parts, constant = [], [], False
        rows = math.prod(shapes[0][:-1])  # of the product: a decode step's 1, a prefill's sequence
        for i in (0, 1):
            t = private_producer(graph, node, i, "Transpose")
            rank = len(shapes[i])
            swaps = t is not None and perm_of(t, rank) == (*range(rank - 2), rank - 1, rank - 2) and len(
                graph.shape(t.inputs[0]) or ()) == rank
            if swaps and isinstance(t.inputs[0], gs.Constant) and (i == 0 or rows < FUSED_CONSTANT_MIN_ROWS):
                swaps, constant = False, True
            flags.append(int(swaps))
            if swaps:
                parts.append(t)
        if not parts:
            return self.no(node, "the transposed operand is a constant, whose Transpose onnxruntime folds at load "
                           f"(fused only as B for {FUSED_CONSTANT_MIN_ROWS} rows or more)"
                           if constant else "no operand is a private Transpose of its last two axes")
        return self.match([node, *parts], trans_a=flags[0], trans_b=flags[1])

    def rewrite(self, graph: Graph, match: Match, nodes: dict[str, gs.Node]) -> None:
        node = nodes[match.root]
        flags = (match.param("trans_a"), match.param("trans_b"))
        inputs = [standard_producer(t).inputs[0] if flag else t for t, flag in zip(node.inputs, flags)]
        out = emit(graph, "FusedMatMul", inputs, {"transA": flags[0], "transB": flags[1], "alpha": 1.0}, domain=MS)
        replace_typed(graph, node.outputs[0], out)
