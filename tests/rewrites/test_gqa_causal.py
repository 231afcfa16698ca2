"""group-query-attention-causal (`rlflow/rewrites/fusions/attention/gqa_causal.py`): a GroupQueryAttention's bias
dropped where it is provably the causal mask, on synthetic prefills (a causal mask from shapes, a mask that is not
causal, a mask read from an input); then the zoo's tiny Llama decode step with `--fix-value attention_mask=1`,
verified at batch 1 and 2, past lengths 3, 16 and 40."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto

from rlflow.graph.core import Graph
from rlflow.measure.verify import verify
from rlflow.optimize.pipeline import load_input
from rlflow.search.candidates import Candidate, all_fusions

from .helpers import assert_refuses, assert_rewrites, graph, ints, node

CAUSAL = "group-query-attention-causal"
MS = "com.microsoft"
I64 = TensorProto.INT64


def _prefill(mask: str, last: str = "last") -> Graph:
    """GroupQueryAttention over S positions, no cache (2 heads, 1 KV head, head size 16, S dynamic at 4), its bias
    `causal` (a triangle computed from S), `zeros` (every key seen: not causal) or `input` (read from input m); its
    seqlens_k S - 1 (`last`), or S - 2 (`short`: the kernel would mask the last key)."""
    s = 4 if mask.startswith("constant") else "s"  # a constant mask comes of a static export
    inputs = {"q": [1, s, 32], "k": [1, s, 16], "v": [1, s, 16]}
    consts = {"one": np.ones(1, np.int32), "scalar": np.zeros(0, np.int64), "ones2": ints(1, 1), "zero": ints(0),
              "step": ints(1), "ax0": ints(0), "ax1": ints(1), "ax01": ints(0, 1), "fzero": np.zeros((), np.float32),
              "low": np.array(-np.inf, np.float32)}
    nodes = [node("Shape", ["k"], "s64", start=1, end=2), node("Cast", ["s64"], "s32", to=TensorProto.INT32),
             node("Shape", ["q"], "b", start=0, end=1), node("Sub", ["s32", "one"], "last"),
             node("Sub", ["last", "one"], "short"), node("Expand", [last, "b"], "seqlens"),
             node("Reshape", ["s32", "scalar"], "total")]
    if mask == "causal":
        nodes += [node("Reshape", ["s64", "scalar"], "n"), node("Range", ["zero_s", "n", "one_s"], "pos"),
                  node("Unsqueeze", ["pos", "ax0"], "cols"), node("Unsqueeze", ["pos", "ax1"], "rows"),
                  node("LessOrEqual", ["cols", "rows"], "allowed"), node("Where", ["allowed", "fzero", "low"], "tri"),
                  node("Unsqueeze", ["tri", "ax01"], "bias")]
        consts.update(zero_s=np.array(0, np.int64), one_s=np.array(1, np.int64))
    elif mask == "zeros":
        nodes += [node("Concat", ["ones2", "s64", "s64"], "bias_shape", axis=0),
                  node("ConstantOfShape", ["bias_shape"], "bias", value=onnx.numpy_helper.from_array(
                      np.zeros(1, np.float32)))]
    elif mask in ("constant", "constant-zeros"):  # what constant-fold leaves of either at a static shape
        triangle = np.where(np.tril(np.ones((4, 4), bool)), 0.0, -np.inf).astype(np.float32)
        consts["bias"] = (triangle if mask == "constant" else np.zeros((4, 4), np.float32)).reshape(1, 1, 4, 4)
    else:
        inputs["m"] = [1, 1, "s", "s"]
        nodes.append(node("Identity", ["m"], "bias"))
    nodes.append(node("GroupQueryAttention", ["q", "k", "v", "", "", "seqlens", "total", "", "", "", "bias"], "y",
                      domain=MS, num_heads=2, kv_num_heads=1, scale=0.25, causal=0))
    shapes = {name: [4 if d == "s" else d for d in dims] for name, dims in inputs.items()}
    return graph(nodes, inputs, {"y": (TensorProto.FLOAT, [1, s, 32])}, consts=consts, opset=18, input_shapes=shapes,
                 custom=[MS])


CASES = {CAUSAL: (lambda: _prefill("causal"), lambda: _prefill("zeros"), "not causal at S=4, T=4")}


def test_a_causal_mask_computed_from_shapes_is_dropped():
    out = assert_rewrites(_prefill("causal"), CAUSAL, count=1)
    (gqa,) = [n for n in out.gs.nodes if n.op == "GroupQueryAttention"]
    assert len(gqa.inputs) <= 10 and gqa.attrs["causal"] == 1


@pytest.mark.parametrize("mask, last, reason", [("zeros", "last", "not causal at S=4, T=4"),
                                                ("input", "last", "reads the values of the model's input m"),
                                                ("causal", "short", "seqlens_k is not T - 1 for every row")])
def test_refuses_a_mask_that_is_not_provably_causal(mask, last, reason):
    assert_refuses(_prefill(mask, last), CAUSAL, reason)


def test_a_constant_mask_is_proved_or_refused_without_error():
    """constant-fold computes a static export's mask into a constant (a DeiT's, after random rewrites, issue #78):
    the proof reads it as it is, where it raised KeyError."""
    assert_rewrites(_prefill("constant"), CAUSAL, count=1)
    assert_refuses(_prefill("constant-zeros"), CAUSAL, "not causal at S=4, T=4")


@pytest.fixture(scope="module")
def llama_step(tmp_path_factory):
    pytest.importorskip("transformers")
    from rlflow import zoo

    return zoo.build("llama-tiny-decode-p16-ts", tmp_path_factory.mktemp("causal")).path


def _sizes(batch: int, past: int) -> dict[str, list[int]]:
    return {"input_ids": [batch, 1], "attention_mask": [batch, past + 1], "position_ids": [batch, 1],
            **{f"past_key_values.{i}.{k}": [batch, 2, past, 16] for i in range(2) for k in ("key", "value")}}


def test_a_decode_step_without_padding_masks_itself(llama_step):
    """As exported the mask reads attention_mask and stays; declared all ones it is causal, and every
    GroupQueryAttention of the all-fusions graph masks by itself, computing what the fixed export does."""
    graph, _ = load_input(llama_step, None, None)
    fused = all_fusions(Candidate(graph, (), graph.fingerprint())).graph
    assert all(len(n.inputs) == 11 for n in fused.gs.nodes if n.op == "GroupQueryAttention")
    assert_refuses(fused, CAUSAL, "reads the values of the model's input attention_mask")
    graph, given = load_input(llama_step, None, None, None, {"attention_mask": 1})
    fused = all_fusions(Candidate(graph, (), graph.fingerprint())).graph
    attentions = [n for n in fused.gs.nodes if n.op == "GroupQueryAttention"]
    assert len(attentions) == 2 and all(len(n.inputs) <= 10 and n.attrs["causal"] == 1 for n in attentions)
    result = verify(given, fused.to_model(static=False), shapes=[_sizes(1, 3), _sizes(2, 16), _sizes(1, 40)])
    assert result.ok, result.message
