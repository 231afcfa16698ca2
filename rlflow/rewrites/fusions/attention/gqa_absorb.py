"""What onnxruntime's `GroupQueryAttention` can take in besides attention (decoder LLMs, issue #50): the rotary
embedding of the query and the keys (`do_rotary`), and the query, key and value projections as one packed MatMul.
Both root at the operator that group-query-attention-fusion writes (`decoder.py`).

What onnxruntime 1.31's CPU kernel does, by probes against `RotaryEmbedding` followed by `GroupQueryAttention`:

* `do_rotary` with `position_ids` is exact for one new position over a non-empty cache, whatever the ids (left
  padding included), and for several positions over a non-empty cache (batch 1).  On a first prompt (past length 0,
  `sequence_length == total_sequence_length`) it rotates the keys it writes to the present state from row 0's
  `position_ids[0, 0] + i`, for every row: exact there only at batch 1 or where every row has the same ids (ids of
  [1, S] expanded to the batch), and only for one position.  So the rule takes a rotary where it can prove one of
  those, and refuses a dynamic batch with per-row ids over a cache that may be empty (the exporters' decode steps).
* Partial rotation: the kernel rotates the first `2 * cos_cache.shape[1]` channels, and refuses tables whose width is
  not a multiple of 8; such tables are refused here.
* `q_norm_weight` / `k_norm_weight` (Qwen3's per-head RMSNorm): the CPU kernel refuses them (CUDA and WebGPU only),
  so Qwen3's SimplifiedLayerNormalization stays outside, and the query and keys then come from it.
* The NaN guard that group-query-attention-fusion keeps after the operator is not taken in: it zeroes a row whose
  keys are all masked at -inf (TorchScript's fill), and any row a non-finite cache or activation makes NaN, which the
  operator passes on.  Where every mask is finite, `attention-nan-guard-elim` (`nan_guard.py`) drops it.
"""
from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs

from rlflow.graph.core import Graph
from rlflow.graph.dynamic_axes import dynamic_axes
from rlflow.rewrites.base import Match, NoMatch, Rule
from rlflow.rewrites.edits import emit, replace_typed
from rlflow.rewrites.queries import MS, constant_input, has_input, np_dtype, perm_of, standard_producer

_ROTARY_INPUTS = (7, 8, 9)
"""cos_cache, sin_cache, position_ids."""

_OTHER_INPUTS = tuple(range(11, 16))
"""head_sink, k_scale, v_scale, q_norm_weight, k_norm_weight: neither rule takes a node that has them."""


def _dims(graph: Graph, tensor: gs.Tensor) -> tuple[tuple[int, bool], ...] | None:
    """(size, dynamic) pairs of a tensor's dimensions, or None when unknown."""
    shape, moved = graph.shape(tensor), dynamic_axes(graph, tensor)
    return None if shape is None or moved is None else tuple(zip(shape, moved))


def _private(graph: Graph, tensor: gs.Tensor) -> bool:
    return len(tensor.outputs) == 1 and not graph.is_output(tensor)


def _producer(graph: Graph, tensor: gs.Tensor, op: str, domain: str = "") -> gs.Node | None:
    """The node of type `op` writing `tensor`, read nowhere else; else None."""
    node = tensor.inputs[0] if len(tensor.inputs) == 1 else None
    if node is None or node.op != op or (node.domain or "") not in ((domain,) if domain else ("", "ai.onnx")):
        return None
    return node if _private(graph, tensor) else None


def plain_gqa(node: gs.Node) -> bool:
    """A GroupQueryAttention without head sinks, cache quantization, q/k norms, softcap, windows or QK output."""
    attrs = node.attrs
    return (not any(has_input(node, i) for i in _OTHER_INPUTS) and not attrs.get("softcap", 0.0)
            and attrs.get("local_window_size", -1) == -1 and not attrs.get("sliding_window_cache", 0)
            and not attrs.get("qk_output", 0) and not attrs.get("smooth_softmax", 0) and len(node.outputs) <= 3
            and attrs.get("k_quant_type", "NONE") in ("NONE", b"NONE"))


