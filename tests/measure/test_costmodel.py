"""The cost model: structural facts only (machines are shared and noisy), on small onnx.helper graphs."""
from __future__ import annotations

import json
import math

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from rlflow.graph.core import Graph
from rlflow.measure.costmodel.model import CostModel
from rlflow.measure.ranks import rankdata, spearman
from rlflow.measure.session import SessionSettings


def _model(nodes, inputs, outputs, initializers=()) -> onnx.ModelProto:
    graph = helper.make_graph(list(nodes), "t", list(inputs), list(outputs), initializer=list(initializers))
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def _weight(name, *shape, seed=0):
    return numpy_helper.from_array(np.random.default_rng(seed).standard_normal(shape).astype(np.float32), name)


def _matmuls(count: int) -> Graph:
    """`count` chained MatMuls with identical configurations: x[32,128] @ W[128,128] ..."""
    nodes, weights, current = [], [], "x"
    for i in range(count):
        weights.append(_weight(f"W{i}", 128, 128, seed=i))
        nodes.append(helper.make_node("MatMul", [current, f"W{i}"], [f"h{i}"], name=f"mm{i}"))
        current = f"h{i}"
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [32, 128])
    y = helper.make_tensor_value_info(current, TensorProto.FLOAT, [32, 128])
    return Graph.from_model(_model(nodes, [x], [y], weights))


def _conv_bn_relu() -> Graph:
    """Conv -> BatchNormalization -> Relu, plus a Transpose of a constant (folded by onnxruntime) feeding an Add."""
    c = 8
    inits = [_weight("w", c, 3, 3, 3), _weight("scale", c, seed=1), _weight("bias", c, seed=2),
             _weight("mean", c, seed=3), numpy_helper.from_array(np.ones(c, np.float32), "var"),
             _weight("k", 16, 16, c, 1, seed=4)]
    nodes = [
        helper.make_node("Conv", ["x", "w"], ["c"], name="conv", pads=[1, 1, 1, 1]),
        helper.make_node("BatchNormalization", ["c", "scale", "bias", "mean", "var"], ["b"], name="bn"),
        helper.make_node("Relu", ["b"], ["r"], name="relu"),
        helper.make_node("Transpose", ["k"], ["kt"], name="const_t", perm=[2, 3, 0, 1]),
        helper.make_node("Add", ["r", "kt"], ["y"], name="add"),
    ]
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 16, 16])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, c, 16, 16])
    return Graph.from_model(_model(nodes, [x], [y], inits))


def test_two_identical_matmuls_cost_twice_one(tmp_path):
    model = CostModel(cache_dir=tmp_path)
    one, two = model.graph_cost(_matmuls(1)), model.graph_cost(_matmuls(2))
    assert one > 0 and math.isfinite(one)
    assert two == pytest.approx(2 * one, rel=1e-9)  # the same configuration, measured once
    assert model.stats.measured == 1


def test_graph_costs_price_what_sets_graphs_apart_first(tmp_path):
    """Under a deadline a cold table measures the groups the graphs do not share before those they do (which cancel in
    a ranking); the costs are `graph_cost`'s."""
    model = CostModel(cache_dir=tmp_path)
    graphs = [_matmuls(2), _conv_bn_relu()]
    passes = []
    costs = model._costs
    model._costs = lambda graph, groups: passes.append([g.key for g in groups]) or costs(graph, groups)
    apart = model.graph_costs(graphs)
    assert apart == [model.graph_cost(g) for g in graphs]
    shared = set(passes[0]) & set(passes[1])
    assert passes[0] and passes[1] and not shared  # the first pass of each graph: its own groups only
    before = len(passes)
    same = model.graph_costs([_matmuls(2), _matmuls(3)])  # one configuration in both: nothing apart to price first
    assert passes[before:before + 2] == [[], []]
    assert same == [model.graph_cost(_matmuls(2)), model.graph_cost(_matmuls(3))]


