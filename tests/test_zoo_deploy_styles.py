"""The deployment section's export-style variants (rlflow/zoo/deploy_styles.py, issue #49): names, what each style
records, the definition hash, and real builds of the smallest architecture (BERT L2/H128 at sequence 16)."""

import dataclasses
import json
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from rlflow import zoo
from rlflow.zoo import deploy, deploy_styles

STYLED = [n for n in zoo.names(include_tiny=False, family="deploy") if deploy_styles.owns(zoo.get(n))]


def test_names_extend_the_sections_with_the_style():
    assert {"bert-l4-h256-s16-ts-static", "bert-l4-h256-s16-dynamo-static", "bert-l2-h128-s16-ts-static-nopool",
            "roberta-base-s16-dynamo-nopool", "distilbert-base-s16-ts-cls", "minilm-l12-h384-s16-ts-o14",
            "deit-small-b1-ts-o18", "whisper-tiny-encoder-b1-dynamo-o17"} <= set(STYLED)
    for name in STYLED:
        entry = zoo.get(name)
        config = entry.config
        base = f"{config['architecture']}-{next(iter(deploy_styles._BY_KEY[config['architecture']].shapes))}"
        assert name == f"{base}-{config['exporter']}-{config['style']}" and not entry.tiny and not entry.gpu
        assert entry.input_shapes == zoo.get(f"{base}-{config['exporter']}").input_shapes
    # the section's own entries come first and are unchanged; no decoder and no GPT-2 has a style
    deploy_names = zoo.names(include_tiny=False, family="deploy")
    assert deploy_names[-len(STYLED):] == STYLED
    assert not any(n.startswith(("gpt2-", "llama", "qwen")) for n in STYLED)
    # nopool where there is a pooler to drop, cls on text only, the opset styles on their exporter only
    assert "distilbert-base-s16-ts-nopool" not in STYLED and "electra-small-s16-ts-static-nopool" not in STYLED
    assert "deit-tiny-b1-ts-cls" not in STYLED and "bert-l2-h128-s16-dynamo-o14" not in STYLED
    assert "bert-l2-h128-s16-ts-o17" not in STYLED and "bert-l2-h128-s16-dynamo-o17" in STYLED


def test_outputs_opsets_and_the_recorded_exporter_say_what_was_done():
    cls, nopool = zoo.get("bert-l4-h256-s16-ts-cls"), zoo.get("albert-base-s16-dynamo-static-nopool")
    assert cls.output_names == ("logits",) and cls.config["model"] == "BertForSequenceClassification"
    assert cls.config["config"]["num_labels"] == 2
    assert nopool.output_names == ("last_hidden_state",) and nopool.config["static"]
    assert zoo.get("bert-l4-h256-s16-ts-o14").config["opset"] == 14
    assert zoo.get("bert-l4-h256-s16-dynamo-o17").config["opset"] == 17
    assert zoo.get("bert-l4-h256-s16-ts-static").config["opset"] == 17
    styles = deploy_styles._STYLES
    assert styles["static-nopool"].describe("ts") == (
        "torch.onnx.export (TorchScript, dynamo=False), opset 17, static shapes (no dynamic_axes), "
        "last_hidden_state only (no pooler_output)")
    assert styles["o17"].describe("dynamo") == "torch.onnx.export (dynamo=True, default optimize), opset 17, " \
                                               "dynamic_shapes"
    assert styles["cls"].describe("dynamo").endswith("ForSequenceClassification head (logits, 2 labels)")


def test_the_variants_code_is_in_their_hash_only(monkeypatch):
    """An edit to the variants' module makes them stale and leaves the section's own builds up to date; an edit to
    rlflow/zoo/deploy.py, whose helpers they use, makes both stale."""
    styled, plain = "bert-l2-h128-s16-ts-static", "bert-l2-h128-s16-ts"
    before = {n: zoo.definition_hash(n) for n in (styled, plain)}
    assert before[styled] != zoo.definition_hash("bert-l2-h128-s16-ts-static-nopool")
    read = Path.read_bytes

    def edited(module):
        return lambda path: read(path) + (b"\n# edited\n" if path == Path(module.__file__) else b"")

    monkeypatch.setattr(Path, "read_bytes", edited(deploy_styles))
    assert zoo.definition_hash(styled) != before[styled] and zoo.definition_hash(plain) == before[plain]
    monkeypatch.setattr(Path, "read_bytes", edited(deploy))
    assert zoo.definition_hash(styled) != before[styled] and zoo.definition_hash(plain) != before[plain]


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """Three TorchScript variants of BERT L2/H128 at sequence 16 (under a second each; dynamo's are in the slow
    test below)."""
    pytest.importorskip("transformers")
    out = tmp_path_factory.mktemp("styles")
    names = ["bert-l2-h128-s16-ts-o14", "bert-l2-h128-s16-ts-cls", "bert-l2-h128-s16-ts-static-nopool"]
    return out, {name: zoo.build(name, out) for name in names}


