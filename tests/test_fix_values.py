"""`rlflow optimize --fix-value`: inputs declared to hold one value, which the output then reads as a constant of their
shape (a decoder with no padding: attention_mask=1)."""
from __future__ import annotations

import json

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from rlflow.errors import InputError
from rlflow.graph.input_values import fix_values, parse_fixed_values


def _mask_model():
    x = helper.make_tensor_value_info("mask", TensorProto.INT64, ["batch", "total"])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", "total"])
    return helper.make_model(helper.make_graph([helper.make_node("Cast", ["mask"], ["y"], to=TensorProto.FLOAT)], "g",
                                               [x], [y]), opset_imports=[helper.make_opsetid("", 18)], ir_version=10)


def test_fixed_values_parse_and_refuse_what_no_model_has():
    assert parse_fixed_values(["attention_mask=1", "scale=0.5"]) == {"attention_mask": 1.0, "scale": 0.5}
    for bad in ("attention_mask", "=1", "mask=x", "mask=inf"):
        with pytest.raises(InputError, match="--fix-value"):
            parse_fixed_values([bad])
    model = _mask_model()
    with pytest.raises(InputError, match="its inputs are mask"):
        fix_values(model, {"attention_mask": 1})
    with pytest.raises(InputError, match="not a value of the input's element type"):
        fix_values(model, {"mask": 0.5})


def test_a_fixed_input_keeps_its_shape_and_loses_its_values():
    model = _mask_model()
    fix_values(model, {"mask": 1})
    onnx.checker.check_model(model)
    fix_values(model, {"mask": 1})  # already read for its shape alone: unchanged
    assert [n.op_type for n in model.graph.node] == ["Shape", "ConstantOfShape", "Cast"]
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    (y,) = session.run(None, {"mask": np.zeros((2, 5), np.int64)})
    assert y.shape == (2, 5) and (y == 1).all()


@pytest.fixture(scope="module")
def llama_step(tmp_path_factory):
    pytest.importorskip("transformers")
    from rlflow import zoo

    return zoo.build("llama-tiny-decode-p16-ts", tmp_path_factory.mktemp("fix-values")).path


def test_optimize_and_bench_fix_the_value_and_say_so(llama_step, tmp_path, capsys):
    from rlflow.cli import main

    out = tmp_path / "out.onnx"
    assert main(["optimize", str(llama_step), "--fix-value", "attention_mask=1", "--method", "greedy",
                 "--time-limit", "2", "-o", str(out)]) == 0
    assert "every attention_mask 1" in capsys.readouterr().out
    written = onnx.load(str(out), load_external_data=False)
    assert "attention_mask" in [vi.name for vi in written.graph.input]
    assert all(n.op_type == "Shape" for n in written.graph.node if "attention_mask" in n.input)
    assert main(["optimize", str(llama_step), "--fix-value", "mask=1", "-o", str(tmp_path / "no.onnx")]) != 0
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "mask" in err and not (tmp_path / "no.onnx").exists()
    bench = tmp_path / "bench"
    assert main(["bench", str(llama_step), "--methods", "greedy", "--time-limit", "1", "--rounds", "3",
                 "--fix-value", "attention_mask=1", "--out", str(bench)]) == 0
    results = json.loads((bench / "results.json").read_text())
    assert results["config"]["fix_values"] == {"attention_mask": 1.0}
    assert [row["status"] for row in results["rows"]] == ["ok"]


def test_a_peer_output_that_folded_a_fixed_input_away_gets_it_back():
    """A peer folds the shape-only read of a fixed input away and drops the input; the bench declares it again,
    unused, so the output runs on the inputs a user's code feeds, and says so."""
    from rlflow.bench.run import _restore_inputs

    source = _mask_model()
    fix_values(source, {"mask": 1})
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 5])
    folded = helper.make_model(helper.make_graph(
        [helper.make_node("ConstantOfShape", ["shape"], ["y"], value=helper.make_tensor("v", TensorProto.FLOAT, [1],
                                                                                         [1.0]))],
        "g", [], [y], [helper.make_tensor("shape", TensorProto.INT64, [2], [2, 5])]),
        opset_imports=[helper.make_opsetid("", 18)], ir_version=10)
    assert _restore_inputs(source, folded) == ["mask"] and _restore_inputs(source, folded) == []
    session = ort.InferenceSession(folded.SerializeToString(), providers=["CPUExecutionProvider"])
    (out,) = session.run(None, {"mask": np.zeros((2, 5), np.int64)})
    assert (out == 1).all()
