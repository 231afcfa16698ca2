"""RMSNorm fusions (`rlflow/rewrites/fusions/rmsnorm.py`): the forms both torch exporters write for transformers'
Llama and Qwen3 (float32 and float16, Qwen3's per-head query and key norms), cut from tiny exports and fused and
verified one by one, whole exports fused everywhere, and synthetic cases for each rule's match and refusals.

onnxruntime's SimplifiedLayerNormalization sits in the default ONNX domain, where the onnx checker knows no such
operator: the checks here run the checker on a copy that moves it to com.microsoft (`checkable`), which the checker
leaves alone, as it does every contrib operator.
"""
from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto
from onnx.utils import Extractor

from rlflow.graph.core import Graph
from rlflow.measure.inputs import random_inputs
from rlflow.measure.verify import verify
from rlflow.rewrites import apply, apply_everywhere, rule

from .conftest import DECODERS, DYNAMO_DECODERS
from .helpers import F32, fused, graph, ints, model, node, weights

F16, F64 = TensorProto.FLOAT16, TensorProto.DOUBLE
SHAPES = ((2, 1), (2, 16))
"""(batch, sequence) of every check: one token (a decode step) and a prompt."""


# ------------------------------------------------------------------------------------------ synthetic patterns
def rms(square="Pow", inverse="Reciprocal", opset=18, axes=(-1,), half=False, weight_first=True, weight_shape=(8,),
        eps_input=False, weight_input=False, shared=False, centred=False, other_square=False, cast_to=None,
        shape=("n", 4, 8)):
    """`w * x / sqrt(mean(x^2) + eps)` as exporters write it: `inverse` Reciprocal (dynamo), Div1 (`Div(1, .)`,
    TorchScript), Pow (`Pow(., -0.5)`) or Div (`x / sqrt`); `half` wraps it in the Casts of a float16 export."""
    ax = dict(axes=list(axes)) if opset < 18 else {}
    extra = ["ax"] if opset >= 18 else []
    nodes, x, elem = [], "x", F16 if half else F32
    if half:
        nodes.append(node("Cast", ["x"], "xf", to=F32))
        x = "xf"
    if centred:
        nodes += [node("ReduceMean", [x, *extra], "mu", **ax), node("Sub", [x, "mu"], "xc")]
        x = "xc"
    base = "z" if other_square else x
    nodes.append(node("Pow", [base, "two"], "sq") if square == "Pow" else node("Mul", [base, base], "sq"))
    nodes += [node("ReduceMean", ["sq", *extra], "ms", **ax), node("Add", ["ms", "eps"], "mse")]
    if inverse == "Pow":
        nodes += [node("Pow", ["mse", "mhalf"], "inv"), node("Mul", [x, "inv"], "nx")]
    elif inverse == "Div":
        nodes += [node("Sqrt", ["mse"], "r"), node("Div", [x, "r"], "nx")]
    else:
        nodes.append(node("Sqrt", ["mse"], "r"))
        nodes.append(node("Reciprocal", ["r"], "inv") if inverse == "Reciprocal" else node("Div", ["one", "r"], "inv"))
        nodes.append(node("Mul", ["inv", x], "nx"))
    normed = "nx"
    if half or cast_to is not None:
        nodes.append(node("Cast", ["nx"], "nh", to=cast_to or F16))
        normed = "nh"
    nodes.append(node("Mul", ["w", normed] if weight_first else [normed, "w"]))
    wtype = {F16: np.float16, F64: np.float64}.get(cast_to or (F16 if half else F32), np.float32)
    consts = {"two": np.array(2.0, np.float32), "mhalf": np.array(-0.5, np.float32), "one": np.array(1.0, np.float32),
              "ax": ints(*axes), "eps": np.array(1e-6, np.float32), "w": (weights(*weight_shape) * 0.1 + 1).astype(wtype)}
    inputs = {"x": (list(shape), elem)}
    for name, flag, spec in (("eps", eps_input, ([], F32)), ("w", weight_input, (list(weight_shape), F32)),
                             ("z", other_square, (list(shape), F32))):
        if flag:
            inputs[name] = spec
            consts.pop(name, None)
    outputs = {"y": {F16: F16, F64: F64}.get(cast_to or (F16 if half else F32), F32), **({"ms": F32} if shared else {})}
    return graph(nodes, inputs, outputs, consts=consts, opset=opset)


