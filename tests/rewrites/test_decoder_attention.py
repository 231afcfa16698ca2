"""Decoder attention fusions (`rlflow/rewrites/fusions/attention/decoder.py`): synthetic attentions for each rule's
match, refusals and numerics, then the exporters' real forms (transformers' Llama and Qwen3, float32 and float16,
TorchScript and dynamo; prefills and decode steps with a KV cache, rotary decomposed or fused), verified through
onnxruntime at several batches, sequences and past lengths with random 0/1 attention masks, and again with a row whose
keys are all masked and a left-padded one.
"""
from __future__ import annotations

import dataclasses
import io
import warnings

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto

from rlflow.graph.core import Graph, load
from rlflow.measure.inputs import random_inputs
from rlflow.measure.verify import compare_arrays, verify
from rlflow.rewrites import apply, apply_everywhere, rule
from rlflow.search.candidates import Candidate, all_fusions

from .conftest import DECODERS
from .helpers import assert_refuses, graph, ints, node

F16, F64, I64 = TensorProto.FLOAT16, TensorProto.DOUBLE, TensorProto.INT64
RULES = ("decoder-attention-fusion", "group-query-attention-fusion", "attention-standard-fusion")
OPS = {"decoder-attention-fusion": "MultiHeadAttention", "group-query-attention-fusion": "GroupQueryAttention",
       "attention-standard-fusion": "Attention"}


# ------------------------------------------------------------------------------------------ synthetic patterns
def attention(grouped=False, seq=1, past=True, masked=True, opset=18, heads=4, kv_heads=2, elem=TensorProto.FLOAT,
              mask_heads=1, leak=False, fill="lowest", scale_input=False):
    """A decoder's attention as the exporters write it, on Q [b, heads, seq, 8] and new K, V [b, kv_heads, seq, 8]
    (inputs: whatever the rotary embedding leaves), appended to a cache [b, kv_heads, p, 8] (`past`, the present state
    an output), KV heads repeated (Unsqueeze, Expand, Reshape) or the query grouped by KV head (`grouped`,
    TorchScript's decode step), scale split between Q and K, an additive mask from `attention_mask` [b, total] (filled
    with the lowest float, as dynamo's, or -inf, as TorchScript's), Softmax, the NaN guard, the context back to
    [b, seq, heads * 8]."""
    rep, d = heads // kv_heads, 8
    inputs = {"q": (["b", heads, seq, d], elem), "k": (["b", kv_heads, seq, d], elem), "v": (["b", kv_heads, seq, d], elem)}
    dtype = onnx.helper.tensor_dtype_to_np_dtype(elem)
    consts = {"half": np.array(np.sqrt(1 / np.sqrt(d)), dtype), "zero": np.zeros((), dtype),
              "low": np.array(np.finfo(dtype).min if fill == "lowest" else -np.inf, dtype), "ax2": ints(2), "ax12": ints(1, 2),
              "rep": ints(1, 1, rep, 1, 1), "heads": ints(0, heads, -1, d), "out": ints(0, 0, heads * d)}
    nodes, outputs = [], {"y": elem}
    if scale_input:  # a scale computed at run time
        inputs["half"] = ([], elem)
        consts.pop("half")
    keys, values = "k", "v"
    if past:
        inputs.update(pk=(["b", kv_heads, "p", d], elem), pv=(["b", kv_heads, "p", d], elem))
        nodes += [node("Concat", ["pk", "k"], "present_k", axis=-2), node("Concat", ["pv", "v"], "present_v", axis=2)]
        keys, values = "present_k", "present_v"
        outputs.update(present_k=elem, present_v=elem)
    if not grouped and rep > 1:
        for t in (keys, values):
            nodes += [node("Unsqueeze", [t, "ax2"], f"{t}_u"), node("Expand", [f"{t}_u", "rep"], f"{t}_e"),
                      node("Reshape", [f"{t}_e", "heads"], f"{t}_r")]
        keys, values = f"{keys}_r", f"{values}_r"
    query = "q"
    if grouped:
        consts.update(groups=ints(0, kv_heads, rep * seq, d), ungroup=ints(0, heads, seq, d))
        nodes.append(node("Reshape", ["q", "groups"], "qg"))
        query = "qg"
    nodes += [node("Mul", [query, "half"], "qs"), node("Transpose", [keys], "kt", perm=[0, 1, 3, 2]),
              node("Mul", ["kt", "half"], "kts"), node("MatMul", ["qs", "kts"], "scores")]
    scores = "scores"
    if masked:
        inputs["attention_mask"] = (["b", "total" if past else seq], I64)
        nodes += [node("Cast", ["attention_mask"], "keep", to=TensorProto.BOOL), node("Unsqueeze", ["keep", "ax12"], "keep4"),
                  node("Where", ["keep4", "zero", "low"], "bias")]
        if seq != 1:  # [b, 1, 1, T] expanded to [b, 1, seq, T]
            consts["one1"] = ints(1)
            nodes += [node("Shape", ["q"], "qb", end=1), node("Shape", ["q"], "qs_", start=2, end=3),
                      node("Shape", ["attention_mask"], "mt", start=1), node("Concat", ["qb", "one1", "qs_", "mt"], "bshape", axis=0),
                      node("Expand", ["keep4", "bshape"], "keep_s"), node("Where", ["keep_s", "zero", "low"], "bias_s")]
        if mask_heads > 1:
            consts["per_head"] = ints(1, mask_heads, 1, 1)
            nodes.append(node("Expand", ["bias", "per_head"], "bias_h"))
        nodes.append(node("Add", ["scores", "bias_h" if mask_heads > 1 else "bias_s" if seq != 1 else "bias"], "masked"))
        scores = "masked"
    nodes += [node("Softmax", [scores], "p", axis=-1), node("IsNaN", ["p"], "nan"), node("Where", ["nan", "zero", "p"], "pg"),
              node("MatMul", ["pg", values], "ctx")]
    if grouped:
        nodes.append(node("Reshape", ["ctx", "ungroup"], "ctx4"))
    nodes += [node("Transpose", ["ctx4" if grouped else "ctx"], "ctxt", perm=[0, 2, 1, 3]), node("Reshape", ["ctxt", "out"], "y")]
    if leak:  # the scaled keys' shape an output
        nodes.append(node("Shape", ["kts"], "kts_shape"))
        outputs["kts_shape"] = I64
    return graph(nodes, inputs, outputs, consts=consts, opset=opset, input_shapes=_sizes(inputs, 2, 3 if past else 0, seq))


