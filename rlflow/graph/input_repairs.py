"""What rlflow does to a model written by other hands before its rules see it, so that whatever onnxruntime loads and
runs is optimised rather than refused (docs/robustness.md lists each step).

* `repair`: nodes out of topological order are sorted, and a domain a node uses without an opset import is imported.
  The onnx checker refuses both, onnxruntime runs both.  What was done is recorded in the model's metadata
  (`REPAIRS_KEY`), so the report and the written model say so.
* `convert_opset`: models below opset 13 are converted to 13 by onnx's version converter, so rules meet one form of
  Split, Squeeze and friends; a model holding LayerNormalization in the default domain below opset 17 (onnxruntime
  registers it there at every opset) is converted to 17, where that operator is ONNX's own with the same meaning.  The
  converter rewrites a Softmax below 13 whose input rank it cannot tell as Flatten, Softmax, Reshape, which hides an
  attention from every rule: a Softmax over its input's last axis (rank from onnxruntime's symbolic shape inference) is
  given axis -1 first, the one form whose meaning the conversion keeps without reshaping.
"""
from __future__ import annotations

import heapq
import logging

import onnx
from onnx import helper

from rlflow.graph.external_data import graphs_within

log = logging.getLogger("rlflow")

REPAIRS_KEY = "rlflow.input_repairs"
"""Metadata key under which the repairs made on a model are listed, joined by '; '."""

MIN_OPSET = 13
"""Models below this opset are converted up, so rules meet one form of Split, Squeeze and friends."""

LAYER_NORM_OPSET = 17
"""The opset from which LayerNormalization is an ONNX operator; onnxruntime registers it in the default domain below."""

_LAST_AXIS_OPS = ("Softmax", "LogSoftmax", "Hardmax")
"""Operators whose axis meant "flatten to 2-D there" below opset 13 and means "this one axis" from 13 on."""


def default_opset(model: onnx.ModelProto) -> int | None:
    return next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), None)


def repairs(model: onnx.ModelProto) -> list[str]:
    """The repairs recorded in `model`'s metadata."""
    return parse_repairs(next((p.value for p in model.metadata_props if p.key == REPAIRS_KEY), ""))


def parse_repairs(text: str) -> list[str]:
    """The repairs a `REPAIRS_KEY` value lists."""
    return [r for r in text.split("; ") if r]


def repair(model: onnx.ModelProto) -> list[str]:
    """Sorts `model`'s nodes and imports the domains its nodes use, in place; returns what was done (also recorded in
    its metadata).  A graph whose nodes cannot be sorted (a cycle, a name nothing produces) is left for the checker to
    refuse with its reason."""
    done = []
    missing = sorted(_used_domains(model) - {o.domain for o in model.opset_import} - {"", "ai.onnx"}
                     - {f.domain for f in model.functions})
    if missing:
        model.opset_import.extend(helper.make_opsetid(domain, 1) for domain in missing)
        done.append(f"opset import added for {', '.join(missing)} (version 1)")
    if _sort(model.graph):
        done.append("nodes sorted into topological order")
    if done:
        record(model, done)
    return done


def record(model: onnx.ModelProto, done: list[str]) -> None:
    """Adds `done` to the repairs `model`'s metadata lists."""
    listed = repairs(model)
    listed += [r for r in done if r not in listed]
    kept = [p for p in model.metadata_props if p.key != REPAIRS_KEY]
    del model.metadata_props[:]
    model.metadata_props.extend(kept)
    model.metadata_props.add(key=REPAIRS_KEY, value="; ".join(listed))


def ort_only_layer_norm(model: onnx.ModelProto) -> bool:
    """Whether `model` holds LayerNormalization in the default domain below opset 17 (onnxruntime's registration)."""
    version = default_opset(model)
    return (version is not None and version < LAYER_NORM_OPSET
            and any(n.op_type == "LayerNormalization" and n.domain in ("", "ai.onnx") for n in _nodes(model.graph)))


def convert_opset(model: onnx.ModelProto) -> onnx.ModelProto:
    """`model` at the opset its rules expect (see the module's docstring), the conversion recorded; `model` itself
    where none is needed, or where the converter fails (with a warning: rules check the opset they need).  The result
    is not checked here: the caller checks it."""
    version = default_opset(model)
    target = LAYER_NORM_OPSET if ort_only_layer_norm(model) else MIN_OPSET
    if version is None or version >= target:
        return model
    from onnx import version_converter

    work = onnx.ModelProto()
    work.CopyFrom(model)
    held = [n for n in _nodes(work.graph) if n.op_type == "LayerNormalization" and n.domain in ("", "ai.onnx")]
    for node in held:  # no adapter below 17 knows it; its meaning does not change
        node.domain = "rlflow.held"
    if held:
        work.opset_import.append(helper.make_opsetid("rlflow.held", 1))
    last_axis = _give_last_axis(work) if version < 13 else 0
    try:
        converted = version_converter.convert_version(work, target)
    except Exception as exc:  # noqa: BLE001 - keep the original opset
        log.warning("could not convert opset %d to %d (%s); rules needing opset %d are skipped",
                    version, target, str(exc).splitlines()[0] if str(exc) else exc, target)
        return model
    for node in _nodes(converted.graph):
        if node.domain == "rlflow.held":
            node.domain = ""
    kept = [o for o in converted.opset_import if o.domain != "rlflow.held"]
    del converted.opset_import[:]
    converted.opset_import.extend(kept)
    note = f"opset {version} converted to {target}"
    if held:
        note += f", {len(held)} LayerNormalization of onnxruntime's registration taken as ONNX's"
    if last_axis:
        note += f", {last_axis} {'/'.join(_LAST_AXIS_OPS)} over the last axis kept unreshaped"
    record(converted, [note])
    return converted


