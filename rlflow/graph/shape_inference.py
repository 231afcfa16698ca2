"""Shape inference for `rlflow.graph.core.Graph` (the `graph` of every function here): every tensor gets a static shape and
an element type.

Whole graphs go through onnx's inference, then onnxruntime's symbolic one where onnx leaves shapes open
(`infer_shapes`); after a rewrite only the nodes it added are inferred, from the known shapes of their inputs
(`infer_locally`).  Both run on a *skeleton*: the nodes with the large constants as typed inputs, so inference never copies weights.
`rlflow.graph.dynamic_axes.dynamic_axes` runs the same machinery at other input sizes.
"""
from __future__ import annotations

import importlib
import importlib.util
import logging
import sys
from pathlib import Path
from typing import Callable, Mapping, Sequence

import numpy as np
import onnx
import onnx_graphsurgeon as gs
from onnx import helper, shape_inference
from onnx_graphsurgeon.exporters.onnx_exporter import OnnxExporter

from rlflow.graph.model_file import max_ir_version

log = logging.getLogger("rlflow")

SMALL_CONSTANT = 1024
"""Constants up to this many elements keep their values during shape inference (Reshape targets, Slice bounds)."""


def infer_shapes(graph) -> None:
    """Refreshes the shape and element type of every tensor of `graph` at its fixed input shapes.

    Where onnx leaves a shape open, onnxruntime's symbolic shape inference completes it: exporters compute positions,
    masks and reshape targets from `Shape` of the inputs, which onnx's data propagation does not follow through a
    `Slice` of a constant (a BERT export left 110 tensors without a shape, and every fusion that checks shapes refused
    the model), while the symbolic pass resolves them all at the fixed input shapes.
    """
    tensors = graph.gs.tensors()
    model = skeleton(graph)
    apply_inferred(model, tensors)
    if any(not isinstance(t, gs.Constant) and (t.dtype is None or graph.shape(t) is None) for t in tensors.values()):
        apply_inferred(model, tensors, symbolic=True)


def infer_locally(graph, nodes: list[gs.Node]) -> bool:
    """Shapes for the outputs of `nodes` alone, from the known shapes of their inputs; False when that is not enough.

    Shape inference is local for standard operators, so after a rewrite only the nodes it added need it; a value
    computed elsewhere (a Reshape target from a Shape chain, an outer tensor of a subgraph) makes this give up, and
    the caller falls back to the whole graph.
    """
    model = local_model(graph, nodes, lambda t: graph.shape(t) if t.dtype is not None else None)
    if model is None:
        return False
    produced = {t.name: t for node in nodes for t in node.outputs}
    apply_inferred(model, produced)
    return all(t.dtype is not None and graph.shape(t) is not None for t in produced.values())


def local_model(graph, nodes: Sequence[gs.Node],
                shape_of: Callable[[gs.Tensor], Sequence[int] | None]) -> onnx.ModelProto | None:
    """`nodes` (in topological order) alone as a model for shape inference: the tensors they read and do not produce
    become typed inputs of shape `shape_of(tensor)` (constants: as in `skeleton`); None when `shape_of` does not know
    one (None) or an input has no element type."""
    produced = {t.name for node in nodes for t in node.outputs}
    inputs, initializers, seen = [], [], set()
    for node in nodes:
        for tensor in node.inputs:
            if tensor.name in produced or tensor.name in seen or tensor.name == "":
                continue
            seen.add(tensor.name)
            if isinstance(tensor, gs.Constant):
                _place_constant(tensor, inputs, initializers)
                continue
            shape = shape_of(tensor)
            if tensor.dtype is None or shape is None:
                return None
            inputs.append(_typed_input(tensor, shape))
    return _model(graph, "local", nodes, inputs, produced, initializers)


def skeleton(graph) -> onnx.ModelProto:
    """The whole graph for shape inference: its nodes, inputs and outputs, and its constants (`_place_constant`)."""
    inputs = [OnnxExporter.export_value_info_proto(t, do_type_check=False) for t in graph.gs.inputs]
    initializers = []
    for tensor in graph.gs.tensors().values():
        if isinstance(tensor, gs.Constant):
            _place_constant(tensor, inputs, initializers)
    return _model(graph, "skeleton", graph.gs.nodes, inputs, [t.name for t in graph.gs.outputs], initializers)


