"""`rlflow optimize` end to end: real exports, the verification gate, the report."""
from __future__ import annotations

import importlib
import json

import numpy as np
import onnx
import onnxruntime as ort
import pytest

import rlflow
from rlflow.cli import main
from rlflow.graph.core import load
from rlflow.measure.verify import verify
from rlflow.optimize.pipeline import verification_shapes
from rlflow.optimize.report import _by_rule, _shapes_text, format_report
from rlflow.rewrites import RULES, rule
from tests.conftest import save


def _optimize_cli(model_path, tmp_path, *extra):
    out = tmp_path / "out.onnx"
    report = tmp_path / "report.json"
    code = main(["optimize", str(model_path), "-o", str(out), "--json", str(report), "--time-limit", "8",
                 "--quiet", *extra])
    return code, out, json.loads(report.read_text())


def test_transformer_from_pytorch(transformer_path, tmp_path):
    before = open(transformer_path, "rb").read()
    code, out, report = _optimize_cli(transformer_path, tmp_path, "--input-shape", "x:2,16,32")
    assert code == 0 and out.exists()
    assert open(transformer_path, "rb").read() == before, "the input must never be modified"
    written = onnx.load(str(out))
    assert written.graph.input[0].type.tensor_type.shape.dim[0].dim_param == "batch", "dynamic dims stay dynamic"
    ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    check = verify(onnx.load(transformer_path), written, seeds=(11, 12), shapes=[{"x": (1, 16, 32)}, {"x": (3, 16, 32)}])
    assert check.ok, check.message
    assert report["settings"]["threads"] == 1 and report["settings"]["opt_level"] == "all"
    assert report["settings"]["input_shapes"] == {"x": [2, 16, 32]}
    assert report["speedup"]["low"] <= report["speedup"]["median"] <= report["speedup"]["high"]
    assert report["op_counts"]["before"]["MatMul"] >= 6


def test_cnn_opset9_ir3(cnn_opset9_ir3_path, tmp_path):
    code, out, report = _optimize_cli(cnn_opset9_ir3_path, tmp_path)
    assert code == 0
    written = onnx.load(str(out))
    assert [i.name for i in written.graph.input] == ["image"] or report["rewritten"] is False
    check = verify(onnx.load(cnn_opset9_ir3_path), written, seeds=(21, 22))
    assert check.ok, check.message


def test_library_call_and_report(tmp_path, matmul_model):
    path = save(matmul_model, tmp_path / "m.onnx")
    result = rlflow.optimize(path, time_limit=2, rounds=5)
    if result.rewritten:
        assert result.comparison.rounds == 5
    else:  # the output is the input: speedup exactly 1, never a noisy self-comparison
        assert result.comparison.rounds == 0 and str(result.speedup) == "1.000x [1.000, 1.000]"
        assert "the output is the input" in format_report(result)
    assert result.settings["provider"] == "CPUExecutionProvider"
    text = format_report(result)
    for heading in ("result", "latency", "speedup", "verified", "rewrites", "operators", "settings"):
        assert f"  {heading}" in text
    out = result.save(tmp_path / "o.onnx")
    assert verify(matmul_model, onnx.load(str(out)), shapes=[{"x": (4, 8)}]).ok