# ---------------------------------------------------------------------------------------------- rotary absorbed
def _rotated(graph: Graph, flat: gs.Tensor, heads: int):
    """The rotation that `flat` [B, S, heads * Dh] brings back from [B, heads, S, Dh]: (nodes, the RotaryEmbedding,
    the [B, S, heads * Dh] or [B, S, heads, Dh] tensor the heads were split from, whether it needs a Reshape), or a
    reason.  The heads come back as Reshape(rotated) (one position) or Reshape(Transpose(rotated, 0213))."""
    reshape = _producer(graph, flat, "Reshape")
    if reshape is None:
        return "not a RotaryEmbedding's output brought back to [B, S, heads * Dh] by a private Reshape"
    nodes, back = [reshape], _producer(graph, reshape.inputs[0], "Transpose")
    if back is not None:
        if perm_of(back, 4) != (0, 2, 1, 3):
            return "the rotated heads are transposed other than (0, 2, 1, 3)"
        nodes.append(back)
    rotated = back.inputs[0] if back is not None else reshape.inputs[0]
    rotary = rotated.inputs[0] if len(rotated.inputs) == 1 else None
    shapes = [n for n in rotated.outputs if n is not nodes[-1]]
    if rotary is None or rotary.op != "RotaryEmbedding" or rotary.domain != MS or graph.is_output(rotated) or any(
            _sizes_axis(n) is None for n in shapes):
        return "not a RotaryEmbedding (com.microsoft) read only by the Reshape back and Shapes of its batch or sequence"
    x = rotary.inputs[0] if rotary is not None else None
    x_dims, out = (_dims(graph, x) if x is not None else None), _dims(graph, flat)
    if x_dims is None or out is None or len(x_dims) != 4:
        return "not a RotaryEmbedding (com.microsoft) of [B, heads, S, Dh] heads"
    b, n, s, d = x_dims
    if n != (heads, False) or d[1] or out != (b, s, (heads * d[0], False)) or (back is None and s != (1, False)):
        return "the rotated heads are not [B, heads, S, Dh] brought back to [B, S, heads * Dh]"
    attrs = rotary.attrs
    if attrs.get("interleaved", 0) or attrs.get("is_packed_batching", 0) or attrs.get("scale", 1.0) != 1.0:
        return "an interleaved, packed-batch or scaled RotaryEmbedding (GroupQueryAttention rotates halves, unscaled)"
    split = _producer(graph, x, "Transpose")
    if split is None or perm_of(split, 4) != (0, 2, 1, 3):
        return "the rotated heads are not split by a private Transpose(0, 2, 1, 3)"
    nodes += [rotary, split]
    source, unsplit = split.inputs[0], _producer(graph, split.inputs[0], "Reshape")
    flat = unsplit is None or _dims(graph, unsplit.inputs[0]) != out
    if not flat:
        nodes.append(unsplit)
        source = unsplit.inputs[0]
    return nodes + shapes, rotary, source, flat, tuple(_sizes_axis(n) for n in shapes)


def _sizes_axis(node: gs.Node, rank: int = 4) -> int | None:
    """For a Shape of [B, heads, S, Dh] heads (`rank` 4) or of [B, S, .] (3) that reads one of its batch or sequence:
    that axis of [B, S, .] (0 or 1), else None."""
    if node.op != "Shape" or (node.domain or "") not in ("", "ai.onnx"):
        return None
    start, end = node.attrs.get("start", 0), node.attrs.get("end", rank)
    start, end = (min(max(v + rank if v < 0 else v, 0), rank) for v in (start, end))
    return {(0, 1): 0, (2 if rank == 4 else 1, 3 if rank == 4 else 2): 1}.get((start, end))


def _same_tensor(a: gs.Tensor, b: gs.Tensor) -> bool:
    if a is b:
        return True
    va, vb = Graph.constant(a), Graph.constant(b)
    return va is not None and vb is not None and va.shape == vb.shape and va.dtype == vb.dtype and np.array_equal(va, vb)


def _rows_share_ids(graph: Graph, positions: gs.Tensor) -> bool:
    """Whether every row of `positions` [B, S] holds the same ids: ids of [1, S] expanded to the batch."""
    expand = standard_producer(positions)
    dims = _dims(graph, expand.inputs[0]) if expand is not None and expand.op == "Expand" else None
    return dims is not None and len(dims) == 2 and dims[0] == (1, False)


