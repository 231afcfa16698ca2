"""Shape profiles: parsing, defaults, measurement at every profile, and a gate that is never slower at any of them."""
from __future__ import annotations

import importlib
import math

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import rlflow
from rlflow.cli import main
from rlflow.errors import InputError
from rlflow.measure.shape_profiles import (
    arrange,
    combine,
    default_profiles,
    instantiate,
    parse_profile,
    read_profiles,
)
from rlflow.measure.timing import Ratio
from rlflow.search.selection import fastest
from tests.conftest import save, tiny_model
from tests.test_optimize import _accept_first_candidate

S16 = "input_ids=1,16;attention_mask=1,16"
S64 = "input_ids=1,64;attention_mask=1,64"


@pytest.fixture
def text_model() -> onnx.ModelProto:
    """Embedding lookup, masked, then a projection: ids and mask are [batch, sequence], both dynamic; an Identity
    gives the searches something to remove."""
    rng = np.random.default_rng(0)
    table = numpy_helper.from_array(rng.standard_normal((50, 16)).astype(np.float32), "E")
    weight = numpy_helper.from_array(rng.standard_normal((16, 8)).astype(np.float32), "W")
    axes = numpy_helper.from_array(np.array([-1], dtype=np.int64), "axes")
    nodes = [helper.make_node("Gather", ["E", "input_ids"], ["emb"]),
             helper.make_node("Cast", ["attention_mask"], ["maskf"], to=TensorProto.FLOAT),
             helper.make_node("Unsqueeze", ["maskf", "axes"], ["mask3"]),
             helper.make_node("Mul", ["emb", "mask3"], ["masked"]),
             helper.make_node("Identity", ["masked"], ["same"]),
             helper.make_node("MatMul", ["same", "W"], ["proj"]),
             helper.make_node("Relu", ["proj"], ["y"])]
    dims = ["batch", "sequence"]
    return tiny_model(nodes, [helper.make_tensor_value_info("input_ids", TensorProto.INT64, dims),
                              helper.make_tensor_value_info("attention_mask", TensorProto.INT64, dims)],
                      [helper.make_tensor_value_info("y", TensorProto.FLOAT, [*dims, 8])], [table, weight, axes])


def test_a_profile_parses_with_either_separator_and_an_optional_weight():
    profile = parse_profile(" input_ids=1,16 ; attention_mask:1,16 @2.5")
    assert dict(profile.shapes) == {"input_ids": (1, 16), "attention_mask": (1, 16)} and profile.weight == 2.5
    assert parse_profile(S16).weight == 1.0 and parse_profile(S16).label == S16


@pytest.mark.parametrize("text", ["", "input_ids", "input_ids=1,x", "input_ids=1,0", "=1,16", "input_ids=1,16@0",
                                  "input_ids=1,16@-1", "input_ids=1,16@heavy", "x=1;x=2", "input_ids=1,16@nan"])
def test_a_bad_profile_is_one_clear_error(text):
    with pytest.raises(InputError, match="bad profile"):
        parse_profile(text)


def test_a_profiles_file_skips_comments_and_names_a_bad_line(tmp_path):
    good = tmp_path / "traffic.txt"
    good.write_text(f"# our traffic\n{S16} @ 3\n\n{S64}  # long ones\n")
    assert [(p.label, p.weight) for p in read_profiles(good)] == [(S16, 3.0), (S64, 1.0)]
    bad = tmp_path / "bad.txt"
    bad.write_text(f"{S16}\ninput_ids=1,zero\n")
    with pytest.raises(InputError, match="line 2"):
        read_profiles(bad)
    (tmp_path / "empty.txt").write_text("# nothing\n")
    with pytest.raises(InputError, match="holds no profile"):
        read_profiles(tmp_path / "empty.txt")
    with pytest.raises(InputError, match="cannot read"):
        read_profiles(tmp_path / "missing.txt")


def test_profiles_must_name_the_same_inputs_and_differ(text_model):
    with pytest.raises(InputError, match="same inputs"):
        arrange([parse_profile(S16), parse_profile("input_ids=1,64")], text_model)
    with pytest.raises(InputError, match="same shapes"):
        arrange([parse_profile(S16), parse_profile(S16 + "@2")], text_model)
    heavy_last = arrange([parse_profile(S16), parse_profile(S64 + "@3")], text_model)
    assert [p.label for p in heavy_last] == [S64, S16]  # the heaviest gives the graph its static shapes


