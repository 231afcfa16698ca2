"""Merge rules: parallel operators combined into one larger operator (TASO's biggest wins on GPUs).

A group of siblings is matched once, at the sibling with the smallest name, so an agent sees one action per group.
"""
from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs

from rlflow.graph.core import Graph
from rlflow.rewrites.base import Match, NoMatch, Rule
from rlflow.rewrites.edits import emit, emit_split
from rlflow.rewrites.queries import (
    constant_input,
    conv_attrs,
    conv_params,
    conv_weights,
    has_input,
    input_producer,
    is_float,
    is_standard,
    normalize_axis,
    private,
)


def lead(node: gs.Node, group: list[gs.Node]) -> bool:
    """True when `node` is the group's first member by name (where a group's match is rooted)."""
    return node is min(group, key=lambda n: n.name)


def siblings(tensor: gs.Tensor, fits) -> list[gs.Node]:
    """Distinct readers of `tensor` for which `fits(reader)` holds, by name."""
    seen, group = set(), []
    for reader in tensor.outputs:
        if id(reader) not in seen and is_standard(reader) and fits(reader):
            seen.add(id(reader))
            group.append(reader)
    return sorted(group, key=lambda n: n.name)


def split_into(graph: Graph, merged: gs.Tensor, parts: list[gs.Node], axis: int, sizes: list[int]) -> None:
    """Splits `merged` along `axis` and makes readers of each part's output read its piece."""
    pieces = emit_split(graph, merged, axis, sizes, len(sizes))
    for node, piece in zip(parts, pieces):
        graph.replace_uses(node.outputs[0], piece)


# ------------------------------------------------------------------------------------------------- shared input
class MatMulMergeSiblings(Rule):
    """Replaces `X.W1, X.W2, ...` with `Split(X.Concat(W1, W2, ...))` (one MatMul for Q, K and V)."""

    name = "matmul-merge-siblings"
    root_ops = ("MatMul",)

    @staticmethod
    def _fits(node: gs.Node, x: gs.Tensor, weight: np.ndarray) -> bool:
        other = constant_input(node, 1)
        return (node.op == "MatMul" and node.inputs[0] is x and other is not None and other.ndim == 2
                and other.shape[0] == weight.shape[0] and other.dtype == weight.dtype)

    def check(self, graph: Graph, node: gs.Node) -> Match | NoMatch:
        weight = constant_input(node, 1)
        if weight is None or weight.ndim != 2:
            return self.no(node, "the weights are not a constant matrix")
        group = siblings(node.inputs[0], lambda n: self._fits(n, node.inputs[0], weight))
        if len(group) < 2:
            return self.no(node, "no other MatMul reads the same input with constant weights")
        if not lead(node, group):
            return self.no(node, "another MatMul leads this group")
        return self.match(group)

    def rewrite(self, graph: Graph, match: Match, nodes: dict[str, gs.Node]) -> None:
        group = [nodes[n] for n in match.nodes]
        weights = [constant_input(n, 1) for n in group]
        merged = graph.add_constant(np.concatenate(weights, axis=1), f"{group[0].name}_merged_W")
        split_into(graph, emit(graph, "MatMul", [group[0].inputs[0], merged]), group, -1, [w.shape[1] for w in weights])