class GroupQueryAttentionRotary(Rule):
    """Replaces the RotaryEmbeddings of a GroupQueryAttention's query and keys with the operator's own rotary (`do_rotary`).

        [B,S,N*Dh] --> Reshape --> Transpose(0213) --> RotaryEmbedding(ids, cos, sin) --> [Transpose] --> Reshape --+
        [B,S,kvN*Dh] --> (the same for the keys) -------------------------------------------------------------------+
                                                                             GroupQueryAttention(q, k, v, ...) <--+
          -> GroupQueryAttention(q, k, v, ..., cos_cache=cos, sin_cache=sin, position_ids=ids, do_rotary=1)

    The query and keys go in as the [B, S, heads * Dh] tensors their heads were split from (a Reshape added where they
    were [B, S, heads, Dh], as after Qwen3's per-head norms); the tables ([positions, rotary dim / 2], the layout of
    both operators) and the position ids are the RotaryEmbeddings'.  Exact where the kernel honours the ids (see the
    module's docstring): a cache that is never empty (its length static, at least 1), or one position at batch 1 or
    with ids shared by every row; refused otherwise, and for tables not a multiple of 8 wide."""

    name = "group-query-attention-rotary"
    root_ops = ("GroupQueryAttention",)
    contrib = True
    domains = (MS,)

    def _pattern(self, graph: Graph, node: gs.Node):
        """(nodes, params) or a reason."""
        if node.attrs.get("do_rotary", 0) or any(has_input(node, i) for i in _ROTARY_INPUTS) or not plain_gqa(node):
            return "the GroupQueryAttention rotates already, or takes inputs or attributes beyond attention over a cache"
        if not (has_input(node, 1) and has_input(node, 2)):
            return "a packed query, key and value: no rotary to take in"
        found = [_rotated(graph, node.inputs[i], int(node.attrs[key])) for i, key in ((0, "num_heads"),
                                                                                      (1, "kv_num_heads"))]
        if any(isinstance(f, str) for f in found):
            return next(f for f in found if isinstance(f, str))
        (q_nodes, q_rot, q_src, q_flat, q_shapes), (k_nodes, k_rot, k_src, k_flat, k_shapes) = found
        if any(not _same_tensor(a, b) for a, b in zip(q_rot.inputs[1:4], k_rot.inputs[1:4])) or (
                q_rot.attrs.get("rotary_embedding_dim", 0) != k_rot.attrs.get("rotary_embedding_dim", 0)):
            return "the query and keys are rotated by other ids, tables or rotary dimensions"
        cos, dtype = graph.shape(q_rot.inputs[2]), np_dtype(node.inputs[0])
        head = graph.shape(q_rot.inputs[0])[3]
        if cos is None or len(cos) != 2 or cos[1] % 8 or 2 * cos[1] > head or np_dtype(q_rot.inputs[2]) != dtype:
            return "the cos/sin tables are not [positions, a multiple of 8 up to Dh / 2] in the query's type"
        positions, x = q_rot.inputs[1], _dims(graph, q_rot.inputs[0])
        past = _dims(graph, node.inputs[3]) if has_input(node, 3) else None
        single = x[2] == (1, False)
        if not ((past is not None and not past[2][1] and past[2][0] >= 1) or (single and (
                x[0] == (1, False) or _rows_share_ids(graph, positions)))):
            return ("the cache may be empty with ids that differ between rows (or several positions): onnxruntime's "
                    "CPU kernel rotates a first prompt's keys at row 0's position_ids[0, 0] + i")
        nodes = [node, *q_nodes, *k_nodes]
        return nodes, dict(query=self.locate(nodes, q_src), key=self.locate(nodes, k_src), q_flat=q_flat,
                           k_flat=k_flat, q_shapes=(len(q_nodes) + 1 - len(q_shapes), q_shapes),
                           k_shapes=(len(nodes) - len(k_shapes), k_shapes), positions=self.locate(nodes, positions),
                           cos=self.locate(nodes, q_rot.inputs[2]), sin=self.locate(nodes, q_rot.inputs[3]))

    def check(self, graph: Graph, node: gs.Node) -> Match | NoMatch:
        return self.matched(node, self._pattern(graph, node))

    def rewrite(self, graph: Graph, match: Match, nodes: dict[str, gs.Node]) -> None:
        node = nodes[match.root]
        heads = []
        for key in ("query", "key"):
            tensor = match.input(key, nodes)
            if match.param(f"{key[0]}_flat"):  # [B, S, heads, Dh] -> [B, S, heads * Dh]
                tensor = emit(graph, "Reshape", [tensor, graph.add_constant(np.array([0, 0, -1], np.int64), "bsh")])
            heads.append(tensor)
            first, axes = match.param(f"{key[0]}_shapes")
            for at, axis in enumerate(axes):  # the sequence lengths read off the split heads, now off [B, S, .]
                sizes = nodes[match.nodes[first + at]].outputs[0]
                replace_typed(graph, sizes, emit(graph, "Shape", [tensor], {"start": axis, "end": axis + 1}))
        extra = [match.input(k, nodes) for k in ("cos", "sin", "positions")]
        inputs = list(node.inputs)
        inputs += [gs.Variable.empty() for _ in range(max(0, 10 - len(inputs)))]
        inputs[0], inputs[1], inputs[7], inputs[8], inputs[9] = *heads, *extra
        outputs = [gs.Variable(graph.fresh_name(t.name)) for t in node.outputs]
        attrs = dict(node.attrs, do_rotary=1, rotary_interleaved=0)
        graph.add_node("GroupQueryAttention", inputs, outputs, attrs, domain=MS)
        for old, new in zip(list(node.outputs), outputs):
            replace_typed(graph, old, new)