def _place_constant(tensor: gs.Constant, inputs: list, initializers: list) -> None:
    """A constant of a model for shape inference: with its values where small (Reshape targets, Slice bounds), else as
    a typed input (inference never copies weights)."""
    if tensor.values.size <= SMALL_CONSTANT:
        initializers.append(OnnxExporter.export_tensor_proto(tensor))
    else:
        inputs.append(_typed_input(tensor, tensor.values.shape))


def _typed_input(tensor: gs.Tensor, shape: Sequence[int]) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(tensor.name, helper.np_dtype_to_tensor_dtype(np.dtype(tensor.dtype)),
                                         list(shape))


def _model(graph, name: str, nodes: Sequence[gs.Node], inputs: list, outputs, initializers: list) -> onnx.ModelProto:
    """`nodes` as a model with `graph`'s opsets, the outputs named `outputs` left for inference to type."""
    body = helper.make_graph([OnnxExporter.export_node(n) for n in nodes], name, inputs,
                             [helper.make_empty_tensor_value_info(output) for output in outputs],
                             initializer=initializers)
    return helper.make_model(body, opset_imports=graph.opset_imports(), ir_version=max_ir_version())


def apply_inferred(model: onnx.ModelProto, tensors: Mapping[str, gs.Tensor], symbolic: bool = False) -> None:
    """Runs shape inference on `model` (onnx's, or onnxruntime's symbolic one) and copies the element types and static
    shapes found to `tensors`.  A shape inference leaves open does not erase one already known: rewrites preserve
    values, so a tensor that survives one keeps its shape."""
    try:
        if symbolic:
            inferred = symbolic_shapes(model)
        else:
            inferred = shape_inference.infer_shapes(model, check_type=False, strict_mode=False, data_prop=True)
    except Exception as exc:  # noqa: BLE001 - inference errors are reported, not fatal: ORT checks later
        log.debug("%sshape inference failed: %s", "symbolic " if symbolic else "", exc)
        return
    for vi in list(inferred.graph.value_info) + list(inferred.graph.output):
        tensor = tensors.get(vi.name)
        if tensor is None or isinstance(tensor, gs.Constant):
            continue
        ttype = vi.type.tensor_type
        if not ttype.elem_type:
            continue
        tensor.dtype = helper.tensor_dtype_to_np_dtype(ttype.elem_type)
        if ttype.HasField("shape"):
            dims = [d.dim_value if d.HasField("dim_value") else None for d in ttype.shape.dim]
            if None not in dims:
                tensor.shape = dims
            elif tensor.shape is None or any(not isinstance(d, (int, np.integer)) for d in tensor.shape):
                tensor.shape = None


def symbolic_shapes(skeleton: onnx.ModelProto) -> onnx.ModelProto:
    """onnxruntime's symbolic shape inference, keeping what it found where it could not finish.

    Its `infer_shapes` raises when any shape stays open, and first saves the model as `sym_shape_infer_temp.onnx` in
    the working directory: a tool must not write there, and a partial answer is still worth having.  So its steps
    are run here one by one (they are not public API: a change in them is caught by the caller, and shapes stay open).
    """
    inference = _symbolic_shape_infer().SymbolicShapeInference(int_max=2**31 - 1, auto_merge=True,
                                                               guess_output_rank=False, verbose=0)
    inference._preprocess(skeleton)
    while inference.run_:
        inference._infer_impl()
    inference._update_output_from_vi()
    return inference.out_mp_


def _symbolic_shape_infer():
    """onnxruntime's `tools/symbolic_shape_infer.py`, loaded from its file (under a name of rlflow's) unless already
    imported: importing it as `onnxruntime.tools.symbolic_shape_infer` runs the package's `__init__`, which imports
    torch where torch is installed, a second of every greedy or TASO-style run that never uses torch."""
    official, own = "onnxruntime.tools.symbolic_shape_infer", "_rlflow_symbolic_shape_infer"
    for name in (official, own):
        if name in sys.modules:
            return sys.modules[name]
    import onnxruntime

    path = Path(onnxruntime.__file__).parent / "tools" / "symbolic_shape_infer.py"
    if not path.is_file():
        return importlib.import_module(official)
    spec = importlib.util.spec_from_file_location(own, path)
    module = sys.modules[own] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
