"""onnxruntime-genai's builder as the decoders' reference (rlflow.bench.genai_builder, .builder_reference): the
Hugging Face folder it reads (the export's weights, an offline tokenizer), the inputs of a builder-like graph filled from the export's step,
the reference row; the builder itself only where `make genai-builder` made its venv (and with -m slow)."""
import json
import sys
from dataclasses import asdict

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from rlflow import zoo
from rlflow.bench import builder_reference as br
from rlflow.bench import genai_builder as gb
from rlflow.errors import RlflowError
from rlflow.measure.session import SessionSettings
from rlflow.zoo import decoders

NAME = "llama-tiny-decode-p16-ts"


@pytest.fixture(scope="module")
def step(tmp_path_factory):
    """llama-tiny's decode step (TorchScript export: seconds) as a file, its static model at past 16, and a copy whose
    LM head is off by one: a 'builder' graph of other weights."""
    from rlflow.graph.core import load

    folder = tmp_path_factory.mktemp("builder-reference")
    data, _ = decoders.export_decoder(decoders._BY_KEY["llama-tiny"], "decode", "ts")
    path = folder / f"{NAME}.onnx"
    path.write_bytes(data)
    graph = load(path, decoders.input_shapes(decoders._BY_KEY["llama-tiny"], "decode", 16))
    other = onnx.load_from_string(data)
    largest = max(other.graph.initializer, key=lambda t: np.prod(t.dims))
    largest.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(largest) + 1.0, largest.name))
    onnx.save(other, folder / "other.onnx")
    return path, graph.to_model(static=True), dict(graph.input_shapes), folder / "other.onnx"


def test_decoder_from_a_name_a_json_or_a_model_and_nothing_else(tmp_path):
    dec = gb.decoder(NAME)
    assert (dec.arch.key, dec.kind, dec.dtype) == ("llama-tiny", "decode", "float32")
    entry = {"name": NAME, "config": json.loads(json.dumps(zoo.get(NAME).config))}
    (tmp_path / "e.json").write_text(json.dumps(entry))
    assert gb.decoder(tmp_path / "e.json") == dec
    entry["config"]["config"]["hidden_size"] = 32  # built from another table: not these weights
    with pytest.raises(RlflowError, match="another configuration"):
        gb.decoder(entry)
    with pytest.raises(RlflowError, match="not one of the zoo's decoders"):
        gb.decoder("bert-l2-h128-s16-ts")
    model = helper.make_model(helper.make_graph([], "g", [], []))
    assert gb.decoder_of(model, "elsewhere/unknown.onnx") is None
    model.metadata_props.add(key="rlflow.zoo.name", value="qwen3-tiny-prefill-s16-dynamo")
    assert gb.decoder_of(model, "renamed.onnx").kind == "prefill"


def test_hf_folder_holds_the_exports_weights_and_a_tokenizer_made_offline(tmp_path):
    import torch
    from transformers import AutoTokenizer, LlamaForCausalLM

    dec = gb.decoder(NAME)
    folder = gb.write_hf_folder(dec, tmp_path / "hf")
    saved = LlamaForCausalLM.from_pretrained(folder).state_dict()
    made = decoders._model(dec.arch, "float32").state_dict()
    assert saved.keys() == made.keys() and all(torch.equal(saved[k], made[k]) for k in made)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    assert len(tokenizer) == dec.arch.config["vocab_size"] == 256
    assert tokenizer.bos_token_id == tokenizer.eos_token_id == 0
    assert tokenizer("<5> <255>")["input_ids"][-2:] == [5, 255]