# ------------------------------------------------------------------------------------------------ packed QKV
def _step(graph: Graph, tensor: gs.Tensor, reader: gs.Node, op: str, shapes: list) -> gs.Node | None:
    """The `op` node writing `tensor` where `reader` and Shapes of its batch or sequence alone read it (those Shapes
    appended to `shapes`); else None."""
    node = tensor.inputs[0] if len(tensor.inputs) == 1 else None
    others = [n for n in tensor.outputs if n is not reader]
    if node is None or node.op != op or (node.domain or "") not in ("", "ai.onnx") or graph.is_output(tensor) or any(
            n.op != "Shape" or (n.domain or "") not in ("", "ai.onnx") or _sizes_axis(n, 3) is None for n in others):
        return None
    shapes += others
    return node


def _projection(graph: Graph, tensor: gs.Tensor, width: int, reader: gs.Node):
    """(x, the nodes, the Add's bias side or None, Shapes of the batch or sequence read on the way) where `tensor`
    [B, S, width] is `MatMul(x, W) [+ b]`, W a constant [hidden, width], through Reshapes back to its shape, each
    read by the next alone (and such Shapes); else None."""
    nodes, dims, shapes = [], _dims(graph, tensor), []
    while (reshape := _step(graph, tensor, reader, "Reshape", shapes)) is not None:
        nodes.append(reshape)
        tensor, reader = reshape.inputs[0], reshape
    if dims is None or len(dims) != 3 or dims[2] != (width, False) or _dims(graph, tensor) != dims:
        return None
    side, add = None, _step(graph, tensor, reader, "Add", shapes)
    if add is not None:
        side = next((i for i in (0, 1) if (b := constant_input(add, i)) is not None and b.shape == (width,)
                     and b.dtype == np_dtype(add.inputs[1 - i]) and _dims(graph, add.inputs[1 - i]) == dims), None)
        if side is None:
            return None
        nodes.append(add)
        tensor, reader = add.inputs[1 - side], add
    matmul = _step(graph, tensor, reader, "MatMul", shapes)
    weights = constant_input(matmul, 1) if matmul is not None else None
    if weights is None or weights.ndim != 2 or weights.shape[1] != width or weights.dtype != np_dtype(tensor):
        return None
    return matmul.inputs[0], [*nodes, matmul], side, shapes


