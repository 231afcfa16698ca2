"""Cleanup rules: operators that compute nothing (identities, neutral elements, no-op layout changes, duplicates)."""
from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs

from rlflow.graph.core import Graph
from rlflow.graph.dynamic_axes import dynamic_axes
from rlflow.rewrites.base import Match, NoMatch, Rule
from rlflow.rewrites.edits import bypass, emit, replace_all
from rlflow.rewrites.queries import (
    DETERMINISTIC_OPS,
    attrs_key,
    constant_input,
    has_input,
    input_producer,
    int_list,
    normalize_axis,
    np_dtype,
    onnx_dtype_to_np,
    scalar,
)

_BIG = 2 ** 31 - 1


class _Bypass(Rule):
    """A node whose output equals one of its inputs: readers of the output read that input instead."""

    def rewrite(self, graph: Graph, match: Match, nodes: dict[str, gs.Node]) -> None:
        node = nodes[match.root]
        bypass(graph, node, node.inputs[match.param("source", 0)])

    def _same_shape(self, graph: Graph, node: gs.Node, source: int) -> bool:
        out, inp = graph.shape(node.outputs[0]), graph.shape(node.inputs[source])
        return out is not None and out == inp and np_dtype(node.outputs[0]) == np_dtype(node.inputs[source])


class IdentityElim(_Bypass):
    """Replaces `Identity(x)` with `x`."""

    name = "identity-elim"
    root_ops = ("Identity",)

    def check(self, graph: Graph, node: gs.Node) -> Match | NoMatch:
        source = node.inputs[0]
        if graph.is_output(node.outputs[0]) and (Graph.producer(source) is None or graph.is_output(source)):
            return self.no(node, "the Identity names a graph output after a graph input, constant or output")
        return self.match([node])


class DropoutElim(_Bypass):
    """Replaces an inference-mode `Dropout(x)` with `x`."""

    name = "dropout-elim"
    root_ops = ("Dropout",)

    def check(self, graph: Graph, node: gs.Node) -> Match | NoMatch:
        if any(t.outputs or graph.is_output(t) for t in node.outputs[1:]):
            return self.no(node, "the dropout mask is used")
        if has_input(node, 2):
            mode = constant_input(node, 2)
            if mode is None or bool(np.any(mode)):
                return self.no(node, "training_mode is not a constant false")
        return self.match([node])


class _NeutralElim(_Bypass):
    """`op(x, c)` with every element of the constant c equal to `neutral` (either side when commutative)."""

    op: str = ""
    neutral: float = 0.0
    commutative: bool = False

    def check(self, graph: Graph, node: gs.Node) -> Match | NoMatch:
        if len(node.inputs) != 2:
            return self.no(node, "not a binary operator")
        for source in ((0, 1) if self.commutative else (0,)):
            value = scalar(constant_input(node, 1 - source))
            if value is not None and value == self.neutral:
                if not self._same_shape(graph, node, source):
                    return self.no(node, "the constant broadcasts the other operand to a larger shape")
                return self.match([node], source=source)
        return self.no(node, f"no operand is a constant {self.neutral:g}")


class MulOneElim(_NeutralElim):
    """Replaces `Mul(x, 1)` with `x`."""

    name = "mul-one-elim"
    root_ops = ("Mul",)
    neutral, commutative = 1.0, True


class AddZeroElim(_NeutralElim):
    """Replaces `Add(x, 0)` with `x`."""

    name = "add-zero-elim"
    root_ops = ("Add",)
    neutral, commutative = 0.0, True


class SubZeroElim(_NeutralElim):
    """Replaces `Sub(x, 0)` with `x`."""

    name = "sub-zero-elim"
    root_ops = ("Sub",)
    neutral, commutative = 0.0, False


class DivOneElim(_NeutralElim):
    """Replaces `Div(x, 1)` with `x`."""

    name = "div-one-elim"
    root_ops = ("Div",)
    neutral, commutative = 1.0, False


class CastNoopElim(_Bypass):
    """Replaces `Cast(x, to)` with `x` when x already has type `to`."""

    name = "cast-noop-elim"
    root_ops = ("Cast",)

    def check(self, graph: Graph, node: gs.Node) -> Match | NoMatch:
        source, target = np_dtype(node.inputs[0]), onnx_dtype_to_np(node.attrs.get("to", 0))
        if source is None or target is None:
            return self.no(node, "element type unknown")
        if source != target:
            return self.no(node, f"the Cast changes the type ({source} to {target})")
        return self.match([node])


def _exact_widening(source: np.dtype, middle: np.dtype) -> bool:
    """True when every value of `source` survives a round trip through `middle`."""
    if source == middle:
        return True
    if source.kind == "b":
        return True
    if middle.kind == "f":
        mantissa = {2: 11, 4: 24, 8: 53}.get(middle.itemsize, 0)
        if source.kind == "f":
            return middle.itemsize > source.itemsize and str(source) != "bfloat16" or (
                str(source) == "bfloat16" and middle.itemsize >= 4)
        return source.kind in "iu" and source.itemsize * 8 - (source.kind == "i") <= mantissa
    if middle.kind in "iu" and source.kind in "iu":
        return bool(np.can_cast(source, middle, casting="safe"))
    return False