def skip(shape=("n", 4, 8), axis=-1, op="SimplifiedLayerNormalization", dtype=F32, shared=True, a_shape=None):
    """`norm(a + b)` with the sum read again (a pre-norm decoder's residual stream); `a_shape`: a's, if not b's."""
    np_type = {F32: np.float32, F16: np.float16, F64: np.float64}[dtype]
    nodes = [node("Add", ["a", "b"], "s"), node(op, ["s", "w"], "n", axis=axis, epsilon=1e-6)]
    nodes.append(node("Add", ["s", "n"]) if shared else node("Identity", ["n"]))
    proto = model(nodes, {"a": (list(a_shape or shape), dtype), "b": (list(shape), dtype)}, {"y": dtype},
                  consts={"w": (weights(shape[-1]) * 0.1 + 1).astype(np_type)}, opset=23 if op == "RMSNormalization" else 17)
    return Graph.from_model(proto, checked=True)  # the checker refuses SimplifiedLayerNormalization


def fused_op(op: str, inputs, *, half=False, outputs=1, used=None, opset=17, **attrs) -> Graph:
    """One onnxruntime operator of the RMSNorm family (`op` in the default domain, or `Skip...` in com.microsoft) on
    [n, 4, 8] inputs and a weight; `used` output indices become graph outputs (default: the first)."""
    elem = F16 if half else F32
    names = [f"o{i}" for i in range(outputs)]
    used = used or (0,)
    domain = "com.microsoft" if op.startswith("Skip") else None
    nodes = [node(op, inputs, names, domain=domain, **attrs)]
    nodes += [node("Identity", [names[i]], "y" if i == used[0] else f"y{i}") for i in used]
    w = (weights(8) * 0.1 + 1).astype(np.float16 if half else np.float32)
    proto = model(nodes, {t: (["n", 4, 8], elem) for t in inputs if t != "w"},
                  {"y" if i == used[0] else f"y{i}": (F32 if i in (1, 2) else elem) for i in used}, consts={"w": w},
                  opset=opset)
    return Graph.from_model(proto, checked=True)  # the checker refuses SimplifiedLayerNormalization


CASES = {
    "rmsnorm-fusion": (lambda: rms(), lambda: rms(eps_input=True), "the epsilon is not a constant scalar"),
    "skip-rmsnorm-fusion": (lambda: skip(), lambda: skip(shape=(2, 3, 4, 8)), "not two 2-D or 3-D tensors"),
    "rmsnorm-standard-fusion": (lambda: rms(opset=23), lambda: rms(opset=18), "RMSNormalization needs opset 23"),
    "rmsnorm-unfuse": (lambda: fused_op("SimplifiedLayerNormalization", ["x", "w"], half=True, epsilon=1e-6),
                       lambda: fused_op("SimplifiedLayerNormalization", ["x", "w"], outputs=2, used=(0, 1)),
                       "the inverse deviation output is used"),
    "skip-rmsnorm-unfuse": (lambda: fused_op("SkipSimplifiedLayerNormalization", ["x", "r", "w"], outputs=4, used=(0, 3)),
                            lambda: fused_op("SkipSimplifiedLayerNormalization", ["x", "r", "w"], outputs=3, used=(0, 2)),
                            "the mean or inverse deviation output is used"),
}


@pytest.mark.parametrize("name", list(CASES))
def test_matches_and_keeps_numbers(name):
    fused(CASES[name][0](), name)


@pytest.mark.parametrize("name", list(CASES))
def test_refuses_with_reason(name):
    _, negative, reason = CASES[name]
    the_rule = rule(name)
    g = negative()
    assert not the_rule.find(g)
    reasons = [m.reason for m in the_rule.reasons(g)]
    assert any(reason in r for r in reasons), reasons


