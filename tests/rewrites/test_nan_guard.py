"""attention-nan-guard-elim (`rlflow/rewrites/fusions/attention/nan_guard.py`): the exporters' NaN guard after a fused
attention, dropped where every mask is finite and kept where a row can be all -inf (TorchScript's fill, boolean or
float16 masks, a mask read from an input); then on real exports, verified at several shapes."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from onnx import TensorProto

from rlflow.graph.core import load
from rlflow.measure.verify import verify
from rlflow.optimize.pipeline import load_input
from rlflow.rewrites import apply, rule
from rlflow.rewrites.fusions.attention.nan_guard import finite_from_constants
from rlflow.search.candidates import Candidate, all_fusions

from .helpers import assert_refuses, assert_rewrites, graph, node

GUARD = "attention-nan-guard-elim"
MS = "com.microsoft"
EXPORTS = Path(__file__).resolve().parents[1] / "fixtures" / "exports"
LOWEST = np.finfo(np.float32).min


def _guarded(mask: str = "lowest", dtype=np.float32, op: str = "Attention"):
    """An attention over 4 positions (2 heads of 16): the standard `Attention` on [1, 2, 4, 16] heads or onnxruntime's
    `MultiHeadAttention` on [1, 4, 32]; its additive mask `Where(causal, 0, fill)` with fill the lowest float
    (`lowest`, dynamo's) or -inf (`inf`, TorchScript's), a sum of two lowest-filled masks (`sum`: -inf where both
    mask), read from input m (`input`) or absent (`none`); and the exporters' guard after it."""
    elem = TensorProto.FLOAT if dtype == np.float32 else TensorProto.FLOAT16
    shape = [1, 2, 4, 16] if op == "Attention" else [1, 4, 32]
    inputs = {name: (shape, elem) for name in ("q", "k", "v")}
    causal = np.tril(np.ones((4, 4), bool))[None, None]
    fill = {"inf": -np.inf}.get(mask, np.finfo(dtype).min)
    consts = {"causal": causal, "fzero": np.zeros((), dtype), "fill": np.array(fill, dtype), "zero": np.zeros((), dtype)}
    nodes = []
    if mask == "input":
        inputs["m"] = ([1, 1, 4, 4], elem)
        nodes.append(node("Identity", ["m"], "bias"))
    elif mask == "sum":
        nodes += [node("Where", ["causal", "fzero", "fill"], "tri"), node("Add", ["tri", "tri"], "bias")]
    elif mask != "none":
        nodes.append(node("Where", ["causal", "fzero", "fill"], "bias"))
    if op == "Attention":
        nodes.append(node("Attention", ["q", "k", "v", *([] if mask == "none" else ["bias"])], "att"))
    else:
        nodes.append(node("MultiHeadAttention", ["q", "k", "v", *([] if mask == "none" else ["", "", "bias"])], "att",
                          domain=MS, num_heads=2))
    nodes += [node("IsNaN", ["att"], "nan"), node("Where", ["nan", "zero", "att"], "y")]
    return graph(nodes, inputs, {"y": (elem, shape)}, consts=consts, opset=23)


CASES = {GUARD: (_guarded, lambda: _guarded("inf"), "its additive mask is not provably finite")}


@pytest.mark.parametrize("mask", ["lowest", "none"])
def test_the_guard_goes_where_every_mask_is_finite(mask):
    out = assert_rewrites(_guarded(mask), GUARD, count=1)
    assert not any(n.op == "IsNaN" for n in out.gs.nodes)


@pytest.mark.parametrize("mask", ["lowest", "none"])
def test_after_onnxruntimes_multi_head_attention_too(mask):
    g = _guarded(mask, op="MultiHeadAttention")
    (match,) = rule(GUARD).find(g)
    result = verify(g.to_model(), apply(g, match).to_model())
    assert result.ok, result.message


@pytest.mark.parametrize("mask, dtype, reason", [
    ("inf", np.float32, "not provably finite"),
    ("sum", np.float32, "not provably finite"),
    ("input", np.float32, "not provably finite"),
    ("lowest", np.float16, "its additive mask is float16")])
@pytest.mark.parametrize("op", ["Attention", "MultiHeadAttention"])
def test_the_guard_stays_where_a_row_can_be_all_minus_infinity(mask, dtype, reason, op):
    assert_refuses(_guarded(mask, dtype, op), GUARD, reason)


def test_a_guard_on_anything_but_an_attention_stays():
    g = graph([node("Relu", ["x"], "r"), node("IsNaN", ["r"], "nan"), node("Where", ["nan", "zero", "r"], "y")],
              {"x": [2, 3]}, consts={"zero": np.zeros((), np.float32)})
    assert_refuses(g, GUARD, "not a fused attention's output")


def test_finite_from_constants_follows_values_not_conditions():
    g = _guarded("lowest")
    bias = next(n for n in g.gs.nodes if n.op == "Attention").inputs[3]
    assert finite_from_constants(bias)
    assert not finite_from_constants(next(n for n in _guarded("inf").gs.nodes if n.op == "Where").outputs[0])


def test_dynamo_bert_loses_its_guards_and_computes_the_same():
    """The tiny BERT's dynamo export masks with the lowest float: after every fusion no guard is left, at any
    sequence length."""
    shapes = {"input_ids": (1, 8), "attention_mask": (1, 8)}
    g = load(EXPORTS / "bert-tiny-dynamo.onnx", shapes)
    done = all_fusions(Candidate(g, (), g.fingerprint()))
    fused = done.graph
    assert GUARD in {m.rule for m in done.applied}
    assert not any(n.op == "IsNaN" for n in fused.gs.nodes)
    reference = g.to_model(static=False)
    sizes = [{"input_ids": [b, s], "attention_mask": [b, s]} for b, s in ((1, 8), (2, 5), (1, 33))]
    result = verify(reference, fused.to_model(static=False), shapes=sizes)
    assert result.ok, result.message


def test_a_torchscript_decode_step_keeps_its_guards_until_it_masks_by_itself(tmp_path):
    """The tiny Llama's TorchScript decode step fills its mask with -inf: the guards stay; declared unpadded
    (`--fix-value attention_mask=1`) every GroupQueryAttention masks by itself and the guards go."""
    pytest.importorskip("transformers")
    from rlflow import zoo

    step = zoo.build("llama-tiny-decode-p16-ts", tmp_path).path
    graph, _ = load_input(step, None, None)
    fused = all_fusions(Candidate(graph, (), graph.fingerprint())).graph
    assert any(n.op == "IsNaN" for n in fused.gs.nodes)
    assert_refuses(fused, GUARD, "not provably finite")
    graph, given = load_input(step, None, None, None, {"attention_mask": 1})
    fused = all_fusions(Candidate(graph, (), graph.fingerprint())).graph
    assert not any(n.op == "IsNaN" for n in fused.gs.nodes)
    sizes = [{"input_ids": [b, 1], "attention_mask": [b, p + 1], "position_ids": [b, 1],
              **{f"past_key_values.{i}.{k}": [b, 2, p, 16] for i in range(2) for k in ("key", "value")}}
             for b, p in ((1, 3), (2, 16), (1, 40))]
    result = verify(given, fused.to_model(static=False), shapes=sizes)
    assert result.ok, result.message


def test_the_rule_is_registered_as_a_fusion():
    assert rule(GUARD).group == "fusion"
