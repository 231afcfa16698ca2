"""GELU fusions: the exact (erf) and tanh formulas into onnxruntime's Gelu and FastGelu, and a bias Add before either
into BiasGelu or FastGelu's bias input."""
from __future__ import annotations

import math

import onnx_graphsurgeon as gs

from rlflow.graph.core import Graph
from rlflow.rewrites.base import Match, NoMatch, Rule
from rlflow.rewrites.edits import emit, replace_typed
from rlflow.rewrites.queries import (
    MS,
    bias_side,
    constant_input,
    is_float,
    is_standard,
    operand_tree,
    other_operand,
    private,
    private_producer,
    scalar,
    standard_producer,
)


def _close(value: float | None, target: float) -> bool:
    return value is not None and math.isclose(value, target, rel_tol=1e-3)


class _GeluBase(Rule):
    """`0.5 * x * (1 + f(x))` as a tree of Muls: subclasses say what f must be."""

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
        if x is None or core is None or not _close(scalar(other_operand(add, core.outputs[0])[1]), 1.0):
            return f"the bracket is not 1 + {self.inner_op}(...)"
        inner = self.inner(graph, core, x)
        if inner is None or not is_float(x):
            return f"the {self.inner_op} argument is not the expected function of x"
        return [*muls, add, core, *inner], x

    def check(self, graph: Graph, node: gs.Node) -> Match | NoMatch:
        found = self._pattern(graph, node)
        if isinstance(found, str):
            return self.no(node, found)
        nodes, x = found
        return self.match(nodes, x=self.locate(nodes, x))

    def rewrite(self, graph: Graph, match: Match, nodes: dict[str, gs.Node]) -> None:
        node = nodes[match.root]
        x = match.input("x", nodes)
        replace_typed(graph, node.outputs[0], emit(graph, self.fused_op, [x], domain=MS))


def _scaled(graph: Graph, tensor: gs.Tensor, x: gs.Tensor, factor: float) -> gs.Node | None:
    """The private node computing `x * factor` (as Mul or Div) that produces `tensor`, or None."""
    producer = standard_producer(tensor)
    if producer is None or producer.op not in ("Mul", "Div") or not private(graph, tensor):
        return None
    if producer.op == "Div":
        return producer if producer.inputs[0] is x and _close(scalar(constant_input(producer, 1)), 1 / factor) else None
    other = other_operand(producer, x)
    return producer if other is not None and _close(scalar(other[1]), factor) else None


class GeluFusion(_GeluBase):
    """Replaces `0.5 * x * (1 + erf(x / sqrt(2)))` with onnxruntime's `Gelu(x)`.

        x --+--> Div(., sqrt(2)) --> Erf --> Add(., 1) --+
            |    or Mul(., 1/sqrt(2))                    v
            +-----------------------------------------> Mul --> Mul(., 0.5)

    Both torch.onnx.export exporters write `nn.GELU()` / `F.gelu` this way below opset 20 (Hugging Face's BERT, ViT):
    TorchScript as `(x * (1 + erf)) * 0.5`, dynamo as `x * (0.5 * (1 + erf))`, so the three factors of the product may
    come in any order.
    """

    name = "gelu-fusion"
    fused_op = "Gelu"
    inner_op = "Erf"

    def inner(self, graph: Graph, node: gs.Node, x: gs.Tensor) -> list[gs.Node] | None:
        scaled = _scaled(graph, node.inputs[0], x, 1 / math.sqrt(2))
        return [scaled] if scaled is not None else None


class FastGeluFusion(_GeluBase):
    """Replaces `0.5 * x * (1 + tanh(sqrt(2/pi) * (x + 0.044715 * x^3)))` with onnxruntime's `FastGelu(x)`.

        x --+--> Pow(., 3) --> Mul(., 0.044715) --> Add(x, .) --> Mul(., sqrt(2/pi)) --> Tanh --> Add(., 1) --+
            |    or x * x * x                                                                                v
            +---------------------------------------------------------------------------------> Mul(x, 0.5, .)

    x^3 is `Pow(x, 3)` where a model writes the formula itself (Hugging Face's `gelu_new` in GPT-2, either exporter)
    and `x * x * x` where torch.onnx.export (TorchScript) writes `F.gelu(approximate="tanh")` (the zoo's GPT-2).
    """

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
            rest = other_operand(add, x)
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


class _BiasActivationFusion(Rule):
    """`f(Add(x, b))` with b a constant vector over the last axis, for an onnxruntime activation f taking a bias; f is
    onnxruntime's operator, the standard `Gelu` of opset 20 (with the matching `approximate`) or its decomposition."""

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

        x --> MatMul(., W) --> Add(., b) --> Gelu          (b: a constant [hidden] vector)

    Gelu is onnxruntime's, opset 20's, or its formula `0.5 * y * (1 + erf(y / sqrt(2)))` (see GeluFusion) as both
    torch exporters write it after a `nn.Linear` on a 3-D input (a transformer's MLP: MatMul, then the bias Add), so
    the formula goes to `BiasGelu` in one step."""

    name = "bias-gelu-fusion"
    root_ops = ("Gelu", "Mul")
    fused_op = "BiasGelu"
    approximate = "none"
    decomposed = GeluFusion()


class BiasFastGeluFusion(_BiasActivationFusion):
    """Replaces `FastGelu(Add(x, b))` with onnxruntime's `FastGelu(x, b)` for a constant vector b over the last axis.

        x --> MatMul(., W) --> Add(., b) --> FastGelu      (b: a constant [hidden] vector)

    FastGelu is onnxruntime's, opset 20's `Gelu` with approximate='tanh', or its tanh formula (see FastGeluFusion), as
    an exporter writes it after a `nn.Linear` on a 3-D input (the zoo's GPT-2, TorchScript).  Hugging Face's GPT-2
    writes its MLP's bias inside a Gemm between Reshapes instead, which this pattern does not see."""

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
