"""Small graph queries the rules share: who writes and reads a tensor, constant operands, element types, shapes and
axes, and the geometry of a few operators.  Pure: nothing here edits a graph (`edits.py` does)."""
from __future__ import annotations

from typing import Sequence

import numpy as np
import onnx
import onnx_graphsurgeon as gs
from onnx import helper

from rlflow.graph.core import Graph

# ----------------------------------------------------------------------------------------------------- operators
MS = "com.microsoft"
"""onnxruntime's contrib operator domain, which the contrib fusions emit and the unfusing inverses root at."""

UNARY_ELEMENTWISE = frozenset({
    "Relu", "Sigmoid", "Tanh", "Exp", "Log", "Abs", "Neg", "Sqrt", "Erf", "LeakyRelu", "Elu", "Selu", "HardSigmoid",
    "Softplus", "Softsign", "Reciprocal", "Floor", "Ceil", "Round", "Sin", "Cos", "Sign", "HardSwish", "Celu",
})
"""Single-input operators applied to each element independently (attributes, if any, are scalars)."""

BINARY_ELEMENTWISE = frozenset({"Add", "Sub", "Mul", "Div", "Max", "Min", "Pow"})
"""Two-input broadcasting elementwise operators."""

_NONDETERMINISTIC = {"RandomNormal", "RandomNormalLike", "RandomUniform", "RandomUniformLike", "Multinomial",
                     "Bernoulli", "Dropout", "Constant", "If", "Loop", "Scan"}

DETERMINISTIC_OPS = tuple(sorted({s.name for s in onnx.defs.get_all_schemas() if s.domain in ("", "ai.onnx")}
                                 - _NONDETERMINISTIC))
"""Standard operators whose outputs depend on their inputs alone (no randomness, no subgraphs)."""


def is_standard(node: gs.Node | None) -> bool:
    """True for a node of the default ONNX domain (a custom-domain `Mul` is not a Mul)."""
    return node is not None and (node.domain or "") in ("", "ai.onnx")


def attrs_key(node: gs.Node) -> tuple:
    """The node's attributes as a comparable value (for 'same operator with the same attributes')."""
    items = []
    for key, value in sorted(node.attrs.items()):
        if isinstance(value, (gs.Graph, gs.Constant)):
            return ("<unhashable>", id(node))
        if isinstance(value, np.ndarray):
            value = (str(value.dtype), value.shape, value.tobytes())
        elif isinstance(value, list):
            value = tuple(value)
        items.append((key, repr(value)))
    return tuple(items)


def same_op(a: gs.Node, b: gs.Node) -> bool:
    """Same operator type, domain and attributes."""
    return a.op == b.op and (a.domain or "") == (b.domain or "") and attrs_key(a) == attrs_key(b)


# ----------------------------------------------------------------------------------------- producers and readers
def private(graph: Graph, tensor: gs.Tensor) -> bool:
    """True when a tensor can disappear in a rewrite: read by one node and not a graph output."""
    return len(tensor.outputs) == 1 and not graph.is_output(tensor)


def input_producer(node: gs.Node, index: int, op: str | Sequence[str] | None = None) -> gs.Node | None:
    """The node producing input `index` of `node` (of type `op`, or one of several, if given), else None."""
    if index >= len(node.inputs):
        return None
    producer = Graph.producer(node.inputs[index])
    if producer is None:
        return None
    if op is not None and (producer.op not in ((op,) if isinstance(op, str) else tuple(op))
                           or (producer.domain or "") not in ("", "ai.onnx")):
        return None  # a custom-domain node named like a standard operator is not that operator
    return producer


def standard_producer(tensor: gs.Tensor) -> gs.Node | None:
    """The node writing `tensor` when it is a default-domain operator, else None."""
    producer = Graph.producer(tensor)
    return producer if is_standard(producer) else None


def private_producer(graph: Graph, node: gs.Node, index: int, op: str | Sequence[str] | None = None) -> gs.Node | None:
    """Like `input_producer`, but only when the tensor is private (the producer can disappear in the rewrite)."""
    producer = input_producer(node, index, op)
    return producer if producer is not None and private(graph, producer.outputs[0]) else None


def operand_tree(graph: Graph, node: gs.Node, depth: int = 2) -> tuple[list[gs.Tensor], list[gs.Node]]:
    """The operands of a tree of private standard nodes of `node`'s operator (Mul, Add) rooted at `node`, at most
    `depth` deep, and the tree's nodes."""
    operands, tree = [], [node]
    for tensor in node.inputs:
        inner = standard_producer(tensor)
        if depth > 1 and inner is not None and inner.op == node.op and private(graph, tensor):
            more, more_tree = operand_tree(graph, inner, depth - 1)
            operands += more
            tree += more_tree
        else:
            operands.append(tensor)
    return operands, tree


def other_operand(node: gs.Node, tensor: gs.Tensor) -> tuple[gs.Tensor, np.ndarray | None] | None:
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


