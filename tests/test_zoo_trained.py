"""The zoo's trained section: the stdlib split, deterministic training, the outlier rescale, the held-out npz, and a
tiny build by name (the full entries train for minutes; they are built by hand)."""

import json
import math

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from rlflow import zoo
from rlflow.cli import main
from rlflow.graph.input_shapes import DEPLOYED_SHAPES_KEY
from rlflow.zoo import stdlib_text, trained

pytest.importorskip("transformers")

TINY = "stdlib-llama-tiny-s128-ts"
TINY_OUTLIERS = "stdlib-llama-tiny-outliers-s128-ts"
TINY_RECIPE = next(r for r in trained.RECIPES if r.tiny)


def _session(path):
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """The tiny plain entry built through the CLI by name, its outliers variant through `zoo.build`."""
    out = tmp_path_factory.mktemp("trained")
    assert main(["zoo", "build", TINY, "--out", str(out)]) == 0
    zoo.build(TINY_OUTLIERS, out)
    return out


def test_the_section_stays_out_of_the_default_lists():
    names = zoo.names(family="trained")
    assert {"stdlib-llama-s128-ts", "stdlib-llama-outliers-s128-ts", TINY, TINY_OUTLIERS} <= set(names)
    assert not set(names) & set(zoo.names() + zoo.names(family="deploy", include_gpu=True))
    full = zoo.names(include_tiny=False, family="trained")
    assert full and all("tiny" not in n for n in full) and zoo.get(TINY).tiny
    entry = zoo.get("stdlib-llama-s128-ts")
    assert entry.input_shapes == {"input_ids": (1, 128)} and entry.dtype("input_ids") == "int64"
    assert entry.config["recipe"]["config"]["tie_word_embeddings"] is False


def test_the_split_is_disjoint_sorted_and_hashes_the_path():
    files = [rel for rel, _ in stdlib_text.stdlib_files()]
    assert files == sorted(files) and len(files) > 300
    assert not any(part in ("test", "tests", "idle_test", "site-packages") for f in files for part in f.split("/"))
    train, held = stdlib_text.split()
    assert not set(train) & set(held) and sorted(train + held) == files
    assert 0.02 < len(held) / len(files) < 0.10
    assert all(stdlib_text.is_heldout(f) for f in held) and not any(stdlib_text.is_heldout(f) for f in train)


