"""The candidates greedy measures first: a rule applied everywhere and every fusion at once, built with one graph copy
per pass (`apply_all`).  They must be the graphs the same rewrites make one at a time, and keep the numbers."""
from __future__ import annotations

from pathlib import Path

import pytest

from rlflow.graph.core import load
from rlflow.measure.verify import verify
from rlflow.rewrites import RULES, apply, apply_all, find_matches, match_counts, rule
from rlflow.search.candidates import Candidate, all_fusions, everywhere
from rlflow.search.greedy import phases, step_size
from rlflow.search.location_kinds import alike, kinds_of_location

EXPORT = Path(__file__).resolve().parents[1] / "fixtures" / "exports" / "bert-tiny-dynamo.onnx"


@pytest.fixture(scope="module")
def bert():
    return load(EXPORT, {"input_ids": (1, 8), "attention_mask": (1, 8)})


def _replayed(graph, applied):
    for match in applied:
        graph = apply(graph, match)
    return graph


def test_apply_all_is_the_rewrites_one_at_a_time(bert):
    matches = rule("skip-layernorm-fusion").find(bert)
    assert len(matches) == 3
    before = bert.fingerprint()
    batch, applied = apply_all(bert, matches)
    assert applied == matches and bert.fingerprint() == before
    assert batch.fingerprint() == _replayed(bert, matches).fingerprint()
    assert batch.op_counts().get("LayerNormalization", 0) == 0


def test_apply_all_skips_a_match_that_no_longer_holds(bert):
    (match,) = rule("attention-fusion").find(bert)
    batch, applied = apply_all(bert, [match, match])  # the second finds its nodes gone
    assert applied == [match] and batch.fingerprint() == apply(bert, match).fingerprint()


def test_everywhere_and_all_fusions_replay_and_keep_the_numbers(bert):
    start = Candidate(bert, (), bert.fingerprint())
    candidates = list(everywhere(start))
    fused = all_fusions(start)
    assert fused is not None and fused.fingerprint not in {c.fingerprint for c in candidates}
    rules = {m.rule for m in fused.applied}
    assert {"embed-layernorm-fusion", "attention-fusion", "attention-pack-qkv", "skip-layernorm-fusion",
            "bias-gelu-fusion"} <= rules
    reference = bert.to_model(static=True)
    for candidate in [fused, *candidates]:
        assert _replayed(bert, candidate.applied).fingerprint() == candidate.fingerprint
        assert verify(reference, candidate.graph.to_model(static=True)).ok


def test_greedy_measures_all_fusions_alone_first_then_the_rest(bert):
    start = Candidate(bert, (), bert.fingerprint())
    seen = {start.fingerprint}
    batches = list(phases(start, [rule(n) for n in ("attention-fusion", "skip-layernorm-fusion", "gelu-fusion")],
                          seen, deadline=float("inf")))
    first, second, third = batches
    assert len(first) == 1 and {m.rule for m in first[0].applied} >= {"attention-fusion", "skip-layernorm-fusion"}
    assert {c.applied[-1].rule for c in second} == {"skip-layernorm-fusion", "attention-fusion", "gelu-fusion"}
    # skip-layernorm at each kind of its locations (two alike, one other), never at one of two alike
    assert [(c.applied[-1].rule, len(c.applied)) for c in third] == [("skip-layernorm-fusion", 2),
                                                                     ("skip-layernorm-fusion", 1)]


def test_a_rule_is_tried_at_each_kind_of_location_and_the_step_size_counts_them(bert):
    """The last phase applies a rule at the locations of one kind at a time (same operators and shapes: a network's
    repeated layers), so a step is as many candidates as `step_size` says, and each keeps the numbers."""
    start = Candidate(bert, (), bert.fingerprint())
    kinds = kinds_of_location(bert, find_matches(bert))
    assert [len(g) for g in kinds["skip-layernorm-fusion"]] == [2, 1] and len(kinds["attention-fusion"]) == 1
    last = list(alike(start, matches=find_matches(bert)))
    assert sorted((c.applied[-1].rule, len(c.applied)) for c in last) == [
        ("scalar-mul-through-layout", 1), ("scalar-mul-through-layout", 1),
        ("skip-layernorm-fusion", 1), ("skip-layernorm-fusion", 2)]
    batches = list(phases(start, RULES, {start.fingerprint}, deadline=float("inf")))
    assert sum(len(b) for b in batches) == step_size(bert) == 17
    reference = bert.to_model(static=True)
    for candidate in last:
        assert verify(reference, candidate.graph.to_model(static=True)).ok


