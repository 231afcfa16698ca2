"""Embedding fusion: a BERT-style model's token, position and segment embeddings, summed and normalised, into
onnxruntime's `EmbedLayerNormalization`.

Both torch exporters write the embeddings as `Gather`s of constant tables added up and fed to `LayerNormalization`;
the position and segment ids are computed in the graph (a slice of a constant, an `Expand`, RoBERTa's `CumSum`) and
stay as they are, only cast to the 32-bit ids the operator takes.
"""
from __future__ import annotations

import numpy as np
import onnx
import onnx_graphsurgeon as gs

from rlflow.graph.core import Graph
from rlflow.graph.dynamic_axes import dynamic_axes
from rlflow.rewrites.base import Match, NoMatch, Rule
from rlflow.rewrites.edits import replace_typed
from rlflow.rewrites.queries import MS, has_input, is_float, normalize_axis, operand_tree, private


def _lookup(graph: Graph, tensor: gs.Tensor, hidden: int) -> gs.Node | None:
    """The `Gather` of rows of a constant float32 [rows, hidden] table by 2-D integer ids writing `tensor` (or a Cast
    of it to float32), read by the sum and otherwise only by `Shape` (TorchScript's DistilBERT takes the sequence
    length from it)."""
    gather = tensor.inputs[0] if tensor.inputs else None
    if (gather is not None and gather.op == "Cast" and gather.attrs.get("to") == onnx.TensorProto.FLOAT
            and private(graph, tensor)):  # a Cast to the type it has (TorchScript's GPT-2 positions)
        tensor = gather.inputs[0]
        gather = tensor.inputs[0] if tensor.inputs else None
    if gather is None or gather.op != "Gather" or gather.domain or graph.is_output(tensor):
        return None
    if sum(1 for reader in tensor.outputs if reader.op != "Shape") != 1:
        return None
    table = Graph.constant(gather.inputs[0])
    ids_shape = graph.shape(gather.inputs[1])
    if (table is None or table.dtype != np.float32 or table.ndim != 2 or table.shape[1] != hidden
            or gather.attrs.get("axis", 0) != 0 or ids_shape is None or len(ids_shape) != 2
            or gather.inputs[1].dtype not in (np.int64, np.int32)):
        return None
    return gather