@pytest.mark.parametrize("kwargs", [
    dict(), dict(square="Mul"), dict(inverse="Div1"), dict(inverse="Pow"), dict(inverse="Div"), dict(weight_first=False),
    dict(opset=17), dict(opset=23), dict(half=True), dict(half=True, inverse="Div1", opset=17),
    dict(shape=("n", "s", 2, 8)), dict(axes=(-2, -1), weight_shape=(4, 1), shape=("n", 4, 8)),
], ids=str)
def test_rmsnorm_variants(kwargs):
    g = rms(**kwargs)
    out = fused(g, "rmsnorm-fusion")
    counts = out.op_counts()
    assert counts == {"SimplifiedLayerNormalization": 1}, counts  # the Casts of a float16 export absorbed too
    (sln,) = out.gs.nodes
    rank, axes = len(g.input_shapes["x"]), len(kwargs.get("axes", (-1,)))
    assert sln.attrs["stash_type"] == 1 and sln.attrs["axis"] == rank - axes


def test_a_float32_norm_cast_to_float16_fuses_in_float32():
    """TorchScript's float16 export normalises its float32 residual stream, casts to float16, then scales: the fused
    operator scales in float32 by the weight widened, and the Cast stays after it."""
    out = fused(rms(cast_to=F16), "rmsnorm-fusion")
    assert out.op_counts() == {"SimplifiedLayerNormalization": 1, "Cast": 1}
    sln = next(n for n in out.gs.nodes if n.op == "SimplifiedLayerNormalization")
    assert Graph.constant(sln.inputs[1]).dtype == np.float32 and out.gs.outputs[0].dtype == np.float16


@pytest.mark.parametrize("kwargs, reason", [
    (dict(weight_input=True), "the weight is not a constant"),
    (dict(axes=(1,)), "the mean is not over the last axis"),
    (dict(shared=True), "the mean square, the normalised x) is read elsewhere"),
    (dict(centred=True), "x is centred"),
    (dict(other_square=True), "the mean is not of the normalised input squared"),
    (dict(cast_to=F64), "cast to another type than x's"),
    (dict(shape=("n", 4, "d"), weight_shape=(1,)), "a normalised axis is dynamic"),
    (dict(weight_shape=(4, 8)), "the weight varies along leading axes"),
], ids=lambda v: v if isinstance(v, str) else "")
def test_rmsnorm_refusals(kwargs, reason):
    g = rms(**kwargs)
    assert not rule("rmsnorm-fusion").find(g)
    assert any(reason in m.reason for m in rule("rmsnorm-fusion").reasons(g)), rule("rmsnorm-fusion").reasons(g)


@pytest.mark.parametrize("kwargs, reason", [
    (dict(axis=1), "not over the last axis alone"),
    (dict(dtype=F64), "not a float32 or float16 norm"),
    (dict(a_shape=(1, 4, 8)), "of one shape (at every size)"),  # a broadcasts along the batch: one shape at batch 1
])
def test_skip_rmsnorm_refusals(kwargs, reason):
    g = skip(**kwargs)
    assert not rule("skip-rmsnorm-fusion").find(g)
    assert any(reason in m.reason for m in rule("skip-rmsnorm-fusion").reasons(g))


@pytest.mark.parametrize("op", ["SimplifiedLayerNormalization", "RMSNormalization"])
@pytest.mark.parametrize("shared, dtype", [(True, F32), (False, F32), (True, F16)])
def test_skip_rmsnorm_variants(op, shared, dtype):
    out = fused(skip(op=op, shared=shared, dtype=dtype), "skip-rmsnorm-fusion", shapes=[{"a": [5, 4, 8], "b": [5, 4, 8]}])
    (fused_node,) = [n for n in out.gs.nodes if n.op == "SkipSimplifiedLayerNormalization"]
    assert (len(fused_node.outputs) == 4) == shared
    assert ("Add" in out.op_counts()) == shared  # the sum's other reader