class GemmMergeSiblings(Rule):
    """Replaces `Gemm(A, B1, C1), Gemm(A, B2, C2), ...` with `Split(Gemm(A, Concat(B1, B2), Concat(C1, C2)))`."""

    name = "gemm-merge-siblings"
    root_ops = ("Gemm",)

    @staticmethod
    def _parts(node: gs.Node):
        """(B as [K, N], beta*C as a 2-D array, (alpha, transA)) or None when not constant."""
        weight = constant_input(node, 1)
        if weight is None or weight.ndim != 2 or (has_input(node, 2) and constant_input(node, 2) is None):
            return None
        if node.attrs.get("transB", 0):
            weight = weight.T
        bias = constant_input(node, 2) if has_input(node, 2) else np.zeros(weight.shape[1], weight.dtype)
        bias = (bias.astype(np.float64) * float(node.attrs.get("beta", 1.0))).astype(weight.dtype)
        bias = bias.reshape((1,) * (2 - bias.ndim) + bias.shape)
        return weight, bias, (float(node.attrs.get("alpha", 1.0)), int(node.attrs.get("transA", 0)))

    def _fits(self, node: gs.Node, a: gs.Tensor, ref) -> bool:
        parts = self._parts(node) if node.op == "Gemm" and node.inputs[0] is a else None
        return parts is not None and parts[0].shape[0] == ref[0].shape[0] and parts[2] == ref[2] and (
            parts[0].dtype == ref[0].dtype)

    def check(self, graph: Graph, node: gs.Node) -> Match | NoMatch:
        ref = self._parts(node)
        if ref is None:
            return self.no(node, "the weights or bias are not constant")
        group = siblings(node.inputs[0], lambda n: self._fits(n, node.inputs[0], ref))
        if len(group) < 2:
            return self.no(node, "no other Gemm reads the same input with constant weights and equal alpha/transA")
        if not lead(node, group):
            return self.no(node, "another Gemm leads this group")
        return self.match(group)

    def rewrite(self, graph: Graph, match: Match, nodes: dict[str, gs.Node]) -> None:
        group = [nodes[n] for n in match.nodes]
        parts = [self._parts(n) for n in group]
        rows = max(p[1].shape[0] for p in parts)
        weight = np.concatenate([p[0] for p in parts], axis=1)
        bias = np.concatenate([np.broadcast_to(p[1], (rows, p[0].shape[1])) for p in parts], axis=1)
        alpha, trans_a = parts[0][2]
        merged = emit(graph, "Gemm", [group[0].inputs[0], graph.add_constant(weight, f"{group[0].name}_merged_B"),
                                      graph.add_constant(np.ascontiguousarray(bias), f"{group[0].name}_merged_C")],
                      {"alpha": alpha, "beta": 1.0, "transA": trans_a})
        split_into(graph, merged, group, 1, [p[0].shape[1] for p in parts])


def _conv_key(graph: Graph, node: gs.Node):
    """What two Convs must share to merge: geometry, input channels, element type; None for unsupported Convs."""
    params = conv_params(graph, node)
    found = conv_weights(node) if node.op == "Conv" else None
    if params is None or found is None or not is_float(node.outputs[0]):
        return None
    weight = found[0]
    return (params["kernel"], params["strides"], params["pads"], params["dilations"], params["group"],
            weight.shape[1], str(weight.dtype))


class ConvMergeSiblings(Rule):
    """Replaces Convs of one input with equal geometry by one Conv on concatenated weights and a Split."""

    name = "conv-merge-siblings"
    root_ops = ("Conv",)

    def check(self, graph: Graph, node: gs.Node) -> Match | NoMatch:
        key = _conv_key(graph, node)
        if key is None:
            return self.no(node, "weights not constant or geometry unknown (auto_pad)")
        if key[4] != 1:
            return self.no(node, "a grouped Conv (its channels would interleave)")
        group = siblings(node.inputs[0], lambda n: n.op == "Conv" and n.inputs[0] is node.inputs[0]
                          and _conv_key(graph, n) == key)
        if len(group) < 2:
            return self.no(node, "no other Conv reads the same input with the same kernel, strides, pads and dilations")
        if not lead(node, group):
            return self.no(node, "another Conv leads this group")
        return self.match(group)

    def rewrite(self, graph: Graph, match: Match, nodes: dict[str, gs.Node]) -> None:
        group = [nodes[n] for n in match.nodes]
        found = [conv_weights(n) for n in group]
        weight = graph.add_constant(np.concatenate([w for w, _ in found]), f"{group[0].name}_merged_W")
        bias = graph.add_constant(np.concatenate([b for _, b in found]), f"{group[0].name}_merged_B")
        merged = emit(graph, "Conv", [group[0].inputs[0], weight, bias], conv_attrs(conv_params(graph, group[0])))
        split_into(graph, merged, group, 1, [w.shape[0] for w, _ in found])


