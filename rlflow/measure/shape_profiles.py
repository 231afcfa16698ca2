"""Shape profiles: the shapes a model with dynamic inputs will run at, each with its share of the traffic.

A rewrite's worth depends on the shape it runs at (onnxruntime's transformers optimizer makes a BERT L6/H384 export 3.1%
faster at sequence 16 and 3.8% slower at sequence 128), so a model served at several shapes is measured at each:
candidates are scored by the weighted geometric mean of their per-profile speedups, and the final measurement keeps a
rewrite only when that mean is measurably above 1 and no profile is measurably slower.

The graph being rewritten has static shapes: those of the primary profile (the heaviest), which the cost model sees.
The others are measured by fixing the dynamic dimensions of the exported model (`instantiate`).
"""
from __future__ import annotations

import ast
import math
import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Mapping, Sequence

import onnx

from rlflow.errors import InputError
from rlflow.graph.core import Graph, load
from rlflow.graph.input_shapes import fix_dims, parse_dims
from rlflow.graph.input_values import fix_values
from rlflow.graph.model_file import read_model
from rlflow.measure.timing import Ratio

TEXT_SEQUENCES = (16, 128)
"""The default profiles of a text model given no shapes: batch 1 at these sequence lengths (an embedding or
classification request, and a paragraph)."""


@dataclass(frozen=True)
class Profile:
    """One shape for every dynamic input, and its share of the traffic (weights are relative); `given`: the text it
    was given as, where that named dimensions rather than inputs (`by_dimension`)."""

    shapes: Mapping[str, tuple[int, ...]]
    weight: float = 1.0
    given: str | None = None

    @property
    def label(self) -> str:
        """`input_ids=1,16;attention_mask=1,16` (the `--profile` syntax, without the weight), or the text given."""
        return self.given or ";".join(f"{name}={','.join(map(str, shape))}" for name, shape in self.shapes.items())

    def as_dict(self) -> dict:
        return {"shapes": {k: list(v) for k, v in self.shapes.items()}, "weight": self.weight}


def parse_profile(text: str) -> Profile:
    """`input_ids=1,16;attention_mask=1,16@3` -> a Profile of weight 3 (`name:dims` is accepted too, as in
    --input-shape; the weight defaults to 1).

    Raises:
        InputError: the text is not in that form, a dimension is not a positive integer, or the weight is not a
            positive number.
    """
    body, at, weight_text = text.strip().rpartition("@") if "@" in text else (text.strip(), "", "")
    shapes: dict[str, tuple[int, ...]] = {}
    try:
        weight = float(weight_text) if at else 1.0
        if not (weight > 0 and math.isfinite(weight)):
            raise ValueError
        for item in (s.strip() for s in body.split(";")):
            if not item:
                continue
            sep = "=" if "=" in item else ":"
            name, found, dims = item.rpartition(sep)
            shape = parse_dims(dims)
            if not found or not name.strip() or name.strip() in shapes:
                raise ValueError
            shapes[name.strip()] = shape
        if not shapes:
            raise ValueError
    except ValueError:
        raise InputError(f"bad profile '{text}': expected name=d0,d1,...;name=d0,... with positive integers, "
                         f"optionally @weight with a positive weight") from None
    return Profile(shapes, weight)


def read_profiles(path: str | os.PathLike) -> list[Profile]:
    """Profiles from a file, one per line in the `--profile` syntax; blank lines and `#` comments are skipped.

    Raises:
        InputError: the file cannot be read, holds no profile, or a line does not parse (its number is given).
    """
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise InputError(f"cannot read profiles from {path}: {exc.strerror if isinstance(exc, OSError) else exc}") \
            from None
    profiles = []
    for number, line in enumerate(lines, 1):
        line = line.split("#", 1)[0].strip()
        if line:
            try:
                profiles.append(parse_profile(line))
            except InputError as exc:
                raise InputError(f"{path}, line {number}: {exc}") from None
    if not profiles:
        raise InputError(f"{path} holds no profile")
    return profiles


def given_profiles(specs: Sequence[str], path: str | os.PathLike | None) -> list[Profile]:
    """The profiles of `--profile` options and a `--profiles` file, in that order (none: [])."""
    return [parse_profile(spec) for spec in specs] + (read_profiles(path) if path else [])


def check_profiles(profiles: Sequence[Profile]) -> None:
    """Profiles must name the same inputs, and no two may give the same shapes.

    Raises:
        InputError: they do not.
    """
    names = set(profiles[0].shapes)
    for profile in profiles[1:]:
        if set(profile.shapes) != names:
            raise InputError(f"profiles must name the same inputs: '{profiles[0].label}' and '{profile.label}' do not")
    shapes = [tuple(sorted(p.shapes.items())) for p in profiles]
    if len(set(shapes)) != len(shapes):
        raise InputError("two profiles give the same shapes: give one, with the sum of their weights")


