"""Tiny graphs built with onnx.helper and the three checks every rule gets: match, reasoned refusal, numerics."""
from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from rlflow.graph.core import Graph
from rlflow.measure.verify import verify
from rlflow.rewrites import apply, rule

F32 = TensorProto.FLOAT


def node(op: str, inputs: Sequence[str], outputs: Sequence[str] | str = ("y",), domain: str | None = None, **attrs):
    """An onnx NodeProto; `outputs` may be a single name."""
    outputs = [outputs] if isinstance(outputs, str) else list(outputs)
    return helper.make_node(op, list(inputs), outputs, domain=domain, **attrs)


def weights(*shape: int, seed: int = 0, scale: float = 1.0, dtype=np.float32) -> np.ndarray:
    """A random normal constant."""
    rng = np.random.default_rng(seed + 7919 * len(shape) + sum(shape))
    return (rng.standard_normal(shape) * scale).astype(dtype)


def ints(*values: int) -> np.ndarray:
    """An int64 vector (Reshape targets, axes, pads)."""
    return np.array(values, dtype=np.int64)


def model(nodes, inputs: Mapping[str, Sequence], outputs: Sequence[str] | Mapping[str, int] = ("y",),
          consts: Mapping[str, np.ndarray] | None = None, opset: int = 13, custom: Sequence[str] = ()) -> onnx.ModelProto:
    """A model from nodes; inputs map a name to a shape (float32) or to (shape, element type); outputs carry no
    shape (inference fills it) and are float32 unless a mapping gives their element type (or (type, shape))."""
    ins = []
    for name, spec in inputs.items():
        shape, elem = (spec if len(spec) == 2 and isinstance(spec[1], int) and isinstance(spec[0], (list, tuple))
                       else (spec, F32))
        ins.append(helper.make_tensor_value_info(name, elem, list(shape)))
    outs = outputs if isinstance(outputs, Mapping) else {name: F32 for name in outputs}
    outs = {n: (e, None) if isinstance(e, int) else e for n, e in outs.items()}
    graph = helper.make_graph(list(nodes), "tiny", ins, [helper.make_tensor_value_info(n, e, shape)
                                                         for n, (e, shape) in outs.items()],
                              initializer=[numpy_helper.from_array(np.asarray(v), k) for k, v in (consts or {}).items()])
    opsets = [helper.make_opsetid(domain, version) for domain, version in
              [("", opset), ("com.microsoft", 1), *((d, 1) for d in custom)]]
    proto = helper.make_model(graph, opset_imports=opsets, ir_version=8)
    inferred = onnx.shape_inference.infer_shapes(proto)  # fills in the outputs' shapes, which the checker wants
    known = {vi.name: vi for vi in list(inferred.graph.value_info) + list(inferred.graph.output)}
    for out in proto.graph.output:
        if known.get(out.name) is not None and known[out.name].type.tensor_type.HasField("shape"):
            out.type.CopyFrom(known[out.name].type)
    return proto


def graph(nodes, inputs, outputs=("y",), consts=None, opset: int = 13, input_shapes=None, custom=()) -> Graph:
    """A Graph from nodes (see `model`); `custom` names extra operator domains."""
    return Graph.from_model(model(nodes, inputs, outputs, consts, opset, custom), input_shapes)


def assert_rewrites(g: Graph, name: str, *, dynamic: Mapping[str, Sequence[int]] | None = None,
                    count: int | None = None) -> Graph:
    """Checks that rule `name` matches `g`, and that applying each match gives a different graph that onnxruntime
    computes the same function with (at `dynamic` input shapes too, when given), leaving `g` untouched.

    Returns the graph after the first match.
    """
    the_rule = rule(name)
    matches = the_rule.find(g)
    assert matches, f"{name} does not match: {[m.reason for m in the_rule.reasons(g)]}"
    if count is not None:
        assert len(matches) == count, matches
    before = g.fingerprint()
    dynamic = dynamic if dynamic is not None else other_input_sizes(g)
    static = dynamic is None
    reference = g.to_model(static=static)
    first = None
    for match in matches:
        new = apply(g, match)
        # (the fingerprint hashes structure, so removing a duplicate node shows only in the node count)
        assert new.fingerprint() != before or len(new) != len(g), f"{match} changed nothing"
        candidate = new.to_model(static=static)
        onnx.checker.check_model(candidate)
        if not the_rule.contrib:
            assert all((n.domain or "") in ("", "ai.onnx") for n in new.gs.nodes), f"{match} emitted a contrib op"
        shapes = (None,) if static else (dict(g.input_shapes), dynamic)
        result = verify(reference, candidate, shapes=shapes)
        assert result.ok, f"{match}: {result.message}"
        first = first or new
    assert g.fingerprint() == before, "apply modified its input graph"
    return first


