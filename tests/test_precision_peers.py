"""rlflow.bench.precision_peers: every peer quantizes a small fp32 model into what it is meant to write, the output
runs in onnxruntime on the CPU within its precision's error, and the input is left as it was; the fp16 peers' own
settings (the optimizer's fusions, the mixed converter's budget) hold."""
from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from rlflow.bench.peers import NotApplicable
from rlflow.bench.precision_peers import BUILT_PEERS, PRECISION_PEERS, run_precision_peer
from rlflow.graph.model_file import max_ir_version

MAX_ERROR = {"int4": 0.2, "int8": 0.03, "fp16": 0.002}
"""Relative error norm of the two-layer model's output, by precision.  Measured on these weights (standard normal
scaled by 1/16, seed 0) and inputs: int4 0.10 (HQQ) to 0.14 (onnxsim's [-7, 7] range), each of the two layers adding
its own; int8 0.010 to 0.017; fp16 0.0003.  The bounds leave room above those, not a margin to hide a regression in a
scheme: a layer left float would pass them, which `LAYERS_WRITTEN` catches instead."""

WIDTH = 256


def two_layers(width: int = WIDTH) -> onnx.ModelProto:
    """x [b, 4, width] -> MatMul W1 -> Relu -> MatMul W2 -> y, in onnx's own default IR version (onnxruntime refuses
    it: the peers must lower it)."""
    rng = np.random.default_rng(0)
    w1, w2 = ((rng.standard_normal((width, width)) / 16).astype(np.float32) for _ in range(2))
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w1"], ["h"]), helper.make_node("Relu", ["h"], ["r"]),
         helper.make_node("MatMul", ["r", "w2"], ["y"])], "two_layers",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", 4, width])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["b", 4, width])],
        [numpy_helper.from_array(w1, "w1"), numpy_helper.from_array(w2, "w2")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def gemm_layer(width: int = WIDTH) -> onnx.ModelProto:
    """x [n, width] -> Gemm (transB, bias) -> y, as torch exports a Linear on a 2-D input."""
    rng = np.random.default_rng(1)
    w = (rng.standard_normal((width, width)) / 16).astype(np.float32)
    b = (rng.standard_normal(width) / 16).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("Gemm", ["x", "w", "b"], ["y"], transB=1)], "gemm",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", width])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", width])],
        [numpy_helper.from_array(w, "w"), numpy_helper.from_array(b, "b")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def residual_norm(width: int = WIDTH) -> onnx.ModelProto:
    """x -> MatMul W -> Add x -> LayerNormalization -> y: the residual a transformer's layer ends with, which
    onnxruntime's transformers optimizer fuses into SkipLayerNormalization."""
    rng = np.random.default_rng(5)
    w = (rng.standard_normal((width, width)) / 16).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["h"]), helper.make_node("Add", ["h", "x"], ["r"]),
         helper.make_node("LayerNormalization", ["r", "gamma", "beta"], ["y"], axis=-1, epsilon=1e-5)], "residual",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", 4, width])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["b", 4, width])],
        [numpy_helper.from_array(w, "w"), numpy_helper.from_array(np.ones(width, np.float32), "gamma"),
         numpy_helper.from_array(np.zeros(width, np.float32), "beta")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def session(model: onnx.ModelProto, optimized: str | None = None) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    options.log_severity_level = 3
    if optimized:
        options.optimized_model_filepath = optimized
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def outputs(model: onnx.ModelProto, feed: dict) -> np.ndarray:
    reference = onnx.ModelProto()
    reference.CopyFrom(model)
    reference.ir_version = min(reference.ir_version, max_ir_version())
    return session(reference).run(None, feed)[0]


def relative_error(out: np.ndarray, ref: np.ndarray) -> float:
    return float(np.linalg.norm(out - ref) / np.linalg.norm(ref))


def int_weights(model: onnx.ModelProto, data_type: int) -> int:
    return sum(t.data_type == data_type for t in model.graph.initializer)


def ops(model: onnx.ModelProto, op_type: str) -> list[onnx.NodeProto]:
    return [n for n in model.graph.node if n.op_type == op_type]


def attributes(node: onnx.NodeProto) -> dict:
    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


LAYERS_WRITTEN = {
    "ort-int4-rtn": lambda m: len(ops(m, "MatMulNBits")),
    "ort-int4-hqq": lambda m: len(ops(m, "MatMulNBits")),
    "ort-int8-dynamic": lambda m: len(ops(m, "MatMulInteger") + ops(m, "DynamicQuantizeMatMul")),
    "onnxsim-int4": lambda m: int_weights(m, TensorProto.INT4),
    "onnxsim-int8": lambda m: len(ops(m, "MatMulInteger")),
    "onnxsim-int8-weight-only": lambda m: int_weights(m, TensorProto.INT8),
    "onnxsim-fp16": lambda m: int_weights(m, TensorProto.FLOAT16),
    "ort-fp16": lambda m: int_weights(m, TensorProto.FLOAT16),
    "ort-fp16-optimized": lambda m: int_weights(m, TensorProto.FLOAT16),
    "onnxconverter-fp16-mixed": lambda m: int_weights(m, TensorProto.FLOAT16),
}
"""Peer -> how many layers of its output are in the form it is meant to write (the test model has two)."""

QUANTIZERS = [name for name in PRECISION_PEERS if name not in BUILT_PEERS]
"""The peers that quantize the model given; the others build their own graph of a zoo decoder
(tests/test_builder_precision.py)."""


def test_every_peer_is_tested_and_names_a_precision():
    assert set(LAYERS_WRITTEN) == set(QUANTIZERS) and BUILT_PEERS == {"genai-int4"} <= set(PRECISION_PEERS)
    assert set(PRECISION_PEERS.values()) <= {"int4", "int8", "fp16"}


@pytest.mark.parametrize("name", QUANTIZERS)
def test_a_peer_quantizes_both_layers_within_its_precision_error(name, tmp_path):
    model = two_layers()
    before = model.SerializeToString()
    feed = {"x": np.random.default_rng(2).standard_normal((2, 4, WIDTH)).astype(np.float32)}
    ref = outputs(model, feed)

    quantized = run_precision_peer(name, model)

    assert model.SerializeToString() == before  # the input is untouched
    assert quantized.ir_version <= max_ir_version()
    assert LAYERS_WRITTEN[name](quantized) == 2
    # onnxsim's forms keep a MatMul, and so does half precision
    assert not ops(quantized, "MatMul") or name.startswith("onnxsim-") or PRECISION_PEERS[name] == "fp16"
    used = {i for n in quantized.graph.node for i in n.input}
    assert all(t.name in used for t in quantized.graph.initializer)  # the replaced float32 weights are gone
    optimized = str(tmp_path / "optimized.onnx")
    out = session(quantized, optimized).run(None, feed)[0]  # runs in onnxruntime as it comes, on the CPU
    assert out.shape == ref.shape and out.dtype == np.float32
    assert relative_error(out, ref) < MAX_ERROR[PRECISION_PEERS[name]]
    if name.startswith("ort-int4"):
        settings = [attributes(n) for n in ops(quantized, "MatMulNBits")]
        assert all(s["bits"] == 4 and s["block_size"] == 32 for s in settings)
        if name == "ort-int4-rtn":  # the genai builder's CPU settings; onnxruntime writes none for HQQ
            assert all(s["accuracy_level"] == 4 for s in settings)
    if name == "onnxsim-int4":
        # Its standard-ONNX form runs as onnxruntime's own int4 kernel: onnxruntime fuses DequantizeLinear + MatMul
        # into MatMulNBits.  Not the first layer here: onnxruntime leaves a MatMul whose output feeds a Relu unfused
        # (its own QDQ int4 output too; Sigmoid, Tanh or none fuse), so only the second layer shows it.
        assert [n.op_type for n in onnx.load(optimized).graph.node][-1] == "MatMulNBits"


def test_a_path_is_read_with_its_external_data(tmp_path):
    model = two_layers()
    path = tmp_path / "model.onnx"
    onnx.save(two_layers(), str(path), save_as_external_data=True, location="model.onnx.data", size_threshold=0)
    assert (tmp_path / "model.onnx.data").exists()
    feed = {"x": np.random.default_rng(3).standard_normal((1, 4, WIDTH)).astype(np.float32)}
    for name in ("ort-int4-rtn", "ort-int8-dynamic", "onnxsim-int8"):
        quantized = run_precision_peer(name, str(path))
        assert not any(t.data_location == TensorProto.EXTERNAL for t in quantized.graph.initializer)
        assert LAYERS_WRITTEN[name](quantized) == 2
        assert relative_error(session(quantized).run(None, feed)[0], outputs(model, feed)) < 0.2


def test_a_gemm_layer_is_quantized_by_every_peer_but_onnxruntimes_int4():
    """onnxruntime's int4 quantizer handles MatMul only: on a model of Gemm layers it quantizes nothing, and its peers
    say so rather than time the float32 model as theirs."""
    model = gemm_layer()
    feed = {"x": np.random.default_rng(4).standard_normal((8, WIDTH)).astype(np.float32)}
    ref = outputs(model, feed)
    for name in QUANTIZERS:
        precision = PRECISION_PEERS[name]
        if name.startswith("ort-int4"):
            with pytest.raises(NotApplicable, match="quantized no layer"):
                run_precision_peer(name, model)
            continue
        quantized = run_precision_peer(name, model)
        assert LAYERS_WRITTEN[name](quantized) == (2 if precision == "fp16" else 1)  # fp16 converts the bias too
        assert relative_error(session(quantized).run(None, feed)[0], ref) < MAX_ERROR[precision]


@pytest.mark.parametrize("name", list(PRECISION_PEERS))
def test_a_model_without_weights_is_not_applicable(name):
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, WIDTH])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, WIDTH])
    model = helper.make_model(helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "relu", [x], [y]),
                              opset_imports=[helper.make_opsetid("", 17)])
    with pytest.raises(NotApplicable) as caught:
        run_precision_peer(name, model)
    assert "\n" not in str(caught.value)


