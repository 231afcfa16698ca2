"""Inverse rules: merged operators split back, contrib fusions undone (each round trip verified)."""
from __future__ import annotations

import numpy as np
import pytest

from rlflow.rewrites import apply, rule

from .helpers import F32, assert_rewrites, case_tests, graph, ints, node, weights

MS = "com.microsoft"


def _split_matmul(axis=-1, bias=True):
    nodes = [node("MatMul", ["x", "w"], "m")]
    if bias:
        nodes.append(node("Add", ["b", "m"], "a"))
    nodes.append(node("Split", ["a" if bias else "m", "sizes"], ["p", "q"], axis=axis))
    return graph(nodes, {"x": ["n", 3, 4]}, ("p", "q"), consts={"w": weights(4, 6), "b": weights(6), "sizes": ints(2, 4)}
                 if axis == -1 else {"w": weights(4, 6), "b": weights(6), "sizes": ints(1, 2)})


def _split_gemm(axis=1):
    return graph([node("Gemm", ["x", "w", "c"], "g", transB=1, beta=0.5), node("Split", ["g"], ["p", "q"], axis=axis)],
                 {"x": [4, 5]}, ("p", "q"), consts={"w": weights(6, 5), "c": weights(1, 6)})


def _split_conv(group=1):
    return graph([node("Conv", ["x", "w", "b"], "c", pads=[1, 1, 1, 1], group=group),
                  node("Split", ["c", "sizes"], ["p", "q"], axis=1)], {"x": ["n", 4, 5, 5]}, ("p", "q"),
                 consts={"w": weights(6, 4 // group, 3, 3), "b": weights(6), "sizes": ints(2, 4)})


def _gemm_reshaped(bias_rows=1):
    return graph([node("Reshape", ["x", "rows"], "r"), node("Gemm", ["r", "w", "c"], "g", transB=1, alpha=2.0),
                  node("Reshape", ["g", "back"])], {"x": [2, 3, 4]},
                 consts={"rows": ints(-1, 4), "w": weights(5, 4), "c": weights(bias_rows, 5), "back": ints(2, 3, 5)})


def _fused_conv(activation="LeakyRelu", params=(0.2,)):
    extra = {"activation_params": list(params)} if params else {}
    return graph([node("FusedConv", ["x", "w", "b"], domain=MS, activation=activation, pads=[1, 1, 1, 1], **extra)], {"x": ["n", 3, 5, 5]}, {"y": (F32, ["n", 4, 5, 5])}, consts={"w": weights(4, 3, 3, 3), "b": weights(4)})


def _fused_gemm(activation="HardSigmoid"):
    return graph([node("FusedGemm", ["x", "w", "c"], domain=MS, activation=activation, activation_alpha=0.3,
                       activation_beta=0.4, transB=1, alpha=0.5)], {"x": [3, 5]}, {"y": (F32, [3, 4])},
                 consts={"w": weights(4, 5), "c": weights(4)})


def _fused_matmul(**attrs):
    return graph([node("FusedMatMul", ["a", "b"], domain=MS, **attrs)], {"a": [2, 4, 3], "b": [2, 5, 4]},
                 {"y": (F32, [2, 3, 5])})


def _contrib(op, inputs=("x",), consts=None, shapes=None, **attrs):
    """A contrib operator alone; `shapes` may give the inputs as (shape, element type) (an int64 x: not float)."""
    shapes = shapes or {"x": ["n", 3, 8]}
    x = shapes["x"]
    typed = len(x) == 2 and isinstance(x[0], tuple)
    out = (x[1], list(x[0])) if typed else (F32, list(x))
    return graph([node(op, list(inputs), domain=MS, **attrs)], shapes, {"y": out}, consts=consts or {})


def _skip_ln(with_bias=True, opset=17):
    inputs = ["x", "s", "g", "be"] + (["bi"] if with_bias else [])
    return graph([node("SkipLayerNormalization", inputs, domain=MS, epsilon=1e-5)], {"x": ["n", 3, 8], "s": ["n", 3, 8]},
                 {"y": (F32, ["n", 3, 8])}, opset=opset, consts={"g": weights(8), "be": weights(8, seed=1), "bi": weights(8, seed=2)})


def _mha(**attrs):
    return graph([node("MultiHeadAttention", ["q", "k", "v"], domain=MS, num_heads=2, **attrs)],
                 {"q": [2, 5, 8], "k": [2, 6, 8], "v": [2, 6, 8]}, {"y": (F32, [2, 5, 8])})


CASES = {
    "matmul-split-unmerge": (lambda: _split_matmul(), lambda: _split_matmul(axis=1), "not along the last axis"),
    "gemm-split-unmerge": (lambda: _split_gemm(), lambda: _split_gemm(axis=0), "not along the columns"),
    "conv-split-unmerge": (lambda: _split_conv(), lambda: _split_conv(group=2), "grouped"),
    "gemm-reshape-to-matmul": (lambda: _gemm_reshaped(), lambda: _gemm_reshaped(bias_rows=6),
                               "C is not a constant row vector"),
    "fused-conv-unfuse": (lambda: _fused_conv(), lambda: _fused_conv("Softplus", ()), "has no standard form"),
    "fused-gemm-unfuse": (lambda: _fused_gemm(), lambda: _fused_gemm("Elu"), "has no standard form"),
    "fused-matmul-unfuse": (lambda: _fused_matmul(transA=1, transB=1, alpha=0.5),
                            lambda: _fused_matmul(transA=1, transBatchA=1), "transBatchA/transBatchB"),
    "gelu-unfuse": (lambda: _contrib("Gelu"), lambda: _contrib("Gelu", shapes={"x": [("n", 8), 7]}),
                    "not a float operator"),
    "fast-gelu-unfuse": (lambda: _contrib("FastGelu", ["x", "b"], {"b": weights(8)}),
                         lambda: _contrib("FastGelu", shapes={"x": [("n", 8), 7]}), "not a float operator"),
    "bias-gelu-unfuse": (lambda: _contrib("BiasGelu", ["x", "b"], {"b": weights(8)}),
                         lambda: _contrib("BiasGelu", ["x", "b"], shapes={"x": [("n", 8), 7], "b": [(8,), 7]}),
                         "not a float operator"),
    "skip-layernorm-unfuse": (lambda: _skip_ln(), lambda: _skip_ln(opset=16), "needs opset 17"),
    "attention-unfuse": (lambda: _mha(scale=0.3), lambda: _mha(unidirectional=1), "is causal"),
}


test_matches_and_keeps_numbers, test_refuses_with_reason = case_tests(CASES)


@pytest.mark.parametrize("bias", [True, False])
def test_matmul_merge_and_unmerge_round_trip(bias):
    g = graph([node("MatMul", ["x", "w1"], "a"), node("MatMul", ["x", "w2"], "b"), node("Add", ["a", "c"], "p"),
               node("Relu", ["b"], "q")], {"x": ["n", 4]}, ("p", "q"), consts={"w1": weights(4, 3), "w2": weights(4, 5),
                                                                            "c": weights(3)})
    merged = assert_rewrites(g, "matmul-merge-siblings")
    assert assert_rewrites(merged, "matmul-split-unmerge").op_counts()["MatMul"] == 2
    if bias:
        assert assert_rewrites(_split_matmul(), "matmul-split-unmerge").op_counts() == {"Add": 2, "MatMul": 2}


@pytest.mark.parametrize("fusion,inverse,build", [
    ("conv-activation-fusion", "fused-conv-unfuse",
     lambda: graph([node("Conv", ["x", "w"], "c"), node("Clip", ["c", "lo", "hi"])], {"x": [1, 3, 5, 5]},
                   consts={"w": weights(4, 3, 3, 3), "lo": np.array(-0.5, np.float32), "hi": np.array(0.5, np.float32)})),
    ("gemm-activation-fusion", "fused-gemm-unfuse",
     lambda: graph([node("Gemm", ["x", "w"], "c"), node("LeakyRelu", ["c"], alpha=0.1)], {"x": [3, 5]},
                   consts={"w": weights(5, 4)})),
    ("matmul-transpose-fusion", "fused-matmul-unfuse",
     lambda: graph([node("Transpose", ["k"], "kt", perm=[0, 2, 1]), node("MatMul", ["q", "kt"])],
                   {"q": [2, 3, 4], "k": [2, 5, 4]})),
    ("skip-layernorm-fusion", "skip-layernorm-unfuse",
     lambda: graph([node("Add", ["x", "z"], "s"), node("LayerNormalization", ["s", "g", "b"], epsilon=1e-3)],
                   {"x": [2, 4, 8], "z": [2, 4, 8]}, opset=17, consts={"g": weights(8), "b": weights(8, seed=1)})),
])
def test_fusions_undo(fusion, inverse, build):
    g = build()
    fused = assert_rewrites(g, fusion)
    unfused = assert_rewrites(fused, inverse)
    assert unfused.op_counts() == g.op_counts() or fusion == "matmul-transpose-fusion"
    assert rule(fusion).find(unfused), f"{fusion} does not find what {inverse} wrote"


@pytest.mark.parametrize("name", ["gelu-fusion", "fast-gelu-fusion"])
def test_gelu_unfused_form_fuses_again(name):
    op = "Gelu" if name == "gelu-fusion" else "FastGelu"
    unfused = assert_rewrites(_contrib(op), f"{'gelu' if op == 'Gelu' else 'fast-gelu'}-unfuse")
    again = assert_rewrites(unfused, name)
    assert again.op_counts() == {op: 1}


def test_bias_gelu_round_trip():
    g = _contrib("BiasGelu", ["x", "b"], {"b": weights(8)})
    unfused = assert_rewrites(g, "bias-gelu-unfuse")
    assert unfused.op_counts() == {"Add": 1, "Gelu": 1}
    assert apply(unfused, rule("bias-gelu-fusion").find(unfused)[0]).op_counts() == {"BiasGelu": 1}