def other_input_sizes(g: Graph) -> dict[str, list[int]] | None:
    """Input shapes with every dynamic dimension set to 3 (the static graph uses 1), or None when all are static."""
    shapes, dynamic = {}, False
    for vi in g.interface[0]:
        dims = []
        for d in vi.type.tensor_type.shape.dim:
            fixed = d.HasField("dim_value") and d.dim_value > 0
            dynamic |= not fixed
            dims.append(d.dim_value if fixed else 3)
        shapes[vi.name] = dims
    return shapes if dynamic else None


def assert_refuses(g: Graph, name: str, reason: str) -> None:
    """Checks that rule `name` does not match `g` and gives `reason` (a substring) at some candidate root."""
    the_rule = rule(name)
    assert not the_rule.find(g), f"{name} unexpectedly matches"
    reasons = [m.reason for m in the_rule.reasons(g)]
    assert any(reason in r for r in reasons), f"{name}: expected reason {reason!r}, got {reasons}"


def case_tests(cases: Mapping[str, tuple]):
    """The two parametrised tests every rule gets from a table name -> (positive builder, negative builder, reason):
    the positive graph matches and each match keeps the numbers; the negative one is refused with the reason."""

    @pytest.mark.parametrize("name", list(cases))
    def test_matches_and_keeps_numbers(name):
        assert_rewrites(cases[name][0](), name)

    @pytest.mark.parametrize("name", list(cases))
    def test_refuses_with_reason(name):
        _, negative, reason = cases[name]
        assert_refuses(negative(), name, reason)

    return test_matches_and_keeps_numbers, test_refuses_with_reason


def checkable(proto: onnx.ModelProto) -> onnx.ModelProto:
    """A copy the onnx checker can judge: onnxruntime's SimplifiedLayerNormalization, which it registers in the default
    ONNX domain where the checker knows no such operator, moved to com.microsoft (left alone, as every contrib op)."""
    copy = onnx.ModelProto()
    copy.CopyFrom(proto)
    for n in copy.graph.node:
        if n.op_type == "SimplifiedLayerNormalization" and n.domain in ("", "ai.onnx"):
            n.domain = "com.microsoft"
    if not any(o.domain == "com.microsoft" for o in copy.opset_import):
        copy.opset_import.append(onnx.helper.make_opsetid("com.microsoft", 1))
    return copy


def fused(g: Graph, *names: str, shapes=None) -> Graph:
    """`g` with each rule of `names` applied at all its matches (each must match), checked and verified through
    onnxruntime at `shapes` (input name -> shape dicts; default: the graph's own, and 3 for each dynamic dimension)."""
    out = g
    for name in names:
        matches = rule(name).find(out)
        assert matches, f"{name}: {[m.reason for m in rule(name).reasons(out)]}"
        for match in matches:
            new = apply(out, match)
            assert out.fingerprint() != new.fingerprint()
            out = new
    onnx.checker.check_model(checkable(out.to_model()))
    if not any(rule(n).contrib for n in names):
        assert all((n.domain or "") in ("", "ai.onnx") for n in out.gs.nodes)
    if shapes is None and other_input_sizes(g) is not None:
        shapes = [dict(g.input_shapes), other_input_sizes(g)]
    static = shapes is None
    result = verify(g.to_model(static=static), out.to_model(static=static), shapes=shapes or (None,))
    assert result.ok, result.message
    return out