def without_fixed(profile: Profile, fixed: Mapping[str, int]) -> Profile:
    """`profile` without the dimensions --fix-dim fixed (no longer the model's to vary), where it gives them the
    same values.

    Raises:
        InputError: it gives one of them another value.
    """
    clash = sorted(name for name, dims in profile.shapes.items() if name in fixed and tuple(dims) != (fixed[name],))
    if clash:
        raise InputError(f"profile '{profile.label}' sets {', '.join(clash)}, which --fix-dim fixes to another value")
    return replace(profile, shapes={k: v for k, v in profile.shapes.items() if k not in fixed})


def arrange(profiles: Sequence[Profile], model: onnx.ModelProto) -> list[Profile]:
    """The profiles checked against each other (`check_profiles`) and against the model's inputs (`check_shapes`),
    the primary first: its shapes become the graph's static shapes.

    Raises:
        InputError: they do not pass.
    """
    weights = {t.name for t in model.graph.initializer}
    inputs = [vi for vi in model.graph.input if vi.name not in weights]
    profiles = [by_dimension(p, inputs) for p in profiles]
    check_profiles(profiles)
    for profile in profiles:
        check_shapes(profile, inputs)
    first = primary(profiles)
    return [first, *(p for p in profiles if p is not first)]


def by_dimension(profile: Profile, inputs: Sequence[onnx.ValueInfoProto]) -> Profile:
    """A profile naming the model's dynamic dimensions (`past_sequence=1024`: the symbols its inputs' shapes carry) in
    place of inputs, as one giving every input its shape: each symbolic dimension takes its symbol's value, or that
    of an expression of them (`past_sequence + 1`, as the dynamo exporter writes an attention mask's).  A decoder's
    cache is 60 inputs of one symbolic shape.  Inputs it names keep the shapes given.

    Raises:
        InputError: a name is neither an input nor a dimension, a dimension's value is not one number, or a dynamic
            dimension of an input it does not name has no value.
    """
    by_name = {vi.name: vi for vi in inputs}
    symbols = {name: dims for name, dims in profile.shapes.items() if name not in by_name}
    if not symbols:
        return profile
    known = {d.dim_param for vi in inputs for d in vi.type.tensor_type.shape.dim if d.dim_param.isidentifier()}
    unknown = sorted(set(symbols) - known)
    if unknown:
        raise InputError(f"profile '{profile.label}' names unknown input(s) or dimension(s) {', '.join(unknown)}; "
                         f"inputs are {', '.join(sorted(by_name))}; dimensions are {', '.join(sorted(known))}")
    if any(len(dims) != 1 for dims in symbols.values()):
        raise InputError(f"profile '{profile.label}': a dimension takes one number ({', '.join(symbols)})")
    values = {name: dims[0] for name, dims in symbols.items()}
    shapes = {name: dims for name, dims in profile.shapes.items() if name in by_name}
    for vi in inputs:
        dims = list(vi.type.tensor_type.shape.dim)
        if vi.name in shapes or all(d.HasField("dim_value") and d.dim_value > 0 for d in dims):
            continue
        shapes[vi.name] = tuple(d.dim_value if d.HasField("dim_value") and d.dim_value > 0
                                else _dimension(d.dim_param, values, profile, vi.name) for d in dims)
    return Profile(shapes, profile.weight, given=profile.label)


_OPERATORS = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b, ast.Mult: lambda a, b: a * b,
              ast.FloorDiv: lambda a, b: a // b}


def _dimension(symbol: str, values: Mapping[str, int], profile: Profile, name: str) -> int:
    """The value of a symbolic dimension of input `name`: a symbol of `values`, or +, -, * and // of them and
    integers."""
    def evaluate(node):
        if isinstance(node, ast.Name) and node.id in values:
            return values[node.id]
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
            return _OPERATORS[type(node.op)](evaluate(node.left), evaluate(node.right))
        raise ValueError

    if symbol in values:
        return values[symbol]
    try:
        value = evaluate(ast.parse(symbol, mode="eval").body) if symbol else None
    except (SyntaxError, ValueError, ZeroDivisionError):
        value = None
    if value is None or value < 1:
        raise InputError(f"profile '{profile.label}' gives no value for dimension '{symbol or '?'}' of input "
                         f"'{name}': name it, or give the input's shape")
    return value


def attach(graph, profiles: Sequence[Profile]) -> None:
    """Gives a Graph loaded at the first of `arrange`'s profiles its profiles (none when there is only one)."""
    graph.profiles = tuple(profiles) if len(profiles) > 1 else ()


