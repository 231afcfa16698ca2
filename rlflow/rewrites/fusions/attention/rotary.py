"""Rotary position embedding (RoPE) fusions for decoder LLMs (transformers' Llama, Qwen3 and the models that copy their
attention): each query or key rotation `x * cos + rotate_half(x) * sin` into onnxruntime's contrib `RotaryEmbedding`
(or, from opset 23, the standard one); the inverse, rotary-unfuse, is in `fusions/unfuse.py`.

The export computes cos and sin for any position from the `inv_freq` constant; the fused operator looks them up in a
table by position id.  The rewrite computes that table as the export computes its values (angles in float32, then the
export's Casts and scale) for CACHE_POSITIONS positions.  onnxruntime refuses a position outside the table
(INVALID_ARGUMENT, both operators, on the CPU), so a longer sequence fails loudly, never silently.  Where the export
already looks cos and sin up in constant tables (`Gather(table, position_ids)`, as rotary-unfuse writes), those
tables are used as they are.  A match is one rotation (a query or a key): the shared cos/sin computation dies with its
last reader, and the rotations of a model share its tables (one cos and one sin per element type).
"""
from __future__ import annotations

import functools

import numpy as np
import onnx_graphsurgeon as gs
from onnx import TensorProto

from rlflow.graph.core import Graph
from rlflow.graph.dynamic_axes import dynamic_axes
from rlflow.rewrites.base import Match, NoMatch, Rule
from rlflow.rewrites.edits import emit, replace_typed
from rlflow.rewrites.queries import (
    MS,
    constant_input,
    has_input,
    normalize_axis,
    np_dtype,
    onnx_dtype_to_np,
    private,
    squeeze_axes,
    standard_producer,
)

CACHE_POSITIONS = 131072
"""Rows of a table computed from inv_freq: positions 0 to 131071, the longest context of Llama 3 and of Qwen3 with
YaRN (and the size onnxruntime's transformers optimizer gives its tables): 64 MiB for head size 128 in float32."""

_TYPES = (np.dtype(np.float32), np.dtype(np.float16))
"""Element types of onnxruntime's CPU RotaryEmbedding kernels (bfloat16 is declared, not run on the CPU)."""

_NOT_ROTARY = "not Add(x * cos, rotate_half(x) * sin)"


