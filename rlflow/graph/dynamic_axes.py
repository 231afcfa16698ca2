"""Which dimensions of a tensor follow the model's dynamic input dimensions: `dynamic_axes`.

A graph is rewritten at one set of static input shapes, but the model must stay right at every other value of its
dynamic dimensions (batch, sequence).  A rewrite that bakes in a shape (a Reshape target, a Split size, a normalised
axis) is only safe along dimensions that do not move with those inputs, so rules ask `dynamic_axes` before they rely
on a dimension's value.  The answer comes from inferring shapes again with every dynamic input dimension one larger and
seeing which dimensions move; the answers are kept on the graph's `lineage_cache` and reused by the graphs rewritten
from it, because inference is the costly part.
"""
from __future__ import annotations

import onnx
import onnx_graphsurgeon as gs
from onnx import shape_inference

from rlflow.graph.core import Graph
from rlflow.graph.shape_inference import local_model, skeleton, symbolic_shapes


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


def shape_one_larger(graph: Graph, tensor: gs.Tensor) -> tuple[int, ...] | None:
    """`tensor`'s shape with every dynamic input dimension one larger (the inference `dynamic_axes` reads), or None
    when unknown."""
    shape = graph.shape(tensor)
    if shape is None or not has_dynamic_inputs(graph):
        return None if shape is None else tuple(shape)
    moved = _moved(graph, tensor)
    other = moved.get(tensor.name) if moved is not None else None
    return None if other is None or None in other else tuple(other)


def _moved(graph: Graph, tensor: gs.Tensor) -> dict[str, tuple] | None:
    """Tensor name -> shape with the dynamic input dimensions one larger, answering `tensor` as well as the
    inferences can (None: the graph refused them), from `graph.lineage_cache` where it can.

    A rewrite keeps the value of every tensor it keeps the name of, so an edited graph's (or a rewritten clone's)
    answer for a tensor seen before still holds: `apply_all` checks every layer's match on one graph without one more
    inference per layer, and the matches of a rewritten graph are found without one.  A tensor a rewrite added is
    inferred from those facts through the few nodes that produce it (`_moved_locally`).  Where that cannot answer,
    the whole graph is inferred: onnx's inference first, onnxruntime's symbolic one (several times slower, the largest
    part of a rule-wide step) only once a tensor is asked for that onnx's left open, as its answer cannot improve one
    onnx completed.
    """
    name = tensor.name
    stamp, moved = graph.lineage_cache.get("dynamic_axes", (None, None))
    if stamp is not None and moved is not None and name in moved and _answers(moved, name, own=False,
                                                                               symbolic=stamp[1]):
        return moved  # a name the facts know answers whoever's they are: no need to list the nodes (the most asked)
    key = tuple(n.name for n in graph.gs.nodes)
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