def _dims(model) -> dict:
    return {i.name: [d.dim_param or d.dim_value for d in i.type.tensor_type.shape.dim] for i in model.graph.input}


def test_static_variants_have_no_dynamic_axis_and_run_at_the_deployed_shape(built):
    out, results = built
    name = "bert-l2-h128-s16-ts-static-nopool"
    nopool = onnx.load(results[name].path)
    assert _dims(nopool) == {"input_ids": [1, 16], "attention_mask": [1, 16]}
    meta = json.loads((out / f"{name}.json").read_text())
    assert "static shapes" in meta["exporter"] and "no pooler_output" in meta["exporter"]
    assert meta["style"] == "static-nopool" and meta["check"]["max_rel_diff"] < 1e-3
    assert {p.key: p.value for p in nopool.metadata_props}["rlflow.zoo.style"] == "static-nopool"
    assert [o.name for o in nopool.graph.output] == ["last_hidden_state"]
    assert "Tanh" not in {n.op_type for n in nopool.graph.node}  # the pooler's activation


def test_opset_14_writes_layer_norm_out_and_the_head_gives_two_logits(built):
    out, results = built
    o14 = onnx.load(results["bert-l2-h128-s16-ts-o14"].path)
    assert o14.opset_import[0].version == 14 and json.loads((out / "bert-l2-h128-s16-ts-o14.json").read_text())[
        "opset"] == 14
    ops = {n.op_type for n in o14.graph.node}
    assert "LayerNormalization" not in ops and "ReduceMean" in ops
    assert all(isinstance(d, str) for dims in _dims(o14).values() for d in dims)  # dynamic, as the exporter's default
    session = ort.InferenceSession(str(results["bert-l2-h128-s16-ts-cls"].path), providers=["CPUExecutionProvider"])
    feeds = {"input_ids": np.random.default_rng(0).integers(0, 30522, (3, 40)),
             "attention_mask": np.ones((3, 40), np.int64)}
    (logits,) = session.run(None, feeds)
    assert logits.shape == (3, 2) and np.isfinite(logits).all()


def test_a_file_at_another_opset_than_its_name_says_is_refused(monkeypatch, tmp_path):
    """dynamo exports at opset 18 and converts down, keeping 18 where that fails: the build refuses a file whose opset
    is not its entry's (here a TorchScript export at 17 under an entry that says 18)."""
    pytest.importorskip("transformers")
    name = "bert-l2-h128-s16-ts-static"
    entry = zoo.get(name)
    monkeypatch.setitem(zoo._REGISTRY, name, dataclasses.replace(entry, config=dict(entry.config, opset=18)))
    with pytest.raises(RuntimeError, match="wrote opset 17, not 18"):
        zoo.build(name, tmp_path)
    assert not list(tmp_path.iterdir())


@pytest.mark.slow
def test_dynamo_variants_build(tmp_path):
    """dynamo's static export without the pooler and its conversion down to opset 17 (about 3 and 6 s)."""
    pytest.importorskip("transformers")
    nopool = onnx.load(zoo.build("bert-l2-h128-s16-dynamo-static-nopool", tmp_path).path)
    assert _dims(nopool) == {"input_ids": [1, 16], "attention_mask": [1, 16]} and nopool.opset_import[0].version == 18
    assert [o.name for o in nopool.graph.output] == ["last_hidden_state"]
    o17 = onnx.load(zoo.build("bert-l2-h128-s16-dynamo-o17", tmp_path).path)
    assert o17.opset_import[0].version == 17 and all(isinstance(d, str) for v in _dims(o17).values() for d in v)
