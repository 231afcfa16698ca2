"""Models written by other hands that onnxruntime runs and the onnx checker refuses are repaired and optimised, not
refused (`rlflow.graph.input_repairs`; docs/robustness.md lists each repair)."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from rlflow.cli import main
from rlflow.graph.core import Graph, load
from rlflow.graph.input_repairs import REPAIRS_KEY, convert_opset, repair, repairs
from rlflow.measure.verify import verify
from tests.conftest import save, tiny_model

H = 16


def _layer(opset: int = 17, *, reversed_nodes: bool = False, contrib_import: bool = True) -> onnx.ModelProto:
    """x @ W + x, LayerNormalization, FastGelu (com.microsoft), then a Transpose pair for the rules to cancel."""
    rng = np.random.default_rng(0)
    weights = [numpy_helper.from_array(rng.standard_normal((H, H)).astype(np.float32), "W"),
               numpy_helper.from_array(np.ones(H, np.float32), "g"),
               numpy_helper.from_array(np.zeros(H, np.float32), "b"),
               numpy_helper.from_array(rng.standard_normal(H).astype(np.float32), "bias")]
    nodes = [helper.make_node("MatMul", ["x", "W"], ["m"]), helper.make_node("Add", ["m", "x"], ["s"]),
             helper.make_node("LayerNormalization", ["s", "g", "b"], ["n"], axis=-1, epsilon=1e-5),
             helper.make_node("FastGelu", ["n", "bias"], ["f"], domain="com.microsoft"),
             helper.make_node("Transpose", ["f"], ["t1"], perm=[1, 0]),
             helper.make_node("Transpose", ["t1"], ["y"], perm=[1, 0])]
    model = tiny_model(nodes[::-1] if reversed_nodes else nodes,
                       [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", H])],
                       [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", H])], weights, opset=opset)
    if contrib_import:
        model.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    return model


CASES = {
    "unsorted": (_layer(reversed_nodes=True), "nodes sorted into topological order"),
    "missing-opset-import": (_layer(contrib_import=False), "opset import added for com.microsoft"),
    "layer-norm-opset-13": (_layer(13), "opset 13 converted to 17, 1 LayerNormalization"),
    "layer-norm-opset-12": (_layer(12), "opset 12 converted to 17, 1 LayerNormalization"),
    "all-three": (_layer(13, reversed_nodes=True, contrib_import=False), "nodes sorted"),
}


def _runs(model: onnx.ModelProto) -> np.ndarray:
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, {"x": np.ones((3, H), np.float32)})[0]


@pytest.mark.parametrize("case", CASES)
def test_onnxruntime_runs_each_case_and_it_is_optimised_not_refused(tmp_path, case):
    model, said = CASES[case]
    _runs(model)  # the premise: onnxruntime loads and runs it
    path = Path(save(model, tmp_path / f"{case}.onnx"))
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    out = tmp_path / "out.onnx"
    code = main(["optimize", str(path), "-o", str(out), "--time-limit", "5", "--method", "greedy", "--quiet",
                 "--json", str(tmp_path / "report.json")])
    report = json.loads((tmp_path / "report.json").read_text())
    assert code == 0
    assert hashlib.sha256(path.read_bytes()).hexdigest() == digest, "the input was modified"
    assert report["candidates_measured"] >= 1, "the search measured nothing: the model was not optimised"
    assert any(said in r for r in report["settings"]["input_repairs"]), report["settings"]["input_repairs"]
    check = verify(model, onnx.load(str(out)), seeds=(3, 4), shapes=[None, {"x": (5, H)}])
    assert check.ok, check.message


def test_a_well_formed_model_needs_no_repair():
    model = _layer()
    assert repair(model) == [] and REPAIRS_KEY not in {p.key for p in model.metadata_props}
    assert load_graph(model).input_repairs == []


def load_graph(model: onnx.ModelProto) -> Graph:
    return Graph.from_model(model)


def test_repairs_are_recorded_once_and_repair_is_idempotent():
    model = _layer(reversed_nodes=True, contrib_import=False)
    done = repair(model)
    assert done == ["opset import added for com.microsoft (version 1)", "nodes sorted into topological order"]
    assert repair(model) == [] and repairs(model) == done
    assert [n.op_type for n in model.graph.node] == [n.op_type for n in _layer().graph.node]


def test_a_cycle_is_left_for_the_checker_to_refuse(tmp_path, capsys):
    model = tiny_model([helper.make_node("Relu", ["b"], ["a"]), helper.make_node("Relu", ["a"], ["b"]),
                        helper.make_node("Relu", ["x"], ["y"])],
                       [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
                       [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])])
    out = tmp_path / "out.onnx"
    assert main(["optimize", str(save(model, tmp_path / "cycle.onnx")), "-o", str(out)]) == 2
    assert capsys.readouterr().err.startswith("error: the onnx checker rejects the model")
    assert not out.exists()


def test_a_subgraph_reading_an_outer_tensor_is_sorted_after_its_producer():
    then = helper.make_graph([helper.make_node("Identity", ["r"], ["t"])], "then", [],
                             [helper.make_tensor_value_info("t", TensorProto.FLOAT, [2])])
    other = helper.make_graph([helper.make_node("Neg", ["r"], ["e"])], "else", [],
                              [helper.make_tensor_value_info("e", TensorProto.FLOAT, [2])])
    nodes = [helper.make_node("If", ["c"], ["y"], then_branch=then, else_branch=other),
             helper.make_node("Relu", ["x"], ["r"])]
    model = tiny_model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2]),
                               helper.make_tensor_value_info("c", TensorProto.BOOL, [])],
                       [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])])
    assert repair(model) == ["nodes sorted into topological order"]
    assert [n.op_type for n in model.graph.node] == ["Relu", "If"]
    onnx.checker.check_model(model)


def _attention_scores_opset12() -> onnx.ModelProto:
    """Scores [B, 2, 2, 8] whose rank onnx's shape inference cannot tell (a Slice with computed ends feeds the
    Reshape's shape), then Softmax over axis 3: the form GPT-2's opset-12 export has."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", 4, 8])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
    consts = [numpy_helper.from_array(np.array([2, 2, 8], np.int64), "tail"),
              numpy_helper.from_array(np.array([0], np.int64), "zero"),
              numpy_helper.from_array(np.array([3], np.int64), "three")]
    nodes = [helper.make_node("Shape", ["x"], ["shape"]), helper.make_node("Shape", ["shape"], ["rank"]),
             helper.make_node("Div", ["rank", "three"], ["one"]),
             helper.make_node("Slice", ["shape", "zero", "one"], ["lead"]),
             helper.make_node("Concat", ["lead", "tail"], ["to"], axis=0),
             helper.make_node("Reshape", ["x", "to"], ["r"]),
             helper.make_node("Softmax", ["r"], ["y"], axis=3)]
    return tiny_model(nodes, [x], [y], consts, opset=12)