def test_cache_hit_then_persisted_and_reloaded(tmp_path):
    graph = _matmuls(2)
    model = CostModel(cache_dir=tmp_path)
    first = model.graph_cost(graph)
    misses, measured = model.stats.misses, model.stats.measured
    assert misses >= 1 and measured >= 1
    assert model.graph_cost(graph) == first
    assert (model.stats.misses, model.stats.measured) == (misses, measured)
    assert model.stats.hits >= 2

    model.save()
    data = json.loads(model.path.read_text())
    assert data["key"]["provider"] == "CPUExecutionProvider" and data["key"]["threads"] == 1
    assert data["key"]["machine"] and data["key"]["onnxruntime"]
    again = CostModel(cache_dir=tmp_path)
    assert again.path == model.path
    assert again.graph_cost(graph) == first
    assert again.stats.misses == 0 and again.stats.measured == 0


def test_other_settings_do_not_share_entries(tmp_path):
    graph = _matmuls(1)
    model = CostModel(cache_dir=tmp_path)
    model.graph_cost(graph)
    model.save()
    other = CostModel(SessionSettings(threads=2), cache_dir=tmp_path)
    assert other.path != model.path
    assert len(other) == 0
    other.graph_cost(graph)
    assert other.stats.misses >= 1 and other.stats.hits == 0


def test_fused_and_folded_nodes_cost_zero(tmp_path):
    graph = _conv_bn_relu()
    model = CostModel(cache_dir=tmp_path)
    costs = model.node_costs(graph)
    assert set(costs) == {n.name for n in graph.gs.nodes}
    assert costs["conv"] > 0
    assert costs["bn"] == 0 and costs["relu"] == 0  # onnxruntime fuses them into the convolution
    assert costs["const_t"] == 0  # constant-folded
    assert costs["add"] == 0  # a single-consumer elementwise epilogue of the same group
    assert model.graph_cost(graph) == pytest.approx(sum(costs.values()))
    assert all(math.isfinite(c) and c >= 0 for c in costs.values())


def test_equivalent_fusions_share_one_measurement(tmp_path):
    """Conv+BN and the Conv with BN folded in become the same onnxruntime kernel: one measurement, equal costs."""
    from rlflow.rewrites import apply, find_matches

    graph = _conv_bn_relu()
    folded = [m for m in find_matches(graph) if m.rule == "conv-bn-fold"]
    if not folded:
        pytest.skip("no conv-bn-fold rule in this registry")
    other = apply(graph, folded[0])
    model = CostModel(cache_dir=tmp_path)
    assert model.graph_cost(other) == model.graph_cost(graph)
    assert model.stats.canonical_hits >= 1


def test_costs_positive_and_finite_on_a_transformer(tmp_path, transformer_path):
    import rlflow

    graph = rlflow.load(transformer_path)
    model = CostModel(cache_dir=tmp_path)
    cost = model.graph_cost(graph)
    assert cost > 0 and math.isfinite(cost)
    costs = model.node_costs(graph)
    assert sum(1 for c in costs.values() if c > 0) < len(costs)  # some nodes are fused or folded


def test_rankdata_and_spearman_with_ties():
    assert rankdata(np.array([10.0, 20.0, 20.0, 30.0])).tolist() == [1.0, 2.5, 2.5, 4.0]
    assert spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    x, y = [1, 2, 2, 3], [1, 3, 2, 4]
    rx, ry = rankdata(np.array(x)), rankdata(np.array(y))
    assert spearman(x, y) == pytest.approx(np.corrcoef(rx, ry)[0, 1])
    assert math.isnan(spearman([1, 1, 1], [1, 2, 3]))


