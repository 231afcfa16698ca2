"""Layout rules: transposes, reshapes, concatenations and splits that cancel or move."""
from __future__ import annotations

from pathlib import Path

import pytest

from rlflow.graph.core import load
from rlflow.measure.verify import verify
from rlflow.rewrites import apply_everywhere, rule

from .helpers import assert_refuses, assert_rewrites, case_tests, graph, ints, node, weights

EXPORTS = Path(__file__).resolve().parents[1] / "fixtures" / "exports"

X = {"x": [2, 3, 4]}
NHWC = {"x": [1, 5, 5, 3]}


def _conv_nhwc(kernel=1, stride=1):
    return graph([node("Transpose", ["x"], "a", perm=[0, 3, 1, 2]),
                  node("Conv", ["a", "w", "b"], "c", kernel_shape=[kernel, kernel], strides=[stride, stride]),
                  node("Transpose", ["c"], perm=[0, 2, 3, 1])], NHWC,
                 consts={"w": weights(6, 3, kernel, kernel), "b": weights(6)})


def _residual_ln(bias_first=False, operand=0, residual_shape=(2, 4, 8)):
    """`LayerNormalization(Add(Add(MatMul(x, W), c), z))`, a transformer's linear layer, bias, residual and norm."""
    linear = [node("MatMul", ["x", "w"], "m"), node("Add", ["c", "m"] if bias_first else ["m", "c"], "h")]
    add = node("Add", ["h", "z"] if operand == 0 else ["z", "h"], "s")
    return graph([*linear, add, node("LayerNormalization", ["s", "g", "b"], epsilon=1e-3)],
                 {"x": ["batch", 4, 8], "z": list(residual_shape)}, opset=17,
                 consts={"w": weights(8, 8), "c": weights(8, seed=2), "g": weights(8), "b": weights(8, seed=1)})


CASES = {
    "residual-bias-reorder": (lambda: _residual_ln(), lambda: _residual_ln(residual_shape=(8,)),
                              "the residual is a constant or broadcasts"),
    "transpose-transpose": (
        lambda: graph([node("Transpose", ["x"], "t", perm=[1, 0, 2]), node("Transpose", ["t"], perm=[2, 0, 1])], X),
        lambda: graph([node("Relu", ["x"], "t"), node("Transpose", ["t"], perm=[2, 0, 1])], X),
        "not produced by a Transpose"),
    "reshape-chain": (
        lambda: graph([node("Reshape", ["x", "s1"], "t"), node("Reshape", ["t", "s2"])], {"x": ["b", 3, 4]},
                      consts={"s1": ints(0, 12), "s2": ints(0, 2, 6)}),
        lambda: graph([node("Unsqueeze", ["x", "a"], "t"), node("Reshape", ["t", "s2"])], {"x": ["b", 3, 4]},
                      consts={"a": ints(0), "s2": ints(0, -1)}),
        "copies a dimension (0)"),
    "squeeze-unsqueeze-cancel": (
        lambda: graph([node("Unsqueeze", ["x", "a"], "t"), node("Relu", ["t"], "r"), node("Squeeze", ["t", "b"], "s"),
                       node("Add", ["s", "x"])], X, consts={"a": ints(1), "b": ints(-3)}),
        lambda: graph([node("Unsqueeze", ["x", "a"], "t"), node("Squeeze", ["t", "b"])], {"x": [2, 1, 4]},
                      consts={"a": ints(1), "b": ints(2)}),
        "the axes differ"),
    "concat-split-cancel": (
        lambda: graph([node("Concat", ["x", "z"], "c", axis=2), node("Split", ["c", "s"], ["p", "q"], axis=-1),
                       node("Mul", ["p", "q"])], {"x": [2, 3, 4], "z": [2, 3, 4]}, consts={"s": ints(4, 4)}),
        lambda: graph([node("Concat", ["x", "z"], "c", axis=2), node("Split", ["c", "s"], ["p", "q"], axis=2),
                       node("Concat", ["q", "p"], axis=2)], {"x": [2, 3, 4], "z": [2, 3, 4]}, consts={"s": ints(2, 6)}),
        "not the Concat's inputs"),
    "split-concat-cancel": (
        lambda: graph([node("Split", ["x"], ["p", "q"], axis=1), node("Concat", ["p", "q"], "c", axis=1),
                       node("Relu", ["c"])], {"x": [2, 4, 4]}),
        lambda: graph([node("Split", ["x"], ["p", "q"], axis=1), node("Concat", ["q", "p"], axis=1)], {"x": [2, 4, 4]}),
        "in order"),
    "concat-flatten": (
        lambda: graph([node("Concat", ["x", "x"], "c", axis=1), node("Concat", ["c", "x"], axis=-2)], X),
        lambda: graph([node("Concat", ["x", "x"], "c", axis=1), node("Concat", ["c", "c"], axis=1)], X),
        "no input is a private Concat"),
    "transpose-unary-sink": (
        lambda: graph([node("Transpose", ["x"], "t", perm=[2, 0, 1]), node("LeakyRelu", ["t"], alpha=0.2)], X),
        lambda: graph([node("Transpose", ["x"], "t", perm=[2, 0, 1]), node("Relu", ["t"], "r"), node("Add", ["r", "t"])],
                      X),
        "read elsewhere too"),
    "transpose-binary-sink": (
        lambda: graph([node("Transpose", ["x"], "t", perm=[2, 0, 1]), node("Sub", ["c", "t"])], X,
                      consts={"c": weights(4, 1, 3)}),
        lambda: graph([node("Transpose", ["x"], "t", perm=[2, 0, 1]), node("Transpose", ["x"], "u", perm=[2, 1, 0]),
                       node("Add", ["t", "u"])], {"x": [3, 3, 3]}),
        "the two Transposes differ"),
    "conv1x1-nhwc-matmul": (lambda: _conv_nhwc(), lambda: _conv_nhwc(kernel=3), "not a 1x1 Conv"),
    "transpose-into-gemm": (
        lambda: graph([node("Transpose", ["x"], "t", perm=[1, 0]), node("Transpose", ["w"], "u"),
                       node("Gemm", ["t", "u", "c"], transB=1, alpha=0.5)], {"x": [4, 3]},
                      consts={"w": weights(4, 5), "c": weights(5)}),
        lambda: graph([node("Transpose", ["x"], "t", perm=[1, 0]), node("Gemm", ["t", "w"], "g"), node("Add", ["g", "t"])],
                      {"x": [3, 3]}, consts={"w": weights(3, 3)}),
        "no operand is a private 2-D Transpose"),
    "matmul-transpose-to-gemm": (
        lambda: graph([node("Transpose", ["z"], "t"), node("MatMul", ["x", "t"])], {"x": ["n", 4], "z": [5, 4]}),
        lambda: graph([node("Transpose", ["z"], "t", perm=[0, 2, 1]), node("MatMul", ["x", "t"])],
                      {"x": [2, 3, 4], "z": [2, 5, 4]}),
        "not a float product of 2-D operands"),
    "matmul3d-add-to-gemm": (
        lambda: graph([node("MatMul", ["x", "w"], "m"), node("Add", ["b", "m"])], {"x": ["batch", 6, 4]},
                      consts={"w": weights(4, 5), "b": weights(5)}),
        lambda: graph([node("MatMul", ["x", "w"], "m"), node("Add", ["m", "b"])], {"x": ["batch", "seq", 4]},
                      consts={"w": weights(4, 5), "b": weights(5)}),
        "more than one leading dimension"),
}