@pytest.fixture
def cached_model() -> onnx.ModelProto:
    """A decode step's interface, as the dynamo exporter names its dimensions: a token [batch, 1], a mask
    [batch, past_sequence + 1] and two cache tensors [batch, 2, past_sequence, 4]."""
    cache = ["batch", 2, "past_sequence", 4]
    nodes = [helper.make_node("ReduceSum", ["k"], ["ks"], keepdims=0), helper.make_node("Identity", ["v"], ["y"])]
    return tiny_model(nodes, [helper.make_tensor_value_info("ids", TensorProto.INT64, ["batch", 1]),
                              helper.make_tensor_value_info("mask", TensorProto.INT64, ["batch", "past_sequence + 1"]),
                              helper.make_tensor_value_info("k", TensorProto.FLOAT, cache),
                              helper.make_tensor_value_info("v", TensorProto.FLOAT, cache)],
                      [helper.make_tensor_value_info("y", TensorProto.FLOAT, cache),
                       helper.make_tensor_value_info("ks", TensorProto.FLOAT, None)], [])


def test_a_profile_may_name_dimensions_instead_of_inputs(cached_model):
    """A decoder's 60 cache inputs share one symbolic shape: `past_sequence=1024` sets them all, and the mask's
    `past_sequence + 1` is worked out; inputs named keep their shapes."""
    short, long = arrange([parse_profile("batch=1;past_sequence=1024"),  # the heaviest first
                           parse_profile("batch=2;past_sequence=128;ids=2,1@3")], cached_model)
    assert (short.label, short.weight) == ("batch=2;past_sequence=128;ids=2,1", 3.0)
    assert dict(short.shapes) == {"ids": (2, 1), "mask": (2, 129), "k": (2, 2, 128, 4), "v": (2, 2, 128, 4)}
    assert dict(long.shapes) == {"ids": (1, 1), "mask": (1, 1025), "k": (1, 2, 1024, 4), "v": (1, 2, 1024, 4)}
    with pytest.raises(InputError, match="no value for dimension 'batch' of input 'ids'"):
        arrange([parse_profile("past_sequence=16")], cached_model)
    with pytest.raises(InputError, match=r"unknown input\(s\) or dimension\(s\) past; .* dimensions are batch, "
                                         r"past_sequence$"):
        arrange([parse_profile("batch=1;past=16")], cached_model)
    with pytest.raises(InputError, match="a dimension takes one number"):
        arrange([parse_profile("batch=1,2;past_sequence=16")], cached_model)
    with pytest.raises(InputError, match="same shapes"):  # the same shapes, said two ways
        arrange([parse_profile("batch=1;past_sequence=8"), parse_profile("batch=1;past_sequence=8;ids=1,1")],
                cached_model)


def test_a_text_model_gets_sequence_16_and_128_by_default(text_model, matmul_model):
    assert [p.label for p in default_profiles(text_model)] == [
        "input_ids=1,16;attention_mask=1,16", "input_ids=1,128;attention_mask=1,128"]
    assert default_profiles(matmul_model) == []  # a float input: no guess, the graph layer's 1 with a warning


def test_instantiate_fixes_only_the_inputs(text_model):
    fixed = instantiate(text_model, {"input_ids": (2, 5), "attention_mask": (2, 5)})
    dims = [[d.dim_value for d in vi.type.tensor_type.shape.dim] for vi in fixed.graph.input]
    assert dims == [[2, 5], [2, 5]]
    assert text_model.graph.input[0].type.tensor_type.shape.dim[0].dim_param == "batch"  # the original untouched


def test_combine_is_the_weighted_geometric_mean_of_speedups_and_bounds():
    ratios = [Ratio(1.2, 1.1, 1.3, 0.95), Ratio(0.9, 0.85, 0.95, 0.95)]
    both = combine(ratios, [3.0, 1.0])
    assert both.median == pytest.approx(math.exp((3 * math.log(1.2) + math.log(0.9)) / 4))
    assert both.low == pytest.approx(math.exp((3 * math.log(1.1) + math.log(0.85)) / 4))
    assert ratios[1].slower and not ratios[0].slower
    assert both.low > 1.0 and both.slower_at == (1,)
    assert not both.faster  # the mean is above 1, but it is measurably slower at the second profile: the gate's rule


