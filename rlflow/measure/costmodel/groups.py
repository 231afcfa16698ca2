"""The fusion groups of a graph, their configuration keys, and each group cut out as a model of its own.

A graph's cost (`rlflow.measure.costmodel.model`) is the sum of the costs of its parts, and the part is a *fusion group*:
per-operator costs overestimate, because onnxruntime fuses Conv+BN+activation (+ residual Add under NCHWc), MatMul+Add
into Gemm, bias+GELU, Add+LayerNorm into SkipLayerNorm, Transpose or a scale into FusedMatMul, and folds constant
subgraphs.  So:

1. Static nodes (every input constant, or a Shape of a static-shaped tensor) cost 0: onnxruntime folds them.
2. The rest is partitioned (`partition`) into groups that contain whatever onnxruntime could fuse into one kernel: a
   compute operator (Conv, MatMul, Gemm...) with its single-consumer elementwise epilogue (BN, bias, activation,
   residual Add, LayerNorm), a Transpose or scale feeding a MatMul, and connected regions of elementwise operators
   (GELU, LayerNorm and Softmax patterns).  A group holds at most one compute operator and `MAX_GROUP` nodes.
3. Each group has a configuration key (operators, attributes, shapes, dtypes, which inputs are weights; weights are
   described by shape, integer and scalar constants by value), and is cut out as a small ONNX model with random
   weights (`isolated_model`).  The optimised graph onnxruntime saves for it is hashed too (`optimized_key`), so
   groups that onnxruntime turns into the same kernels (a Conv after a BN fold and a Conv+BN) can share one
   measurement.

The keys are what cost tables are keyed by: a change to them here is a change of `costmodel.CACHE_VERSION`.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np
import onnx
import onnx_graphsurgeon as gs
from onnx import helper, numpy_helper
from onnx_graphsurgeon.exporters.onnx_exporter import OnnxExporter

from rlflow.graph.core import Graph
from rlflow.graph.external_data import external_reference
from rlflow.graph.model_file import max_ir_version
from rlflow.measure.costmodel.group_shapes import Shapes

MAX_GROUP = 16
"""Most non-static nodes in one fusion group (bounds measurement size and keeps keys reusable)."""

HEAVY = frozenset({
    "Conv", "ConvTranspose", "MatMul", "Gemm", "Einsum", "MatMulInteger", "ConvInteger", "QLinearConv", "QLinearMatMul",
    "FusedConv", "FusedMatMul", "FusedGemm", "Attention", "MultiHeadAttention", "LSTM", "GRU", "RNN",
})
"""Compute operators: each anchors its own group (a group holds at most one)."""

FUSIBLE = frozenset({
    "Add", "Sub", "Mul", "Div", "Pow", "Sqrt", "Exp", "Log", "Neg", "Reciprocal", "Abs", "Erf", "Max", "Min", "Sum",
    "Relu", "LeakyRelu", "Elu", "Selu", "Celu", "PRelu", "Clip", "Sigmoid", "HardSigmoid", "HardSwish", "Tanh",
    "Softplus", "Softsign", "Mish", "Gelu", "FastGelu", "BiasGelu", "QuickGelu", "BatchNormalization",
    "LayerNormalization", "SkipLayerNormalization", "SimplifiedLayerNormalization", "InstanceNormalization",
    "Softmax", "LogSoftmax", "ReduceMean", "Where", "Equal", "Not", "Cast",
})
"""Elementwise and normalisation operators onnxruntime fuses with their neighbours."""

PROLOGUE = frozenset({"Transpose", "Mul", "Div"})
"""Operators onnxruntime folds into a following MatMul (FusedMatMul transposes and alpha)."""

MATMUL_LIKE = frozenset({"MatMul", "Gemm", "FusedMatMul"})

_NONDETERMINISTIC = frozenset({"RandomNormal", "RandomUniform", "RandomNormalLike", "RandomUniformLike", "Multinomial",
                               "Bernoulli"})
_SHAPE_OPS = frozenset({"Shape", "Size"})


@dataclass
class Group:
    """One fusion group of a graph: its nodes (static ancestors first), anchor and configuration key."""

    nodes: list
    members: list  # the non-static nodes (the ones that run)
    anchor: str
    key: str
    shapes: Shapes


def partition(graph: Graph) -> list[Group]:
    """The fusion groups of `graph`, in node order (static nodes belong to no group)."""
    nodes = list(graph.gs.nodes)
    static = _static_nodes(graph, nodes)
    outputs = {id(t) for t in graph.gs.outputs}
    index = {id(n): i for i, n in enumerate(nodes)}
    parent = list(range(len(nodes)))
    heavy = [1 if n.op in HEAVY else 0 for n in nodes]
    size = [1] * len(nodes)

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    def union(a: int, b: int) -> None:
        ra, rb = find(a), find(b)
        if ra == rb or heavy[ra] + heavy[rb] > 1 or size[ra] + size[rb] > MAX_GROUP:
            return
        parent[rb] = ra
        heavy[ra] += heavy[rb]
        size[ra] += size[rb]

    for i, node in enumerate(nodes):
        if i in static:
            continue
        op = node.op
        for tensor in node.outputs:
            consumers = [c for c in tensor.outputs if id(c) in index and index[id(c)] not in static]
            if not consumers or id(tensor) in outputs:
                continue
            if op in HEAVY:
                if len(consumers) == 1 and consumers[0].op in FUSIBLE:
                    union(i, index[id(consumers[0])])
            elif op in FUSIBLE and all(c.op in FUSIBLE for c in consumers):
                for consumer in consumers:
                    union(i, index[id(consumer)])
            if (op in PROLOGUE and len(consumers) == 1 and consumers[0].op in MATMUL_LIKE
                    and (op == "Transpose" or _has_scalar_constant(node))):
                union(index[id(consumers[0])], i)
    shapes = Shapes(graph)
    members: dict[int, list[int]] = {}
    for i in range(len(nodes)):
        if i not in static:
            members.setdefault(find(i), []).append(i)
    groups = []
    for ids in members.values():
        run = [nodes[i] for i in ids]
        ancestors = _static_ancestors(run, static, index)
        ordered = [nodes[i] for i in sorted(set(ids) | ancestors)]
        anchor = next((n for n in run if n.op in HEAVY), run[0])
        key = _group_key(shapes, ordered, {id(n) for n in ordered}, outputs)
        groups.append(Group(ordered, run, anchor.name, key, shapes))
    return groups


def _static_nodes(graph: Graph, nodes: list) -> set[int]:
    """Indices of nodes onnxruntime folds away: every input constant (or folded), or Shape/Size of a static shape."""
    folded: set[int] = set()
    static_tensors: set[int] = set()
    for i, node in enumerate(nodes):
        if node.op in _NONDETERMINISTIC:
            continue
        if node.op in _SHAPE_OPS:
            ok = node.inputs and graph.shape(node.inputs[0]) is not None
        else:
            ok = all(isinstance(t, gs.Constant) or id(t) in static_tensors or not t.name for t in node.inputs)
            ok = ok and bool(node.inputs)
        if ok:
            folded.add(i)
            static_tensors.update(id(t) for t in node.outputs)
    return folded


def _static_ancestors(run: list, static: set[int], index: dict[int, int]) -> set[int]:
    """Static nodes whose outputs a group reads (transitively), which its isolated model must compute."""
    found: set[int] = set()
    stack = [t for n in run for t in n.inputs]
    while stack:
        tensor = stack.pop()
        if not tensor.inputs:
            continue
        producer = tensor.inputs[0]
        i = index.get(id(producer))
        if i is None or i not in static or i in found:
            continue
        found.add(i)
        if producer.op not in _SHAPE_OPS:
            stack.extend(producer.inputs)
    return found


def _has_scalar_constant(node) -> bool:
    return any(isinstance(t, gs.Constant) and t.values.size == 1 for t in node.inputs)


def _constant_desc(tensor: gs.Constant) -> tuple:
    """Weights are described by shape; integer, boolean and scalar constants by value (they steer kernels)."""
    values = tensor.values
    dtype = str(values.dtype)
    if values.dtype.kind == "f" and values.size > 1:
        return ("w", dtype, values.shape)
    array = np.require(values, requirements="C")
    return ("c", dtype, values.shape, hashlib.blake2b(array.tobytes(), digest_size=8).hexdigest())


def _attr_desc(value) -> str:
    if isinstance(value, gs.Constant):
        return repr(_constant_desc(value))
    if isinstance(value, gs.Graph):
        return "graph:" + hashlib.blake2b(gs.export_onnx(value, do_type_check=False).graph.SerializeToString(),
                                          digest_size=8).hexdigest()
    if isinstance(value, np.ndarray):
        return repr((str(value.dtype), value.shape, value.tobytes()))
    return repr(value)


def _group_key(shapes: Shapes, ordered: list, inside: set[int], outputs: set[int]) -> str:
    """The configuration of a group: structure, attributes, shapes and dtypes; not names, not weight values."""
    local: dict[int, tuple] = {}
    externals: dict[int, int] = {}
    parts = []
    for k, node in enumerate(ordered):
        operands = []
        for tensor in node.inputs:
            if not tensor.name:
                operands.append("-")
            elif id(tensor) in local:
                operands.append(local[id(tensor)])
            elif isinstance(tensor, gs.Constant):
                operands.append(_constant_desc(tensor))
            else:
                if id(tensor) not in externals:
                    externals[id(tensor)] = len(externals)
                    shape, dtype = shapes.get(tensor)
                    parts.append(("in", str(dtype), shape))
                operands.append(("x", externals[id(tensor)]))
        escapes = []
        for j, tensor in enumerate(node.outputs):
            local[id(tensor)] = (k, j)
            if tensor.name and (id(tensor) in outputs or any(id(c) not in inside for c in tensor.outputs)):
                escapes.append(j)
        attrs = tuple(sorted((key, _attr_desc(v)) for key, v in node.attrs.items()))
        parts.append((node.domain or "", node.op, attrs, tuple(operands), len(node.outputs), tuple(escapes)))
    return hashlib.blake2b(repr(parts).encode(), digest_size=16).hexdigest()


def isolated_model(graph: Graph, group: Group) -> onnx.ModelProto:
    """The group as a model of its own: external inputs become graph inputs, weights random, escapes outputs."""
    inside = {id(n) for n in group.nodes}
    graph_outputs = {id(t) for t in graph.gs.outputs}
    produced: set[int] = set()
    inputs, initializers, outputs, seen = [], [], [], set()
    rng = np.random.default_rng(0)
    for node in group.nodes:
        for tensor in node.inputs:
            if not tensor.name or id(tensor) in produced or tensor.name in seen:
                continue
            seen.add(tensor.name)
            if isinstance(tensor, gs.Constant):
                reference = external_reference(tensor.name, tensor.values)
                if reference is not None:  # weights left in their file: the real ones, never a copy of gigabytes
                    initializers.append(reference)
                    continue
                values = np.asarray(tensor.values)
                if values.dtype.kind == "f" and values.size > 1:
                    values = rng.uniform(0.5, 1.5, size=values.shape).astype(values.dtype)
                initializers.append(numpy_helper.from_array(np.require(values, requirements="C"), tensor.name))
            else:
                shape, dtype = group.shapes.get(tensor)
                if shape is None or dtype is None:
                    raise ValueError(f"tensor {tensor.name!r} has no static shape or dtype")
                elem = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
                inputs.append(helper.make_tensor_value_info(tensor.name, elem, list(shape)))
        for tensor in node.outputs:
            produced.add(id(tensor))
    for node in group.members:
        for tensor in node.outputs:
            if tensor.name and (id(tensor) in graph_outputs or any(id(c) not in inside for c in tensor.outputs)):
                outputs.append(_value_info(group.shapes, tensor))
    if not outputs:  # a dead end (its results unused): keep its last outputs so nothing is pruned
        outputs = [_value_info(group.shapes, t) for t in group.members[-1].outputs if t.name]
    nodes = [OnnxExporter.export_node(n) for n in group.nodes]
    domains = dict(graph.model_info["opset_import"])
    for node in group.nodes:
        if node.domain and node.domain not in domains:
            domains[node.domain] = 1
    opsets = [helper.make_opsetid(d, v) for d, v in domains.items()]
    body = helper.make_graph(nodes, "group", inputs, outputs, initializer=initializers)
    return helper.make_model(body, opset_imports=opsets, ir_version=max_ir_version())


def _value_info(shapes: Shapes, tensor) -> onnx.ValueInfoProto:
    shape, dtype = shapes.get(tensor)
    if dtype is None:
        return helper.make_empty_tensor_value_info(tensor.name)
    elem = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    return helper.make_tensor_value_info(tensor.name, elem, list(shape) if shape is not None else None)


def optimized_key(model: onnx.ModelProto) -> str:
    """A structural hash of an onnxruntime-optimised model (names and weight values left out)."""
    graph = model.graph
    initializers = {}
    for t in graph.initializer:
        external = t.data_location == onnx.TensorProto.EXTERNAL
        size = int(np.prod(t.dims)) if t.dims else 1
        floating = t.data_type in (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.DOUBLE,
                                   onnx.TensorProto.BFLOAT16)
        if external or (floating and size > 1):
            initializers[t.name] = ("w", t.data_type, tuple(t.dims))
        else:
            initializers[t.name] = ("c", t.data_type, tuple(t.dims),
                                    hashlib.blake2b(numpy_helper.to_array(t).tobytes(), digest_size=8).hexdigest())
    refs: dict[str, tuple] = {}
    parts = []
    for k, vi in enumerate(graph.input):
        dims = tuple(d.dim_value for d in vi.type.tensor_type.shape.dim)
        refs[vi.name] = ("in", k)
        parts.append(("in", vi.type.tensor_type.elem_type, dims))
    for k, node in enumerate(graph.node):
        operands = [refs.get(name) or initializers.get(name) or ("?" if name else "-") for name in node.input]
        attrs = tuple(sorted((a.name, _proto_attr(a)) for a in node.attribute))
        parts.append((node.domain, node.op_type, attrs, tuple(operands)))
        for j, name in enumerate(node.output):
            refs[name] = (k, j)
    parts.append(("out", tuple(refs.get(o.name) or initializers.get(o.name) for o in graph.output)))
    return hashlib.blake2b(repr(parts).encode(), digest_size=16).hexdigest()


def _proto_attr(attr: onnx.AttributeProto) -> str:
    if attr.type == onnx.AttributeProto.TENSOR:
        return repr((attr.t.data_type, tuple(attr.t.dims), hashlib.blake2b(attr.t.SerializeToString(),
                                                                           digest_size=8).hexdigest()))
    if attr.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS):
        return hashlib.blake2b(attr.SerializeToString(), digest_size=8).hexdigest()
    return repr(helper.get_attribute_value(attr))
