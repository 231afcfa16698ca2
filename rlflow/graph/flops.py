"""Parameter, FLOP and byte counts of ONNX graphs.

Works on any ONNX model (the zoo, the bench, rewritten graphs), not on PyTorch modules, so that a rewrite's
effect on arithmetic can be read off the graph it produced.

What is counted (the convention of this project):

* FLOPs are **2 x multiply-accumulates** for the contraction ops:

  - ``Conv`` / ``ConvInteger`` / ``QLinearConv``: ``2 * prod(Y.shape) * (C_in / group) * prod(kernel)``;
  - ``ConvTranspose``: ``2 * prod(X.shape) * (C_out / group) * prod(kernel)``;
  - ``MatMul`` / ``MatMulInteger`` / ``QLinearMatMul``: ``2 * prod(Y.shape) * K`` (K: the contracted length);
  - ``Gemm``: ``2 * M * N * K``.

  A bias inside ``Conv``/``ConvTranspose`` (third input) or ``Gemm`` (input C) adds 1 per output element,
  the same as the separate ``Add`` it replaces, so that fusing a bias into a contraction leaves the count unchanged.
* **1 per output element** for elementwise ops (arithmetic, activations, comparisons, ``Where``, ``Clip``,
  ``Cast`` excluded), pooling (``MaxPool``, ``AveragePool``, ``Global*Pool``, ``LpPool``), normalisation
  (``BatchNormalization``, ``LayerNormalization``, ``InstanceNormalization``, ``GroupNormalization``,
  ``LpNormalization``), ``Softmax``/``LogSoftmax`` and the ``Reduce*`` ops.  Pool windows and reduction
  lengths are deliberately not multiplied in: published MAC figures ignore these ops altogether, so they only
  need to be visible, not exact.
* **0** for everything else: data movement (``Reshape``, ``Transpose``, ``Concat``, ``Split``, ``Slice``,
  ``Gather``, ``Pad``, ``Expand``, ``Cast``, ``Shape``, ``Constant``, ``Identity``, ``Dropout``, ...), ``Einsum``,
  recurrent ops (``LSTM``/``GRU``/``RNN``) and anything inside control-flow subgraphs (``If``/``Loop``/``Scan``).

Shapes come from ONNX shape inference (with data propagation), run here on a copy of the graph whose float
weights are replaced by typed inputs, so that it is cheap on large models.  A symbolic dimension counts as 1;
a node whose output shape is still unknown contributes 0.

Parameters are the elements of float initializers (float32/16/64, bfloat16, float8) plus float ``Constant``
nodes.  Batch-norm running statistics are initializers and so are counted (torchvision does not count them;
the difference is below 0.5% for every zoo model).
"""

from __future__ import annotations

import math
from collections import Counter

import numpy as np
import onnx
from onnx import TensorProto, shape_inference

from rlflow.graph.external_data import tensor_bytes

__all__ = ["count_params", "count_flops", "flops_by_op", "node_flops"]

_FLOAT_TYPES = frozenset(
    t
    for t in (
        TensorProto.FLOAT,
        TensorProto.FLOAT16,
        TensorProto.DOUBLE,
        TensorProto.BFLOAT16,
        getattr(TensorProto, "FLOAT8E4M3FN", None),
        getattr(TensorProto, "FLOAT8E4M3FNUZ", None),
        getattr(TensorProto, "FLOAT8E5M2", None),
        getattr(TensorProto, "FLOAT8E5M2FNUZ", None),
    )
    if t is not None
)

_ELEMENTWISE = frozenset(
    """Add Sub Mul Div Pow Mod Neg Abs Reciprocal Sqrt Exp Log Floor Ceil Round Sign Min Max Mean Sum
    Relu LeakyRelu PRelu Elu Selu Celu Gelu Sigmoid HardSigmoid HardSwish Tanh Erf Softplus Softsign Mish
    ThresholdedRelu Clip Sin Cos Tan Asin Acos Atan Sinh Cosh Asinh Acosh Atanh
    Equal Less LessOrEqual Greater GreaterOrEqual Not And Or Xor Where IsNaN IsInf BitShift""".split()
)
_POOL_NORM_REDUCE = frozenset(
    """MaxPool AveragePool GlobalAveragePool GlobalMaxPool LpPool GlobalLpPool
    BatchNormalization LayerNormalization InstanceNormalization GroupNormalization LpNormalization
    MeanVarianceNormalization Softmax LogSoftmax Hardmax
    ReduceMean ReduceSum ReduceMax ReduceMin ReduceProd ReduceL1 ReduceL2 ReduceLogSum ReduceLogSumExp
    ReduceSumSquare""".split()
)


