"""Exact FLOP and parameter counts on small hand-made graphs."""

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from rlflow.graph.flops import count_bytes_read, count_flops, count_params, flops_by_op


def _model(nodes, inputs, outputs, initializers=()):
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, s) for n, s in inputs],
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in outputs],
        initializer=[numpy_helper.from_array(np.zeros(s, np.float32), n) for n, s in initializers],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10)


def test_conv_with_bias():
    # 1x3x8x8 -> 4 output channels, 3x3, pad 1: Y is 1x4x8x8 = 256 elements, 27 MACs each, + 1 bias add each.
    m = _model(
        [helper.make_node("Conv", ["x", "w", "b"], ["y"], kernel_shape=[3, 3], pads=[1, 1, 1, 1])],
        [("x", [1, 3, 8, 8])],
        ["y"],
        [("w", [4, 3, 3, 3]), ("b", [4])],
    )
    assert count_flops(m) == 2 * 256 * 27 + 256
    assert count_params(m) == 4 * 3 * 3 * 3 + 4


def test_grouped_strided_conv_without_bias():
    # 8 -> 8 channels in 4 groups (2 input channels per group), 3x3, stride 2, no pad: 1x8x3x3 = 72 outputs.
    m = _model(
        [helper.make_node("Conv", ["x", "w"], ["y"], kernel_shape=[3, 3], strides=[2, 2], group=4)],
        [("x", [1, 8, 7, 7])],
        ["y"],
        [("w", [8, 2, 3, 3])],
    )
    assert count_flops(m) == 2 * 72 * 2 * 3 * 3
    assert count_params(m) == 8 * 2 * 3 * 3


def test_depthwise_conv():
    m = _model(
        [helper.make_node("Conv", ["x", "w"], ["y"], kernel_shape=[3, 3], pads=[1, 1, 1, 1], group=16)],
        [("x", [1, 16, 5, 5])],
        ["y"],
        [("w", [16, 1, 3, 3])],
    )
    assert count_flops(m) == 2 * (16 * 25) * 9


def test_batched_matmul():
    # [2, 3, 4] @ [4, 5] -> [2, 3, 5]: 30 outputs, K = 4.
    m = _model([helper.make_node("MatMul", ["a", "b"], ["y"])], [("a", [2, 3, 4])], ["y"], [("b", [4, 5])])
    assert count_flops(m) == 2 * 30 * 4
    assert count_params(m) == 20


def test_gemm_trans_b_with_bias():
    # A [2, 6], B [3, 6] transposed -> Y [2, 3]; K = 6; C adds 1 per output.
    m = _model(
        [helper.make_node("Gemm", ["a", "b", "c"], ["y"], transB=1)],
        [("a", [2, 6])],
        ["y"],
        [("b", [3, 6]), ("c", [3])],
    )
    assert count_flops(m) == 2 * 6 * 6 + 6


def test_gemm_trans_a_without_bias():
    m = _model([helper.make_node("Gemm", ["a", "b"], ["y"], transA=1)], [("a", [6, 2])], ["y"], [("b", [6, 3])])
    assert count_flops(m) == 2 * 6 * 6


def test_elementwise_pool_norm_and_data_movement():
    nodes = [
        helper.make_node("Relu", ["x"], ["r"]),  # 1*4*4*4 = 64
        helper.make_node("MaxPool", ["r"], ["p"], kernel_shape=[2, 2], strides=[2, 2]),  # 1*4*2*2 = 16
        helper.make_node("BatchNormalization", ["p", "s", "bb", "mu", "var"], ["n"]),  # 16
        helper.make_node("Reshape", ["n", "shape"], ["f"]),  # 0
        helper.make_node("Softmax", ["f"], ["y"], axis=-1),  # 16
    ]
    m = _model(nodes, [("x", [1, 4, 4, 4])], ["y"], [("s", [4]), ("bb", [4]), ("mu", [4]), ("var", [4])])
    m.graph.initializer.append(numpy_helper.from_array(np.array([1, 16], np.int64), "shape"))
    assert flops_by_op(m) == {"Relu": 64, "MaxPool": 16, "BatchNormalization": 16, "Softmax": 16}
    assert count_flops(m) == 112
    assert count_params(m) == 16  # the int64 shape tensor is not a parameter


def test_constant_nodes_count_as_params():
    const = helper.make_node("Constant", [], ["k"], value=numpy_helper.from_array(np.ones((2, 3), np.float32)))
    ints = helper.make_node("Constant", [], ["i"], value=numpy_helper.from_array(np.ones(5, np.int64)))
    m = _model([const, ints, helper.make_node("Mul", ["x", "k"], ["y"])], [("x", [2, 3])], ["y"])
    assert count_params(m) == 6
    assert count_flops(m) == 6


def test_unknown_ops_count_zero():
    m = _model([helper.make_node("Einsum", ["a", "b"], ["y"], equation="ij,jk->ik")], [("a", [2, 3])], ["y"], [("b", [3, 4])])
    assert count_flops(m) == 0


