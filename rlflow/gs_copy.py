"""A structural copy of an onnx-graphsurgeon graph, about four times quicker than `gs.Graph.copy`.

Every rewrite starts with a copy of its graph (`rlflow.graph.Graph.clone`), and the agent's rollouts rewrite at every
step.  `gs.Graph.copy` builds each node and tensor through constructors whose input and output lists keep their other
ends in sync one element at a time, and builds the tensor map by name twice: on BERT L2/H128 that was 15 ms a copy,
half of a rewrite and a fifth of the agent's search (docs/results/agent-deploy/README.md, eleventh part).  Here each
node and tensor is copied once, keyed by identity, and the two ends of every edge are written directly.

The copy is the one `gs.Graph.copy` makes: new nodes and tensors with the same fields, the same attribute values and
constant arrays (shared, never deep-copied), graph inputs and outputs mapped onto the copies.  Graphs holding
subgraphs (If, Loop, Scan) are left to `gs.Graph.copy`, which knows which tensors a body reads from outside.
"""
from __future__ import annotations

from collections import OrderedDict

import onnx_graphsurgeon as gs
from onnx_graphsurgeon.util.misc import SynchronizedList


def copy_graph(graph: gs.Graph) -> gs.Graph:
    """A copy of `graph` whose nodes and tensors are new objects; see the module docstring."""
    if any(isinstance(value, gs.Graph) for node in graph.nodes for value in node.attrs.values()):
        return graph.copy()
    copies: dict[int, gs.Tensor] = {}

    def tensor(original: gs.Tensor) -> gs.Tensor:
        copy = copies.get(id(original))
        if copy is None:
            copy = copies[id(original)] = _bare(original)
        return copy

    nodes = []
    for node in graph.nodes:
        copy = object.__new__(type(node))
        fields = copy.__dict__
        fields.update(node.__dict__)
        fields["attrs"] = OrderedDict(node.attrs)
        inputs = [tensor(t) for t in node.inputs]
        outputs = [tensor(t) for t in node.outputs]
        fields["inputs"] = _linked(copy, "outputs", inputs)
        fields["outputs"] = _linked(copy, "inputs", outputs)
        for t in inputs:
            list.append(t.outputs, copy)  # the consumer's end of the edge, without a second sync
        for t in outputs:
            list.append(t.inputs, copy)
        nodes.append(copy)
    return gs.Graph(nodes=nodes, inputs=[tensor(t) for t in graph.inputs],
                    outputs=[tensor(t) for t in graph.outputs], name=graph.name, doc_string=graph.doc_string,
                    opset=graph.opset, import_domains=graph.import_domains, producer_name=graph.producer_name,
                    producer_version=graph.producer_version, functions=list(graph.functions),
                    ir_version=graph.ir_version)


def _bare(original: gs.Tensor) -> gs.Tensor:
    """A tensor with `original`'s fields and no producers or consumers yet."""
    copy = object.__new__(type(original))
    fields = copy.__dict__
    fields.update(original.__dict__)
    fields["inputs"] = SynchronizedList(copy, field_name="outputs", initial=())
    fields["outputs"] = SynchronizedList(copy, field_name="inputs", initial=())
    return copy


def _linked(owner, field_name: str, items: list) -> SynchronizedList:
    """A node's input or output list holding `items`, their own lists left for the caller to fill."""
    linked = SynchronizedList(owner, field_name=field_name, initial=())
    list.extend(linked, items)
    return linked


__all__ = ["copy_graph"]
