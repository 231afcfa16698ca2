"""Rotary embedding fusions (`rlflow/rewrites/fusions/attention/rotary.py`, `rotary-unfuse` in
`fusions/unfuse.py`): synthetic forms of transformers' `apply_rotary_pos_emb` as each exporter writes it, with each
rule's match and refusals; whole tiny decoders (Llama and Qwen3, float32 and float16, both exporters) fused everywhere
and verified; a zoo decode step at positions up to the end of the table and one past it (onnxruntime refuses it);
GPT-NeoX's and Phi-3's partial rotations; and the round trip through the inverse.
"""
from __future__ import annotations

import warnings

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto

from rlflow.graph.core import Graph, load
from rlflow.measure.inputs import random_inputs
from rlflow.measure.verify import verify
from rlflow.rewrites import apply_everywhere, rule
from rlflow.rewrites.fusions.attention import rotary

from .conftest import DECODERS, DYNAMO_DECODERS
from .helpers import fused, graph, ints, node, weights

F16, I64 = TensorProto.FLOAT16, TensorProto.INT64
TABLE = 64
"""Rows of the tables in the synthetic checks (CACHE_POSITIONS is patched to it there: smaller models, quicker)."""


@pytest.fixture(autouse=True)
def small_tables(request, monkeypatch):
    if "decode_step" not in request.fixturenames:  # the zoo's decode step is fused with the full table
        monkeypatch.setattr(rotary, "CACHE_POSITIONS", TABLE)


