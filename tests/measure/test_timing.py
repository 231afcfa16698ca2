"""Timing and interleaved comparison: statistics, settings recorded, self-comparison."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from rlflow.errors import ProviderError
from rlflow.measure import SessionSettings, compare, profile_nodes, time_model
from rlflow.measure import timing as timing_module
from rlflow.measure.bootstrap import bootstrap_ratio
from rlflow.measure.inputs import random_inputs
from rlflow.measure.timing import check_and_time
from tests.conftest import tiny_model


@pytest.fixture(scope="module")
def mlp() -> onnx.ModelProto:
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.standard_normal((256, 256)).astype(np.float32), f"W{i}") for i in range(4)]
    nodes, x = [], "x"
    for i in range(4):
        nodes += [helper.make_node("MatMul", [x, f"W{i}"], [f"h{i}"], name=f"mm{i}"),
                  helper.make_node("Relu", [f"h{i}"], [f"r{i}"], name=f"relu{i}")]
        x = f"r{i}"
    return tiny_model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [16, 256])],
                      [helper.make_tensor_value_info("r3", TensorProto.FLOAT, [16, 256])], inits)


def test_time_model_records_settings(mlp):
    timing = time_model(mlp, SessionSettings(threads=1), warmup=2, repeats=7)
    assert timing.samples == 7 and timing.warmup == 2
    assert timing.settings == {"provider": "CPUExecutionProvider", "threads": 1, "opt_level": "all",
                               "execution_mode": "sequential", "share_weights": False}
    assert 0 < timing.min_ms <= timing.median_ms and timing.iqr_ms >= 0


def test_check_and_time_stops_timing_after_its_seconds_once_it_has_three(mlp, monkeypatch):
    settings = SessionSettings(threads=1)
    assert check_and_time(mlp, settings, repeats=6).samples == 6
    monkeypatch.setattr(timing_module, "CHECK_SECONDS", 0.0)
    timing = check_and_time(mlp, settings, repeats=6, label="input")
    assert timing.samples == 3 and timing.label == "input" and timing.min_ms > 0


def test_check_and_time_refuses_a_model_that_builds_but_cannot_run():
    shape = numpy_helper.from_array(np.array([3, 5], dtype=np.int64), "shape")
    model = tiny_model([helper.make_node("Reshape", ["x", "shape"], ["y"], name="reshape")],
                       [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4])],
                       [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], [shape])
    with pytest.raises(ProviderError, match="cannot run the model"):
        check_and_time(model, SessionSettings(threads=1))


def test_self_comparison_runs_every_round_and_names_the_baseline_one(mlp):
    """A real comparison of a model with itself: every round is timed and the baseline's ratio is exactly 1.  Whether
    its interval holds 1 as often as it should is measured, not asserted: `benchmarks/bench-control/placebo.py`
    (a shared machine's noise made a two-attempt test of it fail)."""
    comparison = compare([mlp, mlp], rounds=30, seed=0)
    ratio = comparison.ratios[1]
    assert comparison.rounds == 30 and comparison.runs_per_round >= 1 and comparison.extra["blocks"] == 5
    assert comparison.ratios[0].median == 1.0 and 0 < ratio.low <= ratio.high and ratio.median > 0


class SessionsThatDiffer:
    """A stand-in for `Runner` without onnxruntime: every session runs at its own speed for its whole life (drawn
    around 1 ms, 1% apart) with 0.2% noise per round, as two sessions of one model do."""

    rng = np.random.default_rng(0)  # one stream for every session: the test sets it

    def __init__(self, model, settings, feeds):
        self.speed = 1e-3 * (1 + 0.01 * self.rng.standard_normal())

    def run(self) -> None:
        pass

    def time(self, runs: int) -> float:
        return self.speed * (1 + 0.002 * self.rng.standard_normal())


def test_a_model_against_itself_is_called_neither_faster_nor_slower_where_only_its_sessions_differ(mlp, monkeypatch):
    """The interval covers how much sessions differ because it resamples blocks of fresh sessions: with several blocks
    the self-comparison holds 1 nearly every time; with one block the same kind of sessions make it claim a difference
    most of the time."""
    monkeypatch.setattr(timing_module, "Runner", SessionsThatDiffer)
    monkeypatch.setattr(SessionsThatDiffer, "rng", np.random.default_rng(0))
    feeds = [random_inputs(mlp)] * 2
    held = [compare([mlp, mlp], rounds=30, seed=seed, feeds=feeds).ratios[1] for seed in range(40)]
    one_block = [compare([mlp, mlp], rounds=30, blocks=1, seed=seed, feeds=feeds).ratios[1] for seed in range(40)]
    assert sum(r.low <= 1.0 <= r.high for r in held) >= 32  # 33-38 of 40 over other draws; 65% if blocks are ignored
    assert sum(r.faster or r.slower for r in one_block) >= 30


def test_compare_needs_two_models(mlp):
    with pytest.raises(ValueError):
        compare([mlp])


def test_bootstrap_ratio_on_known_data():
    rng = np.random.default_rng(0)
    base = 2.0 + 0.01 * rng.standard_normal(40)
    fast = 1.0 + 0.01 * rng.standard_normal(40)
    ratio = bootstrap_ratio(base, fast)
    assert ratio.faster and 1.9 < ratio.low < ratio.median < ratio.high < 2.1
    same = bootstrap_ratio(base, base.copy())
    assert same.low == same.high == same.median == 1.0 and not same.faster and not same.slower


def test_block_bootstrap_covers_session_bias():
    """Per-session offsets (a block's sessions run 2% apart for their whole life) must widen the interval."""
    rng = np.random.default_rng(1)
    offsets = np.repeat([1.02, 1.02, 1.02, 0.99, 1.005], 6)  # no real difference: the sessions alone differ
    base = 1.0 + 0.002 * rng.standard_normal(30)
    other = base / offsets * (1 + 0.002 * rng.standard_normal(30))
    groups = np.repeat(np.arange(5), 6)
    naive = bootstrap_ratio(base, other)
    blocked = bootstrap_ratio(base, other, groups=groups)
    assert naive.faster, "treating rounds as independent claims a false speedup"
    assert not blocked.faster and blocked.low < naive.low


def test_compare_rebuilds_sessions_per_block(mlp):
    comparison = compare([mlp, mlp], rounds=12, blocks=3)
    assert comparison.extra["blocks"] == 3 and comparison.rounds == 12


def test_every_second_block_builds_and_warms_sessions_in_reverse(mlp, monkeypatch):
    """Sessions built and warmed later ran faster: a block that mirrors the order of the one before gives every model
    the same mean place in it, whatever the seed."""
    events = []
    real_init, real_run = timing_module.Runner.__init__, timing_module.Runner.run

    def init(self, model, settings, feeds):  # each copy carries its index as a last byte
        events.append(("build", model[-1]))
        real_init(self, model[:-1], settings, feeds)
        self.index = model[-1]

    monkeypatch.setattr(timing_module.Runner, "__init__", init)
    monkeypatch.setattr(timing_module.Runner, "run", lambda self: events.append(("run", self.index)) or real_run(self))
    copies = [mlp.SerializeToString() + bytes([i]) for i in range(3)]
    for seed in range(4):
        events.clear()
        compare(copies, rounds=4, blocks=4, seed=seed, warmup=1, feeds=[random_inputs(mlp)] * 3)
        starts = [i for i, (kind, _) in enumerate(events) if kind == "build" and (i == 0 or events[i - 1][0] == "run")]
        built = [[index for _, index in events[i:i + 3]] for i in starts]
        warmed = [[index for _, index in events[i + 3:i + 6]] for i in starts]  # warmup=1: one run each
        assert len(built) == 4 and sorted(built[0]) == [0, 1, 2]
        assert built[1] == built[0][::-1] and built[3] == built[2][::-1]
        assert warmed == built


def test_profile_nodes(mlp):
    nodes = profile_nodes(mlp, runs=3)
    assert nodes and all(n.mean_us >= 0 and n.calls == 3 for n in nodes)
    assert {n.op for n in nodes} == {"MatMul", "Relu"}
    assert len(nodes) == 8 and nodes == sorted(nodes, key=lambda n: -n.mean_us)


def test_a_session_that_falls_back_to_the_cpu_is_refused_not_mislabelled():
    """onnxruntime-gpu without loadable CUDA libraries runs a CUDA session on the CPU; timings would then lie."""
    import onnxruntime as ort

    from rlflow.measure.session import create_session

    if "CUDAExecutionProvider" in ort.get_available_providers():
        pytest.skip("CUDA may really run here")
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])
    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g", [x],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    with pytest.raises(ProviderError, match="fell back to CPUExecutionProvider"):
        create_session(model, SessionSettings(provider="CUDAExecutionProvider"))
    assert create_session(model, SessionSettings()).get_providers() == ["CPUExecutionProvider"]