def test_the_rules_matching_in_the_most_places_are_measured_first(bert):
    """Where only a few batches fit in the time (a 1 GB decoder), the widest rules come first, whatever their place in
    the registry."""
    rules = [rule(n) for n in ("scalar-mul-through-layout", "skip-layernorm-fusion")]  # registry order, 2 and 3 places
    counts = match_counts(bert)
    assert [counts[r.name] for r in rules] == [2, 3]
    # one fusion among them: no all-fusions batch, the rules applied everywhere come first
    first = next(phases(Candidate(bert, (), bert.fingerprint()), rules, {bert.fingerprint()}, float("inf"), most=1))
    assert [c.applied[-1].rule for c in first] == ["skip-layernorm-fusion"]


def test_a_large_model_builds_at_most_a_few_candidates_per_batch(bert):
    """`most` (greedy's LARGE_MODEL_CANDIDATES for a model whose weights are shared): a batch is built only when the
    one before was measured, and holds `most` at most; the batches still reach every candidate, in the same order."""
    start = Candidate(bert, (), bert.fingerprint())
    rules = [rule(n) for n in ("attention-fusion", "skip-layernorm-fusion", "gelu-fusion")]
    seen = {start.fingerprint}
    batches = phases(start, rules, seen, deadline=float("inf"), most=2)
    first = next(batches)
    assert len(first) == 1 and seen == {start.fingerprint, first[0].fingerprint}  # nothing else built yet
    rest = list(batches)
    assert [len(b) for b in rest] == [2, 1, 2]  # the rules everywhere (3), then skip-layernorm's two kinds
    unlimited = phases(start, rules, {start.fingerprint}, deadline=float("inf"))
    assert [c.fingerprint for b in unlimited for c in b] == [c.fingerprint for b in (first, *rest) for c in b]