def test_onnxruntimes_optimizer_fuses_before_its_fp16_conversion():
    """`ort-fp16-optimized` is the transformers optimizer's graph in float16: the residual's Add and LayerNormalization
    are one SkipLayerNormalization, its weights float16, and onnxruntime's CPU provider runs it within fp16's error."""
    model = residual_norm()
    feed = {"x": np.random.default_rng(6).standard_normal((2, 4, WIDTH)).astype(np.float32)}
    fused = run_precision_peer("ort-fp16-optimized", model)
    assert ops(fused, "SkipLayerNormalization") and not ops(fused, "LayerNormalization")
    assert int_weights(fused, TensorProto.FLOAT16) == 3  # the weight, the scale and the bias
    out = session(fused).run(None, feed)[0]
    assert out.dtype == np.float32 and relative_error(out, outputs(model, feed)) < MAX_ERROR["fp16"]
    assert not ops(run_precision_peer("ort-fp16", model), "SkipLayerNormalization")  # the plain converter fuses none


def scaled_layer(width: int = WIDTH) -> onnx.ModelProto:
    """x -> MatMul W -> Mul by 1e5 -> Mul by 1e-5 -> y: a constant beyond float16's range (65504), which a converter
    clamps, undone by the next."""
    rng = np.random.default_rng(7)
    w = (rng.standard_normal((width, width)) / 16).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["h"]), helper.make_node("Mul", ["h", "up"], ["s"]),
         helper.make_node("Mul", ["s", "down"], ["y"])], "scaled",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", 4, width])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["b", 4, width])],
        [numpy_helper.from_array(w, "w"), numpy_helper.from_array(np.array(1e5, np.float32), "up"),
         numpy_helper.from_array(np.array(1e-5, np.float32), "down")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_the_mixed_converter_keeps_float32_what_the_budget_needs_on_the_feed_it_is_given():
    """onnxconverter-fp16-mixed bisects for the nodes whose float16 form breaks rlflow's budget on the given feed: the
    Mul by an out-of-range constant stays float32 and the MatMul's weight goes float16, within the budget; a budget
    nothing in float16 meets leaves it nothing it can write."""
    model = scaled_layer()
    feed = {"x": np.random.default_rng(8).standard_normal((2, 4, WIDTH)).astype(np.float32)}
    mixed = run_precision_peer("onnxconverter-fp16-mixed", model, feed, max_error=0.01)
    types = {t.name: t.data_type for t in mixed.graph.initializer}
    assert types["w"] == TensorProto.FLOAT16 and types["up"] == TensorProto.FLOAT
    assert relative_error(session(mixed).run(None, feed)[0], outputs(model, feed)) < 0.01
    with pytest.raises(NotApplicable, match="onnxconverter-fp16-mixed failed"):
        run_precision_peer("onnxconverter-fp16-mixed", two_layers(), feed, max_error=1e-7)


def test_the_mixed_converter_on_a_graph_output_another_node_reads_is_not_applicable_and_says_why():
    """onnxconverter-common's converter (1.16) mistypes a graph output that another node also reads when it keeps the
    float32 interface (a BERT's last_hidden_state that its pooler reads); onnxruntime's converter handles it."""
    model = two_layers()
    model.graph.output.append(helper.make_tensor_value_info("h", TensorProto.FLOAT, ["b", 4, WIDTH]))
    with pytest.raises(NotApplicable, match="mistypes graph output h, which another node reads"):
        run_precision_peer("onnxconverter-fp16-mixed", model)
    feed = {"x": np.random.default_rng(9).standard_normal((1, 4, WIDTH)).astype(np.float32)}
    assert [o.dtype for o in session(run_precision_peer("ort-fp16", model)).run(None, feed)] == [np.float32] * 2


def test_a_peer_model_onnxruntime_cannot_run_is_its_rows_reason_not_the_benchs_end(tmp_path, monkeypatch):
    """A peer's model that onnxruntime refuses (as onnxsim's fp16 pass writes on a Llama-style decoder: a rotary Mul
    of a float32 and a float16 operand, here a MatMul's) is that peer's row in `bench-precision`, which says why and
    measures the rest."""
    import rlflow.bench.precision_peers as peers
    from rlflow.bench.precision import PrecisionBench, run

    def mistyped(name, model, feed=None, max_error=None):
        broken = run_precision_peer("ort-fp16", model)
        broken.graph.node[0].input[0] = "x"  # a float32 input into a float16 MatMul
        return broken

    model = two_layers()
    model.ir_version = max_ir_version()
    onnx.save(model, str(tmp_path / "two.onnx"))
    monkeypatch.setattr(peers, "run_precision_peer", mistyped)
    config = PrecisionBench("fp16", peers=("ort-fp16",), rounds=3, method="greedy", time_limit=1)
    rows = {r["method"]: r for r in run([tmp_path / "two.onnx"], config, tmp_path / "out")["rows"]}
    assert rows["ort-fp16"]["status"] == "not applicable"
    assert rows["ort-fp16"]["reason"].startswith("ort-fp16 wrote a model that does not run: ")
    assert rows["rlflow"]["status"] == rows["rlflow-exact"]["status"] == "ok"


def test_an_unknown_peer_is_refused():
    with pytest.raises(KeyError):
        run_precision_peer("not-a-peer", two_layers())
