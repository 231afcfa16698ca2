"""Attention fusion: multi-head attention as exporters write it, into onnxruntime's `MultiHeadAttention`.

Exporters compute the reshape targets inside attention from `Shape` of its own intermediate tensors (both torch
exporters do, so that batch and sequence stay dynamic).  Those shape computations die with the pattern, so a tensor
of the pattern may also be read by `Shape` nodes, provided everything they compute ends inside the pattern.
"""
from __future__ import annotations

from typing import NamedTuple, Sequence

import numpy as np
import onnx_graphsurgeon as gs

from rlflow.graph.core import Graph
from rlflow.graph.dynamic_axes import dynamic_axes
from rlflow.rewrites.base import Match, NoMatch, Rule
from rlflow.rewrites.edits import emit, expand_rows, replace_typed
from rlflow.rewrites.queries import (
    MS,
    constant_input,
    input_producer,
    is_float,
    normalize_axis,
    np_dtype,
    perm_of,
    scalar,
    standard_producer,
)

_SHAPE_CONE_LIMIT = 64  # nodes of one shape computation followed before giving up


def sole_reader(graph: Graph, tensor: gs.Tensor, output_ok: bool = False) -> bool:
    """True when one node reads `tensor` besides `Shape` nodes, and it is not a graph output (unless `output_ok`)."""
    return ((output_ok or not graph.is_output(tensor)) and
            sum(1 for n in tensor.outputs if n.op != "Shape") == 1)


def sole_producer(graph: Graph, node: gs.Node, index: int, op: str | Sequence[str]) -> gs.Node | None:
    """The standard `op` node writing input `index` of `node`, when `node` is its sole reader (`sole_reader`)."""
    producer = input_producer(node, index, op)
    return producer if producer is not None and sole_reader(graph, producer.outputs[0]) else None


def keeps_shape(graph: Graph, reshape: gs.Node) -> bool:
    """True when a Reshape gives its input's shape back, at these sizes and at others of the dynamic dimensions."""
    before, after = graph.shape(reshape.inputs[0]), graph.shape(reshape.outputs[0])
    return before is not None and before == after and dynamic_axes(graph, reshape.inputs[0]) == dynamic_axes(
        graph, reshape.outputs[0])


def shape_readers_die(graph: Graph, nodes: Sequence[gs.Node]) -> bool:
    """True when every reader of the pattern's inner tensors lies in the pattern or is a `Shape` whose computation
    ends inside the pattern (it is then removed with it)."""
    inside = {n.name for n in nodes}
    frontier = [r for n in nodes[1:] for t in n.outputs for r in t.outputs if r.name not in inside]
    if any(r.op != "Shape" for r in frontier):
        return False
    seen: set[str] = set()
    while frontier:
        reader = frontier.pop()
        if reader.name in inside or reader.name in seen:
            continue
        seen.add(reader.name)
        if len(seen) > _SHAPE_CONE_LIMIT or any(graph.is_output(t) for t in reader.outputs):
            return False
        frontier.extend(r for t in reader.outputs for r in t.outputs)
    return True


def _heads_of(graph: Graph, transpose: gs.Node, perm: tuple[int, ...],
              output_ok: bool = False) -> tuple[gs.Node, gs.Tensor] | None:
    """For `Transpose(Reshape(x, [B, S, H, Dh]), perm)`, both private (the Transpose's output may be a graph output
    with `output_ok`): (the Reshape, x) when x is [B, S, H*Dh]."""
    if perm_of(transpose, 4) != perm:
        return None
    reshape = sole_producer(graph, transpose, 0, "Reshape")
    if reshape is None or not sole_reader(graph, transpose.outputs[0], output_ok):
        return None
    x = reshape.inputs[0]
    before, after = graph.shape(x), graph.shape(reshape.outputs[0])
    if before is None or after is None or len(before) != 3 or len(after) != 4:
        return None
    if after[:2] != before[:2] or after[2] * after[3] != before[2]:
        return None
    moved_before, moved_after = dynamic_axes(graph, x), dynamic_axes(graph, reshape.outputs[0])
    if moved_before is None or moved_after is None or moved_after != (*moved_before[:2], False, False) or moved_before[2]:
        return None
    return reshape, x