class EmbedLayerNormFusion(Rule):
    """Replaces `LayerNormalization` of two or three summed embedding lookups with `EmbedLayerNormalization`.

        input_ids ----> Gather(token table) -------+
        position ids -> Gather(position table) ----+--> Add --> [Add] --> LayerNormalization(axis=-1)
        segment ids --> [Gather(segment table)] ---+         (a lookup may be Cast to float first)

    Both torch exporters write a Hugging Face text model's embeddings this way (BERT: token, position and segment;
    GPT-2: token and position), the position and segment ids computed in the graph.  The lookup whose ids keep a
    batch dimension of 1 (the position ids as exporters slice them), or else the last one, becomes the position
    embedding; the first other one the token embedding and a third the segment embedding.  Where the sum is read
    elsewhere as well (GPT-2's residual stream), or is a graph output, those readers and the output take it from the
    operator's third output.  The operator
    reads 32-bit ids, so Casts are added for 64-bit ones.  As with onnxruntime's own optimizer, ids are assumed to lie
    within their table: `Gather` counts a negative id from the end, the fused operator refuses it."""

    name = "embed-layernorm-fusion"
    root_ops = ("LayerNormalization",)
    contrib = True

    def check(self, graph: Graph, node: gs.Node) -> Match | NoMatch:
        add = node.inputs[0].inputs[0] if node.inputs[0].inputs else None
        if add is None or add.op != "Add" or add.domain:
            return self.no(node, "input is not an Add")
        shape = graph.shape(node.inputs[0])
        if shape is None or len(shape) != 3 or len(node.outputs) > 1 or not is_float(node.outputs[0]):
            return self.no(node, "not one 3-D [batch, sequence, hidden] normalisation")
        if normalize_axis(node.attrs.get("axis", -1), 3) != 2:
            return self.no(node, "the normalisation is not over the last axis alone")
        hidden = shape[2]
        if any(graph.shape(t) != (hidden,) or Graph.constant(t) is None for t in node.inputs[1:] if t.name):
            return self.no(node, "gamma or beta are not constant vectors over the hidden axis")
        operands, adds = operand_tree(graph, add)
        lookups = [_lookup(graph, t, hidden) for t in operands]
        if len(lookups) not in (2, 3) or any(g is None for g in lookups):
            return self.no(node, "the sum is not of two or three embedding lookups")
        if any(graph.shape(g.outputs[0]) != shape for g in lookups):
            return self.no(node, "the lookups do not all have the normalised tensor's shape")
        if any(r.attrs.get("start") or r.attrs.get("end") is not None
               for g in lookups for r in g.outputs[0].outputs if r.op == "Shape"):
            return self.no(node, "a Shape of a lookup takes part of it")
        fixed = [not (dynamic_axes(graph, g.inputs[1]) or (True,))[0] for g in lookups]  # batch stays 1
        if len(set(fixed)) == 1:
            position = len(lookups) - 1
        elif fixed.count(True) == 1:
            position = fixed.index(True)
        else:
            return self.no(node, "more than one lookup keeps its batch dimension at 1")
        rest = [g for i, g in enumerate(lookups) if i != position]
        ordered = [rest[0], lookups[position], *rest[1:]]  # token, position, segment
        return self.match([node, *adds, *ordered], lookups=len(lookups), shared=not private(graph, add.outputs[0]))

    def rewrite(self, graph: Graph, match: Match, nodes: dict[str, gs.Node]) -> None:
        node = nodes[match.root]
        token, position, *segment = [nodes[n] for n in match.nodes[-match.param("lookups"):]]
        gamma = node.inputs[1]
        beta = node.inputs[2] if has_input(node, 2) else graph.add_constant(
            np.zeros(graph.shape(gamma), np.float32), "beta")
        empty = gs.Variable.empty
        inputs = [_int32(graph, token.inputs[1]), _int32(graph, segment[0].inputs[1]) if segment else empty(),
                  token.inputs[0], position.inputs[0], segment[0].inputs[0] if segment else empty(), gamma, beta,
                  empty(), _int32(graph, position.inputs[1])]
        mask_index = gs.Variable(graph.fresh_name("embed_mask_index"), np.int32, graph.shape(token.inputs[1])[:1])
        outputs = [gs.Variable(graph.fresh_name("embed_ln")), mask_index]
        if match.param("shared"):  # the sum is read elsewhere too (GPT-2's residual stream): the third output gives it
            outputs.append(gs.Variable(graph.fresh_name("embed_sum")))
        fused = graph.add_node("EmbedLayerNormalization", inputs, outputs,
                               {"epsilon": float(node.attrs.get("epsilon", 1e-5))}, domain=MS)
        for lookup in (token, position, *segment):  # Shape(lookup) is Shape(ids) and the hidden size
            readers = [r for r in lookup.outputs[0].outputs if r.op == "Shape"]
            if readers:
                hidden = graph.add_constant(np.array(graph.shape(gamma), np.int64), "hidden")
                ids_shape = graph.add_node("Shape", [lookup.inputs[1]], 1)[0]
                shape = graph.add_node("Concat", [ids_shape, hidden], 1, {"axis": 0})[0]
                for reader in readers:
                    replace_typed(graph, reader.outputs[0], shape)
        replace_typed(graph, node.outputs[0], fused[0])
        if match.param("shared"):
            replace_typed(graph, nodes[match.nodes[1]].outputs[0], fused[2])


def _int32(graph: Graph, ids: gs.Tensor) -> gs.Tensor:
    """`ids` as int32 (a Cast for int64 ids)."""
    if ids.dtype == np.int32:
        return ids
    return graph.add_node("Cast", [ids], 1, {"to": onnx.TensorProto.INT32}, hint="ids_int32")[0]