def test_searches_screen_candidates_by_the_gates_rule():
    """A candidate faster on the mean but measurably slower at one profile is not a step (greedy stepped to one once,
    and the gate then refused the whole search's output)."""
    slow_somewhere = combine([Ratio(1.3, 1.2, 1.4, 0.95), Ratio(0.95, 0.92, 0.98, 0.95)], [3.0, 1.0])
    everywhere_ok = combine([Ratio(1.1, 1.05, 1.15, 0.95), Ratio(1.0, 0.97, 1.03, 0.95)], [3.0, 1.0])
    assert fastest([("slow somewhere", slow_somewhere), ("ok", everywhere_ok)]) == ("ok", everywhere_ok)
    assert fastest([("slow somewhere", slow_somewhere)]) is None


def _measured_as(monkeypatch, speedups: list[Ratio]):
    """The gate's comparisons report `speedups[i]` at profile i (in the graph's order, primary first)."""
    gate = importlib.import_module("rlflow.measure.gate")
    real_compare, calls = gate.compare, []

    def measured(models, settings, **kwargs):
        comparison = real_compare(models, settings, **{**kwargs, "rounds": 2, "blocks": 1})
        comparison.ratios[1] = speedups[len(calls)]
        calls.append(models)
        return comparison

    monkeypatch.setattr(importlib.import_module("rlflow.optimize.pipeline"), "greedy", _accept_first_candidate)
    monkeypatch.setattr(gate, "compare", measured)
    return calls


def test_a_rewrite_slower_at_one_profile_is_not_kept(text_model, tmp_path, monkeypatch):
    calls = _measured_as(monkeypatch, [Ratio(1.30, 1.20, 1.40, 0.95), Ratio(0.95, 0.92, 0.98, 0.95)])
    result = rlflow.optimize(save(text_model, tmp_path / "m.onnx"), method="greedy", time_limit=5,
                             profiles=[parse_profile(S16 + "@3"), parse_profile(S64)])
    assert result.gate.low > 1.0  # faster on the weighted mean...
    assert not result.rewritten and "measurably slower at profile " + S64 in result.reason  # ...but not at every one
    assert [p["label"] for p in result.profiles] == [S16, S64] and result.profiles[1]["speedup"]["high"] == 0.98
    shapes = [[[d.dim_value for d in vi.type.tensor_type.shape.dim] for vi in pair[0].graph.input] for pair in calls]
    assert shapes == [[[1, 16], [1, 16]], [[1, 64], [1, 64]]]  # one measurement per profile, at its shapes
    assert result.settings["profiles"] == [p.as_dict() for p in (parse_profile(S16 + "@3"), parse_profile(S64))]
    assert {"input_ids": (1, 64), "attention_mask": (1, 64)} in result.verification.shapes


def test_a_rewrite_kept_when_the_weights_make_it_pay_and_no_profile_is_slower(text_model, tmp_path, monkeypatch):
    _measured_as(monkeypatch, [Ratio(1.30, 1.20, 1.40, 0.95), Ratio(0.99, 0.95, 1.02, 0.95)])
    result = rlflow.optimize(save(text_model, tmp_path / "m.onnx"), method="greedy", time_limit=5,
                             profiles=[parse_profile(S16 + "@3"), parse_profile(S64)])
    assert result.rewritten and result.reason.endswith("(weighted geometric mean over 2 profiles)")
    assert result.speedup == combine([Ratio(1.30, 1.20, 1.40, 0.95), Ratio(0.99, 0.95, 1.02, 0.95)], [3, 1])
    report = importlib.import_module("rlflow.optimize.report").format_report(result)
    assert f"{S16} (75% of traffic)" in report and f"{S64} (25% of traffic)" in report


def test_a_text_model_given_no_shapes_is_measured_at_the_default_profiles(text_model, tmp_path):
    result = rlflow.optimize(save(text_model, tmp_path / "m.onnx"), method="greedy", time_limit=3)
    assert [p["label"] for p in result.profiles] == [p.label for p in default_profiles(text_model)]
    assert all(p["input_ms"] > 0 for p in result.profiles)
    assert result.settings["input_shapes"] == {"input_ids": [1, 16], "attention_mask": [1, 16]}


