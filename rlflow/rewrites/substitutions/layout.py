"""Layout rules: transposes, reshapes, concatenations and splits that can cancel or move."""
from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs

from rlflow.graph.core import Graph
from rlflow.graph.dynamic_axes import dynamic_axes
from rlflow.rewrites.base import Match, NoMatch, Rule
from rlflow.rewrites.edits import bypass, emit, replace_all
from rlflow.rewrites.queries import (
    BINARY_ELEMENTWISE,
    UNARY_ELEMENTWISE,
    constant_input,
    conv_params,
    conv_weights,
    input_producer,
    int_list,
    inverse_perm,
    is_float,
    normalize_axis,
    per_channel,
    perm_of,
    private,
    split_sizes,
    squeeze_axes,
    to_rank,
)


def _perm(node: gs.Node, rank: int | None) -> tuple[int, ...] | None:
    return perm_of(node, rank)


class TransposeTranspose(Rule):
    """Replaces `Transpose(Transpose(x, p), q)` with one `Transpose(x, p.q)`, or with `x` when they cancel."""

    name = "transpose-transpose"
    root_ops = ("Transpose",)

    def check(self, graph: Graph, node: gs.Node) -> Match | NoMatch:
        inner = input_producer(node, 0, "Transpose")
        if inner is None:
            return self.no(node, "input is not produced by a Transpose")
        shape = graph.shape(inner.inputs[0])
        p, q = _perm(inner, len(shape) if shape else None), _perm(node, len(shape) if shape else None)
        if p is None or q is None:
            return self.no(node, "permutation unknown (no perm and no static rank)")
        return self.match([node, inner], perm=tuple(p[i] for i in q))

    def rewrite(self, graph: Graph, match: Match, nodes: dict[str, gs.Node]) -> None:
        outer, inner = nodes[match.nodes[0]], nodes[match.nodes[1]]
        perm = match.param("perm")
        source = inner.inputs[0]
        if perm == tuple(range(len(perm))):
            graph.replace_uses(outer.outputs[0], source)
        else:
            (out,) = graph.add_node("Transpose", [source], attrs={"perm": list(perm)})
            graph.replace_uses(outer.outputs[0], out)


def _rank(graph: Graph, tensor: gs.Tensor) -> int | None:
    shape = graph.shape(tensor)
    return len(shape) if shape is not None else None


class ReshapeChain(Rule):
    """Replaces `Reshape(r(x), s)`, r a Reshape, Squeeze, Unsqueeze or Flatten, with `Reshape(x, s)`."""

    name = "reshape-chain"
    root_ops = ("Reshape",)

    def check(self, graph: Graph, node: gs.Node) -> Match | NoMatch:
        inner = input_producer(node, 0, ("Reshape", "Squeeze", "Unsqueeze", "Flatten"))
        if inner is None:
            return self.no(node, "input is not produced by a Reshape, Squeeze, Unsqueeze or Flatten")
        if not private(graph, inner.outputs[0]):
            return self.no(node, "the inner result is read elsewhere too")
        target = int_list(constant_input(node, 1))
        if target is None or node.attrs.get("allowzero", 0):
            return self.no(node, "the target shape is not constant (or allowzero is set)")
        for i, t in enumerate(target):
            if t == 0 and not self._keeps_dim(graph, inner, i):
                return self.no(node, "the target copies a dimension (0) that the inner operator moves")
        return self.match([node, inner])

    @staticmethod
    def _keeps_dim(graph: Graph, inner: gs.Node, i: int) -> bool:
        if inner.op == "Reshape":  # copied (0), or written as the input's own static size at the same place
            target = int_list(constant_input(inner, 1))
            if target is None or i >= len(target) or (target[i] == 0 and inner.attrs.get("allowzero", 0)):
                return False
            if target[i] == 0:
                return True
            shape, dynamic = graph.shape(inner.inputs[0]), dynamic_axes(graph, inner.inputs[0])
            if shape is None or dynamic is None or i >= len(shape):
                return False
            if target[i] != -1:
                return shape[i] == target[i] and not dynamic[i]
            # -1: the input's size there where the other sizes, all static, multiply to the same on both sides
            rest = [j for j in range(len(shape)) if j != i]
            written = [shape[j] if t == 0 and j < len(shape) else t for j, t in enumerate(target) if j != i]
            return (not any(dynamic[j] for j in rest) and 0 not in written and -1 not in written
                    and int(np.prod([shape[j] for j in rest])) == int(np.prod(written)))
        if inner.op == "Flatten":
            rank = _rank(graph, inner.inputs[0])
            return rank is not None and i == 0 and normalize_axis(inner.attrs.get("axis", 1), rank + 1) == 1
        rank = _rank(graph, inner.inputs[0] if inner.op == "Squeeze" else inner.outputs[0])
        axes = squeeze_axes(inner, rank)
        return axes is not None and all(a > i for a in axes)

    def rewrite(self, graph: Graph, match: Match, nodes: dict[str, gs.Node]) -> None:
        outer, inner = nodes[match.nodes[0]], nodes[match.nodes[1]]
        graph.replace_uses(outer.outputs[0], emit(graph, "Reshape", [inner.inputs[0], outer.inputs[1]]))


