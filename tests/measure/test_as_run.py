"""`fingerprint_as_run`: graphs told apart by what onnxruntime runs of them, not by how they are written."""
from __future__ import annotations

import onnx
from onnx import helper

from rlflow.graph.core import Graph
from rlflow.measure.as_run import fingerprint_as_run
from rlflow.measure.session import SessionSettings

SHAPES = {"x": (2, 8)}


def _with_op(model: onnx.ModelProto, op_type: str, domain: str = "") -> onnx.ModelProto:
    other = onnx.ModelProto()
    other.CopyFrom(model)
    other.graph.node[2].op_type, other.graph.node[2].domain = op_type, domain
    if domain:
        other.opset_import.append(helper.make_opsetid(domain, 1))
    return other


def test_a_node_onnxruntime_removes_leaves_the_graph_it_runs_the_same(matmul_model, matmul_with_identity):
    settings = SessionSettings()
    graph, copied = Graph.from_model(matmul_model, SHAPES), Graph.from_model(matmul_with_identity, SHAPES)
    assert graph.fingerprint() != copied.fingerprint()  # written differently
    assert fingerprint_as_run(graph, settings) == fingerprint_as_run(copied, settings)  # run the same
    other = Graph.from_model(_with_op(matmul_model, "Sigmoid"), SHAPES)
    assert fingerprint_as_run(other, settings) != fingerprint_as_run(graph, settings)


def test_a_graph_onnxruntime_cannot_build_has_no_fingerprint_as_run(matmul_model):
    broken = Graph.from_model(_with_op(matmul_model, "NoSuchOperator", "rlflow.test"), SHAPES)
    assert fingerprint_as_run(broken, SessionSettings()) is None
