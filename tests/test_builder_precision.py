"""The genai builder's int4 graph as a `rlflow bench-precision` peer (rlflow.bench.builder_precision): feeds taken as
decoder steps and translated into the builder's inputs, its error over the outputs both graphs share, the settings it
records, and its row "not applicable" with the reason where it cannot be built; the builder itself only where `make
genai-builder` made its venv (and with -m slow).  A builder-like graph stands in for the builder elsewhere: the
export deriving its positions from the mask, as the builder does."""
import math

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from rlflow.bench import builder_precision as bp
from rlflow.bench import genai_builder as gb
from rlflow.bench.peers import NotApplicable
from rlflow.bench.precision_peers import PRECISION_PEERS, run_precision_peer
from rlflow.errors import RlflowError
from rlflow.graph.input_shapes import DEPLOYED_SHAPES_KEY, format_input_shapes
from rlflow.measure.accuracy import Samples, random_samples
from rlflow.measure.session import SessionSettings
from rlflow.zoo import decoders

NAME = "llama-tiny-decode-p16-ts"
SHAPES = decoders.input_shapes(decoders._BY_KEY["llama-tiny"], "decode", 16)


def builder_like(export: onnx.ModelProto, cache: str = "export") -> onnx.ModelProto:
    """The export without its position_ids input, computing them from the mask as the builder does (a decode step's one
    position: the mask's sum less one); its present cache as the export's, as (batch, total, heads, head) under the
    same names (`cache` "transposed") or left out ("none")."""
    model = onnx.ModelProto()
    model.CopyFrom(export)
    graph = model.graph
    kept = [vi for vi in graph.input if vi.name != "position_ids"]
    del graph.input[:]
    graph.input.extend(kept)
    graph.initializer.extend([numpy_helper.from_array(np.array([1], np.int64), "rlflow_axes"),
                              numpy_helper.from_array(np.array(1, np.int64), "rlflow_one")])
    graph.node.insert(0, helper.make_node("ReduceSum", ["attention_mask", "rlflow_axes"], ["rlflow_total"], keepdims=1))
    graph.node.insert(1, helper.make_node("Sub", ["rlflow_total", "rlflow_one"], ["position_ids"]))
    if cache == "none":
        logits = [o for o in graph.output if o.name == "logits"]
        del graph.output[:]
        graph.output.extend(logits)
    for output in graph.output if cache == "transposed" else ():
        if output.name.startswith("present"):
            for node in graph.node:
                for values in (node.input, node.output):
                    values[:] = [f"{v}_bhtd" if v == output.name else v for v in values]
            graph.node.append(helper.make_node("Transpose", [f"{output.name}_bhtd"], [output.name], perm=[0, 2, 1, 3]))
            dims = output.type.tensor_type.shape.dim
            dims[1].Clear(), dims[2].Clear()
            dims[1].dim_param, dims[2].dim_value = "total", 2
    return model


@pytest.fixture(scope="module")
def step(tmp_path_factory):
    """llama-tiny's decode step (TorchScript export: seconds) as NAME.onnx, deployed at past 16, and a builder-like
    graph of it as a builder's model.onnx."""
    folder = tmp_path_factory.mktemp("builder-precision")
    data, _ = decoders.export_decoder(decoders._BY_KEY["llama-tiny"], "decode", "ts")
    export = onnx.load_from_string(data)
    export.metadata_props.add(key=DEPLOYED_SHAPES_KEY, value=format_input_shapes(SHAPES))  # as the zoo deploys it
    path = folder / f"{NAME}.onnx"
    onnx.save(export, path)
    (folder / "builder").mkdir()
    onnx.save(builder_like(export), folder / "builder" / "model.onnx")
    return path, export, folder / "builder" / "model.onnx"


def test_a_feed_as_a_step_has_an_all_ones_mask_and_positions_after_the_cache():
    rng = np.random.default_rng(0)
    feed = {"input_ids": np.array([[5], [7]]), "attention_mask": rng.integers(0, 2, (2, 17)),
            "position_ids": rng.integers(0, 2, (2, 1)), "past_key_values.0.key": rng.standard_normal((2, 2, 16, 16))}
    got = bp.as_step(feed)
    assert got["attention_mask"].all() and got["attention_mask"].shape == (2, 17)
    assert got["position_ids"].tolist() == [[16], [16]] and got["position_ids"].dtype == feed["position_ids"].dtype
    assert got["input_ids"] is feed["input_ids"] and got["past_key_values.0.key"] is feed["past_key_values.0.key"]
    samples = Samples([feed], "random inputs (1 samples)", random=True)
    steps = bp.as_steps(samples)
    assert steps.source == "random inputs (1 samples) as decoder steps (all-ones mask, positions after the cache)"
    assert bp.as_steps(steps) is steps  # steps already: the same samples, the same words
    assert bp.as_step({"x": feed["input_ids"]}) == {"x": feed["input_ids"]}  # no mask: nothing to take