def test_the_default_method_is_the_agent_on_the_provider_it_was_trained_for_else_greedy(tmp_path, monkeypatch):
    """Each shipped agent is the default where it learnt: default.pt on the CPU, cuda.pt on CUDA; an agent of the
    other provider leaves greedy search the default."""
    import shutil

    from rlflow.optimize.options import default_method
    from rlflow.search import agent as module
    from rlflow.search.agent import CUDA_AGENT, DEFAULT_AGENT, trained_provider

    assert trained_provider() == "cpu" and trained_provider(CUDA_AGENT) == "cuda"
    assert default_method("CPUExecutionProvider") == ("agent", None)
    assert default_method("CUDAExecutionProvider") == ("agent", None)
    monkeypatch.setattr(module, "CUDA_AGENT", tmp_path / "absent.pt")  # an installation without the CUDA agent
    assert default_method("CUDAExecutionProvider") == (
        "greedy", "the shipped agent is trained for cpu, not CUDAExecutionProvider; --method agent runs it anyway")
    bare = tmp_path / "bare.pt"  # no provenance file beside it: the checkpoint's own training config answers
    shutil.copy(DEFAULT_AGENT.with_name("ppo.pt"), bare)
    assert trained_provider(bare) == "cpu"
    cuda = tmp_path / "cuda.pt"
    shutil.copy(bare, cuda)
    cuda.with_suffix(".json").write_text(json.dumps({"provider": "cuda"}))
    assert default_method("CUDAExecutionProvider", cuda) == ("agent", None)
    assert default_method("CPUExecutionProvider", cuda)[0] == "greedy"


def test_the_default_method_is_greedy_where_rules_the_agent_never_learnt_match(monkeypatch):
    """An agent trained before a rule existed never plays it (the shipped CPU agent knows no decoder fusion): on a
    model such a rule matches (an RMSNorm) the default is greedy search, which measures it, and says why; where only
    rules it knows match, the agent.  The agent's rules are narrowed here, so that the test holds whichever agent
    ships."""
    from rlflow.optimize.options import default_method
    from rlflow.search import agent as module
    from tests.rewrites.test_rmsnorm import rms

    known = [r.name for r in RULES if r.name != "rmsnorm-fusion"]
    monkeypatch.setattr(module, "agent_rules", lambda path=None: known)
    monkeypatch.setattr(module, "offered_rules", lambda path=None: None)  # every known rule played in training
    method, reason = default_method("CPUExecutionProvider", graph=rms())
    assert method == "greedy" and reason.startswith("the shipped agent never learnt rmsnorm-fusion")
    no_norm = rms(centred=True)  # centred: a bias-free layer norm (layernorm-fusion's), no RMSNorm to fuse
    assert not rule("rmsnorm-fusion").find(no_norm) and rule("layernorm-fusion").find(no_norm)
    assert default_method("CPUExecutionProvider", graph=no_norm) == ("agent", None)


def test_a_rule_never_offered_in_training_counts_as_never_learnt(tmp_path):
    """A checkpoint's registry may hold a rule that never matched in its training (a decoder fusion for an agent
    trained on encoders): its provenance file lists the rules offered, and where one outside them matches, greedy is
    the default."""
    import json
    import shutil

    from rlflow.optimize.options import default_method
    from rlflow.search import agent as module
    from tests.rewrites.test_rmsnorm import rms

    shutil.copy(module.DEFAULT_AGENT, tmp_path / "a.pt")
    meta = json.loads(module.DEFAULT_AGENT.with_suffix(".json").read_text())
    offered = [name for name in module.agent_rules() if name != "rmsnorm-fusion"]
    (tmp_path / "a.json").write_text(json.dumps({**meta, "rules_offered": offered}))
    assert "rmsnorm-fusion" in module.agent_rules(tmp_path / "a.pt")
    method, reason = default_method("CPUExecutionProvider", tmp_path / "a.pt", rms())
    assert method == "greedy" and reason.startswith("the given agent never learnt rmsnorm-fusion")
    (tmp_path / "a.json").write_text(json.dumps({**meta, "rules_offered": offered + ["rmsnorm-fusion"]}))
    assert default_method("CPUExecutionProvider", tmp_path / "a.pt", rms()) == ("agent", None)