def test_check_command_writes_json_and_markdown(tmp_path):
    from rlflow.cli import main
    path = tmp_path / "cnn.onnx"
    graph = _conv_bn_relu()
    graph.save(path)
    out = tmp_path / "results" / "costmodel.json"
    code = main(["costmodel", "check", str(path), "--out", str(out), "--sequences", "2", "--length", "2", "--rounds",
                 "3", "--cache-dir", str(tmp_path / "cache")])
    assert code == 0
    report = json.loads(out.read_text())
    result = report["models"]["cnn"]
    assert result["graphs"] >= 1 and result["graphs_detail"][0]["sequence"] == []
    assert "| cnn |" in out.with_suffix(".md").read_text()


def test_significant_pairs():
    from rlflow.measure.costmodel.check import significant_pairs

    ratios = [(1.0, 1.0, 1.0), (1.2, 1.1, 1.3), (0.99, 0.95, 1.02)]
    pairs, agree = significant_pairs([10.0, 8.0, 10.5], ratios)
    assert pairs == 2 and agree == 1.0  # graph 1 is faster than 0 and 2; graph 0 vs 2 cannot be told apart
    assert significant_pairs([10.0, 12.0, 10.5], ratios) == (2, 0.0)


class _ScriptedRunner:
    """Stands in for `rlflow.measure.timing.Runner`: each copy of a group takes 10 us a run beyond the overhead probe's
    50 us, but the first `busy` timings (of any model) run 1.8x slower: another process held the core while the
    first group was measured."""

    busy = 60  # timings left in the slow stretch (one group's measurement takes about 100)
    largest = 0  # most copies of a group one model held

    def __init__(self, model, settings, feeds):
        copies = 0 if model.graph.name == "probe" else len(model.graph.node)
        _ScriptedRunner.largest = max(_ScriptedRunner.largest, copies)
        self.seconds = 50e-6 + 10e-6 * copies

    def run(self) -> None:
        pass

    def time(self, runs: int) -> float:
        _ScriptedRunner.busy -= 1
        return self.seconds * (1.8 if _ScriptedRunner.busy >= 0 else 1.0)


class _SlowSessionRunner(_ScriptedRunner):
    """The first session built to time a group stays 30 us a copy slower for as long as it lives (as one Reshape's
    session did: 32.6 us against 0.8-1.7 us when timed again)."""

    built = 0

    def __init__(self, model, settings, feeds):
        super().__init__(model, settings, feeds)
        copies = len(model.graph.node)
        if model.graph.name != "probe" and copies > 1:  # not the one-copy session that counts the copies
            _SlowSessionRunner.built += 1
            if _SlowSessionRunner.built == 1:
                self.seconds += 30e-6 * copies

    def time(self, runs: int) -> float:
        return self.seconds


def test_a_session_that_stays_slow_does_not_set_the_entry(tmp_path, monkeypatch):
    import rlflow.measure.costmodel.group_timing as group_timing
    import rlflow.measure.timing as timing

    monkeypatch.setattr(timing, "Runner", _SlowSessionRunner)
    monkeypatch.setattr(group_timing, "CALIBRATION_S", 0.0)
    monkeypatch.setattr(_SlowSessionRunner, "built", 0)
    assert CostModel(cache_dir=tmp_path / "three").graph_cost(_single("Relu", [4, 8])) == pytest.approx(0.010, abs=1e-9)
    # with one session pair (cost table version 2) the slow session was the entry
    monkeypatch.setattr(_SlowSessionRunner, "built", 0)
    monkeypatch.setattr(group_timing, "SESSION_PAIRS", 1)
    assert CostModel(cache_dir=tmp_path / "one").graph_cost(_single("Relu", [4, 8])) == pytest.approx(0.040, abs=1e-9)


def _single(op: str, shape: list[int]) -> Graph:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, shape)
    return Graph.from_model(_model([helper.make_node(op, ["x"], ["y"], name="n")], [x], [y]))