def check_shapes(profile: Profile, inputs: Sequence[onnx.ValueInfoProto]) -> None:
    """The profile must give every dynamic input a shape of its rank that keeps its fixed dimensions.

    Raises:
        InputError: it does not.
    """
    by_name = {vi.name: vi for vi in inputs}
    unknown = sorted(set(profile.shapes) - set(by_name))
    if unknown:
        raise InputError(f"profile '{profile.label}' names unknown input(s) {', '.join(unknown)}; inputs are "
                         f"{', '.join(sorted(by_name))}")
    for name, vi in by_name.items():
        dims = list(vi.type.tensor_type.shape.dim)
        fixed = [d.dim_value if d.HasField("dim_value") and d.dim_value > 0 else None for d in dims]
        shape = profile.shapes.get(name)
        if shape is None:
            if None in fixed:
                raise InputError(f"profile '{profile.label}' gives no shape for the dynamic input '{name}'")
            continue
        if len(shape) != len(dims):
            raise InputError(f"profile '{profile.label}': input '{name}' has {len(dims)} dimensions, not {len(shape)}")
        for k, (want, static) in enumerate(zip(shape, fixed)):
            if static is not None and static != want:
                raise InputError(f"profile '{profile.label}': dimension {k} of '{name}' is fixed to {static} in the "
                                 f"model, not {want}")


def primary(profiles: Sequence[Profile]) -> Profile:
    """The profile the graph's static shapes (and the cost model) take: the heaviest, the first among equals."""
    return max(profiles, key=lambda p: p.weight)


def default_profiles(model: onnx.ModelProto) -> list[Profile]:
    """Profiles for a model given no shapes: for a text model (every dynamic input an integer [batch, sequence]
    tensor, as input_ids and attention_mask are) batch 1 at each of TEXT_SEQUENCES; else none (the graph layer fixes
    dynamic dimensions to 1, with a warning)."""
    weights = {t.name for t in model.graph.initializer}
    dynamic = {}
    for vi in model.graph.input:
        if vi.name in weights or not vi.type.HasField("tensor_type"):
            continue
        ttype = vi.type.tensor_type
        dims = list(ttype.shape.dim) if ttype.HasField("shape") else None
        if dims is None or all(d.HasField("dim_value") and d.dim_value > 0 for d in dims):
            continue
        dynamic[vi.name] = (ttype.elem_type, dims)
    integer = {onnx.TensorProto.INT64, onnx.TensorProto.INT32}
    if not dynamic or any(t not in integer or len(dims) != 2 for t, dims in dynamic.values()):
        return []
    return [Profile({name: (1, seq) for name in dynamic}) for seq in TEXT_SEQUENCES]


def instantiate(model: onnx.ModelProto, shapes: Mapping[str, Sequence[int]]) -> onnx.ModelProto:
    """A copy of `model` (with dynamic input dimensions) whose inputs named in `shapes` are fixed to them; inner
    shapes are left to onnxruntime's inference."""
    fixed = onnx.ModelProto()
    fixed.CopyFrom(model)
    for vi in fixed.graph.input:
        if vi.name in shapes:
            shape = vi.type.tensor_type.shape
            shape.ClearField("dim")
            for d in shapes[vi.name]:
                shape.dim.add().dim_value = int(d)
    return fixed


@dataclass
class CombinedRatio(Ratio):
    """A speedup over several profiles: their weighted geometric mean, which counts as faster only where the model is
    measurably slower at none of them (`slower_at`: their indices).  The gate's rule, here so that every search screens
    its candidates by it: greedy once stepped onto a decode step's fused graph faster on the mean and slower at the long
    cache, which the gate then refused, and the whole search was lost."""

    slower_at: tuple[int, ...] = ()

    @property
    def faster(self) -> bool:
        return self.low > 1.0 and not self.slower_at


def combine(ratios: Sequence[Ratio], weights: Sequence[float]) -> CombinedRatio:
    """The weighted geometric mean of per-profile speedups (`CombinedRatio`).

    Its bounds are the same mean of the per-profile bounds: wider than the mean's own interval would be (the
    profiles' errors are independent), so a gate on it errs towards keeping the input.
    """
    total = sum(weights)

    def mean(values: Sequence[float]) -> float:
        return math.exp(sum(w * math.log(v) for v, w in zip(values, weights)) / total)

    return CombinedRatio(mean([r.median for r in ratios]), mean([r.low for r in ratios]),
                         mean([r.high for r in ratios]), ratios[0].confidence,
                         tuple(i for i, r in enumerate(ratios) if r.slower))


def load_profiled(model: Path, profiles: list[Profile], fixed: Mapping[str, int] | None = None,
                   values: Mapping[str, float] | None = None) -> Graph:
    """The model at the heaviest profile's shapes, measured at every profile (none: at the shapes it loads with), with
    the `fixed` dimensions and input `values` fixed (`--fix-dim`, `--fix-value`: the methods and the peers all get
    them so)."""
    if not profiles and not fixed and not values:
        return load(model)
    proto = read_model(model)
    fix_values(proto, values or {})
    if fixed:
        fix_dims(proto, fixed)
        profiles = [without_fixed(p, fixed) for p in profiles]
    if not profiles:
        return Graph.from_model(proto, None, source=str(model), checked=True)
    profiles = arrange(profiles, proto)
    graph = Graph.from_model(proto, profiles[0].shapes, source=str(model), checked=True)
    attach(graph, profiles)
    return graph
