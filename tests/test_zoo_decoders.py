"""The deployment section's decoders: entries, names, GPU and tiny marks, and the tiny decode steps built by both
exporters, run at other past lengths and checked against PyTorch."""

import dataclasses
import json
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from rlflow import zoo
from rlflow.graph.input_shapes import parse_input_shapes
from rlflow.zoo import decoders

CPU = [n for n in zoo.names(include_tiny=False, family="deploy") if decoders.owns(zoo.get(n))]
GPU = [n for n in zoo.names(family="deploy", include_gpu=True) if zoo.get(n).gpu]
TINY = [n for n in zoo.names(family="deploy") if zoo.get(n).tiny]
DECODE = [f"{family}-tiny-decode-p16-{exporter}" for family in ("llama", "qwen3") for exporter in ("ts", "dynamo")]


def test_names_say_the_model_the_step_the_shape_and_the_exporter():
    steps = {"prefill": ["s128"], "decode": ["p128", "p1024"]}  # shapes vary fastest: they share one export
    cut = {"prefill": ["s128"], "decode": ["p128"]}  # the agents' training cut: one cache length
    window = {"prefill": ["s128"], "decode": ["p128", "p448"]}  # Gemma3: under its 512-token sliding window
    assert CPU == [f"{model}-{kind}-{shape}-{exporter}"
                   for model, shapes in (("smollm2-135m", steps), ("qwen3-0.6b-l8", steps), ("smollm2-135m-l4", cut),
                                         ("gemma3-270m", window))
                   for kind in shapes for exporter in ("ts", "dynamo") for shape in shapes[kind]]
    assert TINY == [f"{model}-tiny-{step}-{exporter}" for model in ("llama", "qwen3")
                    for step in ("prefill-s16", "decode-p16") for exporter in ("ts", "dynamo")]
    assert GPU == [f"{name}-fp16" for name in CPU] + [name.replace("-l8", "") + "-fp16" for name in CPU[6:12]]
    assert zoo.get("smollm2-135m-l4-decode-p128-ts").config["config"]["hidden_size"] == 576
    gemma = zoo.get("gemma3-270m-decode-p448-dynamo")
    assert gemma.input_shapes["past_key_values.17.value"] == (1, 1, 448, 256)
    assert gemma.config["config"]["sliding_window"] > gemma.input_shapes["attention_mask"][1]


def test_gpu_and_tiny_entries_stay_out_of_the_cpu_lists():
    for name in GPU:
        entry = zoo.get(name)
        assert entry.gpu and not entry.tiny and name not in zoo.names(family="deploy")
    assert all(zoo.get(n).tiny and not zoo.get(n).gpu for n in TINY)
    assert not set(TINY) & set(zoo.names(include_tiny=False, family="deploy"))
    assert not set(CPU + GPU + TINY) & set(zoo.names())  # the research zoo
    assert zoo.get("qwen3-0.6b-decode-p128-ts-fp16").config["config"]["num_hidden_layers"] == 28


def test_deployed_shapes_dtypes_and_ranges():
    decode = zoo.get("smollm2-135m-decode-p1024-dynamo")
    shapes = decode.input_shapes
    assert list(shapes)[:3] == ["input_ids", "attention_mask", "position_ids"]
    assert shapes["input_ids"] == shapes["position_ids"] == (1, 1) and shapes["attention_mask"] == (1, 1025)
    past = [n for n in shapes if n.startswith("past_key_values.")]
    assert len(past) == 60 and all(shapes[n] == (1, 3, 1024, 64) for n in past)
    assert past[:2] == ["past_key_values.0.key", "past_key_values.0.value"]
    assert decode.output_names[:3] == ("logits", "present.0.key", "present.0.value") and len(decode.output_names) == 61
    assert decode.input_ranges == {"input_ids": (0, 49152), "attention_mask": (0, 2), "position_ids": (0, 1025)}
    assert zoo.get("qwen3-0.6b-l8-decode-p128-ts").input_shapes["past_key_values.7.value"] == (1, 8, 128, 128)
    prefill = zoo.get("qwen3-0.6b-l8-prefill-s128-ts")
    assert prefill.input_shapes == {n: (1, 128) for n in ("input_ids", "attention_mask", "position_ids")}
    assert len(prefill.output_names) == 17
    fp16 = zoo.get("qwen3-0.6b-decode-p1024-ts-fp16")
    assert fp16.dtype("past_key_values.27.key") == "float16" and fp16.dtype("input_ids") == "int64"
    assert zoo.get("smollm2-135m-decode-p128-ts").dtype("past_key_values.0.key") == "float32"