test_matches_and_keeps_numbers, test_refuses_with_reason = case_tests(CASES)


def test_transpose_pair_cancels():
    g = graph([node("Transpose", ["x"], "t", perm=[1, 0, 2]), node("Transpose", ["t"], "u", perm=[1, 0, 2]),
               node("Relu", ["u"])], X)
    assert assert_rewrites(g, "transpose-transpose").op_counts() == {"Relu": 1}


def test_binary_sink_of_two_transposes_leaves_one():
    g = graph([node("Transpose", ["x"], "t", perm=[2, 0, 1]), node("Transpose", ["z"], "u", perm=[2, 0, 1]),
               node("Div", ["t", "u"])], {"x": [2, 3, 4], "z": [1, 3, 4]})
    assert assert_rewrites(g, "transpose-binary-sink").op_counts() == {"Div": 1, "Transpose": 1}


def test_conv1x1_without_bias_and_nhwc_removes_transposes():
    g = graph([node("Transpose", ["x"], "a", perm=[0, 3, 1, 2]), node("Conv", ["a", "w"], "c"),
               node("Transpose", ["c"], perm=[0, 2, 3, 1])], NHWC, consts={"w": weights(6, 3, 1, 1)})
    assert assert_rewrites(g, "conv1x1-nhwc-matmul").op_counts() == {"MatMul": 1}


def test_matmul3d_to_gemm_round_trip():
    g = graph([node("MatMul", ["x", "w"], "m"), node("Add", ["m", "b"], "y")], {"x": [2, 3, 6, 4]},
              consts={"w": weights(4, 5), "b": weights(1, 1, 1, 5)})
    gemm = assert_rewrites(g, "matmul3d-add-to-gemm")
    assert gemm.op_counts() == {"Gemm": 1, "Reshape": 2}
    assert assert_rewrites(gemm, "gemm-reshape-to-matmul").op_counts() == {"Add": 1, "MatMul": 1}


def test_matmul3d_refuses_a_bias_that_is_not_a_vector():
    g = graph([node("MatMul", ["x", "w"], "m"), node("Add", ["m", "b"])], {"x": [2, 6, 4]},
              consts={"w": weights(4, 5), "b": weights(6, 5)})
    assert_refuses(g, "matmul3d-add-to-gemm", "not a constant vector along the last axis")