class SqueezeUnsqueezeCancel(Rule):
    """Replaces `Unsqueeze(Squeeze(x, a), a)` and `Squeeze(Unsqueeze(x, a), a)` with `x`."""

    name = "squeeze-unsqueeze-cancel"
    root_ops = ("Squeeze", "Unsqueeze")

    def check(self, graph: Graph, node: gs.Node) -> Match | NoMatch:
        other = "Unsqueeze" if node.op == "Squeeze" else "Squeeze"
        inner = input_producer(node, 0, other)
        if inner is None:
            return self.no(node, f"input is not produced by an {other}")
        middle = _rank(graph, node.inputs[0])
        outer_rank = middle if node.op == "Squeeze" else _rank(graph, node.outputs[0])
        inner_rank = _rank(graph, inner.inputs[0]) if inner.op == "Squeeze" else middle
        a, b = squeeze_axes(inner, inner_rank), squeeze_axes(node, outer_rank)
        if a is None or b is None:
            return self.no(node, "axes not constant (or rank unknown)")
        if a != b:
            return self.no(node, "the axes differ")
        return self.match([node, inner])

    def rewrite(self, graph: Graph, match: Match, nodes: dict[str, gs.Node]) -> None:
        bypass(graph, nodes[match.nodes[0]], nodes[match.nodes[1]].inputs[0])


class ConcatSplitCancel(Rule):
    """Replaces `Split(Concat(x1, ..., xn))` along the same axis and sizes with `x1, ..., xn`."""

    name = "concat-split-cancel"
    root_ops = ("Split",)

    def check(self, graph: Graph, node: gs.Node) -> Match | NoMatch:
        concat = input_producer(node, 0, "Concat")
        if concat is None:
            return self.no(node, "input is not produced by a Concat")
        info = split_sizes(graph, node)
        shapes = [graph.shape(t) for t in concat.inputs]
        if info is None or None in shapes:
            return self.no(node, "split sizes or shapes unknown")
        axis, sizes = info
        if normalize_axis(concat.attrs.get("axis", 0), len(shapes[0])) != axis:
            return self.no(node, "the Split and the Concat use different axes")
        if tuple(s[axis] for s in shapes) != sizes:
            return self.no(node, "the Split's parts are not the Concat's inputs")
        if len(node.inputs) < 2 and any(any(dynamic_axes(graph, t) or (True,)) for t in concat.inputs):
            return self.no(node, "an equal Split of dynamic inputs may cut elsewhere at other sizes")
        return self.match([node, concat])

    def rewrite(self, graph: Graph, match: Match, nodes: dict[str, gs.Node]) -> None:
        split, concat = nodes[match.nodes[0]], nodes[match.nodes[1]]
        replace_all(graph, split.outputs, concat.inputs)


