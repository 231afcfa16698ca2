"""The transformer fusions on real exports: a one-layer BERT from Hugging Face `transformers`, exported with
input_ids and attention_mask by each torch exporter (TorchScript and dynamo), committed under tests/fixtures/exports/
(`make.py` there rebuilds them).  Each fusion must fire on both exporters' graphs as they come, keep the numbers at the
measured shape and at other batch and sequence sizes, and still hold when every key of a row is masked."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest

from rlflow.graph.core import load
from rlflow.rewrites import apply, rule

from .helpers import assert_rewrites

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "exports"
EXPORTERS = ("torchscript", "dynamo")
SHAPE = {"input_ids": (1, 8), "attention_mask": (1, 8)}
OTHER = {"input_ids": [2, 5], "attention_mask": [2, 5]}


def _export(exporter: str):
    return load(FIXTURES / f"bert-tiny-{exporter}.onnx", SHAPE)


@pytest.mark.parametrize("exporter", EXPORTERS)
@pytest.mark.parametrize("name,fused", [("skip-layernorm-fusion", "SkipLayerNormalization"),
                                        ("bias-gelu-fusion", "BiasGelu"),
                                        ("attention-fusion", "MultiHeadAttention"),
                                        ("embed-layernorm-fusion", "EmbedLayerNormalization")])
def test_fusion_fires_on_the_export(exporter, name, fused):
    new = assert_rewrites(_export(exporter), name, dynamic=OTHER)
    assert new.op_counts()[fused] == 1


@pytest.mark.parametrize("exporter", EXPORTERS)
def test_skip_layernorm_takes_the_linear_bias(exporter):
    """Two of the three LayerNormalizations follow a linear layer + residual: their bias goes into the fusion."""
    graph = _export(exporter)
    biased = [m for m in rule("skip-layernorm-fusion").find(graph) if len(m.nodes) == 3]
    assert len(biased) == 2, biased


@pytest.mark.parametrize("exporter", EXPORTERS)
def test_attention_keeps_mask_and_guard(exporter):
    (match,) = rule("attention-fusion").find(_export(exporter))
    assert match.param("masked") and match.param("guarded")


@pytest.mark.parametrize("exporter", EXPORTERS)
def test_attention_packs_its_projections(exporter):
    fused = assert_rewrites(_export(exporter), "attention-fusion", dynamic=OTHER)
    assert assert_rewrites(fused, "attention-pack-qkv", dynamic=OTHER).op_counts()["Attention"] == 1


def _all_fused(exporter: str):
    graph = _export(exporter)
    for name in ("embed-layernorm-fusion", "attention-fusion", "attention-pack-qkv", "skip-layernorm-fusion",
                 "bias-gelu-fusion"):
        while matches := rule(name).find(graph):
            graph = apply(graph, matches[0])
    return graph


@pytest.mark.parametrize("exporter", EXPORTERS)
def test_every_fusion_together_at_any_shape_and_mask(exporter):
    """The written (dynamic) model against the export: random, all-ones and all-zeros masks, a padded row."""
    fused = _all_fused(exporter)
    ops = fused.op_counts()
    assert (ops["EmbedLayerNormalization"], ops["Attention"], ops["SkipLayerNormalization"], ops["BiasGelu"]) == (
        1, 1, 2, 1)
    assert "Softmax" not in ops and "Erf" not in ops and "LayerNormalization" not in ops
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    sessions = [ort.InferenceSession(g.to_model(static=False).SerializeToString(), options,
                                     providers=["CPUExecutionProvider"]) for g in (_export(exporter), fused)]
    rng = np.random.default_rng(0)
    for batch, length, kind in ((2, 13, "random"), (1, 3, "zeros"), (3, 8, "ones"), (2, 6, "padded")):
        mask = {"random": rng.integers(0, 2, (batch, length)), "zeros": np.zeros((batch, length), np.int64),
                "ones": np.ones((batch, length), np.int64)}.get(kind)
        if mask is None:
            mask = np.ones((batch, length), np.int64)
            mask[0, length // 2:] = 0
        feeds = {"input_ids": rng.integers(0, 64, (batch, length)), "attention_mask": mask}
        expected, got = (s.run(None, feeds) for s in sessions)
        for e, g in zip(expected, got):
            assert not np.isnan(g).any()
            np.testing.assert_allclose(g, e, rtol=1e-4, atol=1e-5)


PAST = {f"past_key_values.0.{kv}": (1, 2, 8, 16) for kv in ("key", "value")}
GPT2 = {  # (deployed shape, another) of GPT-2's prefill and decode step: tests/fixtures/exports/make.py
    "prefill": ({"input_ids": (1, 8), "attention_mask": (1, 8)}, {"input_ids": [2, 5], "attention_mask": [2, 5]}),
    "decode": ({"input_ids": (1, 1), "attention_mask": (1, 9), **PAST},
               {"input_ids": [2, 1], "attention_mask": [2, 6], **{k: [2, 2, 5, 16] for k in PAST}}),
}


@pytest.mark.parametrize("exporter", ("ts", "dynamo"))
@pytest.mark.parametrize("kind", list(GPT2))
def test_attention_fuses_with_the_kv_cache(kind, exporter):
    """GPT-2's attention with its causal mask, the present keys and values as outputs and (decode) the past ones as
    inputs: MultiHeadAttention takes the past state and gives the present one."""
    deployed, other = GPT2[kind]
    graph = load(FIXTURES / f"gpt2-tiny-{kind}-{exporter}.onnx", deployed)
    (match,) = rule("attention-fusion").find(graph)
    assert match.param("cached") and match.param("masked")
    fused = assert_rewrites(graph, "attention-fusion", dynamic=other)
    (mha,) = [n for n in fused.gs.nodes if n.op == "MultiHeadAttention"]
    assert [t.name for t in mha.outputs[1:]] == ["present.0.key", "present.0.value"]
    assert len(mha.inputs) == (8 if kind == "decode" else 6)  # (the past keys and values) after attention_bias
    assert "Softmax" not in fused.op_counts()


@pytest.mark.parametrize("exporter", ("ts", "dynamo"))
def test_embed_layernorm_keeps_gpt2s_residual_sum(exporter):
    """GPT-2 adds token and position embeddings into the residual stream: the sum comes from the third output."""
    deployed, other = GPT2["decode"]
    graph = load(FIXTURES / f"gpt2-tiny-decode-{exporter}.onnx", deployed)
    (match,) = rule("embed-layernorm-fusion").find(graph)
    assert match.param("shared") and match.param("lookups") == 2
    assert_rewrites(graph, "embed-layernorm-fusion", dynamic=other)
