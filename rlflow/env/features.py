"""Graph -> fixed-size arrays for the graph encoder (the environment's observation).

A graph becomes padded numpy arrays: one row per node (operator id plus numeric features), one row per edge (a tensor
flowing from its producer to one consumer, with its shape), and one row per rewrite candidate (rule id and the
indices of the nodes it touches).  Sizes are capped so that the arrays fit a Gymnasium space:

* Nodes are taken in the graph's topological order; nodes past `max_nodes` are dropped, with the edges that touch them.
  A candidate touching a dropped node keeps index -1 for it (the policy then scores it from its rule and the nodes it
  can see), so a too-large graph still gets a valid, if partial, observation.  Where an agent acts on a model (the
  agent search, `--finetune`), `observation_caps` sizes the caps to the graph, so that nothing is dropped.
* Edges past `max_edges` are dropped (in node order).
* Candidates past `max_candidates` are dropped; `order_candidates` interleaves the rules first, so every rule keeps
  some of its matches when the cap bites.

Numeric features are log-scaled so that tiny and full-size models share one range.  Everything here is deterministic.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping, Sequence

import numpy as np
import onnx_graphsurgeon as gs

from rlflow.graph.core import Graph

OP_TYPES: tuple[str, ...] = (
    "<other>",
    "Conv", "ConvTranspose", "MatMul", "Gemm", "Einsum", "BatchNormalization", "LayerNormalization",
    "InstanceNormalization", "GroupNormalization", "Add", "Sub", "Mul", "Div", "Pow", "Sqrt", "Exp", "Log", "Neg",
    "Reciprocal", "Abs", "Erf", "Max", "Min", "Sum", "Mean", "Relu", "LeakyRelu", "PRelu", "Elu", "Selu", "Clip",
    "Sigmoid", "HardSigmoid", "HardSwish", "Tanh", "Softplus", "Gelu", "Softmax", "LogSoftmax", "MaxPool",
    "AveragePool", "GlobalAveragePool", "GlobalMaxPool", "ReduceMean", "ReduceSum", "ReduceMax", "Reshape",
    "Transpose", "Flatten", "Squeeze", "Unsqueeze", "Concat", "Split", "Slice", "Gather", "GatherElements", "Expand",
    "Tile", "Pad", "Shape", "Size", "ConstantOfShape", "Range", "Cast", "Identity", "Dropout", "Where", "Equal",
    "Less", "Greater", "Not", "And", "Or", "Resize", "Trilu", "CumSum", "ArgMax", "TopK", "LSTM", "GRU", "RNN",
    "FusedConv", "FusedMatMul", "FusedGemm", "Attention", "MultiHeadAttention", "SkipLayerNormalization",
    "BiasGelu", "FastGelu", "QuickGelu", "SimplifiedLayerNormalization", "Constant",
)
"""Operator vocabulary of the encoder: id = index, unknown operators map to 0.  Append only (it is part of the
observation spec; checkpoints record `OBS_VERSION`)."""

OP_INDEX = {op: i for i, op in enumerate(OP_TYPES)}

NODE_FEATURES = ("log_out_elements", "out_rank", "log_flops", "log_cost_us", "cost_share", "n_inputs",
                 "n_const_inputs", "n_outputs", "n_consumers", "is_graph_output")
"""Columns of `node_features` (besides the operator id, which travels separately)."""

EDGE_FEATURES = ("log_elements", "rank", "log_d0", "log_d1", "log_d2", "log_d3")
"""Columns of `edge_features`: the tensor's element count, rank and first four dimensions (log1p)."""

MAX_TOUCHED = 4
"""Nodes per candidate given to the policy: the root and the next three the match consumes."""

OBS_VERSION = 1
"""Bump when what the arrays mean changes; checkpoints refuse another version."""

_ELEMENTWISE = frozenset("""Add Sub Mul Div Pow Neg Abs Reciprocal Sqrt Exp Log Min Max Mean Sum Relu LeakyRelu PRelu
    Elu Selu Celu Gelu Sigmoid HardSigmoid HardSwish Tanh Erf Softplus Softsign Mish Clip Equal Less Greater Not And
    Or Where MaxPool AveragePool GlobalAveragePool GlobalMaxPool BatchNormalization LayerNormalization
    InstanceNormalization GroupNormalization Softmax LogSoftmax ReduceMean ReduceSum ReduceMax ReduceMin""".split())


