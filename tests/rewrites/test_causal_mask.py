"""Attention with a fixed causal mask written as `Where(C, fill, scores)` (a model that `masked_fill`s a constant
triangle, as the zoo's GPT-2 does): `attention-fusion` takes the mask as the additive bias it is equivalent to."""
from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs
import pytest
from onnx import TensorProto, helper, numpy_helper

from rlflow import load, zoo
from rlflow.graph.core import Graph
from rlflow.rewrites import rule
from rlflow.rewrites.fusions.attention.encoder import _where_mask
from tests.conftest import tiny_model

from .helpers import assert_rewrites


@pytest.fixture(scope="module")
def gpt2_tiny(tmp_path_factory):
    return load(zoo.build("gpt2-small-tiny", tmp_path_factory.mktemp("zoo")).path)


def test_the_zoo_gpt2s_causal_attention_fuses_with_its_mask_as_a_bias(gpt2_tiny):
    matches = rule("attention-fusion").find(gpt2_tiny)
    assert len(matches) == 2 and all(m.param("masked") for m in matches)  # one per layer
    fused = assert_rewrites(gpt2_tiny, "attention-fusion", count=2)
    (mha,) = [n for n in fused.gs.nodes if n.op == "MultiHeadAttention"]
    bias = mha.inputs[5]
    length = gpt2_tiny.input_shapes["input_ids"][1]
    assert isinstance(bias, gs.Constant) and bias.values.shape == (1, 1, length, length)
    assert (bias.values[0, 0][np.triu_indices(length, 1)] <= -1e9).all()  # the future is masked
    assert (bias.values[0, 0][np.tril_indices(length)] == 0).all()


def _where(condition: np.ndarray, fill: float, scores_second: bool = True) -> Graph:
    """One `Where` between a constant condition, a constant fill and scores from the input."""
    shape = list(condition.shape)
    inputs = ["c", "fill", "x"] if scores_second else ["c", "x", "fill"]
    model = tiny_model([helper.make_node("Where", inputs, ["y"])],
                       [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)],
                       [helper.make_tensor_value_info("y", TensorProto.FLOAT, shape)],
                       [numpy_helper.from_array(condition, "c"), numpy_helper.from_array(np.float32(fill), "fill")])
    return Graph.from_model(model)


@pytest.mark.parametrize("scores_second", [True, False])
def test_a_where_mask_is_the_bias_that_gives_the_same_probabilities(scores_second):
    future = np.triu(np.ones((4, 4), bool), 1)
    condition = future if scores_second else ~future  # Where(C, fill, x) masks C; Where(C, x, fill) masks ~C
    graph = _where(condition, np.finfo(np.float32).min, scores_second)
    scores, bias = _where_mask(graph.gs.nodes[0])
    assert scores.name == "x"
    assert np.array_equal(bias == 0, ~future) and (bias[future] <= -1e9).all()


def test_a_where_mask_is_refused_where_a_bias_would_differ():
    future = np.triu(np.ones((4, 4), bool), 1)
    near = _where(future, -100.0)  # a fill a large score could outweigh
    assert _where_mask(near.gs.nodes[0]) is None
    blank_row = future.copy()
    blank_row[0, 0] = True  # every key of the first query masked: Where gives equal scores there, a bias would not
    blank = _where(blank_row, -1e30)
    assert _where_mask(blank.gs.nodes[0]) is None