# ------------------------------------------------------------------------------------------ synthetic patterns
def rope(style="dynamo", half=False, scale=None, positions="input", partial=None, lookups=False, inv_input=False,
         shared=False, odd_axis=False, opset=18, heads=2, size=8, inv_half=False):
    """`x * cos + rotate_half(x) * sin` on x [b, heads, s, size] as transformers writes it: the Slice bounds constant
    (`dynamo`) or from `Shape(x)` (`ts`, which also scales cos and sin; `matmul`: transformers 4's angles); `half` casts cos and sin to float16 for a
    float16 x; `positions` an input [b, s] or a Range [1, s]; `partial`: rotate the first `partial` of the head
    (GPT-NeoX); `lookups`: cos and sin gathered from constant tables (rotary-unfuse's form); `inv_half`: inv_freq
    stored in float16 and cast up before the product (`model.half()` converts the buffer: transformers 5.17's export)."""
    rot = partial or size
    h, consts, nodes = rot // 2, {}, []
    elem = F16 if half else TensorProto.FLOAT
    inputs = {"x": (["b", heads, "s", size], elem)}
    if positions == "input":
        inputs["pos"] = (["b", "s"], I64)
    else:
        nodes += [node("Shape", ["x"], "xs"), node("Gather", ["xs", "two"], "len", axis=0),
                  node("Range", ["zero", "len", "one"], "ar"), node("Unsqueeze", ["ar", "ax0"], "pos")]
        consts.update(two=np.array(2, np.int64), zero=np.array(0, np.int64), one=np.array(1, np.int64), ax0=ints(0))
    consts.update(ax1=ints(1), ax2=ints(2))
    if lookups:
        angles = np.arange(TABLE, dtype=np.float32)[:, None] * (1e4 ** -(np.arange(h) / h)).astype(np.float32)
        consts.update(ctab=np.cos(angles).astype(np.float16 if half else np.float32),
                      stab=np.sin(angles).astype(np.float16 if half else np.float32))
        for t in ("c", "s"):
            nodes += [node("Gather", [f"{t}tab", "pos"], f"{t}g", axis=0), node("Concat", [f"{t}g", f"{t}g"], f"{t}3", axis=-1),
                      node("Unsqueeze", [f"{t}3", "ax1"], f"{t}4")]
    else:
        consts["inv"] = (1e4 ** -(np.arange(h) / h)).astype(np.float32)
        if style == "matmul":  # transformers 4: (inv_freq[None, :, None].expand(b, -1, 1) @ position_ids[:, None, :]).T
            consts.update(inv=consts["inv"].reshape(1, h, 1), ones=ints(1, 1), ax1_=ints(1))
            nodes += [node("Shape", ["pos"], "ps", end=1), node("Concat", ["ps", "ones"], "ishape", axis=0),
                      node("Expand", ["inv", "ishape"], "ie")]
            if inv_half:
                nodes.append(node("Cast", ["ie"], "ie32", to=TensorProto.FLOAT))
            nodes += [node("Unsqueeze", ["pos", "ax1_"], "pu"), node("Cast", ["pu"], "pf", to=TensorProto.FLOAT),
                      node("MatMul", ["ie32" if inv_half else "ie", "pf"], "ft"),
                      node("Transpose", ["ft"], "f", perm=[0, 2, 1])]
        else:
            if inv_half:
                nodes.append(node("Cast", ["inv"], "inv32", to=TensorProto.FLOAT))
            nodes += [node("Unsqueeze", ["pos", "ax2"], "pu"), node("Cast", ["pu"], "pf", to=TensorProto.FLOAT),
                      node("Mul", ["pf", "inv32" if inv_half else "inv"], "f")]
        if inv_half:
            consts["inv"] = consts["inv"].astype(np.float16)
        nodes += [node("Concat", ["f", "f"], "emb", axis=-1), node("Cos", ["emb"], "c3"), node("Sin", ["emb"], "s3")]
        if inv_input:
            inputs["inv"] = ([h], TensorProto.FLOAT)
            consts.pop("inv")
        cos, sin = "c3", "s3"
        if style == "ts" or scale is not None:
            consts["scale"] = np.array(1.0 if scale is None else scale, np.float32)
            nodes += [node("Mul", [cos, "scale"], "c3s"), node("Mul", [sin, "scale"], "s3s")]
            cos, sin = "c3s", "s3s"
        if half:
            nodes += [node("Cast", [cos], "c3h", to=F16), node("Cast", [sin], "s3h", to=F16)]
            cos, sin = "c3h", "s3h"
        nodes += [node("Unsqueeze", [cos, "ax2" if odd_axis else "ax1"], "c4"), node("Unsqueeze", [sin, "ax1"], "s4")]
    x = "x"
    if partial:
        consts.update(p0=ints(0), pr=ints(partial), pend=ints(size), last=ints(3))
        nodes += [node("Slice", ["x", "p0", "pr", "last"], "xr"), node("Slice", ["x", "pr", "pend", "last"], "xp")]
        x = "xr"
    if style == "ts":
        nodes += [node("Shape", [x], "sh"), node("Gather", ["sh", "three"], "d", axis=0), node("Div", ["d", "two_"], "dh"),
                  node("Cast", ["dh"], "dc", to=I64), node("Unsqueeze", ["dc", "ax0_"], "hb")]
        consts.update(three=np.array(3, np.int64), two_=np.array(2, np.int64), ax0_=ints(0))
    else:
        consts["hb"] = ints(h)
    consts.update(s0=ints(0), send=ints(2 ** 63 - 1), saxis=ints(3))
    nodes += [node("Slice", [x, "s0", "hb", "saxis"], "x1"), node("Slice", [x, "hb", "send", "saxis"], "x2"),
              node("Neg", ["x2"], "nx2"), node("Concat", ["nx2", "x1"], "rot", axis=-1),
              node("Mul", [x, "c4"], "a"), node("Mul", ["rot", "s4"], "b_"), node("Add", ["a", "b_"], "r")]
    outputs = {"y": elem}
    nodes.append(node("Concat", ["r", "xp"], "y", axis=-1) if partial else node("Identity", ["r"], "y"))
    if shared:
        outputs["rot"] = elem
    return graph(nodes, inputs, outputs, consts=consts, opset=opset)


