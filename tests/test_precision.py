"""`rlflow optimize --precision`: the precision rules within their tolerances, the error budget's gate, the --data
checks, a quantized input, and the defaults staying exact."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from rlflow.cli import main
from rlflow.graph.core import Graph
from rlflow.measure.accuracy import ErrorReport, Evaluator, load_data, random_samples
from rlflow.measure.session import SessionSettings
from rlflow.measure.verify import OutputCheck, verify
from rlflow.optimize.options import Options, rules_for
from rlflow.optimize.pipeline import optimize
from rlflow.optimize.report import format_report
from rlflow.rewrites import PRECISION_RULES, RULES, Match, apply, apply_all, find_matches
from tests.conftest import save, tiny_model

INTEGER_RULES = [r for r in PRECISION_RULES if r.precision in ("int4", "int8")]
"""The rules that store a product's weight in fewer bits (the half rules have tests/test_half_precision.py)."""


def _linear(op: str, k: int = 256, n: int = 192, seed: int = 0, batch="b") -> onnx.ModelProto:
    """x [b, 8, k] @ W (+ bias as a Gemm over [b*8, k]) with standard-normal W."""
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((k, n)).astype(np.float32)
    if op == "MatMul":
        nodes = [helper.make_node("MatMul", ["x", "W"], ["y"], name="mm")]
        shapes = ([batch, 8, k], [batch, 8, n])
        inits = [numpy_helper.from_array(w, "W")]
    elif op in ("MatMul-Transpose", "FusedMatMul"):  # the dynamo exporter's language-model head; tied-head-fusion's
        transposed = numpy_helper.from_array(np.ascontiguousarray(w.T), "Wt")
        nodes = ([helper.make_node("Transpose", ["Wt"], ["W"], perm=[1, 0]),
                  helper.make_node("MatMul", ["x", "W"], ["y"], name="mm")] if op == "MatMul-Transpose" else
                 [helper.make_node("FusedMatMul", ["x", "Wt"], ["y"], name="mm", domain="com.microsoft", transB=1)])
        shapes = ([batch, 8, k], [batch, 8, n])
        inits = [transposed]
    else:
        nodes = [helper.make_node("Gemm", ["x", "Wt", "bias"], ["y"], name="mm", transB=1)]
        shapes = ([batch, k], [batch, n])
        inits = [numpy_helper.from_array(np.ascontiguousarray(w.T), "Wt"),
                 numpy_helper.from_array(rng.standard_normal(n).astype(np.float32), "bias")]
    model = tiny_model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, shapes[0])],
                       [helper.make_tensor_value_info("y", TensorProto.FLOAT, shapes[1])], inits)
    if op == "FusedMatMul":
        model.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    return model


def _run(model: onnx.ModelProto, x: np.ndarray) -> np.ndarray:
    model.ir_version = min(model.ir_version, 10)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, {"x": x})[0]


@pytest.mark.parametrize("op", ["MatMul", "Gemm", "MatMul-Transpose", "FusedMatMul"])
@pytest.mark.parametrize("rule", INTEGER_RULES, ids=lambda r: r.name)
def test_precision_rule_within_its_tolerance(rule, op):
    model = _linear(op)
    shape = (4, 256) if op == "Gemm" else (2, 8, 256)
    graph = Graph.from_model(model, {"x": shape})
    (match,) = find_matches(graph, [rule])
    rewritten = apply(graph, match, [rule]).to_model(static=False)
    assert [n.op_type for n in rewritten.graph.node] == [rule.replacement(np.zeros((256, 192), np.float32)).op]
    for rows in (shape, (3, *shape[1:])):  # the batch changed: nothing baked
        x = np.random.default_rng(1).standard_normal(rows).astype(np.float32)
        ref, out = _run(model, x), _run(rewritten, x)
        error = np.linalg.norm(out - ref) / np.linalg.norm(ref)
        assert 0 < error <= rule.tolerance, (rule.name, error)


