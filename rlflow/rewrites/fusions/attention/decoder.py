"""Decoder attention fusions: the attention of decoder LLMs (Llama, Qwen3 and their copies: a KV cache, grouped-query
heads, a causal and padding mask) into onnxruntime's `GroupQueryAttention` or `MultiHeadAttention`, or the standard
`Attention` of opset 23.

Both torch exporters decompose transformers' sdpa attention: the new keys and values appended to the cache
(`Concat(past, new, axis=2)`, the present state, a graph output), the KV heads repeated to the query heads
(`Reshape(Expand(Unsqueeze(kv, 2)))`; TorchScript's decode step instead groups the query heads by KV head,
`Reshape(Q, [B, kvN, rep*S, Dh])`), the scores scaled (the scale split between Q and K), the mask added, Softmax,
the NaN guard, and the context.  The query and the new keys are whatever [B, heads, S, Dh] tensors the rotary
embedding leaves, decomposed or fused.

The mask goes in as it is (`attention_bias`, `attn_mask`), so any padding the model accepts is honoured.  A query
whose keys are all masked is a case apart: dynamo fills with the lowest float, so in float32 the row's scores vanish
into the fill and it averages every value; TorchScript fills with -inf and the NaN guard makes the row 0.
GroupQueryAttention computes both alike only with `causal=0` (its causal mode zeroes such a row; the mask carries
causality anyway), MultiHeadAttention as it is; the standard Attention zeroes a row whose mask holds the lowest float,
so a float32 mask's lowest values are raised one step for it.  In float16, onnxruntime's CPU runs the export's sum and
Softmax in float32, as the fused kernels do, but the standard Attention rounds such a row otherwise: it takes float16
masks filled with -inf only.  TorchScript's float16 export computes the softmax in float32 (Casts of the scores and
values, a float32 mask): the operator then runs in float16 with the mask narrowed, which only a -inf fill survives.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np
import onnx_graphsurgeon as gs
from onnx import TensorProto

from rlflow.graph.core import Graph
from rlflow.graph.dynamic_axes import dynamic_axes
from rlflow.rewrites.base import Match, NoMatch, Rule
from rlflow.rewrites.edits import emit, replace_typed
from rlflow.rewrites.fusions.attention.encoder import (
    AttentionFusion,
    keeps_shape,
    last_axes_swapped,
    probabilities,
    scaled_operand,
    shape_readers_die,
    sole_producer,
    sole_reader,
)
from rlflow.rewrites.queries import MS, constant_input, normalize_axis, np_dtype, perm_of, scalar, standard_producer

_TYPES = (np.dtype(np.float32), np.dtype(np.float16))
"""Element types of every form's CPU and CUDA kernels."""

_STATIC_1 = (1, False)

_UNSPLIT = AttentionFusion()
"""attention-fusion, whose MultiHeadAttention on the [B, S, hidden] projections the contrib forms leave it."""


def _dims(graph: Graph, tensor: gs.Tensor) -> tuple[tuple[int, bool], ...] | None:
    """A tensor's dimensions as (size, dynamic) pairs, or None when unknown: two tensors whose pairs agree have the
    same shape at these sizes and at others of the model's dynamic dimensions (as far as one size tells)."""
    shape, moved = graph.shape(tensor), dynamic_axes(graph, tensor)
    return None if shape is None or moved is None else tuple(zip(shape, moved))


class _Kv(NamedTuple):
    """Keys or values as attention reads them."""

    attended: gs.Tensor  # what the scores or the context read: [B, heads, T, Dh] (KV heads repeated or not)
    full: gs.Tensor  # every position, KV heads: [B, kvN, T, Dh] (the present state where there is a cache)
    new: gs.Tensor  # this step's, [B, kvN, S, Dh]
    past: gs.Tensor | None  # the cache [B, kvN, P, Dh]
    repeat: list[gs.Node]  # Unsqueeze, Expand, Reshape repeating the KV heads (none: not repeated)
    concat: list[gs.Node]  # the Concat appending the new to the past (none: no cache)


