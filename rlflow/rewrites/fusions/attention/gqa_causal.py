"""A GroupQueryAttention whose mask is causal only masks by itself: `group-query-attention-causal` drops the
`attention_bias` that group-query-attention-fusion passes on and sets `causal=1`.

Why it matters: by onnxruntime's CUDA sources, a node given an `attention_bias` runs on the unfused path (two GEMMs
over the whole cache and a softmax), never on flash attention, XQA or cuDNN's; without one it may take them.  On the
CPU the mask costs nothing measurable.  The exporters' mask
is causal and padding, computed from the `attention_mask` input, so it is causal only where that input holds no
padding, which only the user can say (`--fix-value attention_mask=1`, `rlflow.graph.input_values`): the mask then
depends on shapes alone.

The rule takes a bias whose every path to the model's inputs goes through a `Shape` (nothing of any input's values),
and proves it causal by computing it: at the graph's shapes and with every dynamic input dimension moved by several
amounts (the shapes of the tensors its Shapes read are taken affine in that amount, from the shapes at +0 and +1;
`shape_one_larger`), it must be 0 where key j <= T - S + i and masked (at most `MASK_FILL`, or the type's lowest
value in float16) elsewhere, as the kernel's own causal mask over a cache of T - S is; and `seqlens_k` and
`total_sequence_length`, computed with it, must be T - 1 for every row and T (the kernel's mask starts where they
say the cache ends).  The answer is kept per subgraph and the shapes it was proved at: the layers of a model share
one mask.
"""
from __future__ import annotations

from collections import OrderedDict

import numpy as np
import onnx
import onnx_graphsurgeon as gs

from rlflow.graph.core import Graph
from rlflow.graph.dynamic_axes import shape_one_larger
from rlflow.graph.model_file import max_ir_version
from rlflow.rewrites.base import Match, NoMatch, Rule
from rlflow.rewrites.edits import replace_typed
from rlflow.rewrites.fusions.attention.encoder import MASK_FILL
from rlflow.rewrites.fusions.attention.gqa_absorb import plain_gqa
from rlflow.rewrites.queries import MS, has_input, np_dtype

_SEQLENS, _TOTAL, _BIAS = 5, 6, 10
"""GroupQueryAttention's seqlens_k, total_sequence_length and attention_bias inputs."""

_MOVES = (0, 1, 2, 7)
"""How far every dynamic input dimension is moved for the proof (0: the graph's own shapes)."""

_PROVED: OrderedDict[bytes, str | None] = OrderedDict()
"""A bias subgraph with its probe shapes, serialized -> None where proved causal, else why not (at most _KEEP)."""

_KEEP = 64


def _subgraph(graph: Graph, tensors: list[gs.Tensor]) -> tuple[list[gs.Node], list[gs.Tensor]] | str:
    """(the nodes computing `tensors`, in the graph's order, and the tensors their Shapes read that they do not
    compute) where nothing else of the model reaches them; else why not."""
    nodes, sources, seen, stack = {}, {}, set(), list(tensors)
    while stack:  # not recursive: a mask made from activations walks the whole model before it meets an input
        tensor = stack.pop()
        if tensor.name in seen or isinstance(tensor, gs.Constant) or tensor.name == "":
            continue
        seen.add(tensor.name)
        producer = tensor.inputs[0] if len(tensor.inputs) == 1 else None
        if producer is None:
            return f"the mask reads the values of the model's input {tensor.name}"
        if any(isinstance(v, gs.Graph) for v in producer.attrs.values()) or producer.op.startswith("Random"):
            return "the mask is computed by a control-flow or random operator"
        nodes[id(producer)] = producer  # once, though several of its outputs are read
        if producer.op == "Shape" and (producer.domain or "") in ("", "ai.onnx"):
            sources.setdefault(producer.inputs[0].name, producer.inputs[0])
        else:
            stack.extend(producer.inputs)
    order = {id(n): i for i, n in enumerate(graph.gs.nodes)}
    computed = {t.name for n in nodes.values() for t in n.outputs}
    return (sorted(nodes.values(), key=lambda n: order[id(n)]),
            [t for name, t in sources.items() if name not in computed])


def _probe_model(graph: Graph, nodes: list[gs.Node], sources: list[gs.Tensor],
                 outputs: list[gs.Tensor]) -> onnx.ModelProto:
    inputs = [gs.Variable(t.name, dtype=t.dtype, shape=None) for t in sources]
    by_name = {t.name: t for t in inputs}
    copies = []
    for node in nodes:
        ins = [t if isinstance(t, gs.Constant) else by_name[t.name] if t.name else gs.Variable.empty()
               for t in node.inputs]
        copies.append(gs.Node(node.op, node.name, dict(node.attrs), ins, [gs.Variable(t.name) for t in node.outputs],
                              domain=node.domain))
        by_name.update({t.name: out for t, out in zip(node.outputs, copies[-1].outputs)})
    outs = []
    for t in outputs:
        if t.name not in by_name:  # a constant (a mask constant-fold computed at a static shape): passed on
            copies.append(gs.Node("Identity", inputs=[t], outputs=[gs.Variable(f"{t.name}_probed")]))
            by_name[t.name] = copies[-1].outputs[0]
        outs.append(by_name[t.name])
    for out, t in zip(outs, outputs):
        out.dtype = t.dtype
    sub = gs.Graph(nodes=copies, inputs=inputs, outputs=outs, opset=graph.opset)
    model = gs.export_onnx(sub, do_type_check=False)
    del model.opset_import[:]
    model.opset_import.extend(graph.opset_imports())
    model.ir_version = max_ir_version()
    return model