def test_precision_rule_refusals():
    small = _linear("MatMul", k=16, n=16)
    rule = PRECISION_RULES[0]
    (reason,) = rule.reasons(Graph.from_model(small, {"x": (1, 8, 16)}))
    assert "fewer than" in reason.reason
    scaled = _linear("Gemm")
    scaled.graph.node[0].attribute.append(helper.make_attribute("alpha", 0.5))
    (reason,) = rule.reasons(Graph.from_model(scaled, {"x": (4, 256)}))
    assert "scales or transposes" in reason.reason
    permuted = _linear("MatMul-Transpose")
    permuted.graph.node[0].attribute[0].ints[:] = [0, 1]  # a Transpose that moves nothing is not the head's
    (reason,) = rule.reasons(Graph.from_model(permuted, {"x": (2, 8, 256)}))
    assert "nor one's Transpose" in reason.reason


def test_defaults_stay_exact():
    assert Options().precision is None
    names = {r.name for r in PRECISION_RULES}
    assert not names & {r.name for r in RULES}
    assert not names & {r.name for r in rules_for(RULES, "all", "CPUExecutionProvider")}


def test_the_exact_search_before_a_precision_step_leaves_weights_where_precision_rules_reach():
    from rlflow.optimize.precision import LOCKS_WEIGHTS, exact_rules

    assert {r.name for r in RULES} - {r.name for r in exact_rules(RULES, "int8")} == LOCKS_WEIGHTS
    assert exact_rules(RULES, None) == list(RULES)


def test_precision_registry_append_only():
    """Appending is fine; these names keep their positions (a precision agent's action ids)."""
    recorded = ["matmul-int4-block32", "matmul-int4-block128", "matmul-int8-block32", "matmul-dynamic-int8",
                "node-fp16", "node-bf16"]
    assert [r.name for r in PRECISION_RULES][:len(recorded)] == recorded
    assert all(r.group == "precision" and r.precision in ("int4", "int8", "fp16", "bf16") for r in PRECISION_RULES)


def _two_layer(tmp_path, k=256) -> str:
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.standard_normal((k, k)).astype(np.float32) / 16, f"W{i}") for i in (1, 2)]
    nodes = [helper.make_node("MatMul", ["x", "W1"], ["h"], name="first"), helper.make_node("Relu", ["h"], ["r"]),
             helper.make_node("MatMul", ["r", "W2"], ["y"], name="second")]
    model = tiny_model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", 1, k])],
                       [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["b", 1, k])], inits)
    return save(model, tmp_path / "two.onnx")


@pytest.fixture
def every_form_faster(monkeypatch):
    """Each layer's forms saving time alone, whatever this machine's clock says: the tests below are about error."""
    import rlflow.search.precision as search

    monkeypatch.setattr(search, "_gain_ms", lambda rows, weight, new, settings, copies: 1.0)


def test_gate_refuses_an_output_over_budget(tmp_path, every_form_faster):
    result = optimize(_two_layer(tmp_path), method="greedy", time_limit=2, precision="int4", max_error=1e-7,
                      rounds=6)
    assert not result.rewritten
    assert "error budget" in result.reason and "least error reached" in result.reason
    assert result.precision["least_error"] > 1e-7
    report = format_report(result)
    assert "precision   int4 within max error 1e-07 (given), measured on random inputs (4 samples)" in report
    assert "the error is measured on random inputs, not on data" in report


def test_within_budget_is_verified_on_the_data(tmp_path, every_form_faster):
    path = _two_layer(tmp_path)
    data = tmp_path / "data.npz"
    np.savez(data, x=np.random.default_rng(3).standard_normal((5, 1, 256)).astype(np.float32))
    result = optimize(path, method="greedy", time_limit=2, precision="int8", data=str(data), rounds=6)
    p = result.precision
    assert p["samples"].endswith("(5 samples)") and not p["random_inputs"] and p["max_error_source"] == "default"
    assert p["layers"] and "float32" not in p["layers"], p["layers"]  # both layers within int8's default budget
    assert p["error"]["max_error"] <= p["max_error"]
    assert result.verification is not None and result.verification.ok and "samples" in result.verification.extra
    assert p["weight_bytes"]["after"] < p["weight_bytes"]["before"]


