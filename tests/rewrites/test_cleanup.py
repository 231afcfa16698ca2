"""Cleanup rules: each removes a no-op, refuses a look-alike that does something, and keeps the numbers."""
from __future__ import annotations

import numpy as np
from onnx import TensorProto

from .helpers import assert_rewrites, case_tests, graph, ints, node

X = {"x": [2, 3, 4]}


def _binary(op, const, swap=False):
    inputs = ["c", "x"] if swap else ["x", "c"]
    return graph([node(op, inputs, "t"), node("Relu", ["t"])], X, consts={"c": np.asarray(const, np.float32)})


CASES = {
    "identity-elim": (
        lambda: graph([node("Identity", ["x"], "t"), node("Relu", ["t"])], X),
        lambda: graph([node("Identity", ["x"])], X),
        "names a graph output"),
    "dropout-elim": (
        lambda: graph([node("Dropout", ["x"], "t"), node("Relu", ["t"])], X),
        lambda: graph([node("Dropout", ["x"], ["t", "m"]), node("Cast", ["m"], to=TensorProto.FLOAT, outputs="c"),
                       node("Add", ["t", "c"])], X),
        "mask is used"),
    "mul-one-elim": (lambda: _binary("Mul", np.ones(4), swap=True), lambda: _binary("Mul", np.full(4, 2.0)),
                     "no operand is a constant 1"),
    "add-zero-elim": (lambda: _binary("Add", np.zeros((1, 4))), lambda: _binary("Add", np.zeros((5, 1, 1, 1))),
                      "broadcasts the other operand"),
    "sub-zero-elim": (lambda: _binary("Sub", 0.0), lambda: _binary("Sub", 0.0, swap=True), "no operand is a constant 0"),
    "div-one-elim": (lambda: _binary("Div", [1.0]), lambda: _binary("Div", [1.0], swap=True),
                     "no operand is a constant 1"),
    "cast-noop-elim": (
        lambda: graph([node("Cast", ["x"], "t", to=TensorProto.FLOAT), node("Relu", ["t"])], X),
        lambda: graph([node("Cast", ["x"], "t", to=TensorProto.FLOAT16), node("Cast", ["t"], to=TensorProto.FLOAT)], X),
        "changes the type"),
    "cast-roundtrip-elim": (
        lambda: graph([node("Cast", ["x"], "t", to=TensorProto.DOUBLE), node("Cast", ["t"], to=TensorProto.FLOAT)], X),
        lambda: graph([node("Cast", ["x"], "t", to=TensorProto.FLOAT16), node("Cast", ["t"], to=TensorProto.FLOAT)], X),
        "loses values"),
    "transpose-noop-elim": (
        lambda: graph([node("Transpose", ["x"], "t", perm=[0, 1, 2]), node("Relu", ["t"])], X),
        lambda: graph([node("Transpose", ["x"], perm=[0, 2, 1])], X),
        "not the identity"),
    "reshape-noop-elim": (
        lambda: graph([node("Reshape", ["x", "s"], "t"), node("Relu", ["t"])], {"x": ["b", 3, 4]},
                      consts={"s": ints(0, 3, -1)}),
        lambda: graph([node("Reshape", ["x", "s"], "t"), node("Relu", ["t"])], {"x": ["b", 3, 4]},
                      consts={"s": ints(1, 3, -1)}),
        "sits on a dynamic dimension"),
    "pad-zero-elim": (
        lambda: graph([node("Pad", ["x", "p"], "t"), node("Relu", ["t"])], X, consts={"p": ints(0, 0, 0, 0, 0, 0)}),
        lambda: graph([node("Pad", ["x", "p"])], X, consts={"p": ints(0, 0, 1, 0, 0, 0)}),
        "pads something"),
    "slice-noop-elim": (
        lambda: graph([node("Slice", ["x", "s", "e", "a"], "t"), node("Relu", ["t"])], {"x": ["b", 3, 4]},
                      consts={"s": ints(0, 0), "e": ints(2 ** 62, 2 ** 62), "a": ints(0, -1)}),
        lambda: graph([node("Slice", ["x", "s", "e", "a"], "t"), node("Relu", ["t"])], {"x": ["b", 3, 4]},
                      consts={"s": ints(0), "e": ints(1), "a": ints(0)}),
        "drops elements"),
    "concat-single-elim": (
        lambda: graph([node("Concat", ["x"], "t", axis=0), node("Relu", ["t"])], X),
        lambda: graph([node("Concat", ["x", "x"], axis=0)], X),
        "several inputs"),
    "concat-empty-elim": (
        lambda: graph([node("Slice", ["x", "s", "e", "a"], "z"), node("Concat", ["x", "z"], "t", axis=-1),
                       node("Relu", ["t"])], {"x": ["b", 3, 4]}, consts={"s": ints(4), "e": ints(2 ** 62), "a": ints(2)}),
        lambda: graph([node("Slice", ["x", "s", "e", "a"], "z"), node("Concat", ["x", "z"], "t", axis=-1),
                       node("Relu", ["t"])], {"x": ["b", 3, 4]}, consts={"s": ints(3), "e": ints(2 ** 62), "a": ints(2)}),
        "no input is empty"),
    "split-single-elim": (
        lambda: graph([node("Split", ["x"], "t", axis=1), node("Relu", ["t"])], X),
        lambda: graph([node("Split", ["x"], ["a", "b"], axis=2), node("Add", ["a", "b"])], X),
        "several outputs"),
    "expand-noop-elim": (
        lambda: graph([node("Expand", ["x", "s"], "t"), node("Relu", ["t"])], {"x": ["b", 3, 4]},
                      consts={"s": ints(3, 1)}),
        lambda: graph([node("Expand", ["x", "s"])], X, consts={"s": ints(2, 2, 3, 4)}),
        "broadcasts to a larger shape"),
    "idempotent-unary-elim": (
        lambda: graph([node("Relu", ["x"], "t"), node("Relu", ["t"])], X),
        lambda: graph([node("Abs", ["x"], "t"), node("Relu", ["t"])], X),
        "not produced by another Relu"),
    "duplicate-node-elim": (
        lambda: graph([node("Relu", ["x"], "a"), node("Relu", ["x"], "b"), node("Add", ["a", "b"])], X),
        lambda: graph([node("Relu", ["x"], "a"), node("Sigmoid", ["x"], "b"), node("Add", ["a", "b"])], X),
        "no other node computes the same thing"),
}