def _sizes(inputs, batch, past, seq):
    """The shapes of `inputs` (name -> (dims, ...)) at a batch, past length and sequence (4 where it is dynamic)."""
    seq = seq if isinstance(seq, int) else 4
    named = {"b": batch, "p": past, "total": past + seq, "seq": seq}
    return {n: [named.get(d, d) for d in spec[0]] for n, spec in inputs.items()}


def fused(g: Graph, name: str, sizes=None, count=None) -> Graph:
    """`g` with rule `name` applied at every match (`count` of them), checked, its attentions gone, and verified
    through onnxruntime at `sizes` (input shape dicts; default: batch 2 and 1, past 3 and 17)."""
    matches = rule(name).find(g)
    assert matches, f"{name}: {sorted({m.reason for m in rule(name).reasons(g)})}"
    assert count is None or len(matches) == count
    out = g
    for match in matches:
        new = apply(out, match)
        assert new.fingerprint() != out.fingerprint()
        out = new
    onnx.checker.check_model(out.to_model(static=False))
    counts = out.op_counts()
    assert "Softmax" not in counts and counts[OPS[name]] == len(matches), counts
    if not rule(name).contrib:
        assert all((n.domain or "") in ("", "ai.onnx") for n in out.gs.nodes)
    if sizes is None:
        spec = {i.name: ([d.dim_param or d.dim_value for d in i.type.tensor_type.shape.dim],) for i in g.interface[0]}
        sizes = [_sizes(spec, b, p if "pk" in spec else 0, spec["q"][0][2]) for b, p in ((2, 3), (1, 17))]
    result = verify(g.to_model(static=False), out.to_model(static=False), shapes=sizes)
    assert result.ok, result.message
    return out