@pytest.mark.parametrize("case, message", [
    ("missing", "lacks the model's input(s) x"),
    ("extra", "has array(s) z the model does not take"),
    ("dtype", "'x' is float64, the model takes float32"),
    ("rank", "has shape [5]"),
    ("fixed", "at axis 1 of a sample, the model fixes 1"),
    ("counts", "different numbers of samples"),
    ("unreadable", "cannot read it as an .npz file"),
])
def test_data_mistakes_one_line_exit_2(case, message, tmp_path, capsys):
    path = _two_layer(tmp_path)
    data = tmp_path / "data.npz"
    good = np.zeros((5, 1, 256), np.float32)
    arrays = {"missing": {"y": good}, "extra": {"x": good, "z": good}, "dtype": {"x": good.astype(np.float64)},
              "rank": {"x": np.zeros(5, np.float32)}, "fixed": {"x": np.zeros((5, 2, 256), np.float32)},
              "counts": None, "unreadable": None}[case]
    if case == "unreadable":
        data.write_text("not an npz")
    elif case == "counts":  # a model of two inputs whose arrays disagree
        model = tiny_model([helper.make_node("Add", ["x", "x2"], ["y"])],
                           [helper.make_tensor_value_info(n, TensorProto.FLOAT, ["b", 4]) for n in ("x", "x2")],
                           [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["b", 4])])
        path = save(model, tmp_path / "add.onnx")
        np.savez(data, x=np.zeros((3, 4), np.float32), x2=np.zeros((2, 4), np.float32))
    else:
        np.savez(data, **arrays)
    code = main(["optimize", path, "-o", str(tmp_path / "out.onnx"), "--precision", "int8", "--data", str(data),
                 "--method", "greedy"])
    assert code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err, err
    assert not (tmp_path / "out.onnx").exists()


@pytest.mark.parametrize("args, message", [
    (["--precision", "fp8"], "unknown precision"),
    (["--precision", "int3"], "unknown precision"),
    (["--precision", "int4", "--max-error", "0"], "above 0"),
    (["--max-error", "0.1"], "give --precision too"),
    (["--precision", "int4", "--ops", "standard"], "--ops standard"),
])
def test_precision_option_mistakes_one_line_exit_2(args, message, tmp_path, capsys):
    path = _two_layer(tmp_path)
    assert main(["optimize", path, "-o", str(tmp_path / "out.onnx"), *args]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err, err


def test_quantized_input_is_accepted(tmp_path):
    """A graph already quantized by onnxruntime: its low-precision operators are named and left alone."""
    from onnxruntime.quantization import quantize_dynamic

    source = _two_layer(tmp_path)
    quantized = tmp_path / "dyn.onnx"
    quantize_dynamic(source, str(quantized), nodes_to_exclude=["second"])
    assert [n.op_type for n in onnx.load(str(quantized)).graph.node].count("MatMul") == 1
    result = optimize(str(quantized), method="greedy", time_limit=2, precision="int8", rounds=6)
    assert result.precision["already"], result.precision
    assert [layer["node"] for layer in result.precision["per_layer"]] == ["second"]  # the rest is already int8
    assert result.output_model is not None


def test_logit_metrics_on_a_language_model_output():
    """Agreement, KL and the next-token loss of both models, on logits shaped [batch, sequence, vocabulary]."""
    vocab, seq = 8, 5
    rng = np.random.default_rng(0)
    table = rng.standard_normal((vocab, vocab)).astype(np.float32)
    def lm(scale):
        return tiny_model([helper.make_node("Gather", ["T", "input_ids"], ["g"]),
                           helper.make_node("Mul", ["g", "s"], ["logits"])],
                          [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["b", "s"])],
                          [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["b", "s", vocab])],
                          [numpy_helper.from_array(table, "T"),
                           numpy_helper.from_array(np.array(scale, np.float32), "s")])
    samples = random_samples(lm(1.0), {"input_ids": (1, seq)}, seed=0)
    evaluator = Evaluator(lm(1.0), samples, SessionSettings(), budget=0.5)
    same = evaluator.error(lm(1.0))
    assert same.max_error == 0 and same.logits["agreement"] == 1 and abs(same.logits["kl"]) < 1e-9
    assert same.logits["loss_reference"] == same.logits["loss_candidate"]
    flat = evaluator.error(lm(0.0))  # uniform: the loss is ln(vocab)
    assert flat.logits["loss_candidate"] == pytest.approx(np.log(vocab))
    assert flat.max_error == pytest.approx(1.0) and not flat.checks[0].ok


