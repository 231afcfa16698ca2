"""Searches honour their time limit: no measurement starts that is predicted to end after the deadline, expansion and
costing stop at theirs, and a search out of time still returns a valid result that says so.

Time is faked: a fake clock replaces `time` in the search and timing modules, and a fake Runner makes every session
build and run advance it by set amounts (as on a large model, where one session takes seconds), so the tests count
work done in fake seconds and sessions started, never wall-clock time on a shared machine.
"""
from __future__ import annotations

import sys
from types import SimpleNamespace

import onnx
import pytest

import rlflow
from rlflow.graph.core import Graph
from rlflow.measure import timing
from rlflow.measure.session import SessionSettings
from rlflow.measure.timing import Pace, compare
from rlflow.rewrites import apply
from rlflow.search.candidates import expand
from rlflow.search.greedy import GreedyConfig, greedy
from rlflow.search.random_walk import RandomConfig, random_walk
from rlflow.search.selection import measure_against, select_measured
from rlflow.search.taso import TasoConfig, taso

SESSION, BESIDE, RUN_PER_NODE, EXPORT, ESTIMATE = 5.0, 1.4, 0.002, 0.5, 0.5
"""Fake seconds: a session build (BESIDE times longer while another session lives, as measured on BERT-base), a run
per node of the model, an export, a cost-model estimate."""

MODULES = ("rlflow.measure.timing", "rlflow.search.candidates", "rlflow.search.selection", "rlflow.search.taso",
           "rlflow.search.greedy", "rlflow.search.random_walk")


class Clock:
    """Fake `time`: advances only when told to."""

    def __init__(self):
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now

    perf_counter = monotonic


@pytest.fixture
def fake(monkeypatch):
    """The fake clock, fake onnxruntime runners (counted) and exports that take EXPORT fake seconds."""
    clock = Clock()
    state = SimpleNamespace(clock=clock, sessions=0, alive=0)

    class FakeRunner:
        """A session whose runs take RUN_PER_NODE per node: graphs with fewer nodes are measurably faster."""

        def __init__(self, model, settings, feeds):
            clock.now += SESSION * (BESIDE if state.alive else 1.0)
            state.sessions += 1
            state.alive += 1
            if isinstance(model, bytes):  # `compare` serializes a model once for all its sessions
                model = onnx.load_from_string(model)
            self.seconds = RUN_PER_NODE * len(model.graph.node)

        def __del__(self):
            state.alive -= 1

        def run(self) -> None:
            clock.now += self.seconds

        def time(self, runs: int) -> float:
            clock.now += runs * self.seconds
            return self.seconds

    real_export = Graph.to_model

    def export(self, *, static=True):
        clock.now += EXPORT
        return real_export(self, static=static)

    for name in MODULES:
        monkeypatch.setattr(sys.modules[name], "time", clock)
    monkeypatch.setattr(timing, "Runner", FakeRunner)
    monkeypatch.setattr(Graph, "to_model", export)
    return state


class FakeCostModel:
    """Estimates a graph's latency by its node count; every estimate takes ESTIMATE fake seconds."""

    def __init__(self, clock: Clock):
        self.clock, self.calls = clock, []

    def graph_cost(self, graph: Graph) -> float:
        self.clock.now += ESTIMATE
        self.calls.append(self.clock.now)
        return float(len(graph))

    def save(self) -> None:
        pass


@pytest.fixture(scope="module")
def graph(transformer_path) -> Graph:
    return rlflow.load(transformer_path)


@pytest.fixture(scope="module")
def children(graph):
    out = expand(graph)
    assert len(out) >= 6
    return out[:6]


def replayed(graph: Graph, applied) -> str:
    for match in applied:
        graph = apply(graph, match)
    return graph.fingerprint()


def test_measure_against_shrinks_batches_to_what_fits_and_counts_the_rest(fake, graph, children):
    deadline = fake.clock.now + 30.0
    screening = measure_against(graph, children, SessionSettings(), rounds=15, seed=0, deadline=deadline)
    assert fake.clock.now <= deadline
    assert 1 <= len(screening.pairs) < len(children)
    assert len(screening.pairs) + screening.unmeasured == len(children)
    assert fake.sessions == 1 + len(screening.pairs) + 1  # the probe, then one batch: the candidates and the base