def test_block_bootstrap_draws_as_the_two_stage_procedure_says():
    """Blocks drawn with replacement, then each drawn block's own number of rounds from it: the interval matches a
    plain loop doing exactly that, with blocks of unequal size (a block cut short by a deadline)."""
    rng = np.random.default_rng(2)
    base = 1.0 + 0.01 * rng.standard_normal(17)
    groups = np.array([0] * 6 + [1] * 6 + [2] * 5)
    other = base / (np.array([1.0, 1.05, 1.10])[groups] + 0.01 * rng.standard_normal(17))  # sessions differ
    ratios = base / other
    members = [np.flatnonzero(groups == g) for g in range(3)]
    loop = np.random.default_rng(3)
    reference = []
    for _ in range(4000):
        chosen = loop.integers(0, 3, size=3)
        reference.append(np.median(np.concatenate([ratios[loop.choice(members[g], size=len(members[g]))]
                                                   for g in chosen])))
    low, high = np.quantile(reference, [0.025, 0.975])
    ratio = bootstrap_ratio(base, other, groups=groups, resamples=4000)
    assert ratio.median == float(np.median(ratios))
    assert abs(ratio.low - low) < 0.004 and abs(ratio.high - high) < 0.004


def test_cuda_graph_capture_is_a_cuda_setting_and_needs_fixed_output_shapes(matmul_model):
    """What can be checked without a GPU: the setting is refused elsewhere, and a captured runner's output buffers
    come from the session's fixed output shapes (a dynamic one is one clear error)."""
    import onnxruntime as ort

    from rlflow.errors import ProviderError
    from rlflow.measure.session import SessionSettings
    from rlflow.measure.timing import output_specs

    with pytest.raises(ValueError, match="CUDA graph capture needs the CUDAExecutionProvider"):
        SessionSettings(cuda_graph=True)
    assert SessionSettings(provider="CUDAExecutionProvider", cuda_graph=True).as_dict()["cuda_graph"] is True
    dynamic = ort.InferenceSession(matmul_model.SerializeToString(), providers=["CPUExecutionProvider"])
    with pytest.raises(ProviderError, match=r"needs every output's shape fixed; y is \['batch', 4\]"):
        output_specs(dynamic)
    fixed = onnx.ModelProto()
    fixed.CopyFrom(matmul_model)
    for value in (*fixed.graph.input, *fixed.graph.output):
        value.type.tensor_type.shape.dim[0].dim_value = 2
    session = ort.InferenceSession(fixed.SerializeToString(), providers=["CPUExecutionProvider"])
    assert output_specs(session) == [("y", [2, 4], np.float32)]


