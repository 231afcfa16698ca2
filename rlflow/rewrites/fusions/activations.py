"""GELU fusions: the exact (erf) and tanh formulas into onnxruntime's Gelu and FastGelu, a bias Add before either
into BiasGelu or FastGelu's bias input, and x * sigmoid(alpha * x) into QuickGelu."""
from __future__ import annotations

import math

import numpy as np
import onnx_graphsurgeon as gs

from rlflow.graph.core import Graph
from rlflow.rewrites.base import Match, NoMatch, Rule
from rlflow.rewrites.edits import emit, replace_typed
from rlflow.rewrites.pattern import Found, PatternRule, const, constant, op, product, var
from rlflow.rewrites.queries import MS, bias_side, is_float, is_standard, np_dtype, private, scalar, standard_producer

SQRT2 = math.sqrt(2)
x = var("x")


class _GeluFormula(PatternRule):
    """`0.5 * x * (1 + f(x))`, its three factors in any order and association, into onnxruntime's `fused_op(x)`."""

    contrib = True
    fused_op = ""
    variables = ("x",)

    def condition(self, graph: Graph, found: Found) -> str | None:
        return None if is_float(found["x"]) else "x is not a float tensor"

    def replacement(self, graph: Graph, tensors: dict[str, gs.Tensor], match: Match) -> gs.Tensor:
        return emit(graph, self.fused_op, [tensors["x"]], domain=MS)


class GeluFusion(_GeluFormula):
    """Replaces `0.5 * x * (1 + erf(x / sqrt(2)))` with onnxruntime's `Gelu(x)`.

    Both torch.onnx.export exporters write `nn.GELU()` / `F.gelu` this way below opset 20 (Hugging Face's BERT, ViT):
    TorchScript as `(x * (1 + erf)) * 0.5`, dynamo as `x * (0.5 * (1 + erf))`; x / sqrt(2) may be x * (1 / sqrt(2)).
    """

    name = "gelu-fusion"
    fused_op = "Gelu"
    pattern = product(const(0.5), x, op.Add(const(1.0), op.Erf(
        (op.Div(x, const(SQRT2)) | op.Mul(x, const(1 / SQRT2)))
        .otherwise("the Erf argument is not the expected function of x"))))


class FastGeluFusion(_GeluFormula):
    """Replaces `0.5 * x * (1 + tanh(sqrt(2/pi) * (x + 0.044715 * x^3)))` with onnxruntime's `FastGelu(x)`.

    x^3 is `Pow(x, 3)` where a model writes the formula itself (Hugging Face's `gelu_new` in GPT-2, either exporter)
    and `x * x * x` where torch.onnx.export (TorchScript) writes `F.gelu(approximate="tanh")` (the zoo's GPT-2).  The
    tanh's argument may also come factored, `x * sqrt(2/pi) * (1 + 0.044715 * x * x)` (Megatron's and Hugging Face's
    `gelu_fast` / `FastGELUActivation`).
    """

    name = "fast-gelu-fusion"
    fused_op = "FastGelu"
    pattern = product(const(0.5), x, op.Add(const(1.0), op.Tanh((
        op.Mul(op.Add(x, product(const(0.044715), x, x, x) | product(const(0.044715), op.Pow(x, const(3.0)))),
               const(math.sqrt(2 / math.pi)))
        | product(x, const(math.sqrt(2 / math.pi)), op.Add(const(1.0), product(const(0.044715), x, x)))
    ).otherwise("the Tanh argument is not the expected function of x"))))


class _BiasActivationFusion(Rule):
    """`f(Add(x, b))` with b a constant vector over the last axis, for an onnxruntime activation f taking a bias; f is
    onnxruntime's operator, the standard `Gelu` of opset 20 (with the matching `approximate`) or its decomposition."""

    contrib = True
    domains = ("", "ai.onnx", MS)
    fused_op = ""
    approximate = ""
    decomposed: _GeluFormula

    def _activation(self, graph: Graph, node: gs.Node) -> tuple[list[gs.Node], gs.Tensor] | str:
        """(the activation's nodes, its argument) rooted at `node`, or why not."""
        if node.op == "Mul":
            if not is_standard(node):
                return "not a standard Mul"
            found = self.decomposed.found(graph, node)
            if isinstance(found, str):
                return found
            nodes, x = found.nodes, found["x"]
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


class QuickGeluFusion(PatternRule):
    """Replaces `x * sigmoid(alpha * x)` (alpha constant; SiLU/Swish when it is absent) with onnxruntime's `QuickGelu`.

    CLIP's `quick_gelu` (alpha 1.702: OpenAI's CLIP text and vision towers) and the SiLU of Llama-style MLPs
    (`nn.SiLU`, alpha 1) as both torch exporters write them.  onnxruntime's transformers optimizer and its graph
    optimizer make the same fusion.
    """

    name = "quick-gelu-fusion"
    contrib = True
    pattern = op.Mul(x, op.Sigmoid(op.Mul(x, constant("alpha")) | x))
    variables = ("x",)

    def condition(self, graph: Graph, found: Found) -> str | None:
        if np_dtype(found["x"]) != np.float32:
            return "x is not float32 (onnxruntime's CPU kernel)"
        alpha = self.params(graph, found)["alpha"]
        return None if alpha is not None and math.isfinite(alpha) else "alpha is not one finite value"

    def params(self, graph: Graph, found: Found) -> dict:
        return {"alpha": 1.0 if found.get("alpha") is None else scalar(Graph.constant(found["alpha"]))}

    def replacement(self, graph: Graph, tensors: dict[str, gs.Tensor], match: Match) -> gs.Tensor:
        return emit(graph, "QuickGelu", [tensors["x"]], {"alpha": match.param("alpha")}, domain=MS)