def _builder_like(folder, past_dims, dtype=TensorProto.FLOAT16, extra=()):
    """A graph with a builder's interface: no position_ids, its cache as (batch, past, heads, head) in float16 under
    other names (genai_config.json beside it says which)."""
    inputs = [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["b", "s"]),
              helper.make_tensor_value_info("attention_mask", TensorProto.INT64, ["b", "t"])]
    inputs += [helper.make_tensor_value_info(f"past.{i}.{kv}", dtype, past_dims) for i in range(2) for kv in "kv"]
    inputs += [helper.make_tensor_value_info(name, TensorProto.INT64, ["b"]) for name in extra]
    out = helper.make_tensor_value_info("y", TensorProto.INT64, ["b", "s"])
    model = helper.make_model(helper.make_graph([helper.make_node("Identity", ["input_ids"], ["y"])], "g", inputs,
                                                [out]))
    config = {"model": {"decoder": {"inputs": {"input_ids": "input_ids", "attention_mask": "attention_mask",
                                               "past_key_names": "past.%d.k", "past_value_names": "past.%d.v"}}}}
    (folder / "genai_config.json").write_text(json.dumps(config))
    return model, folder / "model.onnx"


def test_builder_feeds_take_the_exports_step_in_the_builders_names_layout_and_dtype(tmp_path):
    dec = gb.decoder(NAME)
    feeds = br.step_feeds(dec, decoders.input_shapes(dec.arch, "decode", 16), seed=3)
    assert feeds["attention_mask"].shape == (1, 17) and feeds["attention_mask"].all()
    assert feeds["position_ids"].tolist() == [[16]]
    model, path = _builder_like(tmp_path, ["b", "p", 2, 16])
    got = br.builder_feeds(model, feeds, dec, path)
    assert list(got) == ["input_ids", "attention_mask", "past.0.k", "past.0.v", "past.1.k", "past.1.v"]
    assert got["past.1.v"].shape == (1, 16, 2, 16) and got["past.1.v"].dtype == np.float16
    np.testing.assert_allclose(got["past.1.v"], feeds["past_key_values.1.value"].swapaxes(1, 2), atol=2e-3)
    assert np.array_equal(got["input_ids"], feeds["input_ids"])
    prefill = gb.decoder("llama-tiny-prefill-s16-ts")  # no cache in the export's step: an empty one
    got = br.builder_feeds(model, br.step_feeds(prefill, {"input_ids": (1, 16), "attention_mask": (1, 16)}, 0),
                           prefill, path)
    assert got["past.0.k"].shape == (1, 0, 2, 16) and got["input_ids"].shape == (1, 16)
    with pytest.raises(RlflowError, match=r"past.0.k is \[None, None, 3, 16\]"):
        br.builder_feeds(_builder_like(tmp_path, ["b", "p", 3, 16])[0], feeds, dec, path)
    with pytest.raises(RlflowError, match="token_type_ids has no counterpart"):
        br.builder_feeds(_builder_like(tmp_path, ["b", 2, "p", 16], extra=["token_type_ids"])[0], feeds, dec, path)


def test_reference_row_checks_the_logits_and_is_no_rewrite(step, tmp_path):
    path, source, shapes, other = step
    dec, settings = gb.decoder(NAME), SessionSettings(threads=1)
    row = br.reference_row(source, shapes, dec, settings, rounds=3, builder=path, export_file=path, model_name=NAME)
    assert (row.method, row.kind, row.status, row.rewritten, row.verified) == \
        ("genai-builder", "reference", "ok", False, True)
    assert row.max_rel_error < 1e-6 and row.baseline_ms > 0 and row.latency_ms > 0 and row.speedup > 0
    assert row.reason.startswith("reference (different inputs)")
    details = row.peer_settings
    static, built = details["nodes_after_ort_all"], details["nodes_after_ort_all_as_built"]
    assert static["export"] == static["genai-builder"] == sum(details["ops_after_ort_all"]["export"].values())
    assert static["export"] < len(source.graph.node)  # onnxruntime's ORT_ENABLE_ALL fused some of it
    assert static["all-fusions"] < static["export"]  # rlflow's fusions (RMSNorm at least) then fewer again
    assert built["export"] == built["genai-builder"] > static["export"]  # fixed shapes fold the shape arithmetic
    assert details["builder_inputs"]["cache"] == "4 x [1, 2, 16, 16] float32"
    json.dumps(asdict(row))  # results.json takes it
    wrong = br.reference_row(source, shapes, dec, settings, rounds=3, builder=other, model_name=NAME)
    assert (wrong.status, wrong.verified) == ("wrong output", False) and "logits differ" in wrong.error