class CastRoundtripElim(Rule):
    """Replaces `Cast(Cast(x, wider), type(x))` with `x` when the wider type holds every value of x exactly."""

    name = "cast-roundtrip-elim"
    root_ops = ("Cast",)

    def check(self, graph: Graph, node: gs.Node) -> Match | NoMatch:
        inner = input_producer(node, 0, "Cast")
        if inner is None:
            return self.no(node, "input is not produced by a Cast")
        source, middle = np_dtype(inner.inputs[0]), onnx_dtype_to_np(inner.attrs.get("to", 0))
        final = onnx_dtype_to_np(node.attrs.get("to", 0))
        if source is None or middle is None or final is None:
            return self.no(node, "element type unknown")
        if final != source:
            return self.no(node, "the outer Cast does not return to the original type")
        if not _exact_widening(source, middle):
            return self.no(node, f"the round trip through {middle} loses values of {source}")
        return self.match([node, inner])

    def rewrite(self, graph: Graph, match: Match, nodes: dict[str, gs.Node]) -> None:
        bypass(graph, nodes[match.nodes[0]], nodes[match.nodes[1]].inputs[0])


class TransposeNoopElim(_Bypass):
    """Replaces `Transpose(x, perm)` with `x` when perm is the identity."""

    name = "transpose-noop-elim"
    root_ops = ("Transpose",)

    def check(self, graph: Graph, node: gs.Node) -> Match | NoMatch:
        perm = node.attrs.get("perm")
        shape = graph.shape(node.inputs[0])
        if perm is None:
            if shape is not None and len(shape) <= 1:
                return self.match([node])
            return self.no(node, "the permutation is not the identity")
        if list(perm) != list(range(len(perm))):
            return self.no(node, "the permutation is not the identity")
        return self.match([node])


class ReshapeNoopElim(_Bypass):
    """Replaces `Reshape(x, s)` with `x` when it keeps x's shape for every value of the dynamic dimensions."""

    name = "reshape-noop-elim"
    root_ops = ("Reshape",)

    def check(self, graph: Graph, node: gs.Node) -> Match | NoMatch:
        target = int_list(constant_input(node, 1))
        if target is None:
            return self.no(node, "the target shape is not constant")
        if not self._same_shape(graph, node, 0):
            return self.no(node, "the Reshape changes the shape")
        dynamic = dynamic_axes(graph, node.inputs[0])
        if -1 in target and any(t > 0 and (dynamic is None or dynamic[i]) for i, t in enumerate(target)):
            return self.no(node, "a fixed size next to -1 sits on a dynamic dimension: the shape changes at other sizes")
        return self.match([node])


class PadZeroElim(_Bypass):
    """Replaces `Pad(x, pads=0)` with `x`."""

    name = "pad-zero-elim"
    root_ops = ("Pad",)

    def check(self, graph: Graph, node: gs.Node) -> Match | NoMatch:
        pads = int_list(constant_input(node, 1))
        if pads is None:
            return self.no(node, "the pads are not constant")
        if any(pads):
            return self.no(node, "the Pad pads something")
        return self.match([node])


class SliceNoopElim(_Bypass):
    """Replaces `Slice(x, ...)` with `x` when it keeps every element of every axis."""

    name = "slice-noop-elim"
    root_ops = ("Slice",)

    def check(self, graph: Graph, node: gs.Node) -> Match | NoMatch:
        shape = graph.shape(node.inputs[0])
        values = [int_list(constant_input(node, i)) if has_input(node, i) else None for i in range(1, 5)]
        starts, ends, axes, steps = values
        if shape is None or starts is None or ends is None or (has_input(node, 3) and axes is None) or (
                has_input(node, 4) and steps is None):
            return self.no(node, "the slice bounds are not constant")
        axes = axes if axes is not None else tuple(range(len(starts)))
        steps = steps if steps is not None else (1,) * len(starts)
        dynamic = dynamic_axes(graph, node.inputs[0]) or (True,) * len(shape)
        for start, end, axis, step in zip(starts, ends, axes, steps):
            axis = normalize_axis(axis, len(shape))
            if axis is None or step != 1:
                return self.no(node, "the Slice steps or reverses")
            dim = shape[axis]
            full_start = start == 0 if dynamic[axis] else (start if start >= 0 else start + dim) <= 0
            full_end = end >= _BIG if dynamic[axis] else (end if end >= 0 else end + dim) >= dim
            if not (full_start and full_end):
                return self.no(node, "the Slice drops elements (or may, at other dynamic sizes)")
        return self.match([node])


class ConcatSingleElim(_Bypass):
    """Replaces `Concat(x)` of a single input with `x`."""

    name = "concat-single-elim"
    root_ops = ("Concat",)

    def check(self, graph: Graph, node: gs.Node) -> Match | NoMatch:
        if len(node.inputs) != 1:
            return self.no(node, "the Concat has several inputs")
        return self.match([node])


