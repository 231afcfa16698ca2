"""Graph -> arrays: node and edge features, FLOPs per node, caps and candidate ordering."""
from __future__ import annotations

import math

import numpy as np
from onnx import TensorProto, helper, numpy_helper

from rlflow.env.features import (
    EDGE_FEATURES,
    MAX_TOUCHED,
    NODE_FEATURES,
    OP_INDEX,
    candidate_arrays,
    graph_arrays,
    node_flops,
    order_candidates,
)
from rlflow.graph.core import Graph
from rlflow.graph.flops import count_flops
from rlflow.rewrites import Match


def conv_gemm_graph() -> Graph:
    """Conv(3->4, 3x3, bias) -> Relu -> Flatten -> Gemm(256->10) on a 1x3x8x8 input."""
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.standard_normal(shape).astype(np.float32), name)
             for name, shape in (("W", (4, 3, 3, 3)), ("B", (4,)), ("G", (256, 10)), ("C", (10,)))]
    nodes = [
        helper.make_node("Conv", ["x", "W", "B"], ["c"], pads=[1, 1, 1, 1], name="conv"),
        helper.make_node("Relu", ["c"], ["r"], name="relu"),
        helper.make_node("Flatten", ["r"], ["f"], name="flatten"),
        helper.make_node("Gemm", ["f", "G", "C"], ["y"], name="gemm"),
    ]
    graph = helper.make_graph(nodes, "conv-gemm", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 8, 8])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 10])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    return Graph.from_model(model)


def test_node_arrays():
    graph = conv_gemm_graph()
    costs = {"conv": 0.003, "gemm": 0.001}
    arrays = graph_arrays(graph, costs, max_nodes=6, max_edges=5)
    assert arrays.node_mask.tolist() == [1, 1, 1, 1, 0, 0] and arrays.n_nodes == 4
    assert arrays.node_op[:4].tolist() == [OP_INDEX[op] for op in ("Conv", "Relu", "Flatten", "Gemm")]
    assert arrays.node_features.shape == (6, len(NODE_FEATURES)) and arrays.node_features.dtype == np.float32
    col = {name: i for i, name in enumerate(NODE_FEATURES)}
    conv = arrays.node_features[0]
    assert conv[col["log_out_elements"]] == np.float32(math.log1p(4 * 8 * 8))
    assert conv[col["out_rank"]] == 4
    assert conv[col["log_cost_us"]] == np.float32(math.log1p(3.0))
    assert conv[col["cost_share"]] == np.float32(0.75)
    assert conv[col["n_const_inputs"]] == 2
    assert arrays.node_features[3][col["is_graph_output"]] == 1
    assert not arrays.node_features[4:].any()


def test_edges_follow_tensors_from_producer_to_consumer():
    arrays = graph_arrays(conv_gemm_graph(), None, max_nodes=4, max_edges=5)
    assert arrays.edge_mask.tolist() == [1, 1, 1, 0, 0]
    assert arrays.edge_index[:3].tolist() == [[0, 1], [1, 2], [2, 3]]
    col = {name: i for i, name in enumerate(EDGE_FEATURES)}
    flatten_out = arrays.edge_features[2]
    assert flatten_out[col["rank"]] == 2 and flatten_out[col["log_d1"]] == np.float32(math.log1p(256))


def test_node_cap_drops_later_nodes_and_their_edges():
    arrays = graph_arrays(conv_gemm_graph(), None, max_nodes=2, max_edges=4)
    assert arrays.node_mask.tolist() == [1, 1] and set(arrays.index) == {"conv", "relu"}
    assert arrays.edge_mask.tolist() == [1, 0, 0, 0]


def test_node_flops_sum_to_the_whole_graph_count():
    graph = conv_gemm_graph()
    per_node = {n.name: node_flops(graph, n) for n in graph.gs.nodes}
    assert per_node["conv"] == 2 * 4 * 8 * 8 * 27 + 4 * 8 * 8
    assert per_node["gemm"] == 2 * 10 * 256 + 10
    assert per_node["flatten"] == 0 and per_node["relu"] == 256
    assert sum(per_node.values()) == count_flops(graph.to_model(static=True))


def test_candidates_interleave_rules_when_capped():
    matches = [Match("a", (f"n{i}",)) for i in range(3)] + [Match("b", ("n9",)), Match("c", ("n1", "n2"))]
    ordered = order_candidates(matches, {"a": 0, "b": 1, "c": 2}, cap=4)
    assert [(m.rule, m.root) for m in ordered] == [("a", "n0"), ("b", "n9"), ("c", "n1"), ("a", "n1")]


def test_candidate_arrays():
    matches = [Match("b", ("n1", "n0", "gone", "n2", "n3")), Match("a", ("n2",))]
    rules, touched, mask = candidate_arrays(matches, {"n0": 0, "n1": 1, "n2": 2, "n3": 3}, {"a": 0, "b": 1},
                                            max_candidates=3)
    assert rules.tolist() == [1, 0, 0] and mask.tolist() == [1, 1, 0]
    assert touched.shape == (3, MAX_TOUCHED)
    assert touched.tolist() == [[1, 0, -1, 2], [2, -1, -1, -1], [-1, -1, -1, -1]]


def test_an_agent_observes_every_node_of_a_graph_past_the_default_cap():
    """A 30-layer decoder has about 2,400 nodes: the agent search's environment is sized to the graph, not truncated."""
    import onnx
    from onnx import TensorProto, helper

    from rlflow.env.features import MAX_NODES, observation_caps
    from rlflow.env.rewrite_env import RewriteEnv
    from rlflow.graph.core import Graph

    count = MAX_NODES + 300
    nodes = [helper.make_node("Relu", [f"t{i}"], [f"t{i + 1}"], name=f"relu{i}") for i in range(count)]
    graph = helper.make_graph(nodes, "chain", [helper.make_tensor_value_info("t0", TensorProto.FLOAT, [1, 4])],
                              [helper.make_tensor_value_info(f"t{count}", TensorProto.FLOAT, [1, 4])])
    model = Graph.from_model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10))
    caps = observation_caps(model)
    assert caps["max_nodes"] >= count and observation_caps(Graph.from_model(onnx.load_from_string(
        helper.make_model(helper.make_graph(nodes[:3], "short", graph.input, [helper.make_tensor_value_info(
            "t3", TensorProto.FLOAT, [1, 4])]), opset_imports=[helper.make_opsetid("", 17)],
            ir_version=10).SerializeToString())))["max_nodes"] == MAX_NODES
    obs, _ = RewriteEnv(model, **caps).reset()
    assert int(obs["node_mask"].sum()) == count
    obs, _ = RewriteEnv(model).reset()
    assert int(obs["node_mask"].sum()) == MAX_NODES  # the default cap drops the rest