def test_a_fold_rule_the_agent_never_learnt_leaves_it_the_default(monkeypatch):
    """`shape-dim-fold` matches most exports (a dimension read from a Shape): a fold rule the agent never learnt does
    not turn the default to greedy, a fusion it never learnt does."""
    from rlflow.optimize.options import default_method
    from rlflow.search import agent as module
    from tests.rewrites.test_fold import _reshape_by_dim

    graph = _reshape_by_dim(2)
    assert rule("shape-dim-fold").find(graph)
    known = [name for name in module.agent_rules() if name != "shape-dim-fold"]
    monkeypatch.setattr(module, "agent_rules", lambda path=None: known)
    assert default_method("CPUExecutionProvider", graph=graph) == ("agent", None)


def test_a_rule_for_the_cpu_optimizer_alone_is_not_offered_on_cuda(monkeypatch):
    """`residual-bias-reorder` exists for a quirk of onnxruntime's CPU optimizer: CUDA's rules leave it out, so an
    agent that never learnt it stays the default on CUDA where it matches, and greedy is the default on the CPU."""
    from rlflow.optimize.options import default_method, rules_for
    from rlflow.search import agent as module
    from tests.rewrites.test_layout import _residual_ln

    graph = _residual_ln()
    assert rule("residual-bias-reorder").find(graph)
    known = [name for name in module.agent_rules() if name != "residual-bias-reorder"]
    monkeypatch.setattr(module, "agent_rules", lambda path=None: known)
    cuda_rules = rules_for(RULES, "all", "CUDAExecutionProvider")
    assert "residual-bias-reorder" not in {r.name for r in cuda_rules}
    assert default_method("CUDAExecutionProvider", graph=graph, rules=cuda_rules) == ("agent", None)
    method, reason = default_method("CPUExecutionProvider", graph=graph)
    assert method == "greedy" and "residual-bias-reorder" in reason


def test_a_shipped_cuda_agent_is_the_default_on_cuda_only(tmp_path, monkeypatch):
    """`make agent-cuda` ships rlflow/checkpoints/cuda.pt: installed, it is what method agent plays on CUDA (and what
    the default method picks there); the CPU keeps default.pt."""
    import shutil

    from rlflow.optimize.options import default_method
    from rlflow.search import agent as module

    assert module.shipped_agent("CPUExecutionProvider") == module.DEFAULT_AGENT
    cuda = tmp_path / "cuda.pt"
    monkeypatch.setattr(module, "CUDA_AGENT", cuda)
    assert module.shipped_agent("CUDAExecutionProvider") == module.DEFAULT_AGENT  # none installed
    shutil.copy(module.DEFAULT_AGENT.with_name("ppo.pt"), cuda)
    cuda.with_suffix(".json").write_text(json.dumps({"provider": "cuda"}))
    assert module.shipped_agent("CUDAExecutionProvider") == cuda
    assert module.shipped_agent("CPUExecutionProvider") == module.DEFAULT_AGENT
    assert default_method("CUDAExecutionProvider") == ("agent", None)
    assert default_method("CPUExecutionProvider") == ("agent", None)


def test_a_default_method_other_than_the_agent_is_reported_with_its_reason(tmp_path, matmul_model, monkeypatch):
    module = importlib.import_module("rlflow.optimize.pipeline")  # `rlflow.optimize.pipeline` the attribute is the function
    monkeypatch.setattr(module, "default_method", lambda *args: ("greedy", "a stated reason"))
    result = rlflow.optimize(save(matmul_model, tmp_path / "m.onnx"), time_limit=1, rounds=5)
    assert result.settings["method"] == "greedy" and result.settings["method_reason"] == "a stated reason"
    assert "method greedy (a stated reason), operators all" in format_report(result)
    explicit = rlflow.optimize(save(matmul_model, tmp_path / "m.onnx"), method="greedy", time_limit=1, rounds=5)
    assert explicit.settings["method_reason"] is None and "method greedy, operators" in format_report(explicit)