def _kv(graph: Graph, attended: gs.Tensor) -> _Kv | str:
    """Keys or values [B, heads, T, Dh] read by attention: `Reshape(Expand(Unsqueeze(full, 2)))` or `full` itself,
    `full` being `Concat(past, new, axis=2)` or the new ones; a reason when the repetition is not one."""
    reshape, repeat, full = standard_producer(attended), [], attended
    if reshape is not None and reshape.op == "Reshape" and sole_reader(graph, attended):
        expand = sole_producer(graph, reshape, 0, "Expand")
        unsqueeze = sole_producer(graph, expand, 0, "Unsqueeze") if expand is not None else None
        if unsqueeze is not None:
            full, repeat = unsqueeze.inputs[0], [unsqueeze, expand, reshape]
            d, e, out = _dims(graph, full), _dims(graph, expand.outputs[0]), _dims(graph, attended)
            if (d is None or len(d) != 4 or _dims(graph, unsqueeze.outputs[0]) != (*d[:2], _STATIC_1, *d[2:])
                    or e is None or len(e) != 5 or e[2][1] or e != (*d[:2], e[2], *d[2:]) or out is None
                    or out != (d[0], (d[1][0] * e[2][0], False), *d[2:]) or d[1][1]):
                return "the KV heads are not repeated as Reshape(Expand(Unsqueeze(kv, 2)), [B, heads, T, Dh])"
    concat, past, new = standard_producer(full), None, full
    if (concat is not None and concat.op == "Concat" and len(concat.inputs) == 2
            and normalize_axis(concat.attrs.get("axis", 0), 4) == 2):
        past, new = concat.inputs
    return _Kv(attended, full, new, past, repeat, [concat] if past is not None else [])


class _Found(NamedTuple):
    """A decoder attention: its core (root first: the output Reshape back to [B, S, hidden], down to the scores), the
    tensors around it and what the fused forms need to know."""

    core: list[gs.Node]
    query: gs.Tensor  # [B, N, S, Dh]
    key: _Kv
    value: _Kv
    mask: gs.Tensor | None  # added to the scores, [B or 1, 1, S, T]
    guarded: bool  # the NaN guard `Where(IsNaN(p), 0, p)` on the probabilities
    grouped: bool  # the query heads grouped by KV head (TorchScript's decode step), KV heads not repeated
    heads: int
    kv_heads: int
    scale: float
    single: bool  # S is 1 at every size
    widened: bool  # float16 attention with its softmax and context in float32 (TorchScript's float16 export)


def _fill(mask: gs.Tensor | None) -> float | None:
    """The masked value of a mask written `Where(c, 0, fill)` or `Where(c, fill, 0)` with constant branches (the
    exporters' form), else None."""
    where = standard_producer(mask) if mask is not None else None
    if where is None or where.op != "Where" or len(where.inputs) != 3:
        return None
    a, b = scalar(constant_input(where, 1)), scalar(constant_input(where, 2))
    return b if a == 0.0 else a if b == 0.0 else None


def _widened(graph: Graph, tensor: gs.Tensor) -> tuple[gs.Tensor, list[gs.Node]]:
    """(the float16 tensor a private Cast widens to `tensor` in float32, [the Cast]), else (`tensor`, [])."""
    cast = standard_producer(tensor)
    if (cast is not None and cast.op == "Cast" and sole_reader(graph, tensor) and np_dtype(tensor) == np.float32
            and np_dtype(cast.inputs[0]) == np.float16):
        return cast.inputs[0], [cast]
    return tensor, []