def test_the_builders_error_is_taken_on_the_same_steps_in_its_own_inputs(step):
    """A builder-like graph computes the export's outputs on a step: fed each sample translated, its error is nil over
    the logits and the cache; without its cache outputs, over the logits only, and the row says so."""
    path, export, builder = step
    dec, settings = gb.decoder(NAME), SessionSettings(threads=1)
    samples = random_samples(export, SHAPES, seed=0)  # random masks and positions: no step
    peer = bp.BuilderPeer(onnx.load(str(builder)), dec, builder, {})
    feeds = peer.feeds(samples.feeds[0])
    assert "position_ids" not in feeds and feeds["attention_mask"].all()
    error, said = peer.error(export, samples, settings)
    assert error.source.endswith("as decoder steps (all-ones mask, positions after the cache)")
    assert [c.name for c in error.checks] == ["logits"] + [f"present.{i}.{kv}" for i in range(2) for kv in ("key",
                                                                                                            "value")]
    assert error.max_error < 1e-5 and error.logits["agreement"] == 1.0
    assert said["error_over"] == "logits and the present cache (4 outputs)"
    for cache in ("none", "transposed"):  # no cache, or one in another layout under the same names: logits only
        other = bp.BuilderPeer(builder_like(export, cache), dec, builder, {})
        error, said = other.error(export, samples, settings)
        assert [c.name for c in error.checks] == ["logits"] and error.max_error < 1e-5, cache
        assert said["error_over"].startswith("logits only")
    assert len(bp.comparable_outputs(export, builder_like(export, "transposed"))) == 5  # the graphs cannot tell


def test_quantization_reads_the_int4_settings_off_the_graph():
    """What the builder's graph holds: MatMulNBits' attributes (sizes aside), no zero points (symmetric), and an
    embedding that reads the LM head's int4 weight through a Reshape (tied)."""
    nodes = [helper.make_node("Reshape", ["head_q", "shape"], ["table"]),
             helper.make_node("GatherBlockQuantized", ["table", "ids", "head_scales"], ["x"], bits=4, block_size=32,
                              gather_axis=0, quantize_axis=1, domain="com.microsoft"),
             helper.make_node("MatMulNBits", ["x", "w_q", "w_scales"], ["h"], K=64, N=32, bits=4, block_size=32,
                              accuracy_level=4, domain="com.microsoft"),
             helper.make_node("MatMulNBits", ["h", "head_q", "head_scales"], ["logits"], K=32, N=256, bits=4,
                              block_size=32, accuracy_level=4, domain="com.microsoft")]
    model = helper.make_model(helper.make_graph(nodes, "g", [], []))
    got = bp.quantization(model)
    assert got["MatMulNBits"] == {"nodes": 2, "zero_points": False, "bits": 4, "block_size": 32, "accuracy_level": 4}
    assert got["GatherBlockQuantized"]["nodes"] == 1 and got["embedding_tied_to_lm_head"]
    nodes[2].input.append("w_zero_points")
    nodes[2].attribute[2].i = 1  # accuracy_level differs between nodes: both values
    got = bp.quantization(helper.make_model(helper.make_graph(nodes[1:3], "g", [], [])))
    assert got["MatMulNBits"]["zero_points"] and got["MatMulNBits"]["accuracy_level"] == 1
    assert not got["embedding_tied_to_lm_head"]