def scaled_operand(graph: Graph, tensor: gs.Tensor) -> tuple[gs.Tensor, float, list[gs.Node]]:
    """A MatMul operand as (what is scaled, the scalar factor, the private Mul/Div nodes applying it)."""
    factor, nodes = 1.0, []
    producer = standard_producer(tensor)
    while producer is not None and producer.op in ("Mul", "Div") and sole_reader(graph, tensor):
        side = next((i for i in (1, 0) if scalar(constant_input(producer, i)) is not None
                     and graph.shape(producer.inputs[1 - i]) == graph.shape(tensor)), None)
        if side is None or (producer.op == "Div" and side == 0):
            break
        value = scalar(constant_input(producer, side))
        if producer.op == "Div" and value == 0:
            break
        factor *= 1 / value if producer.op == "Div" else value
        nodes.append(producer)
        tensor = producer.inputs[1 - side]
        producer = standard_producer(tensor)
    return tensor, factor, nodes


def _nan_guard(graph: Graph, context: gs.Node) -> tuple[gs.Node, list[gs.Node]] | None:
    """For `Where(IsNaN(P), 0, P)` feeding the context MatMul, with P = Softmax(..) read by nothing else: (the Softmax,
    the guard's nodes).  Exporters write it so that a query row whose keys are all masked attends to nothing."""
    where = sole_producer(graph, context, 0, "Where")
    if where is None or len(where.inputs) != 3 or scalar(constant_input(where, 1)) != 0.0:
        return None
    probs = where.inputs[2]
    isnan = sole_producer(graph, where, 0, "IsNaN")
    softmax = standard_producer(probs)
    if (isnan is None or isnan.inputs[0] is not probs or softmax is None or softmax.op != "Softmax"
            or graph.is_output(probs) or len(probs.outputs) != 2):
        return None
    return softmax, [where, isnan]


MASK_FILL = -1e9
"""A masked score at or below this gets probability 0 in float32 whether it is replaced (`Where`) or added to (a bias):
exp underflows long before, for any score short of 1e8."""


def _where_mask(where: gs.Node) -> tuple[gs.Tensor, np.ndarray] | None:
    """A fixed causal mask `Where(C, fill, scores)` or `Where(C, scores, fill)` (C constant, fill below `MASK_FILL`,
    a `masked_fill` triangle) as (the scores, the additive bias it equals); None where a row masks every key."""
    condition = constant_input(where, 0)
    if condition is None or condition.dtype != np.bool_ or len(where.inputs) != 3:
        return None
    for fill_at, scores_at, masked in ((1, 2, condition), (2, 1, ~condition)):
        fill = scalar(constant_input(where, fill_at))
        if fill is not None and fill <= MASK_FILL and constant_input(where, scores_at) is None:
            if masked.ndim < 2 or masked.all(axis=-1).any():
                return None
            bias = np.where(masked, np.float32(fill), np.float32(0)).astype(np.float32)
            return where.inputs[scores_at], bias
    return None


