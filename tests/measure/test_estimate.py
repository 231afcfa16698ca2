"""The GPU cost estimate: features of a group, the non-negative fit, and the cost model that reads a device's table."""
from __future__ import annotations

import json

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from rlflow.errors import RlflowError
from rlflow.graph.core import Graph
from rlflow.measure.costmodel.gpu_estimate import EstimatedCostModel, cost_model_for, estimated_only
from rlflow.measure.costmodel.model import CACHE_VERSION, CostModel
from rlflow.measure.costmodel.size_estimate import (
    FEATURES,
    SHIPPED,
    Estimate,
    error,
    fit,
    group_features,
    load_estimate,
    published_h100,
)
from rlflow.measure.session import SessionSettings

CUDA = SessionSettings(provider="CUDAExecutionProvider")
NO_CUDA = "CUDAExecutionProvider" not in ort.get_available_providers()


def _dense(width: int = 32) -> Graph:
    """x[1,64] @ W[64,width] + b -> Relu -> Reshape: one fusion group, the Reshape a view."""
    rng = np.random.default_rng(0)
    weights = [numpy_helper.from_array(rng.standard_normal((64, width)).astype(np.float32), "W"),
               numpy_helper.from_array(rng.standard_normal(width).astype(np.float32), "b"),
               numpy_helper.from_array(np.array([width, 1], dtype=np.int64), "shape")]
    nodes = [helper.make_node("MatMul", ["x", "W"], ["m"]), helper.make_node("Add", ["m", "b"], ["a"]),
             helper.make_node("Relu", ["a"], ["r"]), helper.make_node("Reshape", ["r", "shape"], ["y"])]
    graph = helper.make_graph(nodes, "dense", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 64])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [width, 1])], initializer=weights)
    return Graph.from_model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8))


def _groups(graph: Graph):
    return CostModel(CUDA, cache_dir="/nonexistent").groups(graph)


def test_group_features_count_launches_bytes_and_flops_by_kind():
    feats = dict(zip(FEATURES, sum(group_features(g) for g in _groups(_dense()))))
    assert feats["kernels"] == 3  # MatMul, Add, Relu; the Reshape launches nothing
    assert feats["matmul_flops"] == 2 * 64 * 32 and feats["other_flops"] == 32 + 32 and feats["conv_flops"] == 0
    read = 4 * (64 + 64 * 32 + 32)  # x, W, b: the intermediates stay inside the MatMul's group
    assert feats["bytes"] == read + 4 * 32  # and its output; the Reshape (a group of its own) moves nothing


def test_fit_recovers_non_negative_coefficients_it_was_made_from():
    rng = np.random.default_rng(0)
    features = rng.uniform(1, 10, size=(60, len(FEATURES))) * np.array([1, 1e6, 1e9, 1e9, 1e6])
    truth = np.array([5e-3, 3e-10, 0.0, 1e-11, 2e-9])
    estimate = fit(features, features @ truth, "synthetic")
    assert estimate.calibrated and estimate.coefficients[2] == 0.0
    np.testing.assert_allclose(estimate.coefficients, truth, rtol=1e-6, atol=1e-15)
    assert error(estimate, features, features @ truth)["median_factor"] == pytest.approx(1.0)


def test_fit_gives_no_weight_to_a_feature_that_would_need_a_negative_one():
    rng = np.random.default_rng(1)
    features = rng.uniform(1, 10, size=(40, len(FEATURES)))
    costs = 0.01 * features[:, 0] - 0.0005 * features[:, 1] + 0.1
    assert min(fit(features, costs, "synthetic").coefficients) >= 0.0


def _table(tmp_path, graph: Graph, cost: float) -> str:
    key = {"version": CACHE_VERSION, "provider": CUDA.provider, "machine": "a device", "onnxruntime": "x",
           "threads": 1, "opt_level": "all", "execution_mode": "sequential"}
    groups = {g.key: f"o:{i}" for i, g in enumerate(_groups(graph))}
    path = tmp_path / "table.json"
    path.write_text(json.dumps({"key": key, "groups": groups, "costs": {c: cost for c in groups.values()},
                                "ops": {c: "x" for c in groups.values()}}))
    return str(path)


def test_estimated_cost_model_reads_the_table_estimates_the_rest_and_never_measures(tmp_path, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("an estimated cost model must not measure")

    monkeypatch.setattr(CostModel, "_time_isolated", refuse)
    table = _table(tmp_path, _dense(32), 0.25)
    before = (tmp_path / "table.json").read_text()
    model = EstimatedCostModel(CUDA, table, published_h100())
    assert model.graph_cost(_dense(32)) == pytest.approx(0.25 * len(_groups(_dense(32))))
    wider = _dense(48)  # another configuration: not in the table
    expected = sum(published_h100()(group_features(g)) for g in _groups(wider))
    assert model.graph_cost(wider) == pytest.approx(expected) and model.stats.failures == 0
    model.save()
    assert (tmp_path / "table.json").read_text() == before


def test_estimating_the_same_groups_again_keeps_only_the_recent_durations(tmp_path):
    from rlflow.measure.costmodel.model import RECENT_DURATIONS

    model = EstimatedCostModel(CUDA, _table(tmp_path, _dense(32), 0.25), published_h100())
    wider = _dense(48)  # its groups are not in the table: every look-up goes through `_measure_group`
    for _ in range(4 * RECENT_DURATIONS):
        model.graph_cost(wider)
    assert model.stats.misses >= 4 * RECENT_DURATIONS and len(model._durations) == RECENT_DURATIONS


def test_a_table_for_another_provider_is_refused(tmp_path):
    table = _table(tmp_path, _dense(), 0.25)
    with pytest.raises(ValueError, match="CPUExecutionProvider"):
        EstimatedCostModel(SessionSettings(), table, published_h100()).graph_cost(_dense())


@pytest.mark.skipif(not NO_CUDA, reason="this machine runs CUDA: its cost model measures")
def test_cuda_without_cuda_trains_against_the_shipped_table_and_cannot_measure(capsys):
    model = cost_model_for("cuda")
    assert isinstance(model, EstimatedCostModel) and model.estimate.calibrated
    assert estimated_only(model, measuring=False) and "nothing is measured" in capsys.readouterr().out
    with pytest.raises(RlflowError, match="reward 'measure'"):
        estimated_only(model, measuring=True)
    assert type(cost_model_for("cpu")) is CostModel and not estimated_only(cost_model_for("cpu"), measuring=True)


def test_the_shipped_table_is_current_and_its_estimate_fitted():
    table, estimate_path = SHIPPED["cuda"]
    key = json.loads(table.read_text())["key"]
    assert key["version"] == CACHE_VERSION, "cost table version changed: measure the CUDA table again (gpu/kit.py)"
    assert key["provider"] == "CUDAExecutionProvider" and "H100" in key["machine"]
    estimate = load_estimate(estimate_path)
    assert estimate.calibrated and min(estimate.coefficients) >= 0 and max(estimate.coefficients) > 0
    assert Estimate.from_dict(estimate.as_dict()) == estimate

