"""Evaluating one node on its constant inputs, for `constant-fold`: through onnxruntime's CPU provider, so that a
folded constant equals what onnxruntime would have computed in the unfolded model, with onnx's reference evaluator
(corrected where it is wrong) where onnxruntime refuses the node alone; and whether a node can be evaluated at all,
so that the rule's check refuses what its apply could not do."""
from __future__ import annotations

import logging
import threading
import weakref
from collections import OrderedDict

import numpy as np
import onnx
import onnx_graphsurgeon as gs
from onnx import helper, numpy_helper
from onnx_graphsurgeon.exporters.onnx_exporter import OnnxExporter

from rlflow.graph.core import Graph
from rlflow.graph.model_file import max_ir_version
from rlflow.rewrites.base import RewriteError

log = logging.getLogger("rlflow")


def _fold_model(graph: Graph, node: gs.Node) -> onnx.ModelProto:
    """A model of `node` alone on its constant inputs (initializers, also where an Identity passes one on), with outputs
    out0, out1, ... left untyped for the runtime to infer (onnxruntime refuses an output declared of type UNDEFINED)."""
    initializers = {t.name: numpy_helper.from_array(Graph.constant(t), t.name) for t in node.inputs if t.name != ""}
    proto = OnnxExporter.export_node(node)
    del proto.output[:]
    proto.output.extend(f"out{k}" for k in range(len(node.outputs)))
    outputs = [onnx.ValueInfoProto(name=f"out{k}") for k in range(len(node.outputs))]
    return helper.make_model(helper.make_graph([proto], "fold", [], outputs, initializer=list(initializers.values())),
                             opset_imports=[helper.make_opsetid("", graph.opset)], ir_version=max_ir_version())


def _run_onnxruntime(model: onnx.ModelProto) -> list[np.ndarray]:
    """The outputs of a `_fold_model` computed by onnxruntime's CPU provider, with no graph optimisation."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    options.intra_op_num_threads = 1
    options.log_severity_level = 4  # a refusal is reported by the exception (and falls back), not logged
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return [np.asarray(v) for v in session.run(None, {})]


def _reference_ops() -> list[type]:
    """Corrections to onnx's reference evaluator, used where onnxruntime refuses a node.

    onnx 1.23's GatherElements (`np.choose`) fails past 32-64 entries along the axis and then falls back to a version
    that reads one index per row (BERT's `token_type_ids` buffer gathered at 16 positions of 512 gave "cannot reshape
    array of size 1 into shape (1,16)"), and it refuses indices smaller than the data on the other axes, which the
    operator allows.  Its LpNormalization takes the norm of x, not of |x| (wrong for p=1)."""
    from onnx.reference.op_run import OpRun

    class GatherElements(OpRun):
        op_domain = ""

        def _run(self, data, indices, axis=None):
            axis = int(axis or 0) % data.ndim
            indices = np.where(indices < 0, indices + data.shape[axis], indices).astype(np.int64)
            window = tuple(slice(None) if d == axis else slice(0, n) for d, n in enumerate(indices.shape))
            return (np.take_along_axis(data[window], indices, axis=axis),)

    class LpNormalization(OpRun):
        op_domain = ""

        def _run(self, x, axis=None, p=None):
            axis, p = (-1 if axis is None else int(axis)), (2 if p is None else int(p))
            norm = np.power(np.power(np.abs(x), p).sum(axis=axis, keepdims=True), 1.0 / p)
            return (np.where(norm == 0, 0, x / np.where(norm == 0, 1, norm)).astype(x.dtype),)

    return [GatherElements, LpNormalization]


def _run_reference(model: onnx.ModelProto) -> list[np.ndarray]:
    """The outputs of a `_fold_model` computed by onnx's reference evaluator (with `_reference_ops`)."""
    from onnx.reference import ReferenceEvaluator

    return [np.asarray(v) for v in ReferenceEvaluator(model, new_ops=_reference_ops()).run(None, {})]


def evaluate(graph: Graph, node: gs.Node) -> list[np.ndarray]:
    """Runs one node on its constant inputs through onnxruntime (the reference evaluator where onnxruntime refuses).

    Raises:
        RewriteError: neither can compute the node (`ConstantFold.check` refuses such a node: `evaluation_failure`).
    """
    try:
        model = _fold_model(graph, node)
    except Exception as exc:  # noqa: BLE001 - an input numpy cannot hold (bfloat16) or an attribute onnx refuses
        raise RewriteError(f"constant-fold@{node.name}: cannot export {node.op} alone ({exc})") from None
    try:
        return _run_onnxruntime(model)
    except Exception as exc:  # noqa: BLE001 - fall back to onnx's reference implementation
        log.debug("onnxruntime could not fold %s (%s); using the reference evaluator", node.name, exc)
    try:
        return _run_reference(model)
    except Exception as exc:  # noqa: BLE001
        raise RewriteError(f"constant-fold@{node.name}: cannot evaluate {node.op} ({exc})") from None


_VERDICTS: OrderedDict[tuple, tuple[list[weakref.ref], str | None]] = OrderedDict()
_VERDICT_LIMIT = 1024
_VERDICTS_LOCK = threading.Lock()


def _attr_key(value) -> object:
    """An attribute as a hashable value (a tensor attribute, as ConstantOfShape's `value`, by its bytes)."""
    if isinstance(value, gs.Constant):
        value = np.asarray(value.values)
    if isinstance(value, np.ndarray):
        return value.dtype.str, value.shape, value.tobytes()
    return tuple(value) if isinstance(value, list) else repr(value)


def evaluation_failure(graph: Graph, node: gs.Node) -> str | None:
    """Why `evaluate` cannot compute a node whose inputs are all constants, or None when it can.

    Found by evaluating the node, once per operator, attributes, opset and input arrays: the constants' arrays are
    shared by a graph's clones, so a search asks again at no cost (an entry holds only weak references to the arrays).
    """
    try:
        arrays = [Graph.constant(t) if t.name != "" else None for t in node.inputs]
        key = (node.op, graph.opset, len(node.outputs), tuple((k, _attr_key(v)) for k, v in sorted(node.attrs.items())),
               tuple(None if a is None else (id(a), a.dtype.str, a.shape) for a in arrays))
    except Exception:  # noqa: BLE001 - an input or attribute that cannot be keyed: ask every time
        arrays, key = [], None
    present = [a for a in arrays if a is not None]
    with _VERDICTS_LOCK:
        found = _VERDICTS.get(key) if key is not None else None
        if found is not None and len(found[0]) == len(present) and all(r() is a for r, a in zip(found[0], present)):
            _VERDICTS.move_to_end(key)
            return found[1]
    try:
        evaluate(graph, node)
        verdict = None
    except Exception as exc:  # noqa: BLE001 - check never raises
        verdict = f"neither onnxruntime nor onnx's reference evaluator computes it ({str(exc).split(': ', 1)[-1]})"
    if key is not None:
        try:
            refs = [weakref.ref(a) for a in present]
        except TypeError:  # an array type without weak references: not remembered
            return verdict
        with _VERDICTS_LOCK:
            _VERDICTS[key] = (refs, verdict)
            while len(_VERDICTS) > _VERDICT_LIMIT:
                _VERDICTS.popitem(last=False)
    return verdict
