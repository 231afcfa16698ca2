"""What the agent search keeps of the graphs its rollouts visit: the graphs it may still measure or return, and the
costs of all of them (a visited graph holds the weights its rewrites made)."""
from __future__ import annotations

from types import SimpleNamespace

from rlflow.search.agent import _forget_graphs, _pool


def _visited(costs: dict[str, float]) -> dict:
    return {fp: (cost, SimpleNamespace(fingerprint=fp)) for fp, cost in costs.items()}


def test_only_the_graphs_the_pool_can_choose_are_kept():
    visited = _visited({"a": 5.0, "b": 1.0, "c": 2.0, "d": 9.0, "e": 3.0, "f": 4.0, "g": 12.0})
    endings = ["d", "g"]  # g is estimated slower than the input (10.0): an end graph all the same
    before = _pool(visited, endings, 10.0, "input", 4)
    _forget_graphs(visited, endings, 2)
    assert {fp for fp, (_, c) in visited.items() if c is not None} == {"b", "c", "d", "g"}
    assert [cost for cost, _ in visited.values()] == [5.0, 1.0, 2.0, 9.0, 3.0, 4.0, 12.0]  # every cost kept
    assert [c.fingerprint for c in _pool(visited, endings, 10.0, "input", 2)] == [fp.fingerprint for fp in before[:2]]
    assert [c.fingerprint for c in _pool(visited, endings, 10.0, "input", 2)] == ["d", "b"]