def test_apply_all_keeps_what_a_subgraph_reads_from_outside():
    """An If branch reads a tensor of the outer graph by name: its producers stay live through a batch of rewrites."""
    from onnx import TensorProto, helper

    from rlflow.graph.core import Graph

    def value(name):
        return helper.make_tensor_value_info(name, TensorProto.FLOAT, [2, 2])

    then_g = helper.make_graph([helper.make_node("Add", ["t2", "u2"], ["o1"])], "then", [], [value("o1")])
    else_g = helper.make_graph([helper.make_node("Sub", ["t2", "u2"], ["o2"])], "else", [], [value("o2")])
    nodes = [helper.make_node("Transpose", [x], [f"{x}1"], perm=[1, 0]) for x in ("x", "u")]
    nodes += [helper.make_node("Transpose", [f"{x}1"], [f"{x}2"], perm=[1, 0]) for x in ("x", "u")]
    nodes[2].output[0], nodes[3].output[0] = "t2", "u2"
    nodes.append(helper.make_node("If", ["c"], ["y"], then_branch=then_g, else_branch=else_g))
    graph = helper.make_graph(nodes, "g", [value("x"), value("u"), helper.make_tensor_value_info("c", TensorProto.BOOL,
                                                                                             [])], [value("y")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    g = Graph.from_model(model)
    matches = rule("transpose-transpose").find(g)
    assert len(matches) == 2
    batch, applied = apply_all(g, matches)
    assert applied == matches and batch.fingerprint() == _replayed(g, matches).fingerprint()
    assert verify(g.to_model(static=True), batch.to_model(static=True), seeds=(0,)).ok


def test_a_rewritten_graph_reuses_its_parents_dynamic_axes_and_they_are_right(bert):
    """`dynamic_axes` answers a rewritten clone from its parent's inference (`Graph.lineage_cache`): every tensor's
    answer must equal a fresh inference on the rewritten graph."""
    from rlflow.graph.dynamic_axes import _moved_skeleton, _onnx_moved, _with_symbolic, dynamic_axes

    for tensor in bert.gs.tensors().values():
        dynamic_axes(bert, tensor)  # the parent's inference, cached
    fused = all_fusions(Candidate(bert, (), bert.fingerprint())).graph
    assert "dynamic_axes" in fused.lineage_cache
    fresh, eager = fused.clone(), fused.clone()
    fresh.lineage_cache.clear()
    # the whole graph's inference, onnxruntime's symbolic one included, as every answer came before it was lazy
    skeleton = _moved_skeleton(eager)
    eager.lineage_cache["dynamic_axes"] = ((tuple(n.name for n in eager.gs.nodes), True),
                                           _with_symbolic(skeleton, _onnx_moved(skeleton)))
    tensors = fused.gs.tensors()
    answers = {name: dynamic_axes(fused, t) for name, t in tensors.items()}
    assert answers == {name: dynamic_axes(fresh, t) for name, t in fresh.gs.tensors().items()}
    assert answers == {name: dynamic_axes(eager, t) for name, t in eager.gs.tensors().items()}
    assert any(axes and any(axes) for axes in answers.values()), "the export's batch and sequence axes are dynamic"
    # a fused operator's output is inferred through the node that makes it, from the parent's facts
    probe = all_fusions(Candidate(bert, (), bert.fingerprint())).graph
    fused_output = next(node.outputs[0] for node in probe.gs.nodes if node.domain == "com.microsoft")
    assert dynamic_axes(probe, fused_output) == answers[fused_output.name]
    stamp, facts = probe.lineage_cache["dynamic_axes"]
    assert fused_output.name in facts and stamp[0] != tuple(n.name for n in probe.gs.nodes), "no whole-graph inference"


def test_a_candidate_onnxruntime_cannot_run_is_dropped_and_named(bert, monkeypatch):
    """Under CUDA graph capture onnxruntime refuses a candidate that puts a node on the CPU: the search goes on without
    it, and its result (and the report) names the rules that made each one dropped."""
    import rlflow.search.selection as selection
    from rlflow.errors import ProviderError
    from rlflow.measure.session import SessionSettings
    from rlflow.measure.timing import Ratio
    from rlflow.optimize.report import _dropped_lines
    from rlflow.search.greedy import GreedyConfig, greedy

    def measure(base, base_model, batch, *args):
        if any(m.rule == "attention-fusion" for c in batch for m in c.applied):
            raise ProviderError("This session cannot use the graph capture feature")
        return [(c, Ratio(1.0, 0.99, 1.01, 0.95)) for c in batch]

    monkeypatch.setattr(selection, "_measure_batch", measure)
    rules = [rule(n) for n in ("skip-layernorm-fusion", "attention-fusion")]
    result = greedy(bert, SessionSettings(), GreedyConfig(time_limit=60), rules=rules)
    assert result.stop_reason.startswith("no rewrite is measurably faster; the closest: ")
    assert result.candidates_measured > 0
    assert sorted(d["rules"] for d in result.candidates_dropped) == ["attention-fusion",
                                                                    "attention-fusion, skip-layernorm-fusion"]
    lines = _dropped_lines(result.candidates_dropped)
    assert lines[0].startswith("  dropped     2 candidate(s) onnxruntime could not run, made by: ")
    assert "graph capture" in lines[1]


def test_removing_dead_nodes_between_rewrites_is_a_cleanup_from_the_outputs(bert):
    """`remove_dead_nodes` scans for nodes no one reads and cascades from them, where it walked from the outputs: the
    nodes it leaves must be those a cleanup from the outputs keeps, rewrite after rewrite, and the names in use
    those of what is left."""
    graph = bert.clone()
    for match in [*rule("attention-fusion").find(bert), *rule("skip-layernorm-fusion").find(bert)]:
        rule(match.rule).rewrite(graph, match, graph.node_map())
        graph.remove_dead_nodes()
        kept = {n.name for n in graph.gs.nodes}
        assert kept == {n.name for n in graph.gs.copy().cleanup(remove_unused_graph_inputs=False).nodes}
        assert graph._names_in_use() == (set(graph.gs.tensors()) | kept) - {""}
    assert graph.op_counts().get("LayerNormalization", 0) == 0


def test_greedy_does_not_measure_again_a_rewrite_an_earlier_step_refused(bert, monkeypatch):
    """Lazy greedy: after a step, the very same rewrites (same matches) that were measured not faster are not measured
    again; what the step made new is.  The fake measurement finds only the attention fusion faster."""
    import sys

    from rlflow.measure.session import SessionSettings
    from rlflow.measure.timing import Ratio
    from rlflow.search.greedy import GreedyConfig, greedy
    from rlflow.search.selection import Screening

    greedy_module = sys.modules["rlflow.search.greedy"]
    steps: list[list[frozenset]] = []

    def measure(base, candidates, *args, **kwargs):
        since = int(len(base.gs.nodes) != len(bert.gs.nodes))  # the attention fusion applied: the second step
        if len(steps) <= since:
            steps.append([])
        pairs = []
        for c in candidates:
            step = c.applied[since:]
            steps[-1].append(frozenset(step))
            fast = {m.rule for m in step} == {"attention-fusion"}
            pairs.append((c, Ratio(1.2, 1.1, 1.3, 0.95) if fast else Ratio(1.0, 0.9, 1.1, 0.95)))
        return Screening(pairs)

    monkeypatch.setattr(greedy_module, "measure_against", measure)
    result = greedy(bert, SessionSettings(), GreedyConfig(time_limit=1e6))
    assert [m.rule for m in result.applied] == ["attention-fusion"]
    assert result.stop_reason.startswith("no rewrite is measurably faster; the closest: ")
    assert result.stop_reason.endswith(" 1.000x [0.900, 1.100]")  # the fake measurement's refusal
    first, second = steps
    assert second and not set(second) & set(first)  # the second step measured only what the first had not
    assert len(second) < len(first)


@pytest.mark.parametrize("first", ["skip-layernorm-fusion", "every fusion"])
def test_greedy_never_undoes_a_one_rule_step_but_may_undo_part_of_every_fusion(bert, monkeypatch, first):
    """The fake measurement finds `first` faster at the first step and skip-LayerNorm unfused faster after it: undoing
    a step of one rule contradicts its measurement and is not measured; every fusion at once may lose one kind (the
    encoders' skip-LayerNorm)."""
    import sys

    from rlflow.measure.session import SessionSettings
    from rlflow.measure.timing import Ratio
    from rlflow.search.greedy import GreedyConfig, greedy
    from rlflow.search.selection import Screening

    greedy_module = sys.modules["rlflow.search.greedy"]
    measured: list[set[str]] = []

    def measure(base, candidates, *args, **kwargs):
        pairs, start = [], len(base.gs.nodes) == len(bert.gs.nodes)
        for c in candidates:
            rules = {m.rule for m in c.applied}
            measured.append(rules)
            if start:
                fast = rules == {"skip-layernorm-fusion"} if first != "every fusion" else len(rules) > 2
            else:
                fast = c.applied[-1].rule == "skip-layernorm-unfuse"
            pairs.append((c, Ratio(1.2, 1.1, 1.3, 0.95) if fast else Ratio(1.0, 0.9, 1.1, 0.95)))
        return Screening(pairs)

    monkeypatch.setattr(greedy_module, "measure_against", measure)
    result = greedy(bert, SessionSettings(), GreedyConfig(time_limit=1e6, max_steps=3))
    steps = [s["rule"] for s in result.steps]
    if first == "every fusion":
        assert steps[1] == "skip-layernorm-unfuse"
    else:
        assert steps == ["skip-layernorm-fusion"]
        assert result.stop_reason.startswith("no rewrite is measurably faster; the closest: ")
        assert not any("skip-layernorm-unfuse" in rules for rules in measured)


def test_the_closest_candidate_names_its_rules_and_the_profile_that_refused_it(bert):
    from rlflow.measure.shape_profiles import CombinedRatio, parse_profile
    from rlflow.measure.timing import Ratio
    from rlflow.search.greedy import _closest

    start = Candidate(bert, (), bert.fingerprint())
    candidate = next(iter(everywhere(start, [rule("skip-layernorm-fusion")])))
    profiles = [parse_profile("input_ids=1,8"), parse_profile("input_ids=1,64")]
    plain = _closest((candidate, Ratio(1.02, 0.99, 1.05, 0.95)), start, [])
    assert plain == "skip-layernorm-fusion 1.020x [0.990, 1.050]"
    refused = _closest((candidate, CombinedRatio(1.03, 1.01, 1.04, 0.95, (1,))), start, profiles)
    assert refused == "skip-layernorm-fusion 1.030x [1.010, 1.040], slower at input_ids=1,64"
