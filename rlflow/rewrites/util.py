"""Small graph queries shared by rules: who produces and reads a tensor, constants, attribute defaults, shapes."""
from __future__ import annotations

from typing import Sequence

import numpy as np
import onnx
import onnx_graphsurgeon as gs
from onnx import helper, shape_inference

from rlflow.graph import Graph
from rlflow.shapes import local_model, skeleton, symbolic_shapes

MS = "com.microsoft"
"""onnxruntime's contrib operator domain, which the contrib fusions emit and the unfusing inverses root at."""

UNARY_ELEMENTWISE = frozenset({
    "Relu", "Sigmoid", "Tanh", "Exp", "Log", "Abs", "Neg", "Sqrt", "Erf", "LeakyRelu", "Elu", "Selu", "HardSigmoid",
    "Softplus", "Softsign", "Reciprocal", "Floor", "Ceil", "Round", "Sin", "Cos", "Sign", "HardSwish", "Celu",
})
"""Single-input operators applied to each element independently (attributes, if any, are scalars)."""

BINARY_ELEMENTWISE = frozenset({"Add", "Sub", "Mul", "Div", "Max", "Min", "Pow"})
"""Two-input broadcasting elementwise operators."""

COMMUTATIVE = frozenset({"Add", "Mul", "Max", "Min"})

_NONDETERMINISTIC = {"RandomNormal", "RandomNormalLike", "RandomUniform", "RandomUniformLike", "Multinomial",
                     "Bernoulli", "Dropout", "Constant", "If", "Loop", "Scan"}
DETERMINISTIC_OPS = tuple(sorted({s.name for s in onnx.defs.get_all_schemas() if s.domain in ("", "ai.onnx")}
                                 - _NONDETERMINISTIC))
"""Standard operators whose outputs depend on their inputs alone (no randomness, no subgraphs)."""


def only_consumer(tensor: gs.Tensor) -> gs.Node | None:
    """The single node reading `tensor`, or None when there are zero or several."""
    return tensor.outputs[0] if len(tensor.outputs) == 1 else None


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


def is_standard(node: gs.Node | None) -> bool:
    """True for a node of the default ONNX domain (a custom-domain `Mul` is not a Mul)."""
    return node is not None and (node.domain or "") in ("", "ai.onnx")


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


def constant_input(node: gs.Node, index: int) -> np.ndarray | None:
    """The value of input `index` when it is a constant (absent optional inputs give None)."""
    if index >= len(node.inputs) or node.inputs[index].name == "":
        return None
    return Graph.constant(node.inputs[index])


def has_input(node: gs.Node, index: int) -> bool:
    """True when optional input `index` is present."""
    return index < len(node.inputs) and node.inputs[index].name != ""


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


def single_output(node: gs.Node) -> gs.Tensor | None:
    """The node's only output, or None when it has several (or none)."""
    return node.outputs[0] if len(node.outputs) == 1 else None


def used_outputs(graph: Graph, node: gs.Node) -> list[gs.Tensor]:
    """The outputs of `node` that something reads (a consumer or the graph's outputs)."""
    return [t for t in node.outputs if t.outputs or graph.is_output(t)]


def has_dynamic_inputs(graph: Graph) -> bool:
    """True when some input dimension of the original interface is dynamic (the static shapes are then only one
    instance, so a rule must not rely on the value of a dimension that might change)."""
    for vi in graph.interface[0]:
        ttype = vi.type.tensor_type
        if not ttype.HasField("shape"):
            return True
        if any(not (d.HasField("dim_value") and d.dim_value > 0) for d in ttype.shape.dim):
            return True
    return False


def dynamic_axes(graph: Graph, tensor: gs.Tensor) -> tuple[bool, ...] | None:
    """Which dimensions of `tensor` follow the model's dynamic input dimensions (True) rather than being fixed.

    Found by inferring shapes again with every dynamic input dimension one larger and seeing which dimensions move;
    None when the shape is unknown.  Where the second inference fails, every dimension counts as dynamic.
    """
    shape = graph.shape(tensor)
    if shape is None:
        return None
    if not has_dynamic_inputs(graph):
        return (False,) * len(shape)
    moved = _moved(graph, tensor)
    if moved is None:
        return (True,) * len(shape)
    other = moved.get(tensor.name)
    if other is None:
        if isinstance(tensor, gs.Constant):
            return (False,) * len(shape)
        return (True,) * len(shape)
    if len(other) != len(shape):
        return (True,) * len(shape)
    return tuple(a != b for a, b in zip(shape, other))


