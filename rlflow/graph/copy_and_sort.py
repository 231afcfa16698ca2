"""Two onnx-graphsurgeon operations every rewrite pays, done quicker and giving the same result: copying a graph and
sorting its nodes.

Every rewrite starts with a copy of its graph (`rlflow.graph.core.Graph.clone`) and ends with a sort (`Graph.finish_edit`),
and the agent's rollouts rewrite at every step.  `gs.Graph.copy` builds each node and tensor through constructors
whose input and output lists keep their other ends in sync one element at a time, and builds the tensor map by name
twice, which makes the copy several times slower than the rewrite it serves on encoder-sized graphs.  Here each node
and tensor is copied once, keyed by identity, and the two ends of every edge are written directly.

The copy is the one `gs.Graph.copy` makes: new nodes and tensors with the same fields, the same attribute values and
constant arrays (shared, never deep-copied), graph inputs and outputs mapped onto the copies.  Graphs holding
subgraphs (If, Loop, Scan) are left to `gs.Graph.copy`, which knows which tensors a body reads from outside.

`toposort` orders the nodes exactly as `gs.Graph.toposort` does (the agent's observations list nodes in that order, so
another valid order would change what a trained agent sees), in one pass instead of a recursion that looks every
tensor up by name: on MiniLM 8 ms of a 60 ms rollout step.
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
    copy = object.__new__(type(graph))  # every field as it is (name, opset, domains...), whatever gs's version
    fields = copy.__dict__
    fields.update(graph.__dict__)
    fields.update(nodes=nodes, inputs=[tensor(t) for t in graph.inputs], outputs=[tensor(t) for t in graph.outputs])
    for key in ("_functions", "functions"):  # a list of its own (gs's setter would empty the original's in place)
        if key in fields:
            fields[key] = list(fields[key])
    return copy


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


def toposort(graph: gs.Graph) -> gs.Graph:
    """Sorts `graph.nodes` in place as `gs.Graph.toposort` does, and returns the graph.

    gs gives each node a level (0 for a node reading no other node's output, else one more than its highest
    producer's), records the levels in the order of a depth-first walk from each node in turn through its inputs'
    producers, and sorts those records stably by level.  The same walk here is iterative and keyed by identity.
    Graphs with subgraphs or functions, a node listed twice, and anything gs would refuse (a producer outside the
    graph, a cycle) are left to gs.
    """
    members = {id(node) for node in graph.nodes}
    if graph.functions or len(members) != len(graph.nodes) or any(  # a node listed twice: gs counts it twice
            isinstance(v, gs.Graph) for node in graph.nodes for v in node.attrs.values()):
        return graph.toposort()
    level: dict[int, int] = {}
    order: list[gs.Node] = []  # the walk's post-order: the order gs records its levels in
    for start in graph.nodes:
        if id(start) in level:
            continue
        producers = _producers(start)
        stack = [(start, producers, iter(producers))]  # a node, its producers, and where the walk is among them
        on_path = {id(start)}
        while stack:
            node, producers, pending = stack[-1]
            for producer in pending:
                if id(producer) not in level:
                    if id(producer) not in members or id(producer) in on_path:
                        return graph.toposort()  # gs's own error says what is wrong
                    on_path.add(id(producer))
                    below = _producers(producer)
                    stack.append((producer, below, iter(below)))
                    break
            else:
                stack.pop()
                on_path.discard(id(node))
                level[id(node)] = max((level[id(p)] for p in producers), default=-1) + 1
                order.append(node)
    graph.nodes = sorted(order, key=lambda node: level[id(node)])
    return graph


def _producers(node: gs.Node) -> list[gs.Node]:
    """The nodes producing `node`'s inputs, each once, in input order (gs's `get_used_nodes`: an omitted optional
    tensor, named "", has none)."""
    seen: dict[int, gs.Node] = {}
    for tensor in node.inputs:
        for producer in tensor.inputs if tensor.name else ():
            seen.setdefault(id(producer), producer)
    return list(seen.values())


__all__ = ["copy_graph", "toposort"]
