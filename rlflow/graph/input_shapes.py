"""The input shapes a model is measured at: parsed from the command line's --input-shape, read from the shapes a
model's metadata says it is deployed at (the zoo's deployment section writes them), and fixed into the model's
inputs, every dynamic dimension given a value (`rlflow.graph.core.Graph.from_model`).
"""
from __future__ import annotations

import logging
from typing import Iterable, Mapping, Sequence

import onnx

from rlflow.errors import InputError

log = logging.getLogger("rlflow")


def parse_dims(text: str) -> tuple[int, ...]:
    """`d0,d1,...` -> a shape of positive integers (empty text: a scalar); ValueError otherwise."""
    shape = tuple(int(d) for d in text.split(",")) if text.strip() else ()
    if any(d <= 0 for d in shape):
        raise ValueError(f"not a shape of positive integers: {text!r}")
    return shape


def parse_input_shapes(specs: Iterable[str]) -> dict[str, tuple[int, ...]]:
    """Parses `name:d0,d1,...` strings (the CLI's --input-shape) into a dict."""
    shapes: dict[str, tuple[int, ...]] = {}
    for spec in specs:
        name, sep, dims = spec.rpartition(":")
        try:
            if not sep or not name:
                raise ValueError
            shape = parse_dims(dims)
        except ValueError:
            raise InputError(f"bad --input-shape '{spec}': expected name:d0,d1,... with positive integers") from None
        shapes[name] = shape
    return shapes


DEPLOYED_SHAPES_KEY = "rlflow.input_shapes"
"""Model metadata giving the shapes a model with dynamic inputs is deployed at (the zoo's deployment section writes
it), in the --input-shape syntax joined by ';': `input_ids:1,16;attention_mask:1,16`."""


def format_input_shapes(shapes: Mapping[str, Sequence[int]]) -> str:
    """``{"input_ids": (1, 16), ...}`` -> ``"input_ids:1,16;..."``: what `deployed_shapes` reads back."""
    return ";".join(f"{name}:{','.join(str(d) for d in shape)}" for name, shape in shapes.items())


def deployed_shapes(model: onnx.ModelProto, inputs: Sequence[onnx.ValueInfoProto] = ()) -> dict[str, tuple[int, ...]]:
    """The shapes the model's metadata says it is deployed at (for the inputs named in `inputs`, when given), used
    where the user gives no --input-shape; {} when there is no such metadata or it does not parse."""
    value = next((p.value for p in model.metadata_props if p.key == DEPLOYED_SHAPES_KEY), "")
    if not value:
        return {}
    try:
        shapes = parse_input_shapes(s for s in value.split(";") if s.strip())
    except InputError:
        log.warning("ignoring metadata %s=%r: not name:d0,d1,... specs joined by ';'", DEPLOYED_SHAPES_KEY, value)
        return {}
    names = {vi.name for vi in inputs}
    return {k: v for k, v in shapes.items() if not names or k in names}


def parse_fixed_dims(specs: Iterable[str]) -> dict[str, int]:
    """Parses `name=value` strings (the CLI's --fix-dim) into a dict of positive integers."""
    fixed: dict[str, int] = {}
    for spec in specs:
        name, sep, value = spec.partition("=")
        if not sep or not name.strip().isidentifier() or not value.strip().isdigit() or int(value) <= 0:
            raise InputError(f"bad --fix-dim '{spec}': expected a dimension's name and a positive integer, "
                             "such as batch=1")
        fixed[name.strip()] = int(value)
    return fixed