def test_a_round_starts_with_untimed_runs_where_a_model_runs_often_in_it(mlp, monkeypatch):
    """A model that runs four times or more in a round starts it with untimed runs (at most SWITCH_RUNS, at most a
    quarter of its timed runs); the pace counts them, and the comparison records how many."""
    from rlflow.measure.timing import SWITCH_RUNS, Pace, round_runs

    assert round_runs(0.0008) == (13, SWITCH_RUNS) and round_runs(0.002) == (5, 1) and round_runs(0.004) == (3, 0)
    assert round_runs(0.1) == (1, 0)
    pace = Pace()
    pace.observe("run", 0.0008)
    assert pace.round_seconds(2) == pytest.approx(2 * (13 + SWITCH_RUNS) * 0.0008)
    calls = []
    real_run = timing_module.Runner.run
    monkeypatch.setattr(timing_module.Runner, "run", lambda self: calls.append(1) or real_run(self))
    comparison = compare([mlp, mlp], SessionSettings(), rounds=3, blocks=1, warmup=1)
    timed, untimed = comparison.runs_per_round, comparison.extra["untimed_runs_per_round"]
    assert untimed == min(SWITCH_RUNS, timed // 4)
    # warm-up, the calibrating runs (RUN_PROBES: this model runs in well under a millisecond) and, per round, the
    # untimed and the timed runs of each of the two models
    assert len(calls) == 2 * (1 + timing_module.RUN_PROBES + 3 * (untimed + timed))


class SlowAtFirst:
    """A runner whose runs after a switch take `cold` seconds twice, then `warm`."""

    def __init__(self, cold: float, warm: float):
        self.times, self.warm = [cold, cold], warm

    def time(self, runs: int) -> float:
        return self.times.pop(0) if self.times else self.warm


def test_a_round_is_as_long_as_warm_runs_say_not_the_first_cold_one():
    """The first runs after the other models ran are cold: a round's runs are counted from the fastest of a few runs
    in a row, and a model that takes a round's length in one run is run once for it."""
    from rlflow.measure.timing import MIN_ROUND_SECONDS, round_runs, warm_run_seconds

    assert warm_run_seconds(SlowAtFirst(0.0018, 0.0008)) == 0.0008
    assert round_runs(warm_run_seconds(SlowAtFirst(0.0018, 0.0008))) == (13, 3)
    slow = SlowAtFirst(2 * MIN_ROUND_SECONDS, MIN_ROUND_SECONDS / 2)
    assert warm_run_seconds(slow) == 2 * MIN_ROUND_SECONDS and len(slow.times) == 1