MAX_NODES = 1024
"""Default cap on nodes per observation (the full-size zoo models have at most ~870)."""

MAX_EDGES = 2048
"""Default cap on edges per observation."""

CAP_HEADROOM = 1.25
"""`observation_caps` leaves room for a graph this much larger than the one it starts from (inverse rules add nodes)."""


def observation_caps(graph: Graph) -> dict[str, int]:
    """`max_nodes` and `max_edges` for an environment that plays on `graph`: the defaults, or the graph's own size with
    headroom where it is larger, so that an agent acting on it observes every node (a 30-layer decoder has about 2,400;
    past the cap, nodes would be dropped from the observation).  The agents' networks take any number of nodes; the
    caps only pad the arrays."""
    nodes = len(graph.gs.nodes)
    edges = sum(len(node.inputs) for node in graph.gs.nodes)
    return {"max_nodes": max(MAX_NODES, int(CAP_HEADROOM * nodes)), "max_edges": max(MAX_EDGES, int(CAP_HEADROOM * edges))}


@dataclass
class GraphArrays:
    """One graph as padded arrays (see the module docstring for the caps).

    Attributes:
        node_op: (N,) int64 operator ids (`OP_TYPES`), 0 on padding.
        node_features: (N, len(NODE_FEATURES)) float32.
        node_mask: (N,) int8, 1 for real nodes.
        edge_index: (E, 2) int64 (producer, consumer) node indices, 0 on padding.
        edge_features: (E, len(EDGE_FEATURES)) float32.
        edge_mask: (E,) int8.
        index: node name -> row, for the nodes kept.
        n_nodes: nodes in the graph (before the cap).
    """

    node_op: np.ndarray
    node_features: np.ndarray
    node_mask: np.ndarray
    edge_index: np.ndarray
    edge_features: np.ndarray
    edge_mask: np.ndarray
    index: dict[str, int]
    n_nodes: int


def _elements(shape: Sequence[int] | None) -> int:
    return int(math.prod(shape)) if shape is not None else 0


def node_flops(graph: Graph, node: gs.Node) -> int:
    """FLOPs of one node with the conventions of `rlflow.graph.flops` (2 x MACs for contractions, 1 per output
    element for elementwise, pooling, normalisation and reductions, 0 for data movement)."""
    out = graph.shape(node.outputs[0]) if node.outputs else None
    if out is None:
        return 0
    op = node.op
    if op in _ELEMENTWISE:
        return _elements(out)

    def shape_of(i: int):
        if len(node.inputs) <= i or node.inputs[i] is None or not node.inputs[i].name:
            return None
        return graph.shape(node.inputs[i])

    has = lambda i: len(node.inputs) > i and bool(node.inputs[i].name)  # noqa: E731
    if op in ("Conv", "FusedConv"):
        w = shape_of(1)
        if w is None or len(w) < 2:
            return 0
        return 2 * _elements(out) * math.prod(w[1:]) + (_elements(out) if has(2) else 0)
    if op == "ConvTranspose":
        x, w = shape_of(0), shape_of(1)
        if x is None or w is None or len(w) < 2:
            return 0
        return 2 * _elements(x) * math.prod(w[1:]) + (_elements(out) if has(2) else 0)
    if op in ("MatMul", "FusedMatMul"):
        a = shape_of(0)
        return 2 * _elements(out) * a[-1] if a else 0
    if op in ("Gemm", "FusedGemm"):
        a = shape_of(0)
        if a is None or len(a) != 2:
            return 0
        k = a[0] if node.attrs.get("transA", 0) else a[1]
        return 2 * _elements(out) * k + (_elements(out) if has(2) else 0)
    return 0


