"""The final measurement's plan: as many blocks of fresh sessions as the model's size allows within the budget."""
from __future__ import annotations

import math

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from rlflow.graph.core import Graph
from rlflow.measure import SessionSettings
from rlflow.measure.gate import (
    GATE_MAX_SECONDS,
    GATE_SECONDS,
    MIN_BLOCKS,
    gate_budget,
    measure_gate,
    plan_gate,
    warmup_runs,
)
from rlflow.measure.timing import MIN_ROUNDS, WARMUP_RUNS, Pace, check_and_time
from tests.conftest import tiny_model


def _pace(session: float, run: float) -> Pace:
    pace = Pace()
    pace.observe("session", session)
    pace.observe("run", run)
    return pace


def test_the_budget_grows_with_the_search_limit_between_its_bounds():
    assert gate_budget(10.0) == GATE_SECONDS  # the default agent
    assert gate_budget(2 * GATE_SECONDS + 10) == GATE_SECONDS + 5
    assert gate_budget(600.0) == GATE_MAX_SECONDS


def test_a_model_slow_to_load_gets_its_whole_plan_within_half_the_search_limit():
    slow = _pace(session=4.5, run=0.06)  # a 1 GiB decoder step: a session takes seconds, a run milliseconds
    whole = plan_gate(slow, rounds=30, budget=math.inf)
    assert (whole.blocks, whole.rounds_per_block) == (5, 6) and whole.seconds > GATE_MAX_SECONDS
    assert gate_budget(342.0, [slow, slow], rounds=30) == pytest.approx(2 * whole.seconds)  # one plan a profile
    assert gate_budget(80.0, [slow], rounds=30) == 40.0  # never more than half the search's limit
    assert gate_budget(10.0, [slow], rounds=30) == GATE_SECONDS  # nor less than the least
    fast = _pace(session=0.02, run=0.002)
    assert gate_budget(600.0, [fast], rounds=30) == GATE_MAX_SECONDS


def test_a_fast_model_gets_every_round_and_full_warm_up():
    plan = plan_gate(_pace(session=0.02, run=0.002), rounds=30, budget=GATE_SECONDS)
    assert (plan.blocks, plan.rounds_per_block, plan.warmup) == (5, 6, WARMUP_RUNS)
    assert plan.seconds < GATE_SECONDS


def test_a_slow_model_gives_up_rounds_per_block_before_blocks():
    pace = _pace(session=2.0, run=0.35)  # RoBERTa-base at sequence 128 on this CPU
    roomy = plan_gate(pace, rounds=30, budget=30.0)
    assert roomy.rounds_per_block == MIN_ROUNDS and roomy.blocks == 3 and roomy.warmup == 2
    assert roomy.seconds <= 30.0
    tight = plan_gate(pace, rounds=30, budget=GATE_SECONDS)
    assert (tight.blocks, tight.rounds_per_block) == (MIN_BLOCKS, MIN_ROUNDS)  # the least, even past the budget
    assert tight.seconds > GATE_SECONDS


@pytest.mark.parametrize("run, runs", [(0.001, WARMUP_RUNS), (0.1, 3), (5.0, 2)])
def test_warm_up_is_a_quarter_second_of_runs_within_bounds(run, runs):
    assert warmup_runs(run) == runs


def test_the_gate_runs_its_plan_on_a_real_model():
    rng = np.random.default_rng(0)
    weight = numpy_helper.from_array(rng.standard_normal((64, 64)).astype(np.float32), "W")
    model = tiny_model([helper.make_node("MatMul", ["x", "W"], ["y"])],
                       [helper.make_tensor_value_info("x", TensorProto.FLOAT, [8, 64])],
                       [helper.make_tensor_value_info("y", TensorProto.FLOAT, [8, 64])], [weight])
    settings, pace = SessionSettings(threads=1), Pace()
    check_and_time(model, settings, pace=pace)
    assert pace.seconds["session"] > 0 and pace.seconds["run"] > 0
    graph = Graph.from_model(model)
    gate = measure_gate(graph, graph.clone(), settings, [pace], rounds=12, budget=GATE_SECONDS, seed=0)
    (comparison,), (plan,) = gate.comparisons, gate.plans
    assert (plan.blocks, plan.rounds_per_block) == (2, 6)
    assert comparison.extra["blocks"] == plan.blocks and comparison.rounds == 12
    assert gate.profiles == [] and gate.ratio == comparison.ratios[1]