CASES = {
    "decoder-attention-fusion": (lambda: attention(), lambda: attention(grouped=True), "the query is grouped by KV head"),
    "group-query-attention-fusion": (lambda: attention(), lambda: attention(seq="seq", masked=False),
                                     "several positions over a KV cache"),
    "attention-standard-fusion": (lambda: attention(opset=23), lambda: attention(), "Attention needs opset 23"),
}


@pytest.mark.parametrize("name", list(CASES))
def test_matches_and_keeps_numbers(name):
    fused(CASES[name][0](), name, count=1)


@pytest.mark.parametrize("name", list(CASES))
def test_refuses_with_reason(name):
    _, negative, reason = CASES[name]
    assert_refuses(negative(), name, reason)


@pytest.mark.parametrize("kwargs", [
    dict(grouped=True), dict(past=False), dict(past=False, seq="seq"), dict(seq="seq", past=False, masked=False),
    dict(kv_heads=4), dict(fill="-inf"), dict(elem=F16), dict(grouped=True, elem=F16, fill="-inf"), dict(masked=False)])
@pytest.mark.parametrize("name", RULES)
def test_variants(name, kwargs):
    """The grouped query (not for MultiHeadAttention), no cache (a prefill, of any length), no repeated heads (as
    many KV heads as query heads), a -inf fill, float16, no mask."""
    g = attention(opset=23 if name == "attention-standard-fusion" else 18, **kwargs)
    refused = {"decoder-attention-fusion": kwargs.get("grouped"),
               "attention-standard-fusion": kwargs.get("elem") == F16 and kwargs.get("fill") != "-inf"}
    if refused.get(name):
        assert not rule(name).find(g)
        return
    fused(g, name, count=1)


def test_several_positions_over_a_cache_fuse_into_multi_head_and_standard_attention():
    """onnxruntime's GroupQueryAttention runs a multi-position step over a cache at batch 1 only: refused there,
    exact with the other two forms."""
    g = attention(seq="seq", masked=False)
    assert not rule("group-query-attention-fusion").find(g)
    sizes = [_sizes(dict(q=(["b", 4, "seq", 8],), k=(["b", 2, "seq", 8],), v=(["b", 2, "seq", 8],),
                         pk=(["b", 2, "p", 8],), pv=(["b", 2, "p", 8],)), b, p, 4) for b, p in ((2, 3), (1, 9))]
    fused(g, "decoder-attention-fusion", sizes=sizes)
    fused(attention(seq="seq", masked=False, opset=23), "attention-standard-fusion", sizes=sizes)
    batch_one = attention(seq="seq", masked=False)
    batch_one = Graph.from_model(_fix_batch(batch_one.to_model(static=False)), {k: [1, *v[1:]] for k, v in sizes[0].items()})
    fused(batch_one, "group-query-attention-fusion", sizes=[{k: [1, *v[1:]] for k, v in s.items()} for s in sizes])


def _fix_batch(proto: onnx.ModelProto) -> onnx.ModelProto:
    for vi in [*proto.graph.input, *proto.graph.output]:
        dims = vi.type.tensor_type.shape.dim
        if dims and dims[0].dim_param == "b":
            dims[0].dim_value = 1
    return proto


@pytest.mark.parametrize("kwargs, reason", [
    (dict(elem=F64), "not float32 or float16"),
    (dict(mask_heads=4), "the mask added to the scores is not [B or 1, 1, S, T]"),
    (dict(leak=True), "read elsewhere"),
    (dict(scale_input=True), "not K with its last two axes swapped")])
@pytest.mark.parametrize("name", RULES)
def test_refusals(name, kwargs, reason):
    g = attention(opset=23 if name == "attention-standard-fusion" else 18, **kwargs)
    assert not rule(name).find(g)
    assert any(reason in m.reason for m in rule(name).reasons(g)), [m.reason for m in rule(name).reasons(g)]


