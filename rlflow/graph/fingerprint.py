"""Graph identity: a structural hash of a `rlflow.graph.core.Graph` (not imported here: the graph module imports this one)
that ignores node and tensor names.

Searches, the environment's caches and the agent's rollouts tell graphs apart by it (a graph reached twice, by
different rewrites, is recognised whatever names they chose).  Hashing weights would dominate, so a constant's hash is
cached per array and per place in a mapped weights file.
"""
from __future__ import annotations

import hashlib
import weakref

import numpy as np
import onnx_graphsurgeon as gs

from rlflow.graph.external_data import mapped_place

_COMMUTATIVE = {"Add", "Mul", "Max", "Min", "Sum", "Mean", "And", "Or", "Xor", "Equal"}


def fingerprint(graph) -> str:
    """A structural hash of `graph` (a Graph, or a graphsurgeon graph): equal for graphs that differ only in node and
    tensor names (or commutative operand order)."""
    graph = graph if isinstance(graph, gs.Graph) else graph.gs
    digests: dict[str, bytes] = {}
    for index, tensor in enumerate(graph.inputs):
        digests[tensor.name] = _digest("input", index, tensor.dtype, tensor.shape)
    for tensor in graph.tensors().values():
        if isinstance(tensor, gs.Constant):
            digests[tensor.name] = _constant_digest(tensor)
    digests[""] = _digest("absent")
    for node in graph.nodes:
        operands = [digests.get(t.name, _digest("unknown", t.name)) for t in node.inputs]
        if node.op in _COMMUTATIVE:
            operands.sort()
        attrs = sorted((k, _attr_repr(v)) for k, v in node.attrs.items())
        base = _digest(node.domain, node.op, attrs, *operands)
        for k, tensor in enumerate(node.outputs):
            digests[tensor.name] = _digest(base, k)
    return hashlib.blake2b(b"".join(digests[t.name] for t in graph.outputs), digest_size=16).hexdigest()


def _digest(*parts) -> bytes:
    h = hashlib.blake2b(digest_size=16)
    for part in parts:
        h.update(part if isinstance(part, bytes) else repr(part).encode())
        h.update(b"\x00")
    return h.digest()


_constant_digests: dict[int, tuple[weakref.ref, bytes]] = {}
_mapped_digests: dict[tuple, bytes] = {}


def _constant_digest(tensor: gs.Constant) -> bytes:
    """Hash of a constant's values, cached per array: clones share arrays, so re-hashing weights would dominate.

    The cache holds weak references only, so it never keeps a dropped graph's weights alive.  Weights mapped from a
    file are also cached by their place in it, so a graph rebuilt from an export (the environment does) is not
    hashed again: gigabytes take seconds.
    """
    values = tensor.values
    cached = _constant_digests.get(id(values))
    if cached is not None and cached[0]() is values:
        return cached[1]
    array = np.asarray(values)
    mapped = mapped_place(values)
    place = (*mapped, str(array.dtype), array.shape) if mapped else None
    digest = _mapped_digests.get(place) if place else None
    if digest is None:
        values_hash = hashlib.blake2b(np.ascontiguousarray(array).reshape(-1).view(np.uint8), digest_size=16).digest()
        digest = _digest("const", str(array.dtype), array.shape, values_hash)
        if place:
            _mapped_digests[place] = digest
    try:
        ref = weakref.ref(values)
    except TypeError:
        return digest
    if len(_constant_digests) > 100_000:
        _constant_digests.clear()
    _constant_digests[id(values)] = (ref, digest)
    return digest


def _attr_repr(value) -> str:
    if isinstance(value, gs.Constant):
        return repr((str(value.values.dtype), value.values.shape, value.values.tobytes()))
    if isinstance(value, gs.Graph):
        return repr(gs.export_onnx(value, do_type_check=False).graph.SerializeToString())
    if isinstance(value, np.ndarray):
        return repr((str(value.dtype), value.shape, value.tobytes()))
    return repr(value)