# ------------------------------------------------------------------------------------------ the exporters' forms
def rms_cuts(proto: onnx.ModelProto) -> dict[str, onnx.ModelProto]:
    """Each RMSNorm of an export cut out with onnx's Extractor, named by its weight: from its input x (before a Cast;
    the residual Add's two operands where an Add writes x) to the weight Mul's output (and the Add's sum)."""
    producer = {t: n for n in proto.graph.node for t in n.output}
    readers: dict[str, list] = {}
    for n in proto.graph.node:
        for t in n.input:
            readers.setdefault(t, []).append(n)
    initializers = {t.name for t in proto.graph.initializer}
    extractor = Extractor(onnx.shape_inference.infer_shapes(proto, data_prop=True))
    cuts = {}
    for mean in (n for n in proto.graph.node if n.op_type == "ReduceMean"):
        x = producer[mean.input[0]].input[0]
        source = producer[x].input[0] if x in producer and producer[x].op_type == "Cast" else x
        add = producer.get(source)
        inputs = list(add.input) if add is not None and add.op_type == "Add" else [source]
        tensor, weight = mean.output[0], None
        while weight is None and len(readers.get(tensor, [])) == 1:
            reader = readers[tensor][0]
            weight = next((t for t in reader.input if t in initializers), None) if reader.op_type == "Mul" else None
            tensor = reader.output[0]
        assert weight is not None, f"no weight after {mean.name}"
        cuts[weight] = extractor.extract_model(inputs, [tensor] + ([source] if len(inputs) == 2 else []))
    return cuts


def _sizes(g: Graph, cut: onnx.ModelProto, sequence: int) -> dict[str, list[int]]:
    """The cut's input shapes in the whole export `g` (fixed at sequence 16) at another sequence length."""
    tensors = g.gs.tensors()
    return {i.name: [2, sequence, *g.shape(tensors[i.name])[2:]] for i in cut.graph.input}


def _float64_error(g: Graph, new: Graph, shapes: dict) -> tuple[float, float]:
    """The relative errors of `g` (an RMSNorm cut) and `new` (fused) against the norm computed in float64."""
    (match,) = rule("rmsnorm-fusion").find(g)
    weight = Graph.constant(match.input("weight", g.node_map())).astype(np.float64)
    proto = g.to_model(static=False)
    feeds = random_inputs(proto, 0, shapes)
    x = sum(v.astype(np.float64) for v in feeds.values())
    axes = tuple(range(match.param("axis"), x.ndim))
    expected = x / np.sqrt(np.mean(x * x, axis=axes, keepdims=True) + match.param("epsilon")) * weight
    errors = []
    for m in (proto, new.to_model(static=False)):
        session = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
        out = session.run([proto.graph.output[0].name], feeds)[0].astype(np.float64)
        errors.append(float(np.linalg.norm(out - expected) / np.linalg.norm(expected)))
    return errors[0], errors[1]


def _decoder_cuts(decoder_exports, name: str):
    """(whole export as a Graph at sequence 16, {weight name: cut}) of decoder `name` (`llama-fp16-ts`)."""
    decoder, exporter = name.rsplit("-", 1)
    proto = decoder_exports[name if exporter == "ts" else "decoders-dynamo"]
    whole = Graph.from_model(proto, {i.name: (2, 16) for i in proto.graph.input})
    key = decoder.replace("-", "_") + "."
    return whole, {w: cut for w, cut in rms_cuts(proto).items() if key in w}


FORMS = [f"{d}-ts" for d in DECODERS] + [f"{d}-dynamo" for d in DYNAMO_DECODERS]


@pytest.mark.parametrize("name", FORMS)
def test_the_exporters_forms_fuse_and_keep_numbers(decoder_exports, name):
    """Every RMSNorm of the export, cut out: it fuses (with the residual Add, where one writes its input), and
    onnxruntime computes the same at sequence 1 and 16; a float16 norm is no less accurate fused (against float64)."""
    whole, cuts = _decoder_cuts(decoder_exports, name)
    kinds = {w.split(".")[-2] for w in cuts}
    assert kinds >= {"input_layernorm", "post_attention_layernorm", "norm"}
    assert name.startswith("llama") or kinds >= {"q_norm", "k_norm"}
    for weight, cut in cuts.items():
        g = Graph.from_model(cut, _sizes(whole, cut, 16))
        residual = len(cut.graph.input) == 2
        names = ("rmsnorm-fusion", "skip-rmsnorm-fusion") if residual else ("rmsnorm-fusion",)
        new = fused(g, *names, shapes=[_sizes(whole, cut, s) for _, s in SHAPES])
        counts = new.op_counts()
        assert not {"ReduceMean", "Pow", "Sqrt", "Add"} & set(counts), (weight, counts)
        assert counts.get("SkipSimplifiedLayerNormalization" if residual else "SimplifiedLayerNormalization") == 1
        if name.endswith("fp16-dynamo"):
            assert "Cast" not in counts, (weight, counts)  # both Casts absorbed
        if np.dtype(g.gs.outputs[0].dtype) == np.float16 and not residual:
            before, after = _float64_error(g, apply(g, rule("rmsnorm-fusion").find(g)[0]), _sizes(whole, cut, 16))
            assert after <= before * 1.05, (weight, before, after)