def test_the_contrib_forms_leave_attention_fusion_its_attention():
    """BERT and GPT-2 (their heads split straight from the [B, S, hidden] projections) stay attention-fusion's."""
    from pathlib import Path

    exports = Path(__file__).resolve().parents[1] / "fixtures" / "exports"
    for name in ("bert-tiny-dynamo", "gpt2-tiny-prefill-ts"):
        g = load(exports / f"{name}.onnx")
        assert rule("attention-fusion").find(g)
        for contrib in RULES[:2]:
            assert not rule(contrib).find(g)
            assert any("attention-fusion takes it" in m.reason for m in rule(contrib).reasons(g))


# ------------------------------------------------------------------------------------------ the exporters' forms
def _masked_rows_agree(g: Graph, out: Graph, sizes) -> None:
    """The outputs agree with attention_mask's first row all 0 (a query whose keys are all masked: the export's
    lowest-float fill averages the values, its -inf fill and NaN guard give 0) and the second left-padded."""
    reference, candidate = (ort.InferenceSession(m.to_model(static=False).SerializeToString(),
                                                 providers=["CPUExecutionProvider"]) for m in (g, out))
    for shape in sizes:
        feeds = random_inputs(g.to_model(static=False), 7, shape)
        mask = feeds["attention_mask"]
        mask[:] = 1
        mask[0] = 0
        mask[1:, :3] = 0
        names = [o.name for o in reference.get_outputs()]
        for name, a, b in zip(names, reference.run(names, feeds), candidate.run(names, feeds)):
            check = compare_arrays(name, a, b)
            assert check.ok, (shape, check)


def _everywhere(g: Graph, name: str) -> tuple[Graph, int]:
    out, applied = apply_everywhere(g, rule(name), rule(name).find(g))
    return out, len(applied)


def _prefill(decoder_exports, name: str, opset: int = 18, rotary: bool = False):
    """(the export with its norms (and rotations) fused, as a search meets it, and the sizes to verify at)."""
    proto = decoder_exports[name]
    if opset == 23:
        proto = onnx.version_converter.convert_version(proto, 23)
    sizes = [{i.name: [b, s] for i in proto.graph.input} for b, s in ((2, 1), (2, 16), (1, 7))]
    g = Graph.from_model(proto, sizes[1])
    for earlier in ("rmsnorm-fusion", "rotary-fusion")[:2 if rotary else 1]:
        g, _ = _everywhere(g, earlier)
    return g, sizes


@pytest.mark.parametrize("name", [f"{d}-ts" for d in DECODERS] + ["decoders-dynamo"])
@pytest.mark.parametrize("rule_name", RULES)
def test_prefills_fuse_every_attention_and_keep_numbers(decoder_exports, name, rule_name):
    """Every attention of the export (two layers of one decoder, or one each of two; float16 included, TorchScript's
    with its softmax in float32) fused, the logits the same at batch 2 and 1, sequence 1, 7 and 16, with random padding
    and with a fully masked row.  The standard Attention leaves dynamo's float16 Qwen3 (its -65504 fill) alone."""
    g, sizes = _prefill(decoder_exports, name, 23 if rule_name == "attention-standard-fusion" else 18)
    out, applied = _everywhere(g, rule_name)
    left = int(name == "decoders-dynamo" and rule_name == "attention-standard-fusion")
    assert applied == 2 - left and out.op_counts().get("Softmax", 0) == left
    if left:
        assert any("float16 mask" in m.reason for m in rule(rule_name).reasons(out))
    result = verify(g.to_model(static=False), out.to_model(static=False), shapes=sizes)
    assert result.ok, result.message
    if name.endswith("-ts"):
        _masked_rows_agree(g, out, sizes[1:2])