def probabilities(graph: Graph, merge: gs.Node, keep_shape: bool) -> tuple | str:
    """For the heads `merge` transposes back: (the MatMul of probabilities and values, the Reshape between them if
    any, which with `keep_shape` must give its input's shape back, the Softmax, the NaN guard's nodes), or a reason."""
    context, between = sole_producer(graph, merge, 0, "MatMul"), []
    if context is None and (reshape := sole_producer(graph, merge, 0, "Reshape")) is not None and (
            not keep_shape or keeps_shape(graph, reshape)):
        context, between = sole_producer(graph, reshape, 0, "MatMul"), [reshape]
    if context is None:
        return "the heads are not a MatMul of probabilities and values"
    softmax, guard = sole_producer(graph, context, 0, "Softmax"), []
    if softmax is None and (found := _nan_guard(graph, context)) is not None:
        softmax, guard = found
    cast = sole_producer(graph, context, 0, "Cast") if softmax is None else None
    same = cast is not None and np_dtype(cast.outputs[0]) is not None and (
        np_dtype(cast.inputs[0]) == np_dtype(cast.outputs[0]))
    if same:
        softmax, guard = sole_producer(graph, cast, 0, "Softmax"), [cast]  # GPT-2's `.type(value.dtype)`: a no-op
    if softmax is None or normalize_axis(softmax.attrs.get("axis", -1 if graph.opset >= 13 else 1), 4) != 3:
        return "the probabilities are not a Softmax over the last axis"
    return context, between, softmax, guard


class _Heads(NamedTuple):
    """Keys or values split into heads ([B, H, T, Dh]) as attention reads them."""

    reshape: gs.Node  # the split's Reshape
    source: gs.Tensor  # what is split: the new keys or values, [B, S, hidden]
    nodes: list[gs.Node]  # the Transpose, and the Concat appending it to the past state
    past: gs.Tensor | None  # the state [B, H, P, Dh] the new heads are appended to (a decoder's KV cache)
    present: gs.Tensor | None  # the heads, past included, where the model outputs them as the next step's state


def _cached_heads(graph: Graph, tensor: gs.Tensor) -> _Heads | None:
    """The heads that `tensor` holds: `Transpose(Reshape(x), (0, 2, 1, 3))`, or that appended to a past state
    (`Concat(past, heads, axis=2)`, a decode step; TorchScript writes a one-input Concat where there is no past);
    either may be a graph output, the present state."""
    producer, concat, past = standard_producer(tensor), None, None
    if producer is not None and producer.op == "Concat" and len(producer.inputs) in (1, 2):
        shapes = [graph.shape(t) for t in (*producer.inputs, tensor)]
        if any(s is None or len(s) != 4 for s in shapes) or normalize_axis(producer.attrs.get("axis", 0), 4) != 2:
            return None
        concat, past = producer, producer.inputs[0] if len(producer.inputs) == 2 else None
        if not sole_reader(graph, tensor, output_ok=True):
            return None
        producer = sole_producer(graph, concat, len(concat.inputs) - 1, "Transpose")
    if producer is None or producer.op != "Transpose":
        return None
    found = _heads_of(graph, producer, (0, 2, 1, 3), output_ok=concat is None)
    if found is None:
        return None
    present = tensor if concat is not None or graph.is_output(tensor) else None
    return _Heads(found[0], found[1], [producer, *([concat] if concat else [])], past, present)


def last_axes_swapped(graph: Graph, tensor: gs.Tensor) -> tuple[gs.Tensor, list[gs.Node]] | None:
    """For a private K^T ([B, H, Dh, T]) of heads K ([B, H, T, Dh]) written as `Transpose(K, (0, 1, 3, 2))` or (the
    dynamo exporter) `Reshape(Transpose(Reshape(K, [B*H, T, Dh])), [B, H, Dh, T])`: (K, the nodes in between)."""
    k_t = standard_producer(tensor)
    if k_t is None or not sole_reader(graph, tensor):
        return None
    if k_t.op == "Transpose":
        return (k_t.inputs[0], [k_t]) if perm_of(k_t, 4) == (0, 1, 3, 2) else None
    if k_t.op != "Reshape":
        return None
    swap = sole_producer(graph, k_t, 0, "Transpose")
    flat = None if swap is None or perm_of(swap, 3) != (0, 2, 1) else sole_producer(graph, swap, 0, "Reshape")
    if flat is None:
        return None
    split, flat_shape, out = graph.shape(flat.inputs[0]), graph.shape(flat.outputs[0]), graph.shape(k_t.outputs[0])
    if split is None or len(split) != 4 or flat_shape != (split[0] * split[1], split[2], split[3]) or out != (
            split[0], split[1], split[3], split[2]):
        return None
    return flat.inputs[0], [k_t, swap, flat]