def rotary_op(contrib=True, partial=None, half=False, interleaved=0, positions=True):
    """One RotaryEmbedding (contrib or standard) on x [b, 2, s, 8] with tables of TABLE rows."""
    rot = partial or 8
    dtype = np.float16 if half else np.float32
    attrs = dict(interleaved=interleaved, **({"rotary_embedding_dim": rot, "num_heads": 2} if partial else {}))
    names = ["x", "pos", "cos", "sin"] if contrib else ["x", "cos", "sin", *(["pos"] if positions else [])]
    tables = {"cos": weights(TABLE, rot // 2, dtype=dtype), "sin": weights(TABLE, rot // 2, seed=1, dtype=dtype)}
    inputs = {"x": (["b", 2, "s", 8], F16 if half else TensorProto.FLOAT)}
    if positions:
        inputs["pos"] = (["b", "s"], I64)
    else:
        inputs.update({k: (["b", "s", rot // 2], TensorProto.FLOAT) for k in ("cos", "sin")})
        tables = {}
    n = node("RotaryEmbedding", names, "y", domain="com.microsoft" if contrib else None, **attrs)
    outputs = {"y": (F16 if half else TensorProto.FLOAT, ["b", 2, "s", 8])}
    return graph([n], inputs, outputs, consts=tables, opset=18 if contrib else 23)


CASES = {
    "rotary-fusion": (lambda: rope(), lambda: rope(inv_input=True), "inv_freq is not a constant"),
    "rotary-standard-fusion": (lambda: rope(opset=23), lambda: rope(opset=18), "RotaryEmbedding needs opset 23"),
    "rotary-unfuse": (lambda: rotary_op(), lambda: rotary_op(interleaved=1), "interleaved, packed or scaled"),
}


@pytest.mark.parametrize("name", list(CASES))
def test_matches_and_keeps_numbers(name):
    fused(CASES[name][0](), name)


@pytest.mark.parametrize("name", list(CASES))
def test_refuses_with_reason(name):
    _, negative, reason = CASES[name]
    g = negative()
    assert not rule(name).find(g)
    reasons = [m.reason for m in rule(name).reasons(g)]
    assert any(reason in r for r in reasons), reasons


@pytest.mark.parametrize("kwargs", [
    dict(), dict(style="ts"), dict(half=True), dict(half=True, style="ts"), dict(scale=0.7), dict(positions="range"),
    dict(partial=4), dict(partial=4, style="ts"), dict(lookups=True), dict(lookups=True, half=True), dict(heads=1),
    dict(style="matmul"), dict(style="matmul", half=True), dict(style="matmul", half=True, inv_half=True),
    dict(half=True, inv_half=True),
], ids=str)
def test_rotary_variants(kwargs):
    heads, with_ids = kwargs.get("heads", 2), kwargs.get("positions", "input") == "input"
    shapes = [{"x": [2, heads, s, 8], **({"pos": [2, s]} if with_ids else {})} for s in (1, 16)]
    out = fused(rope(**kwargs), "rotary-fusion", shapes=shapes)
    (fused_node,) = [n for n in out.gs.nodes if n.op == "RotaryEmbedding"]
    assert not {"Neg", "Slice", "Cos", "Sin", "Add"} & set(out.op_counts()), out.op_counts()
    assert fused_node.attrs.get("rotary_embedding_dim", 0) == kwargs.get("partial", 0)
    cos = Graph.constant(fused_node.inputs[2])
    assert cos.shape == (TABLE, kwargs.get("partial", 8) // 2) and cos.dtype == (np.float16 if kwargs.get("half") else np.float32)


@pytest.mark.parametrize("kwargs, reason", [
    (dict(inv_input=True), "inv_freq is not a constant"),
    (dict(shared=True), "a value inside the rotation is read elsewhere"),
    (dict(odd_axis=True), "are not Unsqueeze(1) of Cos and Sin"),
], ids=lambda v: v if isinstance(v, str) else "")
def test_rotary_refusals(kwargs, reason):
    g = rope(**kwargs)
    assert not rule("rotary-fusion").find(g)
    assert any(reason in m.reason for m in rule("rotary-fusion").reasons(g)), rule("rotary-fusion").reasons(g)


def test_a_float64_rotation_is_refused():
    g = rope()
    g.gs.inputs[0].dtype = np.float64  # onnxruntime has no float64 RotaryEmbedding kernel
    assert any("not float32 or float16" in m.reason for m in rule("rotary-fusion").reasons(g))


def test_the_table_is_the_exports_angles_through_its_casts_and_scale():
    """Rows 0 to TABLE - 1 equal what the unfused graph computes at those positions (half precision: its rounding)."""
    for kwargs in (dict(scale=0.7), dict(half=True, style="ts")):
        g = rope(**kwargs)
        out = fused(g, "rotary-fusion")
        (fused_node,) = [n for n in out.gs.nodes if n.op == "RotaryEmbedding"]
        x = np.zeros((1, 2, TABLE, 8), np.float16 if kwargs.get("half") else np.float32)
        x[..., 0] = 1  # rotated, the first element of each head gives cos, the fifth sin
        feeds = {"x": x, "pos": np.arange(TABLE, dtype=np.int64)[None]}
        session = ort.InferenceSession(g.to_model(static=False).SerializeToString(), providers=["CPUExecutionProvider"])
        y = session.run(None, feeds)[0][0, 0]
        np.testing.assert_allclose(Graph.constant(fused_node.inputs[2])[:, 0], y[:, 0], rtol=2e-3 if kwargs.get("half") else 1e-6, atol=1e-6)
        np.testing.assert_allclose(Graph.constant(fused_node.inputs[3])[:, 0], y[:, 4], rtol=2e-3 if kwargs.get("half") else 1e-6, atol=1e-6)


@pytest.mark.parametrize("kwargs", [dict(), dict(partial=4), dict(half=True), dict(contrib=False),
                                    dict(contrib=False, partial=4)], ids=str)
def test_unfuse_variants_and_round_trip(kwargs):
    g = rotary_op(**kwargs)
    shapes = [{"x": [2, 2, s, 8], "pos": [2, s]} for s in (1, 16)]
    back = fused(g, "rotary-unfuse", shapes=shapes)
    assert "RotaryEmbedding" not in back.op_counts() and back.op_counts()["Gather"] == 2
    again = fused(back, "rotary-fusion" if kwargs.get("contrib", True) else "rotary-standard-fusion", shapes=shapes)
    assert again.fingerprint() == g.fingerprint()


def test_unfuse_refuses_tables_without_positions():
    g = rotary_op(contrib=False, positions=False)
    assert not rule("rotary-unfuse").find(g)
    assert any("position ids" in m.reason for m in rule("rotary-unfuse").reasons(g))


# ------------------------------------------------------------------------------------------ the exporters' forms
def _decoder(decoder_exports, name: str):
    """(the export of `name` with its norms fused, as a search meets it, and the sizes to verify at: a decode-sized
    step, a prompt, and batch 1)."""
    proto = decoder_exports[name]
    sizes = [{i.name: [b, s] for i in proto.graph.input} for b, s in ((2, 1), (2, 16), (1, 7))]
    g = Graph.from_model(proto, sizes[1])
    g, _ = apply_everywhere(g, rule("rmsnorm-fusion"), rule("rmsnorm-fusion").find(g))  # Qwen3's query and key norms
    return g, sizes


def _everywhere(g: Graph, name: str) -> tuple[Graph, int]:
    out, applied = apply_everywhere(g, rule(name), rule(name).find(g))
    return out, len(applied)


@pytest.mark.parametrize("name", [f"{d}-ts" for d in DECODERS] + ["decoders-dynamo"])
def test_whole_decoders_fuse_every_rotation_and_keep_numbers(decoder_exports, name):
    """Every query and key rotation of the export fused, nothing of the rotations left, one cos and one sin table per
    element type, and the logits the same at sequence 1 and 16, batch 2 and 1 (the position ids of batch 1 that the
    export broadcasts are expanded)."""
    g, sizes = _decoder(decoder_exports, name)
    out, applied = _everywhere(g, "rotary-fusion")
    counts = out.op_counts()
    assert applied == counts["RotaryEmbedding"] == 2 * (2 if name.endswith("-ts") else len(DYNAMO_DECODERS))
    assert not {"Neg", "Cos", "Sin"} & set(counts), counts
    rotations = [n for n in out.gs.nodes if n.op == "RotaryEmbedding"]
    tables = {t.name for n in rotations for t in n.inputs[2:]}
    assert len(tables) == 2 * len({n.inputs[0].dtype for n in rotations})
    result = verify(g.to_model(static=False), out.to_model(static=False), shapes=sizes)
    assert result.ok, result.message


@pytest.mark.parametrize("name", ["qwen3-fp16-ts", "decoders-dynamo"])
def test_whole_decoders_round_trip_through_the_inverse(decoder_exports, name):
    g, sizes = _decoder(decoder_exports, name)
    once, n = _everywhere(g, "rotary-fusion")
    back, m = _everywhere(once, "rotary-unfuse")
    again, _ = _everywhere(back, "rotary-fusion")
    assert n == m and "RotaryEmbedding" not in back.op_counts() and again.fingerprint() == once.fingerprint()
    result = verify(once.to_model(static=False), back.to_model(static=False), shapes=sizes)
    assert result.ok, result.message


@pytest.mark.parametrize("name", ["llama-fp32-ts", "qwen3-fp16-ts"])
def test_whole_decoders_fuse_to_the_standard_operator_at_opset_23(decoder_exports, name):
    proto = onnx.version_converter.convert_version(decoder_exports[name], 23)
    sizes = [{i.name: [b, s] for i in proto.graph.input} for b, s in ((2, 1), (2, 16))]
    g = Graph.from_model(proto, sizes[1])
    out, applied = _everywhere(g, "rotary-standard-fusion")
    assert applied == 4 and all((n.domain or "") == "" for n in out.gs.nodes if n.op == "RotaryEmbedding")
    result = verify(g.to_model(static=False), out.to_model(static=False), shapes=sizes)
    assert result.ok, result.message


@pytest.fixture(scope="module")
def partial_exports(tmp_path_factory):
    """GPT-NeoX (rotary_pct 0.5) and Phi-3 (partial_rotary_factor 0.5), one tiny layer each, through TorchScript."""
    transformers = pytest.importorskip("transformers")
    import torch

    folder, protos = tmp_path_factory.mktemp("partial"), {}
    common = dict(hidden_size=64, num_attention_heads=4, intermediate_size=128, vocab_size=128, num_hidden_layers=1,
                  max_position_embeddings=64)
    builds = {"neox": lambda: transformers.GPTNeoXForCausalLM(transformers.GPTNeoXConfig(rotary_pct=0.5, **common)),
              "phi3": lambda: transformers.Phi3ForCausalLM(transformers.Phi3Config(
                  num_key_value_heads=2, partial_rotary_factor=0.5, pad_token_id=0, eos_token_id=1, **common))}

    class Logits(torch.nn.Module):
        def __init__(self, model):
            super().__init__()
            self.model = model

        def forward(self, input_ids, attention_mask):
            return self.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits

    ids, mask, axes = torch.randint(0, 128, (2, 8)), torch.ones(2, 8, dtype=torch.int64), {0: "batch", 1: "sequence"}
    for name, build in builds.items():
        torch.manual_seed(0)
        with warnings.catch_warnings(), torch.no_grad():
            warnings.simplefilter("ignore")
            torch.onnx.export(Logits(build().eval()), (ids, mask), str(folder / f"{name}.onnx"), dynamo=False,
                              opset_version=17, input_names=["input_ids", "attention_mask"], output_names=["logits"],
                              dynamic_axes={"input_ids": axes, "attention_mask": axes, "logits": axes})
        protos[name] = onnx.load(str(folder / f"{name}.onnx"))
    return protos


@pytest.mark.parametrize("name", ["neox", "phi3"])
def test_partial_rotations_fuse_whole(partial_exports, name):
    """The rotated first half of each head and the Concat of the rest back: one operator with rotary_embedding_dim."""
    proto = partial_exports[name]
    sizes = [{i.name: [b, s] for i in proto.graph.input} for b, s in ((2, 1), (2, 16))]
    g = Graph.from_model(proto, sizes[1])
    out, applied = _everywhere(g, "rotary-fusion")
    rotations = [n for n in out.gs.nodes if n.op == "RotaryEmbedding"]
    assert applied == len(rotations) == 2 and all(n.attrs["rotary_embedding_dim"] == 8 for n in rotations)
    assert not {"Neg", "Cos", "Sin"} & set(out.op_counts())
    result = verify(g.to_model(static=False), out.to_model(static=False), shapes=sizes)
    assert result.ok, result.message
    back, _ = _everywhere(out, "rotary-unfuse")
    assert _everywhere(back, "rotary-fusion")[0].fingerprint() == out.fingerprint()


@pytest.fixture(scope="module")
def decode_step(tmp_path_factory):
    """The zoo's tiny Llama decode step (TorchScript: position ids and a key/value cache as inputs), its rotations
    fused with the full table."""
    pytest.importorskip("transformers")
    from rlflow import zoo

    g = load(zoo.build("llama-tiny-decode-p16-ts", tmp_path_factory.mktemp("zoo")).path)
    out, applied = _everywhere(g, "rotary-fusion")
    assert applied == 4
    return g, out


def _step_sizes(batch: int, past: int) -> dict[str, list[int]]:
    return {"input_ids": [batch, 1], "attention_mask": [batch, past + 1], "position_ids": [batch, 1],
            **{f"past_key_values.{i}.{k}": [batch, 2, past, 16] for i in range(2) for k in ("key", "value")}}


def test_a_decode_step_keeps_its_numbers_at_any_past_length(decode_step):
    g, out = decode_step
    result = verify(g.to_model(static=False), out.to_model(static=False), shapes=[_step_sizes(2, 16), _step_sizes(2, 40),
                                                                                     _step_sizes(1, 3)])
    assert result.ok, result.message


def test_positions_to_the_end_of_the_table_and_past_it(decode_step):
    """Up to position CACHE_POSITIONS - 1 the fused step computes what the export computes; past it onnxruntime
    refuses to run (the export would go on), never a silently wrong answer."""
    g, out = decode_step
    reference, candidate = (ort.InferenceSession(m.to_model(static=False).SerializeToString(),
                                                 providers=["CPUExecutionProvider"]) for m in (g, out))
    feeds = random_inputs(g.to_model(static=False), 0, _step_sizes(2, 16))
    last = rotary.CACHE_POSITIONS - 1
    assert out.gs.nodes and Graph.constant(next(n for n in out.gs.nodes if n.op == "RotaryEmbedding").inputs[2]).shape[0] == last + 1
    for positions in ([[last], [last - 17]], [[30000], [4097]], [[0], [1]]):
        feeds["position_ids"] = np.array(positions, np.int64)
        for expected, actual in zip(reference.run(None, feeds), candidate.run(None, feeds)):
            assert np.linalg.norm(actual - expected) <= 1e-5 * np.linalg.norm(expected), positions
    feeds["position_ids"] = np.array([[last + 1], [0]], np.int64)
    reference.run(None, feeds)
    with pytest.raises(Exception, match="out of range"):
        candidate.run(None, feeds)