class SplitConcatCancel(Rule):
    """Replaces `Concat(Split(x))` of all the parts, in order and along the same axis, with `x`."""

    name = "split-concat-cancel"
    root_ops = ("Concat",)

    def check(self, graph: Graph, node: gs.Node) -> Match | NoMatch:
        split = input_producer(node, 0, "Split")
        if split is None:
            return self.no(node, "input is not produced by a Split")
        if len(node.inputs) != len(split.outputs) or any(a is not b for a, b in zip(node.inputs, split.outputs)):
            return self.no(node, "the Concat does not join all the Split's parts in order")
        rank = _rank(graph, split.inputs[0])
        if rank is None or normalize_axis(split.attrs.get("axis", 0), rank) != normalize_axis(node.attrs["axis"], rank):
            return self.no(node, "the Split and the Concat use different axes")
        return self.match([node, split])

    def rewrite(self, graph: Graph, match: Match, nodes: dict[str, gs.Node]) -> None:
        bypass(graph, nodes[match.nodes[0]], nodes[match.nodes[1]].inputs[0])


class ConcatFlatten(Rule):
    """Replaces `Concat(a, Concat(b, c), d)` along one axis with `Concat(a, b, c, d)`."""

    name = "concat-flatten"
    root_ops = ("Concat",)

    def check(self, graph: Graph, node: gs.Node) -> Match | NoMatch:
        rank = _rank(graph, node.outputs[0])
        if rank is None:
            return self.no(node, "rank unknown")
        axis = normalize_axis(node.attrs["axis"], rank)
        inner = [p for i in range(len(node.inputs)) if (p := input_producer(node, i, "Concat")) is not None
                 and private(graph, p.outputs[0]) and normalize_axis(p.attrs["axis"], rank) == axis]
        if not inner:
            return self.no(node, "no input is a private Concat along the same axis")
        return self.match([node, *inner])

    def rewrite(self, graph: Graph, match: Match, nodes: dict[str, gs.Node]) -> None:
        outer = nodes[match.root]
        inner = {id(nodes[n].outputs[0]): nodes[n] for n in match.nodes[1:]}
        inputs = [t for s in outer.inputs for t in (inner[id(s)].inputs if id(s) in inner else [s])]
        graph.replace_uses(outer.outputs[0], emit(graph, "Concat", inputs, {"axis": outer.attrs["axis"]}))


class TransposeUnarySink(Rule):
    """Replaces `f(Transpose(x))` with `Transpose(f(x))` for an elementwise f, so transposes can meet and cancel."""

    name = "transpose-unary-sink"
    root_ops = tuple(sorted(UNARY_ELEMENTWISE))

    def check(self, graph: Graph, node: gs.Node) -> Match | NoMatch:
        transpose = input_producer(node, 0, "Transpose")
        if transpose is None:
            return self.no(node, "input is not produced by a Transpose")
        if not private(graph, transpose.outputs[0]):
            return self.no(node, "the Transpose is read elsewhere too")
        if len(node.inputs) != 1:
            return self.no(node, "the operator has more than one input")
        return self.match([node, transpose])

    def rewrite(self, graph: Graph, match: Match, nodes: dict[str, gs.Node]) -> None:
        node, transpose = nodes[match.nodes[0]], nodes[match.nodes[1]]
        inner = emit(graph, node.op, [transpose.inputs[0]], dict(node.attrs), domain=node.domain or "")
        graph.replace_uses(node.outputs[0], emit(graph, "Transpose", [inner], dict(transpose.attrs)))