test_matches_and_keeps_numbers, test_refuses_with_reason = case_tests(CASES)


def test_bypass_keeps_output_name():
    g = graph([node("Relu", ["x"], "t"), node("Dropout", ["t"])], X)
    new = assert_rewrites(g, "dropout-elim")
    assert [t.name for t in new.gs.outputs] == ["y"]
    assert new.op_counts() == {"Relu": 1}


def test_duplicate_of_graph_outputs_keeps_both_names():
    g = graph([node("Relu", ["x"], "a"), node("Relu", ["x"], "b")], X, outputs=("a", "b"))
    new = assert_rewrites(g, "duplicate-node-elim", count=1)
    assert sorted(t.name for t in new.gs.outputs) == ["a", "b"]


def test_slice_static_end_is_full_without_dynamic_dims():
    g = graph([node("Slice", ["x", "s", "e"], "t"), node("Relu", ["t"])], X, consts={"s": ints(-9), "e": ints(2)})
    assert_rewrites(g, "slice-noop-elim")


def test_everywhere_applies_every_match_found_even_past_its_limit():
    """A 30-layer decoder has 60 rotary embeddings: the limit bounds rewrites that create new matches, never the
    matches a graph has (it once left 12 of them unfused)."""
    from rlflow.rewrites import apply_everywhere, rule
    from rlflow.rewrites.base import EVERYWHERE_LIMIT

    count = EVERYWHERE_LIMIT + 12
    chain = [node("Relu" if i % 2 else "Identity", [f"t{i - 1}" if i else "x"], f"t{i}") for i in range(2 * count)]
    g = graph([*chain, node("Relu", [f"t{2 * count - 1}"])], X)
    elim = rule("identity-elim")
    out, applied = apply_everywhere(g, elim, elim.find(g))
    assert len(applied) == count
    assert not elim.find(out) and "Identity" not in out.op_counts()