def count_params(model: onnx.ModelProto) -> int:
    """Number of float weight elements: float initializers plus float ``Constant`` nodes of the main graph."""
    total = 0
    for init in model.graph.initializer:
        if init.data_type in _FLOAT_TYPES:
            total += math.prod(init.dims)
    for node in model.graph.node:
        if node.op_type != "Constant":
            continue
        for attr in node.attribute:
            if attr.name == "value" and attr.t.data_type in _FLOAT_TYPES:
                total += math.prod(attr.t.dims)
            elif attr.name == "value_float":
                total += 1
            elif attr.name == "value_floats":
                total += len(attr.floats)
    return total


def count_flops(model: onnx.ModelProto) -> int:
    """FLOPs of one inference of the main graph, as defined in this module's docstring."""
    return sum(flops_by_op(model).values())


def flops_by_op(model: onnx.ModelProto) -> dict[str, int]:
    """FLOPs per op type (same convention as :func:`count_flops`); op types that count 0 are left out."""
    shapes = _infer_shapes(model)
    per_op: Counter[str] = Counter()
    for node in model.graph.node:
        flops = node_flops(node, shapes)
        if flops:
            per_op[node.op_type] += flops
    return dict(per_op)


def _infer_shapes(model: onnx.ModelProto) -> dict[str, tuple[int, ...]]:
    """Static shapes of every tensor of the main graph that shape inference can determine."""
    light = _copy_without_weights(model)
    try:
        inferred = shape_inference.infer_shapes(light, data_prop=True)
    except Exception:  # a graph onnx cannot infer still gets counted from the shapes it declares
        inferred = light
    shapes: dict[str, tuple[int, ...]] = {}
    graph = inferred.graph
    for init in model.graph.initializer:
        shapes[init.name] = tuple(init.dims)
    for vi in list(graph.input) + list(graph.value_info) + list(graph.output):
        tt = vi.type.tensor_type
        if tt.HasField("shape"):
            shapes.setdefault(vi.name, tuple(d.dim_value if d.HasField("dim_value") else 1 for d in tt.shape.dim))
    return shapes