@pytest.mark.parametrize("bias", [True, False])
def test_conv_transpose(bias):
    # X 1x4x3x3, W [4, 2, 2, 2] stride 2 -> Y 1x2x6x6; each input element does C_out * 2 * 2 = 8 MACs.
    inputs = ["x", "w", "b"] if bias else ["x", "w"]
    inits = [("w", [4, 2, 2, 2])] + ([("b", [2])] if bias else [])
    m = _model([helper.make_node("ConvTranspose", inputs, ["y"], strides=[2, 2])], [("x", [1, 4, 3, 3])], ["y"], inits)
    assert count_flops(m) == 2 * 36 * 8 + (72 if bias else 0)


def test_large_weights_do_not_need_copying():
    # Shape inference runs on a weight-free copy; the counts must not depend on it.
    m = _model([helper.make_node("MatMul", ["a", "b"], ["y"])], [("a", [1, 512])], ["y"], [("b", [512, 1024])])
    before = m.SerializeToString()
    assert count_flops(m) == 2 * 1024 * 512
    assert m.SerializeToString() == before


def test_bytes_read_counts_weights_constants_and_inputs_a_cache_included():
    # a decode-step-like graph: a float16 cache input (1, 2, 7, 4) at its deployed length, a float32 weight, an int64
    # constant; the weight listed as an input too (IR < 4 style) is counted once
    cache = helper.make_tensor_value_info("past", TensorProto.FLOAT16, [1, 2, 7, 4])
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 8])
    weight = numpy_helper.from_array(np.zeros((8, 3), np.float32), "w")
    shape = helper.make_node("Constant", [], ["s"], value=numpy_helper.from_array(np.array([1, 56], np.int64)))
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"]), shape, helper.make_node("Reshape", ["past", "s"], ["flat"])],
        "g", [x, cache, helper.make_tensor_value_info("w", TensorProto.FLOAT, [8, 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None),
         helper.make_tensor_value_info("flat", TensorProto.FLOAT16, None)], initializer=[weight])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10)
    assert count_bytes_read(model) == 8 * 3 * 4 + 2 * 8 + 1 * 8 * 4 + 1 * 2 * 7 * 4 * 2


def test_bytes_read_counts_a_looked_up_table_by_the_rows_read():
    """An embedding only gathered from reads one row per token; the same table also multiplied (tied to an LM head)
    is read whole; a rotary embedding's cos/sin caches are read one row per position."""
    ids = helper.make_tensor_value_info("ids", TensorProto.INT64, [1, 3])
    pos = helper.make_tensor_value_info("pos", TensorProto.INT64, [1, 3])
    table = numpy_helper.from_array(np.zeros((100, 8), np.float32), "table")
    cos, sin = (numpy_helper.from_array(np.zeros((1000, 2), np.float32), n) for n in ("cos", "sin"))
    rotary = helper.make_node("RotaryEmbedding", ["e4", "pos", "cos", "sin"], ["r"], domain="com.microsoft")
    nodes = [helper.make_node("Gather", ["table", "ids"], ["e"]),
             helper.make_node("Reshape", ["e", "shape"], ["e4"]), rotary]
    shape = numpy_helper.from_array(np.array([1, 1, 3, 8], np.int64), "shape")

    def model(extra=()):
        graph = helper.make_graph(nodes + list(extra), "g", [ids, pos],
                                  [helper.make_tensor_value_info("r", TensorProto.FLOAT, None)],
                                  initializer=[table, cos, sin, shape])
        return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                       helper.make_opsetid("com.microsoft", 1)], ir_version=10)

    inputs, rows = 2 * 3 * 8, 3 * 8 * 4 + 2 * 3 * 2 * 4 + 4 * 8
    assert count_bytes_read(model()) == inputs + rows
    tied = model([helper.make_node("MatMul", ["r", "table_t"], ["logits"]),
                  helper.make_node("Transpose", ["table"], ["table_t"])])
    assert count_bytes_read(tied) == inputs + 100 * 8 * 4 + 2 * 3 * 2 * 4 + 4 * 8


def test_bytes_read_counts_an_embedding_norms_tables_by_the_rows_read():
    """EmbedLayerNormalization looks its word and position tables up by the tokens (as many positions as tokens), as
    the Gathers it replaces did: fusing them must not make a model read its whole vocabulary."""
    ids = helper.make_tensor_value_info("ids", TensorProto.INT32, [1, 4])
    words, positions = (numpy_helper.from_array(np.zeros((n, 8), np.float32), name)
                        for n, name in ((1000, "words"), (512, "positions")))
    gamma, beta = (numpy_helper.from_array(np.ones(8, np.float32), name) for name in ("gamma", "beta"))
    node = helper.make_node("EmbedLayerNormalization", ["ids", "", "words", "positions", "", "gamma", "beta"],
                            ["out", "mask_index"], domain="com.microsoft", epsilon=1e-12)
    graph = helper.make_graph([node], "g", [ids], [helper.make_tensor_value_info("out", TensorProto.FLOAT, None)],
                              initializer=[words, positions, gamma, beta])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                    helper.make_opsetid("com.microsoft", 1)], ir_version=10)
    assert count_bytes_read(model) == 4 * 4 + 2 * 4 * 8 * 4 + 2 * 8 * 4
