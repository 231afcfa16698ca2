"""The agent's prior: every fusion at once, or with the one undoing the cost model prices lower."""
from __future__ import annotations

import time

import rlflow
from rlflow import zoo
from rlflow.rewrites import RULES
from rlflow.search.candidates import Candidate, all_fusions
from rlflow.search.fuse_everything import fuse_everything


class _Counting:
    """A cost model that prices a graph by how many nodes of one operator it has."""

    def __init__(self, op: str):
        self.op = op

    def graph_cost(self, graph) -> float:
        return float(sum(node.op == self.op for node in graph.gs.nodes))


def test_the_undoing_the_cost_model_prefers_and_nothing_already_measured(tmp_path):
    graph = rlflow.load(zoo.build("bert-base-tiny", tmp_path).path)
    deadline = time.monotonic() + 60
    start = Candidate(graph, (), graph.fingerprint())
    fused = all_fusions(start)
    assert "SkipLayerNormalization" in {n.op for n in fused.graph.gs.nodes}
    (same,) = fuse_everything(start, [], RULES, _Counting("Add"), deadline)  # every undoing adds Adds: none preferred
    assert same.fingerprint == fused.fingerprint
    (undone,) = fuse_everything(start, [], RULES, _Counting("SkipLayerNormalization"), deadline)
    assert undone.applied[: len(fused.applied)] == fused.applied
    assert {m.rule for m in undone.applied[len(fused.applied):]} == {"skip-layernorm-unfuse"}
    assert "SkipLayerNormalization" not in {n.op for n in undone.graph.gs.nodes}
    assert fuse_everything(start, [fused], RULES, _Counting("Add"), deadline) == []  # already among the pool


class _Estimating(_Counting):
    """The same, telling that it priced some groups by estimate (`CostModel.coverage`)."""

    def coverage(self) -> dict:
        return {"groups": 3, "table": 0, "measured": 1, "estimated": 2, "failed": 0, "estimate": "size"}


def test_where_the_price_was_partly_estimated_the_runner_up_is_measured_too(tmp_path):
    """On a cold table the groups that tell the variants apart are estimated: both are measured, cheapest first."""
    graph = rlflow.load(zoo.build("bert-base-tiny", tmp_path).path)
    start = Candidate(graph, (), graph.fingerprint())
    fused = all_fusions(start)
    cheapest, runner_up = fuse_everything(start, [], RULES, _Estimating("SkipLayerNormalization"),
                                          time.monotonic() + 60)
    assert "SkipLayerNormalization" not in {n.op for n in cheapest.graph.gs.nodes}
    assert runner_up.fingerprint == fused.fingerprint