class TransposeBinarySink(Rule):
    """Replaces `f(Transpose(x, p), Transpose(y, p))` (or a constant for y) with `Transpose(f(x, y), p)`."""

    name = "transpose-binary-sink"
    root_ops = tuple(sorted(BINARY_ELEMENTWISE))

    def check(self, graph: Graph, node: gs.Node) -> Match | NoMatch:
        rank = _rank(graph, node.outputs[0])
        transposes = [input_producer(node, i, "Transpose") for i in range(2)]
        if rank is None or all(t is None for t in transposes):
            return self.no(node, "no input is produced by a Transpose")
        perms = [perm_of(t, rank) if t is not None else None for t in transposes]
        for t in transposes:
            if t is not None and not private(graph, t.outputs[0]):
                return self.no(node, "a Transpose is read elsewhere too")
        if all(t is not None for t in transposes):
            if perms[0] != perms[1] or any(_rank(graph, t.inputs[0]) != rank for t in transposes):
                return self.no(node, "the two Transposes differ")
            return self.match([node, *transposes])
        side = 0 if transposes[0] is not None else 1
        constant = constant_input(node, 1 - side)
        if constant is None:
            return self.no(node, "the other input is neither a Transpose nor a constant")
        if constant.ndim > rank or _rank(graph, transposes[side].inputs[0]) != rank:
            return self.no(node, "the constant broadcasts to a higher rank")
        return self.match([node, transposes[side]], side=side)

    def rewrite(self, graph: Graph, match: Match, nodes: dict[str, gs.Node]) -> None:
        node = nodes[match.root]
        transposes = [nodes[n] for n in match.nodes[1:]]
        rank = len(graph.shape(node.outputs[0]))
        perm = perm_of(transposes[0], rank)
        if len(transposes) == 2:
            inputs = [t.inputs[0] for t in transposes]
        else:
            side = match.param("side")
            constant = np.ascontiguousarray(np.transpose(to_rank(constant_input(node, 1 - side), rank), inverse_perm(perm)))
            inputs = [transposes[0].inputs[0]] * 2
            inputs[1 - side] = graph.add_constant(constant, f"{node.name}_const")
        inner = emit(graph, node.op, inputs, dict(node.attrs))
        graph.replace_uses(node.outputs[0], emit(graph, "Transpose", [inner], {"perm": list(perm)}))


class Conv1x1NhwcMatmul(Rule):
    """Replaces `Transpose(Conv1x1(Transpose(x, NHWC->NCHW)), NCHW->NHWC)` with `MatMul(x, W') + b`."""

    name = "conv1x1-nhwc-matmul"
    root_ops = ("Transpose",)

    def check(self, graph: Graph, node: gs.Node) -> Match | NoMatch:
        conv = input_producer(node, 0, "Conv")
        if conv is None or perm_of(node, 4) != (0, 2, 3, 1):
            return self.no(node, "not an NCHW->NHWC Transpose of a Conv")
        into = input_producer(conv, 0, "Transpose")
        if into is None or perm_of(into, 4) != (0, 3, 1, 2):
            return self.no(node, "the Conv input is not an NHWC->NCHW Transpose")
        if not private(graph, conv.outputs[0]):
            return self.no(node, "the Conv output is read elsewhere too")
        params = conv_params(graph, conv)
        if params is None or len(params["kernel"]) != 2:
            return self.no(node, "not a 2-D Conv with known geometry")
        if params["kernel"] != (1, 1) or params["strides"] != (1, 1) or any(params["pads"]) or params["group"] != 1:
            return self.no(node, "not a 1x1 Conv with stride 1, no padding and one group")
        if conv_weights(conv) is None:
            return self.no(node, "Conv weights or bias are not constant")
        return self.match([node, conv, into])

    def rewrite(self, graph: Graph, match: Match, nodes: dict[str, gs.Node]) -> None:
        node, conv, into = (nodes[n] for n in match.nodes)
        weight, bias = conv_weights(conv)
        matrix = np.ascontiguousarray(weight[:, :, 0, 0].T)
        out = emit(graph, "MatMul", [into.inputs[0], graph.add_constant(matrix, f"{conv.name}_W")])
        if len(conv.inputs) > 2 and conv.inputs[2].name:
            out = emit(graph, "Add", [out, graph.add_constant(bias.copy(), f"{conv.name}_B")])
        graph.replace_uses(node.outputs[0], out)


def _swapped_2d(graph: Graph, node: gs.Node, index: int) -> gs.Node | None:
    """The private Transpose of a 2-D tensor (perm [1, 0]) feeding input `index` of `node`, or None."""
    transpose = input_producer(node, index, "Transpose")
    if transpose is None or not private(graph, transpose.outputs[0]) or _rank(graph, transpose.inputs[0]) != 2:
        return None
    return transpose if perm_of(transpose, 2) == (1, 0) else None


