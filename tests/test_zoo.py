"""The model zoo: registry, deterministic builds, onnxruntime checks; the full-size figures in a slow test."""

import json
import subprocess
import sys

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from rlflow import zoo
from rlflow.graph.flops import count_flops, count_params

SMALL = [n for n in zoo.names() if zoo.get(n).tiny]
FULL = zoo.names(include_tiny=False)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """Every tiny model and the demo block, built once for the module."""
    out = tmp_path_factory.mktemp("zoo")
    return out, {name: zoo.build(name, out) for name in SMALL}


def test_registry_has_the_twelve_and_their_tiny_variants():
    assert len(FULL) == 12
    assert set(SMALL) == {f"{n}-tiny" for n in FULL} | {"demo-block"}
    for name in FULL:
        entry = zoo.get(name)
        assert entry.family in ("cnn", "transformer", "rnn")
        assert set(entry.published) == {"params", "flops", "source"}
    assert zoo.get("demo-block").input_shapes == {"x": (1, 32, 64)}


def test_unknown_name():
    with pytest.raises(ValueError, match="unknown zoo model 'resnet-51'; choose from: squeezenet-1.1, "):
        zoo.get("resnet-51")
    with pytest.raises(ValueError, match="unknown zoo model"):
        zoo.build("resnet-51", "unused")


def test_import_rlflow_does_not_import_torch():
    code = "import sys, rlflow, rlflow.zoo; rlflow.zoo.names(); rlflow.zoo.definition_hash('resnet-50'); " \
           "print('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout == "False\n"


@pytest.mark.parametrize("name", SMALL)
def test_small_models_build_and_run_in_onnxruntime(built, name):
    out, results = built
    result = results[name]
    assert result.path == out / f"{name}.onnx" and not result.skipped
    model = onnx.load(result.path)
    assert model.ir_version <= 10 and model.opset_import[0].version == 17
    assert result.params == count_params(model) > 0 and result.flops == count_flops(model) > 0
    assert result.nodes == len(model.graph.node)
    entry = zoo.get(name)
    assert {i.name: tuple(d.dim_value for d in i.type.tensor_type.shape.dim) for i in model.graph.input} == \
        entry.input_shapes
    session = ort.InferenceSession(str(result.path), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(1)
    feeds = {}
    for key, shape in entry.input_shapes.items():
        if entry.dtype(key) == "int64":
            feeds[key] = rng.integers(*entry.input_ranges[key], size=shape).astype(np.int64)
        else:
            feeds[key] = rng.standard_normal(shape).astype(np.float32)
    outputs = session.run(None, feeds)
    assert [o.name for o in session.get_outputs()] == list(entry.output_names)
    assert all(np.isfinite(o).all() for o in outputs)
    meta = json.loads((out / f"{name}.json").read_text())
    assert meta["opset"] == 17 and "TorchScript" in meta["exporter"] and meta["seed"] == zoo.SEED
    assert meta["definition_hash"] == zoo.definition_hash(name)
    assert meta["check"]["max_rel_diff"] < 1e-3


@pytest.mark.parametrize("name", [n for n in SMALL if zoo.get(n).family == "cnn" and "squeezenet" not in n])
def test_cnn_models_keep_nontrivial_batchnorm(built, name):
    model = onnx.load(built[0] / f"{name}.onnx")
    norms = [n for n in model.graph.node if n.op_type == "BatchNormalization"]
    assert norms, "the exporter folded BatchNormalization into Conv"
    weights = {t.name: onnx.numpy_helper.to_array(t) for t in model.graph.initializer}
    for node in norms:
        assert {a.name: a.i for a in node.attribute}.get("training_mode", 0) == 0  # inference-mode BN
        mean, var = weights[node.input[3]], weights[node.input[4]]
        assert np.abs(mean).max() > 1e-3 and np.abs(var - 1).max() > 1e-3


def test_transformers_have_separate_qkv(built):
    for name in ("demo-block", "bert-base-tiny", "vit-b-16-tiny"):
        model = onnx.load(built[0] / f"{name}.onnx")
        matmul_inputs = [n.input[0] for n in model.graph.node if n.op_type == "MatMul"]
        shared = {x for x in matmul_inputs if matmul_inputs.count(x) == 3}
        assert len(shared) == 2, name  # one input feeds Q, K and V in each of the two layers


def test_builds_are_byte_deterministic(built, tmp_path):
    out, results = built
    for name in ("demo-block", "resnet-50-tiny", "nasnet-a-mobile-tiny", "gpt2-small-tiny"):
        again = zoo.build(name, tmp_path, force=True)
        assert again.path.read_bytes() == results[name].path.read_bytes(), name


def test_unchanged_definitions_are_skipped(tmp_path):
    first = zoo.build("demo-block", tmp_path)
    stamp = first.path.stat().st_mtime_ns
    second = zoo.build("demo-block", tmp_path)
    assert second.skipped and second.path.stat().st_mtime_ns == stamp
    assert (second.params, second.flops, second.nodes) == (first.params, first.flops, first.nodes)
    assert not zoo.build("demo-block", tmp_path, force=True).skipped
    # An edited definition (here: a different recorded hash) rebuilds.
    meta_path = tmp_path / "demo-block.json"
    meta = json.loads(meta_path.read_text())
    meta["definition_hash"] = "0" * 16
    meta_path.write_text(json.dumps(meta))
    assert not zoo.build("demo-block", tmp_path).skipped
    assert not list(tmp_path.glob(".*.tmp"))


def test_definition_hash_follows_sources_and_config():
    before = zoo.definition_hash("bert-base-tiny")
    assert before != zoo.definition_hash("bert-base")  # same sources, other config
    sources = {p.name for p in zoo._sources("bert")}
    assert sources == {"bert.py", "transformer.py", "common.py"}


def test_summary_reuses_a_build(tmp_path):
    zoo.build("demo-block", tmp_path)
    row = zoo.summary("demo-block", cache_dir=tmp_path)
    assert row["name"] == "demo-block" and row["family"] == "transformer"
    assert row["input_shapes"] == {"x": (1, 32, 64)} and row["params"] > 0 and row["flops"] > 0 and row["nodes"] > 0


@pytest.mark.slow
@pytest.mark.parametrize("name", FULL)
def test_full_models_match_published_figures(name):
    """Builds (or reuses) the full model in the repository's models/ folder; within 10% of the published figures."""
    result = zoo.build(name, zoo.MODELS_DIR)
    published = zoo.get(name).published
    assert abs(result.params / published["params"] - 1) < 0.10
    assert abs(result.flops / published["flops"] - 1) < 0.10
    if zoo.get(name).family == "cnn" and name != "squeezenet-1.1":
        model = onnx.load(result.path, load_external_data=False)
        assert any(n.op_type == "BatchNormalization" for n in model.graph.node)
