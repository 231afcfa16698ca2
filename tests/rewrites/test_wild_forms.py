"""Forms written by other hands that the fusions take (issue #78): each with positive cases at several shapes
(verified by onnxruntime), refusals with their reasons."""
from __future__ import annotations

import math

import numpy as np
import pytest

from rlflow.rewrites import rule
from tests.rewrites.helpers import assert_refuses, assert_rewrites, graph, node, weights


def _factored_fast_gelu(x_shape, k=0.044715):
    """0.5 * x * (1 + tanh(x * sqrt(2/pi) * (1 + 0.044715 * x * x))), as Megatron and `gelu_fast` write it."""
    nodes = [node("Mul", ["x", "x"], "xx"), node("Mul", ["k", "xx"], "kxx"), node("Add", ["one", "kxx"], "b"),
             node("Mul", ["x", "s"], "xs"), node("Mul", ["xs", "b"], "t"), node("Tanh", ["t"], "e"),
             node("Add", ["e", "one"], "a"), node("Mul", ["x", "half"], "h"), node("Mul", ["h", "a"])]
    consts = {"k": np.array(k, np.float32), "one": np.array(1.0, np.float32),
              "s": np.array(math.sqrt(2 / math.pi), np.float32), "half": np.array(0.5, np.float32)}
    return graph(nodes, {"x": x_shape}, consts=consts)


@pytest.mark.parametrize("shape", [[2, 5], [3, 4, 8], ["b", 16]])
def test_fast_gelu_fusion_takes_the_factored_form(shape):
    new = assert_rewrites(_factored_fast_gelu(shape), "fast-gelu-fusion", count=1)
    assert new.op_counts() == {"FastGelu": 1}


def test_fast_gelu_fusion_refuses_a_factored_form_with_another_coefficient():
    assert_refuses(_factored_fast_gelu([2, 5], k=0.05), "fast-gelu-fusion",
                   "the Tanh argument is not the expected function of x")


def _rsqrt_layernorm(shape, twice=True, eps_name="eps", opset=17):
    """Cohere's bias-free LayerNorm: `w * ((x - mean) * rsqrt(mean((x - mean)^2) + eps))`, the centred input computed
    twice (`twice`) as its TorchScript export writes it, or once."""
    centred_again = [node("Sub", ["x", "m"], "d2")] if twice else []
    nodes = [node("ReduceMean", ["x"], "m", axes=[-1]), node("Sub", ["x", "m"], "d"), *centred_again,
             node("Pow", ["d2" if twice else "d", "two"], "p"), node("ReduceMean", ["p"], "v", axes=[-1]),
             node("Add", ["v", eps_name], "ve"), node("Sqrt", ["ve"], "s"), node("Reciprocal", ["s"], "r"),
             node("Mul", ["d", "r"], "n"), node("Mul", ["w", "n"])]
    consts = {"two": np.array(2.0, np.float32), "eps": np.array(1e-5, np.float32), "w": weights(shape[-1])}
    return graph(nodes, {"x": shape}, consts=consts, opset=opset)


@pytest.mark.parametrize("shape,twice", [([2, 4, 8], True), (["b", 3, 16], True), ([5, 8], False)])
def test_layernorm_fusion_takes_the_bias_free_rsqrt_form(shape, twice):
    new = assert_rewrites(_rsqrt_layernorm(shape, twice), "layernorm-fusion", count=1)
    assert new.op_counts() == {"LayerNormalization": 1}


def test_layernorm_fusion_refuses_a_rsqrt_form_whose_epsilon_is_not_constant():
    g = _rsqrt_layernorm([2, 4, 8])
    proto_nodes = [n for n in g.to_model().graph.node]
    for n in proto_nodes:
        if n.op_type == "Add":
            n.input[:] = ["v", "z"]
    consts = {"two": np.array(2.0, np.float32), "w": weights(8)}
    refused = graph(proto_nodes, {"x": [2, 4, 8], "z": [1]}, consts=consts, opset=17)
    assert not rule("layernorm-fusion").find(refused)
    assert_refuses(refused, "layernorm-fusion", "z is not a constant")


def test_a_bias_free_match_is_not_offered_inside_a_shifted_one():
    g = _rsqrt_layernorm([2, 4, 8])
    proto = g.to_model()
    shifted = [*proto.graph.node]
    shifted[-1].output[:] = ["scaled"]
    consts = {"two": np.array(2.0, np.float32), "eps": np.array(1e-5, np.float32), "w": weights(8),
              "b": weights(8, seed=2)}
    g = graph([*shifted, node("Add", ["scaled", "b"])], {"x": [2, 4, 8]}, consts=consts, opset=17)
    matches = rule("layernorm-fusion").find(g)
    assert len(matches) == 1 and g.node_map()[matches[0].root].op == "Add"
    assert "the shift Add after it roots the match" in [r.reason for r in rule("layernorm-fusion").reasons(g)]