class TransposeIntoGemm(Rule):
    """Replaces `Gemm(Transpose(A), B)` (or a transposed B) with `Gemm(A, B)` whose transA (transB) flag is flipped."""

    name = "transpose-into-gemm"
    root_ops = ("Gemm",)

    def check(self, graph: Graph, node: gs.Node) -> Match | NoMatch:
        sides = tuple(i for i in (0, 1) if _swapped_2d(graph, node, i) is not None)
        if not sides:
            return self.no(node, "no operand is a private 2-D Transpose")
        return self.match([node, *(_swapped_2d(graph, node, i) for i in sides)], sides=sides)

    def rewrite(self, graph: Graph, match: Match, nodes: dict[str, gs.Node]) -> None:
        node = nodes[match.root]
        inputs, attrs = list(node.inputs), dict(node.attrs)
        for i, transpose in zip(match.param("sides"), match.nodes[1:]):
            inputs[i] = nodes[transpose].inputs[0]
            key = ("transA", "transB")[i]
            attrs[key] = 1 - int(attrs.get(key, 0))
        graph.replace_uses(node.outputs[0], emit(graph, "Gemm", inputs, attrs))


class MatMulTransposeToGemm(TransposeIntoGemm):
    """Replaces `MatMul(Transpose(A), B)` on 2-D operands (or a transposed B) with `Gemm(A, B, transA=1)`."""

    name = "matmul-transpose-to-gemm"
    root_ops = ("MatMul",)

    def check(self, graph: Graph, node: gs.Node) -> Match | NoMatch:
        if any(_rank(graph, t) != 2 for t in node.inputs) or not is_float(node.outputs[0]):
            return self.no(node, "not a float product of 2-D operands")
        return super().check(graph, node)


def _reshape_target(graph: Graph, tensor: gs.Tensor, last: int) -> tuple[int, ...] | None:
    """A Reshape target giving `tensor`'s leading dimensions and `last`, with -1 for the one leading dimension that
    follows the model's dynamic inputs (so it stays dynamic); None when more than one leading dimension does."""
    shape, dynamic = graph.shape(tensor), dynamic_axes(graph, tensor)
    if shape is None or dynamic is None or dynamic[-1] or sum(dynamic[:-1]) > 1:
        return None
    return tuple(-1 if moves else int(d) for d, moves in zip(shape[:-1], dynamic[:-1])) + (int(last),)


class MatMul3dToGemm(Rule):
    """Replaces `Add(MatMul(X, W), b)` with X of rank 3+ by `Reshape(Gemm(Reshape(X, [-1, K]), W, b), [..., N])`."""

    name = "matmul3d-add-to-gemm"
    root_ops = ("Add",)

    def check(self, graph: Graph, node: gs.Node) -> Match | NoMatch:
        for side in (0, 1):
            matmul = input_producer(node, side, "MatMul")
            if matmul is None or not private(graph, matmul.outputs[0]):
                continue
            x, weight, bias = graph.shape(matmul.inputs[0]), constant_input(matmul, 1), constant_input(node, 1 - side)
            if x is None or len(x) < 3 or weight is None or weight.ndim != 2 or not is_float(node.outputs[0]):
                return self.no(node, "not a float MatMul of a rank-3+ tensor and a constant matrix")
            if bias is None or per_channel(bias, (*x[:-1], weight.shape[1]), len(x) - 1) is None:
                return self.no(node, "the addend is not a constant vector along the last axis")
            target = _reshape_target(graph, matmul.inputs[0], weight.shape[1])
            if target is None:
                return self.no(node, "more than one leading dimension (or the last one) is dynamic")
            return self.match([node, matmul], side=side, target=target)
        return self.no(node, "no input is a private MatMul")

    def rewrite(self, graph: Graph, match: Match, nodes: dict[str, gs.Node]) -> None:
        node, matmul = nodes[match.nodes[0]], nodes[match.nodes[1]]
        x, weight = matmul.inputs
        bias = constant_input(node, 1 - match.param("side"))
        rows = emit(graph, "Reshape", [x, graph.add_constant(np.array([-1, weight.shape[0]], np.int64), "rows")])
        out_shape = graph.shape(matmul.outputs[0])
        vector = per_channel(bias, out_shape, len(out_shape) - 1)
        gemm = emit(graph, "Gemm", [rows, weight, graph.add_constant(vector, f"{node.name}_bias")])
        target = graph.add_constant(np.array(match.param("target"), np.int64), "shape")
        graph.replace_uses(node.outputs[0], emit(graph, "Reshape", [gemm, target]))
