"""Merge rules: parallel MatMuls, Gemms and Convs combined into one operator."""
from __future__ import annotations

from .helpers import assert_refuses, assert_rewrites, case_tests, graph, node, weights

IMAGE = {"x": [1, 4, 6, 6]}


def _siblings(op, n=3, k=6, **attrs):
    nodes, consts = [], {}
    for i in range(n):
        width = 4 + i
        if op == "Gemm":
            consts[f"w{i}"] = weights(width, k, seed=i)
            consts[f"c{i}"] = weights(width, seed=10 + i)
            nodes.append(node("Gemm", ["x", f"w{i}", f"c{i}"], f"o{i}", transB=1, **attrs))
        else:
            consts[f"w{i}"] = weights(5 if op == "MatMul-bad" and i else k, width, seed=i)
            nodes.append(node("MatMul", ["x" if i == 0 or op != "MatMul-bad" else "z", f"w{i}"], f"o{i}"))
    inputs = {"x": [3, k]} if op != "MatMul-bad" else {"x": [3, k], "z": [3, 5]}
    return graph(nodes, inputs, outputs=[f"o{i}" for i in range(n)], consts=consts)


def _convs(kernels, pads, strides=(1, 1), group=1, shared=True):
    nodes, consts, inputs = [], {}, {"x": [1, 4, 6, 6]}
    for i, (k, p) in enumerate(zip(kernels, pads)):
        source = "x" if shared or i == 0 else f"x{i}"
        inputs.setdefault(source, [1, 4, 6, 6])
        out_channels = 3 + i if group == 1 else 4 * group
        consts[f"w{i}"] = weights(out_channels, 4 // group, k, k, seed=i)
        consts[f"b{i}"] = weights(out_channels, seed=20 + i)
        nodes.append(node("Conv", [source, f"w{i}", f"b{i}"], f"o{i}", kernel_shape=[k, k], pads=[p] * 4,
                          strides=list(strides), group=group))
    return graph(nodes, inputs, outputs=[f"o{i}" for i in range(len(kernels))], consts=consts)


def _concat_convs(same_input=False, kernels=(3, 3), group=1):
    nodes, consts, inputs = [], {}, {}
    for i, k in enumerate(kernels):
        source = "x0" if same_input else f"x{i}"
        inputs[source] = [1, 4, 6, 6]
        consts[f"w{i}"] = weights(4, 4 // group, k, k, seed=i)
        nodes.append(node("Conv", [source, f"w{i}"], f"o{i}", kernel_shape=[k, k], pads=[k // 2] * 4, group=group))
    nodes.append(node("Concat", [f"o{i}" for i in range(len(kernels))], axis=1))
    return graph(nodes, inputs, consts=consts)


def _add_of(op, channels=(4, 2), share=False):
    nodes, consts, inputs = [], {}, {}
    for i, c in enumerate(channels):
        source = "x0" if share else f"x{i}"
        if op == "Conv":
            inputs[source] = [1, c, 6, 6]
            consts[f"w{i}"] = weights(5, c, 3, 3, seed=i)
            consts[f"b{i}"] = weights(5, seed=i + 9)
            nodes.append(node("Conv", [source, f"w{i}", f"b{i}"], f"o{i}", kernel_shape=[3, 3], pads=[1] * 4))
        else:
            inputs[source] = [2, 3, c]
            consts[f"w{i}"] = weights(c, 5, seed=i)
            nodes.append(node("MatMul", [source, f"w{i}"], f"o{i}"))
    nodes.append(node("Add", ["o0", "o1"]))
    return graph(nodes, inputs, consts=consts)


def _shared_weight(op, batch=(2, 2), dynamic=False):
    inputs = {"a": ["n" if dynamic else batch[0], 4, 5, 5], "b": [batch[1], 4, 5, 5]} if op == "Conv" else {
        "a": [2, batch[0], 4], "b": [2, batch[1], 4]}
    consts = {"w": weights(3, 4, 3, 3) if op == "Conv" else weights(4, 3)}
    attrs = {"kernel_shape": [3, 3]} if op == "Conv" else {}
    return graph([node(op, ["a", "w"], "p", **attrs), node(op, ["b", "w"], "q", **attrs)], inputs, outputs=("p", "q"),
                 consts=consts)


CASES = {
    "matmul-merge-siblings": (lambda: _siblings("MatMul"), lambda: _siblings("MatMul-bad", n=2),
                              "no other MatMul reads the same input"),
    "gemm-merge-siblings": (lambda: _siblings("Gemm", beta=0.5), lambda: _siblings("Gemm", n=1),
                            "no other Gemm reads the same input"),
    "conv-merge-siblings": (lambda: _convs((3, 3, 3), (1, 1, 1)), lambda: _convs((3, 1), (1, 0)),
                            "no other Conv reads the same input"),
    "conv-enlarge-kernel": (lambda: _convs((1, 3), (0, 1)), lambda: _convs((1, 3), (0, 0)),
                            "no sibling Conv has a larger kernel"),
    "conv-concat-to-group": (lambda: _concat_convs(), lambda: _concat_convs(same_input=True),
                             "read the same input"),
    "group-conv-merge-groups": (lambda: _convs((3,), (1,), group=4), lambda: _convs((3,), (1,)),
                                "does not have an even number of groups"),
    "conv-add-merge": (lambda: _add_of("Conv"), lambda: _add_of("MatMul"), "not two private Convs"),
    "matmul-add-merge": (lambda: _add_of("MatMul"), lambda: _add_of("MatMul", channels=(4, 4), share=True),
                         "share their input"),
    "matmul-batch-shared-weight": (
        lambda: _shared_weight("MatMul", batch=(3, 5)),
        lambda: graph([node("MatMul", ["a", "w"])], {"a": [2, 4]}, consts={"w": weights(4, 3)}),
        "no other node applies the same weights"),
    "conv-batch-shared-weight": (lambda: _shared_weight("Conv"), lambda: _shared_weight("Conv", batch=(1, 1), dynamic=True),
                                 "batching axis is dynamic"),
}


test_matches_and_keeps_numbers, test_refuses_with_reason = case_tests(CASES)


def test_qkv_merge_is_one_match_per_group():
    new = assert_rewrites(_siblings("MatMul"), "matmul-merge-siblings", count=1)
    assert new.op_counts()["MatMul"] == 1 and new.op_counts()["Split"] == 1


def test_enlarge_then_merge():
    from rlflow.rewrites import apply, rule

    g = assert_rewrites(_convs((1, 3), (0, 1)), "conv-enlarge-kernel")
    assert_rewrites(g, "conv-merge-siblings")
    merged = apply(g, rule("conv-merge-siblings").find(g)[0])
    assert merged.op_counts()["Conv"] == 1


def test_group_merge_down_to_one_group():
    from rlflow.rewrites import apply, rule

    g = _convs((3,), (1,), group=4)
    for _ in range(2):
        g = apply(g, rule("group-conv-merge-groups").find(g)[0])
    assert [n.attrs["group"] for n in g.gs.nodes if n.op == "Conv"] == [1]
    assert_refuses(g, "group-conv-merge-groups", "even number of groups")


def test_grouped_convs_concatenated_keep_their_groups():
    new = assert_rewrites(_concat_convs(kernels=(3, 3), group=2), "conv-concat-to-group")
    assert [n.attrs["group"] for n in new.gs.nodes if n.op == "Conv"] == [4]


def test_weights_shared_by_layers_in_sequence_are_not_batched():
    """ALBERT applies one set of weights in every layer: a MatMul whose input comes from another's output cannot take
    part in their concatenation (it would be a cycle; the agent's rule-wide step once built one)."""
    chained = graph([node("MatMul", ["x", "w"], "h"), node("Relu", ["h"], "r"), node("MatMul", ["r", "w"], "y")],
                    {"x": [3, 4]}, outputs=["y"], consts={"w": weights(4, 4)})
    assert_refuses(chained, "matmul-batch-shared-weight", "computed from another's output")

