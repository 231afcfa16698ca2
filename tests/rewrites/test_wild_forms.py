"""Forms written by other hands that the fusions take (issue #78): each with positive cases at several shapes
(verified by onnxruntime), refusals with their reasons."""
from __future__ import annotations

import math

import numpy as np
import pytest
from onnx import TensorProto, numpy_helper

from rlflow.rewrites import rule
from tests.rewrites.helpers import F32, assert_refuses, assert_rewrites, case_tests, graph, node, weights
from tests.rewrites.test_fusion import _embeddings


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


def _quick_gelu(shape=(2, 5), alpha=1.702, order=("x", "sg")):
    """CLIP's `x * sigmoid(1.702 * x)`; alpha None writes SiLU, `x * sigmoid(x)`."""
    scaled = [node("Mul", ["a", "x"], "ax")] if alpha is not None else []
    return graph([*scaled, node("Sigmoid", ["ax" if alpha is not None else "x"], "sg"), node("Mul", list(order))],
                 {"x": list(shape)}, consts={"a": np.array(alpha or 1.0, np.float32)} if alpha is not None else None)


def _quick_gelu_of_another_tensor():
    return graph([node("Mul", ["a", "z"], "az"), node("Sigmoid", ["az"], "sg"), node("Mul", ["x", "sg"])],
                 {"x": [2, 5], "z": [2, 5]}, consts={"a": np.array(1.702, np.float32)})


def _contrib_quick_gelu(shape, dtype):
    return graph([node("QuickGelu", ["x"], domain="com.microsoft", alpha=1.702)], {"x": (shape, dtype)},
                 {"y": (dtype, list(shape))})


CASES = {
    "quick-gelu-fusion": (lambda: _quick_gelu(), _quick_gelu_of_another_tensor, "is not the x read before"),
    "quick-gelu-unfuse": (lambda: _contrib_quick_gelu(("n", 3, 8), F32),
                          lambda: _contrib_quick_gelu((4, 8), TensorProto.INT64), "not a float operator"),
}
test_matches_and_keeps_numbers, test_refuses_with_reason = case_tests(CASES)


@pytest.mark.parametrize("shape,alpha,order", [((2, 5), 1.702, ("x", "sg")), ((3, 4, 8), 1.702, ("sg", "x")),
                                               (("b", 16), None, ("x", "sg")), ((1, 7, 32), None, ("sg", "x"))])
def test_quick_gelu_fusion_at_several_shapes_and_both_forms(shape, alpha, order):
    new = assert_rewrites(_quick_gelu(shape, alpha, order), "quick-gelu-fusion", count=1)
    assert new.op_counts() == {"QuickGelu": 1}
    assert new.gs.nodes[0].attrs["alpha"] == pytest.approx(alpha or 1.0)


def test_quick_gelu_unfuse_gives_back_what_the_fusion_takes():
    fused = assert_rewrites(_quick_gelu(), "quick-gelu-fusion")
    unfused = assert_rewrites(fused, "quick-gelu-unfuse")
    assert rule("quick-gelu-fusion").find(unfused)


@pytest.mark.parametrize("lookups", [2, 3])
def test_embed_layernorm_keeps_a_sum_that_is_a_graph_output(lookups):
    """The embeddings' sum returned as an output beside the norm (issue #78): the third output writes it, by name."""
    g = _embeddings(lookups)
    total = "s3" if lookups == 3 else "s2"
    proto = g.to_model()
    g = graph(list(proto.graph.node), {"ids": (["batch", 5], TensorProto.INT64), "pos": ([1, 5], TensorProto.INT64),
                                       **({"seg": (["batch", 5], TensorProto.INT64)} if lookups == 3 else {})},
              outputs=("y", total), opset=17, consts={t.name: numpy_helper.to_array(t) for t in proto.graph.initializer})
    new = assert_rewrites(g, "embed-layernorm-fusion")
    fused = next(n for n in new.gs.nodes if n.op == "EmbedLayerNormalization")
    assert fused.outputs[2].name == total and [t.name for t in new.gs.outputs] == ["y", total]


@pytest.mark.parametrize("mask", [False, True])
def test_attention_fusion_sees_through_gpt2s_cast_of_the_probabilities(mask):
    """Hugging Face's eager GPT-2 casts the Softmax to the values' type, a no-op in float32 (issue #78)."""
    from tests.rewrites.test_fusion import attention

    new = assert_rewrites(attention(mask=mask, cast=True), "attention-fusion", count=1)
    assert new.op_counts()["MultiHeadAttention"] == 1 and "Cast" not in new.op_counts()



@pytest.mark.parametrize("batch", [2, "batch"])
def test_attention_fusion_takes_the_classic_key_padding_mask(batch):
    """Older BERT exports add `(1 - mask) * -10000` as [B, 1, 1, T] (issue #78): the fused attention reads it
    expanded to every query row, at any batch and length."""
    from tests.rewrites.test_fusion import attention

    g = attention(mask=True, mask_shape=(1, 1, 1, 5), dynamic=batch == "batch")
    new = assert_rewrites(g, "attention-fusion", count=1)
    assert new.op_counts()["MultiHeadAttention"] == 1 and new.op_counts()["Expand"] == 1


def test_attention_fusion_refuses_a_mask_that_broadcasts_over_the_keys():
    from tests.rewrites.test_fusion import attention

    assert_refuses(attention(mask=True, mask_shape=(1, 1, 5, 1)), "attention-fusion",
                   "the mask added to the scores is not float32 [B or 1, H or 1, S or 1, T]")