class GroupQueryAttentionPackQkv(Rule):
    """Replaces the query, key and value projections of one input feeding a GroupQueryAttention with one MatMul on their concatenated weights (packed QKV).

        x --+--> MatMul(., Wq) [+ bq] --> [Reshapes] --+
            +--> MatMul(., Wk) [+ bk] --> [Reshapes] --+--> GroupQueryAttention(q, k, v, ...)
            +--> MatMul(., Wv) [+ bv] --> [Reshapes] --+
          -> GroupQueryAttention(MatMul(x, [Wq Wk Wv]) [+ [bq bk bv]], key and value absent, ...)

    onnxruntime-genai's builder writes this form: the operator reads a query of num_heads * Dh + 2 * kv_num_heads * Dh
    channels as Q, K and V.  Where the query and keys are rotated outside the operator, or normalised (Qwen3; see the
    module's docstring), they are no projections, and the rule does not apply; in `all_fusions`, which applies the
    rules in reverse registry order, group-query-attention-rotary (before it in the registry) takes the rotary in one
    round and this rule packs in the next."""

    name = "group-query-attention-pack-qkv"
    root_ops = ("GroupQueryAttention",)
    contrib = True
    domains = (MS,)

    def _pattern(self, graph: Graph, node: gs.Node):
        if not (has_input(node, 1) and has_input(node, 2)) or not plain_gqa(node):
            return "the query, key and value are packed already, or the operator takes more than attention"
        q_dims = _dims(graph, node.inputs[0])
        heads, kv_heads = int(node.attrs["num_heads"]), int(node.attrs["kv_num_heads"])
        if q_dims is None or len(q_dims) != 3 or q_dims[2][1] or q_dims[2][0] % heads:
            return "the query is not [B, S, heads * Dh]"
        size = q_dims[2][0] // heads
        found = [_projection(graph, t, w, node) for t, w in zip(node.inputs[:3], (heads * size, *(2 * [kv_heads * size])))]
        if any(f is None for f in found):
            return "the query, key or value is not a private MatMul (+ bias) of constant weights, through Reshapes"
        x = found[0][0]
        if any(f[0] is not x for f in found) or any(_dims(graph, t)[:2] != q_dims[:2] for t in node.inputs[1:3]):
            return "the query, key and value are not projections of one input to [B, S, .]"
        shapes = [n for f in found for n in f[3]]
        nodes = [node, *(n for f in found for n in f[1]), *shapes]
        return nodes, dict(x=self.locate(nodes, x), biases=tuple(f[2] for f in found),
                           sizes=tuple(len(f[1]) for f in found), shapes=len(shapes))

    def check(self, graph: Graph, node: gs.Node) -> Match | NoMatch:
        return self.matched(node, self._pattern(graph, node))

    def rewrite(self, graph: Graph, match: Match, nodes: dict[str, gs.Node]) -> None:
        node, at, weights, biases = nodes[match.root], 1, [], []
        for size, side in zip(match.param("sizes"), match.param("biases")):
            chain = [nodes[name] for name in match.nodes[at:at + size]]
            at += size
            weights.append(constant_input(chain[-1], 1))
            biases.append(constant_input(chain[-2], side) if side is not None else None)
        x = match.input("x", nodes)
        packed = emit(graph, "MatMul", [x, graph.add_constant(np.concatenate(weights, axis=1), "qkv_weight")])
        if any(b is not None for b in biases):
            bias = np.concatenate([b.reshape(-1) if b is not None else np.zeros(w.shape[1], w.dtype)
                                   for b, w in zip(biases, weights)])
            packed = emit(graph, "Add", [packed, graph.add_constant(bias, "qkv_bias")])
        for name in match.nodes[len(match.nodes) - match.param("shapes"):]:  # batch and sequence, as packed
            shape = nodes[name]
            replace_typed(graph, shape.outputs[0], emit(graph, "Shape", [packed], dict(shape.attrs)))
        inputs = [packed, gs.Variable.empty(), gs.Variable.empty(), *node.inputs[3:]]
        outputs = [gs.Variable(graph.fresh_name(t.name)) for t in node.outputs]
        graph.add_node("GroupQueryAttention", inputs, outputs, dict(node.attrs), domain=MS)
        for old, new in zip(list(node.outputs), outputs):
            replace_typed(graph, old, new)
