"""The zoo's deployment section: entries, names, the deployed-shape metadata, and a small real build per exporter."""

import dataclasses
import json
import subprocess
import sys

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from rlflow import zoo
from rlflow.cli import main
from rlflow.errors import RlflowError
from rlflow.graph.input_shapes import format_input_shapes, parse_input_shapes

DEPLOY = zoo.names(include_tiny=False, family="deploy")  # the CPU's full-size models (the decoders' too)
ARCHS = ["bert-l2-h128", "bert-l4-h256", "minilm-l12-h384", "distilbert-base", "roberta-base", "deit-small",
         "deit-tiny", "gpt2-prefill", "gpt2-decode", "whisper-tiny-encoder", "electra-small", "albert-base",
         "mpnet-base"]
ENCODERS = [n for n in DEPLOY if zoo.get(n).config["architecture"] in ARCHS
            and "style" not in zoo.get(n).config]  # rlflow.zoo.deploy's (the export-style variants are apart)
SMALLEST = ["bert-l2-h128-s16-ts", "bert-l2-h128-s16-dynamo"]


def test_names_say_the_architecture_shape_and_exporter():
    shapes = {"deit-small": ["b1"], "deit-tiny": ["b1"], "whisper-tiny-encoder": ["b1"], "gpt2-prefill": ["s32"],
              "gpt2-decode": ["kv128"]}
    expected = {f"{arch}-{shape}-{exporter}" for arch in ARCHS for shape in shapes.get(arch, ["s16", "s128"])
                for exporter in ("ts", "dynamo")}
    assert set(ENCODERS) == expected and len(ENCODERS) == 42 and DEPLOY[:42] == ENCODERS
    assert {"gpt2-decode-kv128-ts", "bert-l2-h128-s16-dynamo", "whisper-tiny-encoder-b1-ts"} <= set(DEPLOY)
    # consecutive names share one export: shapes vary fastest
    assert DEPLOY[:4] == ["bert-l2-h128-s16-ts", "bert-l2-h128-s128-ts", "bert-l2-h128-s16-dynamo",
                          "bert-l2-h128-s128-dynamo"]


def test_the_section_is_a_family_of_its_own_and_stays_out_of_the_research_zoo():
    assert not set(DEPLOY) & set(zoo.names())
    assert len(zoo.names(include_tiny=False)) == 12
    assert zoo.names(include_tiny=False, family="deploy") == DEPLOY
    for name in DEPLOY:
        entry = zoo.get(name)
        assert entry.family == "deploy" and not entry.tiny and entry.published is None
    assert all(zoo.get(n).transformer is None for n in zoo.names())


def test_entries_carry_what_the_transformers_optimizer_needs():
    from onnxruntime.transformers.optimizer import MODEL_TYPES

    for name in DEPLOY:
        info = zoo.get(name).transformer
        assert {"model_type", "num_heads", "hidden_size"} <= set(info) and info["model_type"] in MODEL_TYPES
        assert info["hidden_size"] % info["num_heads"] == 0
    assert zoo.get("bert-l2-h128-s16-ts").transformer == {"model_type": "bert", "num_heads": 2, "hidden_size": 128}
    assert zoo.get("gpt2-decode-kv128-dynamo").transformer["model_type"] == "gpt2"
    assert zoo.get("deit-small-b1-ts").transformer == {"model_type": "vit", "num_heads": 6, "hidden_size": 384}


def test_deployed_shapes_and_inputs():
    entry = zoo.get("bert-l4-h256-s128-ts")
    assert entry.input_shapes == {"input_ids": (1, 128), "attention_mask": (1, 128)}
    assert entry.input_dtypes == {"input_ids": "int64", "attention_mask": "int64"}
    assert entry.input_ranges == {"input_ids": (0, 30522), "attention_mask": (0, 2)}
    assert zoo.get("roberta-base-s16-dynamo").input_ranges["input_ids"] == (0, 50265)
    decode = zoo.get("gpt2-decode-kv128-ts")
    assert decode.input_shapes["input_ids"] == (1, 1) and decode.input_shapes["attention_mask"] == (1, 129)
    past = [n for n in decode.input_shapes if n.startswith("past_key_values.")]
    assert len(past) == 24 and all(decode.input_shapes[n] == (1, 12, 128, 64) for n in past)
    assert decode.output_names[0] == "logits" and len(decode.output_names) == 25
    assert zoo.get("whisper-tiny-encoder-b1-dynamo").input_shapes == {"input_features": (1, 80, 3000)}
    assert zoo.get("deit-small-b1-ts").input_shapes == {"pixel_values": (1, 3, 224, 224)}