def used_outputs(graph: Graph, node: gs.Node) -> list[gs.Tensor]:
    """The outputs of `node` that something reads (a consumer or the graph's outputs)."""
    return [t for t in node.outputs if t.outputs or graph.is_output(t)]


# --------------------------------------------------------------------------------------------- constant operands
def constant_input(node: gs.Node, index: int) -> np.ndarray | None:
    """The value of input `index` when it is a constant (absent optional inputs give None)."""
    if index >= len(node.inputs) or node.inputs[index].name == "":
        return None
    return Graph.constant(node.inputs[index])


def has_input(node: gs.Node, index: int) -> bool:
    """True when optional input `index` is present."""
    return index < len(node.inputs) and node.inputs[index].name != ""


def scalar(array: np.ndarray | None) -> float | None:
    """The value of a constant whose elements are all the same (a scalar in any shape), else None."""
    if array is None or array.size == 0 or array.dtype.kind not in "fiub":
        return None
    flat = array.reshape(-1)
    first = flat[0]
    return float(first) if np.all(flat == first) else None


def int_list(array: np.ndarray | None) -> tuple[int, ...] | None:
    """A 0-d or 1-d integer constant as a tuple of ints."""
    if array is None or array.dtype.kind not in "iu" or array.ndim > 1:
        return None
    return tuple(int(v) for v in array.reshape(-1))


def bias_side(graph: Graph, add: gs.Node) -> int | None:
    """The side of `add` holding a constant vector over the last axis of its other operand (a bias), or None."""
    shape = graph.shape(add.outputs[0])
    if shape is None or not shape:
        return None
    for side in (0, 1):
        value = constant_input(add, side)
        if (value is not None and value.ndim == 1 and value.shape[0] == shape[-1] and graph.shape(add.inputs[1 - side])
                == shape and value.dtype == np.float32):
            return side
    return None


def per_channel(array: np.ndarray, out_shape: Sequence[int], axis: int) -> np.ndarray | None:
    """A constant broadcast against a tensor of `out_shape` as a vector along `axis` (length out_shape[axis]), or
    None when it varies along any other axis or would change the tensor's shape."""
    rank = len(out_shape)
    if array.ndim > rank:
        return None
    full = array.reshape((1,) * (rank - array.ndim) + array.shape)
    for d, size in enumerate(full.shape):
        if size != 1 and (d != axis or size != out_shape[d]):
            return None
    vector = full.reshape(-1)
    return np.full(out_shape[axis], vector[0], dtype=array.dtype) if vector.size == 1 else vector.copy()


def to_rank(array: np.ndarray, rank: int) -> np.ndarray:
    """A constant with leading 1s added up to `rank` (numpy broadcasting's view of it)."""
    return array.reshape((1,) * (rank - array.ndim) + array.shape)


# ------------------------------------------------------------------------------------------------- element types
def is_float(tensor: gs.Tensor) -> bool:
    """True for float16/32/64 tensors (bfloat16 too); the algebra rules assume real arithmetic."""
    dtype = tensor.dtype
    if dtype is None:
        return False
    try:
        return np.dtype(dtype).kind == "f" or str(dtype) == "bfloat16"
    except TypeError:
        return False


def np_dtype(tensor: gs.Tensor) -> np.dtype | None:
    """The numpy element type of a tensor, or None when unknown."""
    try:
        return np.dtype(tensor.dtype) if tensor.dtype is not None else None
    except TypeError:
        return None


def onnx_dtype_to_np(elem: int) -> np.dtype | None:
    """numpy dtype of an ONNX TensorProto element type, or None."""
    try:
        return np.dtype(helper.tensor_dtype_to_np_dtype(int(elem)))
    except (KeyError, TypeError, ValueError):
        return None


# ----------------------------------------------------------------------------------------------- shapes and axes
def broadcast_shape(*shapes: Sequence[int] | None) -> tuple[int, ...] | None:
    """numpy broadcasting of static shapes, or None when a shape is unknown or they do not broadcast."""
    if any(s is None for s in shapes):
        return None
    try:
        return tuple(int(d) for d in np.broadcast_shapes(*[tuple(s) for s in shapes]))
    except ValueError:
        return None


def normalize_axis(axis: int, rank: int) -> int | None:
    """A non-negative axis, or None when out of range."""
    axis = int(axis)
    if axis < 0:
        axis += rank
    return axis if 0 <= axis < rank else None


def inverse_perm(perm: Sequence[int]) -> tuple[int, ...]:
    """q with q[perm[j]] = j."""
    inverse = [0] * len(perm)
    for j, p in enumerate(perm):
        inverse[p] = j
    return tuple(inverse)


def perm_of(node: gs.Node, rank: int | None) -> tuple[int, ...] | None:
    """A Transpose's permutation (reversed axes when the attribute is absent and the rank known)."""
    perm = node.attrs.get("perm")
    if perm is not None:
        return tuple(int(p) for p in perm)
    return tuple(reversed(range(rank))) if rank is not None else None