def test_concat_split_cancel_with_an_equal_split():
    """An equal Split (no sizes input) of a Concat of static parts cancels; this path once raised a NameError."""
    from onnx import TensorProto, helper

    from rlflow.graph.core import Graph
    from rlflow.rewrites import apply

    value = lambda name: helper.make_tensor_value_info(name, TensorProto.FLOAT, [2, 3])  # noqa: E731
    nodes = [helper.make_node("Concat", ["a", "b"], ["c"], axis=0),
             helper.make_node("Split", ["c"], ["p", "q"], axis=0),
             helper.make_node("Add", ["p", "q"], ["y"])]
    model = helper.make_model(helper.make_graph(nodes, "g", [value("a"), value("b")], [value("y")]),
                              opset_imports=[helper.make_opsetid("", 13)], ir_version=8)
    graph = Graph.from_model(model)
    matches = rule("concat-split-cancel").find(graph)
    assert len(matches) == 1
    assert verify(model, apply(graph, matches[0]).to_model()).ok


@pytest.mark.parametrize("bias_first, operand", [(False, 0), (True, 1)])
def test_residual_bias_reorder_adds_the_residual_first(bias_first, operand):
    """The bias Add moves after the residual one, at any batch (the input's batch is dynamic), once: the new form is
    not matched again."""
    g = _residual_ln(bias_first, operand, residual_shape=("batch", 4, 8))
    new = assert_rewrites(g, "residual-bias-reorder", dynamic={"x": [3, 4, 8], "z": [3, 4, 8]})
    nodes = {n.outputs[0].name: n for n in new.gs.nodes}
    ln = next(n for n in new.gs.nodes if n.op == "LayerNormalization")
    outer = nodes[ln.inputs[0].name]
    assert "c" in [t.name for t in outer.inputs]
    inner = next(nodes[t.name] for t in outer.inputs if t.name in nodes)
    assert {t.name for t in inner.inputs} == {"m", "z"}
    assert not rule("residual-bias-reorder").find(new)


def test_residual_bias_reorder_leaves_a_shared_bias_sum():
    """Where the biased output is read elsewhere too, moving the bias would change what that reader sees."""
    g = graph([node("MatMul", ["x", "w"], "m"), node("Add", ["m", "c"], "h"), node("Add", ["h", "z"], "s"),
               node("LayerNormalization", ["s", "g", "b"], "n"), node("Add", ["n", "h"], "y")],
              {"x": [2, 4, 8], "z": [2, 4, 8]}, opset=17,
              consts={"w": weights(8, 8), "c": weights(8, seed=2), "g": weights(8), "b": weights(8, seed=1)})
    assert_refuses(g, "residual-bias-reorder", "no operand of the Add is a private bias Add")


@pytest.mark.parametrize("export", ["bert-tiny-dynamo", "bert-tiny-torchscript"])
def test_residual_bias_reorder_on_real_exports(export):
    """On both exporters' BERT every post-attention and post-MLP norm matches; the result verifies at other batch
    sizes and sequence lengths than the export's."""
    g = load(EXPORTS / f"{export}.onnx", {"input_ids": (1, 8), "attention_mask": (1, 8)})
    the_rule = rule("residual-bias-reorder")
    matches = the_rule.find(g)
    assert len(matches) == 2 * sum(1 for n in g.gs.nodes if n.op == "Softmax")
    new, done = apply_everywhere(g, the_rule, matches)
    assert len(done) == len(matches)
    sizes = [{"input_ids": [b, s], "attention_mask": [b, s]} for b, s in ((1, 8), (2, 5), (1, 33))]
    result = verify(g.to_model(static=False), new.to_model(static=False), shapes=sizes)
    assert result.ok, result.message


@pytest.mark.parametrize("inner,outer,shape", [
    ((-1, 1, 2, 16), (0, 1, -1), [1, 1, 32]),     # a packed value split to heads and back: Qwen3's V (issue #79)
    ((4, 3, 2, 2), (0, 12), [4, 3, 4]),            # a static size written out where 0 would copy it
    ((-1, 3, 2, 2), (0, 12), ["b", 3, 4]),         # -1 keeps a dynamic batch where the other sizes match
])
def test_reshape_chain_sees_a_kept_dimension_written_out(inner, outer, shape):
    g = graph([node("Reshape", ["x", "s1"], "t"), node("Reshape", ["t", "s2"])], {"x": shape},
              consts={"s1": ints(*inner), "s2": ints(*outer)})
    assert assert_rewrites(g, "reshape-chain", count=1).op_counts() == {"Reshape": 1}


@pytest.mark.parametrize("inner,outer,shape", [
    ((2, 3, 2, 2), (0, 12), ["b", 3, 4]),          # a literal where the batch is dynamic
    ((-1, 2), (0, 1, 2), [4, 3, 4]),               # -1 is 24 there, not the input's 4
])
def test_reshape_chain_refuses_a_dimension_the_inner_reshape_moves(inner, outer, shape):
    g = graph([node("Reshape", ["x", "s1"], "t"), node("Reshape", ["t", "s2"])], {"x": shape},
              consts={"s1": ints(*inner), "s2": ints(*outer)})
    assert_refuses(g, "reshape-chain", "copies a dimension (0)")