def test_input_shapes_metadata_is_the_input_shape_syntax():
    shapes = {"input_ids": (1, 16), "attention_mask": (1, 16)}
    text = format_input_shapes(shapes)
    assert text == "input_ids:1,16;attention_mask:1,16"
    assert parse_input_shapes(text.split(";")) == shapes
    decode = zoo.get("gpt2-decode-kv128-ts").input_shapes
    assert parse_input_shapes(format_input_shapes(decode).split(";")) == decode


def test_definition_hash_needs_neither_torch_nor_transformers():
    code = "import sys, rlflow.zoo as z; h = z.definition_hash('bert-l2-h128-s16-ts'); " \
           "assert h != z.definition_hash('bert-l2-h128-s16-dynamo'); print('torch' in sys.modules, " \
           "'transformers' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out == "False False\n"


def test_the_architecture_table_is_hashed_per_entry_and_the_export_code_whole(monkeypatch):
    """Adding an architecture leaves the other builds up to date; a change to the export code or to an entry's own
    architecture does not."""
    from pathlib import Path

    from rlflow.zoo import deploy as zoo_deploy
    from rlflow.zoo import deploy_architectures as zoo_deploy_architectures

    name = "bert-l2-h128-s16-ts"
    before = zoo.definition_hash(name)
    read = Path.read_bytes

    def edited(target):  # one source file with a line appended, as an edit would leave it
        def read_bytes(path):
            return read(path) + (b"\n# edited\n" if path == Path(target.__file__) else b"")
        return read_bytes

    monkeypatch.setattr(Path, "read_bytes", edited(zoo_deploy_architectures))
    assert zoo.definition_hash(name) == before
    monkeypatch.setattr(Path, "read_bytes", edited(zoo_deploy))
    assert zoo.definition_hash(name) != before
    monkeypatch.setattr(Path, "read_bytes", read)
    entry = zoo.get(name)
    wider = dict(entry.config, config=dict(entry.config["config"], hidden_size=256))
    monkeypatch.setitem(zoo._REGISTRY, name, dataclasses.replace(entry, config=wider))
    assert zoo.definition_hash(name) != before