class ConvEnlargeKernel(Rule):
    """Replaces a Conv's kernel with a larger zero-padded one (and more padding) matching a sibling it can merge with."""

    name = "conv-enlarge-kernel"
    root_ops = ("Conv",)

    @staticmethod
    def _target(small: dict, large: dict) -> bool:
        if large["kernel"] == small["kernel"] or len(large["kernel"]) != len(small["kernel"]):
            return False
        if (small["strides"], small["dilations"], small["group"]) != (large["strides"], large["dilations"], 1) or (
                small["group"] != 1):
            return False
        nd = len(small["kernel"])
        for d in range(nd):
            grow = large["kernel"][d] - small["kernel"][d]
            if grow < 0 or grow % 2:
                return False
            extra = grow // 2 * small["dilations"][d]
            if (small["pads"][d] + extra, small["pads"][d + nd] + extra) != (large["pads"][d], large["pads"][d + nd]):
                return False
        return True

    def check(self, graph: Graph, node: gs.Node) -> Match | NoMatch:
        small = conv_params(graph, node)
        if small is None or conv_weights(node) is None:
            return self.no(node, "weights not constant or geometry unknown (auto_pad)")
        targets = []
        for other in siblings(node.inputs[0], lambda n: n.op == "Conv" and n is not node and n.inputs[0] is node.inputs[0]):
            large = conv_params(graph, other)
            if large is not None and self._target(small, large):
                targets.append((tuple(-k for k in large["kernel"]), other.name, large))
        if not targets:
            return self.no(node, "no sibling Conv has a larger kernel with matching strides, dilations and centred pads")
        large = min(targets)[2]
        return self.match([node], kernel=large["kernel"], pads=large["pads"])

    def rewrite(self, graph: Graph, match: Match, nodes: dict[str, gs.Node]) -> None:
        node = nodes[match.root]
        params = conv_params(graph, node)
        weight, bias = conv_weights(node)
        kernel = match.param("kernel")
        grow = [(0, 0), (0, 0)] + [((k - s) // 2, (k - s) // 2) for k, s in zip(kernel, params["kernel"])]
        params = {**params, "kernel": kernel, "pads": match.param("pads")}
        inputs = [node.inputs[0], graph.add_constant(np.pad(weight, grow), f"{node.name}_W")]
        if has_input(node, 2):
            inputs.append(node.inputs[2])
        graph.replace_uses(node.outputs[0], emit(graph, "Conv", inputs, conv_attrs(params)))


# ----------------------------------------------------------------------------------------------- different inputs
def same_shapes(graph: Graph, tensors, except_axis: int | None = None) -> bool:
    shapes = [graph.shape(t) for t in tensors]
    if any(s is None for s in shapes) or len({len(s) for s in shapes}) != 1:
        return False
    return len({tuple(d for i, d in enumerate(s) if i != except_axis) for s in shapes}) == 1


class ConvConcatToGroup(Rule):
    """Replaces `Concat(Conv(a, W1), Conv(b, W2), ...)` on channels with one grouped Conv on `Concat(a, b, ...)`."""

    name = "conv-concat-to-group"
    root_ops = ("Concat",)

    def check(self, graph: Graph, node: gs.Node) -> Match | NoMatch:
        rank = len(graph.shape(node.outputs[0]) or ())
        if rank < 3 or normalize_axis(node.attrs["axis"], rank) != 1:
            return self.no(node, "not a Concat along channels")
        convs = [input_producer(node, i, "Conv") for i in range(len(node.inputs))]
        if len(convs) < 2 or any(c is None or not private(graph, c.outputs[0]) for c in convs):
            return self.no(node, "not every input is a private Conv")
        keys = {_conv_key(graph, c) for c in convs}
        if None in keys or len(keys) != 1:
            return self.no(node, "the Convs differ in geometry or weights are not constant")
        if len({conv_weights(c)[0].shape for c in convs}) != 1 or not same_shapes(graph, [c.inputs[0] for c in convs]):
            return self.no(node, "the Convs differ in channel counts or input shapes")
        if len({id(c.inputs[0]) for c in convs}) != len(convs):
            return self.no(node, "two Convs read the same input (conv-merge-siblings applies)")
        return self.match([node, *convs])

    def rewrite(self, graph: Graph, match: Match, nodes: dict[str, gs.Node]) -> None:
        node, *convs = (nodes[n] for n in match.nodes)
        found = [conv_weights(c) for c in convs]
        params = conv_params(graph, convs[0])
        params = {**params, "group": params["group"] * len(convs)}
        joined = emit(graph, "Concat", [c.inputs[0] for c in convs], {"axis": 1})
        weight = graph.add_constant(np.concatenate([w for w, _ in found]), f"{node.name}_group_W")
        bias = graph.add_constant(np.concatenate([b for _, b in found]), f"{node.name}_group_B")
        graph.replace_uses(node.outputs[0], emit(graph, "Conv", [joined, weight, bias], conv_attrs(params)))


class GroupConvMergeGroups(Rule):
    """Replaces a Conv with an even number of groups g by one with g/2 groups whose weights hold zero blocks."""

    name = "group-conv-merge-groups"
    root_ops = ("Conv",)

    def check(self, graph: Graph, node: gs.Node) -> Match | NoMatch:
        params = conv_params(graph, node)
        if params is None or conv_weights(node) is None:
            return self.no(node, "weights not constant or geometry unknown (auto_pad)")
        if params["group"] < 2 or params["group"] % 2:
            return self.no(node, "the Conv does not have an even number of groups")
        return self.match([node])

    def rewrite(self, graph: Graph, match: Match, nodes: dict[str, gs.Node]) -> None:
        node = nodes[match.root]
        params = conv_params(graph, node)
        weight, _ = conv_weights(node)
        groups = params["group"]
        per_out, per_in = weight.shape[0] // groups, weight.shape[1]
        merged = np.zeros((weight.shape[0], 2 * per_in, *weight.shape[2:]), weight.dtype)
        for g in range(groups):
            rows = slice(g * per_out, (g + 1) * per_out)
            merged[rows, (g % 2) * per_in:(g % 2 + 1) * per_in] = weight[rows]
        inputs = [node.inputs[0], graph.add_constant(merged, f"{node.name}_W"), *node.inputs[2:3]]
        graph.replace_uses(node.outputs[0], emit(graph, "Conv", inputs, conv_attrs({**params, "group": groups // 2})))


class ConvAddMerge(Rule):
    """Replaces `Add(Conv(a, W1, b1), Conv(b, W2, b2))` with `Conv(Concat(a, b), Concat(W1, W2), b1 + b2)`."""

    name = "conv-add-merge"
    root_ops = ("Add",)

    def check(self, graph: Graph, node: gs.Node) -> Match | NoMatch:
        convs = [input_producer(node, i, "Conv") for i in (0, 1)]
        if any(c is None or not private(graph, c.outputs[0]) for c in convs) or convs[0] is convs[1]:
            return self.no(node, "the Add's inputs are not two private Convs")
        keys = [_conv_key(graph, c) for c in convs]
        if None in keys or keys[0][:5] != keys[1][:5] or keys[0][4] != 1 or keys[0][6] != keys[1][6]:
            return self.no(node, "the Convs differ in geometry, are grouped, or have non-constant weights")
        outs = [graph.shape(c.outputs[0]) for c in convs]
        if outs[0] is None or not outs[0] == outs[1] == graph.shape(node.outputs[0]):
            return self.no(node, "the Convs' outputs differ in shape")
        if not same_shapes(graph, [c.inputs[0] for c in convs], except_axis=1):
            return self.no(node, "the Convs' inputs differ in batch or spatial size")
        return self.match([node, *convs])

    def rewrite(self, graph: Graph, match: Match, nodes: dict[str, gs.Node]) -> None:
        node, *convs = (nodes[n] for n in match.nodes)
        found = [conv_weights(c) for c in convs]
        joined = emit(graph, "Concat", [c.inputs[0] for c in convs], {"axis": 1})
        weight = graph.add_constant(np.concatenate([w for w, _ in found], axis=1), f"{node.name}_W")
        bias = graph.add_constant(found[0][1] + found[1][1], f"{node.name}_B")
        graph.replace_uses(node.outputs[0], emit(graph, "Conv", [joined, weight, bias],
                                                 conv_attrs(conv_params(graph, convs[0]))))


class MatMulAddMerge(Rule):
    """Replaces `Add(a.W1, b.W2)` with `Concat(a, b).Concat(W1, W2)` for constant W1, W2."""

    name = "matmul-add-merge"
    root_ops = ("Add",)

    def check(self, graph: Graph, node: gs.Node) -> Match | NoMatch:
        mms = [input_producer(node, i, "MatMul") for i in (0, 1)]
        if any(m is None or not private(graph, m.outputs[0]) for m in mms) or mms[0] is mms[1]:
            return self.no(node, "the Add's inputs are not two private MatMuls")
        weights = [constant_input(m, 1) for m in mms]
        if any(w is None or w.ndim != 2 for w in weights) or weights[0].shape[1] != weights[1].shape[1] or (
                weights[0].dtype != weights[1].dtype):
            return self.no(node, "the MatMuls' weights are not constant matrices of one width and type")
        if mms[0].inputs[0] is mms[1].inputs[0]:
            return self.no(node, "the MatMuls share their input (matmul-factor-lhs applies)")
        rank = len(graph.shape(mms[0].inputs[0]) or ())
        if rank < 2 or not same_shapes(graph, [m.inputs[0] for m in mms], except_axis=rank - 1):
            return self.no(node, "the MatMuls' inputs differ in shape beyond their last axis")
        if graph.shape(mms[0].outputs[0]) != graph.shape(node.outputs[0]):
            return self.no(node, "the Add broadcasts")
        return self.match([node, *mms])

    def rewrite(self, graph: Graph, match: Match, nodes: dict[str, gs.Node]) -> None:
        node, *mms = (nodes[n] for n in match.nodes)
        joined = emit(graph, "Concat", [m.inputs[0] for m in mms], {"axis": -1})
        weight = graph.add_constant(np.concatenate([constant_input(m, 1) for m in mms]), f"{node.name}_W")
        graph.replace_uses(node.outputs[0], emit(graph, "MatMul", [joined, weight]))