def test_entries_carry_the_peers_hints():
    from onnxruntime.transformers.optimizer import MODEL_TYPES

    assert zoo.get("smollm2-135m-decode-p128-ts").transformer == {
        "model_type": "gpt2", "num_heads": 9, "hidden_size": 576, "num_kv_heads": 3, "head_dim": 64}
    assert zoo.get("qwen3-0.6b-l8-prefill-s128-dynamo").transformer == {
        "model_type": "qwen3", "num_heads": 16, "hidden_size": 1024, "num_kv_heads": 8, "head_dim": 128}
    for name in CPU + GPU + TINY:
        hints = zoo.get(name).transformer
        assert hints["model_type"] in MODEL_TYPES and hints["hidden_size"] % hints["num_heads"] == 0


def test_the_decoders_code_is_hashed_for_the_decoders_only(monkeypatch):
    """Adding the decoders (their code, their table) leaves the encoders' builds up to date."""
    from rlflow.zoo import decoder_architectures

    names = ["bert-l2-h128-s16-ts", "gpt2-decode-kv128-dynamo", "llama-tiny-decode-p16-ts"]
    before = {name: zoo.definition_hash(name) for name in names}
    read = Path.read_bytes

    def edited(target):
        def read_bytes(path):
            return read(path) + (b"\n# edited\n" if path == Path(target.__file__) else b"")
        return read_bytes

    monkeypatch.setattr(Path, "read_bytes", edited(decoders))
    assert {name: zoo.definition_hash(name) == before[name] for name in names} == {
        "bert-l2-h128-s16-ts": True, "gpt2-decode-kv128-dynamo": True, "llama-tiny-decode-p16-ts": False}
    monkeypatch.setattr(Path, "read_bytes", edited(decoder_architectures))
    assert {name: zoo.definition_hash(name) for name in names} == before
    monkeypatch.setattr(Path, "read_bytes", read)
    entry = zoo.get(names[2])
    wider = dict(entry.config, config=dict(entry.config["config"], intermediate_size=256))
    monkeypatch.setitem(zoo._REGISTRY, names[2], dataclasses.replace(entry, config=wider))
    assert zoo.definition_hash(names[2]) != before[names[2]]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The tiny decode steps by both exporters (about a minute on 2 cores, most of it the dynamo exporter's), and
    Llama's prefill by TorchScript."""
    pytest.importorskip("transformers")
    out = tmp_path_factory.mktemp("decoders")
    return out, {name: zoo.build(name, out) for name in [*DECODE, "llama-tiny-prefill-s16-ts"]}


def _torch_step(name):
    config = zoo.get(name).config
    arch = decoders._BY_KEY[config["architecture"]]
    return arch, decoders._wrap(decoders._model(arch, "float32"), config["kind"])


@pytest.mark.parametrize("name", DECODE)
def test_tiny_decode_step_builds_with_its_deployed_shapes_and_the_peers_hints(tiny, name):
    out, results = tiny
    model = onnx.load(results[name].path)
    exporter = name.rsplit("-", 1)[1]
    assert model.ir_version <= 10 and model.opset_import[0].version == {"ts": 17, "dynamo": 18}[exporter]
    props = {p.key: p.value for p in model.metadata_props}
    entry = zoo.get(name)
    assert parse_input_shapes(props["rlflow.input_shapes"].split(";")) == entry.input_shapes
    assert props["rlflow.zoo.name"] == name and props["rlflow.zoo.exporter"] == exporter
    assert [i.name for i in model.graph.input] == list(entry.input_shapes)
    assert [o.name for o in model.graph.output] == list(entry.output_names)
    dims = {i.name: [d.dim_param or d.dim_value for d in i.type.tensor_type.shape.dim] for i in model.graph.input}
    assert isinstance(dims["past_key_values.1.value"][2], str) and dims["past_key_values.1.value"][1::2] == [2, 16]
    assert all(isinstance(d[0], str) for d in dims.values())  # the batch
    meta = json.loads((out / f"{name}.json").read_text())
    assert meta["transformer"] == entry.transformer and meta["transformer"]["num_kv_heads"] == 2
    assert meta["kind"] == "decode" and meta["dtype"] == "float32" and meta["attn_implementation"] == "sdpa"
    assert meta["check"]["max_rel_diff"] < 1e-4 and meta["input_shapes"]["attention_mask"] == [1, 17]


@pytest.mark.parametrize("name", DECODE)
def test_tiny_decode_step_runs_at_other_past_lengths_and_matches_torch(tiny, name):
    import torch

    out, results = tiny
    arch, step = _torch_step(name)
    session = ort.InferenceSession(str(results[name].path), providers=["CPUExecutionProvider"])
    for batch, past in ((1, 5), (2, 40)):
        inputs = decoders.inputs_at(arch, "decode", "float32", batch, past, seed=past)
        inputs["attention_mask"][0, :3] = 0  # left padding: the mask is an input, not baked in
        got = session.run(None, {k: v.numpy() for k, v in inputs.items()})
        with torch.no_grad():
            want = [t.numpy() for t in step(*inputs.values())]
        assert got[0].shape == (batch, 1, 256) and got[1].shape == (batch, 2, past + 1, 16)
        for g, w in zip(got, want):
            np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5)