def test_cli_lists_the_section_without_building_it(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("RLFLOW_CACHE", str(tmp_path))
    monkeypatch.setattr(zoo, "build", lambda *a, **k: pytest.fail("zoo list built a model"))
    assert main(["zoo", "list", "--family", "deploy"]) == 0
    rows = capsys.readouterr().out.splitlines()
    assert [r.split()[0] for r in rows[1:]] == DEPLOY and all(r.split()[1] == "deploy" for r in rows[1:])


def test_cli_builds_the_section_only_when_asked(monkeypatch, tmp_path):
    built = []

    def fake(name, out, force=False):
        built.append(name)
        return zoo.BuildResult(name, tmp_path / f"{name}.onnx", True, 0.0, 1, 1, 1)

    monkeypatch.setattr(zoo, "build", fake)
    assert main(["zoo", "build", "--out", str(tmp_path)]) == 0
    assert built == zoo.names(include_tiny=False)
    built.clear()
    assert main(["zoo", "build", "--family", "deploy", "--out", str(tmp_path)]) == 0
    assert built == DEPLOY
    built.clear()
    assert main(["zoo", "build", "gpt2-decode-kv128-ts", "--out", str(tmp_path)]) == 0
    assert built == ["gpt2-decode-kv128-ts"]


def test_building_without_transformers_names_the_extra(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "transformers", None)  # `import transformers` raises ImportError
    with pytest.raises(RlflowError, match=r"needs transformers: pip install 'rlflow\[deploy\]'"):
        zoo.build("bert-l2-h128-s16-ts", tmp_path)
    assert not list(tmp_path.iterdir())


@pytest.fixture(scope="module")
def smallest(tmp_path_factory):
    """BERT L2/H128 at sequence 16 by both exporters (about 7 s each), and sequence 128 from the same exports."""
    pytest.importorskip("transformers")
    out = tmp_path_factory.mktemp("deploy")
    names = [*SMALLEST, "bert-l2-h128-s128-dynamo"]
    return out, {name: zoo.build(name, out) for name in names}


@pytest.mark.parametrize("name", SMALLEST)
def test_smallest_model_builds_with_dynamic_axes_and_its_deployed_shape(smallest, name):
    out, results = smallest
    result = results[name]
    model = onnx.load(result.path)
    exporter = name.rsplit("-", 1)[1]
    assert model.ir_version <= 10 and model.opset_import[0].version == {"ts": 17, "dynamo": 18}[exporter]
    props = {p.key: p.value for p in model.metadata_props}
    assert props["rlflow.input_shapes"] == "input_ids:1,16;attention_mask:1,16"
    assert props["rlflow.zoo.exporter"] == exporter and props["rlflow.zoo.name"] == name
    dims = {i.name: [d.dim_param or d.dim_value for d in i.type.tensor_type.shape.dim] for i in model.graph.input}
    assert set(dims) == {"input_ids", "attention_mask"} and all(isinstance(d, str) for v in dims.values() for d in v)
    meta = json.loads((out / f"{name}.json").read_text())
    assert meta["family"] == "deploy" and meta["input_shapes"] == {"input_ids": [1, 16], "attention_mask": [1, 16]}
    assert meta["transformer"] == {"model_type": "bert", "num_heads": 2, "hidden_size": 128}
    assert ("TorchScript" in meta["exporter"]) == (exporter == "ts") and meta["check"]["max_rel_diff"] < 1e-3
    assert meta["nodes"] == result.nodes == len(model.graph.node) and meta["params"] > 4e6  # 30522 x 128 embedding
    # the file keeps its dynamic axes: it runs at another batch and sequence
    session = ort.InferenceSession(str(result.path), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(0)
    feeds = {"input_ids": rng.integers(0, 30522, (3, 40)), "attention_mask": np.ones((3, 40), np.int64)}
    hidden, pooled = session.run(None, feeds)
    assert hidden.shape == (3, 40, 128) and pooled.shape == (3, 128) and np.isfinite(hidden).all()


def test_shapes_of_one_architecture_share_the_export(smallest):
    out, results = smallest
    # FLOPs are counted at the deployed shape: eight times the tokens, a little more than eight times the work
    assert 8 < results["bert-l2-h128-s128-dynamo"].flops / results["bert-l2-h128-s16-dynamo"].flops < 10
    a, b = (onnx.load(out / f"bert-l2-h128-{s}-dynamo.onnx") for s in ("s16", "s128"))
    assert a.graph == b.graph
    assert {p.key: p.value for p in b.metadata_props}["rlflow.input_shapes"] == "input_ids:1,128;attention_mask:1,128"


@pytest.mark.slow
@pytest.mark.parametrize("name", [n for n in DEPLOY if not n.startswith("bert-l2-h128-")])
def test_deployment_models_build(name):
    """Builds (or reuses) every deployment model for the CPU in the repository's models/ folder (about 15 minutes on
    2 cores for the encoders and GPT-2, and about 30 more for the decoders: each dynamo export of a decoder takes 3 to
    5 minutes; the encoders' 95 export-style variants, one export each, add about 20 more by the 28 built so far)."""
    pytest.importorskip("transformers")
    result = zoo.build(name, zoo.MODELS_DIR)
    model = onnx.load(result.path, load_external_data=False)
    props = {p.key: p.value for p in model.metadata_props}
    assert parse_input_shapes(props["rlflow.input_shapes"].split(";")) == zoo.get(name).input_shapes


def test_cli_builds_the_other_models_when_one_fails_and_exits_1(monkeypatch, tmp_path, capsys):
    built = []

    def fake(name, out, force=False):
        if name == "gpt2-decode-kv128-ts":
            raise RuntimeError("Invalid input name: past_key_values.9.value\nmore detail")
        built.append(name)
        return zoo.BuildResult(name, tmp_path / f"{name}.onnx", True, 0.0, 1, 1, 1)

    monkeypatch.setattr(zoo, "build", fake)
    assert main(["zoo", "build", "bert-l2-h128-s16-ts", "gpt2-decode-kv128-ts", "deit-small-b1-ts",
                 "--out", str(tmp_path)]) == 1
    assert built == ["bert-l2-h128-s16-ts", "deit-small-b1-ts"]
    assert capsys.readouterr().err.splitlines() == [
        "error: gpt2-decode-kv128-ts: RuntimeError: Invalid input name: past_key_values.9.value",
        "error: 1 of 3 models not built: gpt2-decode-kv128-ts"]
    assert main(["zoo", "build", "gpt2-decode-kv128-ts", "--out", str(tmp_path)]) == 1  # alone: as before, one line
    assert capsys.readouterr().err.startswith("error: internal error (RuntimeError: Invalid input name")
