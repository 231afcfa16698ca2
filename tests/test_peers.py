"""rlflow.bench.peers: the registry, and onnxruntime's transformers optimizer as a peer (hints, settings, verification)."""
from __future__ import annotations

import json
import os
import types
import warnings
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from rlflow.bench.peers import (
    PEER_SETTINGS_KEY,
    PEERS,
    NotApplicable,
    graph_heads_and_hidden,
    graph_model_type,
    has_attention,
    onnxscript_ort,
    ort_transformers,
    peer_settings,
    peer_tools,
    run_peer,
    transformer_settings,
    zoo_hints,
)
from rlflow.bench.results import _peer_settings_lines
from rlflow.bench.run import BenchConfig, _run_peer
from rlflow.graph.core import load
from rlflow.graph.external_data import external_tensors
from rlflow.measure.session import SessionSettings
from rlflow.measure.verify import verify
from tests.conftest import save, tiny_model

FIXTURES = Path(__file__).parent / "fixtures" / "exports"


@pytest.fixture(scope="module")
def tiny_bert_path(tmp_path_factory) -> str:
    """transformers' BertModel (1 layer, hidden 32, 2 heads) exported as users do: TorchScript, with a mask."""
    transformers = pytest.importorskip("transformers")
    import torch

    config = transformers.BertConfig(num_hidden_layers=1, hidden_size=32, num_attention_heads=2,
                                     intermediate_size=64, vocab_size=100)
    torch.manual_seed(0)
    bert = transformers.BertModel(config).eval()

    class Wrapped(torch.nn.Module):  # positional inputs: BertModel.forward's own order changes between versions
        def __init__(self):
            super().__init__()
            self.bert = bert

        def forward(self, input_ids, attention_mask):
            out = self.bert(input_ids=input_ids, attention_mask=attention_mask)
            return out.last_hidden_state, out.pooler_output

    path = tmp_path_factory.mktemp("bert") / "tiny-bert.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(Wrapped().eval(), (torch.randint(0, 100, (1, 8)), torch.ones(1, 8, dtype=torch.int64)),
                          str(path), dynamo=False, opset_version=17, input_names=["input_ids", "attention_mask"],
                          output_names=["last_hidden_state", "pooler_output"])
    return save(onnx.load(str(path)), path)


def test_registry_keeps_the_peers_and_adds_ort_transformers():
    assert PEERS == ("onnxsim", "onnxoptimizer", "onnxslim", "onnxscript", "onnxscript-ort", "ort-transformers")
    assert list(peer_tools()) == list(PEERS)


def test_onnxscript_ort_fuses_a_decoder_export_and_verifies():
    """onnxscript's fusions for onnxruntime take the dynamo export's sdpa with its KV cache (GPT-2's decode step)
    into MultiHeadAttention; the input is left as it was and the fusions it reported travel with the output."""
    model = onnx.load(FIXTURES / "gpt2-tiny-decode-dynamo.onnx")
    before = model.SerializeToString()
    output = onnxscript_ort(model)
    assert model.SerializeToString() == before
    ops = {(n.domain, n.op_type) for n in output.graph.node}
    assert ("com.microsoft", "MultiHeadAttention") in ops and ("", "Softmax") not in ops
    settings = peer_settings(output)
    assert settings["fused"]["sdpa"] >= 1 and output.ir_version <= 10
    shapes = [{"input_ids": (b, 1), "attention_mask": (b, past + 1),
               **{f"past_key_values.0.{kv}": (b, 2, past, 16) for kv in ("key", "value")}} for b, past in ((1, 8), (2, 5))]
    result = verify(model, output, seeds=(0, 1), shapes=shapes)
    assert result.ok, result.message


def test_settings_read_from_the_graph(transformer_path):
    model = onnx.load(transformer_path)  # 4 heads of 8, hidden 32, dynamic batch
    assert has_attention(model)
    assert graph_heads_and_hidden(model) == (4, 32)
    settings = transformer_settings(model)
    assert (settings["model_type"], settings["num_heads"], settings["hidden_size"]) == ("bert", 4, 32)
    assert settings["source"] == {"model_type": "graph", "num_heads": "graph", "hidden_size": "graph"}