def test_tiny_prefill_returns_the_cache_at_any_sequence(tiny):
    out, results = tiny
    session = ort.InferenceSession(str(results["llama-tiny-prefill-s16-ts"].path), providers=["CPUExecutionProvider"])
    arch, prefill = _torch_step("llama-tiny-prefill-s16-ts")
    inputs = decoders.inputs_at(arch, "prefill", "float32", 2, 24, seed=3)
    got = session.run(None, {k: v.numpy() for k, v in inputs.items()})
    assert got[0].shape == (2, 24, 256) and [g.shape for g in got[1:]] == [(2, 2, 24, 16)] * 4
    import torch

    with torch.no_grad():
        np.testing.assert_allclose(got[0], prefill(*inputs.values())[0].numpy(), rtol=1e-4, atol=1e-5)


def test_float16_variant_builds_with_float16_cache(monkeypatch, tmp_path):
    """The GPU variants' path (model.half(), exported on the CPU) on the tiny decoder: float16 cache in and out."""
    pytest.importorskip("transformers")
    base = zoo.get("qwen3-tiny-decode-p16-ts")
    name = "qwen3-tiny-decode-p16-ts-fp16"
    dtypes = {n: "float16" for n in base.input_shapes if n.startswith("past")}
    entry = dataclasses.replace(base, name=name, config=dict(base.config, dtype="float16"), gpu=True,
                                input_dtypes={**base.input_dtypes, **dtypes})
    monkeypatch.setitem(zoo._REGISTRY, name, entry)
    result = zoo.build(name, tmp_path)
    model = onnx.load(result.path)
    types = {v.name: v.type.tensor_type.elem_type for v in [*model.graph.input, *model.graph.output]}
    assert types["past_key_values.0.key"] == types["present.1.value"] == types["logits"] == onnx.TensorProto.FLOAT16
    meta = json.loads((tmp_path / f"{name}.json").read_text())
    assert meta["dtype"] == "float16" and meta["gpu"] and meta["check"]["max_rel_diff"] < meta["check"]["tolerance"]
    assert meta["input_dtypes"]["past_key_values.1.value"] == "float16"


def test_cli_builds_gpu_entries_only_by_name_and_lists_long_names_in_their_column(monkeypatch, tmp_path, capsys):
    from rlflow.cli import main

    built = []

    def fake(name, out, force=False):
        built.append(name)
        return zoo.BuildResult(name, tmp_path / f"{name}.onnx", True, 0.0, 1, 1, 1)

    monkeypatch.setattr(zoo, "build", fake)
    assert main(["zoo", "build", "--family", "deploy", "--out", str(tmp_path)]) == 0
    assert not set(built) & set(GPU + TINY) and set(CPU) <= set(built)
    built.clear()
    assert main(["zoo", "build", "qwen3-0.6b-decode-p1024-dynamo-fp16", "--out", str(tmp_path)]) == 0
    assert built == ["qwen3-0.6b-decode-p1024-dynamo-fp16"]
    monkeypatch.setenv("RLFLOW_CACHE", str(tmp_path))
    capsys.readouterr()
    assert main(["zoo", "list", "--family", "deploy", "--tiny"]) == 0
    rows = [row.split() for row in capsys.readouterr().out.splitlines()[1:]]
    assert [row[0] for row in rows if row[0] in CPU + TINY] == CPU + TINY and all(row[1] == "deploy" for row in rows)


@pytest.mark.parametrize("name", [*DECODE, "llama-tiny-prefill-s16-ts"])
def test_every_fusion_leaves_no_norm_rotary_or_attention_unfused(tiny, name):
    """Issue #50's structure: the all-fusions graph of the smallest decoder cut holds no decomposed RMSNorm
    (ReduceMean, Pow, Sqrt, Reciprocal), rotary embedding (Neg, Sin, Cos) or attention (Softmax), and computes what
    the export does."""
    from rlflow.graph.core import load
    from rlflow.measure.verify import verify
    from rlflow.search.candidates import Candidate, all_fusions

    graph = load(tiny[1][name].path)
    fused = all_fusions(Candidate(graph, (), graph.fingerprint())).graph
    ops = fused.op_counts()
    left = {op: ops[op] for op in ("ReduceMean", "Pow", "Sqrt", "Reciprocal", "Neg", "Sin", "Cos", "Softmax")
            if op in ops}
    assert left == {}
    norms = 5 + (4 if name.startswith("qwen3") else 0)  # two per layer and the final one; Qwen3's q and k norms
    assert ops.get("SimplifiedLayerNormalization", 0) + ops.get("SkipSimplifiedLayerNormalization", 0) == norms
    assert ops.get("RotaryEmbedding") == 4 and ops.get("GroupQueryAttention", 0) + ops.get("MultiHeadAttention", 0) == 2
    assert verify(graph.to_model(static=True), fused.to_model(static=True)).ok