def fix_dims(model: onnx.ModelProto, fixed: Mapping[str, int]) -> None:
    """Gives the named symbolic dimensions of `model`'s inputs, outputs and value infos their values, in place: the
    model then runs at those values only, and rules may rely on them (what onnxruntime's `make_dynamic_shape_fixed`
    does; a batch-1 decoder lets group-query-attention-rotary take its rotary embedding in).

    Raises:
        InputError: a name is no symbolic dimension of the model's inputs.
    """
    if not fixed:
        return
    bad = sorted(name for name, value in fixed.items() if not isinstance(value, int) or value <= 0)
    if bad:
        raise InputError(f"--fix-dim takes positive integers: {', '.join(f'{n}={fixed[n]!r}' for n in bad)}")
    weights = {t.name for t in model.graph.initializer}
    known = {d.dim_param for vi in model.graph.input if vi.name not in weights
             for d in vi.type.tensor_type.shape.dim if d.dim_param}
    unknown = sorted(set(fixed) - known)
    if unknown:
        raise InputError(f"--fix-dim names no dimension of the model's inputs: {', '.join(unknown)}; its dynamic "
                         f"dimensions are {', '.join(sorted(known)) or 'none'}")
    deployed = deployed_shapes(model)
    for vi in model.graph.input:  # the shapes the metadata says it is deployed at follow (a batch-1 export fixed at 2)
        if vi.name in deployed and len(deployed[vi.name]) == len(vi.type.tensor_type.shape.dim):
            deployed[vi.name] = tuple(fixed.get(d.dim_param, size) if d.dim_param else size
                                      for d, size in zip(vi.type.tensor_type.shape.dim, deployed[vi.name]))
    for prop in model.metadata_props:
        if prop.key == DEPLOYED_SHAPES_KEY and deployed:
            prop.value = format_input_shapes(deployed)
    for vi in [*model.graph.input, *model.graph.output, *model.graph.value_info]:
        for dim in vi.type.tensor_type.shape.dim:
            if dim.dim_param in fixed:
                dim.dim_value = fixed[dim.dim_param]  # clears dim_param: one field of a oneof


def fix_input_dims(inputs: list[onnx.ValueInfoProto], given: dict[str, Sequence[int]]) -> dict[str, tuple[int, ...]]:
    """Fixes dynamic input dimensions in place (given, else 1 with a warning) and returns the fixed shapes."""
    names = {vi.name for vi in inputs}
    unknown = sorted(set(given) - names)
    if unknown:
        raise InputError(f"--input-shape names unknown input(s) {', '.join(unknown)}; inputs are {', '.join(sorted(names))}")
    fixed: dict[str, tuple[int, ...]] = {}
    for vi in inputs:
        if not vi.type.HasField("tensor_type"):
            raise InputError(f"input '{vi.name}' is not a tensor (sequences, maps and optionals are not supported)")
        ttype = vi.type.tensor_type
        want = given.get(vi.name)
        if not ttype.HasField("shape"):
            if want is None:
                raise InputError(f"input '{vi.name}' has no shape; give it with --input-shape {vi.name}:d0,d1,...")
            ttype.shape.SetInParent()
            for _ in want:
                ttype.shape.dim.add()
        dims = list(ttype.shape.dim)
        if want is not None and any(int(d) <= 0 for d in want):
            raise InputError(f"input shape for '{vi.name}' must have positive dimensions, not {tuple(want)}")
        if want is not None and len(want) != len(dims):
            raise InputError(f"--input-shape {vi.name} has {len(want)} dimensions; the model's input has {len(dims)}")
        shape = []
        for k, dim in enumerate(dims):
            static = dim.dim_value if dim.HasField("dim_value") and dim.dim_value > 0 else None
            if want is not None:
                if static is not None and static != want[k]:
                    raise InputError(f"--input-shape {vi.name}: dimension {k} is fixed to {static} in the model, "
                                     f"not {want[k]}")
                value = int(want[k])
            elif static is not None:
                value = static
            else:
                label = dim.dim_param or "?"
                log.warning("input '%s' dimension %d ('%s') is dynamic; measuring with 1 (set it with "
                            "--input-shape %s:...)", vi.name, k, label, vi.name)
                value = 1
            dim.Clear()
            dim.dim_value = value
            shape.append(value)
        fixed[vi.name] = tuple(shape)
    return fixed


__all__ = ["DEPLOYED_SHAPES_KEY", "deployed_shapes", "fix_input_dims", "format_input_shapes", "parse_dims",
           "parse_input_shapes"]
