"""Algebra rules: associativity, distributivity, elementwise operators commuting with Concat, Split and layout."""
from __future__ import annotations

from .helpers import assert_rewrites, case_tests, graph, ints, node, weights


def _chain(a, b, c, consts=None, right=False):
    nodes = ([node("MatMul", ["b", "c"], "t"), node("MatMul", ["a", "t"])] if right
             else [node("MatMul", ["a", "b"], "t"), node("MatMul", ["t", "c"])])
    consts = consts or {}
    inputs = {k: v for k, v in {"a": a, "b": b, "c": c}.items() if k not in consts}
    return graph(nodes, inputs, consts=consts)


def _two_matmuls(shared, op="Add"):
    if shared == 0:
        nodes = [node("MatMul", ["x", "w1"], "p"), node("MatMul", ["x", "w2"], "q")]
        inputs = {"x": [2, 5, 6]}
    else:
        nodes = [node("MatMul", ["x", "w1"], "p"), node("MatMul", ["z", "w1"], "q")]
        inputs = {"x": [2, 5, 6], "z": [2, 5, 6]}
    return graph(nodes + [node(op, ["p", "q"])], inputs, consts={"w1": weights(6, 4), "w2": weights(6, 4, seed=1)})


def _concat_of(op, n=2, attrs_differ=False, **attrs):
    nodes, inputs = [], {}
    for i in range(n):
        extra = {"alpha": 0.1 * (i + 1)} if attrs_differ else attrs
        nodes.append(node(op, [f"a{i}"], f"u{i}", **extra))
        inputs[f"a{i}"] = [2, 3, 4]
    return graph(nodes + [node("Concat", [f"u{i}" for i in range(n)], axis=1)], inputs)


def _split_then(op, const=None, shapes=((4,), (4,), (4,)), side=1, axis=-1):
    nodes = [node("Split", ["x"], ["p0", "p1", "p2"], axis=axis)]
    consts = {}
    for i in range(3):
        if const is None:
            nodes.append(node(op, [f"p{i}"], f"o{i}"))
        else:
            consts[f"c{i}"] = weights(*shapes[i], seed=i)
            operands = [f"p{i}", f"c{i}"] if side == 1 else [f"c{i}", f"p{i}"]
            nodes.append(node(op, operands, f"o{i}"))
    nodes.append(node("Concat", ["o2", "o0", "o1"], axis=0))
    return graph(nodes, {"x": [2, 3, 12]}, consts=consts)


def _attention_scores(scale_shape=()):
    return graph([node("Transpose", ["k"], "kt", perm=[0, 1, 3, 2]), node("MatMul", ["q", "kt"], "s"),
                  node("Div", ["s", "d"])], {"q": [1, 2, 16, 4], "k": [1, 2, 16, 4]},
                 consts={"d": weights(*scale_shape) + 3})


