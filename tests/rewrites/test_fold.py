"""Fold rules: constants absorbed into weights, constant subgraphs computed once."""
from __future__ import annotations

import numpy as np
import pytest
from onnx import numpy_helper

from .helpers import assert_rewrites, case_tests, graph, ints, node, weights

IMAGE = {"x": [1, 3, 6, 6]}


def _bn_consts(channels):
    return {"g": weights(channels, seed=1), "be": weights(channels, seed=2), "m": weights(channels, seed=3),
            "v": np.abs(weights(channels, seed=4)) + 0.5}


def _conv_then(op, const_shape, extra=None):
    nodes = [node("Conv", ["x", "w", "b"], "c", kernel_shape=[3, 3], pads=[1, 1, 1, 1]), node(op, ["c", "k"])]
    if extra:
        nodes.append(extra)
    return graph(nodes, IMAGE, outputs=("y",) if not extra else ("y", "c"),
                 consts={"w": weights(4, 3, 3, 3), "b": weights(4), "k": weights(*const_shape, seed=5)})


def _bn_after(op, rank=2):
    x = {"x": [3, 5] if rank == 2 else [2, 3, 5]}
    consts = {"w": weights(5, 4), **_bn_consts(4)}
    if op == "Gemm":
        first = node("Gemm", ["x", "w", "c"], "h", transB=1, alpha=0.5, beta=2.0)
        consts.update(w=weights(4, 5), c=weights(4))
    else:
        first = node("MatMul", ["x", "w"], "h")
    return graph([first, node("BatchNormalization", ["h", "g", "be", "m", "v"])], x, consts=consts)


def _scaled(op, producer="MatMul", const_shape=(4,), rank=3):
    consts = {"w": weights(5, 4), "s": weights(*const_shape, seed=9) + 3}
    if producer == "Gemm":
        first, x = node("Gemm", ["x", "w", "c"], "h", alpha=2.0), {"x": [3, 5]}
        consts["c"] = weights(4)
    else:
        first, x = node("MatMul", ["x", "w"], "h"), {"x": [2, 3, 5] if rank == 3 else [3, 5]}
    return graph([first, node(op, ["h", "s"])], x, consts=consts)


CASES = {
    "conv-bn-fold": (
        lambda: graph([node("Conv", ["x", "w"], "c", kernel_shape=[3, 3]),
                       node("BatchNormalization", ["c", "g", "be", "m", "v"])], IMAGE,
                      consts={"w": weights(4, 3, 3, 3), **_bn_consts(4)}),
        lambda: graph([node("Relu", ["x"], "c"), node("BatchNormalization", ["c", "g", "be", "m", "v"])], IMAGE,
                      consts=_bn_consts(3)),
        "not produced by a Conv"),
    "conv-mul-fold": (lambda: _conv_then("Mul", (4, 1, 1)), lambda: _conv_then("Mul", (6, 1)),
                      "not one value per output channel"),
    "conv-add-fold": (lambda: _conv_then("Add", (1, 4, 1, 1)),
                      lambda: _conv_then("Add", (4, 1, 1), extra=node("Relu", ["c"], "r")),
                      "read elsewhere too"),
    "matmul-bn-fold": (lambda: _bn_after("Gemm"), lambda: _bn_after("MatMul", rank=3), "features are not 2-D"),
    "matmul-scale-fold": (lambda: _scaled("Div", const_shape=(1, 4)), lambda: _scaled("Mul", const_shape=(3, 1)),
                          "not one value per output column"),
    "gemm-bias-fold": (
        lambda: graph([node("Gemm", ["x", "w", "c"], "h", beta=0.5, transB=1), node("Add", ["d", "h"])],
                      {"x": [3, 5]}, consts={"w": weights(4, 5), "c": weights(4), "d": weights(3, 1)}),
        lambda: graph([node("Gemm", ["x", "w"], "h"), node("Add", ["d", "h"])], {"x": [1, 5]},
                      consts={"w": weights(5, 4), "d": weights(3, 4)}),
        "broadcasts the product to a larger shape"),
    "add-const-chain-fold": (
        lambda: graph([node("Add", ["c1", "x"], "t"), node("Add", ["t", "c2"])], {"x": [2, 3]},
                      consts={"c1": weights(3), "c2": weights(2, 1)}),
        lambda: graph([node("Add", ["z", "x"], "t"), node("Add", ["t", "c2"])], {"x": [2, 3], "z": [3]},
                      consts={"c2": weights(2, 1)}),
        "inner Add has no constant operand"),
    "mul-const-chain-fold": (
        lambda: graph([node("Mul", ["x", "c1"], "t"), node("Mul", ["c2", "t"])], {"x": [2, 3]},
                      consts={"c1": weights(3), "c2": weights(1)}),
        lambda: graph([node("Mul", ["x", "c1"], "t"), node("Mul", ["c2", "t"], "u"), node("Add", ["t", "u"])],
                      {"x": [2, 3]}, consts={"c1": weights(3), "c2": weights(1)}),
        "read elsewhere too"),
    "constant-fold": (
        lambda: graph([node("Transpose", ["w"], "wt", perm=[1, 0]),
                       node("ConstantOfShape", ["s"], "z", value=numpy_helper.from_array(np.array([2.0], np.float32))),
                       node("Add", ["wt", "z"], "b"), node("MatMul", ["x", "b"])], {"x": [3, 4]},
                      consts={"w": weights(5, 4), "s": ints(4, 5)}),
        lambda: graph([node("MatMul", ["x", "w"])], {"x": [3, 4]}, consts={"w": weights(4, 5)}),
        "not every input is a constant"),
}


test_matches_and_keeps_numbers, test_refuses_with_reason = case_tests(CASES)


@pytest.mark.parametrize("op,rank", [("MatMul", 2), ("MatMul", 3), ("Gemm", 2)])
def test_scale_fold_variants(op, rank):
    new = assert_rewrites(_scaled("Mul", producer=op, const_shape=() if rank == 3 else (4,), rank=rank),
                          "matmul-scale-fold")
    assert len(new) == 1


def test_matmul_bn_fold_gives_one_gemm():
    assert assert_rewrites(_bn_after("MatMul"), "matmul-bn-fold").op_counts() == {"Gemm": 1}


def test_constant_fold_chain_reaches_a_single_matmul():
    from rlflow.rewrites import apply, rule

    g = CASES["constant-fold"][0]()
    while (matches := rule("constant-fold").find(g)):
        g = apply(g, matches[0])
    assert g.op_counts() == {"MatMul": 1}