@pytest.mark.parametrize("name", ["llama-fp32-ts", "qwen3-fp16-ts", "decoders-dynamo"])
def test_prefills_fuse_after_the_rotary_fusion(decoder_exports, name):
    """The query and key heads are RotaryEmbedding's outputs: the attention fuses the same."""
    g, sizes = _prefill(decoder_exports, name, rotary=True)
    assert "RotaryEmbedding" in g.op_counts()
    out, applied = _everywhere(g, "group-query-attention-fusion")
    assert applied == 2
    result = verify(g.to_model(static=False), out.to_model(static=False), shapes=sizes)
    assert result.ok, result.message


def _step_sizes(batch: int, past: int, seq: int = 1, layers: int = 2) -> dict[str, list[int]]:
    return {"input_ids": [batch, seq], "attention_mask": [batch, past + seq], "position_ids": [batch, seq],
            **{f"past_key_values.{i}.{k}": [batch, 2, past, 16] for i in range(layers) for k in ("key", "value")}}


def _chunk_export(folder) -> str:
    """The zoo's tiny Llama as a step of several positions over a cache (TorchScript, sequence and past dynamic)."""
    import torch

    from rlflow.zoo import decoders

    wrapper = decoders._wrap(decoders._model(decoders._BY_KEY["llama-tiny"], "float32"), "decode")
    sizes = _step_sizes(2, 8, 4)
    gen = torch.Generator().manual_seed(0)
    inputs = {n: torch.randint(0, 256, s, generator=gen) if n == "input_ids" else torch.ones(s, dtype=torch.int64)
              if n == "attention_mask" else (torch.arange(4) + 8).expand(2, 4).contiguous() if n == "position_ids"
              else torch.randn(s, generator=gen) for n, s in sizes.items()}
    outputs = ["logits", *(f"present.{i}.{k}" for i in range(2) for k in ("key", "value"))]
    axes = {n: {0: "batch", 2: "past"} if n.startswith("past") else {0: "batch", 1: "total" if n == "attention_mask"
                                                                     else "sequence"} for n in inputs}
    axes.update({n: {0: "batch", 2: "total"} for n in outputs[1:]}, logits={0: "batch", 1: "sequence"})
    buffer = io.BytesIO()
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        torch.onnx.export(wrapper, tuple(inputs.values()), buffer, dynamo=False, opset_version=17,
                          input_names=list(inputs), output_names=outputs, dynamic_axes=axes)
    path = folder / "llama-tiny-chunk-ts.onnx"
    path.write_bytes(buffer.getvalue())
    return str(path)


@pytest.fixture(scope="module")
def steps(tmp_path_factory, monkeypatch_module):
    """The zoo's tiny decode steps by TorchScript (Llama and Qwen3 in float32, Qwen3 in float16: its query grouped
    by KV head, a key/value cache in and out) and the Llama step of several positions (about 15 s)."""
    pytest.importorskip("transformers")
    from rlflow import zoo

    folder = tmp_path_factory.mktemp("steps")
    base = zoo.get("qwen3-tiny-decode-p16-ts")
    half = {n: "float16" for n in base.input_shapes if n.startswith("past")}
    entry = dataclasses.replace(base, name="qwen3-tiny-decode-p16-ts-fp16", config=dict(base.config, dtype="float16"),
                                gpu=True, input_dtypes={**base.input_dtypes, **half})
    monkeypatch_module.setitem(zoo._REGISTRY, entry.name, entry)
    names = ["llama-tiny-decode-p16-ts", "qwen3-tiny-decode-p16-ts", entry.name]
    paths = {name: zoo.build(name, folder).path for name in names}
    paths["llama-tiny-chunk-ts"] = _chunk_export(folder)
    return paths


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as patch:
        yield patch


def transformers_version() -> tuple[int, int]:
    import transformers

    return tuple(int(part) for part in transformers.__version__.split(".")[:2])


def _step(path: str, opset: int = 17) -> Graph:
    g = load(path)
    if opset == 23:
        g = Graph.from_model(onnx.version_converter.convert_version(g.to_model(static=False), 23), dict(g.input_shapes))
    return g


@pytest.mark.parametrize("name", ["llama-tiny-decode-p16-ts", "qwen3-tiny-decode-p16-ts",
                                  "qwen3-tiny-decode-p16-ts-fp16"])