def test_the_search_measures_its_candidates_at_every_profile(text_model, monkeypatch):
    from rlflow.graph.core import Graph
    from rlflow.measure.session import SessionSettings
    from rlflow.measure.shape_profiles import attach
    from rlflow.search import candidates, selection

    profiles = arrange([parse_profile(S16), parse_profile(S64)], text_model)
    graph = Graph.from_model(text_model, profiles[0].shapes)
    attach(graph, profiles)
    pool = candidates.expand(graph)
    assert pool and all(c.graph.profiles == graph.profiles for c in pool)  # rewrites keep the profiles
    profiled = importlib.import_module("rlflow.measure.profile_comparison")
    real_compare, seen = profiled.compare, []

    def counting(models, settings, **kwargs):
        seen.append(tuple(d.dim_value for d in models[0].graph.input[0].type.tensor_type.shape.dim))
        return real_compare(models, settings, **{**kwargs, "rounds": 3})

    monkeypatch.setattr(profiled, "compare", counting)
    screening = selection.measure_against(graph, pool[:1], SessionSettings(threads=1), rounds=3, seed=0)
    assert seen == [(1, 16), (1, 64)] and len(screening.pairs) == 1


@pytest.mark.parametrize("args, message", [
    (["--profile", "input_ids=1,x"], "bad profile"),
    (["--profile", S16, "--input-shape", "input_ids:1,16"], "not both"),
    (["--profile", "input_ids=1,16;mask=1,16"], "unknown input"),
    (["--profile", "input_ids=1,16"], "no shape for the dynamic input 'attention_mask'"),
    (["--profile", "input_ids=1,16,1;attention_mask=1,16"], "has 2 dimensions, not 3"),
    (["--profiles", "no-such-file.txt"], "cannot read profiles"),
])
def test_bad_profiles_exit_2_with_one_line(text_model, tmp_path, capsys, args, message):
    path = save(text_model, tmp_path / "m.onnx")
    out = tmp_path / "out.onnx"
    assert main(["optimize", path, "-o", str(out), "--time-limit", "1", *args]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0]
    assert not out.exists()


def test_bench_measures_rewritten_outputs_at_every_profile(text_model, tmp_path, monkeypatch):
    import csv

    from rlflow.bench.run import BenchConfig, run_bench

    monkeypatch.setattr(importlib.import_module("rlflow.optimize.pipeline"), "greedy", _accept_first_candidate)
    _measured_as(monkeypatch, [Ratio(1.30, 1.20, 1.40, 0.95), Ratio(1.10, 1.05, 1.15, 0.95)])
    path = save(text_model, tmp_path / "m.onnx")
    config = BenchConfig(methods=("greedy",), time_limit=2, rounds=3, profiles=(S16, S64))
    results = run_bench([tmp_path / "m.onnx"], config, tmp_path / "out", progress=False)
    (row,) = results["rows"]
    assert row["rewritten"] and [p["label"] for p in row["profiles"]] == [S16, S64], path
    assert row["speedup"] == pytest.approx(math.exp(sum(math.log(p["speedup"]) for p in row["profiles"]) / 2))
    with open(tmp_path / "out" / "results.csv") as f:
        assert S64 in next(csv.DictReader(f))["profiles"]
    assert "## Per profile" in (tmp_path / "out" / "results.md").read_text()


def test_bench_hands_a_peer_the_dynamic_model_and_measures_it_at_every_profile(text_model, tmp_path, monkeypatch):
    """With several profiles rlflow's output must run at all of them: a peer gets the model as the user has it (a
    peer handed the primary profile's static model folded its shape computations and was timed there only)."""
    from rlflow.bench import run as module

    given = []

    def identity_peer(name, model, folder, **options):
        given.append(model)
        return model, model

    monkeypatch.setattr(module, "run_peer", identity_peer)
    save(text_model, tmp_path / "m.onnx")
    config = module.BenchConfig(methods=(), peers=("onnxsim",), rounds=3, profiles=(S16, S64))
    (row,) = module.run_bench([tmp_path / "m.onnx"], config, tmp_path / "out", progress=False)["rows"]
    assert row["method"] == "onnxsim" and row["status"] == "ok", row
    assert [p["label"] for p in row["profiles"]] == [S16, S64]
    dims = [d for vi in given[0].graph.input for d in vi.type.tensor_type.shape.dim]
    assert any(d.dim_param for d in dims)  # dynamic, as written