def test_data_samples_of_the_input_rank_feed_one_at_a_time(tmp_path):
    model = onnx.load(_two_layer(tmp_path))
    path = tmp_path / "d.npz"
    np.savez(path, x=np.zeros((3, 1, 256), np.float32))
    assert [f["x"].shape for f in load_data(path, model).feeds] == [(1, 1, 256)] * 3
    np.savez(path, x=np.zeros((2, 4, 1, 256), np.float32))
    assert [f["x"].shape for f in load_data(path, model).feeds] == [(4, 1, 256)] * 2


def test_precision_rules_fire_on_a_real_export(transformer_path):
    """Every precision rule onnxruntime's CPU provider runs (not bf16) on a PyTorch export, everywhere at once: it runs,
    and errs as it should."""
    model = onnx.load(transformer_path)
    graph = Graph.from_model(model, {"x": (2, 16, 32)})
    for rule in [r for r in PRECISION_RULES if r.precision != "bf16"]:
        matches = find_matches(graph, [rule])
        assert matches, [r.reason for r in rule.reasons(graph)]
        lowered, applied = apply_all(graph, matches, [rule])
        assert len(applied) == len(matches)
        check = verify(model, lowered.to_model(static=False), tolerance=1.0)
        assert check.ok and 0 < check.max_rel_norm < 0.5, (rule.name, check.max_rel_norm)


def test_bench_precision_writes_rows_beside_the_peers(tmp_path):
    """rlflow's row and a peer's, each with its speed and its error on the same samples, into both files."""
    from rlflow.bench.precision import PrecisionBench, run

    path = Path(_two_layer(tmp_path))
    np.savez(tmp_path / "two.heldout.npz", x=np.random.default_rng(0).standard_normal((3, 1, 256)).astype(np.float32))
    config = PrecisionBench("int8", peers=("ort-int8-dynamic",), rounds=3, method="greedy", time_limit=1)
    results = run([path], config, tmp_path / "out")
    rows = {r["method"]: r for r in results["rows"]}
    assert set(rows) == {"rlflow-exact", "rlflow", "ort-int8-dynamic"}
    assert all(r["status"] == "ok" for r in rows.values())
    assert all(r["samples"].endswith("two.heldout.npz (3 samples)") for r in rows.values())
    assert rows["ort-int8-dynamic"]["max_error"] > 0 and rows["ort-int8-dynamic"]["speedup"]["median"] > 0
    assert all(r["memory_fraction"] > 0 for r in rows.values())
    assert rows["ort-int8-dynamic"]["bytes_read"] < rows["rlflow-exact"]["bytes_read"]  # int8: a quarter the bytes
    assert "| two | ort-int8-dynamic |" in (tmp_path / "out" / "results.md").read_text()
    assert (tmp_path / "out" / "results.json").exists()