def _keys_transposed(graph: Graph, tensor: gs.Tensor) -> tuple[_Heads, list[gs.Node]] | None:
    """K^T as [B, H, Dh, T] from K split into heads ([B, H, T, Dh], see `_cached_heads`): `Transpose(heads,
    (0, 2, 3, 1))`, a swap of the last two axes after the split, or (the dynamo exporter)
    `Reshape(Transpose(Reshape(K, [B*H, T, Dh])), [B, H, Dh, T])`.  Returns (the heads, the nodes in between)."""
    k_t = standard_producer(tensor)
    if k_t is not None and k_t.op == "Transpose" and sole_reader(graph, tensor):
        key = _heads_of(graph, k_t, (0, 2, 3, 1))
        if key is not None:
            return _Heads(key[0], key[1], [], None, None), [k_t]
    swapped = last_axes_swapped(graph, tensor)
    heads = None if swapped is None else _cached_heads(graph, swapped[0])
    return (heads, swapped[1]) if heads is not None else None


class _Found(NamedTuple):
    """An attention `AttentionFusion` matched."""

    nodes: list[gs.Node]
    query: gs.Tensor
    key: _Heads
    value: _Heads
    mask: gs.Tensor | None
    bias: np.ndarray | None  # a constant Where mask as the additive bias it is equivalent to, [1, 1, S, T]
    where: int | None  # that Where's place among the nodes (`rewrite` computes the bias again from it)
    guarded: bool
    heads: int
    scale: float
    flat: bool  # the output is [B*S, hidden] (GPT-2 reshapes it for its Gemm) rather than [B, S, hidden]


