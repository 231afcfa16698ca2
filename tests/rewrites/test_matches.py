"""A match is a value that carries everything its rule's rewrite needs: it pickles, a clone of the graph gives it
again equal, and the rewrite runs from it alone, without the rule's matcher, to the graph `apply` makes."""
from __future__ import annotations

import pickle
from pathlib import Path

import pytest

from rlflow.graph.core import load
from rlflow.rewrites import RULES, apply, rule
from rlflow.rewrites.fusions.attention import decoder, rotary
from rlflow.rewrites.substitutions import fold, layout

from . import (
    test_algebra,
    test_cleanup,
    test_decoder_attention,
    test_fold,
    test_fusion,
    test_gqa_absorb,
    test_gqa_causal,
    test_inverse,
    test_layout,
    test_merge,
    test_nan_guard,
    test_rmsnorm,
    test_rotary,
    test_wild_forms,
)

CASE_MODULES = (test_algebra, test_cleanup, test_fold, test_fusion, test_inverse, test_layout, test_merge, test_rmsnorm,
                test_rotary, test_decoder_attention, test_gqa_absorb, test_gqa_causal, test_nan_guard, test_wild_forms)
"""The test modules with a CASES table (rule name -> positive builder, negative builder, reason)."""

CASES = {name: case[0] for module in CASE_MODULES for name, case in module.CASES.items()}
EXPORTS = Path(__file__).resolve().parents[1] / "fixtures" / "exports"
SHAPES = {"bert-tiny-dynamo": {"input_ids": (1, 8), "attention_mask": (1, 8)}}

MATCHERS = {"conv-mul-fold": (fold, "_conv_channel_constant"), "conv-add-fold": (fold, "_conv_channel_constant"),
            "transpose-into-gemm": (layout, "_swapped_2d"), "matmul-transpose-to-gemm": (layout, "_swapped_2d"),
            "rotary-fusion": (rotary, "_angles"), "rotary-standard-fusion": (rotary, "_angles"),
            **{name: (decoder, "_pattern") for name in test_decoder_attention.RULES}}
"""Module-level matchers a rule's `check` calls besides its own methods."""


def _refuse(*args, **kwargs):
    raise AssertionError("the rewrite matched again")


def _rewrites_from_the_match_alone(graph, name: str, monkeypatch) -> int:
    r = rule(name)
    matches = r.find(graph)
    assert matches, name
    assert r.find(graph.clone()) == matches
    assert all(pickle.loads(pickle.dumps(m)) == m for m in matches)
    expected = [apply(graph, m).fingerprint() for m in matches]
    with monkeypatch.context() as patch:
        for attribute in ("check", "_pattern"):
            if hasattr(r, attribute):
                patch.setattr(type(r), attribute, _refuse)
        if name in MATCHERS:
            patch.setattr(*MATCHERS[name], _refuse)
        for match, fingerprint in zip(matches, expected):
            result = graph.clone()
            r.rewrite(result, match, result.node_map())
            result.finish_edit()
            assert result.fingerprint() == fingerprint, match
    return len(matches)


@pytest.mark.parametrize("name", [r.name for r in RULES])
def test_every_rule_rewrites_from_its_match_alone(name, monkeypatch):
    _rewrites_from_the_match_alone(CASES[name](), name, monkeypatch)


@pytest.mark.parametrize("export,names", [
    ("bert-tiny-dynamo", ("skip-layernorm-fusion", "gelu-fusion", "bias-gelu-fusion", "attention-fusion",
                          "embed-layernorm-fusion")),
    ("gpt2-tiny-decode-ts", ("skip-layernorm-fusion", "fast-gelu-fusion", "attention-fusion",
                             "embed-layernorm-fusion"))])
def test_the_fusions_rewrite_exports_from_their_matches_alone(export, names, monkeypatch):
    """Masked and guarded attention (BERT), a decode step's key/value cache (GPT-2), shared sums."""
    graph = load(EXPORTS / f"{export}.onnx", SHAPES.get(export))
    for name in names:
        _rewrites_from_the_match_alone(graph, name, monkeypatch)
    fused = apply(graph, rule("attention-fusion").find(graph)[0])
    if export == "bert-tiny-dynamo":
        assert _rewrites_from_the_match_alone(fused, "attention-pack-qkv", monkeypatch) == 1