CASES = {
    "matmul-assoc": (
        lambda: _chain([8, 2], [2, 16], [16, 3]),
        lambda: _chain([2, 16], [16, 8], [8, 3]),
        "needs no fewer FLOPs"),
    "matmul-const-chain-fold": (
        lambda: _chain([2, 3, 6], None, None, consts={"b": weights(6, 5), "c": weights(5, 4)}),
        lambda: _chain([2, 3, 16], None, None, consts={"b": weights(16, 1), "c": weights(1, 16)}),
        "low-rank chain would add FLOPs"),
    "matmul-factor-lhs": (lambda: _two_matmuls(0), lambda: _two_matmuls(1), "share no operand"),
    "matmul-factor-rhs": (lambda: _two_matmuls(1), lambda: _two_matmuls(0), "share no operand"),
    "mul-factor": (
        lambda: graph([node("Mul", ["a", "b"], "p"), node("Mul", ["c", "a"], "q"), node("Add", ["p", "q"])],
                      {"a": [2, 3], "b": [2, 3], "c": [1, 3]}),
        lambda: graph([node("Mul", ["a", "b"], "p"), node("Mul", ["c", "d"], "q"), node("Add", ["p", "q"])],
                      {"a": [2, 3], "b": [2, 3], "c": [1, 3], "d": [2, 3]}),
        "share no operand"),
    "transpose-matmul": (
        lambda: graph([node("MatMul", ["x", "w"], "m"), node("Transpose", ["m"], perm=[0, 2, 1])], {"x": [2, 3, 4]},
                      consts={"w": weights(2, 4, 5)}),
        lambda: graph([node("MatMul", ["x", "z"], "m"), node("Transpose", ["m"], perm=[0, 2, 1])],
                      {"x": [2, 3, 4], "z": [2, 4, 5]}),
        "neither operand is a constant or a transpose"),
    "matmul-transpose-factor": (
        lambda: graph([node("Transpose", ["x"], "a", perm=[1, 0]), node("Transpose", ["z"], "b", perm=[1, 0]),
                       node("MatMul", ["a", "b"])], {"x": [4, 3], "z": [5, 4]}),
        lambda: graph([node("Transpose", ["x"], "a", perm=[1, 0]), node("MatMul", ["a", "z"])],
                      {"x": [4, 3], "z": [4, 5]}),
        "not both private transposes"),
    "concat-unary-commute": (lambda: _concat_of("LeakyRelu", n=3, alpha=0.3),
                             lambda: _concat_of("LeakyRelu", attrs_differ=True), "different operators or attributes"),
    "concat-binary-commute": (
        lambda: graph([node("Sub", ["a", "b"], "p"), node("Sub", ["c", "d"], "q"), node("Concat", ["p", "q"], axis=-1)],
                      {k: [2, 3] for k in "abcd"}),
        lambda: graph([node("Sub", ["a", "b"], "p"), node("Sub", ["c", "d"], "q"), node("Concat", ["p", "q"], axis=-1)],
                      {"a": [2, 3], "b": [1, 3], "c": [2, 3], "d": [2, 3]}),
        "broadcasts"),
    "split-unary-hoist": (lambda: _split_then("Tanh"), lambda: graph(
        [node("Split", ["x"], ["p", "q"], axis=-1), node("Tanh", ["p"], "a"), node("Relu", ["q"], "b"),
         node("Add", ["a", "b"])], {"x": [2, 3, 12]}), "different operators"),
    "split-binary-hoist": (
        lambda: _split_then("Add", const=True),
        lambda: graph([node("Split", ["x"], ["p", "q"], axis=0), node("Add", ["p", "c"], "a"),
                       node("Add", ["q", "z"], "b"), node("Mul", ["a", "b"])], {"x": [2, 3], "z": [3]},
                      consts={"c": weights(3)}),
        "other operand is not a constant"),
    "scalar-mul-hoist": (lambda: _attention_scores(), lambda: _attention_scores(scale_shape=(16,)),
                         "not a private MatMul scaled by a scalar"),
    "scalar-mul-through-layout": (
        lambda: graph([node("Transpose", ["x"], "t", perm=[1, 0, 2]), node("Mul", ["s", "t"])], {"x": [2, 3, 4]},
                      consts={"s": weights(1, 1)}),
        lambda: graph([node("Transpose", ["x"], "t", perm=[1, 0, 2]), node("Mul", ["s", "t"])], {"x": [2, 3, 4]},
                      consts={"s": weights(4)}),
        "not a private layout operator scaled by a scalar"),
    "mul-add-distribute": (
        lambda: graph([node("Add", ["b", "x"], "t"), node("Div", ["t", "s"])], {"x": [2, 3, 4]},
                      consts={"b": weights(4), "s": weights(3, 1) + 4}),
        lambda: graph([node("Add", ["z", "x"], "t"), node("Div", ["t", "s"])], {"x": [2, 3, 4], "z": [4]},
                      consts={"s": weights(3, 1) + 4}),
        "no constant operand"),
}


test_matches_and_keeps_numbers, test_refuses_with_reason = case_tests(CASES)


def test_assoc_reverse_direction():
    new = assert_rewrites(_chain([2, 16], [16, 8], [8, 3], right=True), "matmul-assoc")
    assert new.op_counts() == {"MatMul": 2}


def test_const_chain_fold_leaves_one_matmul():
    new = assert_rewrites(_chain([2, 3, 6], None, None, consts={"b": weights(6, 5), "c": weights(5, 4)}),
                          "matmul-const-chain-fold")
    assert new.op_counts() == {"MatMul": 1}


def test_factor_of_constants_folds_the_sum():
    assert assert_rewrites(_two_matmuls(0), "matmul-factor-lhs").op_counts() == {"MatMul": 1}


def test_split_binary_hoist_joins_biases():
    new = assert_rewrites(_split_then("Mul", const=True, side=0), "split-binary-hoist")
    assert new.op_counts() == {"Concat": 1, "Mul": 1, "Split": 1}


def test_split_binary_hoist_uniform_constant_on_dynamic_axis():
    g = graph([node("Split", ["x"], ["p", "q"], axis=0), node("Add", ["p", "c"], "a"), node("Add", ["q", "c"], "b"),
               node("Mul", ["a", "b"])], {"x": ["n", 3]}, consts={"c": weights(3)}, input_shapes={"x": [2, 3]})
    assert_rewrites(g, "split-binary-hoist", dynamic={"x": [4, 3]})


def test_transpose_matmul_of_transposed_operand_cancels():
    g = graph([node("Transpose", ["x"], "xt", perm=[1, 0]), node("MatMul", ["xt", "z"], "m"),
               node("Transpose", ["m"], perm=[1, 0])], {"x": [4, 3], "z": [4, 5]})
    assert assert_rewrites(g, "transpose-matmul").op_counts() == {"MatMul": 1, "Transpose": 1}


def test_reshape_target_untouched_by_layout_scale():
    g = graph([node("Reshape", ["x", "s"], "t"), node("Mul", ["t", "k"])], {"x": ["b", 3, 4]},
              consts={"s": ints(0, 12), "k": weights(1)})
    assert_rewrites(g, "scalar-mul-through-layout")
