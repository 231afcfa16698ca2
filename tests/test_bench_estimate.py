"""`rlflow bench-estimate`: the searches scored by the CUDA cost model on a machine without CUDA, nothing measured."""
from __future__ import annotations

import json
from pathlib import Path

import onnxruntime as ort
import pytest

from rlflow.cli import main

FIXTURE = Path(__file__).parent / "fixtures" / "exports" / "bert-tiny-dynamo.onnx"

pytestmark = pytest.mark.skipif("CUDAExecutionProvider" in ort.get_available_providers(),
                                reason="with CUDA here the CUDA cost model measures; the command then refuses")


def test_each_method_ends_on_the_graph_the_estimate_prices_lowest(tmp_path, capsys):
    from rlflow.graph.core import load
    from rlflow.measure.costmodel.gpu_estimate import cost_model_for
    from rlflow.optimize.options import rules_for
    from rlflow.rewrites import RULES
    from rlflow.search.candidates import Candidate, all_fusions

    out = tmp_path / "estimate"
    assert main(["bench-estimate", str(FIXTURE), "--time-limit", "3", "--out", str(out)]) == 0
    results = json.loads((out / "results.json").read_text())
    from rlflow.agents.checkpoint import checkpoint_identity
    from rlflow.search.agent import shipped_agent

    assert results["provider"] == "CUDAExecutionProvider"
    assert results["agent"] == checkpoint_identity(shipped_agent("CUDAExecutionProvider"))  # the one CUDA plays
    assert results["estimate"]["held_out"]["all"]["entries"] > 0  # the estimate's own error, beside the figures
    (row,) = results["rows"]
    assert set(row["methods"]) == {"agent", "taso", "fuse-everything"}
    for name in ("agent", "taso"):
        assert "nothing measured" in row["methods"][name]["stop_reason"]
        assert row["methods"][name]["estimated_speedup"] >= 1.0  # the input is kept where nothing is priced lower
    # fuse-everything's figure is the estimate's ratio for the all-fusions graph, recomputed here
    cost_model = cost_model_for("cuda")
    graph = load(FIXTURE)
    fused = all_fusions(Candidate(graph, (), graph.fingerprint()), rules_for(RULES, "all", "CUDAExecutionProvider"))
    expected = cost_model.graph_cost(graph) / cost_model.graph_cost(fused.graph)
    assert row["methods"]["fuse-everything"]["estimated_speedup"] == pytest.approx(expected)
    assert row["methods"]["fuse-everything"]["rewrites"] == len(fused.applied) > 1
    page = (out / "results.md").read_text()
    assert "nothing measured" in page and "bert-tiny-dynamo" in page and "held out of its fit" in page
    assert "results in" in capsys.readouterr().out


def test_methods_can_be_chosen(tmp_path):
    """TASO-style search and fuse-everything do not depend on the agent: a run per agent seed needs only the agent."""
    out = tmp_path / "estimate"
    assert main(["bench-estimate", str(FIXTURE), "--methods", "fuse-everything", "--out", str(out)]) == 0
    results = json.loads((out / "results.json").read_text())
    assert list(results["rows"][0]["methods"]) == ["fuse-everything"] == list(results["summary"])
    assert "fuse-everything (est. speedup, s)" in (out / "results.md").read_text()


def test_bad_input_gets_one_line_and_no_results(tmp_path, capsys):
    out = tmp_path / "estimate"
    assert main(["bench-estimate", str(FIXTURE), "--methods", "agent,greedy", "--out", str(out)]) != 0
    assert "unknown methods greedy" in capsys.readouterr().err and not out.exists()
    assert main(["bench-estimate", str(tmp_path / "absent.onnx"), "--out", str(out)]) != 0
    assert "no such model file" in capsys.readouterr().err and not out.exists()
    assert main(["bench-estimate", str(FIXTURE), "--provider", "cpu", "--out", str(out)]) != 0
    assert "runs on this machine" in capsys.readouterr().err and not out.exists()


def test_the_cuda_agent_fuses_a_decoder_step_as_the_estimate_prices_it(tmp_path):
    """The shipped CUDA agent on a decoder step (a tiny Llama-style one, TorchScript export), scored by the CUDA
    estimate: its rollouts fuse the RMSNorms, the rotary embeddings and the attention with its cache, which the estimate
    prices at one kernel each where the export launches dozens."""
    from rlflow import zoo
    from rlflow.graph.core import load
    from rlflow.measure.costmodel.gpu_estimate import cost_model_for
    from rlflow.optimize.options import rules_for
    from rlflow.rewrites import RULES
    from rlflow.search.agent import AgentConfig, agent_search, shipped_agent

    step = load(zoo.build("llama-tiny-decode-p16-ts", tmp_path).path)
    cost_model = cost_model_for("cuda")
    config = AgentConfig(agent=str(shipped_agent("CUDAExecutionProvider")), time_limit=20, measure=False)
    result = agent_search(step, cost_model.settings, config, rules_for(RULES, "all", "CUDAExecutionProvider"),
                          cost_model=cost_model)
    rules = {m.rule for m in result.applied}
    assert {"rmsnorm-fusion", "rotary-fusion"} <= rules and rules & {"group-query-attention-fusion",
                                                                       "decoder-attention-fusion"}
    assert cost_model.graph_cost(result.graph) < cost_model.graph_cost(step) / 2
