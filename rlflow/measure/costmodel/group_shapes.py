"""Shapes and dtypes of every tensor a fusion group reads or writes, where the graph's own shape inference stops.

`rlflow.graph.core` infers shapes with onnx (falling back to onnxruntime's symbolic inference); both stop at onnxruntime's
contrib operators (SkipLayerNormalization, FusedMatMul, BiasGelu...), which rewrites introduce.  The cost model needs
a static shape for every tensor at a group's edge, so here the contrib operators are replaced by standard stand-ins
with the same output shapes and onnx shape inference is run once more, on demand.
"""
from __future__ import annotations

import logging

import numpy as np
import onnx
import onnx_graphsurgeon as gs
from onnx import helper, numpy_helper
from onnx_graphsurgeon.exporters.onnx_exporter import OnnxExporter

from rlflow.graph.core import Graph
from rlflow.graph.model_file import ONNXRUNTIME_OPS_IN_ONNX_DOMAIN, max_ir_version

log = logging.getLogger("rlflow")


class Shapes:
    """Shapes and dtypes of a graph's tensors, completed where onnx shape inference stops at contrib operators."""

    def __init__(self, graph: Graph):
        self.graph = graph
        self._completed: dict | None = None

    def get(self, tensor) -> tuple[tuple[int, ...] | None, object]:
        shape, dtype = self.graph.shape(tensor), tensor.dtype
        if (shape is None or dtype is None) and not isinstance(tensor, gs.Constant):
            if self._completed is None:
                self._completed = complete_shapes(self.graph)
            more_shape, more_dtype = self._completed.get(tensor.name, (None, None))
            shape = shape if shape is not None else more_shape
            dtype = dtype if dtype is not None else more_dtype
        return shape, dtype


def standin(node: onnx.NodeProto, ranks: dict[str, int]) -> list[onnx.NodeProto]:
    """Standard operators with the output shapes of an onnxruntime contrib operator, for onnx shape inference."""
    op, ins, outs = node.op_type, list(node.input), list(node.output)
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    if op in ("Gelu", "FastGelu", "QuickGelu", "BiasGelu", "BiasSoftmax"):
        present = [i for i in ins if i]
        return [helper.make_node("Add" if len(present) > 1 else "Identity", present[:2], outs[:1])]
    if op == "SimplifiedLayerNormalization":  # onnxruntime's, in the default domain
        return [helper.make_node("Identity", ins[:1], outs[:1])]
    if op in ("SkipLayerNormalization", "SkipSimplifiedLayerNormalization"):
        nodes = [helper.make_node("Add", ins[:2], [outs[0]])]
        nodes += [helper.make_node("Identity", [outs[0]], [o]) for o in outs[1:] if o]
        return nodes
    if op in ("FusedConv", "NhwcFusedConv"):
        keep = {k: v for k, v in attrs.items() if not k.startswith("activation")}
        return [helper.make_node("Conv", [i for i in ins[:3]], outs[:1], **keep)]
    if op == "FusedGemm":
        keep = {k: v for k, v in attrs.items() if k in ("alpha", "beta", "transA", "transB")}
        return [helper.make_node("Gemm", ins[:3], outs[:1], **keep)]
    if op == "FusedMatMul":
        nodes, operands = [], []
        for name, flag in ((ins[0], attrs.get("transA", 0)), (ins[1], attrs.get("transB", 0))):
            rank = ranks.get(name)
            if flag and rank and rank >= 2:
                perm = list(range(rank - 2)) + [rank - 1, rank - 2]
                nodes.append(helper.make_node("Transpose", [name], [name + "__t"], perm=perm))
                name = name + "__t"
            operands.append(name)
        return nodes + [helper.make_node("MatMul", operands, outs[:1])]
    return [node]


def complete_shapes(graph: Graph) -> dict[str, tuple]:
    """Shapes and dtypes of every tensor, by onnx shape inference with contrib operators replaced by stand-ins."""
    from onnx import shape_inference

    inputs, initializers, ranks = [], [], {}
    for tensor in graph.gs.inputs:
        shape = graph.shape(tensor)
        if shape is not None and tensor.dtype is not None:
            inputs.append(helper.make_tensor_value_info(tensor.name, helper.np_dtype_to_tensor_dtype(np.dtype(tensor.dtype)),
                                                        list(shape)))
    for tensor in graph.gs.tensors().values():
        if isinstance(tensor, gs.Constant):
            values = tensor.values
            if values.size <= 1024:
                initializers.append(numpy_helper.from_array(np.require(np.asarray(values), requirements="C"), tensor.name))
            else:
                inputs.append(helper.make_tensor_value_info(tensor.name, helper.np_dtype_to_tensor_dtype(values.dtype),
                                                            list(values.shape)))
        else:
            shape = graph.shape(tensor)
            if shape is not None:
                ranks[tensor.name] = len(shape)
    nodes = []
    for node in graph.gs.nodes:
        proto = OnnxExporter.export_node(node)
        contrib = node.domain == "com.microsoft" or node.op in ONNXRUNTIME_OPS_IN_ONNX_DOMAIN
        nodes.extend(standin(proto, ranks) if contrib else [proto])
    outputs = [helper.make_empty_tensor_value_info(t.name) for t in graph.gs.outputs]
    body = helper.make_graph(nodes, "standin", inputs, outputs, initializer=initializers)
    opsets = [helper.make_opsetid(d, v) for d, v in dict(graph.model_info["opset_import"]).items()]
    model = helper.make_model(body, opset_imports=opsets, ir_version=max_ir_version())
    try:
        inferred = shape_inference.infer_shapes(model, check_type=False, strict_mode=False, data_prop=True)
    except Exception as exc:  # noqa: BLE001 - best effort
        log.debug("cost model: shape completion failed (%s)", exc)
        return {}
    found = {}
    for vi in list(inferred.graph.value_info) + list(inferred.graph.output):
        ttype = vi.type.tensor_type
        if not ttype.elem_type or not ttype.HasField("shape"):
            continue
        dims = [d.dim_value if d.HasField("dim_value") else None for d in ttype.shape.dim]
        if None not in dims:
            found[vi.name] = (tuple(dims), helper.tensor_dtype_to_np_dtype(ttype.elem_type))
    return found