def _pattern(graph: Graph, node: gs.Node) -> _Found | str:
    """The attention that `node` reshapes back to [B, S, hidden], or a reason."""
    merge = sole_producer(graph, node, 0, "Transpose")
    if merge is None or perm_of(merge, 4) != (0, 2, 1, 3):
        return "not a Reshape of heads transposed back ([B, N, S, Dh] -> [B, S, N, Dh])"
    found = probabilities(graph, merge, keep_shape=False)
    if isinstance(found, str):
        return found
    context, between, softmax, guard = found
    add = sole_producer(graph, softmax, 0, "Add")
    mask, mask_nodes, qk = None, [add] if add is not None else [], None
    for i, side in enumerate(add.inputs if add is not None else softmax.inputs):
        scores, scale, scale_nodes = scaled_operand(graph, side)
        scores, widen = _widened(graph, scores)
        qk = standard_producer(scores)
        if qk is not None and qk.op == "MatMul" and sole_reader(graph, scores):
            mask = add.inputs[1 - i] if add is not None else None
            break
    else:
        return "something other than a scale and an additive mask lies between the scores and the Softmax"
    q_in, q_scale, q_nodes = scaled_operand(graph, qk.inputs[0])
    group = standard_producer(q_in) if sole_reader(graph, q_in) else None
    grouped = group is not None and group.op == "Reshape" and bool(between)
    if grouped:
        q_in, more_scale, more_nodes = scaled_operand(graph, group.inputs[0])
        q_scale, q_nodes = q_scale * more_scale, [*q_nodes, group, *more_nodes]
    k_in, k_scale, k_nodes = scaled_operand(graph, qk.inputs[1])
    swapped = last_axes_swapped(graph, k_in)
    if swapped is None:
        return "the scores' right side is not K with its last two axes swapped"
    v_in, v_widen = _widened(graph, context.inputs[1])
    key, value = _kv(graph, swapped[0]), _kv(graph, v_in)
    if isinstance(key, str) or isinstance(value, str):
        return key if isinstance(key, str) else value
    q, kf, kn, out = (_dims(graph, t) for t in (q_in, key.full, key.new, node.outputs[0]))
    if q is None or kf is None or kn is None or out is None or len(q) != 4 or len(kf) != 4:
        return "Q or K is not 4-D of known shape"
    b, (n, moving_n), s, (d, moving_d) = q
    kv_heads, t = kf[1][0], kf[2]
    if moving_n or moving_d or kf[1][1] or kf[0] != b or kf[3] != q[3] or n % kv_heads:
        return "Q and K disagree on batch or head size, or the heads are dynamic or not a multiple of the KV heads"
    if kn != (b, kf[1], s, q[3]) or _dims(graph, value.full) != kf or _dims(graph, value.new) != kn:
        return "the new keys, the values and the query disagree on their shapes ([B, kvN, S, Dh])"
    if key.past is not None:
        p = _dims(graph, key.past)
        if value.past is None or _dims(graph, value.past) != p or p is None or p[2][0] + s[0] != t[0] or (
                p[2][1] or s[1]) != t[1]:
            return "the past keys and values are not [B, kvN, P, Dh] with P + S positions in all"
    elif value.past is not None:
        return "the values have a cache and the keys none"
    heads = kv_heads if grouped else n
    for kv in (key, value):
        if _dims(graph, kv.attended) != (b, (heads, False), t, q[3]) or (not grouped and not kv.repeat and heads
                                                                          != kv_heads):
            return "attention reads keys or values of other heads than the query's"
    if grouped:
        rows = (b, (kv_heads, False), ((n // kv_heads) * s[0], False), q[3])
        if s != _STATIC_1 or _dims(graph, q_in) != q or _dims(graph, group.outputs[0]) != rows or _dims(
                graph, between[0].inputs[0]) != rows or _dims(graph, between[0].outputs[0]) != q:
            return "the query is not grouped by KV head as one position's [B, kvN, N/kvN, Dh]"
    elif between and not keeps_shape(graph, between[0]):
        return "a Reshape between the context and its transpose changes its shape"
    if out != (b, s, (n * d, False)):
        return "the output is not [B, S, heads * head size]"
    if mask is not None:
        m = _dims(graph, mask)
        if m is None or len(m) != 4 or m[0] not in (b, _STATIC_1) or m[1] != _STATIC_1 or m[2:] != (s, t):
            return "the mask added to the scores is not [B or 1, 1, S, T]"
    dtype, wide = np_dtype(q_in), np_dtype(node.outputs[0])
    if (dtype not in _TYPES or np_dtype(key.new) != dtype or np_dtype(value.new) != dtype or wide != (
            np.float32 if widen and v_widen else dtype) or (mask is not None and np_dtype(mask) != wide)):
        return "not float32 or float16 throughout (or float16 with the softmax in float32)"
    if widen and mask is not None and _fill(mask) != -np.inf:
        return "a float32 mask on float16 attention not filled with -inf (float16 has no lowest float32)"
    core = [node, merge, *between, context, *v_widen, *guard, softmax, *mask_nodes, *scale_nodes, *widen, qk,
            *q_nodes, *k_nodes, *swapped[1]]
    return _Found(core, q_in, key, value, mask, bool(guard), grouped, n, kv_heads,
                  float(np.float32(scale * q_scale * k_scale)), s == _STATIC_1, bool(widen))


class _DecoderAttention(Rule):
    """The pattern shared by the decoder attention rules; `cached` rules consume the cache's Concat and the KV heads'
    repetition as well."""

    root_ops = ("Reshape",)
    cached = True

    def _refusal(self, graph: Graph, found: _Found) -> str | None:
        """Why this form cannot take the attention found, or None."""
        return None

    def check(self, graph: Graph, node: gs.Node) -> Match | NoMatch:
        found = _pattern(graph, node)
        if isinstance(found, str):
            return self.no(node, found)
        reason = self._refusal(graph, found)
        if reason is None and self.contrib and not isinstance(_UNSPLIT._pattern(graph, node), str):
            reason = "attention-fusion takes it (MultiHeadAttention on the [B, S, hidden] projections)"
        if reason is not None:
            return self.no(node, reason)
        key, value, nodes = found.key, found.value, list(found.core)
        presents = ()
        if self.cached:
            nodes += [*key.repeat, *key.concat, *value.repeat, *value.concat]
            presents = tuple(kv.full for kv in (key, value) if kv.concat)
        inner = [t for n in nodes[1:] for t in n.outputs if graph.is_output(t)]  # the presents alone may be outputs
        if not shape_readers_die(graph, nodes) or any(not any(t is p for p in presents) for t in inner):
            return self.no(node, "a tensor inside the attention is read elsewhere (other than by shape computations)")
        locate = self.locate
        return self.match(
            nodes, heads=found.heads, kv_heads=found.kv_heads, scale=found.scale, guarded=found.guarded,
            single=found.single, grouped=found.grouped, widened=found.widened, query=locate(nodes, found.query),
            mask=locate(nodes, found.mask),
            key=locate(nodes, key.new if self.cached else key.attended),
            value=locate(nodes, value.new if self.cached else value.attended),
            past_key=locate(nodes, key.past) if self.cached else None,
            past_value=locate(nodes, value.past) if self.cached else None,
            present_key=self.locate_output(nodes, key.full) if presents else None,
            present_value=self.locate_output(nodes, value.full) if presents else None)

    def _finish(self, graph: Graph, match: Match, nodes: dict[str, gs.Node], op: str, inputs: list, attrs: dict,
                domain: str = MS) -> None:
        """Adds the fused node on `inputs` (None: absent), its present outputs replacing the model's, and its output
        (heads flattened where it is 4-D, in the model's type, NaN-guarded where the model guarded its probabilities)
        replacing the root's."""
        present = match.output("present_key", nodes)
        while inputs[-1] is None:
            inputs.pop()
        inputs = [t if t is not None else gs.Variable.empty() for t in inputs]
        outputs = [gs.Variable(graph.fresh_name("attention"))]
        if present is not None:  # the next step's cache, [B, kvN, T, Dh]
            outputs += [gs.Variable(graph.fresh_name("present_key")), gs.Variable(graph.fresh_name("present_value"))]
        graph.add_node(op, inputs, outputs, attrs, domain=domain)
        if present is not None:
            replace_typed(graph, present, outputs[1])
            replace_typed(graph, match.output("present_value", nodes), outputs[2])
        out, dtype = outputs[0], np_dtype(match.input("query", nodes))
        if domain != MS:  # the standard Attention's [B, N, S, Dh]
            out = _flat(graph, out, match.param("single"))
        if match.param("widened"):
            out, dtype = emit(graph, "Cast", [out], {"to": TensorProto.FLOAT}), np.dtype(np.float32)
        if match.param("guarded"):  # a query row with every key masked at -inf: NaN in the Softmax, 0 in the guard
            zero = graph.add_constant(np.zeros((), dtype), "zero")
            out = emit(graph, "Where", [emit(graph, "IsNaN", [out]), zero, out])
        replace_typed(graph, nodes[match.root].outputs[0], out)


def _mask(graph: Graph, match: Match, nodes: dict[str, gs.Node]) -> gs.Tensor | None:
    """The mask in the query's element type (a float32 mask of a widened float16 attention narrowed)."""
    mask = match.input("mask", nodes)
    return emit(graph, "Cast", [mask], {"to": TensorProto.FLOAT16}) if mask is not None and match.param(
        "widened") else mask


def _flat(graph: Graph, heads: gs.Tensor, single: bool) -> gs.Tensor:
    """[B, H, S, Dh] heads as [B, S, H*Dh] (one Reshape where S is 1 or the heads are a transposed [B, S, H, Dh])."""
    split = standard_producer(heads)
    if split is not None and split.op == "Transpose" and perm_of(split, 4) == (0, 2, 1, 3):
        heads = split.inputs[0]  # the [B, S, H, Dh] that was transposed (the values as split)
    elif not single:
        heads = emit(graph, "Transpose", [heads], {"perm": [0, 2, 1, 3]})
    target = np.array([0, 1 if single else 0, -1], np.int64)
    return emit(graph, "Reshape", [heads, graph.add_constant(target, "bsh")])


class GroupQueryAttentionFusion(_DecoderAttention):
    """Replaces a decoder's attention over its KV cache (the cache's Concat and repeated KV heads too) with onnxruntime's `GroupQueryAttention`.

        new K --> Concat(past K, ., axis=2) --> [repeat KV heads] --> K^T --+
        Q ---------------------------------------------------------> MatMul --> [* s] --> [+ mask] --> Softmax
                                                                                                          |
        new V --> Concat(past V, ., axis=2) --> [repeat KV heads] -------------------------------------> MatMul
                                                                      Reshape([B, S, N*Dh]) <-- Transpose(0,2,1,3)

    The operator reads Q and the new keys and values as [B, S, heads * Dh], the cache as it is, and writes the present
    state; `seqlens_k` (every row T - 1) and `total_sequence_length` (T) come from the cache's and the new keys'
    shapes, and the model's mask is its `attention_bias`, with `causal=0` (see the module's docstring).  onnxruntime
    runs a step of several positions over a cache at batch 1 only, so that form needs one position (a decode step)
    or no cache (a prefill), or a batch of 1."""

    name = "group-query-attention-fusion"
    contrib = True

    def _refusal(self, graph: Graph, found: _Found) -> str | None:
        if graph.opset < 15:
            return "the sequence lengths are computed with Shape(start, end), opset 15"
        if found.key.past is not None and not found.single and _dims(graph, found.query)[0] != _STATIC_1:
            return "several positions over a KV cache: GroupQueryAttention runs them at batch 1 only"
        return None

    def rewrite(self, graph: Graph, match: Match, nodes: dict[str, gs.Node]) -> None:
        single, past = match.param("single"), match.input("past_key", nodes)
        key, query = match.input("key", nodes), match.input("query", nodes)
        length = emit(graph, "Shape", [key], {"start": 2, "end": 3})
        if past is not None:
            length = emit(graph, "Add", [emit(graph, "Shape", [past], {"start": 2, "end": 3}), length])
        length = emit(graph, "Cast", [length], {"to": TensorProto.INT32})
        one, scalar = graph.add_constant(np.ones(1, np.int32), "one"), graph.add_constant(np.zeros(0, np.int64), "scalar")
        batch = emit(graph, "Shape", [query], {"start": 0, "end": 1})
        seqlens = emit(graph, "Expand", [emit(graph, "Sub", [length, one]), batch])
        total = emit(graph, "Reshape", [length, scalar])
        inputs = [_flat(graph, query, single), _flat(graph, key, single), _flat(graph, match.input("value", nodes), single),
                  past, match.input("past_value", nodes), seqlens, total, None, None, None, _mask(graph, match, nodes)]
        attrs = {"num_heads": match.param("heads"), "kv_num_heads": match.param("kv_heads"),
                 "scale": match.param("scale"), "causal": 0}
        self._finish(graph, match, nodes, "GroupQueryAttention", inputs, attrs)


class DecoderAttentionFusion(_DecoderAttention):
    """Replaces a decoder's attention on its repeated KV heads (scores, mask, Softmax, context) with onnxruntime's `MultiHeadAttention`.

        Q ------------------------------------------> MatMul --> [* s] --> [+ mask] --> Softmax --> MatMul
        K (cache and repeated KV heads kept) --> K^T ----^                                            |
        V (cache and repeated KV heads kept) -------------------------------------------------------^
                                                               Reshape([B, S, N*Dh]) <-- Transpose(0,2,1,3)

    The keys and values go in as the [B, N, T, Dh] tensors attention reads, the mask as `attention_bias`: exact at
    any shape and mask, a step of several positions over a cache included, which group-query-attention-fusion takes
    at batch 1 only.  The query grouped by KV head (TorchScript's decode step) has no such keys: refused."""

    name = "decoder-attention-fusion"
    contrib = True
    cached = False

    def _refusal(self, graph: Graph, found: _Found) -> str | None:
        return "the query is grouped by KV head: no keys of every query head" if found.grouped else None

    def rewrite(self, graph: Graph, match: Match, nodes: dict[str, gs.Node]) -> None:
        inputs = [_flat(graph, match.input("query", nodes), match.param("single")), match.input("key", nodes),
                  match.input("value", nodes), None, None, _mask(graph, match, nodes)]
        attrs = {"num_heads": match.param("heads"), "scale": match.param("scale")}
        self._finish(graph, match, nodes, "MultiHeadAttention", inputs, attrs)


class AttentionStandardFusion(_DecoderAttention):
    """Replaces a decoder's attention over its KV cache (the cache's Concat and repeated KV heads too) with the standard `Attention` (opset 23).

    The pattern of group-query-attention-fusion, into one operator of the default domain that takes Q, the new keys
    and values as [B, heads, S, Dh], the cache as `past_key`/`past_value` and the mask as `attn_mask`, and writes the
    present state (`--ops standard`, for models of opset 23 or later; onnxruntime 1.31 runs it on the CPU and CUDA).
    It zeroes a query row whose mask holds the lowest float, where a float32 export averages the values: such values of
    a float32 mask are raised one step; a float16 mask must be filled with -inf (see the module's docstring)."""

    name = "attention-standard-fusion"

    def _refusal(self, graph: Graph, found: _Found) -> str | None:
        if graph.opset < 23:
            return "Attention needs opset 23"
        if np_dtype(found.query) == np.float16 and found.mask is not None and _fill(found.mask) != -np.inf:
            return "a float16 mask not filled with -inf: Attention rounds a fully masked row otherwise than the export"
        return None

    def rewrite(self, graph: Graph, match: Match, nodes: dict[str, gs.Node]) -> None:
        query, mask = match.input("query", nodes), _mask(graph, match, nodes)
        if mask is not None and np_dtype(query) == np.float32:  # the lowest float one step up: not "masked" for it
            lowest = np.finfo(np.float32).min
            fill = [graph.add_constant(np.array(v, np.float32), "fill") for v in (lowest, np.nextafter(lowest, 0))]
            mask = emit(graph, "Where", [emit(graph, "Equal", [mask, fill[0]]), fill[1], mask])
        inputs = [query, match.input("key", nodes), match.input("value", nodes), mask, match.input("past_key", nodes),
                  match.input("past_value", nodes)]
        self._finish(graph, match, nodes, "Attention", inputs, {"scale": match.param("scale")}, domain="")