def test_a_busy_moment_while_timing_the_overhead_biases_no_later_group(tmp_path, monkeypatch):
    """The per-call overhead is timed alongside every group: an overhead timed once during a slow stretch and reused
    would floor every group measured after the stretch.  And the stretch itself (everything 1.8x slower) is scaled
    out by the gauge, calibrated before it began."""
    import rlflow.measure.costmodel.group_timing as group_timing
    import rlflow.measure.timing as timing

    monkeypatch.setattr(timing, "Runner", _ScriptedRunner)
    monkeypatch.setattr(group_timing, "CALIBRATION_S", 0.01)
    monkeypatch.setattr(_ScriptedRunner, "busy", 0)
    model = CostModel(cache_dir=tmp_path)
    assert model.gauge.fastest == pytest.approx(50e-6)
    monkeypatch.setattr(_ScriptedRunner, "busy", 60)
    costs = [model.graph_cost(_single(op, shape)) for op, shape in (("Relu", [4, 8]), ("Sigmoid", [2, 16]),
                                                                     ("Tanh", [8, 8]))]
    assert model.stats.measured == 3
    assert costs == pytest.approx([0.010] * 3, abs=1e-9)


def test_an_entry_keeps_the_scale_it_was_measured_with(tmp_path, monkeypatch):
    """A group timed wholly inside a slow stretch before the gauge ever saw full speed stays at 1.8x its cost when
    faster reference runs come later: costs an environment has cached must not change under it."""
    import rlflow.measure.costmodel.group_timing as group_timing
    import rlflow.measure.timing as timing

    monkeypatch.setattr(timing, "Runner", _ScriptedRunner)
    monkeypatch.setattr(group_timing, "CALIBRATION_S", 0.0)
    monkeypatch.setattr(_ScriptedRunner, "busy", 10**6)
    model = CostModel(cache_dir=tmp_path)
    assert model.graph_cost(_single("Relu", [4, 8])) == pytest.approx(0.018, abs=1e-9)
    monkeypatch.setattr(_ScriptedRunner, "busy", 0)
    assert model.graph_cost(_single("Tanh", [8, 8])) == pytest.approx(0.010, abs=1e-9)
    assert model.gauge.fastest == pytest.approx(50e-6)
    assert model.graph_cost(_single("Relu", [4, 8])) == pytest.approx(0.018, abs=1e-9)


def test_a_small_group_is_timed_as_copies_and_its_time_shared_among_them(tmp_path, monkeypatch):
    """A group of 10 us behind 50 us of call overhead is timed as enough copies to take `REPLICA_TARGET_S`, and each
    copy is charged its own share; a group long enough alone is timed alone."""
    import rlflow.measure.costmodel.group_timing as group_timing
    import rlflow.measure.timing as timing

    monkeypatch.setattr(timing, "Runner", _ScriptedRunner)
    monkeypatch.setattr(group_timing, "CALIBRATION_S", 0.0)
    monkeypatch.setattr(_ScriptedRunner, "busy", 0)
    monkeypatch.setattr(_ScriptedRunner, "largest", 0)
    assert CostModel(cache_dir=tmp_path / "a").graph_cost(_single("Relu", [4, 8])) == pytest.approx(0.010, abs=1e-9)
    assert _ScriptedRunner.largest == math.ceil(group_timing.REPLICA_TARGET_S / 60e-6)
    monkeypatch.setattr(_ScriptedRunner, "largest", 0)
    monkeypatch.setattr(group_timing, "REPLICA_TARGET_S", 50e-6)
    assert CostModel(cache_dir=tmp_path / "b").graph_cost(_single("Relu", [4, 8])) == pytest.approx(0.010, abs=1e-9)
    assert _ScriptedRunner.largest == 1


