"""Small graph queries shared by rules: who produces and reads a tensor, constants, attribute defaults."""
from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs

from rlflow.graph import Graph


def only_consumer(tensor: gs.Tensor) -> gs.Node | None:
    """The single node reading `tensor`, or None when there are zero or several."""
    return tensor.outputs[0] if len(tensor.outputs) == 1 else None


def private(graph: Graph, tensor: gs.Tensor) -> bool:
    """True when a tensor can disappear in a rewrite: read by one node and not a graph output."""
    return len(tensor.outputs) == 1 and not graph.is_output(tensor)


def input_producer(node: gs.Node, index: int, op: str | None = None) -> gs.Node | None:
    """The node producing input `index` of `node` (of type `op` if given), else None."""
    if index >= len(node.inputs):
        return None
    producer = Graph.producer(node.inputs[index])
    if producer is None or (op is not None and producer.op != op):
        return None
    return producer


def constant_input(node: gs.Node, index: int) -> np.ndarray | None:
    """The value of input `index` when it is a constant (absent optional inputs give None)."""
    if index >= len(node.inputs) or node.inputs[index].name == "":
        return None
    return Graph.constant(node.inputs[index])


def is_float(tensor: gs.Tensor) -> bool:
    """True for float16/32/64 tensors (bfloat16 too); the algebra rules assume real arithmetic."""
    dtype = tensor.dtype
    if dtype is None:
        return False
    try:
        return np.dtype(dtype).kind == "f" or str(dtype) == "bfloat16"
    except TypeError:
        return False
