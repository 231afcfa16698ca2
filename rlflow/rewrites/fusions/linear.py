"""Fusions around the linear operators: a bias into Gemm (and back), an activation into onnxruntime's FusedConv and
FusedGemm, a transposed operand into FusedMatMul, a tied head onto its embedding table."""
from __future__ import annotations

import math
import weakref

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


FUSED_CONSTANT_MIN_ROWS = 2
"""Rows of A from which a transposed constant B is read through `FusedMatMul(transB)`: where onnxruntime does not
pre-pack weights (rlflow's sessions of models of 1 GiB of weights or more, which share them), it ran faster than the
MatMul over the transposed table from 2 rows on and slower for one row, a tied head at the decoders' widths;
pre-packed, the two ran alike."""


class MatMulTransposeFusion(Rule):
    """Replaces `MatMul(Transpose(A), B)` (last two axes swapped, either operand) with `FusedMatMul(A, B, transA)`.

        A --> Transpose(perm=[.., -1, -2]) --> MatMul(., B)      (or B transposed, or both)

    A model that multiplies by a transposed tensor writes this, through either exporter: the zoo's GPT-2
    (TorchScript) computes its tied language-model head as `wte @ h^T`, to keep one copy of the embedding table.
    A transposed constant B (onnxruntime folds its Transpose at load) is fused only for products of at least
    FUSED_CONSTANT_MIN_ROWS rows: for the one row of a batch-1 decode step the MatMul over the folded table ran faster.
    A transposed constant A is left alone.
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


class TiedHeadFusion(Rule):
    """Replaces `MatMul(X, T)` by `FusedMatMul(X, E, transB=1)` where T is a copy of the embedding table E transposed.

    E is a constant a Gather of the graph reads, T a constant equal to its transpose:

        E --> Gather(., ids) ...        X --> MatMul(., T)      (T == E^T, both constants)

    A model with tied embeddings computes its language-model head over the embedding table; the TorchScript exporter
    writes that table twice, E for the Gather and E^T for the head (622 MB more on Qwen3-0.6B).  Reading E itself
    keeps one copy; as for `matmul-transpose-fusion`, only from FUSED_CONSTANT_MIN_ROWS rows of X.
    """

    name = "tied-head-fusion"
    root_ops = ("MatMul",)
    contrib = True

    def check(self, graph: Graph, node: gs.Node) -> Match | NoMatch:
        head, shape = node.inputs[1], graph.shape(node.inputs[0])
        if not isinstance(head, gs.Constant) or len(head.shape) != 2 or shape is None or len(shape) < 2 or not \
                is_float(node.outputs[0]):
            return self.no(node, "B is not a constant matrix, or A is of unknown rank or not float")
        if math.prod(shape[:-1]) < FUSED_CONSTANT_MIN_ROWS:
            return self.no(node, "one row of A, where the MatMul over the transposed table ran faster")
        if _tied_table(graph, head) is None:
            return self.no(node, "B is not the transpose of an embedding table a Gather reads")
        return self.match([node])

    def rewrite(self, graph: Graph, match: Match, nodes: dict[str, gs.Node]) -> None:
        node = nodes[match.root]
        out = emit(graph, "FusedMatMul", [node.inputs[0], _tied_table(graph, node.inputs[1])],
                   {"transA": 0, "transB": 1, "alpha": 1.0}, domain=MS)
        replace_typed(graph, node.outputs[0], out)


def _tied_table(graph: Graph, head: gs.Constant) -> gs.Constant | None:
    """The embedding table a Gather of `graph` reads whose transpose `head` is, else None (`_is_transpose` caches the
    comparison, so the rewrite finds it again for the cost of a walk over the nodes)."""
    return next((g.inputs[0] for g in graph.gs.nodes if g.op == "Gather" and _is_transpose(g.inputs[0], head)), None)


_transposes: dict[tuple[int, int], tuple[weakref.ref, weakref.ref, bool]] = {}


def _is_transpose(table: gs.Tensor, head: gs.Constant) -> bool:
    """Whether the constant `head` equals the constant `table` transposed; cached per pair of value arrays (graph
    clones share them, and comparing a vocabulary-sized table takes a fraction of a second), by weak references that
    keep no dropped graph's weights alive."""
    if not isinstance(table, gs.Constant) or tuple(table.shape) != tuple(head.shape)[::-1] or table.dtype != head.dtype:
        return False
    key = (id(table.values), id(head.values))
    cached = _transposes.get(key)
    if cached is not None and cached[0]() is table.values and cached[1]() is head.values:
        return cached[2]
    a, b = np.asarray(table.values), np.asarray(head.values)
    equal = bool(np.array_equal(a[:8].T, b[:, :8]) and np.array_equal(a.T, b))
    try:
        _transposes[key] = (weakref.ref(table.values), weakref.ref(head.values), equal)
    except TypeError:  # values without weak references (lazily loaded ones): compared again next time
        pass
    return equal