@pytest.mark.parametrize("name", ["qwen3-fp16-ts", "llama-fp32-ts", "qwen3-fp16-dynamo"])
def test_the_exporters_forms_fuse_to_the_standard_operator_at_opset_23(decoder_exports, name):
    whole, cuts = _decoder_cuts(decoder_exports, name)
    for weight, cut in cuts.items():
        converted = onnx.version_converter.convert_version(cut, 23)
        g = Graph.from_model(converted, _sizes(whole, cut, 16))
        new = fused(g, "rmsnorm-standard-fusion", shapes=[_sizes(whole, cut, s) for _, s in SHAPES])
        assert new.op_counts().get("RMSNormalization") == 1 and "ReduceMean" not in new.op_counts(), weight


@pytest.mark.parametrize("name", ["llama-fp32-ts", "llama-fp16-ts", "decoders-dynamo"])
def test_a_whole_decoder_has_no_rmsnorm_left(decoder_exports, name):
    """rmsnorm-fusion then skip-rmsnorm-fusion everywhere: no ReduceMean is left (every norm fused), every residual
    Add before a norm is inside a SkipSimplifiedLayerNormalization, and the logits are the same."""
    proto = decoder_exports[name]
    sizes = [{i.name: list(s) for i in proto.graph.input} for s in SHAPES]
    g = Graph.from_model(proto, sizes[1])
    norms = g.op_counts()["ReduceMean"]
    out = g
    for name_ in ("rmsnorm-fusion", "skip-rmsnorm-fusion"):
        out, applied = apply_everywhere(out, rule(name_), rule(name_).find(out))
        assert applied
    counts = out.op_counts()
    assert "ReduceMean" not in counts and "Pow" not in counts, counts
    skipped = counts["SkipSimplifiedLayerNormalization"]
    assert counts["SimplifiedLayerNormalization"] + skipped == norms
    layers = 2 if name.endswith("-ts") else 1  # every norm but each decoder's first reads a residual sum
    assert skipped == (2 * layers) * (1 if name.endswith("-ts") else len(DYNAMO_DECODERS))
    result = verify(g.to_model(static=False), out.to_model(static=False), shapes=sizes)
    assert result.ok, result.message


@pytest.mark.parametrize("name", ["qwen3-fp16-dynamo", "qwen3-fp16-ts", "llama-fp32-ts"])
def test_round_trips_through_the_inverses(decoder_exports, name):
    """Each fused norm of the export unfused (rmsnorm-unfuse, skip-rmsnorm-unfuse) fuses again to the same graph."""
    whole, cuts = _decoder_cuts(decoder_exports, name)
    for weight, cut in cuts.items():
        g = Graph.from_model(cut, _sizes(whole, cut, 16))
        names = ["rmsnorm-fusion", "skip-rmsnorm-fusion"][:len(cut.graph.input)]
        once = fused(g, *names)
        back = fused(once, *(n.replace("fusion", "unfuse") for n in reversed(names)))
        again = fused(back, *names)
        assert "ReduceMean" in back.op_counts() and again.op_counts() == once.op_counts(), weight


def test_the_fusions_rewrite_decoders_from_their_matches_alone(decoder_exports, monkeypatch):
    """The matches carry all their rewrites need (`test_matches.py`), on a whole export with a shared residual sum."""
    from .test_matches import _rewrites_from_the_match_alone

    proto = decoder_exports["qwen3-fp16-ts"]
    g = Graph.from_model(proto, {i.name: (2, 16) for i in proto.graph.input})
    assert _rewrites_from_the_match_alone(g, "rmsnorm-fusion", monkeypatch) == 9
    g, _ = apply_everywhere(g, rule("rmsnorm-fusion"), rule("rmsnorm-fusion").find(g))
    assert _rewrites_from_the_match_alone(g, "skip-rmsnorm-fusion", monkeypatch) == 4