def _moved(graph: Graph, tensor: gs.Tensor) -> dict[str, tuple] | None:
    """Tensor name -> shape with the dynamic input dimensions one larger, answering `tensor` as well as the
    inferences can (None: the graph refused them), from `graph.lineage_cache` where it can.

    A rewrite keeps the value of every tensor it keeps the name of, so an edited graph's (or a rewritten clone's)
    answer for a tensor seen before still holds: `apply_all` checks each of 12 layers' matches on one graph without
    12 more inferences, and the matches of a rewritten graph are found without one.  A tensor a rewrite added is
    inferred from those facts through the few nodes that produce it (`_moved_locally`).  Where that cannot answer,
    the whole graph is inferred: onnx's inference first, onnxruntime's symbolic one (0.15-0.2 s on a 600-node
    transformer, the largest part of a rule-wide step) only once a tensor is asked for that onnx's left open, as its
    answer cannot improve one onnx completed.
    """
    name = tensor.name
    key = tuple(n.name for n in graph.gs.nodes)
    stamp, moved = graph.lineage_cache.get("dynamic_axes", (None, None))
    own = stamp is not None and stamp[0] == key
    if stamp is not None and _answers(moved, name, own=own, symbolic=stamp[1]):
        return moved
    if stamp is not None and not own and moved is not None:
        local = _moved_locally(graph, tensor, moved)
        if local is not None:
            moved = {**moved, **local}
            graph.lineage_cache["dynamic_axes"] = (stamp, moved)
            return moved
    model = _moved_skeleton(graph)
    if not own:  # no facts yet, or an ancestor's that do not answer: this graph's own, onnx's first
        moved = _onnx_moved(model)
        graph.lineage_cache["dynamic_axes"] = ((key, False), moved)
        if _answers(moved, name, own=True, symbolic=False):
            return moved
    moved = _with_symbolic(model, moved)
    graph.lineage_cache["dynamic_axes"] = ((key, True), moved)
    return moved


LOCAL_NODES = 8
"""Producing nodes at most that `_moved_locally` infers through before it leaves the tensor to the whole graph's
inference."""


def _moved_locally(graph: Graph, tensor: gs.Tensor, facts: dict[str, tuple]) -> dict[str, tuple] | None:
    """Moved shapes of `tensor` and the other outputs of the nodes that produce it from tensors `facts` knows (at
    most LOCAL_NODES of them), by symbolic inference on those nodes alone; None unless that completes `tensor`.

    Inference is local, so given its inputs' moved shapes a node's outputs get the shapes the whole graph's inference
    would give them; a value it needs that the nodes do not compute (a Reshape target from a Shape chain) leaves the
    shape open, and the caller infers the whole graph.
    """
    def known(t: gs.Tensor) -> bool:
        return isinstance(t, gs.Constant) or t.name == "" or None not in facts.get(t.name, (None,))

    nodes, placed = [], set()

    def place(t: gs.Tensor) -> bool:  # the producers of `t` in topological order (post-order); False: give up
        if known(t):
            return True
        producer = t.inputs[0] if len(t.inputs) == 1 else None
        if producer is None or len(nodes) >= LOCAL_NODES or any(isinstance(v, gs.Graph)
                                                                for v in producer.attrs.values()):
            return False
        if id(producer) in placed:
            return True
        placed.add(id(producer))
        if not all(place(x) for x in producer.inputs):
            return False
        nodes.append(producer)
        return True

    if not place(tensor) or not nodes:
        return None
    model = local_model(graph, nodes, lambda t: facts.get(t.name))
    if model is None:
        return None
    try:
        shapes = _shapes_of(symbolic_shapes(model))
    except Exception:  # noqa: BLE001 - the whole graph's inference will answer
        return None
    local = {t.name: shapes[t.name] for node in nodes for t in node.outputs
             if t.name in shapes and None not in shapes[t.name]}
    return local if tensor.name in local else None


def _answers(moved: dict[str, tuple] | None, name: str, *, own: bool, symbolic: bool) -> bool:
    """Whether facts answer `name` for good: this graph's refused inference; a known shape that the symbolic
    inference has completed or need not; this graph's facts after the symbolic inference (a name still missing is
    then dynamic)."""
    if moved is None:
        return own
    if name in moved:
        return symbolic or None not in moved[name]
    return own and symbolic


def _moved_skeleton(graph: Graph) -> onnx.ModelProto:
    """`graph` without its weights' values (typed inputs instead), every dynamic input dimension one larger."""
    moved = skeleton(graph)
    interface = {vi.name: vi for vi in graph.interface[0]}
    for vi in moved.graph.input:
        original = interface.get(vi.name)
        if original is None:
            continue
        for dim, orig in zip(vi.type.tensor_type.shape.dim, original.type.tensor_type.shape.dim):
            if not (orig.HasField("dim_value") and orig.dim_value > 0):
                dim.dim_value = dim.dim_value + 1
    return moved


def _onnx_moved(model: onnx.ModelProto) -> dict[str, tuple] | None:
    """onnx's shapes of the tensors of `model` (a skeleton), None where it refuses the other sizes (be conservative)."""
    try:
        return _shapes_of(shape_inference.infer_shapes(model, check_type=False, strict_mode=False, data_prop=True))
    except Exception:  # noqa: BLE001 - see the docstring
        return None


