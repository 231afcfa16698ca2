"""The agent's prior: every fusion at once, and the variants with one fusion undone the cost model prices lowest."""
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


def test_the_two_cheapest_variants_cheapest_first(tmp_path):
    """Every fusion, and the variants with one fusion undone everywhere: the two the cost model prices lowest."""
    graph = rlflow.load(zoo.build("bert-base-tiny", tmp_path).path)
    deadline = time.monotonic() + 60
    start = Candidate(graph, (), graph.fingerprint())
    fused = all_fusions(start)
    assert "SkipLayerNormalization" in {n.op for n in fused.graph.gs.nodes}
    same, _ = fuse_everything(start, RULES, _Counting("Add"), deadline)  # every undoing adds Adds: none preferred
    assert same.fingerprint == fused.fingerprint
    undone, runner_up = fuse_everything(start, RULES, _Counting("SkipLayerNormalization"), deadline)
    assert undone.applied[: len(fused.applied)] == fused.applied
    assert {m.rule for m in undone.applied[len(fused.applied):]} == {"skip-layernorm-unfuse"}
    assert "SkipLayerNormalization" not in {n.op for n in undone.graph.gs.nodes}
    assert runner_up.fingerprint == fused.fingerprint  # the measurement decides between them