def test_onnxscript_ort_leaves_a_decoder_export_as_it_was(tiny):
    """The peer onnxscript-ort fuses the dynamo decode step's norms and attention without writing into the model it
    was given (its fusions write into the protos onnxscript's IR reads: the peer runs on a copy)."""
    from rlflow.bench.peers import onnxscript_ort
    from rlflow.measure.verify import verify

    name = "llama-tiny-decode-p16-dynamo"
    path = tiny[1][name].path
    model = onnx.load(path)
    output = onnxscript_ort(model)
    assert model.SerializeToString() == onnx.load(path).SerializeToString()
    assert {"SimplifiedLayerNormalization", "MultiHeadAttention"} <= {n.op_type for n in output.graph.node}
    assert verify(model, output, seeds=(0,), shapes=[zoo.get(name).input_shapes]).ok


def test_a_torchscript_prefill_reads_its_tied_table_once(tiny):
    """The TorchScript exporter writes a tied head's embedding table twice (E for the Gather, E^T for the head):
    `tied-head-fusion` reads E through FusedMatMul(transB) on the prefill's 16 rows, and the copy is gone."""
    from rlflow.graph.core import load
    from rlflow.measure.verify import verify
    from rlflow.rewrites import apply, rule

    graph = load(tiny[1]["llama-tiny-prefill-s16-ts"].path)
    matches = rule("tied-head-fusion").find(graph)
    assert len(matches) == 1
    fused = apply(graph, matches[0])
    before, after = (sum(len(t.raw_data) for t in g.to_model().graph.initializer) for g in (graph, fused))
    assert before - after == 256 * 64 * 4 and fused.op_counts().get("FusedMatMul") == 1
    assert verify(graph.to_model(static=True), fused.to_model(static=True)).ok


def test_a_phi3_torchscript_step_folds_its_rotary_width():
    """Phi-3's TorchScript export reads the rotary width as `Shape(cos)[-1]` and passes the rest of each head (empty:
    Phi-3 rotates all of it) through a Slice and a Concat; once every fusion is made, `shape-dim-fold` and
    `concat-empty-elim` with the cleanups leave nothing of the cos/sin computation, at batch 1 and 2."""
    pytest.importorskip("transformers")
    from rlflow.graph.core import Graph
    from rlflow.measure.verify import verify
    from rlflow.rewrites import apply_everywhere, rule
    from rlflow.search.candidates import Candidate, all_fusions
    from rlflow.zoo import decoder_architectures

    config = dict(decoder_architectures._TINY, rms_norm_eps=1e-5, tie_word_embeddings=False, pad_token_id=0)
    arch = decoder_architectures.DecoderArchitecture("phi3-tiny", "Phi3ForCausalLM", config, {}, "Phi-3", tiny=True)
    model = onnx.load_from_string(decoders.export_decoder(arch, "decode", "ts")[0])
    deployed = decoders.input_shapes(arch, "decode", 16)
    graph = Graph.from_model(model, deployed)
    folded = all_fusions(Candidate(graph, (), graph.fingerprint())).graph
    assert folded.op_counts()["Cos"] == 1  # the rotary width's one reader left
    cleanups = [rule(name) for name in ("shape-dim-fold", "constant-fold", "slice-noop-elim", "concat-empty-elim",
                                        "concat-single-elim")]
    while matched := next(((r, m) for r in cleanups if (m := r.find(folded))), None):
        folded = apply_everywhere(folded, matched[0], matched[1])[0]
    assert not {"Cos", "Sin"} & set(folded.op_counts())
    other = {name: (2, *shape[1:]) for name, shape in decoders.input_shapes(arch, "decode", 40).items()}
    assert verify(model, folded.to_model(static=False), seeds=(0,), shapes=[deployed, other]).ok


def test_a_decode_step_that_ignores_its_cache_is_refused(monkeypatch, tmp_path):
    """transformers before 5.24 took the cache as `past_key_values` and ignored `cache` in its **kwargs: the export
    then never read its cache (seen on the GPU machine's transformers 5.17), and its own reference agreed with it."""
    pytest.importorskip("transformers")
    from rlflow.errors import RlflowError

    monkeypatch.setattr(decoders.deploy, "cache_keyword", lambda model: "a_name_the_model_ignores")
    decoders._exported.cache_clear()
    try:
        with pytest.raises(RlflowError, match="returned a cache of 1 tokens for 16 given and 1 new"):
            zoo.build("llama-tiny-decode-p16-ts", tmp_path)
    finally:
        decoders._exported.cache_clear()
    assert not list(tmp_path.glob("*.onnx"))