def test_settings_from_hints_win_and_missing_ones_come_from_the_graph(transformer_path):
    model = onnx.load(transformer_path)
    settings = transformer_settings(model, {"model_type": "bert", "num_heads": 2, "hidden_size": 128})
    assert (settings["num_heads"], settings["hidden_size"]) == (2, 128)
    assert set(settings["source"].values()) == {"zoo"}
    settings = transformer_settings(model, {"num_heads": 8})
    assert (settings["model_type"], settings["num_heads"], settings["hidden_size"]) == ("bert", 8, 32)
    assert settings["source"] == {"model_type": "graph", "num_heads": "zoo", "hidden_size": "graph"}
    settings = transformer_settings(model, {"num_heads": 3})  # 32 / 3: the optimizer takes both or neither
    assert (settings["num_heads"], settings["hidden_size"]) == (0, 0)


def test_unknown_heads_and_hidden_are_left_to_the_optimizer(matmul_model):
    settings = transformer_settings(matmul_model)
    assert (settings["num_heads"], settings["hidden_size"]) == (0, 0)
    assert settings["source"]["num_heads"] == settings["source"]["hidden_size"] == "optimizer"


def test_model_type_from_the_graph(matmul_model):
    assert graph_model_type(matmul_model) == "bert"
    trilu = tiny_model([helper.make_node("Trilu", ["x"], ["y"])],
                       [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 4])],
                       [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 4])])
    assert graph_model_type(trilu) == "gpt2"
    mask = numpy_helper.from_array(np.tril(np.ones((1, 1, 4, 4), np.float32)), "causal")
    masked = tiny_model([helper.make_node("Mul", ["x", "causal"], ["y"])],
                        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 1, 4, 4])],
                        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 1, 4, 4])], [mask])
    assert graph_model_type(masked) == "gpt2"
    filled = numpy_helper.from_array(np.triu(np.ones((4, 4), bool), 1), "causal")  # masked_fill's mask
    masked = tiny_model([helper.make_node("Where", ["causal", "x", "x"], ["y"])],
                        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 4])],
                        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 4])], [filled])
    assert graph_model_type(masked) == "gpt2"
    pixels = tiny_model([helper.make_node("Relu", ["pixel_values"], ["y"])],
                        [helper.make_tensor_value_info("pixel_values", TensorProto.FLOAT, [1, 3, 8, 8])],
                        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 3, 8, 8])])
    assert graph_model_type(pixels) == "vit"


def test_zoo_hints_by_metadata_then_stem(matmul_model, monkeypatch):
    from rlflow import zoo

    assert zoo_hints(matmul_model, "somewhere/resnet-18.onnx") == {"family": "cnn", "transformer": None}
    assert zoo_hints(matmul_model, "mine.onnx") == {}
    helper.set_model_props(matmul_model, {"rlflow.zoo.name": "bert-tiny"})
    hints = {"model_type": "bert", "num_heads": 4, "hidden_size": 64}
    real_get = zoo.get
    monkeypatch.setattr(zoo, "get", lambda name: types.SimpleNamespace(family="transformer", transformer=hints)
                        if name == "bert-tiny" else real_get(name))
    assert zoo_hints(matmul_model, "renamed.onnx") == {"family": "transformer", "transformer": hints}