class ConcatEmptyElim(Rule):
    """Replaces `Concat(..., e, ...)` with the Concat of its other inputs where e is empty along the axis.

    Empty at every size of the model's dynamic dimensions (the pass-through part of a rotary embedding that rotates
    the whole head, as Phi-3's exports write it)."""

    name = "concat-empty-elim"
    root_ops = ("Concat",)

    def check(self, graph: Graph, node: gs.Node) -> Match | NoMatch:
        kept = []
        for index, tensor in enumerate(node.inputs):
            shape = graph.shape(tensor)
            axis = normalize_axis(node.attrs.get("axis", 0), len(shape)) if shape is not None else None
            if axis is None or shape[axis] != 0 or (dynamic_axes(graph, tensor) or (True,) * len(shape))[axis]:
                kept.append(index)
        if len(kept) == len(node.inputs):
            return self.no(node, "no input is empty along the axis at every size")
        if not kept:
            return self.no(node, "every input is empty")
        return self.match([node], kept=tuple(kept))

    def rewrite(self, graph: Graph, match: Match, nodes: dict[str, gs.Node]) -> None:
        node = nodes[match.root]
        inputs = [node.inputs[i] for i in match.param("kept")]
        replace_all(graph, node.outputs, [emit(graph, "Concat", inputs, {"axis": node.attrs.get("axis", 0)})])


class SplitSingleElim(_Bypass):
    """Replaces `Split(x)` into a single part with `x`."""

    name = "split-single-elim"
    root_ops = ("Split",)

    def check(self, graph: Graph, node: gs.Node) -> Match | NoMatch:
        if len(node.outputs) != 1:
            return self.no(node, "the Split has several outputs")
        if not self._same_shape(graph, node, 0):
            return self.no(node, "shape unknown")
        return self.match([node])


class ExpandNoopElim(_Bypass):
    """Replaces `Expand(x, s)` with `x` when it keeps x's shape for every value of the dynamic dimensions."""

    name = "expand-noop-elim"
    root_ops = ("Expand",)

    def check(self, graph: Graph, node: gs.Node) -> Match | NoMatch:
        target = int_list(constant_input(node, 1))
        if target is None:
            return self.no(node, "the target shape is not constant")
        if not self._same_shape(graph, node, 0):
            return self.no(node, "the Expand broadcasts to a larger shape")
        dynamic = dynamic_axes(graph, node.inputs[0])
        offset = len(dynamic or ()) - len(target)
        if dynamic is None or any(t != 1 and (i + offset < 0 or dynamic[i + offset]) for i, t in enumerate(target)):
            return self.no(node, "a target size other than 1 on a dynamic dimension may broadcast at other sizes")
        return self.match([node])


class IdempotentUnaryElim(Rule):
    """Replaces `f(f(x))` with `f(x)` for an idempotent f (Relu, Abs, Floor, Ceil, Round)."""

    name = "idempotent-unary-elim"
    root_ops = ("Relu", "Abs", "Floor", "Ceil", "Round")

    def check(self, graph: Graph, node: gs.Node) -> Match | NoMatch:
        inner = input_producer(node, 0, node.op)
        if inner is None:
            return self.no(node, f"input is not produced by another {node.op}")
        return self.match([node, inner])

    def rewrite(self, graph: Graph, match: Match, nodes: dict[str, gs.Node]) -> None:
        bypass(graph, nodes[match.nodes[0]], nodes[match.nodes[1]].outputs[0])


class DuplicateNodeElim(Rule):
    """Replaces a node that repeats an earlier one (same operator, attributes and inputs) with the earlier node's outputs."""

    name = "duplicate-node-elim"
    root_ops = DETERMINISTIC_OPS

    def check(self, graph: Graph, node: gs.Node) -> Match | NoMatch:
        if not node.inputs or (node.domain or "") not in ("", "ai.onnx"):
            return self.no(node, "a node without inputs or outside the standard domain")
        key = attrs_key(node)
        if key[:1] == ("<unhashable>",):
            return self.no(node, "the node has graph or tensor attributes")
        twins = [other for other in node.inputs[0].outputs
                 if other is not node and other.name < node.name and other.op == node.op
                 and (other.domain or "") == (node.domain or "") and len(other.inputs) == len(node.inputs)
                 and len(other.outputs) == len(node.outputs) and all(a is b for a, b in zip(other.inputs, node.inputs))
                 and attrs_key(other) == key]
        if not twins:
            return self.no(node, "no other node computes the same thing")
        # The twin with the smallest name keeps its place, so the match is the same on a clone.
        return self.match([node, min(twins, key=lambda n: n.name)])

    def rewrite(self, graph: Graph, match: Match, nodes: dict[str, gs.Node]) -> None:
        node, twin = nodes[match.nodes[0]], nodes[match.nodes[1]]
        replace_all(graph, node.outputs, twin.outputs)