class AttentionFusion(Rule):
    """Replaces multi-head attention on [B, S, hidden] queries, keys and values with onnxruntime's `MultiHeadAttention`.

        q --> Reshape --> Transpose(0,2,1,3) --> [Mul(s)] -----+
        k --> Reshape --> Transpose(0,2,3,1) --> [Mul(s)] --> MatMul --> [Mul or Div(s)] --> [Add(mask)] --> Softmax
                                                                                                              |
                                                                                       [Where(IsNaN(p), 0, p)]
                                                                                                              |
        v --> Reshape --> Transpose(0,2,1,3) -------------------------------------------------------------> MatMul
                                                                                                              |
                                                                  Reshape([B, S, hidden]) <-- Transpose(0,2,1,3)

    (in brackets: what may be absent).  Both torch exporters write Hugging Face's attention this way (BERT, GPT-2:
    scaled dot-product attention decomposed, the scale split between Q and K, the additive mask, the NaN guard);
    TorchScript transposes K with one 4-D Transpose, dynamo with a Reshape-Transpose-Reshape in 3-D.  The zoo's
    GPT-2 (TorchScript) masks its fixed causal triangle with `Where(C, fill, scores)` in the place of the Add.

    An additive mask on the scores (`Softmax(s * Q.K^T + mask)`, as exporters write `attention_mask`) becomes its
    `attention_bias`, and so does a fixed causal mask written as `Where(C, fill, scores)` (`_where_mask`); the
    exporters' NaN guard after the Softmax is kept on the fused output (`attention-nan-guard-elim` drops it where the
    masks are finite).  A decoder's KV cache
    (GPT-2: keys and values appended to past ones and output as the present state) becomes the operator's past inputs
    and present outputs."""

    name = "attention-fusion"
    root_ops = ("Reshape",)
    contrib = True

    def _pattern(self, graph: Graph, node: gs.Node) -> _Found | str:
        """The attention `Reshape(Transpose(Softmax(s * Q.K^T [+ mask]).V))` with Q, K and V split into heads, or a
        reason."""
        merge = sole_producer(graph, node, 0, "Transpose")
        if merge is None or perm_of(merge, 4) != (0, 2, 1, 3):
            return "not a Reshape of heads transposed back ([B, H, S, Dh] -> [B, S, H, Dh])"
        found = probabilities(graph, merge, keep_shape=True)  # a reshape to [B, -1, S, Dh] that keeps it
        if isinstance(found, str):
            return found
        context, kept, softmax, guard = found
        mask, bias, mask_nodes, sides = None, None, [], [softmax.inputs[0]]
        add = sole_producer(graph, softmax, 0, "Add")
        where = sole_producer(graph, softmax, 0, "Where") if add is None else None
        if add is not None:
            mask_nodes, sides = [add], list(add.inputs)
        elif where is not None and (constant_mask := _where_mask(where)) is not None:
            mask_nodes, sides, bias = [where], [constant_mask[0]], constant_mask[1]
        for i, side in enumerate(sides):
            scores, scale, scale_nodes = scaled_operand(graph, side)
            qk = standard_producer(scores)
            if qk is not None and qk.op == "MatMul" and sole_reader(graph, scores):
                mask = add.inputs[1 - i] if add is not None else None
                break
        else:
            return "something other than a scale and an additive mask lies between the scores and the Softmax"
        q_in, q_scale, q_nodes = scaled_operand(graph, qk.inputs[0])
        k_in, k_scale, k_nodes = scaled_operand(graph, qk.inputs[1])
        q_t = standard_producer(q_in)
        if q_t is None or q_t.op != "Transpose" or not sole_reader(graph, k_in):
            return "Q or K is not a Transpose of heads"
        query, keys, value = (_heads_of(graph, q_t, (0, 2, 1, 3)), _keys_transposed(graph, k_in),
                              _cached_heads(graph, context.inputs[1]))
        if query is None or keys is None or value is None:
            return "Q, K or V is not a private [B, S, hidden] tensor split into heads"
        key, k_nodes = keys[0], [*k_nodes, *keys[1]]
        if (key.past is None) != (value.past is None) or (key.present is None) != (value.present is None):
            return "keys and values do not both have a past state, or do not both output the present one"
        shapes = [graph.shape(t) for t in (query[1], key.source, value.source, node.outputs[0])]
        heads = graph.shape(query[0].outputs[0])[2]
        flat = shapes[3] == (shapes[0][0] * shapes[0][1], shapes[0][2])
        if not (shapes[0][0] == shapes[1][0] == shapes[2][0] and shapes[1][1] == shapes[2][1]
                and shapes[0][2] == shapes[1][2] == shapes[2][2] and (shapes[3] == shapes[0] or flat)
                and graph.shape(key.reshape.outputs[0])[2] == graph.shape(value.reshape.outputs[0])[2] == heads):
            return "Q, K, V and the output disagree on batch, length, hidden size or heads"
        moved = dynamic_axes(graph, query[1])
        expected = (moved[0] or moved[1], moved[2]) if flat and moved is not None else moved
        if dynamic_axes(graph, node.outputs[0]) != expected:
            return "the output does not follow the query's dynamic dimensions"
        if not all(is_float(t) and np.dtype(t.dtype) == np.float32 for t in (query[1], key.source, value.source)):
            return "not float32"
        if key.past is not None and graph.shape(key.past) != graph.shape(value.past):
            return "the past keys and values differ in shape"
        if bias is not None:
            total = graph.shape(key.present)[2] if key.present is not None else shapes[1][1]
            if (bias.shape[-2:] != (shapes[0][1], total) or any(d != 1 for d in bias.shape[:-2]) or moved is None
                    or any(moved)):
                return "the constant mask is not [S, T] for a query of fixed shape"
            bias = bias.reshape(1, 1, *bias.shape[-2:])
        if mask is not None:
            batch, length = shapes[0][0], shapes[0][1]
            total = graph.shape(key.present)[2] if key.present is not None else shapes[1][1]
            m = graph.shape(mask)
            if (m is None or len(m) != 4 or m[0] not in (1, batch) or m[1] not in (1, heads) or m[2] not in (1, length)
                    or m[3] != total or not is_float(mask) or np.dtype(mask.dtype) != np.float32):
                return "the mask added to the scores is not float32 [B or 1, H or 1, S or 1, T]"
        nodes = [node, merge, *kept, context, *guard, softmax, *mask_nodes, *scale_nodes, qk, *q_nodes, q_t, query[0],
                 *k_nodes, key.reshape, *key.nodes, value.reshape, *value.nodes]
        if not shape_readers_die(graph, nodes):
            return "a tensor inside the attention is read elsewhere (other than by shape computations it feeds)"
        where_at = next(i for i, n in enumerate(nodes) if n is mask_nodes[0]) if bias is not None else None
        return _Found(nodes, query[1], key, value, mask, bias, where_at, bool(guard), heads,
                      float(np.float32(scale * q_scale * k_scale)), flat)

    def check(self, graph: Graph, node: gs.Node) -> Match | NoMatch:
        found = self._pattern(graph, node)
        if isinstance(found, str):
            return self.no(node, found)
        nodes, locate, key, value = found.nodes, self.locate, found.key, found.value
        return self.match(nodes, heads=found.heads, scale=found.scale,
                          masked=found.mask is not None or found.bias is not None,
                          guarded=found.guarded, cached=key.present is not None, flat=found.flat,
                          query=locate(nodes, found.query), key=locate(nodes, key.source),
                          value=locate(nodes, value.source), mask=locate(nodes, found.mask),
                          where_mask=found.where, past_key=locate(nodes, key.past),
                          past_value=locate(nodes, value.past), present_key=self.locate_output(nodes, key.present),
                          present_value=self.locate_output(nodes, value.present))

    def rewrite(self, graph: Graph, match: Match, nodes: dict[str, gs.Node]) -> None:
        node = nodes[match.root]
        query, present = match.input("query", nodes), match.output("present_key", nodes)
        mask = match.input("mask", nodes)
        if match.param("where_mask") is not None:  # the Where's constant mask as the bias it equals, [1, 1, S, T]
            _, bias = _where_mask(nodes[match.nodes[match.param("where_mask")]])
            mask = graph.add_constant(bias.reshape(1, 1, *bias.shape[-2:]), "attention_bias")
        if mask is not None and graph.shape(mask)[2] == 1:  # the classic key-padding mask [B, 1, 1, T]
            mask = expand_rows(graph, mask, query)
        empty = gs.Variable.empty
        inputs = [query, match.input("key", nodes), match.input("value", nodes), empty(), empty(),
                  mask if mask is not None else empty()]
        if match.param("past_key") is not None:
            inputs += [match.input("past_key", nodes), match.input("past_value", nodes)]
        while not inputs[-1].name:
            inputs.pop()
        out = gs.Variable(graph.fresh_name("attention"))
        outputs = [out]
        if present is not None:  # the next step's state: keys and values with the past, [B, H, T, Dh]
            outputs += [gs.Variable(graph.fresh_name("present_key")), gs.Variable(graph.fresh_name("present_value"))]
        graph.add_node("MultiHeadAttention", inputs, outputs,
                       {"num_heads": match.param("heads"), "scale": match.param("scale")}, domain=MS)
        out.dtype, out.shape = query.dtype, query.shape
        if match.param("guarded"):  # a query row with every key masked: the Softmax gives NaN there, the guard 0
            zero = graph.add_constant(np.zeros((), np.float32), "zero")
            out = emit(graph, "Where", [emit(graph, "IsNaN", [out]), zero, out])
            out.dtype, out.shape = query.dtype, query.shape
        if match.param("flat"):
            hidden = graph.shape(query)[2]
            out = emit(graph, "Reshape", [out, graph.add_constant(np.array([-1, hidden], np.int64), "flat")])
        replace_typed(graph, node.outputs[0], out)
        if present is not None:
            replace_typed(graph, present, outputs[1])
            replace_typed(graph, match.output("present_value", nodes), outputs[2])
