"""`rlflow optimize --precision fp16|bf16`: the half rules within their tolerances in any order, Casts only at the
float32 edges, the nodes kept float32 where the budget needs them, and the whole model's speed deciding."""
from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from rlflow.cli import main
from rlflow.graph.core import Graph
from rlflow.measure.bootstrap import Ratio
from rlflow.optimize.pipeline import optimize
from rlflow.rewrites import apply_all, find_matches, rule
from tests.conftest import save, tiny_model

FP16, BF16 = rule("node-fp16"), rule("node-bf16")


def _block(scale: float = 1.0, k: int = 64) -> onnx.ModelProto:
    """x -> MatMul(W1 * scale) * 0.5 -> LayerNormalization -> Gelu -> MatMul(W2) + x -> ReduceMean: a transformer's block
    in miniature, with a reduction (offered to no half rule) at its end."""
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.standard_normal((k, k)).astype(np.float32) * scale / 8, "W1"),
             numpy_helper.from_array(rng.standard_normal((k, k)).astype(np.float32) / 8, "W2"),
             numpy_helper.from_array(np.array(0.5, np.float32), "scale"),
             numpy_helper.from_array(np.ones(k, np.float32), "gamma"),
             numpy_helper.from_array(np.zeros(k, np.float32), "beta"),
             numpy_helper.from_array(np.array([-1], np.int64), "axes")]
    nodes = [helper.make_node("MatMul", ["x", "W1"], ["h"], name="first"),
             helper.make_node("Mul", ["h", "scale"], ["s"], name="scaled"),
             helper.make_node("LayerNormalization", ["s", "gamma", "beta"], ["n"], name="norm", axis=-1),
             helper.make_node("Gelu", ["n"], ["g"], name="gelu"),
             helper.make_node("MatMul", ["g", "W2"], ["o"], name="second"),
             helper.make_node("Add", ["o", "x"], ["r"], name="residual"),
             helper.make_node("ReduceMean", ["r", "axes"], ["y"], name="mean", keepdims=1)]
    model = tiny_model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", 8, k])],
                       [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["b", 8, 1]),
                        helper.make_tensor_value_info("r", TensorProto.FLOAT, ["b", 8, k])], inits)
    model.opset_import[0].version = 20
    return model


def _error(model: onnx.ModelProto, lowered: onnx.ModelProto, x: np.ndarray, reference=False) -> float:
    if reference:  # onnxruntime's CPU provider has no bfloat16 kernels: onnx's reference evaluator computes it
        from onnx.reference import ReferenceEvaluator

        ref, out = (ReferenceEvaluator(m).run(None, {"x": x}) for m in (model, lowered))
    else:
        ref, out = (ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})
                    for m in (model, lowered))
    return max(float(np.linalg.norm(np.asarray(o, np.float32) - r) / np.linalg.norm(r)) for o, r in zip(out, ref))


def _lowered(model: onnx.ModelProto, half_rule, reverse: bool = False) -> tuple[onnx.ModelProto, list]:
    graph = Graph.from_model(model, {"x": (2, 8, 64)})
    matches = find_matches(graph, [half_rule])
    out, applied = apply_all(graph, matches[::-1] if reverse else matches, [half_rule])
    return out.to_model(static=False), applied


@pytest.mark.parametrize("reverse", [False, True], ids=["in-order", "reversed"])
@pytest.mark.parametrize("half_rule", [FP16, BF16], ids=lambda r: r.name)
def test_half_rule_within_its_tolerance_casts_only_at_float32_edges(half_rule, reverse):
    model = _block()
    lowered, applied = _lowered(model, half_rule, reverse)
    assert sorted(m.root for m in applied) == ["first", "gelu", "norm", "residual", "scaled", "second"]
    casts = [n for n in lowered.graph.node if n.op_type == "Cast"]
    # x in (once, shared by its two readers), the residual out to the ReduceMean and the graph output: one Cast
    # back serves both; no Cast between two half nodes
    assert sorted(helper.get_attribute_value(c.attribute[0]) for c in casts) == [TensorProto.FLOAT, half_rule.half]
    assert [o.type.tensor_type.elem_type for o in lowered.graph.output] == [TensorProto.FLOAT] * 2
    assert lowered.graph.input[0].type.tensor_type.elem_type == TensorProto.FLOAT
    for rows in (2, 5):  # the batch changed: nothing baked
        x = np.random.default_rng(rows).standard_normal((rows, 8, 64)).astype(np.float32)
        error = _error(model, lowered, x, reference=half_rule is BF16)
        assert 0 < error <= half_rule.tolerance, (half_rule.name, error)