def test_bench_weight_bytes_read_a_large_models_weights_from_their_shapes():
    """A large model's weights lie in a file aside, at an absolute path onnx's own reader refuses: counted unread."""
    from rlflow.bench.precision import _weight_bytes

    tensor = TensorProto(name="W", data_type=TensorProto.FLOAT, dims=[1024, 64])
    tensor.data_location = TensorProto.EXTERNAL
    tensor.external_data.add(key="location", value="/tmp/elsewhere/weights.data")
    packed = helper.make_tensor("Q", TensorProto.UINT8, [64, 32, 16], vals=np.zeros(64 * 32 * 16, np.uint8).tobytes(),
                                raw=True)
    model = tiny_model([], [], [], [tensor, packed])
    assert _weight_bytes(model) == 1024 * 64 * 4 + 64 * 32 * 16


def test_a_lowered_model_onnxruntime_cannot_run_is_refused_not_raised(tmp_path, monkeypatch, every_form_faster):
    from rlflow.errors import ProviderError

    def cannot_run(self, candidate):
        raise ProviderError("onnxruntime (CPUExecutionProvider) cannot run the model: no kernel")

    monkeypatch.setattr(Evaluator, "error", cannot_run)
    result = optimize(_two_layer(tmp_path), method="greedy", time_limit=1, precision="int8", rounds=6)
    assert not result.rewritten and "least error reached inf" in result.reason
    assert result.precision["evaluations"]
    assert all(e["max_error"] == float("inf") for e in result.precision["evaluations"])


def test_a_layer_is_timed_among_a_models_worth_of_copies():
    """Each copy its own weights, on the same activation: the copies stream from memory as the model's layers do."""
    from rlflow.search.precision import _product_model

    weight = np.random.default_rng(0).standard_normal((64, 32)).astype(np.float32)
    model = _product_model(64, 32, "MatMul", {}, [weight], copies=3)
    a = np.ones((2, 64), np.float32)
    outs = _run_named(model, {"a": a})
    assert len(outs) == 3 and all(np.allclose(o, a @ weight, rtol=1e-5) for o in outs)
    assert len({t.name for t in model.graph.initializer}) == 3


def _run_named(model: onnx.ModelProto, feeds: dict) -> list[np.ndarray]:
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)


def test_a_model_without_a_layer_to_lower_says_so(tmp_path):
    model = tiny_model([helper.make_node("Relu", ["x"], ["y"])],
                       [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 64])],
                       [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 64])])
    result = optimize(save(model, tmp_path / "relu.onnx"), method="greedy", time_limit=1, precision="int4", rounds=6)
    assert not result.rewritten and "no layer the precision rules take" in result.reason


def test_bytes_read_at_the_measured_shapes_counts_int4_as_half_a_byte():
    """The dynamic batch set to the measured one while counting, and put back after."""
    from rlflow.bench.precision import bytes_read

    model = _linear("MatMul", k=256, n=192)
    lowered = apply(Graph.from_model(model, {"x": (2, 8, 256)}),
                    find_matches(Graph.from_model(model, {"x": (2, 8, 256)}), [PRECISION_RULES[0]])[0],
                    [PRECISION_RULES[0]]).to_model(static=False)
    at_two = bytes_read(lowered, {"x": (2, 8, 256)})
    assert at_two - bytes_read(lowered, {"x": (1, 8, 256)}) == 8 * 256 * 4  # one more sample of x
    packed = 256 * 192 // 2 + 192 * (256 // 32) * 4  # int4 values and a float32 scale per block of 32
    assert at_two == packed + 2 * 8 * 256 * 4
    assert lowered.graph.input[0].type.tensor_type.shape.dim[0].dim_param == "b"


def test_dynamic_int8_quantizes_a_weight_once():
    """Its per-column quantizer is slow, and the search applies a layer's choice at every evaluation: a weight seen
    again, even as another array, gets the same constants back, read-only since graphs share them."""
    rule = next(r for r in PRECISION_RULES if r.name == "matmul-dynamic-int8")
    weight = np.random.default_rng(5).standard_normal((128, 64)).astype(np.float32)
    first, again = rule.replacement(weight), rule.replacement(weight.copy())
    assert again is first and not first.constants[0].flags.writeable
    assert rule.replacement(weight * 2) is not first