def test_measure_against_without_a_deadline_measures_everything(fake, graph, children):
    screening = measure_against(graph, children, SessionSettings(), rounds=6, seed=0)
    assert len(screening.pairs) == len(children) and screening.unmeasured == 0
    assert fake.sessions == len(children) + 1  # no probe: nothing to plan


def test_measure_against_starts_nothing_when_the_deadline_has_passed(fake, graph, children):
    screening = measure_against(graph, children, SessionSettings(), rounds=6, seed=0, deadline=fake.clock.now - 1)
    assert screening.pairs == [] and screening.unmeasured == len(children) and fake.sessions == 0


def test_select_measured_keeps_the_original_when_no_candidate_can_be_measured_in_time(fake, graph, children):
    start = fake.clock.now
    result = select_measured(graph, children, SessionSettings(), rounds=15, seed=0, deadline=start + 8.0,
                             start=start, stop_reason="time limit after 3 expanded", estimated=9)
    assert result.graph is graph and result.applied == [] and result.candidates_measured == 0
    assert result.stop_reason == "time limit after 3 expanded; no time left to measure any of 6 candidates"
    assert result.candidates_unmeasured == 6
    assert fake.sessions == 1  # the probe only
    assert fake.clock.now <= start + 8.0


def test_select_measured_says_when_there_was_nothing_to_measure(fake, graph):
    result = select_measured(graph, [], SessionSettings(), rounds=15, seed=0, deadline=None, start=fake.clock.now,
                             stop_reason="queue empty after 1 expanded", estimated=0)
    assert result.graph is graph and result.candidates_measured == 0 and fake.sessions == 0
    assert result.stop_reason == "queue empty after 1 expanded; no rewrite reached a new graph: nothing to measure"


def test_compare_with_a_pace_starts_no_block_that_would_end_late(fake, graph):
    model = graph.to_model(static=True)
    deadline = fake.clock.now + 4 * SESSION  # room for the first block, not for a second one
    comparison = compare([model, model], SessionSettings(), rounds=12, blocks=3, deadline=deadline, pace=Pace())
    assert comparison.extra["blocks"] == 1 and fake.sessions == 2
    assert fake.clock.now <= deadline
    fake.sessions = 0  # without a pace, the deadline only stops blocks and rounds from starting after it (the gate)
    compare([model, model], SessionSettings(), rounds=12, blocks=3, deadline=fake.clock.now + 4 * SESSION)
    assert fake.sessions == 4


def test_compare_with_a_pace_starts_no_round_that_would_end_late(fake, graph):
    model = graph.to_model(static=True)
    run = RUN_PER_NODE * len(model.graph.node)  # one run per round: a run is over MIN_ROUND_SECONDS
    block = SESSION * (1 + BESIDE) + 2 * (timing.WARMUP_RUNS + 1) * run  # sessions, warm-up, calibration
    deadline = fake.clock.now + block + (timing.MIN_ROUNDS + 2.5) * 2 * run  # room for 2.5 rounds past the minimum
    comparison = compare([model, model], SessionSettings(), rounds=30, blocks=1, deadline=deadline, pace=Pace())
    assert comparison.rounds == timing.MIN_ROUNDS + 2 and fake.clock.now <= deadline


@pytest.mark.parametrize("search", ["taso", "random"])
def test_search_ends_within_its_time_limit_with_a_valid_result(fake, graph, search, monkeypatch):
    import rlflow.search.selection as selection

    calls = {}
    real_select, real_reserve = selection.select_measured, selection.measurement_reserve

    def reserve(*args, **kwargs):
        calls["reserve"] = real_reserve(*args, **kwargs)
        return calls["reserve"]

    def select(*args, **kwargs):
        calls["selected_at"] = fake.clock.now
        return real_select(*args, **kwargs)

    module = sys.modules[f"rlflow.search.{'taso' if search == 'taso' else 'random_walk'}"]
    monkeypatch.setattr(module, "measurement_reserve", reserve)
    monkeypatch.setattr(module, "select_measured", select)
    cost_model, limit, start = FakeCostModel(fake.clock), 60.0, fake.clock.now
    if search == "taso":
        result = taso(graph, SessionSettings(), TasoConfig(time_limit=limit), cost_model=cost_model)
    else:
        config = RandomConfig(time_limit=limit, walks=100)  # more walks than the time allows
        result = random_walk(graph, SessionSettings(), config, cost_model=cost_model)
    assert fake.clock.now - start <= limit
    # one candidate at least fits in the reserve; more than the 25% share, which would not
    assert calls["reserve"] > 0.25 * limit and result.candidates_measured >= 1
    search_deadline = start + limit - calls["reserve"]
    assert calls["selected_at"] <= search_deadline + ESTIMATE + EXPORT  # costing stops at the search's deadline
    assert sum(t > search_deadline for t in cost_model.calls) <= 1
    assert result.stop_reason.startswith("time limit") and "not measured: no time left" in result.stop_reason
    assert result.applied, "the fake runner makes graphs with fewer nodes faster"
    assert len(result.graph) < len(graph) and replayed(graph, result.applied) == result.graph.fingerprint()