def squeeze_axes(node: gs.Node, rank: int | None) -> tuple[int, ...] | None:
    """Normalised constant axes of a Squeeze/Unsqueeze against `rank` (input rank for Squeeze, output for Unsqueeze)."""
    axes = int_list(constant_input(node, 1)) if len(node.inputs) > 1 else node.attrs.get("axes")
    if axes is None or rank is None:
        return None
    normal = [normalize_axis(a, rank) for a in axes]
    return None if None in normal else tuple(sorted(normal))


def reduce_axes(node: gs.Node, rank: int) -> tuple[int, ...] | None:
    """Normalised constant axes of a Reduce* node that keeps its dimensions (attribute below opset 18, else input)."""
    axes = node.attrs.get("axes") if "axes" in node.attrs else (int_list(constant_input(node, 1))
                                                                if has_input(node, 1) else None)
    if axes is None or not node.attrs.get("keepdims", 1):
        return None
    normal = [normalize_axis(a, rank) for a in axes]
    return None if None in normal else tuple(sorted(normal))


def split_sizes(graph: Graph, node: gs.Node) -> tuple[int, tuple[int, ...]] | None:
    """A Split's (axis, part sizes) from its static input shape, or None when unknown or uneven."""
    shape = graph.shape(node.inputs[0])
    if shape is None:
        return None
    axis = normalize_axis(node.attrs.get("axis", 0), len(shape))
    if axis is None:
        return None
    if has_input(node, 1):
        sizes = int_list(constant_input(node, 1))
        if sizes is None:
            return None
    elif "split" in node.attrs:
        sizes = tuple(int(s) for s in node.attrs["split"])
    else:
        parts = len(node.outputs)
        if shape[axis] % parts:
            return None
        sizes = (shape[axis] // parts,) * parts
    if len(sizes) != len(node.outputs) or sum(sizes) != shape[axis]:
        return None
    return axis, tuple(sizes)


def matmul_shapes(graph: Graph, node: gs.Node) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """Static shapes of a MatMul's operands when both have rank >= 2 (1-D operands follow other rules)."""
    a, b = graph.shape(node.inputs[0]), graph.shape(node.inputs[1])
    if a is None or b is None or len(a) < 2 or len(b) < 2:
        return None
    return a, b


def matmul_result(a: Sequence[int], b: Sequence[int]) -> tuple[int, ...] | None:
    """The shape of MatMul(a, b) for rank >= 2 operands, or None when they do not fit."""
    batch = broadcast_shape(a[:-2], b[:-2])
    if batch is None or a[-1] != b[-2]:
        return None
    return (*batch, a[-2], b[-1])


def matmul_flops(a: Sequence[int], b: Sequence[int]) -> int:
    """Multiply-adds times two of MatMul(a, b) (rank >= 2 operands that fit)."""
    batch = broadcast_shape(a[:-2], b[:-2]) or ()
    return 2 * int(np.prod(batch, dtype=np.int64)) * a[-2] * a[-1] * b[-1]


# ---------------------------------------------------------------------------------------------------------- Conv
def conv_params(graph: Graph, node: gs.Node) -> dict | None:
    """A Conv's geometry with defaults filled in (kernel, strides, pads, dilations, group), or None when it uses
    auto_pad SAME or its weight shape is unknown."""
    wshape = graph.shape(node.inputs[1]) if len(node.inputs) > 1 else None
    if wshape is None or len(wshape) < 3:
        return None
    nd = len(wshape) - 2
    auto_pad = node.attrs.get("auto_pad", "NOTSET")
    if isinstance(auto_pad, bytes):
        auto_pad = auto_pad.decode()
    if auto_pad not in ("NOTSET", "VALID", ""):
        return None
    kernel = tuple(int(k) for k in node.attrs.get("kernel_shape", wshape[2:]))
    if kernel != tuple(wshape[2:]):
        return None
    return {
        "kernel": kernel,
        "strides": tuple(int(s) for s in node.attrs.get("strides", [1] * nd)),
        "pads": tuple(int(p) for p in node.attrs.get("pads", [0] * (2 * nd))) if auto_pad != "VALID" else (0,) * (2 * nd),
        "dilations": tuple(int(d) for d in node.attrs.get("dilations", [1] * nd)),
        "group": int(node.attrs.get("group", 1)),
    }


def conv_attrs(params: dict) -> dict:
    """Conv attributes from `conv_params` output."""
    return {"kernel_shape": list(params["kernel"]), "strides": list(params["strides"]), "pads": list(params["pads"]),
            "dilations": list(params["dilations"]), "group": params["group"]}


def conv_weights(node: gs.Node) -> tuple[np.ndarray, np.ndarray] | None:
    """Constant (weight, bias) of a Conv, the bias zero-filled when absent; None when either is not constant."""
    weight = constant_input(node, 1)
    if weight is None:
        return None
    if has_input(node, 2):
        bias = constant_input(node, 2)
        if bias is None:
            return None
    else:
        bias = np.zeros(weight.shape[0], weight.dtype)
    return weight, bias