def test_the_walk_keeps_python_source_outside_tests_only(tmp_path):
    for rel in ("a.py", "pkg/b.py", "pkg/c.txt", "test/d.py", "pkg/tests/e.py", "site-packages/f.py",
                "idlelib/idle_test/g.py", "h.pyc"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("x = 1\n")
    assert [rel for rel, _ in stdlib_text.stdlib_files(tmp_path)] == ["a.py", "pkg/b.py"]


def test_heldout_loss_is_ln256_for_uniform_logits_and_small_for_confident_ones():
    ids = np.random.default_rng(0).integers(0, 256, (3, 16)).astype(np.int64)
    assert stdlib_text.heldout_loss(np.zeros((3, 16, 256), np.float32), ids) == pytest.approx(math.log(256))
    confident = np.zeros((3, 16, 256), np.float32)
    confident[np.arange(3)[:, None], np.arange(15)[None, :], ids[:, 1:]] = 30.0
    assert stdlib_text.heldout_loss(confident, ids) < 1e-6
    assert trained.heldout_loss is stdlib_text.heldout_loss


def test_tiny_training_is_deterministic_and_learns():
    first_state, first = trained.train(TINY_RECIPE)
    second_state, second = trained.train(TINY_RECIPE)
    assert first_state.keys() == second_state.keys()
    assert all(first_state[k].numpy().tobytes() == second_state[k].numpy().tobytes() for k in first_state)
    assert first["train_loss"] == second["train_loss"] and first["heldout_loss"] == second["heldout_loss"]
    assert first["heldout_loss"] < math.log(256) - 0.5


def test_the_outlier_rescale_keeps_the_function_and_makes_outlier_columns():
    import dataclasses

    import torch

    plain, _, none = trained.model_of(zoo.get(TINY))
    outliers, _, channels = trained.model_of(zoo.get(TINY_OUTLIERS))
    assert none is None and len(channels) == trained.OUTLIER_CHANNELS
    assert channels == trained.outlier_channels(TINY_RECIPE.config["hidden_size"])  # seeded: the same every time
    ids = torch.from_numpy(stdlib_text.windows(stdlib_text.corpora()[1], samples=4))
    with torch.no_grad():
        want, got = trained.wrap(plain)(ids).numpy(), trained.wrap(outliers)(ids).numpy()
    assert np.abs(got - want).max() / np.abs(want).max() < 1e-4
    others = [c for c in range(TINY_RECIPE.config["hidden_size"]) if c not in channels]

    def ratio(model, name):
        weight = dict(model.named_parameters())[name].detach().abs()
        return float(weight[:, channels].mean() / weight[:, others].mean())

    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.1.mlp.up_proj.weight", "lm_head.weight"):
        assert ratio(outliers, name) == pytest.approx(trained.OUTLIER_SCALE * ratio(plain, name), rel=1e-5)
    norm = "model.layers.0.input_layernorm.weight"
    assert torch.allclose(dict(outliers.named_parameters())[norm][channels] * trained.OUTLIER_SCALE,
                          dict(plain.named_parameters())[norm][channels])
    bigger = dataclasses.replace(zoo.get(TINY_OUTLIERS), config=dict(zoo.get(TINY_OUTLIERS).config, outlier_scale=60))
    assert ratio(trained.model_of(bigger)[0], "lm_head.weight") == pytest.approx(2 * ratio(outliers, "lm_head.weight"),
                                                                               rel=1e-5)


def test_the_build_writes_a_dynamic_model_its_metadata_and_the_heldout_npz(built):
    path = built / f"{TINY}.onnx"
    model = onnx.load(path)
    assert model.ir_version <= 10 and model.opset_import[0].version == 17
    dims = {i.name: [d.dim_param or d.dim_value for d in i.type.tensor_type.shape.dim] for i in model.graph.input}
    assert list(dims) == ["input_ids"] and all(isinstance(d, str) for d in dims["input_ids"])
    props = {p.key: p.value for p in model.metadata_props}
    assert props[DEPLOYED_SHAPES_KEY] == "input_ids:1,128" and props["rlflow.zoo.python"].count(".") == 2
    assert "sha256" in props["rlflow.zoo.data_split"] and float(props["rlflow.zoo.heldout_loss"]) < math.log(256)
    meta = json.loads((built / f"{TINY}.json").read_text())
    assert meta["family"] == "trained" and meta["sidecars"] == [".heldout.npz"]
    assert meta["training"]["heldout_loss"] < math.log(256) and meta["check"]["max_rel_diff"] < 1e-3

    data = np.load(built / f"{TINY}.heldout.npz")
    session = _session(path)
    assert sorted(data.files) == sorted(i.name for i in session.get_inputs())
    ids = data["input_ids"]
    assert ids.dtype == np.int64 and ids.shape == (stdlib_text.HELDOUT_SAMPLES, 128) and ids.max() < 256
    logits = np.concatenate([session.run(None, {"input_ids": ids[i:i + 16]})[0] for i in range(0, len(ids), 16)])
    assert logits.shape == (len(ids), 128, 256)
    assert stdlib_text.heldout_loss(logits, ids) == pytest.approx(meta["heldout_loss_torch"], abs=1e-3)
    assert session.run(None, {"input_ids": ids[:3, :40]})[0].shape == (3, 40, 256)  # both axes dynamic


def test_the_outliers_file_computes_what_the_plain_file_does(built):
    ids = np.load(built / f"{TINY_OUTLIERS}.heldout.npz")["input_ids"][:4]
    want = _session(built / f"{TINY}.onnx").run(None, {"input_ids": ids})[0]
    got = _session(built / f"{TINY_OUTLIERS}.onnx").run(None, {"input_ids": ids})[0]
    assert np.abs(got - want).max() / np.abs(want).max() < 1e-4
    meta = json.loads((built / f"{TINY_OUTLIERS}.json").read_text())
    assert meta["outlier_scale"] == trained.OUTLIER_SCALE and meta["outlier_max_rel_diff"] < 1e-4
    props = {p.key: p.value for p in onnx.load(built / f"{TINY_OUTLIERS}.onnx").metadata_props}
    assert props["rlflow.zoo.outlier_channels"] == ",".join(map(str, meta["outlier_channels"]))


def test_builds_are_byte_identical_and_skipped_when_up_to_date(built, tmp_path):
    again = zoo.build(TINY, tmp_path, force=True)
    assert again.path.read_bytes() == (built / f"{TINY}.onnx").read_bytes()
    assert (tmp_path / f"{TINY}.heldout.npz").read_bytes() == (built / f"{TINY}.heldout.npz").read_bytes()
    assert zoo.build(TINY, tmp_path).skipped
    (tmp_path / f"{TINY}.heldout.npz").unlink()  # a missing held-out set rebuilds
    assert not zoo.build(TINY, tmp_path).skipped and (tmp_path / f"{TINY}.heldout.npz").is_file()


def test_the_definition_hash_follows_the_python_version(monkeypatch):
    before = zoo.definition_hash(TINY)
    monkeypatch.setattr(trained.platform, "python_version", lambda: "3.99.0")
    assert zoo.definition_hash(TINY) != before