def test_bench_precision_at_the_peers_error_gives_rlflow_the_least_error_a_peer_reached(tmp_path, every_form_faster):
    from rlflow.bench.precision import PrecisionBench, run

    path = Path(_two_layer(tmp_path))
    config = PrecisionBench("int8", peers=("ort-int8-dynamic",), rounds=3, method="greedy", time_limit=1,
                            at_peers_error=True)
    rows = {r["method"]: r for r in run([path], config, tmp_path / "out")["rows"]}
    peer = rows["ort-int8-dynamic"]["max_error"]
    assert rows["rlflow"]["max_error_given"] == pytest.approx(peer)
    assert rows["rlflow"]["max_error"] <= peer
    assert main(["bench-precision", str(path), "--at-peers-error", "--max-error", "0.1", "--out",
                 str(tmp_path / "x")]) == 2


def test_a_layer_that_pays_most_goes_first_where_the_threshold_would_move_all_alike():
    """Four layers whose int4 errs alike (0.1 each, the model's error their sum): the threshold can take all or none,
    and all (0.4) is over the budget 0.25; the second bisection takes the two that save most time, largest first."""
    from rlflow.search.precision import Layer, choose

    class Summing:  # the model's error: the sum of its layers' local errors
        evaluations: list = []

        def evaluate(self, chosen, label):
            error = sum(m.param("error") for m in chosen)
            return None, list(chosen), ErrorReport([OutputCheck("y", 0, 0, error, 1, True)], "test")

    gains = [1.0, 8.0, 2.0, 5.0]
    layers = [Layer(f"l{i}", (1, 64, 64), 4096, {"int4": {"match": Match("int4", (f"l{i}",), (("error", 0.1),)),
                                                          "error": 0.1, "gain_ms": g, "bytes": 1, "faster": True}})
              for i, g in enumerate(gains)]
    found = choose(None, layers, Summing(), budget=0.25, start=0.0)
    assert [layer.chosen for layer in layers] == [None, "int4", None, "int4"]
    assert found.error.max_error == pytest.approx(0.2)


def test_a_layer_is_timed_with_its_weights_pre_packed_whatever_the_models_sessions_do(monkeypatch):
    """A large model's sessions share weights in place, without pre-packing; MatMulNBits's fast CPU path needs its
    packed weight, so a layer timed so looks no faster in int4 than in float32."""
    import rlflow.search.precision as search
    from rlflow.rewrites import rule

    made = []
    real = search.create_session
    monkeypatch.setattr(search, "create_session", lambda model, settings: made.append(settings) or real(model, settings))
    weight = np.random.default_rng(0).standard_normal((64, 32)).astype(np.float32)
    search._gain_ms(1, weight, rule("matmul-int8-block32").replacement(weight),
                    SessionSettings(threads=1, share_weights=True), copies=2)
    assert made and not any(s.share_weights for s in made)


def test_the_gate_pre_packs_an_output_that_holds_matmulnbits(tmp_path):
    """Shared in place, a large model's sessions skip pre-packing, and MatMulNBits then runs its slow path: the gate
    times an int4 output as a deployed session runs it."""
    from rlflow.optimize.pipeline import _gate_settings

    graph = Graph.from_model(_linear("MatMul"), {"x": (2, 8, 256)})
    (match,) = find_matches(graph, [PRECISION_RULES[0]])
    lowered = apply(graph, match, [PRECISION_RULES[0]])
    shared = SessionSettings(threads=1, share_weights=True)
    assert not _gate_settings(shared, lowered).share_weights
    assert _gate_settings(shared, graph).share_weights  # float32 weights: as the search measured them