@pytest.mark.parametrize("rule_name", RULES[1:])
def test_decode_steps_fuse_with_their_cache_and_keep_numbers(steps, name, rule_name):
    """The cache's Concat and the attention become one operator that writes the present state; the outputs are the
    same at other batches and past lengths, with random padding and with a fully masked row.  (MultiHeadAttention
    has no keys of every head where the query is grouped by KV head: refused.)"""
    g = _step(steps[name], 23 if rule_name == "attention-standard-fusion" else 17)
    sizes = [_step_sizes(2, 5), _step_sizes(1, 16), _step_sizes(2, 40)]
    if rule("decoder-attention-fusion").find(g):
        # transformers 5.24's TorchScript export groups the query by KV head, which MultiHeadAttention cannot take
        # (that refusal: test_refuses_with_reason); 5.17's repeats the KV heads first, which it can, exactly
        assert transformers_version() < (5, 24)
        fused_mha, _ = _everywhere(g, "decoder-attention-fusion")
        assert verify(g.to_model(static=False), fused_mha.to_model(static=False), shapes=sizes).ok
    out, applied = _everywhere(g, rule_name)
    counts = out.op_counts()
    assert applied == 2 and "Softmax" not in counts and counts.get("Concat", 0) < g.op_counts()["Concat"] - 2
    result = verify(g.to_model(static=False), out.to_model(static=False), shapes=sizes)
    assert result.ok, result.message
    _masked_rows_agree(g, out, sizes)


def test_decode_steps_fuse_into_group_query_attention_after_every_other_fusion(steps):
    """All fusions together (rotary, norms, ...): GroupQueryAttention takes every attention, no Softmax is left."""
    g = _step(steps["llama-tiny-decode-p16-ts"])
    out = all_fusions(Candidate(g, (), g.fingerprint())).graph
    counts = out.op_counts()
    assert counts["GroupQueryAttention"] == 2 and counts["RotaryEmbedding"] == 4 and "Softmax" not in counts
    result = verify(g.to_model(static=False), out.to_model(static=False), shapes=[_step_sizes(2, 9)])
    assert result.ok, result.message


@pytest.mark.parametrize("rule_name", RULES)
def test_a_step_of_several_positions_over_a_cache(steps, rule_name):
    g = _step(steps["llama-tiny-chunk-ts"], 23 if rule_name == "attention-standard-fusion" else 17)
    if rule_name == "group-query-attention-fusion":
        assert not rule(rule_name).find(g)
        assert any("batch 1 only" in m.reason for m in rule(rule_name).reasons(g))
        return
    out, applied = _everywhere(g, rule_name)
    assert applied == 2 and "Softmax" not in out.op_counts()
    sizes = [_step_sizes(2, 5, 4), _step_sizes(1, 16, 1), _step_sizes(2, 3, 16)]
    result = verify(g.to_model(static=False), out.to_model(static=False), shapes=sizes)
    assert result.ok, result.message
    _masked_rows_agree(g, out, sizes)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["llama-tiny-decode-p16-dynamo", "qwen3-tiny-decode-p16-dynamo"])
def test_dynamo_decode_steps(tmp_path_factory, name):
    """The dynamo exporter's decode step (repeated KV heads, the lowest-float fill): every form, about 30 s each."""
    pytest.importorskip("transformers")
    from rlflow import zoo

    path = zoo.build(name, tmp_path_factory.mktemp("dynamo")).path
    sizes = [_step_sizes(2, 5), _step_sizes(1, 16), _step_sizes(2, 40)]
    for rule_name in RULES:
        g = _step(path, 23 if rule_name == "attention-standard-fusion" else 18)
        out, applied = _everywhere(g, rule_name)
        assert applied == 2 and "Softmax" not in out.op_counts()
        result = verify(g.to_model(static=False), out.to_model(static=False), shapes=sizes)
        assert result.ok, (rule_name, result.message)
        _masked_rows_agree(g, out, sizes)
