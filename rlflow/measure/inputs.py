"""Random inputs for measurement and verification: normal floats, integers inside the range they index."""
from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np
import onnx
from onnx import helper

# Operators through which an integer tensor keeps its values (so an index bound found after them still applies).
_VALUE_PRESERVING = {"Cast", "Reshape", "Unsqueeze", "Squeeze", "Flatten", "Identity", "Expand", "Transpose"}
_DEFAULT_INT_BOUND = 2


def input_specs(model: onnx.ModelProto, shapes: Mapping[str, Sequence[int]] | None = None) -> dict[str, tuple]:
    """name -> (numpy dtype, shape) of the model's real inputs; dynamic dimensions come from `shapes`, else 1."""
    shapes = dict(shapes or {})
    initializers = {t.name for t in model.graph.initializer}
    specs = {}
    for vi in model.graph.input:
        if vi.name in initializers:
            continue
        ttype = vi.type.tensor_type
        dtype = helper.tensor_dtype_to_np_dtype(ttype.elem_type)
        if vi.name in shapes:
            shape = tuple(int(d) for d in shapes[vi.name])
        else:
            shape = tuple(d.dim_value if d.HasField("dim_value") and d.dim_value > 0 else 1 for d in ttype.shape.dim)
        specs[vi.name] = (dtype, shape)
    return specs


def random_inputs(model: onnx.ModelProto, seed: int = 0,
                  shapes: Mapping[str, Sequence[int]] | None = None) -> dict[str, np.ndarray]:
    """One feed dict of random inputs.

    Floats come from a standard normal; integers are drawn in [0, bound) where bound is the size of the table they
    index (Gather on a constant), else 2, so that embeddings and masks get valid values; booleans are fair coins.
    """
    rng = np.random.default_rng(seed)
    feeds = {}
    for name, (dtype, shape) in input_specs(model, shapes).items():
        dtype = np.dtype(dtype)
        if dtype.kind == "f" or str(dtype) == "bfloat16":
            feeds[name] = rng.standard_normal(shape).astype(dtype)
        elif dtype.kind in "iu":
            feeds[name] = rng.integers(0, index_bound(model, name), size=shape).astype(dtype)
        elif dtype.kind == "b":
            feeds[name] = rng.integers(0, 2, size=shape).astype(bool)
        else:
            raise ValueError(f"input '{name}' has element type {dtype}, which rlflow cannot generate")
    return feeds


_EMBED_TABLES = {0: 2, 1: 4, 8: 3}
"""EmbedLayerNormalization's id inputs and the tables they index: input_ids the word embedding, segment_ids the
segment embedding, position_ids the position embedding."""


def index_bound(model: onnx.ModelProto, name: str) -> int:
    """The smallest size of a constant table that `name` indexes (through value-preserving ops), else 2."""
    initializers = {t.name: tuple(t.dims) for t in model.graph.initializer}
    for node in model.graph.node:
        if node.op_type == "Constant":
            for attr in node.attribute:
                if attr.name == "value":
                    initializers[node.output[0]] = tuple(attr.t.dims)
    readers: dict[str, list[onnx.NodeProto]] = {}
    for node in model.graph.node:
        for tensor in node.input:
            readers.setdefault(tensor, []).append(node)
    bounds = []
    frontier, seen = [name], {name}
    while frontier:
        tensor = frontier.pop()
        for node in readers.get(tensor, []):
            if node.op_type in ("Gather", "GatherElements") and len(node.input) > 1 and node.input[1] == tensor:
                table = initializers.get(node.input[0])
                axis = next((a.i for a in node.attribute if a.name == "axis"), 0)
                if table:
                    bounds.append(table[axis])
            elif node.op_type == "EmbedLayerNormalization":  # its ids index its own tables (onnxruntime's contrib op)
                for ids, table in _EMBED_TABLES.items():
                    if ids < len(node.input) and node.input[ids] == tensor and initializers.get(node.input[table]):
                        bounds.append(initializers[node.input[table]][0])
            elif node.op_type in _VALUE_PRESERVING and node.input[0] == tensor:
                for out in node.output:
                    if out not in seen:
                        seen.add(out)
                        frontier.append(out)
    return min(bounds) if bounds else _DEFAULT_INT_BOUND
