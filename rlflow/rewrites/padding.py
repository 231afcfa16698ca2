"""The padding contract (`rlflow optimize --padding attention_mask=right`, docs/padding.md): a rewrite valid only for
the inputs the user declares, not for every input, and so kept out of the registry.

A decoder exported from Hugging Face turns its 2-D attention mask into an additive bias.  `GroupQueryAttention` given
that bias runs onnxruntime's unfused path on CUDA; onnxruntime-genai's graph instead gives the operator each row's
length (`seqlens_k`), which its kernels mask by.  The two agree where the mask is right-padded: row b holds n_b ones
then zeros, its past cache is valid in its first n_b - S positions and its S new tokens are its last valid ones.
There the rewritten model computes, row by row, what the export computes on that row alone, unpadded
(`rlflow.measure.padding` verifies exactly that).  On any other mask (left padding, holes) it computes something else.
"""
from __future__ import annotations

import numpy as np
import onnx
import onnx_graphsurgeon as gs

from rlflow.graph.core import Graph
from rlflow.rewrites.base import Match, NoMatch, Rule
from rlflow.rewrites.edits import emit
from rlflow.rewrites.queries import MS, has_input

SEQLENS, TOTAL, BIAS = 5, 6, 10
"""GroupQueryAttention's inputs: seqlens_k, total_sequence_length, attention_bias."""

PADDING_SIDES = ("right",)
"""The padding a contract may declare: `seqlens_k` counts a row's valid keys from its start, which is right padding."""


def value_inputs(graph: Graph, tensor: gs.Tensor) -> set[str] | None:
    """The graph inputs whose values (not only shapes) `tensor` is computed from; None where a subgraph or a random
    operator takes part."""
    inputs = {t.name for t in graph.gs.inputs}
    found, seen, stack = set(), set(), [tensor]
    while stack:
        t = stack.pop()
        if t.name in seen or isinstance(t, gs.Constant) or not t.name:
            continue
        seen.add(t.name)
        if t.name in inputs:
            found.add(t.name)
            continue
        producer = t.inputs[0] if t.inputs else None
        if producer is None or any(isinstance(v, gs.Graph) for v in producer.attrs.values()) \
                or producer.op.startswith("Random"):
            return None
        if producer.op != "Shape":
            stack.extend(producer.inputs)
    return found


class GqaPaddingLengths(Rule):
    """Replaces a GroupQueryAttention's additive mask computed from a right-padded 2-D mask with the rows' lengths.

        mask [B, T] --> (the export's bias subgraph) --> GroupQueryAttention(..., seqlens_k, total, attention_bias)
        becomes
        mask [B, T] --> ReduceSum(axis 1) - 1 --> Cast(int32) --> GroupQueryAttention(..., seqlens_k, total)

    Valid only under the padding contract (the module's docstring); total_sequence_length, T, is kept.
    """

    name = "gqa-padding-lengths"
    root_ops = ("GroupQueryAttention",)
    domains = (MS,)
    contrib = True

    def __init__(self, mask: str, group: str = "") -> None:
        super().__init__(group)
        self.mask = mask

    def check(self, graph: Graph, node: gs.Node) -> Match | NoMatch:
        if not has_input(node, BIAS):
            return self.no(node, "no attention_bias: nothing is masked by a bias")
        if not (has_input(node, SEQLENS) and has_input(node, TOTAL)):
            return self.no(node, "no seqlens_k or total_sequence_length")
        mask = next((t for t in graph.gs.inputs if t.name == self.mask), None)
        shape = graph.shape(mask) if mask is not None else None
        if shape is None or len(shape) != 2:
            return self.no(node, f"{self.mask} is not a 2-D input of the model")
        read = value_inputs(graph, node.inputs[BIAS])
        if read != {self.mask}:
            return self.no(node, f"the bias is not computed from the values of {self.mask} alone (it reads "
                                 f"{', '.join(sorted(read)) if read else 'no input' if read is not None else 'a subgraph'})")
        return self.match([node])

    def rewrite(self, graph: Graph, match: Match, nodes: dict[str, gs.Node]) -> None:
        node = nodes[match.root]
        mask = next(t for t in graph.gs.inputs if t.name == self.mask)
        counted = mask if np.dtype(mask.dtype).kind in "iu" else emit(graph, "Cast", [mask], {"to": onnx.TensorProto.INT64})
        axis = graph.add_constant(np.array([1], np.int64), "padding_axis")
        total = emit(graph, "ReduceSum", [counted, axis], {"keepdims": 0})
        one = graph.add_constant(np.array(1, np.dtype(counted.dtype)), "padding_one")
        last = emit(graph, "Sub", [total, one])
        node.inputs[SEQLENS] = emit(graph, "Cast", [last], {"to": onnx.TensorProto.INT32}, hint="seqlens_k")
        node.inputs[BIAS] = gs.Variable.empty()
        while node.inputs and not node.inputs[-1].name:
            node.inputs.pop()