def test_taso_estimates_the_children_of_an_expansion_cut_by_its_deadline(fake, graph, monkeypatch):
    """One expansion longer than the search's time (as on nasnet-a-mobile): what it made in time are candidates."""
    import rlflow.search.candidates as candidates

    real_apply = candidates.try_apply

    def slow_apply(*args, **kwargs):
        fake.clock.now += 4.0
        return real_apply(*args, **kwargs)

    monkeypatch.setattr(candidates, "try_apply", slow_apply)
    start = fake.clock.now
    result = taso(graph, SessionSettings(), TasoConfig(time_limit=60.0), cost_model=FakeCostModel(fake.clock))
    assert fake.clock.now - start <= 60.0
    assert result.stop_reason.startswith("time limit after 1 expanded")
    assert 1 <= result.candidates_estimated < len(expand(graph)) and result.candidates_measured >= 1


def test_taso_with_a_limit_too_short_to_measure_returns_the_input(fake, graph):
    start = fake.clock.now
    result = taso(graph, SessionSettings(), TasoConfig(time_limit=10.0), cost_model=FakeCostModel(fake.clock))
    assert result.graph is graph and result.applied == [] and result.candidates_measured == 0
    assert result.stop_reason.startswith("time limit after 0 expanded")
    assert fake.sessions == 1  # the probe: nothing else is started
    assert fake.clock.now - start <= SESSION + 2 * RUN_PER_NODE * len(graph) + 2 * EXPORT + ESTIMATE


def test_taso_with_time_to_spare_measures_its_whole_pool(fake, graph):
    config = TasoConfig(time_limit=1e5, budget=3)
    result = taso(graph, SessionSettings(), config, cost_model=FakeCostModel(fake.clock))
    assert result.stop_reason.startswith("budget after 3 expanded; best of 6 measured:")
    assert result.candidates_measured == config.top_k
    assert fake.sessions == 1 + 2 * (config.top_k + 1)  # the probe, then two blocks of the whole batch


def test_greedy_stops_for_time_when_candidates_are_left_unmeasured(fake, graph):
    start = fake.clock.now
    result = greedy(graph, SessionSettings(), GreedyConfig(time_limit=30.0))
    assert fake.clock.now - start <= 30.0
    assert result.stop_reason == "time limit" and result.candidates_measured >= 1
    assert replayed(graph, result.applied) == result.graph.fingerprint()


def test_greedy_builds_no_more_candidates_than_the_time_left_can_measure(fake, graph, monkeypatch):
    """Building a candidate costs a graph copy and its rewrites (a 30-layer decoder's dozen rules applied everywhere
    took 12 s, and the time left measured four): once the pace is known, a batch holds what the time left can
    measure, and when that is nothing the search stops for time."""
    greedy_module = sys.modules["rlflow.search.greedy"]
    real_measure, batches = greedy_module.measure_against, []

    def measure(base, candidates, *args, **kwargs):
        screening = real_measure(base, candidates, *args, **kwargs)
        batches.append((len(candidates), screening.unmeasured))
        return screening

    monkeypatch.setattr(greedy_module, "measure_against", measure)
    monkeypatch.setattr(greedy_module, "fastest", lambda pairs: None)  # no step is taken: the batches go on
    start = fake.clock.now
    result = greedy(graph, SessionSettings(), GreedyConfig(time_limit=50.0))
    assert fake.clock.now - start <= 50.0 and result.stop_reason == "time limit"
    assert len(batches) >= 2 and batches[0] == (1, 0)  # all fusions at once, then what the time left could measure
    assert all(unmeasured == 0 for _, unmeasured in batches)  # (before: the whole phase built, most unmeasured)
    assert result.candidates_unmeasured == 1  # the next batch was due, and nothing more fitted