def _copy_without_weights(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy of ``model`` whose float initializers are typed graph inputs without data."""
    out = onnx.ModelProto(ir_version=model.ir_version, opset_import=model.opset_import)
    out.graph.name = model.graph.name
    out.graph.node.extend(model.graph.node)
    out.graph.input.extend(model.graph.input)
    out.graph.output.extend(model.graph.output)
    out.graph.value_info.extend(model.graph.value_info)
    declared = {vi.name for vi in model.graph.input}
    for init in model.graph.initializer:
        if init.data_type in _FLOAT_TYPES:
            if init.name not in declared:
                out.graph.input.append(onnx.helper.make_tensor_value_info(init.name, init.data_type, init.dims))
        else:
            out.graph.initializer.append(init)
    out.functions.extend(model.functions)
    return out


def _elements(shape: tuple[int, ...] | None) -> int:
    return math.prod(shape) if shape is not None else 0


def node_flops(node: onnx.NodeProto, shapes: dict[str, tuple[int, ...]]) -> int:
    """FLOPs of one node, given the shapes of its tensors by name (the module's convention; 0 where unknown)."""
    op = node.op_type
    out = shapes.get(node.output[0]) if node.output else None
    if op in _ELEMENTWISE or op in _POOL_NORM_REDUCE:
        return _elements(out)
    if out is None:
        return 0

    def shape_of(i: int) -> tuple[int, ...] | None:
        return shapes.get(node.input[i]) if len(node.input) > i and node.input[i] else None

    if op in ("Conv", "ConvInteger", "QLinearConv"):
        w = shape_of(3 if op == "QLinearConv" else 1)
        if w is None or len(w) < 2:
            return 0
        bias = {"Conv": 2, "QLinearConv": 8}.get(op)
        has_bias = bias is not None and len(node.input) > bias and node.input[bias] != ""
        return 2 * _elements(out) * math.prod(w[1:]) + (_elements(out) if has_bias else 0)
    if op == "ConvTranspose":
        x, w = shape_of(0), shape_of(1)
        if x is None or w is None or len(w) < 2:
            return 0
        macs = _elements(x) * math.prod(w[1:])
        has_bias = len(node.input) > 2 and node.input[2] != ""
        return 2 * macs + (_elements(out) if has_bias else 0)
    if op in ("MatMul", "MatMulInteger", "QLinearMatMul"):
        a = shape_of(0)
        if not a:
            return 0
        return 2 * _elements(out) * a[-1]
    if op == "Gemm":
        a = shape_of(0)
        if a is None or len(a) != 2:
            return 0
        trans_a = next((attr.i for attr in node.attribute if attr.name == "transA"), 0)
        k = a[0] if trans_a else a[1]
        has_c = len(node.input) > 2 and node.input[2] != ""
        return 2 * _elements(out) * k + (_elements(out) if has_c else 0)
    return 0


def count_bytes_read(model: onnx.ModelProto) -> int:
    """Bytes one inference must read at least: every initializer and ``Constant`` node value, and every graph input
    at its static shape (a decode step's KV cache is an input).  Over the machine's streaming bandwidth it gives the
    memory roofline of a memory-bound model, as FLOPs over the matrix-product peak give the compute one.  A table
    only looked up (`_looked_up`: an embedding's Gather, a rotary embedding's cos/sin caches by position) counts the
    rows its lookups read, not all of its rows."""
    shapes = {v.name: [d.dim_value if d.HasField("dim_value") else 1 for d in v.type.tensor_type.shape.dim]
              for v in list(model.graph.input) + list(model.graph.value_info)}
    looked_up = _looked_up(model)
    total = 0
    for init in model.graph.initializer:
        lookups = looked_up.get(init.name)
        if lookups is None or not init.dims:
            total += tensor_bytes(init)
        else:
            rows = sum(math.prod(shapes.get(index, [1])) for index in lookups)
            total += min(tensor_bytes(init), rows * tensor_bytes(init) // init.dims[0])
    for node in model.graph.node:
        if node.op_type == "Constant":
            total += sum(tensor_bytes(a.t) for a in node.attribute if a.name == "value")
    weights = {init.name for init in model.graph.initializer}
    for value in model.graph.input:
        if value.name in weights:
            continue
        tensor = value.type.tensor_type
        dims = [d.dim_value if d.HasField("dim_value") else 1 for d in tensor.shape.dim]
        total += math.prod(dims) * _itemsize(tensor.elem_type)
    return total


_LOOKUPS = {("", "Gather"): {0: 1}, ("com.microsoft", "RotaryEmbedding"): {2: 1, 3: 1},
            ("", "RotaryEmbedding"): {1: 3, 2: 3}, ("com.microsoft", "EmbedLayerNormalization"): {2: 0, 3: 0, 4: 1}}
"""(domain, operator) -> {table input: the input indexing its rows}: reads of a table's rows by index (Gather along
axis 0; a rotary embedding's cos/sin caches by position_ids; an embedding norm's word, position and segment tables
by the token ids, as many positions as tokens, and the segment ids)."""


def _looked_up(model: onnx.ModelProto) -> dict[str, list[str]]:
    """Initializers every reader of which only looks rows up (`_LOOKUPS`) -> the index tensors of those lookups."""
    lookups: dict[str, list[str]] = {}
    other: set[str] = set()
    for node in model.graph.node:
        tables = _LOOKUPS.get(("" if node.domain == "ai.onnx" else node.domain, node.op_type), {})
        axis = next((a.i for a in node.attribute if a.name == "axis"), 0)
        for k, name in enumerate(node.input):
            index = tables.get(k) if axis == 0 else None
            if index is not None and index < len(node.input) and node.input[index]:
                lookups.setdefault(name, []).append(node.input[index])
            else:
                other.add(name)
    return {name: indices for name, indices in lookups.items() if name not in other}


def _itemsize(data_type: int) -> int:
    """Bytes per element of an ONNX tensor type (1 for types numpy cannot name)."""
    try:
        return np.dtype(onnx.helper.tensor_dtype_to_np_dtype(data_type)).itemsize
    except (KeyError, TypeError, ValueError):
        return 1