def test_kept_input_reports_speedup_exactly_one(tmp_path, matmul_model):
    """The output is the input: a self-comparison would only show session noise, so none is reported."""
    path = save(matmul_model, tmp_path / "m.onnx")
    result = rlflow.optimize(path, method="greedy", rules=(), time_limit=2, rounds=5)
    assert not result.rewritten and result.comparison.rounds == 0 and result.comparison.extra["unchanged"]
    assert str(result.speedup) == "1.000x [1.000, 1.000]" and not result.speedup.faster
    before, after = result.comparison.timings
    assert before.median_ms == after.median_ms > 0
    assert "1x: the output is the input" in format_report(result)


def test_verification_shapes_vary_dynamic_dimensions(tmp_path, matmul_model):
    graph = load(save(matmul_model, tmp_path / "m.onnx"), {"x": (2, 8)})
    assert verification_shapes(graph) == [{"x": (2, 8)}, {"x": (3, 8)}]


def test_rewrites_are_kept_only_when_verified(cnn_opset9_ir3_path, monkeypatch):
    """A rewrite that breaks the numbers must never reach the output, whatever it measures."""
    from rlflow.rewrites.substitutions import fold

    pipeline = importlib.import_module("rlflow.optimize.pipeline")  # `rlflow.optimize.pipeline` itself is the function

    original = fold.ConvBatchNorm.rewrite

    def broken(self, graph, match, nodes):
        original(self, graph, match, nodes)
        for node in reversed(graph.gs.nodes):  # the Conv the rewrite just added
            if node.op == "Conv":
                weight = node.inputs[1]
                node.inputs[1] = graph.add_constant(np.asarray(weight.values) * 1.5, "broken")
                break

    monkeypatch.setattr(fold.ConvBatchNorm, "rewrite", broken)
    # Accept any candidate so the gate, not the measurement, must stop it.
    monkeypatch.setattr(pipeline, "greedy", _accept_first_candidate)
    result = rlflow.optimize(cnn_opset9_ir3_path, method="greedy", time_limit=5, rounds=5)
    assert not result.rewritten and "does not verify" in result.reason
    assert result.verification is not None and not result.verification.ok


@pytest.mark.parametrize("interval, kept", [((0.97, 1.05), False), ((1.001, 1.04), True)])
def test_rewrites_are_kept_only_when_measurably_faster(cnn_opset9_ir3_path, monkeypatch, interval, kept):
    """A verified rewrite whose speedup interval reaches 1 or below is not handed back: it shows no gain."""
    from rlflow.measure.timing import Ratio

    pipeline = importlib.import_module("rlflow.optimize.pipeline")
    gate = importlib.import_module("rlflow.measure.gate")
    real_compare = gate.compare

    def measured(models, settings, **kwargs):
        comparison = real_compare(models, settings, **{**kwargs, "rounds": 2, "blocks": 1})
        comparison.ratios[1] = Ratio(sum(interval) / 2, *interval, 0.95)
        return comparison

    monkeypatch.setattr(pipeline, "greedy", _accept_first_candidate)
    monkeypatch.setattr(gate, "compare", measured)
    result = rlflow.optimize(cnn_opset9_ir3_path, method="greedy", time_limit=5)
    assert result.verification.ok and result.rewritten is kept
    expected = "rewritten: measurably faster" if kept else "input kept: the rewritten model is not measurably faster"
    assert result.reason.startswith(expected)
    assert result.gate.low == interval[0] and result.as_dict()["gate"]["high"] == interval[1]  # on record either way
    assert result.outcome == ("rewritten" if kept else "gate rejected") == result.as_dict()["outcome"]


def _accept_first_candidate(graph, settings, config, rules, progress=False):
    from rlflow.search.candidates import SearchResult, expand

    first = expand(graph, rules)[0]
    return SearchResult(first.graph, [first.match], 0, 0.0, "test")


def test_unknown_method():
    with pytest.raises(rlflow.InputError, match="unknown method"):
        rlflow.optimize("whatever.onnx", method="magic")