def test_an_opset_12_softmax_over_its_last_axis_is_not_reshaped_by_the_conversion():
    model = _attention_scores_opset12()
    from onnx import version_converter

    assert "Flatten" in [n.op_type for n in version_converter.convert_version(model, 13).graph.node]  # the premise
    converted = convert_opset(model)
    ops = [n.op_type for n in converted.graph.node]
    assert ops.count("Softmax") == 1 and "Flatten" not in ops
    assert next(a.i for n in converted.graph.node if n.op_type == "Softmax" for a in n.attribute) == -1
    assert "1 Softmax/LogSoftmax/Hardmax over the last axis kept unreshaped" in repairs(converted)[0]
    assert verify(model, converted, seeds=(1,)).ok


def test_old_layer_norm_keeps_the_model_at_its_meaning(tmp_path):
    model = _layer(12)
    graph = load(save(model, tmp_path / "ln12.onnx"))
    assert graph.opset == 17 and graph.op_counts()["LayerNormalization"] == 1
    np.testing.assert_allclose(_runs(graph.to_model(static=False)), _runs(model), rtol=1e-5, atol=1e-5)


def test_the_written_model_records_what_was_repaired(tmp_path):
    path = save(_layer(reversed_nodes=True), tmp_path / "unsorted.onnx")
    out = tmp_path / "out.onnx"
    assert main(["optimize", str(path), "-o", str(out), "--time-limit", "3", "--quiet"]) == 0
    assert repairs(onnx.load(str(out))) == ["nodes sorted into topological order"]
    assert Path(path).exists()