def test_a_norms_unread_statistics_are_dropped_not_made_half():
    model = _block()
    model.graph.node[2].output.extend(["mean_stat", "inv_std"])  # named, read by nothing
    lowered, _ = _lowered(model, FP16)
    (norm,) = [n for n in lowered.graph.node if n.op_type == "LayerNormalization"]
    assert list(norm.output[1:]) in ([], ["", ""])
    x = np.random.default_rng(0).standard_normal((2, 8, 64)).astype(np.float32)
    assert _error(model, lowered, x) <= FP16.tolerance


def test_a_weight_two_half_nodes_read_is_converted_once():
    model = _block()
    model.graph.node[4].input[1] = "W1"  # both MatMuls read W1
    lowered, _ = _lowered(model, FP16)
    halves = [t for t in lowered.graph.initializer if t.data_type == TensorProto.FLOAT16 and len(t.dims) == 2]
    assert [t.name for t in halves] == ["W1_fp16"]


def test_half_rule_refusals():
    model = _block()
    model.graph.node[2].output.append("mean_stat")  # the norm's float32 statistics, read
    model.graph.output.append(helper.make_tensor_value_info("mean_stat", TensorProto.FLOAT, ["b", 8, 1]))
    graph = Graph.from_model(model, {"x": (2, 8, 64)})
    reasons = {r.node: r.reason for r in FP16.reasons(graph)}
    assert "statistics output 1 is read" in reasons["norm"]
    assert {m.root for m in find_matches(graph, [FP16])} == {"first", "scaled", "gelu", "second", "residual"}
    lowered, _ = _lowered(_block(), FP16)
    again = Graph.from_model(lowered, {"x": (2, 8, 64)})
    assert not find_matches(again, [FP16])  # every node offered is half already, or a Cast
    assert any("is float16, not float32" in r.reason for r in FP16.reasons(again))


# The tests below run no exact rules (`rules=()`): which of them greedy keeps depends on this machine's clock, and
# they would rename the nodes these tests name.
@pytest.fixture
def half_faster(monkeypatch):
    """The half graph measured faster than float32, whatever this machine's clock says: these tests are about error."""
    import rlflow.search.half as search

    monkeypatch.setattr(search, "against_float32", lambda graph, half, settings: Ratio(1.5, 1.4, 1.6, 0.95))


def test_fp16_within_budget_converts_every_node_in_one_evaluation(tmp_path, half_faster):
    result = optimize(save(_block(), tmp_path / "block.onnx"), method="greedy", time_limit=2, precision="fp16",
                      rounds=6, rules=())
    p = result.precision
    assert p["layers"] == {"node-fp16": 6} and len(p["evaluations"]) == 1
    assert p["error"]["max_error"] <= p["max_error"] == 0.01 and p["max_error_source"] == "default"
    assert all(v["error"] is None for layer in p["per_layer"] for v in layer["variants"].values())
    assert result.verification.ok and "1.500x" in p["stop_reason"]


def test_fp16_keeps_the_nodes_that_overflow_in_float32(tmp_path, half_faster):
    """W1 scaled by 1e6, the first product overflows float16: that MatMul and the norm reading it, each measured
    alone, are over the budget and kept float32; the nodes after the norm stay in half."""
    result = optimize(save(_block(scale=1e6), tmp_path / "block.onnx"), method="greedy", time_limit=2,
                      precision="fp16", rounds=6, rules=())
    p = result.precision
    kept = {layer["node"] for layer in p["per_layer"] if layer["chosen"] is None}
    assert kept == {"first", "norm"}, kept
    assert p["error"]["max_error"] <= 0.01 and len(p["evaluations"]) > 1
    sensitivity = {layer["node"]: layer["variants"]["node-fp16"]["error"] for layer in p["per_layer"]}
    assert sensitivity["first"] > 0.01 and sensitivity["norm"] > 0.01 and sensitivity["gelu"] < 0.01


def test_fp16_not_faster_keeps_float32_and_says_so(tmp_path, monkeypatch):
    import rlflow.search.half as search

    monkeypatch.setattr(search, "against_float32", lambda graph, half, settings: Ratio(0.9, 0.85, 0.95, 0.95))
    result = optimize(save(_block(), tmp_path / "block.onnx"), method="greedy", time_limit=2, precision="fp16",
                      rounds=6, rules=())
    stop = result.precision["stop_reason"]  # the reason is the gate's, which the exact search's timing decides
    assert "fp16 is not measurably faster than float32 on CPUExecutionProvider: 0.900x" in stop
    assert not any("node-fp16" in m for m in result.applied)
    assert result.precision["layers"] == {"float32": 6}


def test_bf16_on_the_cpu_provider_is_one_line_exit_2(tmp_path, capsys):
    path = save(_block(), tmp_path / "block.onnx")
    assert main(["optimize", path, "-o", str(tmp_path / "out.onnx"), "--precision", "bf16"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "needs the CUDA provider" in err, err
    assert not (tmp_path / "out.onnx").exists()