def test_not_a_zoo_decoder_or_no_builder_is_not_applicable_and_says_why(step, tmp_path, monkeypatch):
    path, export, _ = step
    assert PRECISION_PEERS["genai-int4"] == "int4"
    mlp = helper.make_model(helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "mlp",
                                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
                                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])]))
    with pytest.raises(NotApplicable, match="mlp is not one of the zoo's decoders"):
        bp.builder_peer("genai-int4", "int4", mlp, tmp_path / "mlp.onnx")
    with pytest.raises(NotApplicable, match="not one of the zoo's decoders"):
        run_precision_peer("genai-int4", mlp)
    monkeypatch.setenv("RLFLOW_GENAI_VENV", str(tmp_path / "none"))
    monkeypatch.delenv("RLFLOW_GENAI_BUILDER", raising=False)
    with pytest.raises(NotApplicable, match="make genai-builder"):
        bp.builder_peer("genai-int4", "int4", export, path)
    with pytest.raises(NotApplicable, match="make genai-builder"):
        run_precision_peer("genai-int4", str(path))

    def fails(*args, **kwargs):
        raise RlflowError("the genai builder failed (1): out of memory")

    monkeypatch.setattr(bp, "builder_command", lambda: ["python"])
    monkeypatch.setattr(bp, "build_reference", fails)
    with pytest.raises(NotApplicable, match=r"genai-int4 failed: RlflowError: the genai builder failed \(1\)"):
        bp.builder_peer("genai-int4", "int4", export, path)


def test_bench_precision_times_it_fed_its_own_inputs_and_takes_its_error_on_the_same_samples(step, tmp_path,
                                                                                          monkeypatch):
    """In `bench-precision`: the builder-like graph (as the builder's answer) is a row with its speed and a nil error
    on the zoo decoder's samples as steps, the same as every other row's; a model that is no decoder gets a row that
    says why."""
    from rlflow.bench.precision import PrecisionBench, run

    path, export, builder = step
    record = {"precision": "int4", "provider": "cpu", "versions": {"onnxruntime-genai": "test"}, "seconds": 0.0}
    monkeypatch.setattr(bp, "builder_command", lambda: ["python"])
    monkeypatch.setattr(bp, "build_reference", lambda dec, precision, provider: (builder, record))
    config = PrecisionBench("int4", peers=("genai-int4",), rounds=3, method="greedy", time_limit=1)
    rows = {r["method"]: r for r in run([path], config, tmp_path / "out")["rows"]}
    assert set(rows) == {"rlflow-exact", "rlflow", "genai-int4"}
    assert all(r["status"] == "ok" for r in rows.values())
    row = rows["genai-int4"]
    assert row["max_error"] < 1e-5 and row["speedup"]["median"] > 0 and row["bytes_read"] > 0
    assert len({r["samples"] for r in rows.values()}) == 1 and row["samples"].endswith("positions after the cache)")
    assert row["settings"]["arguments"] == "-p int4 -e cpu" and row["settings"]["build"] == record
    assert row["error_over"] == "logits and the present cache (4 outputs)"
    assert "| genai-int4 |" in (tmp_path / "out" / "results.md").read_text()
    # rlflow's search was given those steps, so its budget (int4's default) holds on the figure its row reports
    assert rows["rlflow"]["max_error"] <= 0.10 and rows["rlflow"]["precision_stop"]

    mlp = tmp_path / "mlp.onnx"
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 64])
    w = numpy_helper.from_array(np.random.default_rng(0).standard_normal((64, 64)).astype(np.float32), "w")
    model = helper.make_model(helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "mlp", [x],
                                                [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 64])], [w]),
                              opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 10
    onnx.save(model, mlp)
    rows = {r["method"]: r for r in run([mlp], config, tmp_path / "out-mlp")["rows"]}
    assert rows["genai-int4"]["status"] == "not applicable"
    assert "mlp is not one of the zoo's decoders" in rows["genai-int4"]["reason"]


@pytest.mark.slow
@pytest.mark.skipif(gb.genai_python() is None, reason="onnxruntime-genai's builder venv is missing: make genai-builder")
def test_the_builders_int4_graph_is_a_peer_at_its_own_defaults(step):
    path, export, _ = step
    peer = bp.builder_peer("genai-int4", "int4", export, path)
    settings = peer.settings
    assert settings["arguments"] == "-p int4 -e cpu" and settings["build"]["precision"] == "int4"
    nbits = settings["quantization"]["MatMulNBits"]
    assert (nbits["bits"], nbits["block_size"], nbits["accuracy_level"], nbits["zero_points"]) == (4, 32, 4, False)
    samples = random_samples(export, SHAPES, seed=0)
    error, said = peer.error(export, samples, SessionSettings(threads=1))
    assert said["error_over"] == "logits and the present cache (4 outputs)"
    assert 0 < error.max_error < 1 and math.isfinite(error.logits["kl"])