def test_replicated_copies_share_no_name_and_each_computes_the_group(tmp_path):
    """The copies timed together must be independent (onnxruntime can merge nothing) and each the group itself."""
    import onnxruntime as ort

    from rlflow.measure.costmodel.group_timing import replicated
    from rlflow.measure.costmodel.groups import isolated_model
    from rlflow.measure.inputs import random_inputs

    graph = _conv_bn_relu()
    group = max(CostModel(cache_dir=tmp_path).groups(graph), key=lambda g: len(g.members))
    single = isolated_model(graph, group)
    triple = replicated(single, 3)
    onnx.checker.check_model(triple)
    names = [n for node in triple.graph.node for n in node.output] + [i.name for i in triple.graph.initializer]
    assert len(names) == len(set(names)) == 3 * (len(names) // 3)
    assert len(triple.graph.node) == 3 * len(single.graph.node)
    feeds = random_inputs(single, 0)
    expected = ort.InferenceSession(single.SerializeToString()).run(None, feeds)
    session = ort.InferenceSession(triple.SerializeToString())
    results = session.run(None, {f"{name}__r{copy}": value for name, value in feeds.items() for copy in range(3)})
    assert len(results) == 3 * len(expected)
    for copy in range(3):
        outputs = [r for r, o in zip(results, session.get_outputs()) if o.name.endswith(f"__r{copy}")]
        for got, want in zip(outputs, expected, strict=True):
            np.testing.assert_allclose(got, want, rtol=1e-5)


def test_check_leaves_out_graphs_the_provider_refuses_and_lists_them():
    from rlflow.measure.costmodel.check import runnable

    class Refused:
        """A rewritten graph onnxruntime will not build (as CUDA refused a Conv+Clip fusion on the H100)."""

        def to_model(self, static=True):
            x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])
            return _model([helper.make_node("NoSuchOperator", ["x"], ["y"])], [x],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])])

    good = _matmuls(1)
    kept, refused = runnable([([], good), (["a"], good), (["b"], Refused())], SessionSettings())
    assert [sequence for sequence, _ in kept] == [[], ["a"]]
    assert [r["sequence"] for r in refused] == [["b"]] and "cannot run" in refused[0]["error"]


def test_a_machine_the_project_has_measured_starts_from_its_shipped_table(tmp_path, monkeypatch):
    from rlflow.measure.costmodel import table as costmodel_table

    model = CostModel(cache_dir=tmp_path / "cache")
    shipped = {"key": model.key, "groups": {"g": "o:1"}, "costs": {"o:1": 0.5}, "ops": {"o:1": "Relu"}}
    (tmp_path / "tables").mkdir()
    (tmp_path / "tables" / "this-machine.json").write_text(json.dumps(shipped))
    (tmp_path / "tables" / "other.json").write_text(json.dumps({**shipped, "key": {**model.key, "machine": "x"}}))
    monkeypatch.setattr(costmodel_table, "TABLES", tmp_path / "tables")
    assert len(CostModel(cache_dir=tmp_path / "cache")) == 1
    other = CostModel(SessionSettings(threads=2), cache_dir=tmp_path / "cache")  # another key: starts empty
    assert len(other) == 0


def test_random_sequences_everywhere_apply_a_rule_at_each_of_its_matches():
    """`costmodel_check --everywhere`: a step is one rule at every match, so a sequence's graphs differ by whole-model
    rewrites (what a measurement separates on a transformer)."""
    from pathlib import Path

    import numpy as np

    from rlflow.graph.core import load
    from rlflow.measure.costmodel.check import random_graphs
    from rlflow.rewrites import find_matches

    export = Path(__file__).resolve().parents[1] / "fixtures" / "exports" / "bert-tiny-dynamo.onnx"
    graph = load(export, {"input_ids": (1, 8), "attention_mask": (1, 8)})
    found = random_graphs(graph, sequences=4, length=1, rng=np.random.default_rng(0), everywhere=True)
    assert len(found) > 1 and found[0] == ([], graph)
    matches = find_matches(graph)
    counts = []
    for applied, _ in found[1:]:
        (rule_name,) = {step.split("@")[0] for step in applied}  # one rule per one-step sequence
        counts.append((len(applied), sum(m.rule == rule_name for m in matches)))
    assert all(1 <= done <= there for done, there in counts)  # a match an earlier one used up is skipped
    assert any(done > 1 for done, _ in counts)  # a rule at several places in one step
