"""`fingerprint_as_run`: graphs told apart by what onnxruntime runs of them, not by how they are written."""
from __future__ import annotations

from rlflow.graph.core import Graph
from rlflow.measure.as_run import fingerprint_as_run
from rlflow.measure.session import SessionSettings
from tests.conftest import with_op

SHAPES = {"x": (2, 8)}


def test_a_node_onnxruntime_removes_leaves_the_graph_it_runs_the_same(matmul_model, matmul_with_identity):
    settings = SessionSettings()
    graph, copied = Graph.from_model(matmul_model, SHAPES), Graph.from_model(matmul_with_identity, SHAPES)
    assert graph.fingerprint() != copied.fingerprint()  # written differently
    assert fingerprint_as_run(graph, settings) == fingerprint_as_run(copied, settings)  # run the same
    other = Graph.from_model(with_op(matmul_model, "Sigmoid"), SHAPES)
    assert fingerprint_as_run(other, settings) != fingerprint_as_run(graph, settings)


def test_a_graph_onnxruntime_cannot_build_has_no_fingerprint_as_run(matmul_model):
    broken = Graph.from_model(with_op(matmul_model, "NoSuchOperator", "rlflow.test"), SHAPES)
    assert fingerprint_as_run(broken, SessionSettings()) is None
