"""Small graph edits the rules share: adding nodes (`emit`, `emit_split`, `clone_node`, `combine`) and pointing a
tensor's readers at another tensor (`replace_all`, `replace_typed`, `replace_with_skip_norm`, `bypass`).  Rules call them on the clone that
`rlflow.rewrites.apply` hands to `Rule.rewrite`, never on a graph a caller holds."""
from __future__ import annotations

from typing import Sequence

import numpy as np
import onnx_graphsurgeon as gs

from rlflow.graph.core import Graph
from rlflow.rewrites.queries import MS


# ----------------------------------------------------------------------------------------------------- new nodes
def emit(graph: Graph, op: str, inputs: Sequence[gs.Tensor], attrs: dict | None = None, domain: str = "",
         hint: str | None = None) -> gs.Tensor:
    """Adds a single-output node and returns its output."""
    (out,) = graph.add_node(op, list(inputs), attrs=attrs, domain=domain, hint=hint)
    return out


def emit_split(graph: Graph, source: gs.Tensor, axis: int, sizes: Sequence[int] | None, parts: int,
               outputs: Sequence[gs.Tensor] | None = None) -> list[gs.Tensor]:
    """Adds a Split of `source` along `axis` into `sizes` (or `parts` equal parts when sizes is None, which keeps a
    dynamic dimension dynamic) in the form the graph's opset wants."""
    attrs: dict = {"axis": int(axis)}
    inputs = [source]
    if sizes is not None and graph.opset < 13:  # a model whose opset could not be raised on load
        attrs["split"] = [int(s) for s in sizes]
    elif sizes is not None:
        inputs.append(graph.add_constant(np.array(list(sizes), dtype=np.int64), "split_sizes"))
    elif graph.opset >= 18:
        attrs["num_outputs"] = int(parts)
    return graph.add_node("Split", inputs, list(outputs) if outputs is not None else parts, attrs=attrs)


def clone_node(graph: Graph, node: gs.Node, inputs: Sequence[gs.Tensor], outputs: int | Sequence[gs.Tensor] = 1
               ) -> list[gs.Tensor]:
    """Adds a node with the same operator, domain and attributes as `node` on new inputs."""
    return graph.add_node(node.op, list(inputs), outputs, attrs=dict(node.attrs), domain=node.domain or "",
                          hint=node.name)


_NUMPY_BINARY = {"Add": np.add, "Sub": np.subtract, "Mul": np.multiply, "Div": np.divide, "Max": np.maximum,
                 "Min": np.minimum, "MatMul": np.matmul}


def combine(graph: Graph, op: str, a: gs.Tensor, b: gs.Tensor, hint: str = "const") -> gs.Tensor:
    """`op(a, b)`: computed now when both are constants (a new constant), else a new node."""
    va, vb = Graph.constant(a), Graph.constant(b)
    if va is not None and vb is not None and op in _NUMPY_BINARY and va.dtype == vb.dtype and va.dtype.kind == "f":
        value = _NUMPY_BINARY[op](va.astype(np.float64), vb.astype(np.float64)).astype(va.dtype)
        return graph.add_constant(value, hint)
    return emit(graph, op, [a, b])


# ------------------------------------------------------------------------------------------------- readers moved
def replace_all(graph: Graph, olds: Sequence[gs.Tensor], news: Sequence[gs.Tensor]) -> None:
    """`graph.replace_uses(old, new)` for each pair whose old tensor is read or is a graph output."""
    for old, new in zip(list(olds), list(news)):
        if old.outputs or graph.is_output(old):
            graph.replace_uses(old, new)


def replace_typed(graph: Graph, old: gs.Tensor, new: gs.Tensor) -> None:
    """`graph.replace_uses(old, new)` for a `new` that onnx shape inference cannot type (a contrib operator's output):
    it takes old's element type and shape, which a semantics-preserving rewrite keeps, so later rules still see them."""
    if new.dtype is None and new.shape is None and not isinstance(new, gs.Constant):
        new.dtype, new.shape = old.dtype, old.shape
    graph.replace_uses(old, new)


def replace_with_skip_norm(graph: Graph, op: str, inputs: Sequence[gs.Tensor], attrs: dict, norm: gs.Tensor,
                           total: gs.Tensor | None, hint: str) -> None:
    """Points `norm`'s readers at a new onnxruntime skip-norm node `op` (`SkipLayerNormalization`,
    `SkipSimplifiedLayerNormalization`) on `inputs`; where the residual sum `total` is read elsewhere too (None where
    it is not), its readers take the node's fourth output, the sum it computes anyway."""
    if total is None:
        replace_typed(graph, norm, emit(graph, op, inputs, attrs, domain=MS))
        return
    out, _, _, summed = graph.add_node(op, list(inputs), [
        gs.Variable(graph.fresh_name(hint)), gs.Variable.empty(), gs.Variable.empty(),
        gs.Variable(graph.fresh_name("skip_sum"))], attrs, domain=MS)
    replace_typed(graph, norm, out)
    replace_typed(graph, total, summed)


def bypass(graph: Graph, node: gs.Node, source: gs.Tensor) -> None:
    """Makes every reader of the node's first output read `source` instead (the node then dies in cleanup)."""
    graph.replace_uses(node.outputs[0], source)


def gemm_weight(graph: Graph, gemm: gs.Node) -> gs.Tensor:
    """A Gemm's B as a MatMul's operand: B itself where neither transposed nor scaled, else a constant with transB
    and alpha folded in (B constant): a copy of every weight had held a large model's candidates at several times its
    size."""
    transposed, alpha = gemm.attrs.get("transB", 0), float(gemm.attrs.get("alpha", 1.0))
    weight = Graph.constant(gemm.inputs[1])
    if weight is None or not (transposed or alpha != 1.0):
        return gemm.inputs[1]
    value = (weight.T if transposed else weight).astype(np.float64) * alpha
    return graph.add_constant(value.astype(weight.dtype), f"{gemm.name}_B")


def gemm_bias(graph: Graph, gemm: gs.Node, shape: tuple[int, ...] | None = None) -> gs.Tensor:
    """A Gemm's C as an addend: C itself where beta is 1 and its shape `shape` (or any), else a constant with beta
    folded in and reshaped (C constant)."""
    c, beta = gemm.inputs[2], float(gemm.attrs.get("beta", 1.0))
    bias = Graph.constant(c)
    if bias is None or (beta == 1.0 and (shape is None or bias.shape == shape)):
        return c
    value = (bias.astype(np.float64) * beta).astype(bias.dtype)
    return graph.add_constant(value if shape is None else value.reshape(shape), f"{gemm.name}_C")


def expand_rows(graph: Graph, mask: gs.Tensor, query: gs.Tensor) -> gs.Tensor:
    """`mask` [B, H, 1, T] expanded to [B, H, S, T], S the length of `query` [B, S, hidden], read at run time (an
    attention's bias must give every query row, where an additive mask broadcasts them)."""
    length = emit(graph, "Gather", [emit(graph, "Shape", [query]), graph.add_constant(np.array([1], np.int64), "at")])
    ones = graph.add_constant(np.array([1, 1], np.int64), "ones")
    shape = emit(graph, "Concat", [ones, length, graph.add_constant(np.array([1], np.int64), "one")], {"axis": 0})
    out = emit(graph, "Expand", [mask, shape], hint="attention_bias")
    rows = graph.shape(mask)
    out.dtype, out.shape = mask.dtype, (*rows[:2], graph.shape(query)[1], rows[3])
    return out