@pytest.mark.parametrize("unmeasured, expected", [(0, "nothing found"), (3, "out of time")])
def test_a_kept_input_says_whether_time_left_candidates_unmeasured(cnn_opset9_ir3_path, monkeypatch, unmeasured,
                                                                   expected):
    from rlflow.search.candidates import SearchResult

    pipeline = importlib.import_module("rlflow.optimize.pipeline")
    monkeypatch.setattr(pipeline, "greedy", lambda graph, *args, **kwargs: SearchResult(
        graph, [], 1, 0.1, "time limit", candidates_unmeasured=unmeasured))
    result = rlflow.optimize(cnn_opset9_ir3_path, method="greedy", time_limit=5)
    assert not result.rewritten and result.outcome == expected == result.as_dict()["outcome"]
    assert result.as_dict()["candidates_unmeasured"] == unmeasured
    assert result.as_dict()["search"] == {"stop_reason": "time limit", "steps": []}  # why the search ended
    assert "stopped: time limit" in format_report(result)


def test_ops_standard_leaves_out_every_rule_with_contrib_output(monkeypatch):
    """`--ops standard`: the search gets only rules whose output stays in the default domain (the fusions into
    onnxruntime's operators are left out; the unfusing inverses stay), and the report says any runtime runs it."""
    from pathlib import Path

    from rlflow.rewrites import RULES
    from rlflow.search.candidates import SearchResult

    pipeline = importlib.import_module("rlflow.optimize.pipeline")
    given = {}

    def search(graph, settings, config, rules, **kwargs):
        given["rules"] = list(rules)
        return SearchResult(graph, [], 0, 0.1, "nothing")

    monkeypatch.setattr(pipeline, "greedy", search)
    bert = Path(__file__).parent / "fixtures" / "exports" / "bert-tiny-dynamo.onnx"
    result = rlflow.optimize(bert, method="greedy", ops="standard", input_shapes={"input_ids": (1, 8),
                                                                                   "attention_mask": (1, 8)})
    names = {r.name for r in given["rules"]}
    assert names == {r.name for r in RULES if not r.contrib} and "attention-fusion" not in names
    assert "attention-unfuse" in names and result.settings["ops"] == "standard"
    assert result.runs_on.startswith("any ONNX runtime") and "runs on     any ONNX runtime" in format_report(result)
    with pytest.raises(rlflow.InputError, match="unknown operator set"):
        rlflow.optimize(bert, method="greedy", ops="mine")


def test_runs_on_names_the_contrib_operators_of_the_output():
    from pathlib import Path

    from rlflow.optimize.result import runtimes
    from rlflow.rewrites import apply, rule

    graph = load(Path(__file__).parent / "fixtures" / "exports" / "bert-tiny-dynamo.onnx",
                 {"input_ids": (1, 8), "attention_mask": (1, 8)})
    fused = apply(graph, rule("attention-fusion").find(graph)[0])
    assert runtimes(fused) == "onnxruntime only (com.microsoft operators: MultiHeadAttention)"
    assert runtimes(graph) == "any ONNX runtime (standard operators only)"


