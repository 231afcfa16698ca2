"""The padding contract (`--padding attention_mask=right`, docs/padding.md): GroupQueryAttention reads the rows'
lengths, and the output computes on a right-padded batch, row by row, what the input computes on each row alone."""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import onnx
import pytest

import rlflow
from rlflow.errors import InputError
from rlflow.measure.bootstrap import Ratio
from rlflow.measure.padding import verify_padded
from rlflow.measure.session import SessionSettings, create_session, run_session
from rlflow.optimize import pipeline
from rlflow.optimize.padding import PADDING_KEY, apply_padding, check_padding, unpadded
from rlflow.optimize.pipeline import load_input
from rlflow.optimize.report import format_report
from rlflow.rewrites.padding import GqaPaddingLengths
from rlflow.search.candidates import Candidate, SearchResult
from rlflow.search.fuse_everything import all_fusions
from tests.conftest import save, tiny_model

MASK = "attention_mask"


@pytest.fixture(scope="module")
def llama_step(tmp_path_factory):
    pytest.importorskip("transformers")
    from rlflow import zoo

    return zoo.build("llama-tiny-decode-p16-ts", tmp_path_factory.mktemp("padding")).path


@pytest.fixture(scope="module")
def fused(llama_step):
    graph, given = load_input(llama_step, None, None)
    return graph, given, all_fusions(Candidate(graph, (), graph.fingerprint())).graph


def _search(graph) -> SearchResult:
    return SearchResult(graph=graph, applied=[], seconds=0.0, candidates_measured=0, stop_reason="test")


def test_the_contract_rewrite_verifies_on_padded_batches(fused):
    graph, given, all_fused = fused
    result, check, outcome = apply_padding(graph, given, _search(all_fused), _ok(), MASK, seed=0)
    assert outcome.applied == 2 and check.ok, check.message
    assert outcome.lengths == [[17, 9, 1], [24, 12, 1]]
    attentions = [n for n in result.graph.gs.nodes if n.op == "GroupQueryAttention"]
    assert all(len(n.inputs) <= 7 and n.inputs[5].inputs[0].op == "Cast" for n in attentions)
    assert "IsNaN" not in result.graph.op_counts()  # the guards of a mask-free attention are dead


def test_the_verifier_catches_a_model_outside_the_contract(fused):
    """The all-fusions graph still masks by the export's bias: on a padded batch it appends each row's new token at
    the end, where the row alone has it at its length."""
    _, given, all_fused = fused
    check = verify_padded(given, all_fused.to_model(static=False), MASK, [dict(all_fused.input_shapes)])
    assert not check.ok and "on a padded batch" in check.message


def test_nothing_changes_where_no_attention_reads_the_mask(fused):
    graph, given, _ = fused
    result, check, outcome = apply_padding(graph, given, _search(graph), _ok(), MASK, seed=0)
    assert outcome.applied == 0 and result.graph is graph and "no GroupQueryAttention" in outcome.reason
    failed = replace(_ok(), ok=False, message="the exact rewrites do not verify")
    result, check, outcome = apply_padding(graph, given, _search(graph), failed, MASK, seed=0)
    assert check is failed and outcome.applied == 0  # the exact search's own verdict stands


def test_the_rule_refuses_a_bias_of_another_input(fused):
    _, _, all_fused = fused
    reasons = {r.reason for r in GqaPaddingLengths("input_ids").reasons(all_fused)}
    assert reasons == {"the bias is not computed from the values of input_ids alone (it reads attention_mask)"}