def _probe_shapes(graph: Graph, sources: list[gs.Tensor]) -> list[dict[str, tuple[int, ...]]] | str:
    """The sources' shapes at each of _MOVES (affine between +0 and +1), or why they cannot be had."""
    base, step = {}, {}
    for tensor in sources:
        shape = graph.shape(tensor)
        larger = shape_one_larger(graph, tensor)
        if shape is None or larger is None or len(larger) != len(shape):
            return f"the shape of {tensor.name}, read by the mask, is not known at other sizes"
        base[tensor.name], step[tensor.name] = np.array(shape), np.array(larger) - np.array(shape)
    moves = _MOVES if any(s.any() for s in step.values()) else (0,)
    return [{n: tuple(int(d) for d in base[n] + k * step[n]) for n in base} for k in moves]


def _causal_reason(values: np.ndarray, seqlens: np.ndarray, total: np.ndarray, dtype: np.dtype) -> str | None:
    if values.ndim != 4 or values.shape[1] != 1:
        return "the mask is not [B or 1, 1, S, T]"
    s, t = values.shape[2:]
    if np.any(seqlens != t - 1) or np.any(total != t):
        return f"seqlens_k is not T - 1 for every row, or total_sequence_length not T (T={t})"
    if t < s:
        return "the mask has fewer keys than queries"
    allowed = np.arange(t)[None, :] <= (t - s) + np.arange(s)[:, None]
    floor = max(MASK_FILL, float(np.finfo(dtype).min)) if dtype.kind == "f" else MASK_FILL
    if np.any(values[..., allowed] != 0) or np.any(values[..., ~allowed] > floor):
        return f"the mask is not causal at S={s}, T={t} (0 on and below the diagonal, masked above)"
    return None


def _proof(graph: Graph, node: gs.Node) -> str | None:
    """None where the node's bias is causal and its sequence lengths say no padding at every probe, else why not (see
    the module's docstring)."""
    tensors = [node.inputs[_BIAS], node.inputs[_SEQLENS], node.inputs[_TOTAL]]
    found = _subgraph(graph, tensors)
    if isinstance(found, str):
        return found
    nodes, sources = found
    shapes = _probe_shapes(graph, sources)
    if isinstance(shapes, str):
        return shapes
    model = _probe_model(graph, nodes, sources, tensors)
    key = model.SerializeToString() + repr(shapes).encode()
    if key in _PROVED:
        _PROVED.move_to_end(key)
        return _PROVED[key]
    reason = _evaluate(model, sources, shapes, np_dtype(tensors[0]))
    _PROVED[key] = reason
    while len(_PROVED) > _KEEP:
        _PROVED.popitem(last=False)
    return reason


def _evaluate(model: onnx.ModelProto, sources: list[gs.Tensor], shapes: list[dict], dtype: np.dtype) -> str | None:
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads, options.log_severity_level = 1, 4
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    try:
        session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
        for sizes in shapes:
            feeds = {t.name: np.zeros(sizes[t.name], np.dtype(t.dtype)) for t in sources}
            reason = _causal_reason(*(np.asarray(v) for v in session.run(None, feeds)), dtype)
            if reason:
                return reason
    except Exception as exc:  # noqa: BLE001 - onnxruntime's errors: the mask cannot be computed at other sizes
        return f"the mask cannot be computed at other sizes ({type(exc).__name__})"
    return None


class GroupQueryAttentionCausal(Rule):
    """Replaces a GroupQueryAttention whose `attention_bias` is a causal mask with one that masks by itself (`causal=1`).

        mask(shapes only) --> GroupQueryAttention(q, k, v, past, seqlens_k, total, ..., attention_bias, causal=0)
          -> GroupQueryAttention(q, k, v, past, seqlens_k, total, ..., causal=1)

    With `seqlens_k` T - 1 for every row and `total_sequence_length` T (group-query-attention-fusion's, computed from
    shapes; checked with the bias), the operator lets query i see keys up to T - S + i, the causal mask over a cache of
    T - S; the bias must be that mask (see the module's docstring)."""

    name = "group-query-attention-causal"
    root_ops = ("GroupQueryAttention",)
    contrib = True
    domains = (MS,)

    def check(self, graph: Graph, node: gs.Node) -> Match | NoMatch:
        if not has_input(node, _BIAS):
            return self.no(node, "no attention_bias to drop")
        if not plain_gqa(node):
            return self.no(node, "the GroupQueryAttention takes inputs or attributes beyond attention over a cache")
        reason = _proof(graph, node)
        return self.no(node, reason) if reason else self.match([node])

    def rewrite(self, graph: Graph, match: Match, nodes: dict[str, gs.Node]) -> None:
        node = nodes[match.root]
        inputs = list(node.inputs[:_BIAS])
        while inputs and inputs[-1].name == "":
            inputs.pop()
        outputs = [gs.Variable(graph.fresh_name(t.name)) for t in node.outputs]
        graph.add_node("GroupQueryAttention", inputs, outputs, dict(node.attrs, causal=1), domain=MS)
        for old, new in zip(list(node.outputs), outputs):
            replace_typed(graph, old, new)
