"""The time limit holds on a model never seen (issue #24, item 4): filling a cold cost table stops at the search's
deadline, the groups left are estimated from their size, and the report says what the limit left undone.

Nothing here asserts a tight timing (the machines are shared and noisy): the deadline is checked with a generous
margin, and the mechanism (what was measured, what estimated, what the report lists) is asserted exactly.  Every cost
table lives in a temporary folder.
"""
from __future__ import annotations

import json
import time

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

import rlflow
from rlflow.agents.policy import CandidatePolicy
from rlflow.graph.core import Graph
from rlflow.measure.costmodel.fallback import Fallback, cpu_figures, features
from rlflow.measure.costmodel.model import CostModel
from rlflow.measure.session import SessionSettings
from rlflow.rewrites import RULES
from rlflow.search.agent import AgentConfig, agent_search

MARGIN_S = 10.0
"""Generous: one step that cannot be interrupted (a rewrite, a group measurement, a measurement batch) on a busy
machine, and the shipped agent's loading."""


@pytest.fixture
def policy():
    torch.manual_seed(0)
    return CandidatePolicy(len(RULES), hidden=16, rounds=2).eval()


def test_past_its_deadline_the_cost_model_measures_nothing_and_estimates_consistently(transformer_path, tmp_path):
    graph = rlflow.load(transformer_path)
    model = CostModel(cache_dir=tmp_path)
    with model.measuring_until(time.monotonic() - 1.0):
        first = model.graph_cost(graph)
        node_costs = model.node_costs(graph)
        again = model.graph_cost(graph)
    assert model.deadline is None  # restored when the block ends
    assert model.stats.measured == 0 and model.stats.misses == 0
    coverage = model.coverage()
    distinct = len({g.key for g in model.groups(graph)})
    assert coverage["groups"] == coverage["estimated"] == distinct and coverage["measured"] == 0
    assert coverage["estimate"]
    assert first > 0 and again == first and sum(node_costs.values()) == pytest.approx(first)
    model.save()
    assert not list(tmp_path.glob("*.json"))  # estimates never enter the table


def test_a_cold_table_is_filled_largest_estimate_first_until_the_deadline(transformer_path, tmp_path, monkeypatch):
    """The misses of one graph are measured in order of their estimate, and none starts after the deadline."""
    graph = rlflow.load(transformer_path)
    model = CostModel(cache_dir=tmp_path)
    order = []

    def fake_measure(graph, group):
        order.append(model._fallback(group))
        time.sleep(0.05)
        return 0.01

    monkeypatch.setattr(model, "_measure_group", fake_measure)
    with model.measuring_until(time.monotonic() + 0.12):
        model.graph_cost(graph)
    coverage = model.coverage()
    assert 1 <= coverage["measured"] < coverage["groups"] and coverage["estimated"] >= 1
    assert order == sorted(order, reverse=True)


def test_agent_search_on_a_cold_table_keeps_its_limit_and_lists_what_it_skipped(transformer_path, tmp_path, policy):
    graph = rlflow.load(transformer_path)
    limit = 0.5
    start = time.monotonic()
    result = agent_search(graph, SessionSettings(), AgentConfig(time_limit=limit, rounds=3),
                          cost_model=CostModel(cache_dir=tmp_path), policy=policy)
    assert time.monotonic() - start < limit + MARGIN_S
    assert result.cost_table["estimated"] >= 1, (result.cost_table, result.not_reached, result.stop_reason)
    assert any(line.startswith("cost table: ") and "estimated from their size" in line for line in result.not_reached)


def test_optimize_reports_what_the_limit_left_undone(transformer_path, tmp_path, monkeypatch):
    """With the shipped agent, a cold cost table and a tiny limit: the JSON report has `not_reached` and
    `cost_table`, and the printed summary says it in one line."""
    from rlflow.optimize.report import format_report

    monkeypatch.setenv("RLFLOW_CACHE", str(tmp_path))
    limit = 1.0
    result = rlflow.optimize(transformer_path, time_limit=limit, rounds=5)
    assert result.search_seconds < limit + MARGIN_S
    report = json.loads(json.dumps(result.as_dict()))
    assert report["not_reached"] == result.not_reached and report["not_reached"]
    assert report["cost_table"]["groups"] >= 1
    lines = [line for line in format_report(result).splitlines() if line.startswith("  not reached ")]
    assert len(lines) == 1 and "cost table: " in lines[0]


def test_a_search_that_finishes_reports_nothing_left(transformer_path, tmp_path, policy):
    """A warm table and a roomy limit: every group comes from the table and no cost-table line is reported."""
    graph = rlflow.load(transformer_path)
    model = CostModel(cache_dir=tmp_path)
    model.graph_cost(graph)  # warms the table for the input graph, no deadline
    result = agent_search(graph, SessionSettings(), AgentConfig(rollouts=1, length=1, time_limit=60, rounds=3),
                          cost_model=model, policy=policy)
    assert not any(line.startswith("agent: ") for line in result.not_reached)
    assert result.cost_table["table"] >= 1


def test_the_fallback_estimate_scales_to_the_groups_it_is_shown(transformer_path, tmp_path):
    graph = rlflow.load(transformer_path)
    groups = {g.key: g for g in CostModel(cache_dir=tmp_path).groups(graph)}
    fallback = Fallback("CPUExecutionProvider")
    probe = next(iter(groups.values()))
    base = fallback(probe)
    assert base == pytest.approx(cpu_figures()(features(probe)))
    shown = list(groups.values())[:3]
    for group in shown:
        fallback.learn(group.key, group, 2.0 * cpu_figures()(features(group)))
    assert fallback(probe) == pytest.approx(2.0 * base)
    assert "scaled by 2.00" in fallback.source


def test_a_gather_reads_the_rows_it_returns_not_its_table(tmp_path):
    """A word embedding is a Gather from a large table: its estimate counts the rows read, not the table."""
    table = numpy_helper.from_array(np.zeros((30000, 64), dtype=np.float32), "table")
    ids = helper.make_tensor_value_info("ids", TensorProto.INT64, [1, 16])
    out = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 16, 64])
    model = helper.make_model(helper.make_graph([helper.make_node("Gather", ["table", "ids"], ["y"])], "g", [ids],
                                                [out], initializer=[table]),
                              opset_imports=[helper.make_opsetid("", 17)], ir_version=10)
    group = CostModel(cache_dir=tmp_path).groups(Graph.from_model(model))[0]
    assert features(group)[1] == pytest.approx(16 * 64 * 4 + 16 * 8 + 16 * 64 * 4)


def test_a_group_with_large_weights_is_timed_as_one_copy(tmp_path, monkeypatch):
    """Replicating a fast group that reads a large table would build sessions of gigabytes (BERT's embedding: 35 s)."""
    import rlflow.measure.costmodel.group_timing as group_timing

    weights = numpy_helper.from_array(np.zeros((1024, 64), dtype=np.float32), "w")
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 1024])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 64])
    model = helper.make_model(helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "m", [x], [y],
                                                initializer=[weights]),
                              opset_imports=[helper.make_opsetid("", 17)], ir_version=10)
    onnx.checker.check_model(model)
    monkeypatch.setattr(group_timing, "MAX_REPLICA_BYTES", 1024 * 64 * 4)
    assert group_timing.replicas(model, SessionSettings()) == 1