def test_no_builder_venv_no_reference_row(step, tmp_path, monkeypatch):
    monkeypatch.setenv("RLFLOW_GENAI_VENV", str(tmp_path / "none"))
    source = step[1]
    assert gb.genai_python() is None and br.bench_references(source, step[0]) == ()
    with pytest.raises(RlflowError, match="make genai-builder"):
        gb.run_builder(tmp_path, tmp_path / "out")
    (tmp_path / "venv" / "bin").mkdir(parents=True)
    (tmp_path / "venv" / "bin" / "python").touch()
    monkeypatch.setenv("RLFLOW_GENAI_VENV", str(tmp_path / "venv"))
    assert br.bench_references(source, step[0]) == ("genai-builder",)
    assert br.bench_references(helper.make_model(helper.make_graph([], "g", [], [])), tmp_path / "mlp.onnx") == ()


def test_a_copy_of_the_builders_source_runs_under_this_python(tmp_path, monkeypatch):
    """The GPU kit's way (RLFLOW_GENAI_BUILDER): the builder's `models` folder, no venv of its own."""
    monkeypatch.setenv("RLFLOW_GENAI_VENV", str(tmp_path / "none"))
    monkeypatch.setenv("RLFLOW_GENAI_BUILDER", str(tmp_path / "models"))
    assert gb.builder_command() is None  # no builder.py there
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "builder.py").touch()
    assert gb.builder_command() == [sys.executable, str(tmp_path / "models" / "builder.py")]


@pytest.mark.slow
@pytest.mark.skipif(gb.genai_python() is None, reason="onnxruntime-genai's builder venv is missing: make genai-builder")
def test_the_builders_graph_computes_the_exports_logits(step, tmp_path):
    path, source, shapes, _ = step
    dec = gb.decoder(NAME)
    model, record = gb.build_reference(dec, cache=tmp_path)
    assert record["versions"]["onnxruntime-genai"] and (model.parent / "genai_config.json").is_file()
    row = br.reference_row(source, shapes, dec, SessionSettings(threads=1), rounds=3, builder=model)
    assert row.status == "ok" and row.peer_settings["logits_max_rel_diff"] < 1e-5
    assert "position_ids" not in row.peer_settings["builder_inputs"]  # the builder's inputs differ
    counts = row.peer_settings["nodes_after_ort_all"]
    assert counts["genai-builder"] < counts["export"]
    assert gb.build_reference(dec, cache=tmp_path)[1].get("cached")  # the same weights: built once


@pytest.mark.slow
@pytest.mark.skipif(gb.genai_python() is None, reason="onnxruntime-genai's builder venv is missing: make genai-builder")
def test_the_builders_source_copy_builds_the_same_graph(step, tmp_path, monkeypatch):
    import shutil

    site = next(gb.genai_python().parent.parent.glob("lib/python*/site-packages/onnxruntime_genai/models"))
    shutil.copytree(site, tmp_path / "models")
    monkeypatch.setenv("RLFLOW_GENAI_BUILDER", str(tmp_path / "models"))
    model, record = gb.build_reference(gb.decoder(NAME), cache=tmp_path / "cache")
    assert record["versions"]["onnxruntime-genai"] == "source copy" and record["versions"]["torch"]
    row = br.reference_row(step[1], step[2], gb.decoder(NAME), SessionSettings(threads=1), rounds=3, builder=model)
    assert row.status == "ok" and row.peer_settings["logits_max_rel_diff"] < 1e-5