def _with_symbolic(model: onnx.ModelProto, moved: dict[str, tuple]) -> dict[str, tuple]:
    """`moved` (a new dict) completed by onnxruntime's symbolic inference, which knows its contrib operators and
    follows Shape chains further; what onnx found is kept where the symbolic one knows no more."""
    moved = dict(moved)
    if not any(None in moved.get(out, (None,)) for node in model.graph.node for out in node.output if out):
        return moved
    try:
        symbolic = _shapes_of(symbolic_shapes(model))
    except Exception:  # noqa: BLE001 - what onnx found is kept; the rest counts as dynamic
        symbolic = {}
    for name, shape in symbolic.items():
        if name not in moved or sum(d is None for d in shape) < sum(d is None for d in moved[name]):
            moved[name] = shape
    return moved


def _shapes_of(model: onnx.ModelProto) -> dict[str, tuple]:
    """Tensor name -> inferred shape (None for a symbolic dimension) of every typed value in `model`."""
    shapes = {}
    for vi in list(model.graph.value_info) + list(model.graph.output) + list(model.graph.input):
        ttype = vi.type.tensor_type
        if ttype.HasField("shape"):
            shapes[vi.name] = tuple(d.dim_value if d.HasField("dim_value") else None for d in ttype.shape.dim)
    return shapes


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


def broadcast_shape(*shapes: Sequence[int] | None) -> tuple[int, ...] | None:
    """numpy broadcasting of static shapes, or None when a shape is unknown or they do not broadcast."""
    if any(s is None for s in shapes):
        return None
    try:
        return tuple(int(d) for d in np.broadcast_shapes(*[tuple(s) for s in shapes]))
    except ValueError:
        return None


def scalar(array: np.ndarray | None) -> float | None:
    """The value of a constant whose elements are all the same (a scalar in any shape), else None."""
    if array is None or array.size == 0 or array.dtype.kind not in "fiub":
        return None
    flat = array.reshape(-1)
    first = flat[0]
    return float(first) if np.all(flat == first) else None


def normalize_axis(axis: int, rank: int) -> int | None:
    """A non-negative axis, or None when out of range."""
    axis = int(axis)
    if axis < 0:
        axis += rank
    return axis if 0 <= axis < rank else None


def int_list(array: np.ndarray | None) -> tuple[int, ...] | None:
    """A 0-d or 1-d integer constant as a tuple of ints."""
    if array is None or array.dtype.kind not in "iu" or array.ndim > 1:
        return None
    return tuple(int(v) for v in array.reshape(-1))


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


def same_value(a: gs.Tensor, b: gs.Tensor) -> bool:
    """The same tensor, or two constants with equal values."""
    if a is b:
        return True
    va, vb = Graph.constant(a), Graph.constant(b)
    return (va is not None and vb is not None and va.dtype == vb.dtype and va.shape == vb.shape
            and bool(np.array_equal(va, vb)))


def bypass(graph: Graph, node: gs.Node, source: gs.Tensor) -> None:
    """Makes every reader of the node's first output read `source` instead (the node then dies in cleanup)."""
    graph.replace_uses(node.outputs[0], source)


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


def to_rank(array: np.ndarray, rank: int) -> np.ndarray:
    """A constant with leading 1s added up to `rank` (numpy broadcasting's view of it)."""
    return array.reshape((1,) * (rank - array.ndim) + array.shape)


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


def emit(graph: Graph, op: str, inputs: Sequence[gs.Tensor], attrs: dict | None = None, domain: str = "",
         hint: str | None = None) -> gs.Tensor:
    """Adds a single-output node and returns its output."""
    (out,) = graph.add_node(op, list(inputs), attrs=attrs, domain=domain, hint=hint)
    return out


_NUMPY_BINARY = {"Add": np.add, "Sub": np.subtract, "Mul": np.multiply, "Div": np.divide, "Max": np.maximum,
                 "Min": np.minimum, "MatMul": np.matmul}


def combine(graph: Graph, op: str, a: gs.Tensor, b: gs.Tensor, hint: str = "const") -> gs.Tensor:
    """`op(a, b)`: computed now when both are constants (a new constant), else a new node."""
    va, vb = Graph.constant(a), Graph.constant(b)
    if va is not None and vb is not None and op in _NUMPY_BINARY and va.dtype == vb.dtype and va.dtype.kind == "f":
        value = _NUMPY_BINARY[op](va.astype(np.float64), vb.astype(np.float64)).astype(va.dtype)
        return graph.add_constant(value, hint)
    return emit(graph, op, [a, b])


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


def clone_node(graph: Graph, node: gs.Node, inputs: Sequence[gs.Tensor], outputs: int | Sequence[gs.Tensor] = 1
               ) -> list[gs.Tensor]:
    """Adds a node with the same operator, domain and attributes as `node` on new inputs."""
    return graph.add_node(node.op, list(inputs), outputs, attrs=dict(node.attrs), domain=node.domain or "",
                          hint=node.name)