def test_cuda_graph_without_cuda_is_one_clear_error(tmp_path, matmul_model, capsys):
    path = save(matmul_model, tmp_path / "m.onnx")
    with pytest.raises(rlflow.errors.InputError, match="--cuda-graph needs the CUDA provider; this run's is "
                                                      "CPUExecutionProvider"):
        rlflow.optimize(path, provider="cpu", cuda_graph=True)
    assert main(["optimize", str(path), "--provider", "cpu", "--cuda-graph"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "error: --cuda-graph needs the CUDA provider; this run's is CPUExecutionProvider"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.onnx"]  # nothing written


def test_the_report_says_when_it_was_measured_with_cuda_graph_capture(tmp_path, matmul_model):
    result = rlflow.optimize(save(matmul_model, tmp_path / "m.onnx"), method="greedy", time_limit=1, rounds=5)
    assert "cuda_graph" not in result.settings and "CPUExecutionProvider, 1 thread(s)" in format_report(result)
    result.settings["cuda_graph"] = True
    assert "CPUExecutionProvider, CUDA graph capture, 1 thread(s)" in format_report(result)


@pytest.mark.parametrize("cuda_graph, first_dim", [(True, 2), (False, "batch")])
def test_with_cuda_graph_the_input_is_timed_as_its_static_export(tmp_path, matmul_model, monkeypatch, cuda_graph,
                                                                 first_dim):
    """A dynamic input computes its shapes on the CPU, and onnxruntime refuses to capture it (BERT-L4 on an H200):
    captured, the input is checked and timed as the search and the final measurement run it."""
    module = importlib.import_module("rlflow.optimize.pipeline")
    monkeypatch.setattr(module, "resolve_provider", lambda name: "CUDAExecutionProvider")
    seen = []

    class Stop(Exception):
        pass

    def check_and_time(model, settings, **kwargs):
        seen.append((model, settings))
        raise Stop

    monkeypatch.setattr(module, "check_and_time", check_and_time)
    with pytest.raises(Stop):
        rlflow.optimize(save(matmul_model, tmp_path / "m.onnx"), method="greedy", cuda_graph=cuda_graph,
                        input_shapes={"x": (2, 8)})
    model, settings = seen[0]
    assert settings.cuda_graph is cuda_graph
    dim = model.graph.input[0].type.tensor_type.shape.dim[0]
    assert (dim.dim_value if dim.HasField("dim_value") else dim.dim_param) == first_dim


def test_rules_for_leave_out_what_the_output_could_not_use():
    """`standard` drops every contrib rule; CUDA drops the rules emitting an operator it has no kernel for (FusedGemm),
    which would run on the CPU and refuse CUDA graph capture, and the one made for the CPU optimizer alone; the CPU
    keeps them all."""
    from rlflow.optimize.options import rules_for
    from rlflow.rewrites import RULES

    names = lambda rules: {r.name for r in rules}  # noqa: E731
    assert rules_for(RULES, "all", "CPUExecutionProvider") == list(RULES)
    on_cuda = names(rules_for(RULES, "all", "CUDAExecutionProvider"))
    assert names(RULES) - on_cuda == {"gemm-activation-fusion", "residual-bias-reorder"}
    assert {"attention-fusion", "bias-gelu-fusion", "conv-activation-fusion"} <= on_cuda
    standard = rules_for(RULES, "standard", "CUDAExecutionProvider")
    assert standard and not any(r.contrib for r in standard)


def test_the_report_gives_a_decoder_s_cache_shapes_once():
    """A decoder step's 60 cache inputs of one shape: one entry per name pattern, not one per layer."""
    shapes = {"input_ids": [1, 1], "attention_mask": [1, 129]}
    shapes.update({f"past_key_values.{i}.{kv}": [1, 3, 128, 64] for i in range(30) for kv in ("key", "value")})
    assert _shapes_text(shapes) == ("input_ids [1, 1], attention_mask [1, 129], past_key_values.{0..29}.key "
                                    "[1, 3, 128, 64], past_key_values.{0..29}.value [1, 3, 128, 64]")
    assert _shapes_text({"x1": [1], "x3": [1], "y": [2]}) == "x{1,3} [1], y [2]"
    assert _shapes_text({"l1.h2": [3], "l2.h3": [3]}) == "l1.h2 [3], l2.h3 [3]"  # two numbers vary: kept apart
    assert _by_rule(["rotary-fusion@a", "rmsnorm-fusion@b", "rotary-fusion@c"]) == "rotary-fusion x2, rmsnorm-fusion"


def test_a_default_time_limit_leaves_room_for_enough_candidates():
    """A model slow to measure (a 1 GB decoder's step at two cache lengths) gets more than the default search time,
    enough for greedy's whole first step and for every candidate the agent's pool holds; a fast one keeps it."""
    from pathlib import Path

    from rlflow.measure.timing import Pace
    from rlflow.optimize.pipeline import SEARCH_CANDIDATES, _default_time_limit, _planned_candidates
    from rlflow.rewrites import RULES
    from rlflow.search.agent import MEASURE_SHARE
    from rlflow.search.fuse_everything import VARIANTS_MEASURED
    from rlflow.search.greedy import step_size

    fast = Pace({"session": 0.05, "run": 0.001, "export": 0.01})
    assert _default_time_limit("greedy", [fast, fast], 8) == 60.0 and _default_time_limit("agent", [fast], 2) == 10.0
    slow = Pace({"session": 3.0, "run": 0.06, "export": 1.5})
    candidate = slow.block_seconds(2, exports=2, rounds=9)  # the candidate and the input exported at the profile
    assert candidate > Pace({"session": 3.0, "run": 0.06}).block_seconds(2, rounds=9) + 2.9
    built = 1.5  # building it: about one export
    assert _default_time_limit("greedy", [slow, slow], 16) == pytest.approx(16 * (2 * candidate + built))
    # the agent's measurement gets MEASURE_SHARE of its limit, and its pool holds the policy's graph and both
    # fuse-everything variants: its default affords them all
    assert SEARCH_CANDIDATES["agent"] == 1 + VARIANTS_MEASURED
    agent = _default_time_limit("agent", [slow], SEARCH_CANDIDATES["agent"])
    assert MEASURE_SHARE * agent == pytest.approx(SEARCH_CANDIDATES["agent"] * (candidate + built)) and agent > 10
    bert = load(Path(__file__).parent / "fixtures" / "exports" / "bert-tiny-dynamo.onnx", {"input_ids": (1, 8), "attention_mask": (1, 8)})
    assert _planned_candidates("greedy", bert, RULES) == 2 * step_size(bert, RULES) > SEARCH_CANDIDATES["greedy"]
    assert _planned_candidates("taso", bert, RULES) == SEARCH_CANDIDATES["taso"]


@pytest.mark.parametrize("shipped", ["default.pt", "cuda.pt"])
def test_both_shipped_agents_load_under_this_registry_and_play_a_small_model(shipped):
    """Each shipped checkpoint loads (its registry is this one or one it extends) and plays a tiny BERT export to a
    verified result; the report names the checkpoint and its hash."""
    from pathlib import Path

    from rlflow.search.agent import DEFAULT_AGENT

    agent = DEFAULT_AGENT.with_name(shipped)
    bert = Path(__file__).parent / "fixtures" / "exports" / "bert-tiny-dynamo.onnx"
    result = rlflow.optimize(str(bert), method="agent", agent=agent, time_limit=8, rounds=3,
                             input_shapes={"input_ids": (1, 16), "attention_mask": (1, 16)})
    assert result.settings["agent"]["path"] == f"rlflow/checkpoints/{shipped}"
    assert result.outcome in ("rewritten", "gate rejected", "not verified", "out of time", "nothing found")
    assert result.verification is None or result.verification.ok


def test_the_report_says_when_verification_skipped_a_shape_set(tmp_path, matmul_model):
    """A shape set the input itself cannot run is skipped by verification (tests/measure/test_verify.py); the report
    says so beside the sets it checked."""
    from dataclasses import replace

    from rlflow.measure.verify import Verification

    result = rlflow.optimize(save(matmul_model, tmp_path / "m.onnx"), method="greedy", time_limit=1, rounds=3)
    checked = Verification(True, [], (0, 1, 2), [{"x": (1, 8)}], "disable", extra={"skipped_shapes": [{"x": (2, 9)}]})
    text = format_report(replace(result, verification=checked))
    assert "over seeds [0, 1, 2] and 1 input shape set(s); 1 skipped, the input itself failing to run there" in text