def test_the_gate_times_both_models_with_the_mask_all_ones(fused):
    graph, given, _ = fused
    ones = unpadded(graph, MASK).to_model(static=False)
    feeds = {vi.name: np.ones(graph.input_shapes[vi.name], onnx.helper.tensor_dtype_to_np_dtype(
        vi.type.tensor_type.elem_type)) for vi in given.graph.input}
    settings = SessionSettings(opt_level="disable")
    names = [o.name for o in given.graph.output]
    expected = run_session(create_session(given, settings), names, feeds)
    feeds[MASK] = np.zeros_like(feeds[MASK])  # values no longer read
    for a, b in zip(expected, run_session(create_session(ones, settings), names, feeds)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_optimize_under_the_contract_writes_it_into_the_output(llama_step, monkeypatch):
    real = pipeline.measure_gate
    timed = []

    def kept(baseline, candidate, *args, **kwargs):  # this test is about what is written, not this machine's clock
        timed.append((baseline, candidate))
        return replace(real(baseline, candidate, *args, **kwargs), ratio=Ratio(2.0, 1.9, 2.1, 0.95))

    def every_fusion(graph, *args, **kwargs):  # nor about which steps greedy measured faster on this machine
        fused = all_fusions(Candidate(graph, (), graph.fingerprint()))
        return SearchResult(graph=fused.graph, applied=list(fused.applied), seconds=0.0, candidates_measured=1,
                            stop_reason="every fusion")

    monkeypatch.setattr(pipeline, "measure_gate", kept)
    monkeypatch.setattr(pipeline, "_search", every_fusion)
    result = rlflow.optimize(llama_step, method="greedy", time_limit=5, rounds=4, padding={MASK: "right"})
    assert result.rewritten and result.padding["applied"] == 2
    assert {p.key: p.value for p in result.output_model.metadata_props}[PADDING_KEY] == f"{MASK}=right"
    assert all(not any(n.op != "Shape" for n in next(t for t in g.gs.inputs if t.name == MASK).outputs)
               for pair in timed for g in pair)
    assert "padding     attention_mask right-padded (declared): 2 GroupQueryAttention" in format_report(result)


@pytest.mark.parametrize("padding,precision,message", [
    ({MASK: "left"}, None, "only right padding can be declared"),
    ({MASK: "right", "other": "right"}, None, "declares one mask"),
    ({MASK: "right"}, "int4", "not supported yet"),
])
def test_contracts_no_run_can_use_are_refused(padding, precision, message):
    with pytest.raises(InputError, match=message):
        check_padding(padding, precision)


def test_a_mask_the_model_lacks_is_refused_before_any_work(tmp_path):
    from onnx import TensorProto, helper

    model = tiny_model([helper.make_node("Relu", ["x"], ["y"])], [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
                       [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])])
    with pytest.raises(InputError, match="names no input of the model: attention_mask"):
        rlflow.optimize(save(model, tmp_path / "m.onnx"), padding={MASK: "right"})


def _ok():
    from rlflow.measure.verify import Verification

    return Verification(True, [], (0,), [], "disable")


@pytest.mark.parametrize("spec,message", [("attention_mask", "bad --padding 'attention_mask'"),
                                          ("attention_mask=left", "only right padding can be declared")])
def test_the_command_refuses_a_bad_contract_in_one_line(tmp_path, capsys, spec, message):
    from onnx import TensorProto, helper

    from rlflow.cli import main

    model = tiny_model([helper.make_node("Relu", ["x"], ["y"])], [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
                       [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])])
    out = tmp_path / "out.onnx"
    assert main(["optimize", str(save(model, tmp_path / "m.onnx")), "-o", str(out), "--padding", spec]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0] and not out.exists()


def test_a_contract_rewrite_that_does_not_verify_leaves_the_exact_result(fused, monkeypatch):
    import importlib

    module = importlib.import_module("rlflow.optimize.padding")  # `rlflow.optimize` is the function, by design

    graph, given, all_fused = fused
    monkeypatch.setattr(module, "verify_padded", lambda *a, **k: replace(_ok(), ok=False, message="logits differ"))
    search = _search(all_fused)
    result, check, outcome = apply_padding(graph, given, search, _ok(), MASK, seed=0)
    assert result is search and check.ok and outcome.applied == 0
    assert outcome.reason == "the rewrite does not verify on padded batches: logits differ"