def test_ort_transformers_fuses_tiny_bert_and_verifies(tiny_bert_path, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    model = onnx.load(tiny_bert_path)
    before = model.SerializeToString()
    folder = sorted(os.listdir(os.path.dirname(tiny_bert_path)))
    output = ort_transformers(model)
    assert model.SerializeToString() == before  # the input is left as it was
    assert os.listdir(tmp_path) == [] and sorted(os.listdir(os.path.dirname(tiny_bert_path))) == folder
    ops = {(n.domain, n.op_type) for n in output.graph.node}
    assert ("com.microsoft", "SkipLayerNormalization") in ops
    settings = peer_settings(output)
    assert not any(p.key == PEER_SETTINGS_KEY for p in output.metadata_props)
    assert (settings["model_type"], settings["num_heads"], settings["hidden_size"]) == ("bert", 2, 32)
    assert settings["opt_level"] == 2 and settings["use_gpu"] is False and settings["attention_mask"] == "raw"
    assert settings["fused"]["SkipLayerNormalization"] >= 1
    assert output.ir_version <= 10
    result = verify(model, output, seeds=(0, 1))
    assert result.ok, result.message
    hints = {"model_type": "bert", "num_heads": 2, "hidden_size": 32}  # a deployment entry's: it runs on them
    settings = peer_settings(peer_tools(family="deploy", transformer=hints)["ort-transformers"](model))
    assert set(settings["source"].values()) == {"zoo"} and settings["fused"]["SkipLayerNormalization"] >= 1


def test_non_transformers_are_not_applicable(cnn_opset9_ir3_path, matmul_model, transformer_path):
    with pytest.raises(NotApplicable, match="no Softmax"):
        ort_transformers(onnx.load(cnn_opset9_ir3_path))
    with pytest.raises(NotApplicable, match="zoo family 'rnn'"):
        peer_tools(family="rnn")["ort-transformers"](matmul_model)
    with pytest.raises(NotApplicable, match="no Softmax"):  # a family that does not say: the graph decides
        peer_tools(family="deploy")["ort-transformers"](matmul_model)
    graph = load(cnn_opset9_ir3_path)
    row = _run_peer(graph, "ort-transformers", {}, SessionSettings(),
                    BenchConfig(rounds=3))
    assert (row.status, row.kind) == ("not applicable", "peer") and "not a transformer" in row.error


def test_bench_row_carries_the_settings(transformer_path):
    graph = load(transformer_path)
    row = _run_peer(graph, "ort-transformers", {}, SessionSettings(),
                    BenchConfig(rounds=3))
    assert row.status == "ok" and row.verified, row.error
    assert row.peer_settings["num_heads"] == 4 and row.peer_settings["fused"]
    lines = _peer_settings_lines([{"model": "transformer", "method": "ort-transformers",
                                   "peer_settings": row.peer_settings}])
    assert lines[1] == "## Peer settings" and "| transformer | ort-transformers | " in lines[-1]
    assert json.dumps(row.peer_settings["fused"], sort_keys=True) in lines[-1]


def test_a_large_model_s_peer_runs_in_its_own_process(monkeypatch, tiny_bert_path, matmul_model, tmp_path):
    """Over ISOLATED_PEER_BYTES a peer runs in a child (what it copies is given back when it ends): same output as in
    this process, its settings and its refusals carried back, input and output with their weights left on disk."""
    from rlflow.bench import peers

    model = onnx.load(tiny_bert_path)
    source, here = run_peer("ort-transformers", model, tmp_path / "unused")
    assert source is model and not (tmp_path / "unused").exists()
    monkeypatch.setattr(peers, "ISOLATED_PEER_BYTES", 0)
    (tmp_path / "child").mkdir()
    source, there = run_peer("ort-transformers", model, tmp_path / "child")
    assert [n.op_type for n in there.graph.node] == [n.op_type for n in here.graph.node]
    assert peer_settings(there) == peer_settings(here)
    assert sorted(os.listdir(tmp_path / "child")) == ["input.onnx", "input.onnx.data", "output.onnx", "output.onnx.data"]
    assert external_tensors(source) and external_tensors(there)
    assert verify(model, source).ok and verify(model, there).ok
    with pytest.raises(NotApplicable, match="zoo family 'rnn'"):
        run_peer("ort-transformers", matmul_model, tmp_path / "child", family="rnn")