def _give_last_axis(model: onnx.ModelProto) -> int:
    """Gives axis -1 to each Softmax-like node of the main graph over its input's last axis; returns how many."""
    candidates = [n for n in model.graph.node if n.op_type in _LAST_AXIS_OPS and n.domain in ("", "ai.onnx")]
    if not candidates:
        return 0
    ranks = _ranks(model)
    count = 0
    for node in candidates:
        axis = next((a for a in node.attribute if a.name == "axis"), None)
        rank = ranks.get(node.input[0])
        value = axis.i if axis is not None else 1
        if rank is not None and value >= 0 and value == rank - 1:
            axis = axis if axis is not None else node.attribute.add(name="axis", type=onnx.AttributeProto.INT)
            axis.i = -1
            count += 1
    return count


def _ranks(model: onnx.ModelProto) -> dict[str, int]:
    """Tensor ranks by onnxruntime's symbolic shape inference (it follows Reshapes onnx's inference gives up on);
    empty where it fails."""
    try:
        from onnxruntime.tools.symbolic_shape_infer import SymbolicShapeInference

        inferred = SymbolicShapeInference.infer_shapes(model, auto_merge=True)
    except Exception as exc:  # noqa: BLE001 - the conversion goes on without the ranks
        log.info("symbolic shape inference failed (%s); Softmax ranks unknown",
                 str(exc).splitlines()[0] if str(exc) else exc)
        return {}
    return {vi.name: len(vi.type.tensor_type.shape.dim) for vi in
            [*inferred.graph.value_info, *inferred.graph.input, *inferred.graph.output]
            if vi.type.tensor_type.HasField("shape")}


def _nodes(graph: onnx.GraphProto):
    """Every node of `graph` and of its subgraphs."""
    return (node for g in graphs_within(graph) for node in g.node)


def _used_domains(model: onnx.ModelProto) -> set[str]:
    nodes = [*_nodes(model.graph), *(n for f in model.functions for n in f.node)]
    return {n.domain for n in nodes}


def _reads(node: onnx.NodeProto) -> set[str]:
    """The names `node` reads, its subgraphs' reads from the enclosing scope included."""
    names = {name for name in node.input if name}
    for attr in node.attribute:
        for sub in [attr.g] if attr.type == onnx.AttributeProto.GRAPH else list(attr.graphs):
            inner = {name for n in sub.node for name in n.output} | {vi.name for vi in sub.input} \
                | {t.name for t in sub.initializer}
            names |= {name for n in sub.node for name in _reads(n)} - inner
    return names


def _sort(graph: onnx.GraphProto) -> bool:
    """Sorts `graph`'s nodes where they are out of order (Kahn's algorithm, the file's order kept where the data
    allow); whether it did."""
    available = {vi.name for vi in graph.input} | {t.name for t in graph.initializer} | {""}
    producer = {name: k for k, node in enumerate(graph.node) for name in node.output}
    reads = [_reads(node) for node in graph.node]
    seen = set(available)
    in_order = True
    for node, names in zip(graph.node, reads):
        if not names <= seen:
            in_order = False
            break
        seen.update(node.output)
    if in_order:
        return False
    waiting = [len({producer[n] for n in names if n in producer and n not in available}) for names in reads]
    readers: dict[int, list[int]] = {}
    for k, names in enumerate(reads):
        for p in {producer[n] for n in names if n in producer and n not in available}:
            readers.setdefault(p, []).append(k)
    ready = [k for k, w in enumerate(waiting) if w == 0]  # a heap: the file's order wherever the data allow it
    order = []
    while ready:
        k = heapq.heappop(ready)
        order.append(k)
        for r in readers.get(k, []):
            waiting[r] -= 1
            if waiting[r] == 0:
                heapq.heappush(ready, r)
    if len(order) != len(graph.node):
        return False  # a cycle: the checker says so
    nodes = [graph.node[k] for k in order]
    sorted_nodes = [onnx.NodeProto() for _ in nodes]
    for copy, node in zip(sorted_nodes, nodes):
        copy.CopyFrom(node)
    del graph.node[:]
    graph.node.extend(sorted_nodes)
    return True