def graph_arrays(graph: Graph, node_costs: Mapping[str, float] | None = None, *, max_nodes: int,
                 max_edges: int) -> GraphArrays:
    """The node and edge arrays of `graph`.

    Args:
        node_costs: node name -> estimated ms (a cost model's `node_costs`); missing names count 0.
        max_nodes, max_edges: padding sizes (see the module docstring for what is dropped beyond them).
    """
    nodes = list(graph.gs.nodes)
    kept = nodes[:max_nodes]
    index = {n.name: i for i, n in enumerate(kept)}
    node_costs = node_costs or {}
    total_cost = sum(node_costs.values()) or 1.0
    outputs = {id(t) for t in graph.gs.outputs}

    node_op = np.zeros(max_nodes, np.int64)
    feats = np.zeros((max_nodes, len(NODE_FEATURES)), np.float32)
    mask = np.zeros(max_nodes, np.int8)
    edge_index = np.zeros((max_edges, 2), np.int64)
    edge_feats = np.zeros((max_edges, len(EDGE_FEATURES)), np.float32)
    edge_mask = np.zeros(max_edges, np.int8)
    node_ids = {id(n): i for i, n in enumerate(kept)}
    n_edges = 0
    for i, node in enumerate(kept):
        out_shape = graph.shape(node.outputs[0]) if node.outputs else None
        cost = float(node_costs.get(node.name, 0.0))
        consumers = sum(len(t.outputs) for t in node.outputs)
        feats[i] = (
            math.log1p(_elements(out_shape)),
            len(out_shape) if out_shape is not None else 0,
            math.log1p(node_flops(graph, node)),
            math.log1p(1000.0 * cost),
            cost / total_cost,
            len(node.inputs),
            sum(isinstance(t, gs.Constant) for t in node.inputs),
            len(node.outputs),
            math.log1p(consumers),
            float(any(id(t) in outputs for t in node.outputs)),
        )
        node_op[i] = OP_INDEX.get(node.op, 0)
        mask[i] = 1
        for tensor in node.outputs:
            shape = graph.shape(tensor)
            dims = [math.log1p(d) for d in (shape or ())[:4]]
            rank = len(shape) if shape is not None else 0
            row = (math.log1p(_elements(shape)), rank, *dims, *[0.0] * (4 - len(dims)))
            for consumer in tensor.outputs:
                j = node_ids.get(id(consumer))
                if j is None or n_edges >= max_edges:
                    continue
                edge_index[n_edges] = (i, j)
                edge_feats[n_edges] = row
                edge_mask[n_edges] = 1
                n_edges += 1
    return GraphArrays(node_op, feats, mask, edge_index, edge_feats, edge_mask, index, len(nodes))


def order_candidates(matches: Sequence, rule_ids: Mapping[str, int], cap: int) -> list:
    """The first `cap` matches, interleaving rules (each rule's first match, then each rule's second...).

    Deterministic, and fair to rules late in the registry when the cap bites.
    """
    seen: dict[str, int] = {}
    keyed = []
    for k, match in enumerate(matches):
        rank = seen.get(match.rule, 0)
        seen[match.rule] = rank + 1
        keyed.append((rank, rule_ids.get(match.rule, 0), k, match))
    keyed.sort(key=lambda item: item[:3])
    return [item[3] for item in keyed[:cap]]


def candidate_arrays(matches: Sequence, index: Mapping[str, int], rule_ids: Mapping[str, int], *,
                     max_candidates: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(rule ids (C,), touched node indices (C, MAX_TOUCHED) with -1 for none, mask (C,) int8) of `matches`."""
    rules = np.zeros(max_candidates, np.int64)
    touched = np.full((max_candidates, MAX_TOUCHED), -1, np.int64)
    mask = np.zeros(max_candidates, np.int8)
    for c, match in enumerate(matches[:max_candidates]):
        rules[c] = rule_ids[match.rule]
        for k, name in enumerate(match.nodes[:MAX_TOUCHED]):
            touched[c, k] = index.get(name, -1)
        mask[c] = 1
    return rules, touched, mask


__all__ = ["OP_TYPES", "NODE_FEATURES", "EDGE_FEATURES", "MAX_TOUCHED", "OBS_VERSION", "GraphArrays", "graph_arrays",
           "candidate_arrays", "order_candidates", "node_flops"]
