"""Inputs whose every element the user declares to be one value (`--fix-value attention_mask=1`): a decoder served one
request at a time never pads, and its attention mask is then all ones.  The model keeps the input (its shape still
carries the sequence length) but reads a constant of its shape instead of its values, so rules may rely on the value:
with no padding, a decoder's mask is causal only, and `GroupQueryAttention` can mask by itself
(group-query-attention-causal).  As with `--fix-dim`, the model so fixed is what the output is verified and measured
against.
"""
from __future__ import annotations

from typing import Iterable, Mapping

import numpy as np
import onnx
from onnx import helper

from rlflow.errors import InputError


def parse_fixed_values(specs: Iterable[str]) -> dict[str, float]:
    """Parses `name=value` strings (the CLI's --fix-value) into a dict of numbers."""
    fixed: dict[str, float] = {}
    for spec in specs:
        name, sep, value = spec.partition("=")
        try:
            number = float(value)
        except ValueError:
            number = None
        if not sep or not name.strip() or number is None or not np.isfinite(number):
            raise InputError(f"bad --fix-value '{spec}': expected an input's name and a finite number, "
                             "such as attention_mask=1")
        fixed[name.strip()] = number
    return fixed


def fix_values(model: onnx.ModelProto, fixed: Mapping[str, float]) -> None:
    """Makes `model` read `ConstantOfShape(Shape(x), value)` wherever it read each fixed input `x`, in place: the
    input stays, with its shape, and its values no longer matter (a model that reads only its shape is left as it is).

    Raises:
        InputError: a name is no input of the model, or the value is not one of its element type.
    """
    if not fixed:
        return
    weights = {t.name for t in model.graph.initializer}
    inputs = {vi.name: vi for vi in model.graph.input if vi.name not in weights}
    unknown = sorted(set(fixed) - set(inputs))
    if unknown:
        raise InputError(f"--fix-value names no input of the model: {', '.join(unknown)}; its inputs are "
                         f"{', '.join(sorted(inputs)) or 'none'}")
    taken = {n.name for n in model.graph.node} | {o for n in model.graph.node for o in n.output} | set(inputs) | weights
    added = []
    for name, value in fixed.items():
        if all(n.op_type == "Shape" for n in model.graph.node if name in n.input):
            continue  # the model reads its shape alone (fixed already): its values do not matter
        elem = inputs[name].type.tensor_type.elem_type
        dtype = np.dtype(helper.tensor_dtype_to_np_dtype(elem)) if elem else None
        if dtype is None or dtype.kind not in "fiub" or (dtype.kind in "iub" and value != int(value)) or (
                dtype.kind == "b" and value not in (0, 1)):
            raise InputError(f"--fix-value {name}={value:g}: not a value of the input's element type "
                             f"({dtype or 'unknown'})")
        shape, constant = _fresh(f"{name}_shape", taken), _fresh(f"{name}_fixed", taken)
        _rename_reads(model.graph, name, constant)
        fill = helper.make_tensor("value", elem, [1], np.array([value], dtype).astype(dtype).tolist())
        added += [helper.make_node("Shape", [name], [shape], name=shape),
                  helper.make_node("ConstantOfShape", [shape], [constant], name=constant, value=fill)]
    rest = list(model.graph.node)
    del model.graph.node[:]
    model.graph.node.extend(added + rest)


def _fresh(base: str, taken: set[str]) -> str:
    name, k = base, 1
    while name in taken:
        name, k = f"{base}_{k}", k + 1
    taken.add(name)
    return name


def _rename_reads(graph: onnx.GraphProto, old: str, new: str) -> None:
    """Every node input named `old` renamed `new`, in subgraphs too (they may read the outer scope)."""
    for node in graph.node:
        node.input[:] = [new if i == old else i for i in node.input]
        for attr in node.attribute:
            for sub in [attr.g] if attr.type == onnx.AttributeProto.GRAPH else list(attr.graphs):
                _rename_reads(sub, old, new)