# ------------------------------------------------------------------------------------------- small integer values
def _ints(graph: Graph, tensor: gs.Tensor, depth: int = 8) -> list | None:
    """A small integer tensor's value, flat, with None for an element that follows a dynamic dimension; None when it is
    not computed from constants and shapes by the operators exporters write for Slice bounds (TorchScript's
    `Shape -> Gather -> Div -> Cast -> Unsqueeze`)."""
    value = Graph.constant(tensor)
    if value is not None:
        return [int(v) for v in value.reshape(-1)] if value.dtype.kind in "iu" and value.size <= 8 else None
    node = standard_producer(tensor)
    if node is None or depth == 0:
        return None
    if node.op == "Shape":
        shape, moving = graph.shape(node.inputs[0]), dynamic_axes(graph, node.inputs[0])
        if shape is None or moving is None:
            return None
        return [None if m else d for d, m in zip(shape, moving)][node.attrs.get("start", 0):node.attrs.get("end")]
    args = [_ints(graph, t, depth - 1) for t in node.inputs]
    if any(a is None for a in args):
        return None
    if node.op in ("Unsqueeze", "Squeeze", "Reshape", "Identity") or (
            node.op == "Cast" and (onnx_dtype_to_np(node.attrs["to"]) or np.dtype(bool)).kind in "iu"):
        return args[0]
    if node.op == "Concat":
        return sum(args, [])
    if node.op == "Gather" and node.attrs.get("axis", 0) == 0:
        data, index = args
        return [data[i] if -len(data) <= i < len(data) else None for i in index] if None not in index else None
    ops = {"Add": lambda a, b: a + b, "Sub": lambda a, b: a - b, "Mul": lambda a, b: a * b,
           "Div": lambda a, b: abs(a) // abs(b) * (1 if (a >= 0) == (b > 0) else -1) if b else None}
    if node.op in ops and len(args) == 2 and 1 in (len(args[0]), len(args[1])):
        a, b = (args[0] * len(args[1]), args[1]) if len(args[0]) == 1 else (args[0], args[1] * len(args[0]))
        return [None if p is None or q is None else ops[node.op](p, q) for p, q in zip(a, b)]
    return None


def _slice(graph: Graph, node: gs.Node | None) -> tuple[int, int, int] | None:
    """(axis, start, end) of a step-1 Slice along one axis of static size (bounds clamped to it), else None."""
    if node is None or node.op != "Slice" or len(node.inputs) < 3:
        return None
    shape = graph.shape(node.inputs[0])
    bounds = [_ints(graph, node.inputs[i]) if has_input(node, i) else [d] for i, d in ((1, 0), (2, 0), (3, 0), (4, 1))]
    if shape is None or any(b is None or len(b) != 1 or b[0] is None for b in bounds) or bounds[3] != [1]:
        return None
    (start,), (end,), (axis,), _ = bounds
    axis = normalize_axis(axis, len(shape))
    moving = dynamic_axes(graph, node.inputs[0])
    if axis is None or moving is None or moving[axis]:
        return None
    size = shape[axis]
    start, end = (min(max(v + size if v < 0 else v, 0), size) for v in (start, end))
    return axis, start, end


# --------------------------------------------------------------------------------------------------- the pattern
def _rotate_half(graph: Graph, tensor: gs.Tensor):
    """(x, the nodes) where `tensor` is `Concat(-x[..., h:], x[..., :h])` on x's last axis, h half of it; else None."""
    concat = standard_producer(tensor)
    if concat is None or concat.op != "Concat" or len(concat.inputs) != 2:
        return None
    neg, first = standard_producer(concat.inputs[0]), standard_producer(concat.inputs[1])
    second = standard_producer(neg.inputs[0]) if neg is not None and neg.op == "Neg" else None
    if second is None or first is None or first.op != "Slice" or first.inputs[0] is not second.inputs[0]:
        return None
    x, shape = first.inputs[0], graph.shape(first.inputs[0])
    if shape is None or not shape or shape[-1] % 2 or normalize_axis(concat.attrs.get("axis", 0), len(shape)) != len(
            shape) - 1:
        return None
    last, half = len(shape) - 1, shape[-1] // 2
    if _slice(graph, first) != (last, 0, half) or _slice(graph, second) != (last, half, 2 * half):
        return None
    return x, [concat, neg, second, first]


def _trig(graph: Graph, tensor: gs.Tensor):
    """(the source node, the value steps from it, in order) for `tensor` = Unsqueeze(., 1) of the source through Casts
    and a constant scale (`attention_scaling`), in any order; else None."""
    steps, unsqueezed, node = [], False, standard_producer(tensor)
    while node is not None and node.op in ("Unsqueeze", "Cast", "Mul"):
        rank = len(graph.shape(node.outputs[0]) or ())
        source = node.inputs[0]
        if node.op == "Unsqueeze":
            if unsqueezed or rank != 4 or squeeze_axes(node, rank) != (1,):
                return None
            unsqueezed = True
        elif node.op == "Cast":
            to = onnx_dtype_to_np(node.attrs["to"])
            if to is None or to.kind != "f":
                return None
            steps.append(("cast", str(to)))
        else:
            side = next((s for s in (0, 1) if (v := constant_input(node, s)) is not None and v.size == 1
                         and v.ndim <= rank and v.dtype.kind == "f"), None)
            if side is None:
                return None
            steps.append(("scale", float(constant_input(node, side).reshape(-1)[0])))
            source = node.inputs[1 - side]
        node = standard_producer(source)
    return (node, tuple(reversed(steps))) if node is not None and unsqueezed else None


def _angles(graph: Graph, emb: gs.Tensor):
    """(the node reading inv_freq, inv_freq, the node reading the position ids, the ids) where `emb` is Concat(f, f)
    on the last axis, f = float32(position_ids[..., None]) * inv_freq, or transformers 4's
    `(inv_freq[None, :, None] @ position_ids[:, None, :]).transpose(1, 2)`; else a reason."""
    concat, reason = standard_producer(emb), "the angles are not Concat(f, f), f = position_ids[..., None] * inv_freq"
    if concat is None or concat.op != "Concat" or len(concat.inputs) != 2 or concat.inputs[0] is not concat.inputs[1]:
        return reason
    freqs, shape = concat.inputs[0], graph.shape(concat.inputs[0])
    node = standard_producer(freqs)
    if shape is None or len(shape) != 3 or normalize_axis(concat.attrs.get("axis", 0), 3) != 2 or node is None or (
            np_dtype(freqs) != np.float32):
        return reason
    if node.op == "Transpose" and tuple(node.attrs.get("perm", ())) == (0, 2, 1):
        node, axis = standard_producer(node.inputs[0]), 1
    else:
        axis = 2
    if node is None or node.op != ("Mul" if axis == 2 else "MatMul"):
        return reason
    found = []
    for side in (0, 1):  # inv_freq: a constant, maybe through an Unsqueeze, a Cast to float32 or an Expand
        reader, tensor = node, node.inputs[side]
        while Graph.constant(tensor) is None and (p := standard_producer(tensor)) is not None and (
                p.op in ("Expand", "Unsqueeze") or (p.op == "Cast" and p.attrs.get("to") == TensorProto.FLOAT)):
            reader, tensor = p, p.inputs[0]
        found += [(side, reader, tensor)] if Graph.constant(tensor) is not None else []
    if len(found) != 1 or (axis == 1 and found[0][0] != 0):
        return "inv_freq is not a constant"
    side, inv_reader, inv_freq = found[0]
    inv = Graph.constant(inv_freq)
    # float16: `model.half()` converted the buffer, and the export casts it up before the product, exactly
    if inv.dtype not in (np.float32, np.float16) or inv.size != shape[2] or max(inv.shape, default=1) != shape[2] or (
            axis == 2 and inv.shape[-1] != shape[2]):
        return "the angles are not float32 positions times a float32 (or float16) inv_freq over the last axis"
    tensor, reader, unsqueezed = node.inputs[1 - side], None, False
    node = standard_producer(tensor)
    while not unsqueezed and node is not None and node.op in ("Cast", "Unsqueeze"):
        if node.op == "Unsqueeze" and squeeze_axes(node, 3) != (axis,):
            return reason
        unsqueezed = node.op == "Unsqueeze"
        reader, tensor = node, node.inputs[0]
        node = standard_producer(tensor)
    if not unsqueezed or np_dtype(tensor) != np.int64 or len(graph.shape(tensor) or ()) != 2:
        return "the angles are not of int64 position ids [batch, sequence]"
    return inv_reader, inv_freq, reader, tensor


def _lookups(concat: gs.Node):
    """(the Gather, the table, the position ids) where `concat` is Concat(g, g') on the last axis, g and g' rows of
    one 2-D constant table gathered by one index tensor; else None."""
    if concat.op != "Concat" or len(concat.inputs) != 2:
        return None
    gathers = [standard_producer(t) for t in concat.inputs]
    if any(g is None or g.op != "Gather" or g.attrs.get("axis", 0) != 0 for g in gathers):
        return None
    (g, h) = gathers
    table = Graph.constant(g.inputs[0])
    if table is None or table.ndim != 2 or g.inputs[0] is not h.inputs[0] or g.inputs[1] is not h.inputs[1] or (
            normalize_axis(concat.attrs.get("axis", 0), 3) != 2 or np_dtype(g.inputs[1]) != np.int64):
        return None
    return g, g.inputs[0], g.inputs[1]


def _apply_steps(value: np.ndarray, steps: tuple) -> np.ndarray:
    """A cos or sin table through the export's Casts and scale, in its order and element types."""
    for kind, arg in steps:
        value = value.astype(np.dtype(arg)) if kind == "cast" else value * np.array(arg, value.dtype)
    return value


@functools.lru_cache(maxsize=4)
def _tables(inv_freq: bytes, positions: int, steps: tuple) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin of `positions` rows of angles `position * inv_freq` (the product in float32, as the export makes
    it), through the export's steps; read-only, and one object per model, which the rotations share."""
    angles = (np.arange(positions, dtype=np.float32)[:, None] * np.frombuffer(inv_freq, np.float32)).astype(np.float64)
    tables = tuple(_apply_steps(f(angles).astype(np.float32), steps) for f in (np.cos, np.sin))
    for table in tables:
        table.flags.writeable = False
    return tables


def _same(a: np.ndarray, b: np.ndarray) -> bool:
    return a is b or (a.shape == b.shape and a.dtype == b.dtype and np.array_equal(a, b))


def _shared(graph: Graph, op: str, inputs: list[gs.Tensor], attrs: dict | None = None) -> gs.Tensor:
    """The output of a node `op(inputs)` that an earlier rewrite emitted (a constant input counts by value), else of
    a new one: the rotations of one model read one copy."""
    def same(a: gs.Tensor, b: gs.Tensor) -> bool:
        va, vb = Graph.constant(a), Graph.constant(b)
        return a is b or (va is not None and vb is not None and _same(va, vb))

    for node in inputs[0].outputs:
        if node.op == op and dict(node.attrs) == dict(attrs or {}) and len(node.inputs) == len(inputs) and all(
                same(a, b) for a, b in zip(node.inputs, inputs)):
            return node.outputs[0]
    return emit(graph, op, inputs, attrs)


class RotaryFusion(Rule):
    """Replaces the rotary embedding `x * cos + rotate_half(x) * sin` of a query or key with onnxruntime's `RotaryEmbedding`.

        position_ids --> Unsqueeze(-1) --> Cast(float) --> Mul(inv_freq) --> Concat(f, f) --> Cos, Sin
                             (or cos, sin = Concat(Gather(table, position_ids)) twice)           |
                                               Cast to x's type, scale, Unsqueeze(1) <-----------+
        x [B, N, S, D] --+--> Mul(cos) -----------------------------------------------> Add --> (the rotated x)
                         +--> Slice(D/2:) --> Neg --+--> Concat --> Mul(sin) -------------^
                         +--> Slice(:D/2) ----------+

    transformers' `apply_rotary_pos_emb` (Llama, Qwen3, after Qwen3's query and key norms) through either exporter:
    TorchScript computes the Slice bounds from `Shape(x)` and scales cos and sin by `attention_scaling` (1); both cast
    them to the model's type in float16.  The table is computed from inv_freq (CACHE_POSITIONS rows, scale folded in)
    in x's type; position ids of batch 1 broadcast against a larger batch are expanded to it.  A partial rotation
    (GPT-NeoX, Phi: `cat([rotate(x[..., :r]), x[..., r:]])`) is fused whole, with `rotary_embedding_dim` r.
    """

    name = "rotary-fusion"
    root_ops = ("Add",)
    contrib = True
    domain = MS

    def check(self, graph: Graph, node: gs.Node) -> Match | NoMatch:
        return self.matched(node, self._pattern(graph, node))

    def _pattern(self, graph: Graph, add: gs.Node):
        """(nodes, params) of the rotation `add` completes, or a reason."""
        muls = [standard_producer(t) for t in add.inputs]
        if len(muls) != 2 or any(m is None or m.op != "Mul" or len(m.inputs) != 2 for m in muls):
            return _NOT_ROTARY
        for by_cos, by_sin in (muls, muls[::-1]):
            for side in (0, 1):
                rotated = _rotate_half(graph, by_sin.inputs[side])
                if rotated is not None and any(t is rotated[0] for t in by_cos.inputs):
                    x, half_nodes = rotated
                    cos = by_cos.inputs[1] if by_cos.inputs[0] is x else by_cos.inputs[0]
                    return self._checked(graph, [add, by_cos, by_sin, *half_nodes], x, cos, by_sin.inputs[1 - side])
        return _NOT_ROTARY

    def _checked(self, graph: Graph, nodes: list[gs.Node], x: gs.Tensor, cos: gs.Tensor, sin: gs.Tensor):
        if any(not private(graph, n.outputs[0]) for n in nodes[1:]):
            return "a value inside the rotation is read elsewhere"
        shape, moving, dtype = graph.shape(x), dynamic_axes(graph, x), np_dtype(x)
        if dtype not in _TYPES:
            return "x is not float32 or float16 (onnxruntime's CPU kernels)"
        if shape is None or len(shape) != 4 or moving is None or moving[1] or moving[3]:
            return "x is not [batch, heads, sequence, head size] with static heads and head size"
        trig = [_trig(graph, cos), _trig(graph, sin)]
        if None in trig or trig[0][1] != trig[1][1]:
            return "cos and sin are not Unsqueeze(1) of Cos and Sin (or lookups) through the same Casts and scale"
        (cos_source, steps), (sin_source, _) = trig
        params = {"steps": steps, "inv": None, "cos": None, "sin": None}
        if cos_source.op == "Cos" and sin_source.op == "Sin" and cos_source.inputs[0] is sin_source.inputs[0]:
            found = _angles(graph, cos_source.inputs[0])
            if isinstance(found, str):
                return found
            inv_reader, inv_freq, reader, positions = found
            nodes += [inv_reader, reader]
            params["inv"], params["cache"] = self.locate(nodes, inv_freq), CACHE_POSITIONS
            half, source_type = Graph.constant(inv_freq).size, np.dtype(np.float32)
        else:
            lookups = [_lookups(cos_source), _lookups(sin_source)]
            if None in lookups or lookups[0][2] is not lookups[1][2]:
                return "cos and sin are neither computed from one Concat(f, f) nor looked up by one set of positions"
            nodes += [lookups[0][0], lookups[1][0]]
            params["cos"], params["sin"] = self.locate(nodes, lookups[0][1]), self.locate(nodes, lookups[1][1])
            tables = [Graph.constant(t[1]) for t in lookups]
            if tables[0].shape != tables[1].shape or tables[0].dtype != tables[1].dtype:
                return "the cos and sin tables differ in shape or type"
            half, source_type, positions = tables[0].shape[1], tables[0].dtype, lookups[0][2]
        if 2 * half != shape[3]:
            return "cos and sin do not cover the head size"
        if np.dtype(next((a for k, a in reversed(steps) if k == "cast"), source_type)) != dtype:
            return "cos and sin are not cast to x's type"
        at, moved = graph.shape(positions), dynamic_axes(graph, positions)
        if at is None or moved is None or graph.shape(cos) != (at[0], 1, at[1], shape[3]) or at[1] != shape[2] or (
                moved[1] != moving[2]):
            return "the position ids do not follow x's sequence axis"
        if at[0] == shape[0] and moved[0] == moving[0]:
            params["expand"] = False
        elif at[0] == 1 and not moved[0]:
            params["expand"] = True
        else:
            return "the position ids do not follow x's batch axis"
        params["positions"] = self.locate(nodes, positions)
        return self._whole(graph, nodes, x, params)

    def _whole(self, graph: Graph, nodes: list[gs.Node], x: gs.Tensor, params: dict):
        """(nodes, params) taking in a partial rotation's Slice and Concat, where x is the head's first part."""
        out, size = nodes[0].outputs[0], graph.shape(x)[3]
        cut, readers = standard_producer(x), out.outputs
        params.update(x=self.locate(nodes, x), out=self.locate_output(nodes, out), rotary_dim=0,
                      heads=graph.shape(x)[1])
        if cut is None or cut.op != "Slice" or len(readers) != 1 or readers[0].op != "Concat" or graph.is_output(out):
            return nodes, params
        whole, outer = cut.inputs[0], readers[0]
        full = graph.shape(whole)
        rest = standard_producer(outer.inputs[1]) if len(outer.inputs) == 2 and outer.inputs[0] is out else None
        if full is None or len(full) != 4 or _slice(graph, cut) != (3, 0, size) or size >= full[3] or rest is None or (
                rest.inputs[0] is not whole or _slice(graph, rest) != (3, size, full[3])) or normalize_axis(
                outer.attrs.get("axis", 0), 4) != 3:
            return nodes, params
        nodes += [cut, outer, rest]
        params.update(x=self.locate(nodes, whole), out=self.locate_output(nodes, outer.outputs[0]), rotary_dim=size)
        return nodes, params

    def rewrite(self, graph: Graph, match: Match, nodes: dict[str, gs.Node]) -> None:
        x, positions = match.input("x", nodes), match.input("positions", nodes)
        if match.param("expand"):  # [1, S] ids broadcast against the batch: ids of [B, S], as the kernel wants
            index = graph.add_constant(np.array([0, 2], np.int64), "batch_sequence")
            sizes = _shared(graph, "Gather", [_shared(graph, "Shape", [x]), index], {"axis": 0})
            positions = _shared(graph, "Expand", [positions, sizes])
        steps = match.param("steps")
        if match.param("inv") is not None:
            inv = np.ascontiguousarray(Graph.constant(match.input("inv", nodes)), np.float32).tobytes()
            tables = _tables(inv, match.param("cache"), steps)
        elif not steps:  # the export's own tables, as they are
            tables = tuple(match.input(k, nodes) for k in ("cos", "sin"))
        else:
            tables = tuple(_apply_steps(Graph.constant(match.input(k, nodes)), steps) for k in ("cos", "sin"))
        cos, sin = (t if isinstance(t, gs.Tensor) else self._constant(graph, t, hint)
                    for t, hint in zip(tables, ("cos_cache", "sin_cache")))
        attrs = {"interleaved": 0}
        if match.param("rotary_dim"):
            attrs.update(rotary_embedding_dim=match.param("rotary_dim"), num_heads=match.param("heads"))
        inputs = [x, positions, cos, sin] if self.domain == MS else [x, cos, sin, positions]
        replace_typed(graph, match.output("out", nodes), emit(graph, "RotaryEmbedding", inputs, attrs, domain=self.domain))

    @staticmethod
    def _constant(graph: Graph, table: np.ndarray, hint: str) -> gs.Constant:
        """A constant holding `table`: the one another rotation of the model reads where there is one."""
        tables = [t for n in graph.gs.nodes if n.op == "RotaryEmbedding" for t in n.inputs if isinstance(t, gs.Constant)]
        same = next((t for t in tables if t.values is table), None) or next(
            (t for t in tables if _same(np.asarray(t.values), table)), None)
        return same if same is not None else graph.add_constant(table, hint)


class RotaryStandardFusion(RotaryFusion):
    """Replaces the rotary embedding `x * cos + rotate_half(x) * sin` of a query or key with the standard `RotaryEmbedding` (opset 23).

    The pattern, the table and their limits are rotary-fusion's; the output stays in the default ONNX domain
    (`--ops standard`), for models of opset 23 or later (onnxruntime 1.31 runs it on the CPU)."""

    name = "rotary-standard-fusion"
    contrib = False
    domain = ""

    def check(self, graph: Graph, node: gs.Node) -> Match | NoMatch:
        if graph.opset < 23:
            return self.no(node, "RotaryEmbedding needs opset 23")
        return super().check(graph, node)
