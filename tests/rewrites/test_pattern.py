"""The pattern layer (`rlflow.rewrites.pattern`): what a pattern matches and refuses, and the `Rule` contract it
produces (pure check, hashable and picklable matches, a re-check on apply)."""
from __future__ import annotations

import pickle

import numpy as np
import onnx_graphsurgeon as gs
import pytest

from rlflow.graph.core import Graph
from rlflow.measure.verify import verify
from rlflow.rewrites.base import Match, RewriteError
from rlflow.rewrites.base import apply as apply_rules
from rlflow.rewrites.edits import emit
from rlflow.rewrites.pattern import Found, PatternRule, constant, op, product, var
from tests.rewrites.helpers import graph, node

x, y = var("x"), var("y")


class DoubleNegToIdentity(PatternRule):
    """Replaces `Neg(Neg(x)) + y` with `x + y` (a test rule: commuted Add, a variable, a labelled failure)."""

    name = "test-double-neg"
    pattern = op.Add(op.Neg(op.Neg(x).otherwise("not a double negation")), y)
    variables = ("x", "y")

    def condition(self, graph: Graph, found: Found) -> str | None:
        return "y is x" if found["x"] is found["y"] else None

    def replacement(self, graph: Graph, tensors: dict[str, gs.Tensor], match: Match) -> gs.Tensor:
        return emit(graph, "Add", [tensors["x"], tensors["y"]])


class ScaledSquare(PatternRule):
    """Replaces `x * x * c` with `Pow(x, 2) * c` (a test rule: a tree in any association, a bound constant)."""

    name = "test-scaled-square"
    pattern = product(x, x, constant("c"))
    variables = ("x", "c")

    def replacement(self, graph: Graph, tensors: dict[str, gs.Tensor], match: Match) -> gs.Tensor:
        two = graph.add_constant(np.array(2.0, np.float32))
        return emit(graph, "Mul", [emit(graph, "Pow", [tensors["x"], two]), tensors["c"]])


def test_root_ops_come_from_the_pattern():
    assert DoubleNegToIdentity.root_ops == ("Add",) and ScaledSquare.root_ops == ("Mul",)


@pytest.mark.parametrize("order", [["n2", "z"], ["z", "n2"]])
def test_a_commutative_operator_matches_either_input_order(order):
    g = graph([node("Neg", ["x"], "n1"), node("Neg", ["n1"], "n2"), node("Add", order)], {"x": [2, 3], "z": [2, 3]})
    root = next(n for n in g.gs.nodes if n.op == "Add")
    match = DoubleNegToIdentity().check(g, root)
    assert match, match
    assert hash(match) == hash(pickle.loads(pickle.dumps(match))) and pickle.loads(pickle.dumps(match)) == match
    assert match.nodes[0] == root.name and len(match.nodes) == 3


def test_refusals_name_the_deepest_failure_or_the_rules_own_words():
    g = graph([node("Neg", ["x"], "n1"), node("Relu", ["n1"], "n2"), node("Add", ["n2", "z"])], {"x": [2], "z": [2]})
    reasons = [r.reason for r in DoubleNegToIdentity().reasons(g)]
    assert reasons == ["n2 is not a private Neg"]
    g = graph([node("Relu", ["x"], "n1"), node("Neg", ["n1"], "n2"), node("Add", ["n2", "z"])], {"x": [2], "z": [2]})
    assert [r.reason for r in DoubleNegToIdentity().reasons(g)] == ["not a double negation"]


def test_an_intermediate_read_elsewhere_is_not_taken():
    g = graph([node("Neg", ["x"], "n1"), node("Neg", ["n1"], "n2"), node("Add", ["n2", "z"]),
               node("Relu", ["n1"], "r")],
              {"x": [2], "z": [2]}, outputs=("y", "r"))
    assert not DoubleNegToIdentity().find(g)


def test_the_condition_refuses_with_its_reason():
    g = graph([node("Neg", ["x"], "n1"), node("Neg", ["n1"], "n2"), node("Add", ["n2", "x"])], {"x": [2]})
    assert [r.reason for r in DoubleNegToIdentity().reasons(g)] == ["y is x"]


@pytest.mark.parametrize("nodes", [
    [node("Mul", ["x", "x"], "s"), node("Mul", ["s", "c"])],
    [node("Mul", ["c", "x"], "s"), node("Mul", ["x", "s"])],
])
def test_a_tree_matches_any_association_and_a_variable_is_one_tensor(nodes):
    g = graph(nodes, {"x": [2, 3]}, consts={"c": np.array(3.0, np.float32)})
    found = ScaledSquare().find(g)
    assert len(found) == 1 and len(found[0].nodes) == 2


def test_a_variable_seen_twice_must_be_the_same_tensor():
    g = graph([node("Mul", ["x", "z"], "s"), node("Mul", ["s", "c"])], {"x": [2, 3], "z": [2, 3]},
              consts={"c": np.array(3.0, np.float32)})
    assert not ScaledSquare().find(g)


def test_apply_rewrites_and_refuses_a_stale_match():
    g = graph([node("Mul", ["x", "x"], "s"), node("Mul", ["s", "c"])], {"x": [2, 3]},
              consts={"c": np.array(3.0, np.float32)})
    square = ScaledSquare()
    match = square.find(g)[0]
    new = apply_rules(g, match, [square])
    assert new.op_counts() == {"Pow": 1, "Mul": 1}
    assert verify(g.to_model(), new.to_model()).ok
    stale = Match(match.rule, match.nodes, (("c", (0, 0)), ("x", (0, 0))))
    with pytest.raises(RewriteError):
        apply_rules(g, stale, [square])
